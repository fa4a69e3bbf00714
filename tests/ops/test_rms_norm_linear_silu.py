"""rms_norm_linear_silu / linear_silu: silu(gate) * up in the epilogue of the merged gate_up GEMV (one launch, the
unfused producer then silu_and_mul's bits, and the plain-torch values), the unfused kernels for several rows and
mixed dtypes; on CPU the registered ops run the reference."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import mini_infer.ops  # noqa: F401  (registers torch.ops.mini_infer.*)
from mini_infer.ops import rms_norm_linear_silu as mod
from mini_infer.ops.linear import linear_triton
from mini_infer.ops.rms_norm_linear import rms_norm_linear_triton
from mini_infer.ops.rms_norm_linear_silu import (
    linear_silu_reference,
    linear_silu_triton,
    rms_norm_linear_silu_reference,
    rms_norm_linear_silu_triton,
)
from mini_infer.ops.silu_and_mul import silu_and_mul_triton
from tests.ops.helpers import (  # plain_gemv_waits_first: autouse here (the unfused pair's GEMV waits first)
    DEVICE,
    assert_close,
    plain_gemv_waits_first,  # noqa: F401
    record_gemv_launches,
    requires_triton,
)

mi = torch.ops.mini_infer
EPS = 1e-6
# (I, K): odd I (no multiple of the rows per program), odd K (no multiple of the K step); K >= 1024 gives the plain
# GEMV its long tile
SHAPES = [(21, 97), (75, 1030)]


def _inputs(rows, half, k, dtype, bias, nw_dtype=None, seed=0):
    """x [1, rows, k], the norm weight [k] (nw_dtype, default dtype), the merged gate_up weight [2 * half, k] and
    bias [2 * half] or None."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0, shift=0.0, to=dtype):
        return (torch.randn(shape, generator=gen) * scale + shift).to(to).to(DEVICE)

    return (rand(1, rows, k, scale=2.0), rand(k, scale=0.1, shift=1.0, to=nw_dtype or dtype),
            rand(2 * half, k, scale=2 * k**-0.5), rand(2 * half) if bias else None)


def _fused(norm, x, nw, w, b, config=None):
    return rms_norm_linear_silu_triton(x, nw, EPS, w, b, config) if norm else linear_silu_triton(x, w, b, config)


