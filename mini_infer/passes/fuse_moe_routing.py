"""FuseMoeRouting: an MoE block's softmax routing into its experts' op, so that batch-1 decode runs no routing launch.

    w, ids = moe_topk(logits, k, "softmax", renormalize, scale, 1, 1, None, wdtype);  out = fused_moe(h, w, ids, W13, W2)
        → out = fused_moe_routed(h, logits, W13, W2, k, renormalize, scale, wdtype)

At batch-1 decode the routing kernel is a one-program launch between the router GEMV and the gate/up GEMM, whose
blocks cannot load an expert's weights before it ends; in `fused_moe_routed` each GEMM block ranks its token's
logits for its own slot instead (ops/fused_moe_routed.py: the ids moe_topk's exactly, the weights within fp32
rounding). Matched where route_moe left the pair: moe_topk with softmax scoring, one group and no correction bias
(Mixtral, Qwen2/3-MoE, DeepSeek-V2's greedy routing), both of its outputs read by one fused_moe alone, with no expert
map (expert parallelism keeps the two ops). DeepSeek-V3's sigmoid / grouped routing stays as it is.

Default: off (opt-in by name, e.g. `bench/latency.py --with fuse_moe_routing`) until timed on a GPU: the routing
launch it removes was exposed 1.7-2.1 us a layer in qwen3-30b-a3b's batch-1 timeline (H200, bench/RESULTS.md,
thirty-sixth session), and the gate/up GEMM's blocks then rank 128 logits after their wait.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

import mini_infer.ops  # noqa: F401  (registers torch.ops.mini_infer)
from mini_infer.passes.base import GraphPass, PassContext, PassResult, replace_with_call
from mini_infer.passes.pattern import is_op

ops = torch.ops.mini_infer


def _routing_outputs(topk: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """moe_topk's (weights, ids) getitem nodes when those are its only readers, else None."""
    items = {u.args[1]: u for u in topk.users if is_op(u, operator.getitem)}
    if len(topk.users) != 2 or set(items) != {0, 1}:
        return None
    return items[0], items[1]


def _fusable(topk: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node] | None:
    """(weights, ids, the fused_moe reading them) for a softmax moe_topk whose outputs feed one fused_moe alone
    (as its weights and ids, with no expert map), else None."""
    args = list(topk.args) + [None] * (9 - len(topk.args))
    _, _, scoring, _, _, n_group, topk_group, bias, _ = args[:9]
    if topk.kwargs or scoring != "softmax" or (n_group or 1) != 1 or (topk_group or 1) != 1 or bias is not None:
        return None
    outs = _routing_outputs(topk)
    if outs is None:
        return None
    weights, ids = outs
    if len(weights.users) != 1 or len(ids.users) != 1:
        return None
    moe = next(iter(weights.users))
    if (not is_op(moe, ops.fused_moe.default) or moe.kwargs or next(iter(ids.users)) is not moe
            or moe.args[1] is not weights or moe.args[2] is not ids):
        return None
    if len(moe.args) > 5 and (moe.args[5] != "silu" or (len(moe.args) > 6 and moe.args[6] is not None)):
        return None
    return weights, ids, moe


class FuseMoeRouting(GraphPass):
    """moe_topk (softmax) → fused_moe ⇒ fused_moe_routed."""

    name = "fuse_moe_routing"
    stage = "lowering"
    requires = ("route_moe",)

    @classmethod
    def default_for(cls, ctx: PassContext) -> GraphPass | None:
        # opt-in until timed on a GPU (module docstring)
        return None

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        fused = 0
        for topk in list(gm.graph.nodes):
            if not is_op(topk, ops.moe_topk.default) or (match := _fusable(topk)) is None:
                continue
            weights, ids, moe = match
            logits, top_k, _, renormalize, scale = topk.args[:5]
            wdtype = topk.args[8] if len(topk.args) > 8 else None
            replace_with_call(gm, moe, ops.fused_moe_routed.default,
                              (moe.args[0], logits, moe.args[3], moe.args[4], top_k, renormalize,
                               1.0 if scale is None else scale, wdtype))
            for node in (moe, ids, weights, topk):
                gm.graph.erase_node(node)
            fused += 1
        return PassResult(fused, f"{fused} MoE blocks route inside their experts' op" if fused else "")
