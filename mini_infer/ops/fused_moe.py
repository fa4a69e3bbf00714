"""`mini_infer::fused_moe`: the routed experts of a mixture-of-experts block, given the routing.

    out[t] = sum_j topk_weights[t, j] * (W2[e] @ act(W1[e] @ x[t] + b1[e], W3[e] @ x[t] + b3[e]) + b2[e]),
    e = topk_ids[t, j]

Shapes (T tokens, H hidden, I expert intermediate size, E experts, k slots per token):
    hidden [T, H] (bf16, fp16 or fp32), topk_weights [T, k] (float; fp32 from `mini_infer::moe_topk`),
    topk_ids [T, k] (int32 or int64), w13 [E, 2*I, H], w2 [E, H, I] (hidden's dtype) -> [T, H] (hidden's dtype);
    optional w13_bias [E, 2*I] = [b1 | b3] and w2_bias [E, H] = b2 (hidden's dtype; absent: zero).
w13 stacks, for each expert, the gate projection W1 (rows 0 .. I-1) on top of the up projection W3 (rows I ..
2I-1): exactly HF's `experts.gate_up_proj` in transformers 5.x (Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3), and
`torch.cat([gate_proj.weight, up_proj.weight])` per expert for checkpoints that keep them apart; w2 is
`experts.down_proj` (`down_proj.weight` per expert). GPT-OSS stores its experts transposed with gate and up
interleaved (`gate_up_proj` [E, H, 2I], gate = [..., ::2]) and with biases: route_moe re-lays them into this
layout once, at compile time. A slot whose id is outside [0, E) contributes nothing, bias included (HF uses id E to
mean "no expert"). The down bias b2 is added per (token, slot) before the routing weight, as HF does.
`activation`:
  * "silu" (the default): act(g, u) = silu(g) * u;
  * "swigluoai" (GPT-OSS, vLLM's name): g' = min(g, swiglu_limit), u' = clamp(u, -swiglu_limit, swiglu_limit),
    act(g, u) = (u' + 1) * g' * sigmoid(swiglu_alpha * g') (HF's `GptOssExperts._apply_gate`; alpha 1.702 and
    limit 7.0 in every GPT-OSS config). swiglu_alpha / swiglu_limit are read only with this activation.
A call with neither bias and activation="silu" launches the same kernels as before these arguments existed (the
kernels' bias pointers are then None, which Triton specializes away, and their switches keep their defaults).

Expert parallelism (`expert_map`, vLLM's name and convention): with it, w13 / w2 hold only this rank's E_local
experts and topk_ids stay the router's global ids; expert_map [E_global] (int32 or int64) gives the local index
of each global expert, or -1 where the expert lives on another rank. Slot (t, j) then uses local expert
expert_map[ids[t, j]], and contributes nothing when that is -1 (or the id is outside [0, E_global)): the rank's
output is its share of the routed sum, for the caller to all-reduce. The map is applied where the (token, slot)
pairs are counted and placed, so the GEMMs see only this rank's pairs: its work is its tokens-for-its-experts,
not all T*k slots. Its entries must be -1 or in [0, E_local) (not checked on the device).

Numerics: matmuls accumulate in fp32, biases are added to the fp32 accumulators; the activation's output is
rounded to hidden's dtype before the down projection (as HF does, and as the kernel's second GEMM needs); the k
slots are summed in fp32. The Triton
grouped-GEMM path also rounds each slot's down-projection output to hidden's dtype before that sum (when k > 1);
its decode path does not.

Two implementations:
  * `fused_moe_reference`: plain torch, the CPU path and the oracle: a loop over the experts that are used
    (host-side, so not for CUDA graphs), fp32 math.
  * `fused_moe_triton`: in the style of vLLM's fused_moe, with no host sync and no data-dependent shape, so it
    runs inside a CUDA graph:
      1. align: the (token, slot) pairs are grouped by (local) expert and each expert's run padded to a multiple
         of BLOCK_M, on the device (atomic counts, an exclusive scan, atomic placement); pairs of other ranks'
         experts are left out here. Buffers have their worst-case size (every pair on this rank),
         T*k + min(E, T*k) * (BLOCK_M - 1) rows; padding rows hold the sentinel T*k.
         Small batches use one single-program kernel, larger ones three kernels. At a handful of pairs
         (`uses_pair_blocks`: T * k <= 16 and (T - 1) * k <= E_global / 16, by shapes only: so at T = 1,
         whose k experts are distinct) there is no align launch: "pair-per-block" mode gives each pair its own
         BLOCK_M block (pair b in block b's first row, the sentinel in the others: a constant buffer cached per
         shape, `pair_block_rows`), the blocks' experts are the flattened topk_ids themselves, and each GEMM
         block maps its id (expert_map) and exits when it names no local expert. Same per-pair products, bit
         for bit, as the sorted path; tokens that share an expert read its weights once per pair. On an H200
         (bit-equal to the sorted path there too): qwen3-30b-a3b T=1 26.1 us per MoE call against 29.5,
         T=2 43.8 against 45.7; deepseek-v2-lite T=1 33.2 against 36.8 (PAIR_BLOCKS_BY_DEFAULT).
      2. one grouped-GEMM launch over all experts for gate and up (two accumulators), the biases and the
         activation in its epilogue: intermediate [T*k, I];
      3. one grouped-GEMM launch for down, the bias and then the routing weight applied in its epilogue: [T*k, H]
         (or the output directly when k == 1);
      4. the sum over the k slots (skipping slots with no expert); in pair-per-block mode (MOE_MERGE_SLOTS, on
         by default) inside the down GEMM's launch instead: the last of a token's k blocks to finish a column tile
         sums that tile (`_merge_slot_tiles`, the same bits).
    Programs whose block lies past the padded end exit at once (in pair-per-block mode, also those of a slot
    with no local expert). For very few (token, slot) pairs
    (`moe_gemv_config`, _moe_gemv.py) a decode path replaces all four steps with two grouped GEMVs: no align,
    the slot sum inside the down GEMV. Tile sizes (`moe_tile_config`) depend only on
    (T, E, k, H, I) and the local expert count, so a CUDA graph captured for one T keeps its kernels. Tuned for bf16/fp16; fp32 is exact
    (IEEE dots) but untuned: its tiles shrink until they fit in shared memory, and on an H100 it ran at 0.14-0.56x
    a dense fp32 bmm at decode sizes and ~0.02x at T=2048 (bench/kernel_moe.py --dtype fp32).

Before the wait (programmatic dependent launch: `await_producers`). MOE_PRELOAD (on by default since an H200 run at
qwen3-30b-a3b batch 1: 362.2 tok/s against 352.0 without, the same tokens; MINI_INFER_MOE_PRELOAD=0 turns it off;
read at each call). A kernel's programs run code before their wait only
once the kernel before them has passed its own wait, that is once the kernel two back has finished: what that one
and earlier ones wrote may be loaded before the wait, what the kernel just before writes may not, and nothing is
stored before it. The kernel just before the down GEMM is the gate/up GEMM of the same call (nothing is launched
between them), which writes `act`, the down GEMM's A, and nothing else. Everything else the down GEMM reads is older:
w2 (a weight), the routing weights and, in pair-per-block mode, the block experts (moe_topk's outputs, or their
contiguous copies made before the gate/up GEMM), the pair rows, block experts and padded count of the sorted path
(align's, launched before the gate/up GEMM) or of pair-per-block mode (the constant `pair_block_rows`), and the
expert map (a constant). So with MOE_PRELOAD, at "decode" tiles whose B tile has at most _PRELOAD_MAX_TILE
elements, each down-GEMM program loads these before its wait: the padded count, its block's pair rows and expert
(mapped and checked in pair-per-block mode), its rows' routing weights, and its last K step's B tile (a w2_bias row,
a weight too, is loaded after the K loop). A block that
will exit masks those loads off, and the exits come after the wait, which every program reaches. After the wait
the program loads the last step's A tile, runs the K loop over the other steps, then does the last step on the
preloaded tile. The dots are the same and in the same order, so the output is the same to the bit. The peeled step
is the last one, not the first: peeled first, its A load would sit between the wait and the loop's first loads,
and the sm_90 PTX then issues the loop's cp.async only once that A tile has arrived. The slot sum that follows
(at "decode" tiles, up to 63 slots) loads its token's slot ids, and their expert-map entries, before its own wait;
the routing wrote them three kernels back. On sm_90 at qwen3-30b-a3b's decode tiles (tests/ops/compile_fused_moe_sm90.py) the down GEMM takes
126 registers with the preload and 64 without at T = 1 and 2 (a 128 x 64 B tile), 72 against 48 at T = 1 on one of
two expert-parallel ranks (128 x 32), with no spills. The 128 x 128 tile of T = 4 (176 against 104 registers) is
left out by the size limit.

Must not import anything from mini_infer outside `mini_infer.ops`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from mini_infer.ops._moe_gemv import (
    ACTIVATION_IDS,
    SWIGLU_ALPHA,
    SWIGLU_LIMIT,
    MoeGemvConfig,
    epilogue_args,
    moe_gemv_config,
    moe_gemv_triton,
)
from mini_infer.ops._split_k import split_counters
from mini_infer.ops._triton_support import (
    HAS_TRITON,
    WEIGHT_EVICTION,
    await_producers,
    next_pow2,
    pdl_args,
    tl,
    triton,
    use_triton,
)

if HAS_TRITON:
    from mini_infer.ops._moe_gemv import gate_activation, map_expert
    from mini_infer.ops._split_k import arrives_last

__all__ = [
    "ACTIVATIONS",
    "GemmTile",
    "MoeTileConfig",
    "fused_moe",
    "fused_moe_reference",
    "fused_moe_triton",
    "local_expert_ids",
    "moe_align_triton",
    "moe_tile_config",
    "padded_rows",
    "pair_block_rows",
    "pair_rows",
    "sum_slots",
    "uses_pair_blocks",
]

ACTIVATIONS = tuple(ACTIVATION_IDS)  # ("silu", "swigluoai")
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class GemmTile:
    """Launch shape of one grouped GEMM: output columns and reduction step per program, GROUP_M swizzle."""

    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class MoeTileConfig:
    """Tiles of one fused_moe call. block_m (rows per program, the padding unit of each expert's run) is shared
    by both GEMMs; `kind` names the regime ("decode": few rows per expert, memory-bound; "prefill")."""

    kind: str
    block_m: int
    gate_up: GemmTile
    down: GemmTile


# Regimes by the mean rows per expert, T * k / E. Decode (memory-bound: the expert weights dominate): BLOCK_M is
# the smallest tile that holds most experts' rows in one block, since an expert whose rows spill into a second
# block has its weights read twice (mixtral-8x7b at T = 64, 16 rows per expert on average: 75% of the copy
# bandwidth with BLOCK_M 16 on an H100, as random routing puts 20+ rows on several experts). Prefill: BLOCK_M 64,
# then 128 (full tensor-core tiles, weights reused across rows).
_DECODE_BLOCK_M = ((8, 16), (24, 32))  # (max mean rows per expert, BLOCK_M)
_MID_MAX_ROWS_PER_EXPERT = 64
# Decode tiles narrow block_n until the launch has about this many live programs: with one token per expert the
# weight stream must still be spread over every SM (132 on an H100/H200), by programs that each stream enough of it.
# One token (batch-1 decode) has its own target: 200 (qwen3-30b-a3b: down 64 columns a program, 256 programs,
# instead of 32 columns, 512) +1.3-1.8% in the engine in three H200 runs (thirty-sixth and -seventh sessions), though
# the isolated kernel (bench/kernel_moe.py, no PDL overlap) read 8% slower; at two tokens (down 128 columns) the
# isolated kernel read 21% slower and no engine run has timed it, so more tokens keep 264. 16-column gate/up tiles
# (_DECODE_MIN_BLOCK_N) lost 3% at one token. 180 since the forty-seventh session: gpt-oss-20b's four experts then
# take 64-column tiles (180 programs each GEMM) instead of 32 (360): 416.3 against 409.9 tok/s (H200, same run), while
# qwen3-30b-a3b keeps its tiles (at a target of 100 its down took 128 columns, 128 programs: 372.7 against 394.1).
# deepseek-v2-lite's down also moves from 32 columns (384 programs) to 64 (192): not yet timed.
_DECODE_TARGET_PROGRAMS = 264
_DECODE_TARGET_PROGRAMS_ONE_TOKEN = 180
_DECODE_MIN_BLOCK_N = 32  # the narrowest decode tile
# (block_k, num_warps, num_stages) of the decode tiles' gate/up and down GEMMs. One token's gate/up GEMM keeps four
# K steps in flight: qwen3-30b-a3b batch 1 389.8 / 389.3 against 384.9 / 384.8 tok/s (H200, thirty-seventh session;
# 4 stages for down as well: 389.7 / 389.5; down 2 stages 370.1, K step 64 for either 378.1-378.6, gate/up K step
# 256 with 2 stages 368.7, against 384.5 in that run). More tokens keep 3 (not timed with 4).
_DECODE_GATE_UP_STEP = (128, 4, 3)
_DECODE_GATE_UP_STEP_ONE_TOKEN = (128, 4, 4)
_DECODE_DOWN_STEP = (128, 4, 3)


def _decode_block_n(n_out: int, live_blocks: int, num_tokens: int) -> int:
    """The widest of 128, 64, ... _DECODE_MIN_BLOCK_N output columns per program that still gives about
    _DECODE_TARGET_PROGRAMS (_DECODE_TARGET_PROGRAMS_ONE_TOKEN for one token)."""
    target = _DECODE_TARGET_PROGRAMS_ONE_TOKEN if num_tokens == 1 else _DECODE_TARGET_PROGRAMS
    block_n = 128
    while block_n > _DECODE_MIN_BLOCK_N and live_blocks * -(-n_out // block_n) < target:
        block_n //= 2
    return block_n


def moe_tile_config(num_tokens: int, num_experts: int, top_k: int, hidden: int, inter: int,
                    local_experts: int | None = None) -> MoeTileConfig:
    """The tiles for a call with these shapes (and nothing else, so that a captured CUDA graph keeps them).
    `num_experts` is the router's count; `local_experts` the experts this rank holds under expert parallelism
    (None: all of them), which receive about num_tokens * top_k * local / num_experts of the pairs.
    Chosen with bench/kernel_moe.py --sweep on an H100 (qwen3-30b-a3b and mixtral-8x7b shapes, bf16)."""
    num_experts = max(num_experts, 1)
    local = num_experts if local_experts is None else local_experts
    rows_per_expert = num_tokens * top_k / num_experts  # the same for a local expert as for any
    for max_rows, block_m in _DECODE_BLOCK_M:
        if rows_per_expert <= max_rows:
            local_pairs = -(-num_tokens * top_k * local // num_experts)
            live_blocks = max(1, min(local, local_pairs))  # about one block per used expert
            gk, gw, gs = _DECODE_GATE_UP_STEP_ONE_TOKEN if num_tokens == 1 else _DECODE_GATE_UP_STEP
            dk, dw, ds = _DECODE_DOWN_STEP
            gate_up_n = _decode_block_n(inter, live_blocks, num_tokens)
            down_n = _decode_block_n(hidden, live_blocks, num_tokens)
            return MoeTileConfig("decode", block_m, GemmTile(gate_up_n, gk, 1, gw, gs), GemmTile(down_n, dk, 1, dw, ds))
    if rows_per_expert <= _MID_MAX_ROWS_PER_EXPERT:
        return MoeTileConfig("prefill", 64, GemmTile(64, 64, 8, 4, 3), GemmTile(128, 64, 8, 4, 3))
    return MoeTileConfig("prefill", 128, GemmTile(128, 64, 8, 8, 4), GemmTile(256, 64, 8, 8, 4))


def padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Worst-case length of the expert-sorted, block-padded row list: each used expert (at most
    min(E, pairs) of them) pads its run by at most block_m - 1 rows."""
    return num_pairs + min(num_experts, num_pairs) * (block_m - 1)


def _check_args(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor,
                w2: torch.Tensor, activation: str, expert_map: torch.Tensor | None = None,
                w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                swiglu_alpha: float = SWIGLU_ALPHA,
                swiglu_limit: float = SWIGLU_LIMIT) -> tuple[int, int, int, int, int]:
    """Validate shapes and dtypes (ValueError naming the argument); returns (T, H, E, I, k)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"fused_moe: activation must be one of {ACTIVATIONS}, got {activation!r}")
    if activation == "swigluoai":
        for name, value in (("swiglu_alpha", swiglu_alpha), ("swiglu_limit", swiglu_limit)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"fused_moe: {name} must be a finite float, got {value!r}")
        if swiglu_limit <= 0:
            raise ValueError(f"fused_moe: swiglu_limit must be > 0, got {swiglu_limit!r}")
    if hidden.dim() != 2 or hidden.dtype not in _DTYPES:
        raise ValueError(f"fused_moe: hidden must be a [T, H] bf16/fp16/fp32 tensor, got {hidden.dtype} "
                         f"{tuple(hidden.shape)}")
    t, h = hidden.shape
    if w13.dim() != 3 or w13.shape[2] != h or w13.shape[1] % 2:
        raise ValueError(f"fused_moe: w13 must be [E, 2*I, H={h}], got {tuple(w13.shape)}")
    e, two_i = w13.shape[0], w13.shape[1]
    if tuple(w2.shape) != (e, h, two_i // 2):
        raise ValueError(f"fused_moe: w2 must be [E={e}, H={h}, I={two_i // 2}], got {tuple(w2.shape)}")
    if w13.dtype != hidden.dtype or w2.dtype != hidden.dtype:
        raise ValueError(f"fused_moe: w13 ({w13.dtype}) and w2 ({w2.dtype}) must have hidden's dtype {hidden.dtype}")
    same_t = not isinstance(t, int) or topk_ids.dim() != 2 or topk_ids.shape[0] == t  # symbolic T: not checked
    if topk_ids.dim() != 2 or not same_t or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"fused_moe: topk_ids must be an int32/int64 [T={t}, k] tensor, got {topk_ids.dtype} "
                         f"{tuple(topk_ids.shape)}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape) or not topk_weights.dtype.is_floating_point:
        raise ValueError(f"fused_moe: topk_weights must be a float tensor shaped like topk_ids "
                         f"{tuple(topk_ids.shape)}, got {topk_weights.dtype} {tuple(topk_weights.shape)}")
    if expert_map is not None and (expert_map.dim() != 1 or expert_map.dtype not in (torch.int32, torch.int64)
                                   or expert_map.shape[0] < e):
        raise ValueError(f"fused_moe: expert_map must be an int32/int64 [E_global >= E={e}] tensor (local index of "
                         f"each global expert, -1 elsewhere), got {expert_map.dtype} {tuple(expert_map.shape)}")
    for name, bias, size in (("w13_bias", w13_bias, two_i), ("w2_bias", w2_bias, h)):
        if bias is not None and (tuple(bias.shape) != (e, size) or bias.dtype != hidden.dtype):
            raise ValueError(f"fused_moe: {name} must be a [E={e}, {size}] tensor of hidden's dtype {hidden.dtype}, "
                             f"got {bias.dtype} {tuple(bias.shape)}")
    return t, h, e, two_i // 2, topk_ids.shape[1]


def local_expert_ids(topk_ids: torch.Tensor, expert_map: torch.Tensor | None) -> torch.Tensor:
    """Each slot's local expert: expert_map[id], or -1 for an id outside [0, E_global); the ids themselves
    without a map."""
    if expert_map is None:
        return topk_ids
    ids = topk_ids.long()
    inside = (ids >= 0) & (ids < expert_map.shape[0])
    return torch.where(inside, expert_map[ids.clamp(0, expert_map.shape[0] - 1)].long(), -1)


# --------------------------------------------------------------------------------------------------
# Reference (plain torch): the CPU path and the oracle.


def _gate_activation_reference(gate_up: torch.Tensor, inter: int, activation: str, swiglu_alpha: float,
                               swiglu_limit: float) -> torch.Tensor:
    """The gated activation of fp32 [rows, 2I] gate | up rows (module docstring)."""
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    if activation == "swigluoai":
        gate = gate.clamp(max=swiglu_limit)
        up = up.clamp(-swiglu_limit, swiglu_limit)
        return (up + 1) * (gate * torch.sigmoid(gate * swiglu_alpha))
    return F.silu(gate) * up


def fused_moe_reference(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor,
                        w2: torch.Tensor, activation: str = "silu", expert_map: torch.Tensor | None = None,
                        w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                        swiglu_alpha: float = SWIGLU_ALPHA, swiglu_limit: float = SWIGLU_LIMIT) -> torch.Tensor:
    """Plain torch: for each (local) expert in use, its rows through gate/up (+ bias), the activation (rounded to
    hidden's dtype), down (+ bias), times the routing weight, added into an fp32 [T, H] accumulator."""
    t, h, e, inter, k = _check_args(hidden, topk_weights, topk_ids, w13, w2, activation, expert_map, w13_bias,
                                    w2_bias, swiglu_alpha, swiglu_limit)
    out = torch.zeros(t, h, dtype=torch.float32, device=hidden.device)
    flat_ids = local_expert_ids(topk_ids, expert_map).reshape(-1)
    flat_w = topk_weights.reshape(-1).float()
    for expert in torch.unique(flat_ids).tolist():
        if not 0 <= expert < e:
            continue
        pairs = torch.nonzero(flat_ids == expert).squeeze(1)
        tokens = pairs // k
        gate_up = F.linear(hidden.index_select(0, tokens).float(), w13[expert].float(),
                           None if w13_bias is None else w13_bias[expert].float())
        act = _gate_activation_reference(gate_up, inter, activation, swiglu_alpha, swiglu_limit)
        act = act.to(hidden.dtype).float()
        down = F.linear(act, w2[expert].float(), None if w2_bias is None else w2_bias[expert].float())
        out.index_add_(0, tokens, down * flat_w[pairs, None])
    return out.to(hidden.dtype)


# --------------------------------------------------------------------------------------------------
# Triton

_ALIGN_BLOCK = 1024  # pairs per program (per loop step in the single-program kernel)
_ALIGN_SINGLE_MAX = 4096  # up to this many pairs, one program aligns them all (one launch: decode)

if HAS_TRITON:

    @triton.jit
    def _align_count(ids_ptr, counts_ptr, start, num_pairs, num_experts, map_ptr, num_global,
                     BLOCK: tl.constexpr, HAS_MAP: tl.constexpr):  # fmt: skip
        """counts[e] += pairs of (local) expert e among pairs [start, start + BLOCK)."""
        offs = start + tl.arange(0, BLOCK)
        ok = offs < num_pairs
        expert = tl.load(ids_ptr + offs, mask=ok, other=-1).to(tl.int32)
        expert = map_expert(expert, ok, map_ptr, num_global, HAS_MAP)
        ok = ok & (expert >= 0) & (expert < num_experts)
        tl.atomic_add(counts_ptr + expert, 1, mask=ok)

    @triton.jit
    def _align_scan(counts_ptr, cursor_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, num_pairs, num_experts,
                    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):  # fmt: skip
        """From the counts: each expert's padded run [start, end), the padded total, cursor = start, the sentinel
        in every padding row, and the expert of every BLOCK_M block up to the total."""
        e = tl.arange(0, BLOCK_E)
        e_ok = e < num_experts
        count = tl.load(counts_ptr + e, mask=e_ok, other=0, cache_modifier=".cg")  # .cg: written by atomics
        padded = (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        end = tl.cumsum(padded, axis=0)
        start = end - padded
        total = tl.sum(padded)
        tl.store(cursor_ptr + e, start, mask=e_ok)
        tl.store(num_padded_ptr, total)
        pad_chunk: tl.constexpr = 16
        for j0 in tl.static_range(0, BLOCK_M, pad_chunk):
            pos = (start + count)[:, None] + (j0 + tl.arange(0, pad_chunk))[None, :]
            tl.store(sorted_ptr + pos, num_pairs, mask=e_ok[:, None] & (pos < end[:, None]))
        end_or_max = tl.where(e_ok, end, 2147483647)
        blocks_chunk: tl.constexpr = 32
        n_blocks = total // BLOCK_M
        for b0 in range(0, n_blocks, blocks_chunk):
            b = b0 + tl.arange(0, blocks_chunk)
            # block b belongs to the first expert whose run ends after its first row
            owner = tl.sum((end_or_max[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), axis=1)
            tl.store(block_expert_ptr + b, owner, mask=b < n_blocks)

    @triton.jit
    def _align_scatter(ids_ptr, cursor_ptr, sorted_ptr, start, num_pairs, num_experts, map_ptr, num_global,
                       BLOCK: tl.constexpr, HAS_MAP: tl.constexpr):  # fmt: skip
        """Each pair of [start, start + BLOCK) takes the next free row of its (local) expert's run (atomic
        cursor); pairs of no local expert take none."""
        offs = start + tl.arange(0, BLOCK)
        ok = offs < num_pairs
        expert = tl.load(ids_ptr + offs, mask=ok, other=-1).to(tl.int32)
        expert = map_expert(expert, ok, map_ptr, num_global, HAS_MAP)
        ok = ok & (expert >= 0) & (expert < num_experts)
        row = tl.atomic_add(cursor_ptr + expert, 1, mask=ok)
        tl.store(sorted_ptr + row, offs, mask=ok)

    @triton.jit
    def _align_count_kernel(ids_ptr, counts_ptr, num_pairs, num_experts, map_ptr, num_global, BLOCK: tl.constexpr,
                            HAS_MAP: tl.constexpr, USE_GDC: tl.constexpr):  # fmt: skip
        await_producers(USE_GDC)
        _align_count(ids_ptr, counts_ptr, tl.program_id(0) * BLOCK, num_pairs, num_experts, map_ptr, num_global,
                     BLOCK, HAS_MAP)

    @triton.jit
    def _align_scan_kernel(counts_ptr, cursor_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, num_pairs,
                           num_experts, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, USE_GDC: tl.constexpr):  # fmt: skip
        await_producers(USE_GDC)
        _align_scan(counts_ptr, cursor_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, num_pairs, num_experts,
                    BLOCK_M, BLOCK_E)

    @triton.jit
    def _align_scatter_kernel(ids_ptr, cursor_ptr, sorted_ptr, num_pairs, num_experts, map_ptr, num_global,
                              BLOCK: tl.constexpr, HAS_MAP: tl.constexpr, USE_GDC: tl.constexpr):  # fmt: skip
        await_producers(USE_GDC)
        _align_scatter(ids_ptr, cursor_ptr, sorted_ptr, tl.program_id(0) * BLOCK, num_pairs, num_experts, map_ptr,
                       num_global, BLOCK, HAS_MAP)

    @triton.jit
    def _align_single_kernel(ids_ptr, counts_ptr, cursor_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr,
                             num_pairs, num_experts, map_ptr, num_global, BLOCK: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, HAS_MAP: tl.constexpr, USE_GDC: tl.constexpr):  # fmt: skip
        """All three align steps in one program (barriers between them): one launch for small batches."""
        await_producers(USE_GDC)
        e = tl.arange(0, BLOCK_E)
        tl.store(counts_ptr + e, tl.zeros([BLOCK_E], tl.int32), mask=e < num_experts)
        tl.debug_barrier()
        for start in range(0, num_pairs, BLOCK):
            _align_count(ids_ptr, counts_ptr, start, num_pairs, num_experts, map_ptr, num_global, BLOCK, HAS_MAP)
        tl.debug_barrier()
        _align_scan(counts_ptr, cursor_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, num_pairs, num_experts,
                    BLOCK_M, BLOCK_E)
        tl.debug_barrier()
        for start in range(0, num_pairs, BLOCK):
            _align_scatter(ids_ptr, cursor_ptr, sorted_ptr, start, num_pairs, num_experts, map_ptr, num_global,
                           BLOCK, HAS_MAP)

    @triton.jit
    def _a_tile(a_ptrs, row_ok, k_ok, EVEN_K: tl.constexpr, DOT_FP32: tl.constexpr):
        """One K step's A tile (its K columns `k_ok` unless EVEN_K), as the dot takes it."""
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
        else:
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if DOT_FP32:
            a = a.to(tl.float32)
        return a

    @triton.jit
    def _b_tile(b_ptrs, col_ok, k_ok, EVEN_K: tl.constexpr, EVICT: tl.constexpr):
        """One K step's B tile [BLOCK_K, BLOCK_N] (its columns `col_ok`, its K rows `k_ok` unless EVEN_K), loaded
        with L2 eviction policy EVICT."""
        if EVEN_K:
            b = tl.load(b_ptrs, mask=col_ok[None, :], other=0.0, eviction_policy=EVICT)
        else:
            b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0, eviction_policy=EVICT)
        return b

    @triton.jit
    def _dot_step(a, b, acc, DOT_FP32: tl.constexpr):
        """acc + a @ b (IEEE fp32 products with DOT_FP32: `a` is fp32 already)."""
        if DOT_FP32:
            acc = tl.dot(a, b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        return acc

    @triton.jit
    def _block_operands(pid_m, rows, cols, ks, padded_end, sorted_ptr, block_expert_ptr, b_ptr, map_ptr, num_pairs,
                        num_experts, num_global, stride_be, stride_bn, stride_bk, BLOCK_M: tl.constexpr,
                        PAIR_BLOCKS: tl.constexpr, HAS_MAP: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
        """`_moe_gemm_kernel`'s block pid_m (`rows` of the sorted list, output columns `cols`, K offsets `ks`):
        (pair: its rows' (token, slot) pairs, the sentinel num_pairs in padding rows; row_ok: pair < num_pairs;
        live: whether the block runs, that is lies before the padded end `padded_end` and (PAIR_BLOCKS) its router id,
        mapped through expert_map when HAS_MAP, names one of the num_experts local experts; b_ptrs: its expert's B
        pointers at K offset 0; expert: that (local) expert, int64). MASKED (PRELOAD, before the wait): a block
        past the padded end loads nothing (its pairs read as the sentinel), and a block that will not run takes
        expert 0. Without it the caller has exited
        already for a block past the padded end (whose rows may lie past the buffers). Either way the caller exits
        where `live` is False, after the wait."""
        live = pid_m * BLOCK_M < padded_end  # a multiple of BLOCK_M: a block's rows are all before it or none
        if MASKED:
            pair = tl.load(sorted_ptr + rows, mask=rows < padded_end, other=num_pairs)
            expert = tl.load(block_expert_ptr + pid_m, mask=live, other=0)
        else:
            pair = tl.load(sorted_ptr + rows)
            row_ok = pair < num_pairs
            expert = tl.load(block_expert_ptr + pid_m)
        if PAIR_BLOCKS:
            expert = map_expert(expert.to(tl.int32), live, map_ptr, num_global, HAS_MAP)
            live = live & (expert >= 0) & (expert < num_experts)
        if MASKED:
            expert = tl.where(live, expert, 0)
            row_ok = pair < num_pairs  # here, and right after the load without MASKED: each path's own order
        expert = expert.to(tl.int64)
        b_ptrs = b_ptr + expert * stride_be + cols[None, :].to(tl.int64) * stride_bn + ks[:, None] * stride_bk
        return pair, row_ok, live, b_ptrs, expert

    @triton.jit
    def _tile_of(pid, num_pid_m, n_out, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """A grouped GEMM's program -> (pid_m, pid_n): its row block and column tile, GROUP_M row blocks swizzled
        over each column tile (neighbouring programs share B tiles in L2)."""
        num_pid_n = tl.cdiv(n_out, BLOCK_N)
        in_group = GROUP_M * num_pid_n
        first_m = (pid // in_group) * GROUP_M
        group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
        return first_m + (pid % in_group) % group_rows, (pid % in_group) // group_rows

    @triton.jit
    def _bias_and_activation(acc, acc_up, expert, cols, col_ok, n_out, bias_ptr, GATED: tl.constexpr,
                             HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, ALPHA: tl.constexpr,
                             LIMIT: tl.constexpr):  # fmt: skip
        """A grouped GEMM's epilogue before the routing weight: the block's expert's bias row(s) added to the fp32
        accumulator(s) (HAS_BIAS; bias_ptr [E, 2 n_out] gate | up when GATED, else [E, n_out]), then, GATED, the
        gate activation (`gate_activation`) of gate and up."""
        if HAS_BIAS:  # a weight, so nothing here waits on the kernel before
            if GATED:
                bias_row = bias_ptr + expert * (2 * n_out) + cols
                acc += tl.load(bias_row, mask=col_ok, other=0.0).to(tl.float32)[None, :]
                acc_up += tl.load(bias_row + n_out, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            else:
                acc += tl.load(bias_ptr + expert * n_out + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc = gate_activation(acc, acc_up, ACTIVATION, ALPHA, LIMIT)
        return acc

    @triton.jit
    def _moe_gemm_kernel(
        a_ptr, b_ptr, c_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, weight_ptr,
        num_pairs, n_out, k_in, rows_per_a, num_pid_m, up_offset,
        stride_am, stride_be, stride_bn, stride_bk, stride_cm,
        num_experts, map_ptr, num_global, out_ptr, cnt_ptr, stride_om, bias_ptr,
        GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, EVEN_K: tl.constexpr, DOT_FP32: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        PAIR_BLOCKS: tl.constexpr, HAS_MAP: tl.constexpr, PRELOAD: tl.constexpr, USE_GDC: tl.constexpr,
        B_EVICT: tl.constexpr = "", MERGE_SLOTS: tl.constexpr = 0, HAS_BIAS: tl.constexpr = False,
        ACTIVATION: tl.constexpr = 0, ALPHA: tl.constexpr = SWIGLU_ALPHA, LIMIT: tl.constexpr = SWIGLU_LIMIT,
    ):  # fmt: skip
        """C[pair] = A[pair // rows_per_a] @ B[expert].T for the BLOCK_M expert-sorted pairs of one block.
        GATED: B holds gate rows [0, n_out) and up rows [n_out, 2 n_out) (up_offset = n_out * stride_bn);
        C = silu(A @ gate.T) * (A @ up.T). MUL_WEIGHT: C *= weight[pair]. DOT_FP32: fp32 operands, IEEE products
        (fp32 inputs, and the CPU interpreter, whose bf16 dot multiplies the raw bits as integers).
        PAIR_BLOCKS (no align step): block_expert holds the router ids (one pair per block); the block maps its
        id (expert_map when HAS_MAP) and exits when it names no expert in [0, num_experts). Otherwise those
        three arguments are unused.
        PRELOAD (module docstring, "Before the wait"; only where the kernel before this one writes A alone): the
        block's rows, pairs, expert, routing weights and last K step's B tile(s) are loaded before the PDL wait,
        masked off in a block that will exit; the exits come after the wait, then the last step's A tile is loaded,
        the K loop runs the other steps and the last step, peeled, takes the preloaded tile: the steps in the same
        order as without it (the same bits), and nothing between the wait and the loop's first loads.
        B_EVICT: the L2 eviction policy of the B (expert weight) loads (_triton_support.WEIGHT_EVICTION for
        decode-shaped launches). MERGE_SLOTS (top_k, PAIR_BLOCKS only; 0: off): the slot sum in this launch
        (`_merge_slot_tiles`): every block, stored or exiting, counts at its token's counter (cnt_ptr) for its column
        tile, and the last one sums the token's slot rows of C into out_ptr (row stride stride_om).
        HAS_BIAS: the block's expert's bias row (bias_ptr, contiguous: [E, 2 n_out] gate | up when GATED, else
        [E, n_out]; None without a bias) added to the fp32 accumulator(s) after the K loop, before the activation
        and before MUL_WEIGHT. ACTIVATION / ALPHA / LIMIT (GATED): `gate_activation`'s (0: silu(gate) * up)."""
        pid_m, pid_n = _tile_of(tl.program_id(0), num_pid_m, n_out, BLOCK_N, GROUP_M)
        num_pid_n = tl.cdiv(n_out, BLOCK_N)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < n_out
        ks = tl.arange(0, BLOCK_K)
        k_end = k_in  # the K loop's end
        if PRELOAD:  # nothing here was written by the kernel just before this one (module docstring)
            pair, row_ok, live, b_ptrs, expert = _block_operands(
                pid_m, rows, cols, ks, tl.load(num_padded_ptr), sorted_ptr, block_expert_ptr, b_ptr, map_ptr,
                num_pairs, num_experts, num_global, stride_be, stride_bn, stride_bk, BLOCK_M, PAIR_BLOCKS, HAS_MAP,
                MASKED=True)  # fmt: skip
            if MUL_WEIGHT:
                row_weight = tl.load(weight_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
            # the last K step (k_in >= 1), not the first: peeled before the loop, the first step would hold the
            # loop's first loads back until its A tile arrived; after the loop, it waits on nothing
            k_end = (k_in - 1) // BLOCK_K * BLOCK_K
            last_ok = ks < k_in - k_end
            # col_ok & live as one compare: the interpreter's `&` of a vector and a scalar gives ints, not a mask
            col_live = cols < tl.where(live, n_out, 0)
            b_last = _b_tile(b_ptrs + k_end * stride_bk, col_live, last_ok, EVEN_K, B_EVICT)
            if GATED:
                b_up_last = _b_tile(b_ptrs + k_end * stride_bk + up_offset, col_live, last_ok, EVEN_K, B_EVICT)
        await_producers(USE_GDC)
        if not PRELOAD:
            padded_end = tl.load(num_padded_ptr)
            if pid_m * BLOCK_M >= padded_end:
                return  # past the padded end (this launch was sized for the worst case): nothing of it is loaded
            pair, row_ok, live, b_ptrs, expert = _block_operands(
                pid_m, rows, cols, ks, padded_end, sorted_ptr, block_expert_ptr, b_ptr, map_ptr, num_pairs,
                num_experts, num_global, stride_be, stride_bn, stride_bk, BLOCK_M, PAIR_BLOCKS, HAS_MAP, MASKED=False)
        if not live:
            if MERGE_SLOTS > 0:  # a slot with no (local) expert still counts for its token's sum
                _merge_slot_tiles(c_ptr, out_ptr, block_expert_ptr, cnt_ptr, pid_m, pid_n, num_pid_n, cols, col_ok,
                                  stride_cm, stride_om, num_experts, map_ptr, num_global, MERGE_SLOTS, BLOCK_N, HAS_MAP)
            return  # past the padded end, or (PAIR_BLOCKS) a slot with no (local) expert: its rows stay unwritten
        a_row = (pair // rows_per_a).to(tl.int64)
        a_ptrs = a_ptr + a_row[:, None] * stride_am + ks[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if PRELOAD:  # the last K step's A tile, loaded with the loop's first ones
            a_last = _a_tile(a_ptrs + k_end, row_ok, last_ok, EVEN_K, DOT_FP32)
        for k0 in range(0, k_end, BLOCK_K):
            k_ok = ks < k_in - k0
            a = _a_tile(a_ptrs, row_ok, k_ok, EVEN_K, DOT_FP32)
            acc = _dot_step(a, _b_tile(b_ptrs, col_ok, k_ok, EVEN_K, B_EVICT), acc, DOT_FP32)
            if GATED:
                acc_up = _dot_step(a, _b_tile(b_ptrs + up_offset, col_ok, k_ok, EVEN_K, B_EVICT), acc_up, DOT_FP32)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K * stride_bk
        if PRELOAD:  # the last K step, peeled: its B tile(s) loaded before the wait
            acc = _dot_step(a_last, b_last, acc, DOT_FP32)
            if GATED:
                acc_up = _dot_step(a_last, b_up_last, acc_up, DOT_FP32)
        acc = _bias_and_activation(acc, acc_up, expert, cols, col_ok, n_out, bias_ptr, GATED, HAS_BIAS, ACTIVATION,
                                   ALPHA, LIMIT)  # the bias after the loop
        if MUL_WEIGHT:
            if not PRELOAD:
                row_weight = tl.load(weight_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)
            acc = acc * row_weight[:, None]
        c_ptrs = c_ptr + pair[:, None].to(tl.int64) * stride_cm + cols[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
        if MERGE_SLOTS > 0:
            _merge_slot_tiles(c_ptr, out_ptr, block_expert_ptr, cnt_ptr, pid_m, pid_n, num_pid_n, cols, col_ok,
                              stride_cm, stride_om, num_experts, map_ptr, num_global, MERGE_SLOTS, BLOCK_N, HAS_MAP)

    @triton.jit
    def _merge_slot_tiles(c_ptr, out_ptr, ids_ptr, cnt_ptr, pid_m, pid_n, num_pid_n, cols, col_ok, stride_cm,
                          stride_om, num_experts, map_ptr, num_global, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr,
                          HAS_MAP: tl.constexpr):  # fmt: skip
        """The slot sum in the down GEMM's launch, pair-per-block mode (block pid_m is pair t * TOP_K + j): the
        block counts at its token's counter for column tile pid_n (after its store, or at its exit), and the last of
        the token's TOP_K blocks to arrive, which has reset the counter, sums the token's slot rows of C over these
        columns in slot order, in fp32, skipping slots with no (local) expert: `_moe_sum_kernel`'s arithmetic, so
        the same bits, whatever the arrival order."""
        token = pid_m // TOP_K
        if arrives_last(cnt_ptr + token * num_pid_n + pid_n, TOP_K):
            acc = tl.zeros([BLOCK_N], tl.float32)
            for j in tl.static_range(TOP_K):
                pair = token.to(tl.int64) * TOP_K + j
                expert = map_expert(tl.load(ids_ptr + pair).to(tl.int32), True, map_ptr, num_global, HAS_MAP)
                row = tl.load(c_ptr + pair * stride_cm + cols, mask=col_ok, other=0.0).to(tl.float32)
                acc += tl.where((expert >= 0) & (expert < num_experts), row, 0.0)
            tl.store(out_ptr + token.to(tl.int64) * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)

    @triton.jit
    def _moe_sum_kernel(src_ptr, ids_ptr, out_ptr, n_cols, num_experts, map_ptr, num_global, TOP_K: tl.constexpr,
                        BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, HAS_MAP: tl.constexpr, PRELOAD: tl.constexpr,
                        USE_GDC: tl.constexpr):  # fmt: skip
        """out[t] = sum over the TOP_K rows t*TOP_K + j of src, in fp32, skipping slots whose id is not a (local)
        expert (their rows were never written). PRELOAD (TOP_K <= 63; module docstring, "Before the wait"): the
        token's slot ids, mapped and checked, are loaded before the PDL wait as a bit set (BLOCK_K: TOP_K's
        power of two), read slot by slot after it; the rows and the sum as without it."""
        t = tl.program_id(0).to(tl.int64)
        if PRELOAD:  # the routing's ids: written before the grouped GEMMs, so two kernels back at least
            slot = tl.arange(0, BLOCK_K)
            slot_ok = slot < TOP_K
            experts = map_expert(tl.load(ids_ptr + t * TOP_K + slot, mask=slot_ok, other=-1).to(tl.int32), slot_ok,
                                 map_ptr, num_global, HAS_MAP)
            used = slot_ok & (experts >= 0) & (experts < num_experts)
            used_bits = tl.sum(tl.where(used, tl.full([BLOCK_K], 1, tl.int64) << slot.to(tl.int64), 0), axis=0)
        await_producers(USE_GDC)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < n_cols
        acc = tl.zeros([BLOCK], tl.float32)
        for j in tl.static_range(TOP_K):
            if PRELOAD:
                slot_used = ((used_bits >> j) & 1) != 0
            else:
                expert = map_expert(tl.load(ids_ptr + t * TOP_K + j).to(tl.int32), True, map_ptr, num_global, HAS_MAP)
                slot_used = (expert >= 0) & (expert < num_experts)
            row = tl.load(src_ptr + (t * TOP_K + j) * n_cols + cols, mask=ok, other=0.0).to(tl.float32)
            acc += tl.where(slot_used, row, 0.0)
        tl.store(out_ptr + t * n_cols + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def moe_align_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                     expert_map: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the (token, slot) pairs of `topk_ids` [T, k] by expert, each expert's run padded to a multiple of
    block_m, on the device. With `expert_map` the experts are the local ones, expert_map[id], and pairs whose
    expert is on another rank (-1) are left out. Returns (sorted_pairs [padded_rows] int32: pair index t*k + j,
    or the sentinel T*k in padding rows; block_expert [padded_rows // block_m (ceil)] int32: the expert of each
    block; num_padded [1] int32: rows in use). Entries past num_padded are unspecified. Pairs are in no particular order within an
    expert's run (atomics); each row's result does not depend on it."""
    if not HAS_TRITON:
        raise RuntimeError("moe_align_triton needs triton")
    ids = topk_ids.reshape(-1)
    ids = ids if ids.is_contiguous() else ids.contiguous()
    num_pairs = ids.numel()
    rows = padded_rows(num_pairs, num_experts, block_m)
    n_blocks = triton.cdiv(rows, block_m)
    # one int32 allocation: sorted_pairs | block_expert | counts | cursor | num_padded
    meta = torch.empty(rows + n_blocks + 2 * num_experts + 1, dtype=torch.int32, device=ids.device)
    sorted_pairs, block_expert, counts, cursor, num_padded = torch.split(
        meta, [rows, n_blocks, num_experts, num_experts, 1])
    block_e = next_pow2(num_experts)
    emap, num_global = _map_args(ids, expert_map)
    has_map = expert_map is not None
    if num_pairs <= _ALIGN_SINGLE_MAX:
        _align_single_kernel[(1,)](ids, counts, cursor, sorted_pairs, block_expert, num_padded, num_pairs,
                                   num_experts, emap, num_global, BLOCK=_ALIGN_BLOCK, BLOCK_M=block_m,
                                   BLOCK_E=block_e, HAS_MAP=has_map, num_warps=8, **pdl_args(ids, trigger_first=False))
    else:
        counts.zero_()
        grid = (triton.cdiv(num_pairs, _ALIGN_BLOCK),)
        _align_count_kernel[grid](ids, counts, num_pairs, num_experts, emap, num_global, BLOCK=_ALIGN_BLOCK,
                                  HAS_MAP=has_map, num_warps=4, **pdl_args(ids, trigger_first=False))
        _align_scan_kernel[(1,)](counts, cursor, sorted_pairs, block_expert, num_padded, num_pairs, num_experts,
                                 BLOCK_M=block_m, BLOCK_E=block_e, num_warps=8, **pdl_args(counts, trigger_first=False))
        _align_scatter_kernel[grid](ids, cursor, sorted_pairs, num_pairs, num_experts, emap, num_global,
                                    BLOCK=_ALIGN_BLOCK, HAS_MAP=has_map, num_warps=4, **pdl_args(ids, trigger_first=False))
    return sorted_pairs, block_expert, num_padded


def _map_args(ids: torch.Tensor, expert_map: torch.Tensor | None) -> tuple[torch.Tensor, int]:
    """(map pointer, E_global) for the kernels; without a map, `ids` stands in for the unread pointer."""
    if expert_map is None:
        return ids, 0
    return (expert_map if expert_map.is_contiguous() else expert_map.contiguous()), expert_map.shape[0]


# Launch shapes that compiled for a (dtype, gemm, tile) key; a tile that runs out of shared memory (fp32) is
# retried with fewer pipeline stages, then a shorter reduction step.
_TILE_OK: dict[tuple, GemmTile] = {}


def _smaller_tiles(tile: GemmTile):
    while True:
        yield tile
        if tile.num_stages > 2:
            tile = replace(tile, num_stages=tile.num_stages - 1)
        elif tile.block_k > 32:
            tile = replace(tile, block_k=tile.block_k // 2)
        elif tile.block_n > 32:
            tile = replace(tile, block_n=tile.block_n // 2)
        else:
            return


def launch_fitting(cache: dict, key: tuple, tile: GemmTile, launch: Callable[[GemmTile], None], who: str,
                   min_block_k: int = 0) -> None:
    """`launch(t)` with the tile that fit `key` before (`cache`), else `tile` and then `_smaller_tiles`' ones in
    turn, the next after each OutOfResources, none with block_k below `min_block_k`; the tile that fit is
    remembered. RuntimeError naming `who` when none fits."""
    for t in ([cache[key]] if key in cache else _smaller_tiles(tile)):
        if t.block_k < min_block_k:
            break
        try:
            launch(t)
        except triton.runtime.errors.OutOfResources:
            continue
        cache[key] = t
        return
    raise RuntimeError(f"{who}: no tile fits for {key}")


@dataclass(frozen=True)
class _RawIds:
    """Pair-per-block mode's arguments to `_moe_gemm_kernel`: block_expert holds router ids, to be mapped
    (expert_map when has_map; `emap` stands in for the unread pointer otherwise) and checked against the
    num_experts local experts by each block."""

    num_experts: int
    emap: torch.Tensor
    num_global: int
    has_map: bool


def _grouped_gemm(a, b, c, sorted_pairs, block_expert, num_padded, weights, num_pairs, rows_per_a, gated, block_m,
                  tile: GemmTile, raw_ids: _RawIds | None = None, preload: bool = False, evict: str = "",
                  merge_into: torch.Tensor | None = None, top_k: int = 0, bias: torch.Tensor | None = None,
                  epilogue: dict | None = None) -> None:
    """Launch `_moe_gemm_kernel` over every block of the worst-case padded row list (raw_ids: pair-per-block
    mode, one block per pair). `preload`: the kernel's PRELOAD, for a launch whose kernel just before it in the
    stream writes none of its arguments but `a` (module docstring, "Before the wait"). `evict`: its B_EVICT.
    `merge_into` (pair-per-block mode): the [T, n_out] output that the launch's slot sum writes (MERGE_SLOTS =
    top_k), C then holding the per-slot rows it reads. `bias` (contiguous, or None) and `epilogue` (the kernel's
    HAS_BIAS / ACTIVATION / ALPHA / LIMIT switches where they differ from its defaults: `epilogue_args`)."""
    n_out = b.shape[1] // 2 if gated else b.shape[1]
    k_in = b.shape[2]
    num_pid_m = triton.cdiv(sorted_pairs.numel(), block_m)
    merge = top_k if merge_into is not None else 0
    epilogue = epilogue or {}
    key = (a.dtype, gated, n_out, k_in, block_m, tile, preload, evict, merge, tuple(sorted(epilogue.items())))

    def launch(t: GemmTile) -> None:
        out, cnt, s_om = c, c, 0
        if merge:
            out, s_om = merge_into, merge_into.stride(0)
            cnt = split_counters(a.device, num_pairs // top_k * triton.cdiv(n_out, t.block_n))
        _moe_gemm_kernel[(num_pid_m * triton.cdiv(n_out, t.block_n),)](
            a, b, c, sorted_pairs, block_expert, num_padded, weights,
            num_pairs, n_out, k_in, rows_per_a, num_pid_m, n_out * b.stride(1),
            a.stride(0), b.stride(0), b.stride(1), b.stride(2), c.stride(0),
            *((raw_ids.num_experts, raw_ids.emap, raw_ids.num_global) if raw_ids else (0, block_expert, 0)),
            out, cnt, s_om, bias,
            GATED=gated, MUL_WEIGHT=weights is not None, EVEN_K=k_in % t.block_k == 0,
            DOT_FP32=a.dtype == torch.float32 or not a.is_cuda, BLOCK_M=block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
            GROUP_M=t.group_m, PAIR_BLOCKS=raw_ids is not None, HAS_MAP=raw_ids is not None and raw_ids.has_map,
            PRELOAD=preload, B_EVICT=evict, MERGE_SLOTS=merge, num_warps=t.num_warps, num_stages=t.num_stages,
            **epilogue, **pdl_args(a, trigger_first=False),
        )  # fmt: skip

    launch_fitting(_TILE_OK, key, tile, launch, "fused_moe_triton")


# Pair-per-block mode (module docstring): at most this many (token, slot) pairs, and few expected repeats of an
# expert across tokens: (T - 1) * k <= E_global / _PAIR_BLOCKS_REPEAT_DIV, i.e. random routing gives about
# (T - 1) * k / (2 E) <= 1/32 extra expert-weight reads. Measured on an H200 (2026-11-24,
# bench/results/s8_pairs_h200.txt): bit-equal outputs, 2-4 us less per call at the shapes it picks; mixtral T=2 and
# T=4, which it does not pick, are slower with it. PAIR_BLOCKS_BY_DEFAULT = False (or pair_blocks=False) goes back to
# the sorted path.
PAIR_BLOCKS_BY_DEFAULT = True
_PAIR_BLOCKS_MAX_PAIRS = 16
_PAIR_BLOCKS_REPEAT_DIV = 16


# Loads before the PDL wait at decode tiles (module docstring, "Before the wait"); on by default since an H200 run
# (qwen3-30b-a3b batch 1, engines in one process: 362.2 tok/s with it, 352.0 without, the same tokens);
# MINI_INFER_MOE_PRELOAD=0 turns it off. Read at each call, so a benchmark can set fused_moe.MOE_PRELOAD between
# engines (before capturing their graphs).
MOE_PRELOAD = os.environ.get("MINI_INFER_MOE_PRELOAD", "1") != "0"
# The down GEMM preloads a B tile of at most this many elements, held in registers through its K loop: qwen3-30b-a3b's
# tiles at T = 1 and 2 (32 and 64 columns of 128), not the 128 x 128 of T = 4 (176 registers against 104 without
# it at 4 warps on sm_90: two programs per SM where shared memory allows three; module docstring).
_PRELOAD_MAX_TILE = 128 * 64
_SUM_PRELOAD_MAX_SLOTS = 63  # the slot sum's preloaded slots are the bits of one int64
# The slot sum in the down GEMM's launch in pair-per-block mode (`_merge_slot_tiles`: the token's last block to
# finish a column tile sums its slot rows, the same bits) instead of `_moe_sum_kernel` after it: one launch fewer an
# MoE layer at batch 1, where the sum kernel's ~1.2-1.4 us are exposed (qwen3-30b-a3b on an H200, bench/RESULTS.md,
# thirtieth session). On by default: H200, qwen3-30b-a3b batch 1 (thirty-third session, two calls, engines in one
# process) 374.3 vs 372.6 and 372.8 vs 372.1 tok/s, the same greedy tokens; bench/gpu_check.py passed with it.
# Read at each call (MINI_INFER_MOE_MERGE_SLOTS=0, or `--switch fused_moe.MOE_MERGE_SLOTS=0`, for the sum kernel).
MOE_MERGE_SLOTS = os.environ.get("MINI_INFER_MOE_MERGE_SLOTS", "1") != "0"


def uses_pair_blocks(num_tokens: int, top_k: int, num_experts: int) -> bool:
    """Whether the grouped GEMMs run one block per (token, slot) pair, with no align step, for these shapes
    (`num_experts`: the router's count): at one token up to 16 slots (a token's top-k experts are distinct), and at a
    few tokens when the experts are many enough that tokens rarely share one."""
    return (num_tokens * top_k <= _PAIR_BLOCKS_MAX_PAIRS
            and (num_tokens - 1) * top_k <= num_experts // _PAIR_BLOCKS_REPEAT_DIV)


_PAIR_ROWS: dict[tuple[int, int, torch.device], torch.Tensor] = {}


def pair_block_rows(num_pairs: int, block_m: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Pair-per-block mode's (sorted_pairs [num_pairs * block_m] int32: block b holds pair b in its first row and
    the sentinel num_pairs in the others; num_padded [1] int32: num_pairs * block_m), constant, built on the
    first call for each (num_pairs, block_m, device) and kept: make that call before capturing a CUDA graph."""
    key = (num_pairs, block_m, device)
    rows = _PAIR_ROWS.get(key)
    if rows is None:
        n = num_pairs * block_m
        rows = torch.full((n + 1,), num_pairs, dtype=torch.int32, device=device)
        rows[0:n:block_m] = torch.arange(num_pairs, dtype=torch.int32, device=device)
        rows[n] = n
        _PAIR_ROWS[key] = rows
    return rows[:-1], rows[-1:]


def pair_rows(ids: torch.Tensor, expert_map: torch.Tensor | None, num_local: int, num_global: int, top_k: int,
              block_m: int, pair_blocks: bool | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, _RawIds | None]:
    """The grouped GEMMs' row lists for the flattened ids [T * k]: (sorted_pairs, block_expert, num_padded, raw_ids)
    in pair-per-block mode (`raw_ids` then says how blocks map their router ids) when `pair_blocks`, or when it is
    None as `uses_pair_blocks` picks by shape if PAIR_BLOCKS_BY_DEFAULT; else after `moe_align_triton` (raw_ids
    None)."""
    num_pairs = ids.numel()
    if pair_blocks is None:
        pair_blocks = PAIR_BLOCKS_BY_DEFAULT and uses_pair_blocks(num_pairs // top_k, top_k, num_global)
    if pair_blocks:
        sorted_pairs, num_padded = pair_block_rows(num_pairs, block_m, ids.device)
        return sorted_pairs, ids, num_padded, _RawIds(num_local, *_map_args(ids, expert_map), expert_map is not None)
    return (*moe_align_triton(ids, num_local, block_m, expert_map), None)


def sum_slots(per_slot: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, num_local: int, top_k: int,
              expert_map: torch.Tensor | None, preload: bool) -> None:
    """out [T, H] = each token's top_k rows of per_slot [T * k, H] summed in fp32, slots with no (local) expert
    skipped (`_moe_sum_kernel`; `preload`: its loads before the PDL wait, up to _SUM_PRELOAD_MAX_SLOTS slots)."""
    t, h = out.shape
    block = min(1024, next_pow2(h))
    emap, n_global = _map_args(ids, expert_map)
    _moe_sum_kernel[(t, triton.cdiv(h, block))](
        per_slot, ids, out, h, num_local, emap, n_global, TOP_K=top_k, BLOCK=block, BLOCK_K=next_pow2(top_k),
        HAS_MAP=expert_map is not None, PRELOAD=preload and top_k <= _SUM_PRELOAD_MAX_SLOTS, num_warps=4,
        **pdl_args(per_slot, trigger_first=False))


def fused_moe_triton(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor,
                     w2: torch.Tensor, activation: str = "silu", expert_map: torch.Tensor | None = None,
                     w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                     swiglu_alpha: float = SWIGLU_ALPHA, swiglu_limit: float = SWIGLU_LIMIT,
                     config: MoeTileConfig | MoeGemvConfig | None = None,
                     pair_blocks: bool | None = None) -> torch.Tensor:
    """The CUDA path (or CPU under TRITON_INTERPRET=1), no host sync (module docstring). A `MoeGemvConfig` runs
    the decode path, a `MoeTileConfig` the grouped GEMMs; None picks by shape: `moe_gemv_config` (few pairs, and
    weights of unit last stride), else `moe_tile_config`. The grouped GEMMs run in pair-per-block mode (no align
    step) when `pair_blocks`, or, when it is None, as `uses_pair_blocks` picks by shape if PAIR_BLOCKS_BY_DEFAULT."""
    if not HAS_TRITON:
        raise RuntimeError("fused_moe_triton needs triton")
    t, h, e, inter, k = _check_args(hidden, topk_weights, topk_ids, w13, w2, activation, expert_map, w13_bias,
                                    w2_bias, swiglu_alpha, swiglu_limit)
    if t == 0:
        return hidden.new_empty(0, h)
    b13, b2 = (b if b is None or b.is_contiguous() else b.contiguous() for b in (w13_bias, w2_bias))
    num_global = e if expert_map is None else expert_map.shape[0]
    if config is None and w13.stride(2) == 1 and w2.stride(2) == 1:
        config = moe_gemv_config(t, k, h, inter)
    x = hidden if hidden.stride(1) == 1 else hidden.contiguous()
    weights = topk_weights.reshape(-1)
    weights = weights if weights.is_contiguous() else weights.contiguous()
    ids = topk_ids.reshape(-1)
    ids = ids if ids.is_contiguous() else ids.contiguous()
    if isinstance(config, MoeGemvConfig):
        emap, n_global = _map_args(ids, expert_map)
        w13, w2 = (w if w.stride(2) == 1 else w.contiguous() for w in (w13, w2))  # only with a given config
        return moe_gemv_triton(x, weights, ids, w13, w2, emap, n_global, expert_map is not None, config,
                               w13_bias=b13, w2_bias=b2, activation=activation, swiglu_alpha=swiglu_alpha,
                               swiglu_limit=swiglu_limit)
    cfg = config or moe_tile_config(t, num_global, k, h, inter, local_experts=e)
    # k == 1: the down GEMM writes the output rows itself, except those of dropped slots (no local expert)
    out = (torch.zeros if k == 1 else torch.empty)(t, h, dtype=hidden.dtype, device=hidden.device)
    num_pairs = t * k
    sorted_pairs, block_expert, num_padded, raw_ids = pair_rows(ids, expert_map, e, num_global, k, cfg.block_m,
                                                                pair_blocks)
    # padding rows are never stored: unused rows of these buffers keep whatever they held
    act = torch.empty(num_pairs, inter, dtype=hidden.dtype, device=hidden.device)
    evict = WEIGHT_EVICTION if cfg.kind == "decode" else ""  # the experts' weights stream once a step there
    _grouped_gemm(x, w13, act, sorted_pairs, block_expert, num_padded, None, num_pairs, k, True, cfg.block_m,
                  cfg.gate_up, raw_ids, evict=evict, bias=b13,
                  epilogue=epilogue_args(b13, activation, swiglu_alpha, swiglu_limit))
    # Nothing is launched between the two GEMMs (per_slot is an empty buffer, or `out`, zero-filled before align):
    # the gate/up GEMM, which writes `act` alone, is the kernel just before the down GEMM, so the down GEMM's other
    # inputs are two kernels back or more, and the slot sum's ids three ("Before the wait", module docstring).
    preload = MOE_PRELOAD and cfg.kind == "decode"  # read at each call: benchmarks toggle it
    merge = MOE_MERGE_SLOTS and raw_ids is not None and k > 1  # pair-per-block mode; read at each call, likewise
    per_slot = out if k == 1 else torch.empty(num_pairs, h, dtype=hidden.dtype, device=hidden.device)
    _grouped_gemm(act, w2, per_slot, sorted_pairs, block_expert, num_padded, weights, num_pairs, 1, False,
                  cfg.block_m, cfg.down, raw_ids,
                  preload and inter > 0 and cfg.down.block_n * cfg.down.block_k <= _PRELOAD_MAX_TILE, evict,
                  out if merge else None, k, bias=b2, epilogue=epilogue_args(b2))
    if k > 1 and not merge:
        sum_slots(per_slot, ids, out, e, k, expert_map, preload)
    return out


# --------------------------------------------------------------------------------------------------
# The registered op.


@torch.library.custom_op("mini_infer::fused_moe", mutates_args=())
def fused_moe(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor,
              w2: torch.Tensor, activation: str = "silu", expert_map: torch.Tensor | None = None,
              w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
              swiglu_alpha: float = SWIGLU_ALPHA, swiglu_limit: float = SWIGLU_LIMIT) -> torch.Tensor:
    """The routed experts (module docstring): Triton on CUDA when available, else the torch reference. The
    arguments after expert_map (biases, SwiGLU constants) are optional, so the five- and seven-argument calls of
    the families without them are unchanged."""
    args = (hidden, topk_weights, topk_ids, w13, w2, activation, expert_map, w13_bias, w2_bias, swiglu_alpha,
            swiglu_limit)
    if use_triton(hidden):
        return fused_moe_triton(*args)
    return fused_moe_reference(*args)


@fused_moe.register_fake
def _(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
      activation: str = "silu", expert_map: torch.Tensor | None = None, w13_bias: torch.Tensor | None = None,
      w2_bias: torch.Tensor | None = None, swiglu_alpha: float = SWIGLU_ALPHA,
      swiglu_limit: float = SWIGLU_LIMIT) -> torch.Tensor:
    _check_args(hidden, topk_weights, topk_ids, w13, w2, activation, expert_map, w13_bias, w2_bias, swiglu_alpha,
                swiglu_limit)
    return hidden.new_empty(hidden.shape)
