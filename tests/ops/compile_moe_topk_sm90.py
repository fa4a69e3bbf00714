"""Compile moe_topk's routing kernel for sm_90 as its launcher builds it, no GPU needed, both ways it selects the
experts of an ungrouped router (moe_topk.TOPK_PACKED_KEYS): its registers, stack (spills) and the shuffles its
reductions issue. Cases: qwen3-30b-a3b's router (128 experts, top-8, softmax), mixtral's (8, top-2) and an
ungrouped sigmoid one (256, top-8). Prints one JSON line. Run in a process of its own without TRITON_INTERPRET:
`python -m tests.ops.compile_moe_topk_sm90`. Exits NO_CUDA_BACKEND when Triton has no CUDA backend or ptxas. Used by
tests/ops/test_moe_topk.py. Builds only.
"""

from __future__ import annotations

import re
import sys

from tests.ops.compile_sm90 import build_launch, record_launches, report_main, resource_usage

CASES = {"qwen3_30b_a3b": (128, 8, "softmax"), "mixtral": (8, 2, "softmax"), "sigmoid_256": (256, 8, "sigmoid")}


def cases() -> list[dict]:
    import torch

    from mini_infer.ops import moe_topk

    out = []
    for name, (experts, top_k, scoring) in CASES.items():
        for packed in (0, 1):
            bias = torch.empty(experts) if scoring == "sigmoid" else None
            with record_launches(moe_topk, "_moe_topk_kernel", TOPK_PACKED_KEYS=packed) as calls:
                moe_topk.moe_topk_triton(torch.empty(1, experts, dtype=torch.bfloat16), top_k, scoring, True,
                                         correction_bias=bias)
            (args, kwargs), = calls["_moe_topk_kernel"]
            built, _ = build_launch(moe_topk._moe_topk_kernel, args, kwargs)
            ptx = built.asm["ptx"]
            out.append({"name": name, "packed": packed, "resources": resource_usage(built.asm["cubin"]),
                        "shuffles": len(re.findall(r"\bshfl\.sync", ptx)),
                        "barriers": len(re.findall(r"\bbar\.sync|\bbarrier\.sync", ptx))})
    return out


if __name__ == "__main__":
    sys.exit(report_main(cases))
