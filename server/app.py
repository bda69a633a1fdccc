"""The OpenAI-compatible HTTP API (FastAPI): routes and middleware. The endpoints' work lives in
`chat`, `completions` and `generation`; errors in `errors`; SSE and usage framing in `framing`."""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import AsyncIterator
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from v4serve.engine.async_engine import AsyncEngine
from v4serve.server.body import BodyLimit, body_schema, install_openapi, parse_body
from v4serve.server.chat import chat_completions
from v4serve.server.completions import completions
from v4serve.server.errors import error_json, install_error_handlers
from v4serve.server.generation import FrontEnd, ServerConfig
from v4serve.server.metrics import Metrics
from v4serve.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from v4serve.server.text.tokenizer import Tokenizer

try:
    VERSION = version("v4serve")
except PackageNotFoundError:  # running from a source tree that was never installed
    VERSION = "0.0.0+unknown"


class ApiKeyAuth:
    """Plain ASGI middleware (not BaseHTTPMiddleware, which hides client disconnects from the
    handlers): `Authorization: Bearer KEY`, compared in constant time, on every route but the
    probes (`/health`, and `/metrics` unless it is protected too)."""

    def __init__(self, app: Any, api_key: str, protect_metrics: bool = False) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()
        self.open_paths = {"/health"} if protect_metrics else {"/health", "/metrics"}

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("path", "") not in self.open_paths:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                response = JSONResponse(error_json("Incorrect API key provided.", "invalid_request_error",
                                                   code="invalid_api_key"), status_code=401)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(engine: AsyncEngine, tokenizer: Tokenizer, config: ServerConfig, metrics: Metrics) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.shutdown()

    app = FastAPI(title="v4serve", version=VERSION, lifespan=lifespan)
    front = FrontEnd(engine, tokenizer, config, metrics)
    app.state.front = front
    install_error_handlers(app)
    install_openapi(app, [ChatCompletionRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest])
    # Added last, so it runs first: a refused key costs nothing, an oversized body is never read.
    app.add_middleware(BodyLimit, max_bytes=config.max_request_bytes)
    if config.api_key:
        app.add_middleware(ApiKeyAuth, api_key=config.api_key, protect_metrics=config.protect_metrics)

    @app.post("/v1/chat/completions", openapi_extra=body_schema(ChatCompletionRequest))
    async def chat(raw: Request) -> Response:
        return await chat_completions(front, await parse_body(raw, ChatCompletionRequest), raw)

    @app.post("/v1/completions", openapi_extra=body_schema(CompletionRequest))
    async def complete(raw: Request) -> Response:
        return await completions(front, await parse_body(raw, CompletionRequest), raw)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": config.served_model_name, "object": "model", "created": 0,
                                            "owned_by": "v4serve", "max_model_len": config.max_model_len}]}

    @app.get("/health")
    async def health() -> Response:
        reason = engine.unavailable_reason()
        if reason is not None:
            return JSONResponse(error_json(reason, "server_error", code="engine_dead"), status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def get_version() -> dict[str, str]:
        return {"version": VERSION}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize", openapi_extra=body_schema(TokenizeRequest))
    async def tokenize(raw: Request) -> dict[str, Any]:
        body = await parse_body(raw, TokenizeRequest)
        front.check_model(body.model)
        if body.messages is not None:
            tokens = await front.encode_chat([m.model_dump(exclude_none=True) for m in body.messages])
        else:
            tokens = await front.encode_text(body.prompt or "", add_bos=body.add_special_tokens)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": config.max_model_len}

    @app.post("/detokenize", openapi_extra=body_schema(DetokenizeRequest))
    async def detokenize(raw: Request) -> dict[str, Any]:
        body = await parse_body(raw, DetokenizeRequest)
        front.check_model(body.model)
        engine.limits.check_token_ids(body.tokens, "tokens")
        return {"prompt": tokenizer.decode(body.tokens)}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(store: bool = False) -> dict[str, Any]:
        """Empty the device prefix cache and host snapshots; with `?store=true` also remove every
        block and snapshot file of this model's namespace from the SSD store, including files other
        daemons sharing the folder wrote."""
        dropped, removed = await engine.call(lambda eng: eng.reset_prefix_cache(store=store))
        return {"status": "ok", "dropped_blocks": dropped, "store_cleared": store, "store_files_removed": removed}

    return app
