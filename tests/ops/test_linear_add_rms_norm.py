"""linear_add_rms_norm / scaled_linear_add_rms_norm_quant: the add + norm (+ quantization) after a one-row GEMV in the
GEMV's launch. Under the interpreter the fused launch gives the unfused kernels' bits (the GEMV's output is the GEMV
kernel's, the norm runs on the norm kernel's tile); repeated calls leave the shared counter zero; several rows run
the unfused kernels; on CPU the registered ops run the references."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import mini_infer.ops  # noqa: F401  (registers torch.ops.mini_infer.*)
from mini_infer.ops import linear_add_rms_norm as mod
from mini_infer.ops._split_k import split_counters
from mini_infer.ops.fp8_linear import fp8_linear_triton
from mini_infer.ops.fused_add_rms_norm import fused_add_rms_norm_triton
from mini_infer.ops.int8_linear import int8_linear_triton
from mini_infer.ops.linear import GEMV_MAX_K, gemv_triton
from mini_infer.ops.linear_add_rms_norm import (
    linear_add_rms_norm_reference,
    linear_add_rms_norm_triton,
    scaled_linear_add_rms_norm_quant_reference,
    scaled_linear_add_rms_norm_quant_triton,
)
from mini_infer.ops.quant import fused_add_rms_norm_quant_triton
from tests.ops.helpers import (
    DEVICE,
    assert_close,
    assert_loop_sums,
    preloaded_and_looped,
    requires_triton,
    without_preload,
)

mi = torch.ops.mini_infer
FP8 = torch.float8_e4m3fn
EPS = 1e-6
# (N, K): no N a multiple of the GEMV's 4 rows per program or of a power of two, no K a multiple of its K step
SHAPES = [(42, 96), (130, 1000), (301, 520)]


def _inputs(rows, n, k, dtype, bias, seed=0):
    """x [1, rows, k], W [n, k], bias [n] or None, residual [1, rows, n], norm weight [n]."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(shape, generator=gen) * scale).to(dtype).to(DEVICE)

    nw = (torch.rand(n, generator=gen) + 0.5).to(dtype).to(DEVICE)
    return rand(1, rows, k), rand(n, k, scale=k**-0.5), rand(n) if bias else None, rand(1, rows, n, scale=2.0), nw


def _quantized(rows, n, k, operand, bias, seed=0):
    """x_q [1, rows, k] and its scales, W_q [n, k] and its scales (random operands of `operand`), bias, residual,
    norm weight (bf16)."""
    gen = torch.Generator().manual_seed(seed)
    if operand == torch.int8:
        x_q = torch.randint(-127, 128, (1, rows, k), generator=gen, dtype=torch.int8)
        w_q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    else:
        x_q = (torch.randn(1, rows, k, generator=gen) * 100).clamp(-448, 448).to(FP8)
        w_q = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(FP8)
    x_scale = torch.rand(1, rows, 1, generator=gen) * 0.01 + 0.001
    w_scale = torch.rand(n, generator=gen) * 0.01 / k**0.5 + 0.0001
    b = torch.randn(n, generator=gen).to(torch.bfloat16) if bias else None
    r = torch.randn(1, rows, n, generator=gen).to(torch.bfloat16)
    nw = (torch.rand(n, generator=gen) + 0.5).to(torch.bfloat16)
    return tuple(t.to(DEVICE) if t is not None else None for t in (x_q, x_scale, w_q, w_scale, b, r, nw))


@pytest.fixture
def fused_launches(monkeypatch):
    """The fused kernels' launches, recorded (by kernel) as the ops make them."""
    calls = []
    for name in ("launch_gemv", "launch_scaled_gemv"):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda kernel, *a, _real=real, **kw: calls.append(kernel) or _real(kernel, *a,
                                                                                                       **kw))
    return calls


def _counter_is_zero() -> bool:
    return split_counters(torch.device(DEVICE), 1)[0].item() == 0


