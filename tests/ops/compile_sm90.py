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
POINTERS = ("x_ptr", "nw_ptr", "wgu_ptr", "bgu_ptr", "wd_ptr", "bd_ptr", "r_ptr", "act_ptr", "s_ptr")


def compile_sm90(gate_rows: int, down_rows: int, num_warps: int, num_stages: int, i: int):
    """The CompiledKernel (sm_90, bf16 tensors, no biases), K steps as the op picks them for I = i."""
    import triton
    from triton.backends.compiler import GPUTarget

    from mini_infer.ops import mlp_persistent as mod

    fn = mod._mlp_persistent_kernel
    ints = ("n_hidden", "n_inter", "n_out", "stride_gu", "stride_d")
    sig = {a: "*bf16" if a in POINTERS else "*i32" if a == "words_ptr" else "fp32" if a == "eps"
           else "i32" if a in ints else "constexpr" for a in fn.arg_names}
    constexprs = dict(HAS_GU_BIAS=False, HAS_D_BIAS=False, BLOCK_N_A=gate_rows, BLOCK_K_A=mod.GEMV_CONFIG_SHORT_K[1],
                      BLOCK_N_B=down_rows, BLOCK_K_B=mod.gemv_config(i)[1], PHASES=3, MAX_SPINS=mod.MAX_SPINS,
                      USE_GDC=True)
    return triton.compile(triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=constexprs),
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
