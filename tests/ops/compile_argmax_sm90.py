"""Compile `argmax_rows`' kernel for sm_90 as its launches build it (the tiles `argmax_config` picks for a
single-program row, a row merged in the launch, and a row of several tiles a program; bf16, fp16, fp32 rows), no
GPU needed; print one JSON line with, for each build, cuobjdump's resource line (STACK: where ptxas puts spilled
registers; LOCAL stays 0) and what the PTX does where programs meet: its atomics (the arrival count, acq_rel at gpu
scope) and its L2 (.cg) loads (the merge's reads of the other programs' partials). The last case is gumbel_argmax's
build (NOISE: Philox noise per element).

Each build is the launch `argmax_rows_triton` makes for one row of the case's V (`gumbel_argmax_triton` for the
NOISE case), recorded by calling it on CPU tensors with the kernel replaced by a recorder and specialized as Triton's
launcher specializes it (compile_sm90's `launch_signature`: fresh tensors 16-byte aligned, V and the row stride
marked divisible by 16 where they are multiples of 16, which V = 1000 is not; the seed is never specialized), with
the PDL wait of a CUDA launch on sm_90.

The interpreter runs Python's control flow and one program at a time; the GPU compiler does neither: this build is
the check on a CPU that the kernel compiles and that the merge's memory ordering is the one `arrives_last` promises.

Run in a process of its own without TRITON_INTERPRET: `python -m tests.ops.compile_argmax_sm90`. Exits
NO_CUDA_BACKEND when Triton has no CUDA backend or ptxas. Used by tests/ops/test_argmax.py. Builds only.
"""

from __future__ import annotations

import re
import sys

from tests.ops.compile_sm90 import build_launch, record_launches, report_main, resource_usage

# (V, x, NOISE)
CASES = [(1000, "*bf16", False), (151936, "*bf16", False), (151936, "*fp16", False), (32000, "*fp32", False),
         (300000, "*bf16", False), (151936, "*bf16", True)]


def launch(n_cols: int, x_type: str, noise: bool) -> tuple[tuple, dict]:
    """(args, kwargs) of the kernel launch for one row of `n_cols` logits of `x_type` (gumbel_argmax's with `noise`),
    as recorded on CPU tensors (`build_launch` adds the PDL wait of a CUDA launch)."""
    import torch

    from mini_infer.ops import argmax
    from mini_infer.ops.gumbel_argmax import gumbel_argmax_triton

    dtype = {"*bf16": torch.bfloat16, "*fp16": torch.float16, "*fp32": torch.float32}[x_type]
    x = torch.empty(1, n_cols, dtype=dtype)
    with record_launches(argmax, "_argmax_rows_kernel") as calls:
        if noise:
            gumbel_argmax_triton(x, torch.ones(1), 12345)
        else:
            argmax.argmax_rows_triton(x)
    (args, kwargs), = calls["_argmax_rows_kernel"]
    return args, kwargs


def cases() -> list[dict]:
    from mini_infer.ops.argmax import _argmax_rows_kernel, argmax_config

    out = []
    for n_cols, x_type, noise in CASES:
        block, tiles, programs, num_warps = argmax_config(n_cols)
        args, kwargs = launch(n_cols, x_type, noise)
        assert (kwargs["BLOCK"], kwargs["TILES"], kwargs["NUM_PROGRAMS"], kwargs["num_warps"], kwargs["NOISE"]) == (
            block, tiles, programs, num_warps, noise), kwargs
        built, _ = build_launch(_argmax_rows_kernel, args, kwargs)
        ptx = built.asm["ptx"]
        out.append({"n_cols": n_cols, "x": x_type, "noise": noise, "programs": programs, "tiles": tiles, "block": block,
                    "resources": resource_usage(built.asm["cubin"]),
                    "atomics": sorted(set(re.findall(r"atom\.[\w.]+", ptx))),
                    "loads": sorted(set(re.findall(r"ld\.global[\w.]*", ptx)))})
    return out


if __name__ == "__main__":
    sys.exit(report_main(cases))
