"""Compiling a Triton kernel for sm_90 with Triton's CUDA backend, no GPU needed: `record_launches` (the arguments an
op's launcher passes its kernels, recorded by calling it on CPU tensors with the kernels replaced by `_Recorder`s),
`launch_signature` (those arguments specialized as Triton's launcher specializes them), `build_launch` (a recorded
launch compiled), `build_sm90` (one build from the kernel's own parameters and explicit divisibility marks, for
kernels whose launch is not recorded), `resource_usage` (cuobjdump's resource line of the cubin), `build_stats` (a
build's registers, stack, shared memory, programs an SM holds and chosen PTX instructions counted; also what
bench/probe_*.py print) and `report_main` (a compile script's process: its cases' JSON report, or why there is none).

Build as launched: a launch marks a pointer whose data is 16-byte aligned and an integer argument that is a multiple
of 16 `tt.divisibility` 16, and makes an integer equal to 1 a constant. Without those marks Triton cannot vectorize
loads, and its register use and spills differ from every real launch's (compile_paged_attention_sm90.py's docstring:
1.3-6 KB of stack with Triton 3.6 in builds that as launched have none); hence recorded launches.

Reading cuobjdump's resource line: ptxas puts spilled registers on the stack (STACK:); LOCAL: stays 0 when it spills.

Only for a process of its own without TRITON_INTERPRET (under the interpreter `triton.jit` builds interpreted
functions, which do not compile); the caller runs it through `run_uninterpreted` (tests/ops/helpers.py). Used by
tests/ops/compile_*_sm90.py and bench/probe_*.py. Builds only: never launches a kernel.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

from tests.ops.helpers import NO_CUDA_BACKEND

SM90 = ("cuda", 90, 32)  # GPUTarget's (backend, arch, warp size)


class _Recorder:
    """Stands in for the kernel: `kernel[grid](*args, **kwargs)` records (args, kwargs) instead of launching."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((args, kwargs))


@contextmanager
def record_launches(module, *names: str, **attributes):
    """Within the block, `module`'s kernels `names` are `_Recorder`s and its other `attributes` (module-level knobs)
    take the given values; yields {name: [(args, kwargs), ...]}, the launches made meanwhile. Everything is restored
    after the block. The launcher is then called on CPU tensors: only the arguments' shapes, strides, dtypes and
    alignment matter (tensors may be left uninitialized); kwargs that a CUDA launch sets otherwise than the CPU call
    (USE_GDC: `pdl_args` of a CPU tensor is False) are the caller's to override."""
    saved = {name: getattr(module, name) for name in (*names, *attributes)}
    recorders = {name: _Recorder() for name in names}
    for name, value in {**recorders, **attributes}.items():
        setattr(module, name, value)
    calls = {name: recorder.calls for name, recorder in recorders.items()}
    try:
        yield calls
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


_POINTER_TYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float8_e4m3fn": "fp8e4nv",
                  "float8_e5m2": "fp8e5", "int8": "i8", "uint8": "u8", "int16": "i16", "int32": "i32",
                  "int64": "i64", "bool": "i1"}


