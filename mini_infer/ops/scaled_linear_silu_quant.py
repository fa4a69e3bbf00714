"""`mini_infer::scaled_linear_silu_quant`: the gated-MLP activation `silu(gate) * up` and its per-token quantization in
the launch of the W8A8 / FP8 merged gate_up GEMV that produces gate and up.

    scaled_linear_silu_quant(x_q, x_scale, W_q, w_scale, b, out_dtype, dtype)
        = silu_and_mul_quant(g, u, dtype),  g, u = scaled linear(x_q, x_scale, W_q, w_scale, b, out_dtype).split(I, -1)
                                                                                           -> (x_q [.., I], scale)
(the linear int8_linear or fp8_linear by x_q's dtype; W_q the merged [2I, K] gate_up weight, gate rows first).
Inserted by the FuseGateUpSiluQuant pass where a `silu_and_mul_quant` reads the two halves of one scaled gate_up
output and nothing else does. Functional: never writes into its inputs.

Why: at batch-1 decode the unfused chain after the gate_up GEMV is silu_and_mul_quant's two launches
(`_chunk_amax_kernel`, `_chunk_quant_kernel`: rows of 18,944 are split over programs) on the step's critical path.
On CUDA, for one row that the scaled GEMV takes, ONE kernel on int8_linear.py's GEMV tiling gives a program
BLOCK_N / 2 gate rows and the matching up rows (interleaved: row 2i gate n + i, row 2i + 1 up I + n + i), run
through the scaled GEMV's K loop (`scaled_row_dots`: dp4a on packed int8, fp8 on CUDA cores or tensor cores) and
epilogue, each rounded to out_dtype as the linear stores it, then silu_and_mul's math (`silu_mul`) and rounding; the
program stores its slice of the bf16 activation row, folds its slice's amax into a shared slot (an integer
atomic max of the non-negative fp32 bits: exact, order-free) and counts itself (`_split_k.arrives_last`, as
linear_add_rms_norm.py does); the program that arrives last takes the row's amax (zeroing the slot for the next
launch), computes the scale and quantizes the whole row with quant.py's helpers. So the values are the unfused
chain's: under the Triton interpreter bit for bit (tested; int8's integer dot products are exact on any tile, fp8's
fp32 sums keep the unfused tile's BLOCK_N rows and BLOCK_K). The tile is the unfused scaled GEMV's
(`scaled_gemv_config`): as many weight rows per program and as many programs; unmeasured on a GPU. Anything else
(several rows: prefill, batches; an fp8 GPU below 8.9, where fp8_linear raises) runs the unfused kernels (the scaled
linear, then silu_and_mul_quant's); the choice depends only on shapes and dtypes: CUDA-graph safe, no host syncs.
One counter pair (`split_counters`) serves every launch (each leaves it zero), so two of these kernels must not run
concurrently on different streams. On CPU the reference is the unfused references. Imports nothing from mini_infer
outside `mini_infer.ops`.
"""

from __future__ import annotations

import torch

from mini_infer.ops._split_k import split_counters
from mini_infer.ops._triton_support import HAS_TRITON, await_producers, tl, triton, use_triton
from mini_infer.ops.fp8_linear import fp8_supported
from mini_infer.ops.int8_linear import check_scaled_linear, launch_scaled_gemv, takes_scaled_gemv
from mini_infer.ops.linear_add_rms_norm import scaled_linear_of
from mini_infer.ops.quant import (
    QMAX,
    check_quant_dtype,
    silu_and_mul_quant_reference,
    silu_and_mul_quant_triton,
)

__all__ = ["scaled_linear_silu_quant", "scaled_linear_silu_quant_reference", "scaled_linear_silu_quant_triton"]

FP8 = torch.float8_e4m3fn
QUANT_BLOCK = 2048  # the last program's chunk of the activation row (fp32 values in registers)


def _check(x_q, x_scale, w_q, w_scale, bias, dtype) -> None:
    """ValueError unless the operands are an int8 / fp8 W8A8 linear's with an even output width and `dtype` a quantized
    activation dtype."""
    if x_q.dtype not in (torch.int8, FP8):
        raise ValueError(f"scaled_linear_silu_quant: x_q must be int8 or float8_e4m3fn, got {x_q.dtype}")
    check_scaled_linear("scaled_linear_silu_quant", x_q.dtype, x_q, x_scale, w_q, w_scale, bias)
    if w_q.shape[0] % 2:
        raise ValueError(f"scaled_linear_silu_quant: a merged gate_up weight has an even row count, got {w_q.shape[0]}")
    check_quant_dtype(dtype)


