"""`POST /tokenize` and `POST /detokenize` (vLLM's shapes): text or chat messages to the served model's token
ids and back, with the same template rules as chat. Routes only."""

from __future__ import annotations

from fastapi import APIRouter

from mini_infer.serving import protocol as P
from mini_infer.serving.errors import ERROR_DOCS, APIError
from mini_infer.serving.routes_chat import prompt_ids_of
from mini_infer.serving.state import ServerState


def _with_bos(tokenizer, ids: list[int]) -> list[int]:
    bos = getattr(tokenizer, "bos_token_id", None)
    return ids if bos is None or (ids and ids[0] == bos) else [bos, *ids]


def routes(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.post("/tokenize", response_model=P.TokenizeResponse, responses=ERROR_DOCS)
    async def tokenize(body: P.TokenizeRequest) -> P.TokenizeResponse:
        eng = state.require_engine()
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of 'prompt' and 'messages'", param="prompt")
        if body.messages is not None:
            ids = prompt_ids_of(state, body.messages, body.add_generation_prompt)
            if body.add_special_tokens:
                ids = _with_bos(state.tokenizer, ids)
        else:
            tok = state.require_tokenizer("tokenize", "prompt")
            add = True if body.add_special_tokens is None else body.add_special_tokens
            ids = list(tok.encode(body.prompt, add_special_tokens=add))
        return P.TokenizeResponse(tokens=ids, count=len(ids), max_model_len=eng.max_model_len)

    @router.post("/detokenize", response_model=P.DetokenizeResponse, responses=ERROR_DOCS)
    async def detokenize(body: P.DetokenizeRequest) -> P.DetokenizeResponse:
        eng = state.require_engine()
        state.check_model(body.model)
        tok = state.require_tokenizer("detokenize", "tokens")
        bad = [t for t in body.tokens if not 0 <= t < eng.vocab_size]
        if bad:
            raise APIError(400, f"tokens must be integers in [0, {eng.vocab_size}); got {bad[:5]}", param="tokens")
        return P.DetokenizeResponse(prompt=tok.decode(body.tokens))

    return router
