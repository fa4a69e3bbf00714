"""FuseRotary: HF's rotary application `x * cos + rotate_half(x) * sin` → `mini_infer.apply_rotary`.

`rotate_half(x)` is `cat([-x[..., d/2:], x[..., :d/2]], -1)` (the neox/HF layout). Each of q and k matches
once per layer. Interleaved (GPT-J style) rotary, as in DeepSeek's HF code, is a different sub-graph and is
left alone; the cos/sin computation is untouched.
"""

from __future__ import annotations

import torch
import torch.fx as fx

import mini_infer.ops  # noqa: F401
from mini_infer.passes.base import GraphPass, PassContext, PassResult, replace_with_call
from mini_infer.passes.pattern import aten, is_last_dim, is_op, ndim, shape

ops = torch.ops.mini_infer
_END = (2**63 - 1, None)


def _slice_of(node: object, x: fx.Node) -> tuple[int, int] | None:
    """If `node` is x[..., a:b] along the last dim, return (a, b) with b=-1 meaning the end."""
    if not is_op(node, aten.slice.Tensor) or node.args[0] is not x:
        return None
    dim = node.args[1] if len(node.args) > 1 else 0
    if not is_last_dim(dim, ndim(x)):
        return None
    start = node.args[2] if len(node.args) > 2 else 0
    end = node.args[3] if len(node.args) > 3 else None
    return start, (-1 if end in _END else end)


def _is_rotate_half(node: object, x: fx.Node) -> bool:
    if not is_op(node, aten.cat.default) or len(node.args[0]) != 2:
        return False
    dim = node.args[1] if len(node.args) > 1 else 0
    if not is_last_dim(dim, ndim(node)):
        return False
    neg, first = node.args[0]
    if not is_op(neg, aten.neg.default):
        return False
    second = _slice_of(neg.args[0], x)
    head = _slice_of(first, x)
    xs = shape(x)
    if second is None or head is None or xs is None or not isinstance(xs[-1], int):
        return False
    half = xs[-1] // 2
    return head == (0, half) and second == (half, -1)


def _match(node: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node] | None:
    if not is_op(node, aten.add.Tensor) or len(node.args) != 2:
        return None
    for m1, m2 in (node.args, node.args[::-1]):
        if not (is_op(m1, aten.mul.Tensor) and is_op(m2, aten.mul.Tensor)):
            continue
        for x, cos in (m1.args, m1.args[::-1]):
            if not isinstance(x, fx.Node):
                continue
            for rot, sin in (m2.args, m2.args[::-1]):
                if _is_rotate_half(rot, x):
                    return x, cos, sin
    return None


class FuseRotary(GraphPass):
    """q*cos + rotate_half(q)*sin (and the same for k) → apply_rotary."""

    name = "fuse_rotary"
    stage = "fusion"
    requires = ("cleanup",)

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        graph = gm.graph
        n = 0
        for node in list(graph.nodes):
            m = _match(node)
            if m is None:
                continue
            replace_with_call(gm, node, ops.apply_rotary.default, m)
            n += 1
        return PassResult(n)
