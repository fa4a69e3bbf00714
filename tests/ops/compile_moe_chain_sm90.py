"""Compile the MoE decode chain's fused kernels for sm_90 as launches at qwen3-30b-a3b's batch-1 shapes build them, no
GPU needed: fused_moe_add_rms_norm.py's slot sum + add + norm (with fused_moe.py's slot-sum kernel, which shares its
row body, beside it) and linear_moe_topk.py's router GEMV + routing (with moe_topk.py's routing kernel), each at the
launch's constexprs and warps. Prints one JSON line: per kernel cuobjdump's resource line (LOCAL: spill bytes).

Run in a process of its own without TRITON_INTERPRET: `python -m tests.ops.compile_moe_chain_sm90`. Exits
NO_CUDA_BACKEND when Triton has no CUDA backend or ptxas. Used by tests/ops/test_fused_moe_add_rms_norm.py. Builds
only: never launches a kernel.
"""

from __future__ import annotations

import sys

from tests.ops.compile_sm90 import build_sm90, report_main, resource_usage

INT32_IDS = {"ids_ptr": "*i32", "map_ptr": "*i32", "ti_ptr": "*i32", "cnt_ptr": "*i32"}
H, E, TOP_K = 2048, 128, 8  # qwen3-30b-a3b


def cases() -> list[dict]:
    from mini_infer.ops.fused_moe import _moe_sum_kernel
    from mini_infer.ops.fused_moe_add_rms_norm import _moe_sum_add_rms_norm_kernel
    from mini_infer.ops.linear import gemv_config
    from mini_infer.ops.linear_moe_topk import _gemv_moe_topk_kernel
    from mini_infer.ops.moe_topk import _moe_topk_kernel, topk_num_warps
    from mini_infer.ops.rms_norm import norm_tile

    block_m, block_n, warps = norm_tile(H)
    gemv_n, gemv_k, _, stages = gemv_config(H, E)
    topk = dict(TOP_K=TOP_K, SIGMOID=False, GROUPED=False, RENORMALIZE=True, BLOCK_G=1, BLOCK_S=E, USE_GDC=True)
    builds = {
        "moe_sum": (_moe_sum_kernel, dict(TOP_K=TOP_K, BLOCK=1024, HAS_MAP=False, USE_GDC=True), 4, 1),
        "moe_sum_add_rms_norm": (_moe_sum_add_rms_norm_kernel, dict(TOP_K=TOP_K, HAS_MAP=False, BLOCK_M=block_m,
                                                                    BLOCK_N=block_n, USE_GDC=True), warps, 1),
        "moe_topk": (_moe_topk_kernel, dict(topk, BLOCK_K=TOP_K), topk_num_warps(E), 1),
        "gemv_moe_topk": (_gemv_moe_topk_kernel, dict(topk, HAS_BIAS=False, BLOCK_SLOTS=TOP_K, BLOCK_N=gemv_n,
                                                      BLOCK_K=gemv_k), topk_num_warps(E), stages),
    }
    out = []
    for name, (kernel, constexprs, num_warps, num_stages) in builds.items():
        compiled = build_sm90(kernel, constexprs, INT32_IDS, num_warps=num_warps, num_stages=num_stages)
        out.append({"kernel": name, "num_warps": num_warps, "usage": resource_usage(compiled.asm["cubin"])})
    return out


if __name__ == "__main__":
    sys.exit(report_main(cases))
