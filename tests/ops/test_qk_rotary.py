"""qk_rotary: the reference is HF Qwen3's q_norm / k_norm then `apply_rotary_pos_emb`, bit for bit; the one-launch
Triton kernel (interpreter here, CUDA on a GPU) equals the reference and the unfused Triton kernels it replaces."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import mini_infer.ops  # noqa: F401  (registers torch.ops.mini_infer.*)
from mini_infer.ops.apply_rotary import apply_rotary_triton
from mini_infer.ops.qk_rotary import qk_rotary_reference, qk_rotary_triton
from mini_infer.ops.rms_norm import rms_norm_triton
from tests.ops.helpers import DEVICE, TOL, assert_close, requires_triton

EPS = 1e-6
# (Hq, Hk): GQA 2:1, MQA, MHA
HEADS = [(4, 2), (6, 1), (3, 3)]
# which norms: both (Qwen3), none (Llama / Qwen2 / Mistral), q only, k only
NORMS = [(True, True), (False, False), (True, False), (False, True)]


def _cos_sin(b, t, d, dtype, device="cpu", start=3):
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    pos = start + torch.arange(t, dtype=torch.float32) + 7 * torch.arange(b, dtype=torch.float32)[:, None]
    emb = torch.cat((pos[..., None] * inv, pos[..., None] * inv), dim=-1)  # [B, T, D]
    return emb.cos().to(dtype).to(device), emb.sin().to(dtype).to(device)


def _inputs(dtype, hq=4, hk=2, b=2, t=5, d=32, device="cpu", seed=0, norms=(True, True), w_dtype=None):
    """HF's layout: q_proj(x).view(B, T, H, D) (the norm's input; `.transpose(1, 2)` gives [B, H, T, D])."""
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, t, hq, d, generator=gen) * 3).to(dtype).to(device)
    k = (torch.randn(b, t, hk, d, generator=gen) * 3).to(dtype).to(device)
    ws = [(1 + 0.2 * torch.randn(d, generator=gen)).to(w_dtype or dtype).to(device) if on else None for on in norms]
    cos, sin = _cos_sin(b, t, d, dtype, device)
    return q, k, cos, sin, ws[0], ws[1]


def _op_args(q, k, cos, sin, qw, kw):
    """What the pass hands the op: [B, H, T, D] views of the norms' inputs, cos/sin unsqueezed to [B, 1, T, D]."""
    return q.transpose(1, 2), k.transpose(1, 2), cos[:, None], sin[:, None], qw, kw, EPS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_hf_qwen3(dtype):
    qwen3 = pytest.importorskip("transformers.models.qwen3.modeling_qwen3")
    q, k, cos, sin, qw, kw = _inputs(dtype)
    q_norm, k_norm = qwen3.Qwen3RMSNorm(32, eps=EPS).to(dtype), qwen3.Qwen3RMSNorm(32, eps=EPS).to(dtype)
    with torch.no_grad():
        q_norm.weight.copy_(qw)
        k_norm.weight.copy_(kw)
        hf_q, hf_k = qwen3.apply_rotary_pos_emb(q_norm(q).transpose(1, 2), k_norm(k).transpose(1, 2), cos, sin)
    out_q, out_k = qk_rotary_reference(*_op_args(q, k, cos, sin, qw, kw))
    assert torch.equal(out_q, hf_q) and torch.equal(out_k, hf_k)
    assert out_q.is_contiguous() and out_k.is_contiguous()
    hf_q, hf_k = qwen3.apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # no norms (Llama)
    out_q, out_k = qk_rotary_reference(*_op_args(q, k, cos, sin, None, None))
    assert torch.equal(out_q, hf_q) and torch.equal(out_k, hf_k)


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("norms", NORMS)
def test_triton_matches_reference(dtype, heads, norms):
    hq, hk = heads
    args = _op_args(*_inputs(dtype, hq, hk, device=DEVICE, seed=hq + 10 * hk, norms=norms))
    out_q, out_k = qk_rotary_triton(*args)
    ref_q, ref_k = qk_rotary_reference(*args)
    assert out_q.is_contiguous() and out_k.is_contiguous()
    assert_close(out_q, ref_q)
    assert_close(out_k, ref_k)


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_unfused_kernels(dtype):
    """The fused kernel rounds where rms_norm's and apply_rotary's kernels round (the normed value to the norm's
    dtype, the rotation in fp32): in bf16 it is within one bf16 ulp of their chain, not just of HF's."""
    q, k, cos, sin, qw, kw = _inputs(dtype, 4, 2, d=64, t=3, device=DEVICE, seed=5)
    args = _op_args(q, k, cos, sin, qw, kw)
    out_q, out_k = qk_rotary_triton(*args)
    for out, x, w in ((out_q, q, qw), (out_k, k, kw)):
        unfused = apply_rotary_triton(rms_norm_triton(x, w, EPS).transpose(1, 2), args[2], args[3])
        scale = unfused.abs().max().item()
        assert (out.float() - unfused.float()).abs().max().item() <= (2**-7 if dtype == torch.bfloat16 else 1e-6) * scale


