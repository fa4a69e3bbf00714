"""The decode path of `mini_infer::fused_moe`: two grouped GEMV kernels for very few (token, slot) pairs.

No align step and no slot sum:
  1. gate/up: program (pair p = t * k + j, output tile n) reads the (local) expert e of slot p, exits at once when
     it has none (id outside [0, E_global), or expert_map -1), and computes gate and up rows n of W13[e] times
     x[t] (one stack of rows), silu(gate) * up in fp32 rounded to hidden's dtype -> act [T*k, I] (rows of
     dropped slots unwritten);
  2. down: program (token t, output tile n) runs one K loop over the k slots' act rows laid end to end (a K step
     divides I, so each step lies in one slot, whose expert and routing weight are scalars there), the routing
     weight applied to act, slots without a (local) expert loading nothing: out [T, H] directly, summed in fp32
     in a fixed order. Unlike the grouped path, the slots' products are not rounded to hidden's dtype one by one
     before the sum (the reference does not round them either). Or (`DOWN_SLOTS`, opt-in, not yet timed on a GPU):
     one K loop over I with every slot in each step, the slots' experts and weights read once before it, and
     (`DOWN_SLOTS_PRELOAD`) those and the last step's weights loaded before the PDL wait
     (`_moe_gemv_down_slots_kernel`). Likewise the gate/up GEMV (`GATE_UP_SLOTS`, opt-in, not yet timed on a GPU):
     a program per (token, n-tile) over every slot (`_moe_gemv_gate_up_slots_kernel`).
Each pair reads its expert's weights itself (tokens that share an expert read it again), so this can pay only
while T * k is tiny. Measured on an H200 (bench/kernel_moe.py --decode, bench/results/kernel_moe_decode*_h200.json)
it beat the grouped GEMMs only at mixtral-8x7b's batch 1 (2 pairs, I 14336: 183 vs 193 us); at qwen3-30b-a3b's
(8 pairs, I 768: 35 vs 30 us) and deepseek-v2-lite's (6 pairs, I 1408: 67 vs 36 us) batch 1 it lost, the tile
sweep finding nothing better. So `moe_gemv_config` picks it up to MOE_GEMV_MAX_PAIRS = 2 pairs only, by shapes
alone (the grid is a function of the shapes: CUDA-graph safe, no host sync). The K loops are the dense GEMV's
(`gemv_step` of linear.py): elementwise fp32 products, one row-sum at the end.

Holds `map_expert`, the expert-map lookup that fused_moe.py's align and sum kernels use too. Launchers assume
fused_moe.py's `_check_args` passed. Must not import anything from mini_infer outside `mini_infer.ops`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from mini_infer.ops._triton_support import HAS_TRITON, await_producers, pdl_args, tl, triton

if HAS_TRITON:
    from mini_infer.ops.linear import gemv_step

__all__ = ["MOE_GEMV_MAX_PAIRS", "GemvTile", "MoeGemvConfig", "moe_gemv_config", "moe_gemv_tiles", "moe_gemv_triton"]


@dataclass(frozen=True)
class GemvTile:
    """Launch shape of one grouped GEMV: weight rows per program (per matrix: gate/up programs read BLOCK_N gate
    and BLOCK_N up rows), K elements per step, warps, pipeline stages."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class MoeGemvConfig:
    """Tiles of one decode-path call (`fused_moe_triton` takes it in place of a `MoeTileConfig`)."""

    gate_up: GemvTile
    down: GemvTile
    down_slots: bool = False  # the down GEMV over all slots at once (`_moe_gemv_down_slots_kernel`)
    gate_up_slots: bool = False  # the gate/up GEMV over all slots at once (`_moe_gemv_gate_up_slots_kernel`)


