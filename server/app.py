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
from v4serve.server.chat import chat_completions
from v4serve.server.completions import completions
from v4serve.server.errors import ApiError, error_json, install_error_handlers
from v4serve.server.generation import FrontEnd, ServerConfig
from v4serve.server.metrics import Metrics
from v4serve.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from v4serve.server.text.chat_encoding import encode_messages
from v4serve.server.text.tokenizer import Tokenizer

try:
    VERSION = version("v4serve")
except PackageNotFoundError:  # running from a source tree that was never installed
    VERSION = "0.0.0+unknown"


class ApiKeyAuth:
    """Plain ASGI middleware (not BaseHTTPMiddleware, which hides client disconnects from the
    handlers): `Authorization: Bearer KEY` on /v1 and the admin endpoint."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and (path.startswith("/v1") or path == "/reset_prefix_cache"):
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
    if config.api_key:
        app.add_middleware(ApiKeyAuth, api_key=config.api_key)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, raw: Request) -> Response:
        return await chat_completions(front, body, raw)

    @app.post("/v1/completions")
    async def complete(body: CompletionRequest, raw: Request) -> Response:
        return await completions(front, body, raw)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": config.served_model_name, "object": "model", "created": 0,
                                            "owned_by": "v4serve", "max_model_len": config.max_model_len}]}

    @app.get("/health")
    async def health() -> Response:
        if not engine.alive:
            return JSONResponse(error_json("the engine loop has stopped", "server_error", code="engine_dead"),
                                status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def get_version() -> dict[str, str]:
        return {"version": VERSION}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        front.check_model(body.model)
        if body.messages is not None:
            try:
                tokens = tokenizer.encode(encode_messages([m.model_dump(exclude_none=True) for m in body.messages]))
            except ValueError as exc:
                raise ApiError(400, str(exc), param="messages") from exc
        elif body.add_special_tokens:
            tokens = front.encode_text_prompt(body.prompt or "")
        else:
            tokens = tokenizer.encode(body.prompt or "")
        return {"tokens": tokens, "count": len(tokens), "max_model_len": config.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        front.check_model(body.model)
        engine.limits.check_token_ids(body.tokens, "tokens")
        return {"prompt": tokenizer.decode(body.tokens)}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(store: bool = False) -> dict[str, Any]:
        """Empty the device prefix cache; with `?store=true` also the SSD store."""
        dropped = await engine.call(lambda eng: eng.reset_prefix_cache(store=store))
        return {"status": "ok", "dropped_blocks": dropped, "store_cleared": store}

    return app
