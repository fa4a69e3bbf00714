"""Probe (issues #14, #10): what would a split-K decode attention's merge cost through a thread-block cluster's
distributed shared memory instead of global memory?

The batch-1 decode attention splits each kv head's keys over programs and merges their partials in the same launch:
every split stores its partial (o, m, l) to a global workspace and counts itself with an atomic; the last to arrive
reloads every partial and merges (`_split_k.finish_rows`). Leaving the merge out ran qwen3-0.6b at 1,614 tok/s
against ~1,535; every other place for the merge lost (docs/architecture.md). Triton 3.6 has no thread-block clusters,
so this probe compiles one small CUDA kernel five ways (NVRTC, `torch.cuda._compile_kernel`) and times a chain of
them in a CUDA graph, one launch a layer:

  * "none":    each split stores its partial and exits (no merge: the floor);
  * "global":  the same, then a `__threadfence` and one atomic count a CTA; the last CTA of the kv head reloads the
               partials (L2) and merges (the engine's way);
  * "cluster": the splits of a kv head are one cluster (`__cluster_dims__`); each keeps its partial in shared memory,
               a cluster barrier, then split 0 reads the others' partials over DSMEM (`mapa` +
               `ld.shared::cluster`) and merges; a second barrier keeps the others' shared memory alive until then;
  * "cluster-all": the same, every split merging its share of the head's columns;
  * "cluster-l2": the partials stored to global memory as "global" does, a cluster barrier in place of the fence
               and count, then every split merges its share of the columns from L2 (what a Triton kernel launched
               as a cluster could do: Triton 3.6 gives no shared-memory addresses, but inline PTX has the barrier).

The kernel's own attention (one thread a (q head, key) score, fp32, the paged cache of `--block-size` tokens) is the
same in all five, so the differences are the merges' costs. Outputs of the four that merge are checked against
fp32 torch. Ordinary launches (no PDL: `_compile_kernel` launches with cuLaunchKernel).

    python bench/probe_cluster_merge.py [--heads 16/8] [--context 384] [--out DIR]   # GPU (sm_90)
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODES = {"none": 0, "global": 1, "cluster": 2, "cluster-all": 3, "cluster-l2": 4}

_SOURCE = r"""
#define NT 128
#define NEG_INF (-__int_as_float(0x7f800000))

__device__ __forceinline__ float bf(unsigned short x) { return __uint_as_float(((unsigned)x) << 16); }
__device__ __forceinline__ unsigned short to_bf(float f) {  // round to nearest even (no NaN here)
    unsigned u = __float_as_uint(f);
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
__device__ __forceinline__ unsigned smem_addr(const void* p) {
    unsigned long long a;
    asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
    return (unsigned)a;
}
__device__ __forceinline__ float ld_rank(const float* p, int rank) {  // p in CTA `rank`'s shared memory
    unsigned remote;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_addr(p)), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
    return v;
}
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ float ld_l2(const float* p) {
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory");
    return v;
}

// column d of q head g merged over the cluster's splits: m, l, o point at this CTA's own partial (shared memory)
__device__ __forceinline__ float merged_over_cluster(const float* m_own, const float* l_own, const float* o_own) {
    float mx = NEG_INF;
    for (int r = 0; r < SPLITS; r++) mx = fmaxf(mx, ld_rank(m_own, r));
    float L = 0.f, O = 0.f;
    for (int r = 0; r < SPLITS; r++) {
        const float m = ld_rank(m_own, r);
        const float w = (m == NEG_INF) ? 0.f : __expf(m - mx);
        L += w * ld_rank(l_own, r);
        O += w * ld_rank(o_own, r);
    }
    return O / L;
}

// column d of q head g merged over the splits' partials in global memory, from base (this kv head's), through L2
__device__ __forceinline__ float merged_from_l2(const float* base, int g, int d) {
    float mx = NEG_INF;
    for (int r = 0; r < SPLITS; r++) mx = fmaxf(mx, ld_l2(base + (r * G + g) * (D + 2) + D));
    float L = 0.f, O = 0.f;
    for (int r = 0; r < SPLITS; r++) {
        const float* pr = base + (r * G + g) * (D + 2);
        const float m = ld_l2(pr + D);
        const float w = (m == NEG_INF) ? 0.f : __expf(m - mx);
        L += w * ld_l2(pr + D + 1);
        O += w * ld_l2(pr + d);
    }
    return O / L;
}

