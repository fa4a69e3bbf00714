"""Probe (not a test, not used by the engine): `linear_add`'s several-row path, cuBLAS `F.linear` then torch's add
against one `torch.addmm(residual, x, W.T)` (the residual added in cuBLAS's epilogue), by rows.

    python bench/probe_linear_add_rows.py [--rows 16,64,256,1024,8192] [--models qwen3-0.6b,qwen2.5-7b]

Why: the twentieth session put every several-row `linear_add` on addmm and saw the nano-vllm workload's decode
steps (256 rows) go from 5.3 to 5.2 ms but its prefill steps (thousands of rows) from 20 to 87 ms, unprofiled;
the twenty-first measured this and a gated version and left `linear_add` as it was (bench/RESULTS.md). This times both ways per (o_proj / down_proj shape, rows) to find the rows where addmm wins:
a CUDA graph of calls cycling over distinct weight copies (together over twice the L2, so the weights come from
HBM as in a step), replayed, median of rounds (kernel_norm.py's `time_calls`), bf16. Columns: us per call of each
way, their ratio (> 1: addmm faster), and the largest difference between the two outputs in ulps of the sum
(the pair rounds the product before the add, addmm rounds once), in ulps of the largest sum.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_norm import int_list, time_calls  # noqa: E402

SHAPES = {  # model -> {linear: (N, K)}: the linears whose output feeds the residual add
    "qwen3-0.6b": {"o_proj": (1024, 2048), "down": (1024, 3072)},
    "qwen2.5-7b": {"o_proj": (3584, 3584), "down": (3584, 18944)},
}
L2_BYTES = 60 * 2**20


def probe(name: str, n: int, k: int, rows: int, target_ms: float, rounds: int) -> dict:
    """Time and compare both ways at one shape."""
    dt, dev = torch.bfloat16, "cuda"
    copies = max(2, math.ceil(2 * L2_BYTES / (n * k * 2)))
    ws = [torch.randn(n, k, dtype=dt, device=dev) / math.sqrt(k) for _ in range(copies)]
    x = torch.randn(rows, k, dtype=dt, device=dev)
    r = torch.randn(rows, n, dtype=dt, device=dev)
    pair_ms, _ = time_calls([lambda w=w: F.linear(x, w) + r for w in ws], target_ms, rounds)
    addmm_ms, _ = time_calls([lambda w=w: torch.addmm(r, x, w.t()) for w in ws], target_ms, rounds)
    a, b = F.linear(x, ws[0]) + r, torch.addmm(r, x, ws[0].t())
    ulp = torch.finfo(dt).eps * a.float().abs().amax()  # an ulp of the largest sum
    return {"linear": name, "n": n, "k": k, "rows": rows, "pair_us": pair_ms * 1e3, "addmm_us": addmm_ms * 1e3,
            "max_ulps": float((a.float() - b.float()).abs().amax() / ulp)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int_list, default="16,64,128,256,512,1024,2048,4096,8192")
    ap.add_argument("--models", default=",".join(SHAPES))
    ap.add_argument("--target-ms", type=float, default=20.0)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_linear_add_rows: needs a CUDA GPU", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | bf16, us per call")
    print(f"{'model':12} {'linear':7} {'rows':>5} {'linear+add':>11} {'addmm':>8} {'pair/addmm':>10} {'max ulps':>9}")
    for model in args.models.split(","):
        for name, (n, k) in SHAPES[model].items():
            for rows in args.rows:
                p = probe(name, n, k, rows, args.target_ms, args.rounds)
                print(f"{model:12} {name:7} {rows:5d} {p['pair_us']:11.2f} {p['addmm_us']:8.2f} "
                      f"{p['pair_us'] / p['addmm_us']:10.2f} {p['max_ulps']:9.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
