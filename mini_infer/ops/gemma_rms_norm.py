"""`mini_infer::gemma_rms_norm` and `mini_infer::fused_add_gemma_rms_norm`: Gemma's RMSNorm, numerically identical to
HF `Gemma2RMSNorm` (also Gemma's and Gemma 3's).

Inserted by the FuseGemmaRMSNorm pass in place of Gemma's norm sub-graph. Semantics (must not change):
`h = x.float(); h = h * rsqrt(mean(h**2, -1) + eps); return (h * (1 + weight.float())).to(x.dtype)` — unlike
Llama's norm (ops/rms_norm.py) the weight is `1 + weight` and multiplies in fp32, before the cast. The fused form
first rounds `s = x + residual` to the sum's dtype, as torch's add stores it, and returns (norm(s), s). The Triton
kernel is rms_norm.py's, its row body's GEMMA weighting switched on, so a row sums in the same order. Imports
nothing from mini_infer outside `mini_infer.ops`.
"""

from __future__ import annotations

import torch

from mini_infer.ops._triton_support import HAS_TRITON, use_triton
from mini_infer.ops.rms_norm import _launch_rms_norm

__all__ = ["fused_add_gemma_rms_norm", "fused_add_gemma_rms_norm_reference", "fused_add_gemma_rms_norm_triton",
           "gemma_rms_norm", "gemma_rms_norm_reference", "gemma_rms_norm_triton"]


def gemma_rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain torch, exactly HF Gemma2RMSNorm.forward."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).type_as(x)


def fused_add_gemma_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    s = x + residual
    return gemma_rms_norm_reference(s, weight, eps), s


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, out: torch.Tensor,
            s: torch.Tensor | None) -> None:
    if not HAS_TRITON:
        raise RuntimeError("gemma_rms_norm_triton needs triton")
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"gemma_rms_norm: weight {tuple(weight.shape)} does not match last dim of x "
                         f"{tuple(x.shape)}")
    _launch_rms_norm(x, residual, weight, eps, out, s, gemma=True)


def gemma_rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton Gemma RMSNorm (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1)."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, None, weight, eps, out, None)
    return out


def fused_add_gemma_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `(gemma_rms_norm(x + residual), x + residual)` in one launch."""
    if x.shape != residual.shape:
        raise ValueError(f"fused_add_gemma_rms_norm: x {tuple(x.shape)} and residual {tuple(residual.shape)} differ")
    s = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
    out = torch.empty(x.shape, dtype=s.dtype, device=x.device)
    _launch(x, residual, weight, eps, out, s)
    return out, s


@torch.library.custom_op("mini_infer::gemma_rms_norm", mutates_args=())
def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Gemma2RMSNorm: Triton on CUDA when available, else the torch reference."""
    if use_triton(x):
        return gemma_rms_norm_triton(x, weight, eps)
    return gemma_rms_norm_reference(x, weight, eps)


@gemma_rms_norm.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x.new_empty(x.shape)


@torch.library.custom_op("mini_infer::fused_add_gemma_rms_norm", mutates_args=())
def fused_add_gemma_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """s = x + residual; (HF Gemma2RMSNorm(s), s): Triton on CUDA when available, else the torch reference."""
    if use_triton(x):
        return fused_add_gemma_rms_norm_triton(x, residual, weight, eps)
    return fused_add_gemma_rms_norm_reference(x, residual, weight, eps)


@fused_add_gemma_rms_norm.register_fake
def _(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    dt = torch.promote_types(x.dtype, residual.dtype)
    return x.new_empty(x.shape, dtype=dt), x.new_empty(x.shape, dtype=dt)
