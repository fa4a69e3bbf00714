"""`mini_infer::linear`: `x @ weight.T + bias`, with a Triton GEMV for single-row inputs on CUDA.

Inserted by the GemvLinear pass in place of `aten.linear` on weight parameters. A decode step at batch size
1 multiplies one row by every weight of the model; there cuBLAS's kernels for M = 1 leave bandwidth unused
on some shapes (bench/kernel_gemv.py: 57-90% of copy bandwidth for o_proj and the merged gate_up on an H200,
65-98% with this kernel). So: one row and K <= `GEMV_MAX_K` -> the GEMV kernel; anything else (prefill,
batches, very long rows such as down_proj's, where cuBLAS's split-K is as fast) -> `F.linear`. The choice
depends only on shapes, so a CUDA graph captured for one batch size keeps its kernel. The tiling is a set of
@triton.jit pieces (`gemv_rows`, `gemv_load` / `gemv_step`, `gemv_accumulate` (the K loop), `gemv_store`;
`gemv_program`, the kernel itself) and a launcher (`launch_gemv`) that other single-row kernels build on
(rms_norm_linear.py: the norm as the GEMV's prologue; linear_add.py: the residual add in its epilogue;
linear_add_rms_norm.py: the next add + norm in its last program; int8_linear.py: the W8A8 GEMV, int8 or fp8
weights into an int32 or fp32 accumulator). The weight preload before the PDL wait lives here too (`PRELOAD_MAX_K`,
`preload_width`, `gemv_preload`, `preloaded_acc`, `chunk_sums`, `gemv_after_wait`), taken by the GEMVs that follow
a kernel leaving SMs idle (linear_add.py, linear_add_rms_norm.py: o_proj after attention, down_proj after gate_up;
`gemv_triton` for weights up to LINEAR_PRELOAD_MAX_BYTES: an MoE router after o_proj's add + norm tail):
rows of at most PRELOAD_MAX_K elements are loaded whole before `await_producers` (longer ones, in linear_add.py, a
prefix: `PREFIX_PRELOAD_K`, `prefix_preload_width`), then their K chunks are added in the K loop's order, so the
sums are the loop's (bit for bit under the interpreter; on a GPU the compiler may contract
the loop's multiply-adds into FMAs, the preload's not). Imports nothing from mini_infer outside `mini_infer.ops`.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from mini_infer.ops._triton_support import (
    HAS_TRITON,
    await_producers,
    next_pow2,
    pdl_args,
    tl,
    triton,
    use_triton,
)

__all__ = ["GEMV_MAX_K", "LINEAR_PRELOAD_MAX_BYTES", "PREFIX_PRELOAD_K", "PRELOAD_MAX_K", "gemv_config", "gemv_triton",
           "launch_gemv", "linear", "linear_reference", "linear_triton", "prefix_preload_width", "preload_width",
           "takes_gemv", "unit_stride_row"]

# Rows up to GEMV_MAX_K elements take the GEMV (every dense preset's down_proj: 14336-18944); longer ones cuBLAS.
# In isolation cuBLAS and the GEMV tie on the long rows (qwen2.5-7b down_proj 37.0 vs 38.1 us, llama-3.1-8b 30.8 vs
# 30.9), but in the engine the GEMV keeps the step's launch chain (PDL) and carries the residual add in its
# epilogue: batch-1 decode with rows up to 32768 on the GEMV vs up to 8192, same lease, alternated twice (H200,
# 2026-11-24, bench/RESULTS.md twelfth session): qwen2.5-7b 251.6 / 251.7 vs 247.0 / 247.0 tok/s, llama-3.1-8b
# 231.0 / 231.0 vs 225.8 / 225.8. MINI_INFER_GEMV_MAX_K (read once, at import) sets another limit.
GEMV_MAX_K = int(os.environ.get("MINI_INFER_GEMV_MAX_K", "32768"))
# (weight rows per program, K elements per step, warps, pipeline stages), by K (`gemv_config`). H200, weights cold in
# L2, 2026-11-24 (bench/RESULTS.md): 2 rows x 1024 beat 4 x 512 by 27-37% on the short-N shapes of qwen3-0.6b and
# qwen3-30b-a3b (o_proj 3.3 vs 4.5 us, down_proj 4.0 vs 6.3, 30b o_proj 6.4 vs 8.4), and were within 3% either way
# on qwen2.5-7b's (gate_up 63.7 vs 65.5, o_proj 9.6 vs 9.3). Rows shorter than 1024 keep the 512 step.
# Wide products of 1024-2047-element rows (an lm_head over a 1024 hidden size) take 4 rows x 512 in two pipelined
# steps: H200 2026-11-24 (bench/RESULTS.md, ninth session), qwen3-0.6b's lm_head 151936 x 1024 73.6 us (4.23 TB/s)
# against 92.1 with 2 x 1024 (one step, nothing to pipeline); at K >= 2048 the 2 x 1024 tile stays ahead (30b
# lm_head 137.4 vs 141.3, qwen2.5-7b 240.7 vs 244.9, llama-3.1-8b 235.0 vs 251.5).
GEMV_CONFIG_LONG_K = (2, 1024, 4, 1)
GEMV_CONFIG_XLONG_K = (2, 1024, 4, 4)  # rows over 8192: the best tile of qwen2.5-7b's down_proj (kernel_gemv_h200.json)
GEMV_CONFIG_SHORT_K = (4, 512, 4, 1)
GEMV_CONFIG_WIDE_1K = (4, 512, 4, 2)
WIDE_N = 32768  # "wide": at least this many rows (vocabularies)
# Rows of at most this many elements are loaded whole before the PDL wait by the launches that ask for it
# (`launch_gemv(preload=True)`: linear_add, linear_add_rms_norm): the programs already resident while the kernel before
# this one runs (at batch 1 a latency-bound decode attention before o_proj, a gate_up GEMV before down_proj) stream
# their weights then, instead of after it. Weights are never written by an earlier kernel, so reading them before the
# wait is safe. Measured on an H200 (bf16, batch 1, `bench/latency.py`, processes alternated in one lease):
# - 2026-11-24, first build (linear_add only, one tl.sum): qwen3-0.6b 1,354.7 / 1,355.0 tok/s vs 1,252.0 / 1,252.8
#   off; qwen2.5-7b (o_proj K 3,584, preloaded up to 4,096) 249.8 / 249.7 vs 250.2 / 250.1: so rows up to 3,072.
# - 2026-11-24, later (`chunk_sums`: the loop's bits), per kernel at qwen3-0.6b, two rounds: off 1,254.2 / 1,254.1;
#   linear_add 1,335.0 / 1,335.6; + linear_add_rms_norm 1,336.4 / 1,337.2; + rms_norm_linear (qkv) 1,284.6 /
#   1,283.9; + rms_norm_linear_silu (gate_up) 1,254.5 / 1,254.9; + gemv_program (lm_head) 1,309.5 / 1,308.7; every
#   kernel 1,162.7 / 1,175.4. The GEMVs after a full-GPU GEMV lose (their preloaded rows hold registers and compete
#   for bandwidth with the kernel they overlap), so only the two after idle-SM kernels preload. Again in the
#   twenty-ninth session, with the next kernel launched before each wait (PDL_TRIGGER_FIRST): q/k/v and gate_up
#   preloading, qwen3-0.6b 1,418.7 / 1,425.0 vs 1,501.7 / 1,513.2 tok/s.
# - 2026-11-24, rows up to 4,096 (o_proj preloaded at K 4,096): qwen3-30b-a3b 341.1 vs 344.4, llama-3.1-8b 226.8 /
#   226.8 vs 227.8 / 227.9: kept at 3,072.
# - 2026-11-25, after the decode attention before o_proj took its "decode_split" shape and its own preload
#   (`bench/latency.py --switch linear.PRELOAD_MAX_K=4096`, engines in one process): mistral-7b 248.5 vs 246.4,
#   llama-3.1-8b 236.8 vs 235.4, qwen3-30b-a3b 372.0 vs 369.2 (both with the rotary in the attention launch at
#   groups up to 8): so rows up to 4,096 (o_proj of every model here but the 0.6B's, whose rows were already in).
# MINI_INFER_GEMV_PRELOAD_MAX_K (read once, at import) overrides the limit; 0 turns the preload off.
PRELOAD_MAX_K = int(os.environ.get("MINI_INFER_GEMV_PRELOAD_MAX_K", "4096"))
# Rows longer than PRELOAD_MAX_K (down_proj of the 7-8B models: 14,336-18,944 elements, after a full-GPU gate_up
# GEMV whose tail leaves SMs idle): linear_add may load their first PREFIX_PRELOAD_K elements (a power of two, 1, 2
# or 4 K steps of the tile) before the wait and the rest in the loop after it (`prefix_preload_width`). H200, bf16,
# batch 1, engines in one process (2026-11-25, bench/RESULTS.md), off / 2,048 / 4,096: mistral-7b 249.1 / 249.7 /
# 251.4 tok/s, llama-3.1-8b 238.4 / 239.1 / 240.7, qwen2.5-7b 258.9 / 259.8 / 264.2. Read at each launch
# (MINI_INFER_GEMV_PREFIX_PRELOAD_K at import; 0 turns it off).
PREFIX_PRELOAD_K = int(os.environ.get("MINI_INFER_GEMV_PREFIX_PRELOAD_K", "4096"))
# Plain one-row linears (`gemv_triton`: an MoE router, a q/k/v GEMV whose norm runs in a launch of its own, lm_head)
# whose weight holds at most this many bytes load their rows before the PDL wait as linear_add's do (rows up to
# PRELOAD_MAX_K). In qwen3-30b-a3b's batch-1 timeline (thirtieth session) the router GEMV (128 x 2,048, 0.5 MB)
# is exposed 3.0-3.3 us after o_proj's add + norm tail, and q/k/v (21 MB) 6.8-7.5 after a one-program norm: both
# follow kernels that leave SMs idle. H200, batch 1, engines in one process (thirty-sixth session, bench/RESULTS.md):
# qwen3-30b-a3b off 373.3-374.0 tok/s, 1 MiB (the router) 379.1, 32 MiB (router and q/k/v) 381.8-382.8; but
# qwen1.5-moe-a2.7b off 503.3-503.5, 1 MiB 503.8, 32 MiB 498.6-499.5 (a 1-32 MiB GEMV there follows a full-GPU one);
# deepseek-v2-lite 358.0 / 358.5 either way. So 1 MiB: the routers, which never lost. Vocabulary-wide lm_heads stay
# far above it (qwen3-0.6b's 311 MB: preloading it lost 2% in the twelfth session). 0 turns it off. Read at each
# launch (MINI_INFER_LINEAR_PRELOAD_MAX_BYTES at import).
LINEAR_PRELOAD_MAX_BYTES = int(os.environ.get("MINI_INFER_LINEAR_PRELOAD_MAX_BYTES", str(1 << 20)))


def linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


if HAS_TRITON:
    from mini_infer.ops._triton_support import WEIGHT_EVICT

    @triton.jit
    def gemv_rows(w_ptr, N, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  ACC_DTYPE: tl.constexpr = tl.float32):  # fmt: skip
        """This program's BLOCK_N weight rows: (row indices, which exist, their pointers, a zero accumulator of
        ACC_DTYPE: fp32 for float weights, int32 for int8 ones (int8_linear.py's GEMV))."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        w_rows = w_ptr + rows[:, None].to(tl.int64) * stride_wn
        return rows, rows < N, w_rows, tl.zeros([BLOCK_N, BLOCK_K], ACC_DTYPE)

    @triton.jit
    def gemv_load(w_rows, row_ok, cols, col_ok):
        """The weight rows' columns `cols` [BLOCK_N, BLOCK_K], zero where a row or column does not exist; L2 eviction
        policy _triton_support.WEIGHT_EVICTION."""
        return tl.load(w_rows + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0,
                       eviction_policy=WEIGHT_EVICT)

    @triton.jit
    def gemv_step(acc, w_rows, row_ok, cols, col_ok, x):
        """One K-step: acc [BLOCK_N, BLOCK_K] + the weight rows' columns `cols` times `x` (the row's values at
        `cols`, in acc's dtype; the weights are converted to it too: exact for bf16/fp16/fp8 -> fp32 and
        int8 -> int32)."""
        return acc + gemv_load(w_rows, row_ok, cols, col_ok).to(acc.dtype) * x[None, :]

    @triton.jit
    def add_bias(y, b_ptr, rows, row_ok, HAS_BIAS: tl.constexpr):
        """This program's fp32 outputs y [BLOCK_N] plus bias[rows] (HAS_BIAS), in fp32."""
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        return y

    @triton.jit
    def gemv_store(acc, b_ptr, y_ptr, rows, row_ok, HAS_BIAS: tl.constexpr):
        """y[rows] = the accumulated dot products (+ bias), cast to y's dtype."""
        y = add_bias(tl.sum(acc, axis=1), b_ptr, rows, row_ok, HAS_BIAS)
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)

    @triton.jit
    def gemv_steps(acc, x_ptr, w_rows, row_ok, k_start, K, BLOCK_K: tl.constexpr):
        """`gemv_step` over the K steps from `k_start` (a multiple of BLOCK_K) to K, the input x loaded a step at a
        time: the K loop of `gemv_accumulate` (from 0) and of a preloaded prefix's rest (`gemv_after_wait`)."""
        for k0 in range(k_start, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            col_ok = cols < K
            x = tl.load(x_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
            acc = gemv_step(acc, w_rows, row_ok, cols, col_ok, x)
        return acc

    @triton.jit
    def gemv_accumulate(x_ptr, w_ptr, N, K, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """The GEMV's K loop over this program's rows: (rows, which exist, the fp32 accumulator [BLOCK_N, BLOCK_K]
        of x . w[row], to be summed along K), for kernels that finish the rows otherwise (`gemv_after_wait`)."""
        rows, row_ok, w_rows, acc = gemv_rows(w_ptr, N, stride_wn, BLOCK_N, BLOCK_K)
        return rows, row_ok, gemv_steps(acc, x_ptr, w_rows, row_ok, 0, K, BLOCK_K)

    @triton.jit
    def chunk_sums(p, BLOCK_K: tl.constexpr):
        """p [R, n * BLOCK_K] (n = 1, 2 or 4) -> [R, BLOCK_K]: the K chunks added one after the other,
        ((c0 + c1) + c2) + c3, the order in which `gemv_accumulate`'s loop adds them, so that the row sums are the
        loop's bit for bit (R: BLOCK_N weight rows, or 1 for a row's squares: rms_norm_linear.py)."""
        R: tl.constexpr = p.shape[0]
        n: tl.constexpr = p.shape[1] // BLOCK_K
        if n == 1:  # constexpr branches, no early return: Triton compiles the code after a returning branch too
            out = p
        elif n == 2:
            c0, c1 = tl.split(tl.permute(tl.reshape(p, [R, 2, BLOCK_K]), [0, 2, 1]))
            out = c0 + c1
        else:
            q = tl.permute(tl.reshape(p, [R, 2, 2, BLOCK_K]), [0, 3, 1, 2])  # [.., BLOCK_K, c // 2, c % 2]
            even, odd = tl.split(q)  # chunks 0, 2 and 1, 3
            c0, c2 = tl.split(even)
            c1, c3 = tl.split(odd)
            out = ((c0 + c1) + c2) + c3
        return out

    @triton.jit
    def gemv_preload(w_rows, row_ok, K, PRELOAD_K: tl.constexpr):
        """The first PRELOAD_K columns of the weight rows `w_rows` (their pointers; whole rows where PRELOAD_K >= K),
        [BLOCK_N, PRELOAD_K], zero past K and where a row does not exist: what a program loads BEFORE its PDL wait
        (weights are never written by an earlier kernel), with the columns (cols, col_ok) the input is then loaded
        at."""
        cols = tl.arange(0, PRELOAD_K)
        col_ok = cols < K
        return gemv_load(w_rows, row_ok, cols, col_ok), cols, col_ok

    @triton.jit
    def preloaded_acc(w, x, BLOCK_K: tl.constexpr):
        """The K loop's accumulator [BLOCK_N, BLOCK_K] from preloaded rows w [BLOCK_N, PRELOAD_K] and the input x
        (fp32, [PRELOAD_K], zero past K): `gemv_step`'s products, their K chunks added in the loop's order."""
        return chunk_sums(w.to(tl.float32) * x[None, :], BLOCK_K)

    @triton.jit
    def gemv_after_wait(x_ptr, w_ptr, N, K, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        PRELOAD_K: tl.constexpr, USE_GDC: tl.constexpr, PREFIX: tl.constexpr = False):  # fmt: skip
        """`await_producers` then `gemv_accumulate`'s (rows, row_ok, acc [BLOCK_N, BLOCK_K]); with PRELOAD_K
        (`preload_width`) the whole rows are loaded before the wait and summed after it in the loop's order (the
        same acc); with PREFIX too (`prefix_preload_width`), only their first PRELOAD_K columns, the rest in the
        loop after the wait (the same acc again)."""
        if PRELOAD_K:
            rows, row_ok, w_rows, _ = gemv_rows(w_ptr, N, stride_wn, BLOCK_N, BLOCK_K)
            w, cols, col_ok = gemv_preload(w_rows, row_ok, K, PRELOAD_K)
            await_producers(USE_GDC)
            acc = preloaded_acc(w, tl.load(x_ptr + cols, mask=col_ok, other=0.0).to(tl.float32), BLOCK_K)
            if PREFIX:
                acc = gemv_steps(acc, x_ptr, w_rows, row_ok, PRELOAD_K, K, BLOCK_K)
        else:
            await_producers(USE_GDC)
            rows, row_ok, acc = gemv_accumulate(x_ptr, w_ptr, N, K, stride_wn, BLOCK_N, BLOCK_K)
        return rows, row_ok, acc

    @triton.jit
    def gemv_program(
        x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_wn,
        HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_GDC: tl.constexpr,
        PRELOAD_K: tl.constexpr = 0,
    ):  # fmt: skip
        """The GEMV kernel (launched as `_gemv_kernel`; kernels that do more after it call it as their first part:
        linear_add_rms_norm.py): y at this program's BLOCK_N rows = x . w[row] (+ bias), fp32 sums. USE_GDC: a
        programmatic dependent launch (`await_producers`); PRELOAD_K: the rows loaded before it (`gemv_after_wait`)."""
        rows, row_ok, acc = gemv_after_wait(x_ptr, w_ptr, N, K, stride_wn, BLOCK_N, BLOCK_K, PRELOAD_K, USE_GDC)
        gemv_store(acc, b_ptr, y_ptr, rows, row_ok, HAS_BIAS)

    _gemv_kernel = gemv_program


def takes_gemv(num_elements: int, dtype: torch.dtype, weight: torch.Tensor) -> bool:
    """Whether a `num_elements`-element input of `dtype` times `weight`.T runs the GEMV kernel: one row of
    K <= GEMV_MAX_K elements in the weight's dtype (a choice by shape and dtype only: CUDA-graph safe)."""
    k = weight.shape[1]
    return HAS_TRITON and num_elements == k and k <= GEMV_MAX_K and dtype == weight.dtype


def gemv_config(k: int, n: int = 0) -> tuple[int, int, int, int]:
    """The GEMV's default tile (BLOCK_N, BLOCK_K, num_warps, num_stages) for N rows (0: not known) of K elements."""
    if k < 1024:
        return GEMV_CONFIG_SHORT_K
    if k > 8192:
        return GEMV_CONFIG_XLONG_K
    return GEMV_CONFIG_WIDE_1K if k < 2048 and n >= WIDE_N else GEMV_CONFIG_LONG_K


def preload_width(k: int, config: tuple[int, int, int, int]) -> int:
    """PRELOAD_K for a one-row kernel of tile `config` over rows of K elements: the width it loads before its PDL wait,
    a power of two covering K and a multiple of the tile's BLOCK_K by 1, 2 or 4 (the chunks `chunk_sums` adds in the
    K loop's order); 0 (the K loop after the wait) for rows longer than PRELOAD_MAX_K or more chunks."""
    block_k = config[1]
    width = max(next_pow2(k), block_k)
    return width if k <= PRELOAD_MAX_K and width // block_k in (1, 2, 4) else 0


def prefix_preload_width(k: int, config: tuple[int, int, int, int]) -> int:
    """PRELOAD_K for a row `preload_width` does not preload whole (`launch_gemv` asks only then): the largest
    power-of-two multiple (1, 2 or 4) of the tile's BLOCK_K within PREFIX_PRELOAD_K and shorter than the row; 0 when
    off or none fits."""
    block_k = config[1]
    if PREFIX_PRELOAD_K < block_k:
        return 0
    width = block_k
    while width * 2 <= min(PREFIX_PRELOAD_K, 4 * block_k) and width * 2 < k:
        width *= 2
    return width if width < k else 0


def launch_gemv(kernel, weight: torch.Tensor, *args, config: tuple[int, int, int, int] | None = None,
                preload: bool = False, prefix: bool = False, splits: int = 1, **constexprs) -> None:
    """Launch a kernel built on the GEMV tiling (`gemv_rows` / `gemv_step` / `gemv_store`) over `weight`'s
    rows: one program per BLOCK_N rows, the tile of `config` (None: `gemv_config` of the weight's K), as a
    programmatic dependent launch (`pdl_args`: every such kernel takes USE_GDC and calls `await_producers` before it
    reads anything an earlier kernel writes). `preload`: the kernel takes PRELOAD_K, which this sets to
    `preload_width` of the weight's K and the tile (its weight rows loaded before the wait where that is not 0).
    `prefix` (with preload; the kernel then takes PRELOAD_PREFIX too): rows too long for that may load a prefix
    (`prefix_preload_width`). `splits` > 1: a second grid axis of that many programs per row block (int8_linear.py's
    split-K tensor-core GEMV)."""
    tile = config or gemv_config(weight.shape[1], weight.shape[0])
    bn, bk, warps, stages = tile
    if preload:
        constexprs["PRELOAD_K"] = preload_width(weight.shape[1], tile)
        width = prefix_preload_width(weight.shape[1], tile) if prefix and not constexprs["PRELOAD_K"] else 0
        if width:
            constexprs.update(PRELOAD_K=width, PRELOAD_PREFIX=True)
    grid = (triton.cdiv(weight.shape[0], bn),) if splits == 1 else (triton.cdiv(weight.shape[0], bn), splits)
    kernel[grid](*args, **constexprs, **pdl_args(weight), BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """One row times `weight`.T (+ bias) with the GEMV kernel; `x` holds exactly K elements (any leading dims
    of size 1). fp32 accumulation, output in x's dtype. A weight of at most LINEAR_PRELOAD_MAX_BYTES has its rows
    (up to PRELOAD_MAX_K elements) loaded before the PDL wait."""
    if not HAS_TRITON:
        raise RuntimeError("gemv_triton needs triton")
    n, k = weight.shape
    if x.numel() != k:
        raise ValueError(f"gemv_triton: x has {x.numel()} elements, the weight's rows have {k}")
    xr = unit_stride_row(x)
    w = weight if weight.stride(1) == 1 else weight.contiguous()
    y = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    preload = w.numel() * w.element_size() <= LINEAR_PRELOAD_MAX_BYTES
    launch_gemv(_gemv_kernel, w, xr, w, bias if bias is not None else w, y, n, k, w.stride(0),
                config=config, preload=preload, HAS_BIAS=bias is not None)
    return y


def unit_stride_row(x: torch.Tensor) -> torch.Tensor:
    """A single-row tensor as a flat vector of unit stride (a view when one exists)."""
    xr = x.reshape(x.numel())
    return xr if xr.stride(0) == 1 else xr.contiguous()


def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The CUDA path: the GEMV kernel for one row with K <= GEMV_MAX_K, else `F.linear` (cuBLAS)."""
    if takes_gemv(x.numel(), x.dtype, weight):
        return gemv_triton(x, weight, bias)
    return F.linear(x, weight, bias)


@torch.library.custom_op("mini_infer::linear", mutates_args=())
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`: a Triton GEMV for single rows on CUDA, cuBLAS otherwise."""
    if use_triton(x):
        return linear_triton(x, weight, bias)
    return linear_reference(x, weight, bias)


@linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
