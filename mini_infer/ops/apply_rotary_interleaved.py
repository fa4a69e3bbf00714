"""`mini_infer::apply_rotary_interleaved`: GPT-J style (interleaved) rotary position embedding on q or k.

DeepSeek-V2/V3 rotate the rotary part of q and k in adjacent pairs: pair i is (x[2i], x[2i+1]), turned by one
angle per pair. HF's DeepSeek-V2 writes it as a complex product (`view_as_complex(x.reshape(.., D/2, 2)) *
freqs_cis`), DeepSeek-V3 (`rope_interleave=True`) as even/odd slices whose results it concatenates
de-interleaved. This op keeps the pairs where they are (the complex form's layout):

    out[..., 2i]   = x[..., 2i] * cos[..., i] - x[..., 2i+1] * sin[..., i]
    out[..., 2i+1] = x[..., 2i+1] * cos[..., i] + x[..., 2i] * sin[..., i]

x is [..., D] (D even, any strides); cos/sin are [..., D/2], one angle per pair, broadcasting against
x[..., :D/2] (e.g. x [T, H, D] with cos [T, 1, D/2]). Computed in fp32; the output is a new contiguous tensor
of x's shape and dtype (as HF's `type_as(x)`). Inserted by the `mla_latent_cache` pass; the neox layout
(`rotate_half`) is `apply_rotary`'s; both run `_rotary`'s Triton kernel. Imports nothing from mini_infer
outside `mini_infer.ops`.
"""

from __future__ import annotations

import torch

from mini_infer.ops._rotary import launch_rotary
from mini_infer.ops._triton_support import HAS_TRITON, use_triton

__all__ = ["apply_rotary_interleaved", "apply_rotary_interleaved_reference", "apply_rotary_interleaved_triton"]


def _check(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """ValueError unless D is even and cos/sin broadcast to x[..., :D/2] without growing it (symbolic sizes are
    not compared: no guards under torch.export)."""
    d = x.shape[-1]
    if d % 2:
        raise ValueError(f"apply_rotary_interleaved: last dim of x is {d}, must be even (pairs)")
    half = (*x.shape[:-1], d // 2)
    for name, t in (("cos", cos), ("sin", sin)):
        fits = t.dim() <= len(half) and all(
            not (isinstance(a, int) and isinstance(b, int)) or a in (1, b)
            for a, b in zip(reversed(tuple(t.shape)), reversed(half))
        )
        if not fits:
            raise ValueError(f"apply_rotary_interleaved: {name} has shape {tuple(t.shape)}, which does not "
                             f"broadcast to x[..., :D/2] {tuple(half)} (one angle per pair)")


def apply_rotary_interleaved_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Plain torch: rotate the pairs (x[2i], x[2i+1]) in fp32, return x's dtype, contiguous."""
    _check(x, cos, sin)
    xf = x.float()
    x1, x2 = xf[..., 0::2], xf[..., 1::2]
    c, s = cos.float(), sin.float()
    out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    return out.to(x.dtype).contiguous()


def apply_rotary_interleaved_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Triton rotary over pairs for any strides of x; cos/sin are broadcast (stride 0), never copied."""
    if not HAS_TRITON:
        raise RuntimeError("apply_rotary_interleaved_triton needs triton")
    _check(x, cos, sin)
    d = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    half = (*x.shape[:-1], d // 2)
    launch_rotary(x, cos.expand(half), sin.expand(half), out, interleaved=True)
    return out


@torch.library.custom_op("mini_infer::apply_rotary_interleaved", mutates_args=())
def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved (GPT-J style) rotary: Triton on CUDA when available, else the torch reference."""
    if use_triton(x):
        return apply_rotary_interleaved_triton(x, cos, sin)
    return apply_rotary_interleaved_reference(x, cos, sin)


@apply_rotary_interleaved.register_fake
def _(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    _check(x, cos, sin)
    return x.new_empty(x.shape)
