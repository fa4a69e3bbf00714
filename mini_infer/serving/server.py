"""`serve(args, engine_kwargs)`: what `mini-infer serve` runs.

The HTTP server starts listening first and the engine loads (and compiles) in a background thread, so a
load balancer or a test can poll `GET /health`: 503 while loading, 200 once the engine is ready, 503 again if
the engine dies. If loading fails, the server prints the error and exits with status 2.
"""

from __future__ import annotations

import logging
import sys
import threading

from mini_infer.serving.api_server import DEFAULT_MAX_BODY_BYTES, ServerSettings, ServerState, build_app

logger = logging.getLogger("mini_infer.serving")


def _served_name(args, engine_kwargs: dict) -> str:
    if getattr(args, "served_model_name", None):
        return args.served_model_name
    model = engine_kwargs.get("model")
    if model is None:
        from mini_infer.models.loader import DEFAULT_MODEL

        return DEFAULT_MODEL
    return str(model)


def make_state(args, engine_kwargs: dict) -> ServerState:
    return ServerState(ServerSettings(
        served_model_name=_served_name(args, engine_kwargs), model=engine_kwargs.get("model"),
        api_key=getattr(args, "api_key", None) or None,
        max_waiting_requests=getattr(args, "max_waiting_requests", None),
        max_body_bytes=getattr(args, "max_request_body_bytes", None) or DEFAULT_MAX_BODY_BYTES))


def load_engine(state: ServerState, engine_kwargs: dict):
    """Build the engine (blocking: load + compile) and hand it to the app."""
    from mini_infer.runtime.async_engine import AsyncLLMEngine
    from mini_infer.runtime.engine import EngineConfig

    config = EngineConfig(**{**engine_kwargs, "served_model_name": state.settings.served_model_name})
    engine = AsyncLLMEngine.from_config(config, max_waiting_requests=state.settings.max_waiting_requests)
    state.set_engine(engine)
    return engine


def serve(args, engine_kwargs: dict) -> int:
    """Run the OpenAI-compatible server until interrupted; returns the exit status."""
    import uvicorn

    from mini_infer.serving.api_server import GuardMiddleware

    state = make_state(args, engine_kwargs)
    app = GuardMiddleware(build_app(state), state)
    host, port = getattr(args, "host", "127.0.0.1"), getattr(args, "port", 8000)
    verbose = bool(getattr(args, "verbose", False))
    config = uvicorn.Config(app, host=host, port=port, log_level="info" if verbose else "warning",
                            access_log=verbose, timeout_graceful_shutdown=5, lifespan="off")
    server = uvicorn.Server(config)
    name = state.settings.served_model_name

    def load() -> None:
        try:
            engine = load_engine(state, engine_kwargs)
        except BaseException as exc:  # noqa: BLE001 - reported, then the server stops
            state.load_error = exc
            if not isinstance(exc, (ValueError, FileNotFoundError)):  # a bad name or option needs no traceback
                logger.exception("loading the engine failed")
            print(f"mini-infer serve: error: could not load {name!r}: {exc}", file=sys.stderr, flush=True)
            server.should_exit = True
            return
        core = engine.engine
        print(f"mini-infer: {name} ready (load {core.load_seconds:.1f}s, compile {core.compile_seconds:.1f}s, "
              f"max_model_len {core.max_model_len}, {core.kv_cache.num_blocks} KV blocks)", flush=True)

    print(f"mini-infer: serving {name} at http://{host}:{port}/v1 (OpenAI API); GET /health answers 503 "
          "until the model is loaded", flush=True)
    loader = threading.Thread(target=load, name="mini-infer-load", daemon=True)
    loader.start()
    try:
        server.run()
    except SystemExit as exc:  # uvicorn exits this way when it cannot bind
        return int(exc.code or 1)
    except KeyboardInterrupt:  # Ctrl-C during start-up or a second Ctrl-C during shutdown: stop quietly
        return 0
    finally:
        if state.engine is not None:
            state.engine.shutdown(timeout=5)
    if state.load_error is not None:
        return 2
    return 0 if server.started else 1
