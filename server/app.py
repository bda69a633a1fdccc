"""The OpenAI-compatible HTTP API (FastAPI): routes and middleware. The endpoints' work lives in
`chat`, `completions` and `generation`; errors in `errors`; SSE and usage framing in `framing`."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import math
from collections.abc import AsyncIterator, Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Any
from urllib.parse import urlsplit

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from v4serve.engine.process.client import EngineClient
from v4serve.server import chat, completions, jobs, responses
from v4serve.server.body import BodyLimit, IgnoredFieldsHeader, body_schema, install_openapi, parse_body
from v4serve.server.connections import RequestCap
from v4serve.server.errors import ApiError, echo, error_json, error_responses, install_error_handlers
from v4serve.server.framing import SERVER_SEND
from v4serve.server.generation import FrontEnd, ServerConfig
from v4serve.server.handover import PATH, Handovers
from v4serve.server.messages import CountTokensRequest, MessagesRequest, anthropic_error, count_tokens, messages
from v4serve.server.metrics import Metrics
from v4serve.server.preprocess import Preprocessor
from v4serve.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from v4serve.server.responses import ResponsesRequest
from v4serve.server.tenants import CURRENT_CALLER, CURRENT_TENANT, ApiKeys, Caller, CredentialsError, caller
from v4serve.server.text.tokenizer import Tokenizer

try:
    VERSION = version("v4serve")
except PackageNotFoundError:  # running from a source tree that was never installed
    VERSION = "0.0.0+unknown"


class Authenticate:
    """Plain ASGI middleware (not BaseHTTPMiddleware, which hides client disconnects from the
    handlers): `tenants.caller` decides who the request is, once, and everything after takes its
    answer (`CURRENT_CALLER`, `CURRENT_TENANT`). With keys (`--api-key`, `--api-keys-file`) every route
    but the probes (`/health`, and `/metrics` unless it is protected too) needs one of them; with or
    without keys, credentials that disagree are a 401."""

    def __init__(self, app: Any, keys: ApiKeys | None, protect_metrics: bool = False) -> None:
        self.app, self.keys = app, keys
        self.open_paths = {"/health"} if protect_metrics or keys is None else {"/health", "/metrics"}

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path in self.open_paths or path.startswith(PATH):  # PATH: peers' own proof
            await self.app(scope, receive, send)
            return
        try:
            who: Caller | None = caller(scope["headers"], self.keys)
        except CredentialsError as exc:
            who, message = None, f"{exc}."
        else:
            message = "Incorrect API key provided."
        if who is None or (self.keys is not None and who.tenant is None):
            body = anthropic_error(401, message) if "/messages" in path else \
                error_json(message, "invalid_request_error", code="invalid_api_key")
            await JSONResponse(body, status_code=401)(scope, receive, send)
            return
        caller_token, tenant_token = CURRENT_CALLER.set(who), CURRENT_TENANT.set(who.tenant)
        try:
            await self.app(scope, receive, send)
        finally:
            CURRENT_TENANT.reset(tenant_token)
            CURRENT_CALLER.reset(caller_token)


class BrowserGuard:
    """Plain ASGI middleware that keeps other sites' web pages out. A page can make a browser send a
    "simple" request (a form, text/plain, a bodiless POST) to any address, this daemon's included,
    without asking it first; only browsers send `Origin`, so a request that changes anything (any
    method but GET, HEAD and OPTIONS) from an origin that is neither this daemon's own (its /docs
    page) nor listed in --allowed-origins gets a 403 before it reaches a route."""

    def __init__(self, app: Any, allowed_origins: tuple[str, ...], metrics: Metrics) -> None:
        self.app, self.allowed, self.metrics = app, set(allowed_origins), metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] not in ("GET", "HEAD", "OPTIONS"):
            headers = dict(scope["headers"])
            origin = headers.get(b"origin", b"").decode("latin-1")
            if origin and not self._allowed(origin, headers.get(b"host", b"").decode("latin-1")):
                self.metrics.count_limited("origin")
                response = JSONResponse(error_json(
                    f"requests from web pages of {origin} are refused; list the origin in --allowed-origins "
                    "to let its pages call this API", code="origin_not_allowed"), status_code=403)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _allowed(self, origin: str, host: str) -> bool:
        return "*" in self.allowed or origin in self.allowed or (bool(host) and urlsplit(origin).netloc == host)


def speaks_anthropic(raw: Request) -> bool:
    """Anthropic's clients send `anthropic-version` (the SDKs) or their key as `x-api-key`."""
    return "anthropic-version" in raw.headers or "x-api-key" in raw.headers


