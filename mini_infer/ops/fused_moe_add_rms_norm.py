"""`mini_infer::fused_moe_add_rms_norm`: the routed experts' output added to the residual stream and normalized, the
add + norm in the launch of fused_moe's slot sum.

    fused_moe_add_rms_norm(hidden, topk_weights, topk_ids, w13, w2, residual, norm_weight, eps, activation,
                           expert_map)
        = fused_add_rms_norm(residual, fused_moe(hidden, topk_weights, topk_ids, w13, w2, activation,
                                                 expert_map).view(residual.shape), norm_weight, eps)
                                                                                  -> (normed, s), shaped like residual
(fused_moe.py for the experts' arguments: hidden [T, H]; residual holds T*H elements, last dim H). Inserted by
the FuseMoeNorm pass where a MoE block's routed output feeds only the residual add + the next norm (Qwen3-MoE,
Mixtral: nothing else is added to it). Functional: never writes into its inputs.

Why: at batch-1 decode the norm after a MoE block is a one-program kernel whose cost is almost all launch. On the
Triton path, where fused_moe's last kernel is its slot sum (the grouped GEMMs, k > 1), that kernel is replaced by
one that, per program of `norm_tile(H)` token rows (the norm kernel's tile), sums the slots (fused_moe.py's
`slot_sum_rows`), stores the sum (fused_moe's output, in hidden's dtype) to a scratch row, synchronizes the
program's threads (`tl.debug_barrier`: the stores are visible to the whole block after it) and runs
fused_add_rms_norm's row body over those rows (rms_norm.py's `rms_norm_rows`). So the sum is fused_moe's bit for
bit and the norm reads it as the unfused norm kernel does, on the same tile: the outputs equal the unfused pair's
bit for bit under the interpreter, and on a GPU too (same kernels' code, same tiles, same warps). Any row length
is served (the norm kernel's tile holds a whole row); the rest runs the two unfused ops' kernels: k == 1 (the down
GEMM writes the output, there is no slot sum), fused_moe's decode GEMV path (`moe_gemv_config`: up to two
(token, slot) pairs, e.g. Mixtral at batch 1, whose down GEMV sums the slots itself), T == 0. The choice depends
only on shapes: CUDA-graph safe, no host syncs. On CPU the reference is the two unfused references.
Imports nothing from mini_infer outside `mini_infer.ops`.
"""

from __future__ import annotations

import torch

from mini_infer.ops._triton_support import HAS_TRITON, await_producers, pdl_args, tl, triton, use_triton
from mini_infer.ops.fused_add_rms_norm import fused_add_rms_norm_reference, fused_add_rms_norm_triton
from mini_infer.ops.fused_moe import (
    _check_args,
    _map_args,
    flat_ids,
    fused_moe_reference,
    moe_expert_rows,
)
from mini_infer.ops.rms_norm import norm_tile

__all__ = ["fused_moe_add_rms_norm", "fused_moe_add_rms_norm_reference", "fused_moe_add_rms_norm_triton"]


def _check_norm_args(hidden: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor) -> None:
    """ValueError unless residual holds the experts' output (T*H elements, last dim H) and norm_weight is [H]."""
    t, h = hidden.shape
    if residual.dim() < 1 or residual.shape[-1] != h or residual.numel() != t * h:
        raise ValueError(f"fused_moe_add_rms_norm: residual {tuple(residual.shape)} must hold the experts' output "
                         f"[T={t}, H={h}] (T*H elements, last dim H)")
    if tuple(norm_weight.shape) != (h,):
        raise ValueError(f"fused_moe_add_rms_norm: norm_weight must be [H={h}], got {tuple(norm_weight.shape)}")