@requires_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_one_row_equals_the_unfused_kernels(monkeypatch, fused_launches, dtype, n, k, bias):
    """One launch, and the bits of gemv_triton then fused_add_rms_norm_triton (within a few ulps on a GPU, where the
    norm's fp32 sum may be ordered differently; bitwise under the interpreter); the counter is zero after it. The K
    loop both ways (the preload's sums: test_preloaded_rows_equal_the_k_loop)."""
    without_preload(monkeypatch)
    x, w, b, r, nw = _inputs(1, n, k, dtype, bias, seed=n + k)
    out, s = linear_add_rms_norm_triton(x, w, b, r, nw, EPS)
    assert fused_launches == [mod._gemv_add_rms_norm_kernel]
    out_ref, s_ref = fused_add_rms_norm_triton(gemv_triton(x, w, b), r, nw, EPS)
    assert out.shape == s.shape == (1, 1, n) and out.dtype == out_ref.dtype and s.dtype == s_ref.dtype
    assert torch.equal(s, s_ref)
    if DEVICE == "cpu":
        assert torch.equal(out, out_ref)
    else:
        assert_close(out, out_ref)
    assert _counter_is_zero()


@requires_triton
@pytest.mark.parametrize(("k", "width"), [(96, 512), (1500, 2048), (4000, 4096)])  # one, two and four K chunks
def test_preloaded_rows_equal_the_k_loop(monkeypatch, k, width):
    """The GEMV part with its rows loaded whole before the PDL wait (linear.py's `PRELOAD_MAX_K`): the K loop's bits,
    so the norm after it too; the counter is zero after both."""
    x, w, b, r, nw = _inputs(1, 26, k, torch.float32, bias=True, seed=k)
    on, off, widths = preloaded_and_looped(monkeypatch, lambda: linear_add_rms_norm_triton(x, w, b, r, nw, EPS))
    assert widths == [width, 0]
    assert_loop_sums(on[0], off[0])
    assert_loop_sums(on[1], off[1])
    assert _counter_is_zero()


@requires_triton
def test_repeated_calls_leave_the_counter_zero():
    """Calls of different widths one after another (as the layers of a decode step run them) each find the counter
    zero and leave it so: every call gives the same results as the first call of its shape."""
    first = {}
    for i in range(3):
        for n, k in SHAPES[:2]:
            x, w, b, r, nw = _inputs(1, n, k, torch.bfloat16, True, seed=n)
            out, s = linear_add_rms_norm_triton(x, w, b, r, nw, EPS)
            assert _counter_is_zero()
            if i == 0:
                first[n] = (out, s)
            assert torch.equal(out, first[n][0]) and torch.equal(s, first[n][1])


@requires_triton
@pytest.mark.parametrize(("rows", "k"), [(3, 96), (1, GEMV_MAX_K + 1)])
def test_other_shapes_run_the_unfused_kernels(fused_launches, rows, k):
    """Several rows (prefill) or a row the GEMV does not take (K > GEMV_MAX_K): linear then fused_add_rms_norm."""
    x, w, b, r, nw = _inputs(rows, 24, k, torch.float32, True)
    out, s = linear_add_rms_norm_triton(x, w, b, r, nw, EPS)
    out_ref, s_ref = linear_add_rms_norm_reference(x, w, b, r, nw, EPS)
    assert fused_launches == []
    assert_close(out, out_ref)
    assert_close(s, s_ref)


@requires_triton
@pytest.mark.parametrize("operand", [torch.int8, FP8])
@pytest.mark.parametrize("qdtype", [torch.int8, FP8])
@pytest.mark.parametrize(("n", "k"), SHAPES[:2])
def test_quantized_one_row_equals_the_unfused_kernels(fused_launches, operand, qdtype, n, k):
    """The W8A8 / FP8 variant: one launch, and the bits of int8_linear / fp8_linear then fused_add_rms_norm_quant
    (q compared as bytes, the scale and the residual sum exactly)."""
    x_q, x_scale, w_q, w_scale, b, r, nw = _quantized(1, n, k, operand, bias=True, seed=n + k)
    q, scale, s = scaled_linear_add_rms_norm_quant_triton(x_q, x_scale, w_q, w_scale, b, torch.bfloat16, r, nw, EPS,
                                                          qdtype)
    assert fused_launches == [mod._scaled_gemv_add_rms_norm_quant_kernel]
    linear = int8_linear_triton if operand == torch.int8 else fp8_linear_triton
    q_ref, scale_ref, s_ref = fused_add_rms_norm_quant_triton(linear(x_q, x_scale, w_q, w_scale, b, torch.bfloat16),
                                                              r, nw, EPS, qdtype)
    assert q.dtype == qdtype and q.shape == (1, 1, n) and scale.shape == (1, 1, 1)
    assert torch.equal(q.cpu().view(torch.uint8), q_ref.cpu().view(torch.uint8))
    assert torch.equal(scale, scale_ref) and torch.equal(s, s_ref)
    assert _counter_is_zero()


