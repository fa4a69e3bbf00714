"""The contract's data: InputSpec shapes and padding rules, StepBatch, and the cache specs' tensors and bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mini_infer.contract import (
    FullAttentionSpec,
    InputSpec,
    LatentAttentionSpec,
    SlidingWindowSpec,
    StepBatch,
    attention_window,
    bytes_per_block,
    default_block_size,
)
from mini_infer.contract.inputs import ATTENTION_METADATA, LOGITS_INDICES, SLOT_MAPPING


def _step() -> StepBatch:
    # two sequences: 3 new tokens at positions 5..7 (context 8), then 1 decode token at position 2 (context 3)
    return StepBatch(token_ids=np.array([7, 8, 9, 4]), positions=np.array([5, 6, 7, 2]),
                     slot_mapping=np.array([21, 22, 23, 2]), seq_lens=np.array([8, 3], np.int32),
                     query_start_loc=np.array([0, 3, 4], np.int32), block_tables=np.array([[4, 5], [0, 0]], np.int32),
                     logits_indices=np.array([2, 3]), block_size=4)


def test_input_spec_values_and_shapes():
    step = _step()
    assert step.num_tokens == 4 and step.num_seqs == 2 and step.num_logits == 2
    assert step.token_seq_index().tolist() == [0, 0, 0, 1]
    values = {s.name: s.value(step) for s in (*ATTENTION_METADATA, LOGITS_INDICES)}
    assert values["slot_mapping"].dtype == torch.int64 and values["slot_mapping"].tolist() == [21, 22, 23, 2]
    assert values["block_tables"].shape == (2, 2) and values["block_tables"].dtype == torch.int32
    assert values["query_start_loc"].tolist() == [0, 3, 4]
    assert SLOT_MAPPING.sizes(tokens=8, seqs=2, logits=2, blocks=None) == (8,)
    bad = InputSpec("bad", torch.int32, ("tokens",), lambda s: s.seq_lens)  # builds [S] for a [T] input
    with pytest.raises(ValueError, match=r"input 'bad': builder returned shape \(2,\), declared \('tokens',\)"):
        bad.value(step)


def test_input_spec_rejects_unknown_dims_and_pads():
    with pytest.raises(ValueError, match="unknown dimension"):
        InputSpec("x", torch.int32, ("heads",), lambda s: None)
    with pytest.raises(ValueError, match="pad must be a number, 'last' or None"):
        InputSpec("x", torch.int32, ("tokens",), lambda s: None, pad="first")


def test_single_sequence_step():
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    step = StepBatch.single_sequence(ids, torch.arange(5)[None], block_size=2)
    assert step.block_tables.tolist() == [[0, 1, 2]] and step.slot_mapping.tolist() == [0, 1, 2, 3, 4]
    assert step.seq_lens.tolist() == [5] and step.query_start_loc.tolist() == [0, 5]
    assert step.logits_indices.tolist() == [4]


def test_full_and_sliding_specs():
    full = FullAttentionSpec(0, num_kv_heads=2, head_size=16, head_size_v=8, dtype=torch.bfloat16)
    assert [(t.name, t.shape) for t in full.tensors()] == [("k_cache_0", (2, 16)), ("v_cache_0", (2, 8))]
    assert full.bytes_per_token() == 2 * (16 + 8) * 2 and full.attention_window is None
    cache = full.allocate(3, 4, torch.device("cpu"))
    assert cache["k_cache_0"].shape == (3, 4, 2, 16) and cache["v_cache_0"].dtype == torch.bfloat16
    window = SlidingWindowSpec(1, 2, 16, 16, torch.float32, sliding_window=8)
    assert window.attention_window == 8 and window.input_names() == ["k_cache_1", "v_cache_1"]
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        SlidingWindowSpec(1, 2, 16, 16, torch.float32, sliding_window=0)
    assert attention_window([window, SlidingWindowSpec(2, 2, 16, 16, torch.float32, sliding_window=4)]) == 8
    assert attention_window([window, full]) is None  # a full-attention layer keeps every block alive
    assert bytes_per_block([full, window], 16) == 16 * (full.bytes_per_token() + window.bytes_per_token())


def test_quantized_kv_spec_stores_fp8_with_scales():
    q = FullAttentionSpec(3, 4, 16, 16, torch.float8_e4m3fn, scales=(0.5, 2.0))
    assert q.quantized and q.bytes_per_token() == 4 * 32  # one byte per value: half of bf16
    assert q.input_names() == ["k_cache_3", "v_cache_3", "k_scale_3", "v_scale_3"]
    cache = q.allocate(2, 4, torch.device("cpu"))
    assert cache["k_cache_3"].dtype == torch.float8_e4m3fn and cache["v_scale_3"].tolist() == [2.0]
    with pytest.raises(ValueError, match="needs scales"):
        FullAttentionSpec(0, 4, 16, 16, torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="scales are for float8 caches"):
        FullAttentionSpec(0, 4, 16, 16, torch.bfloat16, scales=(1.0, 1.0))


def test_latent_spec_is_one_tensor_per_layer():
    spec = LatentAttentionSpec(0, kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.bfloat16)
    assert [(t.name, t.shape) for t in spec.tensors()] == [("latent_cache_0", (576,))]
    assert spec.bytes_per_token() == 576 * 2
    assert "LatentAttentionSpec(latent_cache_0 [576] bfloat16; 1152 B/token)" in spec.describe()


def test_v_cache_stored_tokens_contiguous():
    """`v_keys_contiguous`: V allocated [blocks, Hkv, Dv, block_size] and handed out as the usual [blocks,
    block_size, Hkv, Dv] view of it (unit stride along a block's tokens), zeroed, same bytes per token; K as ever."""
    spec = FullAttentionSpec(2, 4, 16, 8, torch.float8_e4m3fn, scales=(1.0, 1.0), v_keys_contiguous=True)
    k_t, v_t = spec.tensors()
    assert not k_t.keys_contiguous and v_t.keys_contiguous
    cache = spec.allocate(3, 16, torch.device("cpu"))
    k, v = cache["k_cache_2"], cache["v_cache_2"]
    assert k.shape == v.shape[:3] + (16,) and v.shape == (3, 16, 4, 8) and v.dtype == torch.float8_e4m3fn
    assert k.is_contiguous() and v.stride() == (16 * 4 * 8, 1, 8 * 16, 16)
    assert not v.view(torch.uint8).any()
    assert spec.bytes_per_token() == FullAttentionSpec(2, 4, 16, 8, torch.float8_e4m3fn, (1.0, 1.0)).bytes_per_token()
    assert "tokens contiguous" in spec.describe()
    window = SlidingWindowSpec(1, 2, 16, 16, torch.bfloat16, None, True, sliding_window=8)
    assert window.allocate(2, 4, torch.device("cpu"))["v_cache_1"].stride(1) == 1


def test_block_size_hint_and_the_default_block_size():
    """A spec may ask for a block size (a power of two); an engine not told one takes the largest asked, else 16.
    Specs without the field (latent caches) ask for nothing."""
    plain = FullAttentionSpec(0, 2, 16, 16, torch.bfloat16)
    fp8 = FullAttentionSpec(1, 2, 16, 16, torch.float8_e4m3fn, (1.0, 1.0), True, 64)
    window = SlidingWindowSpec(2, 2, 16, 16, torch.bfloat16, None, False, 32, sliding_window=8)
    latent = LatentAttentionSpec(3, 512, 64, torch.bfloat16)
    assert plain.block_size_hint is None and latent.block_size_hint is None and window.block_size_hint == 32
    assert default_block_size([]) == 16 and default_block_size([plain, latent]) == 16
    assert default_block_size([plain, fp8, window]) == 64 and default_block_size([plain], fallback=8) == 8
    for bad in (0, 48, -16, 64.0, True):
        with pytest.raises(ValueError, match=r"layer 1: block_size_hint must be a power of two >= 1 or None, got"):
            FullAttentionSpec(1, 2, 16, 16, torch.bfloat16, block_size_hint=bad)


def test_caches_stored_heads_outer():
    """`heads_outer`: K (and V unless tokens-contiguous) allocated [blocks, Hkv, block_size, D] and handed out as the
    usual [blocks, block_size, Hkv, D] view, zeroed, same bytes; not with keys_contiguous, and not for a flat shape."""
    from mini_infer.contract.caches import CacheTensor

    spec = FullAttentionSpec(0, 4, 16, 8, torch.bfloat16, heads_outer=True)
    cache = spec.allocate(3, 16, torch.device("cpu"))
    k, v = cache["k_cache_0"], cache["v_cache_0"]
    assert k.shape == (3, 16, 4, 16) and k.stride() == (4 * 16 * 16, 16, 16 * 16, 1)
    assert v.shape == (3, 16, 4, 8) and v.stride() == (4 * 16 * 8, 8, 16 * 8, 1) and not v.any()
    assert spec.bytes_per_token() == FullAttentionSpec(0, 4, 16, 8, torch.bfloat16).bytes_per_token()
    assert "(heads outer)" in spec.describe()
    fp8 = FullAttentionSpec(1, 4, 16, 8, torch.float8_e4m3fn, (1.0, 1.0), True, heads_outer=True)
    k_t, v_t = fp8.tensors()
    assert k_t.heads_outer and v_t.keys_contiguous and not v_t.heads_outer
    with pytest.raises(ValueError, match="heads_outer needs a"):
        CacheTensor("v", (4, 8), torch.bfloat16, True, True)
    with pytest.raises(ValueError, match="heads_outer needs a"):
        CacheTensor("latent", (576,), torch.bfloat16, False, True)
