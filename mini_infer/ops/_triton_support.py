"""Optional Triton import and the one dispatch rule shared by every op in this package.

Ops run a Triton kernel when their tensors are on CUDA and Triton imports; otherwise they run their
plain-torch reference. `MINI_INFER_OPS_BACKEND=torch` forces the reference everywhere (for debugging
a suspected kernel bug on a GPU). Must not import anything from mini_infer outside `mini_infer.ops`.

Also the programmatic dependent launch (PDL) switch the kernels share: on Hopper and newer, a kernel launched with
`pdl_args` may start while the kernel before it in the stream is finishing (its programs already resident when
the earlier one ends), and `await_producers` is where each program waits for the earlier kernel's writes. In a
batch-1 decode step, a chain of a few hundred short dependent kernels, that hides ~0.6 us of launch and ramp per
kernel boundary (H200, 112 chained GEMVs of qwen3-0.6b shapes in one CUDA graph: 457 -> 387 us).
`MINI_INFER_PDL=0` turns it off (read at each launch: set it before graphs are captured). And WEIGHT_EVICTION, the
L2 eviction policy of the batch-1 kernels' weight loads (evict_first; its comment below).

PDL_TRIGGER_FIRST (on; `MINI_INFER_PDL_TRIGGER_FIRST=0`, or `--switch _triton_support.PDL_TRIGGER_FIRST=0` in the
benchmarks, turns it off): kernels whose launch allows it let the next kernel launch before their own wait instead
of after it, so that kernels two or more ahead may start (and preload their weights) while this one's producer still
runs; a kernel launches once every program of the one before it has started, so how far ahead is bounded by the
room the SMs have for resident programs. Safe for a kernel X only if X's successor loads nothing before its wait that any kernel of the step
writes (weights, the step's inputs, earlier steps' cache positions): each wait still returns only once the kernel
before has finished, which finished only after its own wait, so every earlier kernel is done by then; only what a
successor loads before its wait can be early. The MoE kernels, whose successors preload the routing's outputs
(tests/ops/test_triton_support.py's PRE_WAIT_POINTERS), never allow it. H200 (bench/RESULTS.md, twenty-fifth
session), batch 1: qwen3-0.6b 1,520.1 / 1,518.6 tok/s against 1,511.9 (round 2), qwen2.5-7b 265.0 against 262.5,
qwen3-30b-a3b 371.8 against 371.7; the nano-vllm workload 23,207.4 against 22,795.3 (bf16 cache), 24,648.1 against
24,646.4 (fp8 cache).
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

__all__ = ["HAS_TRITON", "WEIGHT_EVICTION", "await_producers", "cuda_index", "pdl_args", "triton", "tl", "use_triton",
           "next_pow2", "num_sms"]

# The L2 eviction policy of the weight loads of the one-row GEMV kernels (linear.py's `gemv_load`: every float, int8
# and fp8 GEMV, lm_head's and the MoE decode path's included) and of the MoE GEMMs' decode-shaped launches
# (fused_moe.py): "evict_first" (the default: PTX `createpolicy ... L2::evict_first` with an `L2::cache_hint` on each
# load, so lines streamed once a step give way first and what the step re-reads (activations, norm weights, rotary
# rows, block tables, the KV cache of short contexts) may stay in the 60 MB L2 of an H200 across the gigabytes a
# batch-1 step streams), "evict_last", or "" (no hint; MINI_INFER_WEIGHT_EVICTION=none). H200, batch 1, processes
# alternated (bench/RESULTS.md, thirty-first and thirty-second sessions): qwen2.5-7b w8a8 +2.4% (406.0 / 405.9 against
# 396.3 / 396.3 tok/s), bf16 +1.4% (271.2 / 271.3 against 267.5 / 267.6), llama-3.1-8b +0.9%; fp8, qwen3-0.6b and
# qwen3-30b-a3b unchanged. Read once, at import, because Triton refuses a changed global in a compiled kernel; an A/B
# runs one process per value.
_EVICTION_POLICIES = {"evict_first": "evict_first", "evict_last": "evict_last", "none": "", "": ""}
WEIGHT_EVICTION = os.environ.get("MINI_INFER_WEIGHT_EVICTION", "evict_first")
if WEIGHT_EVICTION not in _EVICTION_POLICIES:
    raise ValueError(f"MINI_INFER_WEIGHT_EVICTION must be evict_first, evict_last or none, got {WEIGHT_EVICTION!r}")
WEIGHT_EVICTION = _EVICTION_POLICIES[WEIGHT_EVICTION]


def use_triton(t: torch.Tensor) -> bool:
    """True when the op should run its Triton kernel for a tensor like `t`."""
    return HAS_TRITON and t.is_cuda and os.environ.get("MINI_INFER_OPS_BACKEND", "") != "torch"


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def cuda_index(device: torch.device) -> int:
    """The index of a CUDA device; the current device for a bare `cuda`."""
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def num_sms(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (cached: used in launch heuristics on every call)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def _pdl_capable(device_index: int) -> bool:
    """sm_90+ NVIDIA GPU and a Triton with the griddepcontrol intrinsics (`tl.extra.cuda.gdc_wait`: older releases
    have neither it nor the `launch_pdl` launch option)."""
    cuda_extra = getattr(getattr(tl, "extra", None), "cuda", None)
    return (torch.version.hip is None and hasattr(cuda_extra, "gdc_wait")
            and torch.cuda.get_device_capability(device_index)[0] >= 9)


# Let the next kernel launch before this one's wait (module docstring); read at each launch.
PDL_TRIGGER_FIRST = os.environ.get("MINI_INFER_PDL_TRIGGER_FIRST", "1") != "0"
TRIGGER_FIRST = 2  # the USE_GDC value of a launch that triggers before its wait


def pdl_args(t: torch.Tensor, trigger_first: bool = True) -> dict:
    """Launch keywords for a kernel that starts with `await_producers`, launched on `t`'s device:
    {"USE_GDC": True, "launch_pdl": True} on a CUDA GPU of compute capability 9.0+ (unless MINI_INFER_PDL=0),
    else {"USE_GDC": False} (the interpreter, older GPUs: an ordinary launch). USE_GDC is TRIGGER_FIRST instead of
    True under PDL_TRIGGER_FIRST for launches that allow it (`trigger_first`: False where the kernel's successor may
    load, before its wait, what a kernel of the step writes)."""
    if (t.is_cuda and os.environ.get("MINI_INFER_PDL", "1") != "0" and not os.environ.get("TRITON_INTERPRET")
            and _pdl_capable(cuda_index(t.device))):
        return {"USE_GDC": TRIGGER_FIRST if PDL_TRIGGER_FIRST and trigger_first else True, "launch_pdl": True}
    return {"USE_GDC": False}


if HAS_TRITON:
    WEIGHT_EVICT = tl.constexpr(WEIGHT_EVICTION)  # WEIGHT_EVICTION, for @triton.jit code

    @triton.jit
    def await_producers(USE_GDC: tl.constexpr):
        """With USE_GDC (a launch with `pdl_args`): wait until the kernel before this one in the stream has
        finished and its writes are visible (griddepcontrol.wait), then allow the next kernel to launch
        (griddepcontrol.launch_dependents). A kernel calls it first, in every program, before it reads any tensor
        an earlier kernel writes and before any early exit: a program that skips the wait could let this kernel
        finish before its producer, and the kernel after it would then wait on the wrong one. USE_GDC ==
        TRIGGER_FIRST (2): the next kernel is allowed to launch first, then the wait (PDL_TRIGGER_FIRST)."""
        if USE_GDC == 2:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        elif USE_GDC:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
