"""`mini_infer::rotary_paged_attention`: `qk_rotary` then `paged_attention`, where a decode step's attention launch
applies the q/k norms and the rotary itself: one kernel a layer instead of two.

Inserted by the FuseRotaryAttention pass in place of a layer's `qk_rotary` and the `paged_attention` reading its
outputs. Semantics (must not change), with `pack(x) = x.select(0, 0).transpose(0, 1)` (the paged_attention pass's
[1, H, T, D] -> [T, H, D] view):
    q2, k2 = qk_rotary(q, k, cos, sin, q_weight, k_weight, eps)
    out = paged_attention(pack(q2), pack(k2), pack(v), k_cache, v_cache, slot_mapping, block_tables, seq_lens,
                          query_start_loc, scale, sliding_window, softcap, k_scale, v_scale, sinks)
Layouts: q [1, Hq, T, D], k [1, Hk, T, D], v [1, Hk, T, Dv] (any strides: views of the merged projection), cos/sin
as qk_rotary takes them (broadcastable to [1, 1, T, D]: packed token r takes cos row r), the rest as paged_attention
takes it (its module docstring; `sinks`, the attention sinks [Hq] or None, is its last argument here too).
Returns [T, Hq, Dv]; mutates only k_cache / v_cache.

Implementations: the reference is the two references in sequence (`qk_rotary_reference`, then paged_attention's,
its long-run route included in the registered op's body). The Triton path runs ONE kernel, paged_attention's
`_paged_attn_kernel` with its ROTARY switch (the q rows and the k rows it writes go through `_rotary.rotated_pairs`,
qk_rotary's math and roundings: the same bits as the two kernels), where `paged_attention.rotary_in_kernel` takes the
launch (decode-shaped, so the attention kernel writes the step's keys itself; a power-of-two head dim of 16 or
more), the long-run route declines the step, qk_rotary's outputs keep q's and k's dtypes, and the query group is at
most `max_group` heads (ROTARY_MAX_GROUP_SPLIT for split launches, ROTARY_MAX_GROUP for one-split ones; the
measurements are beside them). Every other step runs `qk_rotary_triton`, then paged_attention's Triton body: the
values of the unfused pair, in two launches or more.
Imports nothing from mini_infer outside `mini_infer.ops`.
"""

from __future__ import annotations

import torch

from mini_infer.ops import _prefill_sdpa, _split_k
from mini_infer.ops import paged_attention as pa
from mini_infer.ops._triton_support import HAS_TRITON, use_triton
from mini_infer.ops.qk_rotary import _check, _out_dtype, qk_rotary_reference, qk_rotary_triton

__all__ = [
    "ROTARY_MAX_GROUP",
    "ROTARY_MAX_GROUP_SPLIT",
    "max_group",
    "rotary_paged_attention",
    "rotary_paged_attention_reference",
    "rotary_paged_attention_triton",
]


# The one-kernel path only for query groups (query heads per kv head) up to these sizes. A program rotates (and, with
# Qwen3's head norms, normalizes) every q head of its group before its key loop. H200, bf16, batch 1:
# - 2026-11-24 (`bench/latency.py --without fuse_rotary_attention`, each pair in one run; decode launches then 128
#   keys / 4 warps): it won where the group is small and lost where it is large: qwen3-0.6b (group 2, head norms)
#   1,258.0 tok/s vs 1,245.6 unfused; qwen2.5-7b (group 7) 249.1 vs 249.0; qwen3-30b-a3b (group 8, head norms)
#   339.4 vs 345.3.
# - 2026-11-25, after split launches took the "decode_split" shape (64 keys / 8 warps, first tile loaded before the
#   PDL wait), `bench/latency.py --switch rotary_paged_attention.ROTARY_MAX_GROUP=...`, engines in one process:
#   qwen3-30b-a3b (8) 369.2 vs 361.7; llama-3.1-8b (4) 234.4 / 234.4 vs 233.4 / 233.1 (two rounds); mistral-7b (4)
#   245.0 / 245.0 vs 244.3 / 244.2, and 247.0 vs 246.4 in another run; qwen2.5-7b (7) 254.3 vs 253.6.
# - 2026-11-29, the nano-vllm throughput workload (qwen3-0.6b, group 2, decode batches up to 256: one-split launches;
#   `bench/throughput.py --switch rotary_paged_attention.ROTARY_MAX_GROUP=0`): 22,175.5 output tok/s with the rotary
#   in the kernel, 23,375.3 with the two kernels (decode steps 5.3 -> 5.0 ms; fp8 cache 22,292.7 -> 22,714.3). A
#   batch-256 step's attention took 3,960 us in the kernel with the rotary, 3,442 us without it (+ the qk_rotary
#   kernels), `bench/profile_decode.py --batch 256 --prompt-len 600 [--without fuse_rotary_attention]`.
# So split launches (small batches: fewer sequence x kv-head programs than SMs, `_split_k.splits_pay`) take groups
# up to ROTARY_MAX_GROUP_SPLIT; one-split launches (large batches) take none (0): the two kernels.
ROTARY_MAX_GROUP = 0
ROTARY_MAX_GROUP_SPLIT = 8


