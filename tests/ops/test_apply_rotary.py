import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import mini_infer.ops  # noqa: F401  (registers torch.ops.mini_infer.*)
from mini_infer.ops.apply_rotary import apply_rotary_reference, apply_rotary_triton
from tests.ops.helpers import DEVICE, assert_close, requires_triton

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _cos_sin(t, d, dtype, device="cpu"):
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    freqs = torch.outer(torch.arange(t, dtype=torch.float32), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos()[None, None].to(dtype).to(device), emb.sin()[None, None].to(dtype).to(device)


def _independent(x, cos, sin):
    # rotate pairs (i, i + d/2) explicitly, in float64
    half = x.shape[-1] // 2
    xd, c, s = x.double(), cos.double(), sin.double()
    x1, x2 = xd[..., :half], xd[..., half:]
    o1 = x1 * c[..., :half] - x2 * s[..., :half]
    o2 = x2 * c[..., half:] + x1 * s[..., half:]
    return torch.cat((o1, o2), -1)


def _hf_layout_x(dtype, device="cpu", h=3, t=5, d=32):
    # HF: q_proj(x).view(1, T, H, D).transpose(1, 2) -> a non-contiguous [1, H, T, D] view
    return torch.randn(1, t, h, d, dtype=dtype, device=device).transpose(1, 2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_matches_definition_and_hf(dtype):
    torch.manual_seed(0)
    x = _hf_layout_x(dtype)
    cos, sin = _cos_sin(5, 32, dtype)
    out = apply_rotary_reference(x, cos, sin)
    assert out.is_contiguous() and out.shape == x.shape and out.dtype == dtype
    assert_close(out, _independent(x, cos, sin).to(dtype))
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    hf_q, _ = llama.apply_rotary_pos_emb(x, x, cos[:, 0], sin[:, 0])  # HF takes [B, T, D]
    assert torch.equal(hf_q, out)


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_matches_reference_hf_layout(dtype):
    torch.manual_seed(1)
    x = _hf_layout_x(dtype, DEVICE)
    cos, sin = _cos_sin(5, 32, dtype, DEVICE)
    out = apply_rotary_triton(x, cos, sin)
    assert out.is_contiguous()
    assert_close(out, apply_rotary_reference(x, cos, sin))


@requires_triton
@pytest.mark.parametrize(
    "x_shape,cs_shape",
    [
        ((2, 3, 4, 16), (2, 1, 4, 16)),  # batch > 1, broadcast over heads
        ((4, 3, 24), (4, 1, 24)),  # packed [T, H, D] with [T, 1, D] cos/sin, D/2 not a power of 2
        ((6, 8), (6, 8)),  # 2-D
        ((2, 2, 3, 2, 8), (1, 1, 3, 1, 8)),  # 5-D
    ],
)
def test_triton_shapes(x_shape, cs_shape):
    torch.manual_seed(2)
    x = torch.randn(x_shape, device=DEVICE)
    cos, sin = torch.randn(cs_shape, device=DEVICE), torch.randn(cs_shape, device=DEVICE)
    assert_close(apply_rotary_triton(x, cos, sin), apply_rotary_reference(x, cos, sin))


@requires_triton
def test_triton_promotes_dtype():
    torch.manual_seed(3)
    x = _hf_layout_x(torch.bfloat16, DEVICE)
    cos, sin = _cos_sin(5, 32, torch.float32, DEVICE)
    out = apply_rotary_triton(x, cos, sin)
    assert out.dtype == torch.float32
    assert_close(out, apply_rotary_reference(x, cos, sin))


def test_registered_op():
    torch.manual_seed(4)
    x = _hf_layout_x(torch.float32, DEVICE)
    cos, sin = _cos_sin(5, 32, torch.float32, DEVICE)
    assert_close(torch.ops.mini_infer.apply_rotary(x, cos, sin), apply_rotary_reference(x, cos, sin))


def test_fake_impl():
    with FakeTensorMode():
        x = torch.empty(1, 7, 4, 64, dtype=torch.bfloat16).transpose(1, 2)
        cos = torch.empty(1, 1, 7, 64, dtype=torch.bfloat16)
        out = torch.ops.mini_infer.apply_rotary(x, cos, cos)
    assert out.shape == (1, 4, 7, 64) and out.dtype == torch.bfloat16 and out.is_contiguous()


def test_opcheck():
    x = _hf_layout_x(torch.float32)
    cos, sin = _cos_sin(5, 32, torch.float32)
    torch.library.opcheck(torch.ops.mini_infer.apply_rotary.default, (x, cos, sin))