def launch_signature(kernel, args: tuple, kwargs: dict) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) of `kernel` launched with `args` / `kwargs` (launch options such as num_warps
    left out), specialized as Triton's launcher does (3.6 and 3.9 alike): a tensor is a pointer, divisible by 16 when
    its data is 16-byte aligned; an integer 1 is a constant, as is None; another integer is divisible by 16 when it is a
    multiple of 16; floats and bools are not specialized; nor is a parameter in the kernel's `do_not_specialize` (no constant,
    no mark) or its `do_not_specialize_on_alignment` (no mark). A constexpr parameter the launch does not pass takes
    its default."""
    import torch

    values = {**dict(zip(kernel.arg_names, args)), **kwargs}
    sig, constexprs, attrs = {}, {}, {}
    for i, (name, param) in enumerate(zip(kernel.arg_names, kernel.params)):
        value = values[name] if name in values or not param.has_default else param.default
        specialize = not param.do_not_specialize
        if param.is_constexpr or value is None or (specialize and type(value) is int and value == 1):
            sig[name], constexprs[name] = "constexpr", value
            continue
        if isinstance(value, torch.Tensor):
            sig[name] = "*" + _POINTER_TYPES[str(value.dtype).removeprefix("torch.")]
            divisible = value.data_ptr() % 16 == 0
        elif isinstance(value, bool):
            sig[name], divisible = "u1", False
        elif isinstance(value, float):
            sig[name], divisible = "fp32", False
        else:
            sig[name] = "i32" if -(2**31) <= value < 2**31 else "i64" if value < 2**63 else "u64"
            divisible = value % 16 == 0
        if divisible and specialize and not param.do_not_specialize_on_alignment:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, constexprs, attrs


def build_launch(kernel, args: tuple, kwargs: dict, use_gdc: bool | int = True):
    """`kernel` compiled for sm_90 as the launch `kernel[grid](*args, **kwargs)` builds it (`launch_signature`, and
    the launch's num_warps / num_stages; `launch_pdl` is a launch option only), with the PDL wait a CUDA launch on
    sm_90 takes (`pdl_args`: USE_GDC, where the kernel has it, set to `use_gdc`; a launch recorded on CPU tensors
    passed False), and its `enable_fp_fusion` where it passes one. Returns (the compiled kernel, its constexprs by
    name)."""
    import triton
    from triton.backends.compiler import GPUTarget

    kwargs = dict(kwargs, **({"USE_GDC": use_gdc} if "USE_GDC" in kernel.arg_names else {}))
    options = {key: kwargs.pop(key) for key in ("num_warps", "num_stages", "maxnreg", "enable_fp_fusion")
               if key in kwargs}
    kwargs.pop("launch_pdl", None)
    sig, constexprs, attrs = launch_signature(kernel, args, kwargs)
    source = triton.compiler.ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget(*SM90), options=options), constexprs


def build_sm90(kernel, constexprs: dict, pointers: dict | None = None, num_warps: int = 4, num_stages: int = 1,
               divisible: tuple[str, ...] = (), floats: tuple[str, ...] = ("eps",)):
    """`kernel` (a `triton.jit` function) compiled for sm_90 from its own parameters: its constexpr parameters from
    `constexprs` (and any other parameter `constexprs` names: what a launch makes of an integer argument equal to
    1; a constexpr parameter it does not name takes its default, as in a launch that does not pass it), pointers
    (`*_ptr`) bf16 unless `pointers` names another type, `eps` fp32, other scalars i32; the arguments named in
    `divisible` marked multiples of 16 (what a launch specializes to for 16-byte aligned tensors and integers
    divisible by 16). As launched only when `divisible` names exactly what the launch marks: prefer recording the
    launch (`record_launches`, `build_launch`)."""
    import triton
    from triton.backends.compiler import GPUTarget

    pointers = pointers or {}
    constexprs = {**{p.name: p.default for p in kernel.params if p.is_constexpr and p.has_default}, **constexprs}
    sig = {arg: "constexpr" if param.is_constexpr or arg in constexprs
           else pointers.get(arg, "*bf16") if arg.endswith("_ptr") else "fp32" if arg in floats else "i32"
           for arg, param in zip(kernel.arg_names, kernel.params)}
    attrs = {(kernel.arg_names.index(arg),): [["tt.divisibility", 16]] for arg in divisible}
    return triton.compile(triton.compiler.ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget(*SM90), options=dict(num_warps=num_warps, num_stages=num_stages))


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
    """A build's resources: registers ("regs"), stack bytes a thread ("stack": where ptxas puts spilled registers,
    so 0 means no spill; cuobjdump's LOCAL stays 0 when it spills and is not reported), shared memory, the programs
    of `num_warps` an SM holds by registers and shared memory (and its 64 warps), and a count of each PTX
    instruction matching the regex `instructions` (registers and stack 0 without the backend's cuobjdump)."""
    import math
    import re
    from collections import Counter

    field = {k: int(v) for k, v in re.findall(r"(REG|STACK|SHARED):(\d+)", resource_usage(compiled.asm["cubin"]))}
    regs, smem = field.get("REG", 0), compiled.metadata.shared
    by_regs = 65536 // (max(1, math.ceil(regs / 8) * 8) * 32 * num_warps) if regs else 0
    by_smem = 233472 // (smem + 1024) if smem else 32
    return {"regs": regs, "stack": field.get("STACK", 0), "smem": smem,
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
