"""`POST /v1/chat/completions`: messages → DeepSeek-V4 prompt → choices, as one JSON reply or SSE."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from v4serve.server.framing import DONE, Chunker, error_event, sse, usage
from v4serve.server.generation import FrontEnd, Generation
from v4serve.server.protocol import ChatCompletionRequest
from v4serve.server.text.output import Delta


async def chat_completions(front: FrontEnd, body: ChatCompletionRequest, raw: Request) -> Response:
    front.check_model(body.model)
    front.warn_extras(body)
    thinking = body.thinking_mode()
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    prompt = await front.encode_chat(messages, thinking=thinking, tools=body.tools,
                                     reasoning_effort=body.reasoning_effort)
    max_tokens = front.default_max_tokens(body.max_completion_tokens or body.max_tokens, len(prompt))
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    options = front.output_options(body, reasoning_end_token=front.think_end_id if thinking else None)
    generation = front.generation(rid, prompt, body, max_tokens, logprobs, options)
    front.check([generation])
    created = int(time.time())
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunk = Chunker(rid, "chat.completion.chunk", created, front.config.served_model_name, include_usage)
        return sse(_stream(front, chunk, generation, body.logprobs))
    per_choice = await front.collect(generation, raw)
    choices = []
    for i, deltas in enumerate(per_choice):
        message: dict[str, Any] = {"role": "assistant", "content": "".join(d.text for d in deltas)}
        if thinking:
            message["reasoning_content"] = "".join(d.reasoning for d in deltas)
        choices.append({"index": i, "message": message, "finish_reason": deltas[-1].finish_reason,
                        "logprobs": _logprobs(front, deltas) if body.logprobs else None})
    return JSONResponse({"id": rid, "object": "chat.completion", "created": created,
                         "model": front.config.served_model_name, "choices": choices,
                         "usage": usage([generation.usage()])})


def _logprobs(front: FrontEnd, deltas: list[Delta]) -> dict[str, Any]:
    content = []
    for d in deltas:
        for s in d.samples:
            text, raw = front.token_text(s.token)
            top = [{"token": front.token_text(t)[0], "logprob": lp, "bytes": front.token_text(t)[1]} for t, lp in s.top]
            content.append({"token": text, "logprob": s.logprob, "bytes": raw, "top_logprobs": top})
    return {"content": content}


async def _stream(front: FrontEnd, chunk: Chunker, generation: Generation, logprobs: bool) -> AsyncIterator[str]:
    for i in range(len(generation.requests)):
        yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}])
    async with contextlib.aclosing(generation.deltas()) as deltas:
        async for delta in deltas:
            if delta.error:
                yield error_event(delta.error)
                break
            body: dict[str, Any] = {}
            if delta.reasoning:
                body["reasoning_content"] = delta.reasoning
            if delta.text:
                body["content"] = delta.text
            if not body and not delta.finished and not (logprobs and delta.samples):
                continue  # bytes held back (partial character, stop-string prefix, skipped special)
            yield chunk([{"index": delta.index, "delta": body,
                          "logprobs": _logprobs(front, [delta]) if logprobs else None,
                          "finish_reason": delta.finish_reason if delta.finished else None}])
        else:
            if chunk.include_usage:
                yield chunk([], usage([generation.usage()]))
    yield DONE
