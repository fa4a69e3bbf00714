"""FuseQKRotary: one attention's `apply_rotary(q)` and `apply_rotary(k)`, and the per-head `rms_norm` feeding each
(Qwen3's q_norm / k_norm), → one `mini_infer.qk_rotary` node: one launch per layer instead of two to four.

Runs after fuse_rotary (whose `apply_rotary` nodes it pairs) and, to take the norms in, after fuse_rmsnorm. For each
`scaled_dot_product_attention` or the capture's `mini_infer.attention` (so before paged_attention replaces it), q
must be an `apply_rotary` node and k one (read through HF's repeat_kv), both with the same cos and sin nodes,
cos/sin 4-D with one head ([B, 1, T, D]), q and k 4-D sharing B, T and D (compared by expression). A norm is taken
in when a rotary's input is `rms_norm(x, w, eps)`, seen through transposes that keep the last dim (HF's
`.transpose(1, 2)`), with w of shape [D] and the norm and the transposes read by nothing else; the op then reads x
through the same transposes. Two norms with different eps are both left out (the op takes one eps). Left alone,
exact as they were: attentions whose q or k is not such a rotary (DeepSeek's MLA: q = cat(q_nope, q_pe), interleaved
rotary), rotaries with other readers placed between the two, and cos/sin with a head dimension. The graph dump shows
`qk_rotary(q, k, cos, sin, q_norm_w | None, k_norm_w | None, eps)` and its two outputs as `q_rot` / `k_rot`.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

import mini_infer.ops  # noqa: F401  (registers torch.ops.mini_infer)
from mini_infer.passes.base import GraphPass, PassContext, PassResult
from mini_infer.passes.pattern import aten, attention_calls, is_last_dim, is_op, ndim, repeat_kv_source, shape

ops = torch.ops.mini_infer


def _same_dims(a: tuple, b: tuple, dims: tuple[int, ...]) -> bool:
    """Sizes at `dims` equal, symbolic ones compared by expression (never adds a guard)."""
    return all(str(a[i]) == str(b[i]) for i in dims)


def _norm_under(x: fx.Node, head_dim: int) -> tuple[fx.Node, list[fx.Node], fx.Node] | None:
    """If `x` is `rms_norm(src, w, eps)` seen through last-dim-keeping transposes (outermost first), each node of
    that chain read only by the next one (`x` only by its rotary), return (src, transposes, norm); else None."""
    chain: list[fx.Node] = []
    node = x
    while is_op(node, aten.transpose.int) and len(node.users) == 1:
        if any(is_last_dim(d, ndim(node)) for d in node.args[1:3]):
            return None
        chain.append(node)
        node = node.args[0]
    if not is_op(node, ops.rms_norm.default) or len(node.users) != 1:
        return None
    src, weight, _ = node.args
    if shape(weight) != (head_dim,):
        return None
    return src, chain, node


def _rotary_pair(sdpa: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """The apply_rotary nodes of this attention's q and k when they qualify for one qk_rotary (see the docstring)."""
    q_rot = sdpa.args[0]
    k_rot = repeat_kv_source(sdpa.args[1]) or sdpa.args[1]
    if not (is_op(q_rot, ops.apply_rotary.default) and is_op(k_rot, ops.apply_rotary.default)):
        return None
    if q_rot.args[1:] != k_rot.args[1:]:  # the same cos and sin nodes
        return None
    qs, ks = shape(q_rot.args[0]), shape(k_rot.args[0])
    cs, ss = shape(q_rot.args[1]), shape(q_rot.args[2])
    if qs is None or ks is None or cs is None or ss is None or not len(qs) == len(ks) == len(cs) == len(ss) == 4:
        return None
    if str(cs[1]) != "1" or str(ss[1]) != "1" or not isinstance(qs[3], int) or not _same_dims(qs, ks, (0, 2, 3)):
        return None
    return q_rot, k_rot


class FuseQKRotary(GraphPass):
    """apply_rotary(q), apply_rotary(k) of one attention (+ their head rms_norms) → qk_rotary."""

    name = "fuse_qk_rotary"
    stage = "fusion"
    requires = ("fuse_rotary",)

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        graph = gm.graph
        order = {n: i for i, n in enumerate(graph.nodes)}
        fused = with_norms = 0
        for sdpa in attention_calls(graph):
            pair = _rotary_pair(sdpa)
            if pair is None:
                continue
            first, later = sorted(pair, key=order.__getitem__)
            if any(order[u] < order[later] for u in first.users):  # first's result is read before `later` exists
                continue
            q_rot, k_rot = pair
            head_dim = shape(q_rot.args[0])[3]
            norms = [_norm_under(r.args[0], head_dim) for r in pair]
            eps = {float(m[2].args[2]) for m in norms if m is not None}
            if len(eps) > 1:
                norms, eps = [None, None], set()
            with graph.inserting_before(later):
                inputs = [self._input(graph, r.args[0], m) for r, m in zip(pair, norms)]
                weights = [m[2].args[1] if m is not None else None for m in norms]
                node = graph.call_function(ops.qk_rotary.default,
                                           (*inputs, *q_rot.args[1:], *weights, eps.pop() if eps else 0.0))
                outs = [graph.create_node("call_function", operator.getitem, (node, i), name=name)
                        for i, name in enumerate(("q_rot", "k_rot"))]
            for rot, out in zip(pair, outs):
                out.meta["val"] = rot.meta.get("val")
                rot.replace_all_uses_with(out)
            node.meta["val"] = tuple(out.meta["val"] for out in outs)
            fused += 1
            with_norms += any(m is not None for m in norms)
        return PassResult(fused, f"{fused} layers ({with_norms} with q/k norms)" if fused else "")

    @staticmethod
    def _input(graph: fx.Graph, x: fx.Node, norm: tuple[fx.Node, list[fx.Node], fx.Node] | None) -> fx.Node:
        """What the op reads for a rotary input `x`: x itself, or the norm's input through the same transposes."""
        if norm is None:
            return x
        src, chain, _ = norm
        for t in reversed(chain):
            src = graph.call_function(aten.transpose.int, (src, *t.args[1:]))
        return src
