"""FuseSiluMul: the SwiGLU gate `silu(gate) * up` → `mini_infer.silu_and_mul(gate, up)`.

Matches only an elementwise product of two same-shape tensors where one side is `aten.silu`; other
activations (GELU-tanh gates etc.) are left alone.
"""

from __future__ import annotations

import torch
import torch.fx as fx

import mini_infer.ops  # noqa: F401
from mini_infer.passes.base import GraphPass, PassContext, PassResult, replace_with_call
from mini_infer.passes.pattern import aten, is_op, only_user, same_shape

ops = torch.ops.mini_infer


class FuseSiluMul(GraphPass):
    """mul(silu(a), b) → silu_and_mul(a, b)."""

    name = "fuse_silu_mul"
    stage = "fusion"
    requires = ("cleanup",)

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        graph = gm.graph
        n = 0
        for node in list(graph.nodes):
            if not is_op(node, aten.mul.Tensor) or len(node.args) != 2:
                continue
            for act, up in (node.args, node.args[::-1]):
                if (is_op(act, aten.silu.default) and only_user(act, node) and isinstance(up, fx.Node)
                        and same_shape(act, up)):
                    replace_with_call(gm, node, ops.silu_and_mul.default, (act.args[0], up))
                    n += 1
                    break
        return PassResult(n)
