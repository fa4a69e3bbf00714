"""Shared bits of the op tests: the device Triton runs on here, and tolerances per dtype."""

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
