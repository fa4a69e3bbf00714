"""qk_rotary_kv_write and paged_attention_cached, the two ops FuseKVWrite puts in place of qk_rotary + paged_attention.

qk_rotary_kv_write: its q_out and the bytes it leaves in the caches equal what qk_rotary then paged_attention's
cache write leave (bitwise: the Triton kernel against the two Triton kernels under the interpreter, the reference
against the two references), for fp32 / bf16, with and without the Qwen3 head norms, an fp8 cache, padding slots
(-1) and B = 2; the caches start as NaN, so a write to any slot the unfused pair leaves alone shows.
paged_attention_cached over caches that already hold the step's keys equals paged_attention (which writes them
first) bit for bit, on the reference, the Triton kernel and the long-prefill route.
"""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from mini_infer.ops import _prefill_sdpa
from mini_infer.ops import paged_attention as pa
from mini_infer.ops.qk_rotary import qk_rotary_reference, qk_rotary_triton
from mini_infer.ops.qk_rotary_kv_write import qk_rotary_kv_write_reference, qk_rotary_kv_write_triton
from tests.ops.helpers import DEVICE, assert_close, requires_triton
from tests.ops.test_paged_attention import CASES, fp8_case, make_case

FP8 = torch.float8_e4m3fn
EPS = 1e-6
BLOCK_SIZE = 4
# name -> (dtype, fp8 cache, head norms, B, (Hq, Hk), Dv)
WRITE_CASES = {
    "fp32_norms": (torch.float32, False, True, 1, (4, 2), 32),
    "fp32_fp8": (torch.float32, True, False, 1, (4, 1), 32),
    "bf16_norms": (torch.bfloat16, False, True, 1, (4, 2), 32),
    "bf16_b2_mha_dv": (torch.bfloat16, False, False, 2, (3, 3), 16),
    "bf16_norms_fp8": (torch.bfloat16, True, True, 1, (4, 2), 32),
}


def _write_inputs(name: str, t: int = 6, d: int = 32, device: str = DEVICE):
    """Op arguments (q, k, v as HF's transposed views; caches full of NaN; slots shuffled over the cache, two
    tokens padding) for a WRITE_CASES entry."""
    dtype, fp8, norms, b, (hq, hk), dv = WRITE_CASES[name]
    gen = torch.Generator().manual_seed(len(name))

    def rand(*shape, scale=3.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)

    q, k, v = rand(b, t, hq, d).transpose(1, 2), rand(b, t, hk, d).transpose(1, 2), rand(b, t, hk, dv).transpose(1, 2)
    qw, kw = (rand(d, scale=0.2) + 1 if norms else None for _ in range(2))
    pos = 3 + torch.arange(t, dtype=torch.float32) + 7 * torch.arange(b, dtype=torch.float32)[:, None]
    emb = pos[..., None] / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    emb = torch.cat((emb, emb), -1)[:, None]  # [B, 1, T, D]
    cos, sin = emb.cos().to(dtype).to(device), emb.sin().to(dtype).to(device)
    blocks = -(-b * t // BLOCK_SIZE) + 2
    slots = torch.randperm(blocks * BLOCK_SIZE, generator=gen)[: b * t]
    slots[[1, b * t - 1]] = -1  # CUDA-graph padding rows
    cache_dtype = FP8 if fp8 else dtype
    k_cache = torch.full((blocks, BLOCK_SIZE, hk, d), float("nan")).to(cache_dtype).to(device)
    v_cache = torch.full((blocks, BLOCK_SIZE, hk, dv), float("nan")).to(cache_dtype).to(device)
    scales = [torch.tensor([s], device=device) for s in (0.05, 0.02)] if fp8 else [None, None]
    return [q, k, v, cos, sin, qw, kw, EPS, k_cache, v_cache, slots.to(device), *scales]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _unfused(args, rotary, write):
    """qk_rotary then paged_attention's cache write (of k_out and v as packed tokens), on copies of the caches."""
    q, k, v, cos, sin, qw, kw, eps, k_cache, v_cache, slots, k_scale, v_scale = args
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    q_out, k_out = rotary(q, k, cos, sin, qw, kw, eps)
    packed = [x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3]) for x in (k_out, v)]
    write(*packed, k_cache, v_cache, slots, k_scale, v_scale)
    return q_out, k_cache, v_cache


