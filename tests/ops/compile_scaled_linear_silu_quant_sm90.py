"""Compile scaled_linear_silu_quant's two kernels for sm_90 as its launcher launches them at qwen2.5-7b's gate_up
shape (one row of K = 3,584, a [2 x 18,944, 3,584] weight), no GPU needed: the GEMV with the activation and amax
epilogue (`_gemv_silu_amax_kernel`) for int8 operands (packed words, dp4a) and fp8 ones (tensor cores), and the
quantization from the slots (`_slot_quant_kernel`); print one JSON line with each build's resources and PTX counts
(dp4a, wgmma, the relaxed atomic max). Run in a process of its own without TRITON_INTERPRET: `python -m
tests.ops.compile_scaled_linear_silu_quant_sm90`. Exits NO_CUDA_BACKEND when Triton has no CUDA backend or ptxas. Used
by tests/ops/test_scaled_linear_silu_quant.py. Builds only.
"""

from __future__ import annotations

import sys

from tests.ops.compile_sm90 import build_launch, build_stats, record_launches, report_main

OPS = r"dp4a\.s32\.s32|wgmma\.mma_async[\w.]*|atom\.[\w.]*max[\w.]*|red\.[\w.]*max[\w.]*"


def cases() -> list[dict]:
    import torch

    from mini_infer.ops import fp8_linear
    from mini_infer.ops import scaled_linear_silu_quant as mod

    out = []
    for operand in (torch.int8, torch.float8_e4m3fn):
        x_q, x_scale = torch.empty(1, 3584, dtype=operand), torch.empty(1, 1)
        w_q, w_scale = torch.empty(2 * 18944, 3584, dtype=operand), torch.empty(2 * 18944)
        with record_launches(mod, "_gemv_silu_amax_kernel", "_slot_quant_kernel", fp8_supported=lambda d: True) \
                as calls, record_launches(fp8_linear, fp8_supported=lambda d: True):
            mod.scaled_linear_silu_quant_triton(x_q, x_scale, w_q, w_scale, None, torch.bfloat16, operand)
        for name in ("_gemv_silu_amax_kernel", "_slot_quant_kernel"):
            (args, kwargs), = calls[name]
            if name == "_gemv_silu_amax_kernel":  # a CUDA launch: int8's packed words through the dp4a inline asm
                kwargs = dict(kwargs, ASM=kwargs["PACKED"])
            built, _ = build_launch(getattr(mod, name), args, kwargs)
            stats = build_stats(built, kwargs.get("num_warps", 4), OPS)
            out.append({"kernel": name, "operand": str(operand).removeprefix("torch."), "regs": stats["regs"],
                        "stack": stats["stack"], "ops": dict(stats["ops"])})
    return out


if __name__ == "__main__":
    sys.exit(report_main(cases))
