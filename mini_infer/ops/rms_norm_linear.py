"""`mini_infer::rms_norm_linear` and `mini_infer::fused_add_rms_norm_linear`: an RMSNorm (optionally after the
residual add) folded into the prologue of the linear that reads its output.

Inserted by the FuseResidualGemvs pass (rms_norm_linear: the norm after a GEMV that added the residual in its
epilogue, or the first layer's input norm) and the opt-in FuseNormGemv pass, where a norm's output feeds exactly
one `mini_infer.linear`. Semantics: `rms_norm_linear(x, nw, eps, W, b) = linear(rms_norm(x, nw, eps), W, b)` and
`fused_add_rms_norm_linear(x, r, nw, eps, W, b) = (linear(n, W, b), s)` with `n, s = fused_add_rms_norm(x, r, nw,
eps)`, up to the rounding of the normalized row described below (s is unchanged: the sum as
fused_add_rms_norm stores it).
Functional: it never writes into its inputs.

On CUDA, for one row (batch-1 decode) whose normalized dtype is the weight's and K <= GEMV_MAX_K, one Triton kernel
on linear.py's GEMV tiling does both in ONE pass over the row: every program reads each K-chunk of x (+ residual,
rounded to the sum's dtype as torch's add stores it; program 0 stores that sum chunk by chunk), adds its squares
to the row's sum of squares and feeds `x * nw` (fp32) to the dot products; at the end it multiplies each dot
product by 1 / rms (a per-row constant, so it factors out of the sum) and adds the bias:
`y = inv_rms * (W @ (x * nw)) + b`. So the weight loads start at once, instead of after a first pass over the
whole row for its rms (the two-pass kernel it replaces cost 5.6 vs 4.4 us on qwen3-0.6b's qkv, 85 vs 64 us on
qwen2.5-7b's gate_up, H200 bf16; one pass costs about the plain GEMV's time). Numerics change, deliberately: the
normalized row never exists, so it is never rounded to the model dtype (rms_norm rounds `x * inv_rms` to x's dtype,
then `nw * that` to the output dtype, as HF does); only y is rounded. In fp32 the result equals the unfused pair
to fp32 rounding; in bf16 it is closer to the exact value than the unfused pair, and not bit-equal to it (relative
error against an fp32 reference 1.7e-3 on an H200: y's bf16 rounding). The sum of squares is also added up in
another order than rms_norm's kernel. Anything else (several rows: prefill, batches; longer rows; mixed dtypes)
runs the unfused ops' kernels, HF's roundings included, so prefill keeps its speed and its numbers. The choice
depends only on shapes and dtypes: CUDA-graph safe, no host syncs. On CPU the reference is the two unfused
references. Imports nothing from mini_infer outside `mini_infer.ops`.
"""

from __future__ import annotations

import os

import torch

from mini_infer.ops._triton_support import HAS_TRITON, await_producers, tl, triton, use_triton
from mini_infer.ops.fused_add_rms_norm import fused_add_rms_norm_reference, fused_add_rms_norm_triton
from mini_infer.ops.linear import (
    GEMV_CONFIG_SHORT_K,
    launch_gemv,
    linear_reference,
    linear_triton,
    takes_gemv,
    unit_stride_row,
)
from mini_infer.ops.rms_norm import rms_norm_reference, rms_norm_triton

__all__ = [
    "NORM_GEMV_ROWS",
    "NORM_GEMV_STEP",
    "fused_add_rms_norm_linear",
    "fused_add_rms_norm_linear_reference",
    "fused_add_rms_norm_linear_triton",
    "rms_norm_linear",
    "rms_norm_linear_reference",
    "rms_norm_linear_triton",
    "norm_gemv_config",
]

