"""`GracefulServer`: uvicorn's server with mini-infer's shutdown: SIGINT or SIGTERM stop accepting, let the
requests in flight finish for up to `shutdown_timeout` seconds, then end the rest through the engine (a stream
gets an error event and `data: [DONE]`, a waiting request a 503) instead of cutting connections; the process
then exits with status 0. A second SIGINT quits at once.

uvicorn alone would cancel the request tasks at its own timeout (one ASGI traceback per open stream) and
re-raise the signal after shutting down (a SIGTERM exit status). This module decides when to stop and what
happens to requests in flight; it must not build responses.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import threading

import uvicorn

from mini_infer.serving.state import ServerState

DEFAULT_SHUTDOWN_TIMEOUT = 5.0
_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class GracefulServer(uvicorn.Server):
    """A uvicorn server over `state`'s app whose signals drain requests instead of cancelling them."""

    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.state = state
        self.shutdown_timeout = shutdown_timeout
        self.stop_signal: int | None = None  # the signal that asked to stop, if one did

    @contextlib.contextmanager
    def capture_signals(self):
        """SIGINT/SIGTERM ask the server to stop (the main thread only); nothing is re-raised afterwards."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in _SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: do not wait
        self.stop_signal = self.stop_signal or sig
        self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        """Drain (see the module docstring), then uvicorn's own shutdown."""
        self.state.draining = True
        in_flight = len(self.server_state.tasks)
        if in_flight and self.state.engine is not None:
            print(f"mini-infer: shutting down: {in_flight} request(s) in flight get up to "
                  f"{self.shutdown_timeout:g}s to finish", file=sys.stderr, flush=True)
        ender = asyncio.ensure_future(self._end_requests_after_timeout())
        try:
            await super().shutdown(sockets)
        finally:
            ender.cancel()

    async def _end_requests_after_timeout(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.shutdown_timeout
        while self.server_state.tasks and loop.time() < deadline and not self.force_exit:
            await asyncio.sleep(0.05)
        engine = self.state.engine
        if self.server_state.tasks and engine is not None:
            print(f"mini-infer: ending {len(self.server_state.tasks)} request(s) still running after "
                  f"{self.shutdown_timeout:g}s", file=sys.stderr, flush=True)
            await asyncio.to_thread(engine.shutdown, 10.0, "the server is shutting down")
