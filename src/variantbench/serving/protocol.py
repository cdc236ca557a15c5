"""uvicorn's HTTP protocol with a deadline on a request's headers (issue 41: slow clients).

uvicorn bounds the idle time between keep-alive requests (``timeout_keep_alive``) but not the time a
request's headers take: a client that sends a byte every few seconds held its connection, and its
slot in the backlog, for as long as it liked. Here a timer starts with the connection and with each
new request's first byte, and ends when its headers are complete; if it fires first, the client gets
408 and the connection is closed. The body's own deadline is the app's (``serving/guard.py``), where
the request is known.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

DEFAULT_HEADER_TIMEOUT_S = 10.0


def with_header_timeout(seconds: float) -> type[HttpToolsProtocol]:
    """The protocol class to give ``uvicorn.Config(http=...)``."""

    class HeaderDeadline(HttpToolsProtocol):
        header_timeout_s = seconds

        def __init__(self, *args: Any, **kw: Any) -> None:
            super().__init__(*args, **kw)
            self._header_timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()  # a connection that sends nothing is also a slow client

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _headers_late(self) -> None:
            self._header_timer = None
            if self.transport.is_closing():
                return
            if self.cycle is not None and not self.cycle.response_complete:
                return  # a request whose headers are in (the app has it): its body has its own deadline
            self.transport.write(
                b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
            )
            self.transport.close()

    return HeaderDeadline
