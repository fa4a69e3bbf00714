"""The decode path of `mini_infer::fused_moe`: two grouped GEMV kernels for very few (token, slot) pairs.

No align step and no slot sum:
  1. gate/up: program (pair p = t * k + j, output tile n) reads the (local) expert e of slot p, exits at once when
     it has none (id outside [0, E_global), or expert_map -1), and computes gate and up rows n of W13[e] times
     x[t] (one stack of rows), plus their w13_bias rows (HAS_BIAS), the gate activation (`gate_activation`:
     silu(gate) * up, or GPT-OSS's clamped SwiGLU) in fp32 rounded to hidden's dtype -> act [T*k, I] (rows of
     dropped slots unwritten);
  2. down: program (token t, output tile n) runs one K loop over the k slots' act rows laid end to end (a K step
     divides I, so each step lies in one slot, whose expert and routing weight are scalars there), the routing
     weight applied to act, slots without a (local) expert loading nothing; with HAS_BIAS each slot's weight times
     its expert's w2_bias row is then added, slot by slot: out [T, H] directly, summed in fp32 in a fixed order.
     Unlike the grouped path, the slots' products are not rounded to hidden's dtype one by one before the sum
     (the reference does not round them either).
Each pair reads its expert's weights itself (tokens that share an expert read it again), so this can pay only
while T * k is tiny. Measured on an H200 (bench/kernel_moe.py --decode, bench/results/kernel_moe_decode*_h200.json)
it beat the grouped GEMMs only at mixtral-8x7b's batch 1 (2 pairs, I 14336: 183 vs 193 us); at qwen3-30b-a3b's
(8 pairs, I 768: 35 vs 30 us) and deepseek-v2-lite's (6 pairs, I 1408: 67 vs 36 us) batch 1 it lost, the tile
sweep finding nothing better. So `moe_gemv_config` picks it up to MOE_GEMV_MAX_PAIRS = 2 pairs only, by shapes
alone (the grid is a function of the shapes: CUDA-graph safe, no host sync). The K loops are the dense GEMV's
(`gemv_step` of linear.py): elementwise fp32 products, one row-sum at the end.

Holds `map_expert`, the expert-map lookup that fused_moe.py's align and sum kernels use too, and
`gate_activation`, the gate/up epilogue its grouped GEMM shares; `store_gated` and `add_slot_biases`, the GEMVs'
epilogues, which fused_moe_mxfp4.py's MXFP4 GEMVs share. Launchers assume
fused_moe.py's `_check_args` passed. Must not import anything from mini_infer outside `mini_infer.ops`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from mini_infer.ops._triton_support import HAS_TRITON, await_producers, pdl_args, tl, triton

if HAS_TRITON:
    from mini_infer.ops.linear import gemv_step

__all__ = ["ACTIVATION_IDS", "MOE_GEMV_MAX_PAIRS", "SWIGLU_ALPHA", "SWIGLU_LIMIT", "GemvTile", "MoeGemvConfig",
           "epilogue_args", "moe_gemv_config", "moe_gemv_tiles", "moe_gemv_triton"]


# The kernels' ACTIVATION switch (a constexpr) for fused_moe's `activation` argument; 0 (silu) is the default of
# every kernel, whose code is then the same as before the switch existed.
ACTIVATION_IDS = {"silu": 0, "swigluoai": 1}
# "swigluoai"'s constants where none are given: GPT-OSS's (every published config; transformers 5.17 hard-codes them)
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0


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


# The decode path serves calls of at most this many (token, slot) pairs: where it beat the grouped GEMMs on an
# H200 (mixtral-8x7b at batch 1; module docstring). In the engine too it loses beyond that (H200, 2026-11-24,
# MINI_INFER_MOE_GEMV_MAX_PAIRS=8 vs 2: qwen3-30b-a3b batch 1 286.3 vs 342.5 tok/s, deepseek-v2-lite 257.2 vs
# 350.6; bench/RESULTS.md twelfth session). MINI_INFER_MOE_GEMV_MAX_PAIRS sets another limit.
MOE_GEMV_MAX_PAIRS = int(os.environ.get("MINI_INFER_MOE_GEMV_MAX_PAIRS", "2"))  # read once, at import


def moe_gemv_config(num_tokens: int, top_k: int, hidden: int, inter: int) -> MoeGemvConfig | None:
    """The decode path's tiles for these shapes, or None when the grouped-GEMM path serves them (more than
    MOE_GEMV_MAX_PAIRS pairs, or an I that no K step of the down GEMV divides). Depends on shapes only, so a CUDA
    graph captured for one T keeps its kernels."""
    return moe_gemv_tiles(hidden, inter) if num_tokens * top_k <= MOE_GEMV_MAX_PAIRS else None


def moe_gemv_tiles(hidden: int, inter: int) -> MoeGemvConfig | None:
    """The decode path's tiles for experts of these sizes, whatever the number of pairs (None: no down K step
    divides I)."""
    down_k = down_k_step(inter)
    if down_k is None:
        return None
    # the H200 sweep's best of each GEMV (bench/results/kernel_moe_decode_sweep_h200.json): one gate and one up
    # row per program, 3 stages; the down GEMV 4 rows at K steps of 512+, else 2
    return MoeGemvConfig(GemvTile(1, 1024, 4, 3), GemvTile(4 if down_k >= 512 else 2, down_k, 4, 3))


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
    def gate_activation(gate, up, ACTIVATION: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr):
        """The gated activation of fp32 gate / up tiles: ACTIVATION 0, silu(gate) * up; 1 ("swigluoai", GPT-OSS),
        gate clamped to at most LIMIT, up to [-LIMIT, LIMIT], then (up + 1) * gate * sigmoid(ALPHA * gate)."""
        if ACTIVATION == 1:
            gate = tl.minimum(gate, LIMIT)
            up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
            out = (up + 1.0) * (gate * tl.sigmoid(gate * ALPHA))
        else:
            out = gate * tl.sigmoid(gate) * up
        return out

    @triton.jit
    def _slot_expert(ids_ptr, pair, map_ptr, num_global, HAS_MAP: tl.constexpr):
        """The local expert of slot `pair` (int64; this rank's when in [0, E_local))."""
        return map_expert(tl.load(ids_ptr + pair).to(tl.int32), True, map_ptr, num_global, HAS_MAP).to(tl.int64)

    @triton.jit
    def store_gated(dots, expert, pair, stack, row, inter, bias_ptr, act_ptr, BLOCK_N: tl.constexpr,
                    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr):
        """The gate/up GEMV's epilogue: the [2 BLOCK_N] stack of fp32 dots (the tile's gate rows `row`, then its up
        rows, `stack` their index), plus the expert's bias rows (HAS_BIAS; bias_ptr [E, 2I] contiguous), through
        `gate_activation`, stored to act[pair, tile] in act's dtype."""
        if HAS_BIAS:
            bias_rows = bias_ptr + expert * 2 * inter + row + stack // BLOCK_N * inter
            dots += tl.load(bias_rows, mask=row < inter, other=0.0).to(tl.float32)
        gate, up = tl.split(dots.reshape(2, BLOCK_N).permute(1, 0))
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        act = gate_activation(gate, up, ACTIVATION, ALPHA, LIMIT)
        tl.store(act_ptr + pair.to(tl.int64) * inter + rows, act.to(act_ptr.dtype.element_ty), mask=rows < inter)

    @triton.jit
    def add_slot_biases(out, t, rows, weights_ptr, ids_ptr, map_ptr, num_global, num_experts, hidden, bias_ptr,
                        TOP_K: tl.constexpr, HAS_MAP: tl.constexpr):
        """The down GEMV's bias: out [BLOCK_N] (rows `rows` of token t) plus, slot by slot in order, each slot's
        routing weight times its (local) expert's bias row (bias_ptr [E, H] contiguous; HF: weight * (W2 act +
        bias)); slots without a local expert add nothing."""
        for j in tl.static_range(TOP_K):
            pair = t * TOP_K + j
            expert = _slot_expert(ids_ptr, pair, map_ptr, num_global, HAS_MAP)
            mine = (expert >= 0) & (expert < num_experts)
            bias_ok = rows < tl.where(mine, hidden, 0)  # all or none (a vector-and-scalar `&` is no mask)
            bias = tl.load(bias_ptr + tl.where(mine, expert, 0) * hidden + rows, mask=bias_ok, other=0.0)
            out += tl.load(weights_ptr + pair).to(tl.float32) * bias.to(tl.float32)
        return out

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
        stride_xm, stride_we, stride_wn, bias_ptr,
        HAS_MAP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_GDC: tl.constexpr,
        HAS_BIAS: tl.constexpr = False, ACTIVATION: tl.constexpr = 0, ALPHA: tl.constexpr = SWIGLU_ALPHA,
        LIMIT: tl.constexpr = SWIGLU_LIMIT,
    ):  # fmt: skip
        """act[p, n-tile] = silu(W1[e] x[t]) * (W3[e] x[t]) for pair p = program_id(0), t = p // top_k: the
        tile's BLOCK_N gate rows and BLOCK_N up rows (I further down) as one [2 BLOCK_N] stack. HAS_BIAS: the
        expert's bias row [2I] (contiguous, bias_ptr; None without) added to the stack; ACTIVATION / ALPHA / LIMIT:
        `gate_activation`'s."""
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
        store_gated(dots, expert, pair, stack, row, inter, bias_ptr, act_ptr, BLOCK_N, HAS_BIAS, ACTIVATION, ALPHA,
                    LIMIT)

    @triton.jit
    def _moe_gemv_down_kernel(
        act_ptr, w_ptr, out_ptr, weights_ptr, ids_ptr, map_ptr, num_global, num_experts, hidden, inter,
        stride_om, stride_we, stride_wn, bias_ptr,
        TOP_K: tl.constexpr, HAS_MAP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_GDC: tl.constexpr,
        HAS_BIAS: tl.constexpr = False,
    ):  # fmt: skip
        """out[t, n-tile] = sum over slots j of weight[p] * (W2[e] act[p]), p = t * TOP_K + j, t = program_id(0):
        one K loop over the TOP_K slots' rows laid end to end (BLOCK_K divides I: a step stays within one slot,
        whose expert and weight are scalars there), the weight applied to act; slots without a (local) expert
        load nothing and add zero. HAS_BIAS: then weight[p] * bias[e] (bias_ptr: [E, H] contiguous; None
        without) for each slot in order. Summed in fp32 in a fixed order."""
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
        if HAS_BIAS:
            out = add_slot_biases(out, t, rows, weights_ptr, ids_ptr, map_ptr, num_global, num_experts, hidden,
                                  bias_ptr, TOP_K, HAS_MAP)
        tl.store(out_ptr + t.to(tl.int64) * stride_om + rows, out.to(out_ptr.dtype.element_ty), mask=row_ok)