def fused_moe_add_rms_norm_reference(
    hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
    residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, activation: str = "silu",
    expert_map: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The two references one after the other (module docstring)."""
    _check_norm_args(hidden, residual, norm_weight)
    y = fused_moe_reference(hidden, topk_weights, topk_ids, w13, w2, activation, expert_map)
    return fused_add_rms_norm_reference(residual, y.view(residual.shape), norm_weight, eps)


if HAS_TRITON:
    from mini_infer.ops.fused_moe import slot_sum_rows
    from mini_infer.ops.rms_norm import rms_norm_rows

    @triton.jit
    def _moe_sum_add_rms_norm_kernel(
        src_ptr, ids_ptr, y_ptr, r_ptr, nw_ptr, out_ptr, s_ptr, n_rows, n_cols, num_experts, map_ptr, num_global,
        eps, TOP_K: tl.constexpr, HAS_MAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        USE_GDC: tl.constexpr,
    ):  # fmt: skip
        """This program's BLOCK_M token rows: y = the slot sum of src (stored, hidden's dtype), then
        s = r + y (stored) and out = rms_norm(s) * nw, as `_rms_norm_kernel` computes them. All [rows, n_cols],
        contiguous."""
        await_producers(USE_GDC)
        rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        cols = tl.arange(0, BLOCK_N)
        acc, mask = slot_sum_rows(src_ptr, ids_ptr, rows, cols, n_rows, n_cols, num_experts, map_ptr, num_global,
                                  TOP_K, HAS_MAP)
        tl.store(y_ptr + rows[:, None] * n_cols + cols[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)
        tl.debug_barrier()  # the rows just stored, as every thread of the program reads them below
        out, rows, cols, mask = rms_norm_rows(rows, y_ptr, r_ptr, nw_ptr, s_ptr, n_rows, n_cols, n_cols, n_cols,
                                              n_cols, eps, True, BLOCK_N)
        tl.store(out_ptr + rows[:, None] * n_cols + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def fused_moe_add_rms_norm_triton(
    hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
    residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, activation: str = "silu",
    expert_map: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The CUDA path (or CPU under TRITON_INTERPRET=1): fused_moe's kernels with the add + norm in its slot-sum
    launch, or, where fused_moe has no slot sum (module docstring), fused_moe's kernels then fused_add_rms_norm's."""
    if not HAS_TRITON:
        raise RuntimeError("fused_moe_add_rms_norm_triton needs triton")
    _check_args(hidden, topk_weights, topk_ids, w13, w2, activation, expert_map)
    _check_norm_args(hidden, residual, norm_weight)
    rows, done = moe_expert_rows(hidden, topk_weights, topk_ids, w13, w2, activation, expert_map)
    if done:
        return fused_add_rms_norm_triton(residual, rows.view(residual.shape), norm_weight, eps)
    t, h = hidden.shape
    y = torch.empty(t, h, dtype=hidden.dtype, device=hidden.device)
    s_dtype = torch.promote_types(hidden.dtype, residual.dtype)
    s = torch.empty(residual.shape, dtype=s_dtype, device=hidden.device)
    out = torch.empty(residual.shape, dtype=torch.promote_types(norm_weight.dtype, s_dtype), device=hidden.device)
    r = residual.contiguous()
    ids = flat_ids(topk_ids)
    emap, n_global = _map_args(ids, expert_map)
    block_m, block_n, num_warps = norm_tile(h)
    _moe_sum_add_rms_norm_kernel[(triton.cdiv(t, block_m),)](
        rows, ids, y, r, norm_weight.contiguous(), out, s, t, h, w13.shape[0], emap, n_global, float(eps),
        TOP_K=topk_ids.shape[1], HAS_MAP=expert_map is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=num_warps, **pdl_args(rows),
    )  # fmt: skip
    return out, s


@torch.library.custom_op("mini_infer::fused_moe_add_rms_norm", mutates_args=())
def fused_moe_add_rms_norm(
    hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
    residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, activation: str = "silu",
    expert_map: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`fused_add_rms_norm(residual, fused_moe(...).view(residual.shape), norm_weight, eps)`: the add + norm in the
    slot sum's launch on CUDA (module docstring)."""
    if use_triton(hidden):
        return fused_moe_add_rms_norm_triton(hidden, topk_weights, topk_ids, w13, w2, residual, norm_weight, eps,
                                             activation, expert_map)
    return fused_moe_add_rms_norm_reference(hidden, topk_weights, topk_ids, w13, w2, residual, norm_weight, eps,
                                            activation, expert_map)


@fused_moe_add_rms_norm.register_fake
def _(hidden, topk_weights, topk_ids, w13, w2, residual, norm_weight, eps, activation="silu", expert_map=None):
    _check_args(hidden, topk_weights, topk_ids, w13, w2, activation, expert_map)
    s = residual.new_empty(residual.shape, dtype=torch.promote_types(hidden.dtype, residual.dtype))
    return s.new_empty(s.shape, dtype=torch.promote_types(norm_weight.dtype, s.dtype)), s
