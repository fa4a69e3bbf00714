"""`mini_infer::qk_rotary`: the per-head RMSNorms (optional) and HF rotary of one attention's q and k, in one launch.

Inserted by the FuseQKRotary pass in place of a layer's `apply_rotary(q)` and `apply_rotary(k)` (sharing cos/sin)
and, for Qwen3-style models, the `rms_norm` of each head (q_norm / k_norm) feeding them. Semantics (must not
change), for x in (q, k) with its norm weight w (None: no norm):
`x = rms_norm_reference(x, w, eps)` (HF Qwen3RMSNorm: fp32 variance, the normalized value cast back to x's dtype,
then `w *` it with torch promotion) if w is given, then `x * cos + rotate_half(x) * sin` (`apply_rotary`).
Layouts: q [B, Hq, T, D] and k [B, Hk, T, D] (any strides: HF's transposed views), cos/sin broadcastable to
[B, 1, T, D] (one angle set for every head), D even. Returns (q_out, k_out), new contiguous tensors of q's and
k's shapes, each in the dtype torch promotion gives the unfused ops. The Triton kernel is one grid over the rows
(b, head, t) of q then of k, each program running `_rotary.rotate_rows` (the rotary kernel's body, with the norm
of rms_norm.py's row helpers). Imports nothing from mini_infer outside `mini_infer.ops`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mini_infer.ops._rotary import rotary_blocks
from mini_infer.ops._triton_support import HAS_TRITON, await_producers, pdl_args, tl, triton, use_triton
from mini_infer.ops.apply_rotary import apply_rotary_reference
from mini_infer.ops.rms_norm import rms_norm_reference

__all__ = ["qk_rotary", "qk_rotary_reference", "qk_rotary_triton"]


def _out_dtype(x: torch.Tensor, weight: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor) -> torch.dtype:
    normed = x.dtype if weight is None else torch.promote_types(weight.dtype, x.dtype)
    return torch.promote_types(torch.promote_types(normed, cos.dtype), sin.dtype)


def qk_rotary_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Plain torch: HF's q_norm / k_norm (when given), then HF's `apply_rotary_pos_emb`."""
    if q_weight is not None:
        q = rms_norm_reference(q, q_weight, eps)
    if k_weight is not None:
        k = rms_norm_reference(k, k_weight, eps)
    return apply_rotary_reference(q, cos, sin), apply_rotary_reference(k, cos, sin)


if HAS_TRITON:
    from mini_infer.ops._rotary import rotate_rows

    @triton.jit
    def _qk_rotary_kernel(
        q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, qw_ptr, kw_ptr,
        q_blocks, n_q_rows, n_k_rows, HQ, HK, T, HALF, eps,
        sq0, sq1, sq2, sq3, sk0, sk1, sk2, sk3, sc0, sc2, sc3, ss0, ss2, ss3, sqo0, sqo1, sqo2, sko0, sko1, sko2,
        BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, HAS_Q_NORM: tl.constexpr, HAS_K_NORM: tl.constexpr, USE_GDC: tl.constexpr,
    ):  # fmt: skip
        await_producers(USE_GDC)
        # programs [0, q_blocks) take q's rows (b, h, t), the rest k's; cos/sin have no head stride
        pid = tl.program_id(0)
        if pid < q_blocks:
            rotate_rows(q_ptr, cos_ptr, sin_ptr, qo_ptr, qw_ptr, pid, n_q_rows, HQ, T, HALF, eps,
                        sq0, sq1, sq2, sq3, sc0, 0, sc2, sc3, ss0, 0, ss2, ss3, sqo0, sqo1, sqo2,
                        BLOCK_R, BLOCK_H, False, HAS_Q_NORM)
        else:
            rotate_rows(k_ptr, cos_ptr, sin_ptr, ko_ptr, kw_ptr, pid - q_blocks, n_k_rows, HK, T, HALF, eps,
                        sk0, sk1, sk2, sk3, sc0, 0, sc2, sc3, ss0, 0, ss2, ss3, sko0, sko1, sko2,
                        BLOCK_R, BLOCK_H, False, HAS_K_NORM)


