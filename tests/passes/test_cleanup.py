"""Cleanup: removes export's runtime asserts, no-op casts and views and dead code, never changes a value."""

import pytest
from hypothesis import given

from tests.passes.helpers import (
    ARCHS,
    FEW,
    aten,
    captured,
    check_against_eager,
    copy_gm,
    new_context,
    num_tokens,
    op_counts,
    start_pos,
)

_ASSERTS = (aten._assert_tensor_metadata.default, aten._assert_scalar.default,
            aten.sym_constrain_range_for_size.default)


def _cleaned_copy(name):
    from mini_infer.passes import resolve_passes
    from mini_infer.passes.manager import PassManager

    gm, ctx = copy_gm(captured(name)), new_context(name)
    stats = PassManager(resolve_passes(["cleanup"])).run(gm, ctx)
    return gm, ctx, stats


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2-moe", "tiny-deepseek-v3"])
def test_removes_asserts_and_noops(name):
    before = op_counts(captured(name))
    assert sum(before[a] for a in _ASSERTS) > 0  # export left some: the test has something to check
    gm, ctx, stats = _cleaned_copy(name)
    after = op_counts(gm)
    assert sum(after[a] for a in _ASSERTS) == 0
    assert stats[0].num_matches > 0 and stats[0].nodes_after < stats[0].nodes_before
    assert ctx.applied == ["cleanup"]
    # the raw capture is untouched (tests rely on copies being independent)
    assert op_counts(captured(name)) == before
    for node in gm.graph.nodes:  # no cast to the dtype a tensor already has survives
        if node.target in (aten.to.dtype, aten._to_copy.default):
            assert node.args[0].meta["val"].dtype != node.meta["val"].dtype, node.format_node()


@pytest.mark.parametrize("name", ARCHS)
@given(num=num_tokens, start=start_pos)
@FEW
def test_cleaned_graph_equals_eager(name, num, start):
    from tests.passes.helpers import _cleaned

    check_against_eager(name, _cleaned(name), new_context(name, ("cleanup",)), num, start, seed=start)
