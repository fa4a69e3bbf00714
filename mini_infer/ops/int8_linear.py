"""`mini_infer::int8_linear` and `mini_infer::w8a8_linear`: W8A8 int8 linears with per-token / per-channel scales,
and the pieces every W8A8 linear shares (fp8_linear.py builds its ops from them).

    int8_linear(x_q int8 [.., K], x_scale fp32 [.., 1], w_q int8 [N, K], w_scale fp32 [N], bias [N] | None,
                out_dtype) -> [.., N] out_dtype
        acc = x_q @ w_q.T in exact int32;  out = ((acc * x_scale) * w_scale + bias) rounded to out_dtype
        (the dequantization and the bias are the GEMM's epilogue, computed in fp32 in that order)
    w8a8_linear(x, w_q, w_scale, bias) = int8_linear(*quantize_per_token(x, int8), w_q, w_scale, bias, x.dtype)
        (for passes that do not fuse the activation quantization into its producer, see quant.py)

Why: a batch-1 decode step reads every weight once; int8 weights halve those bytes. The decode win needs a
kernel that streams the int8 weights at full bandwidth when M (tokens) is tiny, where `torch._int_mm` is slow
(and on CUDA refuses M <= 16). So the Triton path picks its kernel by M only (shapes, never values: CUDA-graph
safe): M = 1 -> a GEMV on linear.py's tiling (`scaled_gemv_triton`: 4 weight rows per program, so every SM
streams weights; int8 read as int32 words of four and multiplied with dp4a on a GPU; fp8 multiplied on tensor
cores, the row padded to a tensor-core tile and K split over programs where the output has few row blocks
(FP8_GEMV, GEMV_DOT_SPLIT_PER_SM), or converted on CUDA cores), M <= SMALL_M (16) -> a
skinny tile (16 rows, few weight rows per program, long K steps), larger M -> GEMM tiles. The int32
accumulation is exact in every kernel and the epilogue's arithmetic is one piece of code (`_dequantize`), so
every M bucket gives the same bits for a row (greedy decoding does not change with the batch bucket); the reference (`torch._int_mm` where it takes the shape, else an exact float64
product) gives the same int32 and differs from the kernel at most by the fp32 epilogue's rounding (FMA
contraction on a GPU; none under the interpreter, where the two are bit-identical).

Shared with fp8_linear.py (float8_e4m3fn operands, fp32 accumulation): the Triton kernels and their launchers
(`scaled_linear_triton`, the choice by M, over `scaled_gemv_triton` and `scaled_mm_triton`), the argument checks (`check_scaled_linear`), the plain-torch reference
(`scaled_linear_reference`: checks, the operand dtype's accumulation, the fp32 epilogue), the fakes, and
`define_scaled_linear_op` / `define_quantized_linear_op`, which register an operand dtype's pair of ops.
Limits: K <= INT8_MAX_K (131072), so int32 cannot overflow. Imports nothing from mini_infer outside
`mini_infer.ops`.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from mini_infer.ops._split_k import split_counters
from mini_infer.ops._triton_support import (
    HAS_TRITON,
    await_producers,
    cuda_index,
    num_sms,
    pdl_args,
    tl,
    triton,
    use_triton,
)
from mini_infer.ops.linear import launch_gemv, unit_stride_row
from mini_infer.ops.quant import quantize_per_token_reference, quantize_per_token_triton

__all__ = [
    "DOT_ROWS",
    "FP8_DOT",
    "FP8_GEMV",
    "FP8_GEMV_DOT_MAX_K",
    "FP8_GEMV_MODES",
    "fp8_gemv_dot",
    "gemv_split_k",
    "GEMV_DOT_SPLIT_PER_SM",
    "INT8_MAX_K",
    "SCALED_GEMV_CONFIG",
    "SCALED_GEMV_CONFIG_FP8",
    "SCALED_GEMV_CONFIG_FP8_DOT",
    "SCALED_GEMV_CONFIG_FP8_LONG_K",
    "scaled_gemv_config",
    "SMALL_M",
    "check_scaled_linear",
    "define_quantized_linear_op",
    "define_scaled_linear_op",
    "int8_linear",
    "int8_linear_reference",
    "int8_linear_triton",
    "int8_matmul_exact",
    "launch_scaled_gemv",
    "scaled_linear_reference",
    "scaled_mm_config",
    "scaled_gemv_triton",
    "scaled_linear_triton",
    "scaled_mm_triton",
    "takes_scaled_gemv",
    "w8a8_fake",
    "w8a8_linear",
    "w8a8_linear_reference",
    "w8a8_linear_triton",
]

INT8_MAX_K = 2**31 // (128 * 128)  # |acc| <= 128 * 128 * K must fit int32
SMALL_M = 16  # rows up to which the skinny (decode) tile is used

# (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages, SPLIT_K) by the largest M each serves (None: any
# larger), from `bench/kernel_quant.py --sweep` on an H100 (qwen2.5-7b shapes; the skinny int8 tile streams the
# weights at 54-62% of copy bandwidth for the 13-17 MB qkv/o_proj, 76-92% for down/gate_up, ~100% for lm_head).
# SPLIT_K > 1 (int8 only) splits K over programs that add int32 partials atomically (exact, so the bits do not
# depend on it); the sweep found it slower than SPLIT_K = 1 on every shape, so no default uses it.
_CONFIGS = (
    (SMALL_M, (16, 64, 512, 1, 4, 5, 1)),
    (64, (64, 64, 256, 8, 4, 4, 1)),
    (256, (64, 128, 256, 8, 4, 4, 1)),
    (None, (128, 256, 128, 8, 8, 3, 1)),
)
# The one-row GEMV (`scaled_gemv_triton`, M = 1): (weight rows per program, K elements per step, warps, stages).
# int8: 1024 one-byte weights per row and step (the bytes per step of linear.py's bf16 GEMV tile (4, 512, 4, 1)):
# within 5% of the best of `bench/kernel_quant.py --sweep-gemv`'s 36 tiles at every qwen2.5-7b shape on the H200.
# fp8 (fp32 sums of converted weights, no dp4a): 512 per step, the sweep's best or within 7% at every shape
# (1024 was 10-45% slower), except for long rows (K >= FP8_GEMV_LONG_K: qwen2.5-7b's down_proj, K 18,944), where
# (4, 4096, 8, 1) took 23.7 us against 32.7 us for (4, 512, 4, 1) on the H200.
SCALED_GEMV_CONFIG = (4, 1024, 4, 1)
SCALED_GEMV_CONFIG_FP8 = (4, 512, 4, 1)
SCALED_GEMV_CONFIG_FP8_LONG_K = (4, 4096, 8, 1)
FP8_GEMV_LONG_K = 8192
# "auto" multiplies rows shorter than this on tensor cores (FP8_GEMV below): every row since split-K (it was
# FP8_GEMV_LONG_K, the CUDA-core GEMV's own threshold for its long-row tile, which stays).
FP8_GEMV_DOT_MAX_K = 1 << 30
# How the fp8 GEMV multiplies (MINI_INFER_FP8_GEMV, read at import; the launchers take it per call too):
# "cuda-cores": fp8 -> fp16 -> fp32 conversions and fp32 FMAs (no 4-way fp8 dot instruction exists on CUDA cores,
# so the GEMV is bound by the conversions, not by the weight bytes: 3.00 ms of fp8 GEMVs per qwen2.5-7b decode step
# on an H200 against 1.99 ms for int8's dp4a); "dot": tensor cores (`_padded_row_dot`), the weight tile fed to
# tl.dot as loaded. What Triton (3.6 and 3.9) emits for it on sm_90: wgmma ...e4m3.e4m3 (QGMMA) only when the dot
# has 64 rows per warpgroup (4 warps) and both operands K-major; a 16-row dot goes to mma v2, and for mma v2 Triton
# converts fp8 to fp16 on Hopper (native fp8 mma.sync only on sm_89), as it does for a B tile of 8 columns. Hence
# DOT_ROWS = 64 and DOT_COLS = 16. The dot's fp32 accumulator takes the wgmma partial after each BLOCK_K step
# (max_num_imprecise_acc = BLOCK_K: see FP8_DOT). Its own tile SCALED_GEMV_CONFIG_FP8_DOT (BLOCK_N, BLOCK_K,
# warps, cp.async stages; a guess from the sm_90 compile, tests/ops/compile_fp8_gemv_sm90.py: 0.03 instructions
# a weight byte in the K loop, like int8's dp4a GEMV, against 0.11-0.17 for "cuda-cores"); "auto" (the default):
# "dot" for rows shorter than FP8_GEMV_DOT_MAX_K, "cuda-cores" for longer ones. Measured on an H200
# (`bench/kernel_quant.py --sweep-gemv fp8-dot`, qwen2.5-7b at M = 1, cold L2, us per call, "cuda-cores" / "dot" at
# its best tile): qkv 7.6 / 7.1, o_proj 7.3 / 6.6, gate_up 40.7 / 34.2 (96% of copy bandwidth), but down_proj
# (K 18,944: only N / 64 = 56 programs, each streaming a long row) 23.1 / 27.0, hence "auto" stopped at
# FP8_GEMV_LONG_K; with K cut into splits (GEMV_DOT_SPLIT_PER_SM) the dot takes down_proj in 19.9 us, so "auto" now
# runs every row on tensor cores (FP8_GEMV_DOT_MAX_K).
FP8_GEMV_MODES = ("auto", "cuda-cores", "dot")
FP8_GEMV = os.environ.get("MINI_INFER_FP8_GEMV", "auto")
if FP8_GEMV not in FP8_GEMV_MODES:
    raise ValueError(f"MINI_INFER_FP8_GEMV must be one of {FP8_GEMV_MODES}, got {FP8_GEMV!r}")
# Split-K for the tensor-core (fp8 "dot") GEMV: it has BLOCK_N = 64 rows a program, so a short output (qwen2.5-7b's
# q/k/v, o_proj and down_proj: N = 4608 / 3584, 72 / 56 programs) leaves most SMs without a program, each streaming a
# long row alone. Launches of fewer row blocks than GEMV_DOT_SPLIT_PER_SM programs per SM cut K into splits over grid
# axis 1: the largest power of two that keeps the programs within that target and each split at least
# GEMV_DOT_MIN_SPLIT_STEPS BLOCK_K steps long (0: never split). The row block's last split sums the fp32 partials in
# split order (`_merged_splits`: deterministic, whatever the arrival order). A config's fifth element, when given,
# is the split count (sweeps). H200, qwen2.5-7b at M = 1, weights cold, us per call (`bench/kernel_quant.py
# --sweep-gemv fp8-dot --split-sweep`, thirty-first session), (64, 256, 4, 4) unsplit / 2 / 4 splits: q/k/v 7.5 /
# 8.0 / 7.7, o_proj 6.9 / 6.5 / 6.2, down_proj 27.0 / 20.8 / 19.9 (the CUDA-core GEMV 23.0); gate_up (592 blocks)
# 36.0 unsplit. In the engine (batch-1 decode, same process): 352.9 tok/s against 343.5 for the former defaults
# (no split, down_proj on CUDA cores); the (64, 128, 4, 4) tile, split, down_proj on CUDA cores 350.3.
# Also measured and dropped (docs/architecture.md): int8 on tensor cores (int8 x int8 -> int32 wgmma, split or not)
# took fp8's times, slower than dp4a's 6.1 / 5.9 / 18.7 / 34.3 us; w8a8 336.5-370.4 against 397.0 tok/s.
GEMV_DOT_SPLIT_PER_SM = int(os.environ.get("MINI_INFER_GEMV_DOT_SPLIT_PER_SM", "3"))
GEMV_DOT_MIN_SPLIT_STEPS = 2
DOT_ROWS = 64  # the padded A tile's rows (x as A): a warpgroup's wgmma M
DOT_COLS = 16  # the padded B tile's columns (x as B)
SCALED_GEMV_CONFIG_FP8_DOT = (64, 256, 4, 4)  # the sweep's best at qkv, o_proj, down_proj; gate_up within 2%
# fp8 operands in the skinny tile (fp8_linear's M <= FP8_TRITON_MAX_M path): narrower tiles won the sweep
_FP8_SMALL_M_CONFIG = (16, 32, 256, 1, 4, 5, 1)

# How the kernel's tl.dot treats fp8 operands (int8 ignores it): an int is tl.dot's max_num_imprecise_acc, None
# Triton's default for the GPU, "fp16" converts both tiles to fp16 first (exact for e4m3) and runs a 16-bit dot.
# What max_num_imprecise_acc does (Triton 3.x: language/semantic.py, backends/nvidia/compiler.py, and the C++
# supportMMA in lib/Analysis/Utility.cpp and the WGMMA lowering in the nvidia backend's DotOpToLLVM/WGMMA.cpp),
# which matters on sm_90 only:
#   * None: 2**30 on sm_90 (0 elsewhere): one accumulator inside the wgmma instructions for the whole K loop,
#     which for fp8 keeps fewer mantissa bits than fp32 (DeepSeek-V3's report measured ~14 on H800);
#   * 32 <= v <= BLOCK_K (Triton refuses a larger v; scaled_mm_triton checks first): wgmma into a separate
#     partial accumulator, added to the fp32 one in registers every v elements of K and at the end of each
#     tl.dot; 32 is one instruction's K, so 32 is the most often wgmma can promote (the reduced precision is
#     left within 32 products);
#   * v < 32 (e.g. 0): no wgmma for an fp8 dot with an fp32 accumulator; MMAv2 (mma.sync) runs it instead.
# Tiles of fewer than 64 rows (the skinny decode tile) never use wgmma, whatever the value. 32 stays the
# default until `bench/fp8_gpu_check.py` (op-level section, every candidate on one H100/H200) says otherwise.
FP8_DOT: int | str | None = 32


# --------------------------------------------------------------------------------------------------
# shared by the W8A8 linears (int8 here, float8_e4m3fn in fp8_linear.py)
# --------------------------------------------------------------------------------------------------


def check_scaled_linear(name: str, operand: torch.dtype, x_q: torch.Tensor, x_scale: torch.Tensor,
                        w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None) -> None:
    """ValueError naming the op (`name`) and the field unless x_q [.., K] and w_q [N, K] are `operand` tensors,
    x_scale fp32 [.., 1], w_scale fp32 [N], bias [N] or None, and (int8) K <= INT8_MAX_K."""
    k = x_q.shape[-1]
    n = w_q.shape[0]
    if w_q.dim() != 2 or w_q.shape[1] != k:
        raise ValueError(f"{name}: w_q {tuple(w_q.shape)} must be [N, K] with K = x_q's last dim {k}")
    if x_scale.shape != (*x_q.shape[:-1], 1) or x_scale.dtype != torch.float32:
        raise ValueError(f"{name}: x_scale must be fp32 {(*x_q.shape[:-1], 1)}, got {x_scale.dtype} "
                         f"{tuple(x_scale.shape)}")
    if w_scale.shape != (n,) or w_scale.dtype != torch.float32:
        raise ValueError(f"{name}: w_scale must be fp32 ({n},), got {w_scale.dtype} {tuple(w_scale.shape)}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"{name}: bias must be ({n},), got {tuple(bias.shape)}")
    if x_q.dtype != operand or w_q.dtype != operand:
        raise ValueError(f"{name}: x_q and w_q must be {str(operand).removeprefix('torch.')}, got {x_q.dtype} "
                         f"and {w_q.dtype}")
    if operand == torch.int8 and k > INT8_MAX_K:
        raise ValueError(f"{name}: K = {k} exceeds INT8_MAX_K = {INT8_MAX_K} (int32 overflow)")


def _epilogue_reference(acc: torch.Tensor, x_scale, w_scale, bias, out_dtype, out_shape) -> torch.Tensor:
    """((acc * x_scale) * w_scale + bias) in fp32, then out_dtype: the kernels' epilogue, in torch."""
    y = acc.to(torch.float32) * x_scale.reshape(-1, 1)
    y = y * w_scale[None, :]
    if bias is not None:
        y = y + bias.to(torch.float32)[None, :]
    return y.to(out_dtype).reshape(out_shape)


