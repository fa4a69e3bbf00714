"""FuseActQuant: per-token activation quantization fused into the op that produces the activation.

    quantize_per_token(rms_norm(x, w, eps), dt)                       → rms_norm_quant(x, w, eps, dt)
    quantize_per_token(fused_add_rms_norm(x, r, w, eps)[0], dt)       → fused_add_rms_norm_quant(x, r, w, eps, dt)
                                                                        (its third output replaces the sum [1])
    quantize_per_token(silu_and_mul(g, u), dt)                        → silu_and_mul_quant(g, u, dt)

so the int8 (or fp8) activation is written once, instead of a 16-bit activation that a second kernel reads back.
The fused ops compute the same bits as the pair (see ops/quant.py). A producer whose output has readers other than
the quantization is left alone (its 16-bit output is needed anyway). Runs in the fusion stage after fuse_rmsnorm
and fuse_silu_mul (which create the producers) and after quantize passes (which create the quantizations); it
matches nothing in a graph without `quantize_per_token`.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

import mini_infer.ops  # noqa: F401
from mini_infer.passes.base import GraphPass, PassContext, PassResult
from mini_infer.passes.pattern import is_op
from mini_infer.passes.quantize_fp8 import QuantizeFP8
from mini_infer.passes.quantize_w8a8 import QuantizeW8A8

ops = torch.ops.mini_infer


def _only_reader(producer: fx.Node, node: fx.Node) -> bool:
    return len(producer.users) == 1 and node in producer.users


def _getitems(node: fx.Node) -> dict[int, fx.Node]:
    """A tuple-valued node's `getitem` users by index (None if it has another kind of user or a repeated index)."""
    out: dict[int, fx.Node] = {}
    for user in node.users:
        if user.op != "call_function" or user.target is not operator.getitem or user.args[1] in out:
            return {}
        out[user.args[1]] = user
    return out


class FuseActQuant(GraphPass):
    """quantize_per_token after rms_norm / fused_add_rms_norm / silu_and_mul → the producer's *_quant op."""

    name = "fuse_act_quant"
    stage = "fusion"
    requires = ("cleanup",)

    @classmethod
    def default_for(cls, ctx: PassContext) -> GraphPass | None:
        # the modes whose passes quantize activations per token (quantize_moe_mxfp4's weight-only mode: none)
        return cls() if ctx.quantization in (*QuantizeW8A8.quantization_modes, *QuantizeFP8.quantization_modes) \
            else None

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        graph = gm.graph
        counts = {"rms_norm": 0, "fused_add_rms_norm": 0, "silu_and_mul": 0}
        for node in list(graph.nodes):
            if not is_op(node, ops.quantize_per_token.default):
                continue
            x, dt = node.args
            if is_op(x, ops.rms_norm.default) and _only_reader(x, node):
                self._insert(graph, node, ops.rms_norm_quant.default, (*x.args, dt))
                counts["rms_norm"] += 1
            elif is_op(x, ops.silu_and_mul.default) and _only_reader(x, node):
                self._insert(graph, node, ops.silu_and_mul_quant.default, (*x.args, dt))
                counts["silu_and_mul"] += 1
            elif x.op == "call_function" and x.target is operator.getitem and x.args[1] == 0 \
                    and is_op(x.args[0], ops.fused_add_rms_norm.default) and _only_reader(x, node):
                pair = x.args[0]
                items = _getitems(pair)
                if not items or set(items) - {0, 1}:
                    continue
                # the fused op goes where the pair was: the residual sum's readers may come before the quantize
                with graph.inserting_before(pair):
                    fused = graph.call_function(ops.fused_add_rms_norm_quant.default, (*pair.args, dt))
                    if 1 in items:
                        total = graph.call_function(operator.getitem, (fused, 2))
                        total.meta["val"] = items[1].meta.get("val")
                        items[1].replace_all_uses_with(total)
                node.replace_all_uses_with(fused)
                counts["fused_add_rms_norm"] += 1
        n = sum(counts.values())
        return PassResult(n, ", ".join(f"{v} {k}" for k, v in counts.items() if v))

    @staticmethod
    def _insert(graph: fx.Graph, quant: fx.Node, target, args: tuple) -> None:
        """`target(*args)` where `quant` is (its two outputs read through the same getitems)."""
        with graph.inserting_before(quant):
            fused = graph.call_function(target, args)
        quant.replace_all_uses_with(fused)
