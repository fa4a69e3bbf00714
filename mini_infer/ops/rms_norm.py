"""`mini_infer::rms_norm`: RMSNorm over the last dim, numerically identical to HF `LlamaRMSNorm`.

Inserted by the FuseRMSNorm pass in place of the pow/mean/rsqrt/mul chain. Semantics (must not change):
`h = x.float(); h = h * rsqrt(mean(h**2, -1) + eps); return weight * h.to(x.dtype)` with torch type
promotion for the last multiply. Imports nothing from mini_infer outside `mini_infer.ops`.
The Triton kernel here is shared with `fused_add_rms_norm` (the `HAS_RESIDUAL` variant); its row body
(`rms_norm_tile`, or `rms_norm_rows` for rows that are not the program's) and the steps it is made of (`norm_input`,
`rms_inverse`, `weighted_norm`) are @triton.jit helpers that the quantizing norms (quant.py), the norm in a GEMV's
last program (linear_add_rms_norm.py) and the q/k head norms of `qk_rotary` (_rotary.py's `rotate_rows`) call, so
all of them round where HF rounds; `norm_tile` is their tile. The one-pass norm-in-GEMV prologue
(rms_norm_linear.py) calls `norm_input` and `rms_inverse` only: it keeps the normalized row in fp32 (see there).
"""

from __future__ import annotations

import torch

from mini_infer.ops._triton_support import (
    HAS_TRITON,
    await_producers,
    next_pow2,
    pdl_args,
    tl,
    triton,
    use_triton,
)

__all__ = ["norm_tile", "rms_norm", "rms_norm_reference", "rms_norm_triton"]


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain torch, exactly HF LlamaRMSNorm.forward."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


if HAS_TRITON:

    @triton.jit
    def norm_input(x_ptrs, r_ptrs, s_ptrs, mask, HAS_RESIDUAL: tl.constexpr):
        """The norm's input at `x_ptrs` in fp32: x, or with HAS_RESIDUAL `x + residual` rounded to the sum's
        storage dtype (`s_ptrs`' element type) first, as torch's add stores it. Stores nothing."""
        x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)
            x = (x + r).to(s_ptrs.dtype.element_ty).to(tl.float32)
        return x

    @triton.jit
    def rms_inverse(sum_sq, n_cols, eps):
        """1 / sqrt(mean(x**2) + eps) from a row's fp32 sum of squares."""
        return tl.rsqrt(sum_sq / n_cols + eps)

    @triton.jit
    def weighted_norm(x, inv_rms, w, H_DTYPE: tl.constexpr):
        """`w * (x * inv_rms).to(H_DTYPE)` in fp32 (w: the norm weight as fp32). HF casts the normalized value
        back to the input dtype H_DTYPE before the weight multiply: that rounding step is kept."""
        return w * (x * inv_rms).to(H_DTYPE).to(tl.float32)

    @triton.jit
    def rms_norm_tile(
        x_ptr, r_ptr, w_ptr, s_ptr, n_rows, n_cols, stride_x, stride_r, stride_s, eps,
        HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GEMMA: tl.constexpr = False,
    ):  # fmt: skip
        """This program's BLOCK_M whole rows of `weight * rms_norm(x (+ residual))`, in fp32 before the output
        cast, the sum stored at `s_ptr` (HAS_RESIDUAL); with the rows, columns and mask for the caller's store.
        The row body of `rms_norm`, `fused_add_rms_norm`, their quantizing variants (quant.py) and, with GEMMA
        (Gemma's weighting, gemma_rms_norm.py: `(normed * (1 + weight))` in fp32), of `gemma_rms_norm`."""
        rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        return rms_norm_rows(rows, x_ptr, r_ptr, w_ptr, s_ptr, n_rows, n_cols, stride_x, stride_r, stride_s, eps,
                             HAS_RESIDUAL, BLOCK_N, GEMMA)

    @triton.jit
    def rms_norm_rows(
        rows, x_ptr, r_ptr, w_ptr, s_ptr, n_rows, n_cols, stride_x, stride_r, stride_s, eps,
        HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr, GEMMA: tl.constexpr = False,
    ):  # fmt: skip
        """`rms_norm_tile` for the given rows (int64 indices, those >= n_rows masked off), whichever program runs
        it (linear_add_rms_norm.py: the last program of a GEMV normalizes its output row)."""
        cols = tl.arange(0, BLOCK_N)
        col_ok = cols < n_cols
        mask = (rows < n_rows)[:, None] & col_ok[None, :]
        s_ptrs = s_ptr + rows[:, None] * stride_s + cols[None, :]
        x = norm_input(x_ptr + rows[:, None] * stride_x + cols[None, :], r_ptr + rows[:, None] * stride_r
                       + cols[None, :], s_ptrs, mask, HAS_RESIDUAL)
        if HAS_RESIDUAL:
            tl.store(s_ptrs, x.to(s_ptr.dtype.element_ty), mask=mask)
            h_dtype = s_ptr.dtype.element_ty
        else:
            h_dtype = x_ptr.dtype.element_ty
        inv_rms = rms_inverse(tl.sum(x * x, axis=1), n_cols, eps)
        w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        if GEMMA:  # HF Gemma2RMSNorm: the weight is 1 + w and multiplies before the cast
            out = (x * inv_rms[:, None]) * (1.0 + w[None, :])
        else:
            out = weighted_norm(x, inv_rms[:, None], w[None, :], h_dtype)
        return out, rows, cols, mask

    @triton.jit
    def _rms_norm_kernel(
        x_ptr, r_ptr, w_ptr, out_ptr, s_ptr,
        n_rows, n_cols, stride_x, stride_r, stride_o, stride_s, eps,
        HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_GDC: tl.constexpr,
        GEMMA: tl.constexpr,
    ):  # fmt: skip
        await_producers(USE_GDC)
        out, rows, cols, mask = rms_norm_tile(x_ptr, r_ptr, w_ptr, s_ptr, n_rows, n_cols, stride_x, stride_r,
                                              stride_s, eps, HAS_RESIDUAL, BLOCK_M, BLOCK_N, GEMMA)
        tl.store(out_ptr + rows[:, None] * stride_o + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor, n_cols: int) -> torch.Tensor:
    """A [rows, n_cols] view (or copy, when no view exists) with unit stride along the last dim."""
    t2 = t.reshape(-1, n_cols)
    return t2 if t2.stride(-1) == 1 or n_cols == 1 else t2.contiguous()


