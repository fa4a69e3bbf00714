"""Compile paged_attention's unified kernel (`_paged_attn_kernel`) for sm_90 as a decode step's launch builds it, with
and without the KV write inside it (WRITE_KV), and with the write and the q/k norms + rotary (ROTARY, HAS_Q_NORM,
HAS_K_NORM: rotary_paged_attention's launch), no GPU needed; print one JSON line.

Each build is the launch `_triton_attention` makes for a decode step of the case's shapes (head dim 128, block 16, a
bf16 q from the merged projection, fresh 16-byte aligned tensors as the engine's): its arguments are recorded by
calling it on CPU tensors with the kernel replaced by a recorder, then specialized as Triton's launcher specializes
them (compile_sm90's `launch_signature`: a pointer 16-byte aligned and an integer a multiple of 16 are marked divisible by 16, an
integer 1 becomes a constant), with the constexprs and launch shape of a CUDA launch on sm_90 (16-bit dots, the PDL
wait). The specialization matters: built without the divisibility marks (a signature no launch of these shapes has)
an fp8 cache's tiles are loaded a byte at a time, each thread holding the row addresses of all 128 keys, and Triton
3.6 spills 1.3-6 KB there; with them it loads 16-byte vectors and keeps everything in registers.

Cases: a bf16 cache with 8 splits and the fused merge (qwen3-0.6b's 16 / 8 heads at batch 1: the "decode_split" shape,
its first key tile loaded before the wait, PRELOAD; the rotary build also without it, `MINI_INFER_ATTN_PRELOAD=0`), an
fp8 cache in one split under a sliding window (qwen2.5-7b's group of 7, batch 64), and nano-vllm's fp8 workload
(qwen3-0.6b, group of 2, one split, no window, batch 256), the fp8 ones over the V layout the paged_attention pass
declares (by default tokens-contiguous for full-attention layers: `_CONFIG["decode_fp8_vkeys"]` and `V_KEYS_TILES`;
the usual layout under a window: `_CONFIG["decode_fp8"]`), and nano-vllm's again over the usual V layout. For each build:
cuobjdump's resource line (STACK: where ptxas puts spilled registers; LOCAL stays 0), from the PTX the barriers
(`bar.sync` / `barrier.sync`) and the loads through the non-coherent path (`ld.global.nc`, which need not see the
CTA's own stores to the cache), and the launch shape.

With the argument `loop`, each case's key loop instead (`key_loop`: its SASS instructions by class and per byte
of K and V a step reads). With `sinks`, the cases' write and rotary builds with attention sinks (USE_SINKS: GPT-OSS's
per-head logit, folded into split 0's softmax state after its last tile), a bf16 [Hq] sinks tensor passed.

Run in a process of its own without TRITON_INTERPRET: `python -m tests.ops.compile_paged_attention_sm90`. Exits
NO_CUDA_BACKEND when Triton has no CUDA backend or ptxas. Used by tests/ops/test_paged_attention.py. Builds only.
"""

from __future__ import annotations

import re
import sys

from tests.ops.compile_sm90 import build_launch, record_launches, report_main, resource_usage

# (name, fp8 cache, query heads, kv heads, sequences (one query row each), splits, sliding window, V stored
# tokens-contiguous: None for the layout the pass declares)
CASES = [("bf16_splits", False, 16, 8, 1, 8, 0, None), ("fp8_window_g7", True, 28, 4, 64, 1, 4096, None),
         ("fp8_g2", True, 16, 8, 256, 1, 0, None), ("fp8_g2_usual_v", True, 16, 8, 256, 1, 0, False)]
# `loop` mode: nano-vllm's launch over a bf16 cache too, the one-split kernel the fp8 ones compare with
LOOP_CASES = [*CASES, ("bf16_g2", False, 16, 8, 256, 1, 0, None)]
HEAD_DIM, BLOCK_SIZE, CONTEXT = 128, 16, 1024  # CONTEXT: the block table's capacity (its row stride: 64 blocks)