def _fused(args, op):
    args = list(args)
    args[8], args[9] = args[8].clone(), args[9].clone()
    return op(*args), args[8], args[9]


def _assert_same_bits(fused, unfused, slots):
    (q_out, k_cache, v_cache), (want_q, want_k, want_v) = fused, unfused
    assert torch.equal(q_out, want_q)
    assert torch.equal(_bits(k_cache), _bits(want_k)) and torch.equal(_bits(v_cache), _bits(want_v))
    written = ~k_cache.float().isnan().flatten(0, 1).all(-1).all(-1)  # [slots]: the rows that were written
    assert int(written.sum()) == int((slots >= 0).sum())  # padding rows wrote nothing
    assert not v_cache.float().isnan().flatten(0, 1)[written].any()  # every written token got its v row


@pytest.mark.parametrize("name", list(WRITE_CASES))
def test_reference_equals_qk_rotary_then_write(name):
    args = _write_inputs(name, device="cpu")
    fused = _fused(args, qk_rotary_kv_write_reference)
    _assert_same_bits(fused, _unfused(args, qk_rotary_reference, pa.write_kv_cache_reference), args[10])


@requires_triton
@pytest.mark.parametrize("name", list(WRITE_CASES))
def test_triton_equals_the_two_kernels_bitwise(name):
    """The one launch leaves the bits that qk_rotary's kernel then the KV-write kernel leave."""
    args = _write_inputs(name)
    fused = _fused(args, qk_rotary_kv_write_triton)
    _assert_same_bits(fused, _unfused(args, qk_rotary_triton, pa.write_kv_cache_triton), args[10])


@requires_triton
@pytest.mark.parametrize("name", ["fp32_norms", "bf16_b2_mha_dv"])
def test_triton_close_to_reference(name):
    args = _write_inputs(name)
    got, want = _fused(args, qk_rotary_kv_write_triton), _fused(args, qk_rotary_kv_write_reference)
    for a, b in zip(got, want):
        assert torch.equal(a.isnan(), b.isnan())
        assert_close(a.nan_to_num(), b.nan_to_num())


def test_registered_op_fake_and_opcheck():
    args = _write_inputs("bf16_norms_fp8", device="cpu")
    out, k_cache, _ = _fused(args, torch.ops.mini_infer.qk_rotary_kv_write)
    assert torch.equal(out, qk_rotary_reference(*args[:2], *args[3:8])[0])
    assert not k_cache.float().isnan().all()
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        out = torch.ops.mini_infer.qk_rotary_kv_write(*fake)
    assert out.shape == args[0].shape and out.dtype == torch.bfloat16
    args = _write_inputs("fp32_norms", device="cpu")
    args[8], args[9] = args[8].nan_to_num(0.0), args[9].nan_to_num(0.0)
    torch.library.opcheck(torch.ops.mini_infer.qk_rotary_kv_write.default, args)


# -- paged_attention_cached --------------------------------------------------------------------------------------


def _attention_pair(case, impl: str, scales=()):
    """(paged_attention's output, paged_attention_cached's after the same write into fresh caches)."""
    args = (*case.args(), *scales)
    q, k, v, k_cache, v_cache, slots, *meta = args
    entry = pa.paged_attention_triton_entry if impl == "triton" else pa.paged_attention_reference_entry
    cached = pa.paged_attention_cached_triton_entry if impl == "triton" else pa.paged_attention_cached_reference_entry
    write = pa.write_kv_cache_triton if impl == "triton" else pa.write_kv_cache_reference
    want = entry(*args)
    k_cache2, v_cache2 = case.args()[3:5]
    write(k, v, k_cache2, v_cache2, slots, *scales)
    return want, cached(q, k_cache2, v_cache2, *meta)


@pytest.mark.parametrize("name", ["chunked_prefill", "decode_gqa", "sliding_window", "softcap", "padding"])
def test_cached_equals_paged_attention_reference(name):
    want, got = _attention_pair(make_case(**CASES[name], device="cpu"), "reference")
    assert torch.equal(got, want)


