"""What every route of one server shares: its settings, its metrics, and the engine once it has loaded.

Until the engine is set (it loads in the background) `require_engine` answers 503 with Retry-After; while the
server drains for shutdown it answers 503 too, so no new work starts. This module holds state and the checks
that read it; it must not define routes or build responses.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

from mini_infer.runtime.async_engine import AsyncLLMEngine
from mini_infer.sampling_params import model_sampling_defaults
from mini_infer.serving.errors import APIError
from mini_infer.serving.metrics import ServerMetrics

logger = logging.getLogger("mini_infer.serving")

DEFAULT_MAX_BODY_BYTES = 10 * 2**20


@dataclass
class ServerSettings:
    """The server's own options (the engine's are `EngineConfig`'s)."""

    served_model_name: str
    model: str | None = None  # what was asked to load (also accepted as the model name)
    api_key: str | None = None
    max_waiting_requests: int | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    retry_after_s: int = 1


class ServerState:
    """Settings, metrics, the engine once loaded, and the sampling defaults of its model."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.engine: AsyncLLMEngine | None = None
        self.tokenizer = None  # the server's own copy: the engine's is used by the loop thread
        self.sampling_defaults: dict = {}  # from the model's generation_config (--generation-config auto)
        self.load_error: BaseException | None = None
        self.draining = False  # shutting down: requests in flight finish, new ones get 503
        self.metrics = ServerMetrics(settings.served_model_name, self._stats)
        self.model_names = {settings.served_model_name}
        if settings.model:
            self.model_names.add(settings.model)

    def _stats(self) -> dict | None:
        return self.engine.stats() if self.engine is not None else None

    def set_engine(self, engine: AsyncLLMEngine) -> None:
        tok = engine.tokenizer
        if tok is not None:
            try:
                tok = copy.deepcopy(tok)
            except Exception:  # noqa: BLE001 - a tokenizer that cannot be copied is shared (reads only)
                logger.warning("could not copy the tokenizer; sharing the engine's")
        self.tokenizer = tok
        core = getattr(engine, "engine", None)
        if core is not None and getattr(core, "loaded", None) is not None:
            self.sampling_defaults = model_sampling_defaults(
                core.generation_config, core.config.generation_config)
        engine.add_observer(self.metrics)
        self.engine = engine

    def require_engine(self) -> AsyncLLMEngine:
        if self.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        if self.engine is None:
            msg = f"the model is not loaded: {self.load_error}" if self.load_error else "the model is loading"
            raise APIError(503, msg, code="not_ready", headers={"Retry-After": str(self.settings.retry_after_s)})
        if self.engine.is_dead:
            raise APIError(503, f"the engine has stopped: {self.engine.dead_error!r}", code="engine_dead")
        return self.engine

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:
            raise APIError(404, f"The model `{name}` does not exist. Served: "
                           f"{self.settings.served_model_name}.", param="model", code="model_not_found")

    def require_tokenizer(self, what: str, param: str):
        if self.tokenizer is None:
            raise APIError(400, f"model {self.settings.served_model_name!r} has no tokenizer, so {what} is not "
                           "supported: send token ids", param=param, code="no_tokenizer")
        return self.tokenizer
