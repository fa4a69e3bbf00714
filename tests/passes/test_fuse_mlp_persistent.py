"""FuseMlpPersistent: rms_norm_linear → split → silu_and_mul → linear_add ⇒ mlp_persistent, one op per block.

On every dense tiny preset: with its prerequisites alone (no select_logits, no fuse_gemv_norm) every layer's MLP fuses,
the last one's down_proj too (fuse_residual_gemvs made it a linear_add before the final norm's lm_head); in the
recommended pipeline as CUDA runs it, every MLP but the last (fuse_gemv_norm's linear_add_rms_norm keeps its
silu_and_mul) (counts hard-coded). Logits equal eager HF (references), and with the Triton kernels under the
interpreter a one-row step gives the pipeline's logits without the pass bit for bit. A toy whose activation has
another reader: nothing fuses. Off by default.
"""

import pytest
import torch

from mini_infer.models.presets import TINY_DENSE_PRESETS
from mini_infer.passes import PassContext, recommended_passes, resolve_passes
from mini_infer.passes.manager import check_pass_order
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
PREREQUISITES = ["fuse_rmsnorm", "merge_projections", "fuse_silu_mul", "gemv_linear", "fuse_residual_gemvs"]
CUDA_TAIL = ["fuse_residual_gemvs", "fuse_gemv_norm"]  # what CUDA's pipeline runs after gemv_linear
# pipeline -> (MLP blocks fused, silu_and_mul left), the same on every dense preset
EXPECTED = {"prerequisites": (L, 0), "pipeline": (L - 1, 1)}


def _run(name: str, pipeline: str, with_pass: bool = True):
    """`name`'s graph after `pipeline` ("prerequisites", or the recommended CPU pipeline, cleanup aside, with
    CUDA_TAIL), then fuse_mlp_persistent if `with_pass`."""
    passes = PREREQUISITES if pipeline == "prerequisites" else [*recommended_passes(new_context(name))[1:], *CUDA_TAIL]
    return run_passes(name, [*passes, "fuse_mlp_persistent"] if with_pass else passes)


@pytest.mark.parametrize("pipeline", list(EXPECTED))
@pytest.mark.parametrize("name", TINY_DENSE_PRESETS)
def test_fuses_each_mlp_block(name, pipeline):
    fused, left = EXPECTED[pipeline]
    gm, ctx, stats = _run(name, pipeline)
    assert stats[-1].name == "fuse_mlp_persistent" and stats[-1].num_matches == fused
    counts = op_counts(gm)
    assert counts[mi.mlp_persistent.default] == fused and counts[mi.silu_and_mul.default] == left
    config = loaded(name).config
    h, i = config.hidden_size, config.intermediate_size
    for node in (n for n in gm.graph.nodes if n.target is mi.mlp_persistent.default):
        x, nw, eps, w_gu, b_gu, w_d, b_d, residual = node.args
        assert tuple(w_gu.meta["val"].shape) == (2 * i, h) and tuple(w_d.meta["val"].shape) == (h, i)
        assert nw.op == "get_attr" and isinstance(eps, float) and b_gu is None and b_d is None
        assert residual is x  # the residual sum is both the norm's input and what the down GEMV adds to
    check_against_eager(name, gm, ctx, 9, 5, seed=1)
    check_against_eager(name, gm, ctx, 1, 30, seed=2)  # one row: a decode step


def test_one_row_with_triton_kernels_equals_the_unfused_pipeline():
    """Both graphs bound to the Triton kernels (interpreter: the op's two phase launches): a one-row step gives the
    logits of the CUDA pipeline without the pass, bit for bit."""
    name = "tiny-qwen3"
    (fused, names), (unfused, _) = (bound_copy(_run(name, "pipeline", w)[0], "triton") for w in (True, False))
    assert "mlp_persistent_triton" in names
    ctx = _run(name, "pipeline")[1]
    ids, pos = random_ids(1, 7), positions(12, 1)
    index = {"logits_indices": torch.arange(1)}
    assert torch.equal(graph_logits(fused, ctx, ids, pos, **index), graph_logits(unfused, ctx, ids, pos, **index))


def test_opt_in_and_last_when_named():
    """Off by default; named after the CUDA pipeline it builds on, a valid order."""
    config = loaded("tiny-llama").config
    for device in (torch.device("cuda"), CPU):
        ctx = PassContext(config=config, device=device, dtype=torch.float32)
        assert "fuse_mlp_persistent" not in [p.name for p in recommended_passes(ctx)]
    ctx = PassContext(config=config, device=torch.device("cuda"), dtype=torch.float32)
    check_pass_order(resolve_passes([*[p.name for p in recommended_passes(ctx)], "fuse_mlp_persistent"]))
    with pytest.raises(ValueError, match="requires"):
        check_pass_order(resolve_passes(["fuse_rmsnorm", "merge_projections", "fuse_silu_mul", "gemv_linear",
                                         "fuse_mlp_persistent"]))


class _Block(torch.nn.Module):
    """h = norm(x); a = silu(gate(h)) * up(h); norm2(down(a) + x) for the head (so fuse_residual_gemvs makes the
    down projection a linear_add): `plain` fuses; `shared` (a read again) and `gate_read` (gate read again) must
    not."""

    def __init__(self, how):
        super().__init__()
        self.norm, self.norm2, self.how = ToyRMSNorm(), ToyRMSNorm(), how
        self.gate, self.up = torch.nn.Linear(16, 24, bias=False), torch.nn.Linear(16, 24, bias=False)
        self.down = torch.nn.Linear(24, 16, bias=False)

    def forward(self, x, pos):
        h = self.norm(x)
        g = self.gate(h)
        a = torch.nn.functional.silu(g) * self.up(h)
        if self.how != "plain":  # the other reader feeds the residual: the down GEMV stays a linear_add
            x = x + (a if self.how == "shared" else g)[..., :16]
        return self.norm2(self.down(a) + x)


@pytest.mark.parametrize(("how", "fused"), [("plain", 1), ("shared", 0), ("gate_read", 0)])
def test_fuses_only_a_chain_nothing_else_reads(how, fused):
    gm, stats, _ = run_toy(_Block(how), [*PREREQUISITES, "fuse_mlp_persistent"])  # run_toy: logits == eager
    counts = op_counts(gm)
    assert stats[-1].num_matches == counts[mi.mlp_persistent.default] == fused
    assert counts[mi.linear_add.default] == counts[mi.silu_and_mul.default] == 1 - fused  # the rest of the chain