def _pack(x: torch.Tensor) -> torch.Tensor:
    """[1, H, T, D] -> the packed token layout [T, H, D], a view (the paged_attention pass's packing)."""
    return x.select(0, 0).transpose(0, 1)


def _packed_args(q2, k2, v, k_cache, v_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale,
                 sliding_window, softcap, k_scale, v_scale, sinks=None) -> tuple:  # fmt: skip
    """paged_attention's arguments for the rotated q2 / k2 (4-D)."""
    return (_pack(q2), _pack(k2), _pack(v), k_cache, v_cache, slot_mapping, block_tables, seq_lens, query_start_loc,
            scale, sliding_window, softcap, k_scale, v_scale, sinks)


def rotary_paged_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float, k_cache: torch.Tensor,
    v_cache: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor, scale: float, sliding_window: int = 0, softcap: float = 0.0,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Plain torch: `qk_rotary_reference`, then `paged_attention_reference` of the packed rotated q and k."""
    q2, k2 = qk_rotary_reference(q, k, cos, sin, q_weight, k_weight, eps)
    return pa.paged_attention_reference(*_packed_args(q2, k2, v, k_cache, v_cache, slot_mapping, block_tables,
                                                      seq_lens, query_start_loc, scale, sliding_window, softcap,
                                                      k_scale, v_scale, sinks))


def max_group(q: torch.Tensor, k: torch.Tensor, seq_lens: torch.Tensor, num_splits: int | None) -> int:
    """The largest query group the one-kernel path takes for this launch (q [1, Hq, T, D], k [1, Hkv, T, D]):
    ROTARY_MAX_GROUP_SPLIT where the attention launch splits its key ranges (`num_splits` > 1, or by default a small
    batch: `_split_k.splits_pay`), else ROTARY_MAX_GROUP."""
    split = _split_k.splits_pay(q, seq_lens.shape[0], k.shape[1], num_splits)
    return ROTARY_MAX_GROUP_SPLIT if split else ROTARY_MAX_GROUP


def _in_kernel(q, k, v, cos, sin, q_weight, k_weight, k_cache, v_cache, seq_lens, k_scale, v_scale,
               decode_only, num_splits=None) -> bool:  # fmt: skip
    """Whether the attention launch applies the rotary itself: `pa.rotary_in_kernel`'s shapes, qk_rotary's outputs
    in q's and k's own dtypes (the kernel rounds the rotated rows to those), and a query group of at most
    `max_group` heads (where it was measured to win)."""
    if q.dim() != 4 or q.shape[0] != 1 or k.dim() != 4 or v.dim() != 4:
        return False
    if _out_dtype(q, q_weight, cos, sin) != q.dtype or _out_dtype(k, k_weight, cos, sin) != k.dtype:
        return False
    if q.shape[1] > max_group(q, k, seq_lens, num_splits) * k.shape[1]:
        return False
    kv_fp8 = pa.check_kv_scales(k_cache, v_cache, k_scale, v_scale)
    return pa.rotary_in_kernel(_pack(q), _pack(k), k_cache, seq_lens, kv_fp8, decode_only, num_splits)


def _rotary(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_weight, k_weight, eps: float) -> pa.Rotary:
    """The kernel's rotary operands: cos / sin as [T, D] rows (views; stride 0 where they broadcast)."""
    _, _, t, d = q.shape
    rows = (x.expand(1, 1, t, d)[0, 0] for x in (cos, sin))
    return pa.Rotary(*rows, *(w.contiguous() if w is not None else None for w in (q_weight, k_weight)), float(eps))