# The one-pass kernels' tile (BLOCK_N, BLOCK_K, warps, stages): NORM_GEMV_ROWS weight rows (rms_norm_linear_silu:
# of each half) x NORM_GEMV_STEP elements a K step, 4 warps, 1 stage; 4 x 512 by default (linear.py's
# GEMV_CONFIG_SHORT_K). Read at each launch (MINI_INFER_NORM_GEMV_ROWS / _STEP at import), for A/Bs. H200, bf16,
# batch 1, engines in one process (2026-11-25, bench/RESULTS.md): linear.py's tile by K (2 x 1024 for K >= 1024,
# which beat 4 x 512 for the plain GEMV) lost by far: qwen3-0.6b 1,402.0 tok/s (qkv only) and 1,291.3 (qkv and
# gate_up) vs 1,490.6; mistral-7b 232.8 vs 247.0; qwen2.5-7b 228.3 vs 256.8. Other tiles lost too, rows x step:
# qwen3-0.6b 8 x 512 1,446.6, 8 x 256 1,273.4, 4 x 256 1,375.1, 16 x 256 1,303.1 vs 1,490.0; mistral-7b 8 x 512
# 246.6, 8 x 256 247.5 vs 249.0; qwen2.5-7b 254.4, 258.4 vs 258.9.
NORM_GEMV_ROWS = int(os.environ.get("MINI_INFER_NORM_GEMV_ROWS", str(GEMV_CONFIG_SHORT_K[0])))
NORM_GEMV_STEP = int(os.environ.get("MINI_INFER_NORM_GEMV_STEP", str(GEMV_CONFIG_SHORT_K[1])))


def norm_gemv_config() -> tuple[int, int, int, int]:
    """The tile of the one-pass norm + GEMV kernels (rms_norm_linear's and rms_norm_linear_silu's)."""
    return NORM_GEMV_ROWS, NORM_GEMV_STEP, 4, 1


def rms_norm_linear_reference(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                              bias: torch.Tensor | None) -> torch.Tensor:
    """`linear(rms_norm(x, norm_weight, eps), weight, bias)` in plain torch."""
    return linear_reference(rms_norm_reference(x, norm_weight, eps), weight, bias)


def fused_add_rms_norm_linear_reference(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`n, s = fused_add_rms_norm(x, residual, norm_weight, eps); return linear(n, weight, bias), s` in plain torch."""
    normed, s = fused_add_rms_norm_reference(x, residual, norm_weight, eps)
    return linear_reference(normed, weight, bias), s


if HAS_TRITON:
    from mini_infer.ops.linear import add_bias, gemv_rows, gemv_step
    from mini_infer.ops.rms_norm import norm_input, rms_inverse

    @triton.jit
    def norm_gemv_input(x_ptr, r_ptr, s_ptr, nw_ptr, cols, col_ok, HAS_RESIDUAL: tl.constexpr):
        """One K-chunk `cols` of the one-pass norm prologue: (its squares for the row's sum of squares, the GEMV's
        input `x * nw`), both fp32, x the norm's input (with HAS_RESIDUAL x + residual, which program 0 stores as
        the sum). Also the prologue of rms_norm_linear_silu.py's kernel."""
        x = norm_input(x_ptr + cols, r_ptr + cols, s_ptr + cols, col_ok, HAS_RESIDUAL)
        if HAS_RESIDUAL:
            if tl.program_id(0) == 0:
                tl.store(s_ptr + cols, x.to(s_ptr.dtype.element_ty), mask=col_ok)
        nw = tl.load(nw_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        return x * x, x * nw

    @triton.jit
    def _rms_norm_gemv_kernel(
        x_ptr, r_ptr, s_ptr, nw_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_wn, eps,
        HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        USE_GDC: tl.constexpr,
    ):  # fmt: skip
        await_producers(USE_GDC)
        rows, row_ok, w_rows, acc = gemv_rows(w_ptr, N, stride_wn, BLOCK_N, BLOCK_K)
        # one pass: the GEMV of (x * norm weight) and the row's sum of squares side by side (the 1 / rms scale is
        # the same for every column, so it multiplies the dot products at the end); program 0 stores the sum
        sq = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            col_ok = cols < K
            x_sq, x_nw = norm_gemv_input(x_ptr, r_ptr, s_ptr, nw_ptr, cols, col_ok, HAS_RESIDUAL)
            sq += x_sq
            acc = gemv_step(acc, w_rows, row_ok, cols, col_ok, x_nw)
        y = add_bias(tl.sum(acc, axis=1) * rms_inverse(tl.sum(sq, axis=0), K, eps), b_ptr, rows, row_ok, HAS_BIAS)
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)


