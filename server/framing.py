"""Server-sent events and usage, written once for both endpoints: every streamed chunk, the error
event, the final `[DONE]`, and the usage block; and whole JSON replies written piece by piece."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from fastapi.responses import Response, StreamingResponse

from v4serve.server.errors import error_json, failure_message

log = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"


_encode = msgspec.json.Encoder().encode  # compact JSON, UTF-8: several times json.dumps's speed per chunk
# U+0085, U+2028 and U+2029 may stand raw in a JSON string, and SSE ends a line only at CR or LF, but
# clients that split lines as Python's str.splitlines does (httpx's `aiter_lines`, and the SSE readers
# built on it) end one there too, cutting the event in two: its JSON no longer parses. Escaped, as JSON
# allows any character to be.
_SPLITLINES_ONLY = {0x85: "\\u0085", 0x2028: "\\u2028", 0x2029: "\\u2029"}


def sse_json(payload: dict[str, Any]) -> str:
    """A payload as one SSE data line's JSON: compact, UTF-8, nothing a line splitter breaks at."""
    text = _encode(payload).decode()
    if "\u2028" in text or "\u2029" in text or "\x85" in text:
        text = text.translate(_SPLITLINES_ONLY)
    return text


def event(payload: dict[str, Any]) -> str:
    return f"data: {sse_json(payload)}\n\n"


def typed_event(kind: str, payload: dict[str, Any]) -> str:
    """An event of the Responses and Messages APIs: its type named on the `event:` line and in the data."""
    return f"event: {kind}\ndata: {sse_json({'type': kind, **payload})}\n\n"


def error_event(message: str, param: str | None = None) -> str:
    """A generation that failed after the stream began: OpenAI's error body as an event (an
    invalid_request_error naming `param` when the request caused it)."""
    if param is not None:
        return event(error_json(message, "invalid_request_error", param=param))
    return event(error_json(message, "server_error", code="generation_failed"))


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

# The scope key under which the app keeps the server's own `send` (server/app.py `App`).
SERVER_SEND = "v4serve.server_send"


class _Marker(str):
    """A string told apart by identity, not value."""


# Where an API's stream yields this, `EventStream` sends that API's keep-alive event (`Pacing`).
KEEPALIVE: str = _Marker()


@dataclass(frozen=True)
class Pacing:
    """A stream's keep-alive: `keepalive()` is sent whenever `every` seconds pass without an event. A request
    that waits or prefills for minutes sends nothing else, and agent clients abort a stream idle for a few
    minutes (Claude Code's watchdog, Codex's idle timeout, which SSE comments do not reset: hence each API's
    own event).

    The reply drives its events itself (no task between them, nothing handed over per token): one timer per
    stream calls `wake()` when nothing was sent for `every` seconds, which has the generation behind the
    events give its stream a wake-up in place of output (`Generation.wake`); the stream yields KEEPALIVE for
    it, in order with its events (a Responses keep-alive carries the next sequence number), and the reply
    sends the API's keep-alive there. Several generations woken at once give one keep-alive."""

    every: float
    keepalive: Callable[[], str]
    wake: Callable[[], None]


