"""Scheduler: budgets, chunked prefill, FCFS / priority order, preemption by recompute, aborts, rejection.

`FakeEngine` follows the engine contract in the scheduler's module docstring and keeps a fake device
cache (block -> token per slot): every computed token of every running sequence must read back
through its block table after each step, so prefix hits, preemption and block reuse are checked for
what they hand the model, not only for their counters.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, event, example, given, settings

from mini_infer.runtime.block_manager import BlockManager
from mini_infer.runtime.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from mini_infer.runtime.sequence import Sequence, SequenceStatus
from mini_infer.sampling_params import SamplingParams

VOCAB = 4


def make_seq(prompt, rid, max_tokens=4, priority=0, arrival=None) -> Sequence:
    seq = Sequence(
        request_id=rid,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(max_tokens=max_tokens),
        priority=priority,
    )
    if arrival is not None:
        seq.arrival_time = arrival
    return seq


def make(num_blocks=64, block_size=4, prefix=True, **cfg) -> tuple[Scheduler, BlockManager]:
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=prefix)
    return Scheduler(SchedulerConfig(**cfg), bm), bm


class FakeEngine:
    """Drives a scheduler like the engine does; generates `max_tokens` tokens per sequence, then finishes it."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.bm = sched.block_manager
        self.device: dict[int, list[int | None]] = {
            b: [None] * self.bm.block_size for b in range(self.bm.num_blocks)
        }
        self.steps = 0
        self.max_steps = 5000

    def step(self) -> SchedulerOutput:
        sched, bm, cfg = self.sched, self.bm, self.sched.config
        out = sched.schedule()
        self.steps += 1
        assert self.steps <= self.max_steps, "no progress: the engine loop would spin forever"
        # the plan respects the limits
        assert out.num_batched_tokens == sum(n for _, n in out.scheduled) <= cfg.max_num_batched_tokens
        assert len(out.scheduled) <= cfg.max_num_seqs and sched.num_running <= cfg.max_num_seqs
        ids = [s.seq_id for s, _ in out.scheduled]
        assert len(set(ids)) == len(ids)
        assert not {s.seq_id for s in out.preempted} & set(ids)
        assert all(s.status is SequenceStatus.WAITING and not s.block_table for s in out.preempted)
        assert all(s.is_finished for s in out.finished)
        for (seq, n), sample in zip(out.scheduled, out.sample):
            assert seq.status is SequenceStatus.RUNNING and n >= 1
            assert seq.num_computed_tokens + n <= seq.num_tokens
            assert sample == (seq.num_computed_tokens + n == seq.num_tokens)
            assert len(seq.block_table) * bm.block_size >= seq.num_computed_tokens + n
        # the "forward pass": write K/V (here: the token ids) into the scheduled slots
        for seq, n in out.scheduled:
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                block = seq.block_table[pos // bm.block_size]
                assert bm.ref_counts[block] == 1 and bm.block_hashes[block] is None, (
                    "write into a shared block"
                )
                self.device[block][pos % bm.block_size] = seq.token_ids[pos]
        # the engine's part of the contract
        for (seq, n), sample in zip(out.scheduled, out.sample):
            seq.num_computed_tokens += n
            if sample:
                seq.append_token((seq.seq_id * 7 + seq.num_tokens) % VOCAB)
        sched.update_after_step(out)
        for (seq, _), sample in zip(out.scheduled, out.sample):
            if sample and len(seq.output_token_ids) >= seq.sampling_params.max_tokens:
                sched.finish(seq, "length")
        self.check()
        return out

    def check(self) -> None:
        self.bm.check_invariants()
        for seq in self.sched.running:
            for pos in range(seq.num_computed_tokens):
                got = self.device[seq.block_table[pos // self.bm.block_size]][pos % self.bm.block_size]
                assert got == seq.token_ids[pos], f"{seq.request_id} reads a wrong token at {pos}"
        for seq in self.sched.waiting:
            assert not seq.block_table and seq.num_computed_tokens == 0

    def run(self, max_steps=10_000) -> int:
        start = self.steps
        while self.sched.has_unfinished():
            self.step()
            assert self.steps - start < max_steps, "did not drain"
        return self.steps - start


def assert_drained(sched: Scheduler, bm: BlockManager) -> None:
    assert not sched.has_unfinished() and sched.num_running == sched.num_waiting == 0
    assert bm.num_free_blocks == bm.num_blocks and bm.usage == 0.0  # every block free or cached
    assert not bm._states
    bm.check_invariants()


# ---------------------------------------------------------------------- limits and chunking


def test_budget_and_max_num_seqs_respected():
    sched, bm = make(num_blocks=256, max_num_seqs=4, max_num_batched_tokens=24)
    seqs = [make_seq([i % VOCAB] * (3 + 5 * i % 17), f"r{i}", max_tokens=1 + i % 5) for i in range(20)]
    for s in seqs:
        sched.add(s)
    eng = FakeEngine(sched)
    peak = 0
    while sched.has_unfinished():
        out = eng.step()
        peak = max(peak, len(out.scheduled))
    assert peak == 4
    assert all(
        s.finish_reason == "length" and len(s.output_token_ids) == s.sampling_params.max_tokens for s in seqs
    )
    assert_drained(sched, bm)


def test_chunked_prefill_splits_long_prompt_and_mixes_with_decodes():
    sched, _ = make(max_num_batched_tokens=16, prefix=False)
    a = make_seq([1, 2, 3, 4], "a", max_tokens=10)
    sched.add(a)
    eng = FakeEngine(sched)
    out = eng.step()
    assert out.scheduled == [(a, 4)] and out.sample == [True]
    b = make_seq(list(range(40)), "b")
    sched.add(b)
    plans = [[(s.request_id, n) for s, n in eng.step().scheduled] for _ in range(3)]
    assert plans == [[("a", 1), ("b", 15)], [("a", 1), ("b", 15)], [("a", 1), ("b", 10)]]
    assert b.num_computed_tokens == 40 and len(b.output_token_ids) == 1
    assert [(s.request_id, n) for s, n in eng.step().scheduled] == [("a", 1), ("b", 1)]


def test_long_prefill_token_threshold_caps_chunks():
    sched, _ = make(max_num_batched_tokens=100, long_prefill_token_threshold=8, prefix=False)
    a = make_seq(list(range(20)), "a")
    sched.add(a)
    eng = FakeEngine(sched)
    assert [eng.step().scheduled[0][1] for _ in range(4)] == [8, 8, 4, 1]


def test_without_chunked_prefill_prompt_fits_whole_or_waits():
    sched, _ = make(max_num_batched_tokens=16, enable_chunked_prefill=False, prefix=False)
    a = make_seq([1, 2, 3], "a", max_tokens=3)
    b = make_seq(list(range(16)), "b", max_tokens=2)
    sched.add(a)
    eng = FakeEngine(sched)
    eng.step()
    sched.add(b)
    # b needs the whole budget; a's decodes take 1 token each, so b waits until a is done
    assert [(s.request_id, n) for s, n in eng.step().scheduled] == [("a", 1)]
    assert [(s.request_id, n) for s, n in eng.step().scheduled] == [("a", 1)]
    assert a.is_finished
    assert [(s.request_id, n) for s, n in eng.step().scheduled] == [("b", 16)]
    with pytest.raises(ValueError):
        SchedulerConfig(max_num_batched_tokens=16, max_model_len=32, enable_chunked_prefill=False)


# ---------------------------------------------------------------------- order


def admission_order(sched: Scheduler, steps=20) -> list[str]:
    eng, order = FakeEngine(sched), []
    for _ in range(steps):
        if not sched.has_unfinished():
            break
        out = eng.step()
        order += [s.request_id for s, _ in out.scheduled if s.request_id not in order]
    return order


def test_fcfs_admits_in_arrival_order():
    sched, _ = make(max_num_batched_tokens=9, enable_chunked_prefill=False, max_num_seqs=8)
    # added out of order: FCFS goes by arrival time (add order breaks ties)
    for rid, t in [("c", 3.0), ("a", 1.0), ("b", 2.0), ("d", 3.0)]:
        sched.add(make_seq([5] * 8, rid, max_tokens=1, arrival=t))
    assert admission_order(sched) == ["a", "b", "c", "d"]


def test_priority_lower_value_first_ties_by_arrival():
    sched, _ = make(max_num_batched_tokens=9, enable_chunked_prefill=False, policy="priority")
    for rid, prio, t in [("p5", 5, 0.0), ("p1-late", 1, 2.0), ("p3", 3, 1.0), ("p1", 1, 1.5)]:
        sched.add(make_seq([rid.__len__()] * 8, rid, max_tokens=1, priority=prio, arrival=t))
    assert admission_order(sched) == ["p1", "p1-late", "p3", "p5"]


def test_queue_head_blocks_later_requests():
    """A head that cannot get blocks is not overtaken by smaller requests behind it (no starvation)."""
    sched, bm = make(num_blocks=4, block_size=4, prefix=False)  # 16 token slots
    a = make_seq([1] * 8, "a", max_tokens=4)
    sched.add(a)
    eng = FakeEngine(sched)
    eng.step()
    big, small = make_seq([2] * 12, "big", max_tokens=1), make_seq([3], "small", max_tokens=1)
    sched.add(big)
    sched.add(small)
    out = eng.step()
    assert [s.request_id for s, _ in out.scheduled] == ["a"]
    eng.run()
    assert big.finish_reason == small.finish_reason == "length"
    assert_drained(sched, bm)


# ---------------------------------------------------------------------- preemption


def test_preemption_under_tiny_cache_everything_finishes_without_leaks():
    sched, bm = make(num_blocks=6, block_size=4, max_num_batched_tokens=32)  # 24 token slots
    seqs = [
        make_seq([i, 1, 2, 3, 0, i], f"r{i}", max_tokens=8) for i in range(4)
    ]  # 14 tokens each at the end
    for s in seqs:
        sched.add(s)
    eng = FakeEngine(sched)
    preempted = []
    while sched.has_unfinished():
        preempted += eng.step().preempted
    assert sched.num_preemptions > 0 and len(preempted) == sched.num_preemptions
    assert sum(s.num_preemptions for s in seqs) == sched.num_preemptions
    assert all(s.finish_reason == "length" and len(s.output_token_ids) == 8 for s in seqs)
    assert_drained(sched, bm)


def test_preempted_sequence_requeues_at_front_and_recomputes_prompt_plus_outputs():
    sched, bm = make(num_blocks=5, block_size=4, max_num_batched_tokens=64, prefix=False)
    a = make_seq(list(range(8)), "a", max_tokens=20)
    b = make_seq(list(range(8)), "b", max_tokens=20)
    c = make_seq([1], "c", max_tokens=1, arrival=a.arrival_time + 100)
    sched.add(a)
    sched.add(b)
    eng = FakeEngine(sched)
    eng.step()  # both prefill: 2 blocks each, 1 left
    sched.add(c)
    victim = None
    for _ in range(10):
        out = eng.step()
        if out.preempted:
            victim = out.preempted[0]
            break
    assert victim is b  # the later arrival goes, the earlier one keeps running
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and not b.block_table
    assert sched.waiting[0] is b and b.num_preemptions == 1
    outputs = list(b.output_token_ids)
    assert outputs
    while b.status is SequenceStatus.WAITING:
        out = eng.step()
    first = dict((s.request_id, n) for s, n in out.scheduled)["b"]
    assert first == 8 + len(outputs)  # prompt + outputs so far, recomputed (no prefix cache here)
    assert b.output_token_ids[: len(outputs)] == outputs
    eng.run()
    assert_drained(sched, bm)


def test_priority_preempts_lowest_priority_first():
    sched, bm = make(num_blocks=5, block_size=4, policy="priority", prefix=False)
    lo = make_seq(list(range(8)), "lo", max_tokens=20, priority=9, arrival=0.0)
    hi = make_seq(list(range(8)), "hi", max_tokens=20, priority=0, arrival=1.0)
    sched.add(lo)
    sched.add(hi)
    eng = FakeEngine(sched)
    while not (out := eng.step()).preempted:
        pass
    assert out.preempted == [lo] and hi.status is SequenceStatus.RUNNING
    eng.run()
    assert_drained(sched, bm)


# ---------------------------------------------------------------------- abort / finish / reject


def test_abort_waiting_and_running_frees_blocks():
    sched, bm = make(num_blocks=16, block_size=4, max_num_seqs=1)
    run = make_seq(list(range(10)), "run", max_tokens=50)
    wait = make_seq(list(range(10)), "wait", max_tokens=50)
    sched.add(run)
    sched.add(wait)
    eng = FakeEngine(sched)
    eng.step()
    eng.step()
    bm.lookup(wait)  # a waiting sequence may hold lookup state too
    assert run.status is SequenceStatus.RUNNING and wait.status is SequenceStatus.WAITING
    assert bm.usage > 0
    assert sched.abort("wait") == [wait]
    assert sched.abort("run") == [run]
    assert sched.abort("run") == [] and sched.abort("nope") == []
    for s in (run, wait):
        assert s.is_finished and s.finish_reason == "abort" and not s.block_table
    assert_drained(sched, bm)
    assert sched.schedule().is_empty


def test_abort_between_schedule_and_update():
    sched, bm = make()
    a = make_seq(list(range(10)), "a")
    sched.add(a)
    out = sched.schedule()
    sched.abort("a")
    sched.update_after_step(out)  # skips the aborted sequence
    assert_drained(sched, bm)


def test_finish_before_update_still_caches_the_prompt():
    sched, bm = make(num_blocks=16, block_size=4)
    a = make_seq(list(range(8)), "a", max_tokens=1)
    sched.add(a)
    ((seq, n),) = sched.schedule().scheduled
    seq.num_computed_tokens += n
    seq.append_token(0)
    sched.finish(seq, "stop")  # before update_after_step: finish commits the blocks itself
    b = make_seq(list(range(8)) + [3, 3], "b")
    sched.add(b)
    out = sched.schedule()
    assert b.num_cached_tokens == 8 and out.scheduled == [(b, 2)]
    assert bm.prefix_cache_hits == 8


def test_second_request_hits_prefix_cache_through_scheduler():
    sched, bm = make(num_blocks=32, block_size=4)
    a = make_seq(list(range(13)), "a", max_tokens=2)
    sched.add(a)
    eng = FakeEngine(sched)
    eng.step()
    b = make_seq(list(range(12)) + [1, 1, 1], "b", max_tokens=2)
    sched.add(b)
    out = eng.step()
    assert dict((s.request_id, n) for s, n in out.scheduled) == {"a": 1, "b": 3}
    assert b.num_cached_tokens == 12 and bm.prefix_cache_hits == 12
    eng.run()
    assert_drained(sched, bm)


def test_update_after_step_checks_the_engine_advanced():
    sched, _ = make()
    sched.add(make_seq(list(range(10)), "a"))
    out = sched.schedule()
    with pytest.raises(RuntimeError, match="num_computed_tokens"):
        sched.update_after_step(out)


def test_prompt_that_can_never_fit_is_rejected_not_looped():
    sched, bm = make(num_blocks=4, block_size=4)  # 16 token slots
    big = make_seq(list(range(17)), "big")
    ok = make_seq(list(range(3)), "ok", max_tokens=2)
    sched.add(big)
    sched.add(ok)
    assert big.is_finished and big.finish_reason == "error" and "17 tokens" in big.error
    out = sched.schedule()
    assert out.finished == [big] and [s for s, _ in out.scheduled] == [ok]
    assert sched.abort("big") == []
    FakeEngine(sched).run()
    assert_drained(sched, bm)


def test_generation_past_cache_or_max_model_len_finishes_with_length():
    for cfg, expected_outputs in [({}, 3), ({"max_model_len": 15}, 2)]:
        sched, bm = make(num_blocks=4, block_size=4, **cfg)
        s = make_seq(list(range(14)), "s", max_tokens=100)
        sched.add(s)
        eng = FakeEngine(sched)
        finished = []
        while sched.has_unfinished():
            finished += eng.step().finished
        assert finished == [s] and s.finish_reason == "length" and s.error is None
        assert len(s.output_token_ids) == expected_outputs and s.num_tokens > cfg.get("max_model_len", 16)
        assert_drained(sched, bm)


def test_chunked_off_prompt_over_budget_is_rejected():
    sched, _ = make(max_num_batched_tokens=8, enable_chunked_prefill=False)
    s = make_seq(list(range(9)), "s")
    sched.add(s)
    assert s.finish_reason == "error" and "max_num_batched_tokens" in s.error
    assert sched.has_unfinished() and sched.schedule().finished == [s] and not sched.has_unfinished()


def test_a_sequence_holding_blocks_is_refused():
    sched, bm = make(num_blocks=16, block_size=4)
    seq = make_seq(list(range(6)), "p", max_tokens=3)
    seq.block_table = [3]
    with pytest.raises(ValueError, match="already holds cache blocks"):
        sched.add(seq)
    assert not sched.has_unfinished()


# ---------------------------------------------------------------------- random interleavings

BASES = [[0, 1, 2, 3] * 4, [3, 2, 1, 0] * 4, [1] * 16]  # shared prompt prefixes: prefix-cache hits happen

prompts = st.builds(
    lambda base, cut, tail: (BASES[base][:cut] + tail) or [0],
    st.integers(0, len(BASES) - 1),
    st.integers(0, 16),
    st.lists(st.integers(0, VOCAB - 1), max_size=14),
)

add_op = st.tuples(
    st.just("add"), prompts, st.integers(1, 8), st.integers(0, 3)
)  # prompt, max_tokens, priority
ops = st.lists(
    st.one_of(
        add_op,
        add_op,
        st.tuples(st.just("abort"), st.integers(0, 99)),
        st.tuples(st.just("step"), st.integers(1, 3)),
    ),
    min_size=15,
    max_size=50,
)


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    ops=ops,
    num_blocks=st.integers(4, 16),
    block_size=st.sampled_from([2, 4]),
    max_num_seqs=st.integers(1, 6),
    budget=st.integers(1, 40),
    chunked=st.booleans(),
    policy=st.sampled_from(["fcfs", "priority"]),
    prefix=st.booleans(),
)
# found by this test (2026-11-30): chunked prefill off, a 26-token prompt preempted at 31 tokens could not be
# recomputed in a 30-token step and ended a token short of max_tokens, where unpreempted it would have run on
@example(ops=[("add", [0], 1, 0)] * 4 + [("abort", 0)] * 3 + [("add", BASES[0][:15] + [0] * 11, 6, 1)]
         + [("abort", 0)] * 3 + [("step", 2), ("add", [0], 1, 0), ("add", [0], 1, 0), ("add", BASES[0][:3] + [0] * 3, 4, 0)],
         num_blocks=10, block_size=4, max_num_seqs=3, budget=1, chunked=False, policy="priority", prefix=False)
def test_random_interleavings(ops, num_blocks, block_size, max_num_seqs, budget, chunked, policy, prefix):
    if not chunked:
        budget = max(budget, 30)
    sched, bm = make(
        num_blocks=num_blocks,
        block_size=block_size,
        prefix=prefix,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        enable_chunked_prefill=chunked,
        policy=policy,
    )
    eng = FakeEngine(sched)
    seqs: list[Sequence] = []
    clock = 0.0

    def step():
        live = [s for s in seqs if not s.is_finished]
        oldest = min(live, key=sched._key) if live else None
        out = eng.step()
        if policy == "fcfs" and oldest is not None:
            # no starvation: the oldest unfinished sequence makes progress in every step
            assert oldest in [s for s, _ in out.scheduled] or oldest in out.finished

    for op in ops:
        if op[0] == "add":
            clock += 1.0
            s = make_seq(op[1], f"r{len(seqs)}", max_tokens=op[2], priority=op[3], arrival=clock)
            seqs.append(s)
            sched.add(s)
        elif op[0] == "abort" and seqs:
            target = seqs[op[1] % len(seqs)]
            was_finished = target.is_finished
            assert sched.abort(target.request_id) == ([] if was_finished else [target])
            assert target.is_finished and not target.block_table
        elif op[0] == "step":
            for _ in range(op[1]):
                step()
        bm.check_invariants()

    # drain: bounded, since the head of the queue always progresses (fcfs) and priorities are finite
    capacity = num_blocks * block_size
    limit = sched.max_tokens_per_seq  # the cache, or with chunked prefill off the step budget if smaller
    assert limit == (capacity if chunked else min(capacity, budget))
    bound = 1 + sum(s.num_tokens + s.sampling_params.max_tokens for s in seqs) * (1 + len(seqs))
    n = 0
    while sched.has_unfinished():
        step()
        n += 1
        assert n <= bound, "starvation: did not drain"
    for s in seqs:
        assert s.is_finished
        if s.finish_reason == "length":  # max_tokens, or the most a sequence may hold (whether preempted or not)
            assert len(s.output_token_ids) == s.sampling_params.max_tokens or s.num_tokens == limit + 1
        elif s.finish_reason == "error":
            assert s.num_prompt_tokens > limit and s.error
        else:
            assert s.finish_reason == "abort"
    event(f"num_seqs={min(len(seqs), 5)}")
    event(f"preempted={sched.num_preemptions > 0} prefix_hits={bm.prefix_cache_hits > 0}")
    assert_drained(sched, bm)


def test_unchunked_sequences_never_outgrow_one_step():
    """Chunked prefill off: a sequence may hold at most max_num_batched_tokens tokens, running as well as waiting,
    since a preempted one is recomputed in one step. So it ends ("length") where a preempted one would have to:
    a 26-token prompt with a 30-token step ends after 5 tokens (31 held, the last never computed), with or
    without preemption. (Before, it ran on to 8 tokens unless preempted past 30, and then ended short.)"""
    sched, bm = make(num_blocks=10, block_size=4, prefix=False, max_num_batched_tokens=30,
                     enable_chunked_prefill=False)
    assert sched.max_tokens_per_seq == 30
    seq = make_seq([1] * 26, "long", max_tokens=8)
    sched.add(seq)
    FakeEngine(sched).run()
    assert seq.finish_reason == "length" and len(seq.output_token_ids) == 5 and seq.num_computed_tokens == 30
    assert_drained(sched, bm)


def test_default_long_prefill_cap_applies_only_when_the_step_is_shared():
    """The engine's default cap (long_prefill_only_when_shared): a prompt alone takes the whole budget; once
    another request waits, the long prompt's chunk is capped and the newcomer is admitted in the same step."""
    sched, _ = make(num_blocks=256, max_num_batched_tokens=100, long_prefill_token_threshold=8,
                    long_prefill_only_when_shared=True, prefix=False)
    a = make_seq(list(range(300)), "a")
    sched.add(a)
    eng = FakeEngine(sched)
    assert [(s.request_id, n) for s, n in eng.step().scheduled] == [("a", 100)]
    sched.add(make_seq(list(range(500, 520)), "b"))
    assert [(s.request_id, n) for s, n in eng.step().scheduled] == [("a", 8), ("b", 8)]
