"""Achieved memory bandwidth of the fused RMSNorm kernels (not a test), against the device's copy bandwidth.

    python bench/kernel_norm.py [--no-compile] [--warm] [--out bench/out]
    python bench/kernel_norm.py --check          # no GPU needed: Triton under TRITON_INTERPRET=1, tiny shapes

Times, for `rms_norm` and `fused_add_rms_norm` at hidden sizes 896 (qwen2.5-0.5b), 1024 (qwen3-0.6b), 3584
(qwen2.5-7b), 4096 (llama-3-8b) and 1 … 8192 tokens (bf16):

  triton   the Triton launcher the compiled graphs call on CUDA (what `kernel_impls("triton")` binds)
  eager    the plain-torch reference (`*_reference`, HF LlamaRMSNorm), several kernels
  compile  torch.compile of that reference (Inductor; token dim dynamic, hidden static: at most two
           compiles per op and hidden size, as a serving engine would compile); off with --no-compile

Bytes moved are the ideal ones, the same for every impl: rms_norm reads x and weight and writes y; the fused
add reads x, residual and weight and writes y and the new residual. GB/s = bytes / time (1 GB = 1e9 B), and
%copy = that GB/s over the copy bandwidth measured in the same run (`dst.copy_(src)` of a --copy-gib bf16
tensor, 2x its size moved).

Every call is timed as a CUDA-graph replay (no CPU launch cost; the eager reference's several kernels
are replayed back to back too). Unless --warm, each graph cycles through enough copies of the inputs that
they exceed twice the L2 cache (at most --max-sets copies), so mid-sized shapes are read from HBM rather than
L2; at 1 … 64 tokens the kernels are latency-bound and GB/s says little. Before timing, every shape's
outputs are compared with the eager reference (max |err| in the JSON).

Prints a table, writes kernel_norm.json (meta: device, torch/triton/CUDA versions, commit, date) and
kernel_norm.png (GB/s against tokens, one panel per op and hidden size) to --out. About a minute on an H200.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

EPS = 1e-6
HIDDEN = (896, 1024, 3584, 4096)
TOKENS = (1, 64, 256, 2048, 8192)
MODELS = {896: "qwen2.5-0.5b", 1024: "qwen3-0.6b", 3584: "qwen2.5-7b", 4096: "llama-3-8b"}
OP_NAMES = ("rms_norm", "fused_add_rms_norm")
IMPLS = ("triton", "eager", "compile")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# (atol, rtol) against the eager reference: as tests/ops/helpers.py (the interpreter truncates fp32 -> bf16)
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}
CHECK_SHAPES = ((1, 896), (2, 1024), (17, 896), (5, 96), (3, 3584), (1, 4096))  # (tokens, hidden), --check on CPU


def _ref_rms_norm(x, w):
    from mini_infer.ops.rms_norm import rms_norm_reference

    return rms_norm_reference(x, w, EPS)


def _ref_fused_add_rms_norm(x, r, w):
    from mini_infer.ops.fused_add_rms_norm import fused_add_rms_norm_reference

    return fused_add_rms_norm_reference(x, r, w, EPS)


def bytes_moved(op: str, tokens: int, hidden: int, dtype: torch.dtype) -> int:
    e = torch.empty((), dtype=dtype).element_size()
    if op == "rms_norm":  # read x, weight; write y
        return (2 * tokens * hidden + hidden) * e
    return (4 * tokens * hidden + hidden) * e  # read x, residual, weight; write y, residual


class Impls:
    """The three callables per op: the Triton launcher (as `kernel_impls("triton")` binds it), the eager
    reference, and torch.compile of the reference (built lazily, once per op)."""

    def __init__(self, use_compile: bool):
        import mini_infer.ops as ops  # after TRITON_INTERPRET is settled: triton.jit reads it at import

        triton_fns = ops.kernel_impls("triton")
        ref_fns = ops.kernel_impls("reference")
        self.fns: dict[str, dict[str, Callable]] = {}
        for name in OP_NAMES:
            overload = getattr(torch.ops.mini_infer, name).default
            self.fns[name] = {"triton": lambda *t, f=triton_fns[overload]: f(*t, EPS),
                              "eager": lambda *t, f=ref_fns[overload]: f(*t, EPS)}
        self.use_compile = use_compile
        if use_compile:
            import torch._dynamo as dynamo

            cfg = dynamo.config
            cfg.automatic_dynamic_shapes = False  # only the dims we mark go dynamic: hidden stays static
            cfg.recompile_limit = 64
            cfg.fail_on_recompile_limit_hit = True  # never time a silent fallback to eager
            self.fns["rms_norm"]["compile"] = torch.compile(_ref_rms_norm)
            self.fns["fused_add_rms_norm"]["compile"] = torch.compile(_ref_fused_add_rms_norm)

    def names(self) -> tuple[str, ...]:
        return IMPLS if self.use_compile else IMPLS[:2]


def make_inputs(op: str, tokens: int, hidden: int, dtype, device, n_sets: int, seed: int = 0) -> list[tuple]:
    g = torch.Generator(device=device).manual_seed(seed)
    w = (1 + 0.1 * torch.randn(hidden, generator=g, device=device, dtype=torch.float32)).to(dtype)
    sets = []
    for _ in range(n_sets):
        x = torch.randn(tokens, hidden, generator=g, device=device, dtype=torch.float32).to(dtype)
        if op == "rms_norm":
            sets.append((x, w))
        else:
            sets.append((x, torch.randn(tokens, hidden, generator=g, device=device, dtype=torch.float32).to(dtype), w))
    return sets


def calls_for(impls: Impls, op: str, impl: str, sets: list[tuple]) -> list[Callable]:
    fn = impls.fns[op][impl]
    if impl == "compile" and sets[0][0].shape[0] >= 2:
        import torch._dynamo as dynamo

        for s in sets:  # token dim dynamic (size 1 is specialized by dynamo anyway)
            for t in s[:-1]:
                dynamo.mark_dynamic(t, 0)
    return [lambda s=s: fn(*s) for s in sets]


def _tuple(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def compare(got, want, dtype) -> tuple[float, bool]:
    """Max |err| over the outputs, and whether all are within TOL (shapes and dtypes must match)."""
    atol, rtol = TOL[dtype]
    err, ok = 0.0, True
    for a, b in zip(_tuple(got), _tuple(want), strict=True):
        if a.shape != b.shape or a.dtype != b.dtype:
            return math.inf, False
        a, b = a.float(), b.float()
        err = max(err, (a - b).abs().max().item() if a.numel() else 0.0)
        ok = ok and torch.allclose(a, b, atol=atol, rtol=rtol)
    return err, ok


def check_case(impls: Impls, op: str, tokens: int, hidden: int, dtype, device, names) -> dict:
    """Run each impl once through the same closures the timing uses; compare with eager; inputs untouched."""
    sets = make_inputs(op, tokens, hidden, dtype, device, 1, seed=1)
    before = [t.clone() for t in sets[0]]
    want = impls.fns[op]["eager"](*sets[0])
    res = {}
    for impl in names:
        if impl == "eager":
            continue
        t0 = time.perf_counter()
        got = calls_for(impls, op, impl, sets)[0]()
        err, ok = compare(got, want, dtype)
        ok = ok and all(torch.equal(a, b) for a, b in zip(before, sets[0]))
        res[impl] = {"max_abs_err": err, "ok": ok, "first_call_s": round(time.perf_counter() - t0, 3)}
    return res


def time_calls(calls: list[Callable], target_ms: float, rounds: int) -> tuple[float, float]:
    """(ms per call, seconds of the first pass): a CUDA graph of one pass over `calls`, replayed until
    about target_ms per round; the median of `rounds` rounds."""
    t0 = time.perf_counter()
    for c in calls:  # warm-up outside the capture: Triton JIT / Inductor compile and autotune
        c()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g.replay()
    start.record()
    g.replay()
    end.record()
    torch.cuda.synchronize()
    reps = max(1, min(2000, math.ceil(target_ms / max(start.elapsed_time(end), 1e-3))))
    times = []
    for _ in range(rounds):
        start.record()
        for _ in range(reps):
            g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / (reps * len(calls)))
    del g
    return statistics.median(times), first


def eager_ms(fn, budget_ms=250.0, rounds=3):
    """Median over `rounds` of the mean time of back-to-back calls (enough calls for ~budget_ms / rounds)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    iters = max(2, min(50, int(budget_ms / rounds / max(start.elapsed_time(end), 1e-3))))
    times = []
    for _ in range(rounds):
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return statistics.median(times)


