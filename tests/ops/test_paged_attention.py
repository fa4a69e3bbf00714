"""paged_attention: reference vs an independent per-sequence SDPA oracle, Triton vs reference.

Every case builds each sequence's whole K/V history as one contiguous tensor, scatters it into a paged
cache through a shuffled block table (prefix positions written up front, this step's positions left to
the op), fills every other cache slot with NaN and unused block-table entries with -1: reading a slot or a
block-table entry the op must not read turns the output into NaN or crashes.
"""

import math
import re
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

from mini_infer.ops import HAS_TRITON  # also registers torch.ops.mini_infer.*
from mini_infer.ops.paged_attention import (
    _FP8_DOT,
    paged_attention_reference,
    paged_attention_triton,
    write_kv_cache_reference,
)
from tests.ops.helpers import DEVICE, assert_close, record_kernel_launches, requires_triton, run_uninterpreted


@dataclass
class Case:
    seqs: list  # (cached, new) per sequence
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    hist_k: list  # full K history per sequence [ctx, Hkv, D]
    hist_v: list
    scale: float
    sliding_window: int
    softcap: float

    def args(self):
        """Positional args of the op, with fresh copies of the caches (the op writes into them)."""
        return (
            self.q, self.k, self.v, self.k_cache.clone(), self.v_cache.clone(), self.slot_mapping,
            self.block_tables, self.seq_lens, self.query_start_loc, self.scale, self.sliding_window,
            self.softcap,
        )  # fmt: skip


