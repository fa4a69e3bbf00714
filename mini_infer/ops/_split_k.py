"""Split-K (flash-decoding) pieces shared by the paged attention kernel (`paged_attention`) and the latent
attention kernel (`mla_attention`'s absorbed path).

Both kernels tile the packed query rows of all sequences (varlen via `query_start_loc`), run an online softmax
in log2 units (scores times LOG2E, exp2) over a key range, and with NUM_SPLITS > 1 cut that range into BLOCK_N
aligned splits whose partials (running max m, sum l, unnormalized acc) are merged in split order, either by a
reduce kernel (`store_rows` + `launch_split_reduce`) or inside the attention launch (`finish_rows`: the split
that arrives last at its rows, counted in a counter per set of rows that it zeroes again, merges the non-empty
splits; a range that fits one split is written normalized at once). Here:
  * Triton helpers the kernels inline: which sequence a query tile belongs to, a program's split of its key
    range and how many splits are non-empty, a key tile's cache blocks (through the block table) and
    causal/window mask, one online-softmax step, an attention sink folded into a running softmax (`fold_sink`:
    the paged kernel folds it into split 0's state, so neither merge below changes), the merge of partials, and
    the end of a program (normalized rows, its partials, or the fused merge);
  * the reduce kernel, and the launchers' side: the output + workspaces for a split count, the fused merge's
    counters, the reduce launch, and the default split count.
Partials are fp32, laid out [num_splits, T, H] (m, l) and [num_splits, T, H, Dv] (acc). This module knows
nothing of either kernel's cache layout (what a block/offset holds) or how it computes scores.
"""

from __future__ import annotations

import math

import torch

from mini_infer.ops._triton_support import HAS_TRITON, cuda_index, next_pow2, num_sms, tl, triton

__all__ = ["default_num_splits", "launch_split_reduce", "split_counters", "split_outputs"]

