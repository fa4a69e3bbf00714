"""The fused mixture-of-experts op on a GPU (not a test): Triton launcher vs the torch reference vs a dense floor.

    PYTHONPATH=. python bench/kernel_moe.py [--check] [--models qwen3-30b-a3b,mixtral-8x7b] [--tokens 1,8,64,256,2048,8192]
    PYTHONPATH=. python bench/kernel_moe.py --check --tiny     # no GPU needed: tiny shapes, Triton under TRITON_INTERPRET=1
    PYTHONPATH=. python bench/kernel_moe.py --sweep            # also time alternative tile configs per shape (slow)
    PYTHONPATH=. python bench/kernel_moe.py --sweep --sweep-narrow --tokens 1   # decode shapes: 16-32 columns a tile
    PYTHONPATH=. python bench/kernel_moe.py --decode --check   # the decode path beside the grouped GEMMs (< 3 min)

For `qwen3-30b-a3b` (H 2048, I 768, E 128, k 8) and `mixtral-8x7b` (H 4096, I 14336, E 8, k 2) experts in bf16,
at T = 1, 8, 64, 256 (decode batches) and 2048, 8192 (prefill chunks) tokens, routed by softmax top-k of random
logits (about uniform over experts), times one call of:

  triton  `fused_moe_triton` (what the compiled graphs call on CUDA), as a CUDA-graph replay
  ref     `fused_moe_reference` (the CPU path and oracle: fp32 loop over the experts in use; host-synced, so
          timed eagerly with CUDA events, a few calls; --no-ref skips it)
  dense   the floor: two cuBLAS `torch.bmm` over the experts the call touches, the rows split evenly among them
          (the same weight bytes and FLOPs with no routing, gather, activation or slot sum), as a graph replay

and reports, for each: microseconds per call (median of --rounds), the achieved bandwidth of the expert weights
the call actually touches (distinct experts x 3 x H x I x 2 bytes, each counted once) as GB/s and as a share of
the copy bandwidth measured in the same run (`dst.copy_(src)`), and TFLOP/s (2 x T x k x 3 x H x I). Decode
calls are bound by the weight bytes (GB/s is the figure of merit), prefill calls by FLOPs (TFLOP/s). Each
timing cycles through several routings (different experts) so that the touched weights are not L2-resident
from the previous call.

--decode times, at T = 1, 2, 4, 8 for qwen3-30b-a3b, mixtral-8x7b and deepseek-v2-lite, the decode path
(`_moe_gemv.py`: two grouped GEMVs, no align, no slot sum) beside the grouped GEMMs (`moe_tile_config`'s tiles),
each forced whatever `fused_moe_triton` would pick by shape (the "picks" column: "gemv" up to
MOE_GEMV_MAX_PAIRS pairs), as CUDA-graph replays with % of copy bandwidth over the touched expert bytes; with
--check both paths are first compared with the reference; with --sweep the decode path's tiles are varied too.

--mxfp4 times `fused_moe_mxfp4_triton` (the experts packed to MXFP4 by `quantize_mxfp4`, 4.25 bits a weight) beside
`fused_moe_triton` on the bf16 weights, at T = 1, 8, 64, 2048 for gpt-oss-20b and qwen3-30b-a3b, in each of its
paths, forced: the grouped GEMMs (`mxfp4_tiles`) and, up to 64 pairs, the decode GEMVs, beyond, the experts
dequantized for fused_moe_triton ("picks": what it takes by shape); % of copy bandwidth over the touched MXFP4 bytes. With --sweep (--sweep-paths grouped,gemv): the grouped
GEMMs with one tile for both varied (block_n, block_k, warps, stages), the GEMVs one at a time.

--check first compares the Triton output with the reference on every shape (relative Frobenius error and max
|err|), and stops with exit status 1 on a mismatch. Prints a table; writes JSON to --out
(bench/results/kernel_moe_<gpu>.json, gpu as in "h200"). Timing helpers come from bench/kernel_norm.py.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from kernel_norm import copy_bandwidth, git_info, int_list, time_calls  # the sibling script's timing

MODELS = {
    "qwen3-30b-a3b": {"hidden": 2048, "inter": 768, "experts": 128, "top_k": 8},
    "mixtral-8x7b": {"hidden": 4096, "inter": 14336, "experts": 8, "top_k": 2},
    "deepseek-v2-lite": {"hidden": 2048, "inter": 1408, "experts": 64, "top_k": 6},
    "gpt-oss-20b": {"hidden": 2880, "inter": 2880, "experts": 32, "top_k": 4},
}
MXFP4_MODELS = ("gpt-oss-20b", "qwen3-30b-a3b")
MXFP4_TOKENS = (1, 8, 64, 2048)
TOKENS = (1, 8, 64, 256, 2048, 8192)
DECODE_MODELS = ("qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v2-lite")
DECODE_TOKENS = (1, 2, 4, 8)
# --decode --sweep: decode-path gate/up tiles tried (rows per program, K per step, warps, stages); the down tiles
# are built per shape (their K step must divide I: `gemv_sweep_configs`)
GATE_UP_SWEEP = [(1, 2048, 4, 1), (2, 1024, 4, 1), (2, 2048, 4, 1), (4, 1024, 4, 1), (2, 1024, 4, 3), (1, 1024, 4, 3),
                 (2, 512, 4, 3), (4, 512, 4, 3), (2, 2048, 8, 1), (4, 2048, 8, 1)]
TINY_MODELS = {  # --tiny: interpreter-sized (and K not a multiple of the tiles' BLOCK_K)
    "tiny-8e": {"hidden": 64, "inter": 40, "experts": 8, "top_k": 2},
    "tiny-16e": {"hidden": 48, "inter": 32, "experts": 16, "top_k": 4},
}
TINY_TOKENS = (1, 3, 17)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
REL_TOL = {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 1e-4}  # relative Frobenius error vs ref,
# as tests/ops/helpers.py: bf16 is loose (the interpreter even truncates fp32 -> bf16 instead of rounding)


def gpu_tag() -> str:
    """'h200' for 'NVIDIA H200', 'h100' for 'NVIDIA H100 80GB HBM3'; 'cpu' without a GPU."""
    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name().lower()
    m = re.search(r"\b([a-z]{1,2}\d{2,4})\b", name)
    return m.group(1) if m else re.sub(r"[^a-z0-9]+", "_", name).strip("_")


class Case:
    """One (model, T) shape: expert weights, `n_sets` routings of random inputs, and derived sizes."""

    def __init__(self, model: str, shape: dict, tokens: int, dtype: torch.dtype, device: str, n_sets: int):
        self.model, self.tokens, self.dtype = model, tokens, dtype
        self.hidden, self.inter, self.experts, self.top_k = (shape[k] for k in ("hidden", "inter", "experts", "top_k"))
        g = torch.Generator(device=device).manual_seed(tokens)
        h, i, e = self.hidden, self.inter, self.experts
        self.w13 = (torch.randn(e, 2 * i, h, generator=g, device=device) / h**0.5).to(dtype)
        self.w2 = (torch.randn(e, h, i, generator=g, device=device) / i**0.5).to(dtype)
        self.sets = []
        for _ in range(n_sets):
            x = torch.randn(tokens, h, generator=g, device=device).to(dtype)
            logits = torch.randn(tokens, e, generator=g, device=device)
            w, ids = torch.softmax(logits, dim=-1).topk(self.top_k, dim=-1)
            self.sets.append((x, w / w.sum(-1, keepdim=True), ids.to(torch.int32)))
        self.used = [int(torch.unique(s[2]).numel()) for s in self.sets]  # distinct experts per routing

    @property
    def elt(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def touched_bytes(self) -> float:
        """Mean bytes of expert weights one call reads at least once."""
        return statistics.mean(self.used) * 3 * self.hidden * self.inter * self.elt

    def flops(self) -> int:
        return 2 * self.tokens * self.top_k * 3 * self.hidden * self.inter

    def triton_calls(self, config=None) -> list[Callable]:
        from mini_infer.ops.fused_moe import fused_moe_triton

        return [lambda s=s: fused_moe_triton(*s, self.w13, self.w2, "silu", config=config) for s in self.sets]

    def reference_calls(self) -> list[Callable]:
        from mini_infer.ops.fused_moe import fused_moe_reference

        return [lambda s=s: fused_moe_reference(*s, self.w13, self.w2) for s in self.sets]

    def dense_calls(self) -> list[Callable]:
        """Two batched GEMMs over `used` experts (a different slice per set), T*k rows split evenly."""
        calls = []
        for n_used in self.used:
            rows = -(-self.tokens * self.top_k // n_used)
            x1 = torch.randn(n_used, rows, self.hidden, device=self.w13.device, dtype=self.dtype)
            x2 = torch.randn(n_used, rows, self.inter, device=self.w13.device, dtype=self.dtype)
            first = (len(calls) * n_used) % (self.experts - n_used + 1)
            w13t = self.w13[first:first + n_used].transpose(1, 2)
            w2t = self.w2[first:first + n_used].transpose(1, 2)
            calls.append(lambda x1=x1, x2=x2, a=w13t, b=w2t: (torch.bmm(x1, a), torch.bmm(x2, b)))
        return calls


def check_case(case: Case, config=None) -> dict:
    """Triton (with `config`, None: picked by shape) vs reference on the first routing: relative Frobenius error,
    max |err|, pass/fail."""
    tri, ref = case.triton_calls(config)[0], case.reference_calls()[0]
    got, want = tri().float(), ref().float()
    rel = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
    return {"rel_err": rel, "max_abs_err": (got - want).abs().max().item(), "ok": rel <= REL_TOL[case.dtype]
            and got.shape == want.shape}


def decode_paths(case: Case) -> dict:
    """{"grouped": moe_tile_config's tiles, "gemv": the decode path's tiles} for this shape, each forced."""
    from mini_infer.ops._moe_gemv import moe_gemv_tiles
    from mini_infer.ops.fused_moe import moe_tile_config

    return {"grouped": moe_tile_config(case.tokens, case.experts, case.top_k, case.hidden, case.inter),
            "gemv": moe_gemv_tiles(case.hidden, case.inter)}


def gemv_sweep_configs(base, inter: int):
    """The decode path's tiles varied one GEMV at a time (the other kept at `base`'s): GATE_UP_SWEEP, and down
    tiles of 2, 4, 8 rows, 1 or 3 stages, with the K steps that divide I (up to 1024, 512, 256)."""
    from dataclasses import replace

    from mini_infer.ops._moe_gemv import GemvTile, down_k_step

    for shape in GATE_UP_SWEEP:
        if GemvTile(*shape) != base.gate_up:
            yield "gate_up", replace(base, gate_up=GemvTile(*shape))
    for block_k in sorted({down_k_step(inter, most) for most in (1024, 512, 256)} - {None}):
        for block_n in (2, 4, 8):
            for stages in (1, 3):
                if GemvTile(block_n, block_k, 4, stages) != base.down:
                    yield "down", replace(base, down=GemvTile(block_n, block_k, 4, stages))


def bench_decode(args, dtype) -> dict:
    """--decode: the decode path beside the grouped GEMMs at few tokens (module docstring)."""
    from mini_infer.ops._moe_gemv import moe_gemv_config

    copy = copy_bandwidth(args.copy_gib, args.target_ms, args.rounds)
    print(f"{torch.cuda.get_device_name()} | {args.dtype} | copy bandwidth {copy['gbps']:.0f} GB/s | CUDA-graph "
          f"timings over {args.sets} routings, median of {args.rounds}", flush=True)
    print(f"{'model':<17}{'T':>3}{'pairs':>6}{'used':>5}{'MB':>7} |{'grouped us':>11}{'%copy':>6} |{'gemv us':>8}"
          f"{'%copy':>6} |{'speedup':>8}  picks")
    rows = []
    for model in args.models:
        shape = MODELS[model]
        for tokens in args.tokens:
            case = Case(model, shape, tokens, dtype, "cuda", args.sets)
            picks = "gemv" if moe_gemv_config(tokens, case.top_k, case.hidden, case.inter) else "grouped"
            row = {"model": model, "tokens": tokens, **shape, "dtype": args.dtype, "used_experts": case.used,
                   "touched_bytes": case.touched_bytes(), "picks": picks, "impls": {}, "configs": {}}
            for name, cfg in decode_paths(case).items():
                if args.check:
                    row.setdefault("check", {})[name] = check_case(case, cfg)
                ms, _ = time_calls(case.triton_calls(cfg), args.target_ms, args.rounds)
                row["impls"][name] = _metrics(ms, case, copy["gbps"])
                row["configs"][name] = repr(cfg)
            g, v = row["impls"]["grouped"], row["impls"]["gemv"]
            line = (f"{model:<17}{tokens:>3}{tokens * case.top_k:>6}{statistics.mean(case.used):>5.0f}"
                    f"{case.touched_bytes() / 1e6:>7.1f} |{g['us']:>11.1f}{100 * g['frac_copy']:>5.0f}% |"
                    f"{v['us']:>8.1f}{100 * v['frac_copy']:>5.0f}% |{g['us'] / v['us']:>7.2f}x  {picks}")
            if args.check:
                bad = [n for n, c in row["check"].items() if not c["ok"]]
                line += "  rel err " + " / ".join(f"{c['rel_err']:.1e}" for c in row["check"].values())
                line += f"  MISMATCH {bad}" if bad else ""
            print(line, flush=True)
            if args.sweep:
                base = decode_paths(case)["gemv"]
                timed = [(gemv, alt, time_calls(case.triton_calls(alt), args.target_ms, args.rounds)[0] * 1e3)
                         for gemv, alt in gemv_sweep_configs(base, case.inter)]
                row["sweep"] = [{"varied": gemv, "config": repr(alt), "us": us} for gemv, alt, us in timed]
                for gemv in ("gate_up", "down"):
                    _, alt, us = min((t for t in timed if t[0] == gemv), key=lambda t: t[2])
                    print(f"    best {gemv} variation: {us:.1f} us {getattr(alt, gemv)}", flush=True)
            rows.append(row)
            del case
            torch.cuda.empty_cache()
    failed = [(r["model"], r["tokens"]) for r in rows for c in r.get("check", {}).values() if not c["ok"]]
    return {"copy": copy, "results": rows, "check_failed": failed}


def mxfp4_sweep_tiles(kind: str):
    """--mxfp4 --sweep: GemmTiles tried for both grouped GEMMs of a call whose regime is `kind`."""
    from mini_infer.ops.fused_moe import GemmTile

    if kind == "decode":
        return [GemmTile(bn, bk, 1, w, st) for bn in (32, 64, 128) for bk in (64, 128, 256)
                for w, st in ((4, 1), (4, 3), (8, 3)) if not (bn == 128 and bk == 256)]
    return [GemmTile(bn, bk, 8, w, st) for bn in (64, 128) for bk in (64, 128) for w in (4, 8) for st in (2, 3)]


def mxfp4_gemv_sweep(base):
    """--mxfp4 --sweep: the decode GEMVs' tiles, each GEMV varied with the other kept at `base`'s."""
    from dataclasses import replace

    from mini_infer.ops._moe_gemv import GemvTile

    for bn, bk in ((2, 512), (4, 256), (4, 1024), (8, 256), (8, 512), (2, 1024)):
        for w in (4, 8):
            if GemvTile(bn, bk, w, 1) != base.gate_up:
                yield "gate_up", replace(base, gate_up=GemvTile(bn, bk, w, 1))
    for bn, bk in ((4, 256), (8, 512), (16, 256), (4, 512), (16, 128)):
        for w in (4, 8):
            if GemvTile(bn, bk, w, 1) != base.down:
                yield "down", replace(base, down=GemvTile(bn, bk, w, 1))


def _time_mxfp4(case: Case, packed: list, cfg, args) -> float | str:
    """us per fused_moe_mxfp4_triton call over the case's routings with tiles `cfg` (a MoeTileConfig: the grouped
    GEMMs; a MoeGemvConfig: the decode GEMVs); the error's text where the tile does not build or fit."""
    from mini_infer.ops.fused_moe_mxfp4 import fused_moe_mxfp4_triton

    calls = [lambda s=s: fused_moe_mxfp4_triton(*s, *packed, "silu", config=cfg) for s in case.sets]
    try:
        return time_calls(calls, args.target_ms, args.rounds)[0] * 1e3
    except Exception as e:  # a tile that does not compile or fit
        return f"{type(e).__name__}: {e}"[:200]


