"""FuseRotary: HF's rotary application `x * cos + rotate_half(x) * sin` → `mini_infer.apply_rotary`.

`rotate_half(x)` is `cat([-x[..., d/2:], x[..., :d/2]], -1)` (the neox/HF layout). The same rotation written on
the halves, as GPT-OSS's HF code does with cos / sin of half the head dim,

    x1, x2 = chunk(x, 2, -1);  cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

becomes `apply_rotary(x, cat([cos, cos], -1), cat([sin, sin], -1))` (the same products and sums, so the same
values: a - b is a + (-b) in floating point), one pair of cats per distinct cos / sin (a per-layer
`unsqueeze` of one is applied after the cat, so the layers share it). Each of q and k matches
once per layer. Interleaved (GPT-J style) rotary, as in DeepSeek's HF code, is a different sub-graph and is
left alone; the cos/sin computation is untouched.
"""

from __future__ import annotations

import operator

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


def _chunk_halves(a: object, b: object) -> fx.Node | None:
    """x when `a`, `b` are x's two halves along the last dim by `chunk(x, 2, -1)`, in that order; else None."""
    if not (is_op(a, operator.getitem) and is_op(b, operator.getitem)) or a.args[0] is not b.args[0]:
        return None
    chunk = a.args[0]
    if not is_op(chunk, aten.chunk.default) or (a.args[1], b.args[1]) != (0, 1) or chunk.args[1] != 2:
        return None
    x = chunk.args[0]
    dim = chunk.args[2] if len(chunk.args) > 2 else 0
    xs = shape(x)
    if not isinstance(x, fx.Node) or not is_last_dim(dim, ndim(x)) or xs is None or not isinstance(xs[-1], int) \
            or xs[-1] % 2:
        return None
    return x


def _products(node: object) -> list[tuple[object, object]]:
    """(a, b) and (b, a) when `node` is a * b (a Tensor product of two nodes), else []."""
    if not is_op(node, aten.mul.Tensor) or len(node.args) != 2:
        return []
    return [tuple(node.args), tuple(node.args[::-1])]


def _match_halves(node: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node] | None:
    """(x, cos, sin) when `node` is cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1) over chunk(x, 2, -1)."""
    if not is_op(node, aten.cat.default) or len(node.args[0]) != 2:
        return None
    dim = node.args[1] if len(node.args) > 1 else 0
    first, second = node.args[0]
    if not is_last_dim(dim, ndim(node)) or not is_op(first, aten.sub.Tensor) or len(first.args) != 2 \
            or not is_op(second, aten.add.Tensor) or len(second.args) != 2:
        return None
    for x1, cos in _products(first.args[0]):
        for x2, sin in _products(first.args[1]):
            x = _chunk_halves(x1, x2)
            if x is None or not all(isinstance(t, fx.Node) for t in (cos, sin)):
                continue
            for p, q in (second.args, second.args[::-1]):
                if (x2, cos) in _products(p) and (x1, sin) in _products(q):
                    return x, cos, sin
    return None


def _doubled(gm: fx.GraphModule, half: fx.Node, cache: dict[fx.Node, fx.Node]) -> fx.Node:
    """cat([half, half], -1), one cat per source: an `unsqueeze` of a non-last dim (HF's per-layer
    `cos.unsqueeze(1)`) is taken after the cat of its input, so the layers share one."""
    if half in cache:
        return cache[half]
    src = half.args[0] if is_op(half, aten.unsqueeze.default) else None
    dim = half.args[1] if src is not None else None
    if isinstance(src, fx.Node) and isinstance(dim, int) and 0 <= dim < ndim(half) - 1:
        inner = _doubled(gm, src, cache)
        with gm.graph.inserting_after(half):
            cache[half] = gm.graph.call_function(aten.unsqueeze.default, (inner, dim))
    else:
        with gm.graph.inserting_after(half):
            cache[half] = gm.graph.call_function(aten.cat.default, ([half, half], -1))
    return cache[half]


class FuseRotary(GraphPass):
    """q*cos + rotate_half(q)*sin (and the same for k), or the rotation on chunked halves → apply_rotary."""

    name = "fuse_rotary"
    stage = "fusion"
    requires = ("cleanup",)

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        graph = gm.graph
        n = 0
        doubled: dict[fx.Node, fx.Node] = {}
        for node in list(graph.nodes):
            m = _match(node)
            if m is None:
                halves = _match_halves(node)
                if halves is None:
                    continue
                x, cos, sin = halves
                m = (x, _doubled(gm, cos, doubled), _doubled(gm, sin, doubled))
            replace_with_call(gm, node, ops.apply_rotary.default, m)
            n += 1
        return PassResult(n)
