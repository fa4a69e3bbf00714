"""FuseGemmaRMSNorm: Gemma's `(1 + weight)` RMSNorm → mini_infer.gemma_rms_norm, residual add + it →
fused_add_gemma_rms_norm.

Per Gemma 2 layer (L = 2): input, post-attention, pre-feedforward and post-feedforward norms, and the final norm.
Plain: layer 0's input norm (its input is the scaled embedding) and the two post-norms a layer (their inputs are the
attention and MLP outputs): 1 + 2L. Fused with the residual add before them: the pre-feedforward norms, the later
layers' input norms and the final norm: 2L. Llama-form norms (every other family) are not matched.
"""

from collections import Counter

import pytest
import torch
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


def _bf16_gpt_oss(final_norm_weight=None):
    model = load_model("tiny-gpt-oss", dtype="bfloat16", device="cpu").model
    if final_norm_weight is not None:
        model.model.norm.weight.data[0] = final_norm_weight
    return model


def test_fp32_weighted_norms_taken_over_weight_minus_one():
    """GPT-OSS's norm in bf16 (`(weight * normed_fp32).to(bf16)`, fuse_rmsnorm leaves it) as gemma_rms_norm over an
    fp32 `weight - 1`: every norm taken, the original weights dropped, the logits bit-equal to the captured graph's."""
    model = _bf16_gpt_oss()
    captured = compile_model(model, passes=["cleanup"], device="cpu")
    cm = compile_model(model, passes=["cleanup", "fuse_rmsnorm", "fuse_gemma_rmsnorm"], device="cpu")
    rows = {s.name: s for s in cm.stats}
    assert rows["fuse_rmsnorm"].num_matches == 0
    assert rows["fuse_gemma_rmsnorm"].num_matches == 1 + 2 * L
    assert rows["fuse_gemma_rmsnorm"].note.endswith(f"({1 + 2 * L} of them fp32-weighted norms over weight - 1)")
    counts = Counter(n.meta.get("op") for n in cm.graph_module.graph.nodes)  # (ops bound to their kernels)
    assert (counts[mi.gemma_rms_norm.default], counts[mi.fused_add_gemma_rms_norm.default]) == (1, 2 * L)
    buffers = {n: t for n, t in cm.graph_module.named_buffers() if n.endswith("_minus_one")}
    norms = {f"model_{n}".replace(".", "_"): p for n, p in model.named_parameters() if "norm" in n}
    assert len(buffers) == 1 + 2 * L and not any("norm" in n for n, _ in cm.graph_module.named_parameters())
    for name, shifted in buffers.items():
        original = norms[name.removesuffix("_minus_one")]
        assert shifted.dtype == torch.float32 and torch.equal(shifted + 1, original.float())
    for num in (1, 9, 33):
        ids, pos = torch.randint(0, 500, (1, num)), torch.arange(num)[None]
        assert torch.equal(cm(**cm.example_inputs(ids, pos)), captured(**captured.example_inputs(ids, pos)))


def test_weight_that_does_not_round_trip_is_left():
    """A weight whose `1 + (weight - 1)` is not itself in fp32 (an element of 1e-30) keeps its norm as captured."""
    cm = compile_model(_bf16_gpt_oss(final_norm_weight=1e-30), passes=["cleanup", "fuse_gemma_rmsnorm"],
                       device="cpu")
    (row,) = [s for s in cm.stats if s.name == "fuse_gemma_rmsnorm"]
    assert row.num_matches == 2 * L and row.note.endswith("; 1 weights left, not exact as weight - 1)")
    assert op_counts(cm.graph_module)[aten.rsqrt.default] == 1
