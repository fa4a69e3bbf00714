"""FuseGateUpSilu: rms_norm_linear / linear → split into two equal halves → silu_and_mul ⇒ rms_norm_linear_silu /
linear_silu.

On every dense tiny preset: with its prerequisites alone every gate_up is a plain linear and fuses as linear_silu;
in the recommended pipeline as CUDA runs it (fuse_residual_gemvs and fuse_gemv_norm before it) every gate_up is an
rms_norm_linear and fuses as rms_norm_linear_silu, no silu_and_mul is left (counts hard-coded). Logits equal eager
HF (references), and with the Triton kernels under the interpreter a one-row step gives the pipeline's logits
without the pass bit for bit. MoE presets: DeepSeek's dense layer and shared expert fuse, Qwen2-MoE's shared expert
(merged with the router and its gate: a four-way split) and routed experts do not. Tensor parallel: rank 1's
gate_up is a plain linear whose first half is its gate rows. On CUDA the pass is on by default, after
fuse_gemv_norm and before fuse_silu_gemv (which then finds nothing). Toys: the shapes that must stay as they are.
"""

import pytest
import torch

from mini_infer.models.presets import TINY_DENSE_PRESETS
from mini_infer.passes import PassContext, recommended_passes
from mini_infer.passes.manager import PassManager
from tests.passes.helpers import (
    CPU,
    NUM_LAYERS,
    ToyRMSNorm,
    _cleaned,
    bound_copy,
    check_against_eager,
    copy_gm,
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
from tests.passes.test_fuse_silu_gemv import CUDA_TAIL, PREREQUISITES  # the same pipeline parts

L = NUM_LAYERS
# pipeline -> (rms_norm_linear_silu, linear_silu) on every dense preset
EXPECTED = {"prerequisites": (0, L), "pipeline": (L, 0)}
# MoE presets in the CUDA pipeline -> (rms_norm_linear_silu, linear_silu, silu_and_mul left): DeepSeek's dense first
# layer's gate_up follows o_proj's norm, its MoE layer's shared expert reads the norm with the router (a linear);
# Qwen2-MoE's shared gate_up is merged with the router and the shared expert's gate; routed experts: fused_moe
MOE = {"tiny-deepseek-v2": (1, 1, 0), "tiny-qwen2-moe": (0, 0, L), "tiny-mixtral": (0, 0, 0)}


def _run(name: str, pipeline: str, with_pass: bool = True):
    """`name`'s graph after `pipeline`: "prerequisites" (PREREQUISITES) or "pipeline" (the recommended CPU pipeline,
    cleanup aside, with CUDA_TAIL), then fuse_gate_up_silu if `with_pass`."""
    passes = PREREQUISITES if pipeline == "prerequisites" else [*recommended_passes(new_context(name))[1:], *CUDA_TAIL]
    return run_passes(name, [*passes, "fuse_gate_up_silu"] if with_pass else passes)


def _check_counts(gm, row, normed: int, plain: int, left: int) -> None:
    counts = op_counts(gm)
    assert row.name == "fuse_gate_up_silu" and row.num_matches == normed + plain
    assert row.note == ", ".join(f"{n} {what}" for n, what in ((normed, "rms_norm_linear"), (plain, "linear")) if n)
    assert counts[mi.rms_norm_linear_silu.default] == normed and counts[mi.linear_silu.default] == plain
    assert counts[mi.silu_and_mul.default] == left


@pytest.mark.parametrize("pipeline", list(EXPECTED))
@pytest.mark.parametrize("name", TINY_DENSE_PRESETS)
def test_fuses_each_gate_up(name, pipeline):
    normed, plain = EXPECTED[pipeline]
    gm, ctx, stats = _run(name, pipeline)
    _check_counts(gm, stats[-1], normed, plain, 0)
    config = loaded(name).config
    for node in (n for n in gm.graph.nodes if n.target in (mi.rms_norm_linear_silu.default, mi.linear_silu.default)):
        w = node.args[-2]
        assert w.op == "get_attr" and tuple(w.meta["val"].shape) == (2 * config.intermediate_size, config.hidden_size)
        assert tuple(node.meta["val"].shape[-1:]) == (config.intermediate_size,)
        assert all(u.target in (mi.linear_add.default, mi.linear.default, mi.linear_add_rms_norm.default)
                   for u in node.users)  # the down projection reads it
    check_against_eager(name, gm, ctx, 9, 5, seed=1)
    check_against_eager(name, gm, ctx, 1, 30, seed=2)  # one row: a decode step


@pytest.mark.parametrize("name", MOE)
def test_moe_presets(name):
    gm, ctx, stats = _run(name, "pipeline")
    _check_counts(gm, stats[-1], *MOE[name])
    check_against_eager(name, gm, ctx, 9, 5, seed=1)
    check_against_eager(name, gm, ctx, 1, 30, seed=2)


@pytest.mark.parametrize("pipeline", list(EXPECTED))
def test_one_row_with_triton_kernels_equals_the_unfused_pipeline(pipeline):
    """Both graphs bound to the Triton kernels (interpreter): a one-row step runs the epilogue kernel and gives the
    logits of the graph without the pass, bit for bit."""
    name = "tiny-qwen3"
    (fused, names), (unfused, _) = (bound_copy(_run(name, pipeline, w)[0], "triton") for w in (True, False))
    assert ("rms_norm_linear_silu_triton" if pipeline == "pipeline" else "linear_silu_triton") in names
    ctx = _run(name, pipeline)[1]
    ids, pos = random_ids(1, 7), positions(12, 1)
    overrides = {"logits_indices": torch.arange(1)} if pipeline == "pipeline" else {}
    assert torch.equal(graph_logits(fused, ctx, ids, pos, **overrides), graph_logits(unfused, ctx, ids, pos, **overrides))


def test_tensor_parallel_rank_gate_up_halves():
    """Rank 1 of 2: the all-reduce before each post-attention norm leaves gate_up a plain linear, which fuses as
    linear_silu; its weight's first half is rank 1's gate_proj rows, the second its up_proj rows."""
    name = "tiny-llama"
    lm = loaded(name)
    ctx = PassContext(config=lm.config, device=torch.device("cuda"), dtype=torch.float32, rank=1, world_size=2,
                      applied=["cleanup"])
    gm = copy_gm(_cleaned(name))
    stats = PassManager(recommended_passes(ctx)[1:]).run(gm, ctx)  # a CUDA target: this pass included
    row = next(s for s in stats if s.name == "fuse_gate_up_silu")
    assert row.num_matches == L and row.note == f"{L} linear"
    half = lm.config.intermediate_size // 2
    for layer, node in enumerate(n for n in gm.graph.nodes if n.target is mi.linear_silu.default):
        w = PassContext.tensor_of(gm, node.args[1])
        mlp = lm.model.model.layers[layer].mlp
        assert torch.equal(w[:half], mlp.gate_proj.weight[half:]) and torch.equal(w[half:], mlp.up_proj.weight[half:])
    assert op_counts(gm)[mi.silu_and_mul.default] == 0


def test_default_on_cuda_only_before_fuse_silu_gemv():
    config = loaded("tiny-llama").config
    for device, on in ((torch.device("cuda"), True), (CPU, False)):
        names = [p.name for p in recommended_passes(PassContext(config=config, device=device, dtype=torch.float32))]
        assert ("fuse_gate_up_silu" in names) == on
        if on:
            assert names[-4:] == ["gemv_linear", *CUDA_TAIL, "fuse_gate_up_silu"]
    # fuse_silu_gemv (opt-in) named after it: a valid order, and it finds no silu_and_mul left
    gm, _, stats = run_passes("tiny-llama", [*PREREQUISITES, *CUDA_TAIL, "fuse_gate_up_silu",
                                             "fuse_silu_gemv"])
    assert stats[-2].num_matches == L and stats[-1].num_matches == 0


# -- toys: what fuses and what must stay as it is --------------------------------------------------------------


class _Mlp(torch.nn.Module):
    """h = norm(x); a = silu(gate(h)) * up(h); out = down(a) + x, in one of five shapes: `plain` (fuses), `bias`
    (gate and up with a bias: fuses, the merged bias rides along), `swapped` (up traced first, so the merged weight
    is [up; gate]: silu reads the second half), `shared` (the gate half read again), `third` (a third projection
    of h merges with them: a three-way split)."""

    def __init__(self, how):
        super().__init__()
        self.norm, self.how = ToyRMSNorm(), how
        self.gate = torch.nn.Linear(16, 24, bias=how == "bias")
        self.up = torch.nn.Linear(16, 24, bias=how == "bias")
        self.third = torch.nn.Linear(16, 16, bias=False)
        self.down = torch.nn.Linear(24, 16, bias=False)

    def forward(self, x, pos):
        h = self.norm(x)
        if self.how == "swapped":
            u = self.up(h)
            a = torch.nn.functional.silu(self.gate(h)) * u
        else:
            g = self.gate(h)
            a = torch.nn.functional.silu(g) * self.up(h)
        out = self.down(a) + x
        if self.how == "shared":
            out = out + g[..., :16]
        return out + self.third(h) if self.how == "third" else out


@pytest.mark.parametrize(("how", "fused"), [("plain", 1), ("bias", 1), ("swapped", 0), ("shared", 0),
                                            ("third", 0)])
def test_fuses_only_two_halves_read_by_the_activation_alone(how, fused):
    gm, stats, _ = run_toy(_Mlp(how), [*PREREQUISITES, "fuse_gate_up_silu"])  # run_toy: logits == eager
    counts = op_counts(gm)
    assert stats[-1].num_matches == counts[mi.linear_silu.default] == fused
    assert counts[mi.silu_and_mul.default] == 1 - fused
    if how == "bias":
        (node,) = (n for n in gm.graph.nodes if n.target is mi.linear_silu.default)
        assert node.args[2] is not None and tuple(node.args[2].meta["val"].shape) == (48,)
