"""Compile every one-row GEMV kernel that takes linear.py's weight preload (PRELOAD_K) for sm_90 as its launches
build it, with rows preloaded before the PDL wait (one, two and four BLOCK_K chunks where the kernel's default tile
allows: `chunk_sums`' three branches) and without, no GPU needed; print one JSON line with cuobjdump's resource line
for each (STACK: where ptxas puts spilled registers; LOCAL stays 0).

Each build is the launch its op's launcher (`linear_add_triton`, `linear_add_rms_norm_triton`) makes for one bf16 row
of K elements times a [3584, K] weight (qwen2.5-7b's hidden size; K chosen so that `launch_gemv` picks the case's
tile and PRELOAD_K, with linear.py's PRELOAD_MAX_K / PREFIX_PRELOAD_K set as the case says), recorded by calling it
on CPU tensors with the kernel replaced by a recorder and specialized as Triton's launcher specializes it
(compile_sm90's `launch_signature`: fresh tensors 16-byte aligned; N, K and the row stride multiples of 16), with
the PDL wait of a CUDA launch on sm_90.

The interpreter runs Python's control flow, the GPU compiler does not: a first build of the preload path (an early
`return` inside a constexpr branch) passed every interpreted test and failed to compile on an H200. This build is
the check that catches that on a CPU.

Run in a process of its own without TRITON_INTERPRET: `python -m tests.ops.compile_gemv_preload_sm90`. Exits
NO_CUDA_BACKEND when Triton has no CUDA backend or ptxas. Used by tests/ops/test_linear.py. Builds only.
"""

from __future__ import annotations

import sys

from tests.ops.compile_sm90 import build_launch, record_launches, report_main, resource_usage

SHORT, LONG = (4, 512), (2, 1024)  # (BLOCK_N, BLOCK_K): linear.py's default tiles for K < 1024 and 1024 <= K <= 8192
N = 3584  # the weight's rows (outputs): NORM_BLOCK_N 4096 for the norm's row
# kernel -> (its launcher's name, [(tile, PRELOAD_K, K, linear.py's knobs for the launch)]); PRELOAD_K 0: the K loop
# after the wait (the preload turned off, as tests/ops/helpers.py's `preloaded_and_looped` does)
OFF = dict(PRELOAD_MAX_K=0, PREFIX_PRELOAD_K=0)
KERNELS = {
    "linear_add._gemv_add_kernel": ("linear_add_triton", [(SHORT, 512, 512, {}), (LONG, 2048, 2048, {}),
                                                          (LONG, 4096, 3584, {}), (LONG, 0, 2048, OFF)]),
    # a prefix of a longer row (PRELOAD_PREFIX: the rest in the loop after the wait), at the long-row tile's stages
    "linear_add._gemv_add_kernel:prefix": ("linear_add_triton", [(LONG, 2048, 18944, dict(PREFIX_PRELOAD_K=2048)),
                                                                 (LONG, 4096, 18944, dict(PREFIX_PRELOAD_K=4096))]),
    "linear_add_rms_norm._gemv_add_rms_norm_kernel": ("linear_add_rms_norm_triton",
                                                      [(LONG, 2048, 2048, {}), (LONG, 4096, 3584, {}),
                                                       (LONG, 0, 2048, OFF)]),
}


def launch(module, kernel: str, launcher: str, k: int, knobs: dict) -> tuple[tuple, dict]:
    """(args, kwargs) of `kernel`'s launch by `module`'s `launcher` for one bf16 row of `k` elements times a [N, k]
    weight (with a bias), with linear.py's `knobs` (PRELOAD_MAX_K 4096 and PREFIX_PRELOAD_K 4096 unless they say
    otherwise), as recorded on CPU tensors (`build_launch` adds the PDL wait of a CUDA launch)."""
    import torch

    from mini_infer.ops import linear

    x, residual = torch.empty(1, k, dtype=torch.bfloat16), torch.empty(1, N, dtype=torch.bfloat16)
    weight, bias = torch.empty(N, k, dtype=torch.bfloat16), torch.empty(N, dtype=torch.bfloat16)
    extra = (torch.empty(N, dtype=torch.bfloat16), 1e-6) if "rms_norm" in launcher else ()  # norm weight, eps
    with record_launches(linear, **dict(dict(PRELOAD_MAX_K=4096, PREFIX_PRELOAD_K=4096), **knobs)), \
            record_launches(module, kernel) as calls:
        getattr(module, launcher)(x, weight, bias, residual, *extra)
    (args, kwargs), = calls[kernel]
    return args, kwargs


def cases() -> list[dict]:
    import importlib

    out = []
    for name, (launcher, tiles) in KERNELS.items():
        module_name, kernel = name.split(":")[0].split(".")
        module = importlib.import_module(f"mini_infer.ops.{module_name}")
        for (block_n, block_k), preload, k, knobs in tiles:
            args, kwargs = launch(module, kernel, launcher, k, knobs)
            assert (kwargs["BLOCK_N"], kwargs["BLOCK_K"], kwargs.get("PRELOAD_K", 0), kwargs["num_warps"],
                    kwargs["num_stages"], kwargs.get("PRELOAD_PREFIX", False)) == (
                block_n, block_k, preload, 4, 4 if ":prefix" in name else 1, ":prefix" in name), (name, k, kwargs)
            built, _ = build_launch(getattr(module, kernel), args, kwargs)
            out.append({"kernel": name, "block_n": block_n, "block_k": block_k, "preload_k": preload,
                        "resources": resource_usage(built.asm["cubin"])})
    return out


if __name__ == "__main__":
    sys.exit(report_main(cases))
