import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import mini_infer.ops  # noqa: F401  (registers torch.ops.mini_infer.*)
from mini_infer.ops.rms_norm import rms_norm_reference, rms_norm_triton
from tests.ops.helpers import DEVICE, assert_close, requires_triton

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _independent(x, weight, eps):
    # straight from the definition, in float64, rounding where HF rounds
    h = x.double()
    h = h / torch.sqrt((h * h).mean(-1, keepdim=True) + eps)
    return (weight.double() * h.to(x.dtype).double()).to(torch.promote_types(weight.dtype, x.dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_matches_definition_and_hf(dtype):
    torch.manual_seed(0)
    x = torch.randn(2, 5, 48, dtype=dtype) * 3
    w = torch.randn(48, dtype=dtype)
    out = rms_norm_reference(x, w, 1e-5)
    assert_close(out, _independent(x, w, 1e-5))
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    hf = llama.LlamaRMSNorm(48, eps=1e-5).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(w)
        assert torch.equal(hf(x), out)


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 5, 48), (7, 33), (1, 256)])
def test_triton_matches_reference(dtype, shape):
    torch.manual_seed(1)
    x = torch.randn(shape, dtype=dtype, device=DEVICE)
    w = torch.randn(shape[-1], dtype=dtype, device=DEVICE)
    assert_close(rms_norm_triton(x, w, 1e-6), rms_norm_reference(x, w, 1e-6))


@requires_triton
def test_triton_non_contiguous_and_promotion():
    torch.manual_seed(2)
    base = torch.randn(6, 4, 40, device=DEVICE, dtype=torch.bfloat16)
    x = base.transpose(0, 1)[..., :32]  # strided rows, last dim contiguous
    w = torch.randn(32, device=DEVICE, dtype=torch.float32)  # fp32 weight: output promotes to fp32
    out = rms_norm_triton(x, w, 1e-6)
    assert out.dtype == torch.float32 and out.is_contiguous()
    assert_close(out, rms_norm_reference(x, w, 1e-6), torch.bfloat16)


def test_registered_op():
    torch.manual_seed(3)
    x = torch.randn(4, 48, device=DEVICE)
    w = torch.randn(48, device=DEVICE)
    assert_close(torch.ops.mini_infer.rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6))


def test_fake_impl():
    with FakeTensorMode():
        x = torch.empty(2, 7, 64, dtype=torch.bfloat16)
        w = torch.empty(64, dtype=torch.float32)
        out = torch.ops.mini_infer.rms_norm(x, w, 1e-6)
    assert out.shape == (2, 7, 64) and out.dtype == torch.float32


def test_opcheck():
    x = torch.randn(3, 16)
    w = torch.randn(16)
    torch.library.opcheck(torch.ops.mini_infer.rms_norm.default, (x, w, 1e-6))


def test_export_with_symbolic_tokens():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(16))

        def forward(self, x):
            return torch.ops.mini_infer.rms_norm(x, self.w, 1e-6)

    tokens = torch.export.Dim("tokens", min=2, max=1024)
    ep = torch.export.export(M(), (torch.randn(1, 8, 16),), dynamic_shapes={"x": {1: tokens}})
    x = torch.randn(1, 5, 16)
    assert_close(ep.module()(x), rms_norm_reference(x, ep.module().w, 1e-6))
