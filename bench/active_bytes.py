"""Weight bytes one decode token reads from a compiled graph: the numerator of the batch-1 bandwidth floor.

A dense model reads every weight each step (the embedding table and the position tables of `rotary_table` aside:
one row of each per token). A MoE model routed by `route_moe` reads, per `fused_moe` node, only its top_k experts'
slices of the stacked w13 / w2 (at batch 1, k distinct experts), beside everything else: attention, router, shared
experts, dense layers, lm_head. So

    active = all graph tensors except the embedding and position tables  -  sum over fused_moe nodes of (w13 + w2
             [+ their biases] bytes) * (E - k) / E

(`fused_moe_mxfp4`, `quantization="mxfp4"`: the same with its packed blocks and scales for w13 and w2.)

Read from the graph as it runs (ops bound to kernels keep the op in `node.meta["op"]`), not from the config. Stacked
expert weights feeding any other op are an error, not a dense count. Used by bench/latency.py; runs on any device
(no GPU needed to count).

    PYTHONPATH=. python bench/active_bytes.py tiny-qwen3-moe tiny-mixtral   # compiled on the GPU if there is one
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.fx as fx


@dataclass(frozen=True)
class TokenBytes:
    """Weight bytes of a compiled graph: all it holds (embedding and position tables excluded) and what one decode
    token reads."""

    total: int
    active: int
    moe_layers: int
    experts: int = 0
    top_k: int = 0

    def describe(self) -> str:
        if not self.moe_layers:
            return f"{_size(self.total)} of weights per token (dense)"
        return (f"{_size(self.active)} active of {_size(self.total)} per token ({self.moe_layers} MoE layers, "
                f"top-{self.top_k} of {self.experts} experts)")


def _size(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.3f} MB"


def token_bytes(gm: fx.GraphModule) -> TokenBytes:
    """`TokenBytes` of `gm` (a compiled graph, before or after `bind_kernels`)."""
    from mini_infer.compiler import tensor_bytes
    from mini_infer.passes import PassContext
    from mini_infer.passes.rotary_table import TABLE_PREFIX

    total = tensor_bytes([t for n, t in [*gm.named_parameters(), *gm.named_buffers()]
                          if "embed_tokens" not in n and not n.startswith(TABLE_PREFIX)])
    idle, layers, experts, top_k = 0.0, 0, 0, 0
    moe_ops = _moe_ops()
    for node in gm.graph.nodes:
        op = next((op for op in moe_ops if _runs(node, op)), None)
        if op is None:
            continue
        weight_args, bias_args = moe_ops[op]
        weights = [PassContext.tensor_of(gm, node.args[i]) for i in weight_args]
        # per-expert biases (GPT-OSS): w13_bias and w2_bias, read like their experts' weights
        biases = [PassContext.tensor_of(gm, a) for a in node.args[bias_args] if isinstance(a, fx.Node)]
        experts, top_k = weights[0].shape[0], node.args[2].meta["val"].shape[1]
        idle += tensor_bytes([*weights, *biases]) * (experts - min(top_k, experts)) / experts
        layers += 1
    _check_experts_counted(gm)
    return TokenBytes(total, round(total - idle), layers, experts, top_k)


def _moe_ops() -> dict:
    """The MoE ops: {op: (arguments holding per-expert weights, slice of its per-expert bias arguments)}."""
    ops = torch.ops.mini_infer
    return {ops.fused_moe.default: ((3, 4), slice(7, 9)), ops.fused_moe_mxfp4.default: ((3, 4, 5, 6), slice(9, 11))}


def _runs(node: fx.Node, op) -> bool:
    """Whether `node` calls `op` (as traced, or bound to a kernel: the op kept in `node.meta["op"]`)."""
    return node.op == "call_function" and op in (node.target, node.meta.get("op"))


def _check_experts_counted(gm: fx.GraphModule) -> None:
    """ValueError when stacked expert weights (a 3-D tensor under an `experts` module) feed a node other than
    a MoE op (`_moe_ops`): a token would read all of them by this count, and the floor would silently be a dense one's (an
    MoE op that replaced fused_moe did this once: 1 of 48 layers counted)."""
    from mini_infer.passes import PassContext

    moe_ops = _moe_ops()
    for node in gm.graph.nodes:
        if node.op != "get_attr" or "experts" not in str(node.target):  # (re-laid ones: "..._experts_..._relaid")
            continue
        if PassContext.tensor_of(gm, node).dim() != 3:
            continue
        for user in node.users:
            if not any(_runs(user, op) for op in moe_ops):
                raise ValueError(f"active_bytes: the stacked expert weights {node.target} feed {user.format_node()}, "
                                 "which token_bytes counts as read whole: teach it that op before trusting the floor")


def main() -> None:
    from mini_infer.compiler import compile_model
    from mini_infer.models import load_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    for name in sys.argv[1:] or ["tiny-qwen3-moe"]:
        model = load_model(name, device=device).model
        print(f"{name}: {token_bytes(compile_model(model, device=device).graph_module).describe()}")
        del model


if __name__ == "__main__":
    main()
