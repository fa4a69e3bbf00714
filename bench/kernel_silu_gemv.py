"""The down projection at batch-1 decode: silu_and_mul then the GEMV + residual add (two launches) against
`silu_mul_linear` (the activation in the GEMV's prologue, one launch), swept over tiles.

Per preset (bf16, one row, weights cold in L2: several copies cycled, as in a real step), for down_proj's shape
(N = hidden_size, K = intermediate_size; presets whose K the GEMV does not take are skipped): the unfused pair as
the engine runs it without `fuse_silu_gemv` (`silu_and_mul_triton` + `linear_add_triton`), the GEMV + add alone on
a ready activation (the floor the prologue should reach), and `silu_mul_linear_triton` at its default tile
(`silu_mul_gemv_config`) and at every tile of CONFIGS (the best one reported). Each call is a CUDA-graph replay
(bench/kernel_norm.py's `time_calls`); every tile's output is first compared with the unfused pair's. Prints a
table and writes kernel_silu_gemv.json to --out. About 30 s a preset on an H200 (not run yet).

    python bench/kernel_silu_gemv.py                                  # qwen3-0.6b
    python bench/kernel_silu_gemv.py --model qwen3-0.6b --model smollm2-135m --model qwen2.5-7b   # (7b: skipped)
"""

from __future__ import annotations

import argparse
import sys

import torch
from kernel_norm import time_calls, write_gpu_report  # the sibling script's timing and JSON report

from mini_infer.ops._triton_support import triton  # None without triton
from mini_infer.ops.linear import GEMV_MAX_K
from mini_infer.ops.linear_add import linear_add_triton
from mini_infer.ops.silu_and_mul import silu_and_mul_triton
from mini_infer.ops.silu_mul_linear import silu_mul_gemv_config, silu_mul_linear_triton

# (weight rows per program, K per step, warps, pipeline stages)
CONFIGS = [(bn, bk, w, st) for bn in (2, 4, 8) for bk in (512, 1024) for w in (4, 8) for st in (1, 3)]


def down_shape(model: str) -> tuple[int, int]:
    """(N, K) of `model`'s dense down_proj: (hidden_size, intermediate_size)."""
    from mini_infer.models.presets import preset_config

    c = preset_config(model)
    return c.hidden_size, c.intermediate_size


def inputs(n: int, k: int, device: str, dtype: torch.dtype, seed: int = 0):
    """gate and up (views of one merged [1, 2k] row), W [n, k], residual [1, n]."""
    gen = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(1, 2 * k, generator=gen) * 2).to(dtype).to(device)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype).to(device)
    return gate_up[:, :k], gate_up[:, k:], w, torch.randn(1, n, generator=gen).to(dtype).to(device)


def unfused(g, u, w, r):
    return linear_add_triton(silu_and_mul_triton(g, u), w, None, r)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", default=None, help="preset(s) whose down_proj to time (qwen3-0.6b)")
    ap.add_argument("--out", default="bench/out")
    args = ap.parse_args()
    if not torch.cuda.is_available() or triton is None:
        print("bench/kernel_silu_gemv.py times CUDA kernels: it needs a CUDA GPU and triton (correctness: "
              "tests/ops/test_silu_mul_linear.py)")
        return 1
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows = []
    print(f"{torch.cuda.get_device_name()} | bf16, one row, weights cold in L2 | us per call (CUDA-graph replay)")
    print(f"{'model':<16}{'N':>6}{'K':>7} | {'unfused':>8}{'GEMV+add':>9} | {'fused':>7} {'default tile':>16} | "
          f"{'best':>7} {'best tile':>16}")
    for model in args.model or ["qwen3-0.6b"]:
        n, k = down_shape(model)
        if k > GEMV_MAX_K:
            print(f"{model:<16}{n:>6}{k:>7} | K > GEMV_MAX_K: the op runs the unfused kernels (cuBLAS)")
            continue
        copies = max(1, min(16, -(-3 * l2 // (n * k * 2))))
        sets = [inputs(n, k, "cuda", torch.bfloat16, seed=i) for i in range(copies)]
        act = [silu_and_mul_triton(g, u) for g, u, _, _ in sets]

        def timed(fn, sets=sets):
            return time_calls([lambda s=s: fn(*s) for s in sets], 10.0, 3)[0] * 1e3

        ref = unfused(*sets[0])
        t_unfused = timed(unfused)
        t_gemv = time_calls([lambda a=a, s=s: linear_add_triton(a, s[2], None, s[3]) for a, s in zip(act, sets)],
                            10.0, 3)[0] * 1e3
        default = silu_mul_gemv_config(k)
        times = {}
        for cfg in dict.fromkeys([default, *CONFIGS]):
            got = silu_mul_linear_triton(*sets[0][:3], None, sets[0][3], config=cfg)
            if not torch.allclose(got.float(), ref.float(), atol=2e-2, rtol=2e-2):
                print(f"  {model} cfg {cfg}: MISMATCH (max err {(got.float() - ref.float()).abs().max().item():.3e})")
                continue
            times[cfg] = timed(lambda g, u, w, r, cfg=cfg: silu_mul_linear_triton(g, u, w, None, r, config=cfg))
        best = min(times, key=times.get)
        rows.append({"model": model, "N": n, "K": k, "unfused_us": t_unfused, "gemv_add_us": t_gemv,
                     "default_cfg": default, "default_us": times.get(default), "best_cfg": best,
                     "best_us": times[best], "all_us": {str(c): t for c, t in times.items()}})
        print(f"{model:<16}{n:>6}{k:>7} | {t_unfused:>8.2f}{t_gemv:>9.2f} | {times.get(default, float('nan')):>7.2f} "
              f"{str(default):>16} | {times[best]:>7.2f} {str(best):>16}")
        del sets, act
        torch.cuda.empty_cache()
    write_gpu_report(args.out, "kernel_silu_gemv.json", {"rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
