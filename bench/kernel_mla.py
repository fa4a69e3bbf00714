"""MLA decode over the paged latent cache (not a test): the absorbed Triton path beside the expanded one.

    python bench/kernel_mla.py --check             # correctness at the benchmark shapes first, then timings
    python bench/kernel_mla.py [--ctx 4096] [--batches 1,64,256] [--heads 16,128] [--block-size 16]
    python bench/kernel_mla.py --check --sweep     # first the latent kernel's launch shapes per bench shape
                                                   # (best first; the winners as `_DECODE_CONFIGS` lines), then
                                                   # the bench with the table as it is (~2-3 min on an H200)
    python bench/kernel_mla.py --tiny              # CPU, Triton under TRITON_INTERPRET=1, tiny shapes: exercises
                                                   # every code path here (numbers mean nothing)

Shapes: DeepSeek-V2-Lite attention (H=16, Dn=128, Dr=64, Dc=512, Dv=128) and a V3-like H=128 with the same
head dims, bf16, a decode step (one query row per sequence) at --ctx tokens of context, --batches sequences,
block tables shuffled over the cache. Per shape it times:

  absorbed kernel  `latent_attention_triton` (+ its split-K reduce): attention over the latent cache, what
                   `mla_attention` runs for decode between the two absorption bmms
  absorbed op      `mla_attention_triton` as the compiled graph calls it: cache write, q_nope -> q_lat bmm,
                   the kernel, o_lat -> out bmm
  expanded cached  `paged_attention_triton` over per-head K [.., H, Dn+Dr] and V [.., H, Dv] caches already
                   materialized (what a non-latent cache of the same model would read)
  expanded op      `mla_attention_triton(path="expanded")`: the per-head K/V of the used blocks expanded from
                   the latent each call, then paged attention (host sync: timed with triton.testing.do_bench)

Bytes: the latent cache a step must read, S x ctx x (Dc + Dr) x 2 (the kernel's GB/s and %copy are over these;
the goal is >= 70% of copy); the op adds the two weights (H x Dn x Dc + H x Dc x Dv, x 2 B); expanded cached
reads S x ctx x H x (Dn + Dr + Dv) x 2. %copy = GB/s over `dst.copy_(src)` measured in the same run
(bench/kernel_norm.py's helpers, as is the timing: CUDA-graph replay, median of rounds). Unless --warm, enough
copies of the inputs (caches, queries, weights) are cycled to exceed twice the L2 cache, so batch 1 reads HBM.
Expanded variants above --max-expanded-gib of per-head K/V are skipped (V3-like H=128 at batch 256 needs 86 GB).

Prints a table and writes bench/results/kernel_mla_<gpu>.json (--tiny: bench/out/kernel_mla_cpu-tiny.json).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from kernel_norm import copy_bandwidth, git_info, int_list, time_calls  # the sibling script's helpers

if TYPE_CHECKING:  # imported where used: --tiny sets TRITON_INTERPRET before mini_infer.ops imports triton
    from mini_infer.ops.mla_attention import LatentConfig

# (name, H, Dn, Dr, Dc, Dv)
MODELS = {"v2-lite": (16, 128, 64, 512, 128), "v3-like": (128, 128, 64, 512, 128)}
TINY = {"tiny-h4": (4, 16, 16, 32, 16), "tiny-h8": (8, 16, 16, 32, 16)}
TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2)}  # as tests/ops/helpers.py


@dataclass
class Shape:
    model: str
    heads: int
    dn: int
    dr: int
    dc: int
    dv: int
    batch: int
    ctx: int
    block_size: int
    dtype: torch.dtype

    @property
    def latent_bytes(self) -> int:
        return self.batch * self.ctx * (self.dc + self.dr) * _esize(self.dtype)

    @property
    def weight_bytes(self) -> int:
        return self.heads * self.dc * (self.dn + self.dv) * _esize(self.dtype)

    @property
    def expanded_bytes(self) -> int:
        return self.batch * self.ctx * self.heads * (self.dn + self.dr + self.dv) * _esize(self.dtype)


def _esize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def make_inputs(sh: Shape, device: str, seed: int) -> dict:
    """One decode step: latent cache full up to ctx - 1 per sequence, this step's token at position ctx - 1."""
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(sh.dtype)

    per_seq = -(-sh.ctx // sh.block_size)
    num_blocks = sh.batch * per_seq + 1
    bt = torch.randperm(num_blocks, generator=g, device=device)[: sh.batch * per_seq].view(sh.batch, per_seq)
    pos = torch.full((sh.batch,), sh.ctx - 1, device=device)
    return {
        "q_nope": randn(sh.batch, sh.heads, sh.dn),
        "q_pe": randn(sh.batch, sh.heads, sh.dr),
        "c_kv": randn(sh.batch, sh.dc),
        "k_pe": randn(sh.batch, sh.dr),
        "latent_cache": randn(num_blocks, sh.block_size, sh.dc + sh.dr),
        "slot_mapping": (bt[:, -1].long() * sh.block_size + pos % sh.block_size).contiguous(),
        "block_tables": bt.to(torch.int32).contiguous(),
        "seq_lens": torch.full((sh.batch,), sh.ctx, dtype=torch.int32, device=device),
        "query_start_loc": torch.arange(sh.batch + 1, dtype=torch.int32, device=device),
        "w_uk": randn(sh.heads, sh.dn, sh.dc, scale=sh.dc**-0.5),
        "w_uv": randn(sh.heads, sh.dc, sh.dv, scale=sh.dc**-0.5),
        "scale": (sh.dn + sh.dr) ** -0.5,
    }


def op_args(inp: dict) -> tuple:
    keys = ("q_nope", "q_pe", "c_kv", "k_pe", "latent_cache", "slot_mapping", "block_tables", "seq_lens",
            "query_start_loc", "w_uk", "w_uv", "scale")  # fmt: skip
    return tuple(inp[k] for k in keys)


def expanded_cache_inputs(sh: Shape, inp: dict, seed: int) -> tuple:
    """paged_attention_triton's args over per-head K/V caches of the same block layout (random contents)."""
    g = torch.Generator(device=inp["q_nope"].device).manual_seed(seed)
    nb = inp["latent_cache"].shape[0]
    dev = inp["q_nope"].device
    k_cache = torch.randn(nb, sh.block_size, sh.heads, sh.dn + sh.dr, generator=g, device=dev).to(sh.dtype)
    v_cache = torch.randn(nb, sh.block_size, sh.heads, sh.dv, generator=g, device=dev).to(sh.dtype)
    q = torch.cat([inp["q_nope"], inp["q_pe"]], dim=-1)
    k = torch.randn(sh.batch, sh.heads, sh.dn + sh.dr, generator=g, device=dev).to(sh.dtype)
    v = torch.randn(sh.batch, sh.heads, sh.dv, generator=g, device=dev).to(sh.dtype)
    return (q, k, v, k_cache, v_cache, inp["slot_mapping"], inp["block_tables"], inp["seq_lens"],
            inp["query_start_loc"], inp["scale"])  # fmt: skip


def impl_calls(name: str, sh: Shape, sets: list[dict], seed: int, config=None) -> list[Callable]:
    """One closure per input set for impl `name` (`config`: the absorbed kernel's LatentConfig, None: its table)."""
    from mini_infer.ops.mla_attention import latent_attention_triton, mla_attention_triton
    from mini_infer.ops.paged_attention import paged_attention_triton

    def bind(fn, args, **kw):
        return lambda: fn(*args, **kw)

    calls = []
    for i, inp in enumerate(sets):
        if name == "absorbed kernel":
            q_lat = torch.bmm(inp["q_nope"].transpose(0, 1), inp["w_uk"])  # [H, T, Dc], outside the timing
            calls.append(bind(latent_attention_triton, (q_lat, inp["q_pe"], inp["latent_cache"], inp["block_tables"],
                                                        inp["seq_lens"], inp["query_start_loc"], inp["scale"]),
                              config=config))
        elif name == "absorbed op":
            calls.append(bind(mla_attention_triton, op_args(inp)))
        elif name == "expanded cached":
            calls.append(bind(paged_attention_triton, expanded_cache_inputs(sh, inp, seed + i)))
        elif name == "expanded op":
            calls.append(bind(mla_attention_triton, op_args(inp), path="expanded"))
        else:
            raise ValueError(name)
    return calls


def compare(got: torch.Tensor, want: torch.Tensor) -> tuple[float, bool]:
    atol, rtol = TOL[want.dtype]
    ok = got.shape == want.shape and got.dtype == want.dtype and not got.isnan().any()
    err = (got.float() - want.float()).abs().max().item() if ok and got.numel() else math.inf
    return err, bool(ok and torch.allclose(got.float(), want.float(), atol=atol, rtol=rtol))


def reference_in_chunks(reference: Callable, inp: dict, seqs_per_call: int = 16) -> torch.Tensor:
    """The reference's output for a decode step (one query row per sequence), `seqs_per_call` sequences at a
    time: its padded gather over a whole batch of 256 x 128 heads x 4k context would not fit in memory. Each
    chunk writes only its own sequences' slots, so the shared cache ends as one call would leave it."""
    rows = inp["q_nope"].shape[0]
    per_seq = ("q_nope", "q_pe", "c_kv", "k_pe", "slot_mapping", "block_tables", "seq_lens")
    outs = []
    for i in range(0, rows, seqs_per_call):
        j = min(i + seqs_per_call, rows)
        part = dict(inp, **{k: inp[k][i:j] for k in per_seq})
        part["query_start_loc"] = torch.arange(j - i + 1, dtype=torch.int32, device=inp["q_nope"].device)
        outs.append(reference(*op_args(part)))
    return torch.cat(outs)


def check_shape(sh: Shape, device: str, max_expanded: int) -> dict:
    """mla_attention_triton (default = absorbed for decode, and forced expanded) vs mla_attention_reference on the
    same step, through the same call path the timing uses."""
    from mini_infer.ops.mla_attention import mla_attention_reference, mla_attention_triton

    inp = make_inputs(sh, device, seed=1)
    want = reference_in_chunks(mla_attention_reference, dict(inp, latent_cache=inp["latent_cache"].clone()))
    res = {}
    for name, kw in (("absorbed op", {}), ("expanded op", {"path": "expanded"})):
        if name == "expanded op" and sh.expanded_bytes > max_expanded:
            continue
        got = mla_attention_triton(*op_args(dict(inp, latent_cache=inp["latent_cache"].clone())), **kw)
        err, ok = compare(got, want)
        res[name] = {"max_abs_err": err, "ok": ok}
    return res


def time_cpu(calls: list[Callable], rounds: int) -> float:
    """ms per call on the CPU (the interpreter): median over rounds of one pass over `calls`."""
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for c in calls:
            c()
        times.append((time.perf_counter() - t0) * 1e3 / len(calls))
    return statistics.median(times)


def cpu_copy_bandwidth(mib: float = 64.0) -> dict:
    src = torch.randn(int(mib * 2**20) // 4)
    dst = torch.empty_like(src)
    ms = time_cpu([lambda: dst.copy_(src)], 5)
    nbytes = 2 * src.nbytes
    return {"tensor_bytes": src.nbytes, "bytes_moved": nbytes, "ms": ms, "gbps": nbytes / ms / 1e6}


def gpu_tag() -> str:
    name = torch.cuda.get_device_name()
    m = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Za-z]?)\b", name)
    return (m.group(1) if m else re.sub(r"[^a-z0-9]+", "-", name.lower())).lower()


