import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import mini_infer.ops  # noqa: F401  (registers torch.ops.mini_infer.*)
from mini_infer.ops.fused_add_rms_norm import fused_add_rms_norm_reference, fused_add_rms_norm_triton
from tests.ops.helpers import DEVICE, assert_close, requires_triton

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _independent(x, residual, weight, eps):
    s = x + residual
    h = s.double()
    h = h / torch.sqrt((h * h).mean(-1, keepdim=True) + eps)
    return (weight.double() * h.to(s.dtype).double()).to(torch.promote_types(weight.dtype, s.dtype)), s


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_matches_definition(dtype):
    torch.manual_seed(0)
    x, r = torch.randn(2, 6, 40, dtype=dtype), torch.randn(2, 6, 40, dtype=dtype)
    w = torch.randn(40, dtype=dtype)
    x0, r0 = x.clone(), r.clone()
    out, s = fused_add_rms_norm_reference(x, r, w, 1e-6)
    ref_out, ref_s = _independent(x, r, w, 1e-6)
    assert torch.equal(s, ref_s)
    assert_close(out, ref_out)
    assert torch.equal(x, x0) and torch.equal(r, r0)  # functional


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 5, 48), (7, 33)])
def test_triton_matches_reference(dtype, shape):
    torch.manual_seed(1)
    x = torch.randn(shape, dtype=dtype, device=DEVICE)
    r = torch.randn(shape, dtype=dtype, device=DEVICE)
    w = torch.randn(shape[-1], dtype=dtype, device=DEVICE)
    x0, r0 = x.clone(), r.clone()
    out, s = fused_add_rms_norm_triton(x, r, w, 1e-6)
    ref_out, ref_s = fused_add_rms_norm_reference(x, r, w, 1e-6)
    assert_close(s, ref_s)
    assert_close(out, ref_out)
    assert torch.equal(x, x0) and torch.equal(r, r0)


@requires_triton
def test_triton_mixed_dtypes_and_strides():
    torch.manual_seed(2)
    x = torch.randn(5, 3, 32, device=DEVICE, dtype=torch.bfloat16).transpose(0, 1)
    r = torch.randn(3, 5, 32, device=DEVICE, dtype=torch.float32)  # fp32 residual stream
    w = torch.randn(32, device=DEVICE, dtype=torch.bfloat16)
    out, s = fused_add_rms_norm_triton(x, r, w, 1e-6)
    ref_out, ref_s = fused_add_rms_norm_reference(x, r, w, 1e-6)
    assert s.dtype == torch.float32 and out.dtype == torch.float32
    assert_close(s, ref_s)
    assert_close(out, ref_out)


def test_registered_op():
    torch.manual_seed(3)
    x, r = torch.randn(4, 48, device=DEVICE), torch.randn(4, 48, device=DEVICE)
    w = torch.randn(48, device=DEVICE)
    out, s = torch.ops.mini_infer.fused_add_rms_norm(x, r, w, 1e-6)
    ref_out, ref_s = fused_add_rms_norm_reference(x, r, w, 1e-6)
    assert_close(out, ref_out)
    assert_close(s, ref_s)


def test_fake_impl():
    with FakeTensorMode():
        x = torch.empty(2, 7, 64, dtype=torch.bfloat16)
        r = torch.empty(2, 7, 64, dtype=torch.bfloat16)
        w = torch.empty(64, dtype=torch.bfloat16)
        out, s = torch.ops.mini_infer.fused_add_rms_norm(x, r, w, 1e-6)
    assert out.shape == s.shape == (2, 7, 64)
    assert out.dtype == s.dtype == torch.bfloat16


def test_opcheck():
    x, r, w = torch.randn(3, 16), torch.randn(3, 16), torch.randn(16)
    torch.library.opcheck(torch.ops.mini_infer.fused_add_rms_norm.default, (x, r, w, 1e-6))
