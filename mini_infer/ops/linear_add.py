"""`mini_infer::linear_add`: a linear whose output is added to the residual, the add in the GEMV's epilogue.

    linear_add(x, W, b, residual) = linear(x, W, b) + residual                                    -> s
(the linear's output rounded to x's dtype first, then the add rounded to the sum's dtype as torch's add stores
it: s equals the unfused `linear` then add bit for bit). Inserted by the FuseResidualGemvs pass where a decoder
layer's o_proj / down_proj output feeds the residual add whose norm goes on into the next GEMV's prologue
(rms_norm_linear.py). Functional: never writes into its inputs.

Why: at batch-1 decode the add is a one-row elementwise kernel whose cost is almost all launch; the GEMV already
holds its rows' outputs in registers. On CUDA, for one row that the GEMV takes (linear.py's `takes_gemv`), one
kernel on linear.py's GEMV tiling (its K loop `gemv_accumulate`, launched by `launch_gemv` with its default tile)
computes each program's BLOCK_N outputs and stores those rows of the sum, nothing else: no atomics, no program waits
for another (unlike linear_add_rms_norm.py's last-program norm, which serializes a whole-row tail after the GEMV).
Rows of at most linear.py's PRELOAD_MAX_K elements (measurements there) are loaded whole
before the kernel's PDL wait (`gemv_after_wait`; weights are never written by an earlier kernel), their K chunks
then added in the loop's order (`chunk_sums`): the same sums (bit for bit under the interpreter; a GPU compiler may
contract the loop's multiply-adds differently). Longer rows (the 7-8B down_proj) load a prefix of up to
PREFIX_PRELOAD_K elements there (`prefix_preload_width`) and the rest in the loop after the wait: the same sums again.
Anything else (several rows: prefill, batches; rows the GEMV does not take; a residual of another shape) runs
`linear` then torch's add. The choice depends only on shapes and dtypes: CUDA-graph safe, no host syncs. On CPU the
reference is `F.linear` then the add. Imports nothing from mini_infer outside `mini_infer.ops`.
"""

from __future__ import annotations

import torch

from mini_infer.ops._triton_support import HAS_TRITON, tl, triton, use_triton
from mini_infer.ops.linear import (
    launch_gemv,
    linear_reference,
    linear_triton,
    takes_gemv,
    unit_stride_row,
)

__all__ = ["linear_add", "linear_add_reference", "linear_add_triton"]


def linear_add_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         residual: torch.Tensor) -> torch.Tensor:
    """`linear(x, weight, bias) + residual` in plain torch."""
    return linear_reference(x, weight, bias) + residual


if HAS_TRITON:
    from mini_infer.ops.linear import add_bias, gemv_after_wait

    @triton.jit
    def store_linear_plus_residual(y, x_ptr, r_ptr, s_ptr, rows, row_ok):
        """s[rows] = the linear's fp32 outputs y (bias added) rounded as `linear` stores them (x's dtype), plus
        residual[rows], rounded as torch's add stores the sum (s's dtype). Also silu_mul_linear.py's epilogue."""
        y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
        r = tl.load(r_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(s_ptr + rows, (y + r).to(s_ptr.dtype.element_ty), mask=row_ok)

    @triton.jit
    def _gemv_add_kernel(
        x_ptr, w_ptr, b_ptr, r_ptr, s_ptr, N, K, stride_wn,
        HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_GDC: tl.constexpr,
        PRELOAD_K: tl.constexpr = 0, PRELOAD_PREFIX: tl.constexpr = False,
    ):  # fmt: skip
        rows, row_ok, acc = gemv_after_wait(x_ptr, w_ptr, N, K, stride_wn, BLOCK_N, BLOCK_K, PRELOAD_K, USE_GDC,
                                            PRELOAD_PREFIX)
        y = add_bias(tl.sum(acc, axis=1), b_ptr, rows, row_ok, HAS_BIAS)
        store_linear_plus_residual(y, x_ptr, r_ptr, s_ptr, rows, row_ok)


def _sum_dtype(x: torch.Tensor, residual: torch.Tensor) -> torch.dtype:
    """The add's dtype: the linear's output (x's dtype) promoted with the residual's, as torch's add promotes."""
    return torch.promote_types(x.dtype, residual.dtype)


def linear_add_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                      config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """The CUDA path: one GEMV kernel with the add in its epilogue for a single row the GEMV takes (tile `config`;
    None: the GEMV's default), else `linear` (its kernel) then torch's add."""
    n, k = weight.shape
    y_shape = (*x.shape[:-1], n)
    if not (takes_gemv(x.numel(), x.dtype, weight) and tuple(residual.shape) == y_shape):
        return linear_triton(x, weight, bias) + residual
    xr = unit_stride_row(x)
    w = weight if weight.stride(1) == 1 else weight.contiguous()
    s = torch.empty(y_shape, dtype=_sum_dtype(x, residual), device=x.device)
    launch_gemv(_gemv_add_kernel, w, xr, w, bias if bias is not None else w, unit_stride_row(residual), s.view(n),
                n, k, w.stride(0), config=config, preload=True, prefix=True, HAS_BIAS=bias is not None)
    return s


@torch.library.custom_op("mini_infer::linear_add", mutates_args=())
def linear_add(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               residual: torch.Tensor) -> torch.Tensor:
    """`linear(x, weight, bias) + residual`: the add in the GEMV's epilogue for one row on CUDA."""
    if use_triton(x):
        return linear_add_triton(x, weight, bias, residual)
    return linear_add_reference(x, weight, bias, residual)


@linear_add.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0])) + residual  # the add's shape and dtype