# The decode path serves calls of at most this many (token, slot) pairs: where it beat the grouped GEMMs on an
# H200 (mixtral-8x7b at batch 1; module docstring). In the engine too it loses beyond that (H200, 2026-11-24,
# MINI_INFER_MOE_GEMV_MAX_PAIRS=8 vs 2: qwen3-30b-a3b batch 1 286.3 vs 342.5 tok/s, deepseek-v2-lite 257.2 vs
# 350.6; bench/RESULTS.md twelfth session). MINI_INFER_MOE_GEMV_MAX_PAIRS sets another limit.
MOE_GEMV_MAX_PAIRS = int(os.environ.get("MINI_INFER_MOE_GEMV_MAX_PAIRS", "2"))  # read once, at import

# The down GEMV as `_moe_gemv_down_slots_kernel` (every slot's rows of a K step in one load, the slots' experts and
# weights read once) instead of `_moe_gemv_down_kernel` (one slot's K step at a time, its expert re-read each
# step). Why: the measured decode path fell off with the down K step (H200, bench/results/kernel_moe_decode_h200.json,
# batch 1, both GEMVs against copy bandwidth): mixtral-8x7b (step 1,024) 0.94, qwen3-30b-a3b (256) 0.53,
# deepseek-v2-lite (128) 0.38, as a chain of dependent loads per short step would. Built and checked under the
# interpreter and in sm_90 builds (twenty-first session); not yet timed on a GPU, so off by default:
# `bench/kernel_moe.py --decode` times both, `bench/latency.py --switch
# _moe_gemv.DOWN_SLOTS=1,_moe_gemv.MOE_GEMV_MAX_PAIRS=8` the engine. MINI_INFER_MOE_GEMV_DOWN_SLOTS=1 at import sets
# it; read at each `moe_gemv_tiles` call.
DOWN_SLOTS = os.environ.get("MINI_INFER_MOE_GEMV_DOWN_SLOTS", "0") == "1"
# (weight rows per program, K per step, warps, stages) of the slots kernel: a step loads next_pow2(top_k) x 2 x 256
# weights (qwen3-30b-a3b: 8 KiB of bf16), three steps cover its I of 768 exactly.
DOWN_SLOTS_TILE = (2, 256, 4, 2)
# The gate/up GEMV as `_moe_gemv_gate_up_slots_kernel` (a program per token and BLOCK_N-row tile of I over every slot,
# its experts read once: T * I / BLOCK_N programs) instead of `_moe_gemv_gate_up_kernel` (a program per (pair, tile),
# each starting with its slot's expert id: T * k * I / BLOCK_N programs). The same reasoning as DOWN_SLOTS: fewer
# programs, each with more weight bytes in flight and one dependent id load. Not yet timed on a GPU: off by
# default (MINI_INFER_MOE_GEMV_GATE_UP_SLOTS=1 at import; read at each `moe_gemv_tiles` call).
GATE_UP_SLOTS = os.environ.get("MINI_INFER_MOE_GEMV_GATE_UP_SLOTS", "0") == "1"
# its tile: one gate and one up row of every slot a program, 256 columns a step (qwen3-30b-a3b: 8 KiB of bf16 a step
# over 8 slots, 768 programs, 8 steps over H 2,048)
GATE_UP_SLOTS_TILE = (1, 256, 4, 3)
# The slots kernel's routing and last K step's weights loaded before the PDL wait (its PRELOAD; the grouped down
# GEMM's MOE_PRELOAD gained 2.9% at qwen3-30b-a3b batch 1). Read at each launch; not yet timed on a GPU either.
DOWN_SLOTS_PRELOAD = os.environ.get("MINI_INFER_MOE_GEMV_DOWN_SLOTS_PRELOAD", "1") != "0"


def moe_gemv_config(num_tokens: int, top_k: int, hidden: int, inter: int) -> MoeGemvConfig | None:
    """The decode path's tiles for these shapes, or None when the grouped-GEMM path serves them (more than
    MOE_GEMV_MAX_PAIRS pairs, or an I that no K step of the down GEMV divides). Depends on shapes only, so a CUDA
    graph captured for one T keeps its kernels."""
    return moe_gemv_tiles(hidden, inter) if num_tokens * top_k <= MOE_GEMV_MAX_PAIRS else None


