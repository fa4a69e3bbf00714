"""mini_infer::gelu_tanh_and_mul: the reference is HF's pair (`ACT2FN["gelu_pytorch_tanh"](gate) * up`) bit for bit;
the Triton kernel is within fp32 rounding of it (a tanh of its own: module docstring), under the interpreter here."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers.activations import ACT2FN

import mini_infer.ops  # noqa: F401  (registers torch.ops.mini_infer.*)
from mini_infer.ops.gelu_tanh_and_mul import gelu_tanh_and_mul_reference, gelu_tanh_and_mul_triton
from tests.ops.helpers import DEVICE, assert_close, requires_triton

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _hf(gate, up):
    """What the captured graph computes: transformers' gelu_pytorch_tanh, then the product."""
    return ACT2FN["gelu_pytorch_tanh"](gate) * up


def _assert_triton_close(actual, expected):
    """fp32: within a few ulps (the kernel's tanh is not torch's); narrower dtypes: the dtype's tolerance (under the
    interpreter its casts truncate instead of rounding)."""
    if expected.dtype == torch.float32:
        torch.testing.assert_close(actual.cpu(), expected.cpu(), atol=4e-6, rtol=2e-6)
    else:
        assert_close(actual, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_is_hf_bit_for_bit(dtype):
    torch.manual_seed(0)
    g, u = torch.randn(3, 257, dtype=dtype) * 4, torch.randn(3, 257, dtype=dtype)
    assert torch.equal(gelu_tanh_and_mul_reference(g, u), _hf(g, u))
    # bf16 / fp16: the gelu computed in fp32 and rounded to gate's dtype, then the product rounded again
    want = (torch.nn.functional.gelu(g.float(), approximate="tanh").to(dtype).float() * u.float()).to(dtype)
    assert torch.equal(gelu_tanh_and_mul_reference(g, u), want)


def test_reference_is_the_tanh_form_not_erf():
    g = torch.linspace(-4, 4, 101)
    u = torch.ones_like(g)
    tanh_form = 0.5 * g.double() * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (g.double() + 0.044715 * g.double() ** 3)))
    torch.testing.assert_close(gelu_tanh_and_mul_reference(g, u).double(), tanh_form, atol=1e-6, rtol=1e-6)
    assert (gelu_tanh_and_mul_reference(g, u) - torch.nn.functional.gelu(g)).abs().max() > 1e-4


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 5, 96), (7, 33), (2, 1500), (1, 1)])
def test_triton_matches_reference(dtype, shape):
    torch.manual_seed(1)
    g = torch.randn(shape, dtype=dtype, device=DEVICE) * 4
    u = torch.randn(shape, dtype=dtype, device=DEVICE)
    out = gelu_tanh_and_mul_triton(g, u)
    assert out.is_contiguous()
    _assert_triton_close(out, gelu_tanh_and_mul_reference(g, u))


@requires_triton
def test_triton_mixed_dtypes_round_the_gelu_to_gate_dtype():
    # bf16 gate, fp32 up: torch rounds gelu(gate) to bf16, then multiplies in fp32
    torch.manual_seed(4)
    g = (torch.randn(4, 80, device=DEVICE) * 3).bfloat16()
    u = torch.randn(4, 80, device=DEVICE)
    out = gelu_tanh_and_mul_triton(g, u)
    assert out.dtype == torch.float32
    assert_close(out, gelu_tanh_and_mul_reference(g, u), dtype=torch.bfloat16)


@requires_triton
def test_triton_rounds_the_gelu_to_gate_dtype_before_the_product():
    """fp16 gate, fp32 up (fp16 casts round under the interpreter, bf16 ones truncate): the output is fp32, so only
    the gelu's rounding to fp16 makes it equal the reference; without it about 9% of values would be."""
    torch.manual_seed(4)
    g = (torch.randn(8, 1000, device=DEVICE) * 3).half()
    u = torch.randn(8, 1000, device=DEVICE)
    out, want = gelu_tanh_and_mul_triton(g, u), gelu_tanh_and_mul_reference(g, u)
    assert out.dtype == torch.float32
    assert (out == want).float().mean() > 0.98  # the rest: a gelu within fp32 ulps of an fp16 rounding boundary
    assert_close(out, want, dtype=torch.float16)


@requires_triton
@pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning", "ignore:invalid value:RuntimeWarning")  # numpy: 1e30 ** 3
def test_triton_extremes():
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e30, -1e30, 30.0, -30.0, 1e-30],
                     device=DEVICE)
    out, want = gelu_tanh_and_mul_triton(x, torch.ones_like(x)), gelu_tanh_and_mul_reference(x, torch.ones_like(x))
    torch.testing.assert_close(out.cpu(), want.cpu(), equal_nan=True, atol=0, rtol=0)


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_views_of_merged_projection(dtype):
    # merge_projections' gate_up output split into its halves: rows 2 * I apart, each half a non-contiguous view
    torch.manual_seed(2)
    gu = (torch.randn(1, 6, 2 * 48, device=DEVICE) * 3).to(dtype)
    g, u = gu.split(48, dim=-1)
    assert not g.is_contiguous() and not u.is_contiguous()
    out = gelu_tanh_and_mul_triton(g, u)
    assert out.is_contiguous() and out.shape == (1, 6, 48)
    _assert_triton_close(out, gelu_tanh_and_mul_reference(g, u))


@requires_triton
def test_triton_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="gelu_tanh_and_mul: gate"):
        gelu_tanh_and_mul_triton(torch.zeros(2, 8, device=DEVICE), torch.zeros(2, 9, device=DEVICE))


def test_registered_op():
    torch.manual_seed(3)
    g, u = torch.randn(4, 48, device=DEVICE), torch.randn(4, 48, device=DEVICE)
    _assert_triton_close(torch.ops.mini_infer.gelu_tanh_and_mul(g, u), gelu_tanh_and_mul_reference(g, u))


def test_fake_impl():
    with FakeTensorMode():
        g = torch.empty(1, 7, 64, dtype=torch.bfloat16)
        out = torch.ops.mini_infer.gelu_tanh_and_mul(g, torch.empty(1, 7, 64, dtype=torch.float32))
    assert out.shape == (1, 7, 64) and out.dtype == torch.float32


def test_opcheck():
    g, u = torch.randn(3, 16), torch.randn(3, 16)
    torch.library.opcheck(torch.ops.mini_infer.gelu_tanh_and_mul.default, (g, u))
