"""apply_rotary_interleaved: reference vs HF DeepSeek-V2's complex rotary (same layout) and V3's interleave rotary
(de-interleaved layout: a fixed permutation of ours), Triton vs reference for the layouts the MLA pass feeds
(a non-contiguous q_pe slice [T, H, Dr] of q, a k_pe row [T, Dr]), dtypes, errors, the fake impl, opcheck."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import mini_infer.ops  # noqa: F401  (registers torch.ops.mini_infer.*)
from mini_infer.ops.apply_rotary_interleaved import (
    apply_rotary_interleaved_reference,
    apply_rotary_interleaved_triton,
)
from tests.ops.helpers import DEVICE, assert_close, requires_triton

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
T, H, DN, DR = 5, 3, 16, 8


def _angles(t, half, scale=1.0, device="cpu"):
    """(cos, sin) [t, half]: one angle per pair, as HF's rotary tables (attention scaling folded in)."""
    inv = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
    f = torch.outer(torch.arange(t, dtype=torch.float32) + 3, inv)
    return (f.cos() * scale).to(device), (f.sin() * scale).to(device)


def _q_pe(dtype, device="cpu"):
    """The pass's q_pe: a slice of q [T, H, Dn + Dr] (row stride H * (Dn + Dr), not contiguous)."""
    q = torch.randn(T, H, DN + DR, dtype=dtype, device=device)
    return q[..., DN:]


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_equals_hf_deepseek_v2_complex_rotary(dtype):
    v2 = pytest.importorskip("transformers.models.deepseek_v2.modeling_deepseek_v2")
    torch.manual_seed(0)
    q = torch.randn(1, H, T, DR, dtype=dtype)  # HF's layout [B, H, T, D]
    k = torch.randn(1, 1, T, DR, dtype=dtype)
    cos, sin = _angles(T, DR // 2, scale=0.9)
    freqs_cis = torch.polar(torch.ones_like(cos), torch.atan2(sin, cos)) * 0.9  # [T, D/2] complex
    hf_q, hf_k = v2.apply_rotary_emb(q, k, freqs_cis[None])
    out_q = apply_rotary_interleaved_reference(q, cos[None, None], sin[None, None])
    out_k = apply_rotary_interleaved_reference(k, cos[None, None], sin[None, None])
    assert out_q.dtype == dtype and out_q.is_contiguous()
    assert_close(out_q, hf_q)
    assert_close(out_k, hf_k)


def test_reference_is_hf_deepseek_v3_interleave_up_to_the_layout():
    v3 = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
    torch.manual_seed(1)
    q, k = torch.randn(1, H, T, DR), torch.randn(1, 1, T, DR)
    cos, sin = _angles(T, DR // 2)
    table_cos, table_sin = torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None]
    hf_q, hf_k = v3.apply_rotary_pos_emb_interleave(q, k, table_cos, table_sin)
    # HF concatenates the rotated evens then the rotated odds; we keep each pair in place
    deinterleave = torch.cat([torch.arange(0, DR, 2), torch.arange(1, DR, 2)])
    out_q = apply_rotary_interleaved_reference(q, cos, sin)
    out_k = apply_rotary_interleaved_reference(k, cos, sin)
    torch.testing.assert_close(out_q[..., deinterleave], hf_q)
    torch.testing.assert_close(out_k[..., deinterleave], hf_k)
    # dot products (all attention reads) are the same in either layout
    torch.testing.assert_close(out_q @ out_k.transpose(-1, -2), hf_q @ hf_k.transpose(-1, -2))


def test_reference_rotates_pairs_not_halves():
    x = torch.tensor([1.0, 0.0, 0.0, 1.0])  # pair 0 = (1, 0), pair 1 = (0, 1)
    cos, sin = torch.tensor([0.0, 1.0]), torch.tensor([1.0, 0.0])  # pair 0 turned by 90 degrees, pair 1 not
    torch.testing.assert_close(apply_rotary_interleaved_reference(x, cos, sin), torch.tensor([0.0, 1.0, 0.0, 1.0]))


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_matches_reference_q_and_k_layouts(dtype):
    torch.manual_seed(2)
    cos, sin = _angles(T, DR // 2, device=DEVICE)
    q_pe = _q_pe(dtype, DEVICE)
    k_pe = torch.randn(T, DN + DR, dtype=dtype, device=DEVICE)[:, DN:]  # a slice of kv_a_proj's output
    for x, c, s in ((q_pe, cos[:, None], sin[:, None]), (k_pe, cos, sin)):
        out = apply_rotary_interleaved_triton(x, c, s)
        assert out.is_contiguous() and out.dtype == dtype
        assert_close(out, apply_rotary_interleaved_reference(x, c, s))


@requires_triton
@pytest.mark.parametrize(
    "x_shape,cs_shape",
    [
        ((2, 3, 4, 16), (2, 1, 4, 8)),  # 4-D, broadcast over heads
        ((6, 12), (6, 6)),  # 2-D, D/2 not a power of 2
        ((2, 2, 3, 2, 8), (1, 1, 3, 1, 4)),  # 5-D
        ((0, 3, 8), (0, 1, 4)),  # no tokens
    ],
)
def test_triton_shapes(x_shape, cs_shape):
    torch.manual_seed(3)
    x = torch.randn(x_shape, device=DEVICE)
    cos, sin = torch.randn(cs_shape, device=DEVICE), torch.randn(cs_shape, device=DEVICE)
    assert_close(apply_rotary_interleaved_triton(x, cos, sin), apply_rotary_interleaved_reference(x, cos, sin))


@requires_triton
def test_triton_bf16_x_with_fp32_angles_keeps_x_dtype():
    torch.manual_seed(4)
    x = _q_pe(torch.bfloat16, DEVICE)
    cos, sin = _angles(T, DR // 2, device=DEVICE)
    out = apply_rotary_interleaved_triton(x, cos[:, None], sin[:, None])
    assert out.dtype == torch.bfloat16
    assert_close(out, apply_rotary_interleaved_reference(x, cos[:, None], sin[:, None]))


@pytest.mark.parametrize("impl", [apply_rotary_interleaved_reference, torch.ops.mini_infer.apply_rotary_interleaved])
def test_errors_name_the_problem(impl):
    with pytest.raises(ValueError, match="must be even"):
        impl(torch.randn(2, 7), torch.randn(2, 3), torch.randn(2, 3))
    with pytest.raises(ValueError, match="cos has shape"):
        impl(torch.randn(2, 8), torch.randn(2, 8), torch.randn(2, 4))  # a full-width (neox) table


def test_registered_op():
    torch.manual_seed(5)
    x = _q_pe(torch.float32, DEVICE)
    cos, sin = _angles(T, DR // 2, device=DEVICE)
    assert_close(torch.ops.mini_infer.apply_rotary_interleaved(x, cos[:, None], sin[:, None]),
                 apply_rotary_interleaved_reference(x, cos[:, None], sin[:, None]))


def test_fake_impl():
    with FakeTensorMode():
        x = torch.empty(7, 4, 24, dtype=torch.bfloat16)[..., 16:]
        cos = torch.empty(7, 1, 4, dtype=torch.float32)
        out = torch.ops.mini_infer.apply_rotary_interleaved(x, cos, cos)
    assert out.shape == (7, 4, 8) and out.dtype == torch.bfloat16 and out.is_contiguous()


def test_opcheck():
    x = _q_pe(torch.float32)
    cos, sin = _angles(T, DR // 2)
    torch.library.opcheck(torch.ops.mini_infer.apply_rotary_interleaved.default, (x, cos[:, None], sin[:, None]))
