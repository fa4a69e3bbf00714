"""GemvLinear: weight linears → mini_infer.linear (F.linear numerics; a GEMV kernel for one row on CUDA).

Every `aten.linear` whose weight (and bias) are parameters is rewritten, alone and at the end of the full
pipeline (after merge_projections and select_logits, which match `aten.linear`), on all nine tiny presets;
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
def test_last_in_full_pipeline(name):
    gm, ctx, stats = full_pipeline(name)
    assert stats[-1].name == "gemv_linear" and stats[-1].num_matches == op_counts(gm)[mi.linear.default] > 0
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