def launch(fp8: bool, hq: int, hkv: int, seqs: int, splits: int, window: int, v_keys: bool | None, write: bool,
           rotary: bool, preload: bool = True, sinks: bool = False) -> tuple[tuple, dict]:
    """(args, kwargs) of the `_paged_attn_kernel` launch `_triton_attention` makes for a decode step of `seqs`
    sequences (one new token each) over caches holding CONTEXT keys a sequence: the step's k / v written in the kernel
    (`write`; else caches already holding them), q / k rotated in it (`rotary`, with both norms); an fp8 V cache
    stored tokens-contiguous where `v_keys` (None: as the paged_attention pass declares it). `preload`:
    `ATTN_PRELOAD` for the launch. Only shapes, strides and alignment matter: the tensors are left uninitialized."""
    import torch

    from mini_infer.contract.caches import CacheTensor
    from mini_infer.ops import paged_attention as pa
    from mini_infer.passes.paged_attention import fp8_v_keys_contiguous

    d, t = HEAD_DIM, seqs
    qkv = torch.empty(t, (hq + 2 * hkv) * d, dtype=torch.bfloat16)  # q, k, v: views of the merged projection
    q, k, v = (x.view(t, -1, d) for x in qkv.split([hq * d, hkv * d, hkv * d], dim=1))
    cache_dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    v_keys = fp8 and (fp8_v_keys_contiguous(window) if v_keys is None else v_keys)  # None: as the pass declares
    # few blocks (unread); V as CacheTensor allocates it
    k_cache = torch.empty(8, BLOCK_SIZE, hkv, d, dtype=cache_dtype)
    v_cache = CacheTensor("v", (hkv, d), cache_dtype, bool(v_keys)).zeros(8, BLOCK_SIZE, torch.device("cpu"))
    scales = (torch.ones(1), torch.ones(1)) if fp8 else (None, None)
    block_tables = torch.zeros(t, CONTEXT // BLOCK_SIZE, dtype=torch.int32)
    seq_lens = torch.full((t,), CONTEXT, dtype=torch.int32)
    query_start_loc = torch.arange(t + 1, dtype=torch.int32)
    slots = torch.zeros(t, dtype=torch.int64)
    rot = None
    if rotary:  # cos / sin rows as rotary_paged_attention passes them ([T, D]), the norms' weights [D]
        cos, sin = (torch.empty(t, d, dtype=torch.bfloat16) for _ in range(2))
        rot = pa.Rotary(cos, sin, torch.empty(d, dtype=torch.bfloat16), torch.empty(d, dtype=torch.bfloat16), 1e-6)
    # the write in the kernel, as split launches (and one-split ones of kinds whose "write_one_split" is on) build it;
    # decode_fp8's entry decides it for either V layout
    wkind = "decode_fp8" if fp8 else "decode"
    config = {**pa._CONFIG, wkind: {**pa._CONFIG[wkind], "write_one_split": 1}} if write else pa._CONFIG
    with record_launches(pa, "_paged_attn_kernel", ATTN_PRELOAD=preload, _CONFIG=config) as calls:
        pa._triton_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, d**-0.5, window, 0.0,
                             *scales, torch.empty(hq, dtype=torch.bfloat16) if sinks else None,
                             new_kv=(k, v, slots) if write else None, decode_only=True, num_splits=splits,
                             rotary=rot)
    (args, kwargs), = calls["_paged_attn_kernel"]
    # what a CUDA launch on sm_90 takes where the CPU call differs: 16-bit dots for a 16-bit q (the CPU's are fp32,
    # the interpreter's bf16 dot being wrong), the fp32 -> fp8 cast of the GPU (the PDL wait: build_launch)
    kwargs = dict(kwargs, DOT_FP32=q.dtype == torch.float32, ROUND_P_EXACTLY=False)
    return args, kwargs


