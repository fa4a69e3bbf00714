"""Probe (not a test, not used by the engine): decode attention over an fp8 paged KV cache, looking for a kernel
that reads the fp8 cache at the copy bandwidth.

    TRITON_INTERPRET=1 python bench/probe_fp8_decode.py --cpu   # every variant vs a torch reference, small shapes
    python bench/probe_fp8_decode.py --sm90                     # CPU, no interpreter: sm_90 builds, regs/smem/...
    python bench/probe_fp8_decode.py [--variants a,b] [--quick] # CUDA: check, then time (CUDA graphs of 28 calls)

`paged_attention_triton`'s unified kernel over an fp8 (e4m3) cache is barely faster than over a bf16 one at large
batch (H200, qwen3-0.6b shapes, b256/ctx2048: 450 us fp8 against 524 us bf16; 2.4 against 4.2 TB/s of K/V).
Here are decode-only kernels (one query row per sequence, no KV write, no key splits, no window or softcap) over
the op's cache layout and inputs: q [S, Hq, D] bf16, k_cache / v_cache [num_blocks, 16, Hkv, D] float8_e4m3fn
with per-layer fp32 scales ([1]; the cache holds k / k_scale), block_tables [S, max_blocks] int32, seq_lens [S]
int32; out [S, Hq, D] bf16. One program per (sequence, kv head) with its G query heads as score rows (padded to
16 for tl.dot). The math is the op's (its "fp16" way): q saturated to fp16, fp8 tiles converted (exactly) to
fp16 for the dots, scores times scale * k_scale in log2 units, online softmax in fp32 with exp2
(`_split_k.online_softmax_step`), p in fp16, the output times v_scale.

Variants, each after more K/V bytes in flight per SM:
  base      the op's loop: one BLOCK_N key tile per step (block-table entries, K, V), for Triton's pipeliner
            (cp.async into shared memory, `num_stages`); VREGS converts the V tile in registers (the op's
            "fp16_vregs" trick) instead of reading its fp8 bytes from shared memory one at a time.
  wide      2 x BLOCK_N keys per step: both halves' block-table entries and raw fp8 K/V tiles loaded at the top
            of the step, then converted and dotted one half at a time.
  prefetch  software prefetch in registers: the next step's raw fp8 K/V tiles (and the block-table entries of
            the step after it) loaded at the top of the current step and carried in the loop (num_stages 1:
            no pipeliner).
  swapab    S^T = K @ Q^T and O^T = V^T @ P^T: keys on the MMA's M side (wgmma on Hopper with M = BLOCK_N,
            N = 16), softmax along the key axis.
  vt        base over a V cache stored transposed per block, [num_blocks, Hkv, D, 16] (`v_transposed`: the
            same values, made once per cache, outside the timed calls; K keeps the op's layout): V^T tiles
            [D, BLOCK_N], keys contiguous, dotted as p @ trans(V^T) as K is in Q @ K^T; whole blocks loaded (a
            mask per block: 16-byte copies), the last partial tile peeled out of the loop to zero its keys past
            the context.
  vt8       vt's layout with keys on the MMA's M side, as swapab, and both dots in e4m3 (q quantized per score row
            to e4m3, scale amax / 448; p * 256 cast to e4m3, the 256 divided out of the output): S^T = K @ q8^T,
            O^T = V^T @ p8^T, K and V^T tiles entering the dots as stored (both K-major, as an e4m3 wgmma needs).
            With a decode tile's 16 rows on M, Triton 3.6 builds e4m3 dots as f16 MMAs after conversions; with the
            keys on M (64+) they are wgmma m64n16k32 e4m3 (Triton 3.6 and 3.9), with no fp8 -> fp16 conversion.
  vt8pv     vt8 with S^T in fp16 (K converted, q as fp16), only P @ V in e4m3.
  vt2h/vt4h vt with a program per (sequence, pack of 2 / 4 adjacent kv heads): the pack's K and V tiles side by side
            ([keys, HP * D], one block-table entry a key for all of them), score rows (head in pack, q head of its
            group) with each row's q in its own head's columns and zeros elsewhere, so one dot gives every row its
            own head's scores (qwen3-0.6b's group of 2: 4 or 8 of the 16 MMA rows used instead of 2), the softmax
            shared by the pack, and each row storing its own head's columns of P @ V. Fewer programs (S * Hkv / HP)
            and waves, more bytes a step: aimed at the op's fixed cost per call at batch 256 (~17-20 us, growing
            with the waves of programs: b64 6.5 us; bench/RESULTS.md, thirty-third session). On an H200
            (`s33_probe_fp8_packed_heads_h200.txt`) the best, vt2h n128 w4 s2 (255 registers, 14 spilled, two
            programs an SM), ran 29.4 / 90.6 / 100.9 / 347.2 us against vt's same loop capped at 128 registers
            (four single-head programs an SM) 30.0 / 92.5 / 101.0 / 351.0 and the op 27.3 / 90.6 / 97.1 / 341.5:
            within 1-2%, the fixed cost unchanged at b256/ctx512. Not taken into the op.

Why vt: P @ V reduces over keys, but the op's V tile [keys, D] has D contiguous. For 16-bit data ldmatrix.trans
gives the MMA's B operand its key pairs; for fp8 bytes Triton reads the V tile from shared memory one byte at a
time (base n128: 128 ld.shared.b8 per 128-key step). K has no such problem (Q @ K^T reduces over D, contiguous);
with V stored keys-contiguous, V takes K's path. tl.trans(_f16(V^T)), _f16(tl.trans(V^T)) and a [keys, D] load
from the transposed layout build alike (same resources and counts, Triton 3.9 and 3.6). A tl.where on the V tile
inside the loop (the last tile's keys past the context; even under an `if`) makes Triton convert V in registers,
store it as fp16 to shared memory and read it back (74,240 B of shared memory at n128): hence the peeled tail.

The CUDA run (qwen3-0.6b's 16 / 8 heads, D 128, batch 64 / 256, context 512 / 2048, block tables 4,096 keys wide
as bench/kernel_paged_attention.py builds them): each variant's max error against the dequantized fp32 reference
and against the op's output, the resources of each build as launched (this Triton), then a table of us per call
(CUDA graph of 28 calls) and GB/s of K/V bytes read, for every variant and launch shape (CONFIGS) and for the op:
fp8 cache with its write (`paged_attention_triton`, what the sweep timed) and without (`_cached_triton`, what the
variants do), the op's "fp16_vregs" way, and a bf16 cache of the same sizes; the copy bandwidth; the best variant.
Exit status 1 if a variant is beyond 2e-2 of the reference.

Note on sm_90 builds (--sm90): a launch specializes 16-aligned pointers and integers divisible by 16
(tt.divisibility); a build without those hints (tests/ops/compile_paged_attention_sm90.py's) loads the fp8 tiles
one byte at a time and Triton's pipeliner leaves them alone, so it shows no cp.async. This script's builds carry
the hints a real launch at the H200 shapes gets.

sm_90 builds of base and vt (--sm90 on the CPU: builds without a GPU, not timed; Triton 3.9.0 / 3.6.0; G 2,
D 128, 4 warps, 3 stages). PTX instructions are static counts in the key loop (one step, LLVM's loop blocks; vt's
peeled tail doubles its whole-kernel counts); "wider" is every other ld.shared (b32/s32/b64, v2, v4); no wgmma:

  build           regs (stack 0)  smem B   ld.shared.b8   wider    ldmatrix   cvt.rn.f16x2.e4m3x2   mma.sync
  base n128          192 / 200     41472     128 / 128   50 / 62     9 / 8          128              64
  base n128 vregs    144 / 156     74240       0 / 0     50 / 46    25 / 24         128              64
  vt   n128          190 / 214     41472       0 / 0     43 / 47    17 / 16         128              64
  vt   n128 vregs    172 / 168     41472       0 / 0     51 / 55     9 / 8          128              64
  base n64           149 / 154     22784      64 / 64    38 / 42     4 / 4           64              32
  vt   n64           142 / 153     23040       0 / 0     31 / 35     8 / 8           64              32

vt has no byte-wise V reads: its V tile reaches the MMA by 8 more ldmatrix.x4 per 128 keys (vregs: 8
ld.shared.v4.b32 instead), from the same shared memory as base (no fp16 copy; base's vregs builds store one and
read it with ldmatrix.trans), and its V copies into shared memory are 16-byte cp.async.cg where base's are 8-byte
cp.async.ca. Same conversions and MMAs as base. On an H200 (2026-11-29, twenty-sixth session,
`s26_probe_fp8_decode_h200.txt`) vt n128 w4 s3 took 0.95-0.97x base's time (per-key masks kept here). The engine
stores its fp8 V cache so by default (`paged_attention.FP8_V_KEYS_CONTIGUOUS`, read without per-key masks,
`V_KEYS_TILES` 3): 13% faster decode steps than the old layout on the nano-vllm workload.

vt8 on an H200 (2026-11-30, thirty-third session, `s33_probe_fp8_vt8_h200.txt`, `s33_probe_fp8_swapped_h200.txt`;
us per call at b64/ctx512, b64/ctx2048, b256/ctx512, b256/ctx2048): vt8 n128 w4 s3 32.6 / 115.3 / 97.3 / 352.0 and
n64 w4 s3 27.0 / 91.7 / 101.9 / 377.3, against the op over the tokens-contiguous V cache the engine stores (the "op
fp8 vkeys" row: whole-block V reads, capped at 128 registers) 27.1 / 88.8 / 96.5 / 333.4: no faster, with e4m3's
rounding of q and p (max error 1.5e-2 against 1e-3). The same swap inside the op (a fifth dot way, built, sm_90 key
loop 0.080 warp instructions a K/V byte against 0.116) timed 34.2 / 117.4 / 102.4 / 359.8: removed again.

Run on an H200 (2026-11-29, bench/RESULTS.md twentieth session, `s20_probe_fp8_decode_h200.txt`): the best variant
is base n128 w4 s3, 0.85-0.92x the op's time without its write, at most 0.66 of the copy bandwidth; wide, prefetch,
swapab and the vregs builds were slower. No variant reads the cache near the copy bandwidth (that run predates vt).
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from mini_infer.ops import _split_k  # noqa: E402
from mini_infer.ops._triton_support import HAS_TRITON, next_pow2, tl, triton  # noqa: E402

if HAS_TRITON:
    from mini_infer.ops.quant import round_to_fp8_e4m3  # noqa: E402

FP8 = torch.float8_e4m3fn
TOL = 2e-2  # bf16 output
TOL_FP32 = 5e-3  # fp32 output (--cpu): the kernel's fp16 rounding of q and p only
# vt8 / vt8pv round p (and vt8 q) to e4m3 (relative 2**-4 each): max errors of 1e-2 to 2e-2 on an H200 (b64-b256,
# context 512-2048) and up to 5e-2 under the interpreter (17-300 keys: the fewer keys, the larger each p)
TOL_E4M3 = 6e-2
E4M3_VARIANTS = ("vt8", "vt8pv")
BLOCK_SIZE = 16
HQ, HKV, D = 16, 8, 128  # qwen3-0.6b
SHAPES = ((64, 512), (64, 2048), (256, 512), (256, 2048))  # (batch, context) on CUDA
LAYERS = 28
VARIANTS = ("base", "wide", "prefetch", "swapab", "vt", "vt8", "vt8pv", "vt2h", "vt4h")  # _probe_kernel's VARIANT is the index here

if HAS_TRITON:
    LOG2E = _split_k.LOG2E

    @triton.jit
    def _pack_rows(G: tl.constexpr, BLOCK_R: tl.constexpr, D: tl.constexpr, HP: tl.constexpr):
        """(q head of each score row [BLOCK_R], mask [BLOCK_R, HP * D] of each row's own kv head's columns, the
        column's dim [HP * D]) of program (sequence, pack of HP kv heads): _setup's packing, which _store undoes."""
        r = tl.arange(0, BLOCK_R)
        c = tl.arange(0, HP * D)
        j = r // G
        head = (tl.program_id(1) * HP + j) * G + r % G
        mine = (r < HP * G)[:, None] & ((c // D)[None, :] == j[:, None])
        return head, mine, c % D

    @triton.jit
    def _setup(q_ptr, ks_ptr, vs_ptr, lens_ptr, bt_ptr, scale, s_qs, s_qh, s_bt,
               G: tl.constexpr, BLOCK_R: tl.constexpr, D: tl.constexpr, HP: tl.constexpr = 1):  # fmt: skip
        """(qv fp16 [BLOCK_R, HP * D], ctx, bt_row, qk_scale (log2 units), v_scale) of program (sequence, pack of
        HP kv heads): score row r is q head (pack * HP + r // G) * G + r % G, its D values in the columns of its kv
        head's place in the pack (r // G) and zeros in the others', so that one dot against a key tile of the
        pack's HP heads side by side gives each row its own head's scores."""
        s = tl.program_id(0).to(tl.int64)
        head, mine, dim = _pack_rows(G, BLOCK_R, D, HP)
        qv = tl.load(q_ptr + s * s_qs + head[:, None] * s_qh + dim[None, :], mask=mine, other=0.0)
        qv = tl.clamp(qv.to(tl.float32), -65504.0, 65504.0).to(tl.float16)  # the op's fp16 dots
        ctx = tl.load(lens_ptr + s)
        qk_scale = scale * tl.load(ks_ptr) * LOG2E
        v_scale = tl.load(vs_ptr)
        return qv, ctx, bt_ptr + s * s_bt, qk_scale, v_scale

    @triton.jit
    def _raw(c_ptr, pblk, koff, k_ok, kvh, s_b, s_o, s_h, D: tl.constexpr):
        """A K or V tile [keys, D] as stored (fp8), zero where not k_ok."""
        d = tl.arange(0, D)
        return tl.load(c_ptr + pblk[:, None] * s_b + koff[:, None] * s_o + kvh * s_h + d[None, :],
                       mask=k_ok[:, None], other=0.0)

    @triton.jit
    def _f16(x, IN_REGISTERS: tl.constexpr):
        """An fp8 tile as fp16 for tl.dot (exact); IN_REGISTERS: the op's `_dot_tile` split-and-join trick, so the
        compiler converts it in registers instead of reading fp8 bytes from shared memory in the dot's layout."""
        if IN_REGISTERS:
            a, b = tl.split(tl.reshape(x, [x.shape[0], x.shape[1] // 2, 2]))
            x = tl.reshape(tl.join(a.to(tl.float16), b.to(tl.float16)), [x.shape[0], x.shape[1]])
        return x.to(tl.float16)

    @triton.jit
    def _scores(qv, kt, start, ctx, m_i, l_i, qk_scale, BLOCK_N: tl.constexpr):
        """A raw fp8 key tile kt [BLOCK_N, D] (keys start ..) against qv, folded into the running softmax:
        (p, alpha, m_i, l_i) of `online_softmax_step`."""
        sc = tl.dot(qv, tl.trans(_f16(kt, False))) * qk_scale
        if start + BLOCK_N > ctx:  # the last tile: keys past the context
            kpos = start + tl.arange(0, BLOCK_N)
            sc = tl.where((kpos < ctx)[None, :], sc, float("-inf"))
        return _split_k.online_softmax_step(sc, m_i, l_i)

    @triton.jit
    def _values(acc, p, alpha, vt, VREGS: tl.constexpr):
        """acc * alpha + p @ vt (vt the raw fp8 value tile)."""
        return acc * alpha[:, None] + tl.dot(p.to(tl.float16), _f16(vt, VREGS))

    @triton.jit
    def _attend(qv, kt, vt, start, ctx, m_i, l_i, acc, qk_scale, BLOCK_N: tl.constexpr, VREGS: tl.constexpr):
        """One key tile (raw fp8 kt, vt [BLOCK_N, D], keys start ..) folded into (m_i, l_i, acc)."""
        p, alpha, m_i, l_i = _scores(qv, kt, start, ctx, m_i, l_i, qk_scale, BLOCK_N)
        return m_i, l_i, _values(acc, p, alpha, vt, VREGS)

    @triton.jit
    def _store(out_ptr, acc, l_i, v_scale, s_os, s_oh, G: tl.constexpr, BLOCK_R: tl.constexpr, D: tl.constexpr,
               HP: tl.constexpr = 1):  # fmt: skip
        """Each score row's output (acc [BLOCK_R, HP * D]: its own kv head's columns; _setup's packing)."""
        s = tl.program_id(0).to(tl.int64)
        head, mine, dim = _pack_rows(G, BLOCK_R, D, HP)
        o = acc * v_scale / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + s * s_os + head[:, None] * s_oh + dim[None, :], o.to(out_ptr.dtype.element_ty), mask=mine)

    @triton.jit
    def _base_loop(qv, ctx, bt_row, qk_scale, kc_ptr, vc_ptr, kvh, s_kb, s_ko, s_kh, s_vb, s_vo, s_vh, m_i, l_i, acc,
                   D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, VREGS: tl.constexpr):  # fmt: skip
        """base: the op's loop, one key tile a step."""
        for start in range(0, ctx, BLOCK_N):
            _, k_ok, pblk, koff = _split_k.key_tile(bt_row, start, ctx, BLOCK_SIZE, BLOCK_N)
            kt = _raw(kc_ptr, pblk, koff, k_ok, kvh, s_kb, s_ko, s_kh, D)
            p, alpha, m_i, l_i = _scores(qv, kt, start, ctx, m_i, l_i, qk_scale, BLOCK_N)
            # V after the scores, as the op: the pipeliner reads each tile from shared memory where it was loaded
            vt = _raw(vc_ptr, pblk, koff, k_ok, kvh, s_vb, s_vo, s_vh, D)
            acc = _values(acc, p, alpha, vt, VREGS)
        return l_i, acc

    @triton.jit
    def _wide_loop(qv, ctx, bt_row, qk_scale, kc_ptr, vc_ptr, kvh, s_kb, s_ko, s_kh, s_vb, s_vo, s_vh, m_i, l_i, acc,
                   D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, VREGS: tl.constexpr):  # fmt: skip
        """wide: 2 x BLOCK_N keys a step."""
        for start in range(0, ctx, 2 * BLOCK_N):
            # both halves' block-table entries first; each tile loaded where it is used (under the pipeliner the
            # global loads of all four are issued a step ahead as cp.async, whatever their place here; in
            # registers, four raw tiles up front spill at 4 warps)
            _, ok0, pb0, koff = _split_k.key_tile(bt_row, start, ctx, BLOCK_SIZE, BLOCK_N)
            _, ok1, pb1, _ = _split_k.key_tile(bt_row, start + BLOCK_N, ctx, BLOCK_SIZE, BLOCK_N)
            k0 = _raw(kc_ptr, pb0, koff, ok0, kvh, s_kb, s_ko, s_kh, D)
            p, alpha, m_i, l_i = _scores(qv, k0, start, ctx, m_i, l_i, qk_scale, BLOCK_N)
            v0 = _raw(vc_ptr, pb0, koff, ok0, kvh, s_vb, s_vo, s_vh, D)
            acc = _values(acc, p, alpha, v0, VREGS)
            # a second half wholly past ctx has every score -inf: p = 0, alpha = 1 (m_i is finite by now)
            k1 = _raw(kc_ptr, pb1, koff, ok1, kvh, s_kb, s_ko, s_kh, D)
            p, alpha, m_i, l_i = _scores(qv, k1, start + BLOCK_N, ctx, m_i, l_i, qk_scale, BLOCK_N)
            v1 = _raw(vc_ptr, pb1, koff, ok1, kvh, s_vb, s_vo, s_vh, D)
            acc = _values(acc, p, alpha, v1, VREGS)
        return l_i, acc

    @triton.jit
    def _prefetch_loop(qv, ctx, bt_row, qk_scale, kc_ptr, vc_ptr, kvh, s_kb, s_ko, s_kh, s_vb, s_vo, s_vh, m_i, l_i,
                       acc, D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                       VREGS: tl.constexpr):  # fmt: skip
        """prefetch: the next step's raw tiles loaded at the top of the current one, carried in the loop."""
        _, ok, pb, koff = _split_k.key_tile(bt_row, 0, ctx, BLOCK_SIZE, BLOCK_N)
        kt = _raw(kc_ptr, pb, koff, ok, kvh, s_kb, s_ko, s_kh, D)
        vt = _raw(vc_ptr, pb, koff, ok, kvh, s_vb, s_vo, s_vh, D)
        _, ok1, pb1, _ = _split_k.key_tile(bt_row, BLOCK_N, ctx, BLOCK_SIZE, BLOCK_N)
        for start in range(0, ctx, BLOCK_N):
            # the next step's tiles (all masked off past ctx: no traffic) and the entries of the one after it
            kn = _raw(kc_ptr, pb1, koff, ok1, kvh, s_kb, s_ko, s_kh, D)
            vn = _raw(vc_ptr, pb1, koff, ok1, kvh, s_vb, s_vo, s_vh, D)
            _, ok2, pb2, _ = _split_k.key_tile(bt_row, start + 2 * BLOCK_N, ctx, BLOCK_SIZE, BLOCK_N)
            m_i, l_i, acc = _attend(qv, kt, vt, start, ctx, m_i, l_i, acc, qk_scale, BLOCK_N, VREGS)
            kt, vt, ok1, pb1 = kn, vn, ok2, pb2
        return l_i, acc

    @triton.jit
    def _swapab_loop(qv, ctx, bt_row, qk_scale, kc_ptr, vc_ptr, kvh, s_kb, s_ko, s_kh, s_vb, s_vo, s_vh, m_i, l_i,
                     acc, D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                     VREGS: tl.constexpr):  # fmt: skip
        """swapab: S^T = K @ Q^T, O^T = V^T @ P^T, softmax along the key axis (axis 0)."""
        q_t = tl.trans(qv)  # [D, BLOCK_R]
        acc_t = tl.trans(acc)
        for start in range(0, ctx, BLOCK_N):
            kpos, k_ok, pblk, koff = _split_k.key_tile(bt_row, start, ctx, BLOCK_SIZE, BLOCK_N)
            kt = _raw(kc_ptr, pblk, koff, k_ok, kvh, s_kb, s_ko, s_kh, D)
            sc = tl.dot(_f16(kt, False), q_t) * qk_scale  # [BLOCK_N, BLOCK_R]: S^T
            if start + BLOCK_N > ctx:
                sc = tl.where(k_ok[:, None], sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, axis=0))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(sc - m_ref[None, :])
            alpha = tl.exp2(m_i - m_ref)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            m_i = m_new
            vt = _raw(vc_ptr, pblk, koff, k_ok, kvh, s_vb, s_vo, s_vh, D)
            acc_t = acc_t * alpha[None, :] + tl.dot(tl.trans(_f16(vt, VREGS)), p.to(tl.float16))  # O^T
        return l_i, tl.trans(acc_t)

    @triton.jit
    def _vt_step(qv, start, ctx, ctx_blk, bt_row, qk_scale, kc_ptr, vc_ptr, kvh, s_kb, s_ko, s_kh, s_vb, s_vd, s_vh,
                 m_i, l_i, acc, D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                 VREGS: tl.constexpr, TAIL: tl.constexpr):  # fmt: skip
        """vt: base's step over keys start .. with V^T tiles [D, BLOCK_N] from the transposed V cache, whole blocks
        (mask per block, so that each D row's BLOCK_SIZE keys load as one 16-byte vector); TAIL: the last tile,
        its keys past ctx zeroed (whatever the block holds there: 0 * NaN is NaN)."""
        kpos, blk_ok, pblk, koff = _split_k.key_tile(bt_row, start, ctx_blk, BLOCK_SIZE, BLOCK_N)
        k_ok = kpos < ctx
        kt = _raw(kc_ptr, pblk, koff, k_ok, kvh, s_kb, s_ko, s_kh, D)
        p, alpha, m_i, l_i = _scores(qv, kt, start, ctx, m_i, l_i, qk_scale, BLOCK_N)
        d = tl.arange(0, D)
        v_tr = tl.load(vc_ptr + pblk[None, :] * s_vb + kvh * s_vh + d[:, None] * s_vd + koff[None, :],
                       mask=blk_ok[None, :], other=0.0)
        vf = tl.trans(_f16(v_tr, VREGS))  # [BLOCK_N, D], as _scores's K^T: the reduction axis contiguous
        if TAIL:
            vf = tl.where(k_ok[:, None], vf, 0.0)
        return m_i, l_i, acc * alpha[:, None] + tl.dot(p.to(tl.float16), vf)

    @triton.jit
    def _vt_loop(qv, ctx, bt_row, qk_scale, kc_ptr, vc_ptr, kvh, s_kb, s_ko, s_kh, s_vb, s_vd, s_vh, m_i, l_i, acc,
                 D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, VREGS: tl.constexpr):  # fmt: skip
        """vt: the V cache stored transposed per block, [blocks, Hkv, D, BLOCK_SIZE] (s_vd the stride of D, keys
        contiguous); the whole tiles in the loop, a last partial one after it (a tl.where on the V tile inside the
        loop, even under an `if`, makes Triton store the converted fp16 tile to shared memory and read it back)."""
        ctx_blk = tl.cdiv(ctx, BLOCK_SIZE) * BLOCK_SIZE  # the context's blocks, whole
        n_full = ctx // BLOCK_N * BLOCK_N
        for start in range(0, n_full, BLOCK_N):
            m_i, l_i, acc = _vt_step(qv, start, ctx, ctx_blk, bt_row, qk_scale, kc_ptr, vc_ptr, kvh, s_kb, s_ko, s_kh,
                                     s_vb, s_vd, s_vh, m_i, l_i, acc, D, BLOCK_SIZE, BLOCK_N, VREGS, False)
        if n_full < ctx:
            m_i, l_i, acc = _vt_step(qv, n_full, ctx, ctx_blk, bt_row, qk_scale, kc_ptr, vc_ptr, kvh, s_kb, s_ko, s_kh,
                                     s_vb, s_vd, s_vh, m_i, l_i, acc, D, BLOCK_SIZE, BLOCK_N, VREGS, True)
        return l_i, acc

    @triton.jit
    def _e4m3(x, EXACT: tl.constexpr):
        """fp32 x cast to e4m3, rounded to nearest even; EXACT (the interpreter, whose own cast is wrong: quant.py)
        rounds with quant.py's round_to_fp8_e4m3 first."""
        if EXACT:
            x = round_to_fp8_e4m3(x)
        return x.to(tl.float8e4nv)

    @triton.jit
    def _q8_t(qv, qk_scale, BLOCK_R: tl.constexpr, EXACT: tl.constexpr):
        """qv [BLOCK_R, D] quantized per score row to e4m3 (scale = amax / 448, as quant.py's activations), as
        [D, BLOCK_R] for the swapped dot, and the score scale of each row (qk_scale times its quantization scale)."""
        qf = qv.to(tl.float32)
        amax = tl.max(tl.abs(qf), axis=1)
        qs = tl.where(amax == 0.0, 1.0, amax / 448.0)
        q8 = _e4m3(tl.clamp(qf / qs[:, None], -448.0, 448.0), EXACT)
        return tl.trans(q8), qk_scale * qs

    @triton.jit
    def _s8_step(q8t, q_rows, start, ctx, ctx_blk, bt_row, kc_ptr, vc_ptr, kvh, s_kb, s_ko, s_kh, s_vb, s_vd, s_vh,
                 m_i, l_i, acc_t, D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                 QK8: tl.constexpr, TAIL: tl.constexpr, EXACT: tl.constexpr):  # fmt: skip
        """vt8 / vt8pv: one step of keys start .. with keys on the MMA's M side (wgmma: M = BLOCK_N or D, N =
        BLOCK_R). S^T = K @ Q^T (QK8: e4m3 x e4m3, q from _q8_t; else K converted to fp16 against fp16 q^T), softmax
        along the keys (axis 0), O^T += V^T @ (p * 256)^T in e4m3 (V^T tiles [D, BLOCK_N] from the transposed V
        cache, keys contiguous: K-major, as an e4m3 wgmma's operands must be); whole blocks loaded, TAIL masks the
        scores of the keys past ctx (the probe's caches hold no NaN)."""
        kpos, blk_ok, pblk, koff = _split_k.key_tile(bt_row, start, ctx_blk, BLOCK_SIZE, BLOCK_N)
        kt = _raw(kc_ptr, pblk, koff, blk_ok, kvh, s_kb, s_ko, s_kh, D)  # [BLOCK_N, D] fp8
        if QK8:
            sc = tl.dot(kt, q8t) * q_rows[None, :]  # [BLOCK_N, BLOCK_R]
        else:
            sc = tl.dot(_f16(kt, False), q8t) * q_rows[None, :]
        if TAIL:
            sc = tl.where((kpos < ctx)[:, None], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(sc - m_ref[None, :])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        d = tl.arange(0, D)
        v_tr = tl.load(vc_ptr + pblk[None, :] * s_vb + kvh * s_vh + d[:, None] * s_vd + koff[None, :],
                       mask=blk_ok[None, :], other=0.0)  # [D, BLOCK_N] fp8
        acc_t = acc_t * alpha[None, :] + tl.dot(v_tr, _e4m3(p * 256.0, EXACT))
        return m_new, l_i, acc_t

    @triton.jit
    def _s8_loop(qv, ctx, bt_row, qk_scale, kc_ptr, vc_ptr, kvh, s_kb, s_ko, s_kh, s_vb, s_vd, s_vh, m_i, l_i, acc,
                 D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                 QK8: tl.constexpr, EXACT: tl.constexpr):  # fmt: skip
        """vt8 (QK8) / vt8pv: _s8_step over the whole tiles, the last partial one after the loop; the output
        returned as [BLOCK_R, D] with the 256 of p * 256 divided out."""
        if QK8:
            q8t, q_rows = _q8_t(qv, qk_scale, BLOCK_R, EXACT)
        else:
            q8t = tl.trans(qv)
            q_rows = tl.full([BLOCK_R], 1.0, tl.float32) * qk_scale
        acc_t = tl.trans(acc)
        ctx_blk = tl.cdiv(ctx, BLOCK_SIZE) * BLOCK_SIZE
        n_full = ctx // BLOCK_N * BLOCK_N
        for start in range(0, n_full, BLOCK_N):
            m_i, l_i, acc_t = _s8_step(q8t, q_rows, start, ctx, ctx_blk, bt_row, kc_ptr, vc_ptr, kvh, s_kb, s_ko,
                                       s_kh, s_vb, s_vd, s_vh, m_i, l_i, acc_t, D, BLOCK_SIZE, BLOCK_N, QK8, False,
                                       EXACT)
        if n_full < ctx:
            m_i, l_i, acc_t = _s8_step(q8t, q_rows, n_full, ctx, ctx_blk, bt_row, kc_ptr, vc_ptr, kvh, s_kb, s_ko,
                                       s_kh, s_vb, s_vd, s_vh, m_i, l_i, acc_t, D, BLOCK_SIZE, BLOCK_N, QK8, True,
                                       EXACT)
        return l_i, tl.trans(acc_t) * (1.0 / 256.0)

    @triton.jit
    def _probe_kernel(
        q_ptr, kc_ptr, vc_ptr, out_ptr, bt_ptr, lens_ptr, ks_ptr, vs_ptr, scale,
        s_qs, s_qh, s_kb, s_ko, s_kh, s_vb, s_vo, s_vh, s_os, s_oh, s_bt,
        G: tl.constexpr, BLOCK_R: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr, VREGS: tl.constexpr, VARIANT: tl.constexpr, EXACT_E4M3: tl.constexpr = False,
        HP: tl.constexpr = 1,
    ):  # fmt: skip
        """Program (sequence, kv head; vt2h / vt4h: a pack of HP kv heads): the loop of variant VARIANT (an index
        into VARIANTS); EXACT_E4M3 (the interpreter): vt8's casts to e4m3 rounded by quant.py first."""
        kvh = tl.program_id(1)
        qv, ctx, bt_row, qk_scale, v_scale = _setup(q_ptr, ks_ptr, vs_ptr, lens_ptr, bt_ptr, scale, s_qs, s_qh,
                                                    s_bt, G, BLOCK_R, D, HP)
        m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, HP * D], tl.float32)
        if VARIANT == 0:
            l_i, acc = _base_loop(qv, ctx, bt_row, qk_scale, kc_ptr, vc_ptr, kvh, s_kb, s_ko, s_kh, s_vb, s_vo, s_vh,
                                  m_i, l_i, acc, D, BLOCK_SIZE, BLOCK_N, VREGS)
        elif VARIANT == 1:
            l_i, acc = _wide_loop(qv, ctx, bt_row, qk_scale, kc_ptr, vc_ptr, kvh, s_kb, s_ko, s_kh, s_vb, s_vo, s_vh,
                                  m_i, l_i, acc, D, BLOCK_SIZE, BLOCK_N, VREGS)
        elif VARIANT == 2:
            l_i, acc = _prefetch_loop(qv, ctx, bt_row, qk_scale, kc_ptr, vc_ptr, kvh, s_kb, s_ko, s_kh, s_vb, s_vo,
                                      s_vh, m_i, l_i, acc, D, BLOCK_SIZE, BLOCK_N, VREGS)
        elif VARIANT == 3:
            l_i, acc = _swapab_loop(qv, ctx, bt_row, qk_scale, kc_ptr, vc_ptr, kvh, s_kb, s_ko, s_kh, s_vb, s_vo,
                                    s_vh, m_i, l_i, acc, D, BLOCK_SIZE, BLOCK_N, VREGS)
        elif VARIANT == 4:  # vt: s_vo is the stride of D in the transposed V cache
            l_i, acc = _vt_loop(qv, ctx, bt_row, qk_scale, kc_ptr, vc_ptr, kvh, s_kb, s_ko, s_kh, s_vb, s_vo, s_vh,
                                m_i, l_i, acc, D, BLOCK_SIZE, BLOCK_N, VREGS)
        elif VARIANT <= 6:  # vt8 (5) / vt8pv (6): over the transposed V cache as vt
            l_i, acc = _s8_loop(qv, ctx, bt_row, qk_scale, kc_ptr, vc_ptr, kvh, s_kb, s_ko, s_kh, s_vb, s_vo, s_vh,
                                m_i, l_i, acc, D, BLOCK_SIZE, BLOCK_N, BLOCK_R, VARIANT == 5, EXACT_E4M3)
        else:  # vt2h / vt4h: vt's loop over the pack's HP kv heads side by side (adjacent in both caches)
            l_i, acc = _vt_loop(qv, ctx, bt_row, qk_scale, kc_ptr, vc_ptr, kvh * HP, s_kb, s_ko, s_kh, s_vb, s_vo,
                                s_vh, m_i, l_i, acc, HP * D, BLOCK_SIZE, BLOCK_N, VREGS)
        _store(out_ptr, acc, l_i, v_scale, s_os, s_oh, G, BLOCK_R, D, HP)

    KERNELS = {name: _probe_kernel for name in VARIANTS}
else:
    KERNELS = {}

# Launch shapes (block_n, num_warps, num_stages, vregs[, maxnreg]) per variant: the CUDA run times each, --sm90
# builds each (without the register cap maxnreg, which only a launch applies).
CONFIGS = {
    "base": [(128, 4, 3, False), (128, 4, 3, True), (128, 4, 5, True), (64, 4, 3, True), (64, 4, 6, True),
             (64, 4, 8, True), (32, 4, 8, True), (128, 8, 4, True), (64, 2, 6, True)],
    "wide": [(128, 4, 3, False), (128, 4, 3, True), (64, 4, 3, True), (64, 4, 5, True)],
    "prefetch": [(64, 4, 1, True), (128, 8, 1, True), (32, 4, 1, True), (64, 4, 1, False)],
    "swapab": [(128, 4, 3, True), (64, 4, 3, True), (64, 4, 6, True), (128, 4, 3, False), (64, 4, 3, False)],
    "vt": [(128, 4, 3, False), (128, 4, 3, True), (64, 4, 3, False), (64, 4, 6, False), (128, 8, 4, False),
           (128, 4, 2, False, 128)],
    "vt8": [(128, 4, 3, False), (128, 4, 2, False), (64, 4, 3, False), (64, 4, 4, False), (256, 4, 2, False),
            (128, 8, 3, False)],
    "vt8pv": [(128, 4, 3, False), (64, 4, 3, False), (64, 4, 4, False)],
    "vt2h": [(64, 4, 2, False), (64, 4, 3, False), (64, 4, 2, False, 128), (32, 4, 3, False), (128, 4, 2, False),
             (64, 8, 2, False), (128, 8, 2, False, 128)],
    "vt4h": [(32, 4, 2, False), (32, 4, 3, False), (64, 8, 2, False), (32, 8, 3, False)],
}
PACKED = {"vt2h": 2, "vt4h": 4}  # kv heads a program (HP)
COMPILED = {}  # (variant, *config) -> the last launch's compiled kernel (the CUDA run prints its resources)
CPU_CONFIGS = {name: [(128, 4, 3, False), (64, 4, 3, True), (32, 4, 3, True)] for name in CONFIGS}  # values only


_V_TRANSPOSED = {}  # "last": (vc, its values as vt's cache)


def v_transposed(vc):
    """vt's V cache: the values of vc [blocks, 16, Hkv, D] as [blocks, Hkv, D, 16] (each kv head's D rows of a
    block's 16 keys, keys contiguous), made once per cache (kept with vc, which stays alive while it is kept) so that
    timed and graph-captured launches do not include the copy."""
    last = _V_TRANSPOSED.get("last")
    if last is None or last[0] is not vc or last[1] != vc._version:
        _V_TRANSPOSED["last"] = last = (vc, vc._version, vc.permute(0, 2, 3, 1).contiguous())
    return last[2]


def launch(variant, q, kc, vc, bt, lens, scale, ks, vs, block_n, num_warps, num_stages, vregs, maxnreg=None,
           out=None):
    """Variant `variant` of the decode attention; out [S, Hq, D] (new unless given). vc in the op's layout for every
    variant: vt reads `v_transposed(vc)`, its strides of block, D and head passed as s_vb, s_vo, s_vh."""
    s, hq, d = q.shape
    hkv = kc.shape[2]
    g = hq // hkv
    if out is None:
        out = torch.empty_like(q)  # (any float dtype: the kernel casts to it)
    hp = PACKED.get(variant, 1)
    if variant in ("vt", "vt8", "vt8pv", *PACKED):
        vc = v_transposed(vc)
        v_strides = vc.stride(0), vc.stride(2), vc.stride(1)
    else:
        v_strides = vc.stride(0), vc.stride(1), vc.stride(2)
    if hkv % hp:
        raise ValueError(f"{variant}: packs of {hp} kv heads need a multiple of {hp} kv heads, got {hkv}")
    cap = {"maxnreg": maxnreg} if maxnreg else {}
    key = (variant, block_n, num_warps, num_stages, vregs) + ((maxnreg,) if maxnreg else ())
    COMPILED[key] = KERNELS[variant][(s, hkv // hp)](
        q, kc, vc, out, bt, lens, ks, vs, float(scale),
        q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), kc.stride(2), *v_strides,
        out.stride(0), out.stride(1), bt.stride(0),
        G=g, BLOCK_R=max(16, next_pow2(g * hp)), D=d, BLOCK_SIZE=kc.shape[1], BLOCK_N=block_n, VREGS=vregs,
        VARIANT=VARIANTS.index(variant), EXACT_E4M3=not q.is_cuda, HP=hp, num_warps=num_warps,
        num_stages=num_stages, **cap,
    )  # fmt: skip
    return out


def reference(q, kc, vc, bt, lens, scale, ks, vs, chunk=32):
    """Dequantized fp32 attention of each sequence's last query over its seq_lens keys ([S, Hq, D] fp32)."""
    s, hq, d = q.shape
    bs, hkv = kc.shape[1], kc.shape[2]
    out = torch.zeros(s, hq, d, dtype=torch.float32, device=q.device)
    lens_l = lens.tolist()
    for c0 in range(0, s, chunk):
        idx = list(range(c0, min(s, c0 + chunk)))
        n = max(lens_l[i] for i in idx)
        if n == 0:
            continue
        nb = -(-n // bs)
        blk = bt[idx, :nb].long()  # [c, nb]
        k = kc.view(torch.uint8)[blk].view(FP8).float().reshape(len(idx), nb * bs, hkv, d)[:, :n] * ks
        v = vc.view(torch.uint8)[blk].view(FP8).float().reshape(len(idx), nb * bs, hkv, d)[:, :n] * vs
        qf = q[idx].float().view(len(idx), hkv, hq // hkv, d)
        sc = torch.einsum("cjgd,cnjd->cjgn", qf, k) * scale
        valid = torch.arange(n, device=q.device)[None, :] < lens[idx][:, None]
        sc = sc.masked_fill(~valid[:, None, None, :], float("-inf"))
        p = torch.softmax(sc, dim=-1)
        out[idx] = torch.einsum("cjgn,cnjd->cjgd", p, v).reshape(len(idx), hq, d)
    return out


def make_case(lens, hq, hkv, d, device, capacity_blocks=None, seed=0):
    """(q, kc, vc, bt, lens, scale, ks, vs): random bf16 q, fp8 caches quantized from randn over amax / 448
    scales, block tables of shuffled blocks (entries past a sequence's blocks point at block 0)."""
    gen = torch.Generator().manual_seed(seed)
    s = len(lens)
    nbs = [-(-n // BLOCK_SIZE) for n in lens]
    cap = capacity_blocks or max(1, max(nbs))
    num_blocks = sum(nbs) + 4
    kf = torch.randn(num_blocks, BLOCK_SIZE, hkv, d, generator=gen)
    vf = torch.randn(num_blocks, BLOCK_SIZE, hkv, d, generator=gen)
    ks = (kf.abs().amax() / 448.0).reshape(1)
    vs = (vf.abs().amax() / 448.0).reshape(1)
    kc = (kf / ks).clamp(-448, 448).to(FP8)
    vc = (vf / vs).clamp(-448, 448).to(FP8)
    perm = torch.randperm(num_blocks, generator=gen)[: sum(nbs)]
    bt = torch.zeros(s, cap, dtype=torch.int32)
    at = 0
    for i, nb in enumerate(nbs):
        bt[i, :nb] = perm[at : at + nb].int()
        at += nb
    q = torch.randn(s, hq, d, generator=gen).to(torch.bfloat16)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    return [x.to(device) for x in (q, kc, vc, bt, lens_t)] + [d**-0.5, ks.to(device), vs.to(device)]


# --------------------------------------------------------------------------------------------------
# --cpu: the interpreter, every variant against the reference
# --------------------------------------------------------------------------------------------------


def cpu_check() -> int:
    """Each variant at CPU_CONFIGS under the interpreter: max |out - reference| with the kernel's bf16 output
    (tolerance TOL; the interpreter truncates fp32 -> bf16, one bf16 ulp: up to 1.6e-2 at |out| < 4) and with an
    fp32 output (the kernel's math alone: fp16 q, p and tiles; tolerance TOL_FP32)."""
    if not os.environ.get("TRITON_INTERPRET"):
        print("--cpu needs TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    cases = [((1, 17, 300), 16, 8, 128), ((300, 1, 129, 64), 14, 2, 128), ((5, 256, 31), 4, 1, 64),
             ((2, 40), 8, 4, 64)]
    worst, worst32, bad = 0.0, 0.0, 0
    for lens, hq, hkv, d in cases:
        args = make_case(list(lens), hq, hkv, d, "cpu", capacity_blocks=24)
        ref = reference(*args)
        for variant, configs in CPU_CONFIGS.items():
            if hkv % PACKED.get(variant, 1) or hq // hkv * PACKED.get(variant, 1) > 16:
                continue  # packs of kv heads where they divide the kv heads and fill at most 16 score rows
            for cfg in configs:
                t0 = time.perf_counter()
                err = (launch(variant, *args, *cfg).float() - ref).abs().max().item()
                out32 = torch.empty(args[0].shape, dtype=torch.float32)
                err32 = (launch(variant, *args, *cfg, out=out32) - ref).abs().max().item()
                worst, worst32 = max(worst, err), max(worst32, err32)
                e4m3 = variant in E4M3_VARIANTS
                fail = not (err <= (TOL_E4M3 if e4m3 else TOL) and err32 <= (TOL_E4M3 if e4m3 else TOL_FP32))
                bad += fail
                print(f"lens {lens} heads {hq}/{hkv} (G {hq // hkv}) D {d} | {variant:8s} {cfg_label(cfg):18s} "
                      f"max|err| bf16 out {err:.2e}, fp32 out {err32:.2e}  ({time.perf_counter() - t0:.1f} s)"
                      f"{'  FAIL' if fail else ''}", flush=True)
    print(f"worst: bf16 out {worst:.2e} (tolerance {TOL}), fp32 out {worst32:.2e} (tolerance {TOL_FP32}; "
          f"{', '.join(E4M3_VARIANTS)}: {TOL_E4M3} both); "
          f"{bad} failure(s)")
    return 1 if bad else 0


def cfg_label(cfg) -> str:
    block_n, warps, stages, vregs = cfg[:4]
    return f"n{block_n} w{warps} s{stages}" + (" vregs" if vregs else "") + (f" cap{cfg[4]}" if cfg[4:] else "")


# --------------------------------------------------------------------------------------------------
# --sm90: builds for sm_90 (no GPU), with the specialization a launch at the H200 shapes gets
# --------------------------------------------------------------------------------------------------

DIVISIBLE = ("s_qs", "s_qh", "s_kb", "s_ko", "s_kh", "s_vb", "s_vo", "s_vh", "s_os", "s_oh", "s_bt")
POINTER_TYPES = {"kc_ptr": "*fp8e4nv", "vc_ptr": "*fp8e4nv", "bt_ptr": "*i32", "lens_ptr": "*i32", "ks_ptr": "*fp32",
                 "vs_ptr": "*fp32"}


def build_sm90(kernel, g, cfg, d=D, variant="base"):
    """`kernel` built for sm_90 at launch shape `cfg` as a launch at the H200 shapes specializes it."""
    from tests.ops.compile_sm90 import build_sm90 as build

    block_n, num_warps, num_stages, vregs = cfg[:4]
    hp = PACKED.get(variant, 1)
    constexprs = dict(G=g, BLOCK_R=max(16, next_pow2(g * hp)), D=d, BLOCK_SIZE=BLOCK_SIZE, BLOCK_N=block_n,
                      VREGS=vregs, VARIANT=VARIANTS.index(variant), HP=hp)
    divisible = tuple(a for a in kernel.arg_names if a.endswith("_ptr") or a in DIVISIBLE)  # what a launch specializes
    return build(kernel, constexprs, POINTER_TYPES, num_warps, num_stages, divisible=divisible, floats=("scale",))


def sm90_stats(compiled, num_warps) -> dict:
    from tests.ops.compile_sm90 import build_stats

    st = build_stats(compiled, num_warps, r"cp\.async\.c[ag]|wgmma\.mma_async|mma\.sync"
                                          r"|ld\.global(?:\.nc)?(?:\.v\d)?\.b\d+|ld\.shared(?:\.v\d)?\.b\d+")
    ops = st.pop("ops")
    return {**st, "cp_async": ops["cp.async.cg"] + ops["cp.async.ca"], "wgmma": ops["wgmma.mma_async"],
            "mma_sync": ops["mma.sync"], "global_loads": {k: v for k, v in ops.items() if k.startswith("ld.global")},
            "shared_b8_loads": ops["ld.shared.b8"]}


# The V operand's path at the main launch shapes: fp8 bytes read from shared memory one at a time (b8) or wider,
# ldmatrix, fp8 -> fp16 conversions, the dots' MMAs
V_OPS = (r"ld\.shared(?:\.v\d)?\.[bsu]\d+|ldmatrix\.sync\.aligned\.m8n8\.x\d(?:\.trans)?|cvt\.rn\.f16x2\.e4m3x2"
         r"|mma\.sync|wgmma\.mma_async")
OPS_VARIANTS = ("base", "vt")
OPS_CONFIGS = [(128, 4, 3, False), (128, 4, 3, True), (64, 4, 3, False), (64, 4, 3, True)]


def ptx_ops(ptx: str, instructions: str = V_OPS):
    """(whole kernel, key loop): Counters of the PTX instructions matching `instructions`, static counts; the key
    loop is the blocks LLVM's comments mark "Loop Header" / "in Loop" (one step of BLOCK_N keys, with the
    pipeliner's copies for a later step)."""
    from collections import Counter

    whole, loop, in_loop = Counter(), Counter(), False
    lines = ptx.splitlines()
    for i, line in enumerate(lines):
        if re.match(r"\$L__BB\d+_\d+:|// %bb\.\d+:", line):  # a block: its loop comment is on this line or the next
            in_loop = "Loop" in line or "in Loop:" in (lines[i + 1] if i + 1 < len(lines) else "")
        for op in re.findall(rf"(?<![\w.])({instructions})(?![\w])", line):
            whole[op] += 1
            loop[op] += in_loop
    return whole, loop


def ops_row(ptx: str) -> str:
    """ptx_ops grouped: b8 shared loads, wider shared loads, ldmatrix, e4m3x2 conversions, mma.sync, wgmma; each
    as "in the key loop (whole kernel)", then the wider loads and ldmatrix in the loop by kind."""
    whole, loop = ptx_ops(ptx)
    groups = (lambda k: re.fullmatch(r"ld\.shared\.[bsu]8", k), lambda k: k.startswith("ld.shared"),
              lambda k: k.startswith("ldmatrix"), lambda k: k.startswith("cvt"), lambda k: k == "mma.sync",
              lambda k: k.startswith("wgmma"))
    cells, seen = [], set()
    for g in groups:
        keys = [k for k in whole if k not in seen and g(k)]
        seen.update(keys)
        cells.append(f"{sum(loop[k] for k in keys):4d} ({sum(whole[k] for k in keys):4d})")
    kinds = " ".join(f"{k.replace('ld.shared.', '').replace('ldmatrix.sync.aligned.m8n8.', 'ldm.')}x{loop[k]}"
                     for k in sorted(loop) if loop[k] and not re.fullmatch(r"ld\.shared\.[bsu]8", k)
                     and k.startswith(("ld.shared", "ldmatrix")))
    return " ".join(cells) + " | " + kinds


def sm90_report() -> int:
    """--sm90 (kernel_norm.probe_main has checked that this process can build for sm_90)."""
    print(f"triton {triton.__version__}, sm_90 builds at G {HQ // HKV}, D {D}, block {BLOCK_SIZE} (pointers and strides "
          f"divisible by 16, as launched); programs/SM from regs and shared memory")
    print(f"{'variant':9s} {'config':18s} | {'regs':>4s} {'stack':>5s} {'smem':>7s} {'cp.async':>8s} {'wgmma':>5s} "
          f"{'mma':>4s} {'prog/SM':>7s} | global loads, ld.shared.b8")
    ptxs = {}  # (variant, *cfg) -> PTX, for the V operand table
    for variant, configs in CONFIGS.items():
        for cfg in configs:
            t0 = time.perf_counter()
            try:
                compiled = build_sm90(KERNELS[variant], HQ // HKV, cfg, variant=variant)
                st = sm90_stats(compiled, cfg[1])
            except Exception as exc:  # a build that fails (shared memory, a Triton limit): say so
                print(f"{variant:9s} {cfg_label(cfg):18s} | build failed: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            ptxs[(variant, *cfg)] = compiled.asm["ptx"]
            loads = " ".join(f"{k}x{v}" for k, v in sorted(st["global_loads"].items()))
            print(f"{variant:9s} {cfg_label(cfg):18s} | {st['regs']:4d} {st['stack']:5d} "
                  f"{st['smem']:7d} {st['cp_async']:8d} {st['wgmma']:5d} {st['mma_sync']:4d} "
                  f"{st['programs_per_sm']:7d} | {loads}, b8x{st['shared_b8_loads']} "
                  f"({time.perf_counter() - t0:.1f} s)", flush=True)
    print("\nthe V operand's path, PTX instructions (static counts) in the key loop (whole kernel): shared loads of one "
          "byte, wider shared loads, ldmatrix, cvt.rn.f16x2.e4m3x2, mma.sync, wgmma; then the loop's wider loads "
          "and ldmatrix by kind (vt's last partial tile is peeled: its code is in the whole kernel only)")
    print(f"{'variant':9s} {'config':18s} | {'b8':>11s} {'wider':>11s} {'ldmatrix':>11s} {'cvt e4m3x2':>11s} "
          f"{'mma.sync':>11s} {'wgmma':>11s} | loop's wider loads, ldmatrix")
    for variant in OPS_VARIANTS:
        for cfg in OPS_CONFIGS:
            if (variant, *cfg) not in ptxs:
                try:
                    ptxs[(variant, *cfg)] = build_sm90(KERNELS[variant], HQ // HKV, cfg, variant=variant).asm["ptx"]
                except Exception as exc:
                    print(f"{variant:9s} {cfg_label(cfg):18s} | build failed: {type(exc).__name__}: {str(exc)[:200]}")
                    continue
            print(f"{variant:9s} {cfg_label(cfg):18s} | {ops_row(ptxs[(variant, *cfg)])}", flush=True)
    return 0


# --------------------------------------------------------------------------------------------------
# CUDA: check and time
# --------------------------------------------------------------------------------------------------


def device_stats(compiled) -> str:
    """Registers, spills, shared memory and cp.async / wgmma / ld.shared.b8 counts of a launched kernel (this
    Triton's build)."""
    ptx = compiled.asm.get("ptx", "")
    n_cp = len(re.findall(r"\bcp\.async\.c[ag]\b", ptx))
    n_wg = len(re.findall(r"\bwgmma\.mma_async\b", ptx))
    n_b8 = len(re.findall(r"\bld\.shared\.[bsu]8\b", ptx))
    return (f"regs {getattr(compiled, 'n_regs', '?')} spills {getattr(compiled, 'n_spills', '?')} smem "
            f"{compiled.metadata.shared} cp.async {n_cp} wgmma {n_wg} ld.shared.b8 {n_b8}")


def gpu_run(variants, quick, device="cuda") -> int:
    """Check each variant against the reference and the op, then time variants and op (module docstring)."""
    sys.path.insert(0, str(BENCH))
    import kernel_paged_attention as kpa
    from kernel_norm import copy_bandwidth

    from mini_infer.ops import paged_attention as pa
    from mini_infer.ops.paged_attention import paged_attention_cached_triton, paged_attention_triton

    t_start = time.perf_counter()
    cb = copy_bandwidth(1.0, 0, 10)
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} triton {triton.__version__} | copy bandwidth "
          f"{cb['gbps']:.0f} GB/s (dst.copy_(src), 1 GiB) | decode, Hq {HQ} Hkv {HKV} D {D} block {BLOCK_SIZE}, "
          f"bf16 q, CUDA graph of {LAYERS} calls, us per call (GB/s of K/V read)", flush=True)
    configs = {v: CONFIGS[v][:2] if quick else CONFIGS[v] for v in variants}
    rows = {}  # label -> {shape: us}
    first_shape = f"b{SHAPES[0][0]}/ctx{SHAPES[0][1]}"
    bad = 0
    for s, ctx in SHAPES:
        shape = f"b{s}/ctx{ctx}"
        args = kpa.decode_args(s, ctx, HQ, HKV, D, kv="fp8", device=device)
        paged_attention_triton(*args)  # its write puts the step's k/v in the cache (same bytes every call)
        q, kc, vc, bt, lens, scale, ks, vs = args[0], args[3], args[4], args[6], args[7], args[9], args[12], args[13]
        mine = (q, kc, vc, bt, lens, scale, ks, vs)
        kv_bytes = 2 * s * ctx * HKV * D  # fp8 K and V
        ref = reference(*mine)
        op_out = paged_attention_cached_triton(q, kc, vc, bt, lens, args[8], scale, 0, 0.0, ks, vs).float()
        print(f"{shape}: op vs reference max|err| {(op_out - ref).abs().max().item():.2e}", flush=True)

        def record(label, us, nbytes, shape=shape):
            rows.setdefault(label, {})[shape] = (us, nbytes / us / 1e3)

        record("op fp8 (write+attn)", kpa.graph_us(lambda a=args: paged_attention_triton(*a), LAYERS), kv_bytes)
        record("op fp8 (attn only)", kpa.graph_us(
            lambda m=mine, qsl=args[8]: paged_attention_cached_triton(*m[:5], qsl, m[5], 0, 0.0, *m[6:]), LAYERS),
            kv_bytes)
        # the op over the V cache stored tokens-contiguous (the engine's default for full-attention layers: the
        # "decode_fp8_vkeys" kind) with each of its dot ways; the "fp16_vregs" way over the usual layout
        vc_keys = v_transposed(vc).permute(0, 3, 1, 2)  # [blocks, 16, Hkv, D] viewed, keys contiguous
        saved = dict(pa._CONFIG["decode_fp8"])
        for way, vcache, label in (("fp16", vc_keys, "op fp8 vkeys (attn only)"),
                                   ("fp16_vregs", vc, "op fp8 vregs (attn only)")):
            try:
                pa._CONFIG["decode_fp8"] = {**saved, "fp8_dot": way}
                pa._LAUNCH_OK.clear()
                m = (q, kc, vcache, bt, lens, scale, ks, vs)
                got = paged_attention_cached_triton(*m[:5], args[8], m[5], 0, 0.0, *m[6:]).float()
                print(f"  {label}: max|err| vs reference {(got - ref).abs().max().item():.2e}", flush=True)
                record(label, kpa.graph_us(
                    lambda m=m, qsl=args[8]: paged_attention_cached_triton(*m[:5], qsl, m[5], 0, 0.0, *m[6:]),
                    LAYERS), kv_bytes)
            finally:
                pa._CONFIG["decode_fp8"] = saved
                pa._LAUNCH_OK.clear()
        del vc_keys
        worst = (0.0, ""), (0.0, "")
        for variant, cfgs in configs.items():
            for cfg in cfgs:
                label = f"{variant} {cfg_label(cfg)}"
                out = torch.empty_like(q)
                try:
                    got = launch(variant, *mine, *cfg, out=out).float()
                except Exception as exc:  # out of shared memory / resources
                    print(f"  {label}: launch failed: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
                    continue
                err_ref = (got - ref).abs().max().item()
                err_op = (got - op_out).abs().max().item()
                worst = max(worst[0], (err_ref, label)), max(worst[1], (err_op, label))
                if shape == first_shape:  # this Triton's build, as launched
                    print(f"  {label:28s} {device_stats(COMPILED[(variant, *cfg)])}", flush=True)
                ok = err_ref <= (TOL_E4M3 if variant in E4M3_VARIANTS else TOL)
                bad += not ok
                if not ok or err_op > TOL or variant in E4M3_VARIANTS:
                    print(f"  {label}: max|err| vs reference {err_ref:.2e}, vs op {err_op:.2e}"
                          f"{'  FAIL' if not ok else ''}", flush=True)
                record(label, kpa.graph_us(lambda v=variant, c=cfg, o=out, m=mine: launch(v, *m, *c, out=o), LAYERS),
                       kv_bytes)
        print(f"{shape}: worst max|variant - reference| {worst[0][0]:.2e} ({worst[0][1]}), worst max|variant - op| "
              f"{worst[1][0]:.2e} ({worst[1][1]})", flush=True)
        del args, mine, ref, op_out, q, kc, vc
        _V_TRANSPOSED.clear()
        if device == "cuda":
            torch.cuda.empty_cache()
        b16 = kpa.decode_args(s, ctx, HQ, HKV, D, kv="bf16", device=device)
        record("op bf16 (write+attn)", kpa.graph_us(lambda a=b16: paged_attention_triton(*a), LAYERS), 2 * kv_bytes)
        record("op bf16 (attn only)", kpa.graph_us(
            lambda a=b16: paged_attention_cached_triton(a[0], a[3], a[4], *a[6:12]), LAYERS), 2 * kv_bytes)
        del b16
        if device == "cuda":
            torch.cuda.empty_cache()
        print(f"{shape} done ({time.perf_counter() - t_start:.0f} s)", flush=True)

    shapes = [f"b{s}/ctx{c}" for s, c in SHAPES]
    print(f"\n{'kernel':28s} " + " ".join(f"{sh:>20s}" for sh in shapes) + "   (us per call, GB/s)")
    for label, per in rows.items():
        print(f"{label:28s} " + " ".join(f"{per[sh][0]:9.1f} ({per[sh][1]:6.0f})  " if sh in per else f"{'-':>20s}"
                                         for sh in shapes))
    mine_rows = {k: v for k, v in rows.items() if not k.startswith("op ") and len(v) == len(shapes)}
    if mine_rows:
        best = min(mine_rows, key=lambda k: sum(mine_rows[k][sh][0] for sh in shapes))
        op_attn = rows["op fp8 (attn only)"]
        print(f"\nbest variant (least summed time): {best}: " + ", ".join(
            f"{sh} {mine_rows[best][sh][0]:.1f} us ({mine_rows[best][sh][0] / op_attn[sh][0]:.2f}x op fp8 attn)"
            for sh in shapes))
        for sh in shapes:
            b = min(mine_rows, key=lambda k, sh=sh: mine_rows[k][sh][0])
            print(f"  best at {sh}: {b} {mine_rows[b][sh][0]:.1f} us, {mine_rows[b][sh][1]:.0f} GB/s "
                  f"({mine_rows[b][sh][1] / cb['gbps']:.2f} of copy)")
    print(f"{time.perf_counter() - t_start:.0f} s; {bad} variant check(s) beyond {TOL}")
    return 1 if bad else 0


def main() -> int:
    sys.path.insert(0, str(BENCH))
    from kernel_norm import probe_main, probe_parser

    ap = probe_parser(__doc__)
    ap.add_argument("--variants", default=",".join(CONFIGS), help="comma-separated subset (CUDA run)")
    ap.add_argument("--quick", action="store_true", help="CUDA run: the first two launch shapes of each variant")
    args = ap.parse_args()
    return probe_main(args, cpu_check, sm90_report,
                      lambda: gpu_run([v for v in args.variants.split(",") if v], args.quick))


if __name__ == "__main__":
    sys.exit(main())
