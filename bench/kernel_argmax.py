"""The greedy sampler's argmax: torch.argmax(logits, dim=-1) against `argmax_rows` (mini_infer/ops/argmax.py, one
Triton launch: each row split over programs, merged by the last to arrive), not a test.

    python bench/kernel_argmax.py [--rows 1,8,64,256] [--vocab 32000,128256,151936] [--out bench/results]
    python bench/kernel_argmax.py --check     # outputs only: on a GPU at the benchmark shapes, else under
                                              # TRITON_INTERPRET=1 at small ones
    python bench/kernel_argmax.py --sample    # the sampler's temperature draw: torch path vs gumbel_argmax

--sample times, per (rows, vocab), a whole `Sampler()` call on bf16 logits whose rows all sample at temperature 0.6
(no truncation): the torch path (`FUSED_DRAW` off: cast, divide, softmax, exponential noise, divide, argmax) against
the one `gumbel_argmax` launch, eagerly (bench/kernel_norm.py's `eager_ms`: back-to-back calls, host time included:
what a decode step pays between replays; --rounds rounds of about --target-ms each, their median; the H200 numbers in
bench/RESULTS.md were taken as the mean of 50 calls after 5 warm-up calls), and prints the ratio.

For every (rows, vocab) of bf16 logits (vocab 32000: llama-2 / mistral, 128256: llama-3, 151936: qwen2.5 / qwen3),
times `x.argmax(dim=-1)` (torch's reduce, and the memset of its multi-block semaphore) and `argmax_rows_triton(x)`
(the launcher the sampler calls on CUDA) as CUDA-graph replays (bench/kernel_norm.py's `time_calls`: no CPU launch
cost), the logits L2-warm (a decode step's logits were just written by the lm_head). Before timing, each shape's
ids are compared with torch's, exactly, on random logits and on logits with ties across chunks, NaNs and -inf
rows. Prints a table and writes kernel_argmax_<gpu>.json to --out (bench/kernel_norm.py's `write_gpu_report`).
Seconds on an H200 (not run yet: written on a machine without a GPU).
"""

from __future__ import annotations

import argparse
import sys

import torch
from kernel_norm import (  # the sibling script's helpers
    check_device,
    eager_ms,
    int_list,
    time_calls,
    write_gpu_report,
)

ROWS = (1, 8, 64, 256)
VOCABS = (32000, 128256, 151936)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
CHECK_SHAPES = ((1, 1000), (3, 5000), (2, 32000), (1, 151936))  # (rows, vocab) of --check without a GPU