def _mxfp4_sweep(case: Case, packed: list, path: str, base, args) -> list[dict]:
    """--mxfp4 --sweep of one path ("grouped": the same tile for both GEMMs; "gemv": one GEMV at a time)."""
    from dataclasses import replace

    alts = ([(None, replace(base, gate_up=t, down=t)) for t in mxfp4_sweep_tiles(base.kind)] if path == "grouped"
            else list(mxfp4_gemv_sweep(base)))
    runs = []
    for varied, alt in alts:
        us = _time_mxfp4(case, packed, alt, args)
        runs.append({"config": repr(alt), "varied": varied, "us": us})
        shown = us if isinstance(us, str) else f"{us:.1f} us"
        tile = getattr(alt, varied) if varied else alt.gate_up
        print(f"    {path} {varied or 'both'} {tile}: {shown}", flush=True)
    return runs


def bench_mxfp4(args) -> dict:
    """--mxfp4: fused_moe_mxfp4_triton beside fused_moe_triton (module docstring)."""
    from mini_infer.ops import fused_moe_mxfp4 as fmx
    from mini_infer.ops.fused_moe import moe_tile_config

    copy = copy_bandwidth(args.copy_gib, args.target_ms, args.rounds)
    print(f"{torch.cuda.get_device_name()} | bf16 activations | copy bandwidth {copy['gbps']:.0f} GB/s | CUDA-graph "
          f"timings over {args.sets} routings, median of {args.rounds}", flush=True)
    print(f"{'model':<15}{'T':>6}{'used':>5} |{'bf16 us':>9}{'%copy':>6} |{'mx grouped us':>14}{'%copy':>6} |"
          f"{'mx gemv us':>11}{'%copy':>6} |{'mx dequant us':>14}{'%copy':>6} |   picks | best of sweep")
    rows = []
    for model in args.models:
        shape = MODELS[model]
        for tokens in args.tokens:
            case = Case(model, shape, tokens, torch.bfloat16, "cuda", args.sets if tokens <= 64 else 2)
            packed = [t for w in (case.w13, case.w2) for t in fmx.quantize_mxfp4(w)]
            mx_bytes = case.touched_bytes() * 4.25 / 16
            grouped = fmx.mxfp4_tiles(moe_tile_config(tokens, case.experts, case.top_k, case.hidden, case.inter))
            configs = {"grouped": grouped}
            if tokens * case.top_k <= 64:
                configs["gemv"] = fmx._GEMV_TILES
            else:
                configs["dequant"] = fmx.DEQUANTIZE
            bf16_us = time_calls(case.triton_calls(), args.target_ms, args.rounds)[0] * 1e3
            picks = ("gemv" if fmx.mxfp4_gemv_config(tokens, case.top_k) else
                     "dequant" if tokens * case.top_k >= fmx._DEQUANT_MIN_PAIRS else "grouped")
            row = {"model": model, "tokens": tokens, **shape, "used_experts": case.used,
                   "touched_bf16_bytes": case.touched_bytes(), "touched_mxfp4_bytes": mx_bytes, "bf16_us": bf16_us,
                   "picks": picks, "mxfp4": {p: {"config": repr(c), "us": _time_mxfp4(case, packed, c, args)}
                                             for p, c in configs.items()}}
            if args.sweep:
                for path, base in configs.items():
                    if path in args.sweep_paths:
                        row["mxfp4"][path]["sweep"] = _mxfp4_sweep(case, packed, path, base, args)
            line = (f"{model:<15}{tokens:>6}{statistics.mean(case.used):>5.0f} |{bf16_us:>9.1f}"
                    f"{100 * case.touched_bytes() / bf16_us / 1e3 / copy['gbps']:>5.0f}% |")
            for path, width in (("grouped", 14), ("gemv", 11), ("dequant", 14)):
                us = row["mxfp4"].get(path, {}).get("us", math.nan)
                line += (f"{us:>{width}.1f}{100 * mx_bytes / us / 1e3 / copy['gbps']:>5.0f}% |"
                         if isinstance(us, float) else f"{'error':>{width}}{'':>6} |")
            line += f" {picks:>7} |"
            if args.sweep:
                best = min(((p, s) for p, v in row["mxfp4"].items() for s in v.get("sweep", [])
                            if isinstance(s["us"], float)), key=lambda ps: ps[1]["us"], default=None)
                row["sweep_best"] = best and {"path": best[0], **best[1]}
                line += f" {best[1]['us']:.1f} us {best[0]} {best[1]['config']}" if best else " none built"
            print(line, flush=True)
            for path, v in row["mxfp4"].items():
                if isinstance(v["us"], str):
                    print(f"    {path}: {v['us']}", flush=True)
            rows.append(row)
            del case, packed
            torch.cuda.empty_cache()
    return {"copy": copy, "results": rows}


