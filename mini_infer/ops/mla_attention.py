"""`mini_infer::mla_attention`: DeepSeek-V2/V3 multi-head latent attention (MLA) over a paged latent cache.

Inserted by the `mla_latent_cache` pass in place of the attention core of HF's `DeepseekV2Attention` /
`DeepseekV3Attention`. Per token and layer the cache keeps only the normalized latent `c` (kv_lora_rank = Dc
values) and the rotary key `k_pe` shared by all heads (qk_rope_head_dim = Dr): (Dc + Dr) values per token
instead of H x (Dn + Dr + Dv). Mutates only `latent_cache` (declared); imports nothing from mini_infer outside
`mini_infer.ops`.

Math (T packed tokens, H heads, Dn = qk_nope_head_dim, Dv = v_head_dim), as HF computes it:
    c = kv_a_layernorm(kv_a_proj_with_mqa(x)[:, :Dc]),  k_pe = rope(kv_a_proj_with_mqa(x)[:, Dc:])
    kv = kv_b_proj(c).view(T, H, Dn + Dv);  k_h = [kv[:, h, :Dn] | k_pe],  v_h = kv[:, h, Dn:]
    q_h = [q_nope_h | q_pe_h];  out_h = softmax(scale * q_h . k_h + causal mask) v_h   (softmax in fp32)
with `scale` = HF's `self.scaling` (qk_head_dim ** -0.5, times mscale ** 2 under YaRN with mscale_all_dim):
the op takes it as given. The op gets q_pe and k_pe already rotated and c_kv already normalized.

Weights. kv_b_proj.weight W is [H * (Dn + Dv), Dc]; for head h, rows [h*(Dn+Dv), h*(Dn+Dv) + Dn) are W_UK_h
[Dn, Dc] (k_nope_h = W_UK_h c) and the next Dv rows are W_UV_h [Dv, Dc] (v_h = W_UV_h c). The op takes them
arranged for batched matmuls over heads (`absorption_weights` builds them):
    w_uk [H, Dn, Dc] = W.view(H, Dn + Dv, Dc)[:, :Dn]
    w_uv [H, Dc, Dv] = W.view(H, Dn + Dv, Dc)[:, Dn:].transpose(1, 2)

Layout (S sequences), metadata as `paged_attention` (same meaning, same mixes):
    q_nope [T, H, Dn], q_pe [T, H, Dr], c_kv [T, Dc], k_pe [T, Dr]
    latent_cache [num_blocks, block_size, Dc + Dr]: row [c | k_pe] per token, nothing per head
    slot_mapping [T] int64 (negative: do not write), block_tables [S, max_blocks] int32,
    seq_lens [S] int32 (context length including this step's tokens), query_start_loc [S+1] int32.
    -> [T, H, Dv] in q_nope's dtype; rows owned by no sequence are zeros.
The op first writes [c_kv | k_pe] at slot_mapping, then attends over each sequence's cached tokens.

Two computation paths, equal up to rounding:
  * absorbed (decode; DeepSeek-V2 paper, FlashMLA): q_lat_h = W_UK_h^T q_nope_h [Dc]; scores
    q_lat_h . c + q_pe_h . k_pe over the latent cache; o_lat_h = sum p c [Dc]; out_h = W_UV_h o_lat_h. That is
    multi-query attention with one key [c | k_pe] (Dc + Dr) and one value c (Dc) shared by all heads.
  * expanded (prefill): the latent blocks a sequence uses are expanded into per-head K [.., H, Dn + Dr] and
    V [.., H, Dv] and ordinary paged attention runs over them (`paged_attention_reference` / `_triton`). Its
    temporary K/V hold (Dn + Dr + Dv) x H values per cached position of the sequences it serves (not chunked).
Which one runs (`path=None`): T <= S (decode steps, CUDA-graph decode buckets) -> absorbed, decided by shapes
alone. Otherwise sequences with one query row go absorbed and sequences with more go expanded; this split reads
the query lengths on the host. While a CUDA graph is being captured the Triton launcher takes the absorbed path
for every batch (capturable; the absorbed kernel is exact for any mix, just 3-4x the attention FLOPs of the
expanded one on long prefills). `path="absorbed"` / `"expanded"` force one path for the whole batch.

Implementations:
  * `mla_attention_reference`: plain torch, the CPU path and the test oracle. Both paths run through
    `paged_attention_reference` (absorbed: as MQA over the latent cache viewed as one kv head).
  * `mla_attention_triton`: a cache-write kernel; the absorbed path's `latent_attention_triton`, one program per
    (query tile, head group, kv split) that loads each latent tile [BLOCK_N, Dc + Dr] once for all heads of the
    group (all H heads when H <= the config's `heads`: V2-Lite's 16), with split-K over the context (flash-
    decoding: the split, online-softmax and partials pieces are `_split_k`'s, shared with `paged_attention`;
    the merge is `_latent_reduce_kernel`, parallel over (token, head, Dc chunk) so that one decode row with
    many splits still spreads over many programs). Decode launch shapes and split counts come from a table
    keyed by heads and batch size (`_DECODE_CONFIGS`, `decode_config`); grid from shapes only, no host sync.
    The absorption matmuls are torch bmm calls around it. The expanded path runs `paged_attention_triton`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from mini_infer.ops import _split_k
from mini_infer.ops import paged_attention as _paged
from mini_infer.ops._triton_support import (
    HAS_TRITON,
    await_producers,
    next_pow2,
    pdl_args,
    tl,
    triton,
    use_triton,
)
from mini_infer.ops.paged_attention import paged_attention_reference, paged_attention_triton

__all__ = [
    "PATHS",
    "LatentConfig",
    "LatentPlan",
    "absorption_weights",
    "decode_config",
    "latent_attention_plan",
    "latent_attention_triton",
    "mla_attention",
    "mla_attention_reference",
    "mla_attention_triton",
    "write_latent_cache_reference",
    "write_latent_cache_triton",
]

PATHS = ("absorbed", "expanded")


class LatentConfig(NamedTuple):
    """A launch shape of the latent attention kernel. `heads`: most heads per program (BLOCK_H; the fp32
    accumulator is [rows, Dc]); `block_n`: latent rows per inner step; `num_stages`: the compiler's software
    pipelining (stages - 1 latent tiles in flight); `splits`: kv splits (flash-decoding; decode only, bounded by
    the block table's capacity / block_n); `rows`: (query row, head) pairs per program (prefill tiles; 0: one
    query row per tile, the decode shape)."""

    heads: int
    block_n: int
    num_warps: int
    num_stages: int
    splits: int = 1
    rows: int = 0


# Decode launch shapes, (most heads, most sequences, config), the first that fits the batch wins (None: no
# bound). Chosen from sm_90 compiles (registers, spills, shared memory, latent tiles in flight), then checked by
# `bench/kernel_mla.py --sweep` on an H200 (2026-11-23, ctx 4k, bf16): the table was the sweep's winner at every
# shape but 128 heads x batch 1 (16-head tiles, 32 splits: 22.0 us against 31.0 for 64-head tiles). V2-Lite:
# 71% of copy bandwidth at batch 64, 79% at 256; V3's 128 heads stay at 12% (compute: 128 x 576-dim scores).
#   * few sequences: many splits, so that ~100+ programs stream the latent (16 heads fit one program: batch 1
#     is otherwise 1 program per split), the partials merged by `_latent_reduce_kernel`;
#   * more heads than 16 (V3's 128): 64-head tiles at 8 warps, so that tl.dot becomes Hopper's wgmma (M >= 64;
#     the [64, 512] fp32 accumulator is 128 registers a thread; sm_90 then spills a few registers around the
#     key loop, none inside it).
# Where a shape runs out of shared memory (fp32) the launch retries smaller ones.
_DECODE_CONFIGS: tuple[tuple[int | None, int | None, LatentConfig], ...] = (
    (16, 4, LatentConfig(heads=16, block_n=32, num_warps=4, num_stages=3, splits=64)),
    (16, 16, LatentConfig(heads=16, block_n=32, num_warps=4, num_stages=3, splits=16)),
    (16, 96, LatentConfig(heads=16, block_n=32, num_warps=4, num_stages=3, splits=4)),
    (16, None, LatentConfig(heads=16, block_n=32, num_warps=4, num_stages=3, splits=1)),
    (None, 4, LatentConfig(heads=16, block_n=32, num_warps=4, num_stages=3, splits=32)),
    (None, 32, LatentConfig(heads=64, block_n=32, num_warps=8, num_stages=2, splits=4)),
    (None, None, LatentConfig(heads=64, block_n=32, num_warps=8, num_stages=2, splits=1)),
)
_FP32_MAX_HEADS = 16  # fp32 operands: twice the shared memory, and no tensor cores to feed with bigger tiles
_PREFILL_CONFIG = LatentConfig(heads=16, block_n=32, num_warps=8, num_stages=2, rows=32)


def decode_config(heads: int, n_seqs: int) -> LatentConfig:
    """The `_DECODE_CONFIGS` entry for a decode batch of n_seqs sequences with `heads` heads."""
    for max_heads, max_seqs, cfg in _DECODE_CONFIGS:
        if (max_heads is None or heads <= max_heads) and (max_seqs is None or n_seqs <= max_seqs):
            return cfg
    raise LookupError(f"no decode config for {heads} heads and {n_seqs} sequences")  # the last entry takes all


def absorption_weights(
    kv_b_weight: torch.Tensor, num_heads: int, qk_nope_head_dim: int, v_head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_uk [H, Dn, Dc], w_uv [H, Dc, Dv]), contiguous, from HF's kv_b_proj.weight [H * (Dn + Dv), Dc]."""
    h, dn, dv = num_heads, qk_nope_head_dim, v_head_dim
    if kv_b_weight.dim() != 2 or kv_b_weight.shape[0] != h * (dn + dv):
        raise ValueError(
            f"absorption_weights: kv_b_proj.weight has shape {tuple(kv_b_weight.shape)}, expected "
            f"[num_heads * (qk_nope_head_dim + v_head_dim) = {h * (dn + dv)}, kv_lora_rank]"
        )
    w = kv_b_weight.view(h, dn + dv, kv_b_weight.shape[1])
    return w[:, :dn].contiguous(), w[:, dn:].transpose(1, 2).contiguous()