class EventStream(StreamingResponse):
    """A stream of server-sent events whose body parts go straight to the server's `send`. Its start
    goes through the middleware chain as any reply's does (the headers they add, the start they note);
    its events, one per token, skip the chain's wrappers of `send`, none of which looks at a body part
    of a reply that started normally (a middleware that must see them has to change this). A client
    that goes away ends it as it ends a StreamingResponse, and closing `events` ends their work.
    `failed(exc)`: the events that end it when `events` raises once it has begun (None: the error
    propagates). `pacing`: its keep-alive (None: a KEEPALIVE from `events` is skipped)."""

    def __init__(self, events: AsyncIterator[str], failed: Callable[[Exception], list[str]] | None = None,
                 pacing: Pacing | None = None) -> None:
        super().__init__(events, media_type="text/event-stream", headers=SSE_HEADERS)
        self._events, self._failed, self._pacing = events, failed, pacing
        self._body_send: Any = None
        self._last = 0.0  # when the last event was sent (the loop's clock)
        self._timer: asyncio.TimerHandle | None = None  # the next keep-alive check

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        """What StreamingResponse does on ASGI 2.3 (uvicorn's): the events are sent while a second task waits
        for the client to go away, which cancels them. Here the events' task runs `stream_response` itself:
        the frames resumed for each token are only its own (anyio's task group adds two)."""
        self._body_send = scope.get(SERVER_SEND, send)
        streaming = asyncio.ensure_future(self.stream_response(send))
        listening = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait((streaming, listening), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (listening, streaming):
                task.cancel()  # nothing, once done
            # Both end (the events closed, their work aborted) before the reply does, however it ended.
            await asyncio.gather(listening, streaming, return_exceptions=True)
        if not streaming.cancelled() and streaming.exception() is not None:
            raise streaming.exception()  # type: ignore[misc]

    async def stream_response(self, send: Any) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        body, pacing = self._body_send, self._pacing
        loop = asyncio.get_running_loop()
        self._last = loop.time()
        if pacing is not None:
            self._timer = loop.call_at(self._last + pacing.every, self._tick, loop, pacing)
        try:
            try:
                async for chunk in self._events:
                    if chunk is KEEPALIVE:
                        if pacing is None or loop.time() - self._last < pacing.every:
                            continue  # something was sent since the wake-up
                        chunk = pacing.keepalive()
                    self._last = loop.time()
                    await body({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
            except Exception as exc:
                if self._failed is None:
                    raise
                for chunk in self._failed(exc):
                    await body({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
        finally:
            if self._timer is not None:
                self._timer.cancel()
            await self._events.aclose()  # type: ignore[attr-defined]  # its work ends whatever ended this
        await body({"type": "http.response.body", "body": b"", "more_body": False})

    def _tick(self, loop: asyncio.AbstractEventLoop, pacing: Pacing) -> None:
        now = loop.time()
        if now - self._last >= pacing.every:
            pacing.wake()
        self._timer = loop.call_at(max(self._last + pacing.every, now + pacing.every / 8), self._tick, loop, pacing)


def sse(events: AsyncIterator[str], pacing: Pacing) -> StreamingResponse:
    """Chat and completions' streams: whatever fails once one has begun, the client still gets an error
    event and [DONE]."""
    return EventStream(events, _stream_failed, pacing)


def _stream_failed(exc: Exception) -> list[str]:
    return [error_event(f"the stream failed: {failure_message(exc, 'a stream failed')}"), DONE]


# A reply body is written in pieces of about this many characters (a larger one goes out chunked).
BODY_PIECE = 1 << 16


class Lazy:
    """A JSON array whose items are made only as the reply is written (`json_reply`): a choice's logprobs
    are turned into JSON entry by entry, not built whole beside the text they become."""

    def __init__(self, items: Iterable[Any]) -> None:
        self.items = items


def json_pieces(value: Any) -> Iterator[str]:
    """`value` as compact JSON text, in pieces. Dicts holding a dict or a `Lazy` are written key by key,
    `Lazy` arrays item by item; anything else is one piece (so a list holding a `Lazy` must be one too)."""
    if isinstance(value, Lazy):
        yield "["
        for i, item in enumerate(value.items):
            if i:
                yield ","
            yield from json_pieces(item)
        yield "]"
    elif isinstance(value, dict) and any(isinstance(v, (dict, Lazy)) for v in value.values()):
        yield "{"
        for i, (key, item) in enumerate(value.items()):
            yield ("," if i else "") + json.dumps(key, ensure_ascii=False) + ":"
            yield from json_pieces(item)
        yield "}"
    else:
        yield json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def _body(value: Any) -> Iterator[bytes]:
    pieces, size = [], 0
    for piece in json_pieces(value):
        pieces.append(piece)
        size += len(piece)
        if size >= BODY_PIECE:
            yield "".join(pieces).encode()
            pieces, size = [], 0
    yield "".join(pieces).encode()


def json_reply(value: Any) -> Response:
    """A JSON reply never held whole: one that fits in a piece goes out with its length, written on the
    event loop (a thread hop would cost more than its millisecond); a longer one (16 choices' logprobs
    are many MB of text) goes out chunked, the rest of it written on a worker thread as it is sent."""
    body = _body(value)
    first = next(body)
    second = next(body, None)
    if second is None:
        return Response(first, media_type="application/json")

    def rest() -> Iterator[bytes]:
        yield first
        yield second
        yield from body

    return StreamingResponse(rest(), media_type="application/json")


@dataclass(frozen=True)
class Chunker:
    """Builds one event per chunk of a streamed response. With include_usage every chunk carries
    `usage`: null until the final, choice-less one, or (continuous_usage_stats) the usage so far."""

    response_id: str
    object: str  # "chat.completion.chunk" or "text_completion"
    created: int
    model: str
    include_usage: bool
    usage_so_far: Callable[[], dict[str, Any]] | None = None  # set for continuous_usage_stats

    def __call__(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> str:
        payload: dict[str, Any] = {"id": self.response_id, "object": self.object, "created": self.created,
                                   "model": self.model, "choices": choices}
        if self.include_usage:
            payload["usage"] = usage if usage is not None or self.usage_so_far is None else self.usage_so_far()
        return f"data: {sse_json(payload)}\n\n"


def stream_chunker(response_id: str, obj: str, created: int, model: str, options: Any,
                   prompts: Callable[[], Sequence[PromptUsage]]) -> Chunker:
    """The Chunker for a request's `stream_options` (include_usage, continuous_usage_stats)."""
    include = bool(options and options.include_usage)
    continuous = bool(include and options.continuous_usage_stats)
    return Chunker(response_id, obj, created, model, include, (lambda: usage(prompts())) if continuous else None)


@dataclass(frozen=True)
class PromptUsage:
    """One prompt's share of usage: counted once however many choices it has."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int  # all its choices together
    reasoning_tokens: int = 0  # of those, thinking


def usage(prompts: Sequence[PromptUsage]) -> dict[str, Any]:
    prompt = sum(p.prompt_tokens for p in prompts)
    cached = sum(p.cached_tokens for p in prompts)
    completion = sum(p.completion_tokens for p in prompts)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
            "completion_tokens_details": {"reasoning_tokens": sum(p.reasoning_tokens for p in prompts)},
            "prompt_cache_hit_tokens": cached, "prompt_cache_miss_tokens": prompt - cached}
