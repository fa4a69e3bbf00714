"""Small helpers for matching FX nodes by hand: op tests, constant args, shapes from fake metadata.

Only inspection helpers live here; no pass logic and no graph edits.
"""

from __future__ import annotations

import fnmatch
import operator
from typing import Any, NamedTuple

import torch
import torch.fx as fx

import mini_infer.ops  # noqa: F401 - registers torch.ops.mini_infer (attention_calls matches one of them)

aten = torch.ops.aten
# the ops that only re-view a tensor's elements (same values, same order)
VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
# the ops that cast a tensor (dtype, layout or device)
CASTS = (aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default, aten.to.device)


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


def gate_up_halves(act: fx.Node) -> fx.Node | None:
    """The `split_with_sizes` whose [0] and [1], read by nothing but `act`, are `act`'s first two arguments (gate,
    up), when it splits its input's last dim into exactly two equal halves; else None (a gated activation of one
    merged gate_up output: fuse_gate_up_silu)."""
    if len(act.args) < 2:
        return None
    gate, up = act.args[:2]
    if not (is_op(gate, operator.getitem) and is_op(up, operator.getitem) and only_user(gate, act)
            and only_user(up, act) and gate.args[0] is up.args[0] and (gate.args[1], up.args[1]) == (0, 1)):
        return None
    split = gate.args[0]
    if not is_op(split, aten.split_with_sizes.default) or split.kwargs or len(split.args) != 3 \
            or len(split.users) != 2:
        return None
    source, sizes, dim = split.args
    v = val(source)
    if v is None or len(sizes) != 2 or sizes[0] != sizes[1] or dim not in (-1, v.dim() - 1):
        return None
    return split


def kwarg_or_arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    if name in node.kwargs:
        return node.kwargs[name]
    return node.args[index] if len(node.args) > index else default


def attention_calls(graph: fx.Graph) -> list[fx.Node]:
    """The captured attentions in graph order: `scaled_dot_product_attention` nodes and the capture's
    `mini_infer.attention` ones (passes/capture.py); both take (q, k, v, ...) first, q [B, Hq, T, D]."""
    return [n for n in graph.nodes if is_op(n, aten.scaled_dot_product_attention.default)
            or is_op(n, torch.ops.mini_infer.attention.default)]


class AttentionFields(NamedTuple):
    """What an attention node says of its math; None where the node does not say (SDPA has no softcap, window or
    sinks)."""

    scale: float | None  # None: 1 / sqrt(head dim)
    softcap: float | None
    sliding_window: int | None
    sinks: fx.Node | None = None  # the [Hq] attention sinks (GPT-OSS's s_aux), or None: none


def attention_fields(node: fx.Node) -> AttentionFields:
    """Scale, softcap, window and sinks of one of `attention_calls`' nodes."""
    if is_op(node, aten.scaled_dot_product_attention.default):
        scale = kwarg_or_arg(node, 6, "scale")
        return AttentionFields(float(scale) if scale is not None else None, None, None)
    scale, softcap, window = node.args[3:6]
    return AttentionFields(float(scale), float(softcap), int(window), kwarg_or_arg(node, 6, "sinks"))


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


def unpacked(x: Any) -> tuple[fx.Node, fx.Node] | None:
    """(src, the select) when `x` is `transpose(select(src, 0, 0), 0, 1)` (the paged_attention pass's packing of a
    [1, H, T, D] tensor into [T, H, D]), else None."""
    if not is_op(x, aten.transpose.int) or sorted(x.args[1:3]) != [0, 1]:
        return None
    sel = x.args[0]
    if not is_op(sel, aten.select.int) or tuple(sel.args[1:3]) != (0, 0):
        return None
    return sel.args[0], sel


class RotaryAttention(NamedTuple):
    """A `qk_rotary` whose k output reaches a `paged_attention`'s k (see `rotary_attention`)."""

    rot: fx.Node  # the qk_rotary node
    q_rot: fx.Node  # its q output (getitem 0)
    k_rot: fx.Node  # its k output (getitem 1), read only by the attention's packing of it
    v: fx.Node  # the 4-D node the attention's v packs
    anchor: fx.Node  # the later of rot and v in graph order: where a node reading both may go


def rotary_attention(attn: fx.Node, order: dict[fx.Node, int]) -> RotaryAttention | None:
    """The qk_rotary feeding `attn` (a positional-only `paged_attention` call, `order` its graph's node positions)
    when its k output is the attention's k, packed (`unpacked`), neither it nor those views read by anything else,
    its q output is a getitem that nothing reads before v exists, and v is such a packing of a 4-D node; else
    None. What FuseKVWrite and FuseRotaryAttention both replace."""
    k_packed = attn.args[1]
    found, v = unpacked(k_packed), unpacked(attn.args[2])
    if found is None or v is None or attn.kwargs or attn.args[0] is k_packed or attn.args[2] is k_packed \
            or not only_user(k_packed, attn):
        return None
    k_rot, sel = found
    if not (only_user(sel, k_packed) and only_user(k_rot, sel) and is_op(k_rot, operator.getitem)
            and k_rot.args[1] == 1 and is_op(k_rot.args[0], torch.ops.mini_infer.qk_rotary.default)):
        return None
    rot = k_rot.args[0]
    q_rot = [u for u in rot.users if u is not k_rot]
    if len(q_rot) != 1 or not is_op(q_rot[0], operator.getitem) or q_rot[0].args[1] != 0:
        return None
    anchor = max(rot, v[0], key=order.__getitem__)
    if any(order[u] <= order[anchor] for u in q_rot[0].users):  # q_rot is read before v exists
        return None
    return RotaryAttention(rot, q_rot[0], k_rot, v[0], anchor)


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