def norm_tile(n_cols: int) -> tuple[int, int, int]:
    """(BLOCK_M rows per program, BLOCK_N >= n_cols, num_warps) of the norm kernels for rows of n_cols: the tile
    every caller of `rms_norm_tile` / `rms_norm_rows` uses, so they all sum a row in the same order."""
    block_n = next_pow2(n_cols)
    return max(1, min(16, 4096 // block_n)), block_n, 4 if block_n <= 4096 else 8


def _launch_rms_norm(x, residual, weight, eps, out, s, gemma: bool = False) -> None:
    """Launch `_rms_norm_kernel` over x's rows (with `gemma`, Gemma's weighting: gemma_rms_norm.py)."""
    n_cols = x.shape[-1]
    x2 = _rows(x, n_cols)
    n_rows = x2.shape[0]
    if n_rows == 0 or n_cols == 0:
        return
    out2 = out.view(-1, n_cols)
    r2 = _rows(residual, n_cols) if residual is not None else x2
    s2 = s.view(-1, n_cols) if s is not None else out2
    w = weight.contiguous()
    block_m, block_n, num_warps = norm_tile(n_cols)
    grid = (triton.cdiv(n_rows, block_m),)
    _rms_norm_kernel[grid](
        x2, r2, w, out2, s2,
        n_rows, n_cols, x2.stride(0), r2.stride(0), out2.stride(0), s2.stride(0), float(eps),
        HAS_RESIDUAL=residual is not None, BLOCK_M=block_m, BLOCK_N=block_n, GEMMA=gemma, num_warps=num_warps,
        **pdl_args(x2),
    )  # fmt: skip


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton RMSNorm (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1)."""
    if not HAS_TRITON:
        raise RuntimeError("rms_norm_triton needs triton")
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} does not match last dim of x {tuple(x.shape)}")
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    _launch_rms_norm(x, None, weight, eps, out, None)
    return out


@torch.library.custom_op("mini_infer::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: Triton on CUDA when available, else the torch reference."""
    if use_triton(x):
        return rms_norm_triton(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


@rms_norm.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x.new_empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype))
