"""Compile linear_add_rms_norm.py's `_scaled_gemv_add_rms_norm_quant_kernel` (int8, the W8A8 chain's o_proj and
down_proj) for sm_90 as its launches build it, with int8_linear.py's weight preload before the PDL wait
(`scaled_preload_width` at a SCALED_GEMV_PRELOAD_MAX_K limit) and without, no GPU needed; print one JSON line with,
for each case, cuobjdump's resource line (LOCAL: spill bytes) and the global loads the PTX issues before its
`griddepcontrol.wait` (the preload's, which the compiler must leave there).

Cases: qwen2.5-7b's o_proj (K 3,584: the whole row within a 4,096 limit) and down_proj (K 18,944: a 4,096-column
prefix, the rest streamed after the wait; and an 8,192 prefix, to show the register cost of a larger limit), at the
int8 GEMV's default tile (int32 words of four, dp4a), each beside its build without the preload; and o_proj read
byte by byte (the unpacked path, for unaligned tensors).

Run in a process of its own without TRITON_INTERPRET: `python -m tests.ops.compile_scaled_gemv_preload_sm90`. Exits
NO_CUDA_BACKEND when Triton has no CUDA backend or ptxas. Used by tests/ops/test_linear_add_rms_norm.py. Builds only.
"""

from __future__ import annotations

import re
import sys

from tests.ops.compile_sm90 import build_sm90, report_main, resource_usage

# (name, K in int8 elements, SCALED_GEMV_PRELOAD_MAX_K, packed); limit 0: the K loop after the wait
CASES = [("o_proj", 3584, 4096, True), ("o_proj", 3584, 0, True), ("down_proj", 18944, 4096, True),
         ("down_proj", 18944, 8192, True), ("down_proj", 18944, 0, True), ("o_proj_unpacked", 3584, 4096, False)]
POINTERS = {"x_scale_ptr": "*fp32", "w_scale_ptr": "*fp32", "q_ptr": "*i8", "q_scale_ptr": "*fp32", "cnt_ptr": "*i32"}


def loads_before_wait(ptx: str) -> int:
    """`ld.global` instructions in the PTX before its first `griddepcontrol.wait` (-1: no wait)."""
    wait = ptx.find("griddepcontrol.wait")
    return -1 if wait < 0 else len(re.findall(r"\bld\.global", ptx[:wait]))


def build(k: int, limit: int, packed: bool) -> dict:
    import triton.language as tl

    from mini_infer.ops import int8_linear as il
    from mini_infer.ops import linear_add_rms_norm as lar
    from mini_infer.ops.rms_norm import norm_tile

    block_n, block_k, warps, stages = il.SCALED_GEMV_CONFIG
    unit = 4 if packed else 1
    il.SCALED_GEMV_PRELOAD_MAX_K = limit
    preload_k = il.scaled_preload_width(k // unit, block_k // unit, unit)
    norm_m, norm_n, _ = norm_tile(3584)  # the norm of qwen2.5-7b's hidden row, after either GEMV
    operand = "*i32" if packed else "*i8"
    constexprs = dict(HAS_BIAS=False, ACC_DTYPE=tl.int32, PACKED=packed, ASM=packed, DOT=False,
                      NORM_DTYPE=tl.bfloat16, IS_FP8=False, QMAX=127.0, NORM_BLOCK_M=norm_m, NORM_BLOCK_N=norm_n,
                      BLOCK_N=block_n, BLOCK_K=block_k // unit, USE_GDC=True, PRELOAD_K=preload_k)
    built = build_sm90(lar._scaled_gemv_add_rms_norm_quant_kernel, constexprs,
                       dict(POINTERS, x_ptr=operand, w_ptr=operand), warps, stages,
                       divisible=("x_ptr", "w_ptr", "K", "stride_wn"))
    return {"k": k, "limit": limit, "packed": packed, "preload_k": preload_k, "block_k": block_k // unit,
            "loads_before_wait": loads_before_wait(built.asm["ptx"]), "resources": resource_usage(built.asm["cubin"])}


def cases() -> list[dict]:
    return [{"name": name, **build(k, limit, packed)} for name, k, limit, packed in CASES]


if __name__ == "__main__":
    sys.exit(report_main(cases))
