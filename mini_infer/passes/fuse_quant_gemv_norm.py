"""FuseQuantGemvNorm: a per-token quantization whose only reader is a scaled GEMV + add + norm → one op that
quantizes its input in the GEMV's prologue.

    (x_q, xs) = quantize_per_token(x, W_q.dtype);  scaled_linear_add_rms_norm_quant(x_q, xs, W_q, ws, b, dt, r, nw,
                                                                                   eps, qdt)
        → quantize_linear_add_rms_norm_quant(x, W_q, ws, b, dt, r, nw, eps, qdt)

In a quantized dense decoder this is every layer's o_proj: the attention output (no producer to fuse the
quantization into: fuse_act_quant leaves it) quantized for o_proj, which fuse_gemv_norm made a
scaled_linear_add_rms_norm_quant. At batch-1 decode the quantization is a one-program launch on the critical path;
the fused op's one-row kernel quantizes the row in every program, with quantize_per_token's bits
(ops/quantize_linear_add_rms_norm_quant.py). Several rows run the unfused kernels; the CPU references are the
unfused ones. It leaves alone a quantization with any other reader, or read through anything else.

Runs in the lowering stage after fuse_gemv_norm (whose `scaled_linear_add_rms_norm_quant` nodes it matches).
Default: on for CUDA targets with a quantization mode; unmeasured on a GPU when written (bench/latency.py
--without fuse_quant_gemv_norm says what it saves). Off elsewhere, where the op runs the unfused references.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

import mini_infer.ops  # noqa: F401  (registers torch.ops.mini_infer)
from mini_infer.passes.base import GraphPass, PassContext, PassResult, replace_with_call
from mini_infer.passes.pattern import is_op, only_user

ops = torch.ops.mini_infer


def _quantization(gemv: fx.Node) -> fx.Node | None:
    """The quantize_per_token whose outputs [0] and [1] are `gemv`'s x_q and x_scale and read by nothing else; else
    None."""
    x_q, x_scale = gemv.args[:2]
    if not (is_op(x_q, operator.getitem) and is_op(x_scale, operator.getitem) and x_q.args[0] is x_scale.args[0]
            and (x_q.args[1], x_scale.args[1]) == (0, 1) and only_user(x_q, gemv) and only_user(x_scale, gemv)):
        return None
    quant = x_q.args[0]
    if not is_op(quant, ops.quantize_per_token.default) or quant.kwargs or len(quant.args) != 2 \
            or len(quant.users) != 2:
        return None
    return quant


class FuseQuantGemvNorm(GraphPass):
    """quantize_per_token → scaled_linear_add_rms_norm_quant ⇒ quantize_linear_add_rms_norm_quant."""

    name = "fuse_quant_gemv_norm"
    stage = "lowering"
    requires = ("fuse_gemv_norm",)

    @classmethod
    def default_for(cls, ctx: PassContext) -> GraphPass | None:
        # on CUDA with quantization only: there the op's one-row kernel replaces quantize_per_token's launch
        return cls() if ctx.device.type == "cuda" and ctx.quantization is not None else None

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        graph = gm.graph
        n = 0
        for gemv in list(graph.nodes):
            if not is_op(gemv, ops.scaled_linear_add_rms_norm_quant.default) or gemv.kwargs or len(gemv.args) != 10 \
                    or (quant := _quantization(gemv)) is None:
                continue
            x_q, x_scale = gemv.args[:2]
            replace_with_call(gm, gemv, ops.quantize_linear_add_rms_norm_quant.default, (quant.args[0], *gemv.args[2:]))
            for dead in (gemv, x_q, x_scale, quant):
                graph.erase_node(dead)
            n += 1
        return PassResult(n, f"{n} o_proj" if n else "")
