"""Sampler tests: each sampling option checked against its definition, on the CPU."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mini_infer.runtime import sampler as sampler_mod
from mini_infer.runtime.sampler import (
    Sampler,
    SamplingBatch,
    apply_penalties,
    apply_top_k_top_p,
    compute_prompt_logprobs,
    make_generator,
)
from mini_infer.sampling_params import SamplingParams

V = 32


def build(params, histories=None, generators=None, vocab=V, eos=None, device="cpu"):
    histories = histories or [((), ())] * len(params)
    return SamplingBatch.build(params, histories, generators, vocab, device, eos_token_ids=eos)


def draw(logits_row: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> torch.Tensor:
    """n independent draws from one distribution, as n rows of one batch."""
    torch.manual_seed(seed)
    logits = logits_row[None].expand(n, -1).contiguous()
    return Sampler()(logits, build([params] * n, vocab=logits.shape[1])).token_ids


def test_greedy_is_argmax_any_dtype():
    torch.manual_seed(0)
    logits = torch.randn(16, V)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = logits.to(dtype)
        batch = build([SamplingParams(temperature=0.0)] * 16)
        assert batch.all_greedy and not batch.needs_penalties and not batch.needs_topk
        out = Sampler()(x, batch)
        assert out.token_ids.dtype == torch.int64 and out.logprobs is None
        assert torch.equal(out.token_ids, x.float().argmax(-1))


def test_caller_logits_untouched():
    torch.manual_seed(0)
    logits = torch.randn(4, V)
    before = logits.clone()
    params = [SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.1, repetition_penalty=1.3)] * 4
    Sampler()(logits, build(params, [([1, 2], [3])] * 4))
    assert torch.equal(logits, before)


def test_temperature_zero_equals_top_k_one():
    torch.manual_seed(1)
    logits = torch.randn(64, V)
    a = Sampler()(logits, build([SamplingParams(temperature=0.0)] * 64)).token_ids
    b = Sampler()(logits, build([SamplingParams(temperature=1.3, top_k=1)] * 64)).token_ids
    assert torch.equal(a, b)


def test_greedy_and_random_rows_mixed():
    torch.manual_seed(2)
    logits = torch.randn(8, V)
    params = [SamplingParams(temperature=0.0) if i % 2 else SamplingParams(temperature=1.0) for i in range(8)]
    out = Sampler()(logits, build(params)).token_ids
    assert torch.equal(out[1::2], logits[1::2].argmax(-1))


def test_top_k_support():
    torch.manual_seed(3)
    logits = torch.randn(V)
    k = 4
    ids = draw(logits, SamplingParams(temperature=1.5, top_k=k), 4000)
    allowed = set(logits.topk(k).indices.tolist())
    assert set(ids.tolist()) == allowed  # within the top k, and every one of them drawn


def test_top_k_mixed_with_disabled_rows():
    torch.manual_seed(4)
    logits = torch.randn(V)[None].expand(2000, -1).contiguous()
    params = [SamplingParams(top_k=2) if i % 2 else SamplingParams(temperature=2.0) for i in range(2000)]
    ids = Sampler()(logits, build(params)).token_ids
    assert set(ids[1::2].tolist()) == set(logits[0].topk(2).indices.tolist())
    assert len(set(ids[0::2].tolist())) > 10


# Crafted distribution: sorted masses 0.40, 0.30, 0.15, 0.10, 0.05 at ids 1, 3, 4, 2, 0.
PROBS = torch.tensor([0.05, 0.40, 0.10, 0.30, 0.15])
LOGITS = PROBS.log()


@pytest.mark.parametrize(
    "top_p, kept",
    [
        (0.3, {1}),
        (0.5, {1, 3}),
        (0.69, {1, 3}),
        (0.72, {1, 3, 4}),
        (0.9, {1, 3, 4, 2}),
        (0.97, {0, 1, 2, 3, 4}),
    ],
)
def test_top_p_keeps_smallest_set_reaching_p(top_p, kept):
    masked = apply_top_k_top_p(LOGITS[None], None, torch.tensor([top_p]))
    assert set(torch.isfinite(masked[0]).nonzero().flatten().tolist()) == kept
    assert PROBS[list(kept)].sum() >= top_p
    ids = draw(LOGITS, SamplingParams(top_p=top_p), 5000)
    assert set(ids.tolist()) == kept
    counts = torch.bincount(ids, minlength=5).float() / len(ids)
    expected = torch.zeros(5)
    expected[list(kept)] = PROBS[list(kept)] / PROBS[list(kept)].sum()
    assert torch.allclose(counts, expected, atol=0.03)


def test_top_k_then_top_p():
    # top_k=3 keeps 0.40, 0.30, 0.15 (renormalised 0.47, 0.35, 0.18); top_p=0.8 then keeps the first two.
    masked = apply_top_k_top_p(LOGITS[None], torch.tensor([3]), torch.tensor([0.8]))
    assert set(torch.isfinite(masked[0]).nonzero().flatten().tolist()) == {1, 3}


def test_min_p():
    # threshold 0.5 * 0.40 = 0.20: keeps 0.40 and 0.30.
    ids = draw(LOGITS, SamplingParams(min_p=0.5), 4000)
    assert set(ids.tolist()) == {1, 3}
    ids = draw(LOGITS, SamplingParams(min_p=0.3), 4000)  # threshold 0.12: adds 0.15
    assert set(ids.tolist()) == {1, 3, 4}


def chi_square(ids: torch.Tensor, expected: torch.Tensor) -> float:
    n = len(ids)
    observed = torch.bincount(ids, minlength=len(expected)).double()
    exp = expected.double() * n
    keep = exp > 0
    assert observed[~keep].sum() == 0, "drew a token of probability 0"
    return float(((observed[keep] - exp[keep]) ** 2 / exp[keep]).sum())


# Chi-square critical values at p = 1e-4 (fixed seeds make the tests deterministic anyway).
CHI2_CRIT = {1: 15.1, 2: 18.4, 3: 21.1, 4: 23.5}


@pytest.mark.parametrize(
    "params, expected",
    [
        (SamplingParams(temperature=1.0), PROBS),
        (SamplingParams(temperature=0.7), torch.softmax(LOGITS / 0.7, -1)),
        (SamplingParams(temperature=2.0, top_k=3), None),
        (SamplingParams(temperature=1.0, top_p=0.8, min_p=0.0), None),
    ],
)
def test_empirical_distribution(params, expected):
    if expected is None:  # renormalised truncated distribution, computed by hand
        probs = torch.softmax(LOGITS / params.temperature, -1)
        order = probs.argsort(descending=True)
        keep = torch.zeros(5, dtype=torch.bool)
        if params.top_k > 0:
            keep[order[: params.top_k]] = True
        else:
            mass = 0.0
            for i in order.tolist():
                keep[i] = True
                mass += float(probs[i])
                if mass >= params.top_p:
                    break
        expected = torch.where(keep, probs, 0.0)
        expected = expected / expected.sum()
    ids = draw(LOGITS, params, 20000, seed=11)
    df = int((expected > 0).sum()) - 1
    assert chi_square(ids, expected) < CHI2_CRIT[df]


def test_seeded_rows_reproduce_independently_of_batch():
    torch.manual_seed(5)
    steps = [torch.randn(6, V) for _ in range(5)]
    p_seed = SamplingParams(temperature=1.0, seed=1234)
    p_other = SamplingParams(temperature=1.0)

    def run(row: int, rows: int, other_seed: int | None):
        gen = make_generator(1234, "cpu")
        others = {r: make_generator(other_seed, "cpu") if other_seed else None for r in range(rows)}
        got = []
        for logits in steps:
            params = [p_seed if r == row else p_other for r in range(rows)]
            gens = [gen if r == row else others[r] for r in range(rows)]
            x = logits[:rows].clone()
            x[row] = logits[5]  # the seeded request's logits are the same whatever row it sits in
            torch.manual_seed(len(got) * 7 + rows)  # the unseeded rows see different global noise
            got.append(int(Sampler()(x, build(params, generators=gens)).token_ids[row]))
        return got

    ref = run(0, 1, None)
    assert run(0, 1, None) == ref
    assert run(3, 4, None) == ref
    assert run(1, 6, 99) == ref
    assert len(set(ref)) > 1


def test_seeded_row_distribution_is_correct():
    gen = make_generator(7, "cpu")
    batch = build([SamplingParams(seed=7)], generators=[gen])
    ids = torch.stack([Sampler()(LOGITS[None], batch).token_ids[0] for _ in range(3000)])
    assert chi_square(ids, PROBS) < CHI2_CRIT[4]


def test_repetition_penalty_on_prompt_and_output():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 1.0, -1.0]])
    params = [SamplingParams(repetition_penalty=2.0)]
    batch = build(params, [([0, 1], [4, 4])], vocab=6)
    out = apply_penalties(logits, batch)
    assert out.tolist() == [[1.0, -4.0, 2.0, -2.0, 0.5, -1.0]]


def test_presence_and_frequency_on_output_only():
    logits = torch.zeros(1, 6)
    params = [SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)]
    batch = build(params, [([0, 1, 2], [2, 3, 3, 3])], vocab=6)
    assert batch.needs_penalties and batch.repetition_penalty is None and batch.prompt_mask is None
    out = apply_penalties(logits, batch)
    # token 0, 1: prompt only -> untouched; 2: once -> 0.5 + 0.25; 3: three times -> 0.5 + 0.75
    assert out.tolist() == [[0.0, 0.0, -0.75, -1.25, 0.0, 0.0]]


def test_penalties_per_row_and_in_sampling():
    logits = torch.tensor([[3.0, 2.9, 0.0, 0.0]] * 2)
    params = [SamplingParams(temperature=0, frequency_penalty=1.0), SamplingParams(temperature=0)]
    histories = [([], [0]), ([], [0])]
    out = Sampler()(logits, build(params, histories, vocab=4)).token_ids
    assert out.tolist() == [1, 0]  # only the first row is penalised


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0, 1.0]] * 4)
    params = [
        SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[2]),
        SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[2]),
        SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[2], ignore_eos=True),
        SamplingParams(temperature=0, stop_token_ids=[2]),
    ]
    histories = [([7], [0, 0]), ([7], [0, 0, 0]), ([7], []), ([7], [])]
    batch = build(params, histories, vocab=5, eos=[{1}, {1}, {1}, {1}])
    out = Sampler()(logits, batch).token_ids
    # row 0: 2 < 3 tokens: EOS (1) and stop id 2 banned -> 3; row 1: reached min_tokens -> EOS;
    # row 2: ignore_eos, only stop id banned -> 1; row 3: no min_tokens -> EOS.
    assert out.tolist() == [3, 1, 1, 1]
    # shared EOS set form; random rows never draw a banned token
    many = Sampler()(
        torch.zeros(500, 5), build([SamplingParams(min_tokens=1)] * 500, vocab=5, eos={0, 4})
    ).token_ids
    assert set(many.tolist()) == {1, 2, 3}


def test_logprobs_are_raw_log_softmax():
    torch.manual_seed(6)
    logits = torch.randn(5, V, dtype=torch.bfloat16)
    params = [SamplingParams(temperature=0.5, top_k=3, logprobs=4, repetition_penalty=1.5)] * 3 + [
        SamplingParams(temperature=0, logprobs=0),
        SamplingParams(temperature=0.9),
    ]
    batch = build(params, [([1], [2, 3])] * 5)
    out = Sampler()(logits, batch)
    ref = logits.float().log_softmax(-1)
    assert torch.allclose(out.logprobs, ref.gather(1, out.token_ids[:, None]).squeeze(1))
    assert out.topk_ids.shape == (5, 4)
    top_lp, top_ids = ref.topk(4, dim=-1)
    assert torch.allclose(out.topk_logprobs, top_lp) and torch.equal(out.topk_ids, top_ids)
    ranks = (ref > ref.gather(1, out.token_ids[:, None])).sum(-1) + 1
    assert torch.equal(out.ranks, ranks)


def test_processed_logprobs():
    torch.manual_seed(7)
    logits = torch.randn(2, V)
    params = [SamplingParams(temperature=0.5, top_k=3, logprobs=3), SamplingParams(temperature=0, logprobs=1)]
    out = Sampler(logprobs_mode="processed")(logits, build(params))
    masked = apply_top_k_top_p(logits[:1] / 0.5, torch.tensor([3]), None, 3)
    assert torch.allclose(out.topk_logprobs[0], masked.log_softmax(-1).topk(3).values)
    assert torch.isclose(out.topk_logprobs[1, 0], logits[1].log_softmax(-1).max())
    assert bool(torch.isfinite(out.logprobs).all())


def test_compute_prompt_logprobs():
    torch.manual_seed(8)
    logits = torch.randn(37, V, dtype=torch.float16)
    nxt = torch.randint(0, V, (37,))
    lp, ids, top = compute_prompt_logprobs(logits, nxt, 3, chunk_size=8)
    ref = logits.float().log_softmax(-1)
    assert torch.allclose(lp, ref[torch.arange(37), nxt])
    assert torch.equal(ids, ref.topk(3).indices) and torch.allclose(top, ref.topk(3).values)
    lp0, ids0, top0 = compute_prompt_logprobs(logits, nxt, 0)
    assert ids0.shape == (37, 0) and torch.allclose(lp0, lp)


@st.composite
def sampling_cases(draw_):
    rows = draw_(st.integers(1, 4))
    vocab = draw_(st.integers(2, 12))
    params = []
    for _ in range(rows):
        params.append(
            SamplingParams(
                temperature=draw_(st.sampled_from([0.0, 0.3, 1.0, 2.5])),
                top_k=draw_(st.sampled_from([-1, 1, 2, 3, 50])),
                top_p=draw_(st.sampled_from([1.0, 0.9, 0.5, 0.1])),
                min_p=draw_(st.sampled_from([0.0, 0.05, 0.5])),
                seed=draw_(st.one_of(st.none(), st.integers(0, 2**31))),
            )
        )
    values = draw_(
        st.lists(st.floats(-8, 8, allow_nan=False, width=32), min_size=rows * vocab, max_size=rows * vocab)
    )
    return params, torch.tensor(values, dtype=torch.float32).view(rows, vocab)


@settings(max_examples=60, deadline=None)
@given(sampling_cases())
def test_property_support_inside_allowed_set(case):
    params, logits = case
    rows, vocab = logits.shape
    gens = [make_generator(p.seed, "cpu") if p.seed is not None else None for p in params]
    batch = SamplingBatch.build(params, [((), ())] * rows, gens, vocab, "cpu")
    for _ in range(4):
        ids = Sampler()(logits, batch).token_ids
        assert ids.shape == (rows,) and ids.dtype == torch.int64
        for r, (p, t) in enumerate(zip(params, ids.tolist())):
            assert 0 <= t < vocab
            if p.temperature == 0 or p.top_k == 1:
                assert logits[r, t] == logits[r].max()
                continue
            probs = torch.softmax(logits[r].double() / p.temperature, -1)
            higher = probs > probs[t]
            if p.top_k > 0:
                assert int(higher.sum()) < p.top_k
                kept = probs.topk(min(p.top_k, vocab)).values
                probs = torch.where(probs >= kept[-1], probs, 0.0)
                probs = probs / probs.sum()
                higher = probs > probs[t]
            assert float(probs[higher].sum()) < p.top_p + 1e-5
            # min-p: truncation and renormalisation keep probability ratios and the top token
            assert float(probs[t]) >= p.min_p * float(probs.max()) * (1 - 1e-4)


def test_fast_flags():
    b = build([SamplingParams(temperature=0.7)] * 3)
    assert b.all_random and not (b.needs_topk or b.needs_topp or b.needs_minp or b.needs_penalties)
    assert b.max_num_logprobs is None
    b = build([SamplingParams(top_p=0.5), SamplingParams(temperature=0, logprobs=2)])
    assert b.needs_topp and not b.all_random and not b.all_greedy and b.max_num_logprobs == 2
    assert math.isclose(float(b.temperature[1]), 1.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_no_host_sync_and_seeded_rows():
    dev = "cuda"
    vocab = 1000
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, logprobs=5),
        SamplingParams(seed=3, repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.5),
        SamplingParams(min_tokens=4, temperature=1.2),
    ]
    histories = [([1, 2, 3], [4, 5]), ([7], []), ([1, 9], [9, 9, 2]), ([0], [1])]

    def seeded_draws(row, rows, steps):
        gen = make_generator(3, dev)
        got = []
        for logits in steps:
            ps = [params[2] if r == row else params[r % 2] for r in range(rows)]
            hs = [histories[2] if r == row else histories[r % 2] for r in range(rows)]
            gs = [gen if r == row else None for r in range(rows)]
            x = torch.randn(rows, vocab, device=dev, dtype=torch.bfloat16)
            x[row] = logits
            got.append(Sampler()(x, SamplingBatch.build(ps, hs, gs, vocab, dev)).token_ids[row].item())
        return got

    batch = SamplingBatch.build(params, histories, [None, None, make_generator(3, dev), None], vocab, dev, 0)
    logits = torch.randn(4, vocab, device=dev, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = Sampler()(logits, batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.token_ids.device.type == "cuda" and out.topk_ids.shape == (4, 5)
    assert out.token_ids[0].item() == logits[0].float().argmax().item()
    steps = [torch.randn(vocab, device=dev, dtype=torch.bfloat16) for _ in range(4)]
    assert seeded_draws(0, 1, steps) == seeded_draws(5, 8, steps)


def _greedy_ties_logits(rows: int, vocab: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Logits with equal maxima far apart in each row (the first must win), a NaN row and a -inf row."""
    torch.manual_seed(5)
    x = torch.randn(rows, vocab)
    for r in range(rows):
        x[r, [vocab - 1 - r, 3 * vocab // 4, vocab // 3 + r]] = 9.0
    x[1, vocab // 2] = float("nan")
    x[2] = float("-inf")
    return x.to(dtype).to(device)


@pytest.mark.parametrize("mixed", [False, True])
def test_greedy_rows_take_the_argmax_kernel(monkeypatch, mixed):
    """The greedy rows' ids are torch.argmax's through the Triton `argmax_rows` launcher: on a GPU as the engine
    runs it; here with `use_triton` patched to say yes, so the kernel runs on CPU tensors under the interpreter."""
    from mini_infer.ops import HAS_TRITON
    from mini_infer.ops import argmax as argmax_mod

    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        monkeypatch.setattr(argmax_mod, "use_triton", lambda t: True)
    monkeypatch.setattr(sampler_mod, "FUSED_DRAW", False)  # the mixed batch's torch path (its own test below)
    calls = []
    real = argmax_mod.argmax_rows_triton
    monkeypatch.setattr(argmax_mod, "argmax_rows_triton", lambda x, *a: calls.append(x.shape) or real(x, *a))
    rows, vocab = 4, 9000  # 3 programs a row: the in-launch merge runs
    logits = _greedy_ties_logits(rows, vocab, torch.bfloat16, device)
    params = [SamplingParams(temperature=0.0)] * rows
    if mixed:  # rows 1 and 3 sampled, rows 0 and 2 greedy (the mixed path's argmax is over float32 logits)
        params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9)] * (rows // 2)
    batch = SamplingBatch.build(params, [((), ())] * rows, None, vocab, device)
    ids = Sampler()(logits, batch).token_ids
    want = logits.float().cpu().argmax(-1)
    greedy = torch.tensor([p.greedy for p in params])
    assert torch.equal(ids.cpu()[greedy], want[greedy])
    assert want.tolist()[:3] == [vocab // 3, vocab // 2, 0]
    assert calls == [(rows, vocab)]


def test_greedy_on_cpu_is_torch_argmax(monkeypatch):
    """On CPU tensors (no patch) the sampler's argmax is torch's own: the kernel is never called."""
    from mini_infer.ops import argmax as argmax_mod

    monkeypatch.setattr(argmax_mod, "argmax_rows_triton", lambda *a: pytest.fail("Triton argmax on CPU tensors"))
    logits = _greedy_ties_logits(4, 500, torch.float32, "cpu")
    ids = Sampler()(logits, build([SamplingParams(temperature=0.0)] * 4, vocab=500)).token_ids
    assert torch.equal(ids, logits.argmax(-1))


def _fused_draws_patch_backend(monkeypatch) -> None:
    """Skip without Triton; on CPU let `can_draw_on` say yes (the kernel then runs under the interpreter)."""
    from mini_infer.ops import HAS_TRITON
    from mini_infer.ops import gumbel_argmax as gumbel_mod

    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    if not torch.cuda.is_available():
        monkeypatch.setattr(gumbel_mod, "use_triton", lambda t: True)


def _fused_device() -> str:
    """Where the fused-draw tests put their tensors: the GPU when there is one, else CPU under the interpreter."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def _fused_draws(monkeypatch) -> list:
    """Route the sampler's eligible batches through the Triton Gumbel draw (on CPU tensors under the interpreter:
    `can_draw_on` patched to say yes) and record each launch's (rows, inv_temperature)."""
    _fused_draws_patch_backend(monkeypatch)
    calls = []
    real = sampler_mod.gumbel_argmax_triton
    monkeypatch.setattr(sampler_mod, "gumbel_argmax_triton",
                        lambda x, inv_t, seed: calls.append((x.shape[0], inv_t)) or real(x, inv_t, seed))
    return calls


def _launches(calls: list) -> list:
    """`_fused_draws`' record as (rows, inv_temperature list): read back after the sampler ran (no sync inside)."""
    return [(rows, inv_t.tolist()) for rows, inv_t in calls]


def test_fused_draw_one_launch_greedy_rows_exact(monkeypatch):
    """A mixed batch (greedy and temperature rows, no truncation): one Gumbel launch over the logits as given
    (bf16, no float copy), the greedy rows' ids torch.argmax's, inv_temperature 0 on them and 1 / T elsewhere."""
    calls = _fused_draws(monkeypatch)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows, vocab = 4, 9000
    logits = _greedy_ties_logits(rows, vocab, torch.bfloat16, device)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.5)] * (rows // 2)
    batch = SamplingBatch.build(params, [((), ())] * rows, None, vocab, device)
    ids = Sampler()(logits, batch).token_ids
    want = logits.float().cpu().argmax(-1)
    assert ids[0].item() == want[0].item() and ids[2].item() == want[2].item()
    assert _launches(calls) == [(rows, [0.0, 2.0, 0.0, 2.0])]


def test_fused_draw_is_the_ops_draw_at_the_batch_temperature(monkeypatch):
    """Through the sampler, each row's id is gumbel_argmax's at that row's 1 / T (its law is tested with the op,
    tests/ops/test_gumbel_argmax.py), from a fresh seed per call."""
    from mini_infer.ops.gumbel_argmax import gumbel_argmax_triton

    seeds = []
    real = gumbel_argmax_triton
    monkeypatch.setattr(sampler_mod, "gumbel_argmax_triton", lambda x, inv_t, seed: seeds.append(seed) or real(x, inv_t, seed))
    _fused_draws_patch_backend(monkeypatch)
    dev = _fused_device()
    logits = torch.randn(16, V, device=dev)
    params = [SamplingParams(temperature=t) for t in (0.5, 1.0, 2.0, 0.7)] * 4
    ids = Sampler()(logits, build(params, device=dev)).token_ids
    inv_t = torch.tensor([1 / p.temperature for p in params], dtype=torch.float32, device=dev)
    assert torch.equal(ids, real(logits, inv_t, seeds[0]))
    Sampler()(logits, build(params, device=dev))
    assert len(seeds) == 2 and seeds[0] != seeds[1]


@pytest.mark.parametrize("params, seeded, logprobs_mode", [
    (SamplingParams(temperature=0.7, top_k=3), False, "raw"),
    (SamplingParams(temperature=0.7, top_p=0.9), False, "raw"),
    (SamplingParams(temperature=0.7, min_p=0.1), False, "raw"),
    (SamplingParams(temperature=0.7, logprobs=2), False, "processed"),
])
def test_fused_draw_not_taken_where_the_torch_path_is_needed(monkeypatch, params, seeded, logprobs_mode):
    """Truncation and processed logprobs keep the torch path; with neither the batch takes the fused draw, unless
    FUSED_DRAW is off (seeded rows: the next test)."""
    calls = _fused_draws(monkeypatch)
    dev = _fused_device()
    gens = [make_generator(5, dev)] * 2 if seeded else None
    batch = build([params] * 2, generators=gens, device=dev)
    Sampler(logprobs_mode)(torch.randn(2, V, device=dev), batch)
    assert calls == []
    Sampler()(torch.randn(2, V, device=dev), build([SamplingParams(temperature=0.7, logprobs=2)] * 2, device=dev))
    assert len(calls) == 1  # raw logprobs: still fused
    monkeypatch.setattr(sampler_mod, "FUSED_DRAW", False)
    Sampler()(torch.randn(2, V, device=dev), build([SamplingParams(temperature=0.7)] * 2, device=dev))
    assert len(calls) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_draw_no_host_sync(monkeypatch):
    """The fused draw (its seed from the CPU generator) queues without waiting on the device."""
    calls = _fused_draws(monkeypatch)
    batch = build([SamplingParams(temperature=0.8), SamplingParams(temperature=0.0)] * 2, vocab=1000, device="cuda")
    logits = torch.randn(4, 1000, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ids = Sampler()(logits, batch).token_ids
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(calls) == 1 and ids[1].item() == logits[1].float().argmax().item()


def test_truncated_batches_draw_among_candidates(monkeypatch):
    """Top-k / top-p batches with no seeded row draw among each row's candidates (never the vocab-wide masked
    logits), with min-p on the candidates and greedy rows still their argmax; seeded rows and processed logprobs
    keep the vocab-wide path."""
    full_path = []
    real = sampler_mod.apply_top_k_top_p
    monkeypatch.setattr(sampler_mod, "apply_top_k_top_p", lambda *a: full_path.append(1) or real(*a))
    logits = torch.randn(6, V)
    params = [SamplingParams(temperature=0.9, top_k=4), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.2, top_p=0.5, top_k=6, min_p=0.1)] * 2
    ids = Sampler()(logits, build(params)).token_ids
    assert full_path == []
    assert ids[1] == logits[1].argmax() and ids[4] == logits[4].argmax()
    for r in (0, 3):
        assert ids[r].item() in logits[r].topk(4).indices.tolist()
    for r in (2, 5):
        assert ids[r].item() in logits[r].topk(6).indices.tolist()
    seeded = [SamplingParams(temperature=0.9, top_k=4, seed=1)] * 2
    Sampler()(logits[:2], build(seeded, generators=[make_generator(1, "cpu")] * 2))
    Sampler("processed")(logits[:2], build([SamplingParams(temperature=0.9, top_k=4, logprobs=1)] * 2))
    assert full_path == [1, 1]


def test_fused_draw_seeded_rows_keep_their_own_stream(monkeypatch):
    """A fused-draw batch redraws its seeded rows from their own generators: their ids are those of the torch path
    (FUSED_DRAW off) from generators in the same state, so a seeded request's tokens do not depend on the path."""
    calls = _fused_draws(monkeypatch)
    dev = _fused_device()
    logits = torch.randn(4, V, device=dev)
    params = [SamplingParams(temperature=0.8, seed=7), SamplingParams(temperature=0.8),
              SamplingParams(temperature=1.3, seed=9), SamplingParams(temperature=0.0)]

    def draw_ids(fused: bool) -> list[int]:
        monkeypatch.setattr(sampler_mod, "FUSED_DRAW", fused)
        gens = [make_generator(p.seed, dev) if p.seed is not None else None for p in params]
        return Sampler()(logits, build(params, generators=gens, device=dev)).token_ids.tolist()

    fused, torch_path = draw_ids(True), draw_ids(False)
    assert len(calls) == 1
    assert fused[0] == torch_path[0] and fused[2] == torch_path[2]
    assert fused[3] == logits[3].argmax().item()


def test_warm_up_launches_both_draw_kernels_at_the_logits_dtype_and_width(monkeypatch):
    """`Sampler.warm_up` (run by the engine at start-up on CUDA): one greedy argmax launch and one fused Gumbel draw,
    each over a row of the given dtype and width, so their Triton variants are built before the first request
    (on CPU under the interpreter, the backends patched to say yes as in the tests above)."""
    from mini_infer.ops import argmax as argmax_mod

    draws = _fused_draws(monkeypatch)
    if not torch.cuda.is_available():
        monkeypatch.setattr(argmax_mod, "use_triton", lambda t: True)
    argmaxes = []
    real = argmax_mod.argmax_rows_triton
    monkeypatch.setattr(argmax_mod, "argmax_rows_triton",
                        lambda x, *a, **k: argmaxes.append((x.shape, x.dtype)) or real(x, *a, **k))
    Sampler().warm_up(5000, torch.bfloat16, torch.device(_fused_device()))
    assert argmaxes == [((1, 5000), torch.bfloat16)]  # the greedy draw (the fused one calls the launcher directly)
    assert _launches(draws) == [(1, [1.0])]
