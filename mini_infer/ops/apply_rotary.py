"""`mini_infer::apply_rotary`: HF (neox-style) rotary position embedding applied to q or k.

Inserted by the FuseRotary pass in place of `x * cos + rotate_half(x) * sin`, where
`rotate_half(x) = cat(-x[..., d/2:], x[..., :d/2])`. cos/sin broadcast against x (HF: x [B, H, T, D],
often a transposed non-contiguous view; cos/sin [B, 1, T, D]). The output is a new contiguous tensor
of x's shape, dtype per torch promotion of x, cos and sin. The Triton kernel is `_rotary`'s, shared with
`apply_rotary_interleaved`. Imports nothing from mini_infer outside `mini_infer.ops`.
"""

from __future__ import annotations

import torch

from mini_infer.ops._rotary import launch_rotary
from mini_infer.ops._triton_support import HAS_TRITON, use_triton

__all__ = ["apply_rotary", "apply_rotary_reference", "apply_rotary_triton"]


def _out_dtype(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.dtype:
    return torch.promote_types(torch.promote_types(x.dtype, cos.dtype), sin.dtype)


def apply_rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Plain torch, exactly HF's `apply_rotary_pos_emb` for one tensor."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos + rotated * sin).contiguous()


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
    launch_rotary(x, cos.expand(x.shape), sin.expand(x.shape), out, interleaved=False)
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
