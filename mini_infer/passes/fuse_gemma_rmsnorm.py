"""FuseGemmaRMSNorm: Gemma's RMSNorm sub-graph → `mini_infer.gemma_rms_norm`, and residual add + that norm →
`mini_infer.fused_add_gemma_rms_norm`.

Matches `((h * rsqrt(mean(h**2, -1, keepdim) + eps)) * (weight.float() + 1)).to(dtype)` with `h = x.to(float32)`
(casts already gone after Cleanup when x and the weight are fp32), the norms of Gemma, Gemma 2 and Gemma 3 text
models (four a Gemma 2 layer and the final one). Then a norm whose input is `a + b` of two same-shape tensors becomes
one fused op returning (normed, sum), the sum serving the residual stream (Gemma 2's pre-feedforward and next input
norms). Llama's norm (`weight * normed.to(dtype)`, fuse_rmsnorm's) is not matched here, nor is this one there: the two
round differently in 16-bit dtypes.

The norm of GPT-OSS and OLMo 2, `(weight * (h * rsqrt(...))).to(dtype)`, rounds as Gemma's does where x is 16-bit
(the weight multiplies in fp32, before the cast; fuse_rmsnorm takes it where x is fp32 and the two forms agree): it
becomes the same ops over an fp32 buffer `weight - 1`, since the kernel's `1 + (weight - 1)` is `weight` again,
checked bit for bit per weight at compile time (a weight that does not round-trip leaves its norm as captured).
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


def match_fp32_weighted_rms_norm(out: fx.Node) -> tuple[fx.Node, fx.Node, float] | None:
    """`out` = (weight * normed).to(dtype) with normed the fp32 normalization of a 16-bit x, weight a 1-D get_attr
    (GPT-OSS's, OLMo 2's norm) → (x, weight, eps), or None."""
    if not is_op(out, aten.to.dtype, aten._to_copy.default):
        return None
    node = out.args[0]
    if not (is_op(node, aten.mul.Tensor) and len(node.args) == 2 and only_user(node, out)):
        return None
    for weight, normed in (node.args, node.args[::-1]):
        weight = strip_f32_cast(weight) if isinstance(weight, fx.Node) else weight
        if not (isinstance(weight, fx.Node) and weight.op == "get_attr" and ndim(weight) == 1
                and isinstance(normed, fx.Node) and only_user(normed, node)):
            continue
        found = rms_normalized(normed)
        if found is None:
            continue
        x = strip_f32_cast(found[0])
        if dtype(normed) == torch.float32 and dtype(x) in (torch.bfloat16, torch.float16) and dtype(out) == dtype(x):
            return x, weight, found[1]
    return None


def _minus_one(gm: fx.GraphModule, weight: fx.Node, made: dict) -> fx.Node | None:
    """A get_attr of the fp32 buffer `weight - 1` (one per weight, at the graph's top: the residual fusion may move
    its norm up), or None when `1 + (weight - 1)` is not `weight` bit for bit in fp32."""
    if weight not in made:
        w = PassContext.tensor_of(gm, weight).float()
        shifted = w - 1.0
        exact = torch.equal(shifted + 1.0, w)
        first = next(iter(gm.graph.nodes))
        made[weight] = PassContext.add_tensor(gm, f"{weight.target}_minus_one", shifted, first) if exact else None
    return made[weight]


class FuseGemmaRMSNorm(GraphPass):
    """Gemma RMSNorm sub-graphs → gemma_rms_norm; residual add + it → fused_add_gemma_rms_norm."""

    name = "fuse_gemma_rmsnorm"
    stage = "fusion"
    requires = ("cleanup",)

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        made: dict[fx.Node, fx.Node | None] = {}
        shifted = 0

        def match(node: fx.Node) -> tuple[fx.Node, fx.Node, float] | None:
            nonlocal shifted
            found = match_gemma_rms_norm(node)
            if found is not None:
                return found
            found = match_fp32_weighted_rms_norm(node)
            if found is None:
                return None
            x, weight, eps = found
            w1 = _minus_one(gm, weight, made)
            if w1 is None:
                return None
            shifted += 1
            return x, w1, eps

        norms, fused = fuse_norms(gm, match, ops.gemma_rms_norm.default, ops.fused_add_gemma_rms_norm.default)
        if not norms and not fused:
            return PassResult(0, "no Gemma RMSNorm in the graph")
        note = f"{norms - fused} gemma_rms_norm, {fused} fused_add_gemma_rms_norm"
        unmatched = sum(1 for w in made.values() if w is None)
        if shifted or unmatched:
            note += f" ({shifted} of them fp32-weighted norms over weight - 1"
            note += f"; {unmatched} weights left, not exact as weight - 1)" if unmatched else ")"
        return PassResult(norms, note)
