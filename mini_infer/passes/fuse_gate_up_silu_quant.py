"""FuseGateUpSiluQuant: the gated-MLP activation and its per-token quantization into the launch of the W8A8 / FP8
merged gate_up GEMV that produces its operands.

    g, u = split_with_sizes(int8_linear(x_q, xs, W_q, ws, b, dt), [I, I], -1);  (q, s) = silu_and_mul_quant(g, u, qdt)
        (or fp8_linear)                                  → (q, s) = scaled_linear_silu_quant(x_q, xs, W_q, ws, b, dt, qdt)

In a quantized dense decoder this is every layer's gate_up (merge_projections merged gate_proj and up_proj, gate rows
first; fuse_act_quant made the silu_and_mul + quantize_per_token a silu_and_mul_quant). At batch-1 decode the
unfused silu_and_mul_quant is two launches on the critical path (rows of qwen2.5-7b's 18,944 are split over
programs); the fused op's one-row kernel computes silu(g) * u where its programs hold g and u and quantizes the
row in its last program, with the unfused chain's bits (ops/scaled_linear_silu_quant.py). Several rows run the
unfused kernels; the CPU references are the unfused ones.

Which half is gate: as fuse_gate_up_silu (whose `halves_split` this pass shares), only where the graph says so,
`silu_and_mul_quant(split[0], split[1], dt)` of a two-way split into equal halves along the last dim; the linear's
output read by nothing but that split.

Runs in the lowering stage after fuse_act_quant (which makes the silu_and_mul_quant) and fuse_gemv_norm (which
takes the down projection after it: no conflict, it reads silu_and_mul_quant's outputs through the same getitems).
Default: on for CUDA targets with a quantization mode; unmeasured on a GPU when written (bench/latency.py
--without fuse_gate_up_silu_quant says what it saves). Off elsewhere, where the op runs the unfused references.
"""

from __future__ import annotations

import torch
import torch.fx as fx

import mini_infer.ops  # noqa: F401  (registers torch.ops.mini_infer)
from mini_infer.passes.base import GraphPass, PassContext, PassResult, replace_with_call
from mini_infer.passes.fuse_gate_up_silu import halves_split
from mini_infer.passes.pattern import is_op, only_user

ops = torch.ops.mini_infer

_LINEARS = (ops.int8_linear.default, ops.fp8_linear.default)


def _gate_up_linear(split: fx.Node) -> fx.Node | None:
    """The int8 / fp8 linear (all six arguments positional) that `split` splits, when nothing else reads its
    output; else None."""
    lin = split.args[0]
    if not is_op(lin, *_LINEARS) or lin.kwargs or len(lin.args) != 6:
        return None
    return lin if only_user(lin, split) else None


class FuseGateUpSiluQuant(GraphPass):
    """int8_linear / fp8_linear → split into two halves → silu_and_mul_quant ⇒ scaled_linear_silu_quant."""

    name = "fuse_gate_up_silu_quant"
    stage = "lowering"
    requires = ("fuse_act_quant",)

    @classmethod
    def default_for(cls, ctx: PassContext) -> GraphPass | None:
        # on CUDA with quantization only: there the op's one-row kernel replaces silu_and_mul_quant's launches
        return cls() if ctx.device.type == "cuda" and ctx.quantization is not None else None

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        graph = gm.graph
        n = 0
        for act in list(graph.nodes):
            if not is_op(act, ops.silu_and_mul_quant.default) or (split := halves_split(act, 3)) is None \
                    or (lin := _gate_up_linear(split)) is None:
                continue
            replace_with_call(gm, act, ops.scaled_linear_silu_quant.default, (*lin.args, act.args[2]))
            gate, up = act.args[:2]
            for dead in (act, gate, up, split, lin):
                graph.erase_node(dead)
            n += 1
        return PassResult(n, f"{n} gate_up" if n else "")
