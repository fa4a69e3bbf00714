"""Compile every one-row GEMV kernel that takes linear.py's weight preload (PRELOAD_K) for sm_90 as its launches
build it, with rows preloaded before the PDL wait (one, two and four BLOCK_K chunks where the kernel's default tile
allows: `chunk_sums`' three branches) and without, no GPU needed; print one JSON line with cuobjdump's resource line
for each (LOCAL: spill bytes).

The interpreter runs Python's control flow, the GPU compiler does not: a first build of the preload path (an early
`return` inside a constexpr branch) passed every interpreted test and failed to compile on an H200. This build is
the check that catches that on a CPU.

Run in a process of its own without TRITON_INTERPRET: `python -m tests.ops.compile_gemv_preload_sm90`. Exits
NO_CUDA_BACKEND when Triton has no CUDA backend or ptxas. Used by tests/ops/test_linear.py. Builds only.
"""

from __future__ import annotations

import sys

from tests.ops.compile_sm90 import build_sm90, report_main, resource_usage

SHORT, LONG = (4, 512), (2, 1024)  # (BLOCK_N, BLOCK_K): linear.py's default tiles for K < 1024 and 1024 <= K <= 8192
# kernel -> (its constexprs besides the tile and PRELOAD_K, [(tile, PRELOAD_K)]); PRELOAD_K 0: the K loop after the wait
KERNELS = {
    "linear_add._gemv_add_kernel": (dict(HAS_BIAS=True), [(SHORT, 512), (LONG, 2048), (LONG, 4096), (LONG, 0)]),
    # a prefix of a longer row (PRELOAD_PREFIX: the rest in the loop after the wait), at the long-row tile's stages
    "linear_add._gemv_add_kernel:prefix": (dict(HAS_BIAS=True, PRELOAD_PREFIX=True), [(LONG, 2048), (LONG, 4096)]),
    "linear_add_rms_norm._gemv_add_rms_norm_kernel": (dict(HAS_BIAS=True, NORM_BLOCK_M=1, NORM_BLOCK_N=4096),
                                                      [(LONG, 2048), (LONG, 4096), (LONG, 0)]),
}
POINTERS = {"cnt_ptr": "*i32"}  # linear_add_rms_norm's arrival counter


def cases() -> list[dict]:
    import importlib

    out = []
    for name, (constexprs, tiles) in KERNELS.items():
        module, kernel = name.split(":")[0].split(".")
        fn = getattr(importlib.import_module(f"mini_infer.ops.{module}"), kernel)
        for (block_n, block_k), preload in tiles:
            built = build_sm90(fn, dict(constexprs, BLOCK_N=block_n, BLOCK_K=block_k, USE_GDC=True,
                                        PRELOAD_K=preload), pointers=POINTERS, num_stages=4 if ":prefix" in name else 1)
            out.append({"kernel": name, "block_n": block_n, "block_k": block_k, "preload_k": preload,
                        "resources": resource_usage(built.asm["cubin"])})
    return out


if __name__ == "__main__":
    sys.exit(report_main(cases))
