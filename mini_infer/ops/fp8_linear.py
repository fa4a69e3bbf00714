"""`mini_infer::fp8_linear` and `mini_infer::fp8_w8a8_linear`: FP8 (float8_e4m3fn) W8A8 linears, rowwise scales.

    fp8_linear(x_q fp8 [.., K], x_scale fp32 [.., 1], w_q fp8 [N, K], w_scale fp32 [N], bias [N] | None,
               out_dtype) -> [.., N] out_dtype
        out = ((x_q @ w_q.T) * x_scale * w_scale + bias), accumulated in fp32, rounded to out_dtype
    fp8_w8a8_linear(x, w_q, w_scale, bias) = fp8_linear(*quantize_per_token(x, fp8), w_q, w_scale, bias, x.dtype)

Where it runs:
  * CPU (and CUDA with MINI_INFER_OPS_BACKEND=torch): the reference (int8_linear.py's `scaled_linear_reference`),
    which dequantizes (fp8 -> fp32 is exact), multiplies in fp32 and applies the scales and bias in the
    kernels' epilogue order.
  * CUDA, compute capability >= 8.9 (Ada, Hopper and later): by shape only (CUDA-graph safe) —
    M = 1 -> int8_linear.py's GEMV (`scaled_gemv_triton`: the batch-1 decode path that streams the weights; on
    tensor cores, wgmma e4m3 with the row padded to a tile and K split over programs where the output has few row
    blocks (int8_linear.GEMV_DOT_SPLIT_PER_SM), or, with int8_linear.FP8_GEMV / MINI_INFER_FP8_GEMV "cuda-cores",
    as fp8 -> fp32 products on CUDA cores, exact, summed in fp32); M <= FP8_TRITON_MAX_M rows -> its Triton
    tile (`scaled_mm_triton`, skinny tile); larger M -> `torch._scaled_mm` (cuBLAS/CUTLASS rowwise-scaled
    FP8 GEMM) when it takes the call (bf16/fp16 output, K and N multiples of 16), else the Triton GEMM tile
    (whose fp8 accumulation precision on Hopper is int8_linear.FP8_DOT's choice). bench/kernel_quant.py times
    both at every M: move FP8_TRITON_MAX_M if it says so; bench/fp8_gpu_check.py measures their accuracy.
  * CUDA below 8.9: no FP8 tensor-core instructions; the op raises RuntimeError naming the capability.
Unlike the int8 path, fp32 accumulation order differs between tiles and between Triton and _scaled_mm, so a
row's output may differ in its last bits between M buckets (int8_linear is exact across buckets).
The argument checks, the reference, the Triton launchers and the op registration are int8_linear.py's, shared
with the int8 linears; this module adds the capability check and the choice of GEMM on CUDA. Imports nothing
from mini_infer outside `mini_infer.ops`.
"""

from __future__ import annotations

import torch

from mini_infer.ops._triton_support import HAS_TRITON
from mini_infer.ops.int8_linear import (
    check_scaled_linear,
    define_quantized_linear_op,
    define_scaled_linear_op,
    int8_linear_reference,
    int8_linear_triton,
    scaled_linear_reference,
    scaled_linear_triton,
)
from mini_infer.ops.quant import quantize_per_token_reference, quantize_per_token_triton

__all__ = [
    "FP8_MIN_CAPABILITY",
    "FP8_TRITON_MAX_M",
    "fp8_linear",
    "fp8_linear_reference",
    "fp8_linear_triton",
    "fp8_supported",
    "fp8_w8a8_linear",
    "fp8_w8a8_linear_reference",
    "fp8_w8a8_linear_triton",
    "check_scaled_linear_of",
    "scaled_linear_of",
    "scaled_mm_fp8",
]

FP8 = torch.float8_e4m3fn
FP8_MIN_CAPABILITY = (8, 9)
FP8_TRITON_MAX_M = 16  # rows up to which CUDA runs the Triton skinny kernel instead of torch._scaled_mm


def fp8_supported(device: torch.device | str) -> bool:
    """Whether fp8_linear runs on `device`: always on CPU (the dequantizing reference); on CUDA when the GPU
    has FP8 tensor cores (compute capability >= 8.9)."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return True
    if dev.type == "cuda":
        return torch.cuda.get_device_capability(dev) >= FP8_MIN_CAPABILITY
    return False


def _require_fp8_device(device: torch.device) -> None:
    if not fp8_supported(device):
        major, minor = torch.cuda.get_device_capability(device)
        raise RuntimeError(f"fp8_linear: {torch.cuda.get_device_name(device)} has compute capability "
                           f"{major}.{minor}; FP8 GEMMs need >= {FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]} "
                           "(use the int8 W8A8 path or bf16 weights on this GPU)")


# --------------------------------------------------------------------------------------------------
# reference (plain torch)
# --------------------------------------------------------------------------------------------------


def fp8_linear_reference(
    x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
    bias: torch.Tensor | None, out_dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    """Plain torch: fp8 -> fp32 (exact), an fp32 GEMM, then the scales and bias in fp32."""
    return scaled_linear_reference("fp8_linear", FP8, x_q, x_scale, w_q, w_scale, bias, out_dtype)


def fp8_w8a8_linear_reference(
    x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """quantize_per_token(x, fp8) then fp8_linear, output in x's dtype (plain torch)."""
    x_q, x_scale = quantize_per_token_reference(x, FP8)
    return fp8_linear_reference(x_q, x_scale, w_q, w_scale, bias, x.dtype)


