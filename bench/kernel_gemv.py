"""Batch-1 GEMMs of a decode step: cuBLAS (`F.linear`) beside the engine's Triton GEMV, against copy bandwidth.

The batch-1 decode of a 7B model is ~200 weight GEMMs with one row (x [1, K] @ W[N, K]^T), each reading its
weight once: this measures how close each weight shape gets to the copy bandwidth, with weights cold in L2
(several copies cycled, as in a real step where 15 GB of weights pass through a 60 MB L2). The GEMV is
`mini_infer.ops.linear.gemv_triton`, swept over tile configs (the best one per shape is reported). Prints a
table, writes JSON and a PNG bar chart to --out.

    python bench/kernel_gemv.py                  # qwen2.5-7b's shapes
    python bench/kernel_gemv.py --model qwen3-30b-a3b --model qwen3-0.6b   # other presets' dense GEMMs
    python bench/kernel_gemv.py --check          # correctness only (also on CPU, under TRITON_INTERPRET=1)
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from kernel_norm import (  # the sibling script's timing and JSON report
    copy_bandwidth,
    time_calls,
    write_gpu_report,
)

from mini_infer.ops._triton_support import triton  # None without triton
from mini_infer.ops.linear import gemv_triton


def preset_shapes(model: str) -> list[tuple[str, int, int, int]]:
    """(name, N, K, count per step) of a preset's batch-1 weight GEMMs as the engine runs them (merged q/k/v and
    gate/up); an MoE layer contributes its router (its experts run in `fused_moe`, not here)."""
    from mini_infer.models.presets import preset_config

    c = preset_config(model)
    h, layers = c.hidden_size, c.num_hidden_layers
    d = getattr(c, "head_dim", None) or h // c.num_attention_heads
    q, kv = c.num_attention_heads * d, c.num_key_value_heads * d
    shapes = [("qkv (merged)", q + 2 * kv, h, layers), ("o_proj", h, q, layers)]
    experts = getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None)
    if experts:
        shapes.append(("router", experts, h, layers))
    else:
        shapes += [("gate_up (merged)", 2 * c.intermediate_size, h, layers),
                   ("down_proj", h, c.intermediate_size, layers)]
    return [*shapes, ("lm_head", c.vocab_size, h, 1)]

# (weight rows per program, K per step, warps, pipeline stages)
CONFIGS = [(bn, bk, w, st) for bn in (2, 4, 8) for bk in (512, 1024) for w in (4, 8) for st in (1, 3, 4)]



def triton_gemv(x: torch.Tensor, w: torch.Tensor, cfg: tuple[int, int, int, int]) -> torch.Tensor:
    """The engine's GEMV kernel (mini_infer/ops/linear.py) with tile config `cfg`."""
    return gemv_triton(x, w, None, cfg)