def copy_bandwidth(gib: float, target_ms: float, rounds: int) -> dict:
    """`dst.copy_(src)` timed with events, outside a CUDA graph: inside one the copy becomes a memcpy node
    (measured ~2.7 TB/s that way on an H200, against ~4.3 TB/s eager, as bench/latency.py measures it)."""
    n = int(gib * 2**30) // 2
    src = torch.randn(n, device="cuda", dtype=torch.float32).to(torch.bfloat16)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(max(rounds, 10)):
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    ms = statistics.median(times)
    nbytes = 2 * src.nbytes
    del src, dst
    torch.cuda.empty_cache()
    return {"tensor_bytes": nbytes // 2, "bytes_moved": nbytes, "ms": ms, "gbps": nbytes / ms / 1e6}


def git_info() -> dict:
    """What code ran, for every bench script's JSON: {"commit": HEAD's short hash (None outside a git checkout),
    "dirty_files": the paths that differ from HEAD, untracked ones included (not ignored ones)}. A copy of a newer
    working tree over an older .git (as on the GPU machine) has a stale HEAD: the dirty files say so."""
    def git(*a: str) -> str:  # not stripped: porcelain lines start with a status column that may be a space
        try:
            return subprocess.run(["git", *a], capture_output=True, text=True, timeout=10,
                                  cwd=Path(__file__).resolve().parent).stdout
        except (OSError, subprocess.SubprocessError):
            return ""

    dirty = [line[3:] for line in git("status", "--porcelain").splitlines()]
    return {"commit": git("rev-parse", "--short", "HEAD").strip() or None, "dirty_files": dirty}


def write_gpu_report(out: str | Path, name: str, payload: dict, **meta_extra) -> Path:
    """Write {"meta": {device, torch, triton, git state, date, **meta_extra}, **payload} as JSON to out/name (out
    created): the report of the GPU kernel scripts (kernel_gemv.py, kernel_silu_gemv.py, ...). Returns out."""
    import triton

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            **git_info(), "date": time.strftime("%Y-%m-%d"), **meta_extra}
    (out / name).write_text(json.dumps({"meta": meta, **payload}, indent=2))
    return out


