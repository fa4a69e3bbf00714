"""FuseNormGemv: an RMSNorm whose output feeds exactly one weight linear → one op, the norm in the GEMV's prologue.

    linear(rms_norm(x, nw, eps), W, b)                    → rms_norm_linear(x, nw, eps, W, b)
    linear(fused_add_rms_norm(x, r, nw, eps)[0], W, b)    → fused_add_rms_norm_linear(x, r, nw, eps, W, b)
                                                            (its [1], the residual sum, replaces the pair's [1])

At batch-1 decode every decoder layer otherwise runs the norm and then a GEMV on the normalized row (the merged
q/k/v after the input norm, the merged gate/up after the post-attention norm): two launches, and the normalized
row written and read back. The fused op computes the same values up to the rounding of the normalized row, which
its one-row kernel keeps in fp32 (see ops/rms_norm_linear.py), and runs the unfused kernels for more than one row,
so prefill is unchanged. fuse_residual_gemvs (on by default on CUDA) already folds the norms between two dense GEMVs
into the same op. Runs in the lowering stage after gemv_linear (whose
`mini_infer.linear` nodes it matches) and fuse_rmsnorm (whose norms it matches). It leaves alone: a norm whose
output has any other reader (e.g. an MoE router and the experts, or the final norm's row selection before
lm_head), a norm reaching its linear through anything else (a collective, a view, a gather), and quantized
linears (int8 / fp8 ops are not `mini_infer.linear`).

Opt-in: the recommended pipeline leaves it out, because it measured slower than the two kernels it replaces
(qwen3-0.6b batch-1 decode on an H200, same run: 689.9 tok/s with it, 699.6 without; bench/RESULTS.md; that was
the two-pass prologue kernel, before the one-pass one), and with the one-pass kernel it still lost on
qwen3-30b-a3b (323.7 vs 332.2 tok/s, the eighth session). Name it
in `passes=[...]` / `--passes` to run it.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

import mini_infer.ops  # noqa: F401  (registers torch.ops.mini_infer)
from mini_infer.passes.base import GraphPass, PassContext, PassResult, replace_with_call
from mini_infer.passes.pattern import is_op, only_user

ops = torch.ops.mini_infer


def _pair_outputs(pair: fx.Node) -> dict[int, fx.Node] | None:
    """fused_add_rms_norm's readers by output index when they are distinct `getitem`s of [0] and [1], else None."""
    out: dict[int, fx.Node] = {}
    for user in pair.users:
        if not is_op(user, operator.getitem) or user.args[1] not in (0, 1) or user.args[1] in out:
            return None
        out[user.args[1]] = user
    return out


def _move_before(graph: fx.Graph, anchor: fx.Node, nodes: list) -> None:
    """Move the parameter reads (`get_attr`, no inputs: always safe to move earlier) in `nodes` that come after
    `anchor` to just before it."""
    before = set()
    for n in graph.nodes:
        if n is anchor:
            break
        before.add(n)
    for n in nodes:
        if isinstance(n, fx.Node) and n.op == "get_attr" and n not in before:
            anchor.prepend(n)


class FuseNormGemv(GraphPass):
    """mini_infer.linear of a norm's only output → rms_norm_linear / fused_add_rms_norm_linear."""

    name = "fuse_norm_gemv"
    stage = "lowering"
    requires = ("fuse_rmsnorm", "gemv_linear")

    @classmethod
    def default_for(cls, ctx: PassContext) -> GraphPass | None:
        # opt-in. H200, same runs: with the two-pass prologue qwen3-0.6b ran 689.9 tok/s with it, 699.6 without;
        # with the one-pass prologue (2026-11-24), on by default on CUDA after fuse_residual_gemvs and fuse_gemv_norm
        # (so taking only the norm after each MoE block), qwen3-30b-a3b ran 323.7 with it and 332.2 without: its
        # 4 x 512 tile at q/k/v 5120 x 2048 costs more than the norm launch it saves once PDL overlaps launches.
        # Named in `passes=[...]` it runs (not with quantization).
        return None

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        graph = gm.graph
        counts = {"rms_norm": 0, "fused_add_rms_norm": 0}
        for node in list(graph.nodes):
            if not is_op(node, ops.linear.default):
                continue
            x, w, b = node.args
            if is_op(x, ops.rms_norm.default) and only_user(x, node):
                replace_with_call(gm, node, ops.rms_norm_linear.default, (*x.args, w, b))
                graph.erase_node(node)
                graph.erase_node(x)
                counts["rms_norm"] += 1
            elif (is_op(x, operator.getitem) and x.args[1] == 0 and is_op(x.args[0], ops.fused_add_rms_norm.default)
                  and only_user(x, node) and (items := _pair_outputs(x.args[0])) is not None):
                self._fuse_pair(graph, x.args[0], items, node)
                counts["fused_add_rms_norm"] += 1
        return PassResult(sum(counts.values()), ", ".join(f"{v} {k}" for k, v in counts.items() if v))

    @staticmethod
    def _fuse_pair(graph: fx.Graph, pair: fx.Node, items: dict[int, fx.Node], linear: fx.Node) -> None:
        """`linear(pair[0])` and `pair[1]` (`items`: the pair's getitems) → the fused op's [0] and [1], placed where
        the pair was (the residual sum's readers may come before the linear)."""
        w, b = linear.args[1:]
        _move_before(graph, pair, [w, b])
        with graph.inserting_before(pair):
            fused = graph.call_function(ops.fused_add_rms_norm_linear.default, (*pair.args, w, b))
            y = graph.call_function(operator.getitem, (fused, 0))
            total = graph.call_function(operator.getitem, (fused, 1))
        y.meta["val"] = linear.meta.get("val")
        total.meta["val"] = pair.meta["val"][1] if "val" in pair.meta else None
        fused.meta["val"] = (y.meta["val"], total.meta["val"])
        linear.replace_all_uses_with(y)
        graph.erase_node(linear)
        graph.erase_node(items[0])
        if 1 in items:
            items[1].replace_all_uses_with(total)
            graph.erase_node(items[1])
        graph.erase_node(pair)
        if not total.users:
            graph.erase_node(total)
