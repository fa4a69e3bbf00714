"""QuantizeMoeMxfp4: `fused_moe` over 16-bit expert weights → `fused_moe_mxfp4` over MXFP4 ones
(`quantization="mxfp4"`).

Weight-only: each routed expert's w13 [E, 2I, H] and w2 [E, H, I] become MXFP4 blocks and scales (32 weights a
power-of-two scale along the reduction dimension, FP4 E2M1 values: ops/fused_moe_mxfp4.py), a quarter of the
expert bytes a token reads; activations, biases, routing, the attention, shared experts, dense layers and the
lm_head stay as they are. A checkpoint published in MXFP4 (gpt-oss), which the loader dequantizes, comes back to
its own values exactly (`quantize_mxfp4`'s docstring): the compiled model then computes what the eager model
does on that checkpoint. Other models lose precision as any 4-bit weight format does (no calibration).
The quantized tensors are new buffers; the 16-bit originals lose their last graph use and the pass manager drops
them (one copy held, once the HF model is released).

Runs in stage "fusion", after `route_moe` (and after shard_tensor_parallel, which routes the experts itself under
expert parallelism): it rewrites the `fused_moe` nodes those passes emitted, whatever the family. A model without
routed experts (a dense one) is refused naming the option, as are experts whose H or I (I / N under tensor
parallelism) is not a multiple of 32.
This module rewrites graph nodes only; the format and the kernels are in ops/fused_moe_mxfp4.py.
"""

from __future__ import annotations

import torch
import torch.fx as fx

import mini_infer.ops  # noqa: F401
from mini_infer.ops.fused_moe_mxfp4 import GROUP, quantize_mxfp4, round_to_mxfp4
from mini_infer.passes.base import GraphPass, PassContext, PassResult
from mini_infer.passes.pattern import is_op

ops = torch.ops.mini_infer


def round_experts_to_mxfp4(model: torch.nn.Module) -> int:
    """Round every routed-expert weight of an HF MoE model (transformers 5.x's stacked `experts.gate_up_proj` /
    `experts.down_proj`) to its MXFP4 values in place, along the reduction dimension (GPT-OSS stores its experts
    transposed): a model on which this pass is exact, as on a gpt-oss checkpoint (for checks); returns how many
    tensors."""
    dim = 1 if getattr(model.config, "model_type", None) == "gpt_oss" else 2
    n = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                p.copy_(round_to_mxfp4(p, dim))
                n += 1
    return n


class QuantizeMoeMxfp4(GraphPass):
    """fused_moe(hidden, weights, ids, w13, w2, ...) → fused_moe_mxfp4(hidden, weights, ids, q13, s13, q2, s2, ...)."""

    name = "quantize_moe_mxfp4"
    stage = "fusion"
    requires = ("cleanup",)
    quantization_modes = ("mxfp4",)
    # verification against eager allows 20% of the logits' scale after this pass: it catches a broken graph on
    # weights that are not MXFP4 already (4-bit values of random weights move logits more than fp8's do)
    approximation = 0.2

    @classmethod
    def default_for(cls, ctx: PassContext) -> GraphPass | None:
        return cls() if ctx.quantization == "mxfp4" else None

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        nodes = [n for n in gm.graph.nodes if is_op(n, ops.fused_moe.default)]
        if not nodes:
            raise ValueError("quantization='mxfp4' quantizes the routed experts of MoE models (fused_moe after "
                             "route_moe) and this graph has none: use 'w8a8' or 'fp8' for dense models")
        done: dict[str, tuple[fx.Node, fx.Node]] = {}  # weight attribute → its blocks and scales nodes
        before = after = 0
        for node in nodes:
            w13, w2 = node.args[3], node.args[4]
            packed = []
            for w_node, what in ((w13, "w13"), (w2, "w2")):
                if not (isinstance(w_node, fx.Node) and w_node.op == "get_attr"):
                    raise ValueError(f"quantize_moe_mxfp4: {node.name}'s {what} is not a graph weight")
                if w_node.target not in done:
                    weight = PassContext.tensor_of(gm, w_node)
                    if weight.shape[-1] % GROUP:
                        raise ValueError(f"quantization='mxfp4': {w_node.target} {list(weight.shape)} has a "
                                         f"reduction dimension {weight.shape[-1]} that is not a multiple of {GROUP}")
                    with torch.no_grad():
                        blocks, scales = quantize_mxfp4(weight.detach())
                    before += weight.numel() * weight.element_size()
                    after += blocks.numel() + scales.numel()
                    base = str(w_node.target)
                    done[w_node.target] = (PassContext.add_tensor(gm, f"{base}_mxfp4", blocks, before=node),
                                           PassContext.add_tensor(gm, f"{base}_mxfp4_scales", scales, before=node))
                packed += done[w_node.target]
            with gm.graph.inserting_before(node):
                new = gm.graph.call_function(ops.fused_moe_mxfp4.default, (*node.args[:3], *packed, *node.args[5:]),
                                             dict(node.kwargs))
            new.meta = dict(node.meta)
            node.replace_all_uses_with(new)
            gm.graph.erase_node(node)
        ctx.info["mxfp4_experts_bytes"] = after
        return PassResult(len(nodes), f"{len(nodes)} fused_moe to MXFP4: expert weights {before / 1e6:.3f} MB → "
                                      f"{after / 1e6:.3f} MB")