def meta_info(args, device) -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except Exception:
        triton_version = None
    meta = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "git": git_info(), "argv": sys.argv[1:],
            "torch": torch.__version__, "triton": triton_version, "python": platform.python_version(),
            "dtype": args.dtype, "eps": EPS, "l2_mode": "warm" if args.warm else "cold",
            "target_ms": args.target_ms, "rounds": args.rounds, "timing": "CUDA graph replay, median of rounds"}
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        meta.update(device=torch.cuda.get_device_name(), cuda=torch.version.cuda,
                    capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
                    memory_gib=round(p.total_memory / 2**30, 1), l2_bytes=getattr(p, "L2_cache_size", None))
    else:
        meta.update(device="cpu (TRITON_INTERPRET=1)")
    return meta


def run_check(impls: Impls, args, device) -> int:
    dtype = DTYPES[args.dtype]
    shapes = CHECK_SHAPES if device == "cpu" else [(t, h) for h in args.hidden for t in args.tokens]
    where = "CPU, Triton interpreter" if device == "cpu" else torch.cuda.get_device_name()
    print(f"--check on {where}: {args.dtype}, outputs against the eager reference (atol, rtol {TOL[dtype]})")
    failed = 0
    for op in args.ops:
        for tokens, hidden in shapes:
            res = check_case(impls, op, tokens, hidden, dtype, device, impls.names())
            line = "  ".join(f"{impl} max|err| {r['max_abs_err']:.2e} {'ok' if r['ok'] else 'FAIL'}"
                             for impl, r in res.items())
            failed += sum(not r["ok"] for r in res.values())
            print(f"{op:<20} tokens={tokens:<5} hidden={hidden:<5} {line}", flush=True)
    print("check passed" if not failed else f"check FAILED ({failed})")
    return 1 if failed else 0


