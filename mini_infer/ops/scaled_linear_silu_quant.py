"""`mini_infer::scaled_linear_silu_quant`: a W8A8 gate_up linear, the gated-MLP activation and its per-token
quantization, with the activation and the row's amax in the GEMV's epilogue.

    scaled_linear_silu_quant(x_q, x_scale, w_q, w_scale, bias, out_dtype, dtype)
        = silu_and_mul_quant(g, u, dtype),  g, u = int8_linear / fp8_linear(x_q, x_scale, w_q, w_scale, bias,
                                                                            out_dtype).split(I, -1)

(the linear by x_q's dtype; w_q is the merged [2I, K] gate_up weight, gate rows first) -> (h_q [.., I] of `dtype`,
scale [.., 1] fp32). Inserted by the opt-in FuseGateUpSiluQuant pass. Functional: never writes into its inputs.

Why: a W8A8 batch-1 decode step quantizes the MLP's activation silu(g) * u (I = 18,944 on qwen2.5-7b) in two
launches after the gate_up GEMV (quant.py's chunk amaxes, then the quantization: `_launch_split_rows`), 1.0-1.2 and
1.7 us exposed a layer on an H200 (bench/results/s30_timeline7b_w8a8_h200.txt). Here the GEMV's programs hold
their gate and up outputs anyway: on CUDA, for one row the W8A8 GEMV takes (int8_linear.py's `takes_scaled_gemv`),
ONE GEMV kernel gives each program gate rows in pairs with their up rows (int8_linear.py's `scaled_gemv_outputs`
over rows r, I + r interleaved, so a program reads the unfused GEMV's bytes at its tile), stores h = silu(g) * u
for its outputs and adds its outputs' amax into one of AMAX_SLOTS slots (a relaxed atomic max; max is exact in any
order); then ONE quantization kernel (chunks of quant.py's SPLIT_CHUNK columns) takes the row's amax from the
slots, quantizes and stores, and its last program to arrive zeroes the slots again. The roundings are the unfused
chain's: g and u as the GEMV stores them in out_dtype, h in out_dtype as silu_and_mul stores it, quant.py's scale
and rounding, so the bits equal int8_linear / fp8_linear then silu_and_mul_quant (tested under the interpreter;
int8's GEMV sums are exact, fp8's fp32 sums within a row run in the same order at the same tile).

Opt-in (the pass is off by default) until timed on a GPU. Anything else (several rows, fp8 without GPU support)
runs the unfused kernels; the choice depends only on shapes and dtypes: CUDA-graph safe, no host syncs. The slots
and the counter are kept per device and left zero by each launch, so two such launches must not run concurrently on
different streams (the engine uses one). On CPU the reference is the unfused references. Imports nothing from
mini_infer outside `mini_infer.ops`.
"""

from __future__ import annotations

import torch

from mini_infer.ops._split_k import split_counters
from mini_infer.ops._triton_support import (
    HAS_TRITON,
    await_producers,
    next_pow2,
    pdl_args,
    tl,
    triton,
    use_triton,
)
from mini_infer.ops.fp8_linear import check_scaled_linear_of, fp8_supported, scaled_linear_of
from mini_infer.ops.int8_linear import (
    launch_scaled_gemv,
    takes_scaled_gemv,
)
from mini_infer.ops.quant import (
    QMAX,
    SPLIT_CHUNK,
    check_quant_dtype,
    silu_and_mul_quant_reference,
    silu_and_mul_quant_triton,
)

__all__ = [
    "AMAX_SLOTS",
    "scaled_linear_silu_quant",
    "scaled_linear_silu_quant_reference",
    "scaled_linear_silu_quant_triton",
]

FP8 = torch.float8_e4m3fn
AMAX_SLOTS = 64  # slots the GEMV's programs spread their atomic maxes over (program id modulo)
_SLOTS: dict[torch.device, torch.Tensor] = {}  # device -> fp32 [AMAX_SLOTS] amax slots, zero between launches


def _amax_slots(device: torch.device) -> torch.Tensor:
    """The device's zeroed amax slots (made on first use: make the first call before capturing a CUDA graph)."""
    if device not in _SLOTS:
        _SLOTS[device] = torch.zeros(AMAX_SLOTS, dtype=torch.float32, device=device)
    return _SLOTS[device]


