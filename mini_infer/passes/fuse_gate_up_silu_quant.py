"""FuseGateUpSiluQuant: the quantized gated-MLP activation into the epilogue of the W8A8 gate_up GEMV.

    g, u = split_with_sizes(int8_linear(x_q, x_s, W_q, w_s, b, dt), [I, I], -1);  h_q, h_s = silu_and_mul_quant(g, u, q)
        → h_q, h_s = scaled_linear_silu_quant(x_q, x_s, W_q, w_s, b, dt, q)
    (fp8_linear likewise)

The W8A8 / FP8 counterpart of fuse_gate_up_silu: quantize_w8a8 / quantize_fp8 made the merged gate_up an int8 /
fp8 linear and fuse_act_quant put the activation's per-token quantization into `silu_and_mul_quant`; at batch-1
decode that quantization runs two launches after the GEMV (the row's chunk amaxes, then the quantization). The fused
op's GEMV stores the activation and adds its amax into slots, so one quantization launch follows it
(ops/scaled_linear_silu_quant.py), with the unfused chain's bits.

Matches as fuse_gate_up_silu matches (`pattern.gate_up_halves`: the activation reads split[0] and split[1] of a
two-way equal split of the last dim, nothing else reads them or the producer); leaves everything else alone.
Runs in the lowering stage after fuse_act_quant (which creates `silu_and_mul_quant`).

Opt-in (no default): not yet timed on a GPU. To time: `bench/latency.py --model qwen2.5-7b --quantization w8a8
--peers none --with fuse_gate_up_silu_quant --rounds 2` (and fp8).
"""

from __future__ import annotations

import torch
import torch.fx as fx

import mini_infer.ops  # noqa: F401  (registers torch.ops.mini_infer)
from mini_infer.passes.base import GraphPass, PassContext, PassResult, replace_with_call
from mini_infer.passes.pattern import gate_up_halves, is_op, only_user

ops = torch.ops.mini_infer

_PRODUCERS = {ops.int8_linear.default: "int8_linear", ops.fp8_linear.default: "fp8_linear"}


class FuseGateUpSiluQuant(GraphPass):
    """int8_linear / fp8_linear → split into two halves → silu_and_mul_quant ⇒ scaled_linear_silu_quant."""

    name = "fuse_gate_up_silu_quant"
    stage = "lowering"
    requires = ("fuse_act_quant",)

    @classmethod
    def default_for(cls, ctx: PassContext) -> GraphPass | None:
        # opt-in until timed on a GPU (module docstring); named in `passes=[...]` (or `--with`) it runs
        return None

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        counts = dict.fromkeys(_PRODUCERS.values(), 0)
        graph = gm.graph
        for act in list(graph.nodes):
            if not is_op(act, ops.silu_and_mul_quant.default) or act.kwargs or len(act.args) != 3:
                continue
            split = gate_up_halves(act)
            if split is None:
                continue
            producer = split.args[0]
            if not is_op(producer, *_PRODUCERS) or producer.kwargs or len(producer.args) != 6 \
                    or not only_user(producer, split):
                continue
            replace_with_call(gm, act, ops.scaled_linear_silu_quant.default, (*producer.args, act.args[2]))
            gate, up = act.args[:2]
            for dead in (act, gate, up, split, producer):
                graph.erase_node(dead)
            counts[_PRODUCERS[producer.target]] += 1
        return PassResult(sum(counts.values()), ", ".join(f"{v} {k}" for k, v in counts.items() if v))