@requires_triton
def test_fp8_dot_gemv_one_row_equals_the_unfused_kernels(fused_launches, monkeypatch):
    """With the fp8 GEMV on tensor cores (int8_linear.FP8_GEMV "dot"), the fused kernel is launched on the DOT path
    as fp8_linear's GEMV is: one launch, the same bits as fp8_linear then fused_add_rms_norm_quant. (That the fused
    kernel's body then uses tensor cores is test_fp8_linear's sm_90 compile check: the interpreter's sums may give
    the same bits either way.)"""
    from mini_infer.ops import int8_linear as il

    monkeypatch.setattr(il, "FP8_GEMV", "dot")
    dots = []
    real = il.launch_gemv
    monkeypatch.setattr(il, "launch_gemv", lambda *a, **kw: dots.append(kw["DOT"]) or real(*a, **kw))
    n, k = SHAPES[1]
    x_q, x_scale, w_q, w_scale, b, r, nw = _quantized(1, n, k, FP8, bias=True, seed=n)
    q, scale, s = scaled_linear_add_rms_norm_quant_triton(x_q, x_scale, w_q, w_scale, b, torch.bfloat16, r, nw, EPS, FP8)
    assert fused_launches == [mod._scaled_gemv_add_rms_norm_quant_kernel]
    q_ref, scale_ref, s_ref = fused_add_rms_norm_quant_triton(fp8_linear_triton(x_q, x_scale, w_q, w_scale, b,
                                                                                torch.bfloat16), r, nw, EPS, FP8)
    assert dots == [True, True]
    assert torch.equal(q.cpu().view(torch.uint8), q_ref.cpu().view(torch.uint8))
    assert torch.equal(scale, scale_ref) and torch.equal(s, s_ref)


