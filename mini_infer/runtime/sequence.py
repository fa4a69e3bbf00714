"""One sequence's state as the runtime sees it: its tokens, how many have KV in the cache, its blocks.

Plain data: the scheduler, block manager, engine and sampler read and update it; it does no work itself.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from mini_infer.sampling_params import SamplingParams

_seq_counter = itertools.count()
PLACEHOLDER = -1  # async scheduling: an output id sampled by a step still in flight, not read back yet


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """A prompt and the tokens generated for it so far.

    `num_computed_tokens` counts tokens whose K/V is already in the paged cache (prefix-cache hits
    included); the next forward step computes tokens from there on. `block_table` lists the cache
    blocks holding this sequence's tokens, in order.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    seq_id: int = field(default_factory=lambda: next(_seq_counter))
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at the last admission
    block_table: list[int] = field(default_factory=list)
    num_released_blocks: int = 0  # leading table entries returned to the pool (out of the attention window)
    num_preemptions: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None  # why the runtime rejected it (with finish_reason "error")
    stop_pending: bool = False  # async scheduling: its last token is in flight, do not schedule it again

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def known_output_token_ids(self) -> list[int]:
        """The output ids read back so far: without the placeholder of a step in flight (always the last)."""
        ids = self.output_token_ids
        return ids[:-1] if ids and ids[-1] == PLACEHOLDER else list(ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still lacking K/V in the cache (the whole prompt at first, then 1 per decode step)."""
        return self.num_tokens - self.num_computed_tokens

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
