"""Per-request sampling options, under vLLM's names, with validation that names the bad field and its limit.

Also the rules the library and the server share about those options: whether a prompt plus `max_tokens` fits
the context (`check_context_length`), and the defaults a model's `generation_config` recommends
(`model_sampling_defaults`). This module only describes and validates options; sampling itself lives in
runtime/sampler.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_STOP_STRINGS = 64
MAX_STOP_STRING_LEN = 1024
MAX_N = 128
MAX_LOGPROBS = 20
GREEDY_TEMPERATURE = 1e-5  # temperatures below this sample greedily (as vLLM)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass
class SamplingParams:
    """How to sample one request's tokens (vLLM's `SamplingParams` names and defaults).

    `max_tokens=None` means "until the context is full". `stop` strings are cut from the text;
    `stop_token_ids` end generation too (the token is not shown in the text). `logprobs=k` returns the
    top-k log-probabilities of each sampled token (plus the sampled one); `prompt_logprobs=k` does so for
    prompt tokens.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    @property
    def greedy(self) -> bool:
        """True when sampling reduces to argmax (temperature ~0 or top_k == 1)."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        """True when sampling reads the tokens generated so far (repetition, presence or frequency penalty)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the field and its limit for any option out of range."""
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        if not (self.temperature >= 0.0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not _is_int(self.top_k) or self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not (self.repetition_penalty > 0.0 and math.isfinite(self.repetition_penalty)):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
            if len(s) > MAX_STOP_STRING_LEN:
                raise ValueError(
                    f"stop strings may be at most {MAX_STOP_STRING_LEN} characters each, got {len(s)}"
                )
        if len(self.stop_token_ids) > MAX_STOP_STRINGS:
            raise ValueError(
                f"stop_token_ids may hold at most {MAX_STOP_STRINGS} ids, got {len(self.stop_token_ids)}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {v!r}")
        for t in self.stop_token_ids:
            if not _is_int(t) or t < 0:
                raise ValueError(f"stop_token_ids entries must be integers >= 0, got {t!r}")
        if vocab_size is not None:
            for t in self.stop_token_ids:
                if not 0 <= t < vocab_size:
                    raise ValueError(f"stop_token_ids entries must be in [0, {vocab_size}), got {t}")


class ContextLengthExceeded(ValueError):
    """A prompt and `max_tokens` that do not fit the model's context; the same rule for `LLM` and the server."""

    def __init__(self, max_model_len: int, prompt_len: int, max_tokens: int, where: str = "prompt") -> None:
        self.max_model_len, self.prompt_len, self.max_tokens, self.where = max_model_len, prompt_len, max_tokens, where
        super().__init__(
            f"This model's maximum context length is {max_model_len} tokens (max_model_len). However, you "
            f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the {where}, {max_tokens} in the "
            f"completion). Please reduce the length of the {where} or completion.")

    @property
    def prompt_too_long(self) -> bool:
        """True when the prompt alone leaves no room for a generated token (else max_tokens is at fault)."""
        return self.prompt_len >= self.max_model_len


def check_context_length(prompt_len: int, max_tokens: int | None, max_model_len: int, where: str = "prompt") -> None:
    """Raise ContextLengthExceeded unless a `prompt_len`-token prompt and `max_tokens` generated tokens fit in
    `max_model_len`. `max_tokens=None` means the rest of the context and 0 (scoring the prompt) runs one token:
    both need room for one."""
    if max_tokens is None:
        max_tokens = max(0, max_model_len - prompt_len)
    if prompt_len + max(1, max_tokens) > max_model_len:
        raise ContextLengthExceeded(max_model_len, prompt_len, max_tokens, where)


GENERATION_CONFIG_MODES = ("auto", "vllm")
_GENERATION_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")


def model_sampling_defaults(generation_config, mode: str = "auto") -> dict:
    """The sampling defaults a model's creators set in its `generation_config` (vLLM's `--generation-config`):
    with mode "auto", its temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens (as
    `max_tokens`) where they differ from transformers' defaults; with "vllm", none (SamplingParams' own)."""
    if mode not in GENERATION_CONFIG_MODES:
        raise ValueError(f"generation_config must be one of {', '.join(GENERATION_CONFIG_MODES)}, got {mode!r}")
    if mode == "vllm" or generation_config is None:
        return {}
    diff = generation_config.to_diff_dict()
    defaults = {k: diff[k] for k in _GENERATION_FIELDS if diff.get(k) is not None}
    if "max_new_tokens" in defaults:
        defaults["max_tokens"] = defaults.pop("max_new_tokens")
    if defaults.get("top_k", 1) <= 0:  # transformers' "no top-k" is 0, ours -1
        defaults["top_k"] = -1
    return defaults