def make_case(
    seqs,
    hq=4,
    hkv=2,
    d=16,
    dv=None,
    block_size=4,
    dtype=torch.float32,
    pad_tokens=0,
    sliding_window=0,
    softcap=0.0,
    scale=None,
    seed=0,
    shuffle=True,
    cache_fill=float("nan"),
    device=DEVICE,
    num_blocks=None,
    max_blocks=None,
):
    """seqs: (cached, new) per sequence; (0, 0) is a padding sequence (qlen 0, seq_len 0).

    num_blocks / max_blocks fix the cache and block-table shapes (else: just enough, plus spares)."""
    dv = dv or d
    gen = torch.Generator().manual_seed(seed)
    ctxs = [c + n for c, n in seqs]
    n_blocks = [math.ceil(c / block_size) for c in ctxs]
    total_blocks = num_blocks or sum(n_blocks) + 3
    order = torch.randperm(total_blocks, generator=gen) if shuffle else torch.arange(total_blocks)
    block_tables = torch.full((len(seqs), max_blocks or max(n_blocks + [1]) + 1), -1, dtype=torch.int32)
    k_cache = torch.full((total_blocks, block_size, hkv, d), cache_fill, dtype=dtype)
    v_cache = torch.full((total_blocks, block_size, hkv, dv), cache_fill, dtype=dtype)
    hist_k, hist_v, q_rows, k_rows, v_rows, slots = [], [], [], [], [], []
    used = 0
    for s, ((cached, new), ctx) in enumerate(zip(seqs, ctxs)):
        block_tables[s, : n_blocks[s]] = order[used : used + n_blocks[s]].to(torch.int32)
        used += n_blocks[s]
        hk = torch.randn(ctx, hkv, d, generator=gen).to(dtype)
        hv = torch.randn(ctx, hkv, dv, generator=gen).to(dtype)
        hist_k.append(hk)
        hist_v.append(hv)
        for p in range(ctx):
            slot = int(block_tables[s, p // block_size]) * block_size + p % block_size
            if p < cached:  # already in the cache from earlier steps
                k_cache[slot // block_size, slot % block_size] = hk[p]
                v_cache[slot // block_size, slot % block_size] = hv[p]
            else:
                slots.append(slot)
        q_rows.append(torch.randn(new, hq, d, generator=gen).to(dtype))
        k_rows.append(hk[cached:])
        v_rows.append(hv[cached:])
    q_rows.append(torch.randn(pad_tokens, hq, d, generator=gen).to(dtype))
    k_rows.append(torch.randn(pad_tokens, hkv, d, generator=gen).to(dtype))
    v_rows.append(torch.randn(pad_tokens, hkv, dv, generator=gen).to(dtype))
    slots += [-1] * pad_tokens
    qsl = [0]
    for _, new in seqs:
        qsl.append(qsl[-1] + new)
    return Case(
        seqs=list(seqs),
        q=torch.cat(q_rows).to(device),
        k=torch.cat(k_rows).to(device),
        v=torch.cat(v_rows).to(device),
        k_cache=k_cache.to(device),
        v_cache=v_cache.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(ctxs, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        hist_k=hist_k,
        hist_v=hist_v,
        scale=scale if scale is not None else d**-0.5,
        sliding_window=sliding_window,
        softcap=softcap,
    )


def oracle(case: Case) -> torch.Tensor:
    """Per sequence, per kv-head group: full contiguous K/V, explicit mask, float64."""
    t, hq, _ = case.q.shape
    hkv, dv = case.hist_v[0].shape[1], case.hist_v[0].shape[2]
    g = hq // hkv
    out = torch.zeros(t, hq, dv, dtype=torch.float64)
    q0 = 0
    for (cached, new), hk, hv in zip(case.seqs, case.hist_k, case.hist_v):
        if new == 0:
            continue
        ctx = cached + new
        qpos = torch.arange(cached, ctx)[:, None]
        kpos = torch.arange(ctx)[None, :]
        mask = kpos <= qpos
        if case.sliding_window > 0:
            mask &= (qpos - kpos) < case.sliding_window
        qs = case.q[q0 : q0 + new].cpu().double()
        for h in range(hkv):
            qg = qs[:, h * g : (h + 1) * g].transpose(0, 1)  # [G, new, D]
            kh = hk[:, h].double().expand(g, ctx, -1)
            vh = hv[:, h].double().expand(g, ctx, -1)
            if case.softcap > 0:
                sc = qg @ kh.transpose(1, 2) * case.scale
                sc = case.softcap * torch.tanh(sc / case.softcap)
                o = torch.softmax(sc.masked_fill(~mask, float("-inf")), -1) @ vh
            else:
                o = torch.nn.functional.scaled_dot_product_attention(qg, kh, vh, attn_mask=mask, scale=case.scale)
            out[q0 : q0 + new, h * g : (h + 1) * g] = o.transpose(0, 1)
        q0 += new
    return out.to(case.q.dtype)


def check_cache(case: Case, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Every position of every sequence holds its K/V; every other slot is untouched (NaN)."""
    bs = k_cache.shape[1]
    k_cache, v_cache, bt = k_cache.cpu(), v_cache.cpu(), case.block_tables.cpu()
    written = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    for s, (hk, hv) in enumerate(zip(case.hist_k, case.hist_v)):
        pos = torch.arange(hk.shape[0])
        blk, off = bt[s, pos // bs].long(), pos % bs
        assert torch.equal(k_cache[blk, off], hk) and torch.equal(v_cache[blk, off], hv)
        written[blk, off] = True
    assert k_cache[~written].isnan().all() and v_cache[~written].isnan().all()


CASES = {
    "prefill": dict(seqs=[(0, 5), (0, 9), (0, 1), (0, 12)]),
    "chunked_prefill": dict(seqs=[(6, 5), (3, 1), (9, 7), (0, 3)]),
    "decode_gqa": dict(seqs=[(7, 1), (12, 1), (0, 1), (20, 1)], hq=4, hkv=2),
    "decode_mqa_bs16": dict(seqs=[(7, 1), (30, 1), (15, 1)], hq=4, hkv=1, block_size=16),
    "mha_bs16_dv": dict(seqs=[(20, 12), (0, 17)], hq=2, hkv=2, d=32, dv=16, block_size=16),
    "sliding_window": dict(seqs=[(10, 4), (3, 1), (0, 9), (13, 1)], sliding_window=5),
    "softcap": dict(seqs=[(5, 3), (8, 1), (0, 6)], softcap=2.0, scale=1.0),
    "window_softcap_g4": dict(seqs=[(12, 3), (30, 1)], hq=8, hkv=2, sliding_window=8, softcap=5.0, scale=0.5),
    "padding": dict(seqs=[(4, 3), (0, 0), (6, 1), (0, 0), (0, 0)], pad_tokens=3),
}


@pytest.mark.parametrize("name", list(CASES))
def test_reference_matches_oracle(name):
    case = make_case(**CASES[name], device="cpu")
    args = case.args()
    out = paged_attention_reference(*args)
    assert_close(out, oracle(case))
    check_cache(case, args[3], args[4])


def test_reference_long_prefill_is_chunked():
    # more query rows than the reference's chunk (256): exercises its chunk loop
    case = make_case([(40, 300), (2, 1)], hq=2, hkv=1, d=8, block_size=16, device="cpu")
    assert_close(paged_attention_reference(*case.args()), oracle(case))


@requires_triton
@pytest.mark.parametrize("name", list(CASES))
def test_triton_matches_reference(name):
    case = make_case(**CASES[name])
    args_t, args_r = case.args(), case.args()
    out = paged_attention_triton(*args_t)
    assert not out.isnan().any()
    assert_close(out, paged_attention_reference(*args_r))
    check_cache(case, args_t[3], args_t[4])


# decode tiles with 7 query heads per kv head (qwen2.5-7b's group: BLOCK_G 8, one row of padding), odd lengths
DECODE_G7 = dict(seqs=[(9, 1), (22, 1), (0, 1)], hq=14, hkv=2, block_size=4)


@requires_triton
@pytest.mark.parametrize(
    "name,knobs",
    [
        ("chunked_prefill", dict(decode_only=True, num_splits=2)),  # decode tiles on a prefill batch: slower, exact
        ("decode_gqa", dict(decode_only=False)),
        ("sliding_window", dict(num_splits=3)),  # split-K over prefill tiles and a window
        ("padding", dict(decode_only=True, num_splits=2)),  # reduce kernel zeroes unowned rows
        ("decode_g7", {}),
    ],
)
def test_triton_knobs_do_not_change_results(name, knobs):
    case = make_case(**(DECODE_G7 if name == "decode_g7" else CASES[name]))
    out = paged_attention_triton(*case.args(), **knobs)
    assert_close(out, paged_attention_reference(*case.args()))


# blocks as long as a key tile or longer (the engine's 64-token blocks over an fp8 cache, FP8_V_KEYS_BLOCK_SIZE):
# contexts spanning one block, several, and a partial last one; one-split and split decode launches, a prefill chunk
LONG_BLOCK_CASES = [
    ("decode_one_split", [(200, 1), (5, 1), (130, 1), (0, 0)], dict(decode_only=True, num_splits=1)),
    ("decode_splits", [(300, 1), (5, 1), (130, 1)], dict(decode_only=True, num_splits=4)),
    ("chunked_prefill", [(100, 40), (0, 70), (3, 1)], {}),
]


@requires_triton
@pytest.mark.parametrize("block_size", [64, 256])
@pytest.mark.parametrize("name,seqs,knobs", LONG_BLOCK_CASES, ids=[c[0] for c in LONG_BLOCK_CASES])
def test_triton_blocks_longer_than_key_tiles(name, seqs, knobs, block_size):
    """Blocks of 64 and 256 tokens (key tiles of 64-128: a tile within a block, or a block within a tile): the
    Triton kernels agree with the reference over a bf16 cache, and over an fp8 cache whose V is stored
    tokens-contiguous they give the usual layout's output and cache bytes exactly."""
    case = make_case(seqs, hq=4, hkv=2, d=16, block_size=block_size, dtype=torch.bfloat16, seed=1, cache_fill=0.0)
    args = case.args()
    out = paged_attention_triton(*args, **knobs)
    assert_close(out, paged_attention_reference(*case.args()))
    for s_idx, (hk, hv) in enumerate(zip(case.hist_k, case.hist_v)):  # every row where its block table puts it
        pos = torch.arange(hk.shape[0])
        blk, off = case.block_tables.cpu()[s_idx, pos // block_size].long(), pos % block_size
        assert torch.equal(args[3].cpu()[blk, off], hk) and torch.equal(args[4].cpu()[blk, off], hv)
    fp8, ks, vs = fp8_case(case)
    usual, keys = fp8_args(fp8, ks, vs), list(fp8_args(fp8, ks, vs))
    keys[4] = keys_contiguous(keys[4])
    out8 = paged_attention_triton(*keys, **knobs)
    assert not out8.isnan().any()
    assert torch.equal(out8, paged_attention_triton(*usual, **knobs))
    assert torch.equal(keys[4].contiguous().view(torch.uint8), usual[4].view(torch.uint8))


def heads_outer(cache: torch.Tensor) -> torch.Tensor:
    """The same values stored heads-outer ([blocks, H, block_size, D] under the [blocks, block_size, H, D] view)."""
    return stored_as(cache, heads_outer=True)


@requires_triton
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("name,seqs,knobs", LONG_BLOCK_CASES, ids=[c[0] for c in LONG_BLOCK_CASES])
def test_triton_heads_outer_caches(name, seqs, knobs, block_size):
    """Caches stored heads-outer (KV_HEADS_OUTER): a bf16 K and V, and an fp8 K beside the tokens-contiguous fp8 V:
    the same output bits and the same cache bytes (the step's writes included) as the usual layout, and the
    reference over them agrees too (within the dtype's tolerance)."""
    case = make_case(seqs, hq=4, hkv=2, d=16, block_size=block_size, dtype=torch.bfloat16, seed=2, cache_fill=0.0)
    fp8, ks, vs = fp8_case(case)
    for usual, v_of in ((case.args(), heads_outer), ((*fp8.args(), ks, vs), keys_contiguous)):
        outer = list(usual)
        outer[3], outer[4] = heads_outer(usual[3].clone()), v_of(usual[4].clone())
        assert outer[3].stride(2) == block_size * outer[3].shape[3] and outer[3].stride(-1) == 1
        out = paged_attention_triton(*outer, **knobs)
        assert torch.equal(out, paged_attention_triton(*usual, **knobs))
        for a, b in ((outer[3], usual[3]), (outer[4], usual[4])):
            assert torch.equal(a.contiguous().view(torch.uint8), b.view(torch.uint8))
        cpu = [a.cpu() if torch.is_tensor(a) else a for a in usual]
        cpu_outer = list(cpu)
        cpu_outer[3], cpu_outer[4] = heads_outer(cpu[3].clone()), v_of(cpu[4].clone())
        # (a 16-bit decode batch over contiguous caches takes the reference's SDPA path: close, not bit-equal)
        assert_close(paged_attention_reference(*cpu_outer), paged_attention_reference(*cpu))


@pytest.fixture
def small_key_tiles(monkeypatch):
    """16-key tiles (the configured ones are 128): the short contexts of these tests span several splits."""
    from mini_infer.ops import paged_attention as pa

    for kind in pa._CONFIG:
        monkeypatch.setitem(pa._CONFIG, kind, {**pa._CONFIG[kind], "block_n": 16})
    monkeypatch.setattr(pa, "_LAUNCH_OK", {})


# contexts 71 / 6 / 33 over 4 splits of 16-key tiles: 3 of 4 splits used (71: 32 + 32 + 7, splits of two tiles), one
# (6: written directly, no partials), 3 (33: 16 + 16 + 1 key); plus a padding sequence (and a padding row where added)
SPLIT_SEQS = [(70, 1), (5, 1), (32, 1), (0, 0)]


@requires_triton
def test_triton_split_k_decode(small_key_tiles):
    """The merge in the attention launch (last split merges, empty splits exit) gives the bits of the reduce
    kernel, which merges every split's partials (empty ones included) in a second launch; a second call on the
    same buffers (a CUDA graph's replay) gives them again and leaves the counters zero."""
    from mini_infer.ops import _split_k

    case = make_case(SPLIT_SEQS, hq=4, hkv=2, block_size=4, seed=3, pad_tokens=1)
    args = case.args()
    out = paged_attention_triton(*args, decode_only=True, num_splits=4)
    assert_close(out, oracle(case))
    check_cache(case, args[3], args[4])
    assert torch.equal(out, paged_attention_triton(*case.args(), decode_only=True, num_splits=4, fused_merge=False))
    assert torch.equal(paged_attention_triton(*args, decode_only=True, num_splits=4), out)
    assert not _split_k.split_counters(case.q.device, 1).any()


def test_grown_counters_keep_the_old_set_alive(monkeypatch):
    """A CUDA graph captured with one set of counters keeps counting in it; a later call asking for more (the
    sampler's argmax with more rows than any captured launch) gets a new set, and the old one stays allocated."""
    from mini_infer.ops import _split_k

    monkeypatch.setattr(_split_k, "_COUNTERS", {})
    monkeypatch.setattr(_split_k, "_RETIRED", [])
    device = torch.device("cpu")
    first = _split_k.split_counters(device, 10)
    assert _split_k.split_counters(device, 4096) is first  # no growth: the same set
    grown = _split_k.split_counters(device, 5000)
    assert grown is not first and grown.numel() >= 5000 and not grown.any()
    assert any(t is first for t in _split_k._RETIRED)


@requires_triton
@pytest.mark.parametrize("seqs,window", [([(30, 9), (60, 1), (0, 4)], 0), ([(50, 1), (21, 3)], 19)])
def test_triton_fused_merge_prefill_tiles(small_key_tiles, seqs, window):
    """The fused merge over prefill tiles (rows whose visible keys end in different splits), and under a window
    (a key range starting inside a split), twice on the same buffers."""
    case = make_case(seqs, hq=4, hkv=2, block_size=4, seed=5, sliding_window=window)
    args = case.args()
    first = paged_attention_triton(*args, decode_only=False, num_splits=3)
    assert_close(first, oracle(case))
    assert torch.equal(paged_attention_triton(*args, decode_only=False, num_splits=3), first)


@pytest.fixture
def kernel_launches(monkeypatch):
    """The names of paged_attention's write and attention kernels as the module launches them (each still runs)."""
    from mini_infer.ops import paged_attention as pa

    return record_kernel_launches(monkeypatch, pa, "_write_kv_kernel", "_paged_attn_kernel")


@pytest.fixture
def attn_launches(monkeypatch):
    """(grid, keyword arguments) of each `_paged_attn_kernel` launch, in order (each still runs)."""
    from mini_infer.ops import paged_attention as pa

    return record_kernel_launches(monkeypatch, pa, "_paged_attn_kernel", arguments=True)


def spare_slot(case: Case) -> int:
    """The first slot of a cache block no sequence's block table holds (make_case leaves spares)."""
    used = set(case.block_tables.flatten().tolist())
    return next(b for b in range(case.k_cache.shape[0]) if b not in used) * case.k_cache.shape[1]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.cpu().contiguous().view(torch.uint8), b.cpu().contiguous().view(torch.uint8))


# decode-shaped launches (one query row per tile) whose attention kernel writes the step's keys: (make_case kwargs,
# knobs). With 16-key tiles: "qlen2_splits" has a sequence of two new tokens at positions 31 and 32, in different
# splits of its last row's range (split 1 of each row reads position 31, split 2 of the last row 32), a padding
# sequence and a decode row; "window_qlen3" a window that starts inside a run of three new tokens (its last row reads
# the last two only); "padding" rows no sequence owns, one of them with a slot (written as the write kernel does).
FUSED_WRITE = {
    "qlen2_splits": (dict(seqs=[(31, 2), (0, 0), (5, 1), (12, 1)]), dict(num_splits=4)),
    "qlen2_splits_reduce": (dict(seqs=[(31, 2), (0, 0), (5, 1), (12, 1)]), dict(num_splits=4, fused_merge=False)),
    "qlen2_one_split_g4": (dict(seqs=[(31, 2), (0, 0), (40, 1)], hq=8, hkv=2), dict(num_splits=1)),
    "window_qlen3": (dict(seqs=[(10, 3), (4, 1), (0, 1)], sliding_window=2), dict(decode_only=True, num_splits=2)),
    "padding": (dict(seqs=[(7, 1), (0, 0), (20, 1), (0, 0), (0, 0)], pad_tokens=2), dict(num_splits=2)),
}


def fused_write_case(name: str, dtype: torch.dtype, fp8: bool) -> tuple[Case, tuple, dict]:
    """(the FUSED_WRITE case `name` in `dtype`, its cache scales (fp8: k_scale, v_scale; else none), its knobs). The
    "padding" case's last row, owned by no sequence, gets a slot (a spare block's)."""
    case_kw, knobs = FUSED_WRITE[name]
    case = make_case(**case_kw, dtype=dtype, block_size=4, seed=7)
    if name == "padding":
        slots = case.slot_mapping.clone()
        slots[-1] = spare_slot(case)
        case = Case(**{**case.__dict__, "slot_mapping": slots})
    if not fp8:
        return case, (), knobs
    case, ks, vs = fp8_case(case)
    return case, (ks, vs), knobs


@requires_triton
@pytest.mark.parametrize("name", list(FUSED_WRITE))
@pytest.mark.parametrize("dtype,fp8", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
def test_decode_launch_writes_the_step_keys(small_key_tiles, kernel_launches, name, dtype, fp8):
    """A decode-shaped launch is the attention kernel alone (over an fp8 cache, one of one split is the write kernel
    then the attention kernel: _CONFIG["decode_fp8"]'s write_one_split): it leaves the cache bytes
    `write_kv_cache_reference` writes (fp8 caches included; a padding token with a slot written, slot -1 not) and the
    reference's output."""
    case, scales, knobs = fused_write_case(name, dtype, fp8)
    args = (*case.args(), *scales)
    out = paged_attention_triton(*args, **knobs)
    write_first = fp8 and knobs["num_splits"] == 1
    assert kernel_launches == ["_write_kv_kernel", "_paged_attn_kernel"] if write_first else ["_paged_attn_kernel"]
    want_k, want_v = case.k_cache.clone(), case.v_cache.clone()
    write_kv_cache_reference(case.k, case.v, want_k, want_v, case.slot_mapping, *scales)
    assert same_bytes(args[3], want_k) and same_bytes(args[4], want_v)
    args_r = [a.cpu() if torch.is_tensor(a) else a for a in (*case.args(), *scales)]
    assert_close(out, paged_attention_reference(*args_r))


@requires_triton
@pytest.mark.parametrize("name", list(FUSED_WRITE))
@pytest.mark.parametrize("dtype,fp8", [(torch.float32, False), (torch.bfloat16, True)])
def test_one_split_launches_may_write_first(small_key_tiles, kernel_launches, monkeypatch, name, dtype, fp8):
    """_CONFIG's write_one_split off: a decode launch of one split runs the write kernel, then the attention kernel
    (which writes nothing), a split launch still writes in the attention kernel; the output and the cache bytes of
    the default launch, bit for bit, either way; and a one-split launch no longer takes the rotary in the kernel."""
    from mini_infer.ops import paged_attention as pa

    runs = []
    for one_split in (True, False):
        monkeypatch.setitem(pa._CONFIG["decode_fp8" if fp8 else "decode"], "write_one_split", int(one_split))
        case, scales, knobs = fused_write_case(name, dtype, fp8)
        args = (*case.args(), *scales)
        runs.append((paged_attention_triton(*args, **knobs), args[3], args[4]))
    split = knobs["num_splits"] > 1
    assert kernel_launches == ["_paged_attn_kernel"] * 2 if split else ["_paged_attn_kernel", "_write_kv_kernel",
                                                                        "_paged_attn_kernel"]
    (out, k_cache, v_cache), (out2, k_cache2, v_cache2) = runs
    assert same_bytes(out2, out) and same_bytes(k_cache2, k_cache) and same_bytes(v_cache2, v_cache)
    if case.q.shape[-1] >= 16:  # a head dim the rotary path takes
        assert pa.rotary_in_kernel(case.q, case.k, case.k_cache, case.seq_lens, fp8, True, knobs["num_splits"]) == split


@requires_triton
def test_write_kernel_only_for_prefill_shapes(kernel_launches):
    """Prefill-shaped launches (a tile reads keys other tiles' rows own) keep the write kernel before the attention;
    decode-shaped ones, also through the registered op's body, launch the attention kernel alone; the cached
    variant writes nothing."""
    from mini_infer.ops import paged_attention as pa

    prefill = make_case(**CASES["chunked_prefill"])
    paged_attention_triton(*prefill.args())
    assert kernel_launches == ["_write_kv_kernel", "_paged_attn_kernel"]
    kernel_launches.clear()
    decode = make_case(**CASES["decode_gqa"])
    args = decode.args()
    out = pa.paged_attention_triton_entry(*args)
    assert kernel_launches == ["_paged_attn_kernel"]
    check_cache(decode, args[3], args[4])
    kernel_launches.clear()
    written = (*args[:3], args[3].clone(), args[4].clone(), *args[5:])
    cached = pa.paged_attention_cached_triton(written[0], *written[3:5], *written[6:])
    assert kernel_launches == ["_paged_attn_kernel"]
    assert same_bytes(written[3], args[3]) and same_bytes(written[4], args[4])
    assert torch.equal(cached, out)



# Stack bytes (where ptxas puts spilled registers) a build of compile_paged_attention_sm90 may keep: none, but the
# bf16 split launch with the write, which Triton 3.6 builds with 16 (three registers stored before the write loop and
# loaded after the key loop: no spill traffic inside it; 3.9: 0). Every build is as a launch specializes it: the
# same builds without the alignment marks spill up to 6 KB with 3.6 (the script's docstring). The fp8 builds run under
# a register cap of 128 (_CONFIG's "decode_fp8" and "decode_fp8_vkeys": twice the programs an SM, faster on an
# H200 though ptxas then keeps stack: the usual V layout 160-232 bytes with Triton 3.9, 104-192 with 3.6; the
# tokens-contiguous one, fp8_g2's default, 64-72 with 3.9, 8-40 with 3.6). The row guess (ROW_GUESS, on by default
# since it measured faster on an H200) adds 0-48 bytes with 3.9 (the windowed build 232 -> 264; with 3.6 the fp8
# one-split build's 8 -> 0): up to 320 allowed for any of them.
STACK_ALLOWED = {("bf16_splits", "write"): 16, "fp8_window_g7": 320, "fp8_g2": 320, "fp8_g2_usual_v": 320}


@requires_triton
def test_decode_kernel_with_the_write_compiles_sm90():
    """Compiled for sm_90 as decode launches build it (no GPU needed; tests/ops/compile_paged_attention_sm90.py), bf16
    with splits, fp8 under a window and fp8 at qwen3-0.6b's batch-256 decode (over the V layout the pass declares:
    the usual one under a window, tokens-contiguous read by V_KEYS_TILES 3 else; and over the usual one): the
    kernel with the KV write has one
    barrier more than without it (between its stores and its key loads), the builds that write no load through the
    non-coherent path (it could miss the CTA's own stores), and no build spills (no local memory, no stack beyond
    STACK_ALLOWED). (The interpreter runs programs one after another: it shows neither a missing barrier nor a
    compile error.)"""
    report = run_uninterpreted(["-m", "tests.ops.compile_paged_attention_sm90"])
    assert {case["name"] for case in report["cases"]} == {"bf16_splits", "fp8_window_g7", "fp8_g2",
                                                          "fp8_g2_usual_v"}, report
    layouts = {case["name"]: case["write"]["shape"]["v_tiles"] for case in report["cases"]}
    assert layouts == {"bf16_splits": 0, "fp8_window_g7": 0, "fp8_g2": 3, "fp8_g2_usual_v": 0}, layouts
    for case in report["cases"]:
        write, no_write = case["write"], case["no_write"]
        assert write["barriers"] == no_write["barriers"] + 1, case
        builds = {key: built for key, built in case.items() if key != "name"}
        for key, built in builds.items():  # rotary*: with the q/k norms and rotary in it too (rotary_paged_attention)
            stack = re.search(r"\bSTACK:(\d+) ", built["usage"])
            assert stack and "LOCAL:0 " in built["usage"], (case["name"], key, built)
            allowed = STACK_ALLOWED.get((case["name"], key), STACK_ALLOWED.get(case["name"], 0))
            assert int(stack[1]) <= allowed, (report["triton"], case["name"], key,
                                                                                 built)
            assert key == "no_write" or built["nc_loads"] == 0, (case["name"], key, built)


@requires_triton
def test_tokens_contiguous_v_key_loop_reads_no_byte_of_shared_memory():
    """The key loop of nano-vllm's fp8 decode launch, compiled for sm_90 (no GPU;
    `python -m tests.ops.compile_paged_attention_sm90 loop`): over the V layout the pass declares (tokens-contiguous)
    it reads no shared memory a byte at a time, where the usual layout's reads its V tile so (128 `LDS.U8` a step),
    and it issues fewer instructions per K/V byte (the H200's 13% faster decode steps: bench/RESULTS.md)."""
    report = run_uninterpreted(["-m", "tests.ops.compile_paged_attention_sm90", "loop"])
    loops = {case["name"]: case for case in report["cases"]}
    keys, usual = loops["fp8_g2"], loops["fp8_g2_usual_v"]
    assert keys["classes"]["tensor"] > 0 and usual["classes"]["tensor"] > 0, (keys, usual)  # the loop with the dots
    assert keys["shared_byte_loads"] == 0 < usual["shared_byte_loads"], (report["triton"], keys, usual)
    assert keys["warp_instructions_per_kv_byte"] < usual["warp_instructions_per_kv_byte"], (report["triton"], keys,
                                                                                            usual)


@requires_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["chunked_prefill", "decode_gqa"])
def test_triton_half_precision(dtype, name):
    case = make_case(**CASES[name], dtype=dtype)
    out = paged_attention_triton(*case.args())
    assert out.dtype == dtype
    assert_close(out, paged_attention_reference(*case.args()))
    assert_close(out, oracle(case))


@requires_triton
@pytest.mark.parametrize("name", list(FUSED_WRITE))
@pytest.mark.parametrize("dtype,fp8", [(torch.float32, False), (torch.bfloat16, True)])
def test_row_tiles_leave_the_same_bits_with_fewer_programs(small_key_tiles, attn_launches, monkeypatch, name, dtype,
                                                           fp8):
    """ROW_TILES (one program a query row instead of T + S tiles, half of them past their sequence's row in a decode
    step): the output and the cache bytes of the T + S launch, bit for bit (qlen-2 and -3 runs, sequences of no
    rows, a padding row with a slot, splits with the fused merge and with the reduce kernel, fp8 caches), from a
    grid of T tiles."""
    from mini_infer.ops import paged_attention as pa

    monkeypatch.setitem(pa._CONFIG["decode"], "row_tiles", 1)  # 16-bit caches' one-split launches: off by default
    runs = {}
    for row_tiles in (False, True):
        monkeypatch.setattr(pa, "ROW_TILES", row_tiles)
        case, scales, knobs = fused_write_case(name, dtype, fp8)
        args = (*case.args(), *scales)
        runs[row_tiles] = (paged_attention_triton(*args, **knobs), args[3], args[4])
    (old, old_k, old_v), (new, new_k, new_v) = runs[False], runs[True]
    assert same_bytes(new, old) and same_bytes(new_k, old_k) and same_bytes(new_v, old_v)
    t, n_seqs = case.q.shape[0], case.seq_lens.shape[0]
    assert [grid[0] for grid, _ in attn_launches] == [t + n_seqs, t]


# decode-shaped launches for ROW_GUESS: FUSED_WRITE's (runs of two and three rows, sequences of no rows, padding
# rows) and a decode step with one row a sequence, but for a sequence of none among them (the rows after it are not
# their guesses') and one at the end
ROW_GUESS_CASES = {**FUSED_WRITE, "decode": (dict(seqs=[(7, 1), (12, 1), (0, 0), (0, 1), (20, 1), (9, 1), (0, 0)]),
                                             dict(num_splits=1))}


@requires_triton
@pytest.mark.parametrize("row_tiles", [False, True], ids=["t_plus_s_tiles", "row_tiles"])
@pytest.mark.parametrize("name", list(ROW_GUESS_CASES))
def test_row_guess_finds_the_searched_sequence(small_key_tiles, attn_launches, monkeypatch, name, row_tiles):
    """ROW_GUESS (a decode-shaped tile's sequence guessed, s = t or t // 2, searched only where the guess is not the
    search's answer): the output and the cache bytes of the launch that searches every tile, bit for bit, with one
    query row a tile and with T + S tiles."""
    from mini_infer.ops import paged_attention as pa

    monkeypatch.setattr(pa, "ROW_TILES", row_tiles)
    monkeypatch.setitem(pa._CONFIG["decode"], "row_tiles", 1)
    case_kw, knobs = ROW_GUESS_CASES[name]
    runs = []
    for guess in (False, True):
        monkeypatch.setattr(pa, "ROW_GUESS", guess)
        case = make_case(**case_kw, dtype=torch.float32, block_size=4, seed=7)
        args = case.args()
        runs.append((paged_attention_triton(*args, **knobs), args[3], args[4]))
    (old, old_k, old_v), (new, new_k, new_v) = runs
    assert same_bytes(new, old) and same_bytes(new_k, old_k) and same_bytes(new_v, old_v)
    assert_close(new, oracle(case))
    assert [kwargs["ROW_GUESS"] for _, kwargs in attn_launches] == [False, True]


@requires_triton
@pytest.mark.parametrize("name", [n for n, (_, knobs) in FUSED_WRITE.items() if knobs["num_splits"] > 1])
def test_fp8_split_launches_may_preload(small_key_tiles, attn_launches, monkeypatch, name):
    """decode_split_fp8's "preload" (the first key tile's older keys and values loaded before the PDL wait, as the
    16-bit split launches load theirs): the output and the cache bytes of the launch without it, bit for bit, over an
    fp8 cache (qlen-2 and -3 runs, sequences of no rows, padding with a slot, both merges, a sliding window)."""
    from mini_infer.ops import paged_attention as pa

    runs = []
    for preload in (0, 1):
        monkeypatch.setitem(pa._CONFIG, "decode_split_fp8", {**pa._CONFIG["decode_split_fp8"], "preload": preload})
        case, scales, knobs = fused_write_case(name, torch.bfloat16, True)
        args = (*case.args(), *scales)
        runs.append((paged_attention_triton(*args, **knobs), args[3], args[4]))
    (out, k_cache, v_cache), (out2, k_cache2, v_cache2) = runs
    assert [kwargs["PRELOAD"] for _, kwargs in attn_launches] == [False, True]
    assert same_bytes(out2, out) and same_bytes(k_cache2, k_cache) and same_bytes(v_cache2, v_cache)


@requires_triton
def test_register_cap_only_on_one_split_launches(small_key_tiles, attn_launches, monkeypatch):
    """An fp8 cache's decode kind with a register cap and 3 stages: its one-split launches (large batches) take both,
    its split launches (small batches: "decode_split_fp8") neither the cap nor more than 2 stages. Prefill-shaped
    launches of one kind, split then not: 2 stages, then the kind's 3, whatever launched first (the launch cache
    keeps the kind's shape, not a split launch's changes to it)."""
    from mini_infer.ops import paged_attention as pa

    monkeypatch.setitem(pa._CONFIG, "decode_fp8", {**pa._CONFIG["decode_fp8"], "num_stages": 3, "maxnreg": 128})
    monkeypatch.setitem(pa._CONFIG, "prefill_fp8", {**pa._CONFIG["prefill_fp8"], "num_stages": 3})
    for decode_only in (True, False):
        for splits in (4, 1, 4):
            case, scales, knobs = fused_write_case("qlen2_one_split_g4", torch.bfloat16, True)
            paged_attention_triton(*case.args(), *scales, **{**knobs, "num_splits": splits, "decode_only": decode_only})
    launched = [(kwargs["NUM_SPLITS"], kwargs["num_stages"], kwargs.get("maxnreg", 0)) for _, kwargs in attn_launches]
    assert launched == [(4, 2, 0), (1, 3, 128), (4, 2, 0), (4, 2, 0), (1, 3, 0), (4, 2, 0)]


@settings(max_examples=10, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(0, 20), st.integers(0, 9)), min_size=1, max_size=4),
    heads=st.sampled_from([(4, 2), (4, 1), (2, 2)]),
    block_size=st.sampled_from([4, 16]),
    sliding_window=st.sampled_from([0, 3, 8]),
    pad_tokens=st.integers(0, 2),
    seed=st.integers(0, 2**16),
)
def test_random_batches(lens, heads, block_size, sliding_window, pad_tokens, seed):
    seqs = [(c, n) if n else (0, 0) for c, n in lens]  # qlen 0 only as a padding sequence
    kw = dict(hq=heads[0], hkv=heads[1], block_size=block_size, sliding_window=sliding_window)
    case = make_case(seqs, pad_tokens=pad_tokens, seed=seed, **kw)
    expected = oracle(case)
    args = case.args()
    assert_close(paged_attention_reference(*[a.cpu() if torch.is_tensor(a) else a for a in args]), expected)
    if HAS_TRITON:
        out = paged_attention_triton(*args)
        assert_close(out, expected)
        check_cache(case, args[3], args[4])


def test_registered_op():
    case = make_case(**CASES["chunked_prefill"])
    args = case.args()
    out = torch.ops.mini_infer.paged_attention(*args)
    assert_close(out, oracle(case))
    check_cache(case, args[3], args[4])


def test_fake_impl():
    with FakeTensorMode():
        t, hq, hkv, d, dv = 7, 8, 2, 64, 32
        out = torch.ops.mini_infer.paged_attention(
            torch.empty(t, hq, d, dtype=torch.bfloat16),
            torch.empty(t, hkv, d, dtype=torch.bfloat16),
            torch.empty(t, hkv, dv, dtype=torch.bfloat16),
            torch.empty(10, 16, hkv, d, dtype=torch.bfloat16),
            torch.empty(10, 16, hkv, dv, dtype=torch.bfloat16),
            torch.empty(t, dtype=torch.int64),
            torch.empty(3, 4, dtype=torch.int32),
            torch.empty(3, dtype=torch.int32),
            torch.empty(4, dtype=torch.int32),
            0.125,
            0,
            0.0,
        )
    assert out.shape == (t, hq, dv) and out.dtype == torch.bfloat16


def test_opcheck():
    case = make_case(**CASES["chunked_prefill"], cache_fill=0.0, device="cpu")
    torch.library.opcheck(torch.ops.mini_infer.paged_attention.default, case.args())


@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and triton")
@pytest.mark.parametrize("num_splits", [1, 4])
def test_cuda_graph_capture_and_replay(num_splits):
    """The launch depends only on shapes: capture once, replay on batches with other lengths and slots (contexts
    up to 4 splits of 128-key tiles: the fused merge's counters must be zero again after each replay)."""
    shapes = dict(num_blocks=200, max_blocks=64, block_size=16, cache_fill=0.0)
    a = make_case([(7, 1), (12, 1), (0, 1), (20, 1)], seed=1, **shapes)
    b = make_case([(3, 1), (525, 1), (9, 1), (0, 0)], pad_tokens=1, seed=2, **shapes)  # same T
    c = make_case([(300, 1), (130, 1), (900, 1), (1, 1)], seed=3, **shapes)
    static = list(a.args())
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        paged_attention_triton(*static, num_splits=num_splits)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention_triton(*static, num_splits=num_splits)
    for case in (b, c, b):
        for dst, src in zip(static, case.args()):
            if torch.is_tensor(dst):
                dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, oracle(case))


@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="launch-size limits are a GPU matter")
@pytest.mark.parametrize("dtype,d", [(torch.float32, 128), (torch.bfloat16, 256), (torch.float16, 64)])
@pytest.mark.parametrize("seqs", [[(0, 150), (30, 70)], [(300, 1), (5, 1)]])
def test_triton_real_head_dims(dtype, d, seqs):
    case = make_case(seqs, hq=8, hkv=2, d=d, block_size=16, dtype=dtype)
    assert_close(paged_attention_triton(*case.args()), paged_attention_reference(*case.args()))


# --------------------------------------------------------------------------------------------------
# FP8 KV cache (float8_e4m3fn caches with per-layer k_scale / v_scale)
# --------------------------------------------------------------------------------------------------

FP8 = torch.float8_e4m3fn


def fp8_case(case: Case, headroom: float = 1.07):
    """`case` with float8_e4m3fn caches and its scales: amax(history) / (448 * headroom) per cache, so the
    largest ~7% of values saturate at +-448 (exercises the clamp). The prefix already in the cache is
    quantized as the write path would; never-written slots stay NaN."""
    from mini_infer.ops.paged_attention import _to_cache

    scales = []
    for hist in (case.hist_k, case.hist_v):
        amax = max(float(h.float().abs().max()) for h in hist if h.numel())
        scales.append(torch.tensor([amax / (448.0 * headroom)], dtype=torch.float32, device=case.q.device))
    k_cache = _to_cache(case.k_cache, torch.empty(0, dtype=FP8), scales[0])
    v_cache = _to_cache(case.v_cache, torch.empty(0, dtype=FP8), scales[1])
    return Case(**{**case.__dict__, "k_cache": k_cache, "v_cache": v_cache}), scales[0], scales[1]


def fp8_args(case: Case, k_scale, v_scale) -> tuple:
    return (*case.args(), k_scale, v_scale)


FP8_CASES = ["prefill", "chunked_prefill", "decode_gqa", "decode_mqa_bs16", "sliding_window", "softcap", "padding"]


@pytest.mark.parametrize("name", FP8_CASES)
def test_fp8_reference_is_attention_over_the_dequantized_cache(name):
    """Exact: the fp8 reference equals the reference run over fp32 caches holding cache * scale."""
    case, ks, vs = fp8_case(make_case(**CASES[name], dtype=torch.bfloat16, device="cpu"))
    args = fp8_args(case, ks, vs)
    out = paged_attention_reference(*args)  # writes this step's k/v into the fp8 caches first
    assert args[3].dtype == FP8 and args[4].dtype == FP8
    deq = list(case.args())
    deq[3], deq[4] = args[3].float() * ks, args[4].float() * vs
    deq[5] = torch.full_like(case.slot_mapping, -1)  # everything is in the caches already
    assert torch.equal(out, paged_attention_reference(*deq))


@pytest.mark.parametrize("name", ["chunked_prefill", "decode_gqa"])
def test_fp8_reference_close_to_unquantized(name):
    """e4m3 keeps 3 mantissa bits: the attention output stays within a few percent of the bf16 one."""
    base = make_case(**CASES[name], dtype=torch.float32, device="cpu")
    case, ks, vs = fp8_case(base, headroom=1.0)
    out = paged_attention_reference(*fp8_args(case, ks, vs))
    want = oracle(base)
    assert (out - want).norm() / want.norm() < 0.06


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_fp8_cache_write(impl):
    """The cache holds float8_e4m3fn (half the bytes of bf16) and, at every written position, exactly
    clamp(k / k_scale, +-448) rounded to nearest-even; other slots are untouched (NaN)."""
    if impl == "triton" and not HAS_TRITON:
        pytest.skip("triton is not installed")
    from mini_infer.ops.paged_attention import write_kv_cache_reference, write_kv_cache_triton

    case, ks, vs = fp8_case(make_case([(5, 7), (0, 9), (3, 1)], dtype=torch.bfloat16, block_size=4))
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    write = write_kv_cache_triton if impl == "triton" else write_kv_cache_reference
    write(case.k, case.v, k_cache, v_cache, case.slot_mapping, ks, vs)
    assert k_cache.dtype == FP8 and k_cache.nbytes * 2 == torch.empty(k_cache.shape, dtype=torch.bfloat16).nbytes
    bs = k_cache.shape[1]
    written = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    saturated = 0
    for s, (hk, hv) in enumerate(zip(case.hist_k, case.hist_v)):
        pos = torch.arange(hk.shape[0])
        blk, off = case.block_tables.cpu()[s, pos // bs].long(), pos % bs
        want_k = (hk.float() / ks.cpu()).clamp(-448, 448).to(FP8)
        want_v = (hv.float() / vs.cpu()).clamp(-448, 448).to(FP8)
        assert torch.equal(k_cache.cpu()[blk, off].view(torch.uint8), want_k.view(torch.uint8))
        assert torch.equal(v_cache.cpu()[blk, off].view(torch.uint8), want_v.view(torch.uint8))
        saturated += int((want_k.float().abs() == 448).sum())
        written[blk, off] = True
    assert saturated > 0
    assert k_cache.cpu()[~written].float().isnan().all() and v_cache.cpu()[~written].float().isnan().all()


def fp8_dot_way(monkeypatch, way):
    """Make every fp8 config feed fp8 tiles to the dots the `way` of paged_attention._FP8_DOT (None: as configured)."""
    from mini_infer.ops import paged_attention as pa

    if way is not None:
        for name in ("prefill_fp8", "decode_fp8"):
            monkeypatch.setitem(pa._CONFIG, name, {**pa._CONFIG[name], "fp8_dot": way})


FP8_WAYS = [w for w in _FP8_DOT if w != "fp8"]  # "q", "fp16", "fp16_vregs" (16-bit dots); "fp8": test_fp8_dots_*
FP8_WHOLE = [(torch.bfloat16, w) for w in FP8_WAYS] + [(torch.float32, None)]  # (q dtype, fp8 dot way)
# under the interpreter way "q" takes fp32 dots as an fp32 q does: the prefill tiles run it in decode_gqa's place
FP8_FP16_WAYS = [dw for dw in FP8_WHOLE if dw[1] != "q"]


@requires_triton
@pytest.mark.parametrize(
    "name,knobs,dtype,way",
    [("chunked_prefill", {}, *dw) for dw in FP8_FP16_WAYS]  # prefill tiles over a cached prefix and new rows
    + [("decode_gqa", {}, *dw) for dw in FP8_WHOLE]
    # (split-K over several splits, fp32 q: test_fp8_triton_split_k_long_decode)
    + [("window_softcap_g4", dict(num_splits=2), torch.bfloat16, None)],
)  # fmt: skip
def test_fp8_triton_matches_reference(monkeypatch, name, knobs, dtype, way):
    """Each way of feeding the fp8 tiles to 16-bit dots (q's dtype; fp16 dots; fp16 with V converted in
    registers) with a bf16 q, and fp32 dots with an fp32 q (way None: as configured). Under the interpreter the
    bf16 q of way "q" takes fp32 dots (its bf16 dot is wrong), the fp16 ways run their fp16 dots (products and sums
    in fp32 there)."""
    fp8_dot_way(monkeypatch, way)
    case, ks, vs = fp8_case(make_case(**CASES[name], dtype=dtype))
    args_t, args_r = fp8_args(case, ks, vs), fp8_args(case, ks, vs)
    out = paged_attention_triton(*args_t, **knobs)
    assert not out.isnan().any()
    args_r = [a.cpu() if torch.is_tensor(a) else a for a in args_r]  # the reference writes these caches
    assert_close(out, paged_attention_reference(*args_r))
    assert torch.equal(args_t[3].cpu().view(torch.uint8), args_r[3].view(torch.uint8))  # same bytes written
    assert torch.equal(args_t[4].cpu().view(torch.uint8), args_r[4].view(torch.uint8))


@requires_triton
def test_fp8_triton_split_k_long_decode(small_key_tiles):
    """Split-K decode over contexts spanning several splits with an fp8 cache, against the fp32 oracle of the
    dequantized history (the quantization error itself is not what this checks)."""
    base = make_case(SPLIT_SEQS, hq=4, hkv=2, block_size=4, seed=3, dtype=torch.float32)
    case, ks, vs = fp8_case(base)
    args = fp8_args(case, ks, vs)
    out = paged_attention_triton(*args, decode_only=True, num_splits=4)
    deq = Case(**{**case.__dict__,
                  "hist_k": [(h / ks.cpu()).clamp(-448, 448).to(FP8).float() * ks.cpu() for h in case.hist_k],
                  "hist_v": [(h / vs.cpu()).clamp(-448, 448).to(FP8).float() * vs.cpu() for h in case.hist_v]})
    assert_close(out, oracle(deq))


@requires_triton
def test_fp8_fp16_dots_saturate_q(monkeypatch):
    """fp16 dots take q saturated to +-65504 (fp16's largest finite value): a bf16 q beyond it gives the attention of
    the saturated q, not inf / NaN. (Both fp16 ways share the conversion of q.)"""
    fp8_dot_way(monkeypatch, "fp16")
    case, ks, vs = fp8_case(make_case(**CASES["decode_gqa"], dtype=torch.bfloat16))
    big = case.q.clone()
    big[:, 0, :4] = torch.tensor([1e5, -2e5, 7e4, 3.0], dtype=torch.bfloat16)
    args = list(fp8_args(case, ks, vs))
    args[0] = big
    out = paged_attention_triton(*args)
    args_r = [a.cpu() if torch.is_tensor(a) else a for a in fp8_args(case, ks, vs)]
    args_r[0] = big.cpu().float().clamp(-65504, 65504)  # in fp32: bf16 has no 65504
    assert_close(out, paged_attention_reference(*args_r).to(torch.bfloat16))


def _abs_v_args(args: list) -> list:
    """fp8 attention arguments with |v| for v: the new rows' |v| and the cache bytes without their sign bit (e4m3's
    rounding and saturation are symmetric, so these are the bytes of |v|; NaN stays NaN)."""
    args = list(args)
    args[2] = args[2].abs()
    args[4] = (args[4].view(torch.uint8) & 0x7F).view(FP8)
    return args


# (case, knobs, q magnitude): prefill tiles in one split and in several, decode tiles in several (16-key tiles; one of
# those sequences fits one split, whose rows are written directly), and q far
# above e4m3's 448 and far below its smallest normal 2**-6 (scale divided by the magnitude: the same scores)
FP8_DOT_CASES = [
    ("chunked_prefill", {}, 1e3),
    ("split_decode", dict(decode_only=True, num_splits=4), 1e-3),
    ("split_prefill", dict(decode_only=False, num_splits=3), 1.0),
]


@requires_triton
@pytest.mark.parametrize("name,knobs,q_mag", FP8_DOT_CASES)
def test_fp8_dots_within_e4m3_rounding(request, monkeypatch, name, knobs, q_mag):
    """Way "fp8" (e4m3 dots) against the reference, elementwise within bounds that follow from e4m3's 3 mantissa
    bits (relative rounding error up to u = 2**-4 of a normal value):
      * P: the kernel sums p_j * v_j with each p_j rounded (p * 256, normal for p >= 2**-14, else an absolute error
        up to 2**-18) but divides by the sum of the unrounded p_j, so against the reference run on the q the kernel
        used (q8 * q_scale, quant.py's per-row fp8 quantization of each (row, head)) an output element is off by at
        most u * sum_j w_j |v_j| + n_keys * 2**-18 * max|v|, where w are the softmax weights (the attention of |v|).
      * q: scores move by at most delta = scale * sum_i |q8 q_scale - q|_i * max_j |k_ji| per row, which moves each
        weight by a factor within e**(+-2 delta): against the reference on q itself the bound is
        (u + (e**(2 delta) - 1) e**(2 delta)) * sum_j w'_j |v_j| (+ the same subnormal term; w' the weights at
        q8 * q_scale, within e**(+-2 delta) of w).
    Plus the output's bf16 rounding (2**-7 relative: the interpreter truncates) and fp32 noise (1e-5). Dropping the
    q scale from the scores (or quantizing q without one: q beyond 448 saturates, q below 2**-6 loses its bits)
    breaks the first bound by orders of magnitude."""
    from mini_infer.ops import paged_attention as pa
    from mini_infer.ops.quant import quantize_per_token_reference

    fp8_dot_way(monkeypatch, "fp8")
    monkeypatch.setattr(pa, "_LAUNCH_OK", {})
    if name.startswith("split"):
        request.getfixturevalue("small_key_tiles")
        seqs = SPLIT_SEQS if name == "split_decode" else [(30, 9), (60, 1), (0, 4)]
        base = make_case(seqs, hq=4, hkv=2, block_size=4, seed=3, dtype=torch.bfloat16)
    else:
        base = make_case(**CASES[name], dtype=torch.bfloat16)
    base = Case(**{**base.__dict__, "q": (base.q.float() * q_mag).to(torch.bfloat16), "scale": base.scale / q_mag})
    case, ks, vs = fp8_case(base)
    out = paged_attention_triton(*fp8_args(case, ks, vs), **knobs).float().cpu()
    assert not out.isnan().any()
    assert all(shape[1] >= 32 for shape in pa._LAUNCH_OK.values())  # Triton's fp8 dots reduce over >= 32 on CUDA

    args_r = [a.cpu() if torch.is_tensor(a) else a for a in fp8_args(case, ks, vs)]
    want = paged_attention_reference(*args_r).float()  # also writes the caches the bounds read
    t, hq, d = case.q.shape
    q8, q_scale = quantize_per_token_reference(args_r[0].float(), FP8)  # per (row, head) over d
    q_used = q8.float() * q_scale
    at_q_used = paged_attention_reference(q_used, *args_r[1:])
    weighted_abs_v = paged_attention_reference(q_used, *_abs_v_args(args_r)[1:])
    k_cache, v_cache = args_r[3].float().nan_to_num(0.0), args_r[4].float().nan_to_num(0.0)
    ks, vs = ks.cpu(), vs.cpu()
    k_max = k_cache.abs().amax(dim=(0, 1)) * ks  # [Hkv, D]
    delta = case.scale * ((q_used - args_r[0].float()).abs() * k_max.repeat_interleave(hq // k_max.shape[0], 0)).sum(-1)
    n_keys = int(case.seq_lens.max())
    subnormal = n_keys * 2.0**-18 * float(v_cache.abs().max() * vs)
    u = 2.0**-4
    p_bound = u * weighted_abs_v + subnormal + 2.0**-7 * at_q_used.abs() + 1e-5
    assert ((out - at_q_used).abs() <= p_bound).all(), float(((out - at_q_used).abs() / p_bound).max())
    growth = torch.exp(2 * delta)[..., None]  # sum_j w_j |v_j| at q is at most growth times that at q_used
    bound = (u + (growth - 1) * growth) * weighted_abs_v + subnormal + 2.0**-7 * want.abs() + 1e-5
    assert ((out - want).abs() <= bound).all(), float(((out - want).abs() / bound).max())


def test_fp8_scale_arguments_are_checked():
    case = make_case(**CASES["decode_gqa"], device="cpu")
    one = torch.ones(1)
    with pytest.raises(ValueError, match="k_scale/v_scale apply to float8_e4m3fn caches only"):
        paged_attention_reference(*case.args(), one, one)
    c8, ks, vs = fp8_case(case)
    with pytest.raises(ValueError, match="need k_scale as an fp32 tensor of one element, got None"):
        paged_attention_reference(*c8.args())
    with pytest.raises(ValueError, match="need v_scale"):
        paged_attention_reference(*c8.args(), ks, torch.ones(2))
    mixed = list(c8.args())
    mixed[4] = case.v_cache.clone()
    with pytest.raises(ValueError, match="both caches float8_e4m3fn"):
        paged_attention_reference(*mixed, ks, vs)


def test_fp8_registered_op_positional_scales_and_fake():
    case, ks, vs = fp8_case(make_case(**CASES["chunked_prefill"], dtype=torch.bfloat16))
    args = fp8_args(case, ks, vs)
    out = torch.ops.mini_infer.paged_attention(*args)  # scales positional, as the attention pass passes them
    assert_close(out, paged_attention_reference(*fp8_args(case, ks, vs)))
    assert args[3].dtype == FP8
    with FakeTensorMode():
        fake = torch.ops.mini_infer.paged_attention(
            torch.empty(7, 8, 64, dtype=torch.bfloat16), torch.empty(7, 2, 64, dtype=torch.bfloat16),
            torch.empty(7, 2, 32, dtype=torch.bfloat16), torch.empty(10, 16, 2, 64, dtype=FP8),
            torch.empty(10, 16, 2, 32, dtype=FP8), torch.empty(7, dtype=torch.int64),
            torch.empty(3, 4, dtype=torch.int32), torch.empty(3, dtype=torch.int32), torch.empty(4, dtype=torch.int32),
            0.125, 0, 0.0, torch.empty(1), torch.empty(1))
        assert fake.shape == (7, 8, 32) and fake.dtype == torch.bfloat16


def test_fp8_opcheck():
    case, ks, vs = fp8_case(make_case(**CASES["chunked_prefill"], cache_fill=0.0, device="cpu"))
    # test_schema is left out: its checker multiplies the inputs, which CPU torch lacks for float8_e4m3fn
    torch.library.opcheck(torch.ops.mini_infer.paged_attention.default, fp8_args(case, ks, vs),
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("n_seqs,heads,capacity,expected", [
    (1, 8, 400, 8),      # batch 1, a short table: 8 splits (was 2 under the capacity / 256 bound)
    (1, 8, 4096, 16),    # a long table: 16
    (1, 4, 40960, 16),   # at most 16
    (8, 8, 4096, 8),     # 64 programs: 2 x 132 / 64 -> 5 -> 8
    (32, 8, 4096, 1),    # programs fill the GPU: no split
])
def test_default_num_splits_policy(monkeypatch, n_seqs, heads, capacity, expected):
    from types import SimpleNamespace

    from mini_infer.ops import _split_k

    monkeypatch.setattr(_split_k, "num_sms", lambda index: 132)
    q = SimpleNamespace(is_cuda=True, device=SimpleNamespace(index=0))
    assert _split_k.default_num_splits(q, n_seqs, heads, capacity) == expected


def stored_as(cache: torch.Tensor, **layout) -> torch.Tensor:
    """The same values in a tensor allocated as `CacheTensor(**layout)` allocates one (the usual [blocks, block_size,
    H, D] view of another storage order)."""
    from mini_infer.contract.caches import CacheTensor

    nb, bs = cache.shape[:2]
    return CacheTensor("cache", tuple(cache.shape[2:]), cache.dtype, **layout).zeros(nb, bs, cache.device).copy_(cache)


def keys_contiguous(cache: torch.Tensor) -> torch.Tensor:
    """The same values stored tokens-contiguous ([blocks, H, D, block_size] under the [blocks, block_size, H, D]
    view), as a V cache of `CacheTensor(keys_contiguous=True)` is."""
    return stored_as(cache, keys_contiguous=True)


V_KEYS_CASES = [("decode_gqa", {}), ("decode_gqa", dict(decode_only=True, num_splits=3)), ("chunked_prefill", {}),
                ("prefill", {}), ("window_softcap_g4", dict(num_splits=2)), ("split_long", dict(num_splits=4)),
                ("split_long", dict(num_splits=1))]


@requires_triton
@pytest.mark.parametrize("tiles", [1, 2, 3])
@pytest.mark.parametrize("name,knobs", V_KEYS_CASES)
def test_fp8_v_keys_contiguous_cache(small_key_tiles, attn_launches, monkeypatch, name, knobs, tiles):
    """An fp8 V cache stored tokens-contiguous (FP8_V_KEYS_CONTIGUOUS), read each way of V_KEYS_TILES (whole key
    tiles with no per-key mask then the last partial one; whole blocks, the keys past the range zeroed, or not): the
    same output bits and the same cache bytes as the usual layout, and the reference over it agrees too. 16-key tiles:
    the contexts span whole tiles and partial ones, in one split or several. (Never-written slots hold e4m3 NaN,
    which the interpreter reads as 480: the next test shows, over a 16-bit cache, that no NaN past the keys
    reaches the output. Way 3 takes the layout's rule that its cache never holds NaN, so its case's never-written
    slots are zeros, as an engine's cache starts: on a GPU a NaN there reaches the output, by design.)"""
    from mini_infer.ops import paged_attention as pa

    monkeypatch.setattr(pa, "V_KEYS_TILES", tiles)
    spec = dict(seqs=SPLIT_SEQS, hq=4, hkv=2, block_size=4, seed=3) if name == "split_long" else CASES[name]
    fill = {"cache_fill": 0.0} if tiles == 3 else {}
    case, ks, vs = fp8_case(make_case(**{**spec, "dtype": torch.bfloat16, **fill}))
    usual, keys = fp8_args(case, ks, vs), list(fp8_args(case, ks, vs))
    keys[4] = keys_contiguous(keys[4])
    assert pa.v_keys_contiguous(keys[4]) and not pa.v_keys_contiguous(usual[4])
    out = paged_attention_triton(*keys, **knobs)
    assert attn_launches and all(kw["V_TILES"] == tiles for _, kw in attn_launches)
    n_keys_launches = len(attn_launches)
    assert not out.isnan().any()
    assert torch.equal(out, paged_attention_triton(*usual, **knobs))
    assert not any(kw["V_TILES"] for _, kw in attn_launches[n_keys_launches:])
    assert torch.equal(keys[3].view(torch.uint8), usual[3].view(torch.uint8))
    assert torch.equal(keys[4].contiguous().view(torch.uint8), usual[4].view(torch.uint8))
    cpu = [a.cpu() if torch.is_tensor(a) else a for a in fp8_args(case, ks, vs)]
    cpu_keys = list(cpu)
    cpu_keys[4] = keys_contiguous(cpu[4])
    assert torch.equal(paged_attention_reference(*cpu_keys), paged_attention_reference(*cpu))


@requires_triton
@pytest.mark.parametrize("tiles", [1, 2])
@pytest.mark.parametrize("name,knobs", [("split_long", dict(num_splits=1)), ("chunked_prefill", {})])
def test_v_keys_contiguous_never_reads_a_nan_past_the_keys(small_key_tiles, monkeypatch, name, knobs, tiles):
    """A 16-bit cache stored so (the layout is the fp8 cache's, the kernel takes any dtype): its never-written slots
    hold NaN, and the blocks' slots past a sequence's last key must not reach the output (p = 0 does not cancel a
    NaN: V_KEYS_TILES 2 zeroes them; way 3 relies on the layout never holding NaN, next test). fp8 cannot show it
    under the interpreter, which converts e4m3's NaN to 480."""
    from mini_infer.ops import paged_attention as pa

    monkeypatch.setattr(pa, "V_KEYS_TILES", tiles)
    spec = dict(seqs=SPLIT_SEQS, hq=4, hkv=2, block_size=4, seed=3) if name == "split_long" else CASES[name]
    case = make_case(**{**spec, "dtype": torch.bfloat16})
    usual, keys = case.args(), list(case.args())
    keys[4] = keys_contiguous(keys[4])
    assert keys[4].isnan().any()
    out = paged_attention_triton(*keys, **knobs)
    assert not out.isnan().any()
    assert torch.equal(out, paged_attention_triton(*usual, **knobs))


@requires_triton
@pytest.mark.parametrize("writer", ["write_kernel", "decode_kernel", "reference"])
def test_v_keys_contiguous_cache_never_holds_nan(writer):
    """What V_KEYS_TILES 3 relies on: every write into a tokens-contiguous V cache stores NaN as 0 (the write kernel,
    the decode kernel's own write, the reference's), where the usual layout keeps the NaN; other values as ever. A
    16-bit cache: the interpreter reads e4m3's NaN as 480."""
    from mini_infer.ops.paged_attention import _triton_attention, write_kv_cache_triton

    case = make_case(**CASES["decode_gqa"], dtype=torch.bfloat16, cache_fill=0.0)
    v = case.v.clone()
    v[1, 0, 3] = float("nan")
    usual_v, keys_v = case.v_cache.clone(), keys_contiguous(case.v_cache)
    for vc in (usual_v, keys_v):
        kc = case.k_cache.clone()
        if writer == "write_kernel":
            write_kv_cache_triton(case.k, v, kc, vc, case.slot_mapping)
        elif writer == "decode_kernel":
            _triton_attention(case.q, kc, vc, case.block_tables, case.seq_lens, case.query_start_loc, case.scale, 0,
                              0.0, None, None, new_kv=(case.k, v, case.slot_mapping), decode_only=True)
        else:
            write_kv_cache_reference(case.k, v, kc, vc, case.slot_mapping)
    slot = int(case.slot_mapping[1])
    blk, off = slot // case.k_cache.shape[1], slot % case.k_cache.shape[1]
    assert usual_v[blk, off, 0, 3].isnan() and keys_v[blk, off, 0, 3] == 0
    keys_v[blk, off, 0, 3] = float("nan")
    assert torch.equal(keys_v.contiguous().isnan(), usual_v.isnan())
    assert torch.equal(keys_v.contiguous().nan_to_num(), usual_v.nan_to_num())


@requires_triton
def test_fp8_v_keys_contiguous_write_kernel():
    """The write kernel stores into a tokens-contiguous V cache the bytes it stores into the usual layout."""
    from mini_infer.ops.paged_attention import write_kv_cache_triton

    case, ks, vs = fp8_case(make_case(**CASES["chunked_prefill"], dtype=torch.bfloat16))
    kc, vc = case.k_cache.clone(), case.v_cache.clone()
    kc2, vc2 = case.k_cache.clone(), keys_contiguous(case.v_cache)
    write_kv_cache_triton(case.k, case.v, kc, vc, case.slot_mapping, ks, vs)
    write_kv_cache_triton(case.k, case.v, kc2, vc2, case.slot_mapping, ks, vs)
    assert torch.equal(vc2.contiguous().view(torch.uint8), vc.view(torch.uint8))
    assert torch.equal(kc2.view(torch.uint8), kc.view(torch.uint8))


def test_cache_layouts_the_kernels_refuse():
    """A K cache must have unit stride along its last dim, a V cache along its last dim or its block's tokens."""
    from mini_infer.ops.paged_attention import check_cache_layout

    k = torch.zeros(4, 16, 2, 8)
    check_cache_layout(k, keys_contiguous(k))
    with pytest.raises(ValueError, match="unit stride"):
        check_cache_layout(keys_contiguous(k), k)
    with pytest.raises(ValueError, match="unit stride"):
        check_cache_layout(k, torch.zeros(4, 16, 8, 2).transpose(2, 3))  # heads innermost: neither


@pytest.mark.parametrize("text", ["3", "x", "-1", ""])
def test_layout_switches_refuse_a_value_outside_their_choices(monkeypatch, text):
    """MINI_INFER_FP8_V_KEYS_CONTIGUOUS (0, 1, 2) read at import: anything else is an error naming the variable."""
    from mini_infer.ops import paged_attention as pa

    monkeypatch.setenv("MINI_INFER_FP8_V_KEYS_CONTIGUOUS", text)
    with pytest.raises(ValueError, match="MINI_INFER_FP8_V_KEYS_CONTIGUOUS=.*one of 0, 1, 2"):
        pa._env_choice("MINI_INFER_FP8_V_KEYS_CONTIGUOUS", "1", (0, 1, 2))
    monkeypatch.setenv("MINI_INFER_FP8_V_KEYS_CONTIGUOUS", "2")
    assert pa._env_choice("MINI_INFER_FP8_V_KEYS_CONTIGUOUS", "1", (0, 1, 2)) == 2