if HAS_TRITON:
    LOG2E = tl.constexpr(1.4426950408889634)

    @triton.jit
    def _search_tile_sequence(tile, qsl_ptr, n_seqs, BLOCK_Q: tl.constexpr, SEARCH_STEPS: tl.constexpr,
                              ROW_TILES: tl.constexpr):
        """find_tile_sequence's binary search: the last s whose first tile is <= `tile`."""
        lo = tile * 0
        hi = lo + n_seqs - 1
        for _ in range(SEARCH_STEPS):
            mid = (lo + hi + 1) // 2
            if ROW_TILES:
                take = tl.load(qsl_ptr + mid) <= tile
            else:
                take = tl.load(qsl_ptr + mid) // BLOCK_Q + mid <= tile
            lo = tl.where(take, mid, lo)
            hi = tl.where(take, hi, mid - 1)
        return lo

    @triton.jit
    def _sequence_rows(qsl_ptr, seq_lens_ptr, s):
        """(q_beg, q_end, ctx) of sequence s: its query rows [q_beg, q_end) and its context length."""
        return tl.load(qsl_ptr + s), tl.load(qsl_ptr + s + 1), tl.load(seq_lens_ptr + s)

    @triton.jit
    def find_tile_sequence(tile, qsl_ptr, seq_lens_ptr, n_seqs, BLOCK_Q: tl.constexpr, SEARCH_STEPS: tl.constexpr,
                           ROW_TILES: tl.constexpr = False, ROW_GUESS: tl.constexpr = False):
        """(s, q_beg, qlen, ctx, q_off) of query tile `tile`: its sequence s, whose query rows start at q_beg,
        number qlen and sit at the end of a context of ctx positions; q_off is the tile's first row within s.

        Sequence s owns virtual tiles [qsl[s] // BLOCK_Q + s, ... + cdiv(qlen_s, BLOCK_Q)): disjoint, below
        T // BLOCK_Q + S. A binary search (SEARCH_STEPS >= S.bit_length() steps) finds the last s whose first
        tile is <= `tile`; q_off >= qlen marks a tile past its sequence's rows (nothing to do). ROW_TILES (one
        query row a tile, BLOCK_Q == 1): tile t is row t, owned by the last s with qsl[s] <= t (never one of no
        rows: its qsl equals the next one's), so T tiles cover the rows and none is past its sequence's.
        ROW_GUESS (BLOCK_Q == 1): first the guess of a decode step, where every sequence has one row: s = t (ROW_TILES)
        or t // 2 (tiles 2s and 2s + 1 are s's), taken where it is the search's answer (its first tile <= t, and the
        next sequence's first tile > t or it is the last sequence) from three loads at once instead of the search's
        SEARCH_STEPS dependent ones; other tiles (of sequences with several rows, past the owned rows) search."""
        if ROW_GUESS and BLOCK_Q == 1:
            if ROW_TILES:
                g = tile
            else:
                g = tile // 2
            ok = g < n_seqs
            q_beg = tl.load(qsl_ptr + g, mask=ok, other=0)
            q_end = tl.load(qsl_ptr + g + 1, mask=ok, other=0)
            ctx = tl.load(seq_lens_ptr + g, mask=ok, other=0)
            if ROW_TILES:  # the first tiles of g and g + 1
                first = q_beg
                after = q_end
            else:
                first = q_beg + g
                after = q_end + g + 1
            s = g
            if not (ok & (first <= tile) & ((tile < after) | (g + 1 == n_seqs))):
                s = _search_tile_sequence(tile, qsl_ptr, n_seqs, BLOCK_Q, SEARCH_STEPS, ROW_TILES)
                q_beg, q_end, ctx = _sequence_rows(qsl_ptr, seq_lens_ptr, s)
        else:
            s = _search_tile_sequence(tile, qsl_ptr, n_seqs, BLOCK_Q, SEARCH_STEPS, ROW_TILES)
            q_beg, q_end, ctx = _sequence_rows(qsl_ptr, seq_lens_ptr, s)
        qlen = q_end - q_beg
        if ROW_TILES:
            q_off = tile - q_beg
        else:
            q_off = (tile - (q_beg // BLOCK_Q + s)) * BLOCK_Q
        return s, q_beg, qlen, ctx, q_off

    @triton.jit
    def split_key_range(k_lo, k_hi, split, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
        """Program `split`'s part of the key range [k_lo, k_hi): equal BLOCK_N-aligned parts, the last ones
        possibly short or empty. NUM_SPLITS == 1: the whole range."""
        if NUM_SPLITS > 1:
            per = tl.cdiv(tl.cdiv(k_hi - k_lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
            k_lo = k_lo + split * per
            k_hi = tl.minimum(k_lo + per, k_hi)
        return k_lo, k_hi

    @triton.jit
    def used_splits(k_lo, k_hi, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):
        """How many of `split_key_range`'s splits of [k_lo, k_hi) are non-empty (they come first); at least 1,
        so that an empty range still has one program writing its (zero) rows."""
        n = k_hi - k_lo
        per = tl.maximum(tl.cdiv(tl.cdiv(n, NUM_SPLITS), BLOCK_N) * BLOCK_N, BLOCK_N)
        return tl.maximum(tl.cdiv(n, per), 1)

    @triton.jit
    def key_tile(bt_row, start, k_hi, block_size, BLOCK_N: tl.constexpr):
        """Key positions start .. start + BLOCK_N - 1 of the sequence whose block-table row is bt_row:
        (kpos, k_ok, pblk, koff), k_ok where kpos < k_hi, pblk the cache block holding each (int64; block 0
        where not k_ok: no unused table entry is read) and koff the offset in it (int64)."""
        kpos = start + tl.arange(0, BLOCK_N)
        k_ok = kpos < k_hi
        pblk = tl.load(bt_row + kpos // block_size, mask=k_ok, other=0).to(tl.int64)
        koff = (kpos % block_size).to(tl.int64)
        return kpos, k_ok, pblk, koff

    @triton.jit
    def hide_invisible(
        sc, start, kpos, k_ok, q_pos, first_q_pos, sliding_window, BLOCK_N: tl.constexpr, USE_WINDOW: tl.constexpr,
    ):  # fmt: skip
        """Scores sc [rows, BLOCK_N] with -inf where row i (position q_pos[i]) may not see key kpos: past k_hi
        (not k_ok), in its future, or (USE_WINDOW) sliding_window or more positions behind it. Only tiles reaching
        past the tile's first query position first_q_pos (k_hi is at most that + BLOCK_Q; split ends below it
        are BLOCK_N-aligned), or under a window, need it: the bulk of a long context skips it. Rows that are not
        real queries are never stored, so they need no mask."""
        if USE_WINDOW or (start + BLOCK_N > first_q_pos):
            visible = k_ok[None, :] & (kpos[None, :] <= q_pos[:, None])
            if USE_WINDOW:
                visible = visible & ((q_pos[:, None] - kpos[None, :]) < sliding_window)
            sc = tl.where(visible, sc, float("-inf"))
        return sc

    @triton.jit
    def online_softmax_step(sc, m_i, l_i):
        """Fold a tile of scores sc [rows, keys] (log2 units, -inf where hidden) into the running max m_i and
        sum l_i: (p, alpha, m_i, l_i) with p the tile's unnormalized probabilities and alpha the factor that
        rescales the accumulator (acc = acc * alpha[:, None] + p @ V). Rows with nothing visible yet keep
        m = -inf, l = 0, and p = alpha = 0."""
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(sc - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        return p, alpha, m_new, l_i

    @triton.jit
    def fold_sink(m_i, l_i, acc, sink):
        """Fold one more key of value zero and score `sink` [rows] (log2 units; an attention sink, GPT-OSS's s_aux)
        into a running softmax (m_i, l_i, acc): (m, l, acc) with m = max(m_i, sink), l = l_i * 2^(m_i - m) +
        2^(sink - m), acc * 2^(m_i - m). Folded into one split's state (the paged attention kernel: split 0's,
        after its last tile), the merges below then give every row out = sum_j p_j v_j / (sum_j p_j + 2^sink), the
        sink's probability dropped; a row that saw no key (m_i = -inf, l_i = 0) keeps acc = 0."""
        m_new = tl.maximum(m_i, sink)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.exp2(sink - m_ref)
        return m_new, l_i, acc * alpha[:, None]

    @triton.jit
    def _normalize(acc, l_sum):
        """acc / l per row; rows that saw no key (l = 0) stay 0."""
        return acc / tl.where(l_sum == 0.0, 1.0, l_sum)[:, None]

    @triton.jit
    def _store_normalized(out_ptr, acc, l_i, tok, head, col, row_ok, col_ok, s_ot, s_oh):
        o = _normalize(acc, l_i)
        tl.store(
            out_ptr + tok[:, None] * s_ot + head[:, None] * s_oh + col[None, :],
            o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :],
        )  # fmt: skip

    @triton.jit
    def _store_partials(
        ws_m_ptr, ws_l_ptr, ws_acc_ptr, acc, m_i, l_i, split, tok, head, col, row_ok, col_ok,
        s_wms, s_wmt, s_was, s_wat, s_wah,
    ):  # fmt: skip
        sp64 = split.to(tl.int64)  # workspaces can pass 2**31 elements
        w = sp64 * s_wms + tok * s_wmt + head
        tl.store(ws_m_ptr + w, m_i, mask=row_ok)
        tl.store(ws_l_ptr + w, l_i, mask=row_ok)
        wa = sp64 * s_was + tok[:, None] * s_wat + head[:, None] * s_wah + col[None, :]
        tl.store(ws_acc_ptr + wa, acc, mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def merge_partials(
        ws_m_ptr, ws_l_ptr, ws_acc_ptr, m_off, a_off, row_ok, mask, n, s_wms, s_was, NUM_SPLITS: tl.constexpr,
    ):  # fmt: skip
        """(acc, l) of splits 0 .. n-1's partials (n <= NUM_SPLITS) merged in split order, for rows at offsets
        m_off (into m/l) and a_off (into acc, [rows, cols], masked by mask); m_off is int64 (workspaces can
        pass 2**31 elements). The loops are unrolled over NUM_SPLITS with splits from n on masked off (they add
        exact zeros), so that every load can be in flight at once; the loads go through L2 (.cg): the partials
        may come from other programs of the same launch."""
        zero = m_off * 0
        m_max = tl.full(m_off.shape, float("-inf"), tl.float32)
        for sp in tl.static_range(NUM_SPLITS):
            ok = row_ok & ((zero + sp) < n)
            m = tl.load(ws_m_ptr + (zero + sp) * s_wms + m_off, mask=ok, other=float("-inf"), cache_modifier=".cg")
            m_max = tl.maximum(m_max, m)
        m_ref = tl.where(m_max == float("-inf"), 0.0, m_max)
        l_sum = tl.zeros(m_off.shape, tl.float32)
        acc = tl.zeros(a_off.shape, tl.float32)
        for sp in tl.static_range(NUM_SPLITS):
            sp64 = zero + sp
            ok = row_ok & (sp64 < n)
            m = tl.load(ws_m_ptr + sp64 * s_wms + m_off, mask=ok, other=float("-inf"), cache_modifier=".cg")
            wgt = tl.exp2(m - m_ref)  # m is in log2 units
            l_sum += wgt * tl.load(ws_l_ptr + sp64 * s_wms + m_off, mask=ok, other=0.0, cache_modifier=".cg")
            acc += wgt[:, None] * tl.load(
                ws_acc_ptr + sp64[:, None] * s_was + a_off, mask=mask & ok[:, None], other=0.0, cache_modifier=".cg"
            )
        return acc, l_sum

    @triton.jit
    def store_rows(
        out_ptr, ws_m_ptr, ws_l_ptr, ws_acc_ptr, acc, m_i, l_i, split, tok, head, col, row_ok, col_ok,
        s_ot, s_oh, s_wms, s_wmt, s_was, s_wat, s_wah, NUM_SPLITS: tl.constexpr,
    ):  # fmt: skip
        """The end of a program over rows (token tok, head head) and columns col: NUM_SPLITS == 1, the
        normalized output rows; else the split's partials for the reduce kernel (every split writes every row it
        owns, an empty key range as m = -inf, l = 0, acc = 0)."""
        if NUM_SPLITS == 1:
            _store_normalized(out_ptr, acc, l_i, tok, head, col, row_ok, col_ok, s_ot, s_oh)
        else:
            _store_partials(ws_m_ptr, ws_l_ptr, ws_acc_ptr, acc, m_i, l_i, split, tok, head, col, row_ok, col_ok,
                            s_wms, s_wmt, s_was, s_wat, s_wah)

    @triton.jit
    def arrives_last(cnt_ptr, n_arrivals):
        """After this program's stores: count it at cnt_ptr (a counter from `split_counters`, zero between
        launches) and return whether it is the last of the n_arrivals programs counted there; that one has zeroed
        the counter again (a CUDA graph's replay) and sees every other counted program's stores."""
        tl.debug_barrier()  # every thread's stores are issued before the (acq_rel, gpu) count is released
        last = tl.atomic_add(cnt_ptr, 1) == n_arrivals - 1
        if last:
            tl.store(cnt_ptr, 0)
        return last

    @triton.jit
    def finish_rows(
        out_ptr, ws_m_ptr, ws_l_ptr, ws_acc_ptr, cnt_ptr, acc, m_i, l_i, split, n_used, tok, head, col, row_ok,
        col_ok, tok_m, head_m, row_ok_m, s_ot, s_oh, s_wms, s_wmt, s_was, s_wat, s_wah, NUM_SPLITS: tl.constexpr,
    ):  # fmt: skip
        """The end of split `split` (< n_used, the non-empty splits of its rows' key range) with the merge in
        the same launch: n_used == 1, the normalized rows at once; else its partials, then a count at cnt_ptr
        (one counter per set of rows, zero between launches); the split that arrives last resets it and
        merges the n_used partials in split order (deterministic, whatever the arrival order). The merge runs
        over rows (tok_m, head_m, row_ok_m): the real ones among (tok, head, row_ok), or all of them; fewer rows
        keep fewer partials in registers (a decode tile pads its few real rows to the dots' 16)."""
        if n_used == 1:
            _store_normalized(out_ptr, acc, l_i, tok, head, col, row_ok, col_ok, s_ot, s_oh)
        else:
            _store_partials(ws_m_ptr, ws_l_ptr, ws_acc_ptr, acc, m_i, l_i, split, tok, head, col, row_ok, col_ok,
                            s_wms, s_wmt, s_was, s_wat, s_wah)
            if arrives_last(cnt_ptr, n_used):
                mask = row_ok_m[:, None] & col_ok[None, :]
                a_off = tok_m[:, None] * s_wat + head_m[:, None] * s_wah + col[None, :]
                acc_m, l_sum = merge_partials(ws_m_ptr, ws_l_ptr, ws_acc_ptr, tok_m * s_wmt + head_m, a_off, row_ok_m,
                                              mask, n_used, s_wms, s_was, NUM_SPLITS)
                _store_normalized(out_ptr, acc_m, l_sum, tok_m, head_m, col, row_ok_m, col_ok, s_ot, s_oh)

    @triton.jit
    def _split_reduce_kernel(
        ws_m_ptr, ws_l_ptr, ws_acc_ptr, out_ptr, qsl_ptr,
        n_seqs, n_heads, head_dv, s_wms, s_wmt, s_was, s_wat, s_wah, s_ot, s_oh,
        NUM_SPLITS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_DV: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        dv = tl.arange(0, BLOCK_DV)
        owned = (t + h * 0) < tl.load(qsl_ptr + n_seqs)  # rows past the last sequence: zeros
        h_ok = owned & (h < n_heads)
        hd_ok = h_ok[:, None] & (dv < head_dv)[None, :]
        m_off = t * s_wmt + h  # int64 (t is)
        a_off = t * s_wat + h[:, None] * s_wah + dv[None, :]
        acc, l_sum = merge_partials(
            ws_m_ptr, ws_l_ptr, ws_acc_ptr, m_off, a_off, h_ok, hd_ok, NUM_SPLITS, s_wms, s_was, NUM_SPLITS
        )
        o = _normalize(acc, l_sum)
        tl.store(
            out_ptr + t * s_ot + h[:, None] * s_oh + dv[None, :],
            o.to(out_ptr.dtype.element_ty), mask=(h < n_heads)[:, None] & (dv < head_dv)[None, :],
        )  # fmt: skip


def split_outputs(
    like: torch.Tensor, out_shape: tuple[int, ...], num_splits: int, tokens: int, heads: int, dv: int,
    writes_every_row: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, tuple[int, ...]]:  # fmt: skip
    """(out, ws_m, ws_l, ws_acc, ws_strides) for a kernel over `tokens` x `heads` rows of `dv` values cut into
    `num_splits` key splits. One split: out zeroed (rows owned by no sequence stay zero) unless the kernel
    `writes_every_row` (zeros included), no workspaces (out stands in for them, strides 0). More: out
    uninitialized (the reduce kernel, or the kernel, writes every row) and fp32 partials; ws_strides are
    (split and token strides of m/l, split, token and head strides of acc)."""
    if num_splits == 1:
        out = like.new_empty(out_shape) if writes_every_row else like.new_zeros(out_shape)
        return out, out, out, out, (0, 0, 0, 0, 0)
    out = like.new_empty(out_shape)
    ws_m = torch.empty((num_splits, tokens, heads), dtype=torch.float32, device=like.device)
    ws_l = torch.empty_like(ws_m)
    ws_acc = torch.empty((num_splits, tokens, heads, dv), dtype=torch.float32, device=like.device)
    return out, ws_m, ws_l, ws_acc, (ws_m.stride(0), ws_m.stride(1), *ws_acc.stride()[:3])


_COUNTERS: dict[torch.device, torch.Tensor] = {}  # device -> int32 counters of `finish_rows`, zero between launches
# Counters replaced by a larger set are kept: a CUDA graph captured with them still counts in them at every replay
# (a later caller outside the graphs, such as the sampler's argmax with more rows, may grow the set).
_RETIRED: list[torch.Tensor] = []


def split_counters(device: torch.device, n: int) -> torch.Tensor:
    """At least n zeroed int32 counters for `finish_rows` on `device`, kept per device; each launch leaves them
    zero. Grown on first need (to at least 4,096): make the first call of each shape before capturing a CUDA
    graph, as for Triton's compile (a set replaced by a larger one stays allocated for the graphs that captured
    it). Launches on several streams at once must not share them (the engine uses one stream)."""
    cnt = _COUNTERS.get(device)
    if cnt is None or cnt.numel() < n:
        if cnt is not None:
            _RETIRED.append(cnt)
        cnt = torch.zeros(max(n, 4096, 2 * cnt.numel() if cnt is not None else 0), dtype=torch.int32, device=device)
        _COUNTERS[device] = cnt
    return cnt


def launch_split_reduce(
    ws_m: torch.Tensor, ws_l: torch.Tensor, ws_acc: torch.Tensor, ws_strides: tuple[int, ...], out: torch.Tensor,
    s_ot: int, s_oh: int, query_start_loc: torch.Tensor, n_seqs: int, block_dv: int,
) -> None:  # fmt: skip
    """Merge the partials of `split_outputs` into out (token stride s_ot, head stride s_oh): one program per
    token and block of heads; rows owned by no sequence (past query_start_loc[n_seqs]) get zeros."""
    num_splits, t, heads, dv = ws_acc.shape
    block_h = min(next_pow2(heads), max(1, 4096 // block_dv))
    _split_reduce_kernel[(t, triton.cdiv(heads, block_h))](
        ws_m, ws_l, ws_acc, out, query_start_loc,
        n_seqs, heads, dv, *ws_strides, s_ot, s_oh,
        NUM_SPLITS=num_splits, BLOCK_H=block_h, BLOCK_DV=block_dv, num_warps=4,
    )  # fmt: skip


def default_num_splits(q: torch.Tensor, n_seqs: int, programs_per_seq: int, max_context: int) -> int:
    """Split-K only pays when (sequence x programs_per_seq) programs are too few to fill the GPU: then enough
    splits to cover the SMs twice, at most 8 where a block-table row holds at most 1,024 keys (max_context) and 16
    beyond, as a power of two. 1 off CPU.

    The launch cannot see the step's context, only the table's capacity. H200, batch-1 decode, 16/8 and 32/4 heads
    (us per call, write + attention): 8 splits are best up to ~1,000 keys (6.6-6.8 against 16 splits' 6.9-7.1),
    16 at 2,000-4,000 (8.0 / 10.8 against 8 splits' 9.1 / 13.6); the old bound of capacity / 256 keys gave 2 splits
    to a 400-key table, 8.6 us at 300 keys."""
    if not q.is_cuda:
        return 1
    programs = max(1, n_seqs * programs_per_seq)
    sms = num_sms(cuda_index(q.device))
    if programs >= sms:
        return 1
    splits = min(math.ceil(2 * sms / programs), 8 if max_context <= 1024 else 16)
    return next_pow2(splits) if splits > 1 else 1


def splits_pay(q: torch.Tensor, n_seqs: int, programs_per_seq: int, num_splits: int | None = None) -> bool:
    """Whether a launch splits its key ranges: `num_splits` > 1 when the launch is given one, else whether
    `default_num_splits` splits it, at any context: a CUDA launch of fewer (sequence x programs_per_seq) programs
    than SMs (then at least 3 splits, rounded up to 4)."""
    if num_splits is not None:
        return num_splits > 1
    return default_num_splits(q, n_seqs, programs_per_seq, 0) > 1
