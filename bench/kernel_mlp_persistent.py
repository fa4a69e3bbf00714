"""A decoder's MLP blocks at batch-1 decode: the three kernels the default CUDA pipeline runs (rms_norm_linear's
gate_up GEMV with the norm prologue, silu_and_mul, linear_add's down GEMV + residual add) against `mlp_persistent`
(ops/mlp_persistent.py: one persistent launch, a grid barrier between the phases), swept over tiles.

Per preset (bf16, one row): the MLPs of all its layers (distinct weights: cold in L2, as in a real step) chained,
each block's output the next one's input and residual, captured in ONE CUDA graph (programmatic dependent launch as
the engine launches them; bench/kernel_norm.py's `time_calls`); us per MLP block. First the persistent chain's output
is compared with the unfused one's (bf16 roundings differ on a GPU: max relative error printed), and the barrier's
timeout counter must stay 0 (a grid not all resident would show there, not hang). Where the down row is longer than
the GEMV takes (qwen2.5-7b: I = 18944 > GEMV_MAX_K) the op itself runs the unfused kernels (down on cuBLAS); the
kernel is timed anyway through `launch_mlp_persistent`, to say whether taking those rows would pay. Also one
cooperative launch (Triton's `launch_cooperative_grid`) at the default tile, if it captures. Writes
kernel_mlp_persistent.json to --out. About a minute on an H200 (not run yet).

    python bench/kernel_mlp_persistent.py                                  # qwen3-0.6b and qwen2.5-7b
    python bench/kernel_mlp_persistent.py --model qwen3-0.6b --layers 28
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from kernel_norm import git_info, time_calls  # the sibling script's timing and git state

from mini_infer.ops._triton_support import triton  # None without triton
from mini_infer.ops.linear_add import linear_add_triton
from mini_infer.ops.mlp_persistent import (
    MlpTile,
    barrier_timeouts,
    launch_mlp_persistent,
    mlp_takes_persistent,
)
from mini_infer.ops.rms_norm_linear import rms_norm_linear_triton
from mini_infer.ops.silu_and_mul import silu_and_mul_triton

EPS = 1e-6
# (gate rows, down rows, warps, stages, programs per SM): the default first
TILES = list(dict.fromkeys([MlpTile(), *(MlpTile(g, d, 4, 1, p) for g in (2, 4, 8) for d in (1, 2, 4)
                                          for p in (1, 2, 4))]))


def mlp_shape(model: str) -> tuple[int, int, int]:
    """(hidden_size, intermediate_size, layers) of a dense preset."""
    from mini_infer.models.presets import preset_config

    c = preset_config(model)
    return c.hidden_size, c.intermediate_size, c.num_hidden_layers


def layer_weights(h: int, i: int, layers: int, seed: int = 0) -> list[tuple]:
    """Per layer (norm weight [h], gate_up [2i, h], down [h, i]), bf16 on the GPU."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for _ in range(layers):
        nw = (1 + 0.1 * torch.randn(h, device="cuda", generator=gen)).bfloat16()
        wgu = (torch.randn(2 * i, h, device="cuda", generator=gen) * h**-0.5).bfloat16()
        wd = (torch.randn(h, i, device="cuda", generator=gen) * i**-0.5).bfloat16()
        out.append((nw, wgu, wd))
    return out


def unfused(x: torch.Tensor, nw, wgu, wd) -> torch.Tensor:
    """The default pipeline's three kernels for one block (x is the residual sum: the norm's input and the add's)."""
    gate, up = rms_norm_linear_triton(x, nw, EPS, wgu, None).split(wd.shape[1], -1)
    return linear_add_triton(silu_and_mul_triton(gate, up), wd, None, x)


def persistent(tile: MlpTile):
    return lambda x, nw, wgu, wd: launch_mlp_persistent(x, nw, EPS, wgu, None, wd, None, x, tile)


def chain(block, weights, x0: torch.Tensor) -> torch.Tensor:
    x = x0
    for nw, wgu, wd in weights:
        x = block(x, nw, wgu, wd)
    return x


