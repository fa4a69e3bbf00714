"""FuseResidualGemvs: the residual add into the epilogue of the GEMV that produces it, the RMSNorm after it into the
prologue of the GEMV that consumes it.

    n, s = fused_add_rms_norm(linear(x, W, b), r, nw, eps);  y = linear(n, W2, b2)
        → s = linear_add(x, W, b, r);  y = rms_norm_linear(s, nw, eps, W2, b2)
    y = linear(rms_norm(x, nw, eps), W2, b2)  → y = rms_norm_linear(x, nw, eps, W2, b2)   (layer 0's input norm)

(the norm's [1], the residual sum, is then `linear_add`'s output; the linear's output may be either operand of the
add: the add is commutative, bit for bit). In a dense decoder this is o_proj → post-attention norm → gate_up and
down_proj → the next layer's input norm → q/k/v. At batch-1 decode both new ops are one kernel on linear.py's GEMV
tiling with no cross-program step (ops/linear_add.py, ops/rms_norm_linear.py): the norm is gone as a launch, and no
serialized last-program tail follows the GEMV as in `fuse_gemv_norm`'s op (H200, bf16: qwen3-0.6b o_proj 3.4 us
with the add vs 6.1 with add + norm in the last program; the one-pass norm prologue costs about the plain GEMV).
Numerics: the one-row norm prologue keeps the normalized row in fp32 instead of rounding it to the model dtype as
rms_norm does (more precise; not bit-equal in bf16, equal to fp32 rounding in fp32: see ops/rms_norm_linear.py);
several rows run the unfused kernels, and the CPU references are the unfused ones.

Runs in the lowering stage after gemv_linear (whose `mini_infer.linear` nodes it matches) and fuse_rmsnorm (whose
norms it matches), BEFORE fuse_gemv_norm: where the normalized row has other readers (an MoE router and its
experts; the final norm, whose rows select_logits gathers before lm_head) the pattern stays a linear feeding a
`fused_add_rms_norm`, which fuse_gemv_norm then takes. It leaves alone: a linear with another reader or reaching
the add through anything else (a view, tensor parallel's all-reduce), a norm output read by anything but the one
linear's input, and quantized linears (int8 / fp8 ops are not `mini_infer.linear`).

Default: on for CUDA targets, as fuse_gemv_norm (measure it with `bench/latency.py --without fuse_residual_gemvs`);
off elsewhere, where the ops run their unfused references and save nothing.
"""

from __future__ import annotations

import torch
import torch.fx as fx

import mini_infer.ops  # noqa: F401  (registers torch.ops.mini_infer)
from mini_infer.passes.base import GraphPass, PassContext, PassResult, replace_with_call
from mini_infer.passes.fuse_gemv_norm import _absorbed_linear
from mini_infer.passes.fuse_norm_gemv import _pair_outputs
from mini_infer.passes.pattern import is_op

ops = torch.ops.mini_infer


def _consumer(node: fx.Node) -> fx.Node | None:
    """The one `mini_infer.linear` that reads `node` as its input row and nothing else reads `node`, or None."""
    if len(node.users) != 1:
        return None
    (lin,) = node.users
    if is_op(lin, ops.linear.default) and len(lin.args) == 3 and not lin.kwargs and lin.args[0] is node \
            and node not in lin.args[1:]:
        return lin
    return None


class FuseResidualGemvs(GraphPass):
    """linear → fused_add_rms_norm → one linear ⇒ linear_add → rms_norm_linear; rms_norm → one linear ⇒
    rms_norm_linear."""

    name = "fuse_residual_gemvs"
    stage = "lowering"
    requires = ("fuse_rmsnorm", "gemv_linear")

    @classmethod
    def default_for(cls, ctx: PassContext) -> GraphPass | None:
        # on CUDA only, where the ops' one-row kernels replace the norm launch (and fuse_gemv_norm's last-program
        # tail); elsewhere the ops run the unfused references
        return cls() if ctx.device.type == "cuda" else None

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        counts = {"linear_add": 0, "rms_norm": 0}
        for node in list(gm.graph.nodes):
            if is_op(node, ops.fused_add_rms_norm.default):
                counts["linear_add"] += self._fuse_residual(gm, node)
            elif is_op(node, ops.rms_norm.default) and (lin := _consumer(node)) is not None:
                replace_with_call(gm, lin, ops.rms_norm_linear.default, (*node.args, *lin.args[1:]))
                gm.graph.erase_node(lin)
                gm.graph.erase_node(node)
                counts["rms_norm"] += 1
        return PassResult(sum(counts.values()), ", ".join(f"{v} {k}" for k, v in counts.items() if v))

    @staticmethod
    def _fuse_residual(gm: fx.GraphModule, norm: fx.Node) -> int:
        """Rewrite one `linear → fused_add_rms_norm → linear` chain at `norm`; 1 if it matched, else 0."""
        if len(norm.args) != 4 or norm.kwargs:
            return 0
        found, items = _absorbed_linear(norm, (ops.linear.default,)), _pair_outputs(norm)
        if found is None or len(found[0].args) != 3 or items is None or 0 not in items \
                or (consumer := _consumer(items[0])) is None:
            return 0
        producer, residual = found
        graph = gm.graph
        with graph.inserting_before(norm):  # every operand (x, W, b, residual) is defined before the norm
            total = graph.call_function(ops.linear_add.default, (*producer.args, residual))
        total.meta["val"] = norm.meta["val"][1] if "val" in norm.meta else None
        nw, eps = norm.args[2:]
        replace_with_call(gm, consumer, ops.rms_norm_linear.default, (total, nw, eps, *consumer.args[1:]))
        if 1 in items:
            items[1].replace_all_uses_with(total)
            graph.erase_node(items[1])
        for dead in (consumer, items[0], norm, producer):
            graph.erase_node(dead)
        return 1
