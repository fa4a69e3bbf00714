"""mini_infer::attention: equals HF's eager attention (Gemma 2's: soft-capped logits, sliding window, GQA; GPT-OSS's:
attention sinks) and the paged attention over the same keys, in float32 within assert_close's tolerance (GPT-OSS's
bf16 eager softmax too, within bf16's); the fake gives the shape."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward
from transformers.models.gpt_oss.modeling_gpt_oss import (
    eager_attention_forward as gpt_oss_eager_attention_forward,
)

import mini_infer.ops  # noqa: F401  (registers torch.ops.mini_infer.*)
from mini_infer.ops.attention import attention_reference
from mini_infer.ops.paged_attention import paged_attention_reference
from tests.ops.helpers import assert_close


class _Module(torch.nn.Module):
    """What eager_attention_forward reads of its module."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.training = False


def _mask(q, k, window):
    """The additive causal (+ window) mask HF's mask builder makes, [1, 1, T, S]."""
    t, s = q.shape[2], k.shape[2]
    rows = torch.arange(t)[:, None] + (s - t)
    cols = torch.arange(s)[None, :]
    visible = (cols <= rows) & ((rows - cols < window) if window else True)
    return torch.zeros(t, s, dtype=q.dtype).masked_fill(~visible, torch.finfo(q.dtype).min)[None, None]


def hf_eager(q, k, v, scale, softcap, window):
    """HF's own eager attention with the additive causal (+ window) mask its mask builder makes."""
    out, _ = eager_attention_forward(_Module(q.shape[1] // k.shape[1]), q, k, v, _mask(q, k, window), dropout=0.0,
                                     scaling=scale, softcap=softcap or None)
    return out.transpose(1, 2)  # HF returns [B, T, H, D]


def hf_gpt_oss_eager(q, k, v, scale, window, sinks):
    """GPT-OSS's own eager attention (its sinks read from the module) with HF's causal (+ window) mask."""
    module = _Module(q.shape[1] // k.shape[1])
    module.sinks = torch.nn.Parameter(sinks, requires_grad=False)
    out, _ = gpt_oss_eager_attention_forward(module, q, k, v, _mask(q, k, window), scaling=scale, dropout=0.0)
    return out.transpose(1, 2)


CASES = [  # (Hq, Hkv, T, S, softcap, window)
    (4, 2, 7, 7, 2.0, 0),
    (4, 2, 7, 7, 2.0, 3),
    (4, 4, 5, 9, 0.0, 0),  # queries after 4 earlier keys
    (6, 2, 1, 12, 50.0, 4),  # one decode-like row
]


@pytest.mark.parametrize("hq,hkv,t,s,softcap,window", CASES)
def test_reference_equals_hf_eager(hq, hkv, t, s, softcap, window):
    torch.manual_seed(0)
    q, k, v = torch.randn(1, hq, t, 16) * 2, torch.randn(1, hkv, s, 16) * 2, torch.randn(1, hkv, s, 16)
    out = attention_reference(q, k, v, 0.25, softcap, window)
    assert_close(out, hf_eager(q, k, v, 0.25, softcap, window))
    assert torch.equal(torch.ops.mini_infer.attention(q, k, v, 0.25, softcap, window), out)


SINK_CASES = [  # (Hq, Hkv, T, S, window, dtype)
    (4, 2, 7, 7, 0, torch.float32),
    (4, 2, 7, 7, 3, torch.float32),  # GPT-OSS's sliding layers
    (4, 4, 5, 9, 0, torch.float32),
    (6, 2, 1, 12, 4, torch.float32),  # one decode-like row
    (4, 2, 9, 9, 0, torch.bfloat16),  # HF's softmax in bf16, the op's in fp32
]


@pytest.mark.parametrize("hq,hkv,t,s,window,dtype", SINK_CASES)
def test_sinks_equal_gpt_oss_eager(hq, hkv, t, s, window, dtype):
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, hq, t, 16) * 2).to(dtype), (torch.randn(1, hkv, s, 16) * 2).to(dtype), \
        torch.randn(1, hkv, s, 16).to(dtype)
    sinks = (torch.randn(hq) * 2).to(dtype)
    out = attention_reference(q, k, v, 0.25, 0.0, window, sinks)
    assert_close(out, hf_gpt_oss_eager(q, k, v, 0.25, window, sinks))
    assert torch.equal(torch.ops.mini_infer.attention(q, k, v, 0.25, 0.0, window, sinks), out)
    assert not torch.allclose(out.float(), attention_reference(q, k, v, 0.25, 0.0, window).float(), atol=1e-2)


def test_sinks_of_another_shape_are_refused():
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match=r"sinks of shape \(2,\), expected \(4,\)"):
        attention_reference(q, q[:, :2], q[:, :2], 1.0, 0.0, 0, torch.zeros(2))


def test_softcap_and_window_change_the_result():
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 2, 6, 8) * 4, torch.randn(1, 2, 6, 8) * 4, torch.randn(1, 2, 6, 8)
    plain = attention_reference(q, k, v, 1.0, 0.0, 0)
    assert not torch.allclose(attention_reference(q, k, v, 1.0, 1.0, 0), plain, atol=1e-3)
    assert not torch.allclose(attention_reference(q, k, v, 1.0, 0.0, 2), plain, atol=1e-3)


@pytest.mark.parametrize("softcap,window,with_sinks", [(2.0, 0, False), (2.0, 3, False), (0.0, 0, False),
                                                       (0.0, 0, True), (0.0, 3, True)])
def test_paged_attention_over_the_same_keys_agrees(softcap, window, with_sinks):
    """The op the attention pass puts in its place: the same keys in a paged cache, the same answer."""
    torch.manual_seed(2)
    hq, hkv, t, d, block = 4, 2, 9, 16, 4
    q, k, v = torch.randn(1, hq, t, d) * 2, torch.randn(1, hkv, t, d) * 2, torch.randn(1, hkv, t, d)
    sinks = torch.randn(hq) * 2 if with_sinks else None
    blocks = -(-t // block)
    k_cache, v_cache = torch.zeros(blocks, block, hkv, d), torch.zeros(blocks, block, hkv, d)
    packed = [x[0].transpose(0, 1).contiguous() for x in (q, k, v)]  # [T, H, D]
    out = paged_attention_reference(*packed, k_cache, v_cache, torch.arange(t), torch.arange(blocks)[None].int(),
                                    torch.tensor([t], dtype=torch.int32), torch.tensor([0, t], dtype=torch.int32),
                                    0.25, window, softcap, None, None, sinks)
    assert_close(out, attention_reference(q, k, v, 0.25, softcap, window, sinks)[0].transpose(0, 1))


def test_fake_gives_the_output_shape():
    with FakeTensorMode():
        q, k, v = torch.empty(1, 8, 5, 32), torch.empty(1, 2, 5, 32), torch.empty(1, 2, 5, 24)
        out = torch.ops.mini_infer.attention(q, k, v, 0.1, 0.0, 0)
        with_sinks = torch.ops.mini_infer.attention(q, k, v, 0.1, 0.0, 0, torch.empty(8, dtype=torch.bfloat16))
    assert out.shape == with_sinks.shape == (1, 8, 5, 24) and out.dtype == with_sinks.dtype == torch.float32


def test_heads_not_a_multiple_are_refused():
    with pytest.raises(ValueError, match="3 query heads are not a multiple of 2 kv heads"):
        attention_reference(torch.randn(1, 3, 2, 4), torch.randn(1, 2, 2, 4), torch.randn(1, 2, 2, 4), 1.0, 0.0, 0)
