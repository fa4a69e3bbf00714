"""FuseMoeResidual: an MoE block's residual add into its last kernel, the RMSNorm after it into the prologue of the
GEMV that consumes it.

    n, s = fused_add_rms_norm(fused_moe(h, w, ids, W13, W2, ...), r, nw, eps);  y = linear(n, W, b)
        → s = fused_moe_add(h, w, ids, W13, W2, r, ...);  y = rms_norm_linear(s, nw, eps, W, b)

(the MoE output may be either operand of the add: the add is commutative, bit for bit). In a Mixtral / Qwen3-MoE
decoder this is the MoE block → the next layer's input norm → q/k/v: what fuse_residual_gemvs does for a dense
layer's down_proj. At batch-1 decode on CUDA the add rides in the slot sum's or the decode path's down GEMV's epilogue
(ops/fused_moe_add.py) and the norm launch is gone; q/k/v's one-pass norm prologue (ops/rms_norm_linear.py) keeps the
normalized row in fp32 (not bit-equal to rms_norm's rounding in bf16; equal to fp32 rounding in fp32). Several rows
run the unfused kernels (rms_norm_linear's), the add still in the MoE kernel.

It leaves alone: an MoE output with another reader or reaching the add through anything else (a shared expert's
sum: Qwen2-MoE, DeepSeek; tensor parallel's all-reduce, which must come before the residual is added once), a norm
output read by anything but one `mini_infer.linear`'s input (the final norm, whose rows select_logits gathers), and
quantized linears.

Default: off (opt-in: `passes=[..., "fuse_moe_residual"]`, `bench/latency.py --with fuse_moe_residual`). Built in the
twenty-first session and tested on the tiny MoE presets; not yet timed on a GPU. fuse_norm_gemv's add + norm prologue
lost at qwen3-30b-a3b (323.7 vs 332.2 tok/s, its 4 x 512 tile), so this one goes on only once a run shows it wins.
"""

from __future__ import annotations

import torch
import torch.fx as fx

import mini_infer.ops  # noqa: F401  (registers torch.ops.mini_infer)
from mini_infer.passes.base import GraphPass, PassContext, PassResult
from mini_infer.passes.fuse_norm_gemv import _pair_outputs
from mini_infer.passes.fuse_residual_gemvs import _consumer, norm_into_consumer
from mini_infer.passes.pattern import is_op

ops = torch.ops.mini_infer
aten = torch.ops.aten


_RESHAPES = (aten.reshape.default, aten.view.default)


def _absorbed_moe(norm: fx.Node) -> tuple[fx.Node, fx.Node | None, fx.Node] | None:
    """(the fused_moe node, the reshape between it and the add or None, the residual) when one operand of the norm's
    add is a `mini_infer.fused_moe` ([T, H]) or a reshape of one (route_moe gives HF's [1, T, H] back that way), each
    read by nothing else; else None."""
    x, residual = norm.args[:2]
    for operand, other in ((x, residual), (residual, x)):
        if not isinstance(operand, fx.Node) or operand is other or len(operand.users) != 1:
            continue
        moe, reshape = operand, None
        if any(is_op(operand, op) for op in _RESHAPES) and isinstance(operand.args[0], fx.Node):
            moe, reshape = operand.args[0], operand
        if is_op(moe, ops.fused_moe.default) and len(moe.users) == 1 and not moe.kwargs and other is not moe:
            return moe, reshape, other
    return None


class FuseMoeResidual(GraphPass):
    """fused_moe → fused_add_rms_norm → one linear ⇒ fused_moe_add → rms_norm_linear."""

    name = "fuse_moe_residual"
    stage = "lowering"
    requires = ("fuse_rmsnorm", "route_moe", "gemv_linear")

    @classmethod
    def default_for(cls, ctx: PassContext) -> GraphPass | None:
        return None  # opt-in until a GPU run shows it wins (module docstring)

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        graph = gm.graph
        count = 0
        for norm in list(graph.nodes):
            if not is_op(norm, ops.fused_add_rms_norm.default) or len(norm.args) != 4 or norm.kwargs:
                continue
            found, items = _absorbed_moe(norm), _pair_outputs(norm)
            if found is None or items is None or 0 not in items or (consumer := _consumer(items[0])) is None:
                continue
            moe, reshape, residual = found
            with graph.inserting_before(norm):  # every operand of the MoE call and the residual precede the norm
                if reshape is not None:  # the residual as the MoE output's [T, H], the sum back to the add's shape
                    residual = graph.call_function(aten.reshape.default, (residual, [-1, reshape.args[1][-1]]))
                total = graph.call_function(ops.fused_moe_add.default, (*moe.args[:5], residual, *moe.args[5:]))
                if reshape is not None:
                    total = graph.call_function(reshape.target, (total, *reshape.args[1:]))
            total.meta["val"] = norm.meta["val"][1] if "val" in norm.meta else None
            norm_into_consumer(gm, norm, items, consumer, total, total,
                               [items[0], norm, *([reshape] if reshape is not None else []), moe])
            count += 1
        return PassResult(count, f"{count} MoE residual adds" if count else "")
