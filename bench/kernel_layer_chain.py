"""What each batch-1 decode kernel costs on the critical path: a model's decoder blocks chained in one CUDA graph,
with one kernel at a time left out.

With programmatic dependent launch every kernel launches early and waits for the one before it, so a profiler's
per-kernel times overlap and do not say what a fusion would save. This script times chains instead (bf16, one row,
the model's own layer count of distinct weights, so weights come from HBM as in a real step; bench/kernel_norm.py's
`time_calls`), us per layer:
  * MLP: norm + gate_up GEMV (`rms_norm_linear`), `silu_and_mul`, down GEMV + residual (`linear_add`); and the same
    without the silu_and_mul launch (the down GEMV reads the gate half instead: timing only, not the model's math).
  * attention: norm + qkv GEMV (+ bias), `qk_rotary`, the KV write, decode attention over --ctx keys, o_proj GEMV +
    residual; and the same without the rotary, without the write, and without both.
The differences are the upper bounds of folding those kernels away. It times the ops' Triton functions directly
(`write_kv_cache_triton` then the attention kernel for the write, whatever the op's own default is).
The two halves ran as one-off probes on an H200 on 2026-11-24 (bench/RESULTS.md, twelfth session); this script
puts them together. Prints a table and writes kernel_layer_chain.json to --out.

    python bench/kernel_layer_chain.py                                    # qwen3-0.6b and qwen2.5-7b, 256 keys
    python bench/kernel_layer_chain.py --model llama-3.1-8b --ctx 1024
"""

from __future__ import annotations

import argparse

import torch
from kernel_norm import time_calls, write_gpu_report  # the sibling script's timing and JSON report
from kernel_paged_attention import decode_args  # one decode step's paged-attention arguments

from mini_infer.ops._triton_support import triton  # None without triton

EPS = 1e-6


def _rand(gen, *shape, scale=1.0, shift=0.0) -> torch.Tensor:
    return (torch.randn(*shape, device="cuda", generator=gen) * scale + shift).bfloat16()


def mlp_variants(c, layers: int) -> dict:
    """{variant: one chain over the layers' MLPs}: "full" and "no silu_and_mul"."""
    from mini_infer.ops.linear_add import linear_add_triton
    from mini_infer.ops.rms_norm_linear import rms_norm_linear_triton
    from mini_infer.ops.silu_and_mul import silu_and_mul_triton

    h, i = c.hidden_size, c.intermediate_size
    gen = torch.Generator(device="cuda").manual_seed(0)
    ws = [(_rand(gen, h, scale=0.1, shift=1.0), _rand(gen, 2 * i, h, scale=h**-0.5), _rand(gen, h, i, scale=i**-0.5))
          for _ in range(layers)]
    x0 = _rand(gen, 1, h)

    def block(x, nw, wgu, wd, silu: bool):
        gate_up = rms_norm_linear_triton(x, nw, EPS, wgu, None)
        act = silu_and_mul_triton(*gate_up.split(i, -1)) if silu else gate_up[..., :i]
        return linear_add_triton(act, wd, None, x)

    def chain(silu: bool):
        def run():
            x = x0
            for w in ws:
                x = block(x, *w, silu)
            return x
        return run

    return {"full": chain(True), "no silu_and_mul": chain(False)}