def _check_dims(q_nope, q_pe, c_kv, k_pe, latent_cache, w_uk, w_uv) -> None:
    """Every non-token dim agrees with q_nope (H, Dn), q_pe (Dr), c_kv (Dc) and w_uv (Dv); ValueError naming the
    first tensor that does not. Token counts are not compared (symbolic under torch.export)."""
    _, h, dn = q_nope.shape
    dr, dc, dv = q_pe.shape[-1], c_kv.shape[-1], w_uv.shape[-1]
    expected = {
        "q_pe": (q_pe, (None, h, dr)),
        "c_kv": (c_kv, (None, dc)),
        "k_pe": (k_pe, (None, dr)),
        "latent_cache": (latent_cache, (None, None, dc + dr)),
        "w_uk": (w_uk, (h, dn, dc)),
        "w_uv": (w_uv, (h, dc, dv)),
    }
    for name, (tensor, dims) in expected.items():
        if tensor.dim() != len(dims) or any(w is not None and s != w for s, w in zip(tensor.shape, dims)):
            want = ", ".join("*" if w is None else str(w) for w in dims)
            raise ValueError(
                f"mla_attention: {name} has shape {tuple(tensor.shape)}, expected [{want}] "
                f"(H={h}, Dn={dn}, Dr={dr}, Dc={dc}, Dv={dv}; the latent cache holds Dc + Dr values per token)"
            )


