"""OpenAI-compatible HTTP serving: `mini-infer serve`.

- `launcher.py`: `serve(args, engine_kwargs)`, what the command runs: checks, port, uvicorn up first, the engine
  loaded in the background, signals, exit status. `graceful.py`: the uvicorn server whose SIGINT/SIGTERM drain
  requests in flight; `read_timeout.py`: slow clients disconnected.
- `app.py`: the ASGI app (`build_app`, `build_asgi`): FastAPI with the routes below, behind `guard.py`'s
  middleware (API key, content type, body size, lone surrogates).
- `routes_info.py`, `routes_tokenize.py`, `routes_completions.py`, `routes_chat.py`: the routes; the last two
  share `engine_requests.py` (body -> SamplingParams -> queued requests), `streaming.py` (engine streams -> SSE
  or one body) and `logprobs.py`.
- `state.py`: what the routes share (settings, engine, metrics); `errors.py`: OpenAI's error bodies;
  `protocol.py`: pydantic models of every request and response body; `metrics.py`: Prometheus metrics.

The HTTP layer talks only to `mini_infer.runtime.async_engine.AsyncLLMEngine`.
"""
