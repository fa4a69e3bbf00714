"""Compile paged_attention's unified kernel (`_paged_attn_kernel`) for sm_90 as a decode-shaped launch builds it, with
and without the KV write inside it (WRITE_KV), and with the write and the q/k norms + rotary (ROTARY, HAS_Q_NORM,
HAS_K_NORM: rotary_paged_attention's launch), no GPU needed; print one JSON line.

Each is built as launched (the bf16 split case at "decode_split" with its first key tile loaded before the wait,
PRELOAD) and, for the rotary build, also without PRELOAD. Cases: a bf16 cache with 8 splits and the fused merge (qwen3-0.6b's 16 / 8 heads at batch 1), and an fp8 cache in one
split under a sliding window (qwen2.5-7b's group of 7), each at `_CONFIG`'s decode shape. For each: cuobjdump's
resource line (LOCAL: spill bytes) and, from the PTX, the barriers (`bar.sync` / `barrier.sync`) and the loads through
the non-coherent path (`ld.global.nc`, which need not see the CTA's own stores to the cache).

Run in a process of its own without TRITON_INTERPRET: `python -m tests.ops.compile_paged_attention_sm90`. Exits
NO_CUDA_BACKEND when Triton has no CUDA backend or ptxas. Used by tests/ops/test_paged_attention.py. Builds only.
"""

from __future__ import annotations

import re
import sys

from tests.ops.compile_sm90 import report_main, resource_usage

# (name, fp8 cache, query heads per kv head, splits, sliding window)
CASES = [("bf16_splits", False, 2, 8, False), ("fp8_window_g7", True, 7, 1, True)]
POINTERS = {"ws_m_ptr": "*fp32", "ws_l_ptr": "*fp32", "ws_acc_ptr": "*fp32", "cnt_ptr": "*i32", "bt_ptr": "*i32",
            "seq_lens_ptr": "*i32", "qsl_ptr": "*i32", "ks_ptr": "*fp32", "vs_ptr": "*fp32", "slot_ptr": "*i64"}


def build(write: bool, fp8: bool, g: int, splits: int, window: bool, rotary: bool = False, preload: bool | None = None):
    """The kernel as `_triton_attention` launches it for a decode step (head dim 128, block 16, a bf16 q): split
    launches over a bf16 cache at the "decode_split" shape with the first key tile loaded before the wait (PRELOAD;
    `preload=False`: the same shape without it), others at "decode" / "decode_fp8" without it."""
    import triton
    from triton.backends.compiler import GPUTarget

    from mini_infer.ops import paged_attention as pa

    kernel = pa._paged_attn_kernel
    split_shape = not fp8 and splits > 1
    preload = split_shape if preload is None else preload
    cfg = pa._CONFIG["decode_fp8" if fp8 else "decode_split" if split_shape else "decode"]
    pointers = {**POINTERS, **({"kc_ptr": "*fp8e4nv", "vc_ptr": "*fp8e4nv"} if fp8 else {})}
    sig = {arg: "constexpr" if p.is_constexpr else pointers.get(arg, "*bf16") if arg.endswith("_ptr")
           else "fp32" if arg in ("scale", "softcap", "eps") else "i32" for arg, p in zip(kernel.arg_names, kernel.params)}
    block_g = 1 << (g - 1).bit_length()
    constexprs = dict(
        BLOCK_SIZE=16, WRITE_KV=write, ROTARY=rotary, HAS_Q_NORM=rotary, HAS_K_NORM=rotary, G=g, BLOCK_Q=1, BLOCK_G=block_g, BLOCK_R=max(16, block_g),
        BLOCK_N=cfg["block_n"], BLOCK_D=128, BLOCK_DV=128, NUM_SPLITS=splits, FUSED_MERGE=splits > 1, SEARCH_STEPS=4,
        USE_WINDOW=window, USE_SOFTCAP=False, DOT_FP32=False, KV_FP8=fp8,
        FP8_DOT=pa._FP8_DOT[cfg["fp8_dot"]] if fp8 else 0, ROUND_P_EXACTLY=False, PRELOAD=preload, USE_GDC=True,
    )  # fmt: skip
    stages = min(cfg["num_stages"], 2) if splits > 1 else cfg["num_stages"]
    return triton.compile(triton.compiler.ASTSource(fn=kernel, signature=sig, constexprs=constexprs),
                          target=GPUTarget("cuda", 90, 32), options=dict(num_warps=cfg["num_warps"], num_stages=stages))


def report(name: str, fp8: bool, g: int, splits: int, window: bool) -> dict:
    out = {"name": name}
    for key, write, rotary, preload in (("no_write", False, False, None), ("write", True, False, None),
                                        ("rotary", True, True, None), ("rotary_no_preload", True, True, False)):
        compiled = build(write, fp8, g, splits, window, rotary, preload)
        ptx = compiled.asm["ptx"]
        out[key] = {
            "usage": resource_usage(compiled.asm["cubin"]),
            "barriers": len(re.findall(r"\b(?:bar|barrier)\.sync\b", ptx)),
            "nc_loads": len(re.findall(r"\bld\.global\.nc\b", ptx)),
        }
    return out


if __name__ == "__main__":
    sys.exit(report_main(lambda: [report(*case) for case in CASES]))
