"""PagedAttention: every SDPA → mini_infer.paged_attention over per-layer paged caches fed as graph inputs.

Checked per architecture: one match per layer, no SDPA left, the new graph inputs, the declared cache
layouts; logits equal eager HF for one sequence (new T and positions), for three sequences packed in one row
with hand-built metadata (block size 4, shuffled block ids, NaN in unused cache slots), and across two steps
that share the cache (prefill, then decode or a second chunk). tiny-mistral's window is 8 tokens: the
sequences here are longer, and a copy of its graph with the window switched off must disagree with eager.
"""

import copy
import math
import re

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from mini_infer.models.presets import preset_config
from mini_infer.passes.paged_attention import layer_sliding_window
from tests.passes.helpers import (
    ARCHS,
    CACHE_BLOCK,
    FEW,
    METADATA_INPUTS,
    NUM_LAYERS,
    PagedCache,
    assert_logits_close,
    aten,
    check_against_eager,
    copy_gm,
    eager_logits,
    full_pipeline,
    mi,
    num_tokens,
    op_counts,
    placeholder_names,
    positions,
    random_ids,
    run_graph,
    single_pass,
    start_pos,
    step_inputs,
)

L = NUM_LAYERS
# name -> (num_kv_heads, head_size, head_size_v, sliding_window)
SPECS = {
    "tiny-llama": (2, 16, 16, None),
    "tiny-qwen2": (2, 16, 16, None),
    "tiny-qwen3": (2, 32, 32, None),
    "tiny-mistral": (2, 16, 16, 8),
    "tiny-mixtral": (2, 16, 16, None),
    "tiny-qwen2-moe": (2, 16, 16, None),
    "tiny-qwen3-moe": (2, 16, 16, None),
    # MLA attends with decompressed K/V: 4 heads, K = nope 16 + rope 8, V = 16
    "tiny-deepseek-v2": (4, 24, 16, None),
    "tiny-deepseek-v3": (4, 24, 16, None),
    # Gemma 2: every other layer slides (layer 0 does); captured through mini_infer.attention, soft-capped
    "tiny-gemma2": (2, 16, 16, (8, None)),
    # GPT-OSS: the same alternation (layer 0 slides), captured through mini_infer.attention with its sinks
    "tiny-gpt-oss": (2, 16, 16, (8, None)),
}
SOFTCAP = {"tiny-gemma2": 0.05}  # the config's attn_logit_softcapping, carried by the captured node
assert set(SPECS) == set(ARCHS)
CACHE_INPUTS = [f"{kv}_cache_{i}" for i in range(L) for kv in ("k", "v")]
# In the full pipeline DeepSeek's attention goes to mla_latent_cache instead (tests/passes/test_mla_latent_cache.py)
NOT_MLA = [a for a in ARCHS if not a.startswith("tiny-deepseek")]


def _check_graph(name, gm, ctx, num_matches):
    counts = op_counts(gm)
    assert num_matches == L
    assert counts[mi.paged_attention.default] == L
    assert counts[aten.scaled_dot_product_attention.default] == 0
    names = placeholder_names(gm)
    assert names[:2] == ["input_ids", "position_ids"]
    assert [n for n in names if n not in ("input_ids", "position_ids", "logits_indices")] == [
        *METADATA_INPUTS, *CACHE_INPUTS]
    hkv, d, dv, window = SPECS[name]
    specs = ctx.cache_specs
    assert [(s.layer_idx, s.k_input, s.v_input) for s in specs] == [
        (i, f"k_cache_{i}", f"v_cache_{i}") for i in range(L)]
    windows = window if isinstance(window, tuple) else (window,) * L
    for s in specs:
        assert (s.num_kv_heads, s.head_size, s.head_size_v, s.attention_window) == (hkv, d, dv, windows[s.layer_idx])
        assert s.dtype == torch.float32
        assert s.bytes_per_token() == hkv * (d + dv) * 4
    nodes = [n for n in gm.graph.nodes if n.target is mi.paged_attention.default]
    for i, n in enumerate(nodes):  # (q, k, v, k_cache, v_cache, 4 metadata, scale, sliding_window, softcap)
        assert n.args[9] == pytest.approx(d ** -0.5)
        assert n.args[10] == (windows[i] or 0) and n.args[11] == SOFTCAP.get(name, 0.0)
    assert [n.args[3].name for n in nodes] == [f"k_cache_{i}" for i in range(L)]


