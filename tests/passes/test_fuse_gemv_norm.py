"""FuseGemvNorm: a linear whose output feeds only the residual add + norm after it → linear_add_rms_norm (or, W8A8,
scaled_linear_add_rms_norm_quant).

On every dense tiny preset: with its prerequisites, o_proj and down_proj of every layer fuse into the norm after them
(the next layer's input norm, the post-attention norm, the final norm), counts hard-coded per preset; the same added
to the end of the recommended pipeline: logits equal eager HF (reference kernels, and the Triton kernels under the
interpreter for a one-row step, the fused kernel's case). W8A8: every quantizing norm after an int8 linear fuses (the
final norm, a float norm before the float lm_head, stays), and the logits equal the pipeline's without the pass bit
for bit (references, and Triton kernels under the interpreter at one row). Toys: a linear output with a second
reader, one reaching the norm through a view, and one as the add's first operand. Default: on for CUDA targets only.
"""

import pytest
import torch

from mini_infer.models.presets import TINY_DENSE_PRESETS
from mini_infer.passes import PassContext, recommended_passes
from mini_infer.passes.quantize_w8a8 import QuantizeW8A8
from tests.passes.helpers import (
    CPU,
    NUM_LAYERS,
    ToyRMSNorm,
    assert_logits_close,
    assert_unfused_bits,
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
# name -> (linear_add_rms_norm, mini_infer.linear left): o_proj and down_proj of each layer fuse into the norm after
# them (down_proj of the last layer into the final norm); the merged q/k/v and gate/up, and lm_head stay linears
EXPECTED = {name: (2 * L, 2 * L + 1) for name in ("tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral")}
assert set(EXPECTED) == set(TINY_DENSE_PRESETS)
CAL = [[3, 17, 101, 250, 7, 9, 480, 33, 64, 12, 5, 300], [11, 22, 33, 44, 55, 66, 77, 88]]  # small: fast tests


def _check_graph(name, gm, row):
    fused, linears = EXPECTED[name]
    counts = op_counts(gm)
    assert row.num_matches == fused and row.note == f"{fused} linear"
    assert counts[mi.linear_add_rms_norm.default] == fused and counts[mi.linear.default] == linears
    assert counts[mi.fused_add_rms_norm.default] == 0
    config = loaded(name).config
    for node in gm.graph.nodes:
        if node.target is mi.linear_add_rms_norm.default:
            x, w, b, residual, norm_w, eps = node.args
            assert eps == config.rms_norm_eps and norm_w.op == w.op == "get_attr" and b is None
            assert w.meta["val"].shape[0] == config.hidden_size == residual.meta["val"].shape[-1]


@pytest.mark.parametrize("name", TINY_DENSE_PRESETS)
def test_fuses_o_proj_and_down_proj_into_the_next_norm(name):
    gm, ctx, stats = run_passes(name, [*PREREQUISITES, "fuse_gemv_norm"])
    _check_graph(name, gm, stats[-1])
    check_against_eager(name, gm, ctx, 7, 3, seed=3)


def pipeline_with_pass(name: str):
    """The recommended pipeline (cleanup aside, as run_passes starts from it; a CPU context, which leaves the pass
    out) with fuse_gemv_norm named at its end."""
    passes = recommended_passes(new_context(name))
    return run_passes(name, [*passes[1:], "fuse_gemv_norm"])


@pytest.mark.parametrize("name", TINY_DENSE_PRESETS)
def test_last_in_full_pipeline(name):
    gm, ctx, stats = pipeline_with_pass(name)
    assert [s.name for s in stats[-2:]] == ["gemv_linear", "fuse_gemv_norm"]
    _check_graph(name, gm, stats[-1])
    check_against_eager(name, gm, ctx, 9, 5, seed=1)
    check_against_eager(name, gm, ctx, 1, 30, seed=2)  # one row: a decode step


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_one_row_with_triton_kernels(name):
    """The full pipeline's graph bound to the Triton kernels (interpreter): a one-row step runs the fused kernel and
    gives eager HF's logits."""
    gm, ctx, _ = pipeline_with_pass(name)
    bound, names = bound_copy(gm, "triton")
    assert "linear_add_rms_norm_triton" in names
    ids, pos = random_ids(1, 7), positions(12, 1)
    assert_logits_close(graph_logits(bound, ctx, ids, pos), eager_logits(name, ids, pos))


def _w8a8(name: str, with_pass: bool):
    """The recommended W8A8 pipeline (small calibration), with fuse_gemv_norm at its end or not."""
    ctx = PassContext(config=loaded(name).config, device=CPU, dtype=torch.float32, quantization="w8a8")
    passes = [QuantizeW8A8(calibrate=CAL) if p.name == "quantize_w8a8" else p for p in recommended_passes(ctx)][1:]
    return run_passes(name, [*passes, "fuse_gemv_norm"] if with_pass else passes)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_w8a8_pipeline(name):
    """Every quantizing norm after an int8 linear fuses; the final norm (float, before the float lm_head) stays with
    the last down_proj. The logits are the unfused pipeline's, bit for bit: with the references, and with the Triton
    kernels (interpreter) for a one-row step."""
    unfused, fused = _w8a8(name, False), _w8a8(name, True)
    gm, ctx, stats = fused
    assert stats[-1].num_matches == 2 * L - 1 and stats[-1].note == f"{2 * L - 1} scaled linear"
    counts = op_counts(gm)
    assert counts[mi.scaled_linear_add_rms_norm_quant.default] == 2 * L - 1
    assert counts[mi.fused_add_rms_norm_quant.default] == 0 and counts[mi.int8_linear.default] == 2 * L + 1
    assert counts[mi.fused_add_rms_norm.default] == 1
    assert_unfused_bits(fused, unfused, "scaled_linear_add_rms_norm_quant_triton")


def test_default_on_cuda_only():
    config = loaded("tiny-llama").config
    for device, on in ((torch.device("cuda"), True), (CPU, False)):
        for mode in (None, "w8a8"):
            names = [p.name for p in recommended_passes(PassContext(config=config, device=device,
                                                                    dtype=torch.float32, quantization=mode))]
            assert ("fuse_gemv_norm" in names) == on
            if on:
                assert names[-4:] == ["gemv_linear", "fuse_residual_gemvs", "fuse_gemv_norm", "fuse_gate_up_silu"]


# -- toys: what fuses and what must stay as it is --------------------------------------------------------------


class _ProjAddNorm(torch.nn.Module):
    """r = x * 0.5; y = proj(x); n = norm(add), in one of four shapes: `second` (r + y: fuses), `first` (y + r:
    fuses), `shared` (y is read again after the norm), `view` (y reaches the add through a reshape pair)."""

    def __init__(self, how):
        super().__init__()
        self.norm, self.how = ToyRMSNorm(), how
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x, pos):
        r = x * 0.5
        y = self.proj(x)
        if self.how == "view":
            y = y.reshape(*y.shape[:-1], 2, 8).reshape(y.shape)
        s = y + r if self.how == "first" else r + y
        n = self.norm(s)
        return n + s + y if self.how == "shared" else n + s


@pytest.mark.parametrize(("how", "fused"), [("second", 1), ("first", 1), ("shared", 0), ("view", 0)])
def test_fuses_only_a_linear_read_by_the_add_alone(how, fused):
    gm, stats, _ = run_toy(_ProjAddNorm(how), [*PREREQUISITES, "fuse_gemv_norm"])  # run_toy: logits == eager
    counts = op_counts(gm)
    assert stats[-1].num_matches == fused and counts[mi.linear_add_rms_norm.default] == fused
    assert counts[mi.fused_add_rms_norm.default] == 1 - fused
