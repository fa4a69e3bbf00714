"""Probe (not a test, not used by the engine): a Triton split-K GEMM for decode batches,
y = x @ W.T (+ residual), against cuBLAS (`F.linear`, and `F.linear` + a torch add for the residual case).

    TRITON_INTERPRET=1 python bench/probe_gemm_decode.py --cpu   # every config and reduction vs torch
    python bench/probe_gemm_decode.py --sm90                     # CPU, no interpreter: sm_90 builds
    python bench/probe_gemm_decode.py [--quick] [--models qwen3-0.6b] [--batches 256]   # CUDA: check, time

Why: at decode batch 256 (qwen3-0.6b, H200) the linears are 780 us of a 5.8 ms step, and cuBLAS runs the
N 1024 GEMMs (o_proj, down_proj) as 128 CTAs of 64x32 tiles with a 32-48-step K loop each (6.8 us per call
against a ~1.3-2 us roofline): latency-bound, the GPU not filled. `linear_add` adds the residual in a separate
kernel.

The kernel: x [M, K] bf16 row-major, W [N, K] bf16 row-major (nn.Linear's layout), fp32 accumulation
(`tl.dot` on a [BLOCK_N, BLOCK_K] W tile transposed: wgmma on Hopper for BLOCK_M >= 64, mma.sync below), bf16
output; the optional residual [M, N] is added to the fp32 sum before the single rounding. Each output tile's
K range is cut into SPLIT_K slices of whole BLOCK_K steps: one program per (tile, slice), tiles x SPLIT_K
programs, chosen to fill the 132 SMs of an H200; the programs of one W tile's M tiles are adjacent in launch
order (W read once from HBM). Loads wrap rows (row % M, col % N: no M / N masks in the loop; stores masked).
The partial sums of a split tile are reduced one of 4 ways (REDUCTIONS):
  serial    each program stores its fp32 partial in a [SPLIT_K, M, N] workspace, then bumps the tile's
            counter (acq_rel atomic after a CTA barrier); the last-arriving program sums the slices in the
            fixed order 0 .. SPLIT_K - 1 (its own reloaded too: fewer registers), adds the residual, stores
            bf16 and resets the counter. One launch, bitwise deterministic, but one SM reads SPLIT_K tiles.
  atomic    fp32 atomic adds (relaxed) into a zeroed [M, N] workspace, then the counter; the last-arriving
            program reads the sum, adds the residual, stores bf16, and zeroes its workspace tile and the
            counter (self-cleaning: one launch). Not deterministic (order of the atomics).
  atomic2k  the same atomics, then a second small kernel over all SMs that reads the sum, adds the residual,
            stores bf16 and zeroes the workspace. Not deterministic.
  parts2k   partials in [SPLIT_K, M, N] as serial, then the second kernel sums them in order: deterministic.
SPLIT_K 1 ("direct") needs none: the epilogue adds the residual and stores. Not here: stream-K / persistent
scheduling, TMA (pointer loads with Triton's cp.async pipeliner, `num_stages`).

--cpu: every tile config (TILES) with every reduction and splits 1 / 2 / 3, with and without the residual, on
small shapes (M 3 / 17 / 64, N 40 / 96 / 130, K 64 / 200 / 1024), each plan called twice (the second call
finds the workspace and counters the first left), bf16 output and fp32 output (the kernel's math without the
rounding: a tight check of the split bookkeeping) against the fp32 torch reference x.float() @ W.float().T
(+ residual). Error: max |out - ref| / max(1, max |ref|); exit status 1 beyond 2e-2 (bf16 out; the
interpreter truncates fp32 -> bf16) or 1e-4 (fp32 out).

--sm90: each tile config's builds (direct with and without the residual, serial and atomic with it, the GEMM
of the two-kernel reductions, and the finishing kernel), compiled for sm_90 with pointers, M / N / K, the K
slice and the strides marked divisible by 16 as a launch at the H200 shapes specializes them: registers,
spills, shared memory, wgmma / mma.sync / cp.async / TMA (cp.async.bulk.tensor) / atomic instructions in the
PTX, programs per SM (registers and shared memory).

CUDA (default): qwen3-0.6b (hidden 1024, 16 / 8 heads of 128, intermediate 3072: qkv N 4096 K 1024, o_proj
N 1024 K 2048, gate_up N 6144 K 1024, down N 1024 K 3072, lm_head N 151936 K 1024) and qwen2.5-7b (hidden
3584, 28 / 4 heads: qkv N 4608 K 3584, o_proj N 3584 K 3584, gate_up N 37888 K 3584, down N 3584 K 18944) at
M 64 / 128 / 256. Per shape, the candidates (each tile with the largest split that fits one wave of programs
and the one for two waves; atomic reduction) are checked against the fp32 reference and screened with short
timings; the best 3 are re-timed with more rounds and with the other reductions, the best 2 with the
residual epilogue (o_proj / down), against cuBLAS F.linear and F.linear + add. Timing: a CUDA graph of CALLS
calls cycling over distinct weight copies (together over twice the L2, so W comes from HBM as in a decode
step; x stays in L2), replayed, median of rounds (bench/kernel_norm.py's `time_calls`). Columns: us per
call, TFLOP/s (2 M N K), weight GB/s (2 N K bytes / time), cuBLAS's time over this one (> 1: faster than
cuBLAS; F.linear + add for the residual rows), repeat: whether a fresh call gives the graph's last output bit
for bit ("differ" is expected of the atomic reductions only). The output of the last graph replay is checked
again (the self-cleaning counters and workspaces over many calls). Then a per-shape winner and the sum over
the linears of a qwen3-0.6b decode step (28 layers + lm_head). A few minutes on an H200, compiles included
(--quick: one split per tile, fewer re-timed). Exit status 1 if a check fails.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from mini_infer.ops._triton_support import HAS_TRITON, tl, triton  # noqa: E402

NUM_SMS = 132  # H200 (the CUDA run reads the device's own count)
REDUCTIONS = ("serial", "atomic", "atomic2k", "parts2k")  # _gemm_kernel's REDUCE is the index here
FINISH_BLOCK = 1024  # elements per program of the finishing kernel
TOL = 2e-2  # bf16 output, of max(1, max|ref|)
TOL_FP32 = 1e-4  # fp32 output (--cpu)

if HAS_TRITON:

    @triton.jit
    def _epilogue(acc, out_ptr, res_ptr, rm, rn, M, N, s_om, s_rm, HAS_RES: tl.constexpr):
        mask = (rm < M)[:, None] & (rn < N)[None, :]
        if HAS_RES:
            acc += tl.load(res_ptr + rm[:, None] * s_rm + rn[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + rm[:, None] * s_om + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit(do_not_specialize=["split_k"])  # one build for every split > 1
    def _gemm_kernel(x_ptr, w_ptr, out_ptr, res_ptr, ws_ptr, cnt_ptr, M, N, K, k_slice, split_k,
                     s_xm, s_wn, s_om, s_rm,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                     REDUCE: tl.constexpr, HAS_RES: tl.constexpr, EVEN_K: tl.constexpr,
                     DOT_FP32: tl.constexpr):
        """One program per (output tile, K slice). Program order: M tile fastest, then the K slice, then the N
        tile (the programs reading one W tile run together). k_slice: a multiple of BLOCK_K; split_k = its
        number of slices (SPLIT: split_k > 1). DOT_FP32: fp32 operands (the CPU interpreter, whose bf16 dot
        multiplies the raw bits as integers)."""
        pid = tl.program_id(0)
        tiles_m = tl.cdiv(M, BLOCK_M)
        pid_m = pid % tiles_m
        rest = pid // tiles_m
        split = rest % split_k
        pid_n = rest // split_k
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        k0 = split * k_slice
        k_end = tl.minimum(k0 + k_slice, K)
        x_ptrs = x_ptr + (rm % M)[:, None] * s_xm + (k0 + rk)[None, :]  # rows wrap: no masks on M / N
        w_ptrs = w_ptr + (rn % N)[:, None] * s_wn + (k0 + rk)[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(k0, k_end, BLOCK_K):
            if EVEN_K:
                a = tl.load(x_ptrs)
                b = tl.load(w_ptrs)
            else:
                kmask = (k + rk) < K
                a = tl.load(x_ptrs, mask=kmask[None, :], other=0.0)
                b = tl.load(w_ptrs, mask=kmask[None, :], other=0.0)
            if DOT_FP32:
                acc = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, tl.trans(b), acc)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if not SPLIT:
            _epilogue(acc, out_ptr, res_ptr, rm, rn, M, N, s_om, s_rm, HAS_RES)
        else:
            mask = (rm < M)[:, None] & (rn < N)[None, :]
            tile = pid_n * tiles_m + pid_m
            if REDUCE == 0 or REDUCE == 3:  # partials [split_k, M, N] fp32
                tl.store(ws_ptr + (split * M + rm)[:, None] * N + rn[None, :], acc, mask=mask)
            else:  # atomic sum in a zeroed [M, N] fp32 workspace
                tl.atomic_add(ws_ptr + rm[:, None] * N + rn[None, :], acc, mask=mask, sem="relaxed")
            if REDUCE == 0 or REDUCE == 1:  # the last-arriving program of the tile finishes it
                tl.debug_barrier()  # every thread's partial issued before the counter's release
                count = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
                if count == split_k - 1:
                    if REDUCE == 0:
                        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                        for s in range(0, split_k):  # fixed order: deterministic (its own slice reloaded too:
                            # acc dead after its store, ~120 registers fewer than summing it from registers)
                            total += tl.load(ws_ptr + (s * M + rm)[:, None] * N + rn[None, :], mask=mask,
                                             other=0.0, cache_modifier=".cg")
                    else:
                        wsp = ws_ptr + rm[:, None] * N + rn[None, :]
                        total = tl.load(wsp, mask=mask, other=0.0, cache_modifier=".cg")
                        tl.store(wsp, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), mask=mask)
                    tl.store(cnt_ptr + tile, 0)
                    _epilogue(total, out_ptr, res_ptr, rm, rn, M, N, s_om, s_rm, HAS_RES)

    @triton.jit
    def _finish_kernel(ws_ptr, out_ptr, res_ptr, M, N, parts, s_om, s_rm,
                       HAS_RES: tl.constexpr, ZERO: tl.constexpr, BLOCK: tl.constexpr):
        """out = the sum of `parts` fp32 [M, N] slices of ws in order (+ residual); ZERO: reset ws to 0."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < M * N
        row = offs // N
        col = offs % N
        total = tl.load(ws_ptr + offs, mask=mask, other=0.0)
        for s in range(1, parts):
            total += tl.load(ws_ptr + s * M * N + offs, mask=mask, other=0.0)
        if ZERO:
            tl.store(ws_ptr + offs, tl.zeros((BLOCK,), dtype=tl.float32), mask=mask)
        if HAS_RES:
            total += tl.load(res_ptr + row * s_rm + col, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * s_om + col, total.to(out_ptr.dtype.element_ty), mask=mask)


