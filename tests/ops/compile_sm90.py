"""Compiling a Triton kernel for sm_90 with Triton's CUDA backend, no GPU needed: `build_sm90` (one build from the
kernel's own parameters, as a launch specializes it), `resource_usage` (cuobjdump's resource line of the cubin),
`build_stats` (a build's registers, spills, shared memory, programs an SM holds and chosen PTX instructions counted;
also what bench/probe_*.py print) and `report_main` (a compile script's process: its cases' JSON report, or why
there is none).

Only for a process of its own without TRITON_INTERPRET (under the interpreter `triton.jit` builds interpreted
functions, which do not compile); the caller runs it through `run_uninterpreted` (tests/ops/helpers.py). Used by
tests/ops/compile_fp8_gemv_sm90.py. Builds only: never launches a kernel.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from tests.ops.helpers import NO_CUDA_BACKEND


def build_sm90(kernel, constexprs: dict, pointers: dict | None = None, num_warps: int = 4, num_stages: int = 1,
               divisible: tuple[str, ...] = (), floats: tuple[str, ...] = ("eps",)):
    """`kernel` (a `triton.jit` function) compiled for sm_90, as a launch builds it: its constexpr parameters from
    `constexprs` (and any other parameter `constexprs` names: what a launch makes of an integer argument equal to
    1; a constexpr parameter it does not name takes its default, as in a launch that does not pass it), pointers (`*_ptr`) bf16 unless `pointers` names another type, `eps` fp32, other scalars i32; the arguments
    named in `divisible` marked multiples of 16 (what a launch specializes to for 16-byte aligned tensors and
    integers divisible by 16)."""
    import triton
    from triton.backends.compiler import GPUTarget

    pointers = pointers or {}
    constexprs = {**{p.name: p.default for p in kernel.params if p.is_constexpr and p.has_default}, **constexprs}
    sig = {arg: "constexpr" if param.is_constexpr or arg in constexprs
           else pointers.get(arg, "*bf16") if arg.endswith("_ptr") else "fp32" if arg in floats else "i32"
           for arg, param in zip(kernel.arg_names, kernel.params)}
    attrs = {(kernel.arg_names.index(arg),): [["tt.divisibility", 16]] for arg in divisible}
    return triton.compile(triton.compiler.ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages))


def resource_usage(cubin: bytes) -> str:
    """cuobjdump's resource line for the kernel ('' without the backend's cuobjdump)."""
    import triton.backends.nvidia as nvidia

    tool = Path(nvidia.__file__).parent / "bin" / "cuobjdump"
    if not tool.exists():
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    return next((line.strip() for line in out.splitlines() if "REG:" in line), "")


def build_stats(compiled, num_warps: int, instructions: str = r"cp\.async\.c[ag]|wgmma\.mma_async|mma\.sync") -> dict:
    """A build's resources: registers, stack and spill (LOCAL) bytes, shared memory, the programs of `num_warps` an SM
    holds by registers and shared memory (and its 64 warps), and a count of each PTX instruction matching the regex
    `instructions` (registers, stack and spill 0 without the backend's cuobjdump)."""
    import math
    import re
    from collections import Counter

    field = {k: int(v) for k, v in re.findall(r"(REG|STACK|LOCAL|SHARED):(\d+)", resource_usage(compiled.asm["cubin"]))}
    regs, smem = field.get("REG", 0), compiled.metadata.shared
    by_regs = 65536 // (max(1, math.ceil(regs / 8) * 8) * 32 * num_warps) if regs else 0
    by_smem = 233472 // (smem + 1024) if smem else 32
    return {"regs": regs, "stack": field.get("STACK", 0), "spill": field.get("LOCAL", 0), "smem": smem,
            "programs_per_sm": min(by_regs, by_smem, 64 // num_warps),
            "ops": Counter(re.findall(rf"\b({instructions})", compiled.asm["ptx"]))}


def compile_blocker() -> str | None:
    """Why this process cannot build for sm_90 (TRITON_INTERPRET set, or no CUDA backend in Triton), or None."""
    if os.environ.get("TRITON_INTERPRET"):
        return "unset TRITON_INTERPRET: interpreted functions do not compile"
    try:
        import triton.backends.nvidia  # noqa: F401
    except ImportError as exc:
        return f"no CUDA backend: {exc}"
    return None


def report_main(cases: Callable[[], list]) -> int:
    """A compile script's main: print {"triton": version, "cases": cases()} as one JSON line and return 0; return 2
    under TRITON_INTERPRET (interpreted functions do not compile) and NO_CUDA_BACKEND without Triton's CUDA backend or
    ptxas."""
    if os.environ.get("TRITON_INTERPRET"):
        print("unset TRITON_INTERPRET: interpreted functions do not compile", file=sys.stderr)
        return 2
    try:
        import triton
        import triton.backends.nvidia  # noqa: F401

        out = {"triton": triton.__version__, "cases": cases()}
    except (ImportError, FileNotFoundError, subprocess.CalledProcessError) as exc:
        print(f"no CUDA backend / ptxas: {type(exc).__name__}: {exc}", file=sys.stderr)
        return NO_CUDA_BACKEND
    print(json.dumps(out))
    return 0
