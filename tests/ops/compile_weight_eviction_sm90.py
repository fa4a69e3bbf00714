"""Compile the one-row GEMV kernels for sm_90 as their launches build them, no GPU needed, and count their global
loads with and without an L2 cache hint: under MINI_INFER_WEIGHT_EVICTION=evict_first (read at import,
_triton_support.WEIGHT_EVICTION) the weight loads carry `L2::cache_hint` with an `L2::evict_first` policy and the
input row's loads none; without it no load carries one. Prints one JSON line: per kernel, the policy it was built
under and its counts.

Cases: linear.py's bf16 GEMV (`_gemv_kernel`, one row of 1,024 elements times a [256, 1,024] weight) and
int8_linear.py's W8A8 GEMV (`_scaled_gemv_kernel`, the packed int8 row). Run in a process of its own without
TRITON_INTERPRET: `python -m tests.ops.compile_weight_eviction_sm90`. Exits NO_CUDA_BACKEND when Triton has no CUDA
backend or ptxas. Used by tests/ops/test_weight_eviction.py. Builds only.
"""

from __future__ import annotations

import re
import sys

from tests.ops.compile_sm90 import build_launch, record_launches, report_main


def _counts(ptx: str) -> dict:
    """Global loads with and without an L2 cache hint, and the L2 policies the kernel creates."""
    loads = re.findall(r"\bld\.global[\w:.]*", ptx)
    return {"hinted_loads": sum("L2::cache_hint" in ld for ld in loads),
            "plain_loads": sum("L2::cache_hint" not in ld for ld in loads),
            "policies": sorted(set(re.findall(r"createpolicy\.fractional\.(L2::\w+)", ptx)))}


def cases() -> list[dict]:
    import torch

    from mini_infer.ops import int8_linear, linear
    from mini_infer.ops._triton_support import WEIGHT_EVICTION

    out = []
    with record_launches(linear, "_gemv_kernel") as calls:
        linear.gemv_triton(torch.empty(1, 1024, dtype=torch.bfloat16), torch.empty(256, 1024, dtype=torch.bfloat16),
                           None)
    (args, kwargs), = calls["_gemv_kernel"]
    built, _ = build_launch(linear._gemv_kernel, args, kwargs)
    out.append({"kernel": "linear._gemv_kernel", "eviction": WEIGHT_EVICTION, **_counts(built.asm["ptx"])})
    with record_launches(int8_linear, "_scaled_gemv_kernel") as calls:
        int8_linear.scaled_gemv_triton(torch.empty(1, 1024, dtype=torch.int8), torch.empty(1, 1),
                                       torch.empty(256, 1024, dtype=torch.int8), torch.empty(256), None,
                                       torch.bfloat16)
    (args, kwargs), = calls["_scaled_gemv_kernel"]
    built, _ = build_launch(int8_linear._scaled_gemv_kernel, args, kwargs)
    out.append({"kernel": "int8_linear._scaled_gemv_kernel", "eviction": WEIGHT_EVICTION, **_counts(built.asm["ptx"])})
    return out


if __name__ == "__main__":
    sys.exit(report_main(cases))
