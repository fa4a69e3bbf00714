"""ops/_l2_prefetch.py: the GEMV weight prefetch before the PDL wait, checked without a GPU.

The prefetch is inline PTX, which the interpreter cannot run (there USE_GDC is off and the kernels never prefetch:
the op tests cover that path). So this compiles every kernel launched through `launch_gemv` for sm_90 (Triton's
CUDA backend and ptxas run on a CPU-only machine), in a subprocess without TRITON_INTERPRET (under it `triton.jit`
makes interpreter functions, which do not compile), and reads the PTX: with the prefetch on, prefetch
instructions come before `griddepcontrol.wait` and no global load does; with it off, no prefetch at all. Skips
when the CUDA backend or ptxas is unavailable. Also the host policy's off cases (`gemv_prefetch_args`).
"""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch

from mini_infer.ops._l2_prefetch import PREFETCH_OFF, gemv_prefetch_args, prefetch_cap
from tests.ops.helpers import NO_CUDA_BACKEND, requires_triton, run_uninterpreted

# (module, kernel) of every kernel launched through `launch_gemv`
GEMV_KERNELS = [
    ("linear", "_gemv_kernel"),
    ("rms_norm_linear", "_rms_norm_gemv_kernel"),
    ("linear_add", "_gemv_add_kernel"),
    ("silu_mul_linear", "_silu_mul_gemv_kernel"),
    ("int8_linear", "_scaled_gemv_kernel"),
    ("linear_add_rms_norm", "_gemv_add_rms_norm_kernel"),
    ("linear_add_rms_norm", "_scaled_gemv_add_rms_norm_quant_kernel"),
]
ON = {"USE_GDC": True, "PREFETCH_PROGRAMS": 132, "PREFETCH_BYTES": 16 << 20, "PREFETCH_BULK": False}
# (module, kernel, prefetch constexprs, label): every kernel with the line prefetch; the plain GEMV also bulk and off
CASES = [(m, k, ON, "line") for m, k in GEMV_KERNELS] + [
    ("linear", "_gemv_kernel", {**ON, "PREFETCH_BULK": True}, "bulk"),
    ("linear", "_gemv_kernel", {**ON, **PREFETCH_OFF}, "off"),
]
PREFETCH_PTX = re.compile(r"^\s*\{?.*\b(prefetch\.global\.L2::evict_last|cp\.async\.bulk\.prefetch\.L2\.global)\b")


def _compile_cases() -> dict[str, str]:
    """(Run in the subprocess.) The sm_90 PTX of each case, by "module.kernel/label": pointers bf16 except the
    scaled GEMVs' packed int8 (int32 words) and fp32 scales, the other constexprs set to a real launch's."""
    import importlib

    import triton.language as tl

    from tests.ops.compile_sm90 import build_sm90

    pointer = {"x_scale_ptr": "*fp32", "w_scale_ptr": "*fp32", "q_scale_ptr": "*fp32", "cnt_ptr": "*i32",
               "q_ptr": "*i8"}
    common = {"HAS_BIAS": False, "HAS_RESIDUAL": True, "BLOCK_N": 4, "BLOCK_K": 512, "ACC_DTYPE": tl.int32,
              "PACKED": True, "ASM": True, "DOT": False, "NORM_DTYPE": tl.bfloat16, "IS_FP8": False, "QMAX": 127.0,
              "NORM_BLOCK_M": 1, "NORM_BLOCK_N": 1024}
    out = {}
    for module, name, prefetch, label in CASES:
        kernel = getattr(importlib.import_module(f"mini_infer.ops.{module}"), name)
        packed = {"x_ptr": "*i32", "w_ptr": "*i32"} if "scaled" in name else {}  # int8 as int32 words
        constexprs = {arg: prefetch[arg] if arg in prefetch else common[arg]
                      for arg, param in zip(kernel.arg_names, kernel.params) if param.is_constexpr}
        out[f"{module}.{name}/{label}"] = build_sm90(kernel, constexprs, {**pointer, **packed}).asm["ptx"]
    return out


def _main() -> int:
    try:
        import triton
        from triton.backends.compiler import GPUTarget

        @triton.jit
        def _probe(p):
            pass

        src = triton.compiler.ASTSource(fn=_probe, signature={"p": "*i32"})
        triton.compile(src, target=GPUTarget("cuda", 90, 32))
    except Exception as e:  # no CUDA backend or no ptxas here: nothing to check
        print(f"cannot compile for CUDA here: {type(e).__name__}: {e}")
        return NO_CUDA_BACKEND
    print(json.dumps(_compile_cases()))
    return 0


@pytest.fixture(scope="module")
def ptx() -> dict[str, str]:
    return run_uninterpreted([__file__], timeout=900)


def _instructions(text: str) -> list[str]:
    """The PTX's instruction lines (no comments, .loc / .file directives or labels)."""
    lines = (line.split("//")[0].strip() for line in text.splitlines())
    return [line for line in lines if line and not line.startswith(".") and not line.endswith(":")]


def _first(lines: list[str], pattern: str) -> int:
    return next((i for i, line in enumerate(lines) if re.search(pattern, line)), len(lines))


@requires_triton
@pytest.mark.parametrize("case", [f"{m}.{k}/{label}" for m, k, _, label in CASES])
def test_prefetch_ptx(ptx, case):
    lines = _instructions(ptx[case])
    wait = _first(lines, r"griddepcontrol\.wait")
    assert wait < len(lines), "no griddepcontrol.wait: not a PDL kernel"
    assert _first(lines, r"\bld\.global") > wait, "a global load before the wait"
    prefetches = [i for i, line in enumerate(lines) if PREFETCH_PTX.search(line)]
    if case.endswith("/off"):
        assert not prefetches
        return
    kind = "cp.async.bulk.prefetch" if case.endswith("/bulk") else "prefetch.global.L2::evict_last"
    assert prefetches and all(kind in lines[i] for i in prefetches)
    assert max(prefetches) < wait, "a prefetch after the wait"


@pytest.mark.parametrize("cap", ["", "0", "-1"])
def test_policy_off_without_a_cap(monkeypatch, cap):
    monkeypatch.setenv("MINI_INFER_GEMV_PREFETCH", cap)
    prefetch_cap.cache_clear()
    try:
        assert gemv_prefetch_args(torch.zeros(4, 8), True) == PREFETCH_OFF
    finally:
        monkeypatch.undo()
        prefetch_cap.cache_clear()


def test_policy_off_without_pdl_or_alignment(monkeypatch):
    monkeypatch.setenv("MINI_INFER_GEMV_PREFETCH", str(16 << 20))
    prefetch_cap.cache_clear()
    try:
        assert prefetch_cap() == (16 << 20, False)
        assert gemv_prefetch_args(torch.zeros(4, 8), False) == PREFETCH_OFF  # the interpreter, older GPUs
        monkeypatch.setenv("MINI_INFER_GEMV_PREFETCH_MODE", "bulk")
        prefetch_cap.cache_clear()
        assert prefetch_cap() == (16 << 20, True)
        odd = torch.zeros(33, dtype=torch.int8)[1:].view(4, 8)  # one byte past an aligned allocation
        assert gemv_prefetch_args(odd, True) == PREFETCH_OFF  # bulk prefetch needs 16-byte aligned addresses
    finally:
        monkeypatch.undo()
        prefetch_cap.cache_clear()


if __name__ == "__main__":
    sys.exit(_main())
