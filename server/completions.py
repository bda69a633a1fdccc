"""`POST /v1/completions`: string, list and token-id prompts (several at once), `echo`, legacy
`logprobs`; one JSON reply or SSE."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from v4serve.server import jobs
from v4serve.server.errors import ApiError, failure_message
from v4serve.server.framing import (
    DONE,
    KEEPALIVE,
    Chunker,
    Lazy,
    Pacing,
    error_event,
    json_reply,
    sse,
    stream_chunker,
    usage,
)
from v4serve.server.generation import WAKE, FrontEnd, Generation
from v4serve.server.protocol import CompletionRequest
from v4serve.server.text.output import Delta

MAX_CHOICES = 64  # prompts × n in one request
MERGED_DELTAS = 64  # a stream's deltas between its prompts' pumps and the client


async def completions(front: FrontEnd, body: CompletionRequest, raw: Request) -> Response:
    model = front.check_model(body.model)
    count = len(body.prompt) if isinstance(body.prompt, list) and isinstance(body.prompt[0], (str, list)) else 1
    if count * body.n > MAX_CHOICES:  # before any prompt is tokenized
        raise ApiError(400, f"at most {MAX_CHOICES} prompts × n per request", param="prompt")
    prompts = await _prompts(front, body.prompt)
    if body.echo and body.logprobs is not None:  # every choice returns its prompt's logprobs
        echoed = sum(len(p) for p in prompts) * body.n * (1 + body.logprobs)
        if echoed > front.config.max_logprob_entries:
            front.metrics.count_limited("logprob_entries")
            raise ApiError(400, f"echo with logprobs would return {echoed} logprob entries (prompt tokens × n × "
                                f"(logprobs + 1)); at most {front.config.max_logprob_entries} "
                                "(--max-logprob-entries): lower n or logprobs, or drop echo", param="logprobs")
    rid = f"cmpl-{uuid.uuid4().hex}"
    options = front.output_options(body)
    prompt_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
    generations = [front.generation(f"{rid}-{p}", prompt, body, front.default_max_tokens(body.max_tokens, len(prompt)),
                                    body.logprobs, options, prompt_logprobs, prompts=len(prompts))
                   for p, prompt in enumerate(prompts)]
    await front.check(generations, raw)
    created = int(time.time())
    if body.stream:
        chunk = stream_chunker(rid, "text_completion", created, model, body.stream_options,
                               lambda: [g.usage() for g in generations])
        return sse(_stream(front, chunk, generations, body),
                   Pacing(front.config.stream_keepalive,
                          lambda: chunk([{"index": 0, "text": "", "logprobs": None, "finish_reason": None}]),
                          lambda: [g.wake() for g in generations]))
    results = await asyncio.gather(*(front.collect(g, raw) for g in generations))
    choices = Lazy(_choice(front, p * body.n + j, generation, j, deltas, body)
                   for p, (generation, per_choice) in enumerate(zip(generations, results, strict=True))
                   for j, deltas in enumerate(per_choice))
    return json_reply({"id": rid, "object": "text_completion", "created": created, "model": model,
                       "choices": choices, "usage": usage([g.usage() for g in generations]),
                       **generations[0].transfer_reply()})


async def render(front: FrontEnd, body: CompletionRequest) -> list[dict[str, Any]]:
    """vLLM's `/v1/completions/render` (routers call it before routing, and route on its `token_ids`):
    each prompt as the engine would get it, as vLLM's `GenerateRequest` (its token ids, the model) plus
    its text; nothing is generated."""
    model = front.check_model(body.model)
    prompt = body.prompt
    if isinstance(prompt, str) or all(isinstance(p, str) for p in prompt):
        texts = [prompt] if isinstance(prompt, str) else list(prompt)
        pairs = await front.prep.run(jobs.rendered_texts, texts, front.config.max_model_len)
        return [front.rendered(ids.tolist(), text, model) for ids, text in pairs]
    prompts = await _prompts(front, prompt)
    for p in prompts:
        jobs.check_length(p, front.config.max_model_len, "prompt")
    texts = await front.prep.run(jobs.decode_all, prompts)
    return [front.rendered(p, text, model) for p, text in zip(prompts, texts, strict=True)]


async def _prompts(front: FrontEnd, prompt: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        return await front.encode_texts([prompt])
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    if all(isinstance(p, str) for p in prompt):
        return await front.encode_texts(list(prompt))
    if all(isinstance(p, list) for p in prompt):
        if any(not p for p in prompt):
            raise ApiError(400, "token-id prompts must not be empty", param="prompt")
        return [list(p) for p in prompt]
    raise ApiError(400, "prompt must be a string, a list of strings, or token ids", param="prompt")


def _choice(front: FrontEnd, index: int, generation: Generation, j: int, deltas: list[Delta],
            body: CompletionRequest) -> dict[str, Any]:
    prompt = generation.requests[j].prompt_token_ids
    samples = [s for d in deltas for s in d.samples]
    echoed = front.tokenizer.decode(prompt, skip_special_tokens=body.skip_special_tokens) if body.echo else ""
    logprobs = None
    if body.logprobs is not None:
        entries = (list(generation.prompt_logprobs) if body.echo else []) + samples
        tokens = (prompt if body.echo else []) + [s.token for s in samples]
        logprobs = _lazy_logprobs(front, tokens, entries)
    return {"index": index, "text": echoed + "".join(d.text for d in deltas), "logprobs": logprobs,
            "finish_reason": deltas[-1].finish_reason}


def _legacy_logprobs(front: FrontEnd, tokens: list[int], entries: list[Any], offset: int = 0
                     ) -> tuple[dict[str, Any], int]:
    """The completions API's logprobs for these tokens, text offsets counted from `offset`, as lists (a
    streamed chunk's) → (logprobs, the offset after them)."""
    columns = _lazy_logprobs(front, tokens, entries, offset)
    out = {name: list(column.items) for name, column in columns.items()}
    return out, offset + sum(len(text) for text in out["tokens"])


