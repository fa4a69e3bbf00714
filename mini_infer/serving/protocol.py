"""Pydantic models of every HTTP body the server reads or writes (OpenAI's names, vLLM's extras).

Request models carry only structural limits (types, OpenAI's documented ranges); everything that depends
on the model (context length, vocabulary) is checked by the server and the engine, which answer 400 with a
message that names the field. Unknown request fields are ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer

MAX_N = 128
MAX_LOGPROBS = 20
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


# ---------------------------------------------------------------------------------------------- errors
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---------------------------------------------------------------------------------------------- requests
class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Request):
    """Sampling options shared by /v1/completions and /v1/chat/completions."""

    model: str | None = Field(None, description="served model name; omitted = the only model")
    temperature: float | None = Field(None, ge=0.0, description="default: the model's generation_config value "
                                      "(--generation-config auto), else 1.0; 0 = greedy")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=_INT64_MIN, le=_INT64_MAX - MAX_N)
    logit_bias: dict[str, float] | None = Field(None, description="not supported: must be empty")
    user: str | None = None
    # vLLM's extras
    top_k: int | None = Field(None, description="-1 or None = disabled")
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = Field(0, ge=_INT64_MIN, le=_INT64_MAX)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        ..., description="text, list of texts, token ids, or list of token-id lists")
    suffix: str | None = Field(None, description="not supported (400)")
    max_tokens: int | None = Field(16, ge=0, description=(
        "default 16 (OpenAI's), or the model's generation_config max_new_tokens (--generation-config auto); "
        "0 with echo: score the prompt only; null = the rest of the context"))
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(None, ge=1, le=MAX_N, description="only best_of == n is supported")


class ChatMessage(_Request):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = Field(
        None, description='a string, or a list of text parts {"type": "text", "text": "..."}')
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content_shape(cls, v):
        if v is None or isinstance(v, str):
            return v
        if not isinstance(v, list) or not all(isinstance(p, dict) for p in v):
            raise ValueError('content must be a string or a list of parts like {"type": "text", "text": "..."}')
        return v


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = Field(None, ge=0, description="deprecated alias of max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=0, description=(
        "default: the model's generation_config max_new_tokens (--generation-config auto) if it sets one, else "
        "the rest of the context (max_model_len minus the prompt)"))
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = Field(None, description="not supported: must be empty")
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = Field(None, description='only {"type": "text"}')
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = Field(None, description="default: true for prompt, false for messages")
    add_generation_prompt: bool = True


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


# ---------------------------------------------------------------------------------------------- responses
class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamResponse(BaseModel):
    """One SSE chunk of a streamed completion (`usage` is sent only with stream_options.include_usage)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    """What a chat stream chunk adds to a choice's message; fields not sent are left out of the JSON."""

    role: str | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _only_sent(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(BaseModel):
    """One SSE chunk of a streamed chat completion (`usage` is sent only with stream_options.include_usage)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "mini-infer"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfoResponse(_Body):
    tokenizer_class: str
    eos_token: str | None = None
    bos_token: str | None = None
    pad_token: str | None = None
    chat_template: str | None = None
    model_max_length: int


class VersionResponse(BaseModel):
    version: str


class HealthResponse(BaseModel):
    status: str
