"""FuseSiluGemv: silu_and_mul → one down projection (linear_add or linear, as its input row) ⇒ silu_mul_linear.

On every dense tiny preset: with its prerequisites alone, every down_proj is a plain linear and fuses; in the
recommended pipeline as CUDA runs it (fuse_residual_gemvs and fuse_gemv_norm before it), every down_proj but the
last is a linear_add and fuses with its residual, the last (fuse_gemv_norm's linear_add_rms_norm) keeps its
silu_and_mul (counts hard-coded). Logits equal eager HF (references), and with the Triton kernels under the
interpreter a one-row step gives the pipeline's logits without the pass bit for bit. MoE presets: the shared
experts' down_projs fuse (and DeepSeek's dense layer's). W8A8 (quantizing silu, int8 down_proj): nothing fuses. Toys: the shapes that must stay as they are. On CUDA the pass is on by default, last.
"""

import pytest
import torch

from mini_infer.models.presets import TINY_DENSE_PRESETS
from mini_infer.passes import PassContext, recommended_passes, resolve_passes
from mini_infer.passes.manager import check_pass_order
from mini_infer.passes.quantize_w8a8 import QuantizeW8A8
from tests.passes.helpers import (
    CPU,
    NUM_LAYERS,
    ToyRMSNorm,
    bound_copy,
    check_against_eager,
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
PREREQUISITES = ["fuse_rmsnorm", "merge_projections", "fuse_silu_mul", "gemv_linear"]
CUDA_TAIL = ["fuse_residual_gemvs", "fuse_gemv_norm"]  # the passes CUDA's pipeline runs after gemv_linear, before
# fuse_gate_up_silu (left out here: it takes every silu_and_mul this pass would fuse)
# pipeline -> name -> (silu_mul_linear with a residual, without one, silu_and_mul left): alone every down_proj is a
# plain linear; after CUDA_TAIL every down_proj but the last is a linear_add, the last a linear_add_rms_norm
EXPECTED = {
    "prerequisites": {name: (0, L, 0) for name in TINY_DENSE_PRESETS},
    "pipeline": {name: (L - 1, 0, 1) for name in TINY_DENSE_PRESETS},
}


def _run(name: str, pipeline: str, with_pass: bool = True):
    """`name`'s graph after `pipeline`: "prerequisites" (PREREQUISITES) or "pipeline" (the recommended CPU pipeline,
    cleanup aside, with CUDA_TAIL), then fuse_silu_gemv if `with_pass`."""
    passes = PREREQUISITES if pipeline == "prerequisites" else [*recommended_passes(new_context(name))[1:], *CUDA_TAIL]
    return run_passes(name, [*passes, "fuse_silu_gemv"] if with_pass else passes)


@pytest.mark.parametrize("pipeline", list(EXPECTED))
@pytest.mark.parametrize("name", TINY_DENSE_PRESETS)
def test_fuses_each_down_projection(name, pipeline):
    with_residual, plain, left = EXPECTED[pipeline][name]
    gm, ctx, stats = _run(name, pipeline)
    note = ", ".join(f"{n} {what}" for n, what in ((with_residual, "linear_add"), (plain, "linear")) if n)
    assert stats[-1].name == "fuse_silu_gemv" and stats[-1].num_matches == with_residual + plain
    assert stats[-1].note == note
    counts = op_counts(gm)
    assert counts[mi.silu_mul_linear.default] == with_residual + plain and counts[mi.silu_and_mul.default] == left
    config = loaded(name).config
    for node in (n for n in gm.graph.nodes if n.target is mi.silu_mul_linear.default):
        gate, up, w, b, residual = node.args
        assert gate.args[0] is up.args[0] and (gate.args[1], up.args[1]) == (0, 1)  # the merged gate_up's halves
        assert w.op == "get_attr" and tuple(w.meta["val"].shape) == (config.hidden_size, config.intermediate_size)
        assert b is None and (residual is not None) == (with_residual > 0)
    check_against_eager(name, gm, ctx, 9, 5, seed=1)
    check_against_eager(name, gm, ctx, 1, 30, seed=2)  # one row: a decode step


# MoE presets in the CUDA pipeline -> (with a residual, without): the shared experts' down_projs are plain linears
# (their sum with the routed experts' comes first), DeepSeek's dense first layer's a linear_add; routed experts'
# activations live inside fused_moe
MOE = {"tiny-qwen2-moe": (0, L), "tiny-deepseek-v2": (1, L - 1), "tiny-mixtral": (0, 0)}


@pytest.mark.parametrize("name", MOE)
def test_moe_shared_experts(name):
    gm, ctx, stats = run_passes(name, [*recommended_passes(new_context(name))[1:], *CUDA_TAIL, "fuse_silu_gemv"])
    with_residual, plain = MOE[name]
    counts = op_counts(gm)
    assert stats[-1].num_matches == counts[mi.silu_mul_linear.default] == with_residual + plain
    assert sum(n.args[4] is not None for n in gm.graph.nodes if n.target is mi.silu_mul_linear.default) == with_residual
    assert counts[mi.silu_and_mul.default] == 0
    check_against_eager(name, gm, ctx, 9, 5, seed=1)
    check_against_eager(name, gm, ctx, 1, 30, seed=2)


@pytest.mark.parametrize("pipeline", list(EXPECTED))
def test_one_row_with_triton_kernels_equals_the_unfused_pipeline(pipeline):
    """Both graphs bound to the Triton kernels (interpreter): a one-row step runs the prologue kernel and gives the
    logits of the graph without the pass, bit for bit."""
    name = "tiny-qwen3"
    (fused, names), (unfused, _) = (bound_copy(_run(name, pipeline, w)[0], "triton") for w in (True, False))
    assert "silu_mul_linear_triton" in names
    ctx = _run(name, pipeline)[1]
    ids, pos = random_ids(1, 7), positions(12, 1)
    overrides = {"logits_indices": torch.arange(1)} if pipeline == "pipeline" else {}
    assert torch.equal(graph_logits(fused, ctx, ids, pos, **overrides), graph_logits(unfused, ctx, ids, pos, **overrides))


def test_w8a8_leaves_the_quantized_mlp():
    """fuse_act_quant's silu_and_mul_quant feeds int8 down_projs: nothing to fuse."""
    ctx = PassContext(config=loaded("tiny-llama").config, device=CPU, dtype=torch.float32, quantization="w8a8")
    calibrate = [[3, 17, 101, 250, 7, 9, 480, 33], [11, 22, 33, 44, 55, 66]]  # small: fast
    passes = [QuantizeW8A8(calibrate=calibrate) if p.name == "quantize_w8a8" else p for p in recommended_passes(ctx)]
    gm, _, stats = run_passes("tiny-llama", [*passes[1:], *CUDA_TAIL, "fuse_silu_gemv"])
    counts = op_counts(gm)
    assert stats[-1].num_matches == 0 and counts[mi.silu_mul_linear.default] == 0
    assert counts[mi.silu_and_mul_quant.default] == L


def test_opt_in_and_last_when_named():
    """Off by default (slower than the unfused pair on an H200); named, it runs in the lowering stage, after the
    CUDA tail it builds on."""
    config = loaded("tiny-llama").config
    for device in (torch.device("cuda"), CPU):
        ctx = PassContext(config=config, device=device, dtype=torch.float32)
        assert "fuse_silu_gemv" not in [p.name for p in recommended_passes(ctx)]
    ctx = PassContext(config=config, device=torch.device("cuda"), dtype=torch.float32)
    names = [p.name for p in recommended_passes(ctx)]
    assert names[-4:] == ["gemv_linear", *CUDA_TAIL, "fuse_gate_up_silu"]
    check_pass_order(resolve_passes([*names, "fuse_silu_gemv"]))  # named after the default pipeline: a valid order


# -- toys: what fuses and what must stay as it is --------------------------------------------------------------


class _Mlp(torch.nn.Module):
    """h = norm(x); a = silu(gate(h)) * up(h); out = down(a) + x, in one of five shapes: `plain` (fuses), `shared`
    (a read again), `view` (a reaches down through a reshape pair), `gelu` (another activation: no silu_and_mul),
    `down_bias` (a down projection with a bias: fuses, the bias rides along)."""

    def __init__(self, how):
        super().__init__()
        self.norm, self.how = ToyRMSNorm(), how
        self.gate, self.up = torch.nn.Linear(16, 24, bias=False), torch.nn.Linear(16, 24, bias=False)
        self.down = torch.nn.Linear(24, 16, bias=how == "down_bias")

    def forward(self, x, pos):
        h = self.norm(x)
        act = torch.nn.functional.gelu if self.how == "gelu" else torch.nn.functional.silu
        a = act(self.gate(h)) * self.up(h)
        out = self.down(a.reshape(*a.shape[:-1], 4, 6).reshape(a.shape) if self.how == "view" else a) + x
        return out + a[..., :16] if self.how == "shared" else out


@pytest.mark.parametrize(("how", "fused"), [("plain", 1), ("shared", 0), ("view", 0), ("gelu", 0),
                                            ("down_bias", 1)])
def test_fuses_only_an_activation_read_by_the_down_projection_alone(how, fused):
    gm, stats, _ = run_toy(_Mlp(how), [*PREREQUISITES, "fuse_silu_gemv"])  # run_toy: logits == eager
    counts = op_counts(gm)
    assert stats[-1].num_matches == counts[mi.silu_mul_linear.default] == fused
    assert counts[mi.silu_and_mul.default] == (0 if how == "gelu" else 1 - fused)
    if how == "down_bias":
        (node,) = (n for n in gm.graph.nodes if n.target is mi.silu_mul_linear.default)
        assert node.args[3] is not None and node.args[3].op == "get_attr"