def _check(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None) -> None:
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"qk_rotary: q and k must be [B, H, T, D], got {tuple(q.shape)} and {tuple(k.shape)}")
    b, _, t, d = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (b, t, d) or d % 2:
        raise ValueError(f"qk_rotary: q {tuple(q.shape)} and k {tuple(k.shape)} must share B, T and an even D")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w is not None and tuple(w.shape) != (d,):
            raise ValueError(f"qk_rotary: {name} {tuple(w.shape)} does not match head dim {d}")


class RotaryLaunch(NamedTuple):
    """What a kernel over q's then k's rows (qk_rotary's grid) is launched with."""

    n_q_rows: int
    n_k_rows: int
    cos: torch.Tensor  # cos / sin broadcast to [B, 1, T, D] (stride 0 where they were broadcast; never copied)
    sin: torch.Tensor
    q_weight: torch.Tensor  # the norm weights, contiguous (q / k themselves, unread, without a norm)
    k_weight: torch.Tensor
    block_r: int
    block_h: int
    q_blocks: int  # programs [0, q_blocks) take q's rows, the rest k's
    grid: tuple[int]


def rotary_launch(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  q_weight: torch.Tensor | None, k_weight: torch.Tensor | None) -> RotaryLaunch:
    """The launch of a kernel over q's rows then k's ([B, H, T, D] each), one `_rotary.rotate_rows` tile a program."""
    b, hq, t, d = q.shape
    n_q_rows, n_k_rows = b * hq * t, b * k.shape[1] * t
    block_r, block_h = rotary_blocks(d // 2)
    q_blocks = triton.cdiv(n_q_rows, block_r)
    return RotaryLaunch(
        n_q_rows, n_k_rows, cos.expand(b, 1, t, d), sin.expand(b, 1, t, d),
        q_weight.contiguous() if q_weight is not None else q, k_weight.contiguous() if k_weight is not None else k,
        block_r, block_h, q_blocks, (q_blocks + triton.cdiv(n_k_rows, block_r),),
    )  # fmt: skip


def qk_rotary_triton(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One Triton launch for both: any strides of q and k; cos/sin are broadcast (stride 0), never copied."""
    if not HAS_TRITON:
        raise RuntimeError("qk_rotary_triton needs triton")
    _check(q, k, q_weight, k_weight)
    q_out = torch.empty(q.shape, dtype=_out_dtype(q, q_weight, cos, sin), device=q.device)
    k_out = torch.empty(k.shape, dtype=_out_dtype(k, k_weight, cos, sin), device=k.device)
    _, hq, t, d = q.shape
    if q.numel() + k.numel() == 0:
        return q_out, k_out
    ln = rotary_launch(q, k, cos, sin, q_weight, k_weight)
    c4, s4 = ln.cos, ln.sin
    _qk_rotary_kernel[ln.grid](
        q, k, c4, s4, q_out, k_out, ln.q_weight, ln.k_weight,
        ln.q_blocks, ln.n_q_rows, ln.n_k_rows, hq, k.shape[1], t, d // 2, float(eps),
        *q.stride(), *k.stride(), c4.stride(0), c4.stride(2), c4.stride(3), s4.stride(0), s4.stride(2), s4.stride(3),
        *q_out.stride()[:3], *k_out.stride()[:3],
        BLOCK_R=ln.block_r, BLOCK_H=ln.block_h, HAS_Q_NORM=q_weight is not None, HAS_K_NORM=k_weight is not None,
        num_warps=4, **pdl_args(q),
    )  # fmt: skip
    return q_out, k_out


@torch.library.custom_op("mini_infer::qk_rotary", mutates_args=())
def qk_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """q/k head norms (when given) then rotary: Triton on CUDA when available, else the torch reference."""
    if use_triton(q):
        return qk_rotary_triton(q, k, cos, sin, q_weight, k_weight, eps)
    return qk_rotary_reference(q, k, cos, sin, q_weight, k_weight, eps)


@qk_rotary.register_fake
def _(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    return (q.new_empty(q.shape, dtype=_out_dtype(q, q_weight, cos, sin)),
            k.new_empty(k.shape, dtype=_out_dtype(k, k_weight, cos, sin)))
