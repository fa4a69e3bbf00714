"""Probe (issue #14): does a kernel that waits for its producer by a counter, instead of the PDL grid wait, start
its work sooner?

A batch-1 decode step is a chain of ~5 dependent kernels a layer, each launched early by programmatic dependent
launch (PDL) and held at `griddepcontrol.wait` until the kernel before it has exited and its writes are flushed.
Every attempt to shorten the chain inside Triton kernels (docs/architecture.md, tried and dropped) left that wait
in place. Here a chain of the step's GEMVs (every layer's q/k/v, o_proj, gate/up, down at a dense preset's shapes;
each GEMV's input row is the one before it's output, so the dependency is real) runs in one CUDA graph with one
GEMV kernel (BLOCK_N whole weight rows a program, fp32 sums) synchronized four ways:

  * "stream": no PDL, each launch after the one before it has finished (the reference for the outputs);
  * "gdc": PDL, `griddepcontrol.launch_dependents` then `griddepcontrol.wait` (what the engine's kernels do);
  * "flag": PDL launch and trigger, no grid wait: every program spins (acquire) until the producer's counter reads
    the producer's program count; every program, after its stores, a CTA barrier and one release increment of its
    own counter. A memset at the graph's start zeroes the counters;
  * "flag+sleep": the same with a `nanosleep` between polls.

Each also with its weight tile loaded before the wait ("+preload"). The spin cannot hang: a kernel launches only
once every program of the one before it has started, so the producer it spins on is wholly resident. Outputs of
every variant are compared with "stream" (bit-equal: the same arithmetic); a stale read would show.

    python bench/probe_flag_sync.py [--model qwen3-0.6b] [--out DIR]   # GPU
    TRITON_INTERPRET=1 python bench/probe_flag_sync.py --check          # CPU: the kernel's sums, every mode
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from probe_gemv_persistent import warps_for  # noqa: E402  (the sibling probe's warps for a whole-row tile)

from mini_infer.ops._triton_support import next_pow2, tl, triton  # noqa: E402

MAX_K = 4096
MODES = {"stream": 0, "gdc": 1, "flag": 2, "flag+sleep": 3, "flag32": 4, "flag32+sleep": 5}
SUB = 32  # the sub-counters of the "flag32" modes


SUB_C = tl.constexpr(SUB)


@triton.jit
def _nap(v):
    """v, after a nanosleep (between polls)."""
    return tl.inline_asm_elementwise("nanosleep.u32 32;\nmov.b32 $0, $1;", "=r,r", [v], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _fence_acquire(v):
    """v, after a gpu-scope acq_rel fence (the relaxed polls' loads ordered before the reads after it)."""
    return tl.inline_asm_elementwise("fence.acq_rel.gpu;\nmov.b32 $0, $1;", "=r,r", [v], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _chain_gemv_kernel(x_ptr, w_ptr, y_ptr, cnt_in_ptr, cnt_out_ptr, need, N, K, stride_wn, BLOCK_N: tl.constexpr,
                       KP: tl.constexpr, MODE: tl.constexpr, PRELOAD: tl.constexpr, GDC: tl.constexpr):
    """y = W x for one row x [K] (the producer's output) and BLOCK_N rows of W [N, K] a program, whole rows (KP >= K,
    a power of two), fp32 sums. MODE 1: wait for the producer by griddepcontrol.wait; 2 / 3: by spinning on
    cnt_in_ptr until it reads `need` (3: a nanosleep between polls), then count this program at cnt_out_ptr.
    PRELOAD: the weight tile loaded before the wait (no kernel of the chain writes weights)."""
    pid = tl.program_id(0)
    kk = tl.arange(0, KP)
    k_ok = kk < K
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    w_ptrs = w_ptr + rows[:, None].to(tl.int64) * stride_wn + kk[None, :]
    w_mask = (rows < N)[:, None] & k_ok[None, :]
    if PRELOAD:
        w = tl.load(w_ptrs, mask=w_mask, other=0.0)
    if GDC:
        tl.extra.cuda.gdc_launch_dependents()
        if MODE == 1:
            tl.extra.cuda.gdc_wait()
    if MODE == 2 or MODE == 3:
        seen = tl.atomic_add(cnt_in_ptr, 0, sem="acquire")
        while seen < need:
            if MODE == 3:
                seen = _nap(seen)
            seen = tl.atomic_add(cnt_in_ptr, 0, sem="acquire")
    if MODE >= 4:
        subs = tl.arange(0, SUB_C)
        seen = tl.sum(tl.load(cnt_in_ptr + subs, volatile=True))
        while seen < need:
            if MODE == 5:
                seen = _nap(seen)
            seen = tl.sum(tl.load(cnt_in_ptr + subs, volatile=True))
        if GDC:  # (on a GPU; the interpreter runs no PTX and the programs one after another)
            seen = _fence_acquire(seen)
    if not PRELOAD:
        w = tl.load(w_ptrs, mask=w_mask, other=0.0)
    x = tl.load(x_ptr + kk, mask=k_ok, other=0.0, cache_modifier=".cg").to(tl.float32)
    tl.store(y_ptr + rows, tl.sum(w.to(tl.float32) * x[None, :], axis=1).to(y_ptr.dtype.element_ty), mask=rows < N)
    if MODE >= 2:
        tl.debug_barrier()  # every thread's stores issued before the release
        tl.atomic_add(cnt_out_ptr + (pid % SUB_C if MODE >= 4 else 0), 1, sem="release")


class Chain:
    """The chain's buffers: weights ws, outputs ys (GEMV i reads ys[i - 1][:K_i]; GEMV 0 reads x0), counters."""

    def __init__(self, shapes: list[tuple[int, int]], device: str, dtype: torch.dtype, seed: int = 0):
        g = torch.Generator(device="cpu").manual_seed(seed)
        self.ws = [(torch.randn(n, k, generator=g) / k**0.5).to(device=device, dtype=dtype) for n, k in shapes]
        self.x0 = torch.randn(shapes[0][1], generator=g).to(device=device, dtype=dtype)
        self.ys = [torch.empty(n, device=device, dtype=dtype) for n, _ in shapes]
        self.cnt = torch.zeros((len(shapes) + 1) * SUB, device=device, dtype=torch.int32)
        for i in range(1, len(shapes)):
            if shapes[i - 1][0] < shapes[i][1]:
                raise ValueError(f"GEMV {i} reads {shapes[i][1]} inputs; the one before it writes {shapes[i - 1][0]}")

    def run(self, mode: str, block_n: int, preload: bool) -> torch.Tensor:
        """One pass over the chain synchronized by `mode`; returns the last output."""
        m = MODES[mode]
        gdc = self.x0.is_cuda and m > 0 and not os.environ.get("TRITON_INTERPRET")
        if m >= 2:
            self.cnt.zero_()
        grids = []
        for i, w in enumerate(self.ws):
            n, k = w.shape
            x = self.x0 if i == 0 else self.ys[i - 1]
            grid = triton.cdiv(n, block_n)
            kp = next_pow2(k)
            # GEMV 0 waits on nothing (need 0); GEMV i on GEMV i - 1's programs
            need = 0 if i == 0 else grids[-1]
            launch = {"launch_pdl": True} if gdc and i > 0 else {}
            _chain_gemv_kernel[(grid,)](x, w, self.ys[i], self.cnt[i * SUB:], self.cnt[(i + 1) * SUB:], need, n, k,
                                        w.stride(0), BLOCK_N=block_n, KP=kp, MODE=m, PRELOAD=preload, GDC=gdc,
                                        num_warps=warps_for(block_n, kp), **launch)
            grids.append(grid)
        return self.ys[-1]


def step_shapes(model: str) -> list[tuple[int, int]]:
    """(N, K) of a dense preset's batch-1 layer GEMVs a step, in order (lm_head left out)."""
    from kernel_gemv import preset_shapes

    shapes = preset_shapes(model)
    if any(k > MAX_K for _, _, k, _ in shapes if _ != "lm_head"):
        raise SystemExit(f"{model}: a GEMV's K exceeds the probe's whole-row limit {MAX_K}")
    return [(n, k) for name, n, k, _ in shapes if name != "lm_head"] * shapes[0][3]


def check() -> int:
    """Every mode against fp32 torch on a small chain (K not a power of two, a ragged last tile)."""
    device = "cuda" if torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET") else "cpu"
    shapes = [(40, 24), (24, 40), (96, 24), (24, 48)] * 2
    chain = Chain(shapes, device, torch.float32)
    want = chain.x0
    for w in chain.ws:
        want = w @ want[: w.shape[1]]
    bad = 0
    for mode in MODES:
        for bn, pre in ((2, False), (4, True)):
            got = chain.run(mode, bn, pre).clone()
            err = (got - want).abs().max().item() / want.abs().max().item()
            bad += err > 1e-5
            print(f"check {mode:10s} rows {bn} preload {pre!s:5s}: max rel err {err:.1e}")
    print("CHECK", "FAILED" if bad else "PASSED")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--rows", default="4", help="comma list of weight rows a program")
    ap.add_argument("--out", default=None, help="directory for probe_flag_sync.json")
    args = ap.parse_args()
    if args.check:
        return check()
    from kernel_norm import time_calls, write_gpu_report

    shapes = step_shapes(args.model)
    chain = Chain(shapes, "cuda", torch.bfloat16)
    nbytes = sum(w.numel() * 2 for w in chain.ws)
    ref = chain.run("stream", 4, False).clone()
    print(f"{torch.cuda.get_device_name()} | {args.model}: {len(shapes)} chained GEMVs, {nbytes / 1e6:.0f} MB, one "
          f"CUDA graph, us per chain (median of 5); outputs against 'stream' at 4 rows")
    rows = []
    for bn in (int(r) for r in args.rows.split(",")):
        for mode in MODES:
            for pre in (False, True):
                name = f"{mode}{'+preload' if pre else ''}, {bn} rows"
                fn = lambda mode=mode, bn=bn, pre=pre: chain.run(mode, bn, pre)  # noqa: E731
                try:
                    ms = time_calls([fn], 200.0, 5)[0]
                except Exception as exc:  # noqa: BLE001 (a probe: report and go on)
                    print(f"  {name:32s} failed: {type(exc).__name__}: {str(exc).splitlines()[0]}")
                    continue
                out = fn()
                torch.cuda.synchronize()
                equal = bn != 4 or torch.equal(out, ref)
                print(f"  {name:32s} {ms * 1e3:8.1f} us  {nbytes / ms / 1e9:5.2f} TB/s  "
                      f"{ms * 1e3 / len(shapes):5.2f} us a GEMV  output {'equal' if equal else 'DIFFERS'}")
                rows.append({"variant": name, "mode": mode, "rows": bn, "preload": pre, "us": ms * 1e3,
                             "us_per_gemv": ms * 1e3 / len(shapes), "tb_per_s": nbytes / ms / 1e9, "equal": equal})
    if args.out:
        write_gpu_report(args.out, "probe_flag_sync.json", {"model": args.model, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