def int8_matmul_exact(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """a [M, K] int8 @ w [N, K].T int8 -> [M, N] int32, exactly: `torch._int_mm` where it takes the shape
    (any on CPU; on CUDA M > 16 and K, N multiples of 8), else a float64 product (exact below 2**53)."""
    m, k = a.shape
    n = w.shape[0]
    if a.device.type == "cpu" or (m > 16 and k % 8 == 0 and n % 8 == 0 and k >= 16):
        return torch._int_mm(a.contiguous(), w.t())
    return (a.to(torch.float64) @ w.to(torch.float64).t()).to(torch.int32)


def scaled_linear_reference(
    name: str, operand: torch.dtype, x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor,
    w_scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    """Plain torch W8A8 linear for `operand` operands, after check_scaled_linear: int8 -> the exact int32 GEMM
    (`int8_matmul_exact`), float8_e4m3fn -> fp8 to fp32 (exact) and an fp32 GEMM; then the fp32 epilogue."""
    check_scaled_linear(name, operand, x_q, x_scale, w_q, w_scale, bias)
    k, n = x_q.shape[-1], w_q.shape[0]
    a = x_q.reshape(-1, k)
    acc = int8_matmul_exact(a, w_q) if operand == torch.int8 else a.to(torch.float32) @ w_q.to(torch.float32).t()
    return _epilogue_reference(acc, x_scale, w_scale, bias, out_dtype, (*x_q.shape[:-1], n))


def w8a8_fake(name: str, x: torch.Tensor, w_q: torch.Tensor) -> torch.Tensor:
    """The output of a quantize-then-GEMM op (`name`) for fake tensors: [.., N] in x's dtype."""
    if w_q.dim() != 2 or w_q.shape[1] != x.shape[-1]:
        raise ValueError(f"{name}: w_q {tuple(w_q.shape)} must be [N, K] with K = x's last dim {x.shape[-1]}")
    return x.new_empty((*x.shape[:-1], w_q.shape[0]))


def define_scaled_linear_op(name: str, operand: torch.dtype, triton_impl: Callable, reference_impl: Callable):
    """Register `mini_infer::<name>(x_q, x_scale, w_q, w_scale, bias, out_dtype)` for `operand` operands: the
    Triton launcher where use_triton says so, else the reference; its fake checks the arguments."""

    def op(
        x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
        bias: torch.Tensor | None, out_dtype: torch.dtype,
    ) -> torch.Tensor:  # fmt: skip
        impl = triton_impl if use_triton(x_q) else reference_impl
        return impl(x_q, x_scale, w_q, w_scale, bias, out_dtype)

    def fake(x_q, x_scale, w_q, w_scale, bias, out_dtype):
        check_scaled_linear(name, operand, x_q, x_scale, w_q, w_scale, bias)
        return x_q.new_empty((*x_q.shape[:-1], w_q.shape[0]), dtype=out_dtype)

    op.__doc__ = f"W8A8 linear over {operand} operands, dequantized in the epilogue (see {__name__})."
    custom = torch.library.custom_op(f"mini_infer::{name}", op, mutates_args=())
    custom.register_fake(fake)
    return custom


def define_quantized_linear_op(name: str, triton_impl: Callable, reference_impl: Callable):
    """Register `mini_infer::<name>(x, w_q, w_scale, bias)` (quantize x per token, then the GEMM; x's dtype
    out): the Triton launcher where use_triton says so, else the reference; its fake is w8a8_fake."""

    def op(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        impl = triton_impl if use_triton(x) else reference_impl
        return impl(x, w_q, w_scale, bias)

    op.__doc__ = f"Per-token quantization of x, then the W8A8 GEMM ({name}; see {__name__})."
    custom = torch.library.custom_op(f"mini_infer::{name}", op, mutates_args=())
    custom.register_fake(lambda x, w_q, w_scale, bias: w8a8_fake(name, x, w_q))
    return custom


# --------------------------------------------------------------------------------------------------
# reference (plain torch)
# --------------------------------------------------------------------------------------------------


def int8_linear_reference(
    x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
    bias: torch.Tensor | None, out_dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    """Plain-torch W8A8 linear: exact int32 GEMM, fp32 epilogue (see the module docstring)."""
    return scaled_linear_reference("int8_linear", torch.int8, x_q, x_scale, w_q, w_scale, bias, out_dtype)


def w8a8_linear_reference(
    x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """quantize_per_token(x, int8) then int8_linear, output in x's dtype (plain torch)."""
    x_q, x_scale = quantize_per_token_reference(x, torch.int8)
    return int8_linear_reference(x_q, x_scale, w_q, w_scale, bias, x.dtype)


# --------------------------------------------------------------------------------------------------
# Triton
# --------------------------------------------------------------------------------------------------

if HAS_TRITON:
    from mini_infer.ops._split_k import arrives_last
    from mini_infer.ops.linear import gemv_load, gemv_rows, gemv_step

    _DOT_ROWS = tl.constexpr(DOT_ROWS)
    _DOT_COLS = tl.constexpr(DOT_COLS)

    @triton.jit
    def _dequantize(acc, a_scale, w_scale, bias_ptrs, bias_ok, HAS_BIAS: tl.constexpr):
        """((acc * a_scale) * w_scale + bias) in fp32: the one epilogue arithmetic of the GEMM tile and the GEMV
        (broadcast shapes), so an int8 row gets the same bits from either."""
        y = acc.to(tl.float32) * a_scale
        y = y * w_scale
        if HAS_BIAS:
            y = y + tl.load(bias_ptrs, mask=bias_ok, other=0.0).to(tl.float32)
        return y

    @triton.jit
    def _scaled_mm_epilogue(acc, rm, rn, M, N, a_scale_ptr, w_scale_ptr, bias_ptr, c_ptr, s_cm,
                            HAS_BIAS: tl.constexpr):  # fmt: skip
        """c[rm, rn] = ((acc * a_scale[rm]) * w_scale[rn] + bias[rn]) in fp32, cast to c's dtype."""
        m_ok = rm < M
        n_ok = rn < N
        y = _dequantize(acc, tl.load(a_scale_ptr + rm, mask=m_ok, other=0.0)[:, None],
                        tl.load(w_scale_ptr + rn, mask=n_ok, other=0.0)[None, :], bias_ptr + rn[None, :],
                        n_ok[None, :], HAS_BIAS)
        c = c_ptr + rm[:, None].to(tl.int64) * s_cm + rn[None, :]
        tl.store(c, y.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _dot4(acc, w, x, ASM: tl.constexpr):
        """acc + the dot products of the four signed bytes packed in each int32 of w and x, exactly: PTX dp4a
        (one instruction per four products) when ASM, else the bytes sign-extended by shifts (the interpreter,
        which runs no PTX; the same int32)."""
        if ASM:
            return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [w, x, acc],
                                             dtype=tl.int32, is_pure=True, pack=1)
        else:
            for j in tl.static_range(4):
                acc += ((w << (24 - 8 * j)) >> 24) * ((x << (24 - 8 * j)) >> 24)
            return acc

    @triton.jit
    def _padded_row_dot(x_ptr, w_rows, row_ok, k_lo, k_hi, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """x [K] . w[row] over columns k_lo..k_hi for the BLOCK_N weight rows, fp32, on tensor cores (fp8 operands:
        `FP8_GEMV` "dot"): the weight tile goes to `tl.dot` as it was loaded (no conversion; fp32 accumulation) and
        the one row x is padded with rows masked to zero (never read from memory). Which operand is which, by
        BLOCK_N: below DOT_ROWS, x is row 0 of a DOT_ROWS-row A tile and the weights are B (x . w.T: any BLOCK_N,
        the GEMV's split of N; the zero rows cost the tensor cores and shared memory DOT_ROWS / BLOCK_N times the
        weight bytes); from DOT_ROWS on, the weights are A and x column 0 of a DOT_COLS-column B (w . x.T: little
        padding, but BLOCK_N rows a program). Either way the weights stream BLOCK_K columns a step, as `gemv_step`
        streams them. k_lo is a multiple of BLOCK_K and k_hi either one or K (a split's range: `_split_range`), so
        only K masks columns."""
        if BLOCK_N < _DOT_ROWS:
            pad = tl.arange(0, _DOT_ROWS)[:, None] == 0
            acc = tl.zeros([_DOT_ROWS, BLOCK_N], tl.float32)
        else:
            pad = tl.arange(0, _DOT_COLS)[:, None] == 0
            acc = tl.zeros([BLOCK_N, _DOT_COLS], tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            col_ok = cols < K
            x = tl.load(x_ptr + cols[None, :], mask=pad & col_ok[None, :], other=0.0)
            w = gemv_load(w_rows, row_ok, cols, col_ok)
            if BLOCK_N < _DOT_ROWS:
                acc = tl.dot(x, tl.trans(w), acc, max_num_imprecise_acc=BLOCK_K)
            else:
                acc = tl.dot(w, tl.trans(x), acc, max_num_imprecise_acc=BLOCK_K)
        # the padding's rows / columns are zero: the sum is x's row / column
        return tl.sum(acc, axis=0) if BLOCK_N < _DOT_ROWS else tl.sum(acc, axis=1)

    @triton.jit
    def _split_range(K, SPLIT_K: tl.constexpr, BLOCK_K: tl.constexpr):
        """(split, k_lo, k_hi): this program's split of K (grid axis 1) in whole BLOCK_K steps, the last one cut by
        K (empty when K has fewer steps than splits)."""
        split = tl.program_id(1)
        per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
        k_lo = split * per_split
        return split, k_lo, tl.minimum(k_lo + per_split, K)

    @triton.jit
    def _merged_splits(dots, split, rows, row_ok, N, ws_ptr, cnt_ptr, SPLIT_K: tl.constexpr):
        """Split-K's merge in the launch: this split's partial dots go to ws[split, rows], then a count at cnt_ptr
        (this row block's counter, zero between launches); (the SPLIT_K partials summed in split order,
        whatever the arrival order: deterministic; True) for the split that arrives last, which has reset the
        counter, else (its own partial, False)."""
        tl.store(ws_ptr + split * N + rows, dots, mask=row_ok)
        last = arrives_last(cnt_ptr, SPLIT_K)
        total = dots
        if last:
            total = tl.load(ws_ptr + rows, mask=row_ok, other=0)
            for s in tl.static_range(1, SPLIT_K):
                total += tl.load(ws_ptr + s * N + rows, mask=row_ok, other=0)
        return total, last

    @triton.jit
    def scaled_gemv_program(
        x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, b_ptr, y_ptr, N, K, stride_wn, ws_ptr, cnt_ptr,
        HAS_BIAS: tl.constexpr, ACC_DTYPE: tl.constexpr, PACKED: tl.constexpr, ASM: tl.constexpr, DOT: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_GDC: tl.constexpr, SPLIT_K: tl.constexpr = 1,
    ):  # fmt: skip
        """The scaled GEMV's body (launched alone as `_scaled_gemv_kernel`; kernels that do more after it call it as
        their first part: linear_add_rms_norm.py): y = ((x . w[n]) * x_scale * w_scale[n] + bias[n]) for one
        quantized row x [K] and BLOCK_N weight rows per program (linear.py's GEMV tiling). ACC_DTYPE int32 (int8
        operands): every product and sum exact, the same int32 as the GEMM tile's; fp32 (fp8 operands): the products
        are exact, only the order of the fp32 sums differs from the tile's. PACKED (int8): x and w are int32 views,
        four bytes a word (K, stride_wn and BLOCK_K count words), multiplied by `_dot4`. DOT (fp8): the products on
        tensor cores instead (`_padded_row_dot`), K cut into SPLIT_K splits over grid axis 1 (`_split_range`) whose
        partials meet in `_merged_splits` (fp32 workspace ws_ptr [SPLIT_K, N], this row block's counter at
        cnt_ptr[1 + program_id(0)]; cnt_ptr[0] is left to the caller). Returns whether this program stored its
        outputs: always without splits, only the row block's last split with them."""
        await_producers(USE_GDC)
        rows, row_ok, w_rows, acc = gemv_rows(w_ptr, N, stride_wn, BLOCK_N, BLOCK_K, ACC_DTYPE)
        if DOT:
            split, k_lo, k_hi = _split_range(K, SPLIT_K, BLOCK_K)
            dots = _padded_row_dot(x_ptr, w_rows, row_ok, k_lo, k_hi, K, BLOCK_N, BLOCK_K)
        else:
            for k0 in range(0, K, BLOCK_K):
                cols = k0 + tl.arange(0, BLOCK_K)
                col_ok = cols < K
                x = tl.load(x_ptr + cols, mask=col_ok, other=0.0).to(ACC_DTYPE)
                if PACKED:
                    w = gemv_load(w_rows, row_ok, cols, col_ok)
                    acc = _dot4(acc, w, tl.broadcast_to(x[None, :], (BLOCK_N, BLOCK_K)), ASM)
                else:
                    acc = gemv_step(acc, w_rows, row_ok, cols, col_ok, x)
            dots = tl.sum(acc, axis=1)
        stores = True
        if SPLIT_K > 1:
            dots, stores = _merged_splits(dots, split, rows, row_ok, N, ws_ptr, cnt_ptr + 1 + tl.program_id(0),
                                          SPLIT_K)
        if stores:
            y = _dequantize(dots, tl.load(x_scale_ptr), tl.load(w_scale_ptr + rows, mask=row_ok, other=0.0),
                            b_ptr + rows, row_ok, HAS_BIAS)
            tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)
        return stores

    @triton.jit
    def _scaled_gemv_kernel(
        x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, b_ptr, y_ptr, N, K, stride_wn, ws_ptr, cnt_ptr,
        HAS_BIAS: tl.constexpr, ACC_DTYPE: tl.constexpr, PACKED: tl.constexpr, ASM: tl.constexpr, DOT: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_GDC: tl.constexpr, SPLIT_K: tl.constexpr = 1,
    ):  # fmt: skip
        """`scaled_gemv_program` as a kernel of its own (a kernel returns nothing: the program's flag is dropped)."""
        scaled_gemv_program(x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, b_ptr, y_ptr, N, K, stride_wn, ws_ptr, cnt_ptr,
                            HAS_BIAS, ACC_DTYPE, PACKED, ASM, DOT, BLOCK_N, BLOCK_K, USE_GDC, SPLIT_K)

    @triton.jit
    def _scaled_mm_kernel(
        a_ptr, w_ptr, a_scale_ptr, w_scale_ptr, bias_ptr, c_ptr, ws_ptr, cnt_ptr, M, N, K, s_am, s_wn, s_cm,
        HAS_BIAS: tl.constexpr, ACC_DTYPE: tl.constexpr, ZERO: tl.constexpr, EVEN_K: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        SPLIT_K: tl.constexpr, MAX_IMPRECISE_ACC: tl.constexpr, UPCAST_FP16: tl.constexpr, USE_GDC: tl.constexpr,
    ):  # fmt: skip
        """C = A @ W.T with a per-row / per-column scaled epilogue. A [M, K] and W [N, K] are K-contiguous (W's
        tile is loaded K-major, the layout tensor cores want for B). Tiles are ordered in groups of GROUP_M
        row tiles so that neighbouring programs share W tiles in L2. With SPLIT_K > 1 (int32 accumulators
        only), program (tile, split) sums one K range and adds it atomically into the int32 workspace
        `ws` [M, N]; the last split to arrive at a tile (counted in `cnt`) takes the sum out of the workspace,
        zeroing it and the count for the next call, and runs the epilogue. Integer adds in any order give the
        same sum, so the result is that of SPLIT_K = 1."""
        await_producers(USE_GDC)
        pid = tl.program_id(0)
        split = tl.program_id(1)
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * num_n
        first_m = (pid // per_group) * GROUP_M
        group_m = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % group_m
        pid_n = (pid % per_group) // group_m
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        k_lo = 0
        k_hi = K
        if SPLIT_K > 1:
            per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
            k_lo = split * per_split
            k_hi = tl.minimum(k_lo + per_split, K)
        # rows / columns past the end read row M-1 / N-1 (never stored): the loads need no M/N mask
        a_ptrs = a_ptr + tl.minimum(rm, M - 1)[:, None].to(tl.int64) * s_am + (k_lo + rk)[None, :]
        w_ptrs = w_ptr + tl.minimum(rn, N - 1)[None, :].to(tl.int64) * s_wn + (k_lo + rk)[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=ACC_DTYPE)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs)
                w = tl.load(w_ptrs)
            else:
                k_ok = k0 + rk < K
                a = tl.load(a_ptrs, mask=k_ok[None, :], other=ZERO)
                w = tl.load(w_ptrs, mask=k_ok[:, None], other=ZERO)
            # fp8: how the products are accumulated (MAX_IMPRECISE_ACC, UPCAST_FP16) is FP8_DOT's choice
            if UPCAST_FP16:
                acc = tl.dot(a.to(tl.float16), w.to(tl.float16), acc, out_dtype=ACC_DTYPE)
            else:
                acc = tl.dot(a, w, acc, out_dtype=ACC_DTYPE, max_num_imprecise_acc=MAX_IMPRECISE_ACC)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if SPLIT_K > 1:
            ws = ws_ptr + rm[:, None].to(tl.int64) * N + rn[None, :]
            in_c = (rm < M)[:, None] & (rn < N)[None, :]
            tl.atomic_add(ws, acc, mask=in_c)
            if tl.atomic_add(cnt_ptr + pid, 1) == SPLIT_K - 1:  # acq_rel: every split's adds are visible
                acc = tl.atomic_xchg(ws, tl.zeros_like(acc), mask=in_c)
                tl.atomic_xchg(cnt_ptr + pid, 0)
                _scaled_mm_epilogue(acc, rm, rn, M, N, a_scale_ptr, w_scale_ptr, bias_ptr, c_ptr, s_cm, HAS_BIAS)
        else:
            _scaled_mm_epilogue(acc, rm, rn, M, N, a_scale_ptr, w_scale_ptr, bias_ptr, c_ptr, s_cm, HAS_BIAS)


_SPLIT_K_WORKSPACE: dict = {}  # device -> (int32 workspace, int32 tile counters), all zero between calls


def _split_k_workspace(device: torch.device, n_acc: int, n_tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed int32 buffers of at least n_acc / n_tiles elements, kept per device and left zeroed by the kernel.
    Grown on first need: make the first call of each shape before capturing a CUDA graph (as for Triton's
    compile). Launches on several streams at once must not share them (the engine uses one stream)."""
    ws, cnt = _SPLIT_K_WORKSPACE.get(device, (None, None))
    if ws is None or ws.numel() < n_acc or cnt.numel() < n_tiles:
        n_acc = max(n_acc, ws.numel() if ws is not None else 0)
        n_tiles = max(n_tiles, cnt.numel() if cnt is not None else 0)
        ws = torch.zeros(n_acc, dtype=torch.int32, device=device)
        cnt = torch.zeros(n_tiles, dtype=torch.int32, device=device)
        _SPLIT_K_WORKSPACE[device] = (ws, cnt)
    return ws, cnt


def scaled_mm_config(m: int, fp8: bool = False) -> tuple[int, int, int, int, int, int, int]:
    """The launch tile for M rows: (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages, SPLIT_K)."""
    if fp8 and m <= SMALL_M:
        return _FP8_SMALL_M_CONFIG
    for max_m, cfg in _CONFIGS:
        if max_m is None or m <= max_m:
            return cfg
    raise AssertionError("unreachable: the last config takes any M")


def scaled_mm_triton(
    x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
    bias: torch.Tensor | None, out_dtype: torch.dtype, config: tuple | None = None, *,
    fp8_dot: int | str | None = FP8_DOT,
) -> torch.Tensor:  # fmt: skip
    """Triton `((x_q @ w_q.T) * x_scale * w_scale + bias).to(out_dtype)` for int8 (int32 accumulation) or
    float8_e4m3fn (fp32 accumulation) operands. `config` overrides the M-bucket tile (benchmark sweeps),
    `fp8_dot` the fp8 dot's accumulation (see FP8_DOT; an int above the tile's BLOCK_K is refused)."""
    if not HAS_TRITON:
        raise RuntimeError("scaled_mm_triton needs triton")
    k, n = x_q.shape[-1], w_q.shape[0]
    a = x_q.reshape(-1, k)
    if a.stride(-1) != 1:
        a = a.contiguous()
    w = w_q if w_q.stride(-1) == 1 else w_q.contiguous()
    m = a.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=x_q.device)
    if m and n:
        if k == 0:
            out.copy_(bias.to(out_dtype).expand(m, n) if bias is not None else torch.zeros_like(out))
        else:
            is_int = x_q.dtype == torch.int8  # int32 accumulation; fp8: fp32 (ZERO: the masked loads' fill)
            bm, bn, bk, gm, warps, stages, split_k = config or scaled_mm_config(m, fp8=not is_int)
            upcast = not is_int and fp8_dot == "fp16"
            if not (is_int or fp8_dot in (None, "fp16") or (isinstance(fp8_dot, int) and 0 <= fp8_dot <= bk)):
                raise ValueError(f"scaled_mm_triton: fp8_dot must be None, 'fp16' or an int in [0, BLOCK_K = {bk}],"
                                 f" got {fp8_dot!r}")
            split_k = min(split_k, triton.cdiv(k, bk)) if is_int else 1  # float partials would add in any order
            tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
            ws = cnt = out  # unused unless split_k > 1
            if split_k > 1:
                ws, cnt = _split_k_workspace(out.device, m * n, tiles)
            _scaled_mm_kernel[(tiles, split_k)](
                a, w, x_scale.reshape(-1).contiguous(), w_scale.contiguous(),
                bias if bias is not None else w_scale, out, ws, cnt, m, n, k, a.stride(0), w.stride(0), out.stride(0),
                HAS_BIAS=bias is not None, ACC_DTYPE=tl.int32 if is_int else tl.float32, ZERO=0 if is_int else 0.0,
                EVEN_K=k % bk == 0, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, SPLIT_K=split_k,
                MAX_IMPRECISE_ACC=0 if is_int or upcast else fp8_dot, UPCAST_FP16=upcast,
                num_warps=warps, num_stages=stages, **pdl_args(a),
            )  # fmt: skip
    return out.reshape(*x_q.shape[:-1], n)


def takes_scaled_gemv(m: int, k: int, n: int) -> bool:
    """Whether an M x K by N x K W8A8 product runs the GEMV (`scaled_gemv_triton`) rather than the GEMM tile: one
    row (the batch-1 decode step) of a non-empty product. Shapes only: CUDA-graph safe."""
    return HAS_TRITON and m == 1 and k > 0 and n > 0


def _packs_int8(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether int8 x [K] and w [N, K] (unit stride along K) can be read as int32 words of four: K, w's row
    stride and both start addresses multiples of 4 (the same for every call of a CUDA graph's captured tensors)."""
    return (x.dtype == torch.int8 and x.shape[-1] % 4 == 0 and w.stride(0) % 4 == 0 and x.data_ptr() % 4 == 0
            and w.data_ptr() % 4 == 0)


def fp8_gemv_dot(dtype: torch.dtype, k: int, fp8_gemv: str | None = None) -> bool:
    """Whether the one-row GEMV of `dtype` operands and rows of `k` elements runs its products on tensor cores: fp8
    operands and the fp8 GEMV mode `fp8_gemv` (None: the module's FP8_GEMV, looked up at the call) "dot", or
    "auto" with k < FP8_GEMV_DOT_MAX_K; int8 never."""
    mode = FP8_GEMV if fp8_gemv is None else fp8_gemv
    if mode not in FP8_GEMV_MODES:
        raise ValueError(f"fp8_gemv must be one of {FP8_GEMV_MODES}, got {mode!r}")
    return dtype != torch.int8 and (mode == "dot" or (mode == "auto" and k < FP8_GEMV_DOT_MAX_K))


def scaled_gemv_config(dtype: torch.dtype, k: int, fp8_gemv: str | None = None) -> tuple[int, int, int, int]:
    """The one-row GEMV's default tile for quantized activations of `dtype`, rows of K elements and the fp8 GEMV
    mode `fp8_gemv` (`fp8_gemv_dot`)."""
    if dtype == torch.int8:
        return SCALED_GEMV_CONFIG
    if fp8_gemv_dot(dtype, k, fp8_gemv):
        return SCALED_GEMV_CONFIG_FP8_DOT
    return SCALED_GEMV_CONFIG_FP8_LONG_K if k >= FP8_GEMV_LONG_K else SCALED_GEMV_CONFIG_FP8


def gemv_split_k(n: int, k: int, config: tuple[int, ...], device: torch.device) -> int:
    """The split count of a tensor-core GEMV over an [n, k] weight at tile `config`: its fifth element if it has one,
    else by GEMV_DOT_SPLIT_PER_SM (the note above it) on a CUDA device, else 1."""
    if len(config) > 4:
        return int(config[4])
    if not GEMV_DOT_SPLIT_PER_SM or device.type != "cuda":
        return 1
    block_n, block_k = config[0], config[1]
    blocks = triton.cdiv(n, block_n)
    target = GEMV_DOT_SPLIT_PER_SM * num_sms(cuda_index(device))
    by_steps = max(1, k // (block_k * GEMV_DOT_MIN_SPLIT_STEPS))
    return 1 << (min(max(1, target // blocks), by_steps).bit_length() - 1)  # the power of two at or below both


def scaled_gemv_triton(
    x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
    bias: torch.Tensor | None, out_dtype: torch.dtype, config: tuple[int, ...] | None = None,
    *, pack_int8: bool = True, fp8_gemv: str | None = None,
) -> torch.Tensor:  # fmt: skip
    """`scaled_mm_triton`'s product for one row (x_q holds exactly K elements, any leading dims of size 1) on
    linear.py's GEMV tiling: BLOCK_N weight rows per program, streamed BLOCK_K columns at a time. int8: the same
    int32 and epilogue as the tile, so the same bits, read as int32 words of four bytes (dp4a on a GPU) where
    `_packs_int8` allows and `pack_int8`, else byte by byte; fp8: fp32 sums in another order, on CUDA cores or
    tensor cores as `fp8_gemv` says (None: FP8_GEMV).
    `config` (BLOCK_N, BLOCK_K in elements, num_warps, num_stages[, split count for tensor cores]) overrides
    `scaled_gemv_config`'s tile and `gemv_split_k`'s split (benchmark sweeps)."""
    if not HAS_TRITON:
        raise RuntimeError("scaled_gemv_triton needs triton")
    n, k = w_q.shape
    if x_q.numel() != k or x_scale.numel() != 1:
        raise ValueError(f"scaled_gemv_triton: one row of K = {k} and one scale, got x_q {tuple(x_q.shape)} and "
                         f"x_scale {tuple(x_scale.shape)}")
    y = torch.empty((*x_q.shape[:-1], n), dtype=out_dtype, device=x_q.device)
    launch_scaled_gemv(_scaled_gemv_kernel, x_q, x_scale, w_q, w_scale, bias, y, config=config, pack_int8=pack_int8,
                       fp8_gemv=fp8_gemv)
    return y


def launch_scaled_gemv(
    kernel, x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
    bias: torch.Tensor | None, y: torch.Tensor, *args, config: tuple[int, ...] | None = None,
    pack_int8: bool = True, fp8_gemv: str | None = None, **constexprs,
) -> None:  # fmt: skip
    """Launch a kernel whose body starts with `scaled_gemv_program` (one quantized row x_q of K elements times w_q
    [N, K].T into y [N]) with that body's arguments, then `args` and `constexprs`; the tile, the int8 packing, the
    products' units and the split as `scaled_gemv_triton` describes. The counters it hands the body (`split_counters`)
    keep element 0 for the kernel's own use (linear_add_rms_norm.py's last-arriving program), zero between launches."""
    n, k = w_q.shape
    w = w_q if w_q.stride(-1) == 1 else w_q.contiguous()
    xr = unit_stride_row(x_q)
    ws = w_scale.contiguous()
    dot = fp8_gemv_dot(x_q.dtype, k, fp8_gemv)
    if config is None:
        config = scaled_gemv_config(x_q.dtype, k, fp8_gemv)
    split_k = gemv_split_k(n, k, config, x_q.device) if dot else 1
    bn, bk, warps, stages = config[:4]
    if dot and (bk < 32 or bk & (bk - 1) or bn & (bn - 1)):
        raise ValueError(f"the tensor-core GEMV needs BLOCK_K a power of two >= 32 (one mma's K) and BLOCK_N a power "
                         f"of two, got {config}")
    if split_k < 1:
        raise ValueError(f"a tensor-core GEMV splits K into at least one split; got {config}")
    blocks = triton.cdiv(n, bn)
    cnt = split_counters(x_q.device, 1 + (blocks if split_k > 1 else 0))
    partials = torch.empty((split_k, n), dtype=torch.float32, device=x_q.device) if split_k > 1 else cnt
    packed = pack_int8 and _packs_int8(xr, w)
    if packed:  # int32 words of four int8s: K, the row stride and the K step in words
        xr, w, k, bk = xr.view(torch.int32), w.view(torch.int32), k // 4, max(bk // 4, 1)
    launch_gemv(kernel, w, xr, x_scale, w, ws, bias if bias is not None else ws, y, n, k, w.stride(0), partials, cnt,
                *args, config=(bn, bk, warps, stages), splits=split_k, HAS_BIAS=bias is not None,
                ACC_DTYPE=tl.int32 if x_q.dtype == torch.int8 else tl.float32, PACKED=packed,
                ASM=packed and x_q.is_cuda and torch.version.hip is None, DOT=dot, SPLIT_K=split_k, **constexprs)


def scaled_linear_triton(
    x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
    bias: torch.Tensor | None, out_dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    """The Triton W8A8 linear for any M, chosen by shape: one row -> the GEMV (`takes_scaled_gemv`), more ->
    `scaled_mm_triton` with the tile of M's bucket."""
    k, n = x_q.shape[-1], w_q.shape[0]
    if takes_scaled_gemv(x_q.numel() // k if k else 0, k, n):
        return scaled_gemv_triton(x_q, x_scale, w_q, w_scale, bias, out_dtype)
    return scaled_mm_triton(x_q, x_scale, w_q, w_scale, bias, out_dtype)


def int8_linear_triton(
    x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
    bias: torch.Tensor | None, out_dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    """The CUDA path: the GEMV for one row, else the Triton kernel with the tile of M's bucket (skinny for
    M <= SMALL_M)."""
    check_scaled_linear("int8_linear", torch.int8, x_q, x_scale, w_q, w_scale, bias)
    return scaled_linear_triton(x_q, x_scale, w_q, w_scale, bias, out_dtype)


def w8a8_linear_triton(
    x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """Triton quantize_per_token(x, int8) then the int8 GEMM, output in x's dtype."""
    x_q, x_scale = quantize_per_token_triton(x, torch.int8)
    return int8_linear_triton(x_q, x_scale, w_q, w_scale, bias, x.dtype)


# --------------------------------------------------------------------------------------------------
# the registered ops
# --------------------------------------------------------------------------------------------------

int8_linear = define_scaled_linear_op("int8_linear", torch.int8, int8_linear_triton, int8_linear_reference)
w8a8_linear = define_quantized_linear_op("w8a8_linear", w8a8_linear_triton, w8a8_linear_reference)
