"""FuseMoeResidual: fused_moe → (reshape) → fused_add_rms_norm → one linear ⇒ fused_moe_add → rms_norm_linear.

On every tiny MoE preset, with its prerequisites and in the full pipeline (the CUDA one's fusions named at its end):
Mixtral and Qwen3-MoE fuse each MoE block that feeds a next layer's q/k/v (every block but the last, whose norm is the
final one: its rows go through select_logits' gather); Qwen2-MoE and DeepSeek, whose MoE output reaches the add
through a shared expert's sum, fuse nothing. Logits equal eager HF's for several rows and for one (reference kernels,
and the Triton kernels under the interpreter for a one-row step). Off by default, on CUDA too.
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

# name -> MoE blocks fused (each block but the last feeds the next layer's q/k/v through its input norm)
EXPECTED = {"tiny-mixtral": NUM_LAYERS - 1, "tiny-qwen3-moe": NUM_LAYERS - 1, "tiny-qwen2-moe": 0,
            "tiny-deepseek-v2": 0, "tiny-deepseek-v3": 0}
PREREQUISITES = ["fuse_rmsnorm", "route_moe", "merge_projections", "gemv_linear"]


def _check(name, gm, row, selects_logits: bool):
    """Counts as EXPECTED says (without select_logits the last block's final norm feeds lm_head alone: one more);
    each fused_moe_add takes the residual at the MoE output's [T, H] and its sum feeds a norm prologue."""
    fused = EXPECTED[name] + (1 if EXPECTED[name] and not selects_logits else 0)
    counts = op_counts(gm)
    assert row.num_matches == fused and counts[mi.fused_moe_add.default] == fused
    for node in gm.graph.nodes:
        if node.target is mi.fused_moe_add.default:
            hidden, residual = node.args[0], node.args[5]
            assert residual.meta["val"].shape[-1] == hidden.meta["val"].shape[-1] == loaded(name).config.hidden_size
            (back,) = node.users  # reshaped to the add's [1, T, H], read by q/k/v's norm prologue and the next add
            assert any(u.target is mi.rms_norm_linear.default and u.args[0] is back for u in back.users)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_alone(name):
    gm, ctx, stats = run_passes(name, [*PREREQUISITES, "fuse_moe_residual"])
    _check(name, gm, stats[-1], selects_logits=False)
    check_against_eager(name, gm, ctx, 7, 3, seed=3)


def pipeline_with_pass(name: str):
    """The recommended pipeline (a CPU context) with the CUDA pipeline's fusions and this pass named at its end."""
    passes = recommended_passes(new_context(name))
    return run_passes(name, [*passes[1:], "fuse_residual_gemvs", "fuse_gemv_norm", "fuse_moe_residual"])


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_full_pipeline(name):
    gm, ctx, stats = pipeline_with_pass(name)
    _check(name, gm, stats[-1], selects_logits=True)
    check_against_eager(name, gm, ctx, 9, 5, seed=1)
    check_against_eager(name, gm, ctx, 1, 30, seed=2)  # one row: a decode step


def test_one_row_with_triton_kernels():
    """The full pipeline's graph bound to the Triton kernels (interpreter): a one-row step runs the MoE add and the
    one-pass norm kernels and gives eager HF's logits."""
    gm, ctx, _ = pipeline_with_pass("tiny-qwen3-moe")
    bound, names = bound_copy(gm, "triton")
    assert {"fused_moe_add_triton", "rms_norm_linear_triton"} <= names
    ids, pos = random_ids(1, 7), positions(12, 1)
    assert_logits_close(graph_logits(bound, ctx, ids, pos), eager_logits("tiny-qwen3-moe", ids, pos))


def test_off_by_default():
    config = loaded("tiny-qwen3-moe").config
    for device in (torch.device("cuda"), CPU):
        names = [p.name for p in recommended_passes(PassContext(config=config, device=device, dtype=torch.float32))]
        assert "fuse_moe_residual" not in names
