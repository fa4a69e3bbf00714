"""OpenAI-compatible HTTP serving: `mini-infer serve`.

- `protocol.py`: pydantic models of every request and response body.
- `api_server.py`: the FastAPI app (`build_app`), its shared `ServerState`, and the guard middleware
  (API key, content type, body size).
- `metrics.py`: Prometheus metrics in the app's own registry.
- `server.py`: `serve(args, engine_kwargs)`: uvicorn up first, the engine loaded in the background.

The HTTP layer talks only to `mini_infer.runtime.async_engine.AsyncLLMEngine`.
"""