def time_eager(calls: list[Callable], rounds: int) -> float:
    """ms per call of host-synced callables: CUDA events around each call, median over rounds x calls."""
    for c in calls[:1]:
        c()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(rounds):
        for c in calls:
            start.record()
            c()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def sweep_configs(case: Case, narrow: bool = False):
    """Alternative tiles for --sweep around the regime `moe_tile_config` picks for this shape: the gate/up tile
    varied with the down tile kept, then the down tile varied with the gate/up tile kept (their times add up),
    for each BLOCK_M of the regime. `narrow` (--sweep-narrow), decode shapes: BLOCK_M 16 with 16 or 32 output
    columns a program, 2 or 4 warps, K steps of 64-256, instead."""
    from mini_infer.ops.fused_moe import GemmTile, MoeTileConfig, moe_tile_config

    base = moe_tile_config(case.tokens, case.experts, case.top_k, case.hidden, case.inter)
    yield base
    if base.kind == "decode" and narrow:
        shapes = [(16, w, bn, bk, st, 1) for w in (2, 4) for bn in (16, 32) for bk in (64, 128, 256) for st in (3, 4)]
    elif base.kind == "decode":
        shapes = [(bm, w, bn, bk, st, 1) for bm in (16, 32) for w in (4, 8) for bn in (32, 64, 128)
                  for bk in (128, 256, 512) for st in (3, 4) if (bm, bk) != (32, 512)]
    else:
        shapes = [(bm, 4 if bm == 64 else 8, bn, bk, st, 8) for bm in (64, 128) for bn in (64, 128, 256)
                  for bk in (32, 64) for st in (3, 4)]
    for bm, warps, bn, bk, st, gm in shapes:
        tile = GemmTile(bn, bk, gm, warps, st)
        if bn < 256:  # two accumulators of BLOCK_M x 256 do not fit in registers
            yield MoeTileConfig(base.kind, bm, tile, base.down)
        yield MoeTileConfig(base.kind, bm, base.gate_up, tile)


