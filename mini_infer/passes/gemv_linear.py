"""GemvLinear: `aten.linear` on a weight parameter → `mini_infer.linear`, whose CUDA kernel takes a GEMV for
single-row inputs (batch-1 decode) and cuBLAS for everything else.

Matches linears whose weight (and bias, if any) are parameters (`get_attr`), after `merge_projections` has
merged siblings, so merged q/k/v and gate/up weights are matched once. Numerics equal `F.linear` up to
summation order. It must not touch linears of activations (e.g. MoE routers computed on the fly).
"""

from __future__ import annotations

import torch
import torch.fx as fx

import mini_infer.ops  # noqa: F401
from mini_infer.passes.base import GraphPass, PassContext, PassResult, replace_with_call
from mini_infer.passes.pattern import aten, is_op

ops = torch.ops.mini_infer


class GemvLinear(GraphPass):
    """linear(x, W, b) with W, b parameters → mini_infer.linear(x, W, b)."""

    name = "gemv_linear"
    stage = "lowering"
    requires = ("cleanup",)

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        n = 0
        for node in list(gm.graph.nodes):
            if not is_op(node, aten.linear.default):
                continue
            x, w, b = (list(node.args) + [None, None])[:3]
            b = node.kwargs.get("bias", b)
            if not (isinstance(w, fx.Node) and w.op == "get_attr") or (b is not None and b.op != "get_attr"):
                continue
            replace_with_call(gm, node, ops.linear.default, (x, w, b))
            n += 1
        return PassResult(n)
