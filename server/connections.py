"""What a connection may hold: uvicorn's HTTP/1.1 protocol (httptools, the C parser: a streamed token's
chunk is framed and written without a pure-Python state machine) with a deadline for a request's
headers, bounds on their size and number, and a cap on connections that idle ones cannot exhaust.

httptools has no bound of its own on headers (h11's `max_incomplete_event_size` is uvicorn's only one,
and only for h11), and it joins a header line that arrives in pieces by concatenation, quadratic in its
length. Here a request's header block (its request line and header lines) may take at most
`max_header_bytes` (vLLM's `--h11-max-incomplete-event-size`, 4 MiB), one line at most
`MAX_HEADER_LINE` bytes, and at most `max_header_count` lines (vLLM's `--h11-max-header-count`, 256);
past any of them the request gets 431 (Request Header Fields Too Large) in OpenAI's error shape and its
connection is closed. The block is counted as it arrives (each piece the socket delivers while the
headers are incomplete, never a piece in which a request began: never over, at most one read under),
and so is a line (pieces with no newline in them), so a header that never ends costs at most its
bound, never the parser's quadratic joining of a line of many megabytes.

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
import json
import time
from collections.abc import Callable
from typing import Any

import httptools
from fastapi.responses import JSONResponse
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from v4serve.server.body import DRAIN_SECONDS
from v4serve.server.errors import error_json

PROBES = frozenset({"/health", "/metrics"})
MAX_HEADER_BYTES = 4 << 20  # a request's header block (vLLM's h11_max_incomplete_event_size default)
MAX_HEADER_COUNT = 256  # header lines of one request (vLLM's h11_max_header_count default)
MAX_HEADER_LINE = 64 << 10  # one header line, or the request line: far above any cookie or token sent
HEADER_DRAIN_BYTES = 1 << 20  # what a client refused a 431 may still send before its connection is cut


class _HeadersTooLarge(Exception):
    """Raised inside the parser's callbacks to stop it; the protocol answers 431."""
# A connection idle for less than this is never closed to make room: it may have just opened with its
# request on the way (not yet read). Past the cap, those opened within it stay until they are older.
MIN_IDLE_TO_EVICT = 1.0


def protocol_with_header_timeout(header_timeout: float, on_close: Callable[[str], None] = lambda reason: None,
                                  max_connections: int | None = None, max_header_bytes: int = MAX_HEADER_BYTES,
                                  max_header_count: int = MAX_HEADER_COUNT) -> type[HttpToolsProtocol]:
    """The protocol class for `uvicorn.Config(http=...)`; `on_close(reason)` is called for each connection
    it closes ("header_timeout", "idle_evicted" to make room past `max_connections`, or "header_size"
    for headers past their bounds)."""
    line_cap = min(MAX_HEADER_LINE, max_header_bytes)

    class HeaderTimeoutProtocol(HttpToolsProtocol):
        _header_timer: asyncio.TimerHandle | None = None
        _idle_since: float = 0.0
        _in_headers: bool = True  # between a request's start (or the connection's) and its headers' end
        _header_bytes: int = 0  # of the current request's header block, as counted in `data_received`
        _header_count: int = 0
        _line_bytes: int = 0  # bytes of the pieces since the last one with a newline, while in headers
        _begun: int = 0  # requests begun on this connection
        _too_large: str | None = None  # why the headers were refused (the 431 is sent once)
        _drain_left: int = 0  # bytes the client may still send after the 431, dropped

        # ---- bounds on headers --------------------------------------------------------------------
        def data_received(self, data: bytes) -> None:
            if self._too_large is not None:  # refused: what the client still sends is read and dropped
                self._drain_left -= len(data)
                if self._drain_left <= 0:
                    self.transport.close()
                return
            if self._in_headers:  # a piece with no newline lies inside one line: a line that never ends stops here
                self._line_bytes = self._line_bytes + len(data) if b"\n" not in data else 0
                if self._line_bytes > line_cap:
                    self._too_large = f"a header line is over {line_cap} bytes"
                    self._refuse_headers()
                    return
            begun = self._begun
            self._unset_keepalive_if_required()
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserUpgrade:
                if self._should_upgrade():
                    self.handle_websocket_upgrade()
                else:
                    self._unsupported_upgrade_warning()
            except httptools.HttpParserError:
                if self._too_large is not None:
                    self._refuse_headers()
                    return
                self.logger.warning("Invalid HTTP request received.")
                self.send_400_response("Invalid HTTP request received.")
                return
            if self._in_headers and self._begun == begun:  # the whole piece was header bytes
                self._header_bytes += len(data)
                if self._header_bytes > max_header_bytes:
                    self._too_large = f"the request's headers are over {max_header_bytes} bytes"
                    self._refuse_headers()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._begun += 1
            self._in_headers, self._header_bytes, self._header_count = True, 0, 0

        def on_url(self, url: bytes) -> None:
            super().on_url(url)
            if len(self.url) > line_cap:
                self._stop(f"the request line is over {line_cap} bytes")

        def on_header(self, name: bytes, value: bytes) -> None:
            self._header_count += 1
            if self._header_count > max_header_count:
                self._stop(f"the request has over {max_header_count} headers")
            if len(name) + len(value) > line_cap:
                self._stop(f"a header line is over {line_cap} bytes")
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._in_headers = False
            super().on_headers_complete()

        def _stop(self, why: str) -> None:
            self._too_large = why
            raise _HeadersTooLarge(why)

        def _refuse_headers(self) -> None:
            assert self._too_large is not None
            if self._header_timer is not None:  # closed here, counted here: not also as a header timeout
                self._header_timer.cancel()
            if self.cycle is not None and not self.cycle.response_complete:
                # A pipelined request past the bounds while the one before it is still answered: nothing
                # may be written between that answer's bytes, so the connection is closed.
                self.transport.close()
                on_close("header_size")
                return
            body = json.dumps(error_json(f"{self._too_large}: send smaller or fewer headers",
                                         code="request_header_fields_too_large")).encode()
            self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json"
                                 b"\r\ncontent-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n"
                                 b"\r\n" + body)
            on_close("header_size")
            # The write side is shut once the answer is out, and what the client still sends is read and
            # dropped, up to HEADER_DRAIN_BYTES for DRAIN_SECONDS, so a client that went a little over the
            # bound finishes sending and reads its 431; one still sending past that is cut off (reading
            # a 40 MB header to its end cost eight at once more than they were worth).
            if not self.transport.can_write_eof():
                self.transport.close()
                return
            self.transport.write_eof()
            self._drain_left = HEADER_DRAIN_BYTES
            self.loop.call_later(DRAIN_SECONDS, self.transport.close)

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
