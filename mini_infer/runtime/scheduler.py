"""Continuous batching: which sequences run in the next forward step, and how many tokens each.

One step packs, within ``max_num_batched_tokens`` and ``max_num_seqs``:

1. the RUNNING sequences, in policy order: a decoding sequence takes 1 token, one still in
   (chunked) prefill takes ``min(remaining, budget)`` tokens;
2. then WAITING sequences, in policy order, while budget, sequence slots and cache blocks last
   (skipped in a step that had to preempt). Admission takes the prefix-cache hits first, then as
   many prompt tokens as the budget allows; with chunked prefill off a prompt fits whole or waits.
   The queue head blocks those behind it, so order is kept and long prompts are not starved.

Policies: ``"fcfs"`` orders by arrival time; ``"priority"`` by ``seq.priority`` (lower first), then
arrival. When a running sequence cannot get a cache block, the scheduler preempts by RECOMPUTE the
last running sequence in policy order (lowest priority, latest arrival; possibly the one asking):
its blocks are freed, ``num_computed_tokens`` is reset to 0 and it goes back to the waiting queue
(ahead of everything that arrived after it). Its output tokens are kept: on re-admission its
"prompt" is ``prompt + outputs`` (``seq.token_ids``), which also hits the prefix cache. Only running
sequences preempt: a high-priority arrival waits for free blocks rather than evicting lower-priority
running work. With FCFS, the oldest unfinished sequence is scheduled in every step (it is never the
victim unless it could not fit alone), so nothing starves. ``long_prefill_token_threshold`` (chunked
prefill only) caps any one sequence's prefill chunk, so long prompts do not crowd out short ones; with
``long_prefill_only_when_shared`` (the engine's default cap) it applies only in steps where other sequences
are running or waiting: a long prompt alone takes the whole step budget.

A sequence needs cache slots and positions for all of its ``num_tokens`` tokens (under an attention window
with chunked prefill, only for its window and the chunk being computed). One that can never
get them (more tokens than the whole cache or ``max_model_len``; with chunked prefill off, more than
``max_num_batched_tokens``, since a preempted sequence is recomputed in one step) is finished by the scheduler
instead of looping, whether it waits or runs (so that preemption never changes where it ends): with
``finish_reason="error"`` and ``seq.error`` set if its prompt alone is too long, else with
``"length"``. Such sequences are reported in ``SchedulerOutput.finished``. (The engine's own stop
check should end a sequence at ``max_model_len`` first; this is the safety net.)

Engine contract (one step)::

    out = scheduler.schedule()
    # forward pass over out.scheduled: for each (seq, n), the tokens
    #   seq.token_ids[seq.num_computed_tokens : seq.num_computed_tokens + n]
    # at those positions, writing K/V into seq.block_table; logits are needed exactly for the
    # sequences with out.sample[i] True (their step reaches their last token).
    for (seq, n), sample in zip(out.scheduled, out.sample):
        seq.num_computed_tokens += n
        if sample:                                   # == (seq.num_computed_tokens == seq.num_tokens)
            seq.append_token(sampled_token[seq])
    scheduler.update_after_step(out)                 # commits full blocks to the prefix cache
    for seq in <sequences that hit a stop condition>:
        scheduler.finish(seq, reason)                # "stop" / "length"; frees its blocks
    # report out.finished (rejected / length-capped by the scheduler) and out.preempted as needed

``finish`` commits a sequence's computed blocks before freeing them, so calling it before
``update_after_step`` loses no cache entries. ``abort(request_id)`` may be called between steps.
With ``attention_window`` set (every layer attends to at most that many tokens back), each step first returns
to the pool the blocks of running sequences that fell out of the window, so a long generation holds only the
blocks its window covers.
"""

from __future__ import annotations

