"""FuseMoeNorm: a MoE block's routed output that feeds only the residual add + the next RMSNorm → one op, the add +
norm in the launch of fused_moe's slot sum.

    fused_add_rms_norm(r, view(fused_moe(h, w, ids, w13, w2, act, map)), nw, eps)
                                            → fused_moe_add_rms_norm(h, w, ids, w13, w2, r, nw, eps, act, map)
The experts' output may be either operand of the add (HF's `residual + hidden_states` puts it second; the add is
commutative, bit for bit), directly or through one reshape / view back to the residual's shape (HF's MoE blocks
flatten the tokens to [T, H] and reshape the result back). The fused op returns the norm's outputs in the norm's
order, so the norm's readers keep their `getitem`s. In Qwen3-MoE and Mixtral every decoder layer has one such place
(its MoE output, then the next layer's input norm or the final norm); at batch-1 decode the norm is a one-program
kernel whose cost is almost all launch (ops/fused_moe_add_rms_norm.py).

Runs in the lowering stage (after route_moe, which makes the fused_moe nodes, fuse_rmsnorm, which makes the norms,
and, with quantization, fuse_act_quant, whose quantizing norms it leaves alone) and before the opt-in
fuse_norm_gemv. It leaves alone: an experts output with any other reader (or both operands of the add), one reaching
the norm through anything else (a shared expert's sum, as Qwen2-MoE and DeepSeek add; tensor parallel's
all-reduce), a residual of another dtype, a plain (residual-less) norm and the quantizing norms.

Default: on for MoE models on CUDA targets (route_moe's `moe_lowering_default`), where it removes one launch per
MoE layer; off for other devices, where the fused op is the two references run one after the other and saves
nothing.
"""

from __future__ import annotations

import torch
import torch.fx as fx

import mini_infer.ops  # noqa: F401  (registers torch.ops.mini_infer)
from mini_infer.passes.base import GraphPass, PassContext, PassResult, replace_with_call
from mini_infer.passes.pattern import aten, dtype, is_op, only_user, same_shape
from mini_infer.passes.route_moe import moe_lowering_default

ops = torch.ops.mini_infer

_VIEWS = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)


def _experts_output(operand: fx.Node, norm: fx.Node) -> fx.Node | None:
    """The fused_moe node whose output `operand` is (itself, or one view of it), read by nothing but the norm."""
    if is_op(operand, *_VIEWS) and only_user(operand, norm):
        moe = operand.args[0]
        return moe if is_op(moe, ops.fused_moe.default) and only_user(moe, operand) else None
    return operand if is_op(operand, ops.fused_moe.default) and only_user(operand, norm) else None


def _absorbed_moe(norm: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(the fused_moe feeding the norm's add alone, the add's other operand: the residual), or None."""
    a, b = norm.args[:2]
    for operand, residual in ((a, b), (b, a)):
        moe = _experts_output(operand, norm) if isinstance(operand, fx.Node) else None
        if (moe is not None and operand is not residual and isinstance(residual, fx.Node)
                and same_shape(operand, residual) and dtype(moe) == dtype(residual)):
            return moe, residual
    return None


def _moe_args(moe: fx.Node) -> tuple:
    """fused_moe's seven arguments (activation and expert_map filled in with their defaults)."""
    args = list(moe.args) + [None] * (7 - len(moe.args))
    names = ("hidden", "topk_weights", "topk_ids", "w13", "w2", "activation", "expert_map")
    for i, name in enumerate(names):
        if name in moe.kwargs:
            args[i] = moe.kwargs[name]
    if args[5] is None:
        args[5] = "silu"
    return tuple(args)


class FuseMoeNorm(GraphPass):
    """fused_add_rms_norm of a fused_moe's only output → fused_moe_add_rms_norm."""

    name = "fuse_moe_norm"
    stage = "lowering"
    requires = ("fuse_rmsnorm", "route_moe")

    @classmethod
    def default_for(cls, ctx: PassContext) -> GraphPass | None:
        return cls() if moe_lowering_default(ctx) else None

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        graph = gm.graph
        fused = 0
        for norm in list(graph.nodes):
            if not is_op(norm, ops.fused_add_rms_norm.default) or len(norm.args) != 4 or norm.kwargs:
                continue
            found = _absorbed_moe(norm)
            if found is None:
                continue
            moe, residual = found
            view = norm.args[0] if norm.args[0] is not residual else norm.args[1]
            hidden, weights, ids, w13, w2, activation, expert_map = _moe_args(moe)
            replace_with_call(gm, norm, ops.fused_moe_add_rms_norm.default,
                              (hidden, weights, ids, w13, w2, residual, *norm.args[2:4], activation, expert_map))
            graph.erase_node(norm)
            if view is not moe:
                graph.erase_node(view)
            graph.erase_node(moe)
            fused += 1
        return PassResult(fused, f"{fused} MoE output{'s' if fused != 1 else ''} + norm" if fused else "")
