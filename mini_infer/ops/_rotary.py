"""The Triton rotary kernel and its launcher, shared by `apply_rotary` (neox layout) and `apply_rotary_interleaved`;
its row body `rotate_rows` (an @triton.jit helper, with an optional RMSNorm of each row first) is also the body of
`qk_rotary`'s kernel, and its math, `rotated_rows` (the rotated rows, not stored), that of `qk_rotary_kv_write`'s
k rows, which go to the paged cache; `rotated_pairs`, that math over rows given by their offsets, is what
paged_attention's decode kernel applies to its q rows and new k rows (`rotary_paged_attention`).

One kernel body rotates pairs of x's last dim; the INTERLEAVED constexpr picks which elements pair up and which
cos/sin column each pair reads:
  * neox (`rotate_half`): pair c is (x[c], x[c + D/2]); cos/sin span the whole D, each half reads its own column.
  * interleaved (GPT-J): pair c is (x[2c], x[2c+1]); cos/sin hold one angle per pair, column c.
Either way out[first] = x1 * cos - x2 * sin and out[second] = x2 * cos + x1 * sin, in fp32. This module checks
no shapes and knows nothing of the ops' reference paths or registration: the op modules do that.
"""

from __future__ import annotations

import torch

from mini_infer.ops._triton_support import HAS_TRITON, await_producers, next_pow2, pdl_args, tl, triton

__all__ = ["launch_rotary", "rotary_blocks"]