import bisect
import itertools
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from mini_infer.runtime.block_manager import BlockManager
from mini_infer.runtime.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerConfig:
    """Batching limits (vLLM's names). `max_model_len=None`: bounded only by the cache size."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    policy: Literal["fcfs", "priority"] = "fcfs"
    long_prefill_token_threshold: int | None = None  # with chunked prefill: cap on one prefill chunk
    long_prefill_only_when_shared: bool = False  # the cap applies only while other sequences run or wait
    attention_window: int | None = None  # every layer reads at most this many tokens back (sliding window)

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if self.attention_window is not None and self.attention_window < 1:
            raise ValueError(f"attention_window must be >= 1, got {self.attention_window}")
        if self.long_prefill_token_threshold is not None and self.long_prefill_token_threshold < 1:
            raise ValueError(
                f"long_prefill_token_threshold must be >= 1, got {self.long_prefill_token_threshold}"
            )
        if (
            not self.enable_chunked_prefill
            and self.max_model_len is not None
            and self.max_num_batched_tokens < self.max_model_len
        ):
            raise ValueError(
                f"with chunked prefill disabled, max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be >= max_model_len ({self.max_model_len})"
            )


@dataclass
class SchedulerOutput:
    """One step's plan.

    `scheduled`: ``(seq, num_new_tokens)`` pairs, running sequences first (policy order), then the
    ones admitted this step (admission order). `sample[i]`: whether ``scheduled[i]`` reaches its
    sequence's last token, so the step must produce logits and a token for it. `preempted`:
    sequences sent back to waiting this step (their blocks are gone). `finished`: sequences the
    scheduler finished itself (see module docstring), not to be run.
    """

    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    sample: list[bool] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)
    num_batched_tokens: int = 0
    _starts: list[int] = field(default_factory=list, repr=False)  # num_computed_tokens when scheduled

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_seqs(self) -> int:
        return len(self.scheduled)


class Scheduler:
    """Continuous-batching scheduler over a `BlockManager`; see the module docstring for the contract."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: list[Sequence] = []  # sorted by policy key
        self.running: list[Sequence] = []  # sorted by policy key
        self.num_preemptions = 0
        self._by_request: dict[str, list[Sequence]] = {}
        self._add_index: dict[int, int] = {}  # seq_id -> add order, the final tie-break
        self._add_counter = itertools.count()
        self._pending_finished: list[Sequence] = []  # rejected in add(), reported by the next schedule()
        self._key: Callable[[Sequence], tuple]
        if config.policy == "priority":
            self._key = lambda s: (s.priority, s.arrival_time, self._add_index[s.seq_id])
        else:
            self._key = lambda s: (s.arrival_time, self._add_index[s.seq_id])

    # ------------------------------------------------------------------ queue API

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def max_tokens_per_seq(self) -> int:
        """Most tokens a sequence may hold, waiting or running (the cache's size and max_model_len bound it, and with
        chunked prefill off the step budget)."""
        return self._token_limit()

    def has_unfinished(self) -> bool:
        """True while any sequence waits or runs, or a rejection is still to be reported."""
        return bool(self.waiting or self.running or self._pending_finished)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (status WAITING).

        A prompt longer than ``max_model_len`` or the whole cache is finished at once with
        ``finish_reason="error"`` and reported in the next `schedule()`'s ``finished``.
        """
        if seq.seq_id in self._add_index:
            raise ValueError(f"sequence {seq.seq_id} (request {seq.request_id!r}) was already added")
        if seq.is_finished:
            raise ValueError(f"sequence {seq.seq_id} (request {seq.request_id!r}) is already finished")
        if seq.num_tokens == 0:
            raise ValueError(f"request {seq.request_id!r} has an empty prompt")
        if seq.block_table:
            raise ValueError(f"sequence {seq.seq_id} (request {seq.request_id!r}) already holds cache blocks")
        self._add_index[seq.seq_id] = next(self._add_counter)
        self._by_request.setdefault(seq.request_id, []).append(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        if seq.num_prompt_tokens > (limit := self._token_limit()):
            self._finish_too_long(seq, limit)
            self._pending_finished.append(seq)
            return
        bisect.insort(self.waiting, seq, key=self._key)

    def abort(self, request_id: str) -> list[Sequence]:
        """Finish every unfinished sequence of `request_id` with reason "abort", freeing its blocks."""
        seqs = [s for s in self._by_request.get(request_id, []) if not s.is_finished]
        for seq in seqs:
            self.finish(seq, "abort")
        return seqs

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark `seq` finished with `reason`, drop it from the queues, commit its computed blocks to the
        prefix cache and free them. Idempotent."""
        if seq.is_finished:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:  # (a sequence refused in add() is in neither queue)
            self.waiting.remove(seq)
        self.block_manager.commit_computed(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self._forget(seq)

    # ------------------------------------------------------------------ the step

    def schedule(self) -> SchedulerOutput:
        """Plan one step (see the module docstring). Mutates block tables and the queues."""
        cfg, bm = self.config, self.block_manager
        out = SchedulerOutput(finished=self._pending_finished)
        self._pending_finished = []
        budget = cfg.max_num_batched_tokens
        limit = self._token_limit()  # most tokens a sequence may hold, waiting or running
        cap = cfg.long_prefill_token_threshold if cfg.enable_chunked_prefill else None
        if cfg.long_prefill_only_when_shared and len(self.running) + len(self.waiting) <= 1:
            cap = None  # nobody else to make room for
        if cfg.attention_window is not None:
            for seq in self.running:
                bm.release_out_of_window(seq, cfg.attention_window)

        # 1. Running sequences, in policy order; preempt from the back when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0 and len(out.scheduled) < cfg.max_num_seqs:
            seq = self.running[i]
            if seq.stop_pending:  # its last token is still in flight (async scheduling)
                i += 1
                continue
            if seq.num_tokens > limit:
                self._finish_too_long(seq, limit)
                out.finished.append(seq)
                continue
            n = self._num_new_tokens(seq, budget, cap)
            if n <= 0:
                i += 1
                continue
            if not bm.holds(seq, n):  # a decode step needs a block only at a block boundary
                if not self._make_room(seq, n, out):
                    continue  # seq itself was preempted
                bm.allocate(seq, n)
            self._emit(out, seq, n)
            budget -= n
            i += 1

        # 2. Waiting sequences, in policy order; the head blocks the rest.
        while self.waiting and budget > 0 and not out.preempted:
            seq = self.waiting[0]
            if seq.num_tokens > limit:
                self._finish_too_long(seq, limit)
                out.finished.append(seq)
                continue
            if len(self.running) >= cfg.max_num_seqs or len(out.scheduled) >= cfg.max_num_seqs:
                break
            _, num_cached = bm.lookup(seq)
            remaining = seq.num_tokens - num_cached
            if not cfg.enable_chunked_prefill and remaining > budget:
                break
            n = self._num_new_tokens(seq, budget, cap, num_computed=num_cached)
            if not bm.can_allocate(seq, n):
                break
            bm.allocate_prompt(seq, n)
            del self.waiting[0]
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=self._key)
            self._emit(out, seq, n)
            budget -= n

        assert out.num_batched_tokens == cfg.max_num_batched_tokens - budget
        return out

    def update_after_step(self, output: SchedulerOutput) -> None:
        """After the engine advanced ``num_computed_tokens`` (and appended sampled tokens) for every
        scheduled sequence, register the blocks that became full with the prefix cache.

        Sequences finished or aborted in the meantime are skipped. Raises RuntimeError if a live
        scheduled sequence was not advanced by exactly its ``num_new_tokens``.
        """
        for (seq, n), start in zip(output.scheduled, output._starts):
            if seq.status is not SequenceStatus.RUNNING or not seq.block_table:
                continue
            if seq.num_computed_tokens != start + n:
                raise RuntimeError(
                    f"request {seq.request_id!r}: num_computed_tokens is {seq.num_computed_tokens}, expected "
                    f"{start + n} ({start} + {n} scheduled); the engine must advance it before update_after_step"
                )
            self.block_manager.commit_computed(seq)

    # ------------------------------------------------------------------ internals

    def _num_new_tokens(self, seq: Sequence, budget: int, cap: int | None, num_computed: int | None = None) -> int:
        if num_computed is None:
            num_computed = seq.num_computed_tokens
        n = seq.num_tokens - num_computed
        if cap is not None:
            n = min(n, cap)
        return min(n, budget)

    def _emit(self, out: SchedulerOutput, seq: Sequence, n: int) -> None:
        out.scheduled.append((seq, n))
        out._starts.append(seq.num_computed_tokens)
        out.sample.append(seq.num_computed_tokens + n >= seq.num_tokens)
        out.num_batched_tokens += n

    def _make_room(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Preempt running sequences from the back until `seq` can allocate n more tokens; False if that took seq
        itself (it then waits again, its preemption reported in `out`)."""
        while not self.block_manager.can_allocate(seq, n):
            victim = self.running[-1]
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, seq, key=self._key)

    def _token_limit(self) -> int:
        """Most tokens one sequence can ever hold KV for (unchunked: also what one step can recompute, so that a
        sequence preempted at any length can come back)."""
        bm, cfg = self.block_manager, self.config
        limit = bm.num_blocks * bm.block_size
        if cfg.attention_window is not None and cfg.enable_chunked_prefill:
            # blocks out of the window go back to the pool as a sequence advances: it holds its window and the
            # chunk being computed, never its whole length
            limit = sys.maxsize
        if cfg.max_model_len is not None:
            limit = min(limit, cfg.max_model_len)
        if not cfg.enable_chunked_prefill:
            limit = min(limit, cfg.max_num_batched_tokens)
        return limit

    def _finish_too_long(self, seq: Sequence, limit: int) -> None:
        if seq.num_prompt_tokens > limit:
            reason = "error"
            seq.error = (
                f"prompt of {seq.num_prompt_tokens} tokens exceeds the limit of {limit} tokens per sequence "
                f"(KV cache {self.block_manager.num_blocks * self.block_manager.block_size} tokens, "
                f"max_model_len {self.config.max_model_len}, max_num_batched_tokens "
                f"{self.config.max_num_batched_tokens}, chunked prefill "
                f"{'on' if self.config.enable_chunked_prefill else 'off'})"
            )
        else:
            reason = "length"
        self.finish(seq, reason)

    def _forget(self, seq: Sequence) -> None:
        seqs = self._by_request.get(seq.request_id)
        if seqs is not None:
            seqs.remove(seq)
            if not seqs:
                del self._by_request[seq.request_id]
        self._add_index.pop(seq.seq_id, None)
