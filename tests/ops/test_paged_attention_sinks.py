"""paged_attention with attention sinks (GPT-OSS's `s_aux`: one logit a query head in every row's softmax, its
probability dropped): the reference against a direct float64 eager formula (GPT-OSS's eager code: the sink
concatenated to each row's scores, softmax, the sink's column dropped), the Triton kernel (interpreter) against the
reference for decode (the write in the kernel), split-K decode (the fused merge and the reduce kernel), prefill,
chunked prefill and mixed steps, sliding windows, GQA groups, fp32 / bf16 and an fp8 cache; sinks of -inf leave the
output without sinks (the kernel: bit for bit), a launch without sinks is the kernel without the switch, the
long-run route applies them (with and without a context), `paged_attention_cached` takes them too, and the registered op takes them
positionally after the (None) scales, as the attention pass emits them. Cases are test_paged_attention's (shuffled
block tables, NaN in every slot the op must not read).
"""

import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from mini_infer.ops import _prefill_sdpa
from mini_infer.ops import paged_attention as pa
from mini_infer.ops.paged_attention import (
    paged_attention_cached_reference,
    paged_attention_cached_triton,
    paged_attention_reference,
    paged_attention_triton,
)
from tests.ops.helpers import DEVICE, assert_close, record_kernel_launches, requires_triton
from tests.ops.test_paged_attention import (  # small_key_tiles: a fixture (16-key tiles, several splits)
    CASES,
    DECODE_G7,
    FUSED_WRITE,
    SPLIT_SEQS,
    Case,
    check_cache,
    fp8_args,
    fp8_case,
    make_case,
    small_key_tiles,  # noqa: F401
)