@requires_triton
@pytest.mark.parametrize("shape", [(1, 16, 1, 128), (3, 2, 7, 24)])  # a decode row at Qwen3's head dim; D/2 = 12
def test_triton_shapes(shape):
    b, hq, t, d = shape
    args = _op_args(*_inputs(torch.float32, hq, max(1, hq // 2), b=b, t=t, d=d, device=DEVICE, seed=7))
    for out, ref in zip(qk_rotary_triton(*args), qk_rotary_reference(*args)):
        assert_close(out, ref)


@requires_triton
def test_triton_any_strides():
    """q and k as slices of one merged qkv projection (the merge_projections layout), cos/sin as expanded views."""
    b, t, hq, hk, d = 2, 4, 4, 2, 16
    qkv = torch.randn(b, t, (hq + 2 * hk) * d, device=DEVICE)
    q = qkv[..., : hq * d].view(b, t, hq, d)
    k = qkv[..., hq * d: (hq + hk) * d].view(b, t, hk, d)
    cos, sin = _cos_sin(1, t, d, torch.float32, DEVICE)
    args = _op_args(q, k, cos.expand(b, t, d), sin.expand(b, t, d), torch.rand(d, device=DEVICE) + 0.5, None)
    for out, ref in zip(qk_rotary_triton(*args), qk_rotary_reference(*args)):
        assert_close(out, ref)


@requires_triton
def test_triton_promotes_dtype():
    """bf16 activations with fp32 norm weights: the norm returns fp32 (torch promotion), so does the op."""
    args = _op_args(*_inputs(torch.bfloat16, device=DEVICE, seed=3, w_dtype=torch.float32))
    out_q, out_k = qk_rotary_triton(*args)
    ref_q, ref_k = qk_rotary_reference(*args)
    assert out_q.dtype == ref_q.dtype == torch.float32
    assert_close(out_q, ref_q, torch.bfloat16)
    assert_close(out_k, ref_k, torch.bfloat16)


@requires_triton
def test_triton_refuses_bad_shapes():
    q, k, cos, sin, qw, kw, _ = _op_args(*_inputs(torch.float32, device=DEVICE))
    with pytest.raises(ValueError, match="share B, T"):
        qk_rotary_triton(q, k[:, :, :2], cos, sin, qw, kw, EPS)
    with pytest.raises(ValueError, match="k_weight"):
        qk_rotary_triton(q, k, cos, sin, qw, kw[:8], EPS)


def test_norm_changes_the_result():
    """Guard for the tests above: the norms are not a no-op on these inputs (a kernel dropping one must fail)."""
    args = _op_args(*_inputs(torch.float32))
    with_norms = qk_rotary_reference(*args)
    without = qk_rotary_reference(*args[:4], None, None, EPS)
    atol, rtol = TOL[torch.bfloat16]
    for a, b in zip(with_norms, without):
        assert not torch.allclose(a, b, atol=atol, rtol=rtol)


def test_registered_op():
    args = _op_args(*_inputs(torch.float32, device=DEVICE, seed=4))
    for out, ref in zip(torch.ops.mini_infer.qk_rotary(*args), qk_rotary_reference(*args)):
        assert_close(out, ref)


def test_fake_impl():
    with FakeTensorMode():
        q = torch.empty(1, 7, 16, 128, dtype=torch.bfloat16).transpose(1, 2)
        k = torch.empty(1, 7, 8, 128, dtype=torch.bfloat16).transpose(1, 2)
        cos = torch.empty(1, 1, 7, 128, dtype=torch.bfloat16)
        w = torch.empty(128, dtype=torch.float32)
        out_q, out_k = torch.ops.mini_infer.qk_rotary(q, k, cos, cos, w, None, EPS)
    assert out_q.shape == (1, 16, 7, 128) and out_q.dtype == torch.float32 and out_q.is_contiguous()
    assert out_k.shape == (1, 8, 7, 128) and out_k.dtype == torch.bfloat16 and out_k.is_contiguous()


@pytest.mark.parametrize("norms", [(True, True), (False, False)])
def test_opcheck(norms):
    args = _op_args(*_inputs(torch.float32, norms=norms))
    torch.library.opcheck(torch.ops.mini_infer.qk_rotary.default, args)
