"""FuseNormGemv: a norm whose output feeds exactly one weight linear → rms_norm_linear / fused_add_rms_norm_linear.

On every dense tiny preset: with its prerequisites, the input norm and the post-attention norm of every layer fuse
into the merged q/k/v and gate/up GEMVs (counts hard-coded per preset; without select_logits the final norm fuses
into lm_head too), and no layer norm fuses before merge_projections
(a norm then feeds three or two linears); the same added to the end of the recommended pipeline, where it runs
last and the dump shows the new ops; logits equal eager HF (reference kernels, and the Triton kernels under the
interpreter for a one-row step, the fused kernel's case). Toys: a norm with a second reader, a norm reaching its
linear through a view, and a residual sum read before the linear; the pass is opt-in (measured slower on a GPU),
so the recommended pipeline leaves it out.
"""

import pytest
import torch
from hypothesis import given

from mini_infer.models.presets import TINY_DENSE_PRESETS
from mini_infer.passes import PassContext, recommended_passes
from mini_infer.passes.manager import write_graph
from tests.passes.helpers import (
    CPU,
    FEW,
    NUM_LAYERS,
    VOCAB,
    ToyRMSNorm,
    assert_logits_close,
    bound_copy,
    check_against_eager,
    eager_logits,
    graph_logits,
    loaded,
    mi,
    new_context,
    num_tokens,
    op_counts,
    positions,
    random_ids,
    run_passes,
    run_toy,
    start_pos,
)

L = NUM_LAYERS
PREREQUISITES = ["fuse_rmsnorm", "merge_projections", "gemv_linear"]
# name -> (rms_norm_linear, fused_add_rms_norm_linear, mini_infer.linear left) in the recommended pipeline: layer 0's
# input norm is plain (its input is the embedding), the other input norms and every post-attention norm take the
# residual add; o_proj, down_proj and lm_head stay linears (attention / SwiGLU / select_logits' gather feed them)
EXPECTED = {name: (1, 2 * L - 1, 2 * L + 1) for name in ("tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral")}
assert set(EXPECTED) == set(TINY_DENSE_PRESETS)
FUSED_OPS = (mi.rms_norm_linear.default, mi.fused_add_rms_norm_linear.default)


def _check_graph(name, gm, row, selects_logits):
    """Counts as EXPECTED says; without select_logits the final norm feeds lm_head alone and fuses into it too."""
    plain, residual, linears = EXPECTED[name]
    if not selects_logits:
        residual, linears = residual + 1, linears - 1
    counts = op_counts(gm)
    assert row.num_matches == plain + residual
    assert row.note == f"{plain} rms_norm, {residual} fused_add_rms_norm"
    assert (counts[mi.rms_norm_linear.default], counts[mi.fused_add_rms_norm_linear.default]) == (plain, residual)
    assert counts[mi.linear.default] == linears
    assert counts[mi.fused_add_rms_norm.default] == int(selects_logits)  # the final norm, its rows selected
    eps = loaded(name).config.rms_norm_eps
    for node in gm.graph.nodes:
        if node.target in FUSED_OPS:
            *_, norm_w, node_eps, w, b = node.args
            assert node_eps == eps and norm_w.op == w.op == "get_attr"
            qkv_rows, gate_up_rows = _merged_rows(loaded(name).config)
            rows = w.meta["val"].shape[0]
            assert rows in (qkv_rows, gate_up_rows, VOCAB)
            assert (b is not None) == (name == "tiny-qwen2" and rows == qkv_rows)  # Qwen2's q/k/v bias rides along


