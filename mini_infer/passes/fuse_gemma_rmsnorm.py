"""FuseGemmaRMSNorm: Gemma's RMSNorm sub-graph → `mini_infer.gemma_rms_norm`, and residual add + that norm →
`mini_infer.fused_add_gemma_rms_norm`.

Matches `((h * rsqrt(mean(h**2, -1, keepdim) + eps)) * (weight.float() + 1)).to(dtype)` with `h = x.to(float32)`
(casts already gone after Cleanup when x and the weight are fp32), the norms of Gemma, Gemma 2 and Gemma 3 text
models (four a Gemma 2 layer and the final one). Then a norm whose input is `a + b` of two same-shape tensors becomes
one fused op returning (normed, sum), the sum serving the residual stream (Gemma 2's pre-feedforward and next input
norms). Llama's norm (`weight * normed.to(dtype)`, fuse_rmsnorm's) is not matched here, nor is this one there: the two
round differently in 16-bit dtypes.
"""

from __future__ import annotations

import torch
import torch.fx as fx

import mini_infer.ops  # noqa: F401  (registers torch.ops.mini_infer)
from mini_infer.passes.base import GraphPass, PassContext, PassResult
from mini_infer.passes.fuse_rmsnorm import fuse_norms, rms_normalized, strip_f32_cast
from mini_infer.passes.pattern import aten, dtype, is_op, ndim, only_user

ops = torch.ops.mini_infer


def _one_plus_weight(node: fx.Node) -> fx.Node | None:
    """`node` = weight(.float()) + 1 (either order) with weight a 1-D get_attr → the weight, else None."""
    if not is_op(node, aten.add.Tensor, aten.add.Scalar) or len(node.args) != 2 or "alpha" in node.kwargs:
        return None
    for w, one in (node.args, node.args[::-1]):
        if one == 1 or one == 1.0:
            w = strip_f32_cast(w) if isinstance(w, fx.Node) else w
            if isinstance(w, fx.Node) and w.op == "get_attr" and ndim(w) == 1:
                return w
    return None


def match_gemma_rms_norm(out: fx.Node) -> tuple[fx.Node, fx.Node, float] | None:
    """`out` = the norm's last node (its cast back, or the weight multiply) → (x, weight, eps), or None. A multiply
    followed by a cast is matched at the cast."""
    node = out
    if is_op(out, aten.to.dtype, aten._to_copy.default, aten.type_as.default):  # HF's `.type_as(x)`
        node = out.args[0]
        if not (isinstance(node, fx.Node) and only_user(node, out)):
            return None
    if not is_op(node, aten.mul.Tensor) or len(node.args) != 2:
        return None
    for normed, w1 in (node.args, node.args[::-1]):
        if not (isinstance(w1, fx.Node) and isinstance(normed, fx.Node)):
            continue
        weight = _one_plus_weight(w1)
        found = rms_normalized(normed) if weight is not None and only_user(normed, node) else None
        if found is None:
            continue
        h, eps = found
        x = strip_f32_cast(h)
        if node is out and dtype(x) != dtype(out):  # a 16-bit x needs its cast back: matched at the cast
            return None
        if node is not out and dtype(out) != dtype(x):
            return None
        return x, weight, eps
    return None


class FuseGemmaRMSNorm(GraphPass):
    """Gemma RMSNorm sub-graphs → gemma_rms_norm; residual add + it → fused_add_gemma_rms_norm."""

    name = "fuse_gemma_rmsnorm"
    stage = "fusion"
    requires = ("cleanup",)

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        norms, fused = fuse_norms(gm, match_gemma_rms_norm, ops.gemma_rms_norm.default,
                                  ops.fused_add_gemma_rms_norm.default)
        if not norms and not fused:
            return PassResult(0, "no Gemma RMSNorm in the graph")
        return PassResult(norms, f"{norms - fused} gemma_rms_norm, {fused} fused_add_gemma_rms_norm")
