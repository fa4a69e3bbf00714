"""FuseMoeRouting: moe_topk (softmax) -> fused_moe ⇒ fused_moe_routed.

On every MoE tiny preset, after route_moe alone and at the end of the recommended pipeline: each softmax-routed
block fuses (Mixtral, Qwen2-MoE, Qwen3-MoE: both layers; DeepSeek-V2's greedy routing: its one MoE layer after the
dense first), DeepSeek-V3's sigmoid / grouped routing stays (counts hard-coded). Logits equal eager HF; with the Triton
kernels under the interpreter a one-row step in pair-per-block mode (the routed GEMM blocks) gives the unfused
pipeline's logits bit for bit. Toys: the shapes that must stay as they are. Off by default.
"""

import pytest
import torch

from mini_infer.passes import PassContext, recommended_passes
from mini_infer.passes.fuse_moe_routing import FuseMoeRouting
from tests.passes.helpers import (
    assert_unfused_bits,
    bench_module,
    check_against_eager,
    loaded,
    mi,
    new_context,
    op_counts,
    run_passes,
)

# preset -> MoE blocks that fuse, blocks left with moe_topk
MOE = {"tiny-mixtral": (2, 0), "tiny-qwen2-moe": (2, 0), "tiny-qwen3-moe": (2, 0), "tiny-deepseek-v2": (1, 0),
       "tiny-deepseek-v3": (0, 1)}
RENORMALIZE = {"tiny-mixtral": True, "tiny-qwen2-moe": False, "tiny-qwen3-moe": True, "tiny-deepseek-v2": False}


def _pipeline(name: str, alone: bool, with_pass: bool = True) -> list:
    passes = ["route_moe"] if alone else [p.name for p in recommended_passes(new_context(name))[1:]]
    return [*passes, "fuse_moe_routing"] if with_pass else passes


@pytest.mark.parametrize("alone", [True, False], ids=["alone", "pipeline"])
@pytest.mark.parametrize("name", MOE)
def test_fuses_each_softmax_routed_block(name, alone):
    fused, left = MOE[name]
    gm, ctx, stats = run_passes(name, _pipeline(name, alone))
    assert stats[-1].name == "fuse_moe_routing" and stats[-1].num_matches == fused
    counts = op_counts(gm)
    assert counts[mi.fused_moe_routed.default] == fused
    assert counts[mi.moe_topk.default] == counts[mi.fused_moe.default] == left
    config = loaded(name).config
    for node in (n for n in gm.graph.nodes if n.target is mi.fused_moe_routed.default):
        hidden, logits, w13, w2, top_k, renormalize, scale, wdtype = node.args
        assert top_k == config.num_experts_per_tok and w13.op == w2.op == "get_attr"
        assert logits.meta["val"].shape[-1] == w13.meta["val"].shape[0]
        assert renormalize == RENORMALIZE[name] and scale == 1.0
    check_against_eager(name, gm, ctx, 9, 5, seed=1)
    check_against_eager(name, gm, ctx, 1, 30, seed=2)  # one row: a decode step


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-deepseek-v2"])
def test_one_row_with_triton_kernels_equals_the_unfused_pipeline(monkeypatch, name):
    """Both pipelines bound to the Triton kernels (interpreter), the decode-path GEMVs off so that a one-row step
    runs the grouped GEMMs one block a pair, the fused graph's blocks routing themselves: the unfused logits, bit
    for bit (and a 9-token prefill with the references)."""
    from mini_infer.ops import _moe_gemv

    monkeypatch.setattr(_moe_gemv, "MOE_GEMV_MAX_PAIRS", 0)
    fused = run_passes(name, _pipeline(name, alone=False))
    unfused = run_passes(name, _pipeline(name, alone=False, with_pass=False))
    assert_unfused_bits(fused, unfused, "fused_moe_routed_triton")


def test_bench_active_bytes_counts_the_routed_op():
    """bench/active_bytes.py (the batch-1 floor of bench/latency.py) counts top_k of E experts per fused_moe_routed
    node as it does per fused_moe node: the same active bytes with the pass as without."""
    module = bench_module("active_bytes")
    name = "tiny-qwen3-moe"
    with_pass, without = (module.token_bytes(run_passes(name, _pipeline(name, True, w))[0]) for w in (True, False))
    assert with_pass == without and with_pass.moe_layers == 2 and with_pass.active < with_pass.total


class _Routed(torch.nn.Module):
    """A hand-made routed block: logits -> moe_topk -> fused_moe, in one of four shapes: `plain` (fuses), `grouped`
    (DeepSeek-V2's group-limited routing), `ids_read` (the ids read again), `mapped` (an expert map: expert
    parallelism)."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.router = torch.nn.Parameter(torch.randn(8, 16))
        self.w13 = torch.nn.Parameter(torch.randn(8, 12, 16) / 4)
        self.w2 = torch.nn.Parameter(torch.randn(8, 16, 6) / 3)
        self.register_buffer("emap", torch.arange(8, dtype=torch.int32))

    def forward(self, x):
        logits = x @ self.router.t()
        groups = 2 if self.how == "grouped" else 1
        routing = torch.ops.mini_infer.moe_topk.default(logits, 2, "softmax", True, 1.0, groups, 1, None, None)
        weights, ids = routing[0], routing[1]
        if self.how == "mapped":
            return torch.ops.mini_infer.fused_moe.default(x, weights, ids, self.w13, self.w2, "silu", self.emap)
        out = torch.ops.mini_infer.fused_moe.default(x, weights, ids, self.w13, self.w2)
        return out + ids.to(out.dtype).sum() if self.how == "ids_read" else out


@pytest.mark.parametrize(("how", "fuses"), [("plain", 1), ("grouped", 0), ("ids_read", 0), ("mapped", 0)])
def test_toys(how, fuses):
    model = _Routed(how)
    gm = torch.fx.symbolic_trace(model)
    x = torch.randn(3, 16)
    want = gm(x)
    result = FuseMoeRouting().apply(gm, PassContext(config=None, device=torch.device("cpu"), dtype=torch.float32))
    gm.recompile()
    assert result.num_matches == fuses
    assert op_counts(gm)[torch.ops.mini_infer.fused_moe_routed.default] == fuses
    torch.testing.assert_close(gm(x), want)


def test_opt_in():
    """Off by default, on every device, until timed on a GPU."""
    config = loaded("tiny-qwen3-moe").config
    for device in (torch.device("cuda"), torch.device("cpu")):
        ctx = PassContext(config=config, device=device, dtype=torch.float32)
        assert "fuse_moe_routing" not in [p.name for p in recommended_passes(ctx)]
