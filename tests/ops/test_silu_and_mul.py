import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import mini_infer.ops  # noqa: F401  (registers torch.ops.mini_infer.*)
from mini_infer.ops.silu_and_mul import silu_and_mul_reference, silu_and_mul_triton
from tests.ops.helpers import DEVICE, assert_close, requires_triton

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_matches_definition(dtype):
    torch.manual_seed(0)
    g, u = torch.randn(3, 40, dtype=dtype) * 4, torch.randn(3, 40, dtype=dtype)
    expected = g.double() / (1 + torch.exp(-g.double())) * u.double()
    assert_close(silu_and_mul_reference(g, u), expected.to(dtype))


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 5, 96), (7, 33), (2, 1500)])
def test_triton_matches_reference(dtype, shape):
    torch.manual_seed(1)
    g = torch.randn(shape, dtype=dtype, device=DEVICE) * 4
    u = torch.randn(shape, dtype=dtype, device=DEVICE)
    assert_close(silu_and_mul_triton(g, u), silu_and_mul_reference(g, u))


@requires_triton
def test_triton_views_of_fused_projection():
    torch.manual_seed(2)
    gu = torch.randn(1, 6, 2 * 48, device=DEVICE)  # a fused gate_up projection output
    g, u = gu[..., :48], gu[..., 48:]
    out = silu_and_mul_triton(g, u)
    assert out.is_contiguous()
    assert_close(out, silu_and_mul_reference(g, u))


def test_registered_op():
    torch.manual_seed(3)
    g, u = torch.randn(4, 48, device=DEVICE), torch.randn(4, 48, device=DEVICE)
    assert_close(torch.ops.mini_infer.silu_and_mul(g, u), silu_and_mul_reference(g, u))


def test_fake_impl():
    with FakeTensorMode():
        g = torch.empty(1, 7, 64, dtype=torch.bfloat16)
        out = torch.ops.mini_infer.silu_and_mul(g, torch.empty(1, 7, 64, dtype=torch.float32))
    assert out.shape == (1, 7, 64) and out.dtype == torch.float32


def test_opcheck():
    g, u = torch.randn(3, 16), torch.randn(3, 16)
    torch.library.opcheck(torch.ops.mini_infer.silu_and_mul.default, (g, u))