@requires_triton
@pytest.mark.parametrize("name", ["chunked_prefill", "decode_gqa"])
def test_cached_equals_paged_attention_triton(name):
    want, got = _attention_pair(make_case(**CASES[name]), "triton")
    assert torch.equal(got, want)


@pytest.mark.parametrize("impl", ["reference", pytest.param("triton", marks=requires_triton)])
def test_cached_fp8(impl):
    case = make_case(**CASES["chunked_prefill"], device="cpu" if impl == "reference" else DEVICE)
    case, k_scale, v_scale = fp8_case(case)
    want, got = _attention_pair(case, impl, (k_scale, v_scale))
    assert torch.equal(got, want)


def test_cached_long_run_route_reads_the_new_keys_from_the_cache(monkeypatch):
    """Forced route (8 rows): the runs of 20 and 9 rows go through the fused SDPA, their new keys gathered from the
    cache after their context; the output equals paged_attention's, which passes its k/v rows instead."""
    monkeypatch.setattr(_prefill_sdpa, "ROUTE", "on")
    monkeypatch.setattr(_prefill_sdpa, "MIN_QUERY_ROWS", 8)
    runs = []
    attend_run = _prefill_sdpa.attend_run

    def spy(q, k, *rest):
        runs.append(k.shape[0])
        return attend_run(q, k, *rest)

    monkeypatch.setattr(_prefill_sdpa, "attend_run", spy)
    case = make_case([(13, 20), (6, 1), (0, 9)], hq=4, hkv=2, device="cpu")
    want, got = _attention_pair(case, "reference")
    assert runs == [20, 9, 20, 9]  # both ops took the route, for the same runs
    assert torch.equal(got, want)


def test_cached_registered_op_mutates_nothing():
    case = make_case(**CASES["chunked_prefill"], cache_fill=0.0, device="cpu")
    q, k, v, k_cache, v_cache, slots, *meta = case.args()
    pa.write_kv_cache_reference(k, v, k_cache, v_cache, slots)
    torch.library.opcheck(torch.ops.mini_infer.paged_attention_cached.default, (q, k_cache, v_cache, *meta))


@requires_triton
@pytest.mark.parametrize("name", ["fp32_fp8", "bf16_norms_fp8"])
def test_triton_into_a_tokens_contiguous_v_cache(name):
    """Into a V cache stored tokens-contiguous (paged_attention.FP8_V_KEYS_CONTIGUOUS) the launch leaves the bytes it
    leaves in the usual layout."""
    from tests.ops.test_paged_attention import keys_contiguous

    args = _write_inputs(name)
    keys = list(args)
    keys[9] = keys_contiguous(args[9])
    q_usual, k_usual, v_usual = _fused(args, qk_rotary_kv_write_triton)
    q_keys, k_keys, v_keys = _fused(keys, qk_rotary_kv_write_triton)
    assert v_keys.stride(1) == 1
    assert torch.equal(q_keys, q_usual) and torch.equal(_bits(k_keys), _bits(k_usual))
    assert torch.equal(_bits(v_keys.contiguous()), _bits(v_usual))


@requires_triton
def test_triton_stores_no_nan_in_a_tokens_contiguous_v_cache():
    """A tokens-contiguous V cache never holds NaN (paged_attention.V_KEYS_TILES 3 relies on it): a NaN of v is stored
    as 0 there, kept in the usual layout."""
    from tests.ops.test_paged_attention import keys_contiguous

    args = _write_inputs("bf16_b2_mha_dv")
    args[2] = args[2].clone()
    args[2][0, 0, 0, 1] = float("nan")  # v [B, Hk, T, Dv]: token 0 of batch 0, head 0
    args[9] = torch.zeros_like(args[9])
    keys = list(args)
    keys[9] = keys_contiguous(args[9])
    _, _, v_usual = _fused(args, qk_rotary_kv_write_triton)
    _, _, v_keys = _fused(keys, qk_rotary_kv_write_triton)
    slot = int(args[10][0])
    blk, off = slot // v_usual.shape[1], slot % v_usual.shape[1]
    assert v_usual[blk, off, 0, 1].isnan() and v_keys[blk, off, 0, 1] == 0
    assert v_usual.isnan().sum() == 1 and not v_keys.isnan().any()
