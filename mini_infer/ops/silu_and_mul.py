"""`mini_infer::silu_and_mul`: the gated-MLP activation `silu(gate) * up`.

Inserted by a fusion pass in place of `act_fn(gate_proj(x)) * up_proj(x)` (SiLU-gated MLPs). gate and
up have the same shape; they may be views into one fused gate_up projection (row stride != width).
The output is new and contiguous, dtype per torch promotion. Imports nothing from mini_infer outside
`mini_infer.ops`.

Also the launch that gated activations of this shape share (`gated_mul_triton`: one kernel whose activation is a
jit function, gelu_tanh_and_mul.py's too); what is SiLU-specific stays here, another activation's math does not.
"""

from __future__ import annotations

from typing import Any

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

__all__ = ["gated_mul_fake", "gated_mul_triton", "silu_and_mul", "silu_and_mul_reference", "silu_and_mul_triton"]


def silu_and_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up


if HAS_TRITON:

    @triton.jit
    def silu_mul(g, u):
        """silu(g) * u of fp32 values, in fp32 (the kernel's math; also rms_norm_linear_silu.py's epilogue)."""
        return g * tl.sigmoid(g) * u

    @triton.jit
    def silu_mul_load(g_ptrs, u_ptrs, mask):
        """silu(gate) * up at the given pointers, in fp32 (zero where `mask` is off), before the rounding to the
        output dtype; also the activation prologue of silu_mul_linear.py's GEMV, so both round the same value."""
        g = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptrs, mask=mask, other=0.0).to(tl.float32)
        return silu_mul(g, u)

    @triton.jit
    def _gated_mul_kernel(
        g_ptr, u_ptr, out_ptr, n_cols, stride_g, stride_u, stride_o, ACT: tl.constexpr, BLOCK: tl.constexpr,
        USE_GDC: tl.constexpr,
    ):  # fmt: skip
        """BLOCK columns of one row of a gated activation `ACT(gate, up)`: ACT is a jit function (g_ptrs, u_ptrs,
        mask) -> the fp32 values to round to the output dtype (`silu_mul_load`; gelu_tanh_and_mul.py's)."""
        await_producers(USE_GDC)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        out = ACT(g_ptr + row * stride_g + cols, u_ptr + row * stride_u + cols, mask)
        tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor, n_cols: int) -> torch.Tensor:
    t2 = t.reshape(-1, n_cols)
    return t2 if t2.stride(-1) == 1 or n_cols == 1 else t2.contiguous()


def gated_mul_triton(act: Any, gate: torch.Tensor, up: torch.Tensor, op: str) -> torch.Tensor:
    """The gated activation `act(gate, up)` of op `op` by `_gated_mul_kernel` (`act`: its ACT): gate and up of one
    shape, rows of any stride (views into a merged gate_up output), the output new and contiguous, dtype per torch
    promotion; one launch."""
    if gate.shape != up.shape:
        raise ValueError(f"{op}: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    out = torch.empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype), device=gate.device)
    if gate.numel() == 0:
        return out
    n_cols = gate.shape[-1] if gate.dim() else 1
    g2, u2, o2 = _rows(gate, n_cols), _rows(up, n_cols), out.view(-1, n_cols)
    block = min(1024, next_pow2(n_cols))
    grid = (g2.shape[0], triton.cdiv(n_cols, block))
    _gated_mul_kernel[grid](g2, u2, o2, n_cols, g2.stride(0), u2.stride(0), o2.stride(0), ACT=act, BLOCK=block,
                            num_warps=4, **pdl_args(g2))
    return out


def silu_and_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Triton `silu(gate) * up` (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1)."""
    if not HAS_TRITON:
        raise RuntimeError("silu_and_mul_triton needs triton")
    return gated_mul_triton(silu_mul_load, gate, up, "silu_and_mul")


@torch.library.custom_op("mini_infer::silu_and_mul", mutates_args=())
def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up`: Triton on CUDA when available, else the torch reference."""
    if use_triton(gate):
        return silu_and_mul_triton(gate, up)
    return silu_and_mul_reference(gate, up)


def gated_mul_fake(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The fake impl of a gated activation op (gelu_tanh_and_mul's too): gate's shape, dtype per torch promotion."""
    return gate.new_empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype))


silu_and_mul.register_fake(gated_mul_fake)