def moe_gemv_triton(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    map_ptr: torch.Tensor, num_global: int, has_map: bool, config: MoeGemvConfig,
                    w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                    activation: str = "silu", swiglu_alpha: float = SWIGLU_ALPHA,
                    swiglu_limit: float = SWIGLU_LIMIT) -> torch.Tensor:
    """The decode path (module docstring) for validated arguments: x [T, H] with unit column stride, weights and
    ids flat [T*k] contiguous, w13 [E, 2I, H] and w2 [E, H, I] with unit last stride, the optional biases
    [E, 2I] / [E, H] contiguous; `map_ptr` / `num_global` / `has_map` as fused_moe.py's `_map_args` gives them;
    `activation` one of ACTIVATION_IDS (the SwiGLU constants only read for "swigluoai"). Returns [T, H] in x's
    dtype."""
    t, h = x.shape
    e, inter = w2.shape[0], w2.shape[2]
    k = ids.numel() // t
    act = torch.empty(t * k, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(t, h, dtype=x.dtype, device=x.device)
    gu, dn = config.gate_up, config.down
    if inter % dn.block_k:
        raise ValueError(f"moe_gemv_triton: the down K step {dn.block_k} must divide I = {inter}")
    _moe_gemv_gate_up_kernel[(t * k, triton.cdiv(inter, gu.block_n))](
        x, w13, act, ids, map_ptr, num_global, e, k, inter, h, x.stride(0), w13.stride(0), w13.stride(1), w13_bias,
        HAS_MAP=has_map, BLOCK_N=gu.block_n, BLOCK_K=gu.block_k, num_warps=gu.num_warps, num_stages=gu.num_stages,
        **epilogue_args(w13_bias, activation, swiglu_alpha, swiglu_limit), **pdl_args(x, trigger_first=False))
    _moe_gemv_down_kernel[(t, triton.cdiv(h, dn.block_n))](
        act, w2, out, weights, ids, map_ptr, num_global, e, h, inter, out.stride(0), w2.stride(0), w2.stride(1),
        w2_bias, TOP_K=k, HAS_MAP=has_map, BLOCK_N=dn.block_n, BLOCK_K=dn.block_k, num_warps=dn.num_warps,
        num_stages=dn.num_stages, **epilogue_args(w2_bias), **pdl_args(act, trigger_first=False))
    return out


def epilogue_args(bias: torch.Tensor | None, activation: str = "silu", swiglu_alpha: float = SWIGLU_ALPHA,
                   swiglu_limit: float = SWIGLU_LIMIT) -> dict:
    """The kernels' constexpr switches for a bias (None: none; the kernel then gets None for its pointer, which
    Triton specializes away) and, for a gate/up kernel, an activation: only those that differ from the kernels'
    defaults, so that a call without bias with silu launches exactly the kernels it launched before they existed."""
    args: dict = {"HAS_BIAS": True} if bias is not None else {}
    if activation != "silu":
        args.update(ACTIVATION=ACTIVATION_IDS[activation], ALPHA=float(swiglu_alpha), LIMIT=float(swiglu_limit))
    return args
