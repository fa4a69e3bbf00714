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
     before the sum (the reference does not round them either). Or (DOWN_PAIRS, opt-in, not yet timed on a GPU):
     program (pair p, output tile n) over p's I alone, fp32 partial rows, the token's last program to finish the
     tile summing its k partials in slot order (`_moe_gemv_down_pairs_kernel`).
The gate/up GEMV alone (`moe_gemv_gate_up`) also serves fused_moe.py's grouped path (MOE_GEMV_GATE_UP, opt-in).
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

from mini_infer.ops._split_k import split_counters
from mini_infer.ops._triton_support import HAS_TRITON, await_producers, pdl_args, tl, triton

if HAS_TRITON:
    from mini_infer.ops._split_k import arrives_last
    from mini_infer.ops.linear import gemv_load, gemv_step

__all__ = ["MOE_GEMV_MAX_PAIRS", "GemvTile", "MoeGemvConfig", "gate_up_tile", "moe_gemv_config", "moe_gemv_gate_up",
           "moe_gemv_tiles", "moe_gemv_triton"]


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
    down_pairs: bool = False  # the down GEMV a program per (pair, row tile), slots summed by the last to arrive


# The decode path serves calls of at most this many (token, slot) pairs: where it beat the grouped GEMMs on an
# H200 (mixtral-8x7b at batch 1; module docstring). In the engine too it loses beyond that (H200, 2026-11-24,
# MINI_INFER_MOE_GEMV_MAX_PAIRS=8 vs 2: qwen3-30b-a3b batch 1 286.3 vs 342.5 tok/s, deepseek-v2-lite 257.2 vs
# 350.6; bench/RESULTS.md twelfth session). MINI_INFER_MOE_GEMV_MAX_PAIRS sets another limit.
MOE_GEMV_MAX_PAIRS = int(os.environ.get("MINI_INFER_MOE_GEMV_MAX_PAIRS", "2"))  # read once, at import


# The gate/up GEMV's tile (rows of gate and of up a program, K step, warps, stages): the H200 sweep's best
# (bench/results/kernel_moe_decode_sweep_h200.json), one gate and one up row a program, 3 stages. Read at each
# `moe_gemv_tiles` call (a benchmark switch: `--switch _moe_gemv.GATE_UP_TILE=2/1024/4/1`).
GATE_UP_TILE = (1, 1024, 4, 3)
# The gate/up GEMV from at most about GATE_UP_PROGRAMS programs in all (0: a program per row tile), each walking
# several row tiles of its pair (`_moe_gemv_gate_up_kernel`'s STRIDED way, the same bits): in qwen3-30b-a3b's batch-1
# timeline the decode path's gate/up GEMV, 6,144 programs of one gate and one up row, each loading its expert id
# first, read its 50 MB at ~3.4 TB/s (thirty-ninth session) where the dense q/k/v GEMV, 2,560 programs, reads at the
# copy bandwidth. Each program loads a step's weights one step ahead (two steps in flight). Not yet timed on a GPU,
# so 0: `--switch _moe_gemv.GATE_UP_PROGRAMS=1184` (the sm_90 build at the default tile takes 56 registers: 9
# programs of 4 warps an SM, 1,188 on an H200; 148 a pair at qwen3-30b-a3b's 8 pairs, 5-6 row tiles each). Read at
# each launch.
GATE_UP_PROGRAMS = int(os.environ.get("MINI_INFER_MOE_GEMV_GATE_UP_PROGRAMS", "0"))
# The down GEMV a program per (token, slot) pair and BLOCK_N output rows (`_moe_gemv_down_pairs_kernel`) instead of
# a program per (token, row tile) walking every slot's I in one K loop (`_moe_gemv_down_kernel`): in qwen3-30b-a3b's
# batch-1 timeline on an H200 (thirty-ninth session, bench/RESULTS.md) the latter took 25-26 us a layer over 25 MB
# (512 programs, 24 dependent K steps of 256 each), the decode path's gate/up GEMV 14.5-14.7 over 50 MB (6,144
# programs of 2 rows). Each pair's partial rows are stored in fp32 and the last of a token's TOP_K programs to
# finish a row tile sums them in slot order (fused_moe.py's `_merge_slot_tiles` way: deterministic). Any I (the K
# loop masks its last step). Not yet timed on a GPU, so off: `--switch
# _moe_gemv.DOWN_PAIRS=1,_moe_gemv.MOE_GEMV_MAX_PAIRS=8` times it at qwen3-30b-a3b batch 1; read at each
# `moe_gemv_tiles` call (MINI_INFER_MOE_GEMV_DOWN_PAIRS=1 at import). DOWN_PAIRS_TILE: (rows a program, K step,
# warps, stages): qwen3-30b-a3b's I of 768 in three pipelined steps of 256, 4 rows (6 KiB of bf16) a program.
# Only experts of at most DOWN_PAIRS_MAX_I intermediate rows take it: a program walks one pair's I, so long ones
# (mixtral-8x7b's 14,336: 56 steps of 256) would be the slow dependent chain this kernel is to avoid; the per-row-tile
# kernel reads those at 0.94 of the copy bandwidth (the module docstring's sweep).
DOWN_PAIRS = os.environ.get("MINI_INFER_MOE_GEMV_DOWN_PAIRS", "0") == "1"
DOWN_PAIRS_TILE = (4, 256, 4, 3)
DOWN_PAIRS_MAX_I = 4096
# The pairs kernel loads its pair's expert id (written by the router two kernels back: the gate/up GEMV before it
# lets it launch only after its own wait) and the first K step of its weight rows before its PDL wait; the routing
# weight and the act rows (the gate/up GEMV's output) after it. Read at each launch.
DOWN_PAIRS_PRELOAD = os.environ.get("MINI_INFER_MOE_GEMV_DOWN_PAIRS_PRELOAD", "1") != "0"


