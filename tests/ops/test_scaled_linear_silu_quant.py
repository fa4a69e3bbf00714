"""scaled_linear_silu_quant and quantize_linear_add_rms_norm_quant: the W8A8 / FP8 decode chain's quantizations in the
GEMVs' launches. One row: one launch, and the unfused chain's bits (quantized bytes and scales compared exactly;
int8 packed and byte-wise, fp8 on tensor cores and CUDA cores, with and without bias, odd sizes); the shared
counters are zero after it; several rows run the unfused kernels; on CPU the registered ops run the references."""

import pytest
import torch

import mini_infer.ops  # noqa: F401  (registers torch.ops.mini_infer.*)
from mini_infer.ops import int8_linear as il
from mini_infer.ops import linear_add_rms_norm as lar
from mini_infer.ops import scaled_linear_silu_quant as slq
from mini_infer.ops._split_k import split_counters
from mini_infer.ops.linear_add_rms_norm import scaled_linear_add_rms_norm_quant_triton, scaled_linear_of
from mini_infer.ops.quant import quantize_per_token_triton, silu_and_mul_quant_triton
from mini_infer.ops.quantize_linear_add_rms_norm_quant import (
    quantize_linear_add_rms_norm_quant_reference,
    quantize_linear_add_rms_norm_quant_triton,
)
from mini_infer.ops.scaled_linear_silu_quant import (
    scaled_linear_silu_quant_reference,
    scaled_linear_silu_quant_triton,
)
from tests.ops.helpers import DEVICE, requires_triton
from tests.ops.test_linear_add_rms_norm import _quantized

mi = torch.ops.mini_infer
FP8 = torch.float8_e4m3fn
EPS = 1e-6
BF16 = torch.bfloat16
# (N, K): K 97 is not a multiple of 4 (int8 read byte by byte), the others are (int32 words); N / 2 odd
CASES = [(torch.int8, 2 * 21, 97, "auto"), (torch.int8, 2 * 65, 1000, "auto"), (FP8, 2 * 33, 96, "dot"),
         (FP8, 2 * 151, 520, "cuda-cores")]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu().view(torch.uint8), b.cpu().view(torch.uint8))


def _counters_zero() -> bool:
    return not split_counters(torch.device(DEVICE), 2)[:2].any().item()


@pytest.fixture
def launches(monkeypatch):
    calls = []
    for mod in (slq, lar):
        real = mod.launch_scaled_gemv
        monkeypatch.setattr(mod, "launch_scaled_gemv",
                            lambda kernel, *a, _real=real, **kw: calls.append(kernel) or _real(kernel, *a, **kw))
    return calls


@requires_triton
@pytest.mark.parametrize(("operand", "n", "k", "mode"), CASES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("qdtype", [torch.int8, FP8])
def test_gate_up_one_row_equals_the_unfused_chain(launches, monkeypatch, operand, n, k, mode, bias, qdtype):
    monkeypatch.setattr(il, "FP8_GEMV", mode)
    x_q, x_scale, w_q, w_scale, b, _, _ = _quantized(1, n, k, operand, bias, seed=n + k)
    q, scale = scaled_linear_silu_quant_triton(x_q, x_scale, w_q, w_scale, b, BF16, qdtype)
    assert launches == [slq._scaled_gate_up_silu_quant_kernel]
    gate, up = scaled_linear_of("triton", x_q)(x_q, x_scale, w_q, w_scale, b, BF16).split(n // 2, -1)
    q_ref, scale_ref = silu_and_mul_quant_triton(gate, up, qdtype)
    assert q.shape == (1, 1, n // 2) and _same(q, q_ref) and torch.equal(scale, scale_ref)
    assert _counters_zero()


@requires_triton
@pytest.mark.parametrize(("operand", "n", "k", "mode"), CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_o_proj_one_row_equals_the_unfused_chain(launches, monkeypatch, operand, n, k, mode, bias):
    monkeypatch.setattr(il, "FP8_GEMV", mode)
    _, _, w_q, w_scale, b, r, nw = _quantized(1, n, k, operand, bias, seed=n)
    x = (torch.randn(1, 1, k, generator=torch.Generator().manual_seed(k)) * 3).to(BF16).to(DEVICE)
    got = quantize_linear_add_rms_norm_quant_triton(x, w_q, w_scale, b, BF16, r, nw, EPS, operand)
    assert launches == [lar._scaled_gemv_add_rms_norm_quant_kernel]
    ref = scaled_linear_add_rms_norm_quant_triton(*quantize_per_token_triton(x, operand), w_q, w_scale, b, BF16, r, nw,
                                                  EPS, operand)
    assert _same(got[0], ref[0]) and torch.equal(got[1], ref[1]) and torch.equal(got[2], ref[2])
    assert _counters_zero()


@requires_triton
def test_several_rows_run_the_unfused_kernels(launches):
    x_q, x_scale, w_q, w_scale, b, r, nw = _quantized(3, 2 * 12, 64, torch.int8, bias=True)
    q, scale = scaled_linear_silu_quant_triton(x_q, x_scale, w_q, w_scale, b, BF16, torch.int8)
    q_ref, scale_ref = scaled_linear_silu_quant_reference(x_q, x_scale, w_q, w_scale, b, BF16, torch.int8)
    x = torch.randn(1, 3, 64).to(BF16).to(DEVICE)
    r = r[..., :24]
    got = quantize_linear_add_rms_norm_quant_triton(x, w_q, w_scale, b, BF16, r, nw[:24], EPS, torch.int8)
    ref = quantize_linear_add_rms_norm_quant_reference(x, w_q, w_scale, b, BF16, r, nw[:24], EPS, torch.int8)
    assert launches == []
    assert (q.int() - q_ref.int()).abs().max() <= 1 and (got[0].int() - ref[0].int()).abs().max() <= 1
    torch.testing.assert_close(scale, scale_ref, rtol=1e-2, atol=0)


def test_registered_ops_run_the_references_on_cpu():
    x_q, x_scale, w_q, w_scale, b, r, nw = (t.cpu() if t is not None else None
                                            for t in _quantized(2, 2 * 8, 32, torch.int8, bias=True))
    got = mi.scaled_linear_silu_quant(x_q, x_scale, w_q, w_scale, b, BF16, FP8)
    assert all(_same(g, e) for g, e in zip(got, scaled_linear_silu_quant_reference(x_q, x_scale, w_q, w_scale, b,
                                                                                    BF16, FP8)))
    x = torch.randn(1, 2, 32).to(BF16)
    got = mi.quantize_linear_add_rms_norm_quant(x, w_q, w_scale, b, BF16, r, nw, EPS, torch.int8)
    ref = quantize_linear_add_rms_norm_quant_reference(x, w_q, w_scale, b, BF16, r, nw, EPS, torch.int8)
    assert all(_same(g, e) for g, e in zip(got, ref))
    torch.library.opcheck(mi.scaled_linear_silu_quant.default, (x_q, x_scale, w_q, w_scale, b, BF16, torch.int8))
    torch.library.opcheck(mi.quantize_linear_add_rms_norm_quant.default,
                          (x, w_q, w_scale, b, BF16, r, nw, EPS, torch.int8))
