"""FuseGemvNorm: a linear whose output feeds only the residual add + RMSNorm after it → one op, the add + norm (+ the
per-token quantization) in the GEMV's launch.

    fused_add_rms_norm(linear(x, W, b), r, nw, eps)                  → linear_add_rms_norm(x, W, b, r, nw, eps)
    fused_add_rms_norm_quant(int8_linear(x_q, xs, W_q, ws, b, dt), r, nw, eps, qdt)
        (or fp8_linear)                                              → scaled_linear_add_rms_norm_quant(x_q, xs, W_q,
                                                                        ws, b, dt, r, nw, eps, qdt)
The linear's output may be either operand of the add (HF's `residual + hidden_states` puts it second): the add is
commutative, bit for bit. The fused op returns the norm's outputs in the norm's order, so the norm's readers keep
their `getitem`s. Every decoder layer has two such places (o_proj, then down_proj, each followed by the next norm);
at batch-1 decode the norm is a one-program kernel whose cost is almost all launch, and the fused op runs it in
the GEMV's last program (see ops/linear_add_rms_norm.py); for several rows the op runs the unfused kernels, so
prefill is unchanged.

Runs in the lowering stage after gemv_linear (whose `mini_infer.linear` nodes it matches), fuse_rmsnorm (the norms)
and, with quantization, fuse_act_quant (the quantizing norms). It leaves alone: a linear whose output has any other
reader (or is both operands of the add), a linear reaching the norm through anything else (a view, tensor
parallel's all-reduce, a collective), a plain (residual-less) norm, and a quantized linear followed by a float norm
(W8A8's final norm before a float lm_head). Where `fuse_norm_gemv` (opt-in) also runs, run this pass first: a norm
fused into the next GEMV's prologue is no longer a `fused_add_rms_norm`.

Default: on for CUDA targets, where it removes one launch per norm (two per layer); off for other devices, where the
fused op is the two references run one after the other and saves nothing.
"""

from __future__ import annotations

import torch
import torch.fx as fx

import mini_infer.ops  # noqa: F401  (registers torch.ops.mini_infer)
from mini_infer.passes.base import GraphPass, PassContext, PassResult, replace_with_call
from mini_infer.passes.pattern import is_op, only_user

ops = torch.ops.mini_infer

# norm -> (the linears it may absorb, the fused op, the number of the linear's arguments)
_FUSIONS = {
    ops.fused_add_rms_norm.default: ((ops.linear.default,), ops.linear_add_rms_norm.default, 3),
    ops.fused_add_rms_norm_quant.default: ((ops.int8_linear.default, ops.fp8_linear.default),
                                           ops.scaled_linear_add_rms_norm_quant.default, 6),
}


def _absorbed_linear(norm: fx.Node, linears: tuple) -> tuple[fx.Node, fx.Node] | None:
    """(the linear feeding the norm's add alone, the add's other operand), or None."""
    a, b = norm.args[:2]
    for lin, other in ((a, b), (b, a)):
        if is_op(lin, *linears) and lin is not other and only_user(lin, norm) and not lin.kwargs:
            return lin, other
    return None


class FuseGemvNorm(GraphPass):
    """fused_add_rms_norm(_quant) of a linear's only output → linear_add_rms_norm / scaled_linear_add_rms_norm_quant."""

    name = "fuse_gemv_norm"
    stage = "lowering"
    requires = ("fuse_rmsnorm", "gemv_linear")

    @classmethod
    def default_for(cls, ctx: PassContext) -> GraphPass | None:
        # on CUDA only: there it saves a ~2-3 us norm launch per norm (56 per qwen3-0.6b decode step): on an H200
        # (2026-11-23, bench/latency.py --without fuse_gemv_norm, same run) qwen3-0.6b 793.8 tok/s with it, 770.5
        # without; qwen2.5-7b w8a8 345.0 vs 345.8 (noise). Elsewhere the op runs the two references: nothing saved.
        return cls() if ctx.device.type == "cuda" else None

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        graph = gm.graph
        counts = {"linear": 0, "scaled linear": 0}
        for norm in list(graph.nodes):
            fusion = next((f for t, f in _FUSIONS.items() if is_op(norm, t)), None)
            if fusion is None:
                continue
            linears, target, n_args = fusion
            found = _absorbed_linear(norm, linears)
            if found is None:
                continue
            lin, residual = found
            if len(lin.args) != n_args:
                continue
            replace_with_call(gm, norm, target, (*lin.args[:n_args], residual, *norm.args[2:]))
            graph.erase_node(norm)
            graph.erase_node(lin)
            counts["linear" if target is ops.linear_add_rms_norm.default else "scaled linear"] += 1
        return PassResult(sum(counts.values()), ", ".join(f"{v} {k}" for k, v in counts.items() if v))
