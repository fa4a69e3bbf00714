"""Compile `argmax_rows`' kernel for sm_90 as its launches build it (the tiles `argmax_config` picks for a
single-program row, a row merged in the launch, and a row of several tiles a program; bf16, fp16, fp32 rows), no
GPU needed; print one JSON line with, for each build, cuobjdump's resource line (LOCAL: spill bytes) and what the
PTX does where programs meet: its atomics (the arrival count, acq_rel at gpu scope) and its L2 (.cg) loads (the
merge's reads of the other programs' partials). The last case is gumbel_argmax's build (NOISE: Philox noise per
element).

The interpreter runs Python's control flow and one program at a time; the GPU compiler does neither: this build is
the check on a CPU that the kernel compiles and that the merge's memory ordering is the one `arrives_last` promises.

Run in a process of its own without TRITON_INTERPRET: `python -m tests.ops.compile_argmax_sm90`. Exits
NO_CUDA_BACKEND when Triton has no CUDA backend or ptxas. Used by tests/ops/test_argmax.py. Builds only.
"""

from __future__ import annotations

import re
import sys

from tests.ops.compile_sm90 import build_sm90, report_main, resource_usage

# (V, x, NOISE)
CASES = [(1000, "*bf16", False), (151936, "*bf16", False), (151936, "*fp16", False), (32000, "*fp32", False),
         (300000, "*bf16", False), (151936, "*bf16", True)]


def cases() -> list[dict]:
    from mini_infer.ops._triton_support import next_pow2
    from mini_infer.ops.argmax import _argmax_rows_kernel, argmax_config

    out = []
    for n_cols, x_type, noise in CASES:
        block, tiles, programs, num_warps = argmax_config(n_cols)
        pointers = {"x_ptr": x_type, "out_ptr": "*i64", "ws_val_ptr": "*fp32", "ws_idx_ptr": "*i32", "cnt_ptr": "*i32",
                    "inv_t_ptr": "*fp32"}
        built = build_sm90(_argmax_rows_kernel, dict(NUM_PROGRAMS=programs, P_POW2=next_pow2(programs), TILES=tiles,
                                                     BLOCK=block, USE_GDC=True, NOISE=noise),
                           pointers=pointers, num_warps=num_warps, divisible=("x_ptr", "n_cols", "s_xr"))
        ptx = built.asm["ptx"]
        out.append({"n_cols": n_cols, "x": x_type, "noise": noise, "programs": programs, "tiles": tiles, "block": block,
                    "resources": resource_usage(built.asm["cubin"]),
                    "atomics": sorted(set(re.findall(r"atom\.[\w.]+", ptx))),
                    "loads": sorted(set(re.findall(r"ld\.global[\w.]*", ptx)))})
    return out


if __name__ == "__main__":
    sys.exit(report_main(cases))
