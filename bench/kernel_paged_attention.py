"""Timing of paged_attention (not a test): Triton on CUDA vs torch SDPA on contiguous K/V, and the CPU reference.

    python bench/kernel_paged_attention.py [--cpu-only | --sweep | --prefill [--lengths 512,4096] [--out DIR]
                                            | --plan-reuse
                                            | --decode-latency [--check] [--layers N] [--kv-cache-dtype fp8]
                                            | --decode-sweep [--wide | --grid G] [--ways W] [--caches C] [--rotary]
                                                             [--layers N]
                                            | --decode-write [--layers N]
                                            | --split-sweep [--grid G] [--rotary] [--layers N]]

--sweep times the Triton kernel over launch configs (mini_infer.ops.paged_attention._CONFIG).

--decode-sweep: the decode launch configs of bf16 and fp8 caches (_CONFIG["decode"], _CONFIG["decode_fp8"] with
each of _FP8_DOT's ways to feed fp8 tiles to the dots, the e4m3 dots "fp8" among them; the old way "q" only at the
bf16 default shape unless --wide) timed as --decode-latency times them (qwen3-0.6b-like, 16 q /
8 kv heads, at batch 64 and 256, context 512 and 2048), plus the fp8 ways at the prefill config (4 x 1024 new tokens,
and 2048 new over 6144 cached); the cache write alone per cache dtype. Prints the best configs per cache, the winner
(least summed time) as a _CONFIG line, fp8 / bf16 per shape, and each fp8 way's largest difference from the torch
reference. --wide: a larger grid (minutes). --grid "block_n=128,256;num_warps=4,8;num_stages=2,3": this grid instead
(each key a launch-shape field, its values tried in every combination; `maxnreg`: ptxas's register cap a thread, 0
for none); --ways fp16,fp16_vregs: only these fp8 ways; --caches fp8: only this cache dtype's configs; --rotary:
the launches apply Qwen3's q/k norms and the rotary too, as a rotary model's decode steps do (split launches for
groups up to 8; one-split launches run qk_rotary first in the engine, rotary_paged_attention.ROTARY_MAX_GROUP).

--split-sweep: the batch-1 decode launches' shape (_CONFIG["decode_split"]: split launches over a 16-bit cache) over a
grid (--grid as --decode-sweep's; default SPLIT_SWEEP_GRID), for qwen3-0.6b's (16 / 8), qwen2.5-7b's (28 / 4) and
qwen3-30b-a3b's (32 / 4) heads at context 128, 384 and 1,024, timed as --decode-sweep times; --rotary as there. The
kernel alone is not the engine (no GEMVs around it): the twenty-third session's best shape here lost 8% in the
engine at a 2,048-token prompt. Confirm with bench/latency.py --switch, short and long prompts.

--decode-latency: decode steps (one query row per sequence) as the engine runs them: a CUDA graph of --layers
(default 28) calls of `paged_attention_triton` (cache write + attention + merge, the op's body with the prefill route
off), bf16, head dim 128, block 16, every block table 4,096 keys wide (the split count follows that capacity, not the
context), for qwen3-0.6b-like (16 q / 8 kv heads) and qwen2.5-7b-like (28 / 4) attention at batch 1, 8, 64, 256
and context 128, 1024, 4096. Prints microseconds per call of the split-K merge in the attention launch
(`fused`, the default) and of the reduce-kernel merge (`reduce`, fused_merge=False: every split writes partials, a
second launch merges them), with the split count. --check also compares both outputs with the torch reference
(bf16 tolerance 2e-2; exit status 1 beyond it) and with each other. --kv-cache-dtype fp8: float8_e4m3fn caches
(per-layer scales amax / 448) instead of bf16 ones.

--decode-write: the KV write inside the decode attention launch. Decode steps (bf16, head dim 128, block 16, block
tables 4,096 keys wide) at batch 1 and 8, context 128 and 1,024, for qwen3-0.6b-like (16 / 8 heads), qwen2.5-7b-like
(28 / 4) and llama-3.1-8b-like (32 / 8) attention, each a CUDA graph of --layers (default 28) calls: `fused`
(`paged_attention_triton`: one launch, the attention kernel writes the step's k/v), `separate` (the write kernel,
then `paged_attention_cached_triton`: what the op launched before) and `attn` (the attention alone, no write: the
floor). Prints us per call, separate - fused (the saving per layer), and whether the two leave the same output and
cache bytes (exit status 1 if not).

--prefill: one sequence's causal prefill, bf16, head dim 128, block size 16, at --lengths new tokens (default
512,1024,4096,16384,32768) with no cached context, plus a chunked-prefill case (16384 cached + 2048 new), for
qwen3-0.6b-like (16 q / 8 kv heads) and qwen2.5-7b-like (28 q / 4 kv heads) attention. TFLOP/s (4 x Hq x D x
visible (query, key) pairs over the time) of:
  op       `torch.ops.mini_infer.paged_attention` as the engine calls it: the cache write, then the long run
           through torch's fused kernels (ops/_prefill_sdpa.py; the backend it used is printed beside it)
  triton   `paged_attention_triton`: the cache write and the unified Triton kernel (the route off)
  flash    torch SDPA, FlashAttention backend, on contiguous K/V
  cudnn    torch SDPA, cuDNN backend, on contiguous K/V
SDPA columns take the bottom-right causal mask as `causal_lower_right` (chunked case: FlashAttention applies it
natively; cuDNN gets it materialized as a dense mask). Timed eagerly with CUDA events (the op's route is never
taken under CUDA-graph capture), median of 3 rounds after a warm-up. `first ms` is the op's first call at that
shape (cuDNN builds an execution plan per new key: per bucket of the run's length, ops/_prefill_sdpa.py, and
context length class, powers of two under TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1, which that module sets with the
route on unless the environment says otherwise: what a prompt of a new length class pays once); `diff` the largest
|op - triton|. Prints a table and writes bench/results/kernel_paged_attention_prefill_<gpu>.json (--out DIR).

--plan-reuse: whether cuDNN reuses its execution plans across query-run lengths (ops/_prefill_sdpa.py): the op
(route on, qwen2.5-7b-like heads, bf16) at PLAN_REUSE's (cached, new) shapes in order, first with the run's exact
lengths (BUCKET_STEPS = 0), then bucketed (8 per octave), the two groups in length classes of their own. Prints
each shape's first call and warm call (ms) and their difference: ~0 where the shape's cuDNN keys were built
before (a hit), tens of ms where plans were built. The rows after each group's first share their causal call's
key with it (power-of-two rounding under TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1, or the bucket), the context rows
their context key with the group's first context row.
"""