def check(device: str) -> bool:
    ok = True
    for n, k in [(40, 96), (33, 1000), (8, 64)]:
        w = torch.randn(n, k, device=device, dtype=torch.float32)
        x = torch.randn(1, k, device=device, dtype=torch.float32)
        for cfg in [(4, 256, 4, 1), (16, 512, 8, 3)]:
            got = triton_gemv(x, w, cfg)
            err = (got - F.linear(x, w)).abs().max().item()
            ok &= err < 1e-3
            print(f"check N={n} K={k} cfg={cfg}: max err {err:.2e}")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--model", action="append", default=None, help="preset(s) whose shapes to time (qwen2.5-7b)")
    ap.add_argument("--out", default="bench/out")
    args = ap.parse_args()
    if args.check:
        dev = "cuda" if torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET") else "cpu"
        ok = check(dev)
        print("CHECK", "PASSED" if ok else "FAILED")
        return 0 if ok else 1
    if not torch.cuda.is_available() or triton is None:
        print("bench/kernel_gemv.py times CUDA kernels: it needs a CUDA GPU and triton (try --check on CPU)")
        return 1
    bw = copy_bandwidth(1.0, 20.0, 5)["gbps"] * 1e9
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows, steps = [], {}
    print(f"{torch.cuda.get_device_name()} | copy bandwidth {bw / 1e12:.2f} TB/s | bf16, M = 1, weights cold in L2")
    print(f"{'gemm':<30}{'N':>7}{'K':>7}{'MB':>8} | {'cuBLAS us':>9}{'TB/s':>6}{'%copy':>6} | "
          f"{'Triton us':>9}{'TB/s':>6}{'%copy':>6} {'best cfg':>14}")
    models = args.model or ["qwen2.5-7b"]
    shapes = [(m, f"{m[:12]} {name}" if len(models) > 1 else name, n, k, c)
              for m in models for name, n, k, c in preset_shapes(m)]
    for model, name, n, k, count in shapes:
        step = steps.setdefault(model, {"cublas": 0.0, "triton": 0.0, "floor": 0.0})
        nbytes = n * k * 2
        copies = max(1, min(16, -(-3 * l2 // nbytes)))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x, ws[0]).float()

        t_cublas = time_calls([lambda w=w, x=x: F.linear(x, w) for w in ws], 20.0, 5)[0]
        best = None
        for cfg in CONFIGS:
            got = triton_gemv(x, ws[0], cfg).float()
            if not torch.allclose(got, ref, atol=2e-2, rtol=2e-2):
                print(f"  {name} cfg {cfg}: MISMATCH (max err {(got - ref).abs().max().item():.3e})")
                continue

            t = time_calls([lambda w=w, x=x, cfg=cfg: triton_gemv(x, w, cfg) for w in ws], 10.0, 3)[0]
            if best is None or t < best[0]:
                best = (t, cfg)
        t_tri, cfg = best
        row = {"model": model, "gemm": name, "N": n, "K": k, "per_step": count, "bytes": nbytes, "cublas_ms": t_cublas,
               "triton_ms": t_tri, "triton_cfg": cfg, "cublas_Bps": nbytes / (t_cublas / 1e3),
               "triton_Bps": nbytes / (t_tri / 1e3)}
        rows.append(row)
        step["cublas"] += count * t_cublas
        step["triton"] += count * t_tri
        step["floor"] += count * nbytes / bw * 1e3
        print(f"{name:<30}{n:>7}{k:>7}{nbytes / 1e6:>8.1f} | {t_cublas * 1e3:>9.1f}{row['cublas_Bps'] / 1e12:>6.2f}"
              f"{100 * row['cublas_Bps'] / bw:>5.0f}% | {t_tri * 1e3:>9.1f}{row['triton_Bps'] / 1e12:>6.2f}"
              f"{100 * row['triton_Bps'] / bw:>5.0f}% {str(cfg):>14}")
        del ws
        torch.cuda.empty_cache()
    for model, step in steps.items():
        print(f"{model}: all weight GEMMs of one step: cuBLAS {step['cublas']:.3f} ms, best GEMV tile "
              f"{step['triton']:.3f} ms, copy-bandwidth floor {step['floor']:.3f} ms")
    out = write_gpu_report(args.out, "kernel_gemv.json", {"rows": rows, "step_ms": steps}, copy_Bps=bw)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3))
        xs = range(len(rows))
        ax.bar([i - 0.2 for i in xs], [r["cublas_Bps"] / 1e12 for r in rows], 0.4, label="cuBLAS")
        ax.bar([i + 0.2 for i in xs], [r["triton_Bps"] / 1e12 for r in rows], 0.4, label="Triton GEMV")
        ax.axhline(bw / 1e12, ls="--", c="k", lw=1, label="copy")
        ax.set_xticks(list(xs), [r["gemm"] for r in rows], fontsize=7)
        ax.set_ylabel("TB/s")
        ax.legend(fontsize=7)
        ax.set_title(f"batch-1 GEMMs, {', '.join(models)} shapes ({torch.cuda.get_device_name()})", fontsize=9)
        fig.tight_layout()
        fig.savefig(out / "kernel_gemv.png", dpi=120)
    except ImportError:
        print("matplotlib not installed: no plot")
    return 0


if __name__ == "__main__":
    sys.exit(main())