def _sum_dtype(x: torch.Tensor, residual: torch.Tensor | None) -> torch.dtype:
    return x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)


def _fuses(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the one-kernel path serves these shapes and dtypes (one row the GEMV takes), else the unfused ops."""
    if norm_weight.shape != x.shape[-1:] or (residual is not None and residual.shape != x.shape):
        return False
    return takes_gemv(x.numel(), torch.promote_types(norm_weight.dtype, _sum_dtype(x, residual)), weight)


def _launch_rms_norm_gemv(x, residual, norm_weight, eps, weight, bias) -> tuple[torch.Tensor, torch.Tensor | None]:
    n, k = weight.shape
    s_dtype = _sum_dtype(x, residual)
    y = torch.empty((*x.shape[:-1], n), dtype=torch.promote_types(norm_weight.dtype, s_dtype), device=x.device)
    s = torch.empty(x.shape, dtype=s_dtype, device=x.device) if residual is not None else None
    xr = unit_stride_row(x)
    w = weight if weight.stride(1) == 1 else weight.contiguous()
    launch_gemv(
        _rms_norm_gemv_kernel, w,
        xr, unit_stride_row(residual) if residual is not None else xr, s.view(k) if s is not None else xr,
        norm_weight.contiguous(), w, bias if bias is not None else w, y, n, k, w.stride(0), float(eps),
        HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None, config=norm_gemv_config(),
    )  # fmt: skip
    return y, s


def rms_norm_linear_triton(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                           bias: torch.Tensor | None) -> torch.Tensor:
    """The CUDA path: one kernel for a single row the GEMV takes, else `rms_norm` then `linear` (their kernels)."""
    if _fuses(x, None, norm_weight, weight):
        return _launch_rms_norm_gemv(x, None, norm_weight, eps, weight, bias)[0]
    return linear_triton(rms_norm_triton(x, norm_weight, eps), weight, bias)


def fused_add_rms_norm_linear_triton(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The CUDA path: one kernel for a single row the GEMV takes, else `fused_add_rms_norm` then `linear`."""
    if _fuses(x, residual, norm_weight, weight):
        return _launch_rms_norm_gemv(x, residual, norm_weight, eps, weight, bias)
    normed, s = fused_add_rms_norm_triton(x, residual, norm_weight, eps)
    return linear_triton(normed, weight, bias), s


@torch.library.custom_op("mini_infer::rms_norm_linear", mutates_args=())
def rms_norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
    """`linear(rms_norm(x, norm_weight, eps), weight, bias)`: one Triton kernel for a single row on CUDA."""
    if use_triton(x):
        return rms_norm_linear_triton(x, norm_weight, eps, weight, bias)
    return rms_norm_linear_reference(x, norm_weight, eps, weight, bias)


@rms_norm_linear.register_fake
def _(x, norm_weight, eps, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=torch.promote_types(norm_weight.dtype, x.dtype))


@torch.library.custom_op("mini_infer::fused_add_rms_norm_linear", mutates_args=())
def fused_add_rms_norm_linear(
    x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`s = x + residual`; (linear(rms_norm(s, norm_weight, eps), weight, bias), s): one Triton kernel for a single
    row on CUDA."""
    if use_triton(x):
        return fused_add_rms_norm_linear_triton(x, residual, norm_weight, eps, weight, bias)
    return fused_add_rms_norm_linear_reference(x, residual, norm_weight, eps, weight, bias)


@fused_add_rms_norm_linear.register_fake
def _(x, residual, norm_weight, eps, weight, bias):
    s = x.new_empty(x.shape, dtype=_sum_dtype(x, residual))
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=torch.promote_types(norm_weight.dtype, s.dtype)), s
