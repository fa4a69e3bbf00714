"""The engine's size limits that follow from its options and the model: the context length the KV cache can
hold (`fit_max_model_len`), and how many prompt tokens one sequence may prefill per step
(`long_prefill_threshold`). Pure functions of numbers: no allocation, no model, no scheduling.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("mini_infer")

LONG_PREFILL_FRACTION = 0.04  # vLLM's rule: a prefill chunk of at most 4% of max_model_len ...
MIN_LONG_PREFILL_TOKENS = 256  # ... but never so small that a lone long prompt crawls


def fit_max_model_len(max_model_len: int, user_set: bool, capacity_tokens: int, budget_bytes: int) -> int:
    """`max_model_len`, or what a KV cache of `capacity_tokens` holds when that is less and the user did not
    set it (one warning says so). A user's `max_model_len` the cache cannot hold is a ValueError."""
    if capacity_tokens >= max_model_len:
        return max_model_len
    budget = f"{budget_bytes / 2**20:.0f} MiB"
    if user_set or capacity_tokens < 1:
        raise ValueError(
            f"the KV cache budget ({budget}) holds {capacity_tokens} tokens, fewer than max_model_len="
            f"{max_model_len}: lower max_model_len or raise gpu_memory_utilization / kv_cache_memory_bytes")
    logger.warning("max_model_len is %d, what the KV cache budget (%s) holds, not the model's %d: set "
                   "max_model_len, or a larger kv_cache_memory_bytes / gpu_memory_utilization, to choose",
                   capacity_tokens, budget, max_model_len)
    return capacity_tokens


def long_prefill_threshold(setting: int | None, enable_chunked_prefill: bool, max_model_len: int,
                           max_num_batched_tokens: int) -> int | None:
    """The most prompt tokens one sequence may take in a step (None: no cap).

    `setting` None is the default: 4% of `max_model_len` (vLLM's long_prefill_token_threshold), at least
    256 tokens, and at most half the step budget, so a long prompt leaves room in every step for the short
    ones that arrive while it prefills (their first token comes within two steps); the engine applies this
    default only in steps shared with other sequences (a prompt alone takes the whole budget, so its TTFT
    does not pay for fairness nobody needs). 0 turns the cap off; a positive `setting` is the cap, always.
    Without chunked prefill a prompt runs whole: no cap."""
    if not enable_chunked_prefill or setting == 0:
        return None
    if setting is not None:
        return setting
    cap = min(max(int(LONG_PREFILL_FRACTION * max_model_len), MIN_LONG_PREFILL_TOKENS), max_num_batched_tokens // 2)
    return cap if cap >= 1 else None
