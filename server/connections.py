"""What a connection may hold: uvicorn's HTTP/1.1 protocol (httptools, the C parser: a streamed token's
chunk is framed and written without a pure-Python state machine) with a deadline for a request's
headers and a cap on connections that idle ones cannot exhaust.

uvicorn closes a connection idle after a response (`timeout_keep_alive`), but not one that was opened
and never sent anything, nor one that sends its headers a line at a time: both would stay open for
as long as the client likes (slowloris), bounded only by the file-descriptor limit. Here a connection
has `header_timeout` seconds, from when it opens or its last response completes, to finish the
headers of its next request; otherwise it is closed. A request whose headers have arrived is never
cut by it (its body and its response take as long as they take).

`max_connections` caps open connections: one more arriving past it closes the connection that has
been idle longest (no request running on it, for a second at least), so idle sockets can never lock
everyone out. Requests
running at once are capped by `RequestCap` (503 past it), which never refuses the probes (`/health`,
`/metrics`): a load balancer and Prometheus still see the daemon while it is full.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from fastapi.responses import JSONResponse
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from v4serve.server.errors import error_json

PROBES = frozenset({"/health", "/metrics"})
# A connection idle for less than this is never closed to make room: it may have just opened with its
# request on the way (not yet read). Past the cap, those opened within it stay until they are older.
MIN_IDLE_TO_EVICT = 1.0


def protocol_with_header_timeout(header_timeout: float, on_close: Callable[[str], None] = lambda reason: None,
                                  max_connections: int | None = None) -> type[HttpToolsProtocol]:
    """The protocol class for `uvicorn.Config(http=...)`; `on_close(reason)` is called for each connection
    it closes ("header_timeout", or "idle_evicted" to make room past `max_connections`)."""

    class HeaderTimeoutProtocol(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None
        _idle_since: float = 0.0

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._idle_since = time.monotonic()
            self._await_headers(after=None)
            if max_connections is not None and len(self.connections) > max_connections:
                self._evict_idle()

        def on_response_complete(self) -> None:
            answered = self.cycle  # a pipelined request may start inside: it is not the one awaited
            super().on_response_complete()
            self._idle_since = time.monotonic()
            if not self.transport.is_closing():
                self._await_headers(after=answered)

        def connection_lost(self, exc: Exception | None) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            super().connection_lost(exc)

        @property
        def idle(self) -> bool:
            """No request runs on it: it waits for (or is reading) the headers of its next one."""
            return self.cycle is None or self.cycle.response_complete

        def _evict_idle(self) -> None:
            """Close the connection idle longest (not this new one: it is yet to be heard)."""
            now = time.monotonic()
            idle = [c for c in self.connections if c is not self and getattr(c, "idle", False)
                    and now - c._idle_since >= MIN_IDLE_TO_EVICT and not c.transport.is_closing()]
            if not idle:
                return  # all are running requests: the new one stays, and RequestCap answers its requests
            oldest = min(idle, key=lambda c: c._idle_since)
            oldest.transport.close()
            on_close("idle_evicted")

        def _await_headers(self, after: Any) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()

            def expire() -> None:
                if self.cycle is after and not self.transport.is_closing():  # no new request's headers yet
                    self.transport.close()
                    on_close("header_timeout")

            self._header_timer = self.loop.call_later(header_timeout, expire)

    return HeaderTimeoutProtocol


class RequestCap:
    """Plain ASGI middleware: at most `limit` requests run at once; one more gets 503 with Retry-After,
    except the probes, which are always answered."""

    def __init__(self, app: Any, limit: int, on_refused: Callable[[], None] = lambda: None) -> None:
        self.app, self.limit, self.on_refused = app, limit, on_refused
        self.running = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("path") in PROBES:
            await self.app(scope, receive, send)
            return
        if self.running >= self.limit:
            self.on_refused()
            body = error_json(f"the server is at its limit of {self.limit} requests at once (--max-connections); "
                              "retry later", "server_overloaded", code="server_overloaded")
            await JSONResponse(body, status_code=503, headers={"Retry-After": "1"})(scope, receive, send)
            return
        self.running += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.running -= 1
