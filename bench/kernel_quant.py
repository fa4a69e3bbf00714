"""W8A8 linears (int8, FP8) and the FP8 KV cache against their bf16 counterparts (not a test).

    python bench/kernel_quant.py --check         # correctness at the benchmark shapes, then the timings
    python bench/kernel_quant.py --sweep         # also sweep the skinny (M <= 16) tile of scaled_mm_triton
    python bench/kernel_quant.py --check --ms 1 --no-attention --sweep-gemv   # the decode (M = 1) GEMVs + tiles
    python bench/kernel_quant.py --check --ms 1 --no-attention --shapes qkv,o_proj,gate_up,down_proj \
        --sweep-gemv fp8-dot                     # the fp8 GEMV both ways (cuda cores, tensor cores) + the dot tiles
    python bench/kernel_quant.py --tiny          # CPU: Triton under TRITON_INTERPRET=1, tiny shapes, every path

For qwen2.5-7b's weight GEMMs (qkv 3584->4608, o 3584->3584, gate_up 3584->37888, down 18944->3584, lm_head
3584->152064) at M = 1, 8, 64, 256, 8192 tokens, the time per call (CUDA-graph replay, median of rounds:
`time_calls` of bench/kernel_norm.py) of

  bf16         F.linear (cuBLAS)
  gemv         mini_infer.ops.linear.linear_triton, the engine's bf16 decode path (M = 1 only; K > 8192 is cuBLAS)
  int8         int8_linear_triton (already-quantized activation: what a fused producer hands it; at M = 1 the
               W8A8 GEMV, scaled_gemv_triton, int32 words and dp4a)
  int8-tile    scaled_mm_triton's skinny tile (M = 1 only: what int8_linear ran at M = 1 before the GEMV)
  int8-byte    scaled_gemv_triton reading the int8 weights byte by byte (pack_int8=False; M = 1 only)
  int8+q       w8a8_linear_triton (quantize_per_token + int8_linear)
  fp8-gemv     scaled_gemv_triton with fp8 operands, products on CUDA cores (fp8_gemv="cuda-cores", M = 1 only:
               fp8_linear's M = 1 path by default)
  fp8-dot      scaled_gemv_triton with fp8 operands, products on tensor cores (fp8_gemv="dot", M = 1 only:
               fp8_linear's M = 1 path with MINI_INFER_FP8_GEMV=dot)
  fp8-tri      scaled_mm_triton with fp8 operands (the Triton tile fp8_linear uses for 1 < M <= FP8_TRITON_MAX_M)
  fp8-smm      torch._scaled_mm, rowwise scales (what fp8_linear uses above that)
  fp8+q        fp8_w8a8_linear_triton (quantize + whatever fp8_linear picks for M)

Weights are cycled cold through L2 (copies up to 3x L2, as bench/kernel_gemv.py). Reported: us per call; at
M <= 64 the weight bandwidth (weight bytes / time) as % of the copy bandwidth measured in the same run
(`copy_bandwidth` of bench/kernel_norm.py), best of bf16 / int8 / fp8, and at M = 1 every impl's TB/s and % of
copy on a line of its own; at M >= 256 TFLOP/s; and the sum over one decode step's GEMMs at M = 1 (28 layers +
lm_head). --sweep-gemv times scaled_gemv_triton's tiles at M = 1: GEMV_SWEEP for int8 and fp8 (CUDA cores),
DOT_GEMV_SWEEP for fp8-dot (or only the kinds named: --sweep-gemv fp8-dot), with --split-sweep DOT_SPLIT_SWEEP
instead (64-row tiles, K cut into 1-8 splits). Then paged decode
attention, 4k context, batch 64 and 256, bf16 vs fp8 cache.

--check first compares every timed path with the plain-torch references at the benchmark shapes (int8: same
int32, epilogue within one output ulp, the same bits for a row at every M bucket, and at M = 1 the GEMV's bits
(words and bytes) equal to the skinny tile's; fp8: relative error of the fp32-accumulated product, GEMV included; quantization and the fused producers: bit-exact with the unfused kernels; paged
attention with fp8 caches vs its reference) and stops with exit 1 on a mismatch. Prints a table; JSON goes to
bench/results/kernel_quant_<gpu>.json (--out). --tiny runs the same closures once on CPU (interpreter times mean
nothing) and writes bench/out/kernel_quant_cpu.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from kernel_norm import copy_bandwidth, git_info, time_calls  # the sibling script's timing helpers

FP8 = torch.float8_e4m3fn
# qwen2.5-7b: (name, N, K, count per decode step)
SHAPES = [("qkv", 4608, 3584, 28), ("o_proj", 3584, 3584, 28), ("gate_up", 37888, 3584, 28),
          ("down_proj", 3584, 18944, 28), ("lm_head", 152064, 3584, 1)]
MS = (1, 8, 64, 256, 8192)
TINY_SHAPES = [("qkv", 96, 64, 1), ("down_proj", 40, 200, 1)]  # 200: a K tail, 40: an N tail
TINY_MS = (1, 8, 20)
IMPLS = ("bf16", "gemv", "int8", "int8-tile", "int8-byte", "int8+q", "fp8-gemv", "fp8-dot", "fp8-tri", "fp8-smm",
         "fp8+q")
ONE_ROW_IMPLS = ("gemv", "int8-tile", "int8-byte", "fp8-gemv", "fp8-dot")  # timed at M = 1 only
# scaled_gemv_triton's tiles for --sweep-gemv: (BLOCK_N, BLOCK_K in elements, num_warps, num_stages)
GEMV_SWEEP = [(bn, bk, w, 1) for bn in (2, 4, 8, 16) for bk in (512, 1024, 2048, 4096) for w in (4, 8)
              if bn * bk <= 16384]
# the tensor-core fp8 GEMV's tiles: BLOCK_N < 64 pads x to a 64-row A tile (weights as B), BLOCK_N >= 64 makes the
# weights A (x a 16-column B); num_stages: the cp.async pipeline's depth (a tile over shared memory fails: skipped)
DOT_GEMV_SWEEP = [(bn, bk, 4, st) for bn in (16, 32, 64, 128) for bk in (128, 256, 512) for st in (2, 3, 4)
                  if bk * st <= 1024] + [(128, 128, 8, 4), (128, 256, 8, 3)]
# --split-sweep: the tensor-core GEMVs' tiles of 64 rows with K cut into 1-8 splits (the config's fifth element)
DOT_SPLIT_SWEEP = [(64, bk, 4, st, sp) for bk, st in ((128, 4), (256, 3), (256, 4), (512, 2), (512, 3))
                   for sp in (1, 2, 4, 8)]
GEMV_SWEEP_KINDS = ("int8", "fp8", "fp8-dot")
# paged decode attention: qwen2.5-7b's heads, 4k context
ATTN = dict(hq=28, hkv=4, d=128, block=16, ctx=4096, batches=(64, 256))
TINY_ATTN = dict(hq=4, hkv=2, d=16, block=4, ctx=40, batches=(3,))
# the skinny-tile sweep: (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages, SPLIT_K); split-K is int8 only
SWEEP = [(16, bn, bk, 1, 4, st, sk) for bn in (16, 32, 64) for bk in (256, 512) for st in (3, 5) for sk in (1, 2, 4)]
# the mid-M GEMM tiles (int8, M = 64 and 256)
SWEEP_MID = [(bm, bn, bk, 8, w, st, sk) for bm in (64, 128) for bn in (64, 128) for bk in (128, 256)
             for w, st in ((4, 4), (8, 3)) for sk in (1, 2, 4) if not (bm == 128 and bk == 256)]


def gpu_slug() -> str:
    if not torch.cuda.is_available():
        return "cpu"
    m = re.search(r"\b([a-z]+\d+[a-z]*)\b", torch.cuda.get_device_name().lower().replace("nvidia", ""))
    return m.group(1) if m else "gpu"


class Ops:
    """The ops under test, imported once TRITON_INTERPRET is settled (triton.jit reads it at import)."""

    def __init__(self):
        from mini_infer.ops import fp8_linear, int8_linear, linear, paged_attention, quant

        self.fp8, self.int8, self.linear, self.pa, self.quant = fp8_linear, int8_linear, linear, paged_attention, quant


def make_weights(ops: Ops, n: int, k: int, device) -> dict:
    g = torch.Generator(device=device).manual_seed(n + k)
    w = (torch.randn(n, k, generator=g, device=device) / k**0.5).to(torch.bfloat16)
    w8, s8 = ops.quant.quantize_per_token_reference(w, torch.int8)
    wf, sf = ops.quant.quantize_per_token_reference(w, FP8)
    return {"bf16": w, "int8": (w8, s8.view(n)), "fp8": (wf, sf.view(n))}


def weight_copies(t: torch.Tensor, l2: int, device) -> list[torch.Tensor]:
    """Enough copies of `t` that cycling through them reads from HBM (>= 3x L2), at most 16."""
    if device == "cpu":
        return [t]
    n = max(1, min(16, -(-3 * l2 // (t.numel() * t.element_size()))))
    return [t] + [t.clone() for _ in range(n - 1)]


def impl_calls(ops: Ops, name: str, x: torch.Tensor, weights: dict, l2: int, device) -> list[Callable] | None:
    """One closure per weight copy for impl `name`, or None where the impl does not apply."""
    m = x.shape[0]
    int8, fp8 = ops.int8, ops.fp8
    w8, s8 = weights["int8"]
    wf, sf = weights["fp8"]
    n, k = w8.shape
    if name == "bf16":
        return [lambda w=w: F.linear(x, w) for w in weight_copies(weights["bf16"], l2, device)]
    if name in ONE_ROW_IMPLS and m != 1:
        return None
    if name == "gemv":
        return [lambda w=w: ops.linear.linear_triton(x, w, None) for w in weight_copies(weights["bf16"], l2, device)]
    if name.startswith("int8"):
        xq, xs = ops.quant.quantize_per_token_triton(x, torch.int8)
        if name == "int8":
            return [lambda w=w: int8.int8_linear_triton(xq, xs, w, s8, None, x.dtype)
                    for w in weight_copies(w8, l2, device)]
        if name == "int8-tile":
            return [lambda w=w: int8.scaled_mm_triton(xq, xs, w, s8, None, x.dtype, int8.scaled_mm_config(m))
                    for w in weight_copies(w8, l2, device)]
        if name == "int8-byte":
            return [lambda w=w: int8.scaled_gemv_triton(xq, xs, w, s8, None, x.dtype, pack_int8=False)
                    for w in weight_copies(w8, l2, device)]
        return [lambda w=w: int8.w8a8_linear_triton(x, w, s8, None) for w in weight_copies(w8, l2, device)]
    if device == "cuda" and not fp8.fp8_supported(device):
        return None
    xq, xs = ops.quant.quantize_per_token_triton(x, FP8)
    if name in ("fp8-gemv", "fp8-dot"):
        mode = "dot" if name == "fp8-dot" else "cuda-cores"
        return [lambda w=w: int8.scaled_gemv_triton(xq, xs, w, sf, None, x.dtype, fp8_gemv=mode)
                for w in weight_copies(wf, l2, device)]
    if name == "fp8-tri":
        return [lambda w=w: int8.scaled_mm_triton(xq, xs, w, sf, None, x.dtype) for w in weight_copies(wf, l2, device)]
    if name == "fp8-smm":
        if device != "cuda" or not fp8._scaled_mm_takes(m, k, n, x.dtype):
            return None
        return [lambda w=w: fp8.scaled_mm_fp8(xq, xs, w, sf, None, x.dtype) for w in weight_copies(wf, l2, device)]
    if name == "fp8+q":
        return [lambda w=w: fp8.fp8_w8a8_linear_triton(x, w, sf, None) for w in weight_copies(wf, l2, device)]
    raise ValueError(name)


# --------------------------------------------------------------------------------------------------
# correctness
# --------------------------------------------------------------------------------------------------


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30))


def max_ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest |got - want| in units of want's dtype ulp at |want| (0 = identical)."""
    ulp = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}[want.dtype]
    d = (got.float() - want.float()).abs()
    scale = want.float().abs().clamp_min(torch.finfo(want.dtype).tiny) * ulp
    return float((d / scale).max()) if d.numel() else 0.0


