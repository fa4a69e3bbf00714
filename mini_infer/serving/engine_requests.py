"""From a validated request body to requests queued in the engine: `SamplingParams` (request fields first,
then the model's generation_config defaults, then OpenAI's), the shared max_tokens rule, and all-or-nothing
queuing of one request per prompt. Every refusal is an `APIError` naming the field. This module must not build
responses.
"""

from __future__ import annotations

from collections.abc import Iterable

from mini_infer.runtime.async_engine import AsyncLLMEngine, EngineDeadError, EngineOverloaded
from mini_infer.sampling_params import ContextLengthExceeded, SamplingParams, check_context_length
from mini_infer.serving import protocol as P
from mini_infer.serving.errors import APIError, context_length_error
from mini_infer.serving.state import ServerState

SAMPLING_FIELDS = {"n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "seed", "max_tokens", "min_tokens", "stop", "stop_token_ids", "logprobs",
                   "prompt_logprobs", "skip_special_tokens", "include_stop_str_in_output"}
_NEUTRAL = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}


def engine_for(state: ServerState, body: P._SamplingFields) -> AsyncLLMEngine:
    """The engine a generation request goes to, after the checks every such request shares: the engine is up,
    the model is the served one, stream_options only with a stream."""
    eng = state.require_engine()
    state.check_model(body.model)
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")
    return eng


def param_of(message: str, fields: Iterable[str], prompt_param: str) -> str | None:
    """The request field an engine/SamplingParams ValueError is about (its first word), if any."""
    word = message.split(" ", 1)[0].strip(":,'\"")
    if word in fields:
        return word
    if word.startswith("prompt") or "prompt" in message.split(" ", 3)[:3]:
        return prompt_param
    return None


def resolve_max_tokens(requested: int | None, was_set: bool, default: int | None, prompt_len: int,
                       max_model_len: int, where: str, param: str = "max_tokens") -> int:
    """The request's max_tokens. Unset: `default` (the model's generation_config, else the route's), capped
    by the context; None (or no default): the rest of the context. Set: checked by the library's rule."""
    rest = max(0, max_model_len - prompt_len)
    if not was_set and default is not None:
        requested = min(default, rest) if rest >= 1 else default
    if requested is None:
        requested = rest
    try:
        check_context_length(prompt_len, requested, max_model_len, where)
    except ContextLengthExceeded as exc:
        raise context_length_error(exc, param) from None
    return requested


def to_sampling_params(body: P._SamplingFields, defaults: dict, *, max_tokens: int, logprobs: int | None,
                       prompt_logprobs: int | None, vocab_size: int, has_tokenizer: bool) -> SamplingParams:
    """SamplingParams of a request: its own fields, else the model's `defaults`, else OpenAI's neutral ones."""
    if body.logit_bias:
        raise APIError(400, "logit_bias is not supported", param="logit_bias")
    if body.stop and not has_tokenizer:
        raise APIError(400, "stop strings need a tokenizer; this model has none (use stop_token_ids)",
                       param="stop")
    if body.min_tokens > max_tokens:
        raise APIError(400, f"min_tokens ({body.min_tokens}) must be <= max_tokens ({max_tokens})",
                       param="min_tokens")
    fields = {name: getattr(body, name) if getattr(body, name) is not None else defaults.get(name, neutral)
              for name, neutral in _NEUTRAL.items()}
    if fields["top_k"] >= vocab_size:  # the whole vocabulary: the same as no top-k
        fields["top_k"] = -1
    try:
        return SamplingParams(
            n=body.n, **fields, presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0, seed=body.seed, max_tokens=max(1, max_tokens),
            min_tokens=body.min_tokens, stop=body.stop, stop_token_ids=body.stop_token_ids,
            ignore_eos=body.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=body.skip_special_tokens, include_stop_str_in_output=body.include_stop_str_in_output)
    except (ValueError, TypeError) as exc:
        raise APIError(400, str(exc), param=param_of(str(exc), SAMPLING_FIELDS, "prompt")) from None


async def add_all(engine: AsyncLLMEngine, request_id: str, prompts: list[list[int]],
                  params: list[SamplingParams], priority: int, prompt_param: str) -> list:
    """Queue every prompt as its own engine request (`{request_id}-{i}`); all or nothing."""
    streams = []
    try:
        for i, (ids, p) in enumerate(zip(prompts, params)):
            streams.append(await engine.add_request({"prompt_token_ids": ids}, p, f"{request_id}-{i}", priority))
    except BaseException as exc:
        for s in streams:
            engine.abort(s.request_id)
        if isinstance(exc, (ValueError, TypeError, OverflowError)):
            raise APIError(400, str(exc), param=param_of(str(exc), SAMPLING_FIELDS, prompt_param)) from None
        if isinstance(exc, EngineOverloaded):
            raise APIError(503, str(exc), code="overloaded", headers={"Retry-After": "1"}) from None
        if isinstance(exc, EngineDeadError):
            raise APIError(503, str(exc), code="engine_dead") from None
        raise
    return streams
