"""FuseSiluGemv: the gated-MLP activation into the prologue of the down projection's GEMV that reads it.

    y = linear_add(silu_and_mul(g, u), W, b, r)  → y = silu_mul_linear(g, u, W, b, r)
    y = linear(silu_and_mul(g, u), W, b)         → y = silu_mul_linear(g, u, W, b, None)

In a dense decoder the first is every down_proj but the last (fuse_residual_gemvs made them `linear_add`); the
second is a down_proj that pass leaves a plain linear (tensor parallel's, whose all-reduce stands before the add;
an MoE model's shared experts, whose output is added to the routed experts'). At batch-1 decode silu_and_mul is a launch of its own (1.3-2.3 us on
an H200) for a row the down GEMV then reads whole in every program; the fused op reads gate and up there instead
(ops/silu_mul_linear.py), with the pair's roundings. Several rows run the unfused kernels, and the CPU references are
the unfused ones.

Runs in the lowering stage after gemv_linear (whose `mini_infer.linear` nodes it matches) and, in the recommended
pipeline, after fuse_residual_gemvs (whose `linear_add` nodes it matches; run first, this pass would take the down
linears that pass fuses with the residual add) and fuse_gemv_norm (the last layer's down_proj stays that pass's
`linear_add_rms_norm`). fuse_gate_up_silu (default on CUDA, before it) folds the same activations into the
gate_up GEMV's epilogue: named after it, this pass finds no `silu_and_mul` left. It leaves alone: an activation with
another reader or read by the linear as anything but its input row, any other consumer (`linear_add_rms_norm`, MoE
experts), and the quantized paths (fuse_act_quant's `silu_and_mul_quant`; int8 / fp8 linears are not
`mini_infer.linear`).

Default: off (opt-in by name in `passes=[...]`). Measured on an H200 (2026-11-24, bf16, batch 1): the fused
kernel is slower than the pair it replaces, 7.38 us at its default tile and 5.03 at the best of 24 tiles against
4.55 for silu_and_mul + the GEMV (qwen3-0.6b down_proj, `bench/kernel_silu_gemv.py`); in the engine qwen3-0.6b ran
1,071 tok/s with it and 1,163 without (same process), qwen2.5-7b 244.1 and 244.2. With programmatic dependent
launch the silu kernel's launch is already hidden, and the prologue's extra reads and exp sit on every program's
critical path.
"""

from __future__ import annotations

import torch
import torch.fx as fx

import mini_infer.ops  # noqa: F401  (registers torch.ops.mini_infer)
from mini_infer.passes.base import GraphPass, PassContext, PassResult, replace_with_call
from mini_infer.passes.pattern import is_op

ops = torch.ops.mini_infer

# the down projections whose input row the activation may become: op -> (its name in the note, its argument count)
_CONSUMERS = {ops.linear_add.default: ("linear_add", 4), ops.linear.default: ("linear", 3)}


def _down_projection(act: fx.Node) -> fx.Node | None:
    """The one consumer in `_CONSUMERS` reading `act` as its input row, when nothing else reads `act`; else None."""
    if len(act.users) != 1:
        return None
    (user,) = act.users
    if not is_op(user, *_CONSUMERS) or user.kwargs or len(user.args) != _CONSUMERS[user.target][1]:
        return None
    return user if user.args[0] is act and act not in user.args[1:] else None


class FuseSiluGemv(GraphPass):
    """silu_and_mul → one linear_add / linear (its input row) ⇒ silu_mul_linear."""

    name = "fuse_silu_gemv"
    stage = "lowering"
    requires = ("fuse_silu_mul", "gemv_linear")

    @classmethod
    def default_for(cls, ctx: PassContext) -> GraphPass | None:
        # opt-in: slower than the unfused pair on an H200 (module docstring)
        return None

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        counts = {name: 0 for name, _ in _CONSUMERS.values()}
        for act in list(gm.graph.nodes):
            if not is_op(act, ops.silu_and_mul.default) or act.kwargs or len(act.args) != 2:
                continue
            if (down := _down_projection(act)) is None:
                continue
            counts[_CONSUMERS[down.target][0]] += 1
            weight, bias = down.args[1:3]
            residual = down.args[3] if len(down.args) == 4 else None
            replace_with_call(gm, down, ops.silu_mul_linear.default, (*act.args, weight, bias, residual))
            gm.graph.erase_node(down)
            gm.graph.erase_node(act)
        return PassResult(sum(counts.values()), ", ".join(f"{v} {k}" for k, v in counts.items() if v))
