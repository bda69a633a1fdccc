"""Request bodies: a size limit enforced while the bytes arrive, and JSON parsing and validation off
the event loop (so `/health` and every open stream keep answering while a large body is parsed).

The endpoints read their bodies through `parse_body` instead of FastAPI's own parameter parsing;
`body_schema` puts the same pydantic models back into the OpenAPI description.
"""

from __future__ import annotations

import asyncio
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ValidationError

from v4serve.server.errors import ApiError, BodyTooLarge, validation_message

M = TypeVar("M", bound=BaseModel)


class BodyLimit:
    """Plain ASGI middleware: a declared Content-Length over the limit is refused before any byte is
    read; a body that grows past it while streaming in is cut off (the reader gets BodyTooLarge)."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        seen = 0

        async def counted() -> Any:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, counted, send)

    async def _refuse(self, scope: Any, receive: Any, send: Any) -> None:
        await BodyTooLarge(self.max_bytes).response()(scope, receive, send)


async def parse_body(raw: Request, model: type[M]) -> M:
    """The body as `model`, parsed and validated on a worker thread; a bad body is a 400."""
    data = await raw.body()
    try:
        return await asyncio.to_thread(model.model_validate_json, data)
    except ValidationError as exc:
        message, param = validation_message(exc)
        raise ApiError(400, message, param=param) from None


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
