"""A model's MLPs at batch-1 decode, chained in one CUDA graph: gate_up (the norm in its prologue) then silu_and_mul
then down (+ residual), two launches before down, against `rms_norm_linear_silu` (the activation in the gate_up
GEMV's epilogue, one launch), swept over the fused kernel's tiles.

Per preset (bf16, one row, the model's own layer count of distinct weights, so every layer's weights come from
HBM as in a real step): the unfused chain as the engine runs it without `fuse_gate_up_silu`
(`rms_norm_linear_triton` + `silu_and_mul_triton` + `linear_add_triton` per layer), and the fused chain
(`rms_norm_linear_silu_triton` + `linear_add_triton`) at its default tile (`gate_up_silu_config`) and at every tile
of CONFIGS (BLOCK_N rows per half, BLOCK_K, warps, stages; the best one reported). Each chain is one CUDA-graph
replay (bench/kernel_norm.py's `time_calls`; programmatic dependent launch as the engine runs it); the table gives
us per layer and the fused chain's saving. Every tile's first-layer activation is first compared with the unfused
pair's. Prints a table and writes kernel_gate_up_silu.json to --out. About 1-2 minutes for the two default
presets on an H200, most of it compiling the 36 tiles (bench/results/kernel_gate_up_silu_s12_h200.json). The one
kernel is timed at every width, also above GATE_UP_SILU_MAX_I, where the op itself runs the unfused kernels.

    python bench/kernel_gate_up_silu.py                                   # qwen3-0.6b and qwen2.5-7b
    python bench/kernel_gate_up_silu.py --model llama-3.1-8b --layers 8   # fewer layers: less memory, faster
"""

from __future__ import annotations

import argparse
import sys

import torch
from kernel_norm import time_calls, write_gpu_report  # the sibling script's timing and JSON report

from mini_infer.ops import rms_norm_linear_silu as gate_up_silu_op
from mini_infer.ops._triton_support import triton  # None without triton
from mini_infer.ops.linear_add import linear_add_triton
from mini_infer.ops.rms_norm_linear import rms_norm_linear_triton
from mini_infer.ops.rms_norm_linear_silu import gate_up_silu_config, rms_norm_linear_silu_triton
from mini_infer.ops.silu_and_mul import silu_and_mul_triton

# (BLOCK_N rows per half, K per step, warps, pipeline stages)
CONFIGS = [(bn, bk, w, st) for bn in (1, 2, 4) for bk in (256, 512, 1024) for w in (4, 8) for st in (1, 3)]
EPS = 1e-6


def mlp_shape(model: str) -> tuple[int, int, int]:
    """(hidden_size, intermediate_size, num_hidden_layers) of `model`'s dense MLP."""
    from mini_infer.models.presets import preset_config

    c = preset_config(model)
    return c.hidden_size, c.intermediate_size, c.num_hidden_layers


def layer_weights(h: int, i: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer's post-attention norm weight [h], merged gate_up [2i, h] and down [h, i], bf16 on the GPU."""
    def rand(*shape, scale):
        return (torch.randn(shape, generator=gen, device="cuda") * scale).to(torch.bfloat16)

    return rand(h, scale=0.1) + 1, rand(2 * i, h, scale=h**-0.5), rand(h, i, scale=i**-0.5)


def unfused_act(x, nw, w_gu):
    gate_up = rms_norm_linear_triton(x, nw, EPS, w_gu, None)
    return silu_and_mul_triton(*gate_up.split(w_gu.shape[0] // 2, -1))


def chain(x, layers, act_fn):
    """Every layer's MLP in turn: x = down(act_fn(x, nw, gate_up)) + x."""
    for nw, w_gu, w_d in layers:
        x = linear_add_triton(act_fn(x, nw, w_gu), w_d, None, x)
    return x


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", default=None, help="preset(s) to time (qwen3-0.6b, qwen2.5-7b)")
    ap.add_argument("--layers", type=int, default=0, help="layers to chain (0: the model's own count)")
    ap.add_argument("--out", default="bench/out")
    args = ap.parse_args()
    if not torch.cuda.is_available() or triton is None:
        print("bench/kernel_gate_up_silu.py times CUDA kernels: it needs a CUDA GPU and triton (correctness: "
              "tests/ops/test_rms_norm_linear_silu.py)")
        return 1
    gate_up_silu_op.GATE_UP_SILU_MAX_I = 1 << 30  # time the one kernel at every width (module docstring)
    rows = []
    print(f"{torch.cuda.get_device_name()} | bf16, one row, chained MLPs in one CUDA graph | us per layer")
    print(f"{'model':<14}{'H':>6}{'I':>7}{'L':>4} | {'unfused':>8} | {'fused':>7} {'default tile':>17} | "
          f"{'best':>7} {'best tile':>17} | {'saved':>6}")
    for model in args.model or ["qwen3-0.6b", "qwen2.5-7b"]:
        h, i, n_layers = mlp_shape(model)
        n_layers = args.layers or n_layers
        gen = torch.Generator(device="cuda").manual_seed(0)
        layers = [layer_weights(h, i, gen) for _ in range(n_layers)]
        x = (torch.randn(1, h, generator=gen, device="cuda") * 2).to(torch.bfloat16)
        ref = unfused_act(x, *layers[0][:2])

        def per_layer_us(act_fn, layers=layers, x=x, n_layers=n_layers):
            return time_calls([lambda: chain(x, layers, act_fn)], 20.0, 3)[0] * 1e3 / n_layers

        t_unfused = per_layer_us(unfused_act)
        default = gate_up_silu_config(h, 2 * i, True)
        times = {}
        for cfg in dict.fromkeys([default, *CONFIGS]):
            def fused_act(x, nw, w_gu, cfg=cfg):
                return rms_norm_linear_silu_triton(x, nw, EPS, w_gu, None, config=cfg)

            got = fused_act(x, *layers[0][:2])
            if not torch.allclose(got.float(), ref.float(), atol=2e-2, rtol=2e-2):
                print(f"  {model} cfg {cfg}: MISMATCH (max err {(got.float() - ref.float()).abs().max().item():.3e})")
                continue
            times[cfg] = per_layer_us(fused_act)
        best = min(times, key=times.get)
        rows.append({"model": model, "H": h, "I": i, "layers": n_layers, "unfused_us": t_unfused,
                     "default_cfg": default, "default_us": times.get(default), "best_cfg": best,
                     "best_us": times[best], "all_us": {str(c): t for c, t in times.items()}})
        print(f"{model:<14}{h:>6}{i:>7}{n_layers:>4} | {t_unfused:>8.2f} | {times.get(default, float('nan')):>7.2f} "
              f"{str(default):>17} | {times[best]:>7.2f} {str(best):>17} | {t_unfused - times[best]:>6.2f}")
        del layers
        torch.cuda.empty_cache()
    write_gpu_report(args.out, "kernel_gate_up_silu.json", {"rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
