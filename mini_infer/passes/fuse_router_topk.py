"""FuseRouterTopk: a MoE router's linear whose logits only moe_topk reads → one op, the routing in the router GEMV's
launch.

    moe_topk(linear(x, W, b), top_k, scoring, ...)    → linear_moe_topk(x, W, b, top_k, scoring, ...)
route_moe leaves the router's linear an ordinary graph node and feeds its logits to moe_topk; gemv_linear makes it
a `mini_infer.linear`. At batch-1 decode the routing is a one-program kernel whose cost is almost all launch, and
the fused op runs it in the router GEMV's last program (ops/linear_moe_topk.py); for several rows it runs the
unfused kernels, so prefill is unchanged.

Runs in the lowering stage after route_moe and gemv_linear (whose `mini_infer.linear` nodes it matches). It leaves
alone: logits with any other reader, logits reaching moe_topk through anything else (a slice of a GEMM that
merge_projections merged with another projection, as Qwen2-MoE's router with its shared expert's gate; a cast;
tensor parallel's all-gather), and sigmoid routers (DeepSeek-V3: the op would run the two kernels anyway).

Default: on for MoE models on CUDA targets (route_moe's `moe_lowering_default`), where it removes one launch per
MoE layer; off for other devices, where the fused op is the two references run one after the other and saves
nothing.
"""

from __future__ import annotations

import torch
import torch.fx as fx

import mini_infer.ops  # noqa: F401  (registers torch.ops.mini_infer)
from mini_infer.passes.base import GraphPass, PassContext, PassResult, replace_with_call
from mini_infer.passes.pattern import is_op, only_user
from mini_infer.passes.route_moe import moe_lowering_default

ops = torch.ops.mini_infer


def _router_linear(topk: fx.Node) -> fx.Node | None:
    """The `mini_infer.linear` whose output is topk's logits and nothing else's, for a softmax routing given by
    position; else None."""
    if topk.kwargs or len(topk.args) < 3 or topk.args[2] != "softmax":
        return None
    lin = topk.args[0]
    if is_op(lin, ops.linear.default) and only_user(lin, topk) and not lin.kwargs and len(lin.args) == 3:
        return lin
    return None


class FuseRouterTopk(GraphPass):
    """moe_topk of a linear's only output → linear_moe_topk."""

    name = "fuse_router_topk"
    stage = "lowering"
    requires = ("route_moe", "gemv_linear")

    @classmethod
    def default_for(cls, ctx: PassContext) -> GraphPass | None:
        return cls() if moe_lowering_default(ctx) else None

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        graph = gm.graph
        fused = 0
        for topk in list(graph.nodes):
            lin = _router_linear(topk) if is_op(topk, ops.moe_topk.default) else None
            if lin is None:
                continue
            replace_with_call(gm, topk, ops.linear_moe_topk.default, (*lin.args, *topk.args[1:]))
            graph.erase_node(topk)
            graph.erase_node(lin)
            fused += 1
        return PassResult(fused, f"{fused} router{'s' if fused != 1 else ''}" if fused else "")