def _check(x_q, x_scale, w_q, w_scale, bias, dtype) -> None:
    """ValueError naming the field unless the operands are a W8A8 gate_up linear's (an even row count) and `dtype` a
    quantized activation dtype."""
    check_scaled_linear_of("scaled_linear_silu_quant", x_q, x_scale, w_q, w_scale, bias)
    if w_q.shape[0] % 2:
        raise ValueError(f"scaled_linear_silu_quant: w_q must have an even row count (gate rows, then as many up "
                         f"rows), got {w_q.shape[0]}")
    check_quant_dtype(dtype)


def _halves(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gate, up = y.split(y.shape[-1] // 2, -1)
    return gate, up


def scaled_linear_silu_quant_reference(
    x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
    out_dtype: torch.dtype, dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`silu_and_mul_quant` of the halves of the W8A8 linear's output, in plain torch."""
    _check(x_q, x_scale, w_q, w_scale, bias, dtype)
    y = scaled_linear_of("reference", x_q.dtype)(x_q, x_scale, w_q, w_scale, bias, out_dtype)
    return silu_and_mul_quant_reference(*_halves(y), dtype)


if HAS_TRITON:
    from mini_infer.ops._split_k import arrives_last
    from mini_infer.ops.int8_linear import scaled_gemv_outputs
    from mini_infer.ops.quant import _quantize_values, _scale_and_inverse

    @triton.jit
    def _gemv_silu_amax_kernel(
        x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, b_ptr, h_ptr, N, K, stride_wn, ws_ptr, cnt_ptr, slots_ptr,
        HAS_BIAS: tl.constexpr, ACC_DTYPE: tl.constexpr, PACKED: tl.constexpr, ASM: tl.constexpr, DOT: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_GDC: tl.constexpr, SPLIT_K: tl.constexpr = 1,
        W_EVICT: tl.constexpr = "", NUM_SLOTS: tl.constexpr = 64,
    ):  # fmt: skip
        """BLOCK_N // 2 gate rows r and their up rows HALF + r a program, interleaved (r, HALF + r, r + 1, ...);
        h[r] = silu(g) * u as silu_and_mul stores it; the max |h| of its outputs into slot program_id % NUM_SLOTS."""
        await_producers(USE_GDC)
        HALF = N // 2
        pair = tl.arange(0, BLOCK_N)
        gate_rows = tl.program_id(0) * (BLOCK_N // 2) + pair // 2
        y, stores = scaled_gemv_outputs(x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, b_ptr, gate_rows + (pair % 2) * HALF,
                                        gate_rows < HALF, N, K, stride_wn, ws_ptr, cnt_ptr, HAS_BIAS, ACC_DTYPE,
                                        PACKED, ASM, DOT, BLOCK_N, BLOCK_K, SPLIT_K, W_EVICT)
        if stores:
            # g and u as the GEMV stores them, then silu_and_mul's math (quant.py's `_row_values`) and rounding
            g, u = tl.split(tl.reshape(y.to(h_ptr.dtype.element_ty).to(tl.float32), [BLOCK_N // 2, 2]))
            h = (g * tl.sigmoid(g) * u).to(h_ptr.dtype.element_ty)
            rows = tl.program_id(0) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            row_ok = rows < HALF
            tl.store(h_ptr + rows, h, mask=row_ok)
            amax = tl.max(tl.where(row_ok, tl.abs(h.to(tl.float32)), 0.0), axis=0)
            tl.atomic_max(slots_ptr + tl.program_id(0) % NUM_SLOTS, amax, sem="relaxed")

    @triton.jit
    def _slot_quant_kernel(
        h_ptr, slots_ptr, q_ptr, scale_ptr, cnt_ptr, n_cols,
        IS_FP8: tl.constexpr, QMAX: tl.constexpr, CHUNK: tl.constexpr, NUM_SLOTS: tl.constexpr, USE_GDC: tl.constexpr,
    ):  # fmt: skip
        """Program c quantizes columns c * CHUNK.. of h with the row's amax (the max of the slots: quant.py's
        `_chunk_quant_kernel` with slots for chunk amaxes); program 0 stores the scale; the last to arrive zeroes the
        slots (every program has read them before it counts)."""
        await_producers(USE_GDC)
        c = tl.program_id(0)
        amax = tl.max(tl.load(slots_ptr + tl.arange(0, NUM_SLOTS)), axis=0)
        scale, inv = _scale_and_inverse(amax, QMAX)
        if c == 0:
            tl.store(scale_ptr, scale)
        cols = c * CHUNK + tl.arange(0, CHUNK)
        mask = cols < n_cols
        v = _quantize_values(tl.load(h_ptr + cols, mask=mask, other=0.0).to(tl.float32), inv, IS_FP8)
        tl.store(q_ptr + cols, v.to(q_ptr.dtype.element_ty), mask=mask)
        if arrives_last(cnt_ptr, tl.num_programs(0)):
            tl.store(slots_ptr + tl.arange(0, NUM_SLOTS), tl.zeros([NUM_SLOTS], tl.float32))


def _fuses(x_q: torch.Tensor, w_q: torch.Tensor) -> bool:
    """One row the W8A8 GEMV takes (and, for fp8, a GPU with fp8: else fp8_linear's error names the capability)."""
    n, k = w_q.shape
    return (takes_scaled_gemv(x_q.numel() // k if k else 0, k, n)
            and (x_q.dtype != FP8 or not x_q.is_cuda or fp8_supported(x_q.device)))


def scaled_linear_silu_quant_triton(
    x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
    out_dtype: torch.dtype, dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The CUDA path: the GEMV with the activation and amax in its epilogue, then one quantization launch, for one row;
    else the W8A8 linear then `silu_and_mul_quant` (their kernels)."""
    _check(x_q, x_scale, w_q, w_scale, bias, dtype)
    if not _fuses(x_q, w_q):
        y = scaled_linear_of("triton", x_q.dtype)(x_q, x_scale, w_q, w_scale, bias, out_dtype)
        return silu_and_mul_quant_triton(*_halves(y), dtype)
    half = w_q.shape[0] // 2
    lead = x_q.shape[:-1]
    h = torch.empty(half, dtype=out_dtype, device=x_q.device)
    slots = _amax_slots(x_q.device)
    launch_scaled_gemv(_gemv_silu_amax_kernel, x_q, x_scale, w_q, w_scale, bias, h, slots, NUM_SLOTS=AMAX_SLOTS)
    h_q = torch.empty((*lead, half), dtype=dtype, device=x_q.device)
    scale = torch.empty((*lead, 1), dtype=torch.float32, device=x_q.device)
    chunks = triton.cdiv(half, SPLIT_CHUNK)
    _slot_quant_kernel[(chunks,)](h, slots, h_q.view(half), scale.view(1), split_counters(x_q.device, 1), half,
                                  IS_FP8=dtype == FP8, QMAX=QMAX[dtype], CHUNK=min(SPLIT_CHUNK, next_pow2(half)),
                                  NUM_SLOTS=AMAX_SLOTS, num_warps=4, **pdl_args(h))
    return h_q, scale


@torch.library.custom_op("mini_infer::scaled_linear_silu_quant", mutates_args=())
def scaled_linear_silu_quant(
    x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None,
    out_dtype: torch.dtype, dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`silu_and_mul_quant(g, u, dtype)` of the halves of `int8_linear / fp8_linear(x_q, ...)` (by x_q's dtype): the
    GEMV's epilogue takes the activation and its amax for one row on CUDA."""
    impl = scaled_linear_silu_quant_triton if use_triton(x_q) else scaled_linear_silu_quant_reference
    return impl(x_q, x_scale, w_q, w_scale, bias, out_dtype, dtype)


@scaled_linear_silu_quant.register_fake
def _(x_q, x_scale, w_q, w_scale, bias, out_dtype, dtype):
    _check(x_q, x_scale, w_q, w_scale, bias, dtype)
    half = w_q.shape[0] // 2
    return (x_q.new_empty((*x_q.shape[:-1], half), dtype=dtype),
            x_q.new_empty((*x_q.shape[:-1], 1), dtype=torch.float32))
