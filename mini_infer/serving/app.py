"""The OpenAI-compatible ASGI app of one server: FastAPI with every route, OpenAI's error bodies, and the
guard middleware in front.

Routes: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models`, `GET /health`, `GET /version`,
`GET /metrics`, `POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info`, `GET /openapi.json` (FastAPI's).
Bad input of any kind is a 400 in OpenAI's error body (see errors.py, guard.py), never a 500, and never reaches
the engine loop; a client that goes away aborts its requests (streaming.py). The app talks only to an
`AsyncLLMEngine`, held by `ServerState` once loaded (until then engine routes and /health answer 503).

`build_app(state)` is the FastAPI app, `build_asgi(state)` the same behind `GuardMiddleware`. This module
assembles; it must not define routes.
"""

from __future__ import annotations

from fastapi import FastAPI

import mini_infer
from mini_infer.serving import routes_chat, routes_completions, routes_info, routes_tokenize
from mini_infer.serving.errors import install_error_handlers
from mini_infer.serving.guard import GuardMiddleware
from mini_infer.serving.state import ServerState


def build_app(state: ServerState) -> FastAPI:
    """The FastAPI app over `state` (no guard middleware)."""
    app = FastAPI(title="mini-infer", version=mini_infer.__version__,
                  description="OpenAI-compatible API of a compiler-style LLM inference engine")
    app.state.server = state
    install_error_handlers(app)
    for module in (routes_info, routes_tokenize, routes_completions, routes_chat):
        app.include_router(module.routes(state))
    return app


def build_asgi(state: ServerState) -> GuardMiddleware:
    """What the server runs: the app behind the guard middleware (API key, content type, body size, Unicode)."""
    return GuardMiddleware(build_app(state), state)