# --------------------------------------------------------------------------------------------------
# CUDA paths
# --------------------------------------------------------------------------------------------------


def _scaled_mm_takes(m: int, k: int, n: int, out_dtype: torch.dtype) -> bool:
    """Shapes and dtypes torch._scaled_mm accepts with rowwise scales on every FP8 GPU."""
    return m > 0 and k % 16 == 0 and n % 16 == 0 and out_dtype in (torch.bfloat16, torch.float16)


def scaled_mm_fp8(
    x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
    bias: torch.Tensor | None, out_dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    """`torch._scaled_mm` with rowwise scales (x_scale per row of x, w_scale per row of w); the bias goes into
    the call when it has out_dtype, else it is added after (in fp32, then rounded)."""
    k, n = x_q.shape[-1], w_q.shape[0]
    a = x_q.reshape(-1, k)
    fused_bias = bias if bias is not None and bias.dtype == out_dtype else None
    out = torch._scaled_mm(
        a if a.is_contiguous() else a.contiguous(), w_q.t(),  # w_q [N, K] row-major = column-major [K, N]
        scale_a=x_scale.reshape(-1, 1).contiguous(), scale_b=w_scale.reshape(1, n).contiguous(),
        bias=fused_bias, out_dtype=out_dtype,
    )  # fmt: skip
    if bias is not None and fused_bias is None:
        out = (out.to(torch.float32) + bias.to(torch.float32)).to(out_dtype)
    return out.reshape(*x_q.shape[:-1], n)


def fp8_linear_triton(
    x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
    bias: torch.Tensor | None, out_dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    """The CUDA path (also CPU tensors under TRITON_INTERPRET=1, which always take the Triton kernel): see the
    module docstring for the choice between the Triton kernel and torch._scaled_mm."""
    check_scaled_linear("fp8_linear", FP8, x_q, x_scale, w_q, w_scale, bias)
    if x_q.is_cuda:
        _require_fp8_device(x_q.device)
        k, n = x_q.shape[-1], w_q.shape[0]
        m = x_q.numel() // k if k else 0
        if m > FP8_TRITON_MAX_M and _scaled_mm_takes(m, k, n, out_dtype):
            return scaled_mm_fp8(x_q, x_scale, w_q, w_scale, bias, out_dtype)
    if not HAS_TRITON:
        raise RuntimeError("fp8_linear_triton needs triton")
    return scaled_linear_triton(x_q, x_scale, w_q, w_scale, bias, out_dtype)


def fp8_w8a8_linear_triton(
    x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """Triton quantize_per_token(x, fp8) then fp8_linear's CUDA path, output in x's dtype."""
    if x.is_cuda:
        _require_fp8_device(x.device)
    x_q, x_scale = quantize_per_token_triton(x, FP8)
    return fp8_linear_triton(x_q, x_scale, w_q, w_scale, bias, x.dtype)


# --------------------------------------------------------------------------------------------------
# the registered ops
# --------------------------------------------------------------------------------------------------


fp8_linear = define_scaled_linear_op("fp8_linear", FP8, fp8_linear_triton, fp8_linear_reference)
fp8_w8a8_linear = define_quantized_linear_op("fp8_w8a8_linear", fp8_w8a8_linear_triton, fp8_w8a8_linear_reference)


def scaled_linear_of(impl: str, operand: torch.dtype):
    """The W8A8 linear for `operand` operands, `impl` "reference" or "triton": int8_linear's for int8, fp8_linear's
    for float8_e4m3fn (the fused ops that run one of them by x_q's dtype: linear_add_rms_norm.py)."""
    if operand == torch.int8:
        return int8_linear_reference if impl == "reference" else int8_linear_triton
    return fp8_linear_reference if impl == "reference" else fp8_linear_triton


def check_scaled_linear_of(name: str, x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor,
                           w_scale: torch.Tensor, bias: torch.Tensor | None) -> None:
    """ValueError naming the op (`name`) and the field unless x_q is int8 or float8_e4m3fn and the operands are that
    W8A8 linear's (`check_scaled_linear`): the check of the fused ops that run `scaled_linear_of` x_q's dtype."""
    if x_q.dtype not in (torch.int8, FP8):
        raise ValueError(f"{name}: x_q must be int8 or float8_e4m3fn, got {x_q.dtype}")
    check_scaled_linear(name, x_q.dtype, x_q, x_scale, w_q, w_scale, bias)