def anthropic_card(name: str, created: int) -> dict[str, Any]:
    """A model as Anthropic's `/v1/models` lists it."""
    stamp = datetime.datetime.fromtimestamp(created, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"type": "model", "id": name, "display_name": name, "created_at": stamp}


class App(FastAPI):
    """The app, keeping the server's own `send` in each request's scope: the events of a stream go
    there directly (framing.EventStream)."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        scope[SERVER_SEND] = send
        await super().__call__(scope, receive, send)


def build_app(engine: EngineClient, tokenizer: Tokenizer, config: ServerConfig, metrics: Metrics,
              prep: Preprocessor | None = None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        if config.keys is not None:
            config.keys.watch()
        try:
            yield
        finally:
            if config.keys is not None:
                config.keys.close()
            front.prep.close()
            for stop in app.state.before_engine_stops:
                await asyncio.to_thread(stop)
            engine.shutdown()

    app = App(title="v4serve", version=VERSION, lifespan=lifespan)
    app.state.before_engine_stops = []  # what must end before the engine stops (the other API servers)
    front = FrontEnd(engine, tokenizer, config, metrics, prep)
    stored: responses.ResponseStore = (
        responses.SharedStoredResponses(config.responses_folder, config.api_server[1], config.responses_store_bytes)
        if config.responses_folder else responses.StoredResponses(max_bytes=config.responses_store_bytes))
    app.state.front = front
    install_error_handlers(app)
    install_openapi(app, [ChatCompletionRequest, CompletionRequest, TokenizeRequest, DetokenizeRequest,
                          MessagesRequest, CountTokensRequest, ResponsesRequest])
    # Added last, so it runs first: a refused key costs nothing, an oversized body is never read.
    app.add_middleware(IgnoredFieldsHeader)
    app.add_middleware(BodyLimit, max_bytes=config.max_request_bytes)
    app.add_middleware(Authenticate, keys=config.keys, protect_metrics=config.protect_metrics)
    app.add_middleware(BrowserGuard, allowed_origins=config.allowed_origins, metrics=metrics)
    app.add_middleware(RequestCap, limit=config.max_requests,
                       on_refused=lambda: metrics.count_limited("requests_at_once"))
    if config.allowed_origins:  # outermost: a preflight carries no key and must be answered first
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])

    generating = error_responses(400, 401, 403, 404, 413, 415, 500, 503)
    text_routes = error_responses(400, 401, 403, 404, 413, 415)
    cards = {name: {"id": name, "object": "model", "created": config.created, "owned_by": "v4serve",
                    "root": config.served_model_name, "max_model_len": config.max_model_len,
                    "context_length": config.max_model_len} for name in config.model_names}

    @api_route(app, "POST", "/chat/completions", openapi_extra=body_schema(ChatCompletionRequest), responses=generating)
    async def chat_completion(raw: Request) -> Response:
        return await chat.chat_completions(front, await parse_body(raw, ChatCompletionRequest), raw)

    @api_route(app, "POST", "/completions", openapi_extra=body_schema(CompletionRequest), responses=generating)
    async def complete(raw: Request) -> Response:
        return await completions.completions(front, await parse_body(raw, CompletionRequest), raw)

    @api_route(app, "POST", "/chat/completions/render", openapi_extra=body_schema(ChatCompletionRequest),
               responses=text_routes)
    async def chat_render(raw: Request) -> dict[str, Any]:
        """vLLM's: the conversation's prompt (token ids, text) as the engine would get it."""
        return await chat.render(front, await parse_body(raw, ChatCompletionRequest))

    @api_route(app, "POST", "/completions/render", openapi_extra=body_schema(CompletionRequest), responses=text_routes)
    async def completion_render(raw: Request) -> list[dict[str, Any]]:
        """vLLM's: each prompt (text, token ids) as the engine would get it."""
        return await completions.render(front, await parse_body(raw, CompletionRequest))

    @api_route(app, "POST", "/messages", openapi_extra=body_schema(MessagesRequest), responses=generating)
    async def anthropic_messages(raw: Request) -> Response:
        """Anthropic's Messages API (errors in its shape)."""
        return await messages(front, raw)

    @api_route(app, "POST", "/messages/count_tokens", openapi_extra=body_schema(CountTokensRequest),
               responses=text_routes)
    async def anthropic_count_tokens(raw: Request) -> Response:
        return await count_tokens(front, raw)

    @api_route(app, "POST", "/responses", openapi_extra=body_schema(ResponsesRequest), responses=generating)
    async def create_response(raw: Request) -> Response:
        """OpenAI's Responses API."""
        return await responses.create(front, stored, await parse_body(raw, ResponsesRequest), raw)

    @api_route(app, "GET", "/responses/{response_id}", responses=error_responses(401, 404))
    async def get_response(response_id: str, raw: Request) -> dict[str, Any]:
        return stored.get(response_id, responses.owner_of(raw)).body

    @api_route(app, "DELETE", "/responses/{response_id}", responses=error_responses(401, 404))
    async def delete_response(response_id: str, raw: Request) -> dict[str, Any]:
        stored.delete(response_id, responses.owner_of(raw))
        return {"id": response_id, "object": "response", "deleted": True}

    @api_route(app, "GET", "/models", responses=error_responses(401))
    async def models(raw: Request) -> dict[str, Any]:
        """OpenAI's list, or Anthropic's when the caller speaks Anthropic (`anthropic-version` or `x-api-key`)."""
        if speaks_anthropic(raw):
            listed = [anthropic_card(name, config.created) for name in cards]
            return {"data": listed, "has_more": False, "first_id": listed[0]["id"], "last_id": listed[-1]["id"]}
        return {"object": "list", "data": list(cards.values())}

    @api_route(app, "GET", "/models/{model_id:path}", responses=error_responses(401, 404))
    async def model(model_id: str, raw: Request) -> dict[str, Any]:
        name = front.check_model(model_id)
        return anthropic_card(name, config.created) if speaks_anthropic(raw) else cards[name]

    @app.get("/health", responses=error_responses(503))
    async def health() -> Response:
        reason = engine.unavailable_reason()
        if reason is not None:
            return JSONResponse(error_json(reason, "server_error", code="engine_dead"), status_code=503)
        silent = engine.silent_for()
        if silent > config.stall_timeout:
            return JSONResponse(error_json(f"engine not responding for {silent:.0f} s (its current step has not "
                                           "finished)", "server_error", code="engine_stalled"), status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/version", responses=error_responses(401))
    async def get_version() -> dict[str, str | bool | int]:
        # Which API-server process answered (`--api-server-count`): each connection goes to one.
        index, count = config.api_server
        return {**config.version_info, "version": VERSION, "api_server": index, "api_server_count": count}

    # SGLang's worker information, which its router (and vLLM's) read when a worker joins.
    @app.get("/model_info", responses=error_responses(401))
    @app.get("/get_model_info", include_in_schema=False)
    async def model_info() -> dict[str, Any]:
        return {"model_path": config.served_model_name, "tokenizer_path": config.served_model_name,
                "is_generation": True, "served_model_name": config.served_model_name,
                "max_model_len": config.max_model_len}

    @app.get("/server_info", responses=error_responses(401))
    @app.get("/get_server_info", include_in_schema=False)
    async def server_info() -> dict[str, Any]:
        return {**config.version_info, "version": VERSION, "served_model_name": config.served_model_name,
                "max_model_len": config.max_model_len}

    @app.get("/metrics", response_class=PlainTextResponse, responses={
        200: {"content": {"text/plain": {}}, "description": "Prometheus text exposition"}, **error_responses(401)})
    async def prometheus() -> Response:
        metrics.tally.flush()
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize", openapi_extra=body_schema(TokenizeRequest), responses=text_routes)
    async def tokenize(raw: Request) -> dict[str, Any]:
        body = await parse_body(raw, TokenizeRequest)
        front.check_model(body.model)
        if body.messages is not None:
            tokens = await front.encode_chat([m.model_dump(exclude_none=True) for m in body.messages])
        else:
            (tokens,) = await front.encode_texts([body.prompt or ""], add_bos=body.add_special_tokens)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": config.max_model_len}

    @app.post("/detokenize", openapi_extra=body_schema(DetokenizeRequest), responses=text_routes)
    async def detokenize(raw: Request) -> dict[str, Any]:
        body = await parse_body(raw, DetokenizeRequest)
        front.check_model(body.model)
        jobs.check_length(body.tokens, config.max_model_len + 1, "tokens")
        engine.limits.check_token_ids(body.tokens, "tokens")
        return {"prompt": await front.prep.run(jobs.decode, body.tokens)}

    # Prefill and decode apart: a decode replica fetches this (prefill) replica's hand-overs here, proving
    # it holds the fleet's peer secret (these paths take no API key: `Authenticate`).
    @app.get(PATH + "{transfer_id}", include_in_schema=False)
    async def kv_transfer_manifest(transfer_id: str, raw: Request) -> Response:
        handovers = _handovers()
        nonce = handovers.authenticate(raw).nonce
        try:
            wait = float(raw.query_params.get("wait", "0"))
        except ValueError as exc:
            raise ApiError(400, "wait must be a number of seconds", param="wait") from exc
        return await handovers.manifest_when_made(transfer_id, wait if math.isfinite(wait) else 0.0, nonce)

    @app.post(PATH + "{transfer_id}/files", include_in_schema=False)
    async def kv_transfer_files(transfer_id: str, raw: Request) -> StreamingResponse:
        handovers = _handovers()
        proven = handovers.authenticate(raw)  # before a byte of the body is read
        body = await handovers.proven_body(raw, proven)
        names = await asyncio.to_thread(handovers.file_names, transfer_id, body)
        return handovers.files(transfer_id, names, proven.nonce, metrics.sent, metrics.sent_bytes)

    @app.delete(PATH + "{transfer_id}", include_in_schema=False)
    async def kv_transfer_release(transfer_id: str, raw: Request) -> dict[str, Any]:
        handovers = _handovers()
        handovers.authenticate(raw)
        await asyncio.to_thread(handovers.release, transfer_id)
        return {"released": transfer_id}

    def _handovers() -> Handovers:
        if config.handovers is None:
            raise ApiError(404, "this replica hands no KV over (--kv-transfer-config)", code="not_found")
        config.handovers.producing()
        return config.handovers

    store_param = {"parameters": [{"name": "store", "in": "query", "required": False, "schema": {"type": "boolean"},
                                   "description": "also empty the SSD store"}]}

    @app.post("/reset_prefix_cache", openapi_extra=store_param, responses=error_responses(400, 401, 403, 503))
    async def reset_prefix_cache(raw: Request) -> dict[str, Any]:
        """Empty the device prefix cache and host snapshots; with `?store=true` also remove every
        block and snapshot file of this model's namespace from the SSD store, including files other
        daemons sharing the folder wrote."""
        store = query_flag(raw, "store")
        dropped, removed = await engine.reset_prefix_cache(store=store)
        return {"status": "ok", "dropped_blocks": dropped, "store_cleared": store, "store_files_removed": removed}

    return app


def api_route(app: FastAPI, method: str, path: str, **options: Any) -> Callable[[Any], Any]:
    """A route at `/v1{path}` and, for clients given DeepSeek's base URL (no `/v1`), at `{path}` too."""

    def register(handler: Any) -> Any:
        app.api_route("/v1" + path, methods=[method], **options)(handler)
        app.api_route(path, methods=[method], include_in_schema=False, **options)(handler)
        return handler

    return register


def query_flag(raw: Request, name: str) -> bool:
    value = raw.query_params.get(name, "false").strip().lower()
    if value not in ("true", "1", "yes", "false", "0", "no", ""):
        raise ApiError(400, f"{name} must be true or false, got {echo(value)}", param=name)
    return value in ("true", "1", "yes")