def rotary_paged_attention_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float, k_cache: torch.Tensor,
    v_cache: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor, scale: float, sliding_window: int = 0, softcap: float = 0.0,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
    **knobs,
) -> torch.Tensor:  # fmt: skip
    """Triton: one attention launch applying the rotary where it can (module docstring), else `qk_rotary_triton`
    then `paged_attention_triton`. `knobs`: paged_attention_triton's (decode_only, num_splits, fused_merge)."""
    if not HAS_TRITON:
        raise RuntimeError("rotary_paged_attention_triton needs triton")
    _check(q, k, q_weight, k_weight)
    meta = (k_cache, v_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale, sliding_window, softcap,
            k_scale, v_scale, sinks)
    if _in_kernel(q, k, v, cos, sin, q_weight, k_weight, k_cache, v_cache, seq_lens, k_scale, v_scale,
                  knobs.get("decode_only"), knobs.get("num_splits")):
        return pa.paged_attention_triton(*_packed_args(q, k, v, *meta), **knobs,
                                         rotary=_rotary(q, cos, sin, q_weight, k_weight, eps))
    q2, k2 = qk_rotary_triton(q, k, cos, sin, q_weight, k_weight, eps)
    return pa.paged_attention_triton(*_packed_args(q2, k2, v, *meta), **knobs)


def _routed(q, k, v, cos, sin, q_weight, k_weight, eps, k_cache, v_cache, slot_mapping, block_tables, seq_lens,
            query_start_loc, scale, sliding_window, softcap, k_scale=None, v_scale=None, sinks=None, *,
            use_triton_kernel: bool):
    """The registered op's body: where paged_attention's body would run its whole Triton implementation (the
    long-run route declines the step), `rotary_paged_attention_triton`; else qk_rotary (Triton or reference), then
    paged_attention's body (`pa.paged_attention_<backend>_entry`), route included."""
    meta = (k_cache, v_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale, sliding_window, softcap,
            k_scale, v_scale, sinks)
    if use_triton_kernel:
        kv_fp8 = pa.check_kv_scales(k_cache, v_cache, k_scale, v_scale)
        if seq_lens.shape[0] == 0 or not _prefill_sdpa.route_wanted(_pack(q), k_cache, sliding_window, softcap,
                                                                     kv_fp8):
            return rotary_paged_attention_triton(q, k, v, cos, sin, q_weight, k_weight, eps, *meta)
    rotate = qk_rotary_triton if use_triton_kernel else qk_rotary_reference
    entry = pa.paged_attention_triton_entry if use_triton_kernel else pa.paged_attention_reference_entry
    q2, k2 = rotate(q, k, cos, sin, q_weight, k_weight, eps)
    return entry(*_packed_args(q2, k2, v, *meta))


def rotary_paged_attention_triton_entry(*args, **kwargs) -> torch.Tensor:
    """The registered op's body on the Triton path (what compiled graphs call directly: ops.kernel_impls)."""
    return _routed(*args, **kwargs, use_triton_kernel=True)


def rotary_paged_attention_reference_entry(*args, **kwargs) -> torch.Tensor:
    """The registered op's body on the torch-reference path (ops.kernel_impls)."""
    return _routed(*args, **kwargs, use_triton_kernel=False)


@torch.library.custom_op("mini_infer::rotary_paged_attention", mutates_args=("k_cache", "v_cache"))
def rotary_paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float, k_cache: torch.Tensor,
    v_cache: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor, scale: float, sliding_window: int, softcap: float,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """qk_rotary then paged_attention of its packed outputs: Triton on CUDA when available (one launch for decode
    steps), else the torch references."""
    entry = rotary_paged_attention_triton_entry if use_triton(q) else rotary_paged_attention_reference_entry
    return entry(q, k, v, cos, sin, q_weight, k_weight, eps, k_cache, v_cache, slot_mapping, block_tables, seq_lens,
                 query_start_loc, scale, sliding_window, softcap, k_scale, v_scale, sinks)


@rotary_paged_attention.register_fake
def _(q, k, v, cos, sin, q_weight, k_weight, eps, k_cache, v_cache, slot_mapping, block_tables, seq_lens,
      query_start_loc, scale, sliding_window, softcap, k_scale=None, v_scale=None, sinks=None):
    pa.check_kv_scales(k_cache, v_cache, k_scale, v_scale)
    pa.check_sinks(sinks, q.shape[1])
    return q.new_empty((q.shape[2], q.shape[1], v_cache.shape[3]), dtype=_out_dtype(q, q_weight, cos, sin))
