"""Custom ops that the compiler passes insert into FX graphs (`torch.ops.mini_infer.<name>`).

Importing this package registers every op. Each op lives in its own module with three parts: a fake
impl (shapes and dtypes only; works with torch.export's symbolic shapes), `<op>_reference` in plain
torch (the CPU run-time path and the test oracle), and `<op>_triton` (used when the tensors are on
CUDA). The registered op dispatches: CUDA tensors and Triton importable -> Triton, otherwise the
reference (`MINI_INFER_OPS_BACKEND=torch` forces the reference). Triton is optional. Ops import
nothing from mini_infer outside this package.

| op                                                    | returns             | semantics                                             |
|-------------------------------------------------------|---------------------|-------------------------------------------------------|
| rms_norm(x, weight, eps)                              | Tensor              | HF LlamaRMSNorm over the last dim                     |
| fused_add_rms_norm(x, residual, weight, eps)          | (Tensor, Tensor)    | s = x + residual; (rms_norm(s, weight, eps), s)       |
| apply_rotary(x, cos, sin)                             | Tensor (contiguous) | x * cos + rotate_half(x) * sin (HF neox-style)        |
| silu_and_mul(gate, up)                                | Tensor              | silu(gate) * up                                       |
| linear(x, weight, bias)                               | Tensor              | F.linear; a Triton GEMV for one row on CUDA           |
| paged_attention(q, k, v, k_cache!, v_cache!,          | Tensor [T, Hq, Dv]  | write k/v at slot_mapping (negative: skip), then      |
|   slot_mapping, block_tables, seq_lens,               |                     | causal varlen attention over the paged cache; GQA,    |
|   query_start_loc, scale, sliding_window, softcap)    |                     | sliding window (>0), softcap (>0); mutates the caches |

Layouts for paged_attention are in `mini_infer/ops/paged_attention.py`'s docstring. Extra Triton entry
points: `write_kv_cache_triton` and the `decode_only` / `num_splits` knobs of `paged_attention_triton`
(split-K flash-decoding).
"""

from mini_infer.ops import apply_rotary as _apply_rotary_mod  # noqa: F401  (registers the op)
from mini_infer.ops import fused_add_rms_norm as _fused_add_rms_norm_mod  # noqa: F401
from mini_infer.ops import linear as _linear_mod  # noqa: F401
from mini_infer.ops import paged_attention as _paged_attention_mod  # noqa: F401
from mini_infer.ops import rms_norm as _rms_norm_mod  # noqa: F401
from mini_infer.ops import silu_and_mul as _silu_and_mul_mod  # noqa: F401
from mini_infer.ops._triton_support import HAS_TRITON

OPS = ("rms_norm", "fused_add_rms_norm", "apply_rotary", "silu_and_mul", "paged_attention", "linear")


def kernel_impls(backend: str) -> dict:
    """Each registered op overload → the function it dispatches to for `backend` ("reference": the plain-torch
    version, what the ops run on CPU; "triton": the Triton launcher, what they run on CUDA), for callers
    that skip the dispatcher's per-call cost (about 80 us per call)."""
    import torch

    if backend not in ("reference", "triton"):
        raise ValueError(f"backend must be 'reference' or 'triton', got {backend!r}")
    return {getattr(torch.ops.mini_infer, name).default: getattr(globals()[f"_{name}_mod"], f"{name}_{backend}")
            for name in OPS}


def backend_for(device) -> str:
    """The backend the ops pick on `device` (same rule as their dispatch: Triton on CUDA when available)."""
    import os

    import torch

    dev = torch.device(device)
    if dev.type == "cuda" and HAS_TRITON and os.environ.get("MINI_INFER_OPS_BACKEND", "") != "torch":
        return "triton"
    return "reference"


__all__ = ["HAS_TRITON", "OPS", "backend_for", "kernel_impls"]
