"""`POST /v1/completions`: prompts (text, token ids, or lists of either) to one engine request each, answered
as one `CompletionResponse` or streamed `CompletionStreamResponse` chunks (echo, n, logprobs, usage).

Request checks and the route live here; engine plumbing is engine_requests.py's, response transport
streaming.py's.
"""

from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request

from mini_infer.outputs import RequestOutput
from mini_infer.serving import protocol as P
from mini_infer.serving.engine_requests import add_all, engine_for, resolve_max_tokens, to_sampling_params
from mini_infer.serving.errors import ERROR_DOCS, APIError
from mini_infer.serving.logprobs import TokenText, completion_logprobs
from mini_infer.serving.state import ServerState
from mini_infer.serving.streaming import chunk_json, respond

OPENAI_DEFAULT_MAX_TOKENS = 16


def usage(prompt_tokens: int, completion_tokens: int) -> P.UsageInfo:
    return P.UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                       total_tokens=prompt_tokens + completion_tokens)


class CompletionBuilder:
    """Engine outputs of one /v1/completions request as its response body or its stream chunks."""

    def __init__(self, state: ServerState, body: P.CompletionRequest, request_id: str,
                 texts: list[str | None], prompts: list[list[int]], limits: list[int]) -> None:
        self.request, self.id = body, request_id
        self.prompts, self.limits = prompts, limits
        self.model = state.settings.served_model_name
        self.created = int(time.time())
        self.text = TokenText(state.tokenizer)
        tok = state.tokenizer
        self.prompt_texts = [t if t is not None else (tok.decode(ids) if tok is not None else "")
                             for t, ids in zip(texts, prompts)]
        self.sse = chunk_json(bool(body.stream_options and body.stream_options.include_usage))
        # streaming state, per choice index
        self._offsets: dict[int, int] = {}
        self._sent_lp: dict[int, int] = {}
        self._started: set[int] = set()
        self._finished: set[int] = set()
        self._completion_tokens = 0

    def _prompt_logprobs(self, i: int, out: RequestOutput) -> list:
        plp = list(out.prompt_logprobs or [])
        ids = self.prompts[i]
        plp += [None] * (len(ids) - len(plp))
        return list(zip(ids, plp))

    def _index(self, i: int, j: int) -> int:
        return i * self.request.n + j

    def _prompt_usage(self, completion_tokens: int) -> P.UsageInfo:
        return usage(sum(len(p) for p in self.prompts), completion_tokens)

    # ----------------------------------------------------------------- one body
    def body(self, final: dict[int, RequestOutput]) -> P.CompletionResponse:
        body, choices, completion_tokens = self.request, [], 0
        for i in range(len(self.prompts)):
            out = final[i]
            keep = self.limits[i] > 0  # max_tokens=0: the engine ran one token; drop it
            for j, c in enumerate(out.outputs):
                lp = None
                if body.logprobs is not None:
                    items = self._prompt_logprobs(i, out) if body.echo else []
                    if keep:
                        items += list(zip(c.token_ids, c.logprobs or []))
                    lp, _ = completion_logprobs(items, body.logprobs, self.text, 0)
                completion_tokens += len(c.token_ids) if keep else 0
                choices.append(P.CompletionChoice(
                    index=self._index(i, j), text=(self.prompt_texts[i] if body.echo else "") + (c.text if keep else ""),
                    logprobs=lp, finish_reason=c.finish_reason if keep else "length",
                    stop_reason=c.stop_reason if keep else None))
        choices.sort(key=lambda c: c.index)
        return P.CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                    usage=self._prompt_usage(completion_tokens))

    # ----------------------------------------------------------------- a stream
    def first_chunks(self) -> list:
        return []

    def chunks(self, i: int, out: RequestOutput) -> list[P.CompletionStreamResponse]:
        body, keep, result = self.request, self.limits[i] > 0, []
        for j, c in enumerate(out.outputs):
            index = self._index(i, j)
            new_text, new_ids = out.deltas[j] if j < len(out.deltas) else ("", [])
            text, items = "", []
            if index not in self._started:
                self._started.add(index)
                if body.echo:
                    text = self.prompt_texts[i]
                    items = self._prompt_logprobs(i, out)
            if keep:
                text += new_text
                if body.logprobs is not None:
                    n_old = self._sent_lp.get(index, 0)
                    new = list(zip(c.token_ids[n_old:], (c.logprobs or [])[n_old:]))
                    self._sent_lp[index] = n_old + len(new)
                    items += new
                self._completion_tokens += len(new_ids)
            finish = None
            if c.finish_reason is not None and index not in self._finished:
                self._finished.add(index)
                finish = c.finish_reason if keep else "length"
            if not text and not items and finish is None:
                continue
            lp = None
            if body.logprobs is not None:
                lp, self._offsets[index] = completion_logprobs(items, body.logprobs, self.text,
                                                               self._offsets.get(index, 0))
            result.append(P.CompletionStreamResponse(
                id=self.id, created=self.created, model=self.model,
                choices=[P.CompletionChoice(index=index, text=text, logprobs=lp, finish_reason=finish,
                                            stop_reason=c.stop_reason if finish and keep else None)]))
        return result

    def usage_chunk(self) -> P.CompletionStreamResponse | None:
        if not (self.request.stream_options and self.request.stream_options.include_usage):
            return None
        return P.CompletionStreamResponse(id=self.id, created=self.created, model=self.model, choices=[],
                                          usage=self._prompt_usage(self._completion_tokens))


def _completion_prompts(state: ServerState, prompt) -> tuple[list[str | None], list[list[int]]]:
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if isinstance(prompt[0], int):
        prompt = [prompt]
    texts, ids = [], []
    for p in prompt:
        if isinstance(p, str):
            tok = state.require_tokenizer("a text prompt", "prompt")
            texts.append(p)
            ids.append(list(tok.encode(p)) if p else [])
        else:
            texts.append(None)
            ids.append(list(p))
    return texts, ids


def routes(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/completions", response_model=P.CompletionResponse, responses=ERROR_DOCS)
    async def completions(body: P.CompletionRequest, request: Request):
        eng = engine_for(state, body)
        if body.suffix is not None:
            raise APIError(400, "suffix is not supported", param="suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise APIError(400, f"best_of must equal n ({body.n}) or be omitted; got {body.best_of}",
                           param="best_of")
        texts, prompts = _completion_prompts(state, body.prompt)
        defaults = state.sampling_defaults
        was_set = "max_tokens" in body.model_fields_set
        limits = []
        for ids in prompts:
            if not ids:
                raise APIError(400, "prompt must not be empty", param="prompt")
            limits.append(resolve_max_tokens(body.max_tokens, was_set,
                                             defaults.get("max_tokens", OPENAI_DEFAULT_MAX_TOKENS), len(ids),
                                             eng.max_model_len, "prompt"))
        k = body.logprobs
        params = [to_sampling_params(body, defaults, max_tokens=mt, logprobs=k,
                                     prompt_logprobs=k if body.echo and k is not None else None,
                                     vocab_size=eng.vocab_size, has_tokenizer=state.tokenizer is not None)
                  for mt in limits]
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams = await add_all(eng, request_id, prompts, params, body.priority, "prompt")
        builder = CompletionBuilder(state, body, request_id, texts, prompts, limits)
        return await respond(request, body.stream, eng, streams, builder)

    return router
