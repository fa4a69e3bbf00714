"""FuseLookups: the table lookups a step starts with (aten.embedding of a graph-held table by a graph input) → one
`gather_rows` launch.

On every tiny preset, alone (after rotary_table, which makes the position lookups) and at the end of the
recommended pipeline as a CUDA target runs it: the token embedding and the two rotary tables merge into one
gather_rows (DeepSeek-V2's rotary table is complex: it stays, and its lone token embedding with it), no other
aten.embedding is left, logits equal eager HF (references); with the Triton kernels under the interpreter, the CUDA
pipeline's logits on a prefill and a one-row step are bit-equal to the same pipeline without the pass (the op copies
rows). On CUDA the pass is on by default, after rotary_table. Toys: more lookups than one launch takes, lookups by
computed indices and of complex tables, which stay.
"""

import functools

import pytest
import torch
import torch.nn.functional as F

from mini_infer.models.presets import TINY_PRESETS
from mini_infer.ops.gather_rows import MAX_TABLES
from mini_infer.passes import PassContext, recommended_passes
from tests.passes.helpers import (
    ARCHS,
    CPU,
    aten,
    bound_copy,
    check_against_eager,
    graph_logits,
    loaded,
    mi,
    op_counts,
    positions,
    random_ids,
    run_passes,
    run_toy,
)

# preset -> (lookups merged, aten.embedding left): the token embedding + rotary_table's cos and sin tables
MERGED = {name: (3, 0) for name in ARCHS} | {"tiny-deepseek-v2": (0, 2)}  # complex freqs: one complex table


def cuda_names(name: str, with_pass: bool = True) -> list[str]:
    """The recommended pipeline of `name` for a CUDA target (after cleanup), with or without fuse_lookups."""
    ctx = PassContext(config=loaded(name).config, device=torch.device("cuda"), dtype=torch.float32)
    return [p.name for p in recommended_passes(ctx)[1:] if with_pass or p.name != "fuse_lookups"]


@functools.cache
def cuda_pipeline(name: str, with_pass: bool = True):
    return run_passes(name, cuda_names(name, with_pass))


def _check_graph(name, gm, row):
    merged, left = MERGED[name]
    counts = op_counts(gm)
    assert row.name == "fuse_lookups" and row.num_matches == merged
    assert row.note == (f"{merged} lookups in 1 launch" if merged else "1 lookup, nothing to merge")
    assert counts[mi.gather_rows.default] == (1 if merged else 0)
    assert counts[aten.embedding.default] == left
    for node in (n for n in gm.graph.nodes if n.target is mi.gather_rows.default):
        tables, indices = node.args
        assert [i.name for i in indices] == ["input_ids", "position_ids", "position_ids"]
        assert all(t.op == "get_attr" for t in tables)
        assert [u.args[1] for u in node.users] == [0, 1, 2]  # every row read: no lookup dropped


@pytest.mark.parametrize("name", ARCHS)
def test_alone_after_rotary_table(name):
    gm, ctx, stats = run_passes(name, ["rotary_table", "fuse_lookups"])
    _check_graph(name, gm, stats[-1])
    check_against_eager(name, gm, ctx, 9, 5, seed=1)


@pytest.mark.parametrize("name", ARCHS)
def test_in_the_cuda_pipeline(name):
    gm, ctx, stats = cuda_pipeline(name)
    _check_graph(name, gm, next(s for s in stats if s.name == "fuse_lookups"))
    check_against_eager(name, gm, ctx, 9, 5, seed=1)
    check_against_eager(name, gm, ctx, 1, 30, seed=2)  # one row: a decode step


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-deepseek-v3"])
def test_triton_kernels_bit_equal_to_the_pipeline_without_the_pass(name):
    """Bound to the Triton kernels (interpreted), the graph gives the logits of the pipeline without fuse_lookups bit
    for bit: gather_rows copies the rows the lookups copied."""
    (gm, ctx, _), (ref, ref_ctx, _) = cuda_pipeline(name), cuda_pipeline(name, with_pass=False)
    bound, called = bound_copy(gm, "triton")
    ref_bound, _ = bound_copy(ref, "triton")
    assert "gather_rows_triton" in called
    for num, start, seed in ((6, 0, 3), (1, 17, 4)):
        ids, pos = random_ids(num, seed), positions(start, num)
        got, want = graph_logits(bound, ctx, ids, pos), graph_logits(ref_bound, ref_ctx, ids, pos)
        assert torch.equal(got, want)


def test_default_on_cuda_only_after_rotary_table():
    config = loaded("tiny-llama").config
    for device, on in ((torch.device("cuda"), True), (CPU, False)):
        names = [p.name for p in recommended_passes(PassContext(config=config, device=device, dtype=torch.float32))]
        assert ("fuse_lookups" in names) == on
        if on:
            assert names.index("fuse_lookups") == names.index("rotary_table") + 1


# -- toys: how many a launch takes, and what must stay as it is -------------------------------------------------


class _Tables(torch.nn.Module):
    """x + the rows of `n` position tables (32 x 16) at position_ids, + one at position_ids + 1 (a computed index:
    stays) and, with `complex_table`, the real part of a complex table's rows (stays)."""

    def __init__(self, n: int, complex_table: bool = False) -> None:
        super().__init__()
        self.tables = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(32, 16)) for _ in range(n)])
        self.shifted = torch.nn.Parameter(torch.randn(32, 16))
        self.register_buffer("freqs", torch.polar(torch.ones(32, 16), torch.randn(32, 16)) if complex_table else None)

    def forward(self, x, pos):
        for t in self.tables:
            x = x + F.embedding(pos, t)
        x = x + F.embedding(pos + 1, self.shifted)
        if self.freqs is not None:
            x = x + torch.view_as_real(F.embedding(pos, self.freqs))[..., 0]
        return x


@pytest.mark.parametrize("n, fused_ops", [(1, 1), (MAX_TABLES, 1), (2 * MAX_TABLES - 1, 2), (2 * MAX_TABLES + 1, 3)])
def test_lookups_merge_in_graph_order_max_tables_a_launch(n, fused_ops):
    """The token embedding and n position tables: n + 1 lookups, MAX_TABLES a launch; a last group of one stays."""
    gm, stats, _ = run_toy(_Tables(n), ["fuse_lookups"])  # run_toy checks the logits against the eager model
    total = n + 1
    merged = total - (1 if total % MAX_TABLES == 1 else 0)
    counts = op_counts(gm)
    assert stats[0].num_matches == merged
    assert counts[mi.gather_rows.default] == fused_ops
    assert counts[aten.embedding.default] == 1 + total - merged  # the computed index's lookup, a group of one
    sizes = [len(node.args[0]) for node in gm.graph.nodes if node.target is mi.gather_rows.default]
    assert sizes == [min(MAX_TABLES, merged - i) for i in range(0, merged, MAX_TABLES)]


def test_computed_indices_and_complex_tables_stay():
    gm, stats, _ = run_toy(_Tables(1, complex_table=True), ["fuse_lookups"])
    assert stats[0].num_matches == 2 and op_counts(gm)[aten.embedding.default] == 2  # shifted and complex stay
    gm, stats, _ = run_toy(_Tables(0), ["fuse_lookups"])
    assert stats[0].num_matches == 0 and stats[0].note == "1 lookup, nothing to merge"
    assert op_counts(gm)[mi.gather_rows.default] == 0


def test_every_preset_is_covered():
    assert set(MERGED) == set(TINY_PRESETS)
