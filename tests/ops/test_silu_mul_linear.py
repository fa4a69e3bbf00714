"""silu_mul_linear: silu(gate) * up in a one-row GEMV's prologue (one launch, the unfused silu_and_mul then linear /
linear_add's bits, and the plain-torch values), the unfused kernels for several rows and rows the GEMV does not
take; on CPU the registered op runs the reference."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import mini_infer.ops  # noqa: F401  (registers torch.ops.mini_infer.*)
from mini_infer.ops import silu_mul_linear as mod
from mini_infer.ops.linear import GEMV_MAX_K, gemv_triton
from mini_infer.ops.linear_add import linear_add_triton
from mini_infer.ops.silu_and_mul import silu_and_mul_triton
from mini_infer.ops.silu_mul_linear import (
    silu_mul_gemv_config,
    silu_mul_linear_reference,
    silu_mul_linear_triton,
)
from tests.ops.helpers import (  # plain_gemv_waits_first: autouse here (the unfused pair's GEMV waits first)
    DEVICE,
    assert_close,
    plain_gemv_waits_first,  # noqa: F401
    record_gemv_launches,
    requires_triton,
    without_preload,
)

mi = torch.ops.mini_infer
# (N, K): no N a multiple of the rows per program, no K a multiple of the K step; K >= 1024 takes the long tile
SHAPES = [(42, 96), (301, 1000), (130, 1030)]


def _inputs(rows, n, k, dtype, bias, residual, residual_dtype=None, seed=0):
    """gate and up [1, rows, k] as views of one merged gate_up output [1, rows, 2k] (row stride 2k, as the graph
    hands them over), W [n, k], bias [n] or None, residual [1, rows, n] (residual_dtype, default dtype) or None."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0, to=dtype):
        return (torch.randn(shape, generator=gen) * scale).to(to).to(DEVICE)

    gate_up = rand(1, rows, 2 * k, scale=2.0)
    return (gate_up[..., :k], gate_up[..., k:], rand(n, k, scale=k**-0.5), rand(n) if bias else None,
            rand(1, rows, n, scale=2.0, to=residual_dtype or dtype) if residual else None)


def _unfused(gate, up, w, b, r, config=None):
    """silu_and_mul's kernel, then the one-row GEMV (+ linear_add's epilogue kernel), what the fused op replaces, at
    the fused kernel's tile (`config`, None: its default): the same sums in the same order, on a GPU too when
    linear_add's weight preload is off (the `launches` fixture turns it off: its products are not contracted into
    the K loop's FMAs)."""
    act, tile = silu_and_mul_triton(gate, up), config or silu_mul_gemv_config(w.shape[1])
    return gemv_triton(act, w, b, tile) if r is None else linear_add_triton(act, w, b, r, tile)


@pytest.fixture
def launches(monkeypatch):
    """The kernels the op launches through `launch_gemv`, recorded; linear.py's weight preload off, so that the
    unfused linear_add takes the K loop's sums as the fused kernel does (helpers.without_preload)."""
    without_preload(monkeypatch)
    return record_gemv_launches(monkeypatch, mod)


