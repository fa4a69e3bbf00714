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
(`rotate_half`) is `apply_rotary`'s. Imports nothing from mini_infer outside `mini_infer.ops`.
"""

from __future__ import annotations

import torch

from mini_infer.ops._triton_support import HAS_TRITON, tl, triton, use_triton
from mini_infer.ops.apply_rotary import launch_rows

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


if HAS_TRITON:

    @triton.jit
    def _rotary_interleaved_kernel(
        x_ptr, cos_ptr, sin_ptr, out_ptr,
        n_rows, N1, N2, HALF,
        sx0, sx1, sx2, sx3, sc0, sc1, sc2, sc3, ss0, ss1, ss2, ss3, so0, so1, so2,
        BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
    ):  # fmt: skip
        # rows enumerate the three leading dims (i0, i1, i2) of the 4-D view; columns the pairs
        rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        i2 = rows % N2
        i1 = (rows // N2) % N1
        i0 = rows // (N1 * N2)
        p = tl.arange(0, BLOCK_H)
        mask = (rows < n_rows)[:, None] & (p < HALF)[None, :]
        xo = (i0 * sx0 + i1 * sx1 + i2 * sx2)[:, None]
        co = (i0 * sc0 + i1 * sc1 + i2 * sc2)[:, None] + p[None, :] * sc3
        so = (i0 * ss0 + i1 * ss1 + i2 * ss2)[:, None] + p[None, :] * ss3
        oo = (i0 * so0 + i1 * so1 + i2 * so2)[:, None]
        even = 2 * p[None, :]
        x1 = tl.load(x_ptr + xo + even * sx3, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + xo + (even + 1) * sx3, mask=mask, other=0.0).to(tl.float32)
        c = tl.load(cos_ptr + co, mask=mask, other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + so, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + oo + even, (x1 * c - x2 * s).to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(out_ptr + oo + even + 1, (x2 * c + x1 * s).to(out_ptr.dtype.element_ty), mask=mask)


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
    launch_rows(_rotary_interleaved_kernel, x, cos.expand(half), sin.expand(half), out, d // 2)
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
