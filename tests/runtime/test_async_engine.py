"""AsyncLLMEngine: concurrent streams match LLM.generate, cancellation frees KV blocks, bad requests fail
alone, the waiting limit, and a dead loop fails every stream.

One tiny-llama model is compiled once per module; the reference `LLM` and the async engine share it (each
engine has its own KV cache).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from mini_infer.llm import LLM
from mini_infer.runtime.async_engine import AsyncLLMEngine, EngineDeadError, EngineOverloaded, RequestAborted
from mini_infer.runtime.engine import EngineConfig, LLMEngine
from mini_infer.sampling_params import SamplingParams

CFG = dict(max_model_len=256, num_kv_blocks=64, block_size=16)


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-llama", **CFG)


@pytest.fixture(scope="module", params=[False, True], ids=["sync-scheduling", "async-scheduling"])
def engine(llm, request):
    """The server's engine, with and without async scheduling (the CUDA default)."""
    core = LLMEngine(EngineConfig(model="tiny-llama", async_scheduling=request.param, **CFG),
                     loaded=llm.engine.loaded, compiled=llm.engine.compiled)
    eng = AsyncLLMEngine(core)
    yield eng
    eng.shutdown()
    assert not eng._thread.is_alive()


def _run(coro, timeout: float = 120):
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def _wait_idle(engine: AsyncLLMEngine, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.stats()
        if stats["kv_cache_usage"] == 0 and stats["num_running"] == 0 and stats["num_waiting"] == 0:
            return stats
        if time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.05)


PROMPTS = [[1, 5, 9, 33], [7] * 20, list(range(3, 40)), [100, 200, 300], [11, 12], list(range(50, 90, 2))]


def test_concurrent_streams_match_llm_generate(llm, engine):
    params = [SamplingParams(temperature=0.0, max_tokens=6 + 2 * i, ignore_eos=True) for i in range(len(PROMPTS))]
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]

    async def one(i):
        ids, last = [], None
        async for out in engine.generate(PROMPTS[i], params[i], request_id=f"cmp-{i}"):
            ids += out.deltas[0][1]
            last = out
        assert last.finished and last.outputs[0].finish_reason == "length"
        assert last.outputs[0].token_ids == ids  # the deltas add up to the cumulative output
        return ids

    async def main():
        return await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))

    got = _run(main())
    assert got == expected
    assert engine.stats()["generation_tokens"] >= sum(len(e) for e in expected)


def test_n_samples_stream(engine):
    async def main():
        last = None
        async for out in engine.generate([4, 5, 6], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=5,
                                                                   ignore_eos=True)):
            last = out
        return last

    out = _run(main())
    assert out.finished and [len(c.token_ids) for c in out.outputs] == [5, 5, 5]


def test_cancel_frees_blocks(engine):
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def stop_after(i, k):  # the consumer walks away after k outputs
        got = 0
        async for _ in engine.generate(list(range(1, 30 + i)), long):
            got += 1
            if got == k:
                break
        return got

    async def cancelled(i):  # the consumer's task is cancelled (what a client disconnect does)
        started = asyncio.Event()

        async def consume():
            async for out in engine.generate(list(range(2, 40 + i)), long):
                started.set()
                assert not out.finished, "finished before it was cancelled"
        task = asyncio.create_task(consume())
        await started.wait()  # mid-generation: 200 tokens to go (not a fixed sleep, which a loaded machine outruns)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    async def main():
        await asyncio.gather(*(stop_after(i, 2 + i) for i in range(3)), *(cancelled(i) for i in range(2)))
        busy = engine.stats()
        return busy, await _wait_idle(engine)

    _, idle = _run(main())
    assert idle["kv_cache_usage"] == 0, idle
    assert idle["num_running"] == 0 and idle["num_waiting"] == 0, idle
    assert engine.engine.block_manager.usage == 0
    assert not engine.engine.has_unfinished_requests()


def test_bad_requests_raise_value_error_and_engine_keeps_serving(engine):
    async def main():
        for prompt, params in [([], None), ([1, 10**6], None), (list(range(1, 300)), None),
                               ([1, 2], SamplingParams(stop_token_ids=[10**6])), ("text", None)]:
            with pytest.raises(ValueError):
                async for _ in engine.generate(prompt, params):
                    pass
        with pytest.raises(ValueError, match="already in use"):
            await asyncio.gather(
                *(engine.add_request([1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True), request_id="dup")
                  for _ in range(2)))
        engine.abort("dup")
        outs = [o async for o in engine.generate([3, 4, 5], SamplingParams(temperature=0, max_tokens=4,
                                                                           ignore_eos=True))]
        return outs

    outs = _run(main())
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4
    assert engine.is_running and not engine.is_dead
    assert _run(_wait_idle(engine))["kv_cache_usage"] == 0


def test_waiting_limit_raises_overloaded(engine):
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)

    async def one(i):
        return [o async for o in engine.generate([1 + i, 2, 3], params)][-1]

    async def main():
        engine.max_waiting_requests = 2
        try:
            return await asyncio.gather(*(one(i) for i in range(12)), return_exceptions=True)
        finally:
            engine.max_waiting_requests = None

    results = _run(main())
    overloaded = [r for r in results if isinstance(r, EngineOverloaded)]
    served = [r for r in results if not isinstance(r, BaseException)]
    assert overloaded and served, results
    assert len(overloaded) + len(served) == len(results)
    assert all(len(r.outputs[0].token_ids) == 3 for r in served)


class _FakeScheduler:
    num_running = num_waiting = num_preemptions = 0


class _FakeBlockManager:
    usage = 0.0
    prefix_cache_queries = prefix_cache_hits = 0


class _ExplodingEngine:
    """Accepts requests, then its step raises: the loop must die loudly, not hang its streams."""

    def __init__(self):
        self.scheduler, self.block_manager, self.stats = _FakeScheduler(), _FakeBlockManager(), {}
        self.requests = set()
        self.tokenizer, self.max_model_len, self.vocab_size = None, 64, 32

    def add_request(self, request_id, prompt, params, priority=0, arrival_time=None):
        self.requests.add(request_id)
        return request_id

    def abort_request(self, request_id):
        return self.requests.discard(request_id) is None

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        time.sleep(0.05)
        raise RuntimeError("boom")


def test_dead_loop_fails_every_stream():
    eng = AsyncLLMEngine(_ExplodingEngine())

    async def main():
        async def consume(i):
            async for _ in eng.generate([1, 2], request_id=f"r{i}"):
                pass
        results = await asyncio.gather(*(consume(i) for i in range(3)), return_exceptions=True)
        with pytest.raises(EngineDeadError):
            await eng.add_request([1])
        return results

    results = _run(main(), timeout=30)
    assert all(isinstance(r, EngineDeadError) for r in results), results
    assert eng.is_dead and "boom" in repr(eng.dead_error) and eng.stats()["dead"]


def test_shutdown_ends_open_streams(llm):
    core = LLMEngine(EngineConfig(model="tiny-llama", **CFG), loaded=llm.engine.loaded,
                     compiled=llm.engine.compiled)
    eng = AsyncLLMEngine(core)

    async def main():
        stream = await eng.add_request([1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True))
        eng.shutdown(timeout=None)
        with pytest.raises(RequestAborted):
            async for _ in eng.iterate(stream):
                pass
        with pytest.raises(EngineDeadError):
            await eng.add_request([1])

    _run(main(), timeout=60)
    assert not eng._thread.is_alive() and core.block_manager.usage == 0
