"""The server freezes its start-up heap out of Python's cyclic collector once the engine is built, before the app
gets it (serving/launcher.py: `freeze_startup_heap`, called by `load_engine`)."""

from __future__ import annotations

import gc
from types import SimpleNamespace

from mini_infer.runtime.async_engine import AsyncLLMEngine
from mini_infer.serving import launcher


class _Node:
    other: _Node | None = None


def test_freeze_startup_heap_takes_what_is_alive_out_of_the_collector():
    a, b = _Node(), _Node()
    a.other, b.other = b, a  # a cycle, alive: only a full collection could ever look at it
    before = gc.get_freeze_count()
    try:
        frozen = launcher.freeze_startup_heap()
        assert frozen >= before + 2  # (frozen objects still die by refcount: the count may drop right after)
        assert not any(o is a or o is b for o in gc.get_objects())  # no generation holds them any more
        assert gc.is_tracked(a)  # still tracked objects, only frozen
    finally:
        gc.unfreeze()  # back to the oldest generation: the suite's own freezing (tests/conftest.py) goes on
    assert any(o is a for o in gc.get_objects())


def test_load_engine_freezes_before_the_app_gets_the_engine(monkeypatch):
    calls = []
    monkeypatch.setattr(launcher, "freeze_startup_heap", lambda: calls.append("freeze") or 1)
    monkeypatch.setattr(AsyncLLMEngine, "from_config",
                        classmethod(lambda cls, config, max_waiting_requests=None: "engine"))
    state = SimpleNamespace(settings=SimpleNamespace(max_waiting_requests=4), sampling_defaults=None,
                            set_engine=lambda engine: calls.append(("set_engine", engine)))
    assert launcher.load_engine(state, {"model": "tiny-llama"}) == "engine"
    assert calls == ["freeze", ("set_engine", "engine")]