def logits_cases(rows: int, vocab: int, dtype: torch.dtype, device: str) -> dict[str, torch.Tensor]:
    """Random logits, and logits whose rows hold equal maxima in several chunks (the first must win), a NaN (it
    wins over +inf) or only -inf (index 0)."""
    g = torch.Generator(device=device).manual_seed(rows * 7 + vocab)
    rand = torch.randn(rows, vocab, generator=g, device=device, dtype=torch.float32).to(dtype)
    hard = (torch.randn(rows, vocab, generator=g, device=device, dtype=torch.float32) * 3).to(dtype)
    for r in range(rows):
        hard[r, [vocab - 1 - r % vocab, (3 * vocab) // 4, vocab // 3 + r % max(1, vocab // 3)]] = 100.0
        if r % 3 == 1:
            hard[r, [(vocab // 2 + r) % vocab, vocab - 1]] = float("nan")
            hard[r, 0] = float("inf")
        elif r % 3 == 2:
            hard[r] = float("-inf")
    return {"random": rand, "ties/nan/-inf": hard}


def check_shape(rows: int, vocab: int, dtype: torch.dtype, device: str) -> list[str]:
    """The kernel's ids against torch.argmax's (computed on the CPU): what differs, by case (empty: all equal)."""
    from mini_infer.ops.argmax import argmax_rows_triton

    bad = []
    for name, x in logits_cases(rows, vocab, dtype, device).items():
        got, want = argmax_rows_triton(x).cpu(), x.cpu().argmax(dim=-1)
        if not torch.equal(got, want):
            bad.append(f"{name}: rows {(got != want).nonzero().flatten().tolist()[:8]} differ")
    return bad


def run_check(args, device: str) -> int:
    dtype = DTYPES[args.dtype]
    shapes = CHECK_SHAPES if device == "cpu" else [(r, v) for v in args.vocab for r in args.rows]
    where = "CPU, Triton interpreter" if device == "cpu" else torch.cuda.get_device_name()
    print(f"--check on {where}: {args.dtype}, argmax_rows' ids against torch.argmax's (exact)")
    failed = 0
    for rows, vocab in shapes:
        bad = check_shape(rows, vocab, dtype, device)
        failed += bool(bad)
        print(f"rows={rows:<5} vocab={vocab:<7} {'ok' if not bad else 'FAIL ' + '; '.join(bad)}", flush=True)
    print("check passed" if not failed else f"check FAILED ({failed})")
    return 1 if failed else 0


def gpu_tag() -> str:
    """'h200' for 'NVIDIA H200', 'h100' for 'NVIDIA H100 80GB HBM3': the report's file name."""
    words = torch.cuda.get_device_name().replace("NVIDIA", "").split()
    return (words[0] if words else "gpu").lower()


def bench(args) -> list[dict]:
    from mini_infer.ops.argmax import argmax_config, argmax_rows_triton

    dtype = DTYPES[args.dtype]
    print(f"{torch.cuda.get_device_name()} | {args.dtype} logits, L2-warm | us per call (CUDA-graph replay, "
          f"median of {args.rounds})")
    print(f"{'rows':>5}{'vocab':>8}{'programs':>9} | {'torch':>8}{'argmax_rows':>12} | {'speedup':>7}  check")
    results = []
    for vocab in args.vocab:
        for rows in args.rows:
            bad = check_shape(rows, vocab, dtype, "cuda")
            x = logits_cases(rows, vocab, dtype, "cuda")["random"]
            t_torch = time_calls([lambda x=x: x.argmax(dim=-1)], args.target_ms, args.rounds)[0] * 1e3
            t_op = time_calls([lambda x=x: argmax_rows_triton(x)], args.target_ms, args.rounds)[0] * 1e3
            block, tiles, programs, num_warps = argmax_config(vocab)
            results.append({"rows": rows, "vocab": vocab, "dtype": args.dtype, "torch_us": t_torch,
                            "argmax_rows_us": t_op, "speedup": t_torch / t_op, "block": block, "tiles": tiles,
                            "programs_per_row": programs, "num_warps": num_warps, "check": bad or "ok"})
            print(f"{rows:>5}{vocab:>8}{programs:>9} | {t_torch:>8.2f}{t_op:>12.2f} | {t_torch / t_op:>6.2f}x  "
                  f"{'ok' if not bad else 'MISMATCH: ' + '; '.join(bad)}", flush=True)
            del x
    return results


def bench_sample(args) -> list[dict]:
    from mini_infer.runtime import sampler as sampler_mod
    from mini_infer.runtime.sampler import Sampler, SamplingBatch
    from mini_infer.sampling_params import SamplingParams

    print(f"{torch.cuda.get_device_name()} | {args.dtype} logits, temperature 0.6 | us per Sampler() call (eager)")
    print(f"{'rows':>5}{'vocab':>8} | {'torch path':>11}{'gumbel':>9} | ratio")
    results = []
    sampler = Sampler()
    for vocab in args.vocab:
        for rows in args.rows:
            x = torch.randn(rows, vocab, device="cuda").to(DTYPES[args.dtype])
            batch = SamplingBatch.build([SamplingParams(temperature=0.6)] * rows, [((), ())] * rows, None, vocab,
                                        "cuda")
            times = {}
            for fused in (False, True):
                sampler_mod.FUSED_DRAW = fused
                times[fused] = 1e3 * eager_ms(lambda x=x, batch=batch: sampler(x, batch),
                                              budget_ms=args.target_ms * args.rounds, rounds=args.rounds)
            sampler_mod.FUSED_DRAW = True
            results.append({"rows": rows, "vocab": vocab, "torch_path_us": times[False], "gumbel_us": times[True]})
            print(f"{rows:>5}{vocab:>8} | {times[False]:>11.1f}{times[True]:>9.1f} | {times[False] / times[True]:.2f}x",
                  flush=True)
    return results


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int_list, default=",".join(map(str, ROWS)), help="comma list (default %(default)s)")
    ap.add_argument("--vocab", type=int_list, default=",".join(map(str, VOCABS)),
                    help="comma list (default %(default)s)")
    ap.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    ap.add_argument("--target-ms", type=float, default=5.0, help="GPU time per timing round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--check", action="store_true", help="only compare the ids with torch.argmax's (see above)")
    ap.add_argument("--sample", action="store_true", help="time the sampler's temperature draw (see above)")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.target_ms <= 0:
        ap.error("--rounds and --target-ms must be positive")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = check_device("bench/kernel_argmax.py", args.check)  # a GPU, or --check under the interpreter
    if args.check:
        return run_check(args, device)
    if args.sample:
        write_gpu_report(args.out, f"kernel_sample_{gpu_tag()}.json", {"results": bench_sample(args)},
                         timing="eager, median of rounds of back-to-back calls", target_ms=args.target_ms, rounds=args.rounds)
        return 0
    results = bench(args)
    name = f"kernel_argmax_{gpu_tag()}.json"
    write_gpu_report(args.out, name, {"results": results}, timing="CUDA graph replay, median of rounds, L2-warm",
                     target_ms=args.target_ms, rounds=args.rounds)
    print(f"wrote {args.out}/{name}")
    return 0 if all(r["check"] == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
