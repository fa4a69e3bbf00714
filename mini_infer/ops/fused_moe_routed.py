"""`mini_infer::fused_moe_routed`: an MoE block's routed experts given the router's logits, softmax routing.

    fused_moe_routed(hidden, router_logits, w13, w2, top_k, renormalize, routed_scaling_factor, weights_dtype)
        = fused_moe(hidden, *moe_topk(router_logits, top_k, "softmax", renormalize, routed_scaling_factor,
                                      weights_dtype=weights_dtype), w13, w2)

(moe_topk's softmax rule: Mixtral, Qwen2/3-MoE, DeepSeek-V2's greedy routing; no groups, no correction bias, no
expert map). Inserted by the FuseMoeRouting pass where a moe_topk's outputs feed one fused_moe alone.

Why: at batch-1 decode the routing kernel is a one-program launch between the router GEMV and the gate/up GEMM,
whose blocks cannot start loading expert weights before it ends (qwen3-30b-a3b on an H200: exposed 1.7-2.1 us a
layer, ~3.5% of the step; bench/RESULTS.md, thirty-sixth session). On CUDA at the pair-per-block shapes
(`fused_moe.routes_in_gemms`) no routing kernel runs: each GEMM block ranks its token's logits for its own slot
(`moe_topk.softmax_route_slot`: moe_topk's ids exactly; the weights within fp32 rounding of its kernel's, its sums
running in another layout). Other shapes run moe_topk's and fused_moe's kernels. The CPU reference is the two
references. Imports nothing from mini_infer outside `mini_infer.ops`.
"""

from __future__ import annotations

import torch

from mini_infer.ops._triton_support import use_triton
from mini_infer.ops.fused_moe import check_routed_args, fused_moe_reference, fused_moe_routed_triton
from mini_infer.ops.moe_topk import moe_topk_reference

__all__ = ["fused_moe_routed", "fused_moe_routed_reference"]


def fused_moe_routed_reference(hidden: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor,
                               w2: torch.Tensor, top_k: int, renormalize: bool, routed_scaling_factor: float = 1.0,
                               weights_dtype: torch.dtype | None = None) -> torch.Tensor:
    """moe_topk's softmax routing, then fused_moe, in plain torch."""
    weights, ids = moe_topk_reference(router_logits, top_k, "softmax", renormalize, routed_scaling_factor,
                                      weights_dtype=weights_dtype)
    return fused_moe_reference(hidden, weights, ids, w13, w2)


@torch.library.custom_op("mini_infer::fused_moe_routed", mutates_args=())
def fused_moe_routed(hidden: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     top_k: int, renormalize: bool, routed_scaling_factor: float = 1.0,
                     weights_dtype: torch.dtype | None = None) -> torch.Tensor:
    """fused_moe over moe_topk's softmax routing of `router_logits` (module docstring): [T, H] in hidden's dtype."""
    check_routed_args(hidden, router_logits, w13, top_k)
    impl = fused_moe_routed_triton if use_triton(hidden) else fused_moe_routed_reference
    return impl(hidden, router_logits, w13, w2, top_k, renormalize, routed_scaling_factor, weights_dtype)


@fused_moe_routed.register_fake
def _(hidden, router_logits, w13, w2, top_k, renormalize, routed_scaling_factor=1.0, weights_dtype=None):
    check_routed_args(hidden, router_logits, w13, top_k)
    return hidden.new_empty(hidden.shape)
