"""rms_norm_linear / fused_add_rms_norm_linear: the norm folded into the GEMV's prologue for one row, the unfused
ops' kernels otherwise; both equal linear(rms_norm(...)) and return the residual sum unchanged."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import mini_infer.ops  # noqa: F401  (registers torch.ops.mini_infer.*)
from mini_infer.ops import rms_norm_linear as mod
from mini_infer.ops.fused_add_rms_norm import fused_add_rms_norm_triton
from mini_infer.ops.linear import GEMV_MAX_K, gemv_triton
from mini_infer.ops.rms_norm import rms_norm_triton
from mini_infer.ops.rms_norm_linear import (
    fused_add_rms_norm_linear_reference,
    fused_add_rms_norm_linear_triton,
    rms_norm_linear_reference,
    rms_norm_linear_triton,
)
from tests.ops.helpers import DEVICE, assert_close, requires_triton

mi = torch.ops.mini_infer
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
EPS = 1e-6


def _inputs(rows, n, k, dtype, bias, seed=0):
    """x, residual [1, rows, k]; norm weight [k]; W [n, k]; bias [n] or None (the packed [1, T, K] layout)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(shape, generator=gen) * scale).to(dtype).to(DEVICE)

    nw = (torch.rand(k, generator=gen) + 0.5).to(dtype).to(DEVICE)
    return rand(1, rows, k, scale=3.0), rand(1, rows, k), nw, rand(n, k, scale=k**-0.5), rand(n) if bias else None


def _run(residual, x, r, nw, w, b, impl):
    """Both ops through one door: `impl` "triton" or "reference"; (y, sum or None)."""
    if residual:
        f = fused_add_rms_norm_linear_triton if impl == "triton" else fused_add_rms_norm_linear_reference
        return f(x, r, nw, EPS, w, b)
    f = rms_norm_linear_triton if impl == "triton" else rms_norm_linear_reference
    return f(x, nw, EPS, w, b), None


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "n", "k"), [(1, 40, 96), (1, 33, 1000), (1, 130, 520), (3, 24, 64)])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_triton_matches_reference(dtype, rows, n, k, residual, bias):
    x, r, nw, w, b = _inputs(rows, n, k, dtype, bias, seed=n + k)
    y, s = _run(residual, x, r, nw, w, b, "triton")
    y_ref, s_ref = _run(residual, x, r, nw, w, b, "reference")
    assert y.shape == (1, rows, n)
    assert_close(y, y_ref)
    if residual:
        assert_close(s, s_ref)


# a few units in the last place of each dtype: the fp32 scale may differ in its last bit from rms_norm's
ULPS = {torch.float32: 2.0**-20, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("k", [96, 1000, 4096])
def test_single_row_equals_the_unfused_kernels(dtype, residual, k):
    """The one-kernel path rounds where rms_norm does, so it computes what the two kernels compute. Only the row's
    sum of squares is added up in another order, so the fp32 scale may differ in its last bit: in a 16-bit dtype
    the rounded normalized values hide that (bit for bit under the interpreter), in fp32 a few ulps remain."""
    x, r, nw, w, b = _inputs(1, 50, k, dtype, bias=True, seed=k)
    y, s = _run(residual, x, r, nw, w, b, "triton")
    normed, s_ref = fused_add_rms_norm_triton(x, r, nw, EPS) if residual else (rms_norm_triton(x, nw, EPS), None)
    y_ref = gemv_triton(normed, w, b)
    if DEVICE == "cpu" and dtype != torch.float32:
        assert torch.equal(y, y_ref)
    else:
        torch.testing.assert_close(y, y_ref, rtol=ULPS[dtype], atol=ULPS[dtype])
    if residual:
        assert torch.equal(s, s_ref)


@requires_triton
def test_dispatch_by_shape(monkeypatch):
    """One row with K <= GEMV_MAX_K: the one kernel; several rows or longer rows: the unfused kernels. A norm whose
    output dtype is not the weight's (fp32 norm weight, bf16 linear) does not take it either: the linear refuses
    mixed dtypes, as F.linear does."""
    calls = []
    real = mod._launch_rms_norm_gemv
    monkeypatch.setattr(mod, "_launch_rms_norm_gemv", lambda *a: calls.append(1) or real(*a))
    for rows, k, fused in [(1, 64, True), (4, 64, False), (1, GEMV_MAX_K + 1, False)]:
        for residual in (False, True):
            x, r, nw, w, b = _inputs(rows, 8, k, torch.bfloat16, bias=True)
            calls.clear()
            y, s = _run(residual, x, r, nw, w, b, "triton")
            y_ref, s_ref = _run(residual, x, r, nw, w, b, "reference")
            assert_close(y, y_ref)
            assert calls == ([1] if fused else []), (rows, k, residual)
    x, r, nw, w, b = _inputs(1, 8, 64, torch.bfloat16, bias=False)
    calls.clear()
    for residual in (False, True):
        with pytest.raises(RuntimeError):
            _run(residual, x, r, nw.float(), w, b, "triton")
    assert calls == []


def test_registered_ops_run_the_reference_on_cpu():
    x, r, nw, w, b = (t.cpu() for t in _inputs(5, 12, 32, torch.float32, bias=True))
    assert torch.equal(mi.rms_norm_linear(x, nw, EPS, w, b), rms_norm_linear_reference(x, nw, EPS, w, b))
    y, s = mi.fused_add_rms_norm_linear(x, r, nw, EPS, w, None)
    y_ref, s_ref = fused_add_rms_norm_linear_reference(x, r, nw, EPS, w, None)
    assert torch.equal(y, y_ref) and torch.equal(s, s_ref)


def test_fake_impls():
    with FakeTensorMode():
        x = torch.empty(1, 7, 64, dtype=torch.bfloat16)
        nw, w = torch.empty(64, dtype=torch.bfloat16), torch.empty(96, 64, dtype=torch.bfloat16)
        y = mi.rms_norm_linear(x, nw, EPS, w, None)
        y2, s = mi.fused_add_rms_norm_linear(x, torch.empty(1, 7, 64, dtype=torch.float32), nw, EPS, w, None)
    assert y.shape == (1, 7, 96) and y.dtype == torch.bfloat16
    assert y2.shape == (1, 7, 96) and y2.dtype == torch.float32  # the sum promotes, and the norm with it
    assert s.shape == (1, 7, 64) and s.dtype == torch.float32


def test_opcheck():
    x, r, nw, w, b = (t.cpu() for t in _inputs(3, 8, 16, torch.float32, bias=True))
    torch.library.opcheck(mi.rms_norm_linear.default, (x, nw, EPS, w, b))
    torch.library.opcheck(mi.fused_add_rms_norm_linear.default, (x, r, nw, EPS, w, None))