def _varies(config: str, base: str, gemm: str) -> bool:
    """Whether a swept config (repr) keeps the base's tile of the other GEMM."""
    other = "down" if gemm == "gate_up" else "gate_up"

    def part(text: str, name: str) -> str:
        return re.search(name + r"=GemmTile\([^)]*\)", text).group(0)

    return part(config, other) == part(base, other) and config != base


def _metrics(ms: float, case: Case, copy_gbps: float) -> dict:
    gbps = case.touched_bytes() / ms / 1e6
    return {"us": ms * 1e3, "gbps": gbps, "frac_copy": gbps / copy_gbps, "tflops": case.flops() / ms / 1e9}


def bench(args, dtype, checks: dict) -> dict:
    from mini_infer.ops.fused_moe import moe_tile_config

    copy = copy_bandwidth(args.copy_gib, args.target_ms, args.rounds)
    print(f"{torch.cuda.get_device_name()} | {args.dtype} | copy bandwidth {copy['gbps']:.0f} GB/s | CUDA-graph "
          f"timings (ref: eager), median of {args.rounds}", flush=True)
    head = (f"{'model':<15}{'T':>6}{'used':>5}{'MB':>8}{'tile':>12} |{'triton us':>10}{'GB/s':>6}{'%copy':>6}"
            f"{'TF/s':>6} |{'dense us':>9}{'GB/s':>6}{'TF/s':>6} |{'ref us':>10} | vs dense  vs ref")
    print(head)
    rows = []
    for model in args.models:
        shape = (TINY_MODELS if args.tiny else MODELS)[model]
        for tokens in args.tokens:
            decode = tokens * shape["top_k"] <= 16 * shape["experts"]
            case = Case(model, shape, tokens, dtype, "cuda", args.sets if decode else 2)
            cfg = moe_tile_config(tokens, case.experts, case.top_k, case.hidden, case.inter)
            row = {"model": model, "tokens": tokens, **shape, "dtype": args.dtype, "used_experts": case.used,
                   "touched_bytes": case.touched_bytes(), "flops": case.flops(), "n_sets": len(case.sets),
                   "config": {"kind": cfg.kind, "block_m": cfg.block_m, "gate_up": vars(cfg.gate_up),
                              "down": vars(cfg.down)}, "impls": {}}
            if checks:
                row["check"] = checks[(model, tokens)]
            ms_t, _ = time_calls(case.triton_calls(), args.target_ms, args.rounds)
            row["impls"]["triton"] = _metrics(ms_t, case, copy["gbps"])
            ms_d, _ = time_calls(case.dense_calls(), args.target_ms, args.rounds)
            row["impls"]["dense"] = _metrics(ms_d, case, copy["gbps"])
            if not args.no_ref:
                ms_r = time_eager(case.reference_calls()[:2], 2)
                row["impls"]["ref"] = _metrics(ms_r, case, copy["gbps"])
            if args.sweep:
                row["sweep"] = []
                for alt in sweep_configs(case, args.sweep_narrow):
                    try:
                        ms_a, _ = time_calls(case.triton_calls(alt), args.target_ms, args.rounds)
                    except Exception as e:  # a tile that does not compile or fit
                        row["sweep"].append({"config": repr(alt), "error": f"{type(e).__name__}: {e}"[:200]})
                        continue
                    row["sweep"].append({"config": repr(alt), "us": ms_a * 1e3})
                best = min((s for s in row["sweep"] if "us" in s), key=lambda s: s["us"])
                row["sweep_best"] = best
                print(f"  sweep: default {row['sweep'][0]['us']:.1f} us; best {best['us']:.1f} us {best['config']}",
                      flush=True)
                for gemm in ("gate_up", "down"):  # the best of each GEMM's variations (the other one at default)
                    alts = [s for s in row["sweep"][1:] if "us" in s and _varies(s["config"], row["sweep"][0]["config"],
                                                                             gemm)]
                    if alts:
                        b = min(alts, key=lambda s: s["us"])
                        print(f"    best {gemm} variation: {b['us']:.1f} us {b['config']}", flush=True)
            t, d = row["impls"]["triton"], row["impls"]["dense"]
            r = row["impls"].get("ref")
            line = (f"{model:<15}{tokens:>6}{statistics.mean(case.used):>5.0f}{case.touched_bytes() / 1e6:>8.1f}"
                    f"{cfg.kind + '/' + str(cfg.block_m):>12} |{t['us']:>10.1f}{t['gbps']:>6.0f}"
                    f"{100 * t['frac_copy']:>5.0f}%{t['tflops']:>6.0f} |{d['us']:>9.1f}{d['gbps']:>6.0f}"
                    f"{d['tflops']:>6.0f} |{(r['us'] if r else math.nan):>10.0f} | {d['us'] / t['us']:>7.2f}x"
                    f"{(r['us'] / t['us'] if r else math.nan):>8.1f}x")
            if checks:
                line += f"  rel err {row['check']['rel_err']:.1e}{'' if row['check']['ok'] else ' MISMATCH'}"
            if args.sweep:
                line += f"  best tile {row['sweep_best']['us']:.1f} us"
            print(line, flush=True)
            rows.append(row)
            del case
            torch.cuda.empty_cache()
    return {"copy": copy, "results": rows}


