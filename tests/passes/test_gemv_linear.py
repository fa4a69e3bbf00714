"""GemvLinear: weight linears → mini_infer.linear (F.linear numerics; a GEMV kernel for one row on CUDA).

Every `aten.linear` whose weight (and bias) are parameters is rewritten, alone and near the end of the full
pipeline (after merge_projections and select_logits, which match `aten.linear`; before fuse_norm_gemv, which
folds norms into some of its linears), on all nine tiny presets;
logits equal eager HF; a linear whose weight is computed (not a parameter) is left alone.
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
    mi,
    num_tokens,
    op_counts,
    run_passes,
    run_toy,
    single_pass,
    start_pos,
)


def _weight_linears(gm) -> int:
    return sum(1 for n in gm.graph.nodes if n.target is aten.linear.default and n.args[1].op == "get_attr")


@pytest.mark.parametrize("name", ARCHS)
def test_every_weight_linear_is_rewritten(name):
    before = _weight_linears(run_passes(name, [])[0])  # after cleanup, as the pass sees it
    gm, ctx, stats = single_pass(name, "gemv_linear")
    assert before >= 4 * 2 + 1  # at least q, k, v/o-ish projections per layer and the lm_head
    assert stats[0].num_matches == before == op_counts(gm)[mi.linear.default]
    assert _weight_linears(gm) == 0


@pytest.mark.parametrize("name", ARCHS)
@given(num=num_tokens, start=start_pos)
@FEW
def test_logits_equal_eager(name, num, start):
    gm, ctx, _ = single_pass(name, "gemv_linear")
    check_against_eager(name, gm, ctx, num, start, seed=num * 7 + start)


@pytest.mark.parametrize("name", ARCHS)
def test_lowered_in_full_pipeline(name):
    gm, ctx, stats = full_pipeline(name)
    (row,) = [s for s in stats if s.name == "gemv_linear"]
    # last but fuse_norm_gemv, which folds some of its linears (and the norms before them) into one op each
    counts = op_counts(gm)
    folded = counts[mi.rms_norm_linear.default] + counts[mi.fused_add_rms_norm_linear.default]
    assert stats[-2] is row and stats[-1].name == "fuse_norm_gemv" and stats[-1].num_matches == folded
    assert row.num_matches == counts[mi.linear.default] + folded and counts[mi.linear.default] > 0
    assert _weight_linears(gm) == 0
    check_against_eager(name, gm, ctx, 9, 5, seed=1)


class _Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 16)
        self.mix = torch.nn.Parameter(torch.randn(16, 16))

    def forward(self, x, pos):
        h = self.proj(x)
        w = torch.tanh(self.mix)  # a computed weight: not a parameter read
        return torch.nn.functional.linear(h, w)


def test_computed_weights_stay():
    gm, stats, _ = run_toy(_Toy(), ["gemv_linear"])
    assert stats[0].num_matches == 2  # proj and the toy's lm_head
    assert op_counts(gm)[mi.linear.default] == 2 and op_counts(gm)[aten.linear.default] == 1
