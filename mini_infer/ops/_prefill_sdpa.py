"""Long query runs of a paged-attention step through torch's fused attention kernels (cuDNN, FlashAttention).

`mini_infer::paged_attention` (ops/paged_attention.py) hands this module each sequence of a step whose query
run is long (`MIN_QUERY_ROWS` rows or more): its queries q [L, Hq, D], its new keys/values k, v [L, Hkv, D|Dv]
and its cached context [C, Hkv, D|Dv] (gathered by the caller; C = 0 for an all-new prompt). Query row j sits
at position C + j and sees every context key plus new keys 0..j (the bottom-right-aligned causal mask):
  * C == 0: one causal call; the mask is square, so top-left and bottom-right alignment agree;
  * C > 0: two calls, the queries over the context keys (no mask: all visible) and over the new keys (causal,
    square), merged with their log-sum-exps. No call relies on how a backend aligns a non-square causal mask
    (torch's cuDNN backend aligns it top-left in some versions and bottom-right in others).
GQA/MQA go to the kernels as they are (they take fewer kv heads) or, for a backend that refuses them, with the
kv heads repeated. Which backends serve a (device, dtype, heads, head dims) is decided once, by running each
on a small problem against a float32 computation (wrong log-sum-exp conventions or refused shapes drop a
backend); none left means the caller keeps those rows on its own kernel. Sliding windows, softcap and fp8 caches
are not modelled here: `route_wanted` keeps such steps on the caller's kernel. Attention sinks (GPT-OSS's per-head
extra logit s_h, in the denominator only) are applied after the kernels: with the run's log-sum-exp lse (of the
merged parts when there is a context), out * sigmoid(lse - s_h), in fp32.

cuDNN builds an execution plan per new shape (44-94 ms on an H200), so the query run is padded at its end from
L rows to `bucket_length(L)` (a ladder of `BUCKET_STEPS` lengths per octave: 4,096, 4,608, ..., 8,192, 9,216, ...)
before any call, and the real L rows of the outputs and log-sum-exps are sliced off after: every run of a bucket is
one shape to the kernels. Exact: the padded keys (zeros) go to the causal square call only, where real row j sees
keys 0..j < L, never a padded one; the padded query rows (zeros: finite scores, finite outputs) are dropped before
the merge, and rows never mix inside attention. The context call keeps its exact C keys (padding keys of an
unmasked call would be seen).

torch's cuDNN plan cache (aten/src/ATen/native/cudnn/MHA.cpp, as read in three versions that have the variable
below, up to the 2026 ones with paged K/V; not run here, bench/kernel_paged_attention.py --plan-reuse shows it): a
thread-local, unbounded map from `MHAParams` (device, dtype, b, h, s_q, s_kv, d_qk, d_v, q/k/v dims and strides,
bias, dropout, causal flag, whether stats are returned, `use_ragged`; newer versions add the output's and the
stats' dims and strides) to a built graph; a miss runs validate, build_operation_graph, create_execution_plans,
check_support and build_plans. `TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1` (read once, at the first cuDNN attention
call) makes `use_ragged_in_dense` true for any call without a bias whose q, k, v and output are BSHD-contiguous
(`x.transpose(1, 2).is_contiguous()`: every call here, the packed token layout; there is no condition on the
causal flag), and then the key holds s_q, s_kv and the q/k/v sequence dims rounded up to powers of two and no
batch stride (the kernel gets the exact lengths as ragged offsets and sequence lengths). So, per (heads, dims,
dtype): the causal call of a bucket is one plan (two: with and without the log-sum-exp), whatever the torch
version; the context call is one plan per (bucket, C rounded up to a power of two) with the variable, per
(bucket, C) without it. Without the bucketing the versions whose key holds the output's exact dims would build a
plan per L even with the variable. Importing this module sets the variable when the environment turns the route
on (the default: "auto") and does not already say otherwise ("0" keeps one plan per exact shape).

`ROUTE` ("auto": CUDA tensors only, the default; "on": every device, which is how tests and benchmarks force this
route on CPU; "off": never), `MIN_QUERY_ROWS` and `BUCKET_STEPS` are module-level switches read on every call;
`MINI_INFER_PREFILL_ROUTE` in the environment sets ROUTE (`=off` turns the route off). The route's one-time
set-up (cuDNN initialisation, the backend probe, the first plans: ~3.7 s on an H200) is paid at engine start-up,
which runs a lone prompt's longest chunks once when the paged_attention pass declared the route's length
(runtime/warmup.py); a process that calls the op without an engine pays it at its first long run.

This module must not write the caches, read block tables or sync with the device (but for the one-time probe
of a new head/dtype combination, made at the first call, in warm-up): the caller reads the step's lengths
(outside CUDA-graph capture only) and gathers the context. It imports nothing from mini_infer.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["BUCKET_STEPS", "MIN_QUERY_ROWS", "ROUTE", "attend_run", "bucket_length", "route_min_query_rows",
           "route_wanted"]

# "auto" | "on" | "off", see the module docstring; the environment's MINI_INFER_PREFILL_ROUTE overrides the default.
# "auto" by default: warm, the route made TTFT of a 32,000-token prompt on qwen2.5-7b (H200, 8,192-token chunks)
# 1,240.5 ms against 1,341.4 ms without it (bench/RESULTS.md, "Long-prompt prefill through cuDNN"); cold, the first
# long prompt paid ~3.7 s of one-time set-up, which the engine now pays at start-up (runtime/warmup.py).
ROUTE = os.environ.get("MINI_INFER_PREFILL_ROUTE", "auto")
if ROUTE != "off":  # a process-wide torch setting: only when the route may run (see the module docstring)
    os.environ.setdefault("TORCH_CUDNN_SDPA_AVOID_RECOMPILE", "1")

# Shortest query run taken through the fused kernels (a step holding no such run never reads its lengths on
# the host). H200, bench/kernel_paged_attention.py --prefill (one sequence, causal, bf16, D 128): cuDNN through
# the op is 0.99-1.01x cuDNN alone at 16k-32k new tokens (518-555 TFLOP/s vs the Triton kernel's 268-311), and
# 1.5-1.6x the Triton kernel for a 2k chunk over 16k of context; at 512-1024 rows it is 3-5x slower than the
# Triton kernel, at 4096 faster for 28 query heads (381 vs 221) and slower for 16 (106 vs 209, each call
# paying its own host read there; the engine pays one per step).
MIN_QUERY_ROWS = 4096

# Query runs are attended at `bucket_length(L)` rows: BUCKET_STEPS lengths per octave (0: exact lengths). 8 keeps
# the padding under 1/8 of the rows (at most ~27% more work in the causal square call, at L just past a ladder
# length; 0% at a power-of-two chunk such as the engine's 8,192 tokens) for 8 shapes per
# octave: 9 between MIN_QUERY_ROWS and an 8,192-token chunk, 25 up to 32,768. A fixed step of 1,024 would pad up
# to 25% of a 4,097-row run and need a shape per 1,024 rows (29 up to 32,768, 125 up to 131,072).
BUCKET_STEPS = 8

# a backend: (q, k, v as [1, H, S, D] views, causal, scale, want the log-sum-exp) -> (out [1, Hq, L, Dv],
# log-sum-exp with Hq * L elements in natural-log units, or None when not asked for)
Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool, float, bool], tuple]


def _cudnn(q, k, v, causal: bool, scale: float, lse: bool):
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, lse, 0.0, causal, False, scale=scale)
    return out[0], out[1] if lse else None


def _flash(q, k, v, causal: bool, scale: float, lse: bool):
    out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return out[0], out[1]


def _cpu_flash(q, k, v, causal: bool, scale: float, lse: bool):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


@dataclass(frozen=True)
class Backend:
    name: str
    kernel: Kernel
    repeat_kv: bool  # repeat the kv heads to Hq first (for a kernel that refuses GQA)

    def run(self, q, k, v, causal: bool, scale: float, lse: bool):
        g = q.shape[1] // k.shape[1]
        if self.repeat_kv and g > 1:
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        return self.kernel(q, k, v, causal, scale, lse)


# per device type, in order of preference (cuDNN is ~2x FlashAttention-2 on an H200 at long prompts, which
# outweighs repeating the kv heads: a copy of K and V, ~2% of the attention's time at 32k tokens)
BACKENDS: dict[str, list[Backend]] = {
    "cuda": [Backend("cudnn", _cudnn, False), Backend("cudnn+repeat", _cudnn, True),
             Backend("flash", _flash, False), Backend("flash+repeat", _flash, True)],
    "cpu": [Backend("cpu_flash", _cpu_flash, False), Backend("cpu_flash+repeat", _cpu_flash, True)],
}

# what a backend raises for inputs it does not take
_REFUSALS = (RuntimeError, NotImplementedError, ValueError, TypeError)

# (device, dtype, Hq, Hkv, D, Dv) -> the backends that passed the probe, in BACKENDS order
_USABLE: dict[tuple, list[Backend]] = {}


def route_min_query_rows(device: torch.device) -> int | None:
    """The query-run length from which steps on `device` take the route (None: never). A step with such a run
    reads its lengths on the host, which a CUDA graph cannot replay: the runtime runs those steps uncaptured
    (the paged_attention pass declares this number for it)."""
    if ROUTE == "off" or (ROUTE == "auto" and torch.device(device).type != "cuda"):
        return None
    return MIN_QUERY_ROWS


def route_wanted(q: torch.Tensor, k_cache: torch.Tensor, sliding_window: int, softcap: float, kv_fp8: bool) -> bool:
    """Whether a step may send long runs here, from shapes and arguments alone (no device sync): the route is
    on for q's device, the step has MIN_QUERY_ROWS rows or more, no sliding window, softcap or fp8 cache, the
    cache holds q's dtype (the new rows are read from k/v, not the cache), and no CUDA graph is being captured."""
    rows = route_min_query_rows(q.device)
    if rows is None or q.shape[0] < rows:
        return False
    if sliding_window > 0 or softcap > 0 or kv_fp8 or k_cache.dtype != q.dtype:
        return False
    return not (q.is_cuda and torch.cuda.is_current_stream_capturing())