def time_chain(block, weights, x0: torch.Tensor) -> float:
    """us per MLP block: the chain of all layers as one call, replayed in a CUDA graph."""
    return time_calls([lambda: chain(block, weights, x0)], 20.0, 5)[0] * 1e3 / len(weights)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", default=None, help="dense preset(s) (qwen3-0.6b, qwen2.5-7b)")
    ap.add_argument("--layers", type=int, default=None, help="MLP blocks chained (default: the model's layers)")
    ap.add_argument("--out", default="bench/out")
    args = ap.parse_args()
    if not torch.cuda.is_available() or triton is None:
        print("bench/kernel_mlp_persistent.py times CUDA kernels: it needs a CUDA GPU and triton (correctness: "
              "tests/ops/test_mlp_persistent.py)")
        return 1
    dev = torch.device("cuda")
    rows = []
    print(f"{torch.cuda.get_device_name()} | bf16, one row, all layers' MLPs chained in one CUDA graph | us per MLP")
    for model in args.model or ["qwen3-0.6b", "qwen2.5-7b"]:
        h, i, layers = mlp_shape(model)
        weights = layer_weights(h, i, args.layers or layers)
        x0 = torch.randn(1, h, device="cuda").bfloat16()
        op_takes = mlp_takes_persistent(x0, weights[0][0], weights[0][1], weights[0][2], x0)
        ref = chain(unfused, weights, x0).float()
        t_unfused = time_chain(unfused, weights, x0)
        print(f"{model}: H {h}, I {i}, {len(weights)} layers; the op takes it: {op_takes}; unfused (3 kernels) "
              f"{t_unfused:.2f} us")
        times, errors = {}, {}
        for tile in [*TILES, MlpTile(cooperative=True)]:
            before = barrier_timeouts(dev)
            try:
                persistent(tile)(x0, *weights[0])  # one launch first: a grid not all resident costs one timeout
                torch.cuda.synchronize()
                if barrier_timeouts(dev) != before:
                    print(f"  {tuple(tile)}: barrier timed out (grid not all resident): skipped")
                    continue
                got = chain(persistent(tile), weights, x0).float()
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - a launch the driver refuses (cooperative): reported
                print(f"  {tuple(tile)}: did not run: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            if barrier_timeouts(dev) != before:
                print(f"  {tuple(tile)}: barrier timed out (grid not all resident): skipped")
                continue
            err = ((got - ref).abs().max() / ref.abs().max()).item()
            try:
                times[tile] = time_chain(persistent(tile), weights, x0)
            except Exception as exc:  # noqa: BLE001 - e.g. a cooperative launch that does not capture
                print(f"  {tuple(tile)}: not timed: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            errors[tile] = err
            if barrier_timeouts(dev) != before:
                print(f"  {tuple(tile)}: barrier timed out while timing: dropped")
                del times[tile]
            else:
                print(f"  {tuple(tile)}: {times[tile]:.2f} us", flush=True)
        best = min(times, key=times.get)
        for tile in sorted(times, key=times.get)[:8]:
            print(f"  {str(tuple(tile)):<40}{times[tile]:>8.2f} us  ({t_unfused / times[tile]:.2f}x)  "
                  f"max rel err {errors[tile]:.2e}")
        default = MlpTile()
        print(f"  default {tuple(default)}: {times.get(default, float('nan')):.2f} us; best {tuple(best)}: "
              f"{times[best]:.2f} us vs unfused {t_unfused:.2f} us")
        rows.append({"model": model, "H": h, "I": i, "layers": len(weights), "op_takes": op_takes,
                     "unfused_us": t_unfused, "best_tile": tuple(best), "best_us": times[best],
                     "default_us": times.get(default), "all_us": {str(tuple(t)): v for t, v in times.items()},
                     "max_rel_err": {str(tuple(t)): v for t, v in errors.items()}})
        del weights
        torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            **git_info(), "date": time.strftime("%Y-%m-%d")}
    (out / "kernel_mlp_persistent.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
