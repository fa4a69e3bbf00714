"""Shared bits of the op tests: the device Triton runs on here, tolerances per dtype, and a child process that
compiles kernels for a GPU without the interpreter."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mini_infer.ops import HAS_TRITON

# Triton kernels run on CUDA when there is a GPU, else on CPU tensors under TRITON_INTERPRET=1.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

requires_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

# (atol, rtol). bf16 is loose: one bf16 ulp is 2**-8 relative, and the interpreter truncates
# fp32 -> bf16 instead of rounding to nearest.
TOL = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    atol, rtol = TOL[dtype or expected.dtype]
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=atol, rtol=rtol)


def record_gemv_launches(monkeypatch: pytest.MonkeyPatch, module) -> list:
    """The kernels `module` launches through its `launch_gemv` from now on (each still runs), in order."""
    calls = []
    real = module.launch_gemv
    monkeypatch.setattr(module, "launch_gemv",
                        lambda kernel, *a, **kw: calls.append(kernel) or real(kernel, *a, **kw))
    return calls


def record_kernel_launches(monkeypatch: pytest.MonkeyPatch, module, *names: str, launches: list | None = None,
                           arguments: bool = False) -> list:
    """The names of `module`'s Triton kernels `names` as it launches them from now on (each still runs), appended to
    `launches` (a new list if None, so that several modules can share one record), in order; with `arguments`,
    (grid, keyword arguments) of each launch instead."""
    launches = [] if launches is None else launches

    class Recorded:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            if not arguments:
                launches.append(self.name)
                return self.kernel[grid]

            def launch(*args, **kwargs):
                launches.append((grid, kwargs))
                return self.kernel[grid](*args, **kwargs)
            return launch

    for name in names:
        monkeypatch.setattr(module, name, Recorded(name, getattr(module, name)))
    return launches


def preloaded_and_looped(monkeypatch: pytest.MonkeyPatch, run) -> tuple:
    """`run()`'s result with linear.py's weight preload before the PDL wait on (PRELOAD_MAX_K 8192) and off (0, and no
    prefix: PREFIX_PRELOAD_K 0), and the PRELOAD_K `launch_gemv` gave each preloading launch meanwhile
    (`preload_width`'s results), in order."""
    from mini_infer.ops import linear

    widths = []
    real = linear.preload_width
    monkeypatch.setattr(linear, "preload_width", lambda *a: widths.append(real(*a)) or widths[-1])
    monkeypatch.setattr(linear, "PRELOAD_MAX_K", 8192)
    on = run()
    monkeypatch.setattr(linear, "PRELOAD_MAX_K", 0)
    monkeypatch.setattr(linear, "PREFIX_PRELOAD_K", 0)  # no prefix of the rows either: the K loop alone
    return on, run(), widths


def without_preload(monkeypatch: pytest.MonkeyPatch) -> None:
    """linear.py's weight preload off for the rest of the test: the K loop's sums, so a one-row kernel's bits can be
    compared with gemv_triton's (which waits first for weights over LINEAR_PRELOAD_MAX_BYTES, and under
    `plain_gemv_waits_first` for every weight) on a GPU too (see `assert_loop_sums`)."""
    from mini_infer.ops import linear

    monkeypatch.setattr(linear, "PRELOAD_MAX_K", 0)
    monkeypatch.setattr(linear, "PREFIX_PRELOAD_K", 0)


@pytest.fixture(autouse=True)
def plain_gemv_waits_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """Autouse in a test module that imports it: the plain GEMV (`gemv_triton`) loads its rows after the PDL wait
    whatever its weight's size (linear.LINEAR_PRELOAD_MAX_BYTES 0), as a fused kernel compared with the unfused pair
    does, so both take the K loop's sums on a GPU too."""
    from mini_infer.ops import linear

    monkeypatch.setattr(linear, "LINEAR_PRELOAD_MAX_BYTES", 0)


def assert_loop_sums(preloaded: torch.Tensor, looped: torch.Tensor) -> None:
    """The preload's sums against the K loop's: the same bits under the interpreter (`chunk_sums` adds the chunks in
    the loop's order); on a GPU within fp32 rounding, since the compiler contracts the loop's multiply-adds into FMAs
    (one rounding) where the preload multiplies, then adds."""
    if DEVICE == "cpu":
        assert torch.equal(preloaded, looped)
    else:
        torch.testing.assert_close(preloaded, looped, atol=1e-5, rtol=1e-5)


ROOT = Path(__file__).resolve().parents[2]
NO_CUDA_BACKEND = 77  # a child's exit status when Triton cannot compile for CUDA here (no NVIDIA backend / ptxas)


def run_uninterpreted(args: list[str], timeout: int = 300):
    """`python *args` from the repository root in a process without TRITON_INTERPRET (under it `triton.jit` builds
    interpreted functions, which do not compile for a GPU): skips the test when the child exits NO_CUDA_BACKEND,
    fails on any other error, and returns the JSON of the child's last stdout line (its report)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    run = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if run.returncode == NO_CUDA_BACKEND:
        pytest.skip((run.stdout + run.stderr).strip()[-500:])
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])
