"""`mini_infer::gelu_tanh_and_mul`: the GeLU-tanh gated-MLP activation `gelu(gate, approximate="tanh") * up`.

Inserted by the FuseGeluMul pass in place of `act_fn(gate_proj(x)) * up_proj(x)` where act_fn is transformers'
`gelu_pytorch_tanh` (Gemma, Gemma 2, Gemma 3): `torch.nn.functional.gelu(x, approximate="tanh")`, captured as
`aten.gelu(x, approximate='tanh')`. gate and up have the same shape; they may be views into one merged gate_up
projection (row stride != width). The output is new and contiguous, dtype per torch promotion.

Roundings, as the captured pair rounds: the gelu is computed in fp32 and rounded to gate's dtype (torch's gelu on
bf16 / fp16 computes in fp32 and rounds its result), then multiplied by up in fp32 and rounded to the output dtype.
The reference is those two torch ops, so it equals the captured graph bit for bit. The Triton kernel computes the
gelu in torch's order (0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3))), fp32 constants) with a tanh of its
own (from one exp: no libdevice, which the interpreter lacks), then the same two roundings. Not bit-equal: against
torch's CPU gelu under the interpreter 90% of fp32 values are equal and the rest within a few ulps (max |diff|
under 1e-6 for gates of N(0, 3)); 99.7% of fp16 values are equal (the rest one fp16 ulp: a gelu near a rounding
boundary). Under the interpreter casts to bf16 truncate instead of rounding, so bf16 is checked within bf16's
tolerance there. On a GPU (tl.exp is an approximate exp2 there; torch's CUDA gelu uses tanhf) it has not been
measured.

Must not: match or know of any other activation (plain erf GeLU is another function), or import anything from
mini_infer outside `mini_infer.ops`. The launch and the fake impl are silu_and_mul.py's (`gated_mul_triton`, `gated_mul_fake`); only the math is here.
"""

from __future__ import annotations

import torch

from mini_infer.ops._triton_support import HAS_TRITON, tl, triton, use_triton
from mini_infer.ops.silu_and_mul import gated_mul_fake, gated_mul_triton

__all__ = ["gelu_tanh_and_mul", "gelu_tanh_and_mul_reference", "gelu_tanh_and_mul_triton"]


def gelu_tanh_and_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


if HAS_TRITON:
    SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)  # torch's kBeta, M_SQRT2 * M_2_SQRTPI * 0.5, fp32 in the math
    KAPPA = tl.constexpr(0.044715)

    @triton.jit
    def gelu_tanh(x):
        """torch's gelu(x, approximate="tanh") of fp32 values, in fp32 and torch's order. tanh(z) as
        sign(z) (1 - 2e / (1 + e)), e = exp(-2|z|): never overflows (NaN stays NaN, +-inf gives +-1), and near
        |tanh| = 1 (x << 0, where 1 + tanh cancels) it rounds as a correctly rounded tanh does, so the tail's
        quantization is torch's too ((1 - e) / (1 + e) rounds three times there: 72% of fp32 values equal to
        torch's instead of 90%, 96% of fp16 ones instead of 99.7%)."""
        z = SQRT_2_OVER_PI * (x + KAPPA * (x * x * x))
        e = tl.exp(-2.0 * tl.abs(z))
        t = 1.0 - 2.0 * e / (1.0 + e)
        return 0.5 * x * (1.0 + tl.where(z < 0, -t, t))

    @triton.jit
    def gelu_tanh_mul_load(g_ptrs, u_ptrs, mask):
        """gelu_tanh(gate) rounded to gate's dtype, times up, in fp32 (zero where `mask` is off): the captured
        pair's values before the rounding to the output dtype (silu_and_mul.py's kernel does that)."""
        g = tl.load(g_ptrs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptrs, mask=mask, other=0.0).to(tl.float32)
        return gelu_tanh(g).to(g_ptrs.dtype.element_ty).to(tl.float32) * u


def gelu_tanh_and_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Triton `gelu(gate, approximate="tanh") * up` (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1)."""
    if not HAS_TRITON:
        raise RuntimeError("gelu_tanh_and_mul_triton needs triton")
    return gated_mul_triton(gelu_tanh_mul_load, gate, up, "gelu_tanh_and_mul")


@torch.library.custom_op("mini_infer::gelu_tanh_and_mul", mutates_args=())
def gelu_tanh_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`gelu(gate, approximate="tanh") * up`: Triton on CUDA when available, else the torch reference."""
    if use_triton(gate):
        return gelu_tanh_and_mul_triton(gate, up)
    return gelu_tanh_and_mul_reference(gate, up)


gelu_tanh_and_mul.register_fake(gated_mul_fake)
