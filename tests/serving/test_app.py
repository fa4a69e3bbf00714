"""The app in-process (httpx's ASGI transport, no model): 503 while loading, and a dead engine loop turns into
503s (health included) and an error event on open streams, never a hang or a 500."""

from __future__ import annotations

import asyncio
import time

import httpx

from mini_infer.runtime.async_engine import AsyncLLMEngine
from mini_infer.serving.app import build_asgi
from mini_infer.serving.state import ServerSettings, ServerState


class _Sched:
    num_running = num_waiting = num_preemptions = 0


class _Blocks:
    usage = 0.0
    prefix_cache_queries = prefix_cache_hits = 0


class _DyingEngine:
    """Accepts requests; its first step raises (as a crashed kernel would), killing the loop thread."""

    tokenizer, max_model_len, vocab_size = None, 64, 32

    def __init__(self):
        self.scheduler, self.block_manager, self.stats, self.requests = _Sched(), _Blocks(), {}, set()

    def add_request(self, request_id, prompt, params, priority=0, arrival_time=None):
        self.requests.add(request_id)

    def abort_request(self, request_id):
        self.requests.discard(request_id)

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        time.sleep(0.05)
        raise RuntimeError("device lost")


def _client(state: ServerState) -> httpx.AsyncClient:
    app = build_asgi(state)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=30)


def test_loading_state_is_503_with_retry_after():
    state = ServerState(ServerSettings(served_model_name="m"))

    async def main():
        async with _client(state) as c:
            return (await c.get("/health"), await c.post("/v1/completions", json={"prompt": [1]}),
                    await c.get("/metrics"), await c.get("/v1/models"))

    health, comp, metrics, models = asyncio.run(main())
    for r in (health, comp):
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "not_ready"
    assert metrics.status_code == 200 and 'mini_infer:num_requests_running{model_name="m"} 0.0' in metrics.text
    assert models.json()["data"][0]["id"] == "m"


def test_dead_engine_gives_503_everywhere():
    state = ServerState(ServerSettings(served_model_name="m"))
    engine = AsyncLLMEngine(_DyingEngine())
    state.set_engine(engine)

    async def main():
        async with _client(state) as c:
            assert (await c.get("/health")).status_code == 200
            first = await c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 4})
            stream = await c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 4, "stream": True})
            return first, stream, await c.get("/health"), await c.get("/metrics")

    first, stream, health, metrics = asyncio.run(main())
    assert first.status_code == 503 and "device lost" in first.json()["error"]["message"]
    assert stream.status_code == 503  # refused up front: the engine is already dead
    assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
    assert 'mini_infer:engine_dead{model_name="m"} 1.0' in metrics.text
    assert engine.is_dead


def test_engine_dying_mid_stream_sends_an_error_event():
    state = ServerState(ServerSettings(served_model_name="m"))
    state.set_engine(AsyncLLMEngine(_DyingEngine()))

    async def main():
        async with _client(state) as c:
            r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
            assert r.status_code == 400  # no tokenizer: refused before the engine sees it
            return await c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 4, "stream": True})

    r = asyncio.run(main())
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and '"engine_dead"' in events[-2]


def test_sampling_defaults_from_the_models_generation_config(tmp_path, monkeypatch):
    """--generation-config auto (vLLM's): a request that leaves max_tokens (or temperature, top_k, ...) unset
    gets the model's generation_config.json value; "vllm" keeps OpenAI's defaults (16 tokens for
    completions). The API docs state the defaults."""
    from transformers import GenerationConfig

    from mini_infer.runtime.engine import EngineConfig, LLMEngine
    from tests import _model_cache as mc

    mc.loaded("tiny-llama").model.save_pretrained(tmp_path, safe_serialization=True)
    GenerationConfig(max_new_tokens=3, top_k=1, do_sample=True).save_pretrained(tmp_path)
    mc.patch_engine(monkeypatch)

    async def completion_tokens(mode: str, **body) -> int:
        state = ServerState(ServerSettings(served_model_name="m"))
        engine = AsyncLLMEngine(LLMEngine(EngineConfig(model=str(tmp_path), device="cpu", num_kv_blocks=64,
                                                       block_size=4, generation_config=mode)))
        state.set_engine(engine)
        try:
            async with _client(state) as c:
                r = await c.post("/v1/completions", json={"prompt": [5, 6, 7], "ignore_eos": True, **body})
                assert r.status_code == 200, r.text
                return r.json()["usage"]["completion_tokens"]
        finally:
            engine.shutdown()

    assert asyncio.run(completion_tokens("auto")) == 3
    assert asyncio.run(completion_tokens("auto", max_tokens=5)) == 5
    assert asyncio.run(completion_tokens("vllm")) == 16

    async def docs():
        async with _client(ServerState(ServerSettings(served_model_name="m"))) as c:
            return (await c.get("/openapi.json")).json()["components"]["schemas"]

    schemas = asyncio.run(docs())
    assert "16" in schemas["CompletionRequest"]["properties"]["max_tokens"]["description"]
    chat = schemas["ChatCompletionRequest"]["properties"]["max_completion_tokens"]["description"]
    assert "rest of the context" in chat and "generation_config" in chat
