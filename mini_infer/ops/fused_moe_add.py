"""`mini_infer::fused_moe_add`: the routed experts' output added to the residual, the add in the MoE's last launch.

    fused_moe_add(hidden, topk_weights, topk_ids, w13, w2, residual, activation, expert_map)
        = fused_moe(hidden, topk_weights, topk_ids, w13, w2, activation, expert_map) + residual      -> s [T, H]
(the MoE output rounded to hidden's dtype first, then the add rounded to the sum's dtype, as torch's add stores it:
s equals the unfused `fused_moe` then add bit for bit). Inserted by the FuseMoeResidual pass where an MoE block's
output feeds the decoder's residual add + next norm, so that the norm can go on into the next GEMV's prologue
(fuse_residual_gemvs' `rms_norm_linear`). Functional: never writes into its inputs.

Why: at batch-1 decode the add + norm after the MoE is a one-row kernel whose cost is almost all launch (qwen3-30b-a3b
on an H200: 1.1-1.9 us exposed a layer). On CUDA the launch that sums a token's k slots (fused_moe.py: the down
GEMM's slot merge in pair-per-block mode, the slot-sum kernel, or the decode path's down GEMV) adds the residual row
too (`with_residual`); where the down GEMM writes the output rows itself (k == 1) torch's add follows. A residual of
another dtype than hidden's runs `fused_moe` then torch's add. On CPU the reference is `fused_moe`'s reference then
the add. Imports nothing from mini_infer outside `mini_infer.ops`.
"""

from __future__ import annotations

import torch

from mini_infer.ops._triton_support import use_triton
from mini_infer.ops.fused_moe import _check_args, fused_moe_reference, fused_moe_triton

__all__ = ["fused_moe_add", "fused_moe_add_reference", "fused_moe_add_triton"]


def _check_residual_shape(hidden: torch.Tensor, residual: torch.Tensor) -> None:
    """ValueError unless the residual has hidden's [T, H] shape."""
    if residual.shape != hidden.shape:
        raise ValueError(f"fused_moe_add: residual {list(residual.shape)} must have hidden's shape "
                         f"{list(hidden.shape)}")


def fused_moe_add_reference(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                            w13: torch.Tensor, w2: torch.Tensor, residual: torch.Tensor, activation: str = "silu",
                            expert_map: torch.Tensor | None = None) -> torch.Tensor:
    """`fused_moe_reference(...) + residual` in plain torch."""
    _check_residual_shape(hidden, residual)
    return fused_moe_reference(hidden, topk_weights, topk_ids, w13, w2, activation, expert_map) + residual


def fused_moe_add_triton(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                         w13: torch.Tensor, w2: torch.Tensor, residual: torch.Tensor, activation: str = "silu",
                         expert_map: torch.Tensor | None = None) -> torch.Tensor:
    """The CUDA path: `fused_moe_triton` with the residual added where it sums the slots (module docstring); a
    residual of another dtype than hidden's gets torch's add after it."""
    _check_residual_shape(hidden, residual)
    if residual.dtype != hidden.dtype:
        return fused_moe_triton(hidden, topk_weights, topk_ids, w13, w2, activation, expert_map) + residual
    return fused_moe_triton(hidden, topk_weights, topk_ids, w13, w2, activation, expert_map, residual=residual)


@torch.library.custom_op("mini_infer::fused_moe_add", mutates_args=())
def fused_moe_add(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor,
                  w2: torch.Tensor, residual: torch.Tensor, activation: str = "silu",
                  expert_map: torch.Tensor | None = None) -> torch.Tensor:
    """`fused_moe(...) + residual` (module docstring): Triton on CUDA when available, else the torch reference."""
    if use_triton(hidden):
        return fused_moe_add_triton(hidden, topk_weights, topk_ids, w13, w2, residual, activation, expert_map)
    return fused_moe_add_reference(hidden, topk_weights, topk_ids, w13, w2, residual, activation, expert_map)


@fused_moe_add.register_fake
def _(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
      residual: torch.Tensor, activation: str = "silu", expert_map: torch.Tensor | None = None) -> torch.Tensor:
    _check_args(hidden, topk_weights, topk_ids, w13, w2, activation, expert_map)
    _check_residual_shape(hidden, residual)
    return hidden.new_empty(hidden.shape, dtype=torch.promote_types(hidden.dtype, residual.dtype))
