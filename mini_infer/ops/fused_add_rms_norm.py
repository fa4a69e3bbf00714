"""`mini_infer::fused_add_rms_norm`: residual add followed by RMSNorm, in one pass over memory.

Inserted by the FuseRMSNorm pass where a residual add feeds an RMSNorm. Semantics (must not change):
`s = x + residual` (torch promotion); returns `(rms_norm(s, weight, eps), s)`. Functional: it never
writes into its inputs. Imports nothing from mini_infer outside `mini_infer.ops`.
"""

from __future__ import annotations

import torch

from mini_infer.ops._triton_support import HAS_TRITON, use_triton
from mini_infer.ops.rms_norm import _launch_rms_norm, rms_norm_reference

__all__ = ["fused_add_rms_norm", "fused_add_rms_norm_reference", "fused_add_rms_norm_triton"]


def fused_add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    s = x + residual
    return rms_norm_reference(s, weight, eps), s


def fused_add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton add + RMSNorm (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1)."""
    if not HAS_TRITON:
        raise RuntimeError("fused_add_rms_norm_triton needs triton")
    if x.shape != residual.shape:
        raise ValueError(f"fused_add_rms_norm: x {tuple(x.shape)} and residual {tuple(residual.shape)} differ")
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"fused_add_rms_norm: weight {tuple(weight.shape)} does not match x {tuple(x.shape)}")
    s_dtype = torch.promote_types(x.dtype, residual.dtype)
    s = torch.empty(x.shape, dtype=s_dtype, device=x.device)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, s_dtype), device=x.device)
    _launch_rms_norm(x, residual, weight, eps, out, s)
    return out, s


@torch.library.custom_op("mini_infer::fused_add_rms_norm", mutates_args=())
def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`s = x + residual; return rms_norm(s), s`: Triton on CUDA when available, else the torch reference."""
    if use_triton(x):
        return fused_add_rms_norm_triton(x, residual, weight, eps)
    return fused_add_rms_norm_reference(x, residual, weight, eps)


@fused_add_rms_norm.register_fake
def _(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    s_dtype = torch.promote_types(x.dtype, residual.dtype)
    s = x.new_empty(x.shape, dtype=s_dtype)
    return x.new_empty(x.shape, dtype=torch.promote_types(weight.dtype, s_dtype)), s
