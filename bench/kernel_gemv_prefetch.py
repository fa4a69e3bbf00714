"""Probe (issue #14): does prefetching a GEMV's weights into L2 before its PDL wait shorten a decode layer chain?

Captures in one CUDA graph a chain shaped like the engine's batch-1 decode layers, with the engine's own kernels:
per layer the norm + qkv GEMV (`rms_norm_linear`), a stand-in for attention (a PDL kernel of a few programs
spinning --standin-us microseconds on the qkv row, DRAM idle, as paged attention and rotary leave it), o_proj +
residual (`linear_add`), the norm + gate_up GEMV, `silu_and_mul`, down + residual (`linear_add`; qwen2.5-7b's
18944-long rows go to cuBLAS, as in the engine). Every layer has its own random weights and the chain reads far
more than the L2 holds, so each GEMV starts cold. The chain is timed with the prefetch off and with
MINI_INFER_GEMV_PREFETCH caps of 4 / 16 / 32 MiB (one prefetch per 128-byte line) and 16 MiB bulk
(`cp.async.bulk.prefetch`), each captured afresh (the ops read the setting at launch); the outputs must be equal
bit for bit (a prefetch is only a cache hint).

    python bench/kernel_gemv_prefetch.py                          # qwen3-0.6b and qwen2.5-7b shapes, ~1 minute
    python bench/kernel_gemv_prefetch.py --check                  # CPU, TRITON_INTERPRET=1: the chain's wiring only
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from kernel_gemv import preset_shapes  # the sibling script's merged weight shapes of a preset
from kernel_norm import time_calls  # the sibling script's CUDA-graph timing

from mini_infer.ops._l2_prefetch import prefetch_cap
from mini_infer.ops._triton_support import await_producers, pdl_args, tl, triton
from mini_infer.ops.linear_add import linear_add_reference, linear_add_triton
from mini_infer.ops.rms_norm_linear import rms_norm_linear_reference, rms_norm_linear_triton
from mini_infer.ops.silu_and_mul import silu_and_mul_reference, silu_and_mul_triton

EPS = 1e-6
MIB = 1 << 20
# (label, MINI_INFER_GEMV_PREFETCH, MINI_INFER_GEMV_PREFETCH_MODE)
SETTINGS = [("off", "0", "line"), ("4 MiB", str(4 * MIB), "line"), ("16 MiB", str(16 * MIB), "line"),
            ("32 MiB", str(32 * MIB), "line"), ("16 MiB bulk", str(16 * MIB), "bulk")]
LAYERS = {"qwen3-0.6b": 28, "qwen2.5-7b": 8}  # 0.85 GB and 3.7 GB of weights: far past a 50 MB L2
STANDIN_BLOCK = 128
STANDIN_A, STANDIN_B = tl.constexpr(0.999), tl.constexpr(0.001)


@triton.jit
def _standin_kernel(x_ptr, y_ptr, n, iters, BLOCK: tl.constexpr, USE_GDC: tl.constexpr):
    """y[:n] = x[:n] after `iters` dependent fp32 multiply-adds each: attention's place in the chain, a PDL kernel
    of n / BLOCK programs that keeps the SMs busy and DRAM idle."""
    await_producers(USE_GDC)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    for _ in range(iters):
        v = v * STANDIN_A + STANDIN_B
    tl.store(y_ptr + offs, v.to(y_ptr.dtype.element_ty), mask=offs < n)


def standin(qkv: torch.Tensor, q: int, iters: int) -> torch.Tensor:
    y = torch.empty(q, dtype=qkv.dtype, device=qkv.device)
    _standin_kernel[(triton.cdiv(q, STANDIN_BLOCK),)](qkv.view(-1), y, q, iters, BLOCK=STANDIN_BLOCK,
                                                       **pdl_args(qkv))
    return y.view(1, q)


def standin_reference(qkv: torch.Tensor, q: int, iters: int) -> torch.Tensor:
    v = qkv.view(-1)[:q].float()
    for _ in range(iters):
        v = v * STANDIN_A.value + STANDIN_B.value
    return v.to(qkv.dtype).view(1, q)


def make_layers(shapes: dict[str, tuple[int, int]], layers: int, device: str) -> list[dict]:
    """Per layer: the norm weights and the merged qkv, o_proj, merged gate_up and down weights (random, bf16)."""
    dt = torch.bfloat16

    def weight(name):
        n, k = shapes[name]
        return torch.randn(n, k, device=device, dtype=dt) / k**0.5

    h = shapes["o_proj"][0]
    return [{"nw1": 1 + 0.1 * torch.randn(h, device=device, dtype=dt),
             "nw2": 1 + 0.1 * torch.randn(h, device=device, dtype=dt), "qkv": weight("qkv (merged)"),
             "o": weight("o_proj"), "gate_up": weight("gate_up (merged)"), "down": weight("down_proj")}
            for _ in range(layers)]


def chain(x: torch.Tensor, layers: list[dict], iters: int, reference: bool = False) -> torch.Tensor:
    """The decode layers over hidden row x [1, h] with the engine's kernels (or their references)."""
    rms_linear = rms_norm_linear_reference if reference else rms_norm_linear_triton
    linear_add = linear_add_reference if reference else linear_add_triton
    silu_mul = silu_and_mul_reference if reference else silu_and_mul_triton
    attend = standin_reference if reference else standin
    for w in layers:
        q = w["o"].shape[1]
        qkv = rms_linear(x, w["nw1"], EPS, w["qkv"], None)
        x = linear_add(attend(qkv, q, iters), w["o"], None, x)
        gu = rms_linear(x, w["nw2"], EPS, w["gate_up"], None)
        inter = gu.shape[-1] // 2
        x = linear_add(silu_mul(gu[..., :inter], gu[..., inter:]), w["down"], None, x)
    return x