def sinks_for(case: Case, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[Hq] sinks of the size of the scores (normal(0, 2)): each moves its rows by a visible amount."""
    gen = torch.Generator().manual_seed(100 + seed)
    return (torch.randn(case.q.shape[1], generator=gen) * 2).to(dtype).to(case.q.device)


def eager_oracle(case: Case, sinks: torch.Tensor) -> torch.Tensor:
    """GPT-OSS's eager attention per sequence and head in float64, over the full contiguous K/V history:
    cat([scores, sink]) - max, softmax, the sink's column dropped, @ V."""
    t, hq, _ = case.q.shape
    hkv, dv = case.hist_v[0].shape[1], case.hist_v[0].shape[2]
    g = hq // hkv
    out = torch.zeros(t, hq, dv, dtype=torch.float64)
    sinks = sinks.cpu().double()
    q0 = 0
    for (cached, new), hk, hv in zip(case.seqs, case.hist_k, case.hist_v):
        if new == 0:
            continue
        ctx = cached + new
        qpos, kpos = torch.arange(cached, ctx)[:, None], torch.arange(ctx)[None, :]
        visible = kpos <= qpos
        if case.sliding_window > 0:
            visible &= (qpos - kpos) < case.sliding_window
        for h in range(hq):
            qh = case.q[q0 : q0 + new, h].cpu().double()
            kh, vh = hk[:, h // g].double(), hv[:, h // g].double()
            sc = qh @ kh.T * case.scale
            if case.softcap > 0:
                sc = case.softcap * torch.tanh(sc / case.softcap)
            sc = sc.masked_fill(~visible, float("-inf"))
            combined = torch.cat([sc, sinks[h].expand(new, 1)], dim=-1)
            combined = combined - combined.max(dim=-1, keepdim=True).values
            out[q0 : q0 + new, h] = torch.softmax(combined, dim=-1)[:, :-1] @ vh
        q0 += new
    return out.to(case.q.dtype)


def with_sinks(case: Case, sinks: torch.Tensor, scales: tuple = (None, None)) -> tuple:
    """The op's positional arguments with fresh caches and `sinks` last (after the scales, None for a 16-bit cache)."""
    return (*case.args(), *scales, sinks)


@pytest.mark.parametrize("name", list(CASES))
def test_reference_matches_eager_formula(name):
    case = make_case(**CASES[name], device="cpu")
    sinks = sinks_for(case)
    args = with_sinks(case, sinks)
    out = paged_attention_reference(*args)
    assert_close(out, eager_oracle(case, sinks))
    check_cache(case, args[3], args[4])
    assert not torch.allclose(out, paged_attention_reference(*case.args()), atol=1e-3)  # the sinks matter


def test_reference_takes_any_float_dtype_as_fp32():
    case = make_case(**CASES["decode_gqa"], dtype=torch.bfloat16, device="cpu")
    sinks = sinks_for(case, dtype=torch.bfloat16)
    out = paged_attention_reference(*with_sinks(case, sinks))
    assert torch.equal(out, paged_attention_reference(*with_sinks(case, sinks.float())))
    assert_close(out, eager_oracle(case, sinks))


# (name, make_case kwargs, knobs, q / cache dtype): every kind of launch the kernel makes, with sinks
TRITON = [
    ("decode_write_in_kernel", CASES["decode_gqa"], {}, torch.float32),
    ("decode_bf16", CASES["decode_gqa"], {}, torch.bfloat16),
    ("decode_g7", DECODE_G7, {}, torch.bfloat16),
    ("decode_mqa_bs16", CASES["decode_mqa_bs16"], {}, torch.float32),
    ("split_k_fused_merge", dict(seqs=SPLIT_SEQS, seed=3, pad_tokens=1), dict(decode_only=True, num_splits=4),
     torch.float32),
    ("split_k_reduce_kernel", dict(seqs=SPLIT_SEQS, seed=3, pad_tokens=1),
     dict(decode_only=True, num_splits=4, fused_merge=False), torch.float32),
    ("split_k_bf16", dict(seqs=SPLIT_SEQS, seed=3), dict(decode_only=True, num_splits=4), torch.bfloat16),
    ("split_qlen2", *FUSED_WRITE["qlen2_splits"], torch.float32),  # decode tiles of a 2-token run, 4 splits
    ("prefill", CASES["prefill"], {}, torch.float32),
    ("prefill_bf16", CASES["prefill"], {}, torch.bfloat16),
    ("chunked_prefill_mixed", CASES["chunked_prefill"], {}, torch.float32),  # cached prefixes, chunks and a decode
    ("padding_mixed", CASES["padding"], {}, torch.bfloat16),  # rows no sequence owns stay zero
    ("prefill_tiles_split", dict(seqs=[(30, 9), (60, 1), (0, 4)], seed=5), dict(decode_only=False, num_splits=3),
     torch.float32),
    ("sliding_window", CASES["sliding_window"], {}, torch.float32),
    ("window_split_decode", *FUSED_WRITE["window_qlen3"], torch.bfloat16),
    ("window_softcap_g4", CASES["window_softcap_g4"], dict(num_splits=2), torch.float32),
]


@requires_triton
@pytest.mark.usefixtures("small_key_tiles")
@pytest.mark.parametrize("name,case_kw,knobs,dtype", TRITON, ids=[c[0] for c in TRITON])
def test_triton_matches_reference(name, case_kw, knobs, dtype):
    case = make_case(**case_kw, dtype=dtype)
    sinks = sinks_for(case, seed=len(name))
    args = with_sinks(case, sinks)
    out = paged_attention_triton(*args, **knobs)
    assert not out.isnan().any()
    ref = paged_attention_reference(*[a.cpu() if torch.is_tensor(a) else a for a in with_sinks(case, sinks)])
    assert_close(out, ref.to(out.device))
    assert_close(out, eager_oracle(case, sinks).to(out.device))
    check_cache(case, args[3], args[4])


@requires_triton
@pytest.mark.usefixtures("small_key_tiles")
@pytest.mark.parametrize("name,knobs", [("chunked_prefill", {}), ("decode_gqa", dict(num_splits=3))])
def test_triton_fp8_cache(name, knobs):
    case, ks, vs = fp8_case(make_case(**CASES[name], dtype=torch.bfloat16))
    sinks = sinks_for(case)
    out = paged_attention_triton(*fp8_args(case, ks, vs), sinks, **knobs)
    ref_args = [a.cpu() if torch.is_tensor(a) else a for a in (*fp8_args(case, ks, vs), sinks)]
    assert_close(out, paged_attention_reference(*ref_args).to(out.device))


@requires_triton
@pytest.mark.usefixtures("small_key_tiles")
@pytest.mark.parametrize("name,knobs", [("decode_gqa", {}), ("chunked_prefill", {}),
                                        ("decode_gqa", dict(decode_only=True, num_splits=4, fused_merge=False))])
def test_sinks_of_minus_infinity_are_no_sinks(name, knobs):
    """A sink of -inf is a key no row sees: the kernel's output is the one without sinks bit for bit (the fold
    multiplies by 2^0 and adds 2^-inf), the reference's within rounding."""
    case = make_case(**CASES[name], seed=2)
    none = torch.full((case.q.shape[1],), float("-inf"), device=case.q.device)
    assert torch.equal(paged_attention_triton(*with_sinks(case, none), **knobs),
                       paged_attention_triton(*case.args(), **knobs))
    cpu = make_case(**CASES[name], seed=2, device="cpu")
    assert_close(paged_attention_reference(*with_sinks(cpu, none.cpu())), paged_attention_reference(*cpu.args()))


@requires_triton
def test_launch_without_sinks_is_the_kernel_without_the_switch(monkeypatch):
    """USE_SINKS is on only for a call given sinks: a model without them runs the kernel it ran before."""
    launches = record_kernel_launches(monkeypatch, pa, "_paged_attn_kernel", arguments=True)
    case = make_case(**CASES["decode_gqa"])
    paged_attention_triton(*case.args())
    paged_attention_triton(*with_sinks(case, sinks_for(case)))
    assert [kw["USE_SINKS"] for _, kw in launches] == [False, True]


@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("seqs", [[(5, 1), (13, 20), (0, 3)], [(0, 24)]], ids=["with_context", "no_context"])
def test_long_run_route_applies_sinks(monkeypatch, impl, seqs):
    """The torch-SDPA route (forced on, 8 rows) takes a long run with sinks too, applying them from the fused
    kernels' log-sum-exp (merged with the context's when there is one): GPT-OSS's eager attention, and the
    implementation's output for the whole step, within the fp32 tolerance; sinks of -inf leave the route's output
    without sinks."""
    if impl == "triton" and not pa.HAS_TRITON:
        pytest.skip("triton is not installed")
    monkeypatch.setattr(_prefill_sdpa, "ROUTE", "on")
    monkeypatch.setattr(_prefill_sdpa, "MIN_QUERY_ROWS", 8)
    runs = []
    real = _prefill_sdpa.attend_run
    monkeypatch.setattr(_prefill_sdpa, "attend_run", lambda q, *a: runs.append(q.shape[0]) or real(q, *a))
    case = make_case(seqs, device="cpu" if impl == "reference" else DEVICE)
    sinks = sinks_for(case)
    body = pa.paged_attention_triton_entry if impl == "triton" else pa.paged_attention_reference_entry
    whole = paged_attention_triton if impl == "triton" else paged_attention_reference
    out = body(*with_sinks(case, sinks))
    long_run = max(new for _, new in seqs)
    assert runs == [long_run]
    assert_close(out, eager_oracle(case, sinks))
    assert_close(out, whole(*with_sinks(case, sinks)))
    runs.clear()
    assert_close(body(*with_sinks(case, torch.full_like(sinks, float("-inf")))), body(*case.args()))
    assert runs == [long_run, long_run]


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_cached_op_takes_sinks(impl):
    """paged_attention_cached (caches already written): the attention of paged_attention with the same sinks."""
    if impl == "triton" and not pa.HAS_TRITON:
        pytest.skip("triton is not installed")
    case = make_case(**CASES["chunked_prefill"], device="cpu" if impl == "reference" else DEVICE)
    sinks = sinks_for(case)
    args = with_sinks(case, sinks)
    want = paged_attention_reference(*args)  # writes the step's keys into args' caches
    cached = paged_attention_cached_triton if impl == "triton" else paged_attention_cached_reference
    got = cached(case.q, args[3], args[4], case.block_tables, case.seq_lens, case.query_start_loc, case.scale, 0,
                 0.0, None, None, sinks)
    assert_close(got, want)
    op = torch.ops.mini_infer.paged_attention_cached(case.q, args[3], args[4], case.block_tables, case.seq_lens,
                                                     case.query_start_loc, case.scale, 0, 0.0, None, None, sinks)
    assert_close(op, want)


def test_registered_op_fake_and_opcheck():
    """Sinks positional after the scales (None for a 16-bit cache), as the attention pass emits them."""
    case = make_case(**CASES["chunked_prefill"], cache_fill=0.0, device="cpu")
    sinks = sinks_for(case)
    args = with_sinks(case, sinks)
    assert_close(torch.ops.mini_infer.paged_attention(*args), eager_oracle(case, sinks))
    real = with_sinks(case, sinks)
    with FakeTensorMode() as mode:
        out = torch.ops.mini_infer.paged_attention(*[mode.from_tensor(a) if torch.is_tensor(a) else a for a in real])
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    torch.library.opcheck(torch.ops.mini_infer.paged_attention.default, with_sinks(case, sinks))


@pytest.mark.parametrize("bad", [torch.zeros(3), torch.zeros(4, 1), torch.zeros(4, dtype=torch.int32)])
def test_sinks_of_another_shape_or_dtype_are_refused(bad):
    case = make_case(**CASES["decode_gqa"], device="cpu")  # 4 query heads
    with pytest.raises(ValueError, match=r"sinks must be a float tensor of shape \(4,\)"):
        paged_attention_reference(*with_sinks(case, bad))


@requires_triton
def test_decode_kernel_with_sinks_compiles_sm90():
    """The decode launches with sinks (the write in the kernel, with and without the rotary) compiled for sm_90 (no GPU
    needed; `python -m tests.ops.compile_paged_attention_sm90 sinks`) for every shape of the kernel's compile test:
    USE_SINKS on, the write's barrier there, nothing read through the non-coherent path, no spill beyond that test's
    allowance. (The interpreter shows no compile error of the sink's fold under `if split == 0`.)"""
    from tests.ops.helpers import run_uninterpreted
    from tests.ops.test_paged_attention import STACK_ALLOWED

    report = run_uninterpreted(["-m", "tests.ops.compile_paged_attention_sm90", "sinks"])
    assert {case["name"] for case in report["cases"]} == {"bf16_splits", "fp8_window_g7", "fp8_g2", "fp8_g2_usual_v"}
    for case in report["cases"]:
        assert set(case) == {"name", "write", "rotary"}, case
        for key in ("write", "rotary"):
            built = case[key]
            stack = re.search(r"\bSTACK:(\d+) ", built["usage"])
            assert built["shape"]["sinks"] and stack and "LOCAL:0 " in built["usage"], (case["name"], key, built)
            allowed = STACK_ALLOWED.get((case["name"], key), STACK_ALLOWED.get(case["name"], 0))
            assert int(stack[1]) <= allowed, (report["triton"], case["name"], key, built)
            assert built["nc_loads"] == 0, (case["name"], key, built)
