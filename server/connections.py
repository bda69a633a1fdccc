"""What a connection may hold: uvicorn's HTTP/1.1 protocol with a deadline for a request's headers.

uvicorn closes a connection idle after a response (`timeout_keep_alive`), but not one that was opened
and never sent anything, nor one that sends its headers a line at a time: both would stay open for
as long as the client likes (slowloris), bounded only by the file-descriptor limit. Here a connection
has `header_timeout` seconds, from when it opens or its last response completes, to finish the
headers of its next request; otherwise it is closed. A request whose headers have arrived is never
cut by it (its body and its response take as long as they take).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol


def protocol_with_header_timeout(header_timeout: float, on_close: Callable[[], None] = lambda: None
                                  ) -> type[H11Protocol]:
    """The protocol class for `uvicorn.Config(http=...)`; `on_close` is called for each connection it closes."""

    class HeaderTimeoutProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._await_headers(after=None)

        def on_response_complete(self) -> None:
            answered = self.cycle  # a pipelined request may start inside: it is not the one awaited
            super().on_response_complete()
            if not self.transport.is_closing():
                self._await_headers(after=answered)

        def connection_lost(self, exc: Exception | None) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            super().connection_lost(exc)

        def _await_headers(self, after: Any) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()

            def expire() -> None:
                if self.cycle is after and not self.transport.is_closing():  # no new request's headers yet
                    self.transport.close()
                    on_close()

            self._header_timer = self.loop.call_later(header_timeout, expire)

    return HeaderTimeoutProtocol
