"""FuseResidualGemvs: linear → fused_add_rms_norm → one linear ⇒ linear_add → rms_norm_linear, and a lone rms_norm →
one linear ⇒ rms_norm_linear.

On every dense tiny preset, with its prerequisites: o_proj → post-attention norm → gate_up in every layer, and
down_proj → next input norm → q/k/v between layers, fuse (counts hard-coded); layer 0's input norm folds into its
q/k/v; without select_logits the final norm feeds lm_head alone and fuses too. In the recommended pipeline, with
fuse_gemv_norm after it: the final norm (its rows gathered before lm_head) stays for fuse_gemv_norm. Logits equal
eager HF (reference kernels, and the Triton kernels under the interpreter for a one-row step, the fused kernels'
case). Toys: the shapes that must stay as they are. On CUDA the pass is on by default, before fuse_gemv_norm.
"""

import pytest
import torch

from mini_infer.models.presets import TINY_DENSE_PRESETS
from mini_infer.passes import PassContext, recommended_passes
from tests.passes.helpers import (
    CPU,
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
    op_counts,
    positions,
    random_ids,
    run_passes,
    run_toy,
)

L = NUM_LAYERS
PREREQUISITES = ["fuse_rmsnorm", "merge_projections", "gemv_linear"]
# name -> (linear_add, rms_norm_linear from a plain norm) in the recommended pipeline: o_proj (L) and every
# down_proj but the last (L - 1) take the add; layer 0's input norm is plain; the last down_proj (its norm's rows go
# through select_logits' gather) and lm_head stay linears
EXPECTED = {name: (2 * L - 1, 1) for name in ("tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral")}
assert set(EXPECTED) == set(TINY_DENSE_PRESETS)


def _check_graph(name, gm, row, selects_logits):
    """Counts as EXPECTED says (without select_logits the final norm feeds lm_head alone: one more chain); every
    residual sum feeds an rms_norm_linear; each op's operands are the model's."""
    added, plain = EXPECTED[name]
    if not selects_logits:
        added += 1
    counts = op_counts(gm)
    assert row.num_matches == added + plain and row.note == f"{added} linear_add, {plain} rms_norm"
    assert counts[mi.linear_add.default] == added and counts[mi.rms_norm_linear.default] == added + plain
    config = loaded(name).config
    for node in gm.graph.nodes:
        if node.target is mi.linear_add.default:
            x, w, b, residual = node.args
            assert w.op == "get_attr" and b is None
            assert w.meta["val"].shape[0] == config.hidden_size == residual.meta["val"].shape[-1]
            assert any(u.target is mi.rms_norm_linear.default and u.args[0] is node for u in node.users)
        if node.target is mi.rms_norm_linear.default:
            x, norm_w, eps, w, b = node.args
            assert eps == config.rms_norm_eps and norm_w.op == w.op == "get_attr"
            assert (b is not None) == (name == "tiny-qwen2" and w.meta["val"].shape[0] != 2 * config.intermediate_size
                                       and w.meta["val"].shape[0] != VOCAB)  # Qwen2's q/k/v bias rides along


@pytest.mark.parametrize("name", TINY_DENSE_PRESETS)
def test_fuses_each_residual_chain(name):
    gm, ctx, stats = run_passes(name, [*PREREQUISITES, "fuse_residual_gemvs"])
    _check_graph(name, gm, stats[-1], selects_logits=False)
    counts = op_counts(gm)
    assert counts[mi.fused_add_rms_norm.default] == counts[mi.linear.default] == 0  # lm_head took the final norm
    check_against_eager(name, gm, ctx, 7, 3, seed=3)


def pipeline_with_passes(name: str):
    """The recommended pipeline (cleanup aside, as run_passes starts from it; a CPU context, which leaves both passes
    out) with fuse_residual_gemvs and fuse_gemv_norm named at its end, as the CUDA pipeline runs them."""
    passes = recommended_passes(new_context(name))
    return run_passes(name, [*passes[1:], "fuse_residual_gemvs", "fuse_gemv_norm"])