def shapes_from(args) -> list[Shape]:
    dtype = torch.float32 if args.tiny else torch.bfloat16
    models = TINY if args.tiny else {m: MODELS[m] for m in MODELS if MODELS[m][0] in args.heads}
    return [Shape(name, *dims, batch=b, ctx=args.ctx, block_size=args.block_size, dtype=dtype)
            for name, dims in models.items() for b in args.batches]  # fmt: skip


def plan_of(sh: Shape, device: str) -> dict:
    from mini_infer.ops.mla_attention import latent_attention_plan

    q_lat = torch.empty(sh.heads, sh.batch, sh.dc, device=device, dtype=sh.dtype)
    return latent_attention_plan(q_lat, sh.batch, -(-sh.ctx // sh.block_size) * sh.block_size)._asdict()


def bench(args, device: str) -> dict:
    on_gpu = device == "cuda"
    impls = ("absorbed kernel", "absorbed op", "expanded cached", "expanded op")
    max_expanded = int(args.max_expanded_gib * 2**30)
    if on_gpu:
        copy = copy_bandwidth(args.copy_gib, args.target_ms, args.rounds)
        l2 = torch.cuda.get_device_properties(0).L2_cache_size or 64 * 2**20
        where = f"{torch.cuda.get_device_name()} | bf16"
    else:
        copy, l2, where = cpu_copy_bandwidth(), 0, "CPU, TRITON_INTERPRET=1, fp32 (timings mean nothing)"
    print(f"{where} | copy bandwidth {copy['gbps']:.0f} GB/s | ctx {args.ctx}, block {args.block_size} | "
          f"{'one input set' if args.warm or not on_gpu else 'inputs cycled over > 2x L2'}", flush=True)
    head = f"{'model':<9}{'H':>4}{'batch':>6}{'latent MB':>10}{'splits':>7} |"
    for name in impls:
        head += f"{name + ' us':>19}{'GB/s':>7}{'%copy':>6} |"
    print(head)
    rows = []
    for sh in shapes_from(args):
        row = {"model": sh.model, "heads": sh.heads, "dims": dict(dn=sh.dn, dr=sh.dr, dc=sh.dc, dv=sh.dv),
               "batch": sh.batch, "ctx": sh.ctx, "block_size": sh.block_size, "latent_bytes": sh.latent_bytes,
               "weight_bytes": sh.weight_bytes, "expanded_bytes": sh.expanded_bytes, "plan": plan_of(sh, device),
               "impls": {}}  # fmt: skip
        if args.check:
            row["check"] = check_shape(sh, device, max_expanded)
        per_set = sh.latent_bytes + sh.weight_bytes
        n_sets = 1 if (args.warm or not on_gpu) else max(1, min(args.max_sets, math.ceil(2 * l2 / per_set)))
        row["n_sets"] = n_sets
        sets = [make_inputs(sh, device, seed=10 + i) for i in range(n_sets)]
        line = f"{sh.model:<9}{sh.heads:>4}{sh.batch:>6}{sh.latent_bytes / 1e6:>10.1f}{row['plan']['num_splits']:>7} |"
        for name in impls:
            nbytes = {"absorbed kernel": sh.latent_bytes, "absorbed op": sh.latent_bytes + sh.weight_bytes,
                      "expanded cached": sh.expanded_bytes, "expanded op": sh.latent_bytes}[name]  # fmt: skip
            if name.startswith("expanded") and sh.expanded_bytes * (n_sets if name == "expanded cached" else 1) \
                    > max_expanded:
                row["impls"][name] = {"skipped": f"per-head K/V {sh.expanded_bytes / 2**30:.1f} GiB"}
                line += f"{'skipped':>19}{'':>7}{'':>6} |"
                continue
            try:
                ms = run_timing(name, sh, sets, args, on_gpu)
            except Exception as e:  # a launch that does not fit, a capture error: report, go on
                row["impls"][name] = {"error": f"{type(e).__name__}: {e}"[:300]}
                line += f"{'error':>19}{'':>7}{'':>6} |"
                print(f"  {sh.model} batch {sh.batch} {name}: {type(e).__name__}: {e}"[:300], file=sys.stderr)
                continue
            gbps = nbytes / ms / 1e6
            row["impls"][name] = {"us": ms * 1e3, "bytes": nbytes, "gbps": gbps, "frac_copy": gbps / copy["gbps"]}
            line += f"{ms * 1e3:>19.1f}{gbps:>7.0f}{100 * gbps / copy['gbps']:>5.0f}% |"
        bad = [k for k, r in row.get("check", {}).items() if not r["ok"]]
        if bad:
            line += f"  MISMATCH vs reference: {', '.join(bad)}"
        print(line, flush=True)
        rows.append(row)
        del sets
        if on_gpu:
            torch.cuda.empty_cache()
    return {"copy": copy, "results": rows}


def run_timing(name: str, sh: Shape, sets: list[dict], args, on_gpu: bool) -> float:
    """ms per call of impl `name`: CUDA-graph replay (kernel_norm.time_calls) for the capturable ones, do_bench
    (median; it flushes L2 between calls) for the expanded op, which reads lengths on the host."""
    if not on_gpu:
        return time_cpu(impl_calls(name, sh, sets, seed=100), args.rounds)
    if name == "expanded op":
        import triton

        call = impl_calls(name, sh, sets[:1], seed=100)[0]
        return float(triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median"))
    ms, _first = time_calls(impl_calls(name, sh, sets, seed=100), args.target_ms, args.rounds)
    return ms


def sweep_shapes(sh: Shape, table: LatentConfig) -> list[LatentConfig]:
    """Tile shapes worth timing at a decode shape besides the table's: for each heads-per-program (16; for more
    heads also 32, and 64 where tl.dot is wgmma) a few (block_n, num_warps, num_stages) that compile for sm_90
    with Dc = 512 without spilling inside the key loop."""
    from mini_infer.ops.mla_attention import LatentConfig

    if sh.heads <= 16:
        tiles = {16: [(32, 4, 3), (32, 4, 2), (32, 8, 3), (16, 4, 4), (64, 8, 3)]}
    else:
        tiles = {16: [(32, 4, 3), (32, 8, 3)], 32: [(32, 8, 3), (32, 8, 2), (16, 8, 4)], 64: [(32, 8, 2), (16, 8, 3)]}
    out = [LatentConfig(h, *t, splits=table.splits) for h, shapes in tiles.items() for t in shapes]
    return [table] + [c for c in out if c._replace(splits=table.splits) != table]


def sweep_splits(best: LatentConfig, capacity: int) -> list[LatentConfig]:
    """Split counts around `best`'s (x1/4, x1/2, x2, x4; at most one per block_n keys of capacity)."""
    cands = {max(1, best.splits * f // 4) for f in (1, 2, 8, 16)} - {best.splits}
    return [best._replace(splits=s) for s in sorted(cands) if s <= max(1, capacity // best.block_n)]


def sweep(args, on_gpu: bool) -> dict:
    """Time the latent kernel (+ its reduce) per bench shape over launch shapes: first the tile shapes
    (`sweep_shapes`) at the table's split count, then split counts (`sweep_splits`) for the fastest tile; inputs
    cycled over > 2x L2 as in the bench. Prints each shape's candidates best first and the winners as
    `_DECODE_CONFIGS`-style lines; returns them for the JSON."""
    from mini_infer.ops.mla_attention import LatentConfig, decode_config, latent_attention_plan

    if on_gpu:
        copy_gbps = copy_bandwidth(args.copy_gib, args.target_ms, args.rounds)["gbps"]
        l2 = torch.cuda.get_device_properties(0).L2_cache_size or 64 * 2**20
    else:
        copy_gbps, l2 = cpu_copy_bandwidth()["gbps"], 0
    device = "cuda" if on_gpu else "cpu"
    t0 = time.perf_counter()
    rows = []
    print(f"sweep: launch shapes as {LatentConfig._fields}, latent kernel + reduce, us (%copy)", flush=True)
    for sh in shapes_from(args):
        capacity = -(-sh.ctx // sh.block_size) * sh.block_size
        n_sets = 1 if (args.warm or not on_gpu) else max(1, min(args.max_sets, math.ceil(2 * l2 / sh.latent_bytes)))
        sets = [make_inputs(sh, device, seed=10 + i) for i in range(n_sets)]
        q_lat = torch.empty(sh.heads, sh.batch, sh.dc, device=device, dtype=sh.dtype)

        def effective(cfg, q_lat=q_lat, sh=sh, capacity=capacity):  # the split count the op takes from cfg
            return cfg._replace(splits=latent_attention_plan(q_lat, sh.batch, capacity, config=cfg).num_splits)

        table = effective(decode_config(sh.heads, sh.batch))
        times: dict = {}

        def run(cfgs, sh=sh, sets=sets, times=times):
            for cfg in dict.fromkeys(effective(c) for c in cfgs):
                if cfg in times:
                    continue
                calls = impl_calls("absorbed kernel", sh, sets, 0, config=cfg)
                try:
                    ms = time_calls(calls, args.target_ms, 3)[0] if on_gpu else time_cpu(calls, 1)
                except Exception as e:  # out of resources, a compile error: report, go on
                    print(f"  {tuple(cfg)} failed: {type(e).__name__}: {e}"[:200], flush=True)
                    continue
                times[cfg] = ms

        run(sweep_shapes(sh, table))
        if not times:
            continue
        run(sweep_splits(min(times, key=times.get), capacity))
        ranked = sorted(times.items(), key=lambda kv: kv[1])
        print(f"{sh.model} H{sh.heads} batch {sh.batch}: {len(times)} shapes timed, best first", flush=True)
        for cfg, ms in ranked[:6]:
            mark = "  <- table" if cfg == table else ""
            print(f"  {tuple(cfg)}  {ms * 1e3:9.1f}  ({sh.latent_bytes / ms / 1e6 / copy_gbps:4.0%}){mark}")
        best, best_ms = ranked[0]
        rows.append({"model": sh.model, "heads": sh.heads, "batch": sh.batch, "ctx": sh.ctx,
                     "table": table._asdict(), "table_us": times[table] * 1e3 if table in times else None,
                     "best": best._asdict(), "best_us": best_ms * 1e3,
                     "best_frac_copy": sh.latent_bytes / best_ms / 1e6 / copy_gbps,
                     "all": [{**c._asdict(), "us": ms * 1e3} for c, ms in ranked]})  # fmt: skip
        del sets
        if on_gpu:
            torch.cuda.empty_cache()
    print(f"sweep: {time.perf_counter() - t0:.0f} s. Winners as _DECODE_CONFIGS entries (most heads, most sequences):")
    for r in rows:
        b = r["best"]
        print(f"    ({r['heads']}, {r['batch']}, LatentConfig(heads={b['heads']}, block_n={b['block_n']}, "
              f"num_warps={b['num_warps']}, num_stages={b['num_stages']}, splits={b['splits']})),  "
              f"# {r['best_us']:.1f} us, {r['best_frac_copy']:.0%} copy; table {r['table_us'] or 0:.1f} us")  # fmt: skip
    return {"copy_gbps": copy_gbps, "shapes": rows}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ctx", type=int, default=None, help="context tokens per sequence (default 4096; --tiny 40)")
    ap.add_argument("--batches", type=int_list, default=None, help="comma list (default 1,64,256; --tiny 1,3)")
    ap.add_argument("--heads", type=int_list, default="16,128", help="which models by H: 16 (V2-Lite), 128 (V3-like)")
    ap.add_argument("--block-size", type=int, default=16, help="cache block size (the engine's default 16)")
    ap.add_argument("--check", action="store_true", help="compare with mla_attention_reference before timing")
    ap.add_argument("--tiny", action="store_true", help="CPU under TRITON_INTERPRET=1 at tiny shapes")
    ap.add_argument("--sweep", action="store_true", help="first time the latent kernel's decode launch shapes "
                    "per shape (best first, winners as table lines), then the bench as usual")
    ap.add_argument("--warm", action="store_true", help="one input set (L2-warm) instead of cycled copies")
    ap.add_argument("--max-sets", type=int, default=64, help="most input copies cycled per shape")
    ap.add_argument("--max-expanded-gib", type=float, default=40.0, help="skip expanded variants above this")
    ap.add_argument("--copy-gib", type=float, default=1.0)
    ap.add_argument("--target-ms", type=float, default=5.0, help="GPU time per timing round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None, help="JSON folder (default bench/results; --tiny: bench/out)")
    args = ap.parse_args(argv)
    args.ctx = args.ctx or (40 if args.tiny else 4096)
    args.batches = args.batches or ([1, 3] if args.tiny else [1, 64, 256])
    if args.tiny:
        args.check = True
    if not args.tiny and not set(args.heads) & {m[0] for m in MODELS.values()}:
        ap.error("--heads: choose from 16, 128")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    on_gpu = torch.cuda.is_available() and not args.tiny
    if not on_gpu and not args.tiny:
        raise SystemExit("bench/kernel_mla.py times CUDA kernels and needs a GPU; `--tiny` runs its code path on "
                         "the CPU under TRITON_INTERPRET=1")
    if on_gpu and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("TRITON_INTERPRET is set: unset it to run the kernels on the GPU")
    if args.tiny:
        if torch.cuda.is_available():
            raise SystemExit("--tiny runs on the CPU under the interpreter: hide the GPU (CUDA_VISIBLE_DEVICES=)")
        os.environ["TRITON_INTERPRET"] = "1"  # before mini_infer.ops imports triton (triton.jit reads it)
    from mini_infer.ops import HAS_TRITON

    if not HAS_TRITON:
        raise SystemExit("triton is not importable: nothing to benchmark")
    device = "cuda" if on_gpu else "cpu"
    t0 = time.perf_counter()
    report = {"meta": meta(args, device)}
    if args.sweep:
        report["sweep"] = sweep(args, on_gpu)
    report.update(bench(args, device))
    report["meta"]["wall_seconds"] = round(time.perf_counter() - t0, 1)
    out = Path(args.out or ("bench/out" if args.tiny else "bench/results"))
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"kernel_mla_{gpu_tag() if on_gpu else 'cpu-tiny'}.json"
    path.write_text(json.dumps(report, indent=2))
    failed = [(r["model"], r["batch"], k) for r in report["results"] for k, c in r.get("check", {}).items()
              if not c["ok"]]  # fmt: skip
    print(f"{report['meta']['wall_seconds']:.0f} s; wrote {path}" + (f"; CHECK FAILED: {failed}" if failed else
                                                                     ("; check passed" if args.check else "")))
    return 1 if failed else 0


def meta(args, device: str) -> dict:
    import triton

    info = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "git": git_info(), "argv": sys.argv[1:],
            "torch": torch.__version__, "triton": triton.__version__, "tiny": args.tiny, "l2_mode":
            "warm" if args.warm or device != "cuda" else "cold", "timing": "CUDA graph replay, median of rounds (expanded op: "
            "triton.testing.do_bench median)" if device == "cuda" else "CPU perf_counter under the interpreter"}  # fmt: skip
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        info.update(device=torch.cuda.get_device_name(), cuda=torch.version.cuda, sms=p.multi_processor_count,
                    l2_bytes=p.L2_cache_size)  # fmt: skip
    else:
        info["device"] = "cpu (TRITON_INTERPRET=1)"
    return info


if __name__ == "__main__":
    sys.exit(main())