import contextlib
import itertools
import json
import os
import re
import sys
import time
from pathlib import Path

import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa

from mini_infer.ops.paged_attention import paged_attention_reference, paged_attention_triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_norm import eager_ms, git_info  # noqa: E402  (the sibling script's helpers)


def build(s, ctx, new, hq, hkv, d, bs, dtype, device):
    nb = (ctx + bs - 1) // bs
    num_blocks = s * nb + 4
    kc = torch.randn(num_blocks, bs, hkv, d, dtype=dtype, device=device)
    vc = torch.randn_like(kc)
    bt = torch.randperm(num_blocks, device=device)[: s * nb].view(s, nb).int()
    t = s * new
    q = torch.randn(t, hq, d, dtype=dtype, device=device)
    k = torch.randn(t, hkv, d, dtype=dtype, device=device)
    v = torch.randn_like(k)
    lens = torch.full((s,), ctx, dtype=torch.int32, device=device)
    qsl = torch.arange(0, s + 1, dtype=torch.int32, device=device) * new
    pos = torch.arange(ctx - new, ctx, device=device)
    slots = (bt[:, pos // bs].long() * bs + pos % bs).flatten()
    return (q, k, v, kc, vc, slots, bt, lens, qsl, d**-0.5, 0, 0.0)


def cuda_ms(fn, iters=50):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g.replay()
    start.record()
    for _ in range(iters):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def gpu():
    hq, hkv, d, bs, dtype = 28, 4, 128, 16, torch.bfloat16
    print(f"GPU {torch.cuda.get_device_name()} | Hq={hq} Hkv={hkv} D={d} block={bs} bf16, CUDA-graph timings")
    for s, ctx, new in [(1, 4096, 1), (8, 4096, 1), (64, 4096, 1), (64, 1024, 1), (256, 512, 1), (4, 1024, 1024), (1, 4096, 4096)]:
        args = build(s, ctx, new, hq, hkv, d, bs, dtype, "cuda")
        kv_bytes = 2 * s * ctx * hkv * d * 2
        row = f"S={s:4d} ctx={ctx:5d} qlen={new:5d}:"
        for name, kw in [("default", {}), ("splits=1", {"num_splits": 1})]:
            ms = cuda_ms(lambda kw=kw, args=args: paged_attention_triton(*args, **kw))
            row += f" triton[{name}] {ms:.3f} ms ({kv_bytes / ms / 1e9:.2f} TB/s)"
        q = args[0].view(s, new, hq, d).transpose(1, 2)
        kf = torch.randn(s, hkv, ctx, d, dtype=dtype, device="cuda")
        vf = torch.randn_like(kf)
        ms = cuda_ms(lambda q=q, kf=kf, vf=vf, c=new > 1: sdpa(q, kf, vf, is_causal=c, enable_gqa=True))
        row += f" | SDPA contiguous {ms:.3f} ms"
        print(row, flush=True)


def sweep():
    from mini_infer.ops import paged_attention as pa

    hq, hkv, d, bs, dtype = 28, 4, 128, 16, torch.bfloat16
    grids = {
        "prefill": dict(rows=[64, 128], block_n=[32, 64, 128], num_warps=[4, 8], num_stages=[1, 2, 3]),
        "decode": dict(block_n=[32, 64, 128], num_warps=[2, 4, 8], num_stages=[1, 2, 3, 4]),
    }
    shapes = {"prefill": [(4, 1024, 1024), (1, 4096, 4096)], "decode": [(64, 4096, 1), (8, 4096, 1), (256, 512, 1)]}
    with configs_restored() as saved:
        for kind, grid in grids.items():
            cases = [build(*shape, hq, hkv, d, bs, dtype, "cuda") for shape in shapes[kind]]
            results = []
            for values in itertools.product(*grid.values()):
                pa._CONFIG[kind] = launch_shape(saved[kind], grid, values)
                pa._LAUNCH_OK.clear()
                try:
                    times = [cuda_ms(lambda a=a: paged_attention_triton(*a), iters=20) for a in cases]
                except Exception as e:  # out of shared memory, etc.
                    print(kind, pa._CONFIG[kind], "failed:", type(e).__name__)
                    continue
                results.append((sum(times), times, dict(pa._CONFIG[kind])))
            results.sort(key=lambda r: r[0])
            print(f"{kind}: shapes {shapes[kind]}; best first")
            for _total, times, cfg in results[:6]:
                print(f"  {cfg} " + " ".join(f"{t:.3f}" for t in times) + " ms")
            default = [r for r in results if r[2] == saved[kind]]
            if default:
                print("  current default:", " ".join(f"{t:.3f}" for t in default[0][1]))


DECODE_BATCHES = (1, 8, 64, 256)
DECODE_CONTEXTS = (128, 1024, 4096)
DECODE_CAPACITY = 4096  # keys a block-table row addresses (max_model_len)


class Launch(list):
    """paged_attention_triton's positional arguments, and `kwargs` for the call (a rotary, where asked)."""

    kwargs: dict = {}


def decode_args(s, ctx, hq, hkv, d, bs=16, capacity=DECODE_CAPACITY, kv="bf16", device="cuda", rotary=False):
    """`build`'s decode step (one new token per sequence at context ctx) with block tables `capacity` keys wide:
    the entries past ctx point at block 0 (never read). kv="fp8": float8_e4m3fn caches holding `build`'s values
    over per-layer scales amax / 448, the scales appended to the arguments. rotary: the launch also applies Qwen3's
    q/k head norms and the rotary (`Rotary` in `kwargs`), as the engine's decode steps of a rotary model do."""
    args = Launch(build(s, ctx, 1, hq, hkv, d, bs, torch.bfloat16, device))
    bt = torch.zeros((s, capacity // bs), dtype=torch.int32, device=device)
    bt[:, : args[6].shape[1]] = args[6]
    args[6] = bt
    if kv == "fp8":
        args += fp8_caches(args)
    if rotary:
        from mini_infer.ops.paged_attention import Rotary

        angles = torch.rand(s, d // 2, device=device) * 6.28
        cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(torch.bfloat16) for f in (torch.cos, torch.sin))
        weights = (1 + 0.1 * torch.randn(2, d, device=device)).to(torch.bfloat16)
        args.kwargs = {"rotary": Rotary(cos, sin, weights[0], weights[1], 1e-6)}
    return args


def fp8_caches(args):
    """Replace the bf16 caches args[3], args[4] by float8_e4m3fn ones; return their scales (amax / 448)."""
    from mini_infer.ops.paged_attention import FP8, FP8_MAX, _to_cache

    scales = []
    for i in (3, 4):
        scale = (args[i].float().abs().amax() / FP8_MAX).reshape(1)
        args[i] = _to_cache(args[i], torch.empty(0, dtype=FP8), scale)
        scales.append(scale)
    return scales


def graph_us(fn, calls, replays=10):
    """Microseconds per call of `calls` back-to-back calls of fn captured in one CUDA graph (a model's layers)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (replays * calls)


def decode_latency(check, layers, kv="bf16"):
    from mini_infer.ops import _split_k

    print(f"GPU {torch.cuda.get_device_name()} | decode, bf16 q, {kv} cache, D=128, block 16, block tables "
          f"{DECODE_CAPACITY} keys, "
          f"CUDA graph of {layers} calls (write + attention + merge), us per call")
    print(f"{'model':11s} {'batch':>5s} {'ctx':>5s} {'splits':>6s} | {'fused':>7s} {'reduce':>7s} {'ratio':>6s}"
          + (" | max|fused-ref| max|reduce-ref| max|fused-reduce|" if check else ""))
    bad = 0
    t0 = time.perf_counter()
    for model, (hq, hkv, d) in PREFILL_MODELS.items():
        for s in DECODE_BATCHES:
            for ctx in DECODE_CONTEXTS:
                args = decode_args(s, ctx, hq, hkv, d, kv=kv)
                splits = _split_k.default_num_splits(args[0], s, hkv, DECODE_CAPACITY)
                us = {name: graph_us(lambda f=f, a=args: paged_attention_triton(*a, fused_merge=f), layers)
                      for name, f in (("fused", True), ("reduce", False))}
                row = (f"{model:11s} {s:5d} {ctx:5d} {splits:6d} | {us['fused']:7.2f} {us['reduce']:7.2f} "
                       f"{us['fused'] / us['reduce']:6.2f}")
                if check:
                    fused = paged_attention_triton(*args).float()
                    red = paged_attention_triton(*args, fused_merge=False).float()
                    ref = paged_attention_reference(*args).float()
                    diffs = [(fused - ref).abs().max().item(), (red - ref).abs().max().item(),
                             (fused - red).abs().max().item()]
                    bad += diffs[0] > 2e-2 or diffs[1] > 2e-2
                    row += " | " + " ".join(f"{x:12.2e}" for x in diffs)
                print(row, flush=True)
                del args
                torch.cuda.empty_cache()
    print(f"{time.perf_counter() - t0:.0f} s" + (f"; {bad} case(s) beyond tolerance" if check else ""))
    return bad


DECODE_WRITE_MODELS = {"qwen3-0.6b": (16, 8, 128), "qwen2.5-7b": (28, 4, 128), "llama-3.1-8b": (32, 8, 128)}


def decode_write(layers):
    """--decode-write (see the module docstring); returns the number of cases whose fused and separate results
    differ."""
    from mini_infer.ops import _split_k
    from mini_infer.ops.paged_attention import paged_attention_cached_triton, write_kv_cache_triton

    def separate(a):
        write_kv_cache_triton(a[1], a[2], a[3], a[4], a[5])
        return paged_attention_cached_triton(a[0], a[3], a[4], *a[6:10])

    print(f"GPU {torch.cuda.get_device_name()} | decode, bf16, D=128, block 16, block tables {DECODE_CAPACITY} keys, "
          f"CUDA graph of {layers} calls, us per call")
    print(f"{'model':12s} {'batch':>5s} {'ctx':>5s} {'splits':>6s} | {'fused':>7s} {'separate':>8s} {'attn':>7s} | "
          f"{'saved':>6s} same")
    bad = 0
    for model, (hq, hkv, d) in DECODE_WRITE_MODELS.items():
        for s in (1, 8):
            for ctx in (128, 1024):
                args = decode_args(s, ctx, hq, hkv, d)
                splits = _split_k.default_num_splits(args[0], s, hkv, DECODE_CAPACITY)
                us = {"fused": graph_us(lambda a=args: paged_attention_triton(*a), layers),
                      "separate": graph_us(lambda a=args: separate(a), layers),
                      "attn": graph_us(lambda a=args: paged_attention_cached_triton(a[0], a[3], a[4], *a[6:10]),
                                       layers)}
                fused_args, sep_args = list(args), list(args)
                for a in (fused_args, sep_args):
                    a[3], a[4] = args[3].clone(), args[4].clone()
                same = (torch.equal(paged_attention_triton(*fused_args), separate(sep_args))
                        and torch.equal(fused_args[3], sep_args[3]) and torch.equal(fused_args[4], sep_args[4]))
                bad += not same
                print(f"{model:12s} {s:5d} {ctx:5d} {splits:6d} | {us['fused']:7.2f} {us['separate']:8.2f} "
                      f"{us['attn']:7.2f} | {us['separate'] - us['fused']:6.2f} {'yes' if same else 'NO'}", flush=True)
                del args, fused_args, sep_args
                torch.cuda.empty_cache()
    return bad


SWEEP_SHAPES = ((64, 512), (64, 2048), (256, 512), (256, 2048))  # --decode-sweep's (batch, context)
SWEEP_PREFILL = ((4, 1024, 1024), (1, 4096, 1024))  # its fp8 prefill cases: (sequences, context, new tokens)


def sweep_grid(wide):
    """--decode-sweep's launch shapes (block_n, num_warps, num_stages), --wide or not."""
    if wide:
        return dict(block_n=[32, 64, 128], num_warps=[2, 4, 8], num_stages=[1, 2, 3, 4])
    return dict(block_n=[64, 128], num_warps=[4, 8], num_stages=[2, 3])


def time_configs(name, candidates, cases, timer):
    """[(total, per-case times, config, launched shapes)] of each candidate config of _CONFIG[name] over the argument
    tuples `cases`, best first. A shape out of shared memory falls back to smaller ones: `launched` says which ran."""
    from mini_infer.ops import paged_attention as pa

    results = []
    for cfg in candidates:
        pa._CONFIG[name] = cfg
        pa._LAUNCH_OK.clear()
        try:
            times = [timer(lambda a=a: paged_attention_triton(*a, **getattr(a, "kwargs", {}))) for a in cases]
        except Exception as e:  # no launch shape fits, etc.
            print(f"  {name} {cfg} failed: {type(e).__name__}", flush=True)
            continue
        results.append((sum(times), times, cfg, sorted(set(pa._LAUNCH_OK.values()))))
    return sorted(results, key=lambda r: r[0])


def print_ranking(name, labels, results, default, top=6):
    print(f"{name}: us per call at {' '.join(labels)}; best first")
    for _total, times, cfg, launched in results[:top]:
        print("  " + " ".join(f"{t:8.2f}" for t in times) + f"  {cfg}  launched {launched}")
    current = [r for r in results if r[2] == default]
    if current:
        print("  " + " ".join(f"{t:8.2f}" for t in current[0][1]) + "  <- current default")
    print(f"  winner: _CONFIG[{name!r}] = {results[0][2]}", flush=True)


def fp8_way_diffs(name, base, args, ways=None):
    """Largest |triton - reference| at `args` (fp8 caches) for each of _FP8_DOT's ways (or `ways`) at config `base`."""
    from mini_infer.ops import paged_attention as pa

    ref = paged_attention_reference(*args).float()  # writes the same k/v bytes as the kernel's write
    diffs = {}
    for way in ways or pa._FP8_DOT:
        pa._CONFIG[name] = {**base, "fp8_dot": way}
        pa._LAUNCH_OK.clear()
        try:
            diffs[way] = (paged_attention_triton(*args).float() - ref).abs().max().item()
        except Exception as e:  # no launch shape fits, etc.
            print(f"  {name} {pa._CONFIG[name]} failed: {type(e).__name__}", flush=True)
            diffs[way] = float("nan")
    return diffs


@contextlib.contextmanager
def configs_restored():
    """Yields a copy of paged_attention's `_CONFIG` as it was (the defaults a sweep ranks against); the sweep inside
    the block may rewrite it; the table and the cached launch shapes are restored after."""
    from mini_infer.ops import paged_attention as pa

    saved = {k: dict(v) for k, v in pa._CONFIG.items()}
    try:
        yield saved
    finally:
        pa._CONFIG.clear()
        pa._CONFIG.update(saved)
        pa._LAUNCH_OK.clear()


def launch_shape(base: dict, grid: dict, values) -> dict:
    """One point of a --grid over `base` (the kind's _CONFIG entry, so that its other fields, e.g. write_one_split or
    row_tiles, stay as the engine launches them): `maxnreg` 0 means no register cap (the field left out)."""
    cfg = {**base, **dict(zip(grid, values))}
    if cfg.get("maxnreg") == 0:
        del cfg["maxnreg"]
    return cfg


def parse_grid(text: str) -> dict[str, list[int]]:
    """--grid's "key=v,v;key=v" as {key: [v, ...]}."""
    grid = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        key, _, values = part.partition("=")
        if not values:
            raise SystemExit(f"--grid: {part!r} is not key=v1,v2")
        grid[key.strip()] = [int(v) for v in values.split(",")]
    return grid


def decode_sweep(wide=False, layers=28, device="cuda", timer=None, grid=None, shapes=SWEEP_SHAPES,
                 prefill_shapes=SWEEP_PREFILL, heads=None, ways=None, caches=("bf16", "fp8"), rotary=False):
    """--decode-sweep (see the module docstring). `timer(fn)` -> us per call (default: `graph_us` over `layers`
    calls); the other arguments let a CPU run (interpreter) walk the same code on small shapes."""
    from mini_infer.ops import paged_attention as pa
    from mini_infer.ops.paged_attention import write_kv_cache_triton

    timer = timer or (lambda fn: graph_us(fn, layers, replays=3))
    hq, hkv, d = heads or PREFILL_MODELS["qwen3-0.6b"]
    grid = grid or sweep_grid(wide)
    labels = [f"b{s}/ctx{c}" for s, c in shapes]
    dev_name = torch.cuda.get_device_name() if device == "cuda" else device
    print(f"{dev_name} | decode, Hq={hq} Hkv={hkv} D={d} block 16, bf16 q, CUDA graph of {layers} calls "
          f"(write + attention + merge{' + q/k norms and rotary' if rotary else ''}); grid {grid}", flush=True)
    t0 = time.perf_counter()
    best = {}
    with configs_restored() as saved:
        for kv, name in (("bf16", "decode"), ("fp8", "decode_fp8")):
            if kv not in caches:
                continue
            cases = [decode_args(s, ctx, hq, hkv, d, kv=kv, device=device, rotary=rotary) for s, ctx in shapes]
            kv_ways = [w for w in pa._FP8_DOT if ways is None or w in ways] if kv == "fp8" else [None]
            candidates = [{**launch_shape(saved[name], grid, v), **({"fp8_dot": w} if w else {})}
                          for w in kv_ways for v in itertools.product(*grid.values())]
            if kv == "fp8" and not wide:  # the old way ("q": fp8 -> bf16, two cvts a value) at the bf16 shape only
                old_shape = launch_shape(saved[name], grid, [saved["decode"].get(k, 0) for k in grid])
                candidates = [c for c in candidates if c["fp8_dot"] != "q" or c == {**old_shape, "fp8_dot": "q"}]
            results = time_configs(name, candidates, cases, timer)
            print_ranking(name, labels, results, saved[name])
            print(f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
            best[kv] = results[0]
            if kv == "fp8":
                for way in kv_ways:
                    mine = [r for r in results if r[2]["fp8_dot"] == way]
                    if mine:  # none where every launch failed ("fp8" before sm_89) or the grid left the way out
                        print(f"  best with fp8_dot={way!r}: " + " ".join(f"{t:8.2f}" for t in mine[0][1]))
                diffs = fp8_way_diffs(name, best[kv][2], cases[0], ways)
                print("  max |triton - reference| at " + labels[0] + ": "
                      + ", ".join(f"{w} {x:.2e}" for w, x in diffs.items()), flush=True)
            del cases
        if len(best) == 2:
            print("fp8 / bf16 cache, best config of each: "
                  + " ".join(f"{lab} {f / b:.2f}" for lab, f, b in zip(labels, best["fp8"][1], best["bf16"][1])))

        cases = []
        for s, ctx, new in prefill_shapes:
            args = list(build(s, ctx, new, hq, hkv, d, 16, torch.bfloat16, device))
            cases.append(args + fp8_caches(args))
        candidates = [{**saved["prefill_fp8"], "fp8_dot": w} for w in pa._FP8_DOT]
        print_ranking("prefill_fp8", [f"{s}x{new}/ctx{ctx}" for s, ctx, new in prefill_shapes],
                      time_configs("prefill_fp8", candidates, cases, timer), saved["prefill_fp8"])
        del cases

        s, ctx = shapes[-1]
        for kv in caches:
            a = decode_args(s, ctx, hq, hkv, d, kv=kv, device=device)
            us = timer(lambda a=a: write_kv_cache_triton(a[1], a[2], a[3], a[4], a[5], *a[12:]))
            print(f"cache write alone, batch {s}, {kv} cache: {us:.2f} us per call")
    print(f"{time.perf_counter() - t0:.0f} s")
    return best


SPLIT_SWEEP_HEADS = {"qwen3-0.6b": (16, 8, 128), "qwen2.5-7b": (28, 4, 128), "qwen3-30b-a3b": (32, 4, 128)}
SPLIT_SWEEP_SHAPES = ((1, 128), (1, 384), (1, 1024))  # (batch, context): batch-1 decode, as bench/latency.py's
SPLIT_SWEEP_GRID = dict(block_n=[32, 64, 128], num_warps=[4, 8], num_stages=[1, 2])


def split_sweep(layers=28, device="cuda", timer=None, grid=None, shapes=SPLIT_SWEEP_SHAPES, heads=None,
                rotary=False):
    """--split-sweep: _CONFIG["decode_split"] (the small batches' split launches over a 16-bit cache) over `grid`
    (default SPLIT_SWEEP_GRID), timed as --decode-sweep times its configs, for each model's heads of
    SPLIT_SWEEP_HEADS (or `heads`: {name: (Hq, Hkv, D)}); best first per model."""
    timer = timer or (lambda fn: graph_us(fn, layers, replays=10))
    grid = grid or SPLIT_SWEEP_GRID
    labels = [f"b{s}/ctx{c}" for s, c in shapes]
    print(f"{torch.cuda.get_device_name() if device == 'cuda' else device} | decode_split, bf16 q and cache, block "
          f"16, block tables {DECODE_CAPACITY} keys, CUDA graph of {layers} calls (write + attention + merge"
          f"{' + q/k norms and rotary' if rotary else ''}); grid {grid}", flush=True)
    with configs_restored() as saved:
        for model, (hq, hkv, d) in (heads or SPLIT_SWEEP_HEADS).items():
            cases = [decode_args(s, ctx, hq, hkv, d, device=device, rotary=rotary) for s, ctx in shapes]
            candidates = [launch_shape(saved["decode_split"], grid, v) for v in itertools.product(*grid.values())]
            print(f"{model} ({hq} / {hkv} heads):")
            print_ranking("decode_split", labels, time_configs("decode_split", candidates, cases, timer),
                          saved["decode_split"])
            del cases


def cpu():
    torch.set_num_threads(2)
    print("CPU reference, 2 threads, SmolLM2-135M attention shapes (Hq=9 Hkv=3 D=64 block=16), min of 20 calls")
    for s, ctx, new, dtype in [(16, 128, 1, torch.float32), (16, 512, 1, torch.float32), (16, 1024, 1, torch.float32),
                               (16, 512, 1, torch.bfloat16), (1, 64, 1, torch.float32), (16, 100, 100, torch.float32)]:
        args = build(s, ctx, new, 9, 3, 64, 16, dtype, "cpu")
        ts = []
        for _ in range(20):
            t = time.perf_counter()
            paged_attention_reference(*args)
            ts.append(time.perf_counter() - t)
        print(f"S={s:3d} ctx={ctx:5d} qlen={new:4d} {str(dtype):15s} {min(ts) * 1e3:7.2f} ms/call  x30 layers {min(ts) * 30e3:7.1f} ms")


PREFILL_MODELS = {"qwen3-0.6b": (16, 8, 128), "qwen2.5-7b": (28, 4, 128)}  # (Hq, Hkv, D)
PREFILL_CHUNKED = (16384, 2048)  # (cached context, new tokens)


def prefill_case(hq, hkv, d, cached, new):
    """One row of --prefill: the four timings at (cached context, new tokens)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    from mini_infer.ops import _prefill_sdpa

    dtype, total = torch.bfloat16, cached + new
    args = build(1, total, new, hq, hkv, d, 16, dtype, "cuda")
    flops = 4 * hq * d * (new * (new + 1) // 2 + new * cached)
    row = {"hq": hq, "hkv": hkv, "d": d, "cached": cached, "new": new, "tflop": flops / 1e12}
    ms = {"triton": eager_ms(lambda: paged_attention_triton(*args))}
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = torch.ops.mini_infer.paged_attention(*args)
    torch.cuda.synchronize()
    row["op_first_ms"] = (time.perf_counter() - t0) * 1e3
    ms["op"] = eager_ms(lambda: torch.ops.mini_infer.paged_attention(*args))
    row["diff"] = (out.float() - paged_attention_triton(*args).float()).abs().max().item()
    row["op_backend"] = next((b.name for b in _prefill_sdpa.usable_backends(args[0], args[1], args[2])), "none")
    if new < _prefill_sdpa.MIN_QUERY_ROWS:
        row["op_backend"] = "triton (below MIN_QUERY_ROWS)"
    q4 = args[0].view(1, new, hq, d).transpose(1, 2)
    kf = torch.randn(1, total, hkv, d, dtype=dtype, device="cuda").transpose(1, 2)
    vf = torch.randn_like(kf)
    mask = {"is_causal": True} if cached == 0 else {"attn_mask": causal_lower_right(new, total)}
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        def call(backend=backend):
            with sdpa_kernel([backend]):
                sdpa(q4, kf, vf, enable_gqa=True, **mask)
        try:
            ms[name] = eager_ms(call)
        except RuntimeError as e:  # the backend refuses the shape or mask
            ms[name], row[f"{name}_error"] = None, str(e).splitlines()[0][:120]
    row["ms"] = ms
    row["tflops"] = {k: (flops / (v * 1e-3) / 1e12 if v else None) for k, v in ms.items()}
    return row


def prefill(lengths, out_dir):
    from mini_infer.ops import _prefill_sdpa

    if "MINI_INFER_PREFILL_ROUTE" not in os.environ:
        _prefill_sdpa.ROUTE = "auto"  # already the default (no MINI_INFER_PREFILL_ROUTE): this times the route
        os.environ.setdefault("TORCH_CUDNN_SDPA_AVOID_RECOMPILE", "1")  # as the module sets it when the route is on
    cases = [(0, n) for n in lengths] + [PREFILL_CHUNKED]
    dev = torch.cuda.get_device_name()
    print(f"GPU {dev} | one sequence, causal, bf16, D=128, block 16 | MIN_QUERY_ROWS={_prefill_sdpa.MIN_QUERY_ROWS}")
    print(f"{'model':11s} {'cached':>6s} {'new':>6s} | TFLOP/s: {'op':>6s} {'triton':>6s} {'flash':>6s} {'cudnn':>6s}"
          f" | op/cudnn | {'first ms':>8s} {'diff':>7s} backend")
    rows = []
    t0 = time.perf_counter()
    for model, (hq, hkv, d) in PREFILL_MODELS.items():
        for cached, new in cases:
            row = prefill_case(hq, hkv, d, cached, new)
            row["model"] = model
            rows.append(row)
            tf = row["tflops"]
            ratio = f"{tf['op'] / tf['cudnn']:8.2f}" if tf.get("cudnn") else f"{'n/a':>8s}"
            print(f"{model:11s} {cached:6d} {new:6d} | TFLOP/s: {cell(tf['op'])} {cell(tf['triton'])} "
                  f"{cell(tf['flash'])} {cell(tf['cudnn'])} | {ratio} | {row['op_first_ms']:8.1f} "
                  f"{row['diff']:7.4f} {row['op_backend']}", flush=True)
            torch.cuda.empty_cache()
    m = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Za-z]?)\b", dev)
    tag = (m.group(1) if m else re.sub(r"[^a-z0-9]+", "-", dev.lower())).lower()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"kernel_paged_attention_prefill_{tag}.json"
    meta = {"device": dev, "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "git": git_info(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "min_query_rows": _prefill_sdpa.MIN_QUERY_ROWS,
            "TORCH_CUDNN_SDPA_AVOID_RECOMPILE": os.environ.get("TORCH_CUDNN_SDPA_AVOID_RECOMPILE"),
            "timing": "eager, CUDA events, median of 3 rounds", "wall_seconds": round(time.perf_counter() - t0, 1)}
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"{meta['wall_seconds']:.0f} s; wrote {path}")


# --plan-reuse: (BUCKET_STEPS, (cached, new) shapes in order); the groups' power-of-two classes do not overlap
PLAN_REUSE = ((0, ((0, 4500), (0, 4600), (5000, 4500), (6000, 4600))),
              (8, ((0, 9000), (0, 9100), (17000, 9000), (20000, 9100), (31000, 9050))))


def plan_reuse():
    from mini_infer.ops import _prefill_sdpa

    _prefill_sdpa.ROUTE, _prefill_sdpa.MIN_QUERY_ROWS = "on", 4096
    os.environ.setdefault("TORCH_CUDNN_SDPA_AVOID_RECOMPILE", "1")  # as the module sets it when the route is on
    hq, hkv, d = PREFILL_MODELS["qwen2.5-7b"]
    op = torch.ops.mini_infer.paged_attention

    def first_and_warm(cached, new):
        args = build(1, cached + new, new, hq, hkv, d, 16, torch.bfloat16, "cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        op(*args)
        torch.cuda.synchronize()
        first = (time.perf_counter() - t0) * 1e3
        return first, eager_ms(lambda: op(*args), budget_ms=60.0)

    first_and_warm(0, 4096)  # the backend probe, Triton's cache-write compile, the allocator: out of the rows
    print(f"GPU {torch.cuda.get_device_name()} | torch {torch.__version__} | TORCH_CUDNN_SDPA_AVOID_RECOMPILE="
          f"{os.environ['TORCH_CUDNN_SDPA_AVOID_RECOMPILE']} | heads {hq}/{hkv}, D {d}, bf16")
    print(f"{'steps':>5s} {'cached':>6s} {'new':>6s} {'padded':>6s} | {'first ms':>8s} {'warm ms':>8s} {'built ms':>8s}")
    for steps, shapes in PLAN_REUSE:
        _prefill_sdpa.BUCKET_STEPS = steps
        for cached, new in shapes:
            first, warm = first_and_warm(cached, new)
            print(f"{steps:5d} {cached:6d} {new:6d} {_prefill_sdpa.bucket_length(new):6d} | {first:8.1f} {warm:8.1f} "
                  f"{first - warm:8.1f}", flush=True)
            torch.cuda.empty_cache()


def cell(x):
    return f"{x:6.0f}" if x else f"{'n/a':>6s}"


def arg_value(flag, default):
    return sys.argv[sys.argv.index(flag) + 1] if flag in sys.argv else default


if __name__ == "__main__":
    if "--prefill" in sys.argv:
        prefill([int(x) for x in arg_value("--lengths", "512,1024,4096,16384,32768").split(",")],
                arg_value("--out", "bench/results"))
    elif "--plan-reuse" in sys.argv:
        plan_reuse()
    elif "--decode-latency" in sys.argv:
        kv = "fp8" if arg_value("--kv-cache-dtype", "bf16").startswith("fp8") else "bf16"
        sys.exit(1 if decode_latency("--check" in sys.argv, int(arg_value("--layers", "28")), kv) else 0)
    elif "--decode-write" in sys.argv:
        sys.exit(1 if decode_write(int(arg_value("--layers", "28"))) else 0)
    elif "--decode-sweep" in sys.argv:
        ways = arg_value("--ways", None)
        decode_sweep("--wide" in sys.argv, int(arg_value("--layers", "28")),
                     grid=parse_grid(arg_value("--grid", "")) or None, ways=ways.split(",") if ways else None,
                     caches=tuple(arg_value("--caches", "bf16,fp8").split(",")), rotary="--rotary" in sys.argv)
    elif "--split-sweep" in sys.argv:
        split_sweep(int(arg_value("--layers", "28")), grid=parse_grid(arg_value("--grid", "")) or None,
                    rotary="--rotary" in sys.argv)
    elif "--sweep" in sys.argv:
        sweep()
    elif torch.cuda.is_available() and "--cpu-only" not in sys.argv:
        gpu()
        cpu()
    else:
        cpu()