def check_linears(ops: Ops, shapes, ms, device) -> list[dict]:
    """Every timed path against the references; int8 rows identical across M buckets."""
    rows = []
    for name, n, k, _ in shapes:
        weights = make_weights(ops, n, k, device)
        w8, s8 = weights["int8"]
        wf, sf = weights["fp8"]
        g = torch.Generator(device=device).manual_seed(k)
        x_all = torch.randn(max(ms), k, generator=g, device=device).to(torch.bfloat16)
        first_rows = {}
        for m in ms:
            x = x_all[:m]
            res = {"shape": name, "M": m}
            xq, xs = ops.quant.quantize_per_token_reference(x, torch.int8)
            tq, ts = ops.quant.quantize_per_token_triton(x, torch.int8)
            res["quant_int8_exact"] = bool(torch.equal(xq, tq) and torch.equal(xs, ts))
            want = ops.int8.int8_linear_reference(xq, xs, w8, s8, None, torch.bfloat16)
            got = ops.int8.int8_linear_triton(xq, xs, w8, s8, None, torch.bfloat16)
            res["int8_max_ulps"] = max_ulps(got, want)
            first_rows[m] = got[: min(ms)]
            if m == 1:  # the GEMV (words and bytes) against the skinny tile: the same bits
                tile = ops.int8.scaled_mm_triton(xq, xs, w8, s8, None, torch.bfloat16, ops.int8.scaled_mm_config(1))
                res["int8_gemv_bits_equal_tile"] = all(
                    torch.equal(ops.int8.scaled_gemv_triton(xq, xs, w8, s8, None, torch.bfloat16, pack_int8=p), tile)
                    for p in (True, False))
            fq, fs = ops.quant.quantize_per_token_reference(x, FP8)
            tq, ts = ops.quant.quantize_per_token_triton(x, FP8)
            res["quant_fp8_exact"] = bool(torch.equal(fq.view(torch.uint8), tq.view(torch.uint8))
                                          and torch.equal(fs, ts))
            if device == "cpu" or ops.fp8.fp8_supported(device):
                want = ops.fp8.fp8_linear_reference(fq, fs, wf, sf, None, torch.float32)
                res["fp8_triton_rel_err"] = rel_err(ops.int8.scaled_mm_triton(fq, fs, wf, sf, None, torch.bfloat16), want)
                for mode in ("cuda-cores", "dot") if m == 1 else ():
                    res[f"fp8_gemv_{mode}_rel_err"] = rel_err(
                        ops.int8.scaled_gemv_triton(fq, fs, wf, sf, None, torch.bfloat16, fp8_gemv=mode), want)
                if m == 1:  # the tensor-core GEMV cut into 3 splits of K
                    res["fp8_gemv_dot_split_rel_err"] = rel_err(ops.int8.scaled_gemv_triton(
                        fq, fs, wf, sf, None, torch.bfloat16, (*ops.int8.SCALED_GEMV_CONFIG_FP8_DOT[:4], 3),
                        fp8_gemv="dot"), want)
                if device == "cuda" and ops.fp8._scaled_mm_takes(m, k, n, torch.bfloat16):
                    res["fp8_scaled_mm_rel_err"] = rel_err(ops.fp8.scaled_mm_fp8(fq, fs, wf, sf, None, torch.bfloat16),
                                                           want)
            res["ok"] = (res["quant_int8_exact"] and res["quant_fp8_exact"] and res["int8_max_ulps"] <= 1.0
                         and res.get("int8_gemv_bits_equal_tile", True)
                         and all(v < 1e-2 for key, v in res.items() if key.endswith("rel_err")))
            rows.append(res)
            print(f"check {name:<10}M={m:<5} " + " ".join(
                f"{key}={v:.2e}" if isinstance(v, float) else f"{key}={v}" for key, v in res.items()
                if key not in ("shape", "M")), flush=True)
        same = all(torch.equal(first_rows[m], first_rows[ms[0]]) for m in ms)
        rows.append({"shape": name, "int8_rows_identical_across_M": same, "ok": same})
        print(f"check {name:<10}int8 rows 0..{min(ms) - 1} identical at M = {list(ms)}: {same}", flush=True)
        del weights
    return rows