def _unfused(norm, x, nw, w, b):
    """The producer's kernel (rms_norm_linear's one-pass GEMV, or linear's), then silu_and_mul's on its halves: what
    the fused op replaces."""
    gate_up = rms_norm_linear_triton(x, nw, EPS, w, b) if norm else linear_triton(x, w, b)
    return silu_and_mul_triton(*gate_up.split(w.shape[0] // 2, -1))


def _reference(norm, x, nw, w, b):
    return rms_norm_linear_silu_reference(x, nw, EPS, w, b) if norm else linear_silu_reference(x, w, b)


@pytest.fixture
def launches(monkeypatch):
    """The kernels the op launches through `launch_gemv`, recorded."""
    return record_gemv_launches(monkeypatch, mod)


@requires_triton
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("half", "k"), SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_one_row_equals_the_unfused_pair(launches, norm, dtype, half, k, bias):
    """One launch of the epilogue kernel; the unfused kernels' bits (each half rounded as the producer stores it,
    then silu_and_mul's math and rounding); in fp32, torch's values."""
    x, nw, w, b = _inputs(1, half, k, dtype, bias, seed=half + k)
    y = _fused(norm, x, nw, w, b)
    assert launches == [mod._gate_up_silu_kernel]
    expected = _unfused(norm, x, nw, w, b)
    assert y.shape == (1, 1, half) and y.dtype == expected.dtype == dtype and torch.equal(y, expected)
    if dtype == torch.float32:  # (bf16: the one-pass norm is not bit-equal to rms_norm; rms_norm_linear's tests)
        assert_close(y, _reference(norm, x, nw, w, b))


@requires_triton
@pytest.mark.parametrize(("config", "bitwise"), [((1, 512, 1, 1), True), ((8, 64, 4, 2), False)])
def test_tile_override(launches, config, bitwise):
    """A caller's tile (the GPU sweep's): same launch; at the producer's K step (512) its bits, at another one its
    values to fp32 rounding."""
    x, nw, w, b = _inputs(1, 70, 300, torch.float32, True, seed=5)
    y = _fused(True, x, nw, w, b, config)
    assert launches == [mod._gate_up_silu_kernel]
    if bitwise and not x.is_cuda:  # on a GPU the sums' order follows the tile's register layout
        assert torch.equal(y, _unfused(True, x, nw, w, b))
    assert_close(y, _reference(True, x, nw, w, b))


@requires_triton
def test_tile_switch_keeps_the_producers_tile(launches, monkeypatch):
    """rms_norm_linear's NORM_GEMV_ROWS / NORM_GEMV_STEP move the epilogue kernel's tile with the producer's, so it
    keeps the unfused pair's bits."""
    from mini_infer.ops import rms_norm_linear

    monkeypatch.setattr(rms_norm_linear, "NORM_GEMV_ROWS", 8)
    monkeypatch.setattr(rms_norm_linear, "NORM_GEMV_STEP", 256)
    assert mod.gate_up_silu_config(600, 96, True) == (8, 256, 4, 1)
    x, nw, w, b = _inputs(1, 48, 600, torch.float32, True, seed=9)
    y = _fused(True, x, nw, w, b)
    assert launches == [mod._gate_up_silu_kernel]
    if not x.is_cuda:  # on a GPU the sums' order follows the tile's register layout
        assert torch.equal(y, _unfused(True, x, nw, w, b))
    assert_close(y, _reference(True, x, nw, w, b))


@requires_triton
@pytest.mark.parametrize("norm", [True, False])
def test_wide_halves_run_the_unfused_kernels(launches, monkeypatch, norm):
    """A gate_up wider than GATE_UP_SILU_MAX_I outputs per half (where the one kernel lost on an H200): the
    producer's kernel then silu_and_mul's, their bits."""
    monkeypatch.setattr(mod, "GATE_UP_SILU_MAX_I", 16)
    x, nw, w, b = _inputs(1, 17, 96, torch.bfloat16, True)
    y = _fused(norm, x, nw, w, b)
    assert mod._gate_up_silu_kernel not in launches
    assert torch.equal(y, _unfused(norm, x, nw, w, b))


@requires_triton
@pytest.mark.parametrize("norm", [True, False])
def test_several_rows_run_the_unfused_kernels(launches, norm):
    """Several rows (prefill, batches): no epilogue kernel; the producer's kernel then silu_and_mul's."""
    x, nw, w, b = _inputs(3, 24, 96, torch.bfloat16, True)
    y = _fused(norm, x, nw, w, b)
    assert launches == []
    assert y.shape == (1, 3, 24) and torch.equal(y, _unfused(norm, x, nw, w, b))


@requires_triton
def test_norm_output_dtype_promotes(launches):
    """A bf16 row with an fp32 norm weight and fp32 gate_up weight (the norm's output is fp32, the weight's dtype):
    the epilogue kernel, fp32 out, the unfused kernels' bits."""
    x, nw, w, b = _inputs(1, 24, 96, torch.float32, True)
    x = x.to(torch.bfloat16)
    y = _fused(True, x, nw, w, b)
    assert launches == [mod._gate_up_silu_kernel]
    assert y.dtype == torch.float32 and torch.equal(y, _unfused(True, x, nw, w, b))


@requires_triton
def test_odd_width_is_refused():
    x, nw, w, b = _inputs(1, 8, 32, torch.float32, False)
    for rows in (1, 2):
        with pytest.raises(ValueError, match="even width"):
            rms_norm_linear_silu_triton(x.expand(1, rows, 32), nw, EPS, w[:15], None)


@pytest.mark.parametrize("norm", [True, False])
def test_registered_op_runs_the_reference_on_cpu(norm):
    x, nw, w, b = (t.cpu() for t in _inputs(5, 12, 32, torch.float32, True))
    gate_up = torch.nn.functional.linear(mi.rms_norm(x, nw, EPS) if norm else x, w, b)
    expected = torch.nn.functional.silu(gate_up[..., :12]) * gate_up[..., 12:]
    y = mi.rms_norm_linear_silu(x, nw, EPS, w, b) if norm else mi.linear_silu(x, w, b)
    assert torch.equal(y, expected)


def test_fake_impl_and_opcheck():
    with FakeTensorMode():
        x = torch.empty(1, 7, 64, dtype=torch.bfloat16)
        w = torch.empty(96, 64, dtype=torch.bfloat16)
        y = mi.rms_norm_linear_silu(x, torch.empty(64, dtype=torch.bfloat16), EPS, w, None)
        z = mi.rms_norm_linear_silu(x, torch.empty(64, dtype=torch.float32), EPS, w, None)
        v = mi.linear_silu(x, w, None)
    assert y.shape == z.shape == v.shape == (1, 7, 48)
    assert y.dtype == v.dtype == torch.bfloat16 and z.dtype == torch.float32  # the norm's output dtype promotes
    x, nw, w, b = (t.cpu() for t in _inputs(3, 8, 16, torch.float32, True))
    torch.library.opcheck(mi.rms_norm_linear_silu.default, (x, nw, EPS, w, b))
    torch.library.opcheck(mi.linear_silu.default, (x, w, b))
