"""`mini_infer::paged_attention`: write this step's K/V into the paged cache, then attend over it.

Inserted by the PagedAttention pass in place of the model's attention (packed token layout: all tokens
of a step in one [T, H, D] batch). Handles prefill, chunked prefill (queries attending to blocks already
cached plus the new ones), decode, and any mix, varlen via `query_start_loc`; GQA/MQA; sliding window;
logit softcap; attention sinks. It mutates only `k_cache`/`v_cache` (declared), reads block-table entries
only for blocks a sequence actually uses, and imports nothing from mini_infer outside `mini_infer.ops`.

Layout (S sequences, T packed tokens):
    q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, Dv]
    k_cache [num_blocks, block_size, Hkv, D], v_cache [num_blocks, block_size, Hkv, Dv]
    slot_mapping [T] int64 (negative: do not write), block_tables [S, max_blocks] int32,
    seq_lens [S] int32 (context length including this step's tokens), query_start_loc [S+1] int32.
Query row j of sequence s sits at position `seq_lens[s] - qlen_s + j` and sees cache positions
`p <= pos` (and `pos - p < sliding_window` when sliding_window > 0). Rows of q owned by no sequence
produce zeros. Softmax in fp32; the output has q's dtype and shape [T, Hq, Dv].

Attention sinks (GPT-OSS's `s_aux`; `sinks`, the op's last argument, None by default): [Hq], any float dtype,
read as fp32. Head h's sink is one more logit in each of its rows' softmax whose probability is dropped (a key of
value zero, never masked): out = sum_j e^(s_j - m) v_j / (sum_j e^(s_j - m) + e^(sink_h - m)), i.e. the output
without it times sigmoid(lse - sink_h), lse the log-sum-exp of the row's visible scores (after scale and softcap;
the sink is neither scaled nor capped). The reference appends it to the scores as GPT-OSS's eager code does; the
Triton kernel (USE_SINKS, off when None: the kernel of a model without sinks is as before) folds it into split 0's
running softmax after that split's last tile (`_split_k.fold_sink`), so the split merges (fused, or the reduce
kernel) take it unchanged, exactly once. The long-run route (below) applies it after the fused kernels, from their
log-sum-exps (ops/_prefill_sdpa.py).

FP8 KV cache: when both caches are float8_e4m3fn, `k_scale` and `v_scale` (fp32, shape [1], one per layer,
required then) scale them: the write stores `k / k_scale` saturated to +-448 and rounded to nearest-even
e4m3 (the Triton write gives the reference's bytes exactly), and every read dequantizes, `cache * scale`:
the reference in fp32 before its matmuls, so it equals the same attention over an fp32 cache holding the
dequantized values; the Triton kernel converts the fp8 tiles (exactly) to a 16-bit dtype for its dots, fp16 by
default with q (saturated to fp16's range) and the probabilities in fp16 too (`_FP8_DOT`; an fp32 q keeps fp32
dots), and folds k_scale into the score scale and v_scale into the output. A fourth way, "fp8" (no default: to
be timed), runs both dots in e4m3 instead, with q and the probabilities quantized in the kernel (see `_FP8_DOT`):
a few percent off the reference, not the 16-bit ways' bf16 rounding. Other caches take no scales (None, the default).

Two implementations:
  * `paged_attention_reference`: plain torch, the CPU production path and the test oracle. Decode rows
    (qlen == 1) of all sequences are batched into one padded gather + matmul; longer query runs go one
    sequence (and one chunk of at most 256 query rows) at a time. It reads lengths on the host, so on
    CUDA (no Triton) it syncs and cannot be captured in a CUDA graph.
  * `paged_attention_triton`: a KV-write kernel, then one unified kernel whose grid depends only on
    shapes (CUDA-graph capturable, no host sync): `T // BLOCK_Q + S` query tiles (decode-shaped launches under
    ROW_TILES: `T`) x Hkv kv-heads x `num_splits` key-range splits. A decode-shaped launch (one query row per tile,
    `decode_only`) has no write kernel (unless `MINI_INFER_DECODE_KV_WRITE=separate`: DECODE_WRITE_IN_KERNEL; or it
    is a one-split launch of a kind whose `_CONFIG` "write_one_split" is 0: fp8 caches): each program of the unified
    kernel first writes the step's new k/v rows (of its kv head) that fall in its key range, then a CTA barrier,
    then reads them back with the rest (several programs may write one row: the same bytes); a token no sequence owns is written by its tile's first program. Prefill-shaped launches
    keep the write kernel (a tile there reads keys that other tiles' rows own). Each program finds its sequence
    by binary search over `query_start_loc` (a decode step's tile first tries its own row's sequence: ROW_GUESS),
    loads each K/V tile once for all query heads of its kv-head (GQA), and runs an online softmax over the key range; it writes every output row (zeros for rows no sequence owns). With
    `num_splits > 1` (flash-decoding), the splits a tile's range reaches write partial (max, sum, acc) and
    the last of them to finish merges them in split order, in the same launch (splits past the range exit at
    once; a range within one split is written directly). The split-K pieces are `_split_k`'s, shared with
    `mla_attention`'s latent kernel. The kernel is correct for every batch under every knob; the knobs
    only pick tile shapes, see `paged_attention_triton`.

The registered op writes the cache as its implementation does (a step the route below leaves alone: the
implementation called whole, so a decode step's write stays inside the attention launch), then sends each sequence
whose query run is long (prefill chunks of `_prefill_sdpa.MIN_QUERY_ROWS` rows or more) through torch's fused
attention kernels (cuDNN first, FlashAttention next; ops/_prefill_sdpa.py) over its context gathered from the cache
plus its new k/v, and the other sequences through the implementation above, as a batch of those alone. That route is
on for CUDA tensors by default (`_prefill_sdpa.ROUTE` "auto"; `MINI_INFER_PREFILL_ROUTE=off` turns it off; the
engine warms it at start-up, runtime/warmup.py), off on a CPU unless forced ("on"), off while a CUDA graph is
captured (the route reads the step's lengths on the host, once per step) and for sliding windows, softcap and fp8
caches; `paged_attention_triton` and `paged_attention_reference` called directly never take it; compiled graphs call
`paged_attention_<backend>_entry`, the op's body.

`paged_attention_triton(..., rotary=Rotary(...))` is `rotary_paged_attention`'s decode launch
(ops/rotary_paged_attention.py): q and the step's k arrive unrotated and the unified kernel, with its ROTARY switch,
applies qk_rotary's math (`_rotary.rotated_pairs`: the optional per-head RMSNorms, then the neox rotary, rounded to
q's / k's dtype as qk_rotary's outputs are) to its q rows before its dots and to the k rows it writes; only launches
that write in the kernel and whose head tile is the head dim take it (`rotary_in_kernel`). Off, the kernel is as
above.

Before the wait (programmatic dependent launch: `await_producers`). Every program first reads what no kernel of the
step writes: its sequence's lengths (`query_start_loc`, `seq_lens`) and block-table entries, inputs copied before the
step's graph runs. Split decode launches (`num_splits` > 1: a small batch, where the attention is a chain of dependent
loads with idle SMs around it) also load their first key tile's cached keys and values there, the positions older
than the step's own keys (written by an earlier step's kernels, all finished before this step's first kernel
started); the step's keys in that tile are loaded after the in-kernel write, as before. Only loads move; every store
stays after the wait. Those launches take the "decode_split" / "decode_split_fp8" shape (64 keys a step, 8 warps:
with 128 keys and 4 warps the preloaded tiles spill). H200, qwen3-0.6b batch 1, engines alternated over two rounds:
1,473.4 / 1,475.4 tok/s with it, 1,422.7 / 1,426.4 with the shape alone, 1,349.8 / 1,362.4 with the "decode" shape
as before (bench/RESULTS.md, sixteenth session); over an fp8 cache (2,048-token prompt, twenty-fifth session)
1,242.6 with it, 1,192.5 with the shape alone, 1,177.8 with 128 keys and 4 warps.
`MINI_INFER_ATTN_PRELOAD=0` keeps the shape and loads after the wait.

`mini_infer::paged_attention_cached` (no k, v, slot_mapping; mutates nothing) is the same attention, route included,
over caches that already hold the step's keys: written by `qk_rotary_kv_write` (ops/qk_rotary_kv_write.py, the
FuseKVWrite pass), the long-run route then reads a run's new keys from the cache with its context.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from mini_infer.ops import _prefill_sdpa, _split_k
from mini_infer.ops._prefill_sdpa import route_min_query_rows
from mini_infer.ops._triton_support import (
    HAS_TRITON,
    await_producers,
    next_pow2,
    pdl_args,
    tl,
    triton,
    use_triton,
)

__all__ = [
    "route_min_query_rows",
    "paged_attention",
    "paged_attention_cached",
    "paged_attention_cached_reference",
    "paged_attention_cached_triton",
    "paged_attention_reference",
    "paged_attention_triton",
    "write_kv_cache_reference",
    "write_kv_cache_triton",
]

# Longest run of query rows the reference attends in one matmul (bounds its fp32 score buffer).
_REF_QUERY_CHUNK = 256

# Triton launch shapes per kernel kind ("prefill", "decode"; "_fp8": over fp8 caches; "decode_split": decode
# launches cut into key splits over a 16-bit cache, the small batches; "decode_split_fp8": the same launches
# over an fp8 cache, their dot way decode_fp8's). "rows": (query row, head) pairs per prefill tile; block_n:
# keys per inner step; preload (split kinds; 1 when absent): the first key tile loaded before the PDL wait
# (module docstring, "Before the wait"; ATTN_PRELOAD allowing); fp8_dot:
# how fp8 tiles meet q and p in the dots (_FP8_DOT); maxnreg (optional, none by default): ptxas's register cap
# a thread, passed to the launch; write_one_split (decode kinds; 1 when absent): whether a decode-shaped
# launch of one split (large batches) writes the step's keys in the attention kernel (1) or runs
# `_write_kv_kernel` first (0; split launches always write in the kernel, DECODE_WRITE_IN_KERNEL allowing);
# row_tiles (1 when absent): whether the kind's decode launches take ROW_TILES' T programs. Tuned on an H200
# (bf16, head dim 128, GQA 28/4) with bench/kernel_paged_attention.py --sweep ("decode_split": engine runs at
# batch 1, RESULTS' sixteenth session); where a shape runs out of shared memory (fp32, large head dims) the
# launch retries smaller ones.
_CONFIG = {
    "prefill": {"rows": 128, "block_n": 128, "num_warps": 8, "num_stages": 2},
    "decode": {"block_n": 128, "num_warps": 4, "num_stages": 3, "write_one_split": 1, "row_tiles": 0},
    "decode_split": {"block_n": 64, "num_warps": 8, "num_stages": 2},
    "prefill_fp8": {"rows": 128, "block_n": 128, "num_warps": 8, "num_stages": 2, "fp8_dot": "fp16"},
    "decode_fp8": {"block_n": 128, "num_warps": 4, "num_stages": 2, "fp8_dot": "fp16", "maxnreg": 128,
                   "write_one_split": 0},
    "decode_split_fp8": {"block_n": 64, "num_warps": 8, "num_stages": 2, "preload": 1},
    # one-split decode launches over an fp8 cache whose V is stored tokens-contiguous (FP8_V_KEYS_CONTIGUOUS): as
    # "decode_fp8", a kind of its own so that the cap can differ by V_KEYS_TILES (sm_90, Triton 3.6, qwen3-0.6b
    # heads at batch 256: way 1 uncapped 248 registers, no spill, capped at 128 it spills 504 bytes, the loop's last
    # partial tile being a second copy of its body; way 3, the default, capped at 128: 8 bytes of stack); its dot way
    # (fp8_dot) and whether it writes the step's keys itself (write_one_split) are decode_fp8's.
    # H200, nano-vllm workload over an fp8 cache (twenty-sixth session, one engine each, decode-step ms): usual
    # layout 4.7; tokens-contiguous way 1 uncapped 4.8, way 2 4.9, way 3 4.3, way 3 capped at 128 4.1 (the default).
    "decode_fp8_vkeys": {"block_n": 128, "num_warps": 4, "num_stages": 2, "maxnreg": 128},
    # split launches over such a cache (small batches): decode_split_fp8's shape, a kind of its own for switches.
    # H200, qwen3-0.6b batch 1, 2,048-token prompt (twenty-sixth session): 64 keys / 8 warps / preload 1,220.4
    # tok/s, without the preload 1,217.6, 4 warps 1,055.4, 128 keys / 4 warps 470.1 (the usual layout: 1,241.0).
    "decode_split_fp8_vkeys": {"block_n": 64, "num_warps": 8, "num_stages": 2, "preload": 1},
}
# The kind of a decode launch cut into key splits (small batches: latency-bound, module docstring), by its cache's kind.
_SPLIT_KINDS = {"decode": "decode_split", "decode_fp8": "decode_split_fp8", "decode_fp8_vkeys": "decode_split_fp8_vkeys"}
# The fp8 entries: `bench/kernel_paged_attention.py --decode-sweep` on an H200 (2026-11-23, qwen3-0.6b shapes, 16/8
# heads): decode's winner at batch 64/256 and ctx 512/2048 is the bf16 shape with "fp16" (0.84-0.93x the bf16
# cache's time; the old "q" way 1.15-1.19x); prefill's (4 x 1,024 and 1 x 1,024 over 4k) "fp16_vregs" then, "fp16"
# since: 121.4 / 132.6 us against 126.2 / 137.6 (2026-11-29, twentieth session's sweep) and 120.5 / 132.2 against
# 125.2 / 136.6 (twenty-third session's), the same values either way. Decode's register cap of 128 with two stages
# and the write kernel first at one split (twenty-fourth session, nano-vllm workload over an fp8 cache, one run):
# 24,585.9 output tok/s against 23,210.5 without the three (cap and stages alone 23,599.7); the bf16 cache's
# one-split launches lost 1.8% with the write kernel first (22,806.6 vs 23,225.4) and keep the write inside. The cap
# on split launches (small batches) cost qwen3-0.6b over an fp8 cache at batch 1 20% (936.1 vs 1,173.0 tok/s, a
# 2,048-token prompt): they take "decode_split_fp8", uncapped; its shape is the bf16 split launches' (64 keys, 8
# warps) with their preload (twenty-fifth session, qwen3-0.6b batch 1 over an fp8 cache, 2,048-token prompt, one
# engine each: 128 keys / 4 warps / no preload 1,177.8 tok/s, 64 / 8 1,192.5, 64 / 8 with preload 1,242.6).
# The 16-bit dots over an fp8 cache (16-bit q; fp32 q keeps fp32 dots): "q": tiles cast to q's dtype (bf16: two
# cvts per value, fp8 -> fp16 -> bf16); "fp16": q and p in fp16, tiles cast to fp16 (one cvt per pair of values);
# "fp16_vregs": as "fp16", the V tile converted in registers (`_dot_tile`'s IN_REGISTERS). The casts are exact for
# the cache's values; fp16 dots saturate q beyond +-65504 (p is in [0, 1]).
# "fp8" (FlashAttention-3's fp8 path; never a default yet): the dots in e4m3 with fp32 accumulation, no tile casts.
# q is quantized per score row ((query row, head) pair) as quant.py quantizes activations (scale = amax / 448,
# nearest-even e4m3, saturating) and that scale multiplies the scores; K and V tiles enter the dots as stored;
# p * 256 (p in [0, 1] after the running max is subtracted; a power of two, so exact) is cast to e4m3, 256 folded
# into v_scale. Precision: 3 mantissa bits, so q and p each carry a relative rounding error up to 2**-4 (p * 256 is
# normal for p >= 2**-14; below that an absolute error up to 2**-18); the softmax sum l takes the unrounded p.
# Needs sm_89+ on CUDA (refused below; the interpreter runs its e4m3 dots exactly); Triton's e4m3 dots reduce over
# 32 or more, so this way pads the head dim's tile to >= 32 and takes >= 32 keys per step. On sm_90 a 64-row (prefill)
# tile's dots go to wgmma, whose fp8 accumulation inside one tl.dot keeps ~14 mantissa bits (int8_linear.FP8_DOT
# says more): far below e4m3's own 2**-4. The V tile (keys along the dot's K, not contiguous) is what FA3 transposes
# in shared memory; Triton does its own relayout here: whether that pays is what the sweep times.
_FP8_DOT = {"q": 0, "fp16": 1, "fp16_vregs": 2, "fp8": 3}

# Decode-shaped launches write the step's keys in the attention kernel (True) or in `_write_kv_kernel` before it.
# H200, 2026-11-24 (bench/RESULTS.md twelfth session), batch-1 decode, processes alternated: qwen3-0.6b 1,248.3 /
# 1,247.3 tok/s in the kernel vs 1,239.1 / 1,240.2 separate, qwen2.5-7b 250.4 vs 249.7; alone, chained over 28
# layers, the two are within -1.1..+0.6 us a call either way by shape (bench/kernel_paged_attention.py
# --decode-write). MINI_INFER_DECODE_KV_WRITE=separate (read once, at import) for the separate write kernel.
DECODE_WRITE_IN_KERNEL = os.environ.get("MINI_INFER_DECODE_KV_WRITE", "fused") != "separate"
# Split decode launches (small batches) of kinds whose "preload" is 1 (both split kinds) load their first
# key tile's cached keys and values before the wait (module docstring, "Before the wait"); MINI_INFER_ATTN_PRELOAD=0
# loads them after it, as every other launch does. Read at launch.
ATTN_PRELOAD = os.environ.get("MINI_INFER_ATTN_PRELOAD", "1") != "0"
# Launches of one query row a tile (decode-shaped): T programs a kv head (and split), tile t being row t
# (`_split_k.find_tile_sequence`'s ROW_TILES), instead of T + S, of which a decode step's S are past their sequence's
# one row and exit at once (half the programs of a decode step). H200 (twenty-fourth session, bench/RESULTS.md):
# qwen3-0.6b batch 1 (split launches) 1,504.6 / 1,510.4 tok/s against 1,497.5 / 1,504.3 (128-token prompt), 1,292.8
# against 1,268.2 (2,048-token prompt); the nano-vllm workload (one-split launches) +1.0 / +1.7% over an fp8 cache but
# -1.4 / -1.6% over a bf16 one, so "decode" (16-bit caches) keeps T + S tiles at one split (_CONFIG's row_tiles).
# MINI_INFER_ATTN_ROW_TILES=0 (or `--switch paged_attention.ROW_TILES=0`): T + S tiles everywhere. Read at launch.
ROW_TILES = os.environ.get("MINI_INFER_ATTN_ROW_TILES", "1") != "0"
# Decode-shaped launches (one query row a tile) find a tile's sequence by first trying a decode step's owner (s = t
# with ROW_TILES, else t // 2: three loads at once) and searching only where that fails (`_split_k.find_tile_sequence`'s
# ROW_GUESS), instead of a binary search over the step's sequences in every program (ceil(log2 S / 4) * 4 dependent
# loads: 12 at batch 256, each program waiting on them before its first key tile). The same sequence either way.
# H200, nano-vllm workload on qwen3-0.6b, output tok/s with it against without, one engine each: bf16 cache 23,385.8 /
# 23,231.3 (thirty-third session), 23,551.0 / 23,449.0 and 23,427.2 / 23,233.5 (thirty-fourth); fp8 cache 27,950.5 /
# 27,450.3 (16-token blocks) and 30,385.6 / 29,897.7 (64); batch 1 1,521.3 / 1,524.7 against 1,479.9 / 1,527.8.
# `bench/gpu_check.py` passed with it. On by default (MINI_INFER_ATTN_ROW_GUESS=0, or `--switch
# paged_attention.ROW_GUESS=0`: the search alone). Read at launch.
ROW_GUESS = os.environ.get("MINI_INFER_ATTN_ROW_GUESS", "1") != "0"


def _env_choice(name: str, default: str, choices: tuple[int, ...]) -> int:
    """An integer switch read from the environment at import, refused (naming it) outside `choices`."""
    text = os.environ.get(name, default)
    if not text.strip().isdigit() or int(text) not in choices:
        raise ValueError(f"{name}={text!r}: expected one of {', '.join(map(str, choices))}")
    return int(text)


# fp8 KV caches with V stored tokens-contiguous ([blocks, Hkv, Dv, block_size] under the usual [blocks, block_size,
# Hkv, Dv] view: `FullAttentionSpec.v_keys_contiguous`, declared by the paged_attention pass when this is on at
# compile time). P @ V reduces over keys: with Dv contiguous the sm_90 build reads an fp8 V tile from shared memory
# a byte at a time (128 ld.shared.b8 a 128-key step), with the keys contiguous it takes ldmatrix as K does
# (bench/probe_fp8_decode.py's "vt" variant). Launches over such a cache load V without a per-key mask
# (V_KEYS_TILES). On by default: H200 (twenty-sixth session, bench/RESULTS.md), nano-vllm workload over an fp8 cache
# 27,735.5 output tok/s against 24,482.2 with the usual layout (decode steps 4.0 against 4.7 ms; the bf16 cache
# 23,493.3), greedy tokens of 256 sequences x 128 equal to the usual layout's; batch 1 (split launches) 1.7-2.4%
# slower (qwen3-0.6b, 2,048-token prompt: 1,220.4 against 1,241.0). Which layers' specs take it: 1 (the default)
# full-attention layers; 2 sliding-window layers too, slower: their sm_90 build (Triton 3.6, capped at 128, the
# rotary and the write in it) keeps 392-424 bytes of stack against the usual layout's 168-192, where a full layer's
# keeps 40 against 176 (tests/ops/compile_paged_attention_sm90.py), and on an H200 mistral-7b's nano-vllm workload
# ran 5,842.5 output tok/s with it against 9,830.8 (decode steps 18.6 vs 9.6 ms; twenty-seventh session); 0 none,
# V dims-contiguous as 16-bit caches store it. MINI_INFER_FP8_V_KEYS_CONTIGUOUS (or `--switch
# paged_attention.FP8_V_KEYS_CONTIGUOUS=N`), read by the paged_attention pass when it runs.
FP8_V_KEYS_CONTIGUOUS = _env_choice("MINI_INFER_FP8_V_KEYS_CONTIGUOUS", "1", (0, 1, 2))
# The block size such a cache is read fastest at, declared by the paged_attention pass on the specs of layers it stores
# so (`FullAttentionSpec.block_size_hint`: an engine not told a block size takes it). The V cache is [blocks, Hkv, Dv,
# block_size], so a key tile's V^T rows are runs of block_size contiguous bytes: 16 at vLLM's default block size,
# 64 here. H200 (thirty-fourth session, bench/RESULTS.md), nano-vllm workload on qwen3-0.6b over an fp8 cache:
# 30,714.4 output tok/s at 64-token blocks, 30,415.7 at 128, 27,819.6 at 16 (decode steps 3.6 against 4.1 ms); the
# bf16 cache (the usual layout) 23,391.1 / 23,437.7 / 23,466.8 at 16 / 64 / 128, and batch 1 the same at 16 and 64,
# so only these specs ask for it. MINI_INFER_FP8_V_KEYS_BLOCK_SIZE (or `--switch
# paged_attention.FP8_V_KEYS_BLOCK_SIZE=N`), read by the paged_attention pass when it runs.
FP8_V_KEYS_BLOCK_SIZE = _env_choice("MINI_INFER_FP8_V_KEYS_BLOCK_SIZE", "64", (16, 32, 64, 128, 256))
# KV caches stored heads-outer ([blocks, Hkv, block_size, D] under the usual view: `FullAttentionSpec.heads_outer`,
# declared by the paged_attention pass from this when it runs): a program's key tile (one KV head) then reads runs of
# block_size * D contiguous elements instead of block_size rows of D elements Hkv * D apart (an fp8 cache at 64-token
# blocks: 8 KB runs against 128-byte rows 1 KB apart). The kernels take the layout through the strides alone. H200,
# nano-vllm workload on qwen3-0.6b, one run (thirty-fifth session): fp8 cache 30,798.2 output tok/s with it against
# 30,498.3, bf16 cache 23,364.2 against 23,346.7, within the runs' spread; so 0: none; 1: fp8 caches; 2: every cache.
# MINI_INFER_KV_HEADS_OUTER (or `--switch paged_attention.KV_HEADS_OUTER=N`).
KV_HEADS_OUTER = _env_choice("MINI_INFER_KV_HEADS_OUTER", "0", (0, 1, 2))
# How launches over a tokens-contiguous V cache mask their V tiles (the kernel's V_TILES; read at launch; 3 by
# default, the fastest on an H200: _CONFIG's "decode_fp8_vkeys"). 1: whole key tiles with no per-key mask, the last
# partial tile after the loop as usual (a second copy of the loop's body: sm_90, Triton 3.6, nano-vllm's batch-256
# launch uncapped, 248 registers, 40,960 bytes of shared memory, two programs an SM). 2: every tile's V loaded by
# whole blocks and the keys past the range zeroed by a select (one body: 154 registers, but the select sends the
# converted tile through shared memory, 73,728 bytes; three programs an SM either way). 3: as 2 without the select
# (150 registers, 40,960 bytes; capped at 128, 8 bytes of stack and four programs an SM, as the usual layout's
# capped launch with its 104), which takes the layout's rule that its V cache never holds NaN: blocks start zeroed
# and its writes (the kernels' and the reference's) store NaN as 0, so the keys read past a sequence's last one hold
# finite values that p = 0 cancels. None reads V a byte at a time.
V_KEYS_TILES = _env_choice("MINI_INFER_V_KEYS_TILES", "3", (1, 2, 3))


# --------------------------------------------------------------------------------------------------
# reference (plain torch)
# --------------------------------------------------------------------------------------------------


FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def check_kv_scales(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale, v_scale) -> bool:
    """True for an FP8 cache pair (both float8_e4m3fn, with fp32 [1] scales); False for unscaled caches
    (no scales). Raises ValueError naming the argument on any other combination."""
    fp8 = (k_cache.dtype == FP8, v_cache.dtype == FP8)
    if not any(fp8):
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"paged_attention: k_scale/v_scale apply to float8_e4m3fn caches only, the caches "
                             f"are {k_cache.dtype}/{v_cache.dtype}")
        return False
    if not all(fp8):
        raise ValueError(f"paged_attention: an fp8 cache needs both caches float8_e4m3fn, got "
                         f"k_cache {k_cache.dtype}, v_cache {v_cache.dtype}")
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
        if t is None or t.dtype != torch.float32 or t.numel() != 1:
            got = "None" if t is None else f"{t.dtype} {tuple(t.shape)}"
            raise ValueError(f"paged_attention: float8_e4m3fn caches need {name} as an fp32 tensor of one "
                             f"element, got {got}")
    return True


def _to_cache(x: torch.Tensor, cache: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """x in the cache's dtype: for an fp8 cache x / scale, saturated to +-448, rounded to nearest-even."""
    if cache.dtype != FP8:
        return x.to(cache.dtype)
    return (x.to(torch.float32) / scale.reshape(())).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def _raw(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor as its bytes (uint8 view; CPU torch has no index_copy_/index_select for float8), any
    other tensor as itself: the reference moves cache rows through this view."""
    return t.view(torch.uint8) if t.dtype == FP8 else t


def _from_cache(x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Gathered cache rows (through `_raw`) as fp32, dequantized when the cache is fp8 (scale given)."""
    if scale is None:
        return x.to(torch.float32)
    return x.view(FP8).to(torch.float32) * scale.reshape(())


def write_kv_cache_reference(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """Write k[i], v[i] at flat slot slot_mapping[i] of the caches, skipping negative slots (fp8 caches:
    k / k_scale and v / v_scale, see the module docstring)."""
    check_kv_scales(k_cache, v_cache, k_scale, v_scale)
    slots = slot_mapping.to(torch.int64)
    valid = slots >= 0
    if not bool(valid.all()):
        slots, k, v = slots[valid], k[valid], v[valid]
    if slots.numel() == 0:
        return
    if k_cache.is_contiguous() and v_cache.is_contiguous():  # one row copy per token into the flat view
        _raw(k_cache).view(-1, *k_cache.shape[2:]).index_copy_(0, slots, _raw(_to_cache(k, k_cache, k_scale)))
        _raw(v_cache).view(-1, *v_cache.shape[2:]).index_copy_(0, slots, _raw(_to_cache(v, v_cache, v_scale)))
        return
    block_size = k_cache.shape[1]
    blk, off = slots // block_size, slots % block_size
    if v_keys_contiguous(v_cache):  # such a cache never holds NaN (FP8_V_KEYS_CONTIGUOUS): stored as 0
        v = torch.where(v.isnan(), torch.zeros_like(v), v)
    _raw(k_cache).index_put_((blk, off), _raw(_to_cache(k, k_cache, k_scale)))
    _raw(v_cache).index_put_((blk, off), _raw(_to_cache(v, v_cache, v_scale)))


def _gather_blocks(cache: torch.Tensor, blk: torch.Tensor) -> torch.Tensor:
    """cache[blk] for a [num_blocks, block_size, H, D] cache, as a copy."""
    b, bs, h, d = cache.shape
    if cache.stride()[1:] == (h * d, d, 1):  # blocks are contiguous: row gather on a 2-D view, ~4x faster
        return cache.view(b, bs * h * d).index_select(0, blk)
    return cache.index_select(0, blk)


def _attend_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    bt_rows: torch.Tensor,  # [n, max_blocks] block-table rows of the n (virtual) sequences
    q_start: torch.Tensor,  # [n] first q row of each
    q_count: torch.Tensor,  # [n] number of q rows of each (>= 1)
    ctx: torch.Tensor,  # [n] context length seen by the LAST of its rows (position + 1)
    max_q: int,
    scale: float,
    sliding_window: int,
    softcap: float,
    out: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,  # [Hq] fp32, or None
) -> None:
    """Attention for n sequences padded to max_q query rows and a common key length, written into out."""
    n = bt_rows.shape[0]
    dev = q.device
    _, hq, d = q.shape
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    dv = v_cache.shape[3]
    g = hq // hkv

    first_pos = ctx - q_count  # position of each sequence's first query row
    if sliding_window > 0:  # blocks wholly left of every row's window are skipped
        first_blk = (first_pos - sliding_window + 1).clamp_min(0) // block_size
    else:
        first_blk = torch.zeros_like(ctx)
    last_blk = (ctx - 1) // block_size  # last block-table column in use
    n_blk = int((last_blk - first_blk).max()) + 1

    # keys: whole blocks first_blk .. last_blk of each sequence (padded to n_blk by repeating the last
    # one, so no unused block-table entry is read), copied block by block
    cols = torch.minimum(first_blk[:, None] + torch.arange(n_blk, device=dev), last_blk[:, None])
    blk = bt_rows.gather(1, cols).to(torch.int64).flatten()  # [n * n_blk]
    n_keys = n_blk * block_size
    kk = _from_cache(_gather_blocks(_raw(k_cache), blk).view(n, n_keys, hkv, d), k_scale)  # [n, L, Hkv, D] fp32
    vv = _from_cache(_gather_blocks(_raw(v_cache), blk).view(n, n_keys, hkv, dv), v_scale)
    kpos = first_blk[:, None] * block_size + torch.arange(n_keys, device=dev)  # [n, L]
    kvalid = kpos < ctx[:, None]  # also false on the repeated padding blocks (they sit past ctx)
    # padding positions may hold anything (uninitialized cache memory, even NaN): zero V there, since
    # probability 0 * NaN would still poison the output. K padding is removed by the score mask below.
    vv[~kvalid] = 0.0  # a scatter over the (few) padding positions, not a pass over all of V

    # queries: rows q_start .. q_start+q_count-1, padded to max_q
    j = torch.arange(max_q, device=dev)
    qvalid = j[None, :] < q_count[:, None]  # [n, M]
    rows = torch.where(qvalid, q_start[:, None] + j[None, :], 0)
    qq = q[rows].to(torch.float32)  # [n, M, Hq, D]
    qpos = first_pos[:, None] + j[None, :]  # [n, M]

    mask = (kpos[:, None, :] <= qpos[:, :, None]) & kvalid[:, None, :]  # [n, M, L]
    if sliding_window > 0:
        mask &= (qpos[:, :, None] - kpos[:, None, :]) < sliding_window
    # GQA: score rows are (query row, head-in-group) pairs of one kv head
    hidden = ~mask[:, :, None, :].expand(n, max_q, g, n_keys).reshape(n, max_q * g, n_keys)
    qq = qq.view(n, max_q, hkv, g, d)
    o = torch.empty((n, max_q, hkv, g, dv), dtype=torch.float32, device=dev)
    # one kv head at a time: kk[:, :, h] is a strided [n, L, D] batch that bmm reads in place (a
    # single batched matmul over (n, Hkv) would first copy K and V into a head-major layout)
    for h in range(hkv):
        qh = qq[:, :, h].reshape(n, max_q * g, d)
        scores = torch.bmm(qh, kk[:, :, h].transpose(1, 2))  # [n, M*G, L]
        if softcap > 0:
            scores = torch.tanh(scores * (scale / softcap)) * softcap
        else:
            scores *= scale
        scores.masked_fill_(hidden, float("-inf"))
        if sinks is None:
            probs = torch.softmax(scores, dim=-1)  # padded query rows are all -inf -> NaN, never written out
        else:  # each row's head's sink as one more logit (GPT-OSS's eager code), its probability dropped
            sink = sinks[h * g : (h + 1) * g].repeat(max_q).view(1, max_q * g, 1).expand(n, -1, 1)
            combined = torch.cat([scores, sink], dim=-1)
            combined = combined - combined.max(dim=-1, keepdim=True).values
            probs = torch.softmax(combined, dim=-1)[..., :-1]
        o[:, :, h] = torch.bmm(probs, vv[:, :, h]).view(n, max_q, g, dv)
    o = o.view(n, max_q, hq, dv)
    out[rows[qvalid]] = o[qvalid].to(out.dtype)


_PLAN_CACHE: list = []  # one entry, see _per_step
_HOST_LENGTHS: list = []  # likewise


def _per_step(slot: list, tensors: tuple, args: tuple, compute):
    """compute(), cached in `slot` (one entry) on the identity and version of `tensors` and on `args`.

    The same metadata tensors reach every layer of a step, so whatever is derived from them alone is computed
    once per step (weak references: a freed tensor never matches). Tensors made under inference_mode (e.g. a
    sub-batch's metadata) have no version counter: not cached."""
    import weakref

    cacheable = not any(t.is_inference() for t in tensors)
    if cacheable and slot:
        refs, versions, c_args, value = slot[0]
        if (c_args == args and all(r() is t for r, t in zip(refs, tensors))
                and versions == tuple(t._version for t in tensors)):
            return value
    value = compute()
    if cacheable:
        slot[:] = [(tuple(weakref.ref(t) for t in tensors), tuple(t._version for t in tensors), args, value)]
    return value


def _decode_gather_plan(block_tables, lens, block_size: int, sliding_window: int, dtype):
    """Flat cache slots to gather [S * L] and the additive key mask [S, 1, 1, L] of a decode step (once per
    step, see _per_step)."""

    def plan():
        seq_lens = lens.to(torch.int64)
        length = -(-int(seq_lens.max()) // block_size) * block_size
        pos = torch.arange(length, device=lens.device)
        valid = pos[None, :] < seq_lens[:, None]  # [S, L]
        safe = torch.where(valid, pos[None, :], 0)
        blk = block_tables.to(torch.int64).gather(1, safe // block_size)
        slots = (blk * block_size + safe % block_size).flatten()
        if sliding_window > 0:
            valid &= (seq_lens[:, None] - 1 - pos[None, :]) < sliding_window
        mask = torch.zeros(valid.shape, dtype=dtype, device=lens.device).masked_fill_(~valid, float("-inf"))
        return slots, mask[:, None, None, :], length

    return _per_step(_PLAN_CACHE, (block_tables, lens), (block_size, sliding_window, dtype), plan)


def _decode_sdpa_reference(q, k_cache, v_cache, block_tables, seq_lens, scale: float, sliding_window: int,
                           k_scale=None, v_scale=None):
    """Every sequence has one query row: gather each one's keys into a padded [S, L] batch and run one
    SDPA with GQA and an additive key mask. The gather is per token: positions past a sequence's length
    read its position 0 instead (always written by the sequence itself), so whatever the cache holds there,
    even NaN, is never read; the mask then hides them. An fp8 cache is dequantized to fp32 after the gather."""
    n, hq, d = q.shape
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    dtype = torch.float32 if k_scale is not None else k_cache.dtype
    slots, mask, length = _decode_gather_plan(block_tables, seq_lens, block_size, sliding_window, dtype)
    keys = _raw(k_cache).view(-1, hkv, d).index_select(0, slots).view(n, length, hkv, d)
    vals = _raw(v_cache).view(-1, hkv, v_cache.shape[3]).index_select(0, slots).view(n, length, hkv, -1)
    if k_scale is not None:
        keys, vals = _from_cache(keys, k_scale), _from_cache(vals, v_scale)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.view(n, hq, 1, d).to(keys.dtype), keys.transpose(1, 2), vals.transpose(1, 2),
        attn_mask=mask, scale=scale, enable_gqa=hq != hkv)
    return out.view(n, hq, -1).to(q.dtype)


def paged_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    softcap: float = 0.0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain torch paged attention (writes k/v into the caches first). See the module docstring."""
    write_kv_cache_reference(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return _reference_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window,
                                softcap, k_scale, v_scale, sinks)


def check_sinks(sinks: torch.Tensor | None, hq: int) -> None:
    """Raise unless `sinks` is None or a floating-point tensor of shape [hq] (one logit a query head)."""
    if sinks is not None and (sinks.shape != (hq,) or not sinks.dtype.is_floating_point):
        raise ValueError(f"paged_attention: sinks must be a float tensor of shape ({hq},) (one a query head), got "
                         f"{sinks.dtype} {tuple(sinks.shape)}")


def _reference_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale: float,
                         sliding_window: int, softcap: float, k_scale, v_scale, sinks=None) -> torch.Tensor:
    """`paged_attention_reference` after its cache write: attention over what the caches hold."""
    t, hq, _ = q.shape
    check_sinks(sinks, hq)
    out = q.new_zeros((t, hq, v_cache.shape[3]))
    n_seqs = seq_lens.shape[0]
    if n_seqs == 0 or t == 0:
        return out
    qsl = query_start_loc.to(torch.int64)
    lens = seq_lens.to(torch.int64)
    qlens = qsl[1:] - qsl[:-1]
    common = (k_cache, v_cache)
    opts = (scale, int(sliding_window), float(softcap), out)
    scales = (k_scale, v_scale, None if sinks is None else sinks.to(device=q.device, dtype=torch.float32))

    # a pure decode step without softcap or sinks (the common case): one gather and one SDPA for all sequences
    if softcap <= 0 and sinks is None and t == n_seqs and k_cache.is_contiguous() and v_cache.is_contiguous() \
            and bool((qlens == 1).all()):
        out[:] = _decode_sdpa_reference(q, k_cache, v_cache, block_tables, seq_lens, scale, int(sliding_window),
                                        k_scale, v_scale)
        return out

    # decode rows of every sequence: one batched gather + matmul
    dec = torch.nonzero(qlens == 1).flatten()
    if dec.numel():
        ones = torch.ones_like(dec)
        _attend_reference(q, *common, block_tables[dec], qsl[:-1][dec], ones, lens[dec], 1, *opts, *scales)

    # longer query runs: per sequence, in chunks of at most _REF_QUERY_CHUNK rows
    multi = torch.nonzero(qlens > 1).flatten()
    if multi.numel():
        for s, q0, ql, ln in zip(
            multi.tolist(), qsl[:-1][multi].tolist(), qlens[multi].tolist(), lens[multi].tolist()
        ):
            bt = block_tables[s : s + 1]
            for c0 in range(0, ql, _REF_QUERY_CHUNK):
                cn = min(_REF_QUERY_CHUNK, ql - c0)
                ctx_c = ln - ql + c0 + cn
                meta = torch.tensor([[q0 + c0, cn, ctx_c]], dtype=torch.int64, device=q.device)
                _attend_reference(q, *common, bt, meta[:, 0], meta[:, 1], meta[:, 2], cn, *opts, *scales)
    return out


# --------------------------------------------------------------------------------------------------
# Triton
# --------------------------------------------------------------------------------------------------

if HAS_TRITON:
    # the fp8 rounding and the per-row scale of the activation quantization (the KV write; q of the "fp8" dots)
    from mini_infer.ops._rotary import rotated_pairs
    from mini_infer.ops.quant import _quantize_values, _scale_and_inverse, round_to_fp8_e4m3


    @triton.jit
    def _to_cache_values(x, scale_ptr, KV_FP8: tl.constexpr):
        """Values to store in the cache: for an fp8 cache x / scale, saturated and rounded as the reference."""
        if KV_FP8:
            x = round_to_fp8_e4m3(tl.math.div_rn(x.to(tl.float32), tl.load(scale_ptr)))
        return x

    @triton.jit
    def _store_cache_rows(
        c_ptr, scale_ptr, x, slot, h, cols, m, block_size, s_cb, s_co, s_ch, s_cd, KV_FP8: tl.constexpr,
    ):  # fmt: skip
        """x (rows of kv heads h, a vector, at columns `cols` [1, C]; only where m) into flat slot `slot` (int64, one
        for all rows or a column [R, 1] of one a row, as qk_rotary_kv_write's rows have; any value where not m) of a
        cache whose columns are s_cd apart (1 but for a tokens-contiguous V cache), as `_to_cache_values` converts
        it."""
        slot = tl.maximum(slot, 0)
        dst = c_ptr + (slot // block_size) * s_cb + (slot % block_size) * s_co + h[:, None] * s_ch + cols * s_cd
        tl.store(dst, _to_cache_values(x, scale_ptr, KV_FP8).to(c_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _nan_free_v(x, s_vcd):
        """V values about to be stored in a cache whose columns are s_vcd apart: for a tokens-contiguous V cache
        (s_vcd != 1), NaN as 0, since such a cache never holds NaN (V_KEYS_TILES 3 reads past the keys); else x. The
        compare is in fp32: the interpreter's bf16 == sees no NaN."""
        if s_vcd != 1:
            x = tl.where(x.to(tl.float32) == x.to(tl.float32), x, tl.zeros_like(x))
        return x

    @triton.jit
    def _store_v_rows(
        v_ptr, vc_ptr, vs_ptr, tok, slot, h, ok, block_size, head_dv, s_vt, s_vh, s_vcb, s_vco, s_vch, s_vcd,
        KV_FP8: tl.constexpr, BLOCK_DV: tl.constexpr,
    ):  # fmt: skip
        """Packed token tok's v rows of kv heads h (a vector; only where ok) into flat cache slot `slot`; a
        tokens-contiguous V cache (s_vcd != 1) gets NaN stored as 0 (it never holds NaN: FP8_V_KEYS_CONTIGUOUS)."""
        dv = tl.arange(0, BLOCK_DV)[None, :]
        m = ok[:, None] & (dv < head_dv)
        x = _nan_free_v(tl.load(v_ptr + tok * s_vt + h[:, None] * s_vh + dv, mask=m, other=0.0), s_vcd)
        _store_cache_rows(vc_ptr, vs_ptr, x, slot, h, dv, m, block_size, s_vcb, s_vco, s_vch, s_vcd, KV_FP8)

    @triton.jit
    def _store_kv_rows(
        k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, tok, slot, h, ok, block_size, head_d, head_dv,
        s_kt, s_kh, s_vt, s_vh, s_kcb, s_kco, s_kch, s_vcb, s_vco, s_vch, s_vcd,
        KV_FP8: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    ):  # fmt: skip
        """Packed token tok's k and v rows of kv heads h (a vector; only where ok) into flat cache slot `slot`
        (int64; any value where not ok), as `_to_cache_values` converts them: the KV write of both kernels."""
        d = tl.arange(0, BLOCK_D)[None, :]
        m = ok[:, None] & (d < head_d)
        x = tl.load(k_ptr + tok * s_kt + h[:, None] * s_kh + d, mask=m, other=0.0)
        _store_cache_rows(kc_ptr, ks_ptr, x, slot, h, d, m, block_size, s_kcb, s_kco, s_kch, 1, KV_FP8)
        _store_v_rows(v_ptr, vc_ptr, vs_ptr, tok, slot, h, ok, block_size, head_dv, s_vt, s_vh, s_vcb, s_vco, s_vch,
                      s_vcd, KV_FP8, BLOCK_DV)

    @triton.jit
    def _store_new_kv_rows(
        k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, cos_ptr, sin_ptr, kw_ptr, tok, slot, h, ok, block_size, head_d,
        head_dv, eps, s_kt, s_kh, s_vt, s_vh, s_ct, s_cd, s_st, s_sd, s_kcb, s_kco, s_kch, s_vcb, s_vco, s_vch,
        s_vcd, ROTARY: tl.constexpr, KV_FP8: tl.constexpr, HAS_K_NORM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_DV: tl.constexpr,
    ):  # fmt: skip
        """The attention kernel's write of a new token: `_store_kv_rows`, with ROTARY the k rows first put through
        qk_rotary's math (`_rotary.rotated_pairs`: k's RMSNorm when HAS_K_NORM, then the rotary by cos / sin row tok)
        and rounded to k's dtype, as qk_rotary's output is."""
        if ROTARY:
            zero = h * 0
            first, second, mask, o1, o2 = rotated_pairs(
                k_ptr, (tok * s_kt + h * s_kh)[:, None], 1, cos_ptr, (tok * s_ct + zero)[:, None], s_cd, sin_ptr,
                (tok * s_st + zero)[:, None], s_sd, kw_ptr, ok, head_d // 2, eps, BLOCK_D // 2, False, HAS_K_NORM)
            k_dtype = k_ptr.dtype.element_ty
            _store_cache_rows(kc_ptr, ks_ptr, o1.to(k_dtype), slot, h, first, mask, block_size, s_kcb, s_kco, s_kch,
                              1, KV_FP8)
            _store_cache_rows(kc_ptr, ks_ptr, o2.to(k_dtype), slot, h, second, mask, block_size, s_kcb, s_kco, s_kch,
                              1, KV_FP8)
            _store_v_rows(v_ptr, vc_ptr, vs_ptr, tok, slot, h, ok, block_size, head_dv, s_vt, s_vh, s_vcb, s_vco,
                          s_vch, s_vcd, KV_FP8, BLOCK_DV)
        else:
            _store_kv_rows(k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, tok, slot, h, ok, block_size, head_d, head_dv,
                           s_kt, s_kh, s_vt, s_vh, s_kcb, s_kco, s_kch, s_vcb, s_vco, s_vch, s_vcd, KV_FP8, BLOCK_D,
                           BLOCK_DV)

    @triton.jit
    def _write_kv_kernel(
        k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr, block_size, n_heads, head_d, head_dv,
        s_kt, s_kh, s_vt, s_vh, s_kcb, s_kco, s_kch, s_vcb, s_vco, s_vch, s_vcd,
        KV_FP8: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
        USE_GDC: tl.constexpr,
    ):  # fmt: skip
        await_producers(USE_GDC)
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        h = tl.arange(0, BLOCK_H)
        # negative slot: padding token, write nothing. (The comparison is made on a tensor rather than
        # the scalar because the interpreter mis-types `scalar_bool & tensor_bool`.)
        ok = ((slot + h * 0) >= 0) & (h < n_heads)
        _store_kv_rows(k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, t, slot, h, ok, block_size, head_d, head_dv,
                       s_kt, s_kh, s_vt, s_vh, s_kcb, s_kco, s_kch, s_vcb, s_vco, s_vch, s_vcd, KV_FP8, BLOCK_D,
                       BLOCK_DV)

    @triton.jit
    def _dot_tile(x, dtype, IN_REGISTERS: tl.constexpr):
        """A loaded cache tile x [keys, dims] as `dtype` for tl.dot: a cast (fp8 -> fp16 is one cvt per pair of
        values on sm_89+, fp8 -> bf16 two per value, through fp16). IN_REGISTERS: cast as the two halves of a split of
        its last dim, joined again: the same values, but the compiler then converts the tile in registers and hands
        it to the dot as 16-bit values (shared memory and ldmatrix, as a 16-bit cache) instead of reading the fp8
        bytes one at a time from shared memory in the dot's layout (what a V tile, keys along the dot's K, takes)."""
        if IN_REGISTERS:
            a, b = tl.split(tl.reshape(x, [x.shape[0], x.shape[1] // 2, 2]))
            x = tl.reshape(tl.join(a.to(dtype), b.to(dtype)), [x.shape[0], x.shape[1]])
        return x.to(dtype)

    @triton.jit
    def _tanh(x):
        # tanh without libdevice (also runs under the interpreter); saturates cleanly at +-1
        return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)

    @triton.jit
    def _cache_tile(c_ptr, pblk, koff, h, cols, mask, s_cb, s_co, s_ch, s_cd):
        """Rows (cache block pblk, offset koff) of kv head h of a cache, at columns `cols` (s_cd apart: 1 but for a
        tokens-contiguous V cache), as stored: a key or value tile [BLOCK_N, C], zero where not `mask`."""
        return tl.load(c_ptr + pblk[:, None] * s_cb + koff[:, None] * s_co + h * s_ch + cols[None, :] * s_cd,
                       mask=mask, other=0.0)

    @triton.jit
    def _tile_scores(
        qv, kt, m_i, l_i, start, kpos, k_ok, q_pos, first_q_pos, qk_scale, softcap, sliding_window,
        BLOCK_N: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, DOT_FP32: tl.constexpr,
        FP8_DOT: tl.constexpr,
    ):  # fmt: skip
        """One key tile kt [BLOCK_N, D] (as stored) against the score rows qv: the tile's scores in log2 units,
        hidden where invisible, folded into the running softmax: (p, alpha, m_i, l_i) of `online_softmax_step`."""
        if DOT_FP32:
            sc = tl.dot(qv, tl.trans(_dot_tile(kt, tl.float32, False)), input_precision="ieee")
        elif FP8_DOT == 3:  # e4m3 x e4m3, fp32 accumulation (the products are exact)
            sc = tl.dot(qv, tl.trans(kt))
        else:
            sc = tl.dot(qv, tl.trans(_dot_tile(kt, qv.dtype, False)))
        # scores in log2 units (softmax with exp2)
        if USE_SOFTCAP:
            sc = (softcap * _split_k.LOG2E) * _tanh(sc * (qk_scale / softcap))
        else:
            sc = sc * (qk_scale * _split_k.LOG2E)
        sc = _split_k.hide_invisible(sc, start, kpos, k_ok, q_pos, first_q_pos, sliding_window, BLOCK_N, USE_WINDOW)
        return _split_k.online_softmax_step(sc, m_i, l_i)

    @triton.jit
    def _tile_values(p, vt, qv, vc_ptr, DOT_FP32: tl.constexpr, KV_FP8: tl.constexpr, FP8_DOT: tl.constexpr,
                     ROUND_P_EXACTLY: tl.constexpr):
        """p @ vt for one tile: the probabilities p [rows, BLOCK_N] times the value tile vt [BLOCK_N, Dv] (as
        stored), in the dtype each way of dots takes."""
        if DOT_FP32:
            pv = tl.dot(p, _dot_tile(vt, tl.float32, False), input_precision="ieee")
        elif FP8_DOT == 3:  # p * 256 (exact, <= 256 < 448) in e4m3: 3 mantissa bits, normal down to p = 2**-14
            p8 = p * 256.0
            if ROUND_P_EXACTLY:  # the interpreter's own fp32 -> fp8 cast is wrong (quant.py)
                p8 = round_to_fp8_e4m3(p8)
            pv = tl.dot(p8.to(vt.dtype), vt)
        elif KV_FP8:  # fp8 -> the dots' 16-bit dtype is exact; p in fp8 would lose too much
            pv = tl.dot(p.to(qv.dtype), _dot_tile(vt, qv.dtype, FP8_DOT == 2))
        else:
            pv = tl.dot(p.to(vc_ptr.dtype.element_ty), vt)
        return pv

    @triton.jit
    def _attend_key_tile(
        qv, m_i, l_i, acc, bt_row, start, k_hi, kc_ptr, vc_ptr, kvh, d, d_ok, dv, dv_ok, q_pos, first_q_pos, qk_scale,
        softcap, sliding_window, s_kcb, s_kco, s_kch, s_vcb, s_vco, s_vch, s_vcd, BLOCK_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr, USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, DOT_FP32: tl.constexpr,
        KV_FP8: tl.constexpr, FP8_DOT: tl.constexpr, ROUND_P_EXACTLY: tl.constexpr, WHOLE: tl.constexpr,
    ):  # fmt: skip
        """The keys start .. start + BLOCK_N - 1 below k_hi folded into the running softmax (m_i, l_i) and the
        output rows acc: the key tile's scores, then its value tile times p. WHOLE (the V_TILES of the launch) says
        how the V rows are masked, so that a tokens-contiguous V cache (FP8_V_KEYS_CONTIGUOUS) is read in 16-byte
        runs of a block's keys: 1, every key of the tile is below k_hi (block-table entries, K and V loaded with no
        per-key mask); 2, V (and the block-table entries) loaded by whole blocks, the keys at or past k_hi then set
        to zero in the tile (p = 0 does not cancel a NaN); 3, as 2 without the zeroing: a block's unused slots hold
        zeros (allocation) or an earlier owner's values, never NaN (the layout's writes store NaN as 0); 0,
        everything masked per key, as zeros."""
        if WHOLE == 1:
            kpos = start + tl.arange(0, BLOCK_N)
            k_ok = kpos < k_hi
            pblk = tl.load(bt_row + kpos // BLOCK_SIZE).to(tl.int64)
            koff = (kpos % BLOCK_SIZE).to(tl.int64)
            k_mask = d_ok[None, :]
            v_mask = dv_ok[None, :]
        elif WHOLE >= 2:  # the tile over the blocks holding keys below k_hi, whole
            kpos, blk_ok, pblk, koff = _split_k.key_tile(bt_row, start, tl.cdiv(k_hi, BLOCK_SIZE) * BLOCK_SIZE,
                                                         BLOCK_SIZE, BLOCK_N)
            k_ok = kpos < k_hi
            k_mask = k_ok[:, None] & d_ok[None, :]
            v_mask = blk_ok[:, None] & dv_ok[None, :]
        else:
            kpos, k_ok, pblk, koff = _split_k.key_tile(bt_row, start, k_hi, BLOCK_SIZE, BLOCK_N)
            k_mask = k_ok[:, None] & d_ok[None, :]
            v_mask = k_ok[:, None] & dv_ok[None, :]
        kt = _cache_tile(kc_ptr, pblk, koff, kvh, d, k_mask, s_kcb, s_kco, s_kch, 1)
        p, alpha, m_i, l_i = _tile_scores(qv, kt, m_i, l_i, start, kpos, k_ok, q_pos, first_q_pos, qk_scale, softcap,
                                          sliding_window, BLOCK_N, USE_WINDOW, USE_SOFTCAP, DOT_FP32, FP8_DOT)
        vt = _cache_tile(vc_ptr, pblk, koff, kvh, dv, v_mask, s_vcb, s_vco, s_vch, s_vcd)
        if WHOLE == 2:
            vt = tl.where(k_ok[:, None], vt, tl.zeros_like(vt))
        acc = acc * alpha[:, None] + _tile_values(p, vt, qv, vc_ptr, DOT_FP32, KV_FP8, FP8_DOT, ROUND_P_EXACTLY)
        return m_i, l_i, acc

    @triton.jit
    def _paged_attn_kernel(
        q_ptr, kc_ptr, vc_ptr, out_ptr, ws_m_ptr, ws_l_ptr, ws_acc_ptr, cnt_ptr,
        bt_ptr, seq_lens_ptr, qsl_ptr, ks_ptr, vs_ptr, k_ptr, v_ptr, slot_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr,
        sinks_ptr, n_tokens, n_seqs, scale, softcap, sliding_window, eps, BLOCK_SIZE: tl.constexpr, head_d, head_dv,
        s_qt, s_qh, s_kcb, s_kco, s_kch, s_vcb, s_vco, s_vch, s_vcd, s_ot, s_oh, s_bt,
        s_wms, s_wmt, s_was, s_wat, s_wah, s_kt, s_kh, s_vt, s_vh, s_ct, s_cd, s_st, s_sd,
        WRITE_KV: tl.constexpr, ROTARY: tl.constexpr, HAS_Q_NORM: tl.constexpr, HAS_K_NORM: tl.constexpr, G: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_R: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
        NUM_SPLITS: tl.constexpr, FUSED_MERGE: tl.constexpr, SEARCH_STEPS: tl.constexpr,
        USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, DOT_FP32: tl.constexpr, KV_FP8: tl.constexpr,
        FP8_DOT: tl.constexpr, ROUND_P_EXACTLY: tl.constexpr, PRELOAD: tl.constexpr, USE_GDC: tl.constexpr,
        ROW_TILES: tl.constexpr = False, V_TILES: tl.constexpr = 0, ROW_GUESS: tl.constexpr = False,
        USE_SINKS: tl.constexpr = False,
    ):  # fmt: skip
        tile = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        # Before the wait (module docstring, "Before the wait"): the step's lengths and block table are inputs no
        # kernel of the step writes, and with PRELOAD the first key tile's cached positions (older than the step's
        # keys) are loaded too; nothing is stored before the wait.
        s, q_beg, qlen, ctx, q_off = _split_k.find_tile_sequence(
            tile, qsl_ptr, seq_lens_ptr, n_seqs, BLOCK_Q, SEARCH_STEPS, ROW_TILES, ROW_GUESS
        )
        n_owned = tl.load(qsl_ptr + n_seqs)  # rows from here on belong to no sequence
        # score rows: (query row i, head-in-group g) pairs sharing kv head kvh
        r = tl.arange(0, BLOCK_R)
        qi = r // BLOCK_G
        g = r % BLOCK_G
        head = kvh * G + g
        dv = tl.arange(0, BLOCK_DV)
        dv_ok = dv < head_dv
        d = tl.arange(0, BLOCK_D)
        d_ok = d < head_d
        # key range of the tile: [k_lo, k_hi), then this program's split of it; with the fused merge only the
        # non-empty splits work (the others exit below), else every split writes its partials for the reduce
        k_hi = ctx - qlen + tl.minimum(q_off + BLOCK_Q, qlen)
        k_lo = k_hi * 0
        if USE_WINDOW:
            k_lo = tl.maximum(ctx - qlen + q_off - sliding_window + 1, 0)
        n_used = _split_k.used_splits(k_lo, k_hi, NUM_SPLITS, BLOCK_N) if FUSED_MERGE else NUM_SPLITS
        works = (q_off < qlen) & (split < n_used)
        k_lo, k_hi = _split_k.split_key_range(k_lo, k_hi, split, NUM_SPLITS, BLOCK_N)
        new0 = ctx - qlen  # the step's keys of s sit at positions new0 .. ctx - 1
        bt_row = bt_ptr + s.to(tl.int64) * s_bt
        if PRELOAD:  # the first tile's keys older than the step's: in the cache since an earlier step
            kpos0, k_ok0, pblk0, koff0 = _split_k.key_tile(bt_row, k_lo, tl.where(works, k_hi, k_lo), BLOCK_SIZE,
                                                           BLOCK_N)
            old0 = k_ok0 & (kpos0 < new0)
            kt0 = _cache_tile(kc_ptr, pblk0, koff0, kvh, d, old0[:, None] & d_ok[None, :], s_kcb, s_kco, s_kch, 1)
            vt0 = _cache_tile(vc_ptr, pblk0, koff0, kvh, dv, old0[:, None] & dv_ok[None, :], s_vcb, s_vco, s_vch,
                              s_vcd)
        await_producers(USE_GDC)
        if split == 0:  # rows of q owned by no sequence get zeros: tile j's programs zero rows j * BLOCK_Q + qi
            zrow = (tile * BLOCK_Q + qi).to(tl.int64)  # (T // BLOCK_Q + S, or T: ROW_TILES) tiles cover all T rows
            unowned = (qi < BLOCK_Q) & (g < G) & (zrow >= n_owned) & (zrow < n_tokens)
            tl.store(out_ptr + zrow[:, None] * s_ot + head[:, None] * s_oh + dv[None, :],
                     tl.zeros([BLOCK_R, BLOCK_DV], out_ptr.dtype.element_ty), mask=unowned[:, None] & dv_ok[None, :])
            if WRITE_KV:  # (BLOCK_Q == 1) token `tile`, if no sequence owns it, is written as _write_kv_kernel would
                wh = kvh + tl.arange(0, 1)  # this program's kv head, as a vector
                ztok = tile.to(tl.int64) + wh * 0
                zown = (ztok >= n_owned) & (ztok < n_tokens)
                zslot = tl.load(slot_ptr + ztok, mask=zown, other=-1).to(tl.int64)
                _store_new_kv_rows(k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, cos_ptr, sin_ptr, kw_ptr, ztok, zslot,
                                   wh, zslot >= 0, BLOCK_SIZE, head_d, head_dv, eps, s_kt, s_kh, s_vt, s_vh, s_ct, s_cd,
                                   s_st, s_sd, s_kcb, s_kco, s_kch, s_vcb, s_vco, s_vch, s_vcd, ROTARY, KV_FP8,
                                   HAS_K_NORM, BLOCK_D, BLOCK_DV)
        if works:
            q_idx = q_off + qi
            row_ok = (qi < BLOCK_Q) & (q_idx < qlen) & (g < G)
            tok0 = (q_beg + q_off).to(tl.int64)  # the tile's first query row
            tok = tok0 + qi
            q_pos = ctx - qlen + q_idx
            if ROTARY:  # (BLOCK_D == head_d) qk_rotary's math on the q rows, rounded to q's dtype as its output is
                _, _, _, o1, o2 = rotated_pairs(
                    q_ptr, (tok * s_qt + head * s_qh)[:, None], 1, cos_ptr, (tok * s_ct)[:, None], s_cd, sin_ptr,
                    (tok * s_st)[:, None], s_sd, qw_ptr, row_ok, head_d // 2, eps, BLOCK_D // 2, False, HAS_Q_NORM)
                # the halves side by side: [BLOCK_R, 2, D/2] -> [BLOCK_R, D], column c of o2 at D/2 + c
                qv = tl.reshape(tl.permute(tl.join(o1, o2), (0, 2, 1)), (BLOCK_R, BLOCK_D)).to(q_ptr.dtype.element_ty)
            else:
                qv = tl.load(
                    q_ptr + tok[:, None] * s_qt + head[:, None] * s_qh + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0,
                )  # fmt: skip
            if WRITE_KV:  # (decode-shaped launch) the step's new tokens of s that this program reads: write, then read
                # s's new tokens sit at positions ctx - qlen .. ctx - 1, packed rows q_beg .. q_beg + qlen - 1. Row
                # q_off's key range holds its own position, so each new token is written by at least its own row's
                # program; several programs may write one token (its later rows, the other query heads' programs
                # under GQA: same bytes, same addresses), and each reads only what it wrote or what was cached
                # before the launch. bar.sync then makes every thread's stores visible to the CTA's key loads.
                wh = kvh + tl.arange(0, 1)
                for wpos in range(tl.maximum(k_lo, new0), k_hi):
                    wtok = (q_beg + wpos - new0).to(tl.int64)
                    wslot = tl.load(slot_ptr + wtok).to(tl.int64) + wh * 0
                    _store_new_kv_rows(k_ptr, v_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, cos_ptr, sin_ptr, kw_ptr, wtok,
                                       wslot, wh, wslot >= 0, BLOCK_SIZE, head_d, head_dv, eps, s_kt, s_kh, s_vt, s_vh,
                                       s_ct, s_cd, s_st, s_sd, s_kcb, s_kco, s_kch, s_vcb, s_vco, s_vch, s_vcd, ROTARY,
                                       KV_FP8, HAS_K_NORM, BLOCK_D, BLOCK_DV)
                tl.debug_barrier()
            if DOT_FP32:
                qv = qv.to(tl.float32)
            elif FP8_DOT == 3:  # fp8 dots: each score row's q on the e4m3 grid, q ~= q8 * q_scale (quant.py's way)
                qv = qv.to(tl.float32)
                q_scale, q_inv = _scale_and_inverse(tl.max(tl.abs(qv), axis=1), 448.0)
                qv = _quantize_values(qv, q_inv[:, None], True).to(kc_ptr.dtype.element_ty)  # exact: on the grid
            elif FP8_DOT > 0:  # fp16 dots: q saturated to fp16's range (exact inside it for bf16)
                qv = tl.clamp(qv.to(tl.float32), -65504.0, 65504.0).to(tl.float16)

            first_q_pos = ctx - qlen + q_off  # position of the tile's first query row (k_hi <= it + BLOCK_Q)
            qk_scale = scale
            v_scale = 1.0
            if KV_FP8:  # scores of the stored (k / k_scale) keys, times k_scale
                qk_scale = scale * tl.load(ks_ptr)
                v_scale = tl.load(vs_ptr)
                if FP8_DOT == 3:  # q8 scores times each row's q scale; the PV dot took p * 256 (below)
                    qk_scale = qk_scale * q_scale[:, None]
                    v_scale = v_scale * (1.0 / 256.0)
            m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_R], tl.float32)
            acc = tl.zeros([BLOCK_R, BLOCK_DV], tl.float32)
            k_from = k_lo
            if PRELOAD:  # the first tile: its older keys as loaded before the wait, the step's keys (written above) now
                new_ok = k_ok0 & (kpos0 >= new0)
                kt = tl.where(new_ok[:, None], _cache_tile(kc_ptr, pblk0, koff0, kvh, d, new_ok[:, None] & d_ok[None, :],
                                                           s_kcb, s_kco, s_kch, 1), kt0)
                p, alpha, m_i, l_i = _tile_scores(qv, kt, m_i, l_i, k_lo, kpos0, k_ok0, q_pos, first_q_pos, qk_scale,
                                                  softcap, sliding_window, BLOCK_N, USE_WINDOW, USE_SOFTCAP, DOT_FP32,
                                                  FP8_DOT)
                vt = tl.where(new_ok[:, None], _cache_tile(vc_ptr, pblk0, koff0, kvh, dv,
                                                           new_ok[:, None] & dv_ok[None, :], s_vcb, s_vco, s_vch,
                                                           s_vcd), vt0)
                acc = acc * alpha[:, None] + _tile_values(p, vt, qv, vc_ptr, DOT_FP32, KV_FP8, FP8_DOT, ROUND_P_EXACTLY)
                k_from = k_lo + BLOCK_N
            k_whole = k_hi  # V_TILES 1: the loop takes the whole tiles below it, the last partial one follows
            if V_TILES == 1:
                k_whole = k_from + (k_hi - k_from) // BLOCK_N * BLOCK_N
            for start in range(k_from, k_whole, BLOCK_N):
                m_i, l_i, acc = _attend_key_tile(
                    qv, m_i, l_i, acc, bt_row, start, k_hi, kc_ptr, vc_ptr, kvh, d, d_ok, dv, dv_ok, q_pos,
                    first_q_pos, qk_scale, softcap, sliding_window, s_kcb, s_kco, s_kch, s_vcb, s_vco, s_vch, s_vcd,
                    BLOCK_SIZE, BLOCK_N, USE_WINDOW, USE_SOFTCAP, DOT_FP32, KV_FP8, FP8_DOT, ROUND_P_EXACTLY, V_TILES,
                )  # fmt: skip
            if V_TILES == 1:
                if k_whole < k_hi:
                    m_i, l_i, acc = _attend_key_tile(
                        qv, m_i, l_i, acc, bt_row, k_whole, k_hi, kc_ptr, vc_ptr, kvh, d, d_ok, dv, dv_ok, q_pos,
                        first_q_pos, qk_scale, softcap, sliding_window, s_kcb, s_kco, s_kch, s_vcb, s_vco, s_vch,
                        s_vcd, BLOCK_SIZE, BLOCK_N, USE_WINDOW, USE_SOFTCAP, DOT_FP32, KV_FP8, FP8_DOT,
                        ROUND_P_EXACTLY, 0,
                    )  # fmt: skip
            if USE_SINKS:  # each head's sink, one more key of value zero (log2 units as the scores), folded once: into
                if split == 0:  # split 0's state, which every merge (fused or the reduce kernel) takes
                    sink = tl.load(sinks_ptr + head, mask=g < G, other=0.0).to(tl.float32) * _split_k.LOG2E
                    m_i, l_i, acc = _split_k.fold_sink(m_i, l_i, acc, sink)
            if KV_FP8:  # the stored values are v / v_scale
                acc = acc * v_scale
            if FUSED_MERGE:
                if BLOCK_Q == 1:  # a decode tile's real rows are its first G (one query row): merge only those
                    gm = tl.arange(0, BLOCK_G)
                    tok_m = tok0 + gm * 0
                    head_m = kvh * G + gm
                    row_ok_m = (gm < G) & ((gm * 0 + q_off) < qlen)
                else:
                    tok_m, head_m, row_ok_m = tok, head, row_ok
                _split_k.finish_rows(
                    out_ptr, ws_m_ptr, ws_l_ptr, ws_acc_ptr, cnt_ptr + tile * tl.num_programs(1) + kvh, acc, m_i,
                    l_i, split, n_used, tok, head, dv, row_ok, dv_ok, tok_m, head_m, row_ok_m, s_ot, s_oh, s_wms,
                    s_wmt, s_was, s_wat, s_wah, NUM_SPLITS,
                )  # fmt: skip
            else:
                _split_k.store_rows(
                    out_ptr, ws_m_ptr, ws_l_ptr, ws_acc_ptr, acc, m_i, l_i, split, tok, head, dv, row_ok, dv_ok,
                    s_ot, s_oh, s_wms, s_wmt, s_was, s_wat, s_wah, NUM_SPLITS,
                )  # fmt: skip


def _check_fp8_dots(q: torch.Tensor) -> None:
    """Raise unless q's device runs Triton's e4m3 dots: sm_89 or newer, or CPU (the interpreter runs them exactly)."""
    if q.is_cuda and torch.cuda.get_device_capability(q.device) < (8, 9):
        raise ValueError(f"paged_attention: fp8_dot 'fp8' needs e4m3 dots (sm_89 or newer), "
                         f"{torch.cuda.get_device_name(q.device)} has none")


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _scale_args(k_scale, v_scale, placeholder: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' scale pointers (`placeholder`, never read, for unscaled caches)."""
    return (k_scale if k_scale is not None else placeholder, v_scale if v_scale is not None else placeholder)


def v_keys_contiguous(v_cache: torch.Tensor) -> bool:
    """Whether a V cache [blocks, block_size, Hkv, Dv] is stored tokens-contiguous (`CacheTensor.keys_contiguous`):
    unit stride along its block's tokens, not along its last dim."""
    return v_cache.stride(1) == 1 and v_cache.stride(-1) != 1


def check_cache_layout(k_cache: torch.Tensor, v_cache: torch.Tensor, who: str = "paged_attention") -> None:
    """Raise unless the K cache has unit stride along its last dim and the V cache along its last dim or, stored
    tokens-contiguous (`CacheTensor.keys_contiguous`), along its block's tokens (dim 1)."""
    if k_cache.stride(-1) != 1 or (v_cache.stride(-1) != 1 and v_cache.stride(1) != 1):
        raise ValueError(f"{who}: the caches need unit stride along their last dim (the V cache: or along its "
                         f"block's tokens), got strides {k_cache.stride()} and {v_cache.stride()}")


def _check_kv_write_shapes(k, v, k_cache, v_cache, slot_mapping, t: int) -> None:
    """Raise unless k [t, Hkv, D] and v [t, Hkv, Dv] match the caches and slot_mapping has a slot for each of the t
    tokens (the caches' layouts: `check_cache_layout`, by the launchers)."""
    want_k, want_v = (t, *k_cache.shape[2:]), (t, *v_cache.shape[2:])
    if tuple(k.shape) != want_k or tuple(v.shape) != want_v or slot_mapping.dim() != 1 or slot_mapping.shape[0] < t:
        raise ValueError(f"paged_attention: k {tuple(k.shape)}, v {tuple(v.shape)} and slot_mapping "
                         f"{tuple(slot_mapping.shape)} should be {want_k}, {want_v} and ({t},) for these caches")


def write_kv_cache_triton(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """Triton KV-cache write: one program per token, negative slots skipped inside the kernel (fp8 caches:
    k / k_scale and v / v_scale, the reference's bytes)."""
    if not HAS_TRITON:
        raise RuntimeError("write_kv_cache_triton needs triton")
    kv_fp8 = check_kv_scales(k_cache, v_cache, k_scale, v_scale)
    t, hkv, d = k.shape
    dv = v.shape[2]
    if t == 0:
        return
    check_cache_layout(k_cache, v_cache)
    _check_kv_write_shapes(k, v, k_cache, v_cache, slot_mapping, t)
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    _write_kv_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping, *_scale_args(k_scale, v_scale, slot_mapping), k_cache.shape[1],
        hkv, d, dv, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        KV_FP8=kv_fp8, BLOCK_H=next_pow2(hkv), BLOCK_D=next_pow2(d), BLOCK_DV=next_pow2(dv), num_warps=4,
        **pdl_args(k),
    )  # fmt: skip


# (_CONFIG name, device, q dtype, BLOCK_G, BLOCK_D, BLOCK_DV) -> the launch shape that compiled there
_LAUNCH_OK: dict[tuple, tuple[int, int, int, int, int]] = {}


def _launch_configs(name: str, key: tuple):
    """_CONFIG[name]'s shape, then ever smaller shapes (keys per step, pipeline stages, rows) until one fits."""
    if key in _LAUNCH_OK:
        yield _LAUNCH_OK[key]
        return
    cfg = _CONFIG[name]
    rows, block_n, num_warps, num_stages = cfg.get("rows", 1), cfg["block_n"], cfg["num_warps"], cfg["num_stages"]
    maxnreg = cfg.get("maxnreg", 0)
    while True:
        yield rows, block_n, num_warps, num_stages, maxnreg
        if block_n > 32:
            block_n //= 2
        elif num_stages > 1:
            num_stages -= 1
        elif rows > 16:
            rows //= 2
        else:
            return


def paged_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    softcap: float = 0.0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    *,
    decode_only: bool | None = None,
    num_splits: int | None = None,
    fused_merge: bool = True,
    rotary: Rotary | None = None,
) -> torch.Tensor:
    """Triton paged attention (writes k/v into the caches first: inside the attention launch when it is
    decode-shaped, `decode_only`, else by `write_kv_cache_triton`'s kernel before it). See the module docstring.
    `rotary` (only where `rotary_in_kernel` says so): q and k are unrotated, and the launch applies qk_rotary to
    them itself (`Rotary`).

    Every knob choice gives the same result for every batch; the knobs only choose tile shapes, and all
    choices are made from shapes and arguments, never tensor values (CUDA-graph safe, no host sync):
      * `decode_only`: True -> one query row per tile (BLOCK_Q = 1), the decode shape; False -> up to
        `_CONFIG["prefill"]["rows"]` (query row, head) pairs per tile, the prefill shape. None (default,
        and what the registered op uses) -> True iff T <= S, i.e. at most one token per sequence on
        average: decode steps and CUDA-graph decode buckets. A prefill batch run as decode is slower
        (K/V reloaded per query row), never wrong.
      * `num_splits`: key-range splits per tile (flash-decoding). None (default) -> 1 unless decode_only
        and (S x Hkv) programs would leave the GPU under-filled, then enough splits to cover it, at most 8
        for block tables of up to 1,024 keys and 16 beyond (`_split_k.default_num_splits`); split launches
        pipeline 2 key steps ahead (3 otherwise). A tile's key range is cut into BLOCK_N-aligned parts
        of ceil(range / num_splits) keys, so a short context fills only the first few splits.
      * `fused_merge` (with num_splits > 1): True (default) -> splits past a tile's range exit at once, the
        last split to finish a tile merges the partials in split order (one launch; a range within one split
        is written directly); False -> every split writes partials and a reduce kernel merges them (a second
        launch; what the bench compares against). Same merge arithmetic, same order.
    The first call for a new (dtype, head dims, kind) compiles, and may retry smaller launch shapes if
    one runs out of shared memory: make it before capturing a CUDA graph (warm-up), as usual.
    """
    if not HAS_TRITON:
        raise RuntimeError("paged_attention_triton needs triton")
    return _triton_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window,
                             softcap, k_scale, v_scale, sinks, new_kv=(k, v, slot_mapping), decode_only=decode_only,
                             num_splits=num_splits, fused_merge=fused_merge, rotary=rotary)


class Rotary(NamedTuple):
    """qk_rotary's other operands, for a decode-shaped launch that applies it itself (`rotary_paged_attention`): q
    and the step's k are then unrotated, and the kernel runs qk_rotary's math (`_rotary.rotated_pairs`: the head
    norms when weights are given, then the neox rotary) on its q rows and on the k rows it writes, rounding both to
    their own dtype as qk_rotary's outputs (callers check that those have q's and k's dtypes)."""

    cos: torch.Tensor  # [T, D]: packed token r's angles in row r (any strides: stride 0 where broadcast)
    sin: torch.Tensor
    q_weight: torch.Tensor | None  # [D] each, or None: no norm
    k_weight: torch.Tensor | None
    eps: float


def _writes_in_kernel(new_rows: int, t: int, n_seqs: int, decode_only: bool | None, split: bool,
                      kv_fp8: bool) -> bool:
    """Whether a launch writes the step's keys in the attention kernel (decode-shaped: DECODE_WRITE_IN_KERNEL; a
    launch of one split, `split` False, also its _CONFIG kind's "write_one_split")."""
    decode_only = t <= n_seqs if decode_only is None else decode_only
    one_split = _CONFIG["decode_fp8" if kv_fp8 else "decode"].get("write_one_split", 1)
    return (DECODE_WRITE_IN_KERNEL and (split or bool(one_split)) and new_rows > 0 and decode_only and t > 0
            and n_seqs > 0)


def _splits(q: torch.Tensor, n_seqs: int, hkv: int, capacity: int, decode_only: bool, num_splits: int | None) -> int:
    """The launch's key splits: `num_splits`, or by default `_split_k.default_num_splits` for decode-shaped ones."""
    if num_splits is None:
        num_splits = _split_k.default_num_splits(q, n_seqs, hkv, capacity) if decode_only else 1
    return max(1, int(num_splits))


def _dot_plan(q: torch.Tensor, d: int, kv_fp8: bool, decode_only: bool) -> tuple[str, int, bool, int]:
    """(the _CONFIG kind, the fp8 dot way, fp32 dots?, BLOCK_D) of an attention launch."""
    block_d = max(16, next_pow2(d))
    name = ("decode" if decode_only else "prefill") + ("_fp8" if kv_fp8 else "")
    fp8_dot = _FP8_DOT[_CONFIG[name]["fp8_dot"]] if kv_fp8 else 0
    # the interpreter's bf16 dot is wrong (its fp16 dot is right: fp32 products and sums)
    dot_fp32 = q.dtype == torch.float32 or (not q.is_cuda and fp8_dot == 0)
    if dot_fp32:  # fp32 dots whatever the way
        fp8_dot = 0
    elif fp8_dot == _FP8_DOT["fp8"]:
        block_d = max(32, block_d)  # an e4m3 dot reduces over 32 or more (q8 K^T over D, p8 V over BLOCK_N)
    return name, fp8_dot, dot_fp32, block_d


def rotary_in_kernel(q: torch.Tensor, k: torch.Tensor, k_cache: torch.Tensor, seq_lens: torch.Tensor,
                     kv_fp8: bool, decode_only: bool | None = None, num_splits: int | None = None) -> bool:
    """Whether `paged_attention_triton(..., rotary=...)` takes these shapes (packed q [T, Hq, D], k [T, Hkv, D]):
    a launch that writes the step's keys in the attention kernel, whose head tile is the head dim (D a power of two,
    16 or more), so that the rotated halves of a q row, laid side by side, are the row as the kernel's dots read it.
    `num_splits` as the launch gets it (None: split where `_split_k.splits_pay`)."""
    t, _, d = q.shape
    n_seqs = seq_lens.shape[0]
    split = _split_k.splits_pay(q, n_seqs, k_cache.shape[2], num_splits)
    if not _writes_in_kernel(k.shape[0], t, n_seqs, decode_only, split, kv_fp8):
        return False
    return _dot_plan(q, d, kv_fp8, t <= seq_lens.shape[0] if decode_only is None else decode_only)[3] == d


def _triton_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale: float,
                      sliding_window: int, softcap: float, k_scale, v_scale, sinks=None, *, new_kv: tuple | None = None,
                      decode_only: bool | None = None, num_splits: int | None = None,
                      fused_merge: bool = True, rotary: Rotary | None = None) -> torch.Tensor:
    """The unified attention kernel (and, with splits and not `fused_merge`, the split-K reduce kernel) over the
    caches. `new_kv` (k, v, slot_mapping): the step's keys to write first, by the attention kernel itself when the
    launch is decode-shaped (one query row per tile: no launch between the write and the reads), else by
    `write_kv_cache_triton` before it; None: the caches already hold them. `rotary`: q and new_kv's k unrotated,
    rotated in the kernel (ROTARY; raises ValueError where `rotary_in_kernel` is False). `sinks` [Hq] (any float
    dtype) or None: the kernel's USE_SINKS, off (the kernel of a model without sinks) when None."""
    t, hq, d = q.shape
    hkv = k_cache.shape[2]
    dv = v_cache.shape[3]
    if hq % hkv:
        raise ValueError(f"paged_attention: {hq} query heads are not a multiple of {hkv} kv heads")
    check_sinks(sinks, hq)
    if sinks is not None:
        sinks = sinks.contiguous()
    n_seqs = seq_lens.shape[0]
    kv_fp8 = check_kv_scales(k_cache, v_cache, k_scale, v_scale)
    check_cache_layout(k_cache, v_cache)
    if decode_only is None:
        decode_only = t <= n_seqs
    if new_kv is not None and new_kv[0].shape[0] == 0:  # no keys to write (mla_attention's expanded path wrote its own)
        new_kv = None
    num_splits = _splits(q, n_seqs, hkv, block_tables.shape[1] * k_cache.shape[1], decode_only, num_splits)
    if rotary is not None and (new_kv is None or not rotary_in_kernel(q, new_kv[0], k_cache, seq_lens, kv_fp8,
                                                                      decode_only, num_splits)):
        raise ValueError(f"paged_attention: the rotary runs in decode-shaped launches that write the step's keys, "
                         f"with a power-of-two head dim of 16 or more (q {tuple(q.shape)}, {n_seqs} sequences)")
    write_kv = new_kv is not None and _writes_in_kernel(new_kv[0].shape[0], t, n_seqs, decode_only, num_splits > 1,
                                                        kv_fp8)
    if new_kv is not None and not write_kv:
        k, v, slot_mapping = new_kv
        write_kv_cache_triton(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    if t == 0 or n_seqs == 0:
        return q.new_zeros((t, hq, dv))

    q = _last_dim_contiguous(q)
    g = hq // hkv
    block_g = next_pow2(g)
    if write_kv:
        k, v, slot_mapping = new_kv
        _check_kv_write_shapes(k, v, k_cache, v_cache, slot_mapping, t)
        k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    else:  # placeholders, never read (WRITE_KV off)
        k, v, slot_mapping = q, q, seq_lens
    name, fp8_dot, dot_fp32, block_d = _dot_plan(q, d, kv_fp8, decode_only)
    v_keys = v_keys_contiguous(v_cache)
    if v_keys and name == "decode_fp8":
        name = "decode_fp8_vkeys"
    block_dv = max(16, next_pow2(dv))
    if fp8_dot == _FP8_DOT["fp8"]:
        _check_fp8_dots(q)
    if rotary is not None:
        rot_args = (rotary.cos, rotary.sin, *(w if w is not None else q for w in (rotary.q_weight, rotary.k_weight)))
        rot_strides, eps = (*rotary.cos.stride(), *rotary.sin.stride()), float(rotary.eps)
    else:  # placeholders, never read (ROTARY off)
        rot_args, rot_strides, eps = (q, q, q, q), (0, 0, 0, 0), 0.0
    block_size = k_cache.shape[1]
    fused_merge = fused_merge and num_splits > 1
    preload = False
    if num_splits > 1 and name in _SPLIT_KINDS:
        name = _SPLIT_KINDS[name]
        preload = ATTN_PRELOAD and bool(_CONFIG[name].get("preload", 1))
    # the kernel zeroes the rows no sequence owns: out needs no memset
    out, ws_m, ws_l, ws_acc, ws_strides = _split_k.split_outputs(q, (t, hq, dv), num_splits, t, hq, dv,
                                                                 writes_every_row=True)

    key = (name, q.device, q.dtype, block_g, block_d, block_dv)
    for shape in _launch_configs(name, key):
        rows, block_n, num_warps, num_stages, maxnreg = shape
        if fp8_dot == _FP8_DOT["fp8"]:
            block_n = max(32, block_n)
        if num_splits > 1:  # split launches: 2 stages, ~0.2 us a call faster at batch 1 (H200)
            num_stages = min(num_stages, 2)
        block_q = 1 if decode_only else max(1, rows // block_g)
        block_r = max(16, block_q * block_g)  # tl.dot needs >= 16 rows
        row_tiles = ROW_TILES and block_q == 1 and bool(_CONFIG[name].get("row_tiles", 1))
        tiles = t if row_tiles else t // block_q + n_seqs
        counters = _split_k.split_counters(q.device, tiles * hkv) if fused_merge else seq_lens  # unread
        try:
            _paged_attn_kernel[(tiles, hkv, num_splits)](
                q, k_cache, v_cache, out, ws_m, ws_l, ws_acc, counters,
                block_tables, seq_lens, query_start_loc, *_scale_args(k_scale, v_scale, seq_lens), k, v, slot_mapping,
                *rot_args, sinks if sinks is not None else q, t, n_seqs, float(scale), float(softcap), int(sliding_window), eps, block_size, d, dv,
                q.stride(0), q.stride(1),
                k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
                out.stride(0), out.stride(1), block_tables.stride(0), *ws_strides,
                k.stride(0), k.stride(1), v.stride(0), v.stride(1), *rot_strides,
                WRITE_KV=write_kv, ROTARY=rotary is not None, HAS_Q_NORM=rotary is not None and rotary.q_weight is not None,
                HAS_K_NORM=rotary is not None and rotary.k_weight is not None, G=g, BLOCK_Q=block_q, BLOCK_G=block_g, BLOCK_R=block_r, BLOCK_N=block_n,
                BLOCK_D=block_d, BLOCK_DV=block_dv, NUM_SPLITS=num_splits, FUSED_MERGE=fused_merge,
                # rounded up to a multiple of 4 (extra steps are no-ops once lo == hi): few specializations,
                # so batches of changing size do not each compile a new kernel
                SEARCH_STEPS=-(-max(1, n_seqs.bit_length()) // 4) * 4, USE_WINDOW=sliding_window > 0,
                USE_SOFTCAP=softcap > 0, DOT_FP32=dot_fp32, KV_FP8=kv_fp8, FP8_DOT=fp8_dot,
                ROUND_P_EXACTLY=not q.is_cuda, PRELOAD=preload, ROW_TILES=row_tiles, ROW_GUESS=ROW_GUESS,
                V_TILES=V_KEYS_TILES if v_keys else 0, USE_SINKS=sinks is not None, num_warps=num_warps,
                num_stages=num_stages, **({"maxnreg": maxnreg} if maxnreg else {}), **pdl_args(q),
            )  # fmt: skip
        except triton.runtime.errors.OutOfResources:
            continue  # too much shared memory (fp32, big head dims): try the next smaller shape
        _LAUNCH_OK[key] = (rows, block_n, num_warps, *shape[3:])  # the kind's stages / cap (split launches: theirs)
        break
    else:
        raise RuntimeError(f"paged_attention_triton: no launch shape fits for {key}")
    if num_splits > 1 and not fused_merge:
        _split_k.launch_split_reduce(
            ws_m, ws_l, ws_acc, ws_strides, out, out.stride(0), out.stride(1), query_start_loc, n_seqs, block_dv
        )
    return out


# --------------------------------------------------------------------------------------------------
# long query runs through torch's fused attention kernels (ops/_prefill_sdpa.py)
# --------------------------------------------------------------------------------------------------


def _host_lengths(query_start_loc: torch.Tensor, seq_lens: torch.Tensor) -> tuple[list[int], list[int]]:
    """The step's query offsets and context lengths on the host: one device sync per step (_per_step)."""
    return _per_step(_HOST_LENGTHS, (query_start_loc, seq_lens), (),
                     lambda: (query_start_loc.tolist(), seq_lens.tolist()))


def _gather_context(cache: torch.Tensor, block_table_row: torch.Tensor, n: int) -> torch.Tensor:
    """Positions 0 .. n-1 of one sequence from a paged cache, as a contiguous [n, H, D] copy (whole blocks
    are gathered; the positions past n in the last one are sliced off, never read)."""
    blk = block_table_row[: -(-n // cache.shape[1])].to(torch.int64)
    return _gather_blocks(cache, blk).reshape(-1, *cache.shape[2:])[:n]


def _sub_batch(seqs: list[int], qsl: list[int], lens: list[int], block_tables: torch.Tensor):
    """The metadata of a batch holding only sequences `seqs` (their rows packed in order): (rows of the full
    batch [T'], block_tables [S', max_blocks], seq_lens [S'], query_start_loc [S'+1])."""
    dev = block_tables.device
    rows = [r for s in seqs for r in range(qsl[s], qsl[s + 1])]
    sub_qsl = [0]
    for s in seqs:
        sub_qsl.append(sub_qsl[-1] + qsl[s + 1] - qsl[s])
    return (torch.tensor(rows, dtype=torch.int64, device=dev), block_tables[torch.tensor(seqs, device=dev)],
            torch.tensor([lens[s] for s in seqs], dtype=torch.int32, device=dev),
            torch.tensor(sub_qsl, dtype=torch.int32, device=dev))


def _paged_attention_routed(
    q, k, v, k_cache, v_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale: float,
    sliding_window: int, softcap: float, k_scale=None, v_scale=None, sinks=None, *, use_triton_kernel: bool,
) -> torch.Tensor:  # fmt: skip
    """The registered ops' body: the cache write of `use_triton_kernel`'s implementation (Triton or the torch
    reference; a step the route leaves alone goes to `paged_attention_triton` / `_reference`, write and attention,
    so that a decode-shaped Triton launch writes the keys itself), then each sequence with a long query run
    (_prefill_sdpa.MIN_QUERY_ROWS rows or more) through `_prefill_sdpa.attend_run` over its gathered context plus
    its new k/v, and every other sequence through the implementation's attention, given a batch of those sequences
    only (no work twice). The route is decided by `_prefill_sdpa.route_wanted` (shapes and arguments; never during
    CUDA-graph capture); only a step it accepts reads its lengths on the host. k, v and slot_mapping None
    (`paged_attention_cached`): no write, the caches already hold the step's keys, and a long run's new k/v are read
    from them with its context. `sinks` (the heads' attention sinks) go to the route too, which applies them to the
    fused kernels' outputs through their log-sum-exps."""
    kv_fp8 = check_kv_scales(k_cache, v_cache, k_scale, v_scale)
    write = write_kv_cache_triton if use_triton_kernel else write_kv_cache_reference
    attend = _triton_attention if use_triton_kernel else _reference_attention
    opts = (scale, sliding_window, softcap, k_scale, v_scale, sinks)
    meta = (block_tables, seq_lens, query_start_loc)
    if seq_lens.shape[0] == 0 or not _prefill_sdpa.route_wanted(q, k_cache, sliding_window, softcap, kv_fp8):
        if k is None:
            return attend(q, k_cache, v_cache, *meta, *opts)
        whole = paged_attention_triton if use_triton_kernel else paged_attention_reference
        return whole(q, k, v, k_cache, v_cache, slot_mapping, *meta, *opts)
    if k is not None:
        write(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    qsl, lens = _host_lengths(query_start_loc, seq_lens)
    t, hq, _ = q.shape
    out, rest = None, []
    for s in range(len(lens)):
        q0, qlen = qsl[s], qsl[s + 1] - qsl[s]
        run = None
        cached = lens[s] - qlen
        if qlen >= _prefill_sdpa.MIN_QUERY_ROWS and cached >= 0:
            rows = slice(q0, q0 + qlen)
            if k is None:  # the run's keys are cached after its context (the cache holds q's dtype: route_wanted)
                k_all, v_all = (_gather_context(c, block_tables[s], lens[s]) for c in (k_cache, v_cache))
                k_new, v_new, k_ctx, v_ctx = k_all[cached:], v_all[cached:], k_all[:cached], v_all[:cached]
            else:
                k_ctx, v_ctx = (_gather_context(c, block_tables[s], cached) for c in (k_cache, v_cache))
                k_new, v_new = k[rows], v[rows]
            run = _prefill_sdpa.attend_run(q[rows], k_new, v_new, k_ctx, v_ctx, scale, sinks)
        if run is None:
            rest.append(s)
        elif qlen == t:  # the step is this one run: its output as it is
            return run.contiguous()
        else:
            if out is None:
                out = q.new_zeros((t, hq, v_cache.shape[3]))  # rows owned by no sequence stay zero
            out[q0 : q0 + qlen] = run
    if out is None:  # no run was taken
        return attend(q, k_cache, v_cache, *meta, *opts)
    rest = [s for s in rest if qsl[s + 1] > qsl[s]]
    if rest:
        rows, *sub_meta = _sub_batch(rest, qsl, lens, block_tables)
        out[rows] = attend(q[rows], k_cache, v_cache, *sub_meta, *opts)
    return out


def paged_attention_triton_entry(*args, **kwargs) -> torch.Tensor:
    """The registered op's body on the Triton path (what compiled graphs call directly: ops.kernel_impls)."""
    return _paged_attention_routed(*args, **kwargs, use_triton_kernel=True)


def paged_attention_reference_entry(*args, **kwargs) -> torch.Tensor:
    """The registered op's body on the torch-reference path (ops.kernel_impls)."""
    return _paged_attention_routed(*args, **kwargs, use_triton_kernel=False)


def paged_attention_cached_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, sliding_window: int = 0,
    softcap: float = 0.0, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """`paged_attention_reference` without its write: attention over caches that already hold the step's keys."""
    check_kv_scales(k_cache, v_cache, k_scale, v_scale)
    return _reference_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window,
                                softcap, k_scale, v_scale, sinks)


def paged_attention_cached_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, sliding_window: int = 0,
    softcap: float = 0.0, k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None, **knobs,
) -> torch.Tensor:  # fmt: skip
    """`paged_attention_triton` without its write (same knobs): the attention kernel over the caches as they are."""
    if not HAS_TRITON:
        raise RuntimeError("paged_attention_cached_triton needs triton")
    return _triton_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window,
                             softcap, k_scale, v_scale, sinks, **knobs)


def _cached_routed(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale: float, sliding_window: int,
                   softcap: float, k_scale=None, v_scale=None, sinks=None, *, use_triton_kernel: bool) -> torch.Tensor:
    """`paged_attention_cached`'s body: `_paged_attention_routed` with nothing to write."""
    return _paged_attention_routed(q, None, None, k_cache, v_cache, None, block_tables, seq_lens, query_start_loc,
                                   scale, sliding_window, softcap, k_scale, v_scale, sinks,
                                   use_triton_kernel=use_triton_kernel)


def paged_attention_cached_triton_entry(*args, **kwargs) -> torch.Tensor:
    """`paged_attention_cached`'s body on the Triton path (ops.kernel_impls)."""
    return _cached_routed(*args, **kwargs, use_triton_kernel=True)


def paged_attention_cached_reference_entry(*args, **kwargs) -> torch.Tensor:
    """`paged_attention_cached`'s body on the torch-reference path (ops.kernel_impls)."""
    return _cached_routed(*args, **kwargs, use_triton_kernel=False)


# --------------------------------------------------------------------------------------------------
# the registered op
# --------------------------------------------------------------------------------------------------


@torch.library.custom_op("mini_infer::paged_attention", mutates_args=("k_cache", "v_cache"))
def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int,
    softcap: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write k/v into the paged caches, then attend: Triton on CUDA when available, else the torch reference;
    long query runs through torch's fused attention kernels (see `_paged_attention_routed`)."""
    entry = paged_attention_triton_entry if use_triton(q) else paged_attention_reference_entry
    return entry(q, k, v, k_cache, v_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale,
                 sliding_window, softcap, k_scale, v_scale, sinks)


@paged_attention.register_fake
def _(q, k, v, k_cache, v_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale, sliding_window, softcap,
      k_scale=None, v_scale=None, sinks=None):
    check_kv_scales(k_cache, v_cache, k_scale, v_scale)
    check_sinks(sinks, q.shape[1])
    return q.new_empty((q.shape[0], q.shape[1], v_cache.shape[3]))


@torch.library.custom_op("mini_infer::paged_attention_cached", mutates_args=())
def paged_attention_cached(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int,
    softcap: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """`paged_attention` over caches already holding this step's keys (written by `qk_rotary_kv_write`): the same
    attention and long-run route, no write; it mutates nothing."""
    entry = paged_attention_cached_triton_entry if use_triton(q) else paged_attention_cached_reference_entry
    return entry(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window, softcap,
                 k_scale, v_scale, sinks)


@paged_attention_cached.register_fake
def _(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, sliding_window, softcap, k_scale=None,
      v_scale=None, sinks=None):
    check_kv_scales(k_cache, v_cache, k_scale, v_scale)
    check_sinks(sinks, q.shape[1])
    return q.new_empty((q.shape[0], q.shape[1], v_cache.shape[3]))
