"""FuseGemmaRMSNorm: Gemma's `(1 + weight)` RMSNorm → mini_infer.gemma_rms_norm, residual add + it →
fused_add_gemma_rms_norm.

Per Gemma 2 layer (L = 2): input, post-attention, pre-feedforward and post-feedforward norms, and the final norm.
Plain: layer 0's input norm (its input is the scaled embedding) and the two post-norms a layer (their inputs are the
attention and MLP outputs): 1 + 2L. Fused with the residual add before them: the pre-feedforward norms, the later
layers' input norms and the final norm: 2L. Llama-form norms (every other family) are not matched.
"""

import pytest
from hypothesis import given

from mini_infer import compile_model
from mini_infer.models.loader import load_model
from tests.passes.helpers import (
    ARCHS,
    FEW,
    NUM_LAYERS,
    aten,
    check_against_eager,
    full_pipeline,
    mi,
    num_tokens,
    op_counts,
    single_pass,
    start_pos,
)

L = NUM_LAYERS
EXPECTED = {name: (0, 0) for name in ARCHS} | {"tiny-gemma2": (1 + 2 * L, 2 * L)}


def _check(name, gm, num_matches):
    plain, fused = EXPECTED[name]
    counts = op_counts(gm)
    assert num_matches == plain + fused
    assert counts[mi.gemma_rms_norm.default] == plain
    assert counts[mi.fused_add_gemma_rms_norm.default] == fused
    if plain + fused:  # every norm of the graph taken: no rsqrt left
        assert counts[aten.rsqrt.default] == 0


@pytest.mark.parametrize("name", ARCHS)
def test_alone(name):
    gm, ctx, stats = single_pass(name, "fuse_gemma_rmsnorm")
    _check(name, gm, stats[0].num_matches)


@pytest.mark.parametrize("name", ARCHS)
def test_in_full_pipeline(name):
    gm, ctx, stats = full_pipeline(name)
    (row,) = [s for s in stats if s.name == "fuse_gemma_rmsnorm"]
    _check(name, gm, row.num_matches)


@given(num=num_tokens, start=start_pos)
@FEW
def test_logits_equal_eager(num, start):
    gm, ctx, _ = single_pass("tiny-gemma2", "fuse_gemma_rmsnorm")
    check_against_eager("tiny-gemma2", gm, ctx, num, start, seed=num + start)


def test_bfloat16_norms_matched_and_equal_to_eager():
    """In bf16 HF's norm adds casts (x.float(), weight.float(), type_as): every norm is matched all the same and
    verification against eager HF sees no error (the op's rounding itself: tests/ops/test_gemma_rms_norm.py)."""
    model = load_model("tiny-gemma2", dtype="bfloat16", device="cpu").model
    cm = compile_model(model, passes=["cleanup", "fuse_gemma_rmsnorm"], verify=True)
    (row,) = [s for s in cm.stats if s.name == "fuse_gemma_rmsnorm"]
    assert row.num_matches == 1 + 4 * L and row.max_abs_err == 0.0