# --------------------------------------------------------------------------------------------------
# shared by both implementations: absorption matmuls, expansion, path choice
# --------------------------------------------------------------------------------------------------


def _absorb_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """q_lat [H, T, Dc] = W_UK_h^T q_nope_h for every head and token."""
    return torch.bmm(q_nope.transpose(0, 1), w_uk)


def _unabsorb(o_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """out [T, H, Dv] = W_UV_h o_lat_h from o_lat [H, T, Dc]."""
    return torch.bmm(o_lat, w_uv).transpose(0, 1).contiguous()


def _nothing_to_write(like: torch.Tensor, heads: int, d: int, dv: int):
    """(k, v, slot_mapping) with no rows: paged_attention then only attends over what its caches hold."""
    return like.new_empty((0, heads, d)), like.new_empty((0, heads, dv)), torch.empty(0, dtype=torch.int64,
                                                                                        device=like.device)


def _expand_latent(latent_cache, block_tables, seq_lens, w_uk, w_uv):
    """Per-head K [U, block_size, H, Dn + Dr] and V [U, block_size, H, Dv] of the U blocks the sequences use
    (the first ceil(seq_len / block_size) of each block-table row), and the block table renumbered into them.
    Reads the number of blocks on the host."""
    block_size, dc = latent_cache.shape[1], w_uk.shape[2]
    h, dn, _ = w_uk.shape
    n_blk = (seq_lens.to(torch.int64) + block_size - 1) // block_size
    used = torch.arange(block_tables.shape[1], device=block_tables.device)[None, :] < n_blk[:, None]
    blocks = block_tables[used].to(torch.int64)
    table = torch.full_like(block_tables, -1)
    table[used] = torch.arange(blocks.numel(), dtype=table.dtype, device=table.device)
    lat = latent_cache.index_select(0, blocks)  # [U, block_size, Dc + Dr]
    c, k_pe = lat[..., :dc], lat[..., dc:]
    k = lat.new_empty((blocks.numel(), block_size, h, dn + k_pe.shape[-1]))
    k[..., :dn] = torch.einsum("ubc,hnc->ubhn", c, w_uk)
    k[..., dn:] = k_pe[:, :, None, :]
    v = torch.einsum("ubc,hcv->ubhv", c, w_uv)
    return k, v, table


def _expanded(attend, latent_cache, w_uk, w_uv, scale, q_nope, q_pe, block_tables, seq_lens, query_start_loc):
    """The expanded path: per-head K/V of the used blocks, then `attend` (a paged_attention implementation)."""
    k_cache, v_cache, table = _expand_latent(latent_cache, block_tables, seq_lens, w_uk, w_uv)
    q = torch.cat([q_nope, q_pe.to(q_nope.dtype)], dim=-1)
    k, v, slots = _nothing_to_write(q, q.shape[1], q.shape[2], v_cache.shape[3])
    return attend(q, k, v, k_cache, v_cache, slots, table, seq_lens, query_start_loc, scale)


def _route(path, absorbed, expanded, q_nope, q_pe, block_tables, seq_lens, query_start_loc, dv) -> torch.Tensor:
    """Run `absorbed` / `expanded` (each (q_nope, q_pe, block_tables, seq_lens, query_start_loc) -> [t, H, Dv])
    on the batch as the module docstring's path rule says."""
    t, h, _ = q_nope.shape
    n_seqs = seq_lens.shape[0]
    if path is not None and path not in PATHS:
        raise ValueError(f"mla_attention: path must be one of {PATHS} or None, got {path!r}")
    if t == 0 or n_seqs == 0:
        return q_nope.new_zeros((t, h, dv))
    if path is None and t <= n_seqs:
        path = "absorbed"
    if path is not None:
        fn = absorbed if path == "absorbed" else expanded
        return fn(q_nope, q_pe, block_tables, seq_lens, query_start_loc)

    # by sequence: one query row -> absorbed, more -> expanded (expanding a decode row's whole context for
    # one query would cost far more than it saves)
    starts = query_start_loc[:-1].tolist()
    qlens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
    out = q_nope.new_zeros((t, h, dv))
    for fn, keep in ((absorbed, lambda n: n == 1), (expanded, lambda n: n > 1)):
        seqs = [s for s, n in enumerate(qlens) if keep(n)]
        if not seqs:
            continue
        rows = torch.tensor([r for s in seqs for r in range(starts[s], starts[s] + qlens[s])], device=q_nope.device)
        sub_qsl = torch.tensor([0] + [qlens[s] for s in seqs], device=query_start_loc.device).cumsum(0)
        idx = torch.tensor(seqs, device=seq_lens.device)
        out[rows] = fn(q_nope[rows], q_pe[rows], block_tables[idx], seq_lens[idx], sub_qsl.to(query_start_loc.dtype))
    return out


# --------------------------------------------------------------------------------------------------
# reference (plain torch)
# --------------------------------------------------------------------------------------------------


def write_latent_cache_reference(
    c_kv: torch.Tensor, k_pe: torch.Tensor, latent_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write the row [c_kv[i] | k_pe[i]] at flat slot slot_mapping[i] of the latent cache, skipping negative slots."""
    slots = slot_mapping.to(torch.int64)
    rows = torch.cat([c_kv, k_pe.to(c_kv.dtype)], dim=-1).to(latent_cache.dtype)
    valid = slots >= 0
    if not bool(valid.all()):
        slots, rows = slots[valid], rows[valid]
    if slots.numel() == 0:
        return
    if latent_cache.is_contiguous():
        latent_cache.view(-1, latent_cache.shape[-1]).index_copy_(0, slots, rows)
    else:
        block_size = latent_cache.shape[1]
        latent_cache.index_put_((slots // block_size, slots % block_size), rows)


def _absorbed_reference(latent_cache, w_uk, w_uv, scale, q_nope, q_pe, block_tables, seq_lens, query_start_loc):
    """The absorbed path in torch: MQA over the latent cache seen as one kv head, query [q_lat | q_pe], key the
    whole row [c | k_pe], value the whole row too (its last Dr outputs are dropped: one contiguous cache)."""
    dc = w_uk.shape[2]
    q = torch.cat([_absorb_query(q_nope, w_uk).transpose(0, 1), q_pe.to(q_nope.dtype)], dim=-1)  # [T, H, Dc+Dr]
    mqa = latent_cache.unsqueeze(2)  # [num_blocks, block_size, 1, Dc + Dr]
    k, v, slots = _nothing_to_write(q, 1, mqa.shape[3], mqa.shape[3])
    o = paged_attention_reference(q, k, v, mqa, mqa, slots, block_tables, seq_lens, query_start_loc, scale)
    return _unabsorb(o[..., :dc].transpose(0, 1), w_uv)


def mla_attention_reference(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    path: str | None = None,
) -> torch.Tensor:
    """Plain torch MLA (writes the latent cache first). `path`: None (the module docstring's rule),
    "absorbed" or "expanded". Reads lengths on the host (not CUDA-graph capturable)."""
    _check_dims(q_nope, q_pe, c_kv, k_pe, latent_cache, w_uk, w_uv)
    write_latent_cache_reference(c_kv, k_pe, latent_cache, slot_mapping)
    common = (latent_cache, w_uk, w_uv, float(scale))
    absorbed = functools.partial(_absorbed_reference, *common)
    expanded = functools.partial(_expanded, paged_attention_reference, *common)
    return _route(path, absorbed, expanded, q_nope, q_pe, block_tables, seq_lens, query_start_loc, w_uv.shape[2])


# --------------------------------------------------------------------------------------------------
# Triton
# --------------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _write_latent_kernel(
        c_ptr, pe_ptr, cache_ptr, slot_ptr, s_ct, s_pt, s_cb, s_co,
        D_C: tl.constexpr, D_R: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, USE_GDC: tl.constexpr,
    ):  # fmt: skip
        await_producers(USE_GDC)
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        c = tl.arange(0, BLOCK_C)
        r = tl.arange(0, BLOCK_R)
        # negative slot: padding token, write nothing (compared as a tensor: the interpreter mis-types
        # `scalar_bool & tensor_bool`)
        c_ok = ((slot + c * 0) >= 0) & (c < D_C)
        r_ok = ((slot + r * 0) >= 0) & (r < D_R)
        slot = tl.maximum(slot, 0)
        dst = cache_ptr + (slot // BLOCK_SIZE) * s_cb + (slot % BLOCK_SIZE) * s_co
        x = tl.load(c_ptr + t * s_ct + c, mask=c_ok, other=0.0)
        tl.store(dst + c, x.to(cache_ptr.dtype.element_ty), mask=c_ok)
        y = tl.load(pe_ptr + t * s_pt + r, mask=r_ok, other=0.0)
        tl.store(dst + D_C + r, y.to(cache_ptr.dtype.element_ty), mask=r_ok)

    @triton.jit
    def _latent_attn_kernel(
        ql_ptr, qp_ptr, cache_ptr, out_ptr, ws_m_ptr, ws_l_ptr, ws_acc_ptr,
        bt_ptr, seq_lens_ptr, qsl_ptr,
        n_seqs, n_heads, scale,
        s_qlh, s_qlt, s_qpt, s_qph, s_cb, s_co, s_oh, s_ot, s_bt,
        s_wms, s_wmt, s_was, s_wat, s_wah,
        D_C: tl.constexpr, D_R: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_GROUPS: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, NUM_SPLITS: tl.constexpr, SEARCH_STEPS: tl.constexpr,
        DOT_FP32: tl.constexpr, USE_GDC: tl.constexpr,
    ):  # fmt: skip
        await_producers(USE_GDC)
        # program = (query tile, head group) flattened (head groups of one tile adjacent: they read the same
        # latent tiles at about the same time, from L2), x kv split
        hg = tl.program_id(0) % HEAD_GROUPS
        tile = tl.program_id(0) // HEAD_GROUPS
        split = tl.program_id(1)
        s, q_beg, qlen, ctx, q_off = _split_k.find_tile_sequence(
            tile, qsl_ptr, seq_lens_ptr, n_seqs, BLOCK_Q, SEARCH_STEPS
        )
        if q_off < qlen:
            # score rows: (query row, head) pairs
            m = tl.arange(0, BLOCK_M)
            qi = m // BLOCK_H
            head = hg * BLOCK_H + m % BLOCK_H
            q_idx = q_off + qi
            row_ok = (qi < BLOCK_Q) & (q_idx < qlen) & (head < n_heads)
            tok = (q_beg + q_idx).to(tl.int64)
            head64 = head.to(tl.int64)
            q_pos = ctx - qlen + q_idx
            c = tl.arange(0, BLOCK_C)
            r = tl.arange(0, BLOCK_R)
            c_ok = c < D_C
            r_ok = r < D_R
            q_lat = tl.load(
                ql_ptr + head64[:, None] * s_qlh + tok[:, None] * s_qlt + c[None, :],
                mask=row_ok[:, None] & c_ok[None, :], other=0.0,
            )  # fmt: skip
            q_pe = tl.load(
                qp_ptr + tok[:, None] * s_qpt + head64[:, None] * s_qph + r[None, :],
                mask=row_ok[:, None] & r_ok[None, :], other=0.0,
            )  # fmt: skip
            if DOT_FP32:
                q_lat = q_lat.to(tl.float32)
                q_pe = q_pe.to(tl.float32)

            # key range of the tile, then this program's split of it (splits aligned to BLOCK_N)
            k_hi = ctx - qlen + tl.minimum(q_off + BLOCK_Q, qlen)
            k_lo, k_hi = _split_k.split_key_range(k_hi * 0, k_hi, split, NUM_SPLITS, BLOCK_N)

            first_q_pos = ctx - qlen + q_off
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_C], tl.float32)
            bt_row = bt_ptr + s.to(tl.int64) * s_bt
            # block-table lookups run one key tile ahead: a tile's latent loads then depend on no load of their
            # own iteration, so the compiler's pipeliner can keep several latent tiles in flight (num_stages)
            kpos, k_ok, pblk, koff = _split_k.key_tile(bt_row, k_lo, k_hi, BLOCK_SIZE, BLOCK_N)
            for start in range(k_lo, k_hi, BLOCK_N):
                row = cache_ptr + pblk * s_cb + koff * s_co
                lat = tl.load(row[:, None] + c[None, :], mask=k_ok[:, None] & c_ok[None, :], other=0.0)
                kpe = tl.load(row[:, None] + D_C + r[None, :], mask=k_ok[:, None] & r_ok[None, :], other=0.0)
                n_kpos, n_k_ok, n_pblk, n_koff = _split_k.key_tile(bt_row, start + BLOCK_N, k_hi, BLOCK_SIZE, BLOCK_N)
                if DOT_FP32:
                    lat = lat.to(tl.float32)
                    sc = tl.dot(q_lat, tl.trans(lat), input_precision="ieee")
                    sc += tl.dot(q_pe, tl.trans(kpe.to(tl.float32)), input_precision="ieee")
                else:
                    sc = tl.dot(q_lat, tl.trans(lat))
                    sc = tl.dot(q_pe, tl.trans(kpe), sc)
                sc = sc * (scale * _split_k.LOG2E)  # log2 units: softmax with exp2
                sc = _split_k.hide_invisible(sc, start, kpos, k_ok, q_pos, first_q_pos, 0, BLOCK_N, False)  # causal
                p, alpha, m_i, l_i = _split_k.online_softmax_step(sc, m_i, l_i)
                if DOT_FP32:
                    pv = tl.dot(p, lat, input_precision="ieee")
                else:
                    pv = tl.dot(p.to(lat.dtype), lat)
                acc = acc * alpha[:, None] + pv
                kpos, k_ok, pblk, koff = n_kpos, n_k_ok, n_pblk, n_koff
            _split_k.store_rows(
                out_ptr, ws_m_ptr, ws_l_ptr, ws_acc_ptr, acc, m_i, l_i, split, tok, head64, c, row_ok, c_ok,
                s_ot, s_oh, s_wms, s_wmt, s_was, s_wat, s_wah, NUM_SPLITS,
            )  # fmt: skip

    @triton.jit
    def _latent_reduce_kernel(
        ws_m_ptr, ws_l_ptr, ws_acc_ptr, out_ptr, qsl_ptr, n_seqs, d_c,
        s_wms, s_wmt, s_was, s_wat, s_wah, s_ot, s_oh,
        NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, BLOCK_D: tl.constexpr, USE_GDC: tl.constexpr,
    ):  # fmt: skip
        await_producers(USE_GDC)
        # program = (token, head, chunk of Dc); partials of all splits at once: [SPLITS_P2, BLOCK_D]
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
        sp = tl.arange(0, SPLITS_P2).to(tl.int64)
        owned = (t + sp * 0) < tl.load(qsl_ptr + n_seqs)  # rows past the last sequence: zeros
        sp_ok = owned & (sp < NUM_SPLITS)
        d_ok = d < d_c
        m = tl.load(ws_m_ptr + sp * s_wms + t * s_wmt + h, mask=sp_ok, other=float("-inf"))
        m_max = tl.max(m, axis=0)
        wgt = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # m in log2 units; empty splits: 0
        l_sum = tl.sum(wgt * tl.load(ws_l_ptr + sp * s_wms + t * s_wmt + h, mask=sp_ok, other=0.0), axis=0)
        acc = tl.load(
            ws_acc_ptr + sp[:, None] * s_was + t * s_wat + h * s_wah + d[None, :],
            mask=sp_ok[:, None] & d_ok[None, :], other=0.0,
        )  # fmt: skip
        o = tl.sum(wgt[:, None] * acc, axis=0) / tl.where(l_sum == 0.0, 1.0, l_sum)
        tl.store(out_ptr + t * s_ot + h * s_oh + d, o.to(out_ptr.dtype.element_ty), mask=d_ok)


def write_latent_cache_triton(
    c_kv: torch.Tensor, k_pe: torch.Tensor, latent_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Triton latent-cache write: one program per token, negative slots skipped inside the kernel."""
    if not HAS_TRITON:
        raise RuntimeError("write_latent_cache_triton needs triton")
    t, dc = c_kv.shape
    dr = k_pe.shape[1]
    if t == 0:
        return
    if latent_cache.stride(-1) != 1:
        raise ValueError("mla_attention: latent_cache needs unit stride along its last dim")
    c_kv, k_pe = _paged._last_dim_contiguous(c_kv), _paged._last_dim_contiguous(k_pe)
    _write_latent_kernel[(t,)](
        c_kv, k_pe, latent_cache, slot_mapping, c_kv.stride(0), k_pe.stride(0),
        latent_cache.stride(0), latent_cache.stride(1),
        D_C=dc, D_R=dr, BLOCK_SIZE=latent_cache.shape[1], BLOCK_C=next_pow2(dc), BLOCK_R=next_pow2(dr),
        num_warps=4, **pdl_args(c_kv),
    )  # fmt: skip


# (config, device, dtype, BLOCK_M, BLOCK_C, BLOCK_R) -> the (block_n, num_warps, num_stages) that compiled
_LAUNCH_OK: dict[tuple, tuple[int, int, int]] = {}


def _launch_shapes(cfg: LatentConfig, key: tuple):
    """cfg's (block_n, num_warps, num_stages), then smaller key tiles and fewer stages until one fits."""
    if key in _LAUNCH_OK:
        yield _LAUNCH_OK[key]
        return
    block_n, num_stages = cfg.block_n, cfg.num_stages
    while True:
        yield block_n, cfg.num_warps, num_stages
        if block_n > 16:
            block_n //= 2
        elif num_stages > 1:
            num_stages -= 1
        else:
            return


class LatentPlan(NamedTuple):
    """How `latent_attention_triton` tiles a batch: `kind` ("decode" / "prefill"), heads per program, query rows
    per tile, head groups (programs per tile), kv splits, and the launch shape it asks for first (a shape that
    does not fit in shared memory falls back to smaller ones)."""

    kind: str
    block_h: int
    block_q: int
    head_groups: int
    num_splits: int
    block_n: int
    num_warps: int
    num_stages: int


def latent_attention_plan(
    q_lat: torch.Tensor, n_seqs: int, capacity: int, decode_only: bool | None = None, num_splits: int | None = None,
    config: LatentConfig | None = None,
) -> LatentPlan:  # fmt: skip
    """The tiling `latent_attention_triton` uses for q_lat [H, T, Dc] and S = n_seqs sequences, from shapes only.
    `capacity`: keys a block-table row can address (its width x block_size), which bounds the splits: at most
    one per block_n keys. `config` replaces the table's (`decode_config` / `_PREFILL_CONFIG`); `num_splits`
    replaces its split count (not bounded)."""
    h, t, _ = q_lat.shape
    if decode_only is None:
        decode_only = t <= n_seqs
    kind = "decode" if decode_only else "prefill"
    cfg = config or (decode_config(h, n_seqs) if decode_only else _PREFILL_CONFIG)
    block_h = min(next_pow2(h), cfg.heads, _FP32_MAX_HEADS if q_lat.dtype == torch.float32 else cfg.heads)
    head_groups = -(-h // block_h)
    if num_splits is None:
        num_splits = min(cfg.splits, max(1, capacity // cfg.block_n)) if decode_only else 1
    block_q = 1 if decode_only or not cfg.rows else max(1, cfg.rows // block_h)
    return LatentPlan(kind, block_h, block_q, head_groups, max(1, int(num_splits)), cfg.block_n, cfg.num_warps,
                      cfg.num_stages)  # fmt: skip


def latent_attention_triton(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    decode_only: bool | None = None,
    config: LatentConfig | None = None,
) -> torch.Tensor:
    """The absorbed path's attention: o_lat [H, T, Dc] from q_lat [H, T, Dc] (any strides with unit last stride,
    e.g. a bmm output), q_pe [T, H, Dr] and the latent cache (its rows [c | k_pe] are the keys, c the values).

    Every knob gives the same result for every batch; they only pick tile shapes, from shapes and arguments,
    never tensor values (CUDA-graph capturable, no host sync):
      * `decode_only`: True -> one query row per tile, all heads of a head group; False -> `_PREFILL_CONFIG.rows`
        (row, head) pairs per tile. None -> True iff T <= S.
      * `num_splits`: key-range splits (flash-decoding, then `_latent_reduce_kernel`). None -> the config's
        (decode; bounded by the block table's capacity / block_n), 1 (prefill).
      * `config`: the launch shape (`LatentConfig`); None -> `decode_config(H, S)` / `_PREFILL_CONFIG`.
    The first call for a new (dtype, dims, config, splits) compiles: make it before capturing a CUDA graph.
    """
    if not HAS_TRITON:
        raise RuntimeError("latent_attention_triton needs triton")
    h, t, dc = q_lat.shape
    dr = q_pe.shape[2]
    n_seqs = seq_lens.shape[0]
    if q_lat.stride(-1) != 1 or latent_cache.stride(-1) != 1:
        raise ValueError("mla_attention: q_lat and latent_cache need unit stride along their last dim")
    if t == 0 or n_seqs == 0:
        return q_lat.new_zeros((h, t, dc))
    q_pe = _paged._last_dim_contiguous(q_pe)
    block_size = latent_cache.shape[1]
    plan = latent_attention_plan(q_lat, n_seqs, block_tables.shape[1] * block_size, decode_only, num_splits, config)
    cfg = LatentConfig(plan.block_h, plan.block_n, plan.num_warps, plan.num_stages)
    block_h, block_q, head_groups, num_splits = plan.block_h, plan.block_q, plan.head_groups, plan.num_splits
    block_m = max(16, block_q * block_h)  # tl.dot needs >= 16 rows
    block_c, block_r = max(16, next_pow2(dc)), max(16, next_pow2(dr))

    out, ws_m, ws_l, ws_acc, ws_strides = _split_k.split_outputs(q_lat, (h, t, dc), num_splits, t, h, dc)

    dot_fp32 = q_lat.dtype == torch.float32 or not q_lat.is_cuda  # the interpreter's bf16 dot is wrong
    key = (cfg, q_lat.device, q_lat.dtype, block_m, block_c, block_r)
    grid = ((t // block_q + n_seqs) * head_groups, num_splits)
    for block_n, num_warps, num_stages in _launch_shapes(cfg, key):
        try:
            _latent_attn_kernel[grid](
                q_lat, q_pe, latent_cache, out, ws_m, ws_l, ws_acc,
                block_tables, seq_lens, query_start_loc,
                n_seqs, h, float(scale),
                q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1),
                latent_cache.stride(0), latent_cache.stride(1), out.stride(0), out.stride(1),
                block_tables.stride(0), *ws_strides,
                D_C=dc, D_R=dr, BLOCK_SIZE=block_size, HEAD_GROUPS=head_groups,
                BLOCK_Q=block_q, BLOCK_H=block_h, BLOCK_M=block_m, BLOCK_N=block_n,
                BLOCK_C=block_c, BLOCK_R=block_r, NUM_SPLITS=num_splits,
                # rounded up to a multiple of 4: few specializations as the batch size changes
                SEARCH_STEPS=-(-max(1, n_seqs.bit_length()) // 4) * 4, DOT_FP32=dot_fp32,
                num_warps=num_warps, num_stages=num_stages, **pdl_args(q_lat),
            )  # fmt: skip
        except triton.runtime.errors.OutOfResources:
            continue  # too much shared memory (fp32): try the next smaller shape
        _LAUNCH_OK[key] = (block_n, num_warps, num_stages)
        break
    else:
        raise RuntimeError(f"latent_attention_triton: no launch shape fits for {key}")
    if num_splits > 1:
        _launch_latent_reduce(ws_m, ws_l, ws_acc, ws_strides, out, query_start_loc, n_seqs)
    return out


def _launch_latent_reduce(ws_m, ws_l, ws_acc, ws_strides, out, query_start_loc, n_seqs) -> None:
    """Merge the split partials into out [H, T, Dc]: one program per (token, head, chunk of Dc) that reads every
    split of its chunk in one load, so a single decode row with many splits still spreads over H x chunks
    programs (`_split_k`'s reduce walks the splits one after another in one program per token and heads)."""
    num_splits, t, h, dc = ws_acc.shape
    splits_p2 = next_pow2(num_splits)
    block_d = max(16, min(next_pow2(dc), 4096 // splits_p2))  # <= 16 KB of fp32 partials per program
    _latent_reduce_kernel[(t, h, triton.cdiv(dc, block_d))](
        ws_m, ws_l, ws_acc, out, query_start_loc, n_seqs, dc, *ws_strides, out.stride(1), out.stride(0),
        NUM_SPLITS=num_splits, SPLITS_P2=splits_p2, BLOCK_D=block_d, num_warps=4, **pdl_args(ws_m),
    )  # fmt: skip


def _absorbed_triton(latent_cache, w_uk, w_uv, scale, q_nope, q_pe, block_tables, seq_lens, query_start_loc,
                     num_splits=None):  # fmt: skip
    o_lat = latent_attention_triton(
        _absorb_query(q_nope, w_uk), q_pe, latent_cache, block_tables, seq_lens, query_start_loc, scale,
        num_splits=num_splits,
    )  # fmt: skip
    return _unabsorb(o_lat, w_uv)


def mla_attention_triton(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    path: str | None = None,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Triton MLA (writes the latent cache first). See the module docstring for `path`; `num_splits` is
    `latent_attention_triton`'s (absorbed path only). With T <= S, or while a CUDA graph is being captured, no
    host sync: the absorbed path's grid depends on shapes only."""
    if not HAS_TRITON:
        raise RuntimeError("mla_attention_triton needs triton")
    _check_dims(q_nope, q_pe, c_kv, k_pe, latent_cache, w_uk, w_uv)
    write_latent_cache_triton(c_kv, k_pe, latent_cache, slot_mapping)
    if path is None and q_nope.is_cuda and torch.cuda.is_current_stream_capturing():
        path = "absorbed"  # the expanded route reads lengths on the host, which a capture forbids
    common = (latent_cache, w_uk, w_uv, float(scale))
    absorbed = functools.partial(_absorbed_triton, *common, num_splits=num_splits)
    expanded = functools.partial(_expanded, paged_attention_triton, *common)
    return _route(path, absorbed, expanded, q_nope, q_pe, block_tables, seq_lens, query_start_loc, w_uv.shape[2])


# --------------------------------------------------------------------------------------------------
# the registered op
# --------------------------------------------------------------------------------------------------


@torch.library.custom_op("mini_infer::mla_attention", mutates_args=("latent_cache",))
def mla_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    c_kv: torch.Tensor,
    k_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Write [c_kv | k_pe] into the latent cache, then MLA: Triton on CUDA when available, else the reference."""
    args = (q_nope, q_pe, c_kv, k_pe, latent_cache, slot_mapping, block_tables, seq_lens, query_start_loc,
            w_uk, w_uv, scale)  # fmt: skip
    if use_triton(q_nope):
        return mla_attention_triton(*args)
    return mla_attention_reference(*args)


@mla_attention.register_fake
def _(q_nope, q_pe, c_kv, k_pe, latent_cache, slot_mapping, block_tables, seq_lens, query_start_loc, w_uk, w_uv,
      scale):  # fmt: skip
    _check_dims(q_nope, q_pe, c_kv, k_pe, latent_cache, w_uk, w_uv)
    return q_nope.new_empty((q_nope.shape[0], q_nope.shape[1], w_uv.shape[2]))
