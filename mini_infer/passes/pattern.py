"""Small helpers for matching FX nodes by hand: op tests, constant args, shapes from fake metadata.

Only inspection helpers live here; no pass logic and no graph edits.
"""

from __future__ import annotations

import fnmatch
from typing import Any

import torch
import torch.fx as fx

aten = torch.ops.aten
# the ops that only re-view a tensor's elements (same values, same order)
VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def is_op(node: Any, *targets: Any) -> bool:
    """True when `node` is a call_function to one of `targets` (OpOverload or OpOverloadPacket)."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    for t in targets:
        if node.target is t:
            return True
        if isinstance(t, torch._ops.OpOverloadPacket) and getattr(node.target, "overloadpacket", None) is t:
            return True
    return False


def val(node: Any) -> Any:
    """The fake value recorded for `node` (a FakeTensor, SymInt, ...), or None."""
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def shape(node: Any) -> tuple | None:
    v = val(node)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def dtype(node: Any) -> torch.dtype | None:
    v = val(node)
    return v.dtype if isinstance(v, torch.Tensor) else None


def same_shape(a: Any, b: Any) -> bool:
    """Shapes equal, comparing symbolic sizes by expression (never adds a guard)."""
    sa, sb = shape(a), shape(b)
    if sa is None or sb is None or len(sa) != len(sb):
        return False
    return all(str(x) == str(y) for x, y in zip(sa, sb))


def ndim(node: Any) -> int | None:
    s = shape(node)
    return None if s is None else len(s)


def is_last_dim(dims: Any, rank: int | None) -> bool:
    """`dims` (an int or a one-element list) names the last dimension of a rank-`rank` tensor."""
    if isinstance(dims, (list, tuple)):
        if len(dims) != 1:
            return False
        dims = dims[0]
    return isinstance(dims, int) and rank is not None and dims in (-1, rank - 1)


def only_user(node: fx.Node, user: fx.Node) -> bool:
    return len(node.users) == 1 and user in node.users


def kwarg_or_arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    if name in node.kwargs:
        return node.kwargs[name]
    return node.args[index] if len(node.args) > index else default


def module_chain(node: fx.Node) -> list[tuple[str, str]]:
    """(module path, class name) of every module `node` was traced in, outermost first (from the
    `nn_module_stack` metadata torch.export leaves on each node; empty when there is none)."""
    chain = []
    for path, typ in (node.meta.get("nn_module_stack") or {}).values():
        name = typ if isinstance(typ, str) else getattr(typ, "__qualname__", str(typ))
        chain.append((path, name.rsplit(".", 1)[-1]))
    return chain


def repeat_kv_source(node: Any) -> fx.Node | None:
    """The KV tensor that HF's repeat_kv expands into `node`, or None:
    reshape(expand(unsqueeze(x, 2), [B, Hkv, n_rep, T, D]), [B, H, T, D]) → x."""
    if is_op(node, aten.reshape.default, aten.view.default, aten._unsafe_view.default):
        e = node.args[0]
        if is_op(e, aten.expand.default) and is_op(e.args[0], aten.unsqueeze.default) and e.args[0].args[1] == 2:
            return e.args[0].args[0]
    return None


# per-row ops that may follow lm_head before the output (scaling, softcapping, casts)
_LOGITS_ELEMENTWISE = (aten.mul.Tensor, aten.div.Tensor, aten.tanh.default, aten.to.dtype, aten._to_copy.default,
                       aten.add.Tensor, aten.mul.Scalar, aten.div.Scalar)


def lm_head_of(out: Any) -> fx.Node | None:
    """The `linear` (lm_head) whose result reaches `out` (the graph's logits) through per-row ops, or None."""
    node = out
    while isinstance(node, fx.Node):
        if is_op(node, aten.linear.default):
            return node
        if not is_op(node, *_LOGITS_ELEMENTWISE):
            return None
        node = node.args[0]
    return None


def pattern_matches(pattern: str, name: str) -> bool:
    """fnmatch of a module-path pattern (`down_proj`, `layers.0.*`, `model.layers.1.self_attn.*`) on the whole
    module path `name` or on a dotted suffix of it (the quantization passes' `skip`)."""
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, "*." + pattern)
