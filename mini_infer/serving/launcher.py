"""`serve(args, engine_kwargs)`: what `mini-infer serve` runs, from the command line to the exit status.

In order: the engine options and the model are checked (runtime/preflight.py: a bad option or a broken model
is one line and exit status 2, in well under a second); the port is bound (a busy port says so, status 2,
before anything claims to serve); the HTTP server starts listening and the engine loads (and compiles) in a
background thread, so a load balancer or a test can poll `GET /health`: 503 while loading, 200 once ready, 503
again if the engine dies. SIGINT / SIGTERM at any moment end the process with status 0: while loading at once
(the load cannot be interrupted, so the process exits without waiting for it), once serving after a drain of up
to `--shutdown-timeout` seconds (graceful.py). If loading fails, the error is one line and the status 2.
Once loaded, before it answers its first request, everything start-up left alive is frozen out of Python's
cyclic collector (`freeze_startup_heap`), as vLLM's engine does: the engine lives as long as the process.
"""

from __future__ import annotations

import errno
import gc
import logging
import os
import socket
import sys
import threading

from mini_infer.serving.app import build_asgi
from mini_infer.serving.graceful import DEFAULT_SHUTDOWN_TIMEOUT, GracefulServer
from mini_infer.serving.read_timeout import DEFAULT_REQUEST_READ_TIMEOUT, protocol_with_read_timeout
from mini_infer.serving.state import DEFAULT_MAX_BODY_BYTES, ServerSettings, ServerState

logger = logging.getLogger("mini_infer.serving")


def _served_name(args, engine_kwargs: dict) -> str:
    if getattr(args, "served_model_name", None):
        return args.served_model_name
    model = engine_kwargs.get("model")
    if model is None:
        from mini_infer.models.model_info import DEFAULT_MODEL

        return DEFAULT_MODEL
    return str(model)


def make_state(args, engine_kwargs: dict) -> ServerState:
    return ServerState(ServerSettings(
        served_model_name=_served_name(args, engine_kwargs), model=engine_kwargs.get("model"),
        api_key=getattr(args, "api_key", None) or None,
        max_waiting_requests=getattr(args, "max_waiting_requests", None),
        max_body_bytes=getattr(args, "max_request_body_bytes", None) or DEFAULT_MAX_BODY_BYTES))


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening-ready socket on host:port; ValueError saying why not (a busy port, a bad address)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as exc:
        raise ValueError(f"--host {host!r}: not an address of this machine ({exc.strerror})") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        why = "the port is in use (another server?): pick one with --port" if exc.errno == errno.EADDRINUSE \
            else exc.strerror
        raise ValueError(f"cannot listen on {host}:{port}: {why}") from None
    sock.set_inheritable(True)
    return sock


def freeze_startup_heap() -> int:
    """Collect once, then move every object still alive (the model's compiled graph, its modules, the tokenizer:
    ~600,000 objects tracked for qwen3-0.6b) out of Python's cyclic collector (`gc.freeze`), and return how many.
    Later collections then scan only what serving allocates: a full one over the start-up heap took 286 ms on the
    2-core development CPU (qwen3-0.6b preset, 515,806 objects), a pause for every stream at once (the collector
    holds the GIL: the engine thread cannot step). For a process whose engine lives as long as it does (the
    server): objects frozen here are not collected until `serve` unfreezes them on its way out."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def load_engine(state: ServerState, engine_kwargs: dict):
    """Build the engine (blocking: load + compile), freeze the start-up heap, and hand the engine to the app."""
    from mini_infer.runtime.async_engine import AsyncLLMEngine
    from mini_infer.runtime.engine import EngineConfig

    engine = AsyncLLMEngine.from_config(EngineConfig(**engine_kwargs),
                                        max_waiting_requests=state.settings.max_waiting_requests)
    frozen = freeze_startup_heap()  # before the first request (a full collection over this heap takes a while)
    logger.info("start-up heap frozen for the cyclic collector: %d objects", frozen)
    state.set_engine(engine)
    if state.sampling_defaults:
        print(f"mini-infer: sampling defaults from the model's generation_config: {state.sampling_defaults} "
              "(--generation-config vllm ignores them)", flush=True)
    return engine


def _exit_now(status: int) -> None:
    """Exit without waiting for the loading thread: it runs native code that cannot be interrupted, and the
    interpreter's normal shutdown under it aborts the process ("terminate called without an active
    exception")."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(status)


def serve(args, engine_kwargs: dict) -> int:
    """Run the OpenAI-compatible server until SIGINT/SIGTERM; returns the exit status (module docstring)."""
    import uvicorn

    from mini_infer.runtime.engine import EngineConfig
    from mini_infer.runtime.preflight import check_before_load

    host, port = getattr(args, "host", "127.0.0.1"), getattr(args, "port", 8000)
    sock = bind_socket(host, port)  # bound, not yet listening: a busy port is the first thing said
    try:
        check_before_load(EngineConfig(**engine_kwargs))  # ValueError: the CLI prints it, status 2
    except BaseException:
        sock.close()
        raise
    state = make_state(args, engine_kwargs)
    verbose = bool(getattr(args, "verbose", False))
    shutdown_timeout = getattr(args, "shutdown_timeout", None)
    shutdown_timeout = DEFAULT_SHUTDOWN_TIMEOUT if shutdown_timeout is None else shutdown_timeout
    read_timeout = getattr(args, "request_read_timeout", None) or DEFAULT_REQUEST_READ_TIMEOUT
    config = uvicorn.Config(build_asgi(state), log_level="info" if verbose else "warning", access_log=verbose,
                            http=protocol_with_read_timeout(read_timeout), lifespan="off",
                            timeout_graceful_shutdown=shutdown_timeout + 10)
    server = GracefulServer(config, state, shutdown_timeout)
    name = state.settings.served_model_name

    def load() -> None:
        try:
            engine = load_engine(state, engine_kwargs)
        except BaseException as exc:  # noqa: BLE001 - reported, then the server stops
            state.load_error = exc
            if not isinstance(exc, ValueError):  # a bad name, option or file needs no traceback
                logger.exception("loading the engine failed")
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            print(f"mini-infer serve: error: could not load {name!r}: {first}", file=sys.stderr, flush=True)
            server.should_exit = True
            return
        core = engine.engine
        print(f"mini-infer: {name} ready (load {core.load_seconds:.1f}s, compile {core.compile_seconds:.1f}s, "
              f"max_model_len {core.max_model_len}, {core.kv_cache.num_blocks} KV blocks)", flush=True)

    print(f"mini-infer: serving {name} at http://{host}:{sock.getsockname()[1]}/v1 (OpenAI API); GET /health "
          "answers 503 until the model is loaded", flush=True)
    loader = threading.Thread(target=load, name="mini-infer-load", daemon=True)
    loader.start()
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # a signal between the loader's start and uvicorn's own handlers
        server.should_exit = True
    finally:
        sock.close()
    if loader.is_alive():  # stopped while loading: the load cannot be interrupted
        print("mini-infer: stopped while loading the model", file=sys.stderr, flush=True)
        _exit_now(0)
    status = 2 if state.load_error is not None else 0
    if state.engine is not None and not state.engine.shutdown(timeout=5):  # a step still runs: do not wait
        _exit_now(status)
    gc.unfreeze()  # the interpreter's exit collects as usual (nanobind reports frozen Triton objects as leaked)
    return status
