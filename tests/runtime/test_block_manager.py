"""BlockManager: prefix-cache hits, LRU eviction, sliding-window release, and a stateful model check of the
bookkeeping.

The stateful test also keeps a fake device cache (block -> token written in each slot): every
computed token of every live sequence must read back through its block table, so a prefix hit that
hands out the wrong block, or a write into a shared block, is caught, not just a bad ref count.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from mini_infer.runtime.block_manager import BlockManager
from mini_infer.runtime.sequence import Sequence
from mini_infer.sampling_params import SamplingParams


def make_seq(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(request_id=rid, prompt_token_ids=list(tokens), sampling_params=SamplingParams())


def run_prompt(bm: BlockManager, seq: Sequence) -> None:
    """Allocate and 'compute' the whole prompt in one step, then commit."""
    bm.allocate(seq, seq.num_tokens - bm.lookup(seq)[1])
    seq.num_computed_tokens = seq.num_tokens
    bm.commit_computed(seq)


# ---------------------------------------------------------------------- unit tests


def test_second_request_hits_shared_prefix():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq(list(range(10)), "a")
    run_prompt(bm, a)
    assert bm.prefix_cache_queries == 10 and bm.prefix_cache_hits == 0
    b = make_seq(list(range(8)) + [99, 98, 97], "b")
    assert bm.get_computed_blocks(b.token_ids) == (a.block_table[:2], 8)
    assert bm.prefix_cache_queries == 10  # lookups have no side effects
    bm.allocate(b, 3)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] not in a.block_table
    assert b.num_computed_tokens == b.num_cached_tokens == 8
    assert bm.prefix_cache_queries == 21 and bm.prefix_cache_hits == 8
    assert bm.ref_counts[a.block_table[0]] == 2
    bm.check_invariants()


def test_chain_hash_depends_on_whole_prefix():
    bm = BlockManager(num_blocks=16, block_size=4)
    run_prompt(bm, make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9], "a"))
    # same second block, different first block: no hit at all
    assert bm.get_computed_blocks([0, 2, 3, 4, 5, 6, 7, 8, 9]) == ([], 0)


def test_never_covers_the_whole_prompt():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = make_seq(list(range(8)), "a")
    run_prompt(bm, a)
    blocks, n = bm.get_computed_blocks(list(range(8)))
    assert n == 4 and blocks == a.block_table[:1]  # the last block is recomputed for its logits
    b = make_seq(list(range(8)), "b")
    bm.allocate(b, 4)
    assert b.num_computed_tokens == 4 and len(b.block_table) == 2 and b.block_table[1] != a.block_table[1]
    assert bm.get_computed_blocks(list(range(9)))[1] == 8
    assert bm.get_computed_blocks([0]) == ([], 0)
    assert bm.get_computed_blocks([]) == ([], 0)


def test_lru_eviction_order_and_revival():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_seq([1, 2, 3, 4, 9], "a")  # 2 full blocks + 1 partial
    run_prompt(bm, a)
    b = make_seq([5, 6, 7], "b")  # 1 full block + 1 partial (not a hit of a)
    # only 1 block is free besides a's: b must wait
    assert not bm.can_allocate(b, 3)
    a0, a1, a2 = a.block_table
    bm.free(a)  # tail first: a2 (unhashed) -> free pool, then a1, a0 into the LRU
    assert bm.num_cached_blocks == 2 and bm.num_free_blocks == 4
    run_prompt(bm, b)  # takes the never-cached free blocks first
    assert set(b.block_table) == {a2, 3} and bm.num_evictions == 0
    assert bm.get_computed_blocks([1, 2, 3, 4, 0])[1] == 4
    b0, b1 = b.block_table
    bm.free(b)  # b1 (unhashed) -> free pool; LRU now: a1, a0, b0
    c = make_seq([8, 8, 8, 8, 8], "c")
    bm.allocate(c, 5)  # 3 blocks: the free one first, then evicts a1 (a's tail), then a0
    assert c.block_table == [b1, a1, a0] and bm.num_evictions == 2
    assert bm.get_computed_blocks([1, 2, 3, 4, 0]) == ([], 0)
    assert bm.get_computed_blocks([5, 6, 7])[1] == 2  # b's block survived
    bm.check_invariants()
    # a hit on a cached block revives it: it leaves the LRU and can no longer be evicted
    d = make_seq([5, 6, 0], "d")
    assert not bm.can_allocate(d, 1)  # the hit b0 is the only unreferenced block: nothing left for the tail
    bm.free(c)  # unhashed: straight to the free pool
    assert bm.num_cached_blocks == 1
    bm.allocate(d, 1)
    assert d.block_table[0] == b0 and d.num_computed_tokens == 2
    assert bm.num_cached_blocks == 0 and bm.ref_counts[b0] == 1
    assert bm.num_free_blocks == 2  # d's two blocks are out of reach
    e = make_seq([1, 1, 1, 1], "e")
    assert not bm.can_allocate(e, 5)
    bm.allocate(e, 4)
    assert b0 not in e.block_table and bm.num_free_blocks == 0
    bm.check_invariants()


def test_can_allocate_counts_revived_hits_as_taken():
    bm = BlockManager(num_blocks=3, block_size=4)
    a = make_seq(list(range(9)), "a")
    run_prompt(bm, a)  # 3 blocks, 2 hashed
    bm.free(a)
    assert bm.num_free_blocks == 3 and bm.num_cached_blocks == 2
    b = make_seq(list(range(8)) + [50, 51, 52, 53, 54], "b")  # hits both cached blocks
    assert bm.lookup(b)[1] == 8
    # 13 tokens need 4 blocks: 2 hits + 2 new, but only 1 block is free once the hits are revived
    assert not bm.can_allocate(b, 5)
    with pytest.raises(RuntimeError):
        bm.allocate(b, 5)
    assert bm.can_allocate(b, 4)
    bm.allocate(b, 4)
    bm.check_invariants()


def test_duplicate_block_stays_unhashed():
    bm = BlockManager(num_blocks=8, block_size=4)
    a, b = make_seq(list(range(6)), "a"), make_seq(list(range(6)), "b")
    bm.allocate(a, 6)
    bm.allocate(b, 6)  # admitted before a committed: no hit, computes the same block
    for s in (a, b):
        s.num_computed_tokens = 6
        bm.commit_computed(s)
    assert bm.block_hashes[a.block_table[0]] is not None and bm.block_hashes[b.block_table[0]] is None
    bm.check_invariants()
    bm.free(a)
    bm.free(b)
    assert bm.num_cached_blocks == 1 and bm.num_free_blocks == 8
    bm.check_invariants()


def test_release_out_of_window_returns_dead_leading_blocks():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(list(range(14)), "w")
    run_prompt(bm, seq)  # 14 tokens computed in blocks 0..3
    table = list(seq.block_table)
    # window 6: the next query (position 14) reads positions 9..14, so blocks 0 and 1 (positions 0..7) are dead
    assert bm.release_out_of_window(seq, 6) == 2
    assert seq.num_released_blocks == 2 and seq.block_table == table  # stale entries keep positions aligned
    assert [bm.ref_counts[b] for b in table] == [0, 0, 1, 1]
    assert bm.num_free_blocks == 6  # 4 never used + the 2 released (cached, evictable)
    bm.check_invariants()
    assert bm.release_out_of_window(seq, 6) == 0  # idempotent
    seq.append_token(99)
    bm.allocate(seq, 1)
    seq.num_computed_tokens += 1
    bm.commit_computed(seq)
    bm.check_invariants()
    # a second sequence with the same prompt still hits the released (evictable) prefix blocks
    other = make_seq(list(range(14)), "o")
    assert bm.lookup(other)[1] == 12
    bm.free(seq)
    assert seq.num_released_blocks == 0 and bm.num_free_blocks == 8
    bm.check_invariants()


def test_free_is_idempotent_and_reset_prefix_cache():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = make_seq([1, 2, 3], "a")
    run_prompt(bm, a)
    bm.free(a)
    bm.free(a)
    assert a.block_table == [] and bm.num_cached_blocks == 1
    bm.check_invariants()
    assert bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0 and bm.get_computed_blocks([1, 2, 3]) == ([], 0)
    bm.check_invariants()


def test_prefix_caching_off():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = make_seq(list(range(9)), "a")
    run_prompt(bm, a)
    b = make_seq(list(range(9)), "b")
    assert bm.lookup(b) == ([], 0)
    bm.allocate(b, 9)
    assert not set(a.block_table) & set(b.block_table) and bm.prefix_cache_queries == 0
    bm.free(a)
    bm.free(b)
    assert bm.num_cached_blocks == 0 and bm.usage == 0.0
    bm.check_invariants()


def test_usage():
    bm = BlockManager(num_blocks=4, block_size=4)
    a = make_seq(list(range(5)), "a")
    bm.allocate(a, 5)
    assert bm.usage == 0.5


# ---------------------------------------------------------------------- stateful model check

VOCAB = 3  # tiny vocabulary and short blocks: prefixes collide, hits and evictions are frequent
BLOCK = 2


class BlockManagerMachine(RuleBasedStateMachine):
    """Sequences move waiting -> live (allocated) -> freed; rules pick them by a drawn index."""

    def __init__(self) -> None:
        super().__init__()
        self.bm: BlockManager
        self.device: dict[int, list[int | None]]
        self.waiting: list[Sequence] = []
        self.live: list[Sequence] = []
        self.seqs: list[Sequence] = []  # every sequence ever created
        self.counter = 0

    def _write(self, seq: Sequence, n: int) -> None:
        """'Compute' n tokens: write them into the device cache, then advance num_computed_tokens."""
        for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            block = seq.block_table[pos // BLOCK]
            assert self.bm.ref_counts[block] == 1, "writing into a shared block"
            assert self.bm.block_hashes[block] is None, "writing into a cached block"
            self.device[block][pos % BLOCK] = seq.token_ids[pos]
        seq.num_computed_tokens += n

    def _new(self, tokens: list[int]) -> None:
        self.counter += 1
        seq = make_seq(tokens, f"s{self.counter}")
        self.seqs.append(seq)
        self.waiting.append(seq)

    @initialize(
        num_blocks=st.integers(3, 10),
        prompts=st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8), max_size=4),
        window=st.integers(1, 9),
    )
    def warm_cache(self, num_blocks, prompts, window):
        """Pick the pool size and the model's attention window; start with some prefixes cached, so hits and
        evictions come early."""
        self.bm = BlockManager(num_blocks=num_blocks, block_size=BLOCK)
        self.window = window
        self.device = {b: [None] * BLOCK for b in range(num_blocks)}
        for tokens in prompts:
            if self.bm.num_blocks_for(len(tokens)) > num_blocks:
                continue
            self._new(tokens)
            seq = self.waiting.pop()
            n = seq.num_tokens - self.bm.lookup(seq)[1]
            self.bm.allocate(seq, n)
            self._write(seq, n)
            self.bm.commit_computed(seq)
            self.bm.free(seq)

    @rule(tokens=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12))
    def new_seq(self, tokens):
        self._new(tokens)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 999), cut=st.integers(0, 12), tail=st.lists(st.integers(0, VOCAB - 1), max_size=6))
    def new_seq_sharing_prefix(self, i, cut, tail):
        other = self.seqs[i % len(self.seqs)]
        self._new(other.token_ids[:cut] + tail or [0])

    @precondition(lambda self: self.waiting)
    @rule(i=st.integers(0, 999), frac=st.floats(0, 1), commit=st.booleans())
    def admit(self, i, frac, commit):
        seq = self.waiting[i % len(self.waiting)]
        _, num_cached = self.bm.lookup(seq)
        assert (self.bm.get_computed_blocks(seq.token_ids)[1]) == num_cached
        n = max(1, round(frac * (seq.num_tokens - num_cached)))
        if not self.bm.can_allocate(seq, n):
            with pytest.raises(RuntimeError):
                self.bm.allocate(seq, n)
            assert seq.block_table == []
            return  # stays waiting
        queries, hits, evictions = (
            self.bm.prefix_cache_queries,
            self.bm.prefix_cache_hits,
            self.bm.num_evictions,
        )
        self.bm.allocate(seq, n)
        event(f"admit: hit={num_cached > 0} evicted={self.bm.num_evictions > evictions}")
        assert seq.num_computed_tokens == seq.num_cached_tokens == num_cached
        assert self.bm.prefix_cache_queries == queries + seq.num_tokens
        assert self.bm.prefix_cache_hits == hits + num_cached
        assert len(seq.block_table) == self.bm.num_blocks_for(num_cached + n)
        self._write(seq, n)
        self.waiting.remove(seq)
        self.live.append(seq)
        if commit:
            self.bm.commit_computed(seq)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 999), frac=st.floats(0, 1), token=st.integers(0, VOCAB - 1), commit=st.booleans())
    def step(self, i, frac, token, commit):
        seq = self.live[i % len(self.live)]
        if seq.num_uncomputed_tokens == 0:  # "sampled" a token: the sequence grows by one
            seq.append_token(token)
        n = max(1, round(frac * seq.num_uncomputed_tokens))
        if self.bm.can_allocate(seq, n):
            self.bm.allocate(seq, n)
            assert len(seq.block_table) * BLOCK >= seq.num_computed_tokens + n
            self._write(seq, n)
        else:
            with pytest.raises(RuntimeError):
                self.bm.allocate(seq, n)
        if commit:
            self.bm.commit_computed(seq)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 999))
    def commit(self, i):
        self.bm.commit_computed(self.live[i % len(self.live)])

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 999))
    def slide(self, i):
        """A sliding-window model releases the blocks its next query can no longer read."""
        seq = self.live[i % len(self.live)]
        released = self.bm.release_out_of_window(seq, self.window)
        event(f"slide: released={released > 0}")
        first_readable = max(seq.num_computed_tokens - self.window + 1, 0)
        assert seq.num_released_blocks * BLOCK <= first_readable

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 999))
    def finish(self, i):
        seq = self.live.pop(i % len(self.live))
        self.bm.commit_computed(seq)
        self.bm.free(seq)
        assert seq.block_table == []

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 999))
    def abort(self, i):
        seq = self.live.pop(i % len(self.live))
        self.bm.free(seq)
        self.bm.free(seq)  # idempotent

    @precondition(lambda self: self.waiting)
    @rule(i=st.integers(0, 999))
    def abort_waiting(self, i):
        self.bm.free(self.waiting.pop(i % len(self.waiting)))

    @rule(dice=st.integers(0, 4))
    def reset_cache(self, dice):
        if dice == 0:  # rarely, or hardly anything would stay cached
            self.bm.reset_prefix_cache()

    @invariant()
    def consistent(self):
        self.bm.check_invariants()
        for seq in self.live:
            assert len(seq.block_table) * BLOCK >= seq.num_computed_tokens
            for pos in range(seq.num_released_blocks * BLOCK, seq.num_computed_tokens):  # the live blocks
                got = self.device[seq.block_table[pos // BLOCK]][pos % BLOCK]
                assert got == seq.token_ids[pos], f"{seq.request_id} reads a wrong token at position {pos}"

    def teardown(self):
        for seq in self.seqs:
            self.bm.free(seq)
        self.bm.check_invariants()
        assert self.bm.num_free_blocks == self.bm.num_blocks  # every block free or cached: nothing leaked
        assert self.bm.usage == 0.0
        assert not self.bm._states


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=list(HealthCheck)
)
TestBlockManagerMachine = BlockManagerMachine.TestCase


def test_stateful_run_sees_hits_and_evictions():
    """Guard the guard: the stateful setting does reach prefix hits and evictions."""
    bm = BlockManager(num_blocks=10, block_size=BLOCK)
    seqs = [make_seq([i % 2, 1, 0, 1, 2], f"x{i}") for i in range(12)]
    for s in seqs:
        run_prompt(bm, s)
        bm.free(s)
    assert bm.prefix_cache_hits > 0
    for i in range(20):
        s = make_seq([2, 2, i % 3, i % 2, 0, 1, 2, 0], f"y{i}")
        run_prompt(bm, s)
        bm.free(s)
    assert bm.num_evictions > 0
    bm.check_invariants()