def moe_gemv_tiles(hidden: int, inter: int) -> MoeGemvConfig | None:
    """The decode path's tiles for experts of these sizes, whatever the number of pairs (None: no down K step
    divides I, for the per-slot down kernel; the slots kernel, `DOWN_SLOTS`, takes any I)."""
    # the H200 sweep's best of each GEMV (bench/results/kernel_moe_decode_sweep_h200.json): one gate and one up
    # row per program, 3 stages; the down GEMV 4 rows at K steps of 512+, else 2
    gate_up = GemvTile(*GATE_UP_SLOTS_TILE) if GATE_UP_SLOTS else GemvTile(1, 1024, 4, 3)
    if DOWN_SLOTS:
        return MoeGemvConfig(gate_up, GemvTile(*DOWN_SLOTS_TILE), down_slots=True, gate_up_slots=GATE_UP_SLOTS)
    down_k = down_k_step(inter)
    if down_k is None:
        return None
    return MoeGemvConfig(gate_up, GemvTile(4 if down_k >= 512 else 2, down_k, 4, 3), gate_up_slots=GATE_UP_SLOTS)


def down_k_step(inter: int, most: int = 1024) -> int | None:
    """The down GEMV's K step: the largest power of two up to `most` that divides I (a step must stay within one
    slot's row), at least 16; None if there is none."""
    step = most
    while step >= 16 and inter % step:
        step //= 2
    return step if step >= 16 else None


