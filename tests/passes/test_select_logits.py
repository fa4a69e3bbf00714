"""SelectLogits: lm_head runs only on the rows named by the new graph input `logits_indices`."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.passes.helpers import (
    ARCHS,
    FEW,
    assert_logits_close,
    aten,
    eager_logits,
    full_pipeline,
    graph_logits,
    mi,
    op_counts,
    placeholder_names,
    positions,
    random_ids,
    single_pass,
    start_pos,
)


def _check_graph(gm, num_matches):
    assert num_matches == 1
    assert "logits_indices" in placeholder_names(gm)
    assert op_counts(gm)[aten.index_select.default] == 1
    heads = (aten.linear.default, mi.linear.default)  # the full pipeline ends with gemv_linear
    (head,) = [n for n in gm.graph.nodes if n.target in heads and n.args[0].target is aten.index_select.default]
    assert head.args[0].args[2].name == "logits_indices"


@pytest.mark.parametrize("name", ARCHS)
def test_gathers_before_lm_head(name):
    gm, ctx, stats = single_pass(name, "select_logits")
    _check_graph(gm, stats[0].num_matches)
    # by default (verification inputs) only the last row is computed
    ids, pos = random_ids(9, 0), positions(0, 9)
    assert_logits_close(graph_logits(gm, ctx, ids, pos), eager_logits(name, ids, pos)[:, -1:])


@pytest.mark.parametrize("name", ARCHS)
def test_in_full_pipeline(name):
    gm, ctx, stats = full_pipeline(name)
    (row,) = [s for s in stats if s.name == "select_logits"]
    _check_graph(gm, row.num_matches)
    assert [s.name for s in stats][0] == "select_logits"  # right after cleanup (stage "cleanup")


@st.composite
def _rows(draw):
    num = draw(st.integers(1, 40))
    idx = draw(st.lists(st.integers(0, num - 1), min_size=1, max_size=6))  # any order, repeats allowed
    return num, idx


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3", "tiny-mixtral", "tiny-deepseek-v3"])
@given(rows=_rows(), start=start_pos)
@FEW
def test_rows_equal_eager_at_indices(name, rows, start):
    num, idx = rows
    gm, ctx, _ = single_pass(name, "select_logits")
    ids, pos = random_ids(num, seed=start), positions(start, num)
    out = graph_logits(gm, ctx, ids, pos, logits_indices=torch.tensor(idx))
    assert out.shape[:2] == (1, len(idx))
    assert_logits_close(out, eager_logits(name, ids, pos)[:, idx])
