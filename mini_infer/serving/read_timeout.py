"""Slow clients cannot hold sockets open: uvicorn's HTTP protocol with a request read timeout.

uvicorn closes a connection idle between requests (`timeout_keep_alive`), but not one that opened and sent
nothing, stopped halfway through its request headers, or sent a body shorter than its Content-Length: each
waits forever, and enough of them exhaust the server's sockets. `protocol_with_read_timeout(seconds)` returns
uvicorn's own HTTP protocol class (h11 or httptools, as uvicorn would pick) with one timer per connection:
the request headers must be complete within `seconds` of the connection opening (or of the previous response
ending), and a request body may not stall for `seconds` between two reads. Past either, the connection is
closed (the route, if one runs, sees the client disconnect). This module must not touch requests' content.
"""

from __future__ import annotations

import asyncio
import logging

logger = logging.getLogger("mini_infer.serving")

DEFAULT_REQUEST_READ_TIMEOUT = 30.0


class _ReadTimeout:
    """Mixin for uvicorn's H11Protocol / HttpToolsProtocol (uses their `cycle`, `transport`, `loop` and
    `on_response_complete`)."""

    read_timeout: float = DEFAULT_REQUEST_READ_TIMEOUT
    _read_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_read_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        cycle = self.cycle
        if cycle is None or cycle.response_complete:  # between requests: the headers' deadline runs on
            if self._read_timer is None and not self.transport.is_closing():
                self._arm_read_timer()
        elif cycle.more_body:  # inside a body: a deadline from these bytes
            self._arm_read_timer()
        else:  # the request is in; the app works on it
            self._cancel_read_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm_read_timer()  # the next request's headers must come in time too

    def connection_lost(self, exc) -> None:
        self._cancel_read_timer()
        super().connection_lost(exc)

    def _arm_read_timer(self) -> None:
        self._cancel_read_timer()
        self._read_timer = self.loop.call_later(self.read_timeout, self._read_timed_out)

    def _cancel_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if not self.transport.is_closing():
            logger.info("closing a connection from %s: no complete request within %gs", self.client,
                        self.read_timeout)
            self.transport.close()


def protocol_with_read_timeout(seconds: float) -> type:
    """uvicorn's default HTTP protocol class, closing connections whose request does not arrive in time."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    return type(f"{AutoHTTPProtocol.__name__}WithReadTimeout", (_ReadTimeout, AutoHTTPProtocol),
                {"read_timeout": float(seconds)})
