"""`mini_infer::linear_add_rms_norm` and `mini_infer::scaled_linear_add_rms_norm_quant`: a linear whose output is
added to the residual and normalized (and, W8A8/FP8, quantized per token), the add + norm in the GEMV's launch.

    linear_add_rms_norm(x, W, b, residual, nw, eps)
        = fused_add_rms_norm(linear(x, W, b), residual, nw, eps)                            -> (normed, s)
    scaled_linear_add_rms_norm_quant(x_q, x_scale, W_q, w_scale, b, out_dtype, residual, nw, eps, dtype)
        = fused_add_rms_norm_quant(int8_linear / fp8_linear(x_q, ..., out_dtype), residual, nw, eps, dtype)
                                                                                            -> (q, scale, s)
(the linear by x_q's dtype: int8 or float8_e4m3fn). Inserted by the FuseGemvNorm pass where a decoder layer's
o_proj / down_proj output feeds only the residual add + norm. Functional: never writes into its inputs.

Why: at batch-1 decode the norm is a one-program kernel whose cost is almost all launch. On CUDA, for one row that
the GEMV takes (linear.py's `takes_gemv`; the W8A8 GEMV takes any one row), one launch does both: every program
runs the GEMV's body (`gemv_program`, with linear.py's weight preload before the PDL wait for rows of at most
PRELOAD_MAX_K elements; int8_linear.py's `scaled_gemv_program`, no preload, whose fp8 tensor-core launches may cut K
into splits: then a row block's last split stores and counts, the others neither) and
stores its slice of the linear's output row, then counts itself in a counter (`_split_k.split_counters` and
`arrives_last`: a `tl.debug_barrier()` first, then one acq_rel atomic per program, as the split-K merge does); the
program that arrives last zeroes the counter again (CUDA-graph replays) and runs the norm's row body over the whole
row (rms_norm.py's `rms_norm_rows`, with quant.py's `store_quantized_norm` for the quantizing variant) on the tile of the unfused norm kernel
(`norm_tile`). So the linear's output is the GEMV kernel's, and the norm reads the same stored values with the same
tile: under the Triton interpreter the outputs equal the unfused pair's bit for bit. On a GPU the fused kernel
runs the norm with the GEMV's warps (4): the same as the norm kernel's for rows up to 4,096 columns; longer rows
may sum their squares in another order (the fp32 scale one ulp apart). Anything else (several rows: prefill,
batches; rows the GEMV does not take) runs the unfused ops' kernels. The choice depends only on shapes and dtypes:
CUDA-graph safe, no host syncs. One counter serves every launch (launches on one stream run one after another;
each leaves it zero), so two of these kernels must not run concurrently on different streams.
On CPU the reference is the two unfused references. Imports nothing from mini_infer outside `mini_infer.ops`.
"""

from __future__ import annotations

import torch

from mini_infer.ops._split_k import split_counters
from mini_infer.ops._triton_support import HAS_TRITON, tl, triton, use_triton
from mini_infer.ops.fp8_linear import check_scaled_linear_of, fp8_supported, scaled_linear_of
from mini_infer.ops.fused_add_rms_norm import fused_add_rms_norm_reference, fused_add_rms_norm_triton
from mini_infer.ops.int8_linear import (
    launch_scaled_gemv,
    takes_scaled_gemv,
)
from mini_infer.ops.linear import (
    launch_gemv,
    linear_reference,
    linear_triton,
    takes_gemv,
    unit_stride_row,
)
from mini_infer.ops.quant import (
    QMAX,
    _tl_dtype,
    check_quant_dtype,
    fused_add_rms_norm_quant_reference,
    fused_add_rms_norm_quant_triton,
)
from mini_infer.ops.rms_norm import norm_tile

__all__ = [
    "linear_add_rms_norm",
    "linear_add_rms_norm_reference",
    "linear_add_rms_norm_triton",
    "scaled_linear_add_rms_norm_quant",
    "scaled_linear_add_rms_norm_quant_reference",
    "scaled_linear_add_rms_norm_quant_triton",
]

FP8 = torch.float8_e4m3fn


def _check_scaled(x_q, x_scale, w_q, w_scale, bias, dtype) -> None:
    """ValueError unless the operands are an int8 or fp8 W8A8 linear's and `dtype` a quantized activation dtype."""
    check_scaled_linear_of("scaled_linear_add_rms_norm_quant", x_q, x_scale, w_q, w_scale, bias)
    check_quant_dtype(dtype)


