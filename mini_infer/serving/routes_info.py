"""The routes that read state and start no generation: `GET /health`, `/version`, `/v1/models`, `/metrics`
and `/tokenizer_info` (what lm-evaluation-harness's remote tokenizer reads). Routes only."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response

import mini_infer
from mini_infer.serving import protocol as P
from mini_infer.serving.errors import ERROR_DOCS
from mini_infer.serving.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from mini_infer.serving.state import ServerState


def routes(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.get("/health", response_model=P.HealthResponse, responses={503: {"model": P.ErrorResponse}})
    async def health() -> P.HealthResponse:
        state.require_engine()
        return P.HealthResponse(status="ok")

    @router.get("/version", response_model=P.VersionResponse)
    async def version() -> P.VersionResponse:
        return P.VersionResponse(version=mini_infer.__version__)

    @router.get("/v1/models", response_model=P.ModelList)
    async def models() -> P.ModelList:
        eng = state.engine
        card = P.ModelCard(id=state.settings.served_model_name, root=state.settings.model,
                           max_model_len=eng.max_model_len if eng is not None else None)
        return P.ModelList(data=[card])

    @router.get("/metrics", response_class=Response)
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=METRICS_CONTENT_TYPE)

    @router.get("/tokenizer_info", response_model=P.TokenizerInfoResponse, responses=ERROR_DOCS)
    async def tokenizer_info() -> P.TokenizerInfoResponse:
        eng = state.require_engine()
        tok = state.require_tokenizer("tokenizer_info", "model")
        tmpl = getattr(tok, "chat_template", None)
        return P.TokenizerInfoResponse(
            tokenizer_class=type(tok).__name__, eos_token=tok.eos_token, bos_token=tok.bos_token,
            pad_token=tok.pad_token, chat_template=tmpl if isinstance(tmpl, str) else None,
            model_max_length=eng.max_model_len)

    return router
