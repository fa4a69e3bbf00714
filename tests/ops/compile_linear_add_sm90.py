"""Compile linear_add's one-row kernel (`_gemv_add_kernel`) for sm_90 as its launches build it, with rows preloaded
before the PDL wait (PRELOAD_K of one, two and four BLOCK_K chunks: `_chunk_sums`' three branches) and without, no
GPU needed; print one JSON line with cuobjdump's resource line for each (LOCAL: spill bytes).

The interpreter runs Python's control flow, the GPU compiler does not: a first build of the preload path (an early
`return` inside a constexpr branch) passed every interpreted test and failed to compile on an H200. This build is
the check that catches that on a CPU.

Run in a process of its own without TRITON_INTERPRET: `python -m tests.ops.compile_linear_add_sm90`. Exits
NO_CUDA_BACKEND when Triton has no CUDA backend or ptxas. Used by tests/ops/test_linear_add.py. Builds only.
"""

from __future__ import annotations

import sys

from tests.ops.compile_sm90 import build_sm90, report_main, resource_usage

# (BLOCK_N, BLOCK_K, PRELOAD_K): linear.py's default tiles for K < 1024 and 1024 <= K <= 8192
CASES = [(4, 512, 512), (2, 1024, 2048), (2, 1024, 4096), (2, 1024, 0)]


def cases() -> list[dict]:
    from mini_infer.ops import linear_add as la

    out = []
    for block_n, block_k, preload in CASES:
        kernel = build_sm90(la._gemv_add_kernel, dict(HAS_BIAS=True, BLOCK_N=block_n, BLOCK_K=block_k, USE_GDC=True,
                                                      PRELOAD_K=preload))
        out.append({"block_n": block_n, "block_k": block_k, "preload_k": preload,
                    "resources": resource_usage(kernel.asm["cubin"])})
    return out


if __name__ == "__main__":
    sys.exit(report_main(cases))
