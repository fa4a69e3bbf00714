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
Rows of at most PRELOAD_MAX_K elements (off by default: see it) are loaded whole before the kernel's PDL wait
(weights are never written by an earlier kernel), their K chunks then added in the loop's order (`_chunk_sums`): the
same sums (bit for bit under the interpreter; a GPU compiler may contract the loop's multiply-adds differently).
Anything else (several rows: prefill, batches; rows the GEMV does not take; a residual of another shape) runs
`linear` then torch's add. The choice depends only on shapes and dtypes: CUDA-graph safe, no host syncs. On CPU the
reference is `F.linear` then the add. Imports nothing from mini_infer outside `mini_infer.ops`.
"""

from __future__ import annotations

import os

import torch

from mini_infer.ops._triton_support import HAS_TRITON, await_producers, next_pow2, tl, triton, use_triton
from mini_infer.ops.linear import (
    gemv_config,
    launch_gemv,
    linear_reference,
    linear_triton,
    takes_gemv,
    unit_stride_row,
)

__all__ = ["PRELOAD_MAX_K", "linear_add", "linear_add_reference", "linear_add_triton", "preload_width"]

# Rows of at most this many elements are loaded whole before the PDL wait (MINI_INFER_GEMV_PRELOAD_MAX_K; 0: never):
# the programs already resident while the kernel before this one runs (at batch 1 a latency-bound decode attention
# or a small gate_up GEMV leaves most SMs idle) stream their weights then, instead of after it. On an H200
# (2026-11-24, bf16, batch 1, `bench/latency.py`, processes alternated in one lease) a first version (one tl.sum over
# the whole row: other bits than the loop's) gave qwen3-0.6b (o_proj K 2,048, down_proj K 3,072) 1,354.7 / 1,355.0
# tok/s vs 1,252.0 / 1,252.8, and qwen2.5-7b (o_proj K 3,584; down_proj's 18,944 too long) 249.8 / 249.7 vs 250.2 /
# 250.1 with rows up to 4,096: so 3,072 is the limit to use. OFF by default until this version (`_chunk_sums`: the
# loop's bits) has passed bench/gpu_check.py on a GPU: the session's device time ran out after a first build of it
# failed to compile there (fixed since; checked under the interpreter and built for sm_90 on a CPU without spills,
# tests/ops/compile_linear_add_sm90.py, which reproduces the first build's failure). To try it:
# MINI_INFER_GEMV_PRELOAD_MAX_K=3072.
PRELOAD_MAX_K = int(os.environ.get("MINI_INFER_GEMV_PRELOAD_MAX_K", "0"))


def linear_add_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         residual: torch.Tensor) -> torch.Tensor:
    """`linear(x, weight, bias) + residual` in plain torch."""
    return linear_reference(x, weight, bias) + residual


if HAS_TRITON:
    from mini_infer.ops.linear import add_bias, gemv_accumulate

    @triton.jit
    def store_linear_plus_residual(y, x_ptr, r_ptr, s_ptr, rows, row_ok):
        """s[rows] = the linear's fp32 outputs y (bias added) rounded as `linear` stores them (x's dtype), plus
        residual[rows], rounded as torch's add stores the sum (s's dtype). Also silu_mul_linear.py's epilogue."""
        y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
        r = tl.load(r_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(s_ptr + rows, (y + r).to(s_ptr.dtype.element_ty), mask=row_ok)

    @triton.jit
    def _chunk_sums(p, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """p [BLOCK_N, n * BLOCK_K] (n = 1, 2 or 4) -> [BLOCK_N, BLOCK_K]: the K chunks added one after the other,
        ((c0 + c1) + c2) + c3, the order in which `gemv_accumulate`'s loop adds them, so that the row sums are the
        loop's bit for bit."""
        n: tl.constexpr = p.shape[1] // BLOCK_K
        if n == 1:  # constexpr branches, no early return: Triton compiles the code after a returning branch too
            out = p
        elif n == 2:
            c0, c1 = tl.split(tl.permute(tl.reshape(p, [BLOCK_N, 2, BLOCK_K]), [0, 2, 1]))
            out = c0 + c1
        else:
            q = tl.permute(tl.reshape(p, [BLOCK_N, 2, 2, BLOCK_K]), [0, 3, 1, 2])  # [.., BLOCK_K, c // 2, c % 2]
            even, odd = tl.split(q)  # chunks 0, 2 and 1, 3
            c0, c2 = tl.split(even)
            c1, c3 = tl.split(odd)
            out = ((c0 + c1) + c2) + c3
        return out

    @triton.jit
    def _gemv_add_kernel(
        x_ptr, w_ptr, b_ptr, r_ptr, s_ptr, N, K, stride_wn,
        HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_GDC: tl.constexpr,
        PRELOAD_K: tl.constexpr = 0,
    ):  # fmt: skip
        if PRELOAD_K:  # the whole rows [BLOCK_N, PRELOAD_K >= K] loaded before the wait: weights no kernel writes
            rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
            row_ok = rows < N
            cols = tl.arange(0, PRELOAD_K)
            col_ok = cols < K
            w = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_wn + cols[None, :],
                        mask=row_ok[:, None] & col_ok[None, :], other=0.0)
            await_producers(USE_GDC)
            x = tl.load(x_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
            y = add_bias(tl.sum(_chunk_sums(w.to(tl.float32) * x[None, :], BLOCK_N, BLOCK_K), axis=1), b_ptr, rows,
                         row_ok, HAS_BIAS)
        else:
            await_producers(USE_GDC)
            rows, row_ok, acc = gemv_accumulate(x_ptr, w_ptr, N, K, stride_wn, BLOCK_N, BLOCK_K)
            y = add_bias(tl.sum(acc, axis=1), b_ptr, rows, row_ok, HAS_BIAS)
        store_linear_plus_residual(y, x_ptr, r_ptr, s_ptr, rows, row_ok)


def _sum_dtype(x: torch.Tensor, residual: torch.Tensor) -> torch.dtype:
    """The add's dtype: the linear's output (x's dtype) promoted with the residual's, as torch's add promotes."""
    return torch.promote_types(x.dtype, residual.dtype)


def preload_width(k: int, config: tuple[int, int, int, int] | None = None) -> int:
    """The row width the one-row kernel loads before its PDL wait (`PRELOAD_MAX_K`): a power of two covering K, a
    multiple of the tile's BLOCK_K by 1, 2 or 4 (the chunks `_chunk_sums` adds in the K loop's order); 0: rows
    longer than PRELOAD_MAX_K, or a tile whose chunks would be more, take the K loop after the wait."""
    block_k = (config or gemv_config(k))[1]
    width = max(next_pow2(k), block_k)
    return width if k <= PRELOAD_MAX_K and width // block_k in (1, 2, 4) else 0


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
    preload = preload_width(k, config)
    launch_gemv(_gemv_add_kernel, w, xr, w, bias if bias is not None else w, unit_stride_row(residual), s.view(n),
                n, k, w.stride(0), config=config, HAS_BIAS=bias is not None, PRELOAD_K=preload)
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