def _lazy_logprobs(front: FrontEnd, tokens: list[int], entries: list[Any], offset: int = 0) -> dict[str, Any]:
    """The completions API's logprobs as lazy columns, each made as the reply is written (a choice with an
    echoed prompt may have a million entries)."""

    def texts() -> Iterator[str]:
        return (front.token_text(t)[0] for t in tokens)

    def offsets() -> Iterator[int]:
        at = offset
        for text in texts():
            yield at
            at += len(text)

    return {"tokens": Lazy(texts()),
            "token_logprobs": Lazy(None if e is None else e.logprob for e in entries),
            "top_logprobs": Lazy(None if e is None else {front.token_text(t)[0]: lp for t, lp in e.top}
                                 for e in entries),
            "text_offset": Lazy(offsets())}


async def _stream(front: FrontEnd, chunk: Chunker, generations: list[Generation],
                  body: CompletionRequest) -> AsyncIterator[str]:
    # One prompt (the common case): its deltas read here, no layer between (a layer is a call per token);
    # its stream failing ends this as a chat stream's does (`sse`).
    single = len(generations) == 1
    deltas = generations[0].deltas() if single else _merged(generations)
    failed = False
    offsets: dict[int, int] = {}  # per choice: text offset of its next logprob entry
    try:
        async for item in deltas:
            p, delta = (0, item) if single else item
            if delta is WAKE:
                yield KEEPALIVE
                continue
            if delta.error:
                yield error_event(delta.error, delta.error_param)
                failed = True
                break
            index = p * body.n + delta.index
            if index not in offsets:  # a choice's first delta: its prompt's logprobs are known now
                offsets[index] = 0
                if body.echo:
                    yield _echo_chunk(front, chunk, generations[p], delta.index, index, body, offsets)
            if not delta.text and not delta.finished and body.logprobs is None:
                continue  # bytes held back (partial character or stop-string prefix)
            lp = None
            if body.logprobs is not None:
                lp, offsets[index] = _legacy_logprobs(front, [s.token for s in delta.samples], delta.samples,
                                                      offsets[index])
            yield chunk([{"index": index, "text": delta.text, "logprobs": lp,
                          "finish_reason": delta.finish_reason if delta.finished else None}])
        if chunk.include_usage and not failed:
            yield chunk([], usage([g.usage() for g in generations]))
        yield DONE
    finally:
        await deltas.aclose()


async def _merged(generations: list[Generation]) -> AsyncIterator[tuple[int, Delta]]:
    """Every prompt's deltas as they come, each with its prompt's place; a prompt whose stream fails
    gives one error delta."""
    # Bounded: a pump waits while the client is not reading, so unread output stays in its Generation,
    # which bounds it (--max-unread-tokens), and not here.
    merged: asyncio.Queue[tuple[int, Delta | None]] = asyncio.Queue(maxsize=MERGED_DELTAS)

    async def pump(p: int, generation: Generation) -> None:
        try:
            async with contextlib.aclosing(_failing_as_delta(generation)) as deltas:
                async for delta in deltas:
                    await merged.put((p, delta))
        finally:
            await merged.put((p, None))

    tasks = [asyncio.ensure_future(pump(p, g)) for p, g in enumerate(generations)]
    open_prompts = len(generations)
    try:
        while open_prompts:
            p, delta = await merged.get()
            if delta is None:
                open_prompts -= 1
            else:
                yield p, delta
    finally:
        for t in tasks:
            t.cancel()


async def _failing_as_delta(generation: Generation) -> AsyncIterator[Delta]:
    try:
        async with contextlib.aclosing(generation.deltas()) as deltas:
            async for delta in deltas:
                yield delta
    except Exception as exc:
        yield _failure(exc)


def _failure(exc: Exception) -> Delta:
    """A prompt's stream that failed (e.g. the engine stopped between the check and the submission)
    as one error delta."""
    return Delta(index=0, finished=True, finish_reason="error", error=failure_message(exc, "a prompt's stream failed"))


def _echo_chunk(front: FrontEnd, chunk: Chunker, generation: Generation, j: int, index: int,
                body: CompletionRequest, offsets: dict[int, int]) -> str:
    """The prompt, echoed as a choice's first chunk (with its logprobs when asked for)."""
    prompt = generation.requests[j].prompt_token_ids
    text = front.tokenizer.decode(prompt, skip_special_tokens=body.skip_special_tokens)
    lp = None
    if body.logprobs is not None:
        lp, offsets[index] = _legacy_logprobs(front, prompt, list(generation.prompt_logprobs))
    return chunk([{"index": index, "text": text, "logprobs": lp, "finish_reason": None}])
