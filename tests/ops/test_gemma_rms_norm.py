"""gemma_rms_norm / fused_add_gemma_rms_norm: HF Gemma2RMSNorm bit for bit (the reference), the Triton kernel and the
fused form's sum within the dtype's tolerance (under the interpreter on a CPU), the fakes."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm

import mini_infer.ops  # noqa: F401  (registers torch.ops.mini_infer.*)
from mini_infer.ops.gemma_rms_norm import (
    fused_add_gemma_rms_norm_reference,
    fused_add_gemma_rms_norm_triton,
    gemma_rms_norm_reference,
    gemma_rms_norm_triton,
)
from tests.ops.helpers import DEVICE, assert_close, requires_triton

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_equals_hf(dtype):
    torch.manual_seed(0)
    x = torch.randn(2, 5, 48, dtype=dtype) * 3
    hf = Gemma2RMSNorm(48, eps=1e-6).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(48) * 0.5)
        assert torch.equal(gemma_rms_norm_reference(x, hf.weight, 1e-6), hf(x))
    # not Llama's rounding: in 16-bit dtypes the two differ somewhere
    if dtype != torch.float32:
        llama = (1 + hf.weight.detach()) * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
                                            ).to(dtype)
        assert not torch.equal(llama, hf(x))


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 5, 48), (7, 33), (1, 256)])
def test_triton_matches_reference(dtype, shape):
    torch.manual_seed(1)
    x = torch.randn(shape, dtype=dtype, device=DEVICE) * 2
    w = torch.randn(shape[-1], dtype=dtype, device=DEVICE) * 0.5
    assert_close(gemma_rms_norm_triton(x, w, 1e-6), gemma_rms_norm_reference(x, w, 1e-6))
    r = torch.randn(shape, dtype=dtype, device=DEVICE)
    out, s = fused_add_gemma_rms_norm_triton(x, r, w, 1e-6)
    ref_out, ref_s = fused_add_gemma_rms_norm_reference(x, r, w, 1e-6)
    assert_close(s, ref_s)  # as fused_add_rms_norm's test: under the interpreter 16-bit sums can differ in a last bit
    assert_close(out, ref_out)


def test_registered_ops_and_fakes():
    torch.manual_seed(3)
    x, r, w = torch.randn(4, 48, device=DEVICE), torch.randn(4, 48, device=DEVICE), torch.randn(48, device=DEVICE)
    assert_close(torch.ops.mini_infer.gemma_rms_norm(x, w, 1e-6), gemma_rms_norm_reference(x, w, 1e-6))
    out, s = torch.ops.mini_infer.fused_add_gemma_rms_norm(x, r, w, 1e-6)
    assert_close(out, gemma_rms_norm_reference(x + r, w, 1e-6))
    with FakeTensorMode():
        fx_, fr, fw = torch.empty(2, 7, 48, dtype=torch.bfloat16), torch.empty(2, 7, 48), torch.empty(48)
        assert torch.ops.mini_infer.gemma_rms_norm(fx_, fw, 1e-6).dtype == torch.bfloat16
        o, s = torch.ops.mini_infer.fused_add_gemma_rms_norm(fx_, fr, fw, 1e-6)
        assert o.shape == s.shape == (2, 7, 48) and o.dtype == s.dtype == torch.float32


@requires_triton
def test_triton_refuses_a_weight_of_another_width():
    with pytest.raises(ValueError, match="does not match last dim"):
        gemma_rms_norm_triton(torch.randn(2, 8, device=DEVICE), torch.randn(7, device=DEVICE), 1e-6)
