"""Probe (issue #14): prefetch a layer's MLP weights into L2 while its attention runs, from a side stream.

At batch 1 a small model's decode attention is a chain of dependent loads (~7 us a layer on qwen3-0.6b) that
leaves DRAM idle, and the GEMVs after it (o_proj, gate/up, down) run at about half the copy bandwidth. The
twenty-fourth session's prefetch (each GEMV prefetching its own weights before its PDL wait, while the kernel
before it read its own: docs/architecture.md, tried and dropped) competed with that kernel's reads. Here the
prefetch runs only in the attention's window: right after the q/k/v GEMV the chain forks to a side stream that
issues L2 prefetches (`cp.async.bulk.prefetch.L2`, or one `prefetch.global.L2::evict_last` per line) over the
weights the layer reads next, and the side stream joins the chain at its end, so nothing waits on it.

The chain is the engine's kernels per layer (norm + qkv `rms_norm_linear`, an attention stand-in: a PDL kernel of
16 programs spinning --standin-us on the qkv row, o_proj + residual `linear_add`, norm + gate/up + SiLU
`rms_norm_linear_silu`, down + residual `linear_add`), 28 qwen3-0.6b layers with their own random weights, one
CUDA graph. Prints us per chain for each variant; outputs must equal the no-prefetch chain's bit for bit.

    python bench/probe_l2_prefetch_attention.py [--model qwen3-0.6b] [--standin-us 6]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernel_gemv import preset_shapes  # noqa: E402 (the sibling script's merged weight shapes of a preset)
from kernel_norm import time_calls  # noqa: E402 (the sibling script's CUDA-graph timing)

from mini_infer.ops._triton_support import await_producers, pdl_args, tl, triton  # noqa: E402
from mini_infer.ops.linear_add import linear_add_triton  # noqa: E402
from mini_infer.ops.rms_norm_linear import rms_norm_linear_triton  # noqa: E402
from mini_infer.ops.rms_norm_linear_silu import rms_norm_linear_silu_triton  # noqa: E402

EPS = 1e-6
LINE = tl.constexpr(128)
STANDIN_BLOCK = 128
STANDIN_A, STANDIN_B = tl.constexpr(0.999), tl.constexpr(0.001)


@triton.jit
def _standin_kernel(x_ptr, y_ptr, n, iters, BLOCK: tl.constexpr, USE_GDC: tl.constexpr):
    """y[:n] = x[:n] after `iters` dependent fp32 multiply-adds: attention's place, few programs, DRAM idle."""
    await_producers(USE_GDC)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
    for _ in range(iters):
        v = v * STANDIN_A + STANDIN_B
    tl.store(y_ptr + offs, v.to(y_ptr.dtype.element_ty), mask=offs < n)


