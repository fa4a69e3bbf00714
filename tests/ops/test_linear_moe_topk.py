"""linear_moe_topk: a MoE router's linear and its routing, the routing in the router GEMV's last program. Under the
interpreter the fused launch gives the unfused kernels' bits (gemv_triton's logits, moe_topk_triton's routing) for
one row with softmax scoring (plain, grouped, with a bias, the weights rounded as Qwen's are); repeated calls leave
the shared counter zero; several rows and sigmoid scoring run the unfused kernels (the test checks which ran); on
CPU the registered op runs the references; the fake gives moe_topk's shapes. (The routing's property test over
ties, tests/ops/test_moe_topk.py, runs this kernel too.)"""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import mini_infer.ops  # noqa: F401  (registers torch.ops.mini_infer.*)
from mini_infer.ops import linear_moe_topk as mod
from mini_infer.ops._split_k import split_counters
from mini_infer.ops.linear import gemv_triton, linear_reference, linear_triton
from mini_infer.ops.linear_moe_topk import linear_moe_topk_reference, linear_moe_topk_triton
from mini_infer.ops.moe_topk import moe_topk_reference, moe_topk_triton
from tests.ops.helpers import DEVICE, requires_triton

mi = torch.ops.mini_infer
# (experts, hidden): no expert count a multiple of the GEMV's rows per program, no hidden size of its K step
SHAPES = [(60, 300), (128, 1100)]
ROUTINGS = {
    "qwen": dict(top_k=8, scoring="softmax", renormalize=True, weights_dtype="logits"),
    "mixtral": dict(top_k=2, scoring="softmax", renormalize=True),
    "deepseek-v2 grouped": dict(top_k=6, scoring="softmax", renormalize=False, routed_scaling_factor=16.0, n_group=4,
                                topk_group=2),
}


def _router(rows, n, k, dtype, bias, seed=0):
    """x [rows, k], W [n, k], bias [n] or None."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=gen) * k**-0.5).to(dtype).to(DEVICE)
    return x, w, (torch.randn(n, generator=gen) * 0.1).to(dtype).to(DEVICE) if bias else None


def _routing(name, dtype):
    kw = dict(ROUTINGS[name])
    if kw.get("weights_dtype") == "logits":
        kw["weights_dtype"] = dtype
    return kw


def _record_unfused_routings(monkeypatch) -> list:
    calls = []
    real = mod.moe_topk_triton
    monkeypatch.setattr(mod, "moe_topk_triton", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


@requires_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("routing", ROUTINGS)
def test_one_launch_equals_unfused_kernels(dtype, n, k, routing, monkeypatch):
    if routing == "deepseek-v2 grouped" and n % 4:
        pytest.skip("groups must divide the experts")
    x, w, b = _router(1, n, k, dtype, bias=routing == "mixtral", seed=n)
    kw = _routing(routing, dtype)
    calls = _record_unfused_routings(monkeypatch)
    got = linear_moe_topk_triton(x, w, b, **kw)
    assert calls == []
    expected = moe_topk_triton(gemv_triton(x, w, b), **kw)
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == e.dtype and g.shape == e.shape and torch.equal(g, e), (g, e)
    assert int(split_counters(x.device, 1)[0]) == 0  # the last program reset the counter
    again = linear_moe_topk_triton(x, w, b, **kw)
    assert all(torch.equal(a, g) for a, g in zip(again, got, strict=True))


@requires_triton
@pytest.mark.parametrize(("rows", "scoring"), [(3, "softmax"), (1, "sigmoid")])
def test_other_cases_run_the_unfused_kernels(rows, scoring, monkeypatch):
    """Several rows (not the GEMV's) and sigmoid scoring (its routing kernel runs without FMA) run linear then
    moe_topk: their outputs exactly."""
    n, k = 32, 96
    x, w, _ = _router(rows, n, k, torch.bfloat16, bias=False, seed=rows)
    cb = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(DEVICE) if scoring == "sigmoid" else None
    kw = dict(top_k=4, scoring=scoring, renormalize=True, n_group=4 if cb is not None else 1,
              topk_group=2 if cb is not None else 1, correction_bias=cb)
    calls = _record_unfused_routings(monkeypatch)
    got = linear_moe_topk_triton(x, w, None, **kw)
    assert calls == [1]
    expected = moe_topk_triton(linear_triton(x, w, None), **kw)
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))


@pytest.mark.parametrize("rows", [1, 5])
def test_registered_op_on_cpu_is_the_two_references(rows):
    x, w, b = (t.cpu() if t is not None else None for t in _router(rows, 60, 300, torch.bfloat16, bias=True))
    kw = _routing("qwen", torch.bfloat16)
    expected = moe_topk_reference(linear_reference(x, w, b), **kw)
    for got in (mi.linear_moe_topk(x, w, b, **kw), linear_moe_topk_reference(x, w, b, **kw)):
        assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))


def test_fake_shapes():
    x, w, _ = (t.cpu() if t is not None else None for t in _router(3, 60, 300, torch.bfloat16, bias=False))
    with FakeTensorMode() as m:
        tw, ti = mi.linear_moe_topk(m.from_tensor(x), m.from_tensor(w), None, 8, "softmax", True,
                                    weights_dtype=torch.bfloat16)
    assert tw.shape == ti.shape == (3, 8) and tw.dtype == torch.bfloat16 and ti.dtype == torch.int32
