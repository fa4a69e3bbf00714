"""Probe (issue #14): does a persistent, grid-stride GEMV shorten a batch-1 step's chain of small GEMVs?

The twenty-ninth session's probes put qwen3-0.6b's batch-1 GEMVs at about half the copy bandwidth with their bytes
not the limit (an L2 window or an L2 prefetch did not help): each of the 112 small GEMVs a step loses ~1.6 us to its
ramp and tail. The engine's GEMV (mini_infer/ops/linear.py) launches one program per 2-4 weight rows: 512-3,072
programs a GEMV at this model's shapes. This probe's kernel launches at most `ctas_per_sm` programs an SM, each
walking its row tiles grid-stride (tile pid, pid + P, ...) with the input row loaded once, whole rows in one load
(K <= 4,096), optionally its first tile loaded before the PDL wait. A chain of the step's GEMVs at a dense preset's
shapes (every layer's q/k/v, o_proj, gate/up, down; K <= 4,096) in one CUDA graph, the engine's `mini_infer::linear`
against the persistent kernel at several (rows a tile, programs an SM, preload) settings, us per chain; every
output checked against fp32 torch.

    python bench/probe_gemv_persistent.py [--model qwen3-0.6b]       # GPU
    TRITON_INTERPRET=1 python bench/probe_gemv_persistent.py --check  # CPU: the kernel's sums on small shapes
    python bench/probe_gemv_persistent.py --build                      # CPU: sm_90 registers / stack per setting
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mini_infer.ops._triton_support import await_producers, next_pow2, num_sms, pdl_args, tl, triton  # noqa: E402

MAX_K = 4096


@triton.jit
def _persistent_gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, stride_wn, BLOCK_N: tl.constexpr, KP: tl.constexpr,
                            PRELOAD: tl.constexpr, USE_GDC: tl.constexpr):
    """y = W x for one row x [K] and W [N, K] (row stride stride_wn): program p takes row tiles p, p + P, ... of
    BLOCK_N rows, each tile's whole rows (KP >= K, a power of two) in one load, fp32 sums; PRELOAD: its first
    tile loaded before the PDL wait (weights: no kernel of the step writes them)."""
    pid = tl.program_id(0)
    progs = tl.num_programs(0)
    kk = tl.arange(0, KP)
    k_ok = kk < K
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    if PRELOAD:
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_wn + kk[None, :],
                    mask=(rows < N)[:, None] & k_ok[None, :], other=0.0)
        await_producers(USE_GDC)
    else:
        await_producers(USE_GDC)
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_wn + kk[None, :],
                    mask=(rows < N)[:, None] & k_ok[None, :], other=0.0)
    x = tl.load(x_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, tl.sum(w.to(tl.float32) * x[None, :], axis=1).to(y_ptr.dtype.element_ty), mask=rows < N)
    for tile in range(pid + progs, tl.cdiv(N, BLOCK_N), progs):
        rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        w = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_wn + kk[None, :],
                    mask=(rows < N)[:, None] & k_ok[None, :], other=0.0)
        tl.store(y_ptr + rows, tl.sum(w.to(tl.float32) * x[None, :], axis=1).to(y_ptr.dtype.element_ty),
                 mask=rows < N)


def warps_for(block_n: int, kp: int) -> int:
    """4-16 warps, so that a thread holds at most 64 of a tile's BLOCK_N x KP weights (no spills: `--build`)."""
    return min(16, max(4, block_n * kp // (32 * 64)))


def persistent_gemv(x: torch.Tensor, w: torch.Tensor, block_n: int, ctas_per_sm: int, preload: bool) -> torch.Tensor:
    """One row x [K] times w [N, K]^T with the probe's kernel (K <= MAX_K)."""
    n, k = w.shape
    if k > MAX_K:
        raise ValueError(f"the probe's kernel loads whole rows of at most {MAX_K} elements, got {k}")
    y = torch.empty(n, dtype=x.dtype, device=x.device)
    sms = num_sms(x.device.index or 0) if x.is_cuda else 4
    grid = min(triton.cdiv(n, block_n), sms * ctas_per_sm)
    _persistent_gemv_kernel[(grid,)](x, w, y, n, k, w.stride(0), BLOCK_N=block_n, KP=next_pow2(k), PRELOAD=preload,
                                     num_warps=warps_for(block_n, next_pow2(k)), **pdl_args(x))
    return y


def build(model: str) -> int:
    """Each setting's sm_90 build at the model's K values (no GPU): registers, stack (spills), programs an SM."""
    from tests.ops.compile_sm90 import build_launch, build_stats, compile_blocker, record_launches

    blocker = compile_blocker()
    if blocker:
        print(f"no sm_90 build here: {blocker}")
        return 1
    module = sys.modules[__name__]
    spills = 0
    for k in sorted({k for _, k in step_shapes(model)}):
        for bn in (2, 4, 8):
            for pre in (False, True):
                x, w = torch.empty(k, dtype=torch.bfloat16), torch.empty(1024, k, dtype=torch.bfloat16)
                with record_launches(module, "_persistent_gemv_kernel") as calls:
                    persistent_gemv(x, w, bn, 2, pre)
                (args, kwargs), = calls["_persistent_gemv_kernel"]
                compiled, _ = build_launch(_persistent_gemv_kernel, args, kwargs)
                st = build_stats(compiled, kwargs["num_warps"])
                spills += st["stack"] > 0
                print(f"K {k:5d} rows {bn} preload {pre!s:5s} warps {kwargs['num_warps']:2d}: {st['regs']} registers, "
                      f"stack {st['stack']} B, {st['programs_per_sm']} programs an SM")
    return 1 if spills else 0


def step_shapes(model: str) -> list[tuple[int, int]]:
    """(N, K) of a dense preset's batch-1 GEMVs a step with K <= MAX_K, in order (lm_head left out)."""
    from kernel_gemv import preset_shapes

    shapes = [(n, k) for name, n, k, _ in preset_shapes(model) if name != "lm_head" and k <= MAX_K]
    layers = preset_shapes(model)[0][3]
    return shapes * layers


SETTINGS = [(bn, cps, pre) for bn in (2, 4, 8) for cps in (2, 4, 8) for pre in (False, True)]


def check() -> int:
    """The kernel against fp32 torch on small shapes (several tiles a program, a ragged last tile, K not a power
    of two), every setting."""
    device = "cuda" if torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET") else "cpu"
    torch.manual_seed(0)
    bad = 0
    for n, k in ((37, 48), (64, 100), (130, 64)):
        w = torch.randn(n, k, device=device) / k**0.5
        x = torch.randn(k, device=device)
        want = w @ x
        for bn, cps, pre in [(2, 1, False), (4, 2, True), (8, 1, True)]:
            got = persistent_gemv(x, w, bn, cps, pre)
            err = (got - want).abs().max().item()
            bad += err > 1e-4
            print(f"check n={n} k={k} rows {bn} programs/SM {cps} preload {pre}: max |err| {err:.2e}")
    print("CHECK", "FAILED" if bad else "PASSED")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--build", action="store_true", help="sm_90 builds only (CPU)")
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--out", default=None, help="directory for probe_gemv_persistent.json")
    args = ap.parse_args()
    if args.check:
        return check()
    if args.build:
        return build(args.model)
    from kernel_norm import time_calls, write_gpu_report

    from mini_infer.ops.linear import linear

    torch.manual_seed(0)
    shapes = step_shapes(args.model)
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for n, k in shapes]
    xs = {k: torch.randn(k, device="cuda", dtype=torch.bfloat16) for _, k in shapes}
    nbytes = sum(w.numel() * 2 for w in ws)
    refs = [(w.float() @ xs[w.shape[1]].float()) for w in ws[:8]]
    print(f"{torch.cuda.get_device_name()} | {args.model}: {len(ws)} GEMVs, {nbytes / 1e6:.0f} MB, one CUDA graph, "
          f"us per chain (median of 5)")
    rows = []

    def report(name, fn, outs):
        ms = time_calls([fn], 200.0, 5)[0]
        err = max((o.float() - r).abs().max().item() / r.abs().max().item() for o, r in zip(outs, refs))
        print(f"  {name:44s} {ms * 1e3:8.1f} us  {nbytes / ms / 1e9:5.2f} TB/s  max rel err {err:.1e}")
        rows.append({"variant": name, "us": ms * 1e3, "tb_per_s": nbytes / ms / 1e9, "max_rel_err": err})

    engine = lambda: [linear(xs[w.shape[1]].view(1, -1), w, None) for w in ws]  # noqa: E731
    report("engine GEMV (mini_infer::linear)", engine, [o.view(-1) for o in engine()[:8]])
    for bn, cps, pre in SETTINGS:
        fn = lambda bn=bn, cps=cps, pre=pre: [persistent_gemv(xs[w.shape[1]], w, bn, cps, pre) for w in ws]  # noqa: E731
        try:
            report(f"persistent: {bn} rows, {cps} programs/SM{', preload' if pre else ''}", fn, fn()[:8])
        except Exception as exc:  # noqa: BLE001 (a probe: report and go on)
            print(f"  persistent {bn}/{cps}/{pre} failed: {type(exc).__name__}: {str(exc).splitlines()[0]}")
    report("engine GEMV again", engine, [o.view(-1) for o in engine()[:8]])
    if args.out:
        write_gpu_report(args.out, "probe_gemv_persistent.json", {"model": args.model, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
