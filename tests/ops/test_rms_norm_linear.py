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


def _exact(s, nw, w, b):
    """`inv_rms * (W @ (s * nw)) + b` in float64 from the norm's input s (x, or the stored residual sum): the value
    the one-pass kernel approximates, with no rounding of the normalized row; and the sum of |terms| per output."""
    s = s.double()
    inv = torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS)
    y = inv * (s * nw.double()) @ w.double().T
    scale = inv * (s * nw.double()).abs() @ w.double().abs().T  # the size of the terms summed, for the fp32 bound
    return (y + b.double() if b is not None else y), (scale + b.double().abs() if b is not None else scale)


# The tolerance, derived: the kernel's only rounding to the model dtype is y's, at most one ulp (finfo.eps
# relative; a GPU rounds to nearest, half of that; the Triton interpreter truncates, a whole one). Before it, fp32
# products and sums: one product rounding plus at most K / BLOCK_K (8 for K = 4096) sequential chunk adds and
# log2(BLOCK_K) = 9 tree levels, under 2**5 fp32 roundings of 2**-24 each, relative to the sum of |terms| (and the
# scale's rsqrt a few ulps more): 2**-18 of that bounds them.
FP32_SUMS = 2.0**-18


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("k", [96, 1000, 4096])
def test_single_row_is_the_unrounded_norm_times_the_weights(dtype, residual, k):
    """One pass: y = inv_rms * (W @ (s * nw)) + b with only y rounded to the model dtype (the normalized row is
    never rounded, unlike rms_norm's), within the tolerance derived above of the float64 value; the residual sum
    is the unfused op's, bit for bit."""
    x, r, nw, w, b = _inputs(1, 50, k, dtype, bias=True, seed=k)
    y, s = _run(residual, x, r, nw, w, b, "triton")
    exact, scale = _exact(s if residual else x, nw, w, b)
    err = (y.double() - exact).abs()
    bound = torch.finfo(dtype).eps * exact.abs() + FP32_SUMS * scale
    assert (err <= bound).all(), (err / bound).max().item()
    if residual:
        assert torch.equal(s, fused_add_rms_norm_triton(x, r, nw, EPS)[1])


@requires_triton
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize(("rows", "step"), [(8, 512), (8, 256), (2, 1024)])
def test_tile_switch(monkeypatch, residual, rows, step):
    """NORM_GEMV_ROWS / NORM_GEMV_STEP (the A/B switches) set the kernel's tile; any of them stays within the same
    bound of the exact value."""
    monkeypatch.setattr(mod, "NORM_GEMV_ROWS", rows)
    monkeypatch.setattr(mod, "NORM_GEMV_STEP", step)
    assert mod.norm_gemv_config() == (rows, step, 4, 1)
    x, r, nw, w, b = _inputs(1, 50, 2000, torch.bfloat16, bias=True, seed=3)
    y, s = _run(residual, x, r, nw, w, b, "triton")
    exact, scale = _exact(s if residual else x, nw, w, b)
    bound = torch.finfo(torch.bfloat16).eps * exact.abs() + FP32_SUMS * scale
    assert ((y.double() - exact).abs() <= bound).all()


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_single_row_against_the_unfused_kernels(dtype):
    """Against rms_norm then the GEMV (HF's roundings of the normalized row): in fp32 they agree to fp32 rounding;
    in bf16 the unfused pair's two roundings of each normalized value (one ulp each at most) add to the difference,
    so they agree to the derived bound plus 2 ulps of the sum of |terms|."""
    x, r, nw, w, b = _inputs(1, 64, 1000, dtype, bias=True, seed=5)
    for residual in (False, True):
        y, s = _run(residual, x, r, nw, w, b, "triton")
        normed = fused_add_rms_norm_triton(x, r, nw, EPS)[0] if residual else rms_norm_triton(x, nw, EPS)
        y_unfused = gemv_triton(normed, w, b)
        exact, scale = _exact(s if residual else x, nw, w, b)
        eps = torch.finfo(dtype).eps
        bound = eps * (exact.abs() + y_unfused.double().abs()) + (FP32_SUMS + (2 * eps if dtype != torch.float32
                                                                               else 0)) * scale
        assert ((y.double() - y_unfused.double()).abs() <= bound).all()


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
