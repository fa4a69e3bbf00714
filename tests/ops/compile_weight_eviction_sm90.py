"""Compile the one-row GEMV kernels for sm_90 as their launches build them, no GPU needed, and count their global
loads with and without an L2 cache hint: under MINI_INFER_WEIGHT_EVICTION=evict_first (the default; read at import,
_triton_support.WEIGHT_EVICTION) the weight loads carry `L2::cache_hint` with an `L2::evict_first` policy and the
input row's loads none; with `none` no load carries one. Prints one JSON line: per kernel, the policy it was built
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


def _case(module, kernel: str, call, eviction: str) -> dict:
    """`module`'s kernel `kernel` built for sm_90 as `call()` (its op's launcher on CPU tensors) launches it, with the
    policy it was built under (`eviction`) and its counts."""
    with record_launches(module, kernel) as calls:
        call()
    (args, kwargs), = calls[kernel]
    built, _ = build_launch(getattr(module, kernel), args, kwargs)
    return {"kernel": f"{module.__name__.rsplit('.', 1)[-1]}.{kernel}", "eviction": eviction,
            **_counts(built.asm["ptx"])}


def cases() -> list[dict]:
    import torch

    from mini_infer.ops import int8_linear, linear
    from mini_infer.ops._triton_support import WEIGHT_EVICTION

    return [
        _case(linear, "_gemv_kernel", lambda: linear.gemv_triton(
            torch.empty(1, 1024, dtype=torch.bfloat16), torch.empty(256, 1024, dtype=torch.bfloat16), None),
              WEIGHT_EVICTION),
        _case(int8_linear, "_scaled_gemv_kernel", lambda: int8_linear.scaled_gemv_triton(
            torch.empty(1, 1024, dtype=torch.int8), torch.empty(1, 1), torch.empty(256, 1024, dtype=torch.int8),
            torch.empty(256), None, torch.bfloat16), WEIGHT_EVICTION),
    ]


if __name__ == "__main__":
    sys.exit(report_main(cases))