extern "C" __global__ void
#if MODE >= 2
__cluster_dims__(SPLITS, 1, 1)
#endif
attn(const unsigned short* __restrict__ q, const unsigned short* __restrict__ kc,
     const unsigned short* __restrict__ vc, const int* __restrict__ bt, int seq_len, int hkv,
     unsigned short* __restrict__ out, float* __restrict__ ws, int* __restrict__ cnt)
{
    const int split = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
    __shared__ float sq[G][D];
    __shared__ float sp[G][KPS];
    __shared__ float so[G][D];
    __shared__ float sm[G], sl[G];
    __shared__ int last;
    for (int i = tid; i < G * D; i += NT) sq[i / D][i % D] = bf(q[(h * G + i / D) * D + i % D]);
    __syncthreads();
    const int k0 = split * KPS;
    for (int i = tid; i < G * KPS; i += NT) {
        const int g = i / KPS, j = i % KPS, t = k0 + j;
        float s = NEG_INF;
        if (t < seq_len) {
            const unsigned short* kr = kc + (((long)bt[t / BS] * BS + t % BS) * hkv + h) * D;
            float acc = 0.f;
            for (int d = 0; d < D; d += 2) {
                const unsigned w = *(const unsigned*)(kr + d);
                acc += sq[g][d] * bf((unsigned short)(w & 0xffffu)) + sq[g][d + 1] * bf((unsigned short)(w >> 16));
            }
            s = acc * SCALE;
        }
        sp[g][j] = s;
    }
    __syncthreads();
    if (tid < G) {
        float m = NEG_INF, l = 0.f;
        for (int j = 0; j < KPS; j++) m = fmaxf(m, sp[tid][j]);
        for (int j = 0; j < KPS; j++) {
            const float e = (m == NEG_INF) ? 0.f : __expf(sp[tid][j] - m);
            sp[tid][j] = e;
            l += e;
        }
        sm[tid] = m;
        sl[tid] = l;
    }
    __syncthreads();
    for (int i = tid; i < G * D; i += NT) {
        const int g = i / D, d = i % D;
        float acc = 0.f;
        for (int j = 0; j < KPS && k0 + j < seq_len; j++) {
            const int t = k0 + j;
            acc += sp[g][j] * bf(vc[(((long)bt[t / BS] * BS + t % BS) * hkv + h) * D + d]);
        }
        so[g][d] = acc;
    }
    __syncthreads();
    // the partials: ws[h][split][g][0..D-1] = o, [D] = m, [D + 1] = l
    float* mine = ws + ((long)(h * SPLITS + split) * G) * (D + 2);
#if MODE == 0 || MODE == 1 || MODE == 4
    for (int i = tid; i < G * D; i += NT) mine[(i / D) * (D + 2) + i % D] = so[i / D][i % D];
    if (tid < G) { mine[tid * (D + 2) + D] = sm[tid]; mine[tid * (D + 2) + D + 1] = sl[tid]; }
#endif
#if MODE == 1
    __syncthreads();
    if (tid == 0) {
        __threadfence();
        const int old = atomicAdd(cnt + h, 1);
        last = old == SPLITS - 1;
        if (last) cnt[h] = 0;
        __threadfence();
    }
    __syncthreads();
    if (!last) return;
    const float* base = ws + (long)h * SPLITS * G * (D + 2);
    for (int i = tid; i < G * D; i += NT) {
        const int g = i / D, d = i % D;
        out[(h * G + g) * D + d] = to_bf(merged_from_l2(base, g, d));
    }
#endif
#if MODE == 2
    cluster_sync();
    if (split == 0) {
        for (int i = tid; i < G * D; i += NT) {
            const int g = i / D, d = i % D;
            out[(h * G + g) * D + d] = to_bf(merged_over_cluster(&sm[g], &sl[g], &so[g][d]));
        }
    }
    cluster_sync();
#endif
#if MODE == 3
    cluster_sync();
    {   // every split merges its share of the columns
        const int per = (D + SPLITS - 1) / SPLITS, c0 = split * per;
        for (int i = tid; i < G * per; i += NT) {
            const int g = i / per, d = c0 + i % per;
            if (d >= D) continue;
            out[(h * G + g) * D + d] = to_bf(merged_over_cluster(&sm[g], &sl[g], &so[g][d]));
        }
    }
    cluster_sync();
#endif
#if MODE == 4
    cluster_sync();  // release / acquire at cluster scope: the other splits' stores above are visible
    {
        const float* base = ws + (long)h * SPLITS * G * (D + 2);
        const int per = (D + SPLITS - 1) / SPLITS, c0 = split * per;
        for (int i = tid; i < G * per; i += NT) {
            const int g = i / per, d = c0 + i % per;
            if (d >= D) continue;
            out[(h * G + g) * D + d] = to_bf(merged_from_l2(base, g, d));
        }
    }
#endif
}
"""


def compile_mode(mode: str, g: int, d: int, splits: int, kps: int, bs: int):
    """The kernel for `mode` (NVRTC), its constants as macros."""
    defines = (f"#define MODE {MODES[mode]}\n#define G {g}\n#define D {d}\n#define SPLITS {splits}\n"
               f"#define KPS {kps}\n#define BS {bs}\n#define SCALE {1 / math.sqrt(d):.9f}f\n")
    return torch.cuda._compile_kernel(defines + _SOURCE, "attn")


def reference(q, kc, vc, bt, seq_len, hkv, bs):
    """fp32 attention of one query token over its paged cache ([blocks x BS, HKV, D]): [HQ, D], by the op's own
    reference (`paged_attention_cached_reference`)."""
    from mini_infer.ops.paged_attention import paged_attention_cached_reference

    d = q.shape[-1]
    caches = [c.float().view(-1, bs, hkv, c.shape[-1]) for c in (kc, vc)]
    ints = dict(dtype=torch.int32, device=q.device)
    return paged_attention_cached_reference(q.float()[None], *caches, bt[None], torch.tensor([seq_len], **ints),
                                            torch.tensor([0, 1], **ints), 1 / math.sqrt(d))[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", default="16/8", help="q heads / kv heads (qwen3-0.6b 16/8, qwen3-30b-a3b 32/4)")
    ap.add_argument("--context", default="384", help="comma list of context lengths (keys)")
    ap.add_argument("--keys-per-split", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=28, help="launches chained in the graph (one a layer)")
    ap.add_argument("--out", default=None, help="directory for probe_cluster_merge.json")
    args = ap.parse_args()
    from kernel_norm import time_calls, write_gpu_report

    if not hasattr(torch.cuda, "_compile_kernel"):
        raise SystemExit("this torch has no torch.cuda._compile_kernel (NVRTC); the probe needs it")
    hq, hkv = (int(x) for x in args.heads.split("/"))
    g, d, kps, bs = hq // hkv, 128, args.keys_per_split, args.block_size
    torch.manual_seed(0)
    rows = []
    print(f"{torch.cuda.get_device_name()} | heads {hq}/{hkv}, head dim {d}, {kps} keys a split, blocks of {bs}, "
          f"{args.layers} launches chained in one CUDA graph, us a launch (median of 5)")
    for ctx in (int(c) for c in args.context.split(",")):
        splits = max(1, min(8, -(-ctx // kps)))  # the cluster holds at most 8 CTAs portably
        if splits * kps < ctx:
            print(f"  context {ctx}: more than 8 splits of {kps} keys; skipped")
            continue
        n_blocks = -(-ctx // bs)
        layers = []
        for _ in range(args.layers):
            kc = (torch.randn(n_blocks * bs, hkv, d, device="cuda") * 0.5).to(torch.bfloat16)
            vc = torch.randn(n_blocks * bs, hkv, d, device="cuda").to(torch.bfloat16)
            q = torch.randn(hq, d, device="cuda").to(torch.bfloat16)
            bt = torch.randperm(n_blocks, device="cuda").to(torch.int32)
            layers.append((q, kc, vc, bt, torch.empty(hq, d, device="cuda", dtype=torch.bfloat16)))
        ws = torch.empty(hkv * splits * g * (d + 2), device="cuda", dtype=torch.float32)
        cnt = torch.zeros(hkv, device="cuda", dtype=torch.int32)
        for mode in MODES:
            kernel = compile_mode(mode, g, d, splits, kps, bs)

            def chain(kernel=kernel, layers=layers, splits=splits, ctx=ctx, ws=ws, cnt=cnt):
                for q, kc, vc, bt, out in layers:
                    kernel(grid=(splits, hkv, 1), block=(128, 1, 1), args=[q, kc, vc, bt, ctx, hkv, out, ws, cnt])

            chain()
            torch.cuda.synchronize()
            err = None
            if mode != "none":
                q, kc, vc, bt, out = layers[-1]
                want = reference(q, kc, vc, bt, ctx, hkv, bs)
                err = ((out.float() - want).abs().max() / want.abs().max()).item()
            us = time_calls([chain], 200.0, 5)[0] * 1e3 / args.layers
            print(f"  context {ctx:5d}, {splits} splits, merge {mode:8s}: {us:6.2f} us a launch"
                  + (f"  (max rel err {err:.1e})" if err is not None else ""))
            rows.append({"context": ctx, "splits": splits, "mode": mode, "us": us, "max_rel_err": err})
    if args.out:
        write_gpu_report(args.out, "probe_cluster_merge.json", {"heads": args.heads, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
