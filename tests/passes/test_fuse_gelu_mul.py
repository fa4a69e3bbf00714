"""FuseGeluMul: the GeLU-tanh gate `gelu(gate, approximate="tanh") * up` → mini_infer.gelu_tanh_and_mul.

Per layer (L = 2): Gemma 2's MLP (hidden_activation gelu_pytorch_tanh) is the only such gate among the tiny presets.
Every other family gates with SiLU (fuse_silu_mul's), and GPT-OSS's experts with a clamped x * sigmoid(alpha x)
(route_moe's): 0, and their graphs are left exactly as they were. In the full pipeline merge_projections runs first,
and gate and up reach the op as the two halves of the merged gate_up output.
"""

import operator

import pytest
import torch
from hypothesis import given

from mini_infer import compile_model
from mini_infer.models.loader import load_model
from mini_infer.passes import recommended_passes
from tests.passes.helpers import (
    ARCHS,
    FEW,
    NUM_LAYERS,
    assert_logits_close,
    aten,
    bound_copy,
    check_against_eager,
    eager_logits,
    graph_logits,
    mi,
    new_context,
    num_tokens,
    op_counts,
    positions,
    random_ids,
    run_passes,
    run_toy,
    single_pass,
    start_pos,
)

L = NUM_LAYERS
EXPECTED = {name: 0 for name in ARCHS} | {"tiny-gemma2": L}


def _check_counts(name, gm, num_matches):
    counts = op_counts(gm)
    assert num_matches == EXPECTED[name]
    assert counts[mi.gelu_tanh_and_mul.default] == EXPECTED[name]
    assert counts[aten.gelu.default] == 0  # the tiny presets have no other gelu


@pytest.mark.parametrize("name", ARCHS)
def test_counts(name):
    gm, ctx, stats = single_pass(name, "fuse_gelu_mul")
    _check_counts(name, gm, stats[0].num_matches)


@pytest.mark.parametrize("name", [n for n in ARCHS if not EXPECTED[n]])
def test_other_families_unchanged(name):
    """No match, and the graph is the cleaned one node for node."""
    gm, _, stats = single_pass(name, "fuse_gelu_mul")
    (before, _, _) = run_passes(name, [])
    assert stats[0].num_matches == 0
    assert str(gm.graph) == str(before.graph)


@given(num=num_tokens, start=start_pos)
@FEW
def test_logits_equal_eager(num, start):
    gm, ctx, _ = single_pass("tiny-gemma2", "fuse_gelu_mul")
    check_against_eager("tiny-gemma2", gm, ctx, num, start, seed=num * 3 + start)


def test_logits_equal_the_unfused_graph_bit_for_bit():
    """The reference is the captured pair's torch ops: the fused graph's logits are the unfused graph's bits, alone
    and after merge_projections (gate and up the two halves of one merged output)."""
    ids, pos = random_ids(13, 7), positions(5, 13)
    for before in ([], ["merge_projections"]):
        fused, unfused = run_passes("tiny-gemma2", [*before, "fuse_gelu_mul"]), run_passes("tiny-gemma2", before)
        assert torch.equal(graph_logits(fused[0], fused[1], ids, pos), graph_logits(unfused[0], unfused[1], ids, pos))


def test_after_merge_projections_takes_the_halves():
    gm, ctx, stats = run_passes("tiny-gemma2", ["merge_projections", "fuse_gelu_mul"])
    calls = [n for n in gm.graph.nodes if n.target == mi.gelu_tanh_and_mul.default]
    assert stats[1].num_matches == len(calls) == L
    for call in calls:
        gate, up = call.args
        assert gate.target is operator.getitem and up.target is operator.getitem
        assert gate.args[0] is up.args[0] and (gate.args[1], up.args[1]) == (0, 1)
        assert gate.args[0].target == aten.split_with_sizes.default
    check_against_eager("tiny-gemma2", gm, ctx, 9, 17, seed=2)


def test_triton_kernel_in_the_graph():
    """The graph bound to the Triton kernels (the interpreter here): the halves' views through the kernel, logits
    within the fp32 contract of eager HF."""
    gm, ctx, _ = run_passes("tiny-gemma2", ["merge_projections", "fuse_gelu_mul"])
    bound, names = bound_copy(gm, "triton")
    assert "gelu_tanh_and_mul_triton" in names
    ids, pos = random_ids(6, 3), positions(2, 6)
    assert_logits_close(graph_logits(bound, ctx, ids, pos), eager_logits("tiny-gemma2", ids, pos))


def pipeline_of(name: str) -> list[str]:
    """`name`'s recommended pipeline (after cleanup): fuse_gelu_mul runs right after fuse_silu_mul (on by default
    since an H200 run showed it wins on gemma-2-2b)."""
    names = [p.name for p in recommended_passes(new_context(name))[1:]]
    assert names.index("fuse_gelu_mul") == names.index("fuse_silu_mul") + 1
    return names


@pytest.mark.parametrize("name", ARCHS)
def test_counts_in_full_pipeline(name):
    gm, ctx, stats = run_passes(name, pipeline_of(name))
    (row,) = [s for s in stats if s.name == "fuse_gelu_mul"]
    _check_counts(name, gm, row.num_matches)


@given(num=num_tokens, start=start_pos)
@FEW
def test_full_pipeline_logits_equal_eager(num, start):
    gm, ctx, _ = run_passes("tiny-gemma2", pipeline_of("tiny-gemma2"))
    check_against_eager("tiny-gemma2", gm, ctx, num, start, seed=num + 5 * start)


def test_bfloat16_matched_and_equal_to_eager():
    """In bf16 HF's gelu rounds to bf16 before the product, as the op's reference does: verification against eager
    HF sees no error."""
    model = load_model("tiny-gemma2", dtype="bfloat16", device="cpu").model
    cm = compile_model(model, passes=["cleanup", "fuse_gelu_mul"], verify=True)
    (row,) = [s for s in cm.stats if s.name == "fuse_gelu_mul"]
    assert row.num_matches == L and row.max_abs_err == 0.0


_ACTS = {
    "gelu_tanh": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
    "gelu": torch.nn.functional.gelu,  # erf GeLU: another function
    "silu": torch.nn.functional.silu,
}


class _Gated(torch.nn.Module):
    def __init__(self, act, reuse=False, broadcast=False):
        super().__init__()
        self.gate = torch.nn.Linear(16, 24, bias=False)
        self.up = torch.nn.Linear(16, 1 if broadcast else 24, bias=False)
        self.down = torch.nn.Linear(24, 16, bias=False)
        self.act, self.reuse = _ACTS[act], reuse

    def forward(self, x, pos):
        g = self.act(self.gate(x))
        out = self.down(g * self.up(x))
        return out + self.down(g) if self.reuse else out


@pytest.mark.parametrize("act, reuse, broadcast, expected", [
    ("gelu_tanh", False, False, 1),
    ("gelu", False, False, 0),  # erf GeLU is not the tanh form: left as captured
    ("silu", False, False, 0),  # fuse_silu_mul's
    ("gelu_tanh", True, False, 0),  # the gelu read elsewhere too
    ("gelu_tanh", False, True, 0),  # a product that broadcasts up
])
def test_matches_gelu_tanh_gate_only(act, reuse, broadcast, expected):
    gm, stats, _ = run_toy(_Gated(act, reuse, broadcast), ["fuse_gelu_mul"])
    assert stats[0].num_matches == expected
    counts = op_counts(gm)
    assert counts[mi.gelu_tanh_and_mul.default] == expected
    if act == "gelu":
        assert counts[aten.gelu.default] == 1
