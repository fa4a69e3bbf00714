"""bench/jit_watch.py: the Triton cache-miss hook installed for the window only, the first-used variants recorded by
kernel name, a hook that was there before still called (the GPU runs the real misses; here the hook is called as
Triton calls it, with keyword arguments)."""

from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("triton")


def test_records_the_window_and_restores_the_hook(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    import jit_watch

    owner = jit_watch._hook_owner()
    assert owner is not None
    obj, attr = owner
    earlier = []
    monkeypatch.setattr(obj, attr, lambda **kw: earlier.append(kw["fn"].name))
    before = getattr(obj, attr)
    with jit_watch.JitWatch() as watch:
        hook = getattr(obj, attr)
        assert hook is not before
        for name in ("_argmax_rows_kernel", "_gather_rows_kernel", "_argmax_rows_kernel"):
            assert not hook(key=name, repr=f"{name}[num_warps=4]()", fn=SimpleNamespace(name=name), compile={},
                            is_manual_warmup=False, already_compiled=False)  # falsy: Triton goes on compiling
    assert getattr(obj, attr) is before
    assert watch.first_uses == ["_argmax_rows_kernel", "_gather_rows_kernel", "_argmax_rows_kernel"]
    assert watch.variants == [f"{n}[num_warps=4]() | key {n}" for n in watch.first_uses]  # Triton's description
    assert earlier == watch.first_uses  # the earlier hook was chained
    assert watch.line() == "Triton kernel variants first used: 3 (_argmax_rows_kernel x2, _gather_rows_kernel)"
