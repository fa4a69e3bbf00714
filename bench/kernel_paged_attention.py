"""Timing of paged_attention (not a test): Triton on CUDA vs torch SDPA on contiguous K/V, and the CPU reference.

    python bench/kernel_paged_attention.py [--cpu-only | --sweep]

--sweep times the Triton kernel over launch configs (mini_infer.ops.paged_attention._CONFIG).
"""

import itertools
import sys
import time

import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa

from mini_infer.ops.paged_attention import paged_attention_reference, paged_attention_triton


def build(s, ctx, new, hq, hkv, d, bs, dtype, device):
    nb = (ctx + bs - 1) // bs
    num_blocks = s * nb + 4
    kc = torch.randn(num_blocks, bs, hkv, d, dtype=dtype, device=device)
    vc = torch.randn_like(kc)
    bt = torch.randperm(num_blocks, device=device)[: s * nb].view(s, nb).int()
    t = s * new
    q = torch.randn(t, hq, d, dtype=dtype, device=device)
    k = torch.randn(t, hkv, d, dtype=dtype, device=device)
    v = torch.randn_like(k)
    lens = torch.full((s,), ctx, dtype=torch.int32, device=device)
    qsl = torch.arange(0, s + 1, dtype=torch.int32, device=device) * new
    pos = torch.arange(ctx - new, ctx, device=device)
    slots = (bt[:, pos // bs].long() * bs + pos % bs).flatten()
    return (q, k, v, kc, vc, slots, bt, lens, qsl, d**-0.5, 0, 0.0)


def cuda_ms(fn, iters=50):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g.replay()
    start.record()
    for _ in range(iters):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def gpu():
    hq, hkv, d, bs, dtype = 28, 4, 128, 16, torch.bfloat16
    print(f"GPU {torch.cuda.get_device_name()} | Hq={hq} Hkv={hkv} D={d} block={bs} bf16, CUDA-graph timings")
    for s, ctx, new in [(1, 4096, 1), (8, 4096, 1), (64, 4096, 1), (64, 1024, 1), (256, 512, 1), (4, 1024, 1024), (1, 4096, 4096)]:
        args = build(s, ctx, new, hq, hkv, d, bs, dtype, "cuda")
        kv_bytes = 2 * s * ctx * hkv * d * 2
        row = f"S={s:4d} ctx={ctx:5d} qlen={new:5d}:"
        for name, kw in [("default", {}), ("splits=1", {"num_splits": 1})]:
            ms = cuda_ms(lambda kw=kw, args=args: paged_attention_triton(*args, **kw))
            row += f" triton[{name}] {ms:.3f} ms ({kv_bytes / ms / 1e9:.2f} TB/s)"
        q = args[0].view(s, new, hq, d).transpose(1, 2)
        kf = torch.randn(s, hkv, ctx, d, dtype=dtype, device="cuda")
        vf = torch.randn_like(kf)
        ms = cuda_ms(lambda q=q, kf=kf, vf=vf, c=new > 1: sdpa(q, kf, vf, is_causal=c, enable_gqa=True))
        row += f" | SDPA contiguous {ms:.3f} ms"
        print(row, flush=True)


def sweep():
    from mini_infer.ops import paged_attention as pa

    hq, hkv, d, bs, dtype = 28, 4, 128, 16, torch.bfloat16
    saved = {k: dict(v) for k, v in pa._CONFIG.items()}
    grids = {
        "prefill": dict(rows=[64, 128], block_n=[32, 64, 128], num_warps=[4, 8], num_stages=[1, 2, 3]),
        "decode": dict(block_n=[32, 64, 128], num_warps=[2, 4, 8], num_stages=[1, 2, 3, 4]),
    }
    shapes = {"prefill": [(4, 1024, 1024), (1, 4096, 4096)], "decode": [(64, 4096, 1), (8, 4096, 1), (256, 512, 1)]}
    for kind, grid in grids.items():
        cases = [build(*shape, hq, hkv, d, bs, dtype, "cuda") for shape in shapes[kind]]
        results = []
        for values in itertools.product(*grid.values()):
            pa._CONFIG[kind] = dict(zip(grid, values))
            pa._LAUNCH_OK.clear()
            try:
                times = [cuda_ms(lambda a=a: paged_attention_triton(*a), iters=20) for a in cases]
            except Exception as e:  # out of shared memory, etc.
                print(kind, pa._CONFIG[kind], "failed:", type(e).__name__)
                continue
            results.append((sum(times), times, dict(pa._CONFIG[kind])))
        results.sort(key=lambda r: r[0])
        print(f"{kind}: shapes {shapes[kind]}; best first")
        for _total, times, cfg in results[:6]:
            print(f"  {cfg} " + " ".join(f"{t:.3f}" for t in times) + " ms")
        default = [r for r in results if r[2] == saved[kind]]
        if default:
            print("  current default:", " ".join(f"{t:.3f}" for t in default[0][1]))
    pa._CONFIG.update(saved)
    pa._LAUNCH_OK.clear()


def cpu():
    torch.set_num_threads(2)
    print("CPU reference, 2 threads, SmolLM2-135M attention shapes (Hq=9 Hkv=3 D=64 block=16), min of 20 calls")
    for s, ctx, new, dtype in [(16, 128, 1, torch.float32), (16, 512, 1, torch.float32), (16, 1024, 1, torch.float32),
                               (16, 512, 1, torch.bfloat16), (1, 64, 1, torch.float32), (16, 100, 100, torch.float32)]:
        args = build(s, ctx, new, 9, 3, 64, 16, dtype, "cpu")
        ts = []
        for _ in range(20):
            t = time.perf_counter()
            paged_attention_reference(*args)
            ts.append(time.perf_counter() - t)
        print(f"S={s:3d} ctx={ctx:5d} qlen={new:4d} {str(dtype):15s} {min(ts) * 1e3:7.2f} ms/call  x30 layers {min(ts) * 30e3:7.1f} ms")


if __name__ == "__main__":
    if "--sweep" in sys.argv:
        sweep()
    elif torch.cuda.is_available() and "--cpu-only" not in sys.argv:
        gpu()
        cpu()
    else:
        cpu()
