"""OpenAI's error shape, `{"error": {"message", "type", "param", "code"}}`, and the handlers that
turn every failure into it: 400 for bad requests (never 422 or 500), 404 for an unknown model,
503 (with Retry-After when it is worth retrying) when the engine cannot take work."""

from __future__ import annotations

import logging
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from v4serve.engine.process.client import EngineDead, EngineOverloaded
from v4serve.engine.request import RequestError

log = logging.getLogger(__name__)


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """What every error response carries (documented in /openapi.json for each status)."""

    error: ErrorBody


ERROR_STATUSES = {
    400: "a bad request: invalid JSON or field, unknown parameter, prompt too long",
    401: "missing or wrong API key (with --api-key)",
    404: "unknown model or route",
    403: "a web page of an origin not in --allowed-origins",
    413: "the request body is larger than --max-request-bytes",
    415: "the request body is not sent as application/json",
    500: "the generation failed (only this request)",
    503: "the engine is dead, shutting down or overloaded (Retry-After says when to retry)",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` for a route: the OpenAI error shape under each status it can answer with."""
    return {status: {"model": ErrorResponse, "description": ERROR_STATUSES[status]} for status in statuses}


def error_json(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": ErrorBody(message=message, type=type_, param=param, code=code).model_dump()}


# An error message is at most this long: a value it quotes from the request is cut to ECHO_CHARS
# (`echo`), and a message that still grows past this (a schema library quoting a whole schema) is cut
# here. An error must not hand back a multi-megabyte field, or amplify one.
MAX_MESSAGE_CHARS = 1000
ECHO_CHARS = 64


def echo(value: object, limit: int = ECHO_CHARS) -> str:
    """A value from the request as an error message quotes it: its repr, cut to `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text) - limit} more characters)"


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        if len(message) > MAX_MESSAGE_CHARS:
            message = f"{message[:MAX_MESSAGE_CHARS]}… (message cut at {MAX_MESSAGE_CHARS} characters)"
        if param is not None and len(param) > 2 * ECHO_CHARS:  # it can hold a property's name
            param = f"{param[:2 * ECHO_CHARS]}…"
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(error_json(self.message, self.type, self.param, self.code), status_code=self.status,
                            headers=self.headers)


class BodyTooLarge(ApiError):
    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than the {limit} bytes this server accepts "
                         f"(--max-request-bytes)", code="request_too_large", headers={"Connection": "close"})


def validation_message(exc: RequestValidationError | ValidationError) -> tuple[str, str | None]:
    """One readable message (and the parameter it names) for pydantic's list of problems."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "unknown_field":  # raised by the model holding it: its name is in the context
        loc.append(str((first.get("ctx") or {}).get("field", "")))
    param = ".".join(loc) or None
    msg = first.get("msg", "invalid value")
    if first.get("type") == "json_invalid":  # also invalid UTF-8 and lone surrogates
        detail = (first.get("ctx") or {}).get("error")
        return "the request body is not valid JSON" + (f" ({detail})" if detail else ""), None
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return (f"{param}: {msg}" if param else msg) + more, param


def as_api_error(exc: Exception) -> ApiError:
    """The OpenAI error for a failure raised while handling a request."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, RequestValidationError):
        message, param = validation_message(exc)
        return ApiError(400, message, param=param)
    if isinstance(exc, RequestError):
        return ApiError(400, str(exc), param=exc.param, code=exc.code)
    if isinstance(exc, EngineOverloaded):
        return ApiError(503, f"the server is overloaded: {exc}; retry later", "server_overloaded",
                        code="server_overloaded", headers={"Retry-After": "1"})
    if isinstance(exc, EngineDead):
        return ApiError(503, str(exc), "server_error", code="engine_dead")
    if isinstance(exc, StarletteHTTPException):  # unknown route (404), wrong method (405, with Allow)
        type_ = "NotFoundError" if exc.status_code == 404 else "invalid_request_error"
        return ApiError(exc.status_code, str(exc.detail), type_, headers=dict(exc.headers or {}) or None)
    raise TypeError(f"no OpenAI error for {type(exc).__name__}")


def internal_error(exc: BaseException, what: str = "the request failed") -> ApiError:
    """The 500 for a failure no client caused: "internal error" and an id to find it by in the log,
    where the detail goes. An exception's text never reaches a client: it can hold anything (a
    file's bytes, a path, another request's data)."""
    error_id = f"err_{uuid.uuid4().hex[:16]}"
    log.error("%s (%s)", what, error_id, exc_info=exc)
    return ApiError(500, f"internal error ({error_id}; the server's log has the detail)", "server_error",
                    code="internal_error")


def failure_message(exc: BaseException, what: str) -> str:
    """What a client may read of a failure once its stream has begun: the error's own message when it
    is one of ours (built from the request or the engine's state), else an internal error's."""
    try:
        return as_api_error(exc).message  # type: ignore[arg-type]
    except TypeError:
        return internal_error(exc, what).message


class ClientGone(Exception):
    """The client closed its connection before its request body ended."""


def install_error_handlers(app: FastAPI) -> None:
    async def handle(_: Request, exc: Exception) -> JSONResponse:
        return as_api_error(exc).response()

    async def gone(_: Request, exc: Exception) -> JSONResponse:
        # Nobody reads this answer; it only ends the request without a traceback in the log.
        log.debug("a client closed its connection mid-body")
        return ApiError(400, "the connection closed before the request body ended").response()

    async def unexpected(raw: Request, exc: Exception) -> JSONResponse:
        return internal_error(exc, f"{raw.method} {raw.url.path} failed").response()

    for kind in (ApiError, RequestValidationError, RequestError, EngineOverloaded, EngineDead,
                 StarletteHTTPException):
        app.add_exception_handler(kind, handle)
    app.add_exception_handler(ClientGone, gone)
    app.add_exception_handler(Exception, unexpected)
