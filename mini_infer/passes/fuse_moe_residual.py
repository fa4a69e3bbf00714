"""FuseMoeResidual: the residual add after an MoE block into the MoE's last launch, leaving a plain norm.

    n, s = fused_add_rms_norm(view(fused_moe(h, w, ids, W13, W2, ...)), r, nw, eps)
        → s = view(fused_moe_add(h, w, ids, W13, W2, view(r), ...));  n = rms_norm(s, nw, eps)

(the add is commutative, bit for bit: either operand may be the MoE's; `view` is any chain of reshapes, or none).
In an MoE decoder (Mixtral, Qwen3-MoE) this is each MoE block's output → the next layer's input norm, whose
normalized row feeds q/k/v alone: fuse_residual_gemvs, which runs after this pass, then folds that `rms_norm` into
the q/k/v GEMV's prologue (`rms_norm_linear`), so at batch-1 decode the add + norm launch is gone (the add rides on
the slot sum of ops/fused_moe_add.py). Where the normalized row has other readers (the final norm, whose rows
select_logits gathers), the norm stays a launch of its own: the same launch count as before.

Numerics: s is the unfused pair's to the bit (the MoE output rounded to its dtype, then the add), and so is n
(rms_norm reads the stored s, as fused_add_rms_norm's norm does).

Runs in the lowering stage after route_moe (whose `fused_moe` nodes it matches) and fuse_rmsnorm (whose norms it
matches), BEFORE fuse_residual_gemvs. It leaves alone: an MoE output with another reader or reaching the add through
anything but reshapes (a shared expert's add, tensor parallel's all-reduce: the residual must be added once, after
the ranks' shares are summed), operands of different dtypes or shapes, and anything that is not the pair above.

Default: on for MoE models on CUDA targets (as fuse_residual_gemvs, and route_moe's `is_moe_config`) (measure it with `bench/latency.py --without
fuse_moe_residual`); off elsewhere, where the ops run their unfused references and save nothing.
"""

from __future__ import annotations

import torch
import torch.fx as fx

import mini_infer.ops  # noqa: F401  (registers torch.ops.mini_infer)
from mini_infer.passes.base import GraphPass, PassContext, PassResult
from mini_infer.passes.fuse_norm_gemv import _pair_outputs
from mini_infer.passes.pattern import VIEWS, dtype, is_op, same_shape, shape, val
from mini_infer.passes.route_moe import is_moe_config

ops = torch.ops.mini_infer
aten = torch.ops.aten


def _moe_behind(node: fx.Node, norm: fx.Node) -> tuple[fx.Node, list[fx.Node]] | None:
    """(the `fused_moe` whose output reaches `norm` as `node` through reshapes alone, each node read only by the
    next, and those reshapes in order), or None."""
    chain: list[fx.Node] = []
    user = norm
    while isinstance(node, fx.Node) and len(node.users) == 1 and user in node.users:
        if is_op(node, ops.fused_moe.default):
            return node, chain[::-1]
        if not is_op(node, *VIEWS):
            return None
        chain.append(node)
        user, node = node, node.args[0]
    return None


class FuseMoeResidual(GraphPass):
    """fused_moe → (reshapes) → fused_add_rms_norm ⇒ fused_moe_add → (reshapes) → rms_norm."""

    name = "fuse_moe_residual"
    stage = "lowering"
    requires = ("fuse_rmsnorm", "route_moe")

    @classmethod
    def default_for(cls, ctx: PassContext) -> GraphPass | None:
        # MoE models on CUDA only, where the add rides on the MoE's slot sum and the norm goes on into the next
        # GEMV; elsewhere the ops run the unfused references
        return cls() if ctx.device.type == "cuda" and is_moe_config(ctx.config) else None

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        fused = sum(self._fuse(gm, node) for node in list(gm.graph.nodes)
                    if is_op(node, ops.fused_add_rms_norm.default))
        return PassResult(fused, f"{fused} MoE residual add(s)" if fused else "")

    @staticmethod
    def _fuse(gm: fx.GraphModule, norm: fx.Node) -> int:
        """Rewrite the pair at `norm` when one of its two summands is an MoE output; 1 if it matched, else 0."""
        if len(norm.args) != 4 or norm.kwargs or (items := _pair_outputs(norm)) is None:
            return 0
        x, r, nw, eps = norm.args
        found = _moe_behind(x, norm) if x is not r else None
        if found is None:
            found, r = (_moe_behind(r, norm) if x is not r else None), x
        if found is None:
            return 0
        moe, chain = found
        moe_out = chain[-1] if chain else moe
        hidden = shape(moe)
        if not (same_shape(moe_out, r) and dtype(moe) == dtype(r) and hidden is not None and len(hidden) == 2
                and isinstance(hidden[1], int) and len(moe.args) >= 5):
            return 0
        graph = gm.graph
        with graph.inserting_before(norm):  # every operand (the MoE's, the residual) is defined before the norm
            flat = r
            if chain:
                flat = graph.call_function(aten.reshape.default, (r, [-1, hidden[1]]))
                flat.meta["val"] = val(moe)
            args = (*moe.args[:5], flat, *moe.args[5:])
            total = graph.call_function(ops.fused_moe_add.default, args, dict(moe.kwargs))
            total.meta["val"] = val(moe)
            if chain:
                total = graph.call_function(aten.reshape.default, (total, chain[-1].args[1]))
                total.meta["val"] = val(chain[-1])
            normed = graph.call_function(ops.rms_norm.default, (total, nw, eps))
        norm_val = val(norm)
        if norm_val is not None:
            normed.meta["val"] = norm_val[0]
        for index, out in ((0, normed), (1, total)):
            if index in items:
                items[index].replace_all_uses_with(out)
                graph.erase_node(items[index])
        graph.erase_node(norm)
        for dead in (*chain[::-1], moe):
            graph.erase_node(dead)
        return 1
