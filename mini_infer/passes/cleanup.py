"""Cleanup: strip what export leaves behind that does no work at inference time.

Removes runtime metadata asserts, inlines grad/autocast wrapper sub-graphs, drops casts to the dtype a tensor
already has and views to the shape it already has, then dead code. It never changes a value.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from mini_infer.passes.base import GraphPass, PassContext, PassResult
from mini_infer.passes.pattern import CASTS, aten, dtype, is_op, same_shape, val

_ASSERTS = (
    aten._assert_tensor_metadata.default,
    aten._assert_scalar.default,
    aten.sym_constrain_range_for_size.default,
    aten.sym_constrain_range.default,
)
_WRAPPERS = tuple(
    op for op in (getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None),
                  getattr(torch.ops.higher_order, "wrap_with_autocast", None)) if op is not None
)


def _inline_wrapper(gm: fx.GraphModule, node: fx.Node) -> None:
    """Replace a `wrap_with_*` call by the body of its sub-graph."""
    # args: (flag..., submodule get_attr, *operands); the submodule is the first get_attr arg
    sub_idx = next(i for i, a in enumerate(node.args) if isinstance(a, fx.Node) and a.op == "get_attr")
    sub: fx.GraphModule = getattr(gm, node.args[sub_idx].target)
    operands = node.args[sub_idx + 1:]
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    val_map: dict[fx.Node, fx.Node] = dict(zip(placeholders, operands))
    if any(sn.op == "get_attr" for sn in sub.graph.nodes):
        raise NotImplementedError(f"sub-graph {node.args[sub_idx].target} reads attributes")
    with gm.graph.inserting_before(node):
        outputs = gm.graph.graph_copy(sub.graph, val_map)
    for user in list(node.users):
        if is_op(user, operator.getitem):
            user.replace_all_uses_with(outputs[user.args[1]])
            gm.graph.erase_node(user)
    if node.users:
        node.replace_all_uses_with(outputs if not isinstance(outputs, (tuple, list)) else outputs[0])
    gm.graph.erase_node(node)


def _is_noop_cast(node: fx.Node) -> bool:
    if not is_op(node, *CASTS):
        return False
    src, out = val(node.args[0]), val(node)
    if not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor):
        return False
    # a cast that names a device may move data (fake values live on the CPU during validation, so their
    # devices cannot tell): keep it
    if any(isinstance(a, torch.device) for a in (*node.args, *node.kwargs.values())):
        return False
    return dtype(node.args[0]) == out.dtype


def _is_noop_view(node: fx.Node) -> bool:
    if not is_op(node, aten.view.default, aten.reshape.default, aten.expand.default, aten.alias.default,
                 aten._unsafe_view.default, aten.contiguous.default, aten.clone.default):
        return False
    if is_op(node, aten.contiguous.default, aten.clone.default):
        return False  # they change strides, which kernels downstream may rely on
    return same_shape(node.args[0], node)


class Cleanup(GraphPass):
    """Remove asserts, wrapper sub-graphs, no-op casts and views, and dead code."""

    name = "cleanup"
    stage = "cleanup"

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        graph = gm.graph
        removed = {"asserts": 0, "wrappers": 0, "casts": 0, "views": 0}
        for node in list(graph.nodes):
            if is_op(node, *_ASSERTS) and not node.users:
                graph.erase_node(node)
                removed["asserts"] += 1
            elif _WRAPPERS and is_op(node, *_WRAPPERS):
                _inline_wrapper(gm, node)
                removed["wrappers"] += 1
        for node in list(graph.nodes):
            if _is_noop_cast(node):
                removed["casts"] += 1
            elif _is_noop_view(node):
                removed["views"] += 1
            else:
                continue
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
        before = len(graph.nodes)
        graph.eliminate_dead_code()
        dead = before - len(graph.nodes)
        note = ", ".join(f"{v} {k}" for k, v in removed.items() if v) + (f", {dead} dead" if dead else "")
        return PassResult(sum(removed.values()) + dead, note)