def moe_gemv_config(num_tokens: int, top_k: int, hidden: int, inter: int) -> MoeGemvConfig | None:
    """The decode path's tiles for these shapes, or None when the grouped-GEMM path serves them (more than
    MOE_GEMV_MAX_PAIRS pairs, or an I that no K step of the down GEMV divides). Depends on shapes only, so a CUDA
    graph captured for one T keeps its kernels."""
    return moe_gemv_tiles(hidden, inter) if num_tokens * top_k <= MOE_GEMV_MAX_PAIRS else None


def gate_up_tile() -> GemvTile:
    """The gate/up GEMV's tile (GATE_UP_TILE, read now)."""
    return GemvTile(*GATE_UP_TILE)


def moe_gemv_tiles(hidden: int, inter: int) -> MoeGemvConfig | None:
    """The decode path's tiles for experts of these sizes, whatever the number of pairs (None: no down K step
    divides I, unless the per-pair down GEMV takes them: DOWN_PAIRS, I up to DOWN_PAIRS_MAX_I)."""
    if DOWN_PAIRS and inter <= DOWN_PAIRS_MAX_I:
        return MoeGemvConfig(gate_up_tile(), GemvTile(*DOWN_PAIRS_TILE), down_pairs=True)
    down_k = down_k_step(inter)
    if down_k is None:
        return None
    # the down GEMV 4 rows at K steps of 512+, else 2 (the H200 sweep's best, as GATE_UP_TILE)
    return MoeGemvConfig(gate_up_tile(), GemvTile(4 if down_k >= 512 else 2, down_k, 4, 3))


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
    def _store_act(act_ptr, pair, dots, tile, inter, BLOCK_N: tl.constexpr):
        """act[pair, tile's rows] = silu(gate) * up from the tile's [2 BLOCK_N] row sums (its gate rows, then its up
        rows), rounded to act's dtype."""
        gate, up = tl.split(dots.reshape(2, BLOCK_N).permute(1, 0))
        rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        act = gate * tl.sigmoid(gate) * up
        tl.store(act_ptr + pair.to(tl.int64) * inter + rows, act.to(act_ptr.dtype.element_ty), mask=rows < inter)

    @triton.jit
    def _moe_gemv_gate_up_kernel(
        x_ptr, w_ptr, act_ptr, ids_ptr, map_ptr, num_global, num_experts, top_k, inter, hidden,
        stride_xm, stride_we, stride_wn,
        HAS_MAP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STRIDED: tl.constexpr,
        USE_GDC: tl.constexpr,
    ):  # fmt: skip
        """act[p, n-tile] = silu(W1[e] x[t]) * (W3[e] x[t]) for pair p = program_id(0), t = p // top_k: the
        tile's BLOCK_N gate rows and BLOCK_N up rows (I further down) as one [2 BLOCK_N] stack. STRIDED: the same
        bits from fewer programs, program j taking the tiles j, j + P, j + 2P, ... (P = num_programs(1)), its expert
        id read once, (tile, K step) walked in one loop whose weights are loaded a step ahead; else the tile j."""
        await_producers(USE_GDC)
        pair = tl.program_id(0)
        expert = _slot_expert(ids_ptr, pair, map_ptr, num_global, HAS_MAP)
        if (expert < 0) | (expert >= num_experts):
            return  # another rank's expert, or none: the down kernel skips this slot too
        x_row = x_ptr + (pair // top_k).to(tl.int64) * stride_xm
        w_expert = w_ptr + expert * stride_we
        if STRIDED:
            _gate_up_tiles_strided(x_row, w_expert, act_ptr, pair, inter, hidden, stride_wn, BLOCK_N, BLOCK_K)
        else:
            stack = tl.arange(0, 2 * BLOCK_N)  # the tile's gate rows, then its up rows
            row = tl.program_id(1) * BLOCK_N + stack % BLOCK_N
            w_rows = w_expert + (row + stack // BLOCK_N * inter)[:, None].to(tl.int64) * stride_wn
            dots = _dot_rows(w_rows, row < inter, x_row, hidden, 2 * BLOCK_N, BLOCK_K)
            _store_act(act_ptr, pair, dots, tl.program_id(1), inter, BLOCK_N)

    @triton.jit
    def _gate_up_tiles_strided(x_row, w_expert, act_ptr, pair, inter, hidden, stride_wn, BLOCK_N: tl.constexpr,
                               BLOCK_K: tl.constexpr):
        """`_moe_gemv_gate_up_kernel`'s STRIDED way for program j = program_id(1) of `pair`."""
        j = tl.program_id(1)
        k_steps = tl.cdiv(hidden, BLOCK_K)
        steps = tl.cdiv(tl.cdiv(inter, BLOCK_N) - j, tl.num_programs(1)) * k_steps  # tiles j, j + P, ... below the end
        # each step's weights are loaded one step ahead (the loop's loads wait on nothing the step before computes)
        w_cur, x_cur = _strided_step_load(w_expert, x_row, j, 0, steps, k_steps, inter, hidden, stride_wn, BLOCK_N,
                                          BLOCK_K)
        acc = tl.zeros([2 * BLOCK_N, BLOCK_K], tl.float32)
        for it in range(0, steps):
            w_next, x_next = _strided_step_load(w_expert, x_row, j, it + 1, steps, k_steps, inter, hidden, stride_wn,
                                                BLOCK_N, BLOCK_K)
            acc += w_cur.to(tl.float32) * x_cur[None, :]  # gemv_step's arithmetic
            if it % k_steps == k_steps - 1:  # the tile's last K step: its rows' sums, then the next tile from zero
                _store_act(act_ptr, pair, tl.sum(acc, axis=1), j + it // k_steps * tl.num_programs(1), inter, BLOCK_N)
                acc = tl.zeros([2 * BLOCK_N, BLOCK_K], tl.float32)
            w_cur, x_cur = w_next, x_next

    @triton.jit
    def _strided_step_load(w_expert, x_row, j, it, steps, k_steps, inter, hidden, stride_wn, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr):
        """Step `it` of `_gate_up_tiles_strided`'s program j: (its [2 BLOCK_N, BLOCK_K] weights, zero past
        the rows, the row's end or the last step; x's BLOCK_K values there in fp32)."""
        stack = tl.arange(0, 2 * BLOCK_N)
        tile = j + it // k_steps * tl.num_programs(1)
        row = tile * BLOCK_N + stack % BLOCK_N
        cols = it % k_steps * BLOCK_K + tl.arange(0, BLOCK_K)
        col_ok = (cols < hidden) & (cols * 0 + it < steps)
        w_rows = w_expert + (row + stack // BLOCK_N * inter)[:, None].to(tl.int64) * stride_wn
        return (gemv_load(w_rows, row < inter, cols, col_ok),
                tl.load(x_row + cols, mask=col_ok, other=0.0).to(tl.float32))

    @triton.jit
    def _moe_gemv_down_kernel(
        act_ptr, w_ptr, out_ptr, weights_ptr, ids_ptr, map_ptr, num_global, num_experts, hidden, inter,
        stride_om, stride_we, stride_wn,
        TOP_K: tl.constexpr, HAS_MAP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_GDC: tl.constexpr,
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
        out = tl.sum(acc, axis=1)
        tl.store(out_ptr + t.to(tl.int64) * stride_om + rows, out.to(out_ptr.dtype.element_ty), mask=row_ok)

    @triton.jit
    def _pair_first_step(w_ptr, ids_ptr, map_ptr, pair, num_global, num_experts, inter, rows, row_ok, cols0, stride_we,
                         stride_wn, HAS_MAP: tl.constexpr):
        """`_moe_gemv_down_pairs_kernel`'s start: (n_k, I for a pair with a local expert, else 0: no K step loads
        anything; its weight rows' pointers; their first K step's weights)."""
        expert = _slot_expert(ids_ptr, pair, map_ptr, num_global, HAS_MAP)
        mine = (expert >= 0) & (expert < num_experts)
        n_k = tl.where(mine, inter, 0)
        w_rows = w_ptr + tl.where(mine, expert, 0) * stride_we + rows[:, None].to(tl.int64) * stride_wn
        return n_k, w_rows, gemv_load(w_rows, row_ok, cols0, cols0 < n_k)

    @triton.jit
    def _moe_gemv_down_pairs_kernel(
        act_ptr, w_ptr, out_ptr, part_ptr, cnt_ptr, weights_ptr, ids_ptr, map_ptr, num_global, num_experts, hidden,
        inter, stride_om, stride_we, stride_wn,
        TOP_K: tl.constexpr, HAS_MAP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        PRELOAD: tl.constexpr, USE_GDC: tl.constexpr,
    ):  # fmt: skip
        """part[p, n-tile] = weight[p] * (W2[e] act[p]) in fp32 for pair p = program_id(0) (its local expert e; a
        pair without one stores nothing), then out[t, n-tile] = the sum over slots j of part[t * TOP_K + j] in slot
        order, by the last of token t's TOP_K programs to count at its counter for the tile (`arrives_last`; pairs
        without a local expert count too and are skipped in the sum). One K loop over I (the last step masked),
        the weight applied to act, elementwise fp32 products and one row-sum (the dense GEMV's loop). PRELOAD: the
        pair's expert id and the first K step's weights are loaded before the wait (both written before the kernel
        just before this one, which launches this one only after its own wait)."""
        pair = tl.program_id(0).to(tl.int64)
        tile = tl.program_id(1)
        t = pair // TOP_K
        rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < hidden
        cols0 = tl.arange(0, BLOCK_K)
        if PRELOAD:
            n_k, w_rows, w0 = _pair_first_step(w_ptr, ids_ptr, map_ptr, pair, num_global, num_experts, inter, rows,
                                               row_ok, cols0, stride_we, stride_wn, HAS_MAP)
            await_producers(USE_GDC)
        else:
            await_producers(USE_GDC)
            n_k, w_rows, w0 = _pair_first_step(w_ptr, ids_ptr, map_ptr, pair, num_global, num_experts, inter, rows,
                                               row_ok, cols0, stride_we, stride_wn, HAS_MAP)
        wgt = tl.load(weights_ptr + pair).to(tl.float32)
        a_row = act_ptr + pair * inter
        a = tl.load(a_row + cols0, mask=cols0 < n_k, other=0.0).to(tl.float32) * wgt
        acc = w0.to(tl.float32) * a[None, :]
        for k0 in range(BLOCK_K, n_k, BLOCK_K):
            cols = k0 + cols0
            col_ok = cols < n_k
            a = tl.load(a_row + cols, mask=col_ok, other=0.0).to(tl.float32) * wgt
            acc = gemv_step(acc, w_rows, row_ok, cols, col_ok, a)
        part = tl.sum(acc, axis=1)
        tl.store(part_ptr + pair * hidden + rows, part, mask=row_ok & (rows * 0 < n_k))  # n_k > 0: a local expert
        if arrives_last(cnt_ptr + t * tl.num_programs(1) + tile, TOP_K):
            total = tl.zeros([BLOCK_N], tl.float32)
            for j in tl.static_range(TOP_K):
                p = t * TOP_K + j
                e = _slot_expert(ids_ptr, p, map_ptr, num_global, HAS_MAP)
                used = tl.where((e >= 0) & (e < num_experts), hidden, 0)
                total += tl.load(part_ptr + p * hidden + rows, mask=rows < used, other=0.0)
            tl.store(out_ptr + t * stride_om + rows, total.to(out_ptr.dtype.element_ty), mask=row_ok)


def moe_gemv_gate_up(x: torch.Tensor, w13: torch.Tensor, act: torch.Tensor, ids: torch.Tensor, map_ptr: torch.Tensor,
                     num_global: int, has_map: bool, tile: GemvTile) -> None:
    """The decode path's gate/up GEMV alone (`_moe_gemv_gate_up_kernel`): act[p] = silu(W1[e] x[t]) * (W3[e] x[t])
    for every (token, slot) pair p = t * k + j of `ids` (flat [T*k]) with a (local) expert e, rows of the others
    left unwritten; act is [T*k, I] in x's dtype, the layout the grouped down GEMM's pair-per-block mode reads
    (fused_moe.py's MOE_GEMV_GATE_UP). Launched so that the next kernel may load, before its own wait, what the
    kernels before this one wrote (the routing), never `act`."""
    t, h = x.shape
    e, inter = w13.shape[0], w13.shape[1] // 2
    k = ids.numel() // t
    tiles = triton.cdiv(inter, tile.block_n)
    per_pair = max(1, GATE_UP_PROGRAMS // (t * k)) if GATE_UP_PROGRAMS > 0 else tiles
    _moe_gemv_gate_up_kernel[(t * k, min(per_pair, tiles))](
        x, w13, act, ids, map_ptr, num_global, e, k, inter, h, x.stride(0), w13.stride(0), w13.stride(1),
        HAS_MAP=has_map, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, STRIDED=per_pair < tiles,
        num_warps=tile.num_warps, num_stages=tile.num_stages, **pdl_args(x, trigger_first=False))


def moe_gemv_triton(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    map_ptr: torch.Tensor, num_global: int, has_map: bool, config: MoeGemvConfig) -> torch.Tensor:
    """The decode path (module docstring) for validated arguments: x [T, H] with unit column stride, weights and
    ids flat [T*k] contiguous, w13 [E, 2I, H] and w2 [E, H, I] with unit last stride; `map_ptr` / `num_global`
    / `has_map` as fused_moe.py's `_map_args` gives them. Returns [T, H] in x's dtype."""
    t, h = x.shape
    e, inter = w2.shape[0], w2.shape[2]
    k = ids.numel() // t
    act = torch.empty(t * k, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(t, h, dtype=x.dtype, device=x.device)
    dn = config.down
    if inter % dn.block_k and not config.down_pairs:
        raise ValueError(f"moe_gemv_triton: the down K step {dn.block_k} must divide I = {inter}")
    moe_gemv_gate_up(x, w13, act, ids, map_ptr, num_global, has_map, config.gate_up)
    if config.down_pairs:
        tiles = triton.cdiv(h, dn.block_n)
        part = torch.empty(t * k, h, dtype=torch.float32, device=x.device)
        _moe_gemv_down_pairs_kernel[(t * k, tiles)](
            act, w2, out, part, split_counters(x.device, t * tiles), weights, ids, map_ptr, num_global, e, h, inter,
            out.stride(0), w2.stride(0), w2.stride(1), TOP_K=k, HAS_MAP=has_map, BLOCK_N=dn.block_n,
            BLOCK_K=dn.block_k, PRELOAD=DOWN_PAIRS_PRELOAD, num_warps=dn.num_warps, num_stages=dn.num_stages,
            **pdl_args(act, trigger_first=False))
        return out
    _moe_gemv_down_kernel[(t, triton.cdiv(h, dn.block_n))](
        act, w2, out, weights, ids, map_ptr, num_global, e, h, inter, out.stride(0), w2.stride(0), w2.stride(1),
        TOP_K=k, HAS_MAP=has_map, BLOCK_N=dn.block_n, BLOCK_K=dn.block_k, num_warps=dn.num_warps,
        num_stages=dn.num_stages, **pdl_args(act, trigger_first=False))
    return out
