"""FuseRMSNorm: the HF RMSNorm sub-graph → `mini_infer.rms_norm`, and residual add + RMSNorm →
`mini_infer.fused_add_rms_norm`.

Matches `weight * (h * rsqrt(mean(h**2, -1, keepdim) + eps)).to(dtype)` with `h = x.to(float32)` (the cast is
gone after Cleanup when x is already fp32), the form of Llama/Qwen2/Qwen3/Mistral/Mixtral/DeepSeek norms,
the q/k norms of Qwen3 included. GPT-OSS's norm, `(weight * h * rsqrt(...)).to(dtype)`, is the same where x is fp32
and is matched there; on a lower-precision x its weight multiplies in fp32 before the cast, which `rms_norm` does
not round alike: it is left to fuse_gemma_rmsnorm, whose op rounds so. Then a norm whose input is `a + b` of two same-shape tensors becomes one
fused op returning (normed, sum), the sum serving the residual stream. It matches nothing else: variants
such as Gemma's `(1 + weight)` are left to fuse_gemma_rmsnorm, which shares its normalization match
(`rms_normalized`) and its rewrite (`fuse_norms`: the norms, then their residual adds).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

import mini_infer.ops  # noqa: F401  (registers torch.ops.mini_infer)
from mini_infer.passes.base import GraphPass, PassContext, PassResult, replace_with_call
from mini_infer.passes.pattern import aten, dtype, is_last_dim, is_op, ndim, only_user, same_shape

ops = torch.ops.mini_infer


def strip_f32_cast(node: fx.Node) -> fx.Node:
    """`node`'s input when `node` is a cast to float32 (HF's `x.float()`), else `node`."""
    if is_op(node, aten.to.dtype, aten._to_copy.default) and dtype(node) == torch.float32:
        return node.args[0]
    return node


def rms_normalized(node: fx.Node) -> tuple[fx.Node, float] | None:
    """`node` = h * rsqrt(mean(h**2, -1, keepdim) + eps), the rsqrt read by nothing else → (h, eps), or None.
    The normalization both HF norm forms share (Llama's here, Gemma's in fuse_gemma_rmsnorm)."""
    if not is_op(node, aten.mul.Tensor):
        return None
    for h, rs in (node.args, node.args[::-1]):
        if not is_op(rs, aten.rsqrt.default) or not only_user(rs, node):
            continue
        add = rs.args[0]
        if not is_op(add, aten.add.Tensor, aten.add.Scalar) or not isinstance(add.args[1], float):
            continue
        mean = add.args[0]
        if not is_op(mean, aten.mean.dim) or not (len(mean.args) > 2 and mean.args[2]):
            continue
        if not is_last_dim(mean.args[1], ndim(mean)):
            continue
        sq = mean.args[0]
        if is_op(sq, aten.pow.Tensor_Scalar) and sq.args[1] == 2 and sq.args[0] is h:
            return h, float(add.args[1])
    return None


def match_rms_norm(out: fx.Node) -> tuple[fx.Node, fx.Node, float] | None:
    """`out` = weight * normed → (x, weight get_attr, eps), or None."""
    if not is_op(out, aten.mul.Tensor) or len(out.args) != 2:
        return None
    a, b = out.args
    for weight, normed in ((a, b), (b, a)):
        if not (isinstance(weight, fx.Node) and weight.op == "get_attr" and ndim(weight) == 1):
            continue
        inner = normed
        if is_op(inner, aten.to.dtype) and only_user(inner, out):
            inner = inner.args[0]
        found = rms_normalized(inner)
        if found is None:
            continue
        x = strip_f32_cast(found[0])
        if inner is normed and dtype(out) == torch.float32 and dtype(x) != torch.float32:
            return None  # the weight multiplies in fp32 before the cast back (GPT-OSS): another rounding
        return x, weight, found[1]
    return None


class FuseRMSNorm(GraphPass):
    """RMSNorm sub-graphs → rms_norm; residual add + rms_norm → fused_add_rms_norm."""

    name = "fuse_rmsnorm"
    stage = "fusion"
    requires = ("cleanup",)

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        norms, fused = fuse_norms(gm, match_rms_norm, ops.rms_norm.default, ops.fused_add_rms_norm.default)
        return PassResult(norms, f"{norms - fused} rms_norm, {fused} fused_add_rms_norm")


def fuse_norms(gm: fx.GraphModule, match, norm_op, fused_op) -> tuple[int, int]:
    """Each node `match` recognizes (returning the norm's (x, weight, eps)) → `norm_op(x, weight, eps)`; then each
    such norm of a residual add → `fused_op` (`_fuse_residual_adds`). Returns (norms, how many of them fused)."""
    norms = 0
    for node in list(gm.graph.nodes):
        m = match(node)
        if m is not None:
            replace_with_call(gm, node, norm_op, m)
            norms += 1
    gm.graph.eliminate_dead_code()
    return norms, _fuse_residual_adds(gm.graph, norm_op, fused_op)


def _fuse_residual_adds(graph: fx.Graph, norm_op, fused_op) -> int:
    """Each `norm_op(a + b, *rest)` (a, b and the sum of one shape) → `fused_op(a, b, *rest)` returning (normed,
    sum), the sum's other readers reading it from there; returns how many."""
    fused = 0
    for node in list(graph.nodes):
        if not is_op(node, norm_op):
            continue
        s = node.args[0]
        if not (is_op(s, aten.add.Tensor) and len(s.args) == 2 and all(isinstance(a, fx.Node) for a in s.args)
                and same_shape(s.args[0], s) and same_shape(s.args[1], s) and "alpha" not in s.kwargs):
            continue
        with graph.inserting_after(s):
            pair = graph.call_function(fused_op, (s.args[0], s.args[1], *node.args[1:]))
        with graph.inserting_after(pair):
            normed = graph.call_function(operator.getitem, (pair, 0))
            total = graph.call_function(operator.getitem, (pair, 1))
        normed.meta["val"], total.meta["val"] = node.meta.get("val"), s.meta.get("val")
        pair.meta["val"] = (normed.meta["val"], total.meta["val"])
        node.replace_all_uses_with(normed)
        graph.erase_node(node)
        s.replace_all_uses_with(total)
        graph.erase_node(s)
        fused += 1
    return fused
