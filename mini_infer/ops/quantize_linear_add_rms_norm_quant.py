"""`mini_infer::quantize_linear_add_rms_norm_quant`: a W8A8 / FP8 linear of a float activation, quantized per token
in the GEMV's own launch, then the residual add + RMSNorm + quantization of linear_add_rms_norm.py.

    quantize_linear_add_rms_norm_quant(x, W_q, w_scale, b, out_dtype, residual, nw, eps, dtype)
        = scaled_linear_add_rms_norm_quant(*quantize_per_token(x, W_q.dtype), W_q, w_scale, b, out_dtype, residual,
                                           nw, eps, dtype)                                  -> (q, scale, s)
(int8 or float8_e4m3fn by W_q's dtype). Inserted by the FuseQuantGemvNorm pass where a decoder layer's o_proj reads
the attention output through `quantize_per_token` alone. Functional: never writes into its inputs.

Why: at batch-1 decode the attention output's quantization is a one-program launch of its own (`_quant_rows_kernel`)
on the step's critical path. On CUDA, for one row that linear_add_rms_norm.py's one-launch kernel takes
(`scaled_gemv_norm_fuses`), that kernel runs with X_QMAX: every program first finds the row's amax (K = the hidden
size: a few KB, read from L2), then quantizes each K chunk of the row in registers before its products (int8:
four values packed into an int32 word for dp4a; fp8: the e4m3 value), with quant.py's rounding, so every program
multiplies the bytes `quantize_per_token` would have stored (int8_linear.py's `scaled_gemv_program`, `_x_chunk`).
The rest is that kernel's: under the Triton interpreter the outputs equal quantize_per_token's kernel then
scaled_linear_add_rms_norm_quant's bit for bit (tested). The cost: each program reads the 16-bit row twice (the
amax pass and the K loop) instead of the int8 row once; unmeasured on a GPU. Anything else (several rows: prefill,
batches) runs the unfused kernels (quantize_per_token's, then scaled_linear_add_rms_norm_quant's); the choice
depends only on shapes and dtypes: CUDA-graph safe, no host syncs. On CPU the reference is the unfused references.
Imports nothing from mini_infer outside `mini_infer.ops`.
"""

from __future__ import annotations

import torch

from mini_infer.ops._triton_support import use_triton
from mini_infer.ops.linear_add_rms_norm import (
    _check_scaled,
    _norm_fake,
    launch_scaled_gemv_add_rms_norm_quant,
    scaled_gemv_norm_fuses,
    scaled_linear_add_rms_norm_quant_reference,
    scaled_linear_add_rms_norm_quant_triton,
)
from mini_infer.ops.quant import _tl_dtype, quantize_per_token_reference, quantize_per_token_triton

__all__ = [
    "quantize_linear_add_rms_norm_quant",
    "quantize_linear_add_rms_norm_quant_reference",
    "quantize_linear_add_rms_norm_quant_triton",
]


def _check(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
           dtype: torch.dtype) -> None:
    """ValueError unless x is a float activation [.., K] and the rest a W8A8 / FP8 linear's operands (x's quantized
    stand-in checked as scaled_linear_add_rms_norm_quant checks x_q)."""
    _tl_dtype(x.dtype)  # fp32 / fp16 / bf16
    meta = torch.device("meta")  # shapes and dtypes only: nothing allocated
    _check_scaled(torch.empty(x.shape, dtype=w_q.dtype, device=meta),
                  torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=meta), w_q, w_scale, bias, dtype)


def quantize_linear_add_rms_norm_quant_reference(
    x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
    residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """`scaled_linear_add_rms_norm_quant(*quantize_per_token(x, w_q.dtype), ...)` in plain torch."""
    x_q, x_scale = quantize_per_token_reference(x, w_q.dtype)
    return scaled_linear_add_rms_norm_quant_reference(x_q, x_scale, w_q, w_scale, bias, out_dtype, residual,
                                                      norm_weight, eps, dtype)


def quantize_linear_add_rms_norm_quant_triton(
    x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
    residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The CUDA path: one launch (the quantization in the GEMV's prologue) for a single row, else
    `quantize_per_token` then `scaled_linear_add_rms_norm_quant` (their kernels)."""
    _check(x, w_q, w_scale, bias, dtype)
    if scaled_gemv_norm_fuses(x, w_q, out_dtype, residual, norm_weight):
        return launch_scaled_gemv_add_rms_norm_quant(x, w_scale, w_q, w_scale, bias, out_dtype, residual, norm_weight,
                                                     eps, dtype, quantize_x=True)  # x_scale: unread
    x_q, x_scale = quantize_per_token_triton(x, w_q.dtype)
    return scaled_linear_add_rms_norm_quant_triton(x_q, x_scale, w_q, w_scale, bias, out_dtype, residual, norm_weight,
                                                   eps, dtype)


@torch.library.custom_op("mini_infer::quantize_linear_add_rms_norm_quant", mutates_args=())
def quantize_linear_add_rms_norm_quant(
    x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
    residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """`scaled_linear_add_rms_norm_quant(*quantize_per_token(x, w_q.dtype), w_q, ...)`: one launch for one row on
    CUDA."""
    impl = quantize_linear_add_rms_norm_quant_triton if use_triton(x) else quantize_linear_add_rms_norm_quant_reference
    return impl(x, w_q, w_scale, bias, out_dtype, residual, norm_weight, eps, dtype)


@quantize_linear_add_rms_norm_quant.register_fake
def _(x, w_q, w_scale, bias, out_dtype, residual, norm_weight, eps, dtype):
    _check(x, w_q, w_scale, bias, dtype)
    s = _norm_fake(x, w_q.shape[0], out_dtype, residual)
    return s.new_empty(s.shape, dtype=dtype), s.new_empty((*s.shape[:-1], 1), dtype=torch.float32), s