def linear_add_rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
    norm_weight: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`fused_add_rms_norm(linear(x, weight, bias), residual, norm_weight, eps)` in plain torch."""
    return fused_add_rms_norm_reference(linear_reference(x, weight, bias), residual, norm_weight, eps)


def scaled_linear_add_rms_norm_quant_reference(
    x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
    out_dtype: torch.dtype, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """`fused_add_rms_norm_quant(scaled linear(x_q, ...), residual, norm_weight, eps, dtype)` in plain torch."""
    y = scaled_linear_of("reference", x_q.dtype)(x_q, x_scale, w_q, w_scale, bias, out_dtype)
    return fused_add_rms_norm_quant_reference(y, residual, norm_weight, eps, dtype)


if HAS_TRITON:
    from mini_infer.ops._split_k import arrives_last
    from mini_infer.ops.int8_linear import scaled_gemv_program
    from mini_infer.ops.linear import gemv_program
    from mini_infer.ops.quant import store_quantized_norm
    from mini_infer.ops.rms_norm import rms_norm_rows

    @triton.jit
    def _normalized_row(y_ptr, r_ptr, nw_ptr, s_ptr, N, eps, NORM_BLOCK_M: tl.constexpr, NORM_BLOCK_N: tl.constexpr):
        """fused_add_rms_norm's row body over the linear's stored output row y [N] and the residual: (normed fp32,
        rows, cols, mask) as `rms_norm_rows` returns them; the sum stored at s_ptr."""
        rows = tl.arange(0, NORM_BLOCK_M).to(tl.int64)  # row 0 is the one row; the others are masked off
        return rms_norm_rows(rows, y_ptr, r_ptr, nw_ptr, s_ptr, 1, N, N, N, N, eps, True, NORM_BLOCK_N)

    @triton.jit
    def _gemv_add_rms_norm_kernel(
        x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_wn, r_ptr, nw_ptr, out_ptr, s_ptr, cnt_ptr, eps,
        HAS_BIAS: tl.constexpr, NORM_BLOCK_M: tl.constexpr, NORM_BLOCK_N: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_GDC: tl.constexpr, PRELOAD_K: tl.constexpr = 0,
    ):  # fmt: skip
        gemv_program(x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_wn, HAS_BIAS, BLOCK_N, BLOCK_K, USE_GDC, PRELOAD_K)
        if arrives_last(cnt_ptr, tl.num_programs(0)):
            out, rows, cols, mask = _normalized_row(y_ptr, r_ptr, nw_ptr, s_ptr, N, eps, NORM_BLOCK_M, NORM_BLOCK_N)
            tl.store(out_ptr + rows[:, None] * N + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _scaled_gemv_add_rms_norm_quant_kernel(
        x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, b_ptr, y_ptr, N, K, stride_wn, ws_ptr, cnt_ptr,
        r_ptr, nw_ptr, q_ptr, q_scale_ptr, s_ptr, eps,
        HAS_BIAS: tl.constexpr, ACC_DTYPE: tl.constexpr, PACKED: tl.constexpr, ASM: tl.constexpr, DOT: tl.constexpr,
        NORM_DTYPE: tl.constexpr, IS_FP8: tl.constexpr, QMAX: tl.constexpr, NORM_BLOCK_M: tl.constexpr,
        NORM_BLOCK_N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_GDC: tl.constexpr,
        SPLIT_K: tl.constexpr = 1,
    ):  # fmt: skip
        # a split-K launch stores a row block's outputs from its last split only: those programs are counted here
        stored = scaled_gemv_program(x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, b_ptr, y_ptr, N, K, stride_wn, ws_ptr,
                                     cnt_ptr, HAS_BIAS, ACC_DTYPE, PACKED, ASM, DOT, BLOCK_N, BLOCK_K, USE_GDC, SPLIT_K)
        if stored:
            if arrives_last(cnt_ptr, tl.num_programs(0)):
                # N here is the output row's length: with PACKED, K and stride_wn count int32 words, N does not
                out, rows, cols, mask = _normalized_row(y_ptr, r_ptr, nw_ptr, s_ptr, N, eps, NORM_BLOCK_M,
                                                        NORM_BLOCK_N)
                store_quantized_norm(out, rows, cols, mask, 1, q_ptr, q_scale_ptr, N, NORM_DTYPE, IS_FP8, QMAX)


def _fusable(y_shape: tuple, residual: torch.Tensor, norm_weight: torch.Tensor, y_dtype: torch.dtype) -> bool:
    """The add + norm fits the fused kernel: one output row of y_shape, the residual of the same shape, and the sum's
    dtype the output's (the norm then reads the row where the GEMV stored it)."""
    n = y_shape[-1]
    return (residual.shape == y_shape and norm_weight.shape == (n,) and n > 0
            and torch.promote_types(y_dtype, residual.dtype) == y_dtype)


