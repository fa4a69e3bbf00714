"""`POST /v1/chat/completions`: messages through the model's chat template (the library's rules, see
mini_infer/chat_template.py) to one engine request, answered as one `ChatCompletionResponse` or streamed
`ChatCompletionStreamResponse` chunks (n, logprobs, usage).

Request checks and the route live here; engine plumbing is engine_requests.py's, response transport
streaming.py's.
"""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request

from mini_infer.chat_template import InvalidMessages, chat_prompt_ids, conversation
from mini_infer.outputs import RequestOutput
from mini_infer.serving import protocol as P
from mini_infer.serving.engine_requests import add_all, engine_for, resolve_max_tokens, to_sampling_params
from mini_infer.serving.errors import ERROR_DOCS, APIError
from mini_infer.serving.logprobs import TokenText, chat_logprobs
from mini_infer.serving.routes_completions import usage
from mini_infer.serving.state import ServerState
from mini_infer.serving.streaming import chunk_json, respond


def prompt_ids_of(state: ServerState, messages: list[P.ChatMessage], add_generation_prompt: bool,
                  continue_final_message: bool = False) -> list[int]:
    """The token ids of chat messages through the served tokenizer's template; 400 naming the bad field."""
    dumped = [m.model_dump() for m in messages]
    try:
        conversation(dumped)  # the messages' own faults first, whatever the model
        tok = state.require_tokenizer("chat", "messages")
        return chat_prompt_ids(tok, dumped, add_generation_prompt, continue_final_message)
    except InvalidMessages as exc:
        raise APIError(400, str(exc), param=exc.param) from None


class ChatBuilder:
    """Engine outputs of one /v1/chat/completions request as its response body or its stream chunks."""

    def __init__(self, state: ServerState, body: P.ChatCompletionRequest, request_id: str, prompt_len: int):
        self.request, self.id, self.prompt_len = body, request_id, prompt_len
        self.model = state.settings.served_model_name
        self.created = int(time.time())
        self.text = TokenText(state.tokenizer)
        self.k = body.top_logprobs or 0
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.sse = chunk_json(self.include_usage)
        self._sent_lp: dict[int, int] = {}
        self._finished: set[int] = set()
        self._completion_tokens = 0

    def _chunk(self, index: int, delta: P.DeltaMessage, logprobs=None, finish_reason=None, stop_reason=None):
        return P.ChatCompletionStreamResponse(
            id=self.id, created=self.created, model=self.model,
            choices=[P.ChatCompletionStreamChoice(index=index, delta=delta, logprobs=logprobs,
                                                  finish_reason=finish_reason, stop_reason=stop_reason)])

    def body(self, final: dict[int, RequestOutput]) -> P.ChatCompletionResponse:
        out = final[0]
        choices = []
        for c in out.outputs:
            lp = None
            if self.request.logprobs:
                lp = P.ChatChoiceLogprobs(content=chat_logprobs(list(zip(c.token_ids, c.logprobs or [])), self.k,
                                                                self.text))
            choices.append(P.ChatCompletionChoice(index=c.index, message=P.ChatResponseMessage(content=c.text),
                                                  logprobs=lp, finish_reason=c.finish_reason,
                                                  stop_reason=c.stop_reason))
        completion_tokens = sum(len(c.token_ids) for c in out.outputs)
        return P.ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                        usage=usage(self.prompt_len, completion_tokens))

    def first_chunks(self) -> list[P.ChatCompletionStreamResponse]:
        return [self._chunk(j, P.DeltaMessage(role="assistant", content="")) for j in range(self.request.n)]

    def chunks(self, _: int, out: RequestOutput) -> list[P.ChatCompletionStreamResponse]:
        result = []
        for j, c in enumerate(out.outputs):
            new_text, new_ids = out.deltas[j] if j < len(out.deltas) else ("", [])
            self._completion_tokens += len(new_ids)
            lp = None
            if self.request.logprobs:
                n_old = self._sent_lp.get(j, 0)
                new = list(zip(c.token_ids[n_old:], (c.logprobs or [])[n_old:]))
                self._sent_lp[j] = n_old + len(new)
                if new:
                    lp = P.ChatChoiceLogprobs(content=chat_logprobs(new, self.k, self.text))
            if new_text or lp:
                result.append(self._chunk(j, P.DeltaMessage(content=new_text), lp))
            if c.finish_reason is not None and j not in self._finished:
                self._finished.add(j)
                result.append(self._chunk(j, P.DeltaMessage(), None, c.finish_reason, c.stop_reason))
        return result

    def usage_chunk(self) -> P.ChatCompletionStreamResponse | None:
        if not self.include_usage:
            return None
        return P.ChatCompletionStreamResponse(id=self.id, created=self.created, model=self.model, choices=[],
                                              usage=usage(self.prompt_len, self._completion_tokens))


def routes(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/chat/completions", response_model=P.ChatCompletionResponse, responses=ERROR_DOCS)
    async def chat_completions(body: P.ChatCompletionRequest, request: Request):
        eng = engine_for(state, body)
        if body.tools:
            raise APIError(400, "tools are not supported", param="tools")
        if body.response_format is not None and body.response_format.get("type", "text") != "text":
            raise APIError(400, "only response_format {\"type\": \"text\"} is supported", param="response_format")
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        ids = prompt_ids_of(state, body.messages, body.add_generation_prompt, body.continue_final_message)
        field_name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if requested is not None and requested < 1:
            raise APIError(400, f"{field_name} must be >= 1, got {requested}", param=field_name)
        defaults = state.sampling_defaults
        mt = resolve_max_tokens(requested, requested is not None, defaults.get("max_tokens"), len(ids),
                                eng.max_model_len, "messages", field_name)
        params = to_sampling_params(body, defaults, max_tokens=mt,
                                    logprobs=(body.top_logprobs or 0) if body.logprobs else None,
                                    prompt_logprobs=None, vocab_size=eng.vocab_size,
                                    has_tokenizer=state.tokenizer is not None)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        streams = await add_all(eng, request_id, [ids], [params], body.priority, "messages")
        return await respond(request, body.stream, eng, streams, ChatBuilder(state, body, request_id, len(ids)))

    return router