def build(fp8: bool, hq: int, hkv: int, seqs: int, splits: int, window: int, v_keys: bool | None, write: bool,
          rotary: bool = False, preload: bool = True, sinks: bool = False):
    """The kernel compiled for sm_90 as `launch` launches it; returns (the compiled kernel, the launch shape)."""
    from mini_infer.ops import paged_attention as pa

    args, kwargs = launch(fp8, hq, hkv, seqs, splits, window, v_keys, write, rotary, preload, sinks)
    compiled, constexprs = build_launch(pa._paged_attn_kernel, args, kwargs)
    shape = dict(num_warps=kwargs["num_warps"], num_stages=kwargs["num_stages"], block_n=constexprs["BLOCK_N"],
                 splits=constexprs["NUM_SPLITS"], preload=constexprs["PRELOAD"], fp8_dot=constexprs["FP8_DOT"],
                 v_tiles=constexprs["V_TILES"], maxnreg=kwargs.get("maxnreg"), sinks=constexprs["USE_SINKS"])
    return compiled, shape


def report(name: str, fp8: bool, hq: int, hkv: int, seqs: int, splits: int, window: int, v_keys: bool | None,
           sinks: bool = False) -> dict:
    out = {"name": name}
    builds = [("no_write", False, False, True), ("write", True, False, True),
              ("rotary", True, True, True)]
    if sinks:  # the launches a GPT-OSS decode step makes (its q/k / v written in the kernel, with or without rotary)
        builds = builds[1:]
    elif not fp8 and splits > 1:  # the launches that preload (module docstring of paged_attention, "Before the wait")
        builds.append(("rotary_no_preload", True, True, False))
    for key, write, rotary, preload in builds:
        compiled, shape = build(fp8, hq, hkv, seqs, splits, window, v_keys, write, rotary, preload, sinks)
        ptx = compiled.asm["ptx"]
        out[key] = {
            "usage": resource_usage(compiled.asm["cubin"]),
            "barriers": len(re.findall(r"\b(?:bar|barrier)\.sync\b", ptx)),
            "nc_loads": len(re.findall(r"\bld\.global\.nc\b", ptx)),
            "shape": shape,
        }
    return out


def key_loop(name: str, fp8: bool, hq: int, hkv: int, seqs: int, splits: int, window: int, v_keys: bool | None) -> dict:
    """The rotary build's key loop (the longest loop of its SASS: compile_fp8_gemv_sm90's `k_loop`) by instruction
    class, and its warp instructions per byte of the K and V tiles one step reads (head dim 128): what an SM must
    issue to keep up with its share of the copy bandwidth. `python -m tests.ops.compile_paged_attention_sm90 loop`."""
    from mini_infer.ops import paged_attention as pa
    from tests.ops.compile_fp8_gemv_sm90 import classify, k_loop, sass_of

    args, kwargs = launch(fp8, hq, hkv, seqs, splits, window, v_keys, True, True)
    compiled, constexprs = build_launch(pa._paged_attn_kernel, args, kwargs)
    body = k_loop(sass_of(compiled.asm["cubin"]))
    kv_bytes = constexprs["BLOCK_N"] * HEAD_DIM * 2 * (1 if fp8 else 2)
    return {"name": name, "classes": classify(body), "top": body.most_common(8),
            "shared_byte_loads": sum(n for op, n in body.items() if op.startswith(("LDS.U8", "LDS.S8"))),
            "warp_instructions_per_kv_byte": round(sum(body.values()) * kwargs["num_warps"] / kv_bytes, 3)}


if __name__ == "__main__":
    mode = sys.argv[1] if sys.argv[1:] else ""
    sys.exit(report_main(lambda: [key_loop(*case) for case in LOOP_CASES] if mode == "loop" else
                         [report(*case, sinks=mode == "sinks") for case in CASES]))
