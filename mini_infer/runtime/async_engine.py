"""`AsyncLLMEngine`: the synchronous `LLMEngine` behind an asyncio interface, for the HTTP server.

One daemon thread owns the `LLMEngine` (which is not thread-safe) and runs its step loop while there is
work. Everything else talks to that thread through one FIFO inbox (`queue.Queue`): new requests and aborts
are applied between steps, in the order they were sent. Outputs go the other way: after each step the loop
thread hands every changed request's `RequestOutput` to the asyncio loop that asked for it, through
`loop.call_soon_threadsafe`, into a per-request `asyncio.Queue`.

    engine = AsyncLLMEngine.from_config(EngineConfig(model="tiny-llama"))
    async for out in engine.generate([1, 2, 3], SamplingParams(max_tokens=8)):
        print(out.deltas[0])

Contract:
- `add_request` returns once the loop thread has accepted the request, so a bad request raises the
  engine's `ValueError` there (the server answers 400 before it starts a stream); the loop keeps serving.
- A consumer that stops iterating (the generator is closed or cancelled, e.g. the HTTP client went away)
  aborts its request; the engine frees its KV blocks before the next step.
- Past `max_waiting_requests` queued requests, `add_request` raises `EngineOverloaded` (the server answers
  503 with Retry-After).
- If the loop thread dies, the engine is marked dead (`is_dead`, health 503), every open stream raises
  `EngineDeadError`, and so does every later `add_request`.
- `stats()` is a snapshot of the engine's counters taken by the loop thread after each step: safe to read
  from any thread. Observers (`add_observer`) see every output in the loop thread (for latency metrics).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from mini_infer.outputs import RequestOutput
from mini_infer.sampling_params import SamplingParams

logger = logging.getLogger("mini_infer.async_engine")


class EngineOverloaded(RuntimeError):
    """Too many requests are waiting; retry later (HTTP 503 + Retry-After)."""


class EngineDeadError(RuntimeError):
    """The engine's loop thread has died; no request can be served (HTTP 503)."""


class RequestAborted(RuntimeError):
    """The request was aborted by someone other than its consumer (e.g. engine shutdown)."""


class EngineObserver(Protocol):
    """Sees the engine's traffic from inside the loop thread; must be fast and must not raise."""

    def on_output(self, output: RequestOutput) -> None: ...

    def on_abort(self, request_id: str) -> None: ...


_ACCEPTED = object()  # first stream item: the loop thread queued the request
_ABORTED = object()  # last stream item of a request aborted by someone other than its consumer
_STOP = ("stop", None)


@dataclass
class _Stream:
    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False


@dataclass
class _Add:
    stream: _Stream
    prompt: Any
    params: SamplingParams
    priority: int
    arrival_time: float


