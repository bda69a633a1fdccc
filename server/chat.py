"""`POST /v1/chat/completions`: messages → DeepSeek-V4 prompt → choices, as one JSON reply or SSE.

Tools are offered in the prompt (unless `tool_choice` is "none"); DSML calls in the output come back
as `message.tool_calls` (`delta.tool_calls` when streaming) with `finish_reason` "tool_calls".
`tool_choice` "required" or a named function, and `response_format`, are enforced by a grammar; with
tools under "auto", `response_format` makes the reply a call or the formatted answer.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from v4serve.server import jobs
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
from v4serve.server.protocol import ChatCompletionRequest
from v4serve.server.text.output import Delta
from v4serve.server.text.tool_calls import ToolCallDelta


async def chat_completions(front: FrontEnd, body: ChatCompletionRequest, raw: Request) -> Response:
    model = front.check_model(body.model)
    thinking = body.thinking_mode(front.config.default_thinking)
    think_end = front.think_end_id if thinking else None
    prepared = await front.prep.run(jobs.chat, _messages(body), body.tools, body.tool_choice, body.parallel_tool_calls,
                                    body.response_format, think_end, front.config.max_model_len,
                                    thinking=thinking, reasoning_effort=body.v4_effort())
    prompt = prepared.prompt.tolist()
    max_tokens = front.default_max_tokens(body.max_completion_tokens or body.max_tokens, len(prompt))
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    options = front.output_options(body, reasoning_end_token=think_end, tool_calls=prepared.parse_calls,
                                   parallel_tool_calls=prepared.parallel, inside_tool_calls=prepared.inside_calls)
    generation = front.generation(rid, prompt, body, max_tokens, logprobs, options, grammar=prepared.grammar)
    await front.check([generation], raw)
    created = int(time.time())
    if body.stream:
        chunk = stream_chunker(rid, "chat.completion.chunk", created, model,
                               body.stream_options, lambda: [generation.usage()])
        events = _stream(front, chunk, generation, body.logprobs, body.include_reasoning)
        return sse(events, Pacing(front.config.stream_keepalive,
                                  lambda: chunk([{"index": 0, "delta": {}, "logprobs": None, "finish_reason": None}]),
                                  generation.wake))
    per_choice = await front.collect(generation, raw)
    reasoning = thinking and body.include_reasoning  # the model reasons either way; the reply may leave it out
    choices = Lazy(_choice(front, i, deltas, reasoning, body.logprobs) for i, deltas in enumerate(per_choice))
    return json_reply({"id": rid, "object": "chat.completion", "created": created, "model": model,
                       "choices": choices, "usage": usage([generation.usage()]), **generation.transfer_reply()})


def _messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    return [m.model_dump(exclude_none=True) for m in body.messages]


async def render(front: FrontEnd, body: ChatCompletionRequest) -> dict[str, Any]:
    """vLLM's `/v1/chat/completions/render` (routers call it before routing, and route on its
    `token_ids`): the conversation's prompt as the engine would get it, tools and thinking mode
    applied; nothing is generated."""
    model = front.check_model(body.model)
    prompt, text = await front.prep.run(jobs.rendered_chat, _messages(body), body.tools, body.tool_choice,
                                        body.parallel_tool_calls, body.response_format, front.config.max_model_len,
                                        thinking=body.thinking_mode(front.config.default_thinking),
                                        reasoning_effort=body.v4_effort())
    return front.rendered(prompt.tolist(), text, model)


def _choice(front: FrontEnd, i: int, deltas: list[Delta], reasoning: bool, logprobs: bool) -> dict[str, Any]:
    content = "".join(d.text for d in deltas)
    calls = _assembled([c for d in deltas for c in d.tool_calls])
    message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
    if reasoning:
        message["reasoning_content"] = "".join(d.reasoning for d in deltas)
    if calls:
        message["tool_calls"] = calls
    return {"index": i, "message": message, "finish_reason": deltas[-1].finish_reason,
            "logprobs": {"content": Lazy(_entries(front, deltas))} if logprobs else None}


def _assembled(deltas: list[ToolCallDelta]) -> list[dict[str, Any]]:
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        if d.index not in calls:
            calls[d.index] = {"id": d.id, "type": "function", "function": {"name": d.name, "arguments": ""}}
        calls[d.index]["function"]["arguments"] += d.arguments
    return [calls[i] for i in sorted(calls)]


def _stream_tool_calls(deltas: list[ToolCallDelta]) -> list[dict[str, Any]]:
    """OpenAI's streamed form: id, type and name with a call's first fragment, then arguments only."""
    out = []
    for d in deltas:
        function: dict[str, Any] = {"arguments": d.arguments}
        item: dict[str, Any] = {"index": d.index, "function": function}
        if d.id is not None:
            item |= {"id": d.id, "type": "function"}
            function["name"] = d.name
        out.append(item)
    return out


def _logprobs(front: FrontEnd, deltas: list[Delta]) -> dict[str, Any]:
    return {"content": list(_entries(front, deltas))}


def _entries(front: FrontEnd, deltas: list[Delta]) -> Iterator[dict[str, Any]]:
    for d in deltas:
        for s in d.samples:
            text, raw = front.token_text(s.token)
            top = [{"token": front.token_text(t)[0], "logprob": lp, "bytes": front.token_text(t)[1]} for t, lp in s.top]
            yield {"token": text, "logprob": s.logprob, "bytes": raw, "top_logprobs": top}


async def _stream(front: FrontEnd, chunk: Chunker, generation: Generation, logprobs: bool,
                  reasoning: bool) -> AsyncIterator[str]:
    for i in range(len(generation.requests)):
        yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}])
    async with contextlib.aclosing(generation.deltas()) as deltas:
        async for delta in deltas:
            if delta is WAKE:
                yield KEEPALIVE
                continue
            if delta.error:
                yield error_event(delta.error, delta.error_param)
                break
            body: dict[str, Any] = {}
            if delta.reasoning and reasoning:
                body["reasoning_content"] = delta.reasoning
            if delta.text:
                body["content"] = delta.text
            if delta.tool_calls:
                body["tool_calls"] = _stream_tool_calls(delta.tool_calls)
            if not body and not delta.finished and not (logprobs and delta.samples):
                continue  # bytes held back (partial character, stop-string or tag prefix, skipped special)
            yield chunk([{"index": delta.index, "delta": body,
                          "logprobs": _logprobs(front, [delta]) if logprobs else None,
                          "finish_reason": delta.finish_reason if delta.finished else None}])
        else:
            if chunk.include_usage:
                yield chunk([], usage([generation.usage()]))
    yield DONE