def _quantized_halves(gate_up: torch.Tensor, dtype: torch.dtype, silu_and_mul_quant_fn):
    gate, up = gate_up.split(gate_up.shape[-1] // 2, -1)
    return silu_and_mul_quant_fn(gate, up, dtype)


def scaled_linear_silu_quant_reference(
    x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
    out_dtype: torch.dtype, dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`silu_and_mul_quant` of the halves of the scaled linear's output, in plain torch."""
    _check(x_q, x_scale, w_q, w_scale, bias, dtype)
    y = scaled_linear_of("reference", x_q)(x_q, x_scale, w_q, w_scale, bias, out_dtype)
    return _quantized_halves(y, dtype, silu_and_mul_quant_reference)


if HAS_TRITON:
    from mini_infer.ops._split_k import arrives_last
    from mini_infer.ops.int8_linear import _dequantize, scaled_row_dots
    from mini_infer.ops.quant import _quantize_values, _scale_and_inverse
    from mini_infer.ops.silu_and_mul import silu_mul

    @triton.jit
    def _scaled_gate_up_silu_quant_kernel(
        x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, b_ptr, act_ptr, N, K, stride_wn, q_ptr, q_scale_ptr, cnt_ptr,
        HAS_BIAS: tl.constexpr, ACC_DTYPE: tl.constexpr, PACKED: tl.constexpr, ASM: tl.constexpr, DOT: tl.constexpr,
        IS_FP8: tl.constexpr, QMAX: tl.constexpr, QUANT_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, USE_GDC: tl.constexpr,
    ):  # fmt: skip
        await_producers(USE_GDC)
        half = N // 2
        BH: tl.constexpr = BLOCK_N // 2
        # row 2i: gate output n0 + i; row 2i + 1: the up row of the same output, `half` further down
        i = tl.arange(0, BLOCK_N)
        outs = tl.program_id(0) * BH + i // 2
        rows = outs + (i % 2) * half
        row_ok = outs < half
        w_rows = w_ptr + rows[:, None].to(tl.int64) * stride_wn
        dots = scaled_row_dots(x_ptr, 1.0, w_rows, row_ok, K, ACC_DTYPE, PACKED, ASM, DOT, BLOCK_N, BLOCK_K, 0)
        y = _dequantize(dots, tl.load(x_scale_ptr), tl.load(w_scale_ptr + rows, mask=row_ok, other=0.0), b_ptr + rows,
                        row_ok, HAS_BIAS)
        y = y.to(act_ptr.dtype.element_ty).to(tl.float32)  # as the linear stores gate_up
        g, u = tl.split(tl.reshape(y, [BH, 2]))
        out = tl.program_id(0) * BH + tl.arange(0, BH)
        out_ok = out < half
        act = silu_mul(g, u).to(act_ptr.dtype.element_ty)  # as silu_and_mul(_quant) rounds it
        tl.store(act_ptr + out, act, mask=out_ok)
        amax = tl.max(tl.where(out_ok, tl.abs(act.to(tl.float32)), 0.0), axis=0)
        tl.atomic_max(cnt_ptr + 1, amax.to(tl.int32, bitcast=True))  # non-negative fp32 order as their bits
        if arrives_last(cnt_ptr, tl.num_programs(0)):
            scale, inv = _scale_and_inverse(tl.atomic_xchg(cnt_ptr + 1, 0).to(tl.float32, bitcast=True), QMAX)
            tl.store(q_scale_ptr, scale)
            for c0 in range(0, half, QUANT_BLOCK):
                cols = c0 + tl.arange(0, QUANT_BLOCK)
                ok = cols < half
                v = tl.load(act_ptr + cols, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
                tl.store(q_ptr + cols, _quantize_values(v, inv, IS_FP8).to(q_ptr.dtype.element_ty), mask=ok)


def _fuses(x_q: torch.Tensor, w_q: torch.Tensor) -> bool:
    """One row the scaled GEMV takes, on a device that runs the operand dtype (else fp8_linear's error names it)."""
    n, k = w_q.shape
    return takes_scaled_gemv(x_q.numel() // k if k else 0, k, n) and (x_q.dtype != FP8 or fp8_supported(x_q.device))


def scaled_linear_silu_quant_triton(
    x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
    out_dtype: torch.dtype, dtype: torch.dtype, config: tuple[int, int, int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The CUDA path: one launch for a single row (tile `config`, BLOCK_N counting gate and up rows; None: the scaled
    GEMV's), else the scaled linear then `silu_and_mul_quant` (their kernels)."""
    _check(x_q, x_scale, w_q, w_scale, bias, dtype)
    if not _fuses(x_q, w_q):
        y = scaled_linear_of("triton", x_q)(x_q, x_scale, w_q, w_scale, bias, out_dtype)
        return _quantized_halves(y, dtype, silu_and_mul_quant_triton)
    half = w_q.shape[0] // 2
    act = torch.empty(half, dtype=out_dtype, device=x_q.device)  # the bf16 activation row, read back by the last
    q = torch.empty((*x_q.shape[:-1], half), dtype=dtype, device=x_q.device)
    q_scale = torch.empty((*x_q.shape[:-1], 1), dtype=torch.float32, device=x_q.device)
    if config is not None and (config[0] < 2 or config[0] & (config[0] - 1)):
        raise ValueError(f"scaled_linear_silu_quant: BLOCK_N must be a power of two >= 2 (gate and up rows), got "
                         f"{config}")
    launch_scaled_gemv(
        _scaled_gate_up_silu_quant_kernel, x_q, x_scale, w_q, w_scale, bias, act,
        q.view(half), q_scale, split_counters(x_q.device, 2), config=config,
        IS_FP8=dtype == FP8, QMAX=QMAX[dtype], QUANT_BLOCK=min(QUANT_BLOCK, triton.next_power_of_2(half)),
    )  # fmt: skip
    return q, q_scale


@torch.library.custom_op("mini_infer::scaled_linear_silu_quant", mutates_args=())
def scaled_linear_silu_quant(
    x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
    out_dtype: torch.dtype, dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`silu_and_mul_quant(g, u, dtype)` of the halves of int8_linear / fp8_linear(x_q, x_scale, w_q, w_scale, bias,
    out_dtype) (by x_q's dtype): one launch for one row on CUDA."""
    impl = scaled_linear_silu_quant_triton if use_triton(x_q) else scaled_linear_silu_quant_reference
    return impl(x_q, x_scale, w_q, w_scale, bias, out_dtype, dtype)


@scaled_linear_silu_quant.register_fake
def _(x_q, x_scale, w_q, w_scale, bias, out_dtype, dtype):
    _check(x_q, x_scale, w_q, w_scale, bias, dtype)
    shape = (*x_q.shape[:-1], w_q.shape[0] // 2)
    return x_q.new_empty(shape, dtype=dtype), x_q.new_empty((*shape[:-1], 1), dtype=torch.float32)
