"""Compile one kernel that starts with `await_producers` (`gather_rows`' kernel, as its launch builds it) for sm_90
with each PDL order `pdl_args` may pass (USE_GDC True: wait, then let the next kernel launch; TRIGGER_FIRST: the
other way round, _triton_support.PDL_TRIGGER_FIRST), no GPU needed; print one JSON line with, for each, the order of
the `griddepcontrol` instructions in its PTX.

Run in a process of its own without TRITON_INTERPRET: `python -m tests.ops.compile_pdl_sm90`. Exits NO_CUDA_BACKEND
when Triton has no CUDA backend or ptxas. Used by tests/ops/test_triton_support.py. Builds only.
"""

from __future__ import annotations

import re
import sys

from tests.ops.compile_sm90 import build_launch, record_launches, report_main


def cases() -> list[dict]:
    import torch

    from mini_infer.ops import gather_rows
    from mini_infer.ops._triton_support import TRIGGER_FIRST

    table, index = torch.empty(64, 128, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.int64)
    with record_launches(gather_rows, "_gather_rows_kernel") as calls:
        gather_rows.gather_rows_triton([table], [index])
    (args, kwargs), = calls["_gather_rows_kernel"]
    out = []
    for name, use_gdc in (("wait_first", True), ("trigger_first", TRIGGER_FIRST)):
        compiled, _ = build_launch(gather_rows._gather_rows_kernel, args, kwargs, use_gdc=use_gdc)
        out.append({"name": name, "order": re.findall(r"\bgriddepcontrol\.(wait|launch_dependents)\b",
                                                      compiled.asm["ptx"])})
    return out


if __name__ == "__main__":
    sys.exit(report_main(cases))