def bench(impls: Impls, args) -> dict:
    dtype = DTYPES[args.dtype]
    names = impls.names()
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or 64 * 2**20
    copy = copy_bandwidth(args.copy_gib, args.target_ms, args.rounds)
    print(f"{torch.cuda.get_device_name()} | {args.dtype} | copy bandwidth {copy['gbps']:.0f} GB/s "
          f"({copy['tensor_bytes'] / 2**30:.2f} GiB dst.copy_(src)) | L2 {l2 / 2**20:.0f} MiB, inputs "
          f"{'warm (one set)' if args.warm else f'cold (cycled over > 2x L2, at most {args.max_sets} sets)'} "
          f"| CUDA-graph timings, median of {args.rounds}", flush=True)
    head = f"{'op':<19}{'hidden':>7}{'tokens':>7}{'MiB':>9}{'sets':>5} |"
    for impl in names:
        head += f"{impl + ' us':>11}{'GB/s':>7}{'%copy':>6} |"
    print(head + " triton vs eager")
    results, compile_s = [], 0.0
    for op in args.ops:
        for hidden in args.hidden:
            for tokens in args.tokens:
                nbytes = bytes_moved(op, tokens, hidden, dtype)
                n_sets = 1 if args.warm else max(1, min(args.max_sets, math.ceil(2 * l2 / nbytes)))
                row = {"op": op, "hidden": hidden, "model": MODELS.get(hidden), "tokens": tokens,
                       "dtype": args.dtype, "bytes": nbytes, "n_sets": n_sets,
                       "check": check_case(impls, op, tokens, hidden, dtype, "cuda", names), "impls": {}}
                sets = make_inputs(op, tokens, hidden, dtype, "cuda", n_sets)
                line = f"{op:<19}{hidden:>7}{tokens:>7}{nbytes / 2**20:>9.2f}{n_sets:>5} |"
                for impl in names:
                    try:
                        ms, first = time_calls(calls_for(impls, op, impl, sets), args.target_ms, args.rounds)
                    except Exception as e:  # e.g. a compiled graph that will not capture
                        row["impls"][impl] = {"error": f"{type(e).__name__}: {e}"[:300]}
                        line += f"{'error':>11}{'':>7}{'':>6} |"
                        print(f"  {op} {impl} hidden={hidden} tokens={tokens}: {type(e).__name__}: {e}"[:300],
                              file=sys.stderr)
                        continue
                    if impl == "compile":  # compiles happen in check_case's call, or else in the warm-up
                        compile_s += first + row["check"]["compile"]["first_call_s"]
                    gbps = nbytes / ms / 1e6
                    row["impls"][impl] = {"us": ms * 1e3, "gbps": gbps, "frac_copy": gbps / copy["gbps"]}
                    line += f"{ms * 1e3:>11.2f}{gbps:>7.0f}{100 * gbps / copy['gbps']:>5.0f}% |"
                t, e = row["impls"].get("triton", {}), row["impls"].get("eager", {})
                if "us" in t and "us" in e:
                    line += f" {e['us'] / t['us']:.2f}x"
                bad = [impl for impl, r in row["check"].items() if not r["ok"]]
                if bad:
                    line += f"  MISMATCH vs eager: {', '.join(bad)}"
                print(line, flush=True)
                results.append(row)
                del sets
                torch.cuda.empty_cache()
    return {"copy": copy, "compile_seconds": round(compile_s, 1), "results": results}