if HAS_TRITON:

    @triton.jit
    def map_expert(expert, ok, map_ptr, num_global, HAS_MAP: tl.constexpr):
        """The local expert of router ids `expert` (where `ok`): expert_map[id], -1 for an id outside
        [0, num_global); the ids themselves without a map."""
        if HAS_MAP:
            inside = ok & (expert >= 0) & (expert < num_global)
            expert = tl.load(map_ptr + expert, mask=inside, other=-1).to(tl.int32)
        return expert

    @triton.jit
    def store_sum(out_ptr, res_ptr, offs, y, ok, HAS_RES: tl.constexpr):
        """out[offs] = the fp32 sums y rounded to out's dtype (the MoE output), plus, with HAS_RES, residual[offs] in
        fp32, rounded again: `fused_moe` then torch's add, bit for bit, when residual has out's dtype. Also the
        slot sum's epilogue (fused_moe.py)."""
        y = y.to(out_ptr.dtype.element_ty)
        if HAS_RES:
            r = tl.load(res_ptr + offs, mask=ok, other=0.0).to(tl.float32)
            y = (y.to(tl.float32) + r).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + offs, y, mask=ok)

    @triton.jit
    def _slot_expert(ids_ptr, pair, map_ptr, num_global, HAS_MAP: tl.constexpr):
        """The local expert of slot `pair` (int64; this rank's when in [0, E_local))."""
        return map_expert(tl.load(ids_ptr + pair).to(tl.int32), True, map_ptr, num_global, HAS_MAP).to(tl.int64)

    @triton.jit
    def _dot_rows(w_rows, row_ok, v_row, n_k, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
        """The ROWS weight rows at pointers `w_rows` [ROWS, 1] (`row_ok`: which exist) dotted with the vector
        v_row[0 : n_k], in fp32 (the dense GEMV's K loop: elementwise products, one row-sum at the end)."""
        acc = tl.zeros([ROWS, BLOCK_K], tl.float32)
        for k0 in range(0, n_k, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            col_ok = cols < n_k
            v = tl.load(v_row + cols, mask=col_ok, other=0.0).to(tl.float32)
            acc = gemv_step(acc, w_rows, row_ok, cols, col_ok, v)
        return tl.sum(acc, axis=1)

    @triton.jit
    def _moe_gemv_gate_up_kernel(
        x_ptr, w_ptr, act_ptr, ids_ptr, map_ptr, num_global, num_experts, top_k, inter, hidden,
        stride_xm, stride_we, stride_wn,
        HAS_MAP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_GDC: tl.constexpr,
    ):  # fmt: skip
        """act[p, n-tile] = silu(W1[e] x[t]) * (W3[e] x[t]) for pair p = program_id(0), t = p // top_k: the
        tile's BLOCK_N gate rows and BLOCK_N up rows (I further down) as one [2 BLOCK_N] stack."""
        await_producers(USE_GDC)
        pair = tl.program_id(0)
        expert = _slot_expert(ids_ptr, pair, map_ptr, num_global, HAS_MAP)
        if (expert < 0) | (expert >= num_experts):
            return  # another rank's expert, or none: the down kernel skips this slot too
        stack = tl.arange(0, 2 * BLOCK_N)  # the tile's gate rows, then its up rows
        row = tl.program_id(1) * BLOCK_N + stack % BLOCK_N
        w_rows = w_ptr + expert * stride_we + (row + stack // BLOCK_N * inter)[:, None].to(tl.int64) * stride_wn
        x_row = x_ptr + (pair // top_k).to(tl.int64) * stride_xm
        dots = _dot_rows(w_rows, row < inter, x_row, hidden, 2 * BLOCK_N, BLOCK_K)
        gate, up = tl.split(dots.reshape(2, BLOCK_N).permute(1, 0))
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        act = gate * tl.sigmoid(gate) * up
        tl.store(act_ptr + pair.to(tl.int64) * inter + rows, act.to(act_ptr.dtype.element_ty), mask=rows < inter)

    @triton.jit
    def _moe_gemv_down_kernel(
        act_ptr, w_ptr, out_ptr, weights_ptr, ids_ptr, map_ptr, num_global, num_experts, hidden, inter,
        stride_om, stride_we, stride_wn, res_ptr,
        TOP_K: tl.constexpr, HAS_MAP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_GDC: tl.constexpr,
        HAS_RES: tl.constexpr = False,
    ):  # fmt: skip
        """out[t, n-tile] = sum over slots j of weight[p] * (W2[e] act[p]), p = t * TOP_K + j, t = program_id(0):
        one K loop over the TOP_K slots' rows laid end to end (BLOCK_K divides I: a step stays within one slot,
        whose expert and weight are scalars there), the weight applied to act; slots without a (local) expert
        load nothing and add zero. Summed in fp32 in a fixed order."""
        await_producers(USE_GDC)
        t = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < hidden
        w_rows = w_ptr + rows[:, None].to(tl.int64) * stride_wn
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for c0 in range(0, TOP_K * inter, BLOCK_K):
            j = c0 // inter
            pair = t * TOP_K + j
            expert = _slot_expert(ids_ptr, pair, map_ptr, num_global, HAS_MAP)
            mine = (expert >= 0) & (expert < num_experts)
            cols = c0 - j * inter + tl.arange(0, BLOCK_K)
            col_ok = cols < tl.where(mine, inter, 0)  # all or none
            a = tl.load(act_ptr + pair.to(tl.int64) * inter + cols, mask=col_ok, other=0.0).to(tl.float32)
            a *= tl.load(weights_ptr + pair).to(tl.float32)
            acc = gemv_step(acc, w_rows + tl.where(mine, expert, 0) * stride_we, row_ok, cols, col_ok, a)
        store_sum(out_ptr, res_ptr, t.to(tl.int64) * stride_om + rows, tl.sum(acc, axis=1), row_ok, HAS_RES)

    @triton.jit
    def _slot_experts(ids_ptr, map_ptr, num_global, num_experts, t, TOP_K: tl.constexpr, SLOTS: tl.constexpr,
                      HAS_MAP: tl.constexpr):
        """Token t's slots for the slots kernels: (pair ids t * TOP_K + j [SLOTS], their (local) experts, which
        slots have one: j < TOP_K (SLOTS is TOP_K rounded up to a power of two) and an expert in [0,
        num_experts))."""
        slot = tl.arange(0, SLOTS)
        in_top = slot < TOP_K
        pair = t * TOP_K + slot
        expert = map_expert(tl.load(ids_ptr + pair, mask=in_top, other=-1).to(tl.int32), in_top, map_ptr,
                            num_global, HAS_MAP)
        return pair, expert, in_top & (expert >= 0) & (expert < num_experts)

    @triton.jit
    def _moe_gemv_gate_up_slots_kernel(
        x_ptr, w_ptr, act_ptr, ids_ptr, map_ptr, num_global, num_experts, inter, hidden, stride_xm, stride_we,
        stride_wn,
        TOP_K: tl.constexpr, SLOTS: tl.constexpr, HAS_MAP: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, USE_GDC: tl.constexpr,
    ):  # fmt: skip
        """act[p, n-tile] = silu(W1[e] x[t]) * (W3[e] x[t]) for every slot p = t * TOP_K + j of token t =
        program_id(0), as `_moe_gemv_gate_up_kernel` computes it, in one program per (token, n-tile): the slots'
        experts read once (SLOTS = TOP_K rounded up to a power of two; slots past TOP_K or without a (local)
        expert masked off, their act rows unwritten), then one K loop whose steps load the tile's gate and up rows
        of every slot at once, [SLOTS, 2 BLOCK_N, BLOCK_K], against x[t]'s columns. fp32 products summed per slot
        along K, silu(gate) * up in fp32, rounded to act's dtype."""
        await_producers(USE_GDC)
        t = tl.program_id(0).to(tl.int64)
        pair, expert, mine = _slot_experts(ids_ptr, map_ptr, num_global, num_experts, t, TOP_K, SLOTS, HAS_MAP)
        stack = tl.arange(0, 2 * BLOCK_N)  # the tile's gate rows, then its up rows (I further down)
        row = tl.program_id(1) * BLOCK_N + stack % BLOCK_N
        w_rows = (w_ptr + tl.where(mine, expert, 0).to(tl.int64)[:, None] * stride_we
                  + (row + stack // BLOCK_N * inter)[None, :].to(tl.int64) * stride_wn)  # [SLOTS, 2 BLOCK_N]
        w_ok = mine[:, None] & (row < inter)[None, :]
        x_row = x_ptr + t * stride_xm
        acc = tl.zeros([SLOTS, 2 * BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            col_ok = cols < hidden
            xv = tl.load(x_row + cols, mask=col_ok, other=0.0).to(tl.float32)
            w = tl.load(w_rows[:, :, None] + cols[None, None, :], mask=w_ok[:, :, None] & col_ok[None, None, :],
                        other=0.0)
            acc += w.to(tl.float32) * xv[None, None, :]
        dots = tl.sum(acc, axis=2)  # [SLOTS, 2 BLOCK_N]
        gate, up = tl.split(tl.permute(tl.reshape(dots, [SLOTS, 2, BLOCK_N]), [0, 2, 1]))
        act = gate * tl.sigmoid(gate) * up
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(act_ptr + pair[:, None] * inter + rows[None, :], act.to(act_ptr.dtype.element_ty),
                 mask=mine[:, None] & (rows < inter)[None, :])

    @triton.jit
    def _slots_routing(ids_ptr, weights_ptr, map_ptr, w_ptr, num_global, num_experts, hidden, stride_we, stride_wn,
                       TOP_K: tl.constexpr, SLOTS: tl.constexpr, HAS_MAP: tl.constexpr, BLOCK_N: tl.constexpr):
        """Token program_id(0)'s slots for `_moe_gemv_down_slots_kernel`: (pair ids [SLOTS], which slots have a
        (local) expert [SLOTS], their routing weights (fp32, 0 elsewhere), the weight-row pointers [SLOTS, BLOCK_N]
        of this program's rows in each slot's expert, which of those exist). Reads only the routing (ids, weights,
        expert map) and no weight."""
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        pair, expert, mine = _slot_experts(ids_ptr, map_ptr, num_global, num_experts, tl.program_id(0).to(tl.int64),
                                           TOP_K, SLOTS, HAS_MAP)
        wgt = tl.load(weights_ptr + pair, mask=mine, other=0.0).to(tl.float32)
        w_rows = (w_ptr + tl.where(mine, expert, 0).to(tl.int64)[:, None] * stride_we
                  + rows[None, :].to(tl.int64) * stride_wn)
        return pair, mine, wgt, w_rows, mine[:, None] & (rows < hidden)[None, :]

    @triton.jit
    def _slots_weights(w_rows, w_ok, k0, inter, BLOCK_K: tl.constexpr):
        """The slots' weight rows at columns k0 .. k0 + BLOCK_K - 1 of I, [SLOTS, BLOCK_N, BLOCK_K] (zero where a
        slot, row or column does not exist)."""
        cols = k0 + tl.arange(0, BLOCK_K)
        return tl.load(w_rows[:, :, None] + cols[None, None, :],
                       mask=w_ok[:, :, None] & (cols < inter)[None, None, :], other=0.0)

    @triton.jit
    def _slots_step(acc, w, act_ptr, pair, mine, wgt, k0, inter, BLOCK_K: tl.constexpr):
        """acc [BLOCK_N, BLOCK_K] + the step's products summed over the slots: w [SLOTS, BLOCK_N, BLOCK_K] (from
        `_slots_weights`) times each slot's act row at columns k0 .. (fp32) times its routing weight."""
        cols = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(act_ptr + pair[:, None] * inter + cols[None, :], mask=mine[:, None] & (cols < inter)[None, :],
                    other=0.0).to(tl.float32)
        return acc + tl.sum(w.to(tl.float32) * (a * wgt[:, None])[:, None, :], axis=0)

    @triton.jit
    def _moe_gemv_down_slots_kernel(
        act_ptr, w_ptr, out_ptr, weights_ptr, ids_ptr, map_ptr, num_global, num_experts, hidden, inter,
        stride_om, stride_we, stride_wn, res_ptr,
        TOP_K: tl.constexpr, SLOTS: tl.constexpr, HAS_MAP: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, USE_GDC: tl.constexpr, PRELOAD: tl.constexpr = False, HAS_RES: tl.constexpr = False,
    ):  # fmt: skip
        """out[t, n-tile] = sum over slots j of weight[p] * (W2[e] act[p]), p = t * TOP_K + j, t = program_id(0), as
        `_moe_gemv_down_kernel` computes it, but the K loop runs over I once with every slot in each step: the
        TOP_K slots' experts and weights are read once, before the loop (SLOTS = TOP_K rounded up to a power of
        two; slots past TOP_K and slots without a (local) expert masked off: no load, zero added), and a step
        loads [SLOTS, BLOCK_N, BLOCK_K] weights at once, so the weight loads of a step depend on nothing read in
        the loop. BLOCK_K need not divide I (the last step is masked). Sums in fp32: per step over the slots, then
        along K, in a fixed order (the last step last). PRELOAD: the routing and the last step's weights are
        loaded before the PDL wait: the kernel just before this one is the call's gate/up GEMV, which writes only
        act; the routing (ids, weights) was written before it (moe_topk's outputs) and the expert map is a
        constant, as fused_moe.py's MOE_PRELOAD describes for the grouped down GEMM."""
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        if PRELOAD:  # the last step peeled: its weights loaded before the wait, added last (the loop's order)
            last = (inter - 1) // BLOCK_K * BLOCK_K
            pair, mine, wgt, w_rows, w_ok = _slots_routing(
                ids_ptr, weights_ptr, map_ptr, w_ptr, num_global, num_experts, hidden, stride_we, stride_wn,
                TOP_K, SLOTS, HAS_MAP, BLOCK_N)
            w_last = _slots_weights(w_rows, w_ok, last, inter, BLOCK_K)
            await_producers(USE_GDC)
            for k0 in range(0, last, BLOCK_K):
                acc = _slots_step(acc, _slots_weights(w_rows, w_ok, k0, inter, BLOCK_K), act_ptr, pair, mine, wgt,
                                  k0, inter, BLOCK_K)
            acc = _slots_step(acc, w_last, act_ptr, pair, mine, wgt, last, inter, BLOCK_K)
        else:
            await_producers(USE_GDC)
            pair, mine, wgt, w_rows, w_ok = _slots_routing(
                ids_ptr, weights_ptr, map_ptr, w_ptr, num_global, num_experts, hidden, stride_we, stride_wn,
                TOP_K, SLOTS, HAS_MAP, BLOCK_N)
            for k0 in range(0, inter, BLOCK_K):
                acc = _slots_step(acc, _slots_weights(w_rows, w_ok, k0, inter, BLOCK_K), act_ptr, pair, mine, wgt,
                                  k0, inter, BLOCK_K)
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        store_sum(out_ptr, res_ptr, tl.program_id(0).to(tl.int64) * stride_om + rows, tl.sum(acc, axis=1),
                  rows < hidden, HAS_RES)


def moe_gemv_triton(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    map_ptr: torch.Tensor, num_global: int, has_map: bool, config: MoeGemvConfig,
                    residual: torch.Tensor | None = None) -> torch.Tensor:
    """The decode path (module docstring) for validated arguments: x [T, H] with unit column stride, weights and
    ids flat [T*k] contiguous, w13 [E, 2I, H] and w2 [E, H, I] with unit last stride; `map_ptr` / `num_global`
    / `has_map` as fused_moe.py's `_map_args` gives them. Returns [T, H] in x's dtype; with `residual` (contiguous
    [T, H] of x's dtype) the output plus it, the add in the down GEMV's epilogue (`store_sum`)."""
    t, h = x.shape
    e, inter = w2.shape[0], w2.shape[2]
    k = ids.numel() // t
    act = torch.empty(t * k, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(t, h, dtype=x.dtype, device=x.device)
    gu, dn = config.gate_up, config.down
    if inter % dn.block_k and not config.down_slots:
        raise ValueError(f"moe_gemv_triton: the down K step {dn.block_k} must divide I = {inter}")
    gu_meta = dict(HAS_MAP=has_map, BLOCK_N=gu.block_n, BLOCK_K=gu.block_k, num_warps=gu.num_warps,
                   num_stages=gu.num_stages, **pdl_args(x))
    if config.gate_up_slots:
        _moe_gemv_gate_up_slots_kernel[(t, triton.cdiv(inter, gu.block_n))](
            x, w13, act, ids, map_ptr, num_global, e, inter, h, x.stride(0), w13.stride(0), w13.stride(1),
            TOP_K=k, SLOTS=triton.next_power_of_2(k), **gu_meta)
    else:
        _moe_gemv_gate_up_kernel[(t * k, triton.cdiv(inter, gu.block_n))](
            x, w13, act, ids, map_ptr, num_global, e, k, inter, h, x.stride(0), w13.stride(0), w13.stride(1),
            **gu_meta)
    down_args = (act, w2, out, weights, ids, map_ptr, num_global, e, h, inter, out.stride(0), w2.stride(0),
                 w2.stride(1), residual if residual is not None else out)
    down_meta = dict(TOP_K=k, HAS_MAP=has_map, BLOCK_N=dn.block_n, BLOCK_K=dn.block_k, num_warps=dn.num_warps,
                     num_stages=dn.num_stages, HAS_RES=residual is not None, **pdl_args(act))
    if config.down_slots:
        _moe_gemv_down_slots_kernel[(t, triton.cdiv(h, dn.block_n))](
            *down_args, SLOTS=triton.next_power_of_2(k), PRELOAD=DOWN_SLOTS_PRELOAD, **down_meta)
    else:
        _moe_gemv_down_kernel[(t, triton.cdiv(h, dn.block_n))](*down_args, **down_meta)
    return out