def use_setting(cap: str, mode: str) -> None:
    os.environ["MINI_INFER_GEMV_PREFETCH"] = cap
    os.environ["MINI_INFER_GEMV_PREFETCH_MODE"] = mode
    prefetch_cap.cache_clear()


def calibrate_standin(q: int, target_us: float) -> int:
    """Multiply-add iterations for a stand-in of about target_us (20 of them chained in a CUDA graph, so the
    replay's launch cost is spread thin)."""
    qkv = torch.randn(1, q, device="cuda", dtype=torch.bfloat16)
    probe = 2000
    us = time_calls([lambda: standin(qkv, q, probe)] * 20, 50.0, 3)[0] * 1e3
    return max(1, round(probe * target_us / us))


def check() -> int:
    """The chain's wiring on tiny shapes (CPU under the interpreter, or a GPU): equal outputs for every setting,
    close to the plain-torch references' chain."""
    device = "cuda" if torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET") else "cpu"
    torch.manual_seed(0)
    shapes = {"qkv (merged)": (128, 64), "o_proj": (64, 64), "gate_up (merged)": (256, 64), "down_proj": (64, 128)}
    layers = make_layers(shapes, 2, device)
    x = torch.randn(1, 64, device=device, dtype=torch.bfloat16)
    want = chain(x, layers, 7, reference=True).float()
    outs = []
    for label, cap, mode in SETTINGS:
        use_setting(cap, mode)
        outs.append(chain(x, layers, 7))
        print(f"check {label}: max |chain - reference| {(outs[-1].float() - want).abs().max().item():.3e}")
    ok = all(torch.equal(o, outs[0]) for o in outs) and torch.allclose(outs[0].float(), want, atol=5e-2, rtol=5e-2)
    print("CHECK", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--model", action="append", default=None, help="preset(s) (qwen3-0.6b, qwen2.5-7b)")
    ap.add_argument("--standin-us", type=float, default=5.0, help="the attention stand-in's time per layer")
    args = ap.parse_args()
    if args.check:
        return check()
    if not torch.cuda.is_available() or triton is None:
        print("bench/kernel_gemv_prefetch.py times CUDA graphs: it needs a CUDA GPU (try --check on CPU)")
        return 1
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()} | bf16 batch-1 decode layer chains in one CUDA graph, PDL "
          f"{'on' if pdl_args(torch.empty(1, device='cuda'))['USE_GDC'] else 'OFF'} | us per chain (median)")
    for model in args.model or list(LAYERS):
        shapes = {name: (n, k) for name, n, k, _ in preset_shapes(model)}
        n_layers = LAYERS.get(model, 8)
        layers = make_layers(shapes, n_layers, "cuda")
        q = shapes["o_proj"][1]
        iters = calibrate_standin(q, args.standin_us)
        nbytes = sum(w.numel() * w.element_size() for lw in layers for k, w in lw.items() if not k.startswith("nw"))
        x = torch.randn(1, shapes["o_proj"][0], device="cuda", dtype=torch.bfloat16)
        print(f"{model}: {n_layers} layers x 6 kernels, {nbytes / 1e9:.2f} GB of weights, attention stand-in "
              f"{iters} iterations (~{args.standin_us:g} us)")
        first = None
        for label, cap, mode in SETTINGS:
            use_setting(cap, mode)
            out = chain(x, layers, iters)
            ms = time_calls([lambda x=x, layers=layers, iters=iters: chain(x, layers, iters)], 200.0, 5)[0]
            first = first or (ms, out)
            print(f"  {label:<12} {ms * 1e3:9.1f} us  {ms * 1e3 / n_layers:7.2f} us/layer  "
                  f"{nbytes / ms / 1e9:6.2f} TB/s  {100 * (ms / first[0] - 1):+6.1f}% vs off  "
                  f"output equal to off: {torch.equal(out, first[1])}")
        del layers
        torch.cuda.empty_cache()
    use_setting("0", "line")
    return 0


if __name__ == "__main__":
    sys.exit(main())