def linear_add_rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
    norm_weight: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The CUDA path: one launch for a single row the GEMV takes, else `linear` then `fused_add_rms_norm` (their
    kernels)."""
    n, k = weight.shape
    y_shape = (*x.shape[:-1], n)
    if not (takes_gemv(x.numel(), x.dtype, weight) and _fusable(y_shape, residual, norm_weight, x.dtype)):
        return fused_add_rms_norm_triton(linear_triton(x, weight, bias), residual, norm_weight, eps)
    xr = unit_stride_row(x)
    w = weight if weight.stride(1) == 1 else weight.contiguous()
    y = torch.empty(n, dtype=x.dtype, device=x.device)
    s = torch.empty(y_shape, dtype=x.dtype, device=x.device)
    out = torch.empty(y_shape, dtype=torch.promote_types(norm_weight.dtype, x.dtype), device=x.device)
    block_m, block_n, _ = norm_tile(n)
    launch_gemv(
        _gemv_add_rms_norm_kernel, w,
        xr, w, bias if bias is not None else w, y, n, k, w.stride(0),
        unit_stride_row(residual), norm_weight.contiguous(), out, s, split_counters(x.device, 1), float(eps),
        HAS_BIAS=bias is not None, NORM_BLOCK_M=block_m, NORM_BLOCK_N=block_n, preload=True,
    )  # fmt: skip
    return out, s


def scaled_linear_add_rms_norm_quant_triton(
    x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
    out_dtype: torch.dtype, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The CUDA path: one launch for a single row (the scaled GEMV's case), else the scaled linear then
    `fused_add_rms_norm_quant` (their kernels)."""
    _check_scaled(x_q, x_scale, w_q, w_scale, bias, dtype)
    n, k = w_q.shape
    y_shape = (*x_q.shape[:-1], n)
    fuses = (takes_scaled_gemv(x_q.numel() // k if k else 0, k, n) and _fusable(y_shape, residual, norm_weight,
                                                                                 out_dtype)
             and (x_q.dtype != FP8 or fp8_supported(x_q.device)))  # else fp8_linear's error names the capability
    if not fuses:
        y = scaled_linear_of("triton", x_q.dtype)(x_q, x_scale, w_q, w_scale, bias, out_dtype)
        return fused_add_rms_norm_quant_triton(y, residual, norm_weight, eps, dtype)
    y = torch.empty(n, dtype=out_dtype, device=x_q.device)
    s = torch.empty(y_shape, dtype=out_dtype, device=x_q.device)
    q = torch.empty(y_shape, dtype=dtype, device=x_q.device)
    q_scale = torch.empty((*y_shape[:-1], 1), dtype=torch.float32, device=x_q.device)
    block_m, block_n, _ = norm_tile(n)
    launch_scaled_gemv(
        _scaled_gemv_add_rms_norm_quant_kernel, x_q, x_scale, w_q, w_scale, bias, y,
        unit_stride_row(residual), norm_weight.contiguous(), q, q_scale, s, float(eps),
        NORM_DTYPE=_tl_dtype(torch.promote_types(norm_weight.dtype, out_dtype)), IS_FP8=dtype == FP8,
        QMAX=QMAX[dtype], NORM_BLOCK_M=block_m, NORM_BLOCK_N=block_n,
    )  # fmt: skip
    return q, q_scale, s


def _norm_fake(x: torch.Tensor, n: int, out_dtype: torch.dtype, residual: torch.Tensor) -> torch.Tensor:
    """The residual sum's fake: [.., N] of promote(out_dtype, residual's dtype)."""
    return x.new_empty((*x.shape[:-1], n), dtype=torch.promote_types(out_dtype, residual.dtype))


@torch.library.custom_op("mini_infer::linear_add_rms_norm", mutates_args=())
def linear_add_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
    norm_weight: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`fused_add_rms_norm(linear(x, weight, bias), residual, norm_weight, eps)`: one launch for one row on CUDA."""
    if use_triton(x):
        return linear_add_rms_norm_triton(x, weight, bias, residual, norm_weight, eps)
    return linear_add_rms_norm_reference(x, weight, bias, residual, norm_weight, eps)


@linear_add_rms_norm.register_fake
def _(x, weight, bias, residual, norm_weight, eps):
    s = _norm_fake(x, weight.shape[0], x.dtype, residual)
    return s.new_empty(s.shape, dtype=torch.promote_types(norm_weight.dtype, s.dtype)), s


@torch.library.custom_op("mini_infer::scaled_linear_add_rms_norm_quant", mutates_args=())
def scaled_linear_add_rms_norm_quant(
    x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
    out_dtype: torch.dtype, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """`fused_add_rms_norm_quant(int8_linear / fp8_linear(x_q, x_scale, w_q, w_scale, bias, out_dtype), residual,
    norm_weight, eps, dtype)` (by x_q's dtype): one launch for one row on CUDA."""
    impl = scaled_linear_add_rms_norm_quant_triton if use_triton(x_q) else scaled_linear_add_rms_norm_quant_reference
    return impl(x_q, x_scale, w_q, w_scale, bias, out_dtype, residual, norm_weight, eps, dtype)


@scaled_linear_add_rms_norm_quant.register_fake
def _(x_q, x_scale, w_q, w_scale, bias, out_dtype, residual, norm_weight, eps, dtype):
    _check_scaled(x_q, x_scale, w_q, w_scale, bias, dtype)
    s = _norm_fake(x_q, w_q.shape[0], out_dtype, residual)
    return s.new_empty(s.shape, dtype=dtype), s.new_empty((*s.shape[:-1], 1), dtype=torch.float32), s