def _merged_rows(config) -> tuple[int, int]:
    """Output rows of the merged q/k/v and gate/up weights."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return head_dim * (config.num_attention_heads + 2 * config.num_key_value_heads), 2 * config.intermediate_size


@pytest.mark.parametrize("name", TINY_DENSE_PRESETS)
def test_fuses_each_norm_into_its_merged_projection(name):
    gm, _, stats = run_passes(name, [*PREREQUISITES, "fuse_norm_gemv"])
    _check_graph(name, gm, stats[-1], selects_logits=False)


@pytest.mark.parametrize("name", TINY_DENSE_PRESETS)
def test_layer_norms_stay_without_merged_projections(name):
    """Before merge_projections each layer norm feeds q, k and v (or gate and up): a norm with other readers stays;
    only the final norm (no select_logits here) fuses, into lm_head."""
    gm, _, stats = run_passes(name, ["fuse_rmsnorm", "gemv_linear", "fuse_norm_gemv"])
    assert stats[-1].num_matches == 1 and stats[-1].note == "1 fused_add_rms_norm"
    (fused,) = [n for n in gm.graph.nodes if n.target in FUSED_OPS]
    assert fused.args[-2].meta["val"].shape[0] == VOCAB
    assert op_counts(gm)[mi.fused_add_rms_norm.default] == 2 * L - 1


@pytest.mark.parametrize("name", TINY_DENSE_PRESETS)
@given(num=num_tokens, start=start_pos)
@FEW
def test_logits_equal_eager(name, num, start):
    gm, ctx, _ = run_passes(name, [*PREREQUISITES, "fuse_norm_gemv"])
    check_against_eager(name, gm, ctx, num, start, seed=num * 3 + start)


def pipeline_with_pass(name: str):
    """The recommended pipeline (cleanup aside, as run_passes starts from it) with fuse_norm_gemv named at its end."""
    passes = recommended_passes(new_context(name))
    return run_passes(name, [*passes[1:], "fuse_norm_gemv"])


@pytest.mark.parametrize("name", TINY_DENSE_PRESETS)
def test_last_in_full_pipeline(name, tmp_path):
    gm, ctx, stats = pipeline_with_pass(name)
    assert [s.name for s in stats[-2:]] == ["gemv_linear", "fuse_norm_gemv"]
    _check_graph(name, gm, stats[-1], selects_logits=True)
    check_against_eager(name, gm, ctx, 9, 5, seed=1)
    check_against_eager(name, gm, ctx, 1, 30, seed=2)  # one row: a decode step
    write_graph(gm, tmp_path / "after.txt")
    dump = (tmp_path / "after.txt").read_text()
    assert "torch.ops.mini_infer.rms_norm_linear.default(" in dump
    assert "torch.ops.mini_infer.fused_add_rms_norm_linear.default(" in dump


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_one_row_with_triton_kernels(name):
    """The full pipeline's graph bound to the Triton kernels (interpreter): a one-row step runs the fused kernel
    (with Qwen2's bias) and gives eager HF's logits."""
    gm, ctx, _ = pipeline_with_pass(name)
    bound, names = bound_copy(gm, "triton")
    assert {"rms_norm_linear_triton", "fused_add_rms_norm_linear_triton"} <= names
    ids, pos = random_ids(1, 7), positions(12, 1)
    assert_logits_close(graph_logits(bound, ctx, ids, pos), eager_logits(name, ids, pos))


def test_opt_in():
    config = loaded("tiny-llama").config
    for mode in (None, "w8a8", "fp8"):
        names = [p.name for p in recommended_passes(PassContext(config=config, device=CPU, dtype=torch.float32,
                                                                quantization=mode))]
        assert "fuse_norm_gemv" not in names and names[-1] == "gemv_linear"


# -- toys: what must stay as it is ------------------------------------------------------------------------------


class _NormLinear(torch.nn.Module):
    """norm → proj (biased), in one of three shapes: `single` (fuses), `shared` (the normalized row is read again),
    `view` (the row split in two halves between norm and linear)."""

    def __init__(self, how):
        super().__init__()
        self.norm, self.how = ToyRMSNorm(), how
        self.proj = torch.nn.Linear(8, 8) if how == "view" else torch.nn.Linear(16, 16)

    def forward(self, x, pos):
        h = self.norm(x)
        if self.how == "view":
            return self.proj(h.reshape(*h.shape[:-1], 2, 8)).flatten(-2)
        y = self.proj(h)
        return y + h if self.how == "shared" else y


@pytest.mark.parametrize(("how", "fused"), [("single", 1), ("shared", 0), ("view", 0)])
def test_fuses_only_a_norm_read_by_one_linear_alone(how, fused):
    gm, stats, _ = run_toy(_NormLinear(how), [*PREREQUISITES, "fuse_norm_gemv"])  # run_toy: logits == eager
    counts = op_counts(gm)
    assert stats[-1].num_matches == fused and counts[mi.rms_norm_linear.default] == fused
    assert counts[mi.rms_norm.default] == 1 - fused


class _SumReadFirst(torch.nn.Module):
    """s = x + x*0.5; n = norm(s); the sum is read (t = s * 2) before the linear of n is computed."""

    def __init__(self):
        super().__init__()
        self.norm, self.proj = ToyRMSNorm(), torch.nn.Linear(16, 16, bias=False)

    def forward(self, x, pos):
        s = x + x * 0.5
        n = self.norm(s)
        t = s * 2
        return self.proj(n) + t


def test_residual_sum_read_before_the_linear():
    gm, stats, _ = run_toy(_SumReadFirst(), [*PREREQUISITES, "fuse_norm_gemv"])  # run_toy: logits == eager
    counts = op_counts(gm)
    assert stats[-1].note == "1 fused_add_rms_norm"
    assert counts[mi.fused_add_rms_norm_linear.default] == 1 and counts[mi.fused_add_rms_norm.default] == 0