# Tile configs (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages); shared memory stages * (BM + BN) * BK * 2
TILES = (
    (32, 64, 128, 4, 4),
    (64, 32, 128, 4, 5),
    (64, 64, 128, 4, 4),
    (64, 128, 64, 4, 4),
    (128, 64, 64, 4, 4),
    (128, 128, 64, 8, 4),
    (256, 64, 64, 8, 3),
    (128, 256, 64, 8, 3),
)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def tile_label(tile) -> str:
    bm, bn, bk, w, s = tile
    return f"{bm}x{bn}x{bk} w{w} s{s}"


class Plan:
    """One launch plan: a tile config, the K slicing and the reduction for an M x N x K product, with its
    workspace and tile counters (zeroed once; the kernels leave them as they found them)."""

    def __init__(self, tile, m: int, n: int, k: int, split: int, reduce: str = "atomic", device="cpu"):
        bm, bn, bk, self.warps, self.stages = tile
        self.tile, self.m, self.n, self.k = tile, m, n, k
        steps = cdiv(k, bk)
        split = max(1, min(split, steps))
        self.k_slice = cdiv(steps, split) * bk
        self.split = cdiv(k, self.k_slice)  # no empty slice
        self.reduce = "direct" if self.split == 1 else reduce
        self.tiles = cdiv(m, bm) * cdiv(n, bn)
        self.programs = self.tiles * self.split
        f32 = dict(dtype=torch.float32, device=device)
        if self.reduce in ("serial", "parts2k"):
            self.ws = torch.empty(self.split, m, n, **f32)
        elif self.reduce in ("atomic", "atomic2k"):
            self.ws = torch.zeros(m, n, **f32)
        else:
            self.ws = torch.empty(1, **f32)
        self.cnt = torch.zeros(max(1, self.tiles), dtype=torch.int32, device=device)

    def label(self) -> str:
        return f"{tile_label(self.tile)} k{self.split} {self.reduce}"


