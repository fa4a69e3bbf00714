"""What generation returns, under vLLM's names: `RequestOutput` with one `CompletionOutput` per sample.

Plain data shared by the engine, `LLM` and the server; no logic beyond small conveniences.
"""

from __future__ import annotations

from dataclasses import dataclass, field


# One position's log-probabilities: token id -> Logprob.
@dataclass
class Logprob:
    """Log-probability of one token at one position, its rank, and its text when a tokenizer is known."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One generated sample of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort", "error" or None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps (time.monotonic) of a request's life, for latency metrics."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0


@dataclass
class RequestOutput:
    """A request's state after a step: prompt, samples so far, and whether it has finished.

    `outputs[i].text` / `.token_ids` are cumulative. For streaming, `new_text` / `new_token_ids` on each
    sample hold only what this step added.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    deltas: list[tuple[str, list[int]]] = field(default_factory=list)  # per sample: (new text, new ids)