@pytest.mark.parametrize("name", ARCHS)
def test_graph_inputs_and_cache_specs(name):
    gm, ctx, stats = single_pass(name, "paged_attention")
    _check_graph(name, gm, ctx, stats[0].num_matches)


@pytest.mark.parametrize("name", NOT_MLA)
def test_in_full_pipeline(name):
    gm, ctx, stats = full_pipeline(name)
    (row,) = [s for s in stats if s.name == "paged_attention"]
    _check_graph(name, gm, ctx, row.num_matches)


@pytest.mark.parametrize("name", ARCHS)
@given(num=num_tokens, start=start_pos)
@example(num=23, start=100)  # past tiny-mistral's 8-token window, over two of the example's 16-token blocks
@FEW
def test_single_sequence_equals_eager(name, num, start):
    gm, ctx, _ = single_pass(name, "paged_attention")
    check_against_eager(name, gm, ctx, num, start, seed=num + 11 * start)


def test_sliding_window_matters():
    """With the window switched off in a copy of tiny-mistral's graph, the logits no longer match eager."""
    gm, ctx, _ = single_pass("tiny-mistral", "paged_attention")
    wide = copy_gm(gm)
    for n in wide.graph.nodes:
        if n.target is mi.paged_attention.default:
            n.args = (*n.args[:10], 0, *n.args[11:])
    wide.recompile()
    check_against_eager("tiny-mistral", gm, ctx, 20, 5)
    with pytest.raises(AssertionError, match=re.escape("max |logits - eager|")):
        check_against_eager("tiny-mistral", wide, ctx, 20, 5)


def test_sliding_window_per_layer_from_real_configs():
    qwen2, mistral = preset_config("qwen2.5-7b"), preset_config("mistral-7b")
    assert [layer_sliding_window(qwen2, i) for i in (0, 27)] == [None, None]  # use_sliding_window=False
    assert [layer_sliding_window(mistral, i) for i in (0, 31)] == [4096, 4096]
    assert layer_sliding_window(preset_config("mixtral-8x7b"), 0) is None


# -- hand-built metadata ----------------------------------------------------------------------------------


def _pack(lens, starts, ctx, seed):
    cache = PagedCache(ctx, sum(math.ceil(n / CACHE_BLOCK) for n in lens) + 3, seed)
    seqs = [(random_ids(n, seed + i), positions(s, n)) for i, (n, s) in enumerate(zip(lens, starts))]
    ids = torch.cat([i for i, _ in seqs], 1)
    pos = torch.cat([p for _, p in seqs], 1)
    tables = [cache.table(n) for n in lens]
    return seqs, step_inputs(ids, pos, [(0, n) for n in lens], tables, cache)


lens3 = st.lists(st.integers(1, 24), min_size=3, max_size=3)
starts3 = st.lists(st.integers(0, 200), min_size=3, max_size=3)


@pytest.mark.parametrize("name", ARCHS)
@given(lens=lens3, starts=starts3)
@example(lens=[13, 3, 20], starts=[0, 50, 7])
@FEW
def test_three_packed_sequences_equal_eager_per_sequence(name, lens, starts):
    gm, ctx, _ = single_pass(name, "paged_attention")
    seqs, inputs = _pack(lens, starts, ctx, seed=sum(lens))
    out = run_graph(gm, inputs)
    assert out.shape[1] == sum(lens)
    row = 0
    for (ids, pos), n in zip(seqs, lens):
        assert_logits_close(out[:, row:row + n], eager_logits(name, ids, pos))
        row += n


