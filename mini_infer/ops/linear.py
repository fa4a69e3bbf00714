"""`mini_infer::linear`: `x @ weight.T + bias`, with a Triton GEMV for single-row inputs on CUDA.

Inserted by the GemvLinear pass in place of `aten.linear` on weight parameters. A decode step at batch size
1 multiplies one row by every weight of the model; there cuBLAS's kernels for M = 1 leave bandwidth unused
on some shapes (bench/kernel_gemv.py: 57-90% of copy bandwidth for o_proj and the merged gate_up on an H200,
65-98% with this kernel). So: one row and K <= `GEMV_MAX_K` -> the GEMV kernel; anything else (prefill,
batches, very long rows such as down_proj's, where cuBLAS's split-K is as fast) -> `F.linear`. The choice
depends only on shapes, so a CUDA graph captured for one batch size keeps its kernel. Imports nothing from
mini_infer outside `mini_infer.ops`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mini_infer.ops._triton_support import HAS_TRITON, tl, triton, use_triton

__all__ = ["GEMV_MAX_K", "linear", "linear_reference", "linear_triton", "gemv_triton"]

GEMV_MAX_K = 8192  # longer rows (down_proj's 18944) stay with cuBLAS (bench/kernel_gemv.py)
# (weight rows per program, K elements per step, warps, pipeline stages): the best tile for every qwen2.5-7b
# shape the GEMV serves on an H200 (bench/kernel_gemv.py sweep)
_GEMV_CONFIG = (4, 512, 4, 1)


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


if HAS_TRITON:

    @triton.jit
    def _gemv_kernel(
        x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_wn,
        HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        w_rows = w_ptr + rows[:, None].to(tl.int64) * stride_wn
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            col_ok = cols < K
            x = tl.load(x_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
            w = tl.load(w_rows + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
            acc += w.to(tl.float32) * x[None, :]
        y = tl.sum(acc, axis=1)
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                config: tuple[int, int, int, int] = _GEMV_CONFIG) -> torch.Tensor:
    """One row times `weight`.T (+ bias) with the GEMV kernel; `x` holds exactly K elements (any leading dims
    of size 1). fp32 accumulation, output in x's dtype."""
    if not HAS_TRITON:
        raise RuntimeError("gemv_triton needs triton")
    n, k = weight.shape
    if x.numel() != k:
        raise ValueError(f"gemv_triton: x has {x.numel()} elements, the weight's rows have {k}")
    xr = x.reshape(k)
    if xr.stride(0) != 1:
        xr = xr.contiguous()
    w = weight if weight.stride(1) == 1 else weight.contiguous()
    y = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    bn, bk, warps, stages = config
    _gemv_kernel[(triton.cdiv(n, bn),)](
        xr, w, bias if bias is not None else w, y, n, k, w.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return y


def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The CUDA path: the GEMV kernel for one row with K <= GEMV_MAX_K, else `F.linear` (cuBLAS)."""
    k = weight.shape[1]
    if HAS_TRITON and x.numel() == k and k <= GEMV_MAX_K and x.dtype == weight.dtype:
        return gemv_triton(x, weight, bias)
    return F.linear(x, weight, bias)


@torch.library.custom_op("mini_infer::linear", mutates_args=())
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`: a Triton GEMV for single rows on CUDA, cuBLAS otherwise."""
    if use_triton(x):
        return linear_triton(x, weight, bias)
    return linear_reference(x, weight, bias)


@linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
