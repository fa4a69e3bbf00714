"""FuseMoeResidual: fused_moe → (reshapes) → fused_add_rms_norm ⇒ fused_moe_add → (reshapes) → rms_norm.

On every tiny MoE preset, with its prerequisites: Mixtral's and Qwen3-MoE's MoE outputs (every layer) fuse, while
Qwen2-MoE's (a gated shared expert added first) and DeepSeek's (shared experts) stay (counts hard-coded); logits
equal eager HF. In the CUDA pipeline fuse_residual_gemvs then folds the plain norm into q/k/v's GEMV (the
between-layers norm; the final one stays with select_logits' gather), and the graph bound to the Triton kernels
(interpreter) gives eager HF's logits for a one-row step. On CUDA the pass is on for MoE models only, before
fuse_residual_gemvs.
"""

import pytest
import torch

from mini_infer.passes import PassContext, recommended_passes
from tests.passes.helpers import (
    CPU,
    NUM_LAYERS,
    assert_logits_close,
    bound_copy,
    check_against_eager,
    eager_logits,
    graph_logits,
    loaded,
    mi,
    new_context,
    op_counts,
    positions,
    random_ids,
    run_passes,
)

PREREQUISITES = ["fuse_rmsnorm", "merge_projections", "route_moe", "gemv_linear"]
# preset -> MoE blocks whose output fuses (every tiny preset has NUM_LAYERS layers)
EXPECTED = {"tiny-mixtral": NUM_LAYERS, "tiny-qwen3-moe": NUM_LAYERS, "tiny-qwen2-moe": 0, "tiny-deepseek-v2": 0,
            "tiny-deepseek-v3": 0}


@pytest.mark.parametrize("name", EXPECTED)
def test_fuses_each_moe_output_into_its_residual_add(name):
    before = op_counts(run_passes(name, PREREQUISITES)[0])
    gm, ctx, stats = run_passes(name, [*PREREQUISITES, "fuse_moe_residual"])
    fused, counts = EXPECTED[name], op_counts(gm)
    assert stats[-1].num_matches == fused
    assert counts[mi.fused_moe_add.default] == fused and counts[mi.rms_norm.default] == before[mi.rms_norm.default] + fused
    assert counts[mi.fused_moe.default] == before[mi.fused_moe.default] - fused
    assert counts[mi.fused_add_rms_norm.default] == before[mi.fused_add_rms_norm.default] - fused
    for node in gm.graph.nodes:
        if node.target is mi.fused_moe_add.default:  # its sum feeds the norm, and the rest of the layer
            assert any(u.target is mi.rms_norm.default for u in node.users for u in [u, *u.users])
    if fused:  # (the others' graphs are their prerequisites')
        check_against_eager(name, gm, ctx, 7, 3, seed=3)
        check_against_eager(name, gm, ctx, 1, 20, seed=4)  # one row: a decode step


def cuda_pipeline(name: str):
    """The recommended pipeline (a CPU context, which leaves the CUDA passes out) with fuse_moe_residual,
    fuse_residual_gemvs and fuse_gemv_norm named at its end, as the CUDA pipeline runs them."""
    passes = recommended_passes(new_context(name))
    return run_passes(name, [*passes[1:], "fuse_moe_residual", "fuse_residual_gemvs", "fuse_gemv_norm"])


@pytest.mark.parametrize("name", ["tiny-qwen3-moe"])
def test_in_the_pipeline_the_norm_goes_into_the_next_gemv(name):
    """Layer 0's MoE output + residual is normalized inside layer 1's q/k/v GEMV (rms_norm_linear); the last one's
    norm stays a launch (select_logits gathers its rows). The graph bound to the Triton kernels gives eager HF's
    logits for a one-row step."""
    gm, ctx, stats = cuda_pipeline(name)
    assert stats[-3].name == "fuse_moe_residual" and stats[-3].num_matches == NUM_LAYERS
    adds = [n for n in gm.graph.nodes if n.target is mi.fused_moe_add.default]
    norm_gemv = [u for n in adds for u in n.users for u in [u, *u.users] if u.target is mi.rms_norm_linear.default]
    assert len(adds) == NUM_LAYERS and len(norm_gemv) == NUM_LAYERS - 1
    check_against_eager(name, gm, ctx, 5, 3, seed=1)
    bound, names = bound_copy(gm, "triton")
    assert {"fused_moe_add_triton", "rms_norm_linear_triton"} <= names
    ids, pos = random_ids(1, 7), positions(12, 1)
    assert_logits_close(graph_logits(bound, ctx, ids, pos), eager_logits(name, ids, pos))


def test_default_on_cuda_for_moe_models_only_before_fuse_residual_gemvs():
    for name, moe in (("tiny-qwen3-moe", True), ("tiny-llama", False)):
        config = loaded(name).config
        for device in (torch.device("cuda"), CPU):
            names = [p.name for p in recommended_passes(PassContext(config=config, device=device,
                                                                    dtype=torch.float32))]
            on = moe and device.type == "cuda"
            assert ("fuse_moe_residual" in names) == on
            if on:
                assert names.index("fuse_moe_residual") + 1 == names.index("fuse_residual_gemvs")