def gemm(x: torch.Tensor, w: torch.Tensor, p: Plan, residual: torch.Tensor | None = None,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ w.T (+ residual) with plan p (p.m, p.n, p.k must match x [M, K] and w [N, K])."""
    m, k = x.shape
    n = w.shape[0]
    assert (m, n, k) == (p.m, p.n, p.k) and x.stride(1) == 1 and w.stride(1) == 1
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    two_kernels = p.reduce in ("atomic2k", "parts2k")
    res = residual if residual is not None else out
    bm, bn, bk = p.tile[:3]
    _gemm_kernel[(p.programs,)](
        x, w, out, res, p.ws, p.cnt, m, n, k, p.k_slice, p.split, x.stride(0), w.stride(0), out.stride(0),
        res.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT=p.split > 1,
        REDUCE=REDUCTIONS.index(p.reduce) if p.split > 1 else 0,
        HAS_RES=residual is not None and not two_kernels, EVEN_K=k % bk == 0, DOT_FP32=not x.is_cuda,
        num_warps=p.warps, num_stages=p.stages)
    if two_kernels:
        _finish_kernel[(cdiv(m * n, FINISH_BLOCK),)](
            p.ws, out, res, m, n, p.split if p.reduce == "parts2k" else 1, out.stride(0), res.stride(0),
            HAS_RES=residual is not None, ZERO=p.reduce == "atomic2k", BLOCK=FINISH_BLOCK, num_warps=4)
    return out


def reference(x, w, residual=None):
    y = x.float() @ w.float().T
    return y + residual.float() if residual is not None else y


def make_inputs(m, n, k, device, seed=0, copies=1):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, k, generator=g, device=device).to(torch.bfloat16)
    ws = [(torch.randn(n, k, generator=g, device=device) / math.sqrt(k)).to(torch.bfloat16)
          for _ in range(copies)]
    res = torch.randn(m, n, generator=g, device=device).to(torch.bfloat16)
    return x, ws, res


def rel_err(got, ref) -> float:
    return (got.float() - ref).abs().max().item() / max(1.0, ref.abs().max().item())


# --------------------------------------------------------------------------------------------------
# --cpu: the interpreter
# --------------------------------------------------------------------------------------------------

CPU_SHAPES = ((3, 40, 64), (17, 96, 200), (64, 130, 1024), (17, 130, 1024))


def cpu_check() -> int:
    if not os.environ.get("TRITON_INTERPRET"):
        print("--cpu needs TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    bad, worst, worst32, n_runs = 0, 0.0, 0.0, 0
    t_all = time.perf_counter()
    for m, n, k in CPU_SHAPES:
        x, (w,), res = make_inputs(m, n, k, "cpu", seed=m * 7 + n + k)
        refs = {False: reference(x, w), True: reference(x, w, res)}
        for tile in TILES:
            t0 = time.perf_counter()
            line = []
            cases = [(1, "direct")] + [(s, r) for s in (2, 3) for r in REDUCTIONS]
            seen = set()
            for i, (split, red) in enumerate(cases):
                p = Plan(tile, m, n, k, split, red if red != "direct" else "atomic")
                use_res = (i + split) % 2 == 0  # each reduction with and without the residual
                if (p.split, p.reduce, use_res) in seen:
                    continue  # K too short for this split at this BLOCK_K: the same plan as before
                seen.add((p.split, p.reduce, use_res))
                resid = res if use_res else None
                errs = []
                for out_dtype in (torch.bfloat16, torch.float32):
                    out = torch.empty(m, n, dtype=out_dtype)
                    for _ in range(2):  # twice: the second call finds the workspace / counters the first left
                        got = gemm(x, w, p, resid, out=out)
                        errs.append(rel_err(got, refs[use_res]))
                        n_runs += 1
                e16, e32 = max(errs[:2]), max(errs[2:])
                worst, worst32 = max(worst, e16), max(worst32, e32)
                fail = e16 > TOL or e32 > TOL_FP32
                bad += fail
                line.append(f"k{p.split}/{p.reduce}{'+res' if use_res else ''} {e16:.1e}/{e32:.1e}"
                            + (" FAIL" if fail else ""))
            print(f"M {m:3d} N {n:3d} K {k:4d} | {tile_label(tile):18s} | " + ", ".join(line)
                  + f"  ({time.perf_counter() - t0:.1f} s)", flush=True)
    print(f"{n_runs} runs, max rel err bf16 out {worst:.2e} (tolerance {TOL}), fp32 out {worst32:.2e} "
          f"(tolerance {TOL_FP32}); {bad} failure(s); {time.perf_counter() - t_all:.0f} s")
    return 1 if bad else 0


# --------------------------------------------------------------------------------------------------
# --sm90: builds for sm_90 (no GPU), with the specialization a launch at the H200 shapes gets
# --------------------------------------------------------------------------------------------------

POINTER_TYPES = {"ws_ptr": "*fp32", "cnt_ptr": "*i32"}
DIVISIBLE = ("M", "N", "K", "k_slice", "s_xm", "s_wn", "s_om", "s_rm")


def build_sm90(kernel, constexprs: dict, num_warps: int, num_stages: int):
    """`kernel` built for sm_90 as a launch specializes it (pointers and the DIVISIBLE integers multiples of 16)."""
    from tests.ops.compile_sm90 import build_sm90 as build

    divisible = tuple(a for a in kernel.arg_names if (a.endswith("_ptr") or a in DIVISIBLE) and a not in constexprs)
    return build(kernel, constexprs, POINTER_TYPES, num_warps, num_stages, divisible=divisible, floats=())


def sm90_stats(compiled, num_warps) -> dict:
    from tests.ops.compile_sm90 import build_stats

    st = build_stats(compiled, num_warps, r"cp\.async\.bulk\.tensor|cp\.async\.c[ag]|wgmma\.mma_async|mma\.sync"
                                          r"|red\.global|atom\.global")
    ops = st["ops"]
    return {"regs": st["regs"], "stack": st["stack"], "smem": st["smem"],
            "wgmma": ops["wgmma.mma_async"], "mma": ops["mma.sync"],
            "cp_async": ops["cp.async.cg"] + ops["cp.async.ca"], "tma": ops["cp.async.bulk.tensor"],
            "atomics": ops["red.global"] + ops["atom.global"], "per_sm": st["programs_per_sm"]}


def stats_line(st) -> str:
    return (f"{st['regs']:4d} {st['stack']:5d} {st['smem']:6d} {st['wgmma']:5d} {st['mma']:4d} "
            f"{st['cp_async']:8d} {st['tma']:3d} {st['atomics']:7d} {st['per_sm']:7d}")


def sm90_report() -> int:
    """--sm90 (kernel_norm.probe_main has checked that this process can build for sm_90)."""
    print(f"triton {triton.__version__}, sm_90 builds (pointers, M/N/K, k_slice, strides divisible by 16, as "
          f"launched at the H200 shapes); prog/SM from registers and shared memory")
    print(f"{'tile':18s} {'build':18s} | {'regs':>4s} {'stack':>5s} {'smem':>6s} {'wgmma':>5s} {'mma':>4s} "
          f"{'cp.async':>8s} {'TMA':>3s} {'atomics':>7s} {'prog/SM':>7s}")
    bad = 0
    builds = [("direct", dict(SPLIT=False, REDUCE=0, HAS_RES=False)),
              ("direct+res", dict(SPLIT=False, REDUCE=0, HAS_RES=True)),
              ("serial+res", dict(SPLIT=True, REDUCE=0, HAS_RES=True)),
              ("atomic+res", dict(SPLIT=True, REDUCE=1, HAS_RES=True)),
              ("atomic2k gemm", dict(SPLIT=True, REDUCE=2, HAS_RES=False)),
              ("parts2k gemm", dict(SPLIT=True, REDUCE=3, HAS_RES=False))]
    for tile in TILES:
        bm, bn, bk, warps, stages = tile
        for name, ce in builds:
            t0 = time.perf_counter()
            try:
                ce = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=True, DOT_FP32=False, **ce)
                st = sm90_stats(build_sm90(_gemm_kernel, ce, warps, stages), warps)
            except Exception as exc:  # a build that fails (shared memory, a Triton limit): say so
                bad += 1
                print(f"{tile_label(tile):18s} {name:18s} | build failed: {type(exc).__name__}: "
                      f"{str(exc)[:200]}")
                continue
            print(f"{tile_label(tile):18s} {name:18s} | {stats_line(st)}  ({time.perf_counter() - t0:.1f} s)",
                  flush=True)
    for name, ce in (("finish parts2k+res", dict(HAS_RES=True, ZERO=False)),
                     ("finish atomic2k+res", dict(HAS_RES=True, ZERO=True))):
        st = sm90_stats(build_sm90(_finish_kernel, dict(BLOCK=FINISH_BLOCK, **ce), 4, 1), 4)
        print(f"{'finish ' + str(FINISH_BLOCK):18s} {name:18s} | {stats_line(st)}")
    return 1 if bad else 0


# --------------------------------------------------------------------------------------------------
# CUDA: check and time
# --------------------------------------------------------------------------------------------------

MODELS = {  # name: {linear: (N, K, has residual in the engine (linear_add))}
    "qwen3-0.6b": {"qkv": (4096, 1024, False), "o_proj": (1024, 2048, True), "gate_up": (6144, 1024, False),
                   "down": (1024, 3072, True), "lm_head": (151936, 1024, False)},
    "qwen2.5-7b": {"qkv": (4608, 3584, False), "o_proj": (3584, 3584, True), "gate_up": (37888, 3584, False),
                   "down": (3584, 18944, True)},
}
BATCHES = (64, 128, 256)
CALLS = 20  # calls per CUDA graph
PEAK_TFLOPS = 989.0  # H200 dense bf16 (spec), for the roofline column only


def candidates(m, n, k, sms, quick) -> list[tuple[tuple, int]]:
    """(tile, split) pairs to screen for an M x N x K product: tiles with BLOCK_M <= max(M, 32), each with the
    largest split whose programs fit one wave of `sms` (and, unless quick, the one for two waves), at least 2
    BLOCK_K steps per slice; split 1 once the tiles alone fill a wave."""
    out = []
    for tile in TILES:
        bm, bn, bk = tile[:3]
        if bm > max(m, 32) or (bm < 64 and m >= 128):
            continue
        tiles = cdiv(m, bm) * cdiv(n, bn)
        steps = cdiv(k, bk)
        splits = []
        for waves in (1,) if quick else (1, 2):
            s = max(1, min(waves * sms // tiles, steps // 2, 16))
            splits.append(s)
        for s in dict.fromkeys(splits):
            if tiles * s >= sms // 2 or s == max(splits):  # skip badly underfilled ones unless nothing better
                out.append((tile, s))
    return out


class ShapeRun:
    """One M x N x K product on CUDA: inputs, references, the timed rows (label, us, kind) and failures."""

    def __init__(self, tag, x, wts, res, time_calls, quick):
        self.tag, self.x, self.wts, self.res = tag, x, wts, res
        self.time_calls, self.quick = time_calls, quick
        self.m, self.k = x.shape
        self.n = wts[0].shape[0]
        self.ref0 = reference(x, wts[0])
        self.last = wts[(CALLS - 1) % len(wts)]
        self.ref_last = reference(x, self.last) if self.last is not wts[0] else self.ref0
        self.repeats = {}  # label -> a fresh call equals the graph's last call bit for bit
        self.out = torch.empty(self.m, self.n, dtype=torch.bfloat16, device=x.device)
        self.rows, self.bad = [], 0

    def timed(self, fn, t) -> float:
        """us per call of fn(weight) in a CUDA graph of CALLS calls cycling over the weight copies."""
        copies = len(self.wts)
        calls = [lambda w=self.wts[i % copies]: fn(w) for i in range(CALLS)]
        return self.time_calls(calls, t["target_ms"], t["rounds"])[0] * 1e3

    def run_plan(self, p: Plan, with_res: bool, t) -> float | None:
        """Check plan p (first call, and the output of the graph's last call), then its us per call."""
        label = p.label() + (" +res" if with_res else "")
        resid = self.res if with_res else None
        add = self.res.float() if with_res else 0.0
        try:
            got = gemm(self.x, self.wts[0], p, resid, out=self.out)
        except Exception as exc:  # out of resources: say so, skip
            print(f"  {self.tag} {label}: launch failed: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
            return None
        e0 = rel_err(got, self.ref0 + add)
        us = self.timed(lambda w: gemm(self.x, w, p, resid, out=self.out), t)
        e1 = rel_err(self.out, self.ref_last + add)  # after many graph replays
        self.repeats[label] = torch.equal(gemm(self.x, self.last, p, resid), self.out)
        if max(e0, e1) > TOL:
            self.bad += 1
            print(f"  {self.tag} {label}: rel err {e0:.2e} (first call) {e1:.2e} (after the graph)  FAIL",
                  flush=True)
            return None
        return us

    def run(self, sms, has_res, screen, final) -> list:
        m, n, k, x, res = self.m, self.n, self.k, self.x, self.res
        rows = self.rows
        rows.append(("cuBLAS F.linear", self.timed(lambda w: F.linear(x, w), final), "cublas"))
        self.err_cublas = rel_err(F.linear(x, self.wts[0]), self.ref0)
        screened = []
        for tile, split in candidates(m, n, k, sms, self.quick):
            us = self.run_plan(Plan(tile, m, n, k, split, "atomic", device=x.device), False, screen)
            if us is not None:
                screened.append((us, tile, split))
        screened.sort(key=lambda r: r[0])
        self.screened = screened
        best = screened[:2 if self.quick else 3]
        for _, tile, split in best:  # re-timed with more rounds, and with the other reductions
            for red in ("atomic",) + (() if self.quick else ("serial", "atomic2k", "parts2k")):
                p = Plan(tile, m, n, k, split, red, device=x.device)
                if red != "atomic" and p.reduce == "direct":
                    continue
                us = self.run_plan(p, False, final)
                if us is not None:
                    rows.append((p.label(), us, "triton"))
        if has_res:
            rows.append(("cuBLAS F.linear + add", self.timed(lambda w: F.linear(x, w).add_(res), final),
                         "cublas+add"))
            for _, tile, split in best[:2]:
                for red in ("atomic", "serial"):
                    p = Plan(tile, m, n, k, split, red, device=x.device)
                    if red != "atomic" and p.reduce == "direct":
                        continue
                    us = self.run_plan(p, True, final)
                    if us is not None:
                        rows.append((p.label() + " +res", us, "triton+res"))
        return rows


def gpu_run(models, batches, quick) -> int:
    sys.path.insert(0, str(BENCH))
    from kernel_norm import copy_bandwidth, time_calls

    t_start = time.perf_counter()
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    l2 = getattr(props, "L2_cache_size", 0) or 50 * 2**20
    cb = copy_bandwidth(1.0, 0, 10)["gbps"]
    print(f"{torch.cuda.get_device_name()} ({sms} SMs, L2 {l2 / 2**20:.0f} MiB) | torch {torch.__version__} "
          f"triton {triton.__version__} | copy bandwidth {cb:.0f} GB/s | CUDA graphs of {CALLS} calls over "
          f"distinct weight copies (> 2x L2); us per call, TFLOP/s, weight GB/s, cuBLAS time / this "
          f"(>1 = faster)",
          flush=True)
    screen = dict(target_ms=4.0, rounds=2)
    final = dict(target_ms=15.0, rounds=5)
    bad = 0
    winners = {}  # (model, name, m) -> {"cublas": us, "best": (label, us), "cublas+add": us, "best_res": ...}
    for model in models:
        for name, (n, k, has_res) in MODELS[model].items():
            wbytes = n * k * 2
            copies = max(2, min(CALLS, math.ceil(2 * l2 / wbytes)))
            x_all, wts, res_all = make_inputs(max(batches), n, k, "cuda", seed=n + k, copies=copies)
            for m in batches:
                t_shape = time.perf_counter()
                flops = 2 * m * n * k
                sr = ShapeRun(f"{model} {name} M {m}:", x_all[:m].contiguous(), wts, res_all[:m].contiguous(),
                              time_calls, quick)
                rows = sr.run(sms, has_res, screen, final)
                bad += sr.bad
                print(f"\n{model} {name} M {m} N {n} K {k}: {wbytes / 1e6:.1f} MB of weights x {copies} "
                      f"copies; roofline {flops / PEAK_TFLOPS / 1e6:.2f} us (flops) / "
                      f"{wbytes / cb / 1e3:.2f} us (weights at copy bandwidth); cuBLAS rel err "
                      f"{sr.err_cublas:.1e}; screened "
                      f"{len(sr.screened)} configs "
                      f"({', '.join(f'{tile_label(t)} k{s} {u:.1f}' for u, t, s in sr.screened[:6])}"
                      f"{', ...' if len(sr.screened) > 6 else ''})")
                cublas = rows[0][1]
                cublas_add = next((us for _, us, kind in rows if kind == "cublas+add"), None)
                print(f"  {'kernel':36s} {'us':>8s} {'TFLOP/s':>8s} {'W GB/s':>8s} {'cuBLAS/this':>11s} "
                      f"{'repeat':>6s}")
                for label, us, kind in rows:
                    base = cublas_add if kind in ("cublas+add", "triton+res") else cublas
                    rep = {True: "same", False: "differ"}.get(sr.repeats.get(label), "")
                    print(f"  {label:36s} {us:8.2f} {flops / us / 1e6:8.1f} {wbytes / us / 1e3:8.0f} "
                          f"{base / us:11.2f} {rep:>6s}")
                win = {"cublas": cublas, "cublas+add": cublas_add}
                for kind, key in (("triton", "best"), ("triton+res", "best_res")):
                    mine = [r for r in rows if r[2] == kind]
                    if mine:
                        win[key] = min(mine, key=lambda r: r[1])[:2]
                winners[(model, name, m)] = win
                print(f"  ({time.perf_counter() - t_shape:.1f} s; {time.perf_counter() - t_start:.0f} s "
                      f"total)", flush=True)
                del sr
            del x_all, wts, res_all
            torch.cuda.empty_cache()

    print("\nper-shape winner (us per call; cuBLAS time / best Triton, > 1: Triton faster)")
    for (model, name, m), win in winners.items():
        line = f"  {model:11s} {name:8s} M {m:3d} | cuBLAS {win['cublas']:7.2f}"
        if "best" in win:
            lab, us = win["best"]
            line += f" | Triton {us:7.2f} {win['cublas'] / us:5.2f}x ({lab})"
        if "best_res" in win and win["cublas+add"]:
            lab, us = win["best_res"]
            line += (f" | +res: cuBLAS+add {win['cublas+add']:7.2f}, Triton {us:7.2f} "
                     f"{win['cublas+add'] / us:5.2f}x ({lab})")
        print(line)
    for m in batches:  # qwen3-0.6b decode step: 28 layers (o_proj, down with the residual) + lm_head
        if not all(("qwen3-0.6b", nm, m) in winners for nm in MODELS["qwen3-0.6b"]):
            continue
        cub, best = 0.0, 0.0
        for nm, (_, _, has_res) in MODELS["qwen3-0.6b"].items():
            win = winners[("qwen3-0.6b", nm, m)]
            reps = 1 if nm == "lm_head" else 28
            c = win["cublas+add"] if has_res and win["cublas+add"] else win["cublas"]
            b = (win.get("best_res") if has_res else win.get("best")) or (None, c)
            cub += reps * c
            best += reps * min(b[1], c)
        print(f"qwen3-0.6b decode step, linears at M {m}: cuBLAS (F.linear + add for o_proj / down) "
              f"{cub:.0f} us, the faster of cuBLAS and the best Triton config per linear {best:.0f} us")
    print(f"{time.perf_counter() - t_start:.0f} s; {bad} check(s) beyond {TOL}")
    return 1 if bad else 0


def main() -> int:
    sys.path.insert(0, str(BENCH))
    from kernel_norm import probe_main, probe_parser

    ap = probe_parser(__doc__)
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated subset (CUDA run)")
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)), help="comma-separated M (CUDA run)")
    ap.add_argument("--quick", action="store_true", help="CUDA run: one split per tile, fewer re-timed")
    args = ap.parse_args()
    return probe_main(args, cpu_check, sm90_report,
                      lambda: gpu_run([m for m in args.models.split(",") if m],
                                      [int(b) for b in args.batches.split(",") if b], args.quick))


if __name__ == "__main__":
    sys.exit(main())