@pytest.mark.parametrize("name", ARCHS)
@given(prompt=st.integers(1, 24), new=st.integers(1, 6), start=start_pos)
@example(prompt=12, new=1, start=0)  # decode one token after a prompt longer than tiny-mistral's window
@FEW
def test_two_steps_share_the_cache(name, prompt, new, start):
    """Step 1 prefills `prompt` tokens; step 2 feeds `new` more (1: decode) reading step 1's K/V from the cache."""
    gm, ctx, _ = single_pass(name, "paged_attention")
    total = prompt + new
    ids, pos = random_ids(total, seed=prompt * 5 + new), positions(start, total)
    cache = PagedCache(ctx, math.ceil(total / CACHE_BLOCK) + 2, seed=total)
    table = cache.table(total)
    first = run_graph(gm, step_inputs(ids[:, :prompt], pos[:, :prompt], [(0, prompt)], [table], cache))
    second = run_graph(gm, step_inputs(ids[:, prompt:], pos[:, prompt:], [(prompt, new)], [table], cache))
    ref = eager_logits(name, ids, pos)
    assert_logits_close(first, eager_logits(name, ids[:, :prompt], pos[:, :prompt]))
    assert_logits_close(second, ref[:, prompt:])


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mistral", "tiny-qwen3-moe", "tiny-deepseek-v2",
                                  "tiny-deepseek-v3"])
def test_full_pipeline_mixed_batch(name):
    """The full pipeline on one step mixing a decode, a prefill and a chunk, sampling each sequence's last row
    (DeepSeek's attention is mla_latent_cache's there: one latent cache per layer)."""
    gm, ctx, _ = full_pipeline(name)
    lens = [15, 9, 18]
    cache = PagedCache(ctx, 20, seed=3)
    seqs = [(random_ids(n, 40 + i), positions(3 * i, n)) for i, n in enumerate(lens)]
    tables = [cache.table(n) for n in lens]
    # step 1: prefill the first 14 tokens of seq 0 and the first 10 of seq 2 (seq 1 not yet scheduled)
    step1 = step_inputs(torch.cat([seqs[0][0][:, :14], seqs[2][0][:, :10]], 1),
                         torch.cat([seqs[0][1][:, :14], seqs[2][1][:, :10]], 1),
                         [(0, 14), (0, 10)], [tables[0], tables[2]], cache)
    run_graph(gm, {**step1, "logits_indices": torch.tensor([13, 23])})
    # step 2: decode seq 0, prefill all of seq 1, the remaining 8 tokens of seq 2
    ids = torch.cat([seqs[0][0][:, 14:], seqs[1][0], seqs[2][0][:, 10:]], 1)
    pos = torch.cat([seqs[0][1][:, 14:], seqs[1][1], seqs[2][1][:, 10:]], 1)
    step2 = step_inputs(ids, pos, [(14, 1), (0, 9), (10, 8)], tables, cache)
    out = run_graph(gm, {**step2, "logits_indices": torch.tensor([0, 9, 17])})
    assert out.shape == (1, 3, out.shape[2])
    for i, (sid, spos) in enumerate(seqs):
        assert_logits_close(out[:, i], eager_logits(name, sid, spos)[:, -1])


class _NoAttention(torch.nn.Module):
    def forward(self, x, pos):
        return x * 2


def test_no_attention_no_match():
    """A graph without SDPA gains no inputs and declares no cache."""
    from tests.passes.helpers import run_toy

    gm, stats, _ = run_toy(_NoAttention(), ["paged_attention"])
    assert stats[0].num_matches == 0 and placeholder_names(gm) == ["input_ids", "position_ids"]


def test_caches_are_written_in_place():
    gm, ctx, _ = single_pass("tiny-llama", "paged_attention")
    cache = PagedCache(ctx, 4, seed=0)
    before = copy.deepcopy(cache.caches)
    inputs = step_inputs(random_ids(6, 0), positions(0, 6), [(0, 6)], [cache.table(6)], cache)
    run_graph(gm, inputs)
    slots = inputs["slot_mapping"]
    for name, c in cache.caches.items():
        written = c.view(-1, *c.shape[2:])[slots]
        assert torch.isfinite(written).all(), name
        untouched = torch.ones(c.shape[0] * CACHE_BLOCK, dtype=torch.bool)
        untouched[slots] = False
        assert torch.isnan(c.view(-1, *c.shape[2:])[untouched]).all()
        assert torch.isnan(before[name]).all()
