"""The OpenAI-compatible HTTP API (FastAPI)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from v4serve.engine.async_engine import AsyncEngine, Delta, EngineDead, EngineOverloaded, OutputOptions
from v4serve.engine.engine import RequestError
from v4serve.engine.request import Request as EngineRequest
from v4serve.engine.request import SamplingParams
from v4serve.server.metrics import Metrics
from v4serve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingFields,
    TokenizeRequest,
    error_json,
)
from v4serve.server.text.chat_encoding import THINK_END, encode_messages
from v4serve.server.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)
VERSION = "0.1.0"


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str
    max_model_len: int
    api_key: str | None = None


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers


def _error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(error_json(err.message, err.type, err.param, err.code), status_code=err.status,
                        headers=err.headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid value")
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return (f"{param}: {msg}" if param else msg) + more, param


class Api:
    """Request handling, kept apart from routing so each handler reads top to bottom."""

    def __init__(self, engine: AsyncEngine, tokenizer: Tokenizer, config: ServerConfig, metrics: Metrics) -> None:
        self.engine, self.tokenizer, self.config, self.metrics = engine, tokenizer, config, metrics
        think_end = tokenizer.encode(THINK_END)
        self.think_end_id = think_end[0] if len(think_end) == 1 else None

    # ---- shared pieces ------------------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.config.served_model_name:
            raise ApiError(404, f"The model `{name}` does not exist.", "NotFoundError", "model", "model_not_found")

    @staticmethod
    def warn_extras(body: SamplingFields) -> None:
        extra = sorted((body.model_extra or {}).keys())
        if extra:
            log.warning("ignoring unsupported request fields: %s", ", ".join(extra))

    def sampling(self, body: SamplingFields, max_tokens: int, logprobs: int | None,
                 prompt_logprobs: int | None = None, seed_offset: int = 0) -> SamplingParams:
        vocab = self.engine.engine.model.cfg.vocab_size
        bias = {int(k): v for k, v in (body.logit_bias or {}).items()}
        for name, ids in (("logit_bias", list(bias)), ("stop_token_ids", list(body.stop_token_ids or []))):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ApiError(400, f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", param=name)
        return SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p, top_k=-1 if body.top_k in (None, 0) else body.top_k,
            min_p=body.min_p or 0.0, seed=None if body.seed is None else body.seed + seed_offset,
            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty, logit_bias=bias,
            stop_token_ids=list(body.stop_token_ids or []), ignore_eos=body.ignore_eos,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs)

    @staticmethod
    def output_options(body: SamplingFields, reasoning_end_token: int | None = None) -> OutputOptions:
        return OutputOptions(stop=tuple(body.stop_list()), include_stop_str_in_output=body.include_stop_str_in_output,
                             skip_special_tokens=body.skip_special_tokens, reasoning_end_token=reasoning_end_token)

    def default_max_tokens(self, requested: int | None, prompt_len: int) -> int:
        if requested is not None:
            return requested
        return max(1, self.config.max_model_len - prompt_len)

    def choices(self, prefix: str, prompt: list[int], body: SamplingFields, max_tokens: int,
                logprobs: int | None, prompt_logprobs: int | None = None) -> list[EngineRequest]:
        return [EngineRequest(f"{prefix}-{i}", list(prompt),
                              self.sampling(body, max_tokens, logprobs, prompt_logprobs, seed_offset=i),
                              cache_salt=body.cache_salt) for i in range(body.n)]

    def token_text(self, token: int) -> tuple[str, list[int]]:
        raw = self.tokenizer.token_bytes(token)
        return raw.decode("utf-8", errors="replace"), list(raw)

    @staticmethod
    def usage(groups: list[list[EngineRequest]]) -> dict[str, Any]:
        """Usage of one API request: each prompt counted once, every choice's completion."""
        prompt = sum(g[0].num_prompt_tokens for g in groups)
        cached = sum(g[0].num_cached_tokens for g in groups)
        completion = sum(len(r.output_token_ids) for g in groups for r in g)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached},
                "prompt_cache_hit_tokens": cached, "prompt_cache_miss_tokens": prompt - cached}

    async def collect(self, requests: list[EngineRequest], options: OutputOptions,
                      raw: Request) -> list[list[Delta]]:
        """All deltas of every choice; aborts if the client disconnects while waiting."""
        per_choice: list[list[Delta]] = [[] for _ in requests]

        async def consume() -> None:
            async with contextlib.aclosing(self.engine.generate(requests, options)) as stream:
                async for delta in stream:
                    if delta.error:
                        raise ApiError(500, delta.error, "server_error", code="generation_failed")
                    per_choice[delta.index].append(delta)

        task = asyncio.ensure_future(consume())
        while not task.done():
            await asyncio.wait([task], timeout=0.25)
            if not task.done() and await raw.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                raise ApiError(499, "client disconnected")
        task.result()
        return per_choice

    # ---- chat -------------------------------------------------------------------------------------
    async def chat(self, body: ChatCompletionRequest, raw: Request) -> Response:
        self.check_model(body.model)
        self.warn_extras(body)
        thinking = body.thinking_mode()
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        try:
            text = encode_messages(messages, thinking=thinking, tools=body.tools,
                                   reasoning_effort=body.reasoning_effort)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="messages") from exc
        prompt = self.tokenizer.encode(text)
        max_tokens = self.default_max_tokens(body.max_completion_tokens or body.max_tokens, len(prompt))
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        requests = self.choices(rid, prompt, body, max_tokens, logprobs)
        options = self.output_options(body, reasoning_end_token=self.think_end_id if thinking else None)
        created = int(time.time())
        self.engine.check(requests)  # errors must come before a stream's first byte
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return self.sse(self.chat_stream(rid, created, requests, options, include_usage, body.logprobs))
        per_choice = await self.collect(requests, options, raw)
        choices = []
        for i, deltas in enumerate(per_choice):
            message: dict[str, Any] = {"role": "assistant", "content": "".join(d.text for d in deltas)}
            if thinking:
                message["reasoning_content"] = "".join(d.reasoning for d in deltas)
            choices.append({"index": i, "message": message, "finish_reason": deltas[-1].finish_reason,
                            "logprobs": self.chat_logprobs(deltas) if body.logprobs else None})
        return JSONResponse({"id": rid, "object": "chat.completion", "created": created,
                             "model": self.config.served_model_name, "choices": choices,
                             "usage": self.usage([requests])})

    def chat_logprobs(self, deltas: list[Delta]) -> dict[str, Any]:
        content = []
        for d in deltas:
            for s in d.samples:
                text, raw = self.token_text(s.token)
                top = [{"token": self.token_text(t)[0], "logprob": lp, "bytes": self.token_text(t)[1]}
                       for t, lp in s.top]
                content.append({"token": text, "logprob": s.logprob, "bytes": raw, "top_logprobs": top})
        return {"content": content}

    async def chat_stream(self, rid: str, created: int, requests: list[EngineRequest], options: OutputOptions,
                          include_usage: bool, logprobs: bool) -> AsyncIterator[str]:
        chunk = self.chunker(rid, "chat.completion.chunk", created, include_usage)

        for i in range(len(requests)):
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}])
        async for delta in self.guarded(requests, options):
            if delta.error:
                yield self.error_event(delta.error)
                break
            body: dict[str, Any] = {}
            if delta.reasoning:
                body["reasoning_content"] = delta.reasoning
            if delta.text:
                body["content"] = delta.text
            if not body and not delta.finished and not (logprobs and delta.samples):
                continue  # bytes held back (partial character, stop-string prefix, skipped special)
            yield chunk([{"index": delta.index, "delta": body,
                          "logprobs": self.chat_logprobs([delta]) if logprobs else None,
                          "finish_reason": delta.finish_reason if delta.finished else None}])
        else:
            if include_usage:
                yield chunk([], self.usage([requests]))
        yield "data: [DONE]\n\n"

    async def guarded(self, requests: list[EngineRequest], options: OutputOptions) -> AsyncIterator[Delta]:
        async with contextlib.aclosing(self.engine.generate(requests, options)) as stream:
            async for delta in stream:
                yield delta

    def chunker(self, rid: str, obj: str, created: int, include_usage: bool) -> Any:
        """Builds one SSE event per chunk; with include_usage every chunk carries `usage` (null
        until the final, choice-less one)."""

        def chunk(choices: list[dict[str, Any]], usage: Any = None) -> str:
            payload = {"id": rid, "object": obj, "created": created, "model": self.config.served_model_name,
                       "choices": choices}
            if include_usage:
                payload["usage"] = usage
            return f"data: {json.dumps(payload)}\n\n"

        return chunk

    @staticmethod
    def error_event(message: str) -> str:
        return f"data: {json.dumps(error_json(message, 'server_error', code='generation_failed'))}\n\n"

    @staticmethod
    def sse(gen: AsyncIterator[str]) -> StreamingResponse:
        return StreamingResponse(gen, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # ---- completions --------------------------------------------------------------------------------
    def completion_prompts(self, prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            return [self.encode_text_prompt(prompt)]
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        if all(isinstance(p, str) for p in prompt):
            return [self.encode_text_prompt(p) for p in prompt]
        if all(isinstance(p, list) for p in prompt):
            if any(not p for p in prompt):
                raise ApiError(400, "token-id prompts must not be empty", param="prompt")
            return [list(p) for p in prompt]
        raise ApiError(400, "prompt must be a string, a list of strings, or token ids", param="prompt")

    def encode_text_prompt(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text)
        bos = self.tokenizer.bos_token_id
        return ids if ids[:1] == [bos] else [bos] + ids

    async def completions(self, body: CompletionRequest, raw: Request) -> Response:
        self.check_model(body.model)
        self.warn_extras(body)
        prompts = self.completion_prompts(body.prompt)
        if len(prompts) * body.n > 64:
            raise ApiError(400, "at most 64 prompts × n per request", param="prompt")
        rid = f"cmpl-{uuid.uuid4().hex}"
        options = self.output_options(body)
        groups = []
        for p, prompt in enumerate(prompts):
            max_tokens = self.default_max_tokens(body.max_tokens, len(prompt))
            prompt_lp = body.logprobs if body.echo and body.logprobs is not None else None
            groups.append(self.choices(f"{rid}-{p}", prompt, body, max_tokens, body.logprobs, prompt_lp))
        self.engine.check([r for g in groups for r in g])  # errors must come before a stream's first byte
        created = int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return self.sse(self.completion_stream(rid, created, groups, options, body, include_usage))
        results = await asyncio.gather(*(self.collect(g, options, raw) for g in groups))
        choices = []
        for p, (group, per_choice) in enumerate(zip(groups, results, strict=True)):
            for j, deltas in enumerate(per_choice):
                choices.append(self.completion_choice(p * body.n + j, group[j], deltas, body))
        usage = self.usage(groups)
        return JSONResponse({"id": rid, "object": "text_completion", "created": created,
                             "model": self.config.served_model_name, "choices": choices, "usage": usage})

    def completion_choice(self, index: int, request: EngineRequest, deltas: list[Delta],
                          body: CompletionRequest) -> dict[str, Any]:
        text = "".join(d.text for d in deltas)
        samples = [s for d in deltas for s in d.samples]
        logprobs = None
        prefix = ""
        if body.echo:
            prefix = self.tokenizer.decode(request.prompt_token_ids, skip_special_tokens=body.skip_special_tokens)
        if body.logprobs is not None:
            entries = (request.prompt_logprobs if body.echo else []) + samples
            tokens = (request.prompt_token_ids if body.echo else []) + [s.token for s in samples]
            logprobs = self.legacy_logprobs(tokens, entries)
        return {"index": index, "text": prefix + text, "logprobs": logprobs,
                "finish_reason": deltas[-1].finish_reason}

    def legacy_logprobs(self, tokens: list[int], entries: list[Any]) -> dict[str, Any]:
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = 0
        for token, entry in zip(tokens, entries, strict=True):
            text = self.token_text(token)[0]
            out["tokens"].append(text)
            out["text_offset"].append(offset)
            offset += len(text)
            if entry is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
            else:
                out["token_logprobs"].append(entry.logprob)
                out["top_logprobs"].append({self.token_text(t)[0]: lp for t, lp in entry.top})
        return out

    async def completion_stream(self, rid: str, created: int, groups: list[list[EngineRequest]],
                                options: OutputOptions, body: CompletionRequest,
                                include_usage: bool) -> AsyncIterator[str]:
        chunk = self.chunker(rid, "text_completion", created, include_usage)

        merged: asyncio.Queue[tuple[int, Delta | None]] = asyncio.Queue()

        async def pump(p: int, group: list[EngineRequest]) -> None:
            try:
                async for delta in self.guarded(group, options):
                    await merged.put((p, delta))
            finally:
                await merged.put((p, None))

        tasks = [asyncio.ensure_future(pump(p, g)) for p, g in enumerate(groups)]
        open_groups, failed = len(groups), False
        try:
            if body.echo:
                for p, group in enumerate(groups):
                    text = self.tokenizer.decode(group[0].prompt_token_ids,
                                                 skip_special_tokens=body.skip_special_tokens)
                    for j in range(body.n):
                        yield chunk([{"index": p * body.n + j, "text": text, "logprobs": None, "finish_reason": None}])
            while open_groups:
                p, delta = await merged.get()
                if delta is None:
                    open_groups -= 1
                    continue
                if delta.error:
                    yield self.error_event(delta.error)
                    failed = True
                    break
                if not delta.text and not delta.finished and body.logprobs is None:
                    continue  # bytes held back (partial character or stop-string prefix)
                lp = None
                if body.logprobs is not None:
                    lp = self.legacy_logprobs([s.token for s in delta.samples], delta.samples)
                yield chunk([{"index": p * body.n + delta.index, "text": delta.text, "logprobs": lp,
                              "finish_reason": delta.finish_reason if delta.finished else None}])
            if include_usage and not failed:
                yield chunk([], self.usage(groups))
            yield "data: [DONE]\n\n"
        finally:
            for t in tasks:
                t.cancel()


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
    api = Api(engine, tokenizer, config, metrics)
    app.state.api = api

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return JSONResponse(error_json(message, param=param), status_code=400)

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, exc: RequestError) -> JSONResponse:
        return JSONResponse(error_json(str(exc), param=exc.param, code=exc.code), status_code=400)

    @app.exception_handler(EngineOverloaded)
    async def _overloaded(_: Request, exc: EngineOverloaded) -> JSONResponse:
        return JSONResponse(error_json(f"the server is overloaded: {exc}; retry later", "server_overloaded",
                                       code="server_overloaded"), status_code=503, headers={"Retry-After": "1"})

    @app.exception_handler(EngineDead)
    async def _dead(_: Request, exc: EngineDead) -> JSONResponse:
        return JSONResponse(error_json(str(exc), "server_error", code="engine_dead"), status_code=503)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "NotFoundError" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_json(str(exc.detail), type_), status_code=exc.status_code)

    if config.api_key:
        app.add_middleware(ApiKeyAuth, api_key=config.api_key)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, raw: Request) -> Response:
        return await api.chat(body, raw)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await api.completions(body, raw)

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
    async def version() -> dict[str, str]:
        return {"version": VERSION}

    @app.get("/metrics")
    async def prometheus() -> Response:
        metrics.sample_queues(engine.engine)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        api.check_model(body.model)
        if body.messages is not None:
            try:
                tokens = tokenizer.encode(encode_messages([m.model_dump(exclude_none=True) for m in body.messages]))
            except ValueError as exc:
                raise ApiError(400, str(exc), param="messages") from exc
        else:
            tokens = api.encode_text_prompt(body.prompt or "") if body.add_special_tokens else tokenizer.encode(
                body.prompt or "")
        return {"tokens": tokens, "count": len(tokens), "max_model_len": config.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        api.check_model(body.model)
        vocab = engine.engine.model.cfg.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise ApiError(400, f"token ids must be in 0..{vocab - 1}", param="tokens")
        return {"prompt": tokenizer.decode(body.tokens)}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(store: bool = False) -> dict[str, Any]:
        """Empty the device prefix cache; with `?store=true` also the SSD store."""
        dropped = await engine.call(lambda eng: eng.kv.reset_prefix_cache(store=store))
        return {"status": "ok", "dropped_blocks": dropped, "store_cleared": store}

    return app
