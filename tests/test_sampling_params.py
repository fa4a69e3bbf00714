"""SamplingParams validation: every bad option raises ValueError naming its field (first, so the server can
name it as `param`); the context-length rule the library and server share; generation_config defaults."""

from __future__ import annotations

import math

import pytest

from mini_infer.sampling_params import (
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP_STRING_LEN,
    MAX_STOP_STRINGS,
    ContextLengthExceeded,
    SamplingParams,
    check_context_length,
    model_sampling_defaults,
)

BAD = [
    ("n", dict(n=0)),
    ("n", dict(n=MAX_N + 1)),
    ("n", dict(n=1.5)),
    ("n", dict(n=True)),
    ("temperature", dict(temperature=-0.1)),
    ("temperature", dict(temperature=math.nan)),
    ("temperature", dict(temperature=math.inf)),
    ("top_p", dict(top_p=0.0)),
    ("top_p", dict(top_p=1.01)),
    ("top_p", dict(top_p=math.nan)),
    ("top_k", dict(top_k=0)),
    ("top_k", dict(top_k=-2)),
    ("top_k", dict(top_k=2.5)),
    ("min_p", dict(min_p=-0.1)),
    ("min_p", dict(min_p=1.5)),
    ("min_p", dict(min_p=math.nan)),
    ("repetition_penalty", dict(repetition_penalty=0.0)),
    ("repetition_penalty", dict(repetition_penalty=math.nan)),
    ("presence_penalty", dict(presence_penalty=2.5)),
    ("presence_penalty", dict(presence_penalty=math.nan)),
    ("frequency_penalty", dict(frequency_penalty=-2.5)),
    ("max_tokens", dict(max_tokens=0)),
    ("max_tokens", dict(max_tokens=-3)),
    ("max_tokens", dict(max_tokens=2.0)),
    ("min_tokens", dict(min_tokens=-1)),
    ("min_tokens", dict(min_tokens=1.5)),
    ("min_tokens", dict(min_tokens=20, max_tokens=10)),
    ("seed", dict(seed="7")),
    ("stop", dict(stop=["x" * (MAX_STOP_STRING_LEN + 1)])),
    ("stop", dict(stop=["a"] * (MAX_STOP_STRINGS + 1))),
    ("stop", dict(stop=[""])),
    ("stop", dict(stop=[3])),
    ("stop_token_ids", dict(stop_token_ids=list(range(MAX_STOP_STRINGS + 1)))),
    ("stop_token_ids", dict(stop_token_ids=[-1])),
    ("logprobs", dict(logprobs=-1)),
    ("logprobs", dict(logprobs=MAX_LOGPROBS + 1)),
    ("logprobs", dict(logprobs=1.5)),
    ("prompt_logprobs", dict(prompt_logprobs=MAX_LOGPROBS + 1)),
    ("prompt_logprobs", dict(prompt_logprobs=-1)),
]


@pytest.mark.parametrize("field, kwargs", BAD, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD)])
def test_bad_field_raises_naming_it(field, kwargs):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_stop_token_ids_checked_against_vocab():
    p = SamplingParams(stop_token_ids=[5, 99])
    p.validate()
    with pytest.raises(ValueError, match="stop_token_ids"):
        p.validate(vocab_size=50)


def test_defaults_and_edges_are_valid():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_tokens, p.stop, p.stop_token_ids) == (
        1,
        1.0,
        1.0,
        -1,
        16,
        [],
        [],
    )
    SamplingParams(
        n=MAX_N,
        temperature=0.0,
        top_p=1.0,
        top_k=1,
        min_p=1.0,
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        max_tokens=None,
        min_tokens=5,
        stop=["x" * MAX_STOP_STRING_LEN],
        logprobs=0,
        prompt_logprobs=MAX_LOGPROBS,
        seed=0,
    )


def test_stop_string_normalised_and_greedy():
    assert SamplingParams(stop="END").stop == ["END"]
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=1e-7).greedy  # too small to divide by: argmax
    assert SamplingParams(temperature=0.8, top_k=1).greedy
    assert not SamplingParams(temperature=0.8).greedy


@pytest.mark.parametrize("field, kwargs", BAD, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD)])
def test_message_starts_with_the_field(field, kwargs):
    """The server names the field (OpenAI's `param`) from the message's first word."""
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert str(info.value).split(" ", 1)[0] == field, str(info.value)


def test_context_length_rule():
    check_context_length(10, 6, 16)
    check_context_length(10, None, 16)  # the rest of the context
    with pytest.raises(ContextLengthExceeded) as info:
        check_context_length(10, 7, 16)
    err = info.value
    assert "maximum context length is 16 tokens" in str(err) and "17 tokens (10 in the prompt, 7 in" in str(err)
    assert not err.prompt_too_long
    for max_tokens in (None, 0, 1):  # a full prompt leaves no room for the one token every request runs
        with pytest.raises(ContextLengthExceeded) as info:
            check_context_length(16, max_tokens, 16, where="messages")
        assert info.value.prompt_too_long and "in the messages" in str(info.value)


def test_model_sampling_defaults_from_generation_config():
    from transformers import GenerationConfig

    gen = GenerationConfig(temperature=0.6, top_p=0.9, top_k=0, max_new_tokens=7, repetition_penalty=1.1,
                           do_sample=True)
    defaults = model_sampling_defaults(gen, "auto")
    assert defaults == {"temperature": 0.6, "top_p": 0.9, "top_k": -1, "max_tokens": 7, "repetition_penalty": 1.1}
    assert SamplingParams(**defaults).max_tokens == 7
    assert model_sampling_defaults(gen, "vllm") == {}
    assert model_sampling_defaults(GenerationConfig(), "auto") == {}  # transformers' own defaults: nothing
    assert model_sampling_defaults(None) == {}
    with pytest.raises(ValueError, match="generation_config"):
        model_sampling_defaults(gen, "hf")