if HAS_TRITON:
    from mini_infer.ops.rms_norm import rms_inverse, weighted_norm

    @triton.jit
    def normed(x, inv_rms, w_ptr, cols, w_ok, x_dtype: tl.constexpr):
        """x (fp32) RMS-normalized by `inv_rms` and weighted by the norm weight's columns `cols` (`weighted_norm`),
        rounded to x's dtype when the weight has it (else promote(x, w) is fp32: no rounding), in fp32."""
        y = weighted_norm(x, inv_rms, tl.load(w_ptr + cols, mask=w_ok, other=0.0).to(tl.float32), x_dtype)
        if w_ptr.dtype.element_ty == x_dtype:
            y = y.to(x_dtype).to(tl.float32)
        return y

    @triton.jit
    def rotated_pairs(
        x_ptr, xo, sx3, cos_ptr, co, sc3, sin_ptr, so, ss3, w_ptr, row_ok, HALF, eps,
        BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_NORM: tl.constexpr,
    ):  # fmt: skip
        """The rotation (and optional RMSNorm) of a block of rows given by their offsets: row i of x starts at
        `x_ptr + xo[i]`, its cos / sin rows at `cos_ptr + co[i]` / `sin_ptr + so[i]` (xo, co, so [BLOCK_R, 1] int64;
        column strides sx3, sc3, ss3), rows where not `row_ok` [BLOCK_R] read as zeros. The math of `rotated_rows`
        (which calls it), for kernels that index their rows another way (paged_attention's decode tiles). Returns
        (first, second: the pairs' columns, [1, BLOCK_H]; mask [BLOCK_R, BLOCK_H]; o1, o2: fp32 [BLOCK_R, BLOCK_H])."""
        p = tl.arange(0, BLOCK_H)
        mask = row_ok[:, None] & (p < HALF)[None, :]
        if INTERLEAVED:  # pair p: (x[2p], x[2p+1])
            first = 2 * p[None, :]
            second = first + 1
        else:  # pair p: (x[p], x[p + HALF])
            first = p[None, :]
            second = first + HALF
        x1 = tl.load(x_ptr + xo + first * sx3, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + xo + second * sx3, mask=mask, other=0.0).to(tl.float32)
        if HAS_NORM:
            x_dtype = x_ptr.dtype.element_ty
            inv_rms = rms_inverse(tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1), 2 * HALF, eps)[:, None]
            w_ok = (p < HALF)[None, :]
            x1 = normed(x1, inv_rms, w_ptr, first, w_ok, x_dtype)
            x2 = normed(x2, inv_rms, w_ptr, second, w_ok, x_dtype)
        if INTERLEAVED:  # one angle per pair, column p
            c1 = tl.load(cos_ptr + (co + p[None, :] * sc3), mask=mask, other=0.0).to(tl.float32)
            s1 = tl.load(sin_ptr + (so + p[None, :] * ss3), mask=mask, other=0.0).to(tl.float32)
            c2 = c1
            s2 = s1
        else:  # cos/sin span D: each element of the pair reads its own column
            c1 = tl.load(cos_ptr + co + first * sc3, mask=mask, other=0.0).to(tl.float32)
            c2 = tl.load(cos_ptr + co + second * sc3, mask=mask, other=0.0).to(tl.float32)
            s1 = tl.load(sin_ptr + so + first * ss3, mask=mask, other=0.0).to(tl.float32)
            s2 = tl.load(sin_ptr + so + second * ss3, mask=mask, other=0.0).to(tl.float32)
        o1 = x1 * c1 - x2 * s1
        o2 = x2 * c2 + x1 * s2
        return first, second, mask, o1, o2

    @triton.jit
    def rotated_rows(
        x_ptr, cos_ptr, sin_ptr, w_ptr, row_block, n_rows, N1, N2, HALF, eps,
        sx0, sx1, sx2, sx3, sc0, sc1, sc2, sc3, ss0, ss1, ss2, ss3,
        BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_NORM: tl.constexpr,
    ):  # fmt: skip
        """Block `row_block` of BLOCK_R rows of x, rotated (fp32, not stored); with HAS_NORM, RMSNorm each row first
        (weight at `w_ptr`, over its 2 * HALF elements), rounded where HF's norm rounds (rms_norm.py's
        `weighted_norm`) and to the norm's output dtype, promote(x, w), before the rotation reads it. Returns
        (i0, i1, i2: each row's indices in the 4-D view, [BLOCK_R] int64; first, second: the pairs' columns,
        [1, BLOCK_H]; mask [BLOCK_R, BLOCK_H]; o1, o2: the rotated pairs, fp32 [BLOCK_R, BLOCK_H])."""
        # rows enumerate the three leading dims (i0, i1, i2) of the 4-D view; columns the HALF pairs
        rows = (row_block * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        i2 = rows % N2
        i1 = (rows // N2) % N1
        i0 = rows // (N1 * N2)
        xo = (i0 * sx0 + i1 * sx1 + i2 * sx2)[:, None]
        co = (i0 * sc0 + i1 * sc1 + i2 * sc2)[:, None]
        so = (i0 * ss0 + i1 * ss1 + i2 * ss2)[:, None]
        first, second, mask, o1, o2 = rotated_pairs(x_ptr, xo, sx3, cos_ptr, co, sc3, sin_ptr, so, ss3, w_ptr,
                                                    rows < n_rows, HALF, eps, BLOCK_H, INTERLEAVED, HAS_NORM)
        return i0, i1, i2, first, second, mask, o1, o2

    @triton.jit
    def rotate_rows(
        x_ptr, cos_ptr, sin_ptr, out_ptr, w_ptr, row_block, n_rows, N1, N2, HALF, eps,
        sx0, sx1, sx2, sx3, sc0, sc1, sc2, sc3, ss0, ss1, ss2, ss3, so0, so1, so2,
        BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr, HAS_NORM: tl.constexpr,
    ):  # fmt: skip
        """`rotated_rows`' block stored into out (strides so0..so2 over the three leading dims, unit last)."""
        i0, i1, i2, first, second, mask, o1, o2 = rotated_rows(
            x_ptr, cos_ptr, sin_ptr, w_ptr, row_block, n_rows, N1, N2, HALF, eps,
            sx0, sx1, sx2, sx3, sc0, sc1, sc2, sc3, ss0, ss1, ss2, ss3, BLOCK_R, BLOCK_H, INTERLEAVED, HAS_NORM)
        oo = (i0 * so0 + i1 * so1 + i2 * so2)[:, None]
        tl.store(out_ptr + oo + first, o1.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(out_ptr + oo + second, o2.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rotary_kernel(
        x_ptr, cos_ptr, sin_ptr, out_ptr,
        n_rows, N1, N2, HALF,
        sx0, sx1, sx2, sx3, sc0, sc1, sc2, sc3, ss0, ss1, ss2, ss3, so0, so1, so2,
        BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr, USE_GDC: tl.constexpr,
    ):  # fmt: skip
        await_producers(USE_GDC)
        rotate_rows(x_ptr, cos_ptr, sin_ptr, out_ptr, x_ptr, tl.program_id(0), n_rows, N1, N2, HALF, 0.0,
                    sx0, sx1, sx2, sx3, sc0, sc1, sc2, sc3, ss0, ss1, ss2, ss3, so0, so1, so2,
                    BLOCK_R, BLOCK_H, INTERLEAVED, False)


def _as_4d(t: torch.Tensor) -> torch.Tensor:
    if t.dim() < 4:
        return t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))
    if t.dim() > 4:
        return t.reshape((-1,) + tuple(t.shape[-3:]))  # copies only when the leading dims do not merge
    return t


def rotary_blocks(half: int) -> tuple[int, int]:
    """(BLOCK_R rows, BLOCK_H pairs) of one program of `rotate_rows` for D/2 = `half` pairs per row."""
    block_h = next_pow2(half)
    return max(1, min(64, 2048 // block_h)), block_h


def launch_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor, interleaved: bool
) -> None:  # fmt: skip
    """Rotate x [..., D] (any strides, D even, numel > 0) into out (contiguous, x's shape): programs over blocks
    of rows (x's leading dims, seen as three through a 4-D view), D/2 pairs each. cos/sin are already expanded
    (stride 0 where they broadcast) to x's shape (neox) or to x[..., :D/2]'s (interleaved)."""
    half = x.shape[-1] // 2
    x4, c4, s4 = _as_4d(x), _as_4d(cos), _as_4d(sin)
    o4 = out.view(x4.shape)
    n0, n1, n2, _ = x4.shape
    n_rows = n0 * n1 * n2
    block_r, block_h = rotary_blocks(half)
    _rotary_kernel[(triton.cdiv(n_rows, block_r),)](
        x4, c4, s4, o4, n_rows, n1, n2, half,
        *x4.stride(), *c4.stride(), *s4.stride(), *o4.stride()[:3],
        BLOCK_R=block_r, BLOCK_H=block_h, INTERLEAVED=interleaved, num_warps=4, **pdl_args(x4),
    )  # fmt: skip
