"""`mini_infer::fused_moe_add`: the routed experts' output plus the residual, the add in the last MoE kernel.

    fused_moe_add(hidden, topk_weights, topk_ids, w13, w2, residual, activation, expert_map)
        = fused_moe(hidden, topk_weights, topk_ids, w13, w2, activation, expert_map) + residual        -> s
(the MoE output rounded to hidden's dtype first, then torch's add: s equals the unfused pair bit for bit where the
add is fused, and is that pair where it is not). Inserted by the FuseMoeResidual pass where an MoE block's output
feeds the residual add whose norm goes on into the next GEMV's prologue (`rms_norm_linear`), as linear_add.py's op
does for a dense layer's down_proj. Functional: never writes into its inputs.

On CUDA (fused_moe.py's `fused_moe_triton` with `residual`): the add is the epilogue of the slot sum (top-k > 1,
grouped GEMMs) or of the decode path's down GEMV (_moe_gemv.py's `store_sum`), so no add kernel runs; a residual of
another shape or dtype, and top-1 grouped calls (whose down GEMM writes the output rows itself), take torch's add
after. On CPU the reference is `fused_moe_reference` then the add. Imports nothing from mini_infer outside
`mini_infer.ops`.
"""

from __future__ import annotations

import torch

from mini_infer.ops._triton_support import use_triton
from mini_infer.ops.fused_moe import fused_moe_reference, fused_moe_triton

__all__ = ["fused_moe_add", "fused_moe_add_reference", "fused_moe_add_triton"]


def fused_moe_add_reference(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                            w13: torch.Tensor, w2: torch.Tensor, residual: torch.Tensor, activation: str = "silu",
                            expert_map: torch.Tensor | None = None) -> torch.Tensor:
    """`fused_moe_reference(...) + residual` in plain torch."""
    return fused_moe_reference(hidden, topk_weights, topk_ids, w13, w2, activation, expert_map, residual=residual)


def fused_moe_add_triton(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                         w13: torch.Tensor, w2: torch.Tensor, residual: torch.Tensor, activation: str = "silu",
                         expert_map: torch.Tensor | None = None) -> torch.Tensor:
    """The CUDA path: `fused_moe_triton` with the residual added in its last kernel's epilogue (module docstring)."""
    return fused_moe_triton(hidden, topk_weights, topk_ids, w13, w2, activation, expert_map, residual=residual)


@torch.library.custom_op("mini_infer::fused_moe_add", mutates_args=())
def fused_moe_add(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor,
                  w2: torch.Tensor, residual: torch.Tensor, activation: str = "silu",
                  expert_map: torch.Tensor | None = None) -> torch.Tensor:
    """`fused_moe(...) + residual`: the add in the last MoE kernel's epilogue on CUDA."""
    if use_triton(hidden):
        return fused_moe_add_triton(hidden, topk_weights, topk_ids, w13, w2, residual, activation, expert_map)
    return fused_moe_add_reference(hidden, topk_weights, topk_ids, w13, w2, residual, activation, expert_map)


@fused_moe_add.register_fake
def _(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
      residual: torch.Tensor, activation: str = "silu", expert_map: torch.Tensor | None = None) -> torch.Tensor:
    moe = torch.ops.mini_infer.fused_moe.default(hidden, topk_weights, topk_ids, w13, w2, activation, expert_map)
    return moe + residual  # the add's shape and dtype
