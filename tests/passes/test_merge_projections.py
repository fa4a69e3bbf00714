"""MergeProjections: linears sharing an input → one linear + split.

Per architecture (L = 2), counts observed once and pinned: dense families merge q/k/v and gate/up in each
layer (2 groups per layer, 3 + 2 GEMMs → 2, i.e. 3 fewer per layer); Mixtral and Qwen3-MoE merge q/k/v only
(their experts run as batched matmuls, not linears); Qwen2-MoE also merges its shared expert with the
router and shared-expert gate; DeepSeek merges the dense MLP and the shared experts' gate/up.
"""

import pytest
import torch
from hypothesis import given

from tests.passes.helpers import (
    ARCHS,
    FEW,
    aten,
    check_against_eager,
    full_pipeline,
    loaded,
    num_tokens,
    op_counts,
    run_passes,
    single_pass,
    start_pos,
)

# (merged groups, GEMMs removed, linears left)
EXPECTED = {
    "tiny-llama": (4, 6, 9),
    "tiny-qwen2": (4, 6, 9),
    "tiny-qwen3": (4, 6, 9),
    "tiny-mistral": (4, 6, 9),
    "tiny-mixtral": (2, 4, 7),
    "tiny-qwen2-moe": (4, 10, 9),
    "tiny-qwen3-moe": (2, 4, 7),
    "tiny-deepseek-v2": (4, 4, 12),
    "tiny-deepseek-v3": (4, 4, 14),
    "tiny-gemma2": (4, 6, 9),
    "tiny-gpt-oss": (2, 4, 7),  # q/k/v with their biases; no dense MLP (experts only); the router stays
}
assert set(EXPECTED) == set(ARCHS)


@pytest.mark.parametrize("name", ARCHS)
def test_counts(name):
    gm, ctx, stats = single_pass(name, "merge_projections")
    groups, removed, left = EXPECTED[name]
    assert stats[0].num_matches == groups
    assert stats[0].note == f"{removed} GEMMs fewer"
    counts = op_counts(gm)
    before = op_counts(run_passes(name, [])[0])  # DeepSeek has splits of its own (q nope/rope, kv/k_pe)
    assert counts[aten.linear.default] == left
    assert counts[aten.split_with_sizes.default] - before[aten.split_with_sizes.default] == groups


@pytest.mark.parametrize("name", ARCHS)
@given(num=num_tokens, start=start_pos)
@FEW
def test_logits_equal_eager(name, num, start):
    gm, ctx, _ = single_pass(name, "merge_projections")
    check_against_eager(name, gm, ctx, num, start, seed=num * 5 + start)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_merged_weights_are_the_concatenation(name):
    """The merged weight is exactly [w_q; w_k; w_v] (and biases likewise for Qwen2's q/k/v bias)."""
    gm, ctx, _ = single_pass(name, "merge_projections")
    merged = [t for n, t in gm.named_buffers() if n.startswith("merged_") and n.endswith("_weight")]
    def p(name_: str) -> torch.Tensor:  # the HF model's own weights (the graph dropped the unmerged ones)
        return loaded(name).model.get_parameter(f"model.layers.0.self_attn.{name_}")

    qkv = torch.cat([p("q_proj.weight"), p("k_proj.weight"), p("v_proj.weight")], 0)
    assert any(t.shape == qkv.shape and torch.equal(t, qkv) for t in merged)
    if name == "tiny-qwen2":
        biases = [t for n, t in gm.named_buffers() if n.startswith("merged_") and n.endswith("_bias")]
        b = torch.cat([p("q_proj.bias"), p("k_proj.bias"), p("v_proj.bias")])
        assert any(torch.equal(t, b) for t in biases)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
@given(num=num_tokens, start=start_pos)
@FEW
def test_full_pipeline_with_merge(name, num, start):
    gm, ctx, stats = full_pipeline(name)
    assert "merge_projections" in ctx.applied
    check_against_eager(name, gm, ctx, num, start, seed=num + start)