def run_check(args, dtype, device: str) -> dict:
    """check_case for every shape; returns {(model, tokens): result}."""
    where = "CPU, Triton interpreter" if device == "cpu" else torch.cuda.get_device_name()
    print(f"--check on {where}: {args.dtype}, Triton vs reference (relative Frobenius error <= {REL_TOL[dtype]})")
    results = {}
    for model in args.models:
        shape = (TINY_MODELS if args.tiny else MODELS)[model]
        for tokens in args.tokens:
            res = results[(model, tokens)] = check_case(Case(model, shape, tokens, dtype, device, 1))
            print(f"{model:<15} T={tokens:<5} rel err {res['rel_err']:.2e}  max|err| {res['max_abs_err']:.2e}  "
                  f"{'ok' if res['ok'] else 'FAIL'}", flush=True)
    failed = sum(not r["ok"] for r in results.values())
    print("check passed" if not failed else f"check FAILED ({failed})")
    return results


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=None, help=f"comma list of {','.join(MODELS)} (or of "
                    f"{','.join(TINY_MODELS)} with --tiny); default all")
    ap.add_argument("--tokens", type=int_list, default=None, help=f"comma list (default {TOKENS}, --tiny "
                    f"{TINY_TOKENS})")
    ap.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (with --check: runs on CPU, interpreted)")
    ap.add_argument("--check", action="store_true", help="compare Triton with the reference first; stop on a "
                    "mismatch")
    ap.add_argument("--no-ref", action="store_true", help="do not time the reference")
    ap.add_argument("--sweep", action="store_true", help="also time alternative tile configs per shape")
    ap.add_argument("--sweep-narrow", action="store_true", help="with --sweep: decode shapes' narrow tiles (16-32 "
                    "output columns a program, 2-4 warps) instead of the usual set")
    ap.add_argument("--decode", action="store_true", help="the decode path beside the grouped GEMMs at few tokens "
                    f"(default models {','.join(DECODE_MODELS)}, tokens {DECODE_TOKENS})")
    ap.add_argument("--mxfp4", action="store_true", help="fused_moe_mxfp4 (both paths) beside bf16 fused_moe "
                    f"(default models {','.join(MXFP4_MODELS)}, tokens {MXFP4_TOKENS})")
    ap.add_argument("--sweep-paths", default="grouped,gemv", help="with --mxfp4 --sweep: the paths swept")
    ap.add_argument("--sets", type=int, default=8, help="routings cycled per timing at decode sizes (cold L2)")
    ap.add_argument("--copy-gib", type=float, default=1.0, help="size of the copy-bandwidth tensor (>= 1)")
    ap.add_argument("--target-ms", type=float, default=20.0, help="GPU time per timing round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    models = TINY_MODELS if args.tiny else MODELS
    default_models = DECODE_MODELS if args.decode else MXFP4_MODELS if args.mxfp4 else models
    args.models = [m for m in (args.models or ",".join(default_models)).split(",") if m]
    if not args.models or set(args.models) - set(models):
        ap.error(f"--models: choose from {','.join(models)}")
    if args.decode and args.tiny:
        ap.error("--decode times GPU kernels at the models' shapes: not with --tiny")
    if args.mxfp4 and (args.tiny or args.decode):
        ap.error("--mxfp4 times GPU kernels at the models' shapes: not with --tiny or --decode")
    args.tokens = args.tokens or list(TINY_TOKENS if args.tiny else DECODE_TOKENS if args.decode else
                                      MXFP4_TOKENS if args.mxfp4 else TOKENS)
    if args.sets < 1 or args.rounds < 1 or args.target_ms <= 0 or args.copy_gib < 1:
        ap.error("--sets, --rounds, --target-ms must be positive and --copy-gib >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    dtype = DTYPES[args.dtype]
    on_gpu = torch.cuda.is_available()
    if not on_gpu and not (args.check and args.tiny):
        raise SystemExit("bench/kernel_moe.py times CUDA kernels and needs a GPU; without one, "
                         "`python bench/kernel_moe.py --check --tiny` runs the Triton path under TRITON_INTERPRET=1 "
                         "at tiny shapes and compares it with the reference.")
    if on_gpu and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("TRITON_INTERPRET is set: unset it to run the kernels on the GPU")
    if not on_gpu:
        os.environ["TRITON_INTERPRET"] = "1"  # before mini_infer.ops imports triton (triton.jit reads it)
    from mini_infer.ops import HAS_TRITON

    if not HAS_TRITON:
        raise SystemExit("triton is not importable: nothing to run")
    checks = run_check(args, dtype, "cuda" if on_gpu else "cpu") if args.check and not args.decode else {}
    if not on_gpu or not all(r["ok"] for r in checks.values()):
        return 0 if all(r["ok"] for r in checks.values()) else 1
    t0 = time.perf_counter()
    import triton

    meta = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "git": git_info(), "argv": sys.argv[1:],
            "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
            "device": torch.cuda.get_device_name(), "cuda": torch.version.cuda,
            "sms": torch.cuda.get_device_properties(0).multi_processor_count, "dtype": args.dtype,
            "target_ms": args.target_ms, "rounds": args.rounds,
            "timing": "triton and dense: CUDA graph replay over the routings, median of rounds; ref: eager events"}
    run = bench_decode(args, dtype) if args.decode else bench_mxfp4(args) if args.mxfp4 else bench(args, dtype, checks)
    report = {"meta": meta, **run}
    meta["wall_seconds"] = round(time.perf_counter() - t0, 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    mode = "decode_" if args.decode else "mxfp4_" if args.mxfp4 else ""
    path = out / f"kernel_moe_{mode}{gpu_tag()}{'_tiny' if args.tiny else ''}.json"
    path.write_text(json.dumps(report, indent=2))
    print(f"{meta['wall_seconds']:.0f} s; wrote {path}")
    if report.get("check_failed"):
        print(f"check FAILED: {report['check_failed']}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
