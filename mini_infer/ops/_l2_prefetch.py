"""L2 prefetch of a GEMV's weights before its programmatic-dependent-launch wait (issue #14 experiment).

A decode GEMV launched with `pdl_args` has its first programs resident while the kernel before it (attention,
rotary, silu, another GEMV) still runs; they sit in `await_producers` and DRAM idles around the short kernels.
Weights never depend on an earlier kernel, so those programs may start pulling them into L2 before they wait:
`prefetch_then_await` has each of the first PREFETCH_PROGRAMS programs issue L2 prefetches (no registers, no data
dependence) over its share of the weight's first PREFETCH_BYTES bytes, then runs `await_producers`; the GEMV
then reads those bytes from L2. Two ways to prefetch (PREFETCH_BULK): one `prefetch.global.L2::evict_last` per
128-byte line (sm_80+), or one `cp.async.bulk.prefetch.L2.global` per thread over a contiguous piece (sm_90+,
the copy engine walks the lines). Both are hints: a prefetch never faults and never changes a result.

The policy (`gemv_prefetch_args`): off unless `MINI_INFER_GEMV_PREFETCH` (a byte cap, read once per process:
`prefetch_cap.cache_clear()` re-reads it) is a positive number; only with PDL (the interpreter and older GPUs run
no PTX and never prefetch); the SM count as PREFETCH_PROGRAMS. Off means PREFETCH_BYTES 0: the kernels then
compile to exactly the code they had before. Must not read or write anything but the weight's own bytes, and
must not import anything from mini_infer outside `mini_infer.ops`.
"""

from __future__ import annotations

import functools
import os

import torch

from mini_infer.ops._triton_support import HAS_TRITON, await_producers, num_sms, tl, triton

__all__ = ["PREFETCH_LINE", "PREFETCH_OFF", "gemv_prefetch_args", "prefetch_cap", "prefetch_then_await"]

PREFETCH_LINE = 128  # bytes per L2 line; also the lanes of one prefetch step (one per thread at 4 warps)
PREFETCH_OFF = {"PREFETCH_PROGRAMS": 0, "PREFETCH_BYTES": 0, "PREFETCH_BULK": False}


@functools.cache
def prefetch_cap() -> tuple[int, bool]:
    """(byte cap, bulk) from the environment: `MINI_INFER_GEMV_PREFETCH` bytes (unset, empty or "0": off), and
    `MINI_INFER_GEMV_PREFETCH_MODE` "bulk" for `cp.async.bulk.prefetch` (else one prefetch per line). Cached: a
    launch reads it once per process; call `prefetch_cap.cache_clear()` after changing either (benches)."""
    cap = int(os.environ.get("MINI_INFER_GEMV_PREFETCH", "0") or 0)
    return max(cap, 0), os.environ.get("MINI_INFER_GEMV_PREFETCH_MODE", "line") == "bulk"


def gemv_prefetch_args(weight: torch.Tensor, use_gdc: bool) -> dict:
    """The prefetch constexprs of a GEMV launch over `weight` (unit stride along K): PREFETCH_PROGRAMS (the SM
    count), PREFETCH_BYTES (the cap; the kernel prefetches at most the weight's extent) and PREFETCH_BULK, or
    `PREFETCH_OFF` without PDL (`use_gdc`), with no cap, or for bulk prefetch from a weight not 16-byte aligned.
    The values depend on the device and the environment only: a captured graph keeps its kernels."""
    cap, bulk = prefetch_cap()
    if not use_gdc or cap <= 0 or (bulk and weight.data_ptr() % 16):
        return PREFETCH_OFF
    return {"PREFETCH_PROGRAMS": num_sms(weight.device.index if weight.device.index is not None
                                         else torch.cuda.current_device()),
            "PREFETCH_BYTES": cap, "PREFETCH_BULK": bulk}


if HAS_TRITON:
    _LINE = tl.constexpr(PREFETCH_LINE)

    @triton.jit
    def _prefetch_l2_lines(addr, ok):
        """One `prefetch.global.L2::evict_last` per lane whose `ok` is set (a predicate inside the asm: prefetch
        has no mask). The dummy output is what `inline_asm_elementwise` requires; not pure, so it stays."""
        return tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0; }",
            "=r,l,r", [addr, ok.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _prefetch_l2_bulk(addr, size):
        """One `cp.async.bulk.prefetch.L2.global [addr], size` per lane with size > 0 (16-byte multiples from a
        16-byte aligned addr; sm_90+)."""
        return tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _prefetch_share(w_ptr, N, K, stride_wn, PREFETCH_PROGRAMS: tl.constexpr, PREFETCH_BYTES: tl.constexpr,
                        PREFETCH_BULK: tl.constexpr):
        """This program's share of the first min(extent, PREFETCH_BYTES) bytes of the row-major weight w [N, K]
        (row stride stride_wn elements; extent ((N - 1) * stride_wn + K) elements), prefetched into L2: program
        p < P = min(programs, PREFETCH_PROGRAMS) takes bytes [p * c, (p + 1) * c), c = that total / P rounded up
        to whole lines; the others do nothing."""
        pid = tl.program_id(0)
        programs = tl.minimum(tl.num_programs(0), PREFETCH_PROGRAMS)
        if pid < programs:
            extent = ((N - 1).to(tl.int64) * stride_wn + K) * (w_ptr.dtype.element_ty.primitive_bitwidth // 8)
            total = tl.minimum(extent, PREFETCH_BYTES)
            share = tl.cdiv(tl.cdiv(total, programs), _LINE) * _LINE
            start = pid.to(tl.int64) * share
            end = tl.minimum(start + share, total)
            base = w_ptr.to(tl.pointer_type(tl.int8), bitcast=True)
            lane = tl.arange(0, _LINE).to(tl.int64)
            if PREFETCH_BULK:
                # one contiguous piece per lane, in 16-byte multiples (a tail under 16 bytes is left out)
                piece = tl.cdiv(tl.cdiv(share, _LINE), 16) * 16
                lo = start + lane * piece
                size = (tl.minimum(lo + piece, end) - lo) // 16 * 16
                _prefetch_l2_bulk(base + lo, tl.maximum(size, 0).to(tl.int32))
            else:
                for off in range(start, end, _LINE * _LINE):
                    line = off + lane * _LINE
                    _prefetch_l2_lines(base + line, line < end)

    @triton.jit
    def prefetch_then_await(w_ptr, N, K, stride_wn, USE_GDC: tl.constexpr, PREFETCH_PROGRAMS: tl.constexpr,
                            PREFETCH_BYTES: tl.constexpr, PREFETCH_BULK: tl.constexpr):
        """`await_producers(USE_GDC)`, with (USE_GDC and PREFETCH_BYTES > 0) this program's share of the GEMV's
        weight w [N, K] (row stride stride_wn) prefetched into L2 first (`_prefetch_share`). Before the wait it
        touches nothing an earlier kernel writes: the weight's bytes only, as a cache hint. PREFETCH_BYTES 0:
        exactly `await_producers`."""
        if USE_GDC and PREFETCH_BYTES > 0:
            _prefetch_share(w_ptr, N, K, stride_wn, PREFETCH_PROGRAMS, PREFETCH_BYTES, PREFETCH_BULK)
        await_producers(USE_GDC)
