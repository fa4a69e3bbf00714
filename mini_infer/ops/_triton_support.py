"""Optional Triton import and the one dispatch rule shared by every op in this package.

Ops run a Triton kernel when their tensors are on CUDA and Triton imports; otherwise they run their
plain-torch reference. `MINI_INFER_OPS_BACKEND=torch` forces the reference everywhere (for debugging
a suspected kernel bug on a GPU). Must not import anything from mini_infer outside `mini_infer.ops`.
"""

from __future__ import annotations

import functools
import os

import torch

try:  # Triton is optional: CPU-only installs and non-Linux platforms run the torch references.
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # ImportError, or a broken install that fails on import
    triton = None
    tl = None
    HAS_TRITON = False

__all__ = ["HAS_TRITON", "triton", "tl", "use_triton", "next_pow2", "num_sms"]


def use_triton(t: torch.Tensor) -> bool:
    """True when the op should run its Triton kernel for a tensor like `t`."""
    return HAS_TRITON and t.is_cuda and os.environ.get("MINI_INFER_OPS_BACKEND", "") != "torch"


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


@functools.cache
def num_sms(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (cached: used in launch heuristics on every call)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count