class AsyncLLMEngine:
    """Asyncio front of an `LLMEngine` whose step loop runs in one background thread."""

    def __init__(self, engine, max_waiting_requests: int | None = None, start: bool = True) -> None:
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}  # loop-thread only
        self._lock = threading.Lock()  # guards _dead, _pending_adds and _ids across threads
        self._pending_adds = 0  # requests sent to the inbox and not yet counted by a stats snapshot
        self._applied = 0  # adds applied since the last snapshot (loop thread)
        self._dead: BaseException | None = None
        self._stopping = False
        self._stop_reason = "the engine is shutting down"
        self._ids = itertools.count()
        self._observers: list[EngineObserver] = []
        self._stats: dict[str, Any] = {}
        self._snapshot()
        self._thread = threading.Thread(target=self._run, name="mini-infer-engine", daemon=True)
        if start:
            self._thread.start()

    @classmethod
    def from_config(cls, config=None, max_waiting_requests: int | None = None) -> AsyncLLMEngine:
        """Build (load + compile; blocking) an `LLMEngine` from an `EngineConfig` and wrap it."""
        from mini_infer.runtime.engine import EngineConfig, LLMEngine

        return cls(LLMEngine(config or EngineConfig()), max_waiting_requests=max_waiting_requests)

    # ------------------------------------------------------------------ properties
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None

    @property
    def dead_error(self) -> BaseException | None:
        """Why no request can be served: the loop died, or the engine reports a failure of its own (a
        tensor-parallel rank died: seen here at once, even while a step waits on that rank)."""
        return self._dead or getattr(self.engine, "failure", None)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._dead is None and not self._stopping

    def add_observer(self, observer: EngineObserver) -> None:
        """Register an observer before traffic starts (it is called from the loop thread)."""
        self._observers.append(observer)

    def stats(self) -> dict[str, Any]:
        """The engine's counters as of the last step (a copy; any thread)."""
        stats = dict(self._stats)
        stats["num_waiting"] += self._pending_adds
        stats["dead"] = self.is_dead
        return stats

    # ------------------------------------------------------------------ requests
    async def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                          priority: int = 0) -> _Stream:
        """Queue a request and wait until the loop thread has accepted it; returns its stream.

        Raises the engine's ValueError for a bad request, EngineOverloaded past the waiting limit,
        EngineDeadError when the loop has died.
        """
        params = params or SamplingParams()
        with self._lock:
            if self.dead_error is not None:
                raise EngineDeadError(f"the engine is dead: {self.dead_error!r}")
            if self._stopping:
                raise EngineDeadError(self._stop_reason)
            if self.max_waiting_requests is not None and self._num_waiting() >= self.max_waiting_requests:
                raise EngineOverloaded(
                    f"too many waiting requests (limit {self.max_waiting_requests}); retry later")
            if request_id is None:
                request_id = f"async-{next(self._ids)}"
            stream = _Stream(request_id, asyncio.get_running_loop())
            self._pending_adds += 1
            self._inbox.put(("add", _Add(stream, prompt, params, priority, time.monotonic())))
        try:
            first = await stream.queue.get()
        except BaseException:  # cancelled while the loop thread was accepting it: take it back
            self.abort(request_id)
            raise
        if isinstance(first, BaseException):
            raise first
        assert first is _ACCEPTED
        return stream

    async def generate(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs, one per step that changed it, the last with `.finished`.

        Stopping the iteration early (break, aclose, cancellation) aborts the request.
        """
        stream = await self.add_request(prompt, params, request_id, priority)
        outputs = self.iterate(stream)
        try:
            async for out in outputs:
                yield out
        finally:
            await outputs.aclose()  # closes at once, so an early stop aborts now, not at garbage collection

    async def iterate(self, stream: _Stream) -> AsyncIterator[RequestOutput]:
        """The outputs of an accepted stream (see `generate`)."""
        try:
            while True:
                item = await stream.queue.get()
                if item is _ABORTED:
                    stream.finished = True
                    raise RequestAborted(f"request {stream.request_id} was aborted")
                if isinstance(item, BaseException):
                    stream.finished = True
                    raise item
                if item.finished:
                    stream.finished = True
                yield item
                if stream.finished:
                    return
        finally:
            if not stream.finished:
                self.abort(stream.request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (any thread); applied before the loop's next step. Unknown ids are ignored."""
        self._inbox.put(("abort", request_id))

    def shutdown(self, timeout: float | None = 10.0, reason: str = "the engine is shutting down") -> bool:
        """Stop the loop thread; open streams end with RequestAborted(`reason`). Returns whether the thread has
        stopped (False: it was still in a step after `timeout` seconds)."""
        self._stop_reason = reason
        self._stopping = True
        self._inbox.put(_STOP)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
        stopped = not self._thread.is_alive()
        if stopped and hasattr(self.engine, "close"):  # the other tensor-parallel ranks, if any
            self.engine.close()
        return stopped

    # ------------------------------------------------------------------ the loop thread
    def _num_waiting(self) -> int:
        return self._stats.get("num_waiting", 0) + self._pending_adds

    def _run(self) -> None:
        try:
            while True:
                busy = self.engine.has_unfinished_requests()
                if not self._drain_inbox(block=not busy):
                    break
                if self.engine.has_unfinished_requests():
                    outputs = self.engine.step()
                    self._snapshot()  # before delivery: a consumer that saw an output sees its counters
                    self._dispatch(outputs)
                else:
                    self._snapshot()
        except BaseException as exc:  # noqa: BLE001 - anything that escapes kills the loop: say so everywhere
            logger.exception("engine loop died")
            self._die(exc)
            return
        # orderly shutdown: end every open stream
        for rid in list(self._streams):
            self.engine.abort_request(rid)
        self._post_many([(s, RequestAborted(f"request {s.request_id} ended: {self._stop_reason}"))
                         for s in self._streams.values()])
        self._streams.clear()
        self._fail_inbox(RequestAborted(self._stop_reason))

    def _drain_inbox(self, block: bool) -> bool:
        """Apply every queued add/abort; block for the first one when idle. False once told to stop."""
        posts: list[tuple[_Stream, Any]] = []
        try:
            while True:
                try:
                    kind, item = self._inbox.get(block=block)
                except queue.Empty:
                    return True
                block = False
                if kind == "stop":
                    return False
                if kind == "add":
                    posts.append(self._apply_add(item))
                else:
                    self._apply_abort(item)
        finally:
            self._post_many(posts)

    def _apply_add(self, add: _Add) -> tuple[_Stream, Any]:
        stream = add.stream
        self._applied += 1  # still counted as pending until the next snapshot sees it in the scheduler
        try:
            self.engine.add_request(stream.request_id, add.prompt, add.params, priority=add.priority,
                                    arrival_time=add.arrival_time)
        except Exception as exc:  # a bad request fails alone; the loop goes on
            return stream, exc
        self._streams[stream.request_id] = stream
        return stream, _ACCEPTED

    def _apply_abort(self, request_id: str) -> None:
        self.engine.abort_request(request_id)
        stream = self._streams.pop(request_id, None)
        if stream is not None:  # it was live (not finished, not refused)
            for obs in self._observers:
                obs.on_abort(request_id)
            self._post_many([(stream, _ABORTED)])

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        posts = []
        for out in outputs:
            for obs in self._observers:
                obs.on_output(out)
            stream = self._streams.get(out.request_id)
            if stream is None:  # aborted meanwhile
                continue
            if out.finished:
                del self._streams[out.request_id]
            posts.append((stream, out))
        self._post_many(posts)

    def _post_many(self, posts: list[tuple[_Stream, Any]]) -> None:
        """Hand items to their streams' event loops, one call_soon_threadsafe per loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for stream, item in posts:
            by_loop.setdefault(stream.loop, []).append((stream, item))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that event loop is closed: nobody listens, free the requests
                for stream, _ in items:
                    if self._streams.pop(stream.request_id, None) is not None:
                        self.engine.abort_request(stream.request_id)

    def _snapshot(self) -> None:
        eng = self.engine
        sched, bm = eng.scheduler, eng.block_manager
        stats = {
            "num_running": sched.num_running,
            "num_waiting": sched.num_waiting,
            "kv_cache_usage": bm.usage,
            "prefix_cache_queries": bm.prefix_cache_queries,
            "prefix_cache_hits": bm.prefix_cache_hits,
            "num_preemptions": sched.num_preemptions,
            "prompt_tokens": eng.stats.get("prompt_tokens", 0),
            "generation_tokens": eng.stats.get("generation_tokens", 0),
            "steps": eng.stats.get("steps", 0),
            "num_streams": len(self._streams),
            "time": time.time(),
        }
        with self._lock:
            self._stats = stats
            self._pending_adds -= self._applied
            self._applied = 0

    def _fail_inbox(self, exc: BaseException) -> None:
        posts = []
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                with self._lock:
                    self._pending_adds -= 1
                posts.append((item.stream, exc))
        self._post_many(posts)

    def _die(self, exc: BaseException) -> None:
        with self._lock:
            self._dead = exc
        err = EngineDeadError(f"the engine loop died: {type(exc).__name__}: {exc}")
        self._post_many([(s, err) for s in self._streams.values()])
        self._streams.clear()
        self._fail_inbox(err)


def _deliver(items: list) -> None:
    for stream, item in items:
        stream.queue.put_nowait(item)


__all__ = ["AsyncLLMEngine", "EngineDeadError", "EngineObserver", "EngineOverloaded", "RequestAborted"]