def check_fused_producers(ops: Ops, device, hidden: int, inter: int, m: int) -> list[dict]:
    """The fused quantizing producers give the bits of (existing Triton op, then quantize_per_token_triton)."""
    from mini_infer.ops.fused_add_rms_norm import fused_add_rms_norm_triton
    from mini_infer.ops.rms_norm import rms_norm_triton
    from mini_infer.ops.silu_and_mul import silu_and_mul_triton

    q = ops.quant
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, hidden, generator=g, device=device).to(torch.bfloat16)
    r = torch.randn(m, hidden, generator=g, device=device).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(hidden, generator=g, device=device)).to(torch.bfloat16)
    gu = torch.randn(m, 2 * inter, generator=g, device=device).to(torch.bfloat16)
    gate, up = gu[:, :inter], gu[:, inter:]

    def same(a, b):
        return all(torch.equal(s.view(torch.uint8) if s.dtype == FP8 else s, t.view(torch.uint8) if t.dtype == FP8
                               else t) for s, t in zip(a, b))

    rows = []
    for qd in (torch.int8, FP8):
        normed, s = fused_add_rms_norm_triton(x, r, w, 1e-6)
        res = {"dtype": str(qd),
               "rms_norm_quant": same(q.rms_norm_quant_triton(x, w, 1e-6, qd),
                                      q.quantize_per_token_triton(rms_norm_triton(x, w, 1e-6), qd)),
               "fused_add_rms_norm_quant": same(q.fused_add_rms_norm_quant_triton(x, r, w, 1e-6, qd),
                                                (*q.quantize_per_token_triton(normed, qd), s)),
               "silu_and_mul_quant": same(q.silu_and_mul_quant_triton(gate, up, qd),
                                          q.quantize_per_token_triton(silu_and_mul_triton(gate, up), qd))}
        res["ok"] = all(v for key, v in res.items() if key != "dtype")
        print(f"check fused producers {qd}, M={m}: " + " ".join(f"{k}={v}" for k, v in res.items()), flush=True)
        rows.append(res)
    return rows


