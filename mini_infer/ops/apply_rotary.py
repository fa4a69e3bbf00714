"""`mini_infer::apply_rotary`: HF (neox-style) rotary position embedding applied to q or k.

Inserted by the FuseRotary pass in place of `x * cos + rotate_half(x) * sin`, where
`rotate_half(x) = cat(-x[..., d/2:], x[..., :d/2])`. cos/sin broadcast against x (HF: x [B, H, T, D],
often a transposed non-contiguous view; cos/sin [B, 1, T, D]). The output is a new contiguous tensor
of x's shape, dtype per torch promotion of x, cos and sin. Imports nothing from mini_infer outside
`mini_infer.ops`.
"""

from __future__ import annotations

import torch

from mini_infer.ops._triton_support import HAS_TRITON, next_pow2, tl, triton, use_triton

__all__ = ["apply_rotary", "apply_rotary_reference", "apply_rotary_triton", "launch_rows"]


def _out_dtype(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.dtype:
    return torch.promote_types(torch.promote_types(x.dtype, cos.dtype), sin.dtype)


def apply_rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Plain torch, exactly HF's `apply_rotary_pos_emb` for one tensor."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos + rotated * sin).contiguous()


if HAS_TRITON:

    @triton.jit
    def _rotary_kernel(
        x_ptr, cos_ptr, sin_ptr, out_ptr,
        n_rows, N1, N2, HALF,
        sx0, sx1, sx2, sx3, sc0, sc1, sc2, sc3, ss0, ss1, ss2, ss3, so0, so1, so2,
        BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
    ):  # fmt: skip
        # rows enumerate the three leading dims (i0, i1, i2) of the 4-D view; columns the first half of D
        rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        i2 = rows % N2
        i1 = (rows // N2) % N1
        i0 = rows // (N1 * N2)
        c = tl.arange(0, BLOCK_H)
        mask = (rows < n_rows)[:, None] & (c < HALF)[None, :]
        xo = (i0 * sx0 + i1 * sx1 + i2 * sx2)[:, None]
        co = (i0 * sc0 + i1 * sc1 + i2 * sc2)[:, None]
        so = (i0 * ss0 + i1 * ss1 + i2 * ss2)[:, None]
        oo = (i0 * so0 + i1 * so1 + i2 * so2)[:, None]
        lo = c[None, :]
        hi = c[None, :] + HALF
        x1 = tl.load(x_ptr + xo + lo * sx3, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + xo + hi * sx3, mask=mask, other=0.0).to(tl.float32)
        c1 = tl.load(cos_ptr + co + lo * sc3, mask=mask, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + co + hi * sc3, mask=mask, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + so + lo * ss3, mask=mask, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + so + hi * ss3, mask=mask, other=0.0).to(tl.float32)
        o1 = x1 * c1 - x2 * s1
        o2 = x2 * c2 + x1 * s2
        tl.store(out_ptr + oo + lo, o1.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(out_ptr + oo + hi, o2.to(out_ptr.dtype.element_ty), mask=mask)


def _as_4d(t: torch.Tensor) -> torch.Tensor:
    if t.dim() < 4:
        return t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))
    if t.dim() > 4:
        return t.reshape((-1,) + tuple(t.shape[-3:]))  # copies only when the leading dims do not merge
    return t


def launch_rows(kernel, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor, half: int) -> None:
    """Launch a rotary kernel with `_rotary_kernel`'s signature: programs over blocks of rows (x's leading dims,
    seen as three through a 4-D view), `half` columns each; cos/sin already expanded to their full shape."""
    x4, c4, s4 = _as_4d(x), _as_4d(cos), _as_4d(sin)
    o4 = out.view(x4.shape)
    n0, n1, n2, _ = x4.shape
    n_rows = n0 * n1 * n2
    block_h = next_pow2(half)
    block_r = max(1, min(64, 2048 // block_h))
    kernel[(triton.cdiv(n_rows, block_r),)](
        x4, c4, s4, o4, n_rows, n1, n2, half,
        *x4.stride(), *c4.stride(), *s4.stride(), *o4.stride()[:3],
        BLOCK_R=block_r, BLOCK_H=block_h, num_warps=4,
    )  # fmt: skip


def apply_rotary_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Triton rotary for any strides of x; cos/sin are broadcast (stride 0) to x's shape, never copied."""
    if not HAS_TRITON:
        raise RuntimeError("apply_rotary_triton needs triton")
    d = x.shape[-1]
    if d % 2:
        raise ValueError(f"apply_rotary: last dim {d} must be even")
    out = torch.empty(x.shape, dtype=_out_dtype(x, cos, sin), device=x.device)
    if x.numel() == 0:
        return out
    launch_rows(_rotary_kernel, x, cos.expand(x.shape), sin.expand(x.shape), out, d // 2)
    return out


@torch.library.custom_op("mini_infer::apply_rotary", mutates_args=())
def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x * cos + rotate_half(x) * sin`: Triton on CUDA when available, else the torch reference."""
    if use_triton(x):
        return apply_rotary_triton(x, cos, sin)
    return apply_rotary_reference(x, cos, sin)


@apply_rotary.register_fake
def _(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape, dtype=_out_dtype(x, cos, sin))
