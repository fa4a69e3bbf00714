"""FuseGateUpSilu: the gated-MLP activation into the epilogue of the merged gate_up GEMV that produces its operands.

    g, u = split_with_sizes(rms_norm_linear(x, nw, eps, W, b), [I, I], -1);  a = silu_and_mul(g, u)
        → a = rms_norm_linear_silu(x, nw, eps, W, b)
    g, u = split_with_sizes(linear(x, W, b), [I, I], -1);  a = silu_and_mul(g, u)
        → a = linear_silu(x, W, b)

In a dense decoder the first is every layer's gate_up (merge_projections merged gate_proj and up_proj, gate rows
first; fuse_residual_gemvs put the post-attention norm in its prologue); the second a gate_up that pass leaves a
plain linear (tensor parallel's, whose all-reduce stands before the norm; a DeepSeek shared expert's). At batch-1
decode silu_and_mul is a launch of its own (chained MLPs in one CUDA graph on an H200: 0.70 us a layer on
qwen3-0.6b, 1.2 us on qwen2.5-7b / llama-3.1-8b) for values the GEMV's programs already hold: the fused op's one-row
kernel gives each program its gate rows and the matching up rows and stores only silu(g) * u (ops/
rms_norm_linear_silu.py), with the unfused pair's roundings. Several rows run the unfused kernels; the CPU references
are the unfused ones.

Which half is gate: the op takes the producer's first I outputs as gate, so the pass matches only where the
graph itself says so, `silu_and_mul(split[0], split[1])` of a two-way split into equal halves along the last dim.
That holds by construction wherever the halves come from, tensor-parallel ranks included (shard_tensor_parallel
keeps each rank's rows of gate_proj and of up_proj, and merge_projections then concatenates this rank's gate rows
before its up rows); a graph that reads the halves the other way round, splits unevenly (Qwen2-MoE's shared expert
merged with the router and its gate: a four-way split) or through anything else (a view, a slice) stays as it is.

Runs in the lowering stage after gemv_linear (whose `mini_infer.linear` nodes it matches), fuse_residual_gemvs
(whose `rms_norm_linear` nodes it matches) and fuse_gemv_norm, and before fuse_silu_gemv (which then finds no
silu_and_mul to take). It leaves alone: a producer or a half with another reader, the quantized paths
(fuse_act_quant's `silu_and_mul_quant`; int8 / fp8 linears are not `mini_infer.linear`) and MoE routed experts
(their activation lives inside `fused_moe`).

Default: on for CUDA targets: on an H200 (2026-11-24, bf16, batch 1, `bench/latency.py --without
fuse_gate_up_silu`, two processes) qwen3-0.6b ran 1,231.8 / 1,233.0 tok/s with it and 1,208.2 / 1,207.8 without;
wider MLPs (qwen2.5-7b) run the unfused kernels inside the op (ops/rms_norm_linear_silu.py says why). Off
elsewhere, where the ops run their unfused references and save nothing.
"""

from __future__ import annotations

import torch
import torch.fx as fx

import mini_infer.ops  # noqa: F401  (registers torch.ops.mini_infer)
from mini_infer.passes.base import GraphPass, PassContext, PassResult, replace_with_call
from mini_infer.passes.pattern import gate_up_halves, is_op, only_user

ops = torch.ops.mini_infer

# the gate_up producers: op -> (the fused op, its name in the note, its argument count)
_PRODUCERS = {
    ops.rms_norm_linear.default: (ops.rms_norm_linear_silu.default, "rms_norm_linear", 5),
    ops.linear.default: (ops.linear_silu.default, "linear", 3),
}


def _halves_split(act: fx.Node) -> fx.Node | None:
    """The `split_with_sizes` whose [0] and [1], read by nothing but `act`, are `act`'s (gate, up), when it splits
    its input's last dim into exactly two equal halves; else None."""
    if act.kwargs or len(act.args) != 2:
        return None
    return gate_up_halves(act)


def _producer(split: fx.Node) -> fx.Node | None:
    """The gate_up op in `_PRODUCERS` that `split` splits, when nothing else reads its output; else None."""
    producer = split.args[0]
    if not is_op(producer, *_PRODUCERS) or producer.kwargs or len(producer.args) != _PRODUCERS[producer.target][2]:
        return None
    return producer if only_user(producer, split) else None


class FuseGateUpSilu(GraphPass):
    """rms_norm_linear / linear → split into two halves → silu_and_mul ⇒ rms_norm_linear_silu / linear_silu."""

    name = "fuse_gate_up_silu"
    stage = "lowering"
    requires = ("fuse_silu_mul", "gemv_linear")

    @classmethod
    def default_for(cls, ctx: PassContext) -> GraphPass | None:
        # on CUDA only, where the ops' one-row kernel replaces silu_and_mul's launch; elsewhere the ops run the
        # unfused references
        return cls() if ctx.device.type == "cuda" else None

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        counts = {name: 0 for _, name, _ in _PRODUCERS.values()}
        graph = gm.graph
        for act in list(graph.nodes):
            if not is_op(act, ops.silu_and_mul.default) or (split := _halves_split(act)) is None \
                    or (producer := _producer(split)) is None:
                continue
            fused, name, _ = _PRODUCERS[producer.target]
            replace_with_call(gm, act, fused, producer.args)  # every operand is defined before the producer
            gate, up = act.args
            for dead in (act, gate, up, split, producer):
                graph.erase_node(dead)
            counts[name] += 1
        return PassResult(sum(counts.values()), ", ".join(f"{v} {k}" for k, v in counts.items() if v))
