"""Request bodies: a size limit enforced while the bytes arrive, and JSON parsing and validation off
the event loop (so `/health` and every open stream keep answering while a large body is parsed).

The endpoints read their bodies through `parse_body` instead of FastAPI's own parameter parsing;
`body_schema` puts the same pydantic models back into the OpenAPI description.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from v4serve.server import jobs
from v4serve.server.errors import ApiError, BodyTooLarge, ClientGone, validation_message
from v4serve.server.protocol import validation_context

M = TypeVar("M", bound=BaseModel)


# A refused body is still read to its end, and dropped, before the connection is closed: a client
# that sends its whole body before it reads (http.client, so urllib) otherwise has its connection
# reset under it (the kernel resets a socket closed with unread data), cannot tell "too large" from
# "network down", and retries. Reading is bounded by bytes past
# the limit and by time; past either the server closes anyway. The byte bound is fixed rather than a
# multiple of the limit because the need is the client's: a 20 MB upload against the default 4 MiB
# limit must be read to be answered, whatever the limit is. 64 MiB costs well under a second on a
# LAN and nothing is kept; a client further over is better cut off than waited for.
DRAIN_BYTES = 64 * 1024 * 1024
# Long enough for 64 MiB at ~50 Mbit/s; a slow or stalled sender holds its connection no longer.
DRAIN_SECONDS = 10.0


class BodyLimit:
    """Plain ASGI middleware: a declared Content-Length over the limit is refused before the body is
    read; a body that grows past it while streaming in is cut off (the reader gets BodyTooLarge). The
    413 is sent at once, and then held open while the rest of the body is read and dropped (uvicorn
    answers `http.disconnect` to every read once a response is complete); completing it closes the
    connection (`Connection: close`)."""

    def __init__(self, app: Any, max_bytes: int, drain_bytes: int = DRAIN_BYTES,
                 drain_seconds: float = DRAIN_SECONDS) -> None:
        self.app, self.max_bytes = app, max_bytes
        self.drain_bytes, self.drain_seconds = drain_bytes, drain_seconds

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        seen = 0  # body bytes received so far
        refused = False
        pending = True  # more of the body is coming, and is worth reading to drop it

        async def counted() -> Any:
            nonlocal seen, refused, pending
            message = await receive()
            seen += len(message.get("body", b""))
            pending = message.get("more_body", False)
            if seen > self.max_bytes:
                refused = True
                raise BodyTooLarge(self.max_bytes)
            return message

        async def answering(message: Any) -> None:
            # The last part of the 413 waits until the rest of the body has been read and dropped.
            if refused and message["type"] == "http.response.body" and not message.get("more_body", False):
                await send({**message, "more_body": True})
                if pending:
                    await self._drain(receive, seen)
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)

        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            refused = True
            # Nothing to drop from a client waiting for `100 Continue` (curl, for large bodies): it
            # sends no body once it has its answer. And a body past the bound is reset either way.
            pending = (headers.get(b"expect", b"").lower() != b"100-continue"
                       and int(declared) <= self.max_bytes + self.drain_bytes)
            await BodyTooLarge(self.max_bytes).response()(scope, receive, answering)
            return
        await self.app(scope, counted, answering)

    async def _drain(self, receive: Any, seen: int) -> None:
        """Read and drop the rest of a refused body: until it ends, the client goes away, or the
        byte or time bound is reached. Only the count is kept."""

        async def drop() -> None:
            nonlocal seen
            while seen <= self.max_bytes + self.drain_bytes:
                message = await receive()
                seen += len(message.get("body", b""))
                if not message.get("more_body", False):  # the end, or http.disconnect
                    return

        with contextlib.suppress(asyncio.TimeoutError):  # not the builtin TimeoutError on 3.10
            await asyncio.wait_for(drop(), self.drain_seconds)


# JSON objects and arrays one body may hold. Validating a body is one call into pydantic that holds the
# GIL throughout, about 3 µs per object (a 4 MiB body of 150,000 one-letter content blocks held the
# event loop 0.4-0.6 s); at this bound it holds it ~50 ms. A long agent session with its tools holds a
# few thousand.
MAX_JSON_CONTAINERS = 16384
# A body this small cannot hold enough containers to matter (each takes at least two bytes).
_SCAN_FROM_BYTES = MAX_JSON_CONTAINERS * 2


def _validate(model: type[M], data: bytes, context: dict[str, Any]) -> M:
    # Strict, as OpenAI's API: `"max_tokens": true` or `"n": "2"` is a 400, not 1 and 2.
    try:
        return model.model_validate_json(data, strict=True, context=context)
    except ValidationError as exc:
        # A required field missing while unknown ones were sent (`{"text": ...}` for `prompt`, a misspelling):
        # name them. Here, on the worker thread, as the validation itself.
        if (not context["ignored"] and context["unknown_fields"] == "accept"
                and any(e["type"] == "missing" and len(e["loc"]) == 1 for e in exc.errors())):
            context["unread"] = _unknown_top_level(model, data)
        raise


async def _check_containers(raw: Request, data: bytes) -> None:
    """Refuse a body of more JSON containers than MAX_JSON_CONTAINERS before pydantic sees it. Its
    `{` and `[` bytes bound them from above (one fast pass); only when that bound is passed (braces in
    strings: code, JSON pasted as text) does a preprocessing worker count them exactly, off this process."""
    if len(data) < _SCAN_FROM_BYTES or data.count(b"{") + data.count(b"[") <= MAX_JSON_CONTAINERS:
        return
    count = await raw.app.state.front.prep.run(jobs.json_containers, data)
    if count > MAX_JSON_CONTAINERS:
        raw.app.state.front.metrics.count_limited("body_containers")
        raise ApiError(400, f"the request body holds {count} JSON objects and arrays; at most {MAX_JSON_CONTAINERS} "
                            "(send fewer, larger content blocks)", code="request_too_complex")


async def parse_body(raw: Request, model: type[M]) -> M:
    """The body as `model`, parsed and validated on a worker thread; a bad body is a 400, one that is
    not declared JSON a 415 (what a web page can send another site without asking first is a form or
    text/plain: never parsed here)."""
    try:
        data = await raw.body()
    except ClientDisconnect:  # gone mid-body: nothing to answer, nothing worth a traceback in the log
        raise ClientGone from None
    media_type = raw.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raw.app.state.front.metrics.count_limited("media_type")
        raise ApiError(415, f"request bodies must be sent as Content-Type: application/json, got "
                            f"{media_type or 'no content type'}", code="unsupported_media_type")
    await _check_containers(raw, data)
    context = validation_context(raw.app.state.front.config.unknown_fields)
    try:
        body = await asyncio.to_thread(_validate, model, data, context)
    except ValidationError as exc:
        message, param = validation_message(exc)
        unread = context["ignored"] or context.get("unread")
        if unread:  # `{"text": ...}` for `prompt`, a misspelt field: say which of the sent fields went unread
            message += f" (unknown fields were ignored: {', '.join(unread[:8])[:200]})"
            param = param or unread[0]
        raise ApiError(400, message, param=param) from None
    if context["ignored"]:
        raw.state.ignored_fields = context["ignored"]
    return body


def _unknown_top_level(model: type[BaseModel], data: bytes) -> list[str]:
    """The body's top-level names the model does not define (only a refused body gets here: a model's
    own check names them in the context once its fields are valid)."""
    try:
        sent = json.loads(data)
    except (ValueError, RecursionError):
        return []
    known = {name for n, f in model.model_fields.items() for name in (n, f.alias) if name}
    return [ascii(k)[1:-1][:64] for k in sent if k not in known][:16] if isinstance(sent, dict) else []


IGNORED_FIELDS_HEADER = b"x-v4serve-ignored-fields"


class IgnoredFieldsHeader:
    """Plain ASGI middleware: a reply to a request whose unknown fields were dropped names them in the
    `x-v4serve-ignored-fields` header (the body was parsed before the reply starts, streamed or not)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def named(message: Any) -> None:
            ignored = scope.get("state", {}).get("ignored_fields")
            if message["type"] == "http.response.start" and ignored:
                value = header_value(ignored)
                message = {**message, "headers": [*message.get("headers", []), (IGNORED_FIELDS_HEADER, value)]}
            await send(message)

        await self.app(scope, receive, named)


def header_value(names: list[str]) -> bytes:
    """The names as one header value, at most 1 KiB: a name is anything a client sent, so one that is
    not plain (empty, spaces, control or non-ASCII characters: a CR would end the reply before it
    starts) is written as an ASCII JSON string."""
    shown = (n if _PLAIN_NAME.fullmatch(n) else json.dumps(n) for n in names)
    return ", ".join(shown).encode("ascii")[:1024].rstrip(b", ")


_PLAIN_NAME = re.compile(r"[\w.\[\]-]+", re.ASCII)


def body_schema(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` for a route that reads `model` through parse_body."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def install_openapi(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Add the body models (and what they reference) to the generated OpenAPI components, and drop
    FastAPI's 422 responses (this server answers 400)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            spec = get_openapi(title=app.title, version=app.version, routes=app.routes)
            schemas = spec.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
            # Validation failures are 400s in OpenAI's shape here, never FastAPI's 422.
            for operation in (op for ops in spec["paths"].values() for op in ops.values()):
                operation.get("responses", {}).pop("422", None)
            for unused in ("HTTPValidationError", "ValidationError"):
                schemas.pop(unused, None)
            app.openapi_schema = spec
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
