"""FuseSiluMul: the SwiGLU gate `silu(gate) * up` → `mini_infer.silu_and_mul(gate, up)`.

Matches only an elementwise product of two same-shape tensors where one side is `aten.silu`; other
activations are left alone (GeLU-tanh gates are fuse_gelu_mul's, which shares this file's `fuse_gated_products`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

import mini_infer.ops  # noqa: F401
from mini_infer.passes.base import GraphPass, PassContext, PassResult, replace_with_call
from mini_infer.passes.pattern import aten, is_op, only_user, same_shape

ops = torch.ops.mini_infer


def fuse_gated_products(gm: fx.GraphModule, is_activation: Callable[[fx.Node], bool], fused: Any) -> int:
    """Replace each `mul(act(a), b)` (either operand order) of two same-shape tensors, where `is_activation(act)` and
    nothing but the product reads act, by `fused(a, b)`; the number replaced (also fuse_gelu_mul's matcher)."""
    n = 0
    for node in list(gm.graph.nodes):
        if not is_op(node, aten.mul.Tensor) or len(node.args) != 2:
            continue
        for act, up in (node.args, node.args[::-1]):
            if (isinstance(act, fx.Node) and is_activation(act) and only_user(act, node) and isinstance(up, fx.Node)
                    and same_shape(act, up)):
                replace_with_call(gm, node, fused, (act.args[0], up))
                n += 1
                break
    return n


class FuseSiluMul(GraphPass):
    """mul(silu(a), b) → silu_and_mul(a, b)."""

    name = "fuse_silu_mul"
    stage = "fusion"
    requires = ("cleanup",)

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        return PassResult(fuse_gated_products(gm, lambda act: is_op(act, aten.silu.default), ops.silu_and_mul.default))
