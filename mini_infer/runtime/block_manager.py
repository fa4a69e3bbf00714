"""Paged KV-cache bookkeeping: which cache blocks hold which sequence's tokens, with prefix caching.

Pure Python, no torch: the device-side cache is indexed by the block ids handed out here.

Blocks are the ints ``0 .. num_blocks - 1``; each holds ``block_size`` consecutive tokens of one
sequence. Under a sliding attention window, blocks a sequence's later queries can no longer read go back to
the pool while the sequence runs (``release_out_of_window``; they stay in its table as stale entries). Every block is in exactly one of three places:

- the *free pool*: unreferenced and carrying no hash (its contents are garbage);
- the *evictable LRU*: unreferenced but carrying a hash, so a later request whose prompt starts
  with the same tokens can reuse it (a prefix-cache hit) until it is evicted;
- *referenced*: ``ref_count > 0``, listed in that many live sequences' block tables.

Prefix caching: a block that is full of computed tokens gets a chain hash
``H(parent_hash, token_ids_of_block)`` (BLAKE2b over the parent digest and the packed token ids), so
equal hashes mean equal *whole prefixes*, not merely equal blocks. ``hash_to_block`` maps each hash
to the one block carrying it. Allocation prefers never-cached free blocks and only then evicts the
least recently freed cached block, dropping its hash.

Lifecycle, as the scheduler drives it::

    can_allocate(seq, n) / allocate(seq, n)   # first call on an empty table takes prefix hits first
    ... engine computes n tokens, seq.num_computed_tokens += n ...
    commit_computed(seq)                      # hash blocks that became full, so others can hit them
    release_out_of_window(seq, window)        # sliding-window models: blocks no query can read again
    free(seq)                                 # when finished, aborted or preempted

The token ids of a full, computed block must never change afterwards (the hashes are cached per
sequence); ``free`` must be called for every sequence this manager has seen, to drop that cache.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field

from mini_infer.runtime.sequence import Sequence

_ROOT_HASH = hashlib.blake2b(b"mini-infer/prefix-cache/v1", digest_size=32).digest()


def hash_block(parent_hash: bytes, token_ids: SequenceABC[int]) -> bytes:
    """Chain hash of one full block: stable across processes and runs, collision-resistant (256 bits)."""
    h = hashlib.blake2b(parent_hash, digest_size=32)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


@dataclass(eq=False)
class _SeqState:
    """Per-sequence cache of chain hashes (one per full block, in order) and the commit mark."""

    seq: Sequence
    hashes: list[bytes] = field(default_factory=list)
    num_committed: int = 0  # blocks 0..num_committed-1 were already offered to the prefix cache


class BlockManager:
    """Hands out KV-cache blocks to sequences, ref-counts shared ones, and caches full prompt blocks."""

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts: list[int] = [0] * num_blocks
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        self.hash_to_block: dict[bytes, int] = {}
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # least recently freed first
        self._states: dict[int, _SeqState] = {}  # seq_id -> state, for every sequence seen and not freed
        # Counters (tokens, like vLLM's prefix-cache metrics; evictions in blocks).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_evictions = 0

    # ------------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: never-cached free ones plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Unreferenced blocks still holding a reusable prefix (the evictable LRU)."""
        return len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by live sequences."""
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by live sequences (the KV-cache usage metric); cached-but-free count as free."""
        return self.num_used_blocks / self.num_blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hit tokens over queried tokens since start (0.0 before any query)."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, token_ids: SequenceABC[int]) -> tuple[list[int], int]:
        """Longest run of leading full blocks of `token_ids` already in the prefix cache.

        Returns ``(block_ids, num_cached_tokens)`` with ``num_cached_tokens = len(block_ids) * block_size``.
        Never covers the whole prompt: at least its last token is left to compute (the model must
        produce logits for it), so ``num_cached_tokens < len(token_ids)``. No side effects: ref counts,
        the LRU order and the counters are untouched.
        """
        if not self.enable_prefix_caching:
            return [], 0
        hashes = self._extend_hashes([], token_ids, self._max_cacheable_blocks(len(token_ids)))
        return self._lookup(hashes)

    def lookup(self, seq: Sequence) -> tuple[list[int], int]:
        """`get_computed_blocks(seq.token_ids)`, with the sequence's block hashes cached until `free(seq)`.

        A sequence that asks for prompt logprobs gets no hits (as in vLLM): the logits of cached positions
        are never computed. Its own blocks are still committed for others to hit.
        """
        if not self.enable_prefix_caching or seq.sampling_params.prompt_logprobs is not None:
            return [], 0
        state = self._state(seq)
        n = self._max_cacheable_blocks(seq.num_tokens)
        hashes = self._extend_hashes(state.hashes, seq.token_ids, n)
        return self._lookup(hashes[:n])

    def holds(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether `seq`'s blocks already hold ``seq.num_computed_tokens + num_new_tokens`` tokens (then
        `allocate` would add nothing): a decode step needs a block only at a block boundary."""
        return seq.num_computed_tokens + num_new_tokens <= len(seq.block_table) * self.block_size

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether `allocate(seq, num_new_tokens)` would succeed now.

        For a sequence with an empty block table (first allocation of a waiting sequence),
        `num_new_tokens` counts tokens *after* the prefix-cache hits that allocation takes
        (see `get_computed_blocks`); hit blocks sitting in the evictable LRU are not counted as free,
        since reviving them takes them out of the pool.
        """
        if not seq.block_table:
            hits, num_cached = self.lookup(seq)
            num_revived = sum(1 for b in hits if self.ref_counts[b] == 0)
            needed = self.num_blocks_for(num_cached + num_new_tokens) - len(hits)
            return needed <= self.num_free_blocks - num_revived
        return self._num_missing_blocks(seq, num_new_tokens) <= self.num_free_blocks

    # ------------------------------------------------------------------ mutations

    def allocate(self, seq: Sequence, num_new_tokens: int) -> list[int]:
        """Grow `seq.block_table` to hold ``seq.num_computed_tokens + num_new_tokens`` tokens.

        On an empty table this is `allocate_prompt` (prefix hits first). Returns the newly added
        block ids. Raises RuntimeError when out of blocks: check `can_allocate` first.
        """
        if not seq.block_table:
            return self.allocate_prompt(seq, num_new_tokens)
        missing = self._num_missing_blocks(seq, num_new_tokens)
        if missing > self.num_free_blocks:
            raise RuntimeError(f"out of KV-cache blocks: need {missing}, {self.num_free_blocks} free")
        new = [self._take_block() for _ in range(missing)]
        seq.block_table.extend(new)
        return new

    def allocate_prompt(self, seq: Sequence, num_new_tokens: int) -> list[int]:
        """First allocation of a waiting sequence (empty block table): take prefix-cache hits, then blocks.

        Sets ``seq.num_computed_tokens = seq.num_cached_tokens = <hit tokens>`` (anything computed
        before, e.g. ahead of a preemption, is gone with its blocks), revives / ref-counts the hit
        blocks, counts the query and the hits, then allocates room for `num_new_tokens` more tokens.
        Returns the newly allocated (non-hit) block ids.
        """
        if seq.block_table:
            raise ValueError(f"sequence {seq.request_id!r} already holds blocks")
        if not self.can_allocate(seq, num_new_tokens):
            raise RuntimeError(f"out of KV-cache blocks for sequence {seq.request_id!r}")
        hits, num_cached = self.lookup(seq)
        if self.enable_prefix_caching:
            self.prefix_cache_queries += seq.num_tokens
            self.prefix_cache_hits += num_cached
        for b in hits:
            if self.ref_counts[b] == 0:
                del self._evictable[b]
            self.ref_counts[b] += 1
        seq.block_table.extend(hits)
        seq.num_computed_tokens = num_cached
        seq.num_cached_tokens = num_cached
        state = self._state(seq)
        state.num_committed = len(hits)  # hit blocks already carry their hash
        missing = self.num_blocks_for(num_cached + num_new_tokens) - len(hits)
        new = [self._take_block() for _ in range(missing)]
        seq.block_table.extend(new)
        return new

    def commit_computed(self, seq: Sequence) -> None:
        """Register hashes for `seq`'s blocks that are now full of computed tokens.

        Call after a step advanced ``seq.num_computed_tokens``. A block whose hash is already
        cached under another block (two requests computed the same prefix at once) stays unhashed:
        the existing mapping wins and the duplicate returns to the free pool when released.
        Idempotent; a no-op with prefix caching off.
        """
        if not self.enable_prefix_caching or not seq.block_table:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        state = self._state(seq)
        if state.num_committed >= num_full:
            return
        hashes = self._extend_hashes(state.hashes, seq.token_ids, num_full)
        for i in range(max(state.num_committed, seq.num_released_blocks), num_full):
            block, h = seq.block_table[i], hashes[i]
            if self.block_hashes[block] is not None:  # a prefix-cache hit: already cached
                continue
            if h in self.hash_to_block:  # same prefix cached elsewhere: keep that one
                continue
            self.block_hashes[block] = h
            self.hash_to_block[h] = block
        state.num_committed = num_full

    def release_out_of_window(self, seq: Sequence, window: int) -> int:
        """Return to the pool the leading blocks of `seq` that no later query can read under an attention
        window of `window` tokens; returns how many were released.

        The next query sits at position `seq.num_computed_tokens` (or later) and reads keys from
        `position - window + 1` on, so blocks wholly before `num_computed_tokens - window + 1` are dead. They
        keep their place in the block table (stale ids that attention never reads: positions stay aligned
        with table columns) and `seq.num_released_blocks` counts them. With async scheduling the step in
        flight may still read such a block; a block reused by another sequence is written only by a later
        step on the same device queue, after that read. Released full blocks keep their prefix-cache hash.
        """
        dead = max(seq.num_computed_tokens - window + 1, 0) // self.block_size
        dead = min(dead, len(seq.block_table))
        released = 0
        for i in range(seq.num_released_blocks, dead):
            self._release(seq.block_table[i])
            released += 1
        seq.num_released_blocks = max(seq.num_released_blocks, dead)
        return released

    def free(self, seq: Sequence) -> None:
        """Release all of `seq`'s blocks and clear its block table. Idempotent.

        Ref counts drop by one; a block reaching zero goes to the evictable LRU if it carries a hash,
        else to the free pool. Blocks are released tail first, so a sequence's last blocks are
        evicted before its first ones (the shared prefix outlives the tail). Leaves
        ``seq.num_computed_tokens`` alone: the caller resets it on preemption.
        """
        for b in reversed(seq.block_table[seq.num_released_blocks:]):
            self._release(b)
        seq.block_table = []  # a new list, not clear(): the model runner mirrors tables by identity
        seq.num_released_blocks = 0
        self._states.pop(seq.seq_id, None)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (e.g. after a weight update): no later request hits old blocks.

        Evictable blocks return to the free pool; blocks in use lose their hash and stay with their
        sequences. Returns True (vLLM's signature).
        """
        while self._evictable:
            b, _ = self._evictable.popitem(last=False)
            self._free.append(b)
        for h, b in self.hash_to_block.items():
            assert self.block_hashes[b] == h
            self.block_hashes[b] = None
        self.hash_to_block.clear()
        return True

    def reset_counters(self) -> None:
        """Zero the prefix-cache and eviction counters."""
        self.prefix_cache_queries = self.prefix_cache_hits = self.num_evictions = 0

    # ------------------------------------------------------------------ checks

    def check_invariants(self) -> None:
        """Assert the bookkeeping is consistent (for tests; O(total blocks + table lengths)).

        Every block is in exactly one of {free pool, evictable LRU, referenced}; free blocks carry no
        hash and evictable ones do; ref counts equal the number of live block tables holding the
        block; no table holds a block twice; `hash_to_block` and the blocks' hashes agree both ways;
        a hashed block in a live table holds that sequence's prefix (its hash is the chain hash of
        the sequence's tokens up to that block).
        """
        free = list(self._free)
        assert len(set(free)) == len(free), "free pool holds a block twice"
        free_set, evictable = set(free), set(self._evictable)
        assert not free_set & evictable, "block both free and evictable"
        for b in range(self.num_blocks):
            ref = self.ref_counts[b]
            places = (b in free_set) + (b in evictable) + (ref > 0)
            assert places == 1, f"block {b} in {places} places (ref {ref})"
            assert ref >= 0, f"block {b} has negative ref count"
            if b in free_set:
                assert self.block_hashes[b] is None, f"free block {b} carries a hash"
            if b in evictable:
                assert self.block_hashes[b] is not None, f"evictable block {b} carries no hash"
        counts = [0] * self.num_blocks
        for state in self._states.values():
            table = state.seq.block_table[state.seq.num_released_blocks:]  # the live part
            assert len(set(table)) == len(table), f"{state.seq.request_id!r} holds a block twice"
            for b in table:
                counts[b] += 1
        assert counts == self.ref_counts, "ref counts differ from live block tables"
        for h, b in self.hash_to_block.items():
            assert self.block_hashes[b] == h, f"hash map points at block {b} that carries another hash"
        num_hashed = sum(h is not None for h in self.block_hashes)
        assert num_hashed == len(self.hash_to_block), "a hashed block is missing from the hash map"
        if not self.enable_prefix_caching:
            assert not self.hash_to_block
        for state in self._states.values():
            seq = state.seq
            chain = self._extend_hashes(
                [], seq.token_ids, min(len(seq.block_table), seq.num_tokens // self.block_size)
            )
            for i, b in enumerate(seq.block_table):
                if i >= seq.num_released_blocks and self.block_hashes[b] is not None:
                    assert i < len(chain) and self.block_hashes[b] == chain[i], (
                        f"block {b} at position {i} of {seq.request_id!r} carries a hash of other tokens"
                    )

    # ------------------------------------------------------------------ internals

    def _max_cacheable_blocks(self, num_tokens: int) -> int:
        # Full blocks strictly before the last token: the last token is always recomputed.
        return max(num_tokens - 1, 0) // self.block_size

    def _extend_hashes(
        self, hashes: list[bytes], token_ids: SequenceABC[int], num_blocks: int
    ) -> list[bytes]:
        bs = self.block_size
        parent = hashes[-1] if hashes else _ROOT_HASH
        for i in range(len(hashes), num_blocks):
            parent = hash_block(parent, token_ids[i * bs : (i + 1) * bs])
            hashes.append(parent)
        return hashes

    def _lookup(self, hashes: list[bytes]) -> tuple[list[int], int]:
        blocks: list[int] = []
        for h in hashes:
            b = self.hash_to_block.get(h)
            if b is None:
                break
            blocks.append(b)
        return blocks, len(blocks) * self.block_size

    def _state(self, seq: Sequence) -> _SeqState:
        state = self._states.get(seq.seq_id)
        if state is None:
            state = self._states[seq.seq_id] = _SeqState(seq)
        return state

    def _num_missing_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        return max(self.num_blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table), 0)

    def _release(self, b: int) -> None:
        self.ref_counts[b] -= 1
        if self.ref_counts[b] == 0:
            if self.block_hashes[b] is not None:
                self._evictable[b] = None
            else:
                self._free.append(b)

    def _take_block(self) -> int:
        if self._free:
            b = self._free.popleft()
        elif self._evictable:
            b, _ = self._evictable.popitem(last=False)
            h = self.block_hashes[b]
            del self.hash_to_block[h]
            self.block_hashes[b] = None
            self.num_evictions += 1
        else:
            raise RuntimeError("out of KV-cache blocks")
        self.ref_counts[b] = 1
        return b