@requires_triton
@pytest.mark.parametrize(("dtype", "residual_dtype"), [(torch.float32, None), (torch.float32, torch.float32),
                                                       (torch.bfloat16, None), (torch.bfloat16, torch.bfloat16),
                                                       (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_one_row_equals_the_unfused_pair(launches, dtype, residual_dtype, n, k, bias):
    """One launch of the prologue kernel, without a residual (residual_dtype None) or with one; the unfused kernels'
    bits (the activation rounded to its dtype before the dot, the linear's output to x's dtype before the add, the
    sum to the promoted dtype); in fp32, torch's values."""
    g, u, w, b, r = _inputs(1, n, k, dtype, bias, residual_dtype is not None, residual_dtype, seed=n + k)
    y = silu_mul_linear_triton(g, u, w, b, r)
    assert launches == [mod._silu_mul_gemv_kernel]
    expected = _unfused(g, u, w, b, r)
    assert y.dtype == expected.dtype and torch.equal(y, expected)
    if dtype == torch.float32:  # (in bf16 the unfused kernels' values are their own tests' business)
        assert_close(y, silu_mul_linear_reference(g, u, w, b, r))


@requires_triton
@pytest.mark.parametrize("config", [(1, 64, 1, 1), (16, 256, 4, 2)])
def test_tile_override(launches, config):
    """A caller's tile (the GPU sweep's): same launch, the unfused pair's bits at that tile."""
    g, u, w, b, r = _inputs(1, 70, 300, torch.float32, True, True, seed=5)
    y = silu_mul_linear_triton(g, u, w, b, r, config=config)
    assert launches == [mod._silu_mul_gemv_kernel]
    assert torch.equal(y, _unfused(g, u, w, b, r, config))


@requires_triton
@pytest.mark.parametrize("how", ["interleaved", "flat"])
def test_one_row_other_layouts(launches, how):
    """gate / up with a last-dim stride of 2 (interleaved halves: copied to unit stride) and flat [1, K] rows."""
    k, n = 96, 40
    g, u, w, b, r = _inputs(1, n, k, torch.float32, True, True, seed=9)
    if how == "interleaved":
        gate_up = torch.stack((g, u), dim=-1).flatten(-2)  # [1, 1, 2k]: g0 u0 g1 u1 ...
        g, u = gate_up[..., 0::2], gate_up[..., 1::2]
        assert g.stride(-1) == 2
    else:
        g, u, r = g.reshape(1, k), u.reshape(1, k), r.reshape(1, n)
    y = silu_mul_linear_triton(g, u, w, b, r)
    assert launches == [mod._silu_mul_gemv_kernel] and y.shape == r.shape
    assert torch.equal(y, _unfused(g.contiguous(), u.contiguous(), w, b, r))


@requires_triton
@pytest.mark.parametrize("case", ["rows", "long_k", "mixed_dtypes", "broadcast_residual"])
def test_other_shapes_run_the_unfused_kernels(launches, case):
    """Several rows (prefill), a row longer than the GEMV takes, gate and up of two dtypes, a residual that
    broadcasts ([n]): no prologue kernel; silu_and_mul's kernel then the linear's (and torch's add)."""
    rows, k = (3, 96) if case == "rows" else (1, GEMV_MAX_K + 1) if case == "long_k" else (1, 96)
    g, u, w, b, r = _inputs(rows, 24, k, torch.float32, True, True)
    if case == "mixed_dtypes":
        u = u.to(torch.bfloat16)
    if case == "broadcast_residual":
        r = r[0, 0]
    y = silu_mul_linear_triton(g, u, w, b, r)
    assert launches == []
    assert_close(y, silu_mul_linear_reference(g, u, w, b, r))
    if case == "rows":
        assert_close(silu_mul_linear_triton(g, u, w, b, None), silu_mul_linear_reference(g, u, w, b, None))


@pytest.mark.parametrize("residual", [False, True])
def test_registered_op_runs_the_reference_on_cpu(residual):
    g, u, w, b, r = (None if t is None else t.cpu() for t in _inputs(5, 12, 32, torch.float32, True, residual))
    y = torch.nn.functional.linear(torch.nn.functional.silu(g) * u, w, b)
    assert torch.equal(mi.silu_mul_linear(g, u, w, b, r), y if r is None else y + r)


def test_fake_impl_and_opcheck():
    with FakeTensorMode():
        g = torch.empty(1, 7, 64, dtype=torch.bfloat16)
        w = torch.empty(96, 64, dtype=torch.bfloat16)
        y = mi.silu_mul_linear(g, g, w, None, None)
        s = mi.silu_mul_linear(g, g, w, None, torch.empty(1, 7, 96, dtype=torch.float32))
    assert y.shape == s.shape == (1, 7, 96) and y.dtype == torch.bfloat16 and s.dtype == torch.float32  # add promotes
    for residual in (False, True):
        g, u, w, b, r = (None if t is None else t.cpu() for t in _inputs(3, 12, 16, torch.float32, True, residual))
        torch.library.opcheck(mi.silu_mul_linear.default, (g, u, w, b, r))