def attention_args(ops: Ops, batch: int, cfg: dict, device, fp8: bool, seed: int = 0) -> tuple:
    """A decode step: `batch` sequences at context cfg['ctx'], one new token each, paged caches."""
    hq, hkv, d, bs, ctx = cfg["hq"], cfg["hkv"], cfg["d"], cfg["block"], cfg["ctx"]
    g = torch.Generator(device=device).manual_seed(seed)
    nb = -(-ctx // bs)
    num_blocks = batch * nb + 4
    kc = torch.randn(num_blocks, bs, hkv, d, generator=g, device=device).to(torch.bfloat16)
    vc = torch.randn(num_blocks, bs, hkv, d, generator=g, device=device).to(torch.bfloat16)
    bt = torch.randperm(num_blocks, generator=g, device=device)[: batch * nb].view(batch, nb).int()
    q = torch.randn(batch, hq, d, generator=g, device=device).to(torch.bfloat16)
    k = torch.randn(batch, hkv, d, generator=g, device=device).to(torch.bfloat16)
    v = torch.randn(batch, hkv, d, generator=g, device=device).to(torch.bfloat16)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=device)
    slots = bt[:, (ctx - 1) // bs].long() * bs + (ctx - 1) % bs
    args = [q, k, v, kc, vc, slots, bt, lens, qsl, d**-0.5, 0, 0.0]
    if fp8:
        ks = (kc.float().abs().amax() / 448).reshape(1)
        vs = (vc.float().abs().amax() / 448).reshape(1)
        args[3] = ops.pa._to_cache(kc, torch.empty(0, dtype=FP8), ks)
        args[4] = ops.pa._to_cache(vc, torch.empty(0, dtype=FP8), vs)
        args += [ks, vs]
    return tuple(args)


def check_attention(ops: Ops, device, cfg: dict) -> dict:
    """fp8-cache Triton decode (default knobs and split-K) vs the fp8 reference."""
    args = attention_args(ops, 8, {**cfg, "ctx": min(cfg["ctx"], 300)}, device, fp8=True, seed=1)
    ref_args = [a.clone() if torch.is_tensor(a) else a for a in args]
    want = ops.pa.paged_attention_reference(*ref_args)
    res = {}
    for knobs in ({}, {"decode_only": True, "num_splits": 4}):
        tri_args = [a.clone() if torch.is_tensor(a) else a for a in args]
        got = ops.pa.paged_attention_triton(*tri_args, **knobs)
        res[f"rel_err{knobs or ''}"] = rel_err(got, want)
        res["cache_bytes_equal"] = bool(torch.equal(tri_args[3].view(torch.uint8), ref_args[3].view(torch.uint8)))
    res["ok"] = res["cache_bytes_equal"] and all(v < 2e-2 for key, v in res.items() if key.startswith("rel_err"))
    print("check fp8 paged attention: " + " ".join(f"{k}={v}" for k, v in res.items()), flush=True)
    return res


# --------------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------------


def time_it(calls: list[Callable], device, target_ms: float, rounds: int) -> float:
    """ms per call: CUDA-graph replay (kernel_norm.time_calls) on a GPU, one wall-clock pass on CPU."""
    if device == "cuda":
        return time_calls(calls, target_ms, rounds)[0]
    t0 = time.perf_counter()
    for c in calls:
        c()
    return (time.perf_counter() - t0) * 1e3 / len(calls)


def bench_linears(ops: Ops, shapes, ms, device, copy_gbps: float, l2: int, args) -> list[dict]:
    rows = []
    head = f"{'gemm':<10}{'M':>6} |" + "".join(f"{n:>10}" for n in IMPLS) + " | us per call; then "
    print(head + "%copy (weight bytes / time, M <= 64) or TFLOP/s (M >= 256) of bf16 / int8 / fp8 best")
    for name, n, k, per_step in shapes:
        weights = make_weights(ops, n, k, device)
        g = torch.Generator(device=device).manual_seed(1)
        for m in ms:
            x = torch.randn(m, k, generator=g, device=device).to(torch.bfloat16)
            row = {"gemm": name, "N": n, "K": k, "M": m, "per_step": per_step, "us": {}}
            for impl in IMPLS:
                calls = impl_calls(ops, impl, x, weights, l2, device)
                if calls is None:
                    continue
                try:
                    row["us"][impl] = time_it(calls, device, args.target_ms, args.rounds) * 1e3
                except Exception as e:  # e.g. a shape _scaled_mm rejects on this GPU
                    row.setdefault("errors", {})[impl] = f"{type(e).__name__}: {e}"[:300]
                del calls
            us = row["us"]
            best = {"bf16": min(us.get("bf16", math.inf), us.get("gemv", math.inf)), "int8": us.get("int8", math.inf),
                    "fp8": min(us.get(i, math.inf) for i in ("fp8-gemv", "fp8-dot", "fp8-tri", "fp8-smm"))}
            line = f"{name:<10}{m:>6} |" + "".join(f"{us[i]:>10.1f}" if i in us else f"{'-':>10}" for i in IMPLS) + " |"
            if device == "cuda" and m <= 64:
                wbytes = {"bf16": 2 * n * k, "int8": n * k, "fp8": n * k}
                row["weight_frac_copy"] = {kk: wbytes[kk] / (t * 1e-6) / (copy_gbps * 1e9)
                                           for kk, t in best.items() if t < math.inf}
                line += "".join(f" {kk} {100 * v:>3.0f}%" for kk, v in row["weight_frac_copy"].items())
            elif device == "cuda":
                row["tflops"] = {kk: 2 * m * n * k / (t * 1e-6) / 1e12 for kk, t in best.items() if t < math.inf}
                line += "".join(f" {kk} {v:>5.0f}" for kk, v in row["tflops"].items())
            if row.get("errors"):
                line += "  errors: " + ", ".join(row["errors"])
            if device == "cuda" and m == 1:  # every impl: weight bytes / time, TB/s and % of copy
                row["weight_tbps"] = {i: (2 if i in ("bf16", "gemv") else 1) * n * k / (t * 1e-6) / 1e12
                                      for i, t in us.items()}
                line += "\n" + " " * 10 + "M=1 weight TB/s (% copy): " + ", ".join(
                    f"{i} {v:.2f} ({100 * v * 1e3 / copy_gbps:.0f}%)" for i, v in row["weight_tbps"].items())
            print(line, flush=True)
            rows.append(row)
        del weights
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def decode_step_sums(rows: list[dict]) -> dict:
    """One decode step's weight GEMMs at M = 1 (28 layers + lm_head), per impl."""
    sums: dict[str, float] = {}
    for r in rows:
        if r["M"] != 1:
            continue
        for impl, us in r["us"].items():
            sums[impl] = sums.get(impl, 0.0) + r["per_step"] * us
    return sums


def time_configs(launch: Callable, grid, operands: tuple, copies: list[torch.Tensor], device, args,
                 label: str) -> list[tuple[float, tuple]]:
    """(us per call, config) for `launch(x_q, x_scale, w, w_scale, None, bf16, config)` over every config of
    `grid` (cycling the weight copies), fastest first; a config that fails to launch is reported and left out."""
    xq, xs, s = operands
    res = []
    for cfg in grid:
        calls = [lambda w=w, cfg=cfg: launch(xq, xs, w, s, None, torch.bfloat16, cfg) for w in copies]
        try:
            res.append((time_it(calls, device, args.target_ms, args.rounds) * 1e3, cfg))
        except Exception as e:  # out of resources
            print(f"  {label} {cfg}: {type(e).__name__}", file=sys.stderr)
    return sorted(res)


def sweep_skinny(ops: Ops, shapes, device, copy_gbps: float, l2: int, args) -> list[dict]:
    """Time scaled_mm_triton over SWEEP (skinny tile, M = 1, 8, 16, int8 and fp8 operands) and SWEEP_MID (int8,
    M = 64, 256)."""
    out = []
    for name, n, k, _ in shapes:
        weights = make_weights(ops, n, k, device)
        for qname, (w, s) in (("int8", weights["int8"]), ("fp8", weights["fp8"])):
            if qname == "fp8" and device == "cuda" and not ops.fp8.fp8_supported(device):
                continue
            copies = weight_copies(w, l2, device)
            for m in (1, 8, 16, 64, 256):
                if m > 16 and qname != "int8":
                    continue
                x = torch.randn(m, k, device=device).to(torch.bfloat16)
                xq, xs = ops.quant.quantize_per_token_triton(x, torch.int8 if qname == "int8" else FP8)
                grid = SWEEP_MID if m > 16 else SWEEP if qname == "int8" else [c for c in SWEEP if c[-1] == 1]
                res = time_configs(ops.int8.scaled_mm_triton, grid, (xq, xs, s), copies, device, args,
                                   f"sweep {name} {qname} M={m}")
                frac = n * k / (res[0][0] * 1e-6) / (copy_gbps * 1e9) if device == "cuda" else 0.0
                print(f"sweep {name:<10}{qname:<5}M={m:<4} best {res[0][1]} {res[0][0]:.1f} us ({100 * frac:.0f}% copy);"
                      f" next {[f'{t:.1f} {c[1:3] + c[5:]}' for t, c in res[1:4]]}", flush=True)
                out.append({"gemm": name, "dtype": qname, "M": m, "results": [(t, list(c)) for t, c in res]})
        del weights
    return out


def sweep_gemv(ops: Ops, shapes, device, copy_gbps: float, l2: int, args) -> list[dict]:
    """Time scaled_gemv_triton (M = 1) over its tiles for each kind of args.sweep_gemv: int8 (int32 words, dp4a)
    and fp8 (CUDA cores) over GEMV_SWEEP, fp8-dot (tensor cores) over DOT_GEMV_SWEEP."""
    out = []
    for name, n, k, _ in shapes:
        weights = make_weights(ops, n, k, device)
        x = torch.randn(1, k, device=device).to(torch.bfloat16)
        for qname in args.sweep_gemv.split(","):
            w, s = weights["int8" if qname == "int8" else "fp8"]
            if qname != "int8" and device == "cuda" and not ops.fp8.fp8_supported(device):
                continue
            copies = weight_copies(w, l2, device)
            xq, xs = ops.quant.quantize_per_token_triton(x, torch.int8 if qname == "int8" else FP8)
            mode = "dot" if qname == "fp8-dot" else "cuda-cores"
            grid = (DOT_SPLIT_SWEEP if args.split_sweep else DOT_GEMV_SWEEP) if mode == "dot" else GEMV_SWEEP
            res = time_configs(functools.partial(ops.int8.scaled_gemv_triton, fp8_gemv=mode),
                               grid if device == "cuda" else grid[:2], (xq, xs, s), copies, device, args,
                               f"sweep-gemv {name} {qname}")
            cfg = ops.int8.scaled_gemv_config(xq.dtype, k, mode)
            default = next((t for t, c in res if c == cfg), math.nan)
            tbps = n * k / (res[0][0] * 1e-6) / 1e12
            print(f"sweep-gemv {name:<10}{qname:<5} best {res[0][1]} {res[0][0]:.1f} us ({tbps:.2f} TB/s, "
                  f"{100 * tbps * 1e3 / copy_gbps:.0f}% copy); default {cfg} {default:.1f} us;"
                  f" next {[f'{t:.1f} {c}' for t, c in res[1:4]]}", flush=True)
            out.append({"gemm": name, "dtype": qname, "results": [(t, list(c)) for t, c in res]})
        del weights
    return out


def bench_attention(ops: Ops, cfg: dict, device, args) -> list[dict]:
    rows = []
    for batch in cfg["batches"]:
        row = {"batch": batch, "ctx": cfg["ctx"], "hq": cfg["hq"], "hkv": cfg["hkv"], "d": cfg["d"]}
        for kind in ("bf16", "fp8"):
            a = attention_args(ops, batch, cfg, device, fp8=kind == "fp8")
            ms = time_it([lambda a=a: ops.pa.paged_attention_triton(*a)], device, args.target_ms, args.rounds)
            kv_bytes = 2 * batch * cfg["ctx"] * cfg["hkv"] * cfg["d"] * (1 if kind == "fp8" else 2)
            row[kind] = {"us": ms * 1e3, "kv_bytes": kv_bytes, "tbps": kv_bytes / (ms * 1e-3) / 1e12}
            del a
        row["speedup"] = row["bf16"]["us"] / row["fp8"]["us"]
        print(f"paged decode attention, batch {batch}, ctx {cfg['ctx']}: bf16 cache {row['bf16']['us']:.1f} us "
              f"({row['bf16']['tbps']:.2f} TB/s of KV), fp8 cache {row['fp8']['us']:.1f} us "
              f"({row['fp8']['tbps']:.2f} TB/s), {row['speedup']:.2f}x", flush=True)
        rows.append(row)
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="correctness at the benchmark shapes first (exit 1 on failure)")
    ap.add_argument("--check-only", action="store_true", help="only the correctness checks")
    ap.add_argument("--sweep", action="store_true", help="also sweep scaled_mm_triton's tiles (M <= 256)")
    ap.add_argument("--sweep-gemv", nargs="?", const=",".join(GEMV_SWEEP_KINDS), default=None,
                    help="also sweep scaled_gemv_triton's tiles (M = 1): all kinds, or a comma list of "
                         f"{', '.join(GEMV_SWEEP_KINDS)}")
    ap.add_argument("--split-sweep", action="store_true",
                    help="--sweep-gemv's fp8-dot over DOT_SPLIT_SWEEP: tiles of 64 rows, K in 1-8 splits")
    ap.add_argument("--tiny", action="store_true", help="CPU, TRITON_INTERPRET=1, tiny shapes: exercises every path")
    ap.add_argument("--ms", default=None, help="comma list of M (default 1,8,64,256,8192)")
    ap.add_argument("--shapes", default=None, help="comma list of gemm names (default all)")
    ap.add_argument("--no-attention", action="store_true")
    ap.add_argument("--target-ms", type=float, default=5.0, help="GPU time per timing round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--copy-gib", type=float, default=1.0)
    ap.add_argument("--out", default=None, help="folder for the JSON (default bench/results, --tiny: bench/out)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    on_gpu = torch.cuda.is_available() and not args.tiny
    if not on_gpu and not args.tiny:
        raise SystemExit("bench/kernel_quant.py times CUDA kernels; without a GPU run `--tiny` (the same code paths "
                         "on CPU under TRITON_INTERPRET=1, tiny shapes)")
    if not on_gpu:
        os.environ["TRITON_INTERPRET"] = "1"  # before mini_infer.ops imports triton
    elif os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("TRITON_INTERPRET is set: unset it to time the kernels on the GPU")
    from mini_infer.ops import HAS_TRITON

    if not HAS_TRITON:
        raise SystemExit("triton is not importable: nothing to benchmark")
    ops = Ops()
    device = "cuda" if on_gpu else "cpu"
    shapes = TINY_SHAPES if args.tiny else SHAPES
    if args.shapes:
        shapes = [s for s in shapes if s[0] in args.shapes.split(",")]
    ms = tuple(int(v) for v in args.ms.split(",")) if args.ms else (TINY_MS if args.tiny else MS)
    attn = TINY_ATTN if args.tiny else ATTN
    t0 = time.perf_counter()
    report: dict = {"meta": {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "git": git_info(), "argv": sys.argv[1:],
                             "torch": torch.__version__, "device": torch.cuda.get_device_name() if on_gpu else
                             "cpu (TRITON_INTERPRET=1)", "timing": "CUDA graph replay, median of rounds"
                             if on_gpu else "one wall-clock pass (interpreter: meaningless)"}}
    if on_gpu:
        p = torch.cuda.get_device_properties(0)
        report["meta"].update(capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count, cuda=torch.version.cuda,
                              fp8=ops.fp8.fp8_supported("cuda"))
    if args.check or args.check_only or args.tiny:
        checks = {"linears": check_linears(ops, shapes, ms, device),
                  "fused_producers": check_fused_producers(ops, device, 128 if args.tiny else 3584,
                                                           96 if args.tiny else 18944, 5 if args.tiny else 64),
                  "attention": check_attention(ops, device, attn)}
        report["check"] = checks
        failed = [r for rows in checks.values() for r in (rows if isinstance(rows, list) else [rows]) if not r["ok"]]
        print("check passed" if not failed else f"check FAILED ({len(failed)} rows)", flush=True)
        if failed:
            return 1
        if args.check_only:
            return 0
    l2 = torch.cuda.get_device_properties(0).L2_cache_size if on_gpu else 0
    copy = copy_bandwidth(args.copy_gib, args.target_ms, args.rounds) if on_gpu else {"gbps": float("nan")}
    report["meta"]["copy_gbps"] = copy["gbps"]
    print(f"{report['meta']['device']} | copy bandwidth {copy['gbps']:.0f} GB/s | bf16 activations, weights cold "
          f"in L2 | {report['meta']['timing']}", flush=True)
    report["linears"] = bench_linears(ops, shapes, ms, device, copy["gbps"], l2, args)
    if 1 in ms:
        report["decode_step_us"] = decode_step_sums(report["linears"])
        print("one decode step's weight GEMMs at M = 1: " + ", ".join(
            f"{k} {v / 1e3:.3f} ms" for k, v in report["decode_step_us"].items()), flush=True)
    if args.sweep:
        report["sweep_skinny"] = sweep_skinny(ops, shapes, device, copy["gbps"], l2, args)
    if args.sweep_gemv:
        report["sweep_gemv"] = sweep_gemv(ops, shapes, device, copy["gbps"], l2, args)
    if not args.no_attention:
        report["attention"] = bench_attention(ops, attn, device, args)
    report["meta"]["wall_seconds"] = round(time.perf_counter() - t0, 1)
    out = Path(args.out or ("bench/out" if args.tiny else "bench/results"))
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"kernel_quant_{gpu_slug()}.json"
    path.write_text(json.dumps(report, indent=2, default=str))
    print(f"{report['meta']['wall_seconds']:.0f} s; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
