"""Compile mlp_persistent's kernel as a GPU launch builds it (bf16, PHASES=3: the grid barrier, USE_GDC: PDL) for
sm_90 with Triton's CUDA backend, no GPU needed; print one JSON line: the PTX instructions the barrier and PDL
need (found or not), cuobjdump's resource line (registers, shared memory, LOCAL = spill bytes) and the tile.

Run in a process of its own without TRITON_INTERPRET (under the interpreter `triton.jit` builds interpreted
functions, which do not compile): `python -m tests.ops.compile_sm90 [gate_rows down_rows num_warps num_stages I]`.
Exits NO_CUDA_BACKEND (tests/ops/helpers.py) when Triton has no CUDA backend or ptxas (the caller,
`run_uninterpreted`, skips). Used by tests/ops/test_mlp_persistent.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.ops.helpers import NO_CUDA_BACKEND

# the barrier's atomics (arrival acq_rel, generation bump release, the poll's volatile loads and acquire) and PDL's
PTX_NEEDLES = ("griddepcontrol.wait", "griddepcontrol.launch_dependents", "atom.global.gpu.acq_rel.add",
               "red.global.gpu.release.add", "ld.volatile.global", "ld.global.gpu.acquire")


def build_sm90(kernel, constexprs: dict, pointers: dict | None = None, num_warps: int = 4, num_stages: int = 1,
               divisible: tuple[str, ...] = ()):
    """`kernel` (a `triton.jit` function) compiled for sm_90, as a launch builds it: its constexpr parameters from
    `constexprs`, pointers (`*_ptr`) bf16 unless `pointers` names another type, `eps` fp32, other scalars i32; the
    arguments named in `divisible` marked multiples of 16 (what a launch specializes to for 16-byte aligned tensors
    and integers divisible by 16)."""
    import triton
    from triton.backends.compiler import GPUTarget

    pointers = pointers or {}
    sig = {arg: "constexpr" if param.is_constexpr else pointers.get(arg, "*bf16") if arg.endswith("_ptr")
           else "fp32" if arg == "eps" else "i32" for arg, param in zip(kernel.arg_names, kernel.params)}
    attrs = {(kernel.arg_names.index(arg),): [["tt.divisibility", 16]] for arg in divisible}
    return triton.compile(triton.compiler.ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps, num_stages=num_stages))


def compile_sm90(gate_rows: int, down_rows: int, num_warps: int, num_stages: int, i: int):
    """The CompiledKernel (sm_90, bf16 tensors, no biases), K steps as the op picks them for I = i."""
    from mini_infer.ops import mlp_persistent as mod

    constexprs = dict(HAS_GU_BIAS=False, HAS_D_BIAS=False, BLOCK_N_A=gate_rows, BLOCK_K_A=mod.GEMV_CONFIG_SHORT_K[1],
                      BLOCK_N_B=down_rows, BLOCK_K_B=mod.gemv_config(i)[1], PHASES=3, MAX_SPINS=mod.MAX_SPINS,
                      USE_GDC=True)
    return build_sm90(mod._mlp_persistent_kernel, constexprs, {"words_ptr": "*i32"}, num_warps, num_stages)


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


def main(argv: list[str]) -> int:
    if os.environ.get("TRITON_INTERPRET"):
        print("unset TRITON_INTERPRET: interpreted functions do not compile", file=sys.stderr)
        return 2
    gate_rows, down_rows, num_warps, num_stages, i = (int(a) for a in argv) if argv else (4, 2, 4, 1, 3072)
    try:
        import triton.backends.nvidia  # noqa: F401

        kernel = compile_sm90(gate_rows, down_rows, num_warps, num_stages, i)
    except (ImportError, FileNotFoundError, subprocess.CalledProcessError) as exc:
        print(f"no CUDA backend / ptxas: {type(exc).__name__}: {exc}", file=sys.stderr)
        return NO_CUDA_BACKEND
    ptx = kernel.asm["ptx"]
    print(json.dumps({"tile": [gate_rows, down_rows, num_warps, num_stages], "I": i,
                      "ptx": {n: n in ptx for n in PTX_NEEDLES}, "usage": resource_usage(kernel.asm["cubin"])}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