@requires_triton
@pytest.mark.parametrize("split", [2, 3])
def test_split_tensor_core_gemv_one_row_equals_the_unfused_kernels(fused_launches, monkeypatch, split):
    """The fp8 GEMV on tensor cores with K cut into splits (int8_linear's FP8_GEMV "dot", a 5-element tile): only each
    row block's last split stores and is counted for the norm, so the fused kernel still gives the bits of the same
    GEMV then fused_add_rms_norm_quant; every counter is zero after it."""
    from mini_infer.ops import int8_linear as il

    monkeypatch.setattr(il, "FP8_GEMV", "dot")
    tile = (32, 64, 4, 2, split)
    monkeypatch.setattr(il, "SCALED_GEMV_CONFIG_FP8_DOT", tile)
    n, k = SHAPES[1]
    x_q, x_scale, w_q, w_scale, b, r, nw = _quantized(1, n, k, FP8, bias=True, seed=n + split)
    q_ref, scale_ref, s_ref = fused_add_rms_norm_quant_triton(fp8_linear_triton(x_q, x_scale, w_q, w_scale, b,
                                                                                torch.bfloat16), r, nw, EPS, FP8)
    fused_launches.clear()
    q, scale, s = scaled_linear_add_rms_norm_quant_triton(x_q, x_scale, w_q, w_scale, b, torch.bfloat16, r, nw, EPS, FP8)
    assert fused_launches == [mod._scaled_gemv_add_rms_norm_quant_kernel]
    assert torch.equal(q.cpu().view(torch.uint8), q_ref.cpu().view(torch.uint8))
    assert torch.equal(scale, scale_ref) and torch.equal(s, s_ref)
    assert not split_counters(torch.device(DEVICE), 1 + -(-n // tile[0])).any()


@requires_triton
def test_quantized_rows_run_the_unfused_kernels(fused_launches):
    x_q, x_scale, w_q, w_scale, b, r, nw = _quantized(3, 20, 64, torch.int8, bias=False)
    got = scaled_linear_add_rms_norm_quant_triton(x_q, x_scale, w_q, w_scale, b, torch.bfloat16, r, nw, EPS, torch.int8)
    ref = scaled_linear_add_rms_norm_quant_reference(x_q, x_scale, w_q, w_scale, b, torch.bfloat16, r, nw, EPS,
                                                     torch.int8)
    assert fused_launches == []
    assert (got[0].int() - ref[0].int()).abs().max() <= 1  # bf16 linear outputs may round differently (GEMM tile)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-2, atol=0)


def test_registered_ops_run_the_reference_on_cpu():
    x, w, b, r, nw = (t.cpu() for t in _inputs(5, 12, 32, torch.float32, bias=True))
    for got, ref in zip(mi.linear_add_rms_norm(x, w, b, r, nw, EPS), linear_add_rms_norm_reference(x, w, b, r, nw, EPS)):
        assert torch.equal(got, ref)
    args = tuple(t.cpu() if t is not None else None for t in _quantized(2, 12, 32, torch.int8, bias=True))
    x_q, x_scale, w_q, w_scale, b, r, nw = args
    got = mi.scaled_linear_add_rms_norm_quant(x_q, x_scale, w_q, w_scale, b, torch.bfloat16, r, nw, EPS, torch.int8)
    ref = scaled_linear_add_rms_norm_quant_reference(x_q, x_scale, w_q, w_scale, b, torch.bfloat16, r, nw, EPS,
                                                     torch.int8)
    assert all(torch.equal(g, e) for g, e in zip(got, ref))


def test_fake_impls():
    with FakeTensorMode():
        x, w = torch.empty(1, 7, 64, dtype=torch.bfloat16), torch.empty(96, 64, dtype=torch.bfloat16)
        r, nw = torch.empty(1, 7, 96, dtype=torch.bfloat16), torch.empty(96, dtype=torch.float32)
        out, s = mi.linear_add_rms_norm(x, w, None, r, nw, EPS)
        assert out.shape == s.shape == (1, 7, 96) and out.dtype == torch.float32 and s.dtype == torch.bfloat16
        x_q, x_scale = torch.empty(1, 7, 64, dtype=torch.int8), torch.empty(1, 7, 1, dtype=torch.float32)
        w_q, w_scale = torch.empty(96, 64, dtype=torch.int8), torch.empty(96, dtype=torch.float32)
        q, scale, s = mi.scaled_linear_add_rms_norm_quant(x_q, x_scale, w_q, w_scale, None, torch.bfloat16, r,
                                                          nw.bfloat16(), EPS, FP8)
        assert q.shape == s.shape == (1, 7, 96) and q.dtype == FP8 and s.dtype == torch.bfloat16
        assert scale.shape == (1, 7, 1) and scale.dtype == torch.float32
        with pytest.raises(ValueError, match="int8 or float8"):
            mi.scaled_linear_add_rms_norm_quant(x, x_scale, w, w_scale, None, torch.bfloat16, r, nw, EPS, FP8)


def test_opcheck():
    x, w, b, r, nw = (t.cpu() for t in _inputs(3, 12, 16, torch.float32, bias=True))
    torch.library.opcheck(mi.linear_add_rms_norm.default, (x, w, b, r, nw, EPS))
    x_q, x_scale, w_q, w_scale, b, r, nw = (t.cpu() for t in _quantized(2, 12, 16, torch.int8, bias=True))
    torch.library.opcheck(mi.scaled_linear_add_rms_norm_quant.default,
                          (x_q, x_scale, w_q, w_scale, b, torch.bfloat16, r, nw, EPS, torch.int8))