def bucket_length(n: int) -> int:
    """The row count a run of n query rows is attended at: n rounded up to a multiple of 2**floor(log2 n) /
    BUCKET_STEPS (at least 1), so BUCKET_STEPS lengths per octave; n itself when BUCKET_STEPS is 0."""
    if BUCKET_STEPS <= 0 or n <= 1:
        return n
    step = max(1, (1 << (n.bit_length() - 1)) // BUCKET_STEPS)
    return -(-n // step) * step


def _padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x [S, H, D] as a contiguous [rows, H, D] tensor: x's rows, then zeros (x's rows as they are when rows == S
    and x is contiguous)."""
    if rows == x.shape[0]:
        return x.contiguous()
    out = x.new_empty((rows, *x.shape[1:]))
    out[: x.shape[0]].copy_(x)
    out[x.shape[0] :].zero_()
    return out


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[S, H, D] -> a [1, H, S, D] view (the packed token layout is the kernels' BSHD layout)."""
    return x.unsqueeze(0).transpose(1, 2)


def _tokens_first(o: torch.Tensor) -> torch.Tensor:
    """[1, H, L, D] -> [L, H, D]."""
    return o[0].transpose(0, 1)


def _math_attention(q, k, v, causal: bool, scale: float):
    """Float32 attention with its log-sum-exp, for [1, H, S, D] inputs (kv heads repeated): the probe's oracle."""
    g = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(g, dim=1), v.float().repeat_interleave(g, dim=1)
    s = q.float() @ k.transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v, s.logsumexp(-1)


def _passes_probe(backend: Backend, device: torch.device, dtype: torch.dtype, hq: int, hkv: int, d: int,
                  dv: int) -> bool:
    """Whether `backend` runs these heads and dims and agrees with float32 attention (output and log-sum-exp),
    causal on a square problem and unmasked on a wider one."""
    gen = torch.Generator().manual_seed(0)
    tol = 1e-4 if dtype == torch.float32 else 3e-2

    def rows(n: int, h: int, dim: int) -> torch.Tensor:  # laid out as attend_run's inputs are
        return _heads_first(torch.randn(n, h, dim, generator=gen).to(device, dtype))

    q = rows(80, hq, d)  # lengths that are no power of two (cuDNN's AVOID_RECOMPILE pads them)
    try:
        for causal, keys in ((True, 80), (False, 200)):
            k, v = rows(keys, hkv, d), rows(keys, hkv, dv)
            out, lse = backend.run(q, k, v, causal, d**-0.5, True)
            want_out, want_lse = _math_attention(q, k, v, causal, d**-0.5)
            if out.shape != want_out.shape or not torch.allclose(out.float(), want_out, atol=tol, rtol=tol):
                return False
            if not torch.allclose(lse.float().reshape(want_lse.shape), want_lse, atol=tol, rtol=tol):
                return False
    except _REFUSALS:  # refused: dtype, head dims, GQA, no such kernel (or another signature in this torch)
        return False
    return True


def usable_backends(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[Backend]:
    """The backends that serve q/k/v's device, dtype, heads and head dims (probed on first use)."""
    key = (q.device, q.dtype, q.shape[1], k.shape[1], q.shape[2], v.shape[2])
    if key not in _USABLE:
        _USABLE[key] = [b for b in BACKENDS.get(q.device.type, []) if _passes_probe(b, q.device, *key[1:])]
    return _USABLE[key]


def _merge(o_ctx, lse_ctx, o_new, lse_new) -> torch.Tensor:
    """Attention over context + new keys from the two parts (outputs [1, Hq, L, Dv], log-sum-exps [Hq, L]):
    weights exp(lse) / (exp(lse_ctx) + exp(lse_new)), i.e. the context part's weight is
    sigmoid(lse_ctx - lse_new). Out [L, Hq, Dv] in fp32."""
    w_ctx = torch.sigmoid(lse_ctx.float() - lse_new.float()).t()[:, :, None]
    return _tokens_first(o_new).float().lerp_(_tokens_first(o_ctx).float(), w_ctx)


def _with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention out [L, Hq, Dv] with log-sum-exp lse [Hq, L] of its keys, given one more logit a head (the sink,
    [Hq]) that adds to the denominator only: out * sigmoid(lse - sink), in fp32."""
    keep = torch.sigmoid(lse.float() - sinks.float().to(lse.device)[:, None]).t()[:, :, None]
    return out.float() * keep


def _real_rows(o: torch.Tensor, lse: torch.Tensor | None, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The first n query rows of a padded call's output [1, Hq, L', Dv] and log-sum-exp (any layout holding
    Hq * L' elements, head-major) as [1, Hq, n, Dv] and [Hq, n]."""
    hq = o.shape[1]
    return o[:, :, :n], None if lse is None else lse.reshape(hq, -1)[:, :n]


def attend_run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_ctx: torch.Tensor, v_ctx: torch.Tensor,
               scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor | None:
    """Attention of one sequence's query run: q [L, Hq, D] at positions C .. C+L-1 over the context keys/values
    k_ctx, v_ctx [C, Hkv, D|Dv] (C may be 0) and the run's own k, v [L, Hkv, D|Dv], causal; with `sinks` [Hq],
    each head's sink logit in the softmax's denominator. Returns [L, Hq, Dv] in q's dtype, or None when no backend
    serves these shapes (the caller computes the run itself). The kernels see the run padded to
    `bucket_length(L)` rows (see the module docstring)."""
    n = q.shape[0]
    rows = bucket_length(n)
    q4, k4, v4 = (_heads_first(_padded(x, rows)) for x in (q, k, v))  # contiguous rows: the BSHD layout
    with_ctx = k_ctx.shape[0] > 0
    for backend in usable_backends(q, k, v):
        try:
            o_new, lse_new = _real_rows(*backend.run(q4, k4, v4, True, scale, with_ctx or sinks is not None), n)
            if not with_ctx:
                if sinks is None:
                    return _tokens_first(o_new)
                return _with_sinks(_tokens_first(o_new), lse_new, sinks).to(q.dtype)
            o_ctx, lse_ctx = _real_rows(*backend.run(q4, _heads_first(k_ctx.contiguous()),
                                                     _heads_first(v_ctx.contiguous()), False, scale, True), n)
        except _REFUSALS:  # a shape this backend refuses: the next one
            continue
        out = _merge(o_ctx, lse_ctx, o_new, lse_new)
        if sinks is not None:
            out = _with_sinks(out, torch.logaddexp(lse_ctx.float(), lse_new.float()), sinks)
        return out.to(q.dtype)
    return None