def plot(report: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    meta, rows, copy = report["meta"], report["results"], report["copy"]["gbps"]
    ops = list(dict.fromkeys(r["op"] for r in rows))
    hiddens = list(dict.fromkeys(r["hidden"] for r in rows))
    fig, axes = plt.subplots(len(ops), len(hiddens), figsize=(3.4 * len(hiddens), 3.0 * len(ops)),
                             sharex=True, sharey=True, squeeze=False)
    for i, op in enumerate(ops):
        for j, hidden in enumerate(hiddens):
            ax = axes[i][j]
            sel = [r for r in rows if r["op"] == op and r["hidden"] == hidden]
            for k, impl in enumerate(IMPLS):
                pts = [(r["tokens"], r["impls"][impl]["gbps"]) for r in sel if "gbps" in r["impls"].get(impl, {})]
                if pts:
                    ax.plot(*zip(*pts), marker="o", ms=3, color=f"C{k}", label=impl)
            ax.axhline(copy, color="k", ls="--", lw=0.8, label="copy")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{op}, hidden {hidden}", fontsize=9)
            ax.grid(alpha=0.3)
            if i == len(ops) - 1:
                ax.set_xlabel("tokens")
            if j == 0:
                ax.set_ylabel("GB/s")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"RMSNorm kernels, {meta['dtype']}, {meta['device']} ({meta['date'][:10]}, "
                 f"{meta['git']['commit']}, L2-{meta['l2_mode']} inputs)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def probe_parser(doc: str) -> argparse.ArgumentParser:
    """A probe script's argument parser (bench/probe_*.py) with its two CPU modes, --cpu and --sm90, for `probe_main`."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--cpu", action="store_true", help="interpreter check (TRITON_INTERPRET=1)")
    ap.add_argument("--sm90", action="store_true", help="sm_90 builds on the CPU: registers, spills, smem, instructions")
    return ap


def probe_main(args, cpu: Callable[[], int], sm90: Callable[[], int], gpu: Callable[[], int]) -> int:
    """A probe script's modes (bench/probe_*.py): `args.cpu` its interpreter check, `args.sm90` its sm_90 builds, else
    its CUDA run; exit status 2 without Triton, for the builds where this process cannot compile (`compile_blocker`),
    or for the CUDA run without a GPU."""
    from mini_infer.ops._triton_support import HAS_TRITON

    if not HAS_TRITON:
        print("needs triton", file=sys.stderr)
        return 2
    if args.cpu:
        return cpu()
    if args.sm90:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from tests.ops.compile_sm90 import compile_blocker

        blocker = compile_blocker()
        if blocker:
            print(f"--sm90: {blocker}", file=sys.stderr)
            return 2
        return sm90()
    if not torch.cuda.is_available():
        print("no CUDA device: use --cpu or --sm90", file=sys.stderr)
        return 2
    return gpu()


def int_list(text: str) -> list[int]:
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return vals


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int_list, default=",".join(map(str, HIDDEN)), help="comma list (default %(default)s)")
    ap.add_argument("--tokens", type=int_list, default=",".join(map(str, TOKENS)), help="comma list (default %(default)s)")
    ap.add_argument("--ops", default=",".join(OP_NAMES), help="comma list of rms_norm,fused_add_rms_norm")
    ap.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile of the reference")
    ap.add_argument("--warm", action="store_true", help="reuse one input set (L2-warm) instead of cycling copies")
    ap.add_argument("--max-sets", type=int, default=128, help="most input copies cycled per shape (cold mode)")
    ap.add_argument("--copy-gib", type=float, default=1.0, help="size of the copy-bandwidth tensor (>= 1)")
    ap.add_argument("--target-ms", type=float, default=5.0, help="GPU time per timing round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--check", action="store_true",
                    help="only compare outputs with the eager reference through the timed call path: on CPU "
                         "under TRITON_INTERPRET=1 at tiny shapes, on a GPU at the benchmark shapes")
    ap.add_argument("--out", default="bench/out")
    args = ap.parse_args(argv)
    args.ops = [o for o in args.ops.split(",") if o]
    if not args.ops or set(args.ops) - set(OP_NAMES):
        ap.error(f"--ops: choose from {','.join(OP_NAMES)}")
    if args.copy_gib < 1:
        ap.error("--copy-gib must be >= 1 (smaller copies can sit in L2)")
    if args.max_sets < 1 or args.rounds < 1 or args.target_ms <= 0:
        ap.error("--max-sets, --rounds and --target-ms must be positive")
    return args


def check_device(script: str, check: bool) -> str:
    """Where a kernel script with a `--check` mode runs: "cuda" with a GPU; "cpu" when only --check was asked and
    there is none, with TRITON_INTERPRET=1 set (before mini_infer.ops imports triton: triton.jit reads it). Exits
    with a message without a GPU and --check, with TRITON_INTERPRET set on a GPU, or when triton does not import."""
    on_gpu = torch.cuda.is_available()
    if not on_gpu and not check:
        raise SystemExit(f"{script} needs a CUDA GPU (torch.cuda.is_available() is False here): it times Triton "
                         f"kernels on the device. Without one, `python {script} --check` runs the launch path once "
                         "under TRITON_INTERPRET=1 and compares it with the torch reference.")
    if on_gpu and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("TRITON_INTERPRET is set: unset it to run the kernels on the GPU")
    if not on_gpu:
        os.environ["TRITON_INTERPRET"] = "1"
    from mini_infer.ops import HAS_TRITON

    if not HAS_TRITON:
        raise SystemExit("triton is not importable: nothing to benchmark")
    return "cuda" if on_gpu else "cpu"


def main(argv=None) -> int:
    args = parse_args(argv)
    device = check_device("bench/kernel_norm.py", args.check)
    on_gpu = device == "cuda"
    if not on_gpu and not args.no_compile:
        print("(on CPU, torch.compile goes through Inductor's C++ backend, not the GPU one)")
    impls = Impls(use_compile=not args.no_compile)
    if args.check:
        return run_check(impls, args, device)

    t0 = time.perf_counter()
    report = {"meta": meta_info(args, device)}
    report.update(bench(impls, args))
    report["meta"]["wall_seconds"] = round(time.perf_counter() - t0, 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernel_norm.json").write_text(json.dumps(report, indent=2))
    plot(report, out / "kernel_norm.png")
    print(f"{report['meta']['wall_seconds']:.0f} s (torch.compile warm-up {report['compile_seconds']:.0f} s); "
          f"wrote {out / 'kernel_norm.json'} and {out / 'kernel_norm.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