def attention_variants(c, layers: int, ctx: int) -> dict:
    """{variant: one chain over the layers' attention blocks}: "full", "no rotary", "no KV write", "neither"."""
    from mini_infer.ops.linear_add import linear_add_triton
    from mini_infer.ops.paged_attention import _triton_attention, write_kv_cache_triton
    from mini_infer.ops.qk_rotary import qk_rotary_triton
    from mini_infer.ops.rms_norm_linear import rms_norm_linear_triton

    h = c.hidden_size
    d = getattr(c, "head_dim", None) or h // c.num_attention_heads
    hq, hkv = c.num_attention_heads, c.num_key_value_heads
    n_qkv = (hq + 2 * hkv) * d
    gen = torch.Generator(device="cuda").manual_seed(1)
    ws = [(_rand(gen, h, scale=0.1, shift=1.0), _rand(gen, n_qkv, h, scale=h**-0.5), _rand(gen, n_qkv, scale=0.1),
           _rand(gen, h, hq * d, scale=(hq * d) ** -0.5), decode_args(1, ctx, hq, hkv, d, capacity=max(512, ctx)))
          for _ in range(layers)]
    cos, sin = _rand(gen, 1, 1, d), _rand(gen, 1, 1, d)
    x0 = _rand(gen, 1, h)

    def block(x, nw, wqkv, bqkv, wo, args, rotary: bool, write: bool):
        qkv = rms_norm_linear_triton(x, nw, EPS, wqkv, bqkv)
        q = qkv[:, : hq * d].view(1, 1, hq, d).transpose(1, 2)
        k = qkv[:, hq * d: (hq + hkv) * d].view(1, 1, hkv, d).transpose(1, 2)
        v = qkv[:, (hq + hkv) * d:].view(1, hkv, d)
        if rotary:
            q, k = qk_rotary_triton(q, k, cos, sin, None, None, EPS)
        q, k = q.transpose(1, 2).reshape(1, hq, d), k.transpose(1, 2).reshape(1, hkv, d)
        _, _, _, kc, vc, slots, bt, lens, qsl, scale, _, _ = args
        if write:
            write_kv_cache_triton(k, v, kc, vc, slots)
        o = _triton_attention(q, kc, vc, bt, lens, qsl, scale, 0, 0.0, None, None)
        return linear_add_triton(o.view(1, hq * d), wo, None, x)

    def chain(rotary: bool, write: bool):
        def run():
            x = x0
            for w in ws:
                x = block(x, *w, rotary, write)
            return x
        return run

    return {"full": chain(True, True), "no rotary": chain(False, True), "no KV write": chain(True, False),
            "neither": chain(False, False)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", default=None, help="dense preset(s) (qwen3-0.6b, qwen2.5-7b)")
    ap.add_argument("--ctx", type=int, default=256, help="keys each decode attention reads (256)")
    ap.add_argument("--out", default="bench/out")
    args = ap.parse_args()
    if not torch.cuda.is_available() or triton is None:
        print("bench/kernel_layer_chain.py times CUDA kernels: it needs a CUDA GPU and triton")
        return 1
    from mini_infer.models.presets import preset_config

    rows = []
    print(f"{torch.cuda.get_device_name()} | bf16, batch 1, a model's blocks chained in one CUDA graph | us per layer")
    for model in args.model or ["qwen3-0.6b", "qwen2.5-7b"]:
        c = preset_config(model)
        layers = c.num_hidden_layers
        for block, variants in (("mlp", mlp_variants(c, layers)), ("attention", attention_variants(c, layers, args.ctx))):
            us = {name: time_calls([fn], 20.0, 5)[0] * 1e3 / layers for name, fn in variants.items()}
            saved = {name: us["full"] - t for name, t in us.items() if name != "full"}
            rows.append({"model": model, "block": block, "layers": layers, "ctx": args.ctx, "us": us, "saved_us": saved})
            print(f"{model:<14}{block:<10} " + " | ".join(f"{name} {t:.2f}" for name, t in us.items())
                  + "  (saved: " + ", ".join(f"{name} {s:.2f}" for name, s in saved.items()) + ")", flush=True)
            del variants
            torch.cuda.empty_cache()
    out = write_gpu_report(args.out, "kernel_layer_chain.json", {"rows": rows})
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return 0
    names = sorted({n for r in rows for n in r["saved_us"]})
    fig, ax = plt.subplots(figsize=(8, 0.5 + 0.3 * len(rows) * len(names)))
    height = 0.8 / len(names)
    for j, name in enumerate(names):  # one bar per left-out kernel (set), grouped by model and block
        ax.barh([i + j * height for i in range(len(rows))], [r["saved_us"].get(name, 0.0) for r in rows],
                height=height, label=name)
    ax.set_yticks([i + 0.4 - height / 2 for i in range(len(rows))], [f"{r['model']} {r['block']}" for r in rows])
    ax.set_xlabel("us per layer saved by leaving the kernel(s) out")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "kernel_layer_chain.png", dpi=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
