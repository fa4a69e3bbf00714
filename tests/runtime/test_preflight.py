"""Refused before loading: every engine option or model fault that would surely fail is one ValueError naming
the option (or file), raised by `LLMEngine` before `load_model` runs and in well under a second. Then the
limits that follow from options: max_model_len lowered to what the KV budget holds when the user did not set
it (one warning), and the long-prefill cap that lets a short request's first token come within two steps of
its arrival while a long prompt prefills (counted in engine steps, the scheduler's clock)."""

from __future__ import annotations

import logging
import time

import pytest
import torch

import mini_infer.runtime.engine as engine_mod
import mini_infer.runtime.preflight as preflight
from mini_infer.runtime.engine import EngineConfig, LLMEngine
from mini_infer.runtime.limits import long_prefill_threshold
from mini_infer.sampling_params import SamplingParams
from tests import _model_cache as mc


@pytest.fixture
def no_loading(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("load_model ran: the check came too late")

    monkeypatch.setattr(engine_mod, "load_model", refuse)


@pytest.mark.parametrize("options, message", [
    (dict(model="tiny-llama", max_model_len=5000), "max_model_len=5000 is above this model's limit of 1024"),
    (dict(model="tiny-llama", kv_cache_memory_bytes=1), "kv_cache_memory_bytes=1 cannot hold one KV block"),
    (dict(model="tiny-llama", kv_cache_memory_bytes=100_000, max_model_len=1024), "fewer than max_model_len=1024"),
    (dict(model="/no/such/model"), "no such file or directory"),
    (dict(model="tiny-llama", device="tpu"), "device='tpu'"),
])
def test_refused_before_loading(no_loading, options, message):
    start = time.perf_counter()
    with pytest.raises(ValueError, match=message):
        LLMEngine(EngineConfig(**options))
    assert time.perf_counter() - start < 1.0


@pytest.mark.parametrize("options, name", [(dict(max_num_seqs=0), "max_num_seqs"),
                                            (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
                                            (dict(kv_cache_memory_bytes=0), "kv_cache_memory_bytes"),
                                            (dict(generation_config="hf"), "generation_config"),
                                            (dict(long_prefill_token_threshold=-1), "long_prefill_token_threshold")])
def test_option_ranges(options, name):
    with pytest.raises(ValueError, match=name):
        EngineConfig(model="tiny-llama", **options)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu(no_loading):
    with pytest.raises(ValueError, match="no CUDA GPU is available"):
        LLMEngine(EngineConfig(model="tiny-llama", device="cuda"))


def test_weights_larger_than_memory(no_loading, monkeypatch):
    monkeypatch.setattr(preflight, "available_memory", lambda device: 1000)
    with pytest.raises(ValueError, match=r"tiny-llama has 0\.\d+B parameters.*more than the 0\.0 GB"):
        LLMEngine(EngineConfig(model="tiny-llama", device="cpu"))


def _engine(**kw) -> LLMEngine:
    kw.setdefault("async_scheduling", False)
    return LLMEngine(EngineConfig(model="tiny-llama", device="cpu", **kw), loaded=mc.loaded("tiny-llama"),
                     compiled=mc.compiled("tiny-llama"))


def test_max_model_len_defaults_to_what_the_kv_budget_holds(caplog):
    per_block = 2 * 2 * 2 * 16 * 4 * 16  # tiny-llama: 2 layers x K,V x 2 heads x 16 dims x fp32 x 16 tokens
    with caplog.at_level(logging.WARNING, logger="mini_infer"):
        engine = _engine(kv_cache_memory_bytes=8 * per_block)  # 8 blocks: 128 tokens, the model allows 1024
    assert engine.max_model_len == 128 and engine.scheduler.config.max_model_len == 128
    warnings = [r.getMessage() for r in caplog.records if "max_model_len" in r.getMessage()]
    assert len(warnings) == 1 and "128" in warnings[0] and "1024" in warnings[0]
    (out,) = _run_to_end(engine, [list(range(1, 120))], SamplingParams(max_tokens=None, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 128 - 119


def _run_to_end(engine, prompts, params):
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return [final[f"r{i}"] for i in range(len(prompts))]


def test_long_prefill_cap_default():
    assert long_prefill_threshold(None, True, 40960, 8192) == 1638  # 4% of max_model_len (vLLM's rule)
    assert long_prefill_threshold(None, True, 2048, 8192) == 256  # never below 256 tokens ...
    assert long_prefill_threshold(None, True, 262144, 8192) == 4096  # ... nor above half the step budget
    assert long_prefill_threshold(0, True, 2048, 8192) is None and long_prefill_threshold(None, False, 2048, 8192) is None
    assert long_prefill_threshold(100, True, 2048, 8192) == 100


def _steps_to_first_token_of_short(engine) -> int:
    """Steps from a short request's arrival, during a 1000-token prefill, to its first token."""
    gen = torch.Generator().manual_seed(0)
    long = torch.randint(3, 512, (1000,), generator=gen).tolist()
    engine.add_request("long", long, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    engine.step()  # the long prompt's first chunk
    engine.add_request("short", list(range(3, 19)), SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    for steps in range(1, 20):
        if any(o.request_id == "short" and o.outputs[0].token_ids for o in engine.step()):
            return steps
    raise AssertionError("the short request never got a token")


def test_short_request_is_not_stuck_behind_a_long_prefill():
    """256-token steps: by default the long prompt takes at most half a step, so the short one runs beside
    it in the next step; without the cap it waits for the whole prefill."""
    capped = _engine(max_num_batched_tokens=256, num_kv_blocks=128, block_size=16)
    assert capped.scheduler.config.long_prefill_token_threshold == 128
    assert _steps_to_first_token_of_short(capped) <= 2
    uncapped = _engine(max_num_batched_tokens=256, num_kv_blocks=128, block_size=16, long_prefill_token_threshold=0)
    assert _steps_to_first_token_of_short(uncapped) >= 3