@pytest.mark.parametrize("name", TINY_DENSE_PRESETS)
def test_full_pipeline_leaves_the_final_norm_to_fuse_gemv_norm(name):
    gm, ctx, stats = pipeline_with_passes(name)
    assert [s.name for s in stats[-3:]] == ["gemv_linear", "fuse_residual_gemvs", "fuse_gemv_norm"]
    _check_graph(name, gm, stats[-2], selects_logits=True)
    counts = op_counts(gm)
    assert stats[-1].num_matches == 1 and counts[mi.linear_add_rms_norm.default] == 1  # last down_proj + final norm
    assert counts[mi.fused_add_rms_norm.default] == 0 and counts[mi.linear.default] == 1  # lm_head
    check_against_eager(name, gm, ctx, 9, 5, seed=1)
    check_against_eager(name, gm, ctx, 1, 30, seed=2)  # one row: a decode step


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_one_row_with_triton_kernels(name):
    """The full pipeline's graph bound to the Triton kernels (interpreter): a one-row step runs the epilogue-add and
    one-pass norm kernels (with Qwen2's bias) and gives eager HF's logits (fp32: the one-pass norm's numerics
    agree to fp32 rounding)."""
    gm, ctx, _ = pipeline_with_passes(name)
    bound, names = bound_copy(gm, "triton")
    assert {"linear_add_triton", "rms_norm_linear_triton", "linear_add_rms_norm_triton"} <= names
    ids, pos = random_ids(1, 7), positions(12, 1)
    assert_logits_close(graph_logits(bound, ctx, ids, pos), eager_logits(name, ids, pos))


def test_default_on_cuda_only_before_fuse_gemv_norm():
    config = loaded("tiny-llama").config
    for device, on in ((torch.device("cuda"), True), (CPU, False)):
        names = [p.name for p in recommended_passes(PassContext(config=config, device=device, dtype=torch.float32))]
        assert ("fuse_residual_gemvs" in names) == on
        if on:
            assert names[-4:] == ["gemv_linear", "fuse_residual_gemvs", "fuse_gemv_norm", "fuse_gate_up_silu"]


# -- toys: what fuses and what must stay as it is --------------------------------------------------------------


class _Chain(torch.nn.Module):
    """r = x * 0.5; y = proj(x); n, s = norm(r + y); out = head(n) + s, in one of five shapes: `chain` (fuses),
    `first` (y + r: fuses), `shared_n` (n read again), `shared_y` (y read again), `view` (n reaches head through a
    reshape pair)."""

    def __init__(self, how):
        super().__init__()
        self.norm, self.how = ToyRMSNorm(), how
        self.proj, self.head = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16, bias=False)

    def forward(self, x, pos):
        r = x * 0.5
        y = self.proj(x)
        s = y + r if self.how == "first" else r + y
        n = self.norm(s)
        h = n.reshape(*n.shape[:-1], 2, 8).reshape(n.shape) if self.how == "view" else n
        out = self.head(h) + s
        if self.how == "shared_n":
            out = out + n
        return out + y if self.how == "shared_y" else out


@pytest.mark.parametrize(("how", "fused"), [("chain", 1), ("first", 1), ("shared_n", 0), ("shared_y", 0),
                                            ("view", 0)])
def test_fuses_only_a_linear_norm_linear_chain(how, fused):
    gm, stats, _ = run_toy(_Chain(how), [*PREREQUISITES, "fuse_residual_gemvs"])  # run_toy: logits == eager
    counts = op_counts(gm)
    assert counts[mi.linear_add.default] == fused and counts[mi.fused_add_rms_norm.default] == 1 - fused
    assert stats[-1].num_matches == fused  # (the toy's input is the embedding: no plain norm)