@triton.jit
def _prefetch_kernel(base, nbytes, BULK: tl.constexpr, LANES: tl.constexpr):
    """Program p of P prefetches its share of [base, base + nbytes) into L2: BULK one `cp.async.bulk.prefetch`
    per lane over a 16-byte-multiple piece, else one line prefetch per lane and step."""
    pid = tl.program_id(0)
    progs = tl.num_programs(0)
    share = tl.cdiv(tl.cdiv(nbytes, progs), LINE) * LINE
    start = pid.to(tl.int64) * share
    end = tl.minimum(start + share, nbytes)
    lane = tl.arange(0, LANES).to(tl.int64)
    ptr = base.to(tl.pointer_type(tl.int8), bitcast=True)
    if BULK:
        piece = tl.cdiv(tl.cdiv(share, LANES), 16) * 16
        lo = start + lane * piece
        size = tl.maximum((tl.minimum(lo + piece, end) - lo) // 16 * 16, 0).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [ptr + lo, size], dtype=tl.int32, is_pure=False, pack=1)
    else:
        for off in range(start, end, LINE * LANES):
            line = off + lane * LINE
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0; }",
                "=r,l,r", [ptr + line, (line < end).to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


def prefetch(w: torch.Tensor, programs: int, bulk: bool) -> None:
    _prefetch_kernel[(programs,)](w, w.numel() * w.element_size(), BULK=bulk, LANES=128, num_warps=4)


def standin(qkv: torch.Tensor, q: int, iters: int) -> torch.Tensor:
    y = torch.empty(q, dtype=qkv.dtype, device=qkv.device)
    _standin_kernel[(triton.cdiv(q, STANDIN_BLOCK),)](qkv.view(-1), y, q, iters, BLOCK=STANDIN_BLOCK,
                                                       **pdl_args(qkv))
    return y.view(1, q)


def make_layers(shapes: dict[str, tuple[int, int]], layers: int) -> list[dict]:
    dt = torch.bfloat16

    def weight(name):
        n, k = shapes[name]
        return torch.randn(n, k, device="cuda", dtype=dt) / k**0.5

    h = shapes["o_proj"][0]
    return [{"nw1": 1 + 0.1 * torch.randn(h, device="cuda", dtype=dt),
             "nw2": 1 + 0.1 * torch.randn(h, device="cuda", dtype=dt), "qkv": weight("qkv (merged)"),
             "o": weight("o_proj"), "gate_up": weight("gate_up (merged)"), "down": weight("down_proj")}
            for _ in range(layers)]


def chain(x, layers, iters, side: torch.cuda.Stream | None, targets: tuple[str, ...], programs: int,
          bulk: bool) -> torch.Tensor:
    """The decode layers over hidden row x [1, h]; with `side`, each layer forks after its qkv GEMV and the side
    stream prefetches `targets` ("o", "gate_up", "down", "next_qkv"), joined at the end."""
    for i, w in enumerate(layers):
        q = w["o"].shape[1]
        qkv = rms_norm_linear_triton(x, w["nw1"], EPS, w["qkv"], None)
        if side is not None:
            fork = torch.cuda.Event()
            fork.record()
            side.wait_event(fork)
            with torch.cuda.stream(side):
                for t in targets:
                    if t == "next_qkv":
                        if i + 1 < len(layers):
                            prefetch(layers[i + 1]["qkv"], programs, bulk)
                    else:
                        prefetch(w[t], programs, bulk)
        x = linear_add_triton(standin(qkv, q, iters), w["o"], None, x)
        h = rms_norm_linear_silu_triton(x, w["nw2"], EPS, w["gate_up"], None)
        x = linear_add_triton(h, w["down"], None, x)
    if side is not None:
        torch.cuda.current_stream().wait_stream(side)
    return x


def calibrate_standin(q: int, target_us: float) -> int:
    qkv = torch.randn(1, q, device="cuda", dtype=torch.bfloat16)
    probe = 2000
    us = time_calls([lambda: standin(qkv, q, probe)] * 20, 50.0, 3)[0] * 1e3
    return max(1, round(probe * target_us / us))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--standin-us", type=float, action="append", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    shapes = {name: (n, k) for name, n, k, _ in preset_shapes(args.model)}
    layers = make_layers(shapes, args.layers)
    x = torch.randn(1, shapes["o_proj"][0], device="cuda", dtype=torch.bfloat16)
    nbytes = sum(w.numel() * 2 for lw in layers for k, w in lw.items() if not k.startswith("nw"))
    side = torch.cuda.Stream()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    variants = [("off", None, (), 0, True),
                ("gate_up+down, bulk, 32 programs", side, ("gate_up", "down"), 32, True),
                ("gate_up+down, bulk, SMs programs", side, ("gate_up", "down"), sms, True),
                ("gate_up+down, lines, SMs programs", side, ("gate_up", "down"), sms, False),
                ("gate_up+down+next qkv, bulk, SMs", side, ("gate_up", "down", "next_qkv"), sms, True),
                ("o+gate_up+down, bulk, SMs", side, ("o", "gate_up", "down"), sms, True),
                ("gate_up only, bulk, SMs", side, ("gate_up",), sms, True),
                ("off again", None, (), 0, True)]
    rows = []
    print(f"{torch.cuda.get_device_name()} | {args.model}: {args.layers} decode layers, {nbytes / 1e6:.0f} MB of "
          f"weights, one CUDA graph, us per chain (median of 5)")
    for standin_us in args.standin_us or [6.0]:
        iters = calibrate_standin(shapes["o_proj"][1], standin_us)
        ref = None
        for name, s, targets, programs, bulk in variants:
            fn = lambda s=s, t=targets, p=programs, b=bulk, n=iters: chain(x, layers, n, s, t, p, b)  # noqa: E731
            try:
                out = fn()
                ms = time_calls([fn], 200.0, 5)[0]
            except Exception as exc:  # noqa: BLE001 (a probe: report and go on)
                print(f"  stand-in {standin_us:g} us | {name:38s} failed: {type(exc).__name__}: {exc}")
                rows.append({"standin_us": standin_us, "variant": name, "error": str(exc)})
                continue
            same = None if ref is None else bool(torch.equal(out, ref))
            ref = out if ref is None else ref
            print(f"  stand-in {standin_us:g} us | {name:38s} {ms * 1e3:8.1f} us  {ms * 1e3 / args.layers:6.2f} "
                  f"us/layer  {nbytes / ms / 1e9:5.2f} TB/s  equal: {same}")
            rows.append({"standin_us": standin_us, "variant": name, "us": ms * 1e3, "equal": same})
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "model": args.model, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
