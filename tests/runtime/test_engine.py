"""LLMEngine end to end against Hugging Face `generate` on the same model object.

Oracle: HF `model.generate(do_sample=False)` run per prompt (no padding) on the very model the engine
compiled. Greedy token ids must be equal under every scheduling regime the engine can get into (one
batch, prefix-cache hits, chunked prefill mixed with decodes, preemption by recompute), for every dense
tiny preset (tiny-mistral's sliding window of 8 is crossed by every prompt) and for the real SmolLM2
weights. Then: no KV block leaks, bad requests refused with a ValueError naming the field (and the engine
keeps serving), sampling options through the engine, prompt logprobs against eager logits (also with
prefix caching and chunked prefill), and a failing step failing only its own requests.
"""

from __future__ import annotations

import functools

import pytest
import torch

from mini_infer.models.presets import TINY_DENSE_PRESETS
from mini_infer.outputs import RequestOutput
from mini_infer.runtime.engine import EngineConfig, LLMEngine
from mini_infer.sampling_params import SamplingParams
from tests import _model_cache as mc

NEW = 12
LENGTHS = (3, 17, 40, 9, 26)  # mixed lengths, all past tiny-mistral's window of 8 once generated
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
SMOL = None  # load_model(None): the embedded SmolLM2-135M-Instruct
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
ASYNC_SCHEDULING = False  # tests/runtime/test_engine_async.py runs this module again with it on


# ---------------------------------------------------------------------- helpers


def make_engine(name: str | None, **kw) -> LLMEngine:
    """An engine over the process-wide loaded + compiled model `name` (tiny cache unless told)."""
    if name is SMOL:
        kw.setdefault("max_model_len", 1024)
        kw.setdefault("kv_cache_memory_bytes", 64 << 20)
    else:
        kw.setdefault("num_kv_blocks", 256)
        kw.setdefault("block_size", 4)
    kw.setdefault("async_scheduling", ASYNC_SCHEDULING)
    lm = mc.loaded(name)
    return LLMEngine(EngineConfig(model=name, device="cpu", **kw), loaded=lm, compiled=mc.compiled(name))


def random_prompts(seed: int, lengths, vocab: int = 512) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


@functools.cache
def hf_ref(name: str | None, prompt: tuple[int, ...], n: int = NEW) -> list[int]:
    return mc.hf_greedy(mc.loaded(name).model, list(prompt), n)


def hf_logprobs(name: str | None, ids: list[int]) -> torch.Tensor:
    """log_softmax of the eager HF logits over `ids` ([len(ids), vocab], fp32)."""
    model = mc.loaded(name).model
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()
    return logits.log_softmax(-1)


class Collector:
    """Steps an engine, accumulating each request's streamed deltas and final output."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.final: dict[str, RequestOutput] = {}
        self.streamed: dict[str, list[list]] = {}

    def step(self) -> list[RequestOutput]:
        outs = self.engine.step()
        for out in outs:
            for c in out.outputs:  # every output so far, not only the final: only ids read back, one logprob each
                assert all(t >= 0 for t in c.token_ids), f"an id not read back yet in {c.token_ids}"
                assert c.logprobs is None or len(c.logprobs) == len(c.token_ids)
            acc = self.streamed.setdefault(out.request_id, [["", []] for _ in out.outputs])
            assert len(out.deltas) == len(out.outputs)
            for a, (text, toks) in zip(acc, out.deltas):
                a[0] += text
                a[1] += toks
            if out.finished:
                assert out.request_id not in self.final, "a request reported finished twice"
                self.final[out.request_id] = out
        return outs

    def drain(self, ids: list[str], max_steps: int = 2000) -> dict[str, RequestOutput]:
        """Step until the engine is idle; checks the streamed deltas add up to the final outputs."""
        for _ in range(max_steps):
            if not self.engine.has_unfinished_requests():
                break
            self.step()
        else:
            raise AssertionError(f"engine did not finish in {max_steps} steps")
        for rid, out in self.final.items():
            for a, c in zip(self.streamed[rid], out.outputs):
                assert a[0] == c.text and a[1] == c.token_ids, "streamed deltas differ from the final output"
        assert set(ids) <= set(self.final), f"unfinished: {set(ids) - set(self.final)}"
        return self.final


def drain(engine: LLMEngine, ids: list[str]) -> dict[str, RequestOutput]:
    return Collector(engine).drain(ids)


def run(engine: LLMEngine, prompts, params: SamplingParams | list[SamplingParams] = GREEDY,
        prefix: str = "r") -> list[RequestOutput]:
    params = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(f"{prefix}{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    final = drain(engine, ids)
    return [final[i] for i in ids]


def assert_no_leak(engine: LLMEngine) -> None:
    bm = engine.block_manager
    bm.check_invariants()
    assert bm.num_used_blocks == 0 and bm.usage == 0.0
    assert not engine.has_unfinished_requests() and not engine.requests


def record_schedules(engine: LLMEngine) -> list:
    """Wrap the scheduler so every step's [(num_new_tokens, prompt_len, computed_before, samples)] is kept."""
    log: list = []
    orig = engine.scheduler.schedule

    def schedule():
        out = orig()
        log.append([(n, s.num_prompt_tokens, s.num_computed_tokens, smp)
                    for (s, n), smp in zip(out.scheduled, out.sample)])
        return out

    engine.scheduler.schedule = schedule
    return log


# ---------------------------------------------------------------------- greedy == HF, tiny presets

PROMPTS = random_prompts(0, LENGTHS)


@pytest.mark.parametrize("name", TINY_DENSE_PRESETS)
def test_greedy_matches_hf_default_settings(name):
    engine = make_engine(name, num_kv_blocks=None, block_size=16, kv_cache_memory_bytes=8 << 20)
    outs = run(engine, PROMPTS)
    for p, o in zip(PROMPTS, outs):
        c = o.outputs[0]
        assert c.finish_reason == "length" and len(c.token_ids) == NEW
        assert c.token_ids == hf_ref(name, tuple(p)), f"{name}: prompt of {len(p)} tokens"
        assert o.prompt_token_ids == p and o.finished
    assert engine.stats["generation_tokens"] == NEW * len(PROMPTS)
    assert_no_leak(engine)


@pytest.mark.parametrize("name", TINY_DENSE_PRESETS)
def test_greedy_matches_hf_with_prefix_cache_hits(name):
    common = random_prompts(1, [28])[0]  # 7 whole blocks of 4
    suffixes = random_prompts(2, (0, 3, 9, 14, 1))
    # one prompt is exactly the shared prefix: all its blocks are cached, but its last token must be computed
    prompts = [common + s for s in suffixes]
    cached = make_engine(name, enable_prefix_caching=True)
    run(cached, [prompts[2]], prefix="warm")  # its full blocks stay cached after it finishes
    hits_before = cached.block_manager.prefix_cache_hits
    outs = run(cached, prompts)
    hits = cached.block_manager.prefix_cache_hits - hits_before
    assert hits >= 24 * len(prompts), f"only {hits} prompt tokens came from the prefix cache"
    assert all(o.num_cached_tokens > 0 for o in outs)
    plain = make_engine(name, enable_prefix_caching=False)
    plain_outs = run(plain, prompts)
    assert plain.block_manager.prefix_cache_hits == 0
    for p, o, q in zip(prompts, outs, plain_outs):
        assert o.outputs[0].token_ids == q.outputs[0].token_ids == hf_ref(name, tuple(p))
    assert_no_leak(cached)
    assert_no_leak(plain)


@pytest.mark.parametrize("name", TINY_DENSE_PRESETS)
def test_greedy_matches_hf_with_chunked_prefill(name):
    engine = make_engine(name, max_num_batched_tokens=8, enable_chunked_prefill=True)
    log = record_schedules(engine)
    outs = run(engine, PROMPTS)
    for p, o in zip(PROMPTS, outs):
        assert o.outputs[0].token_ids == hf_ref(name, tuple(p))
    assert all(sum(n for n, *_ in step) <= 8 for step in log)
    # a prompt was split: a chunk that started past 0 and stayed inside the prompt
    assert any(0 < before < plen and n > 0 for step in log for n, plen, before, _ in step)
    # and a decode (one token after the prompt) ran in the same step as a prefill chunk
    assert any(any(before >= plen for _, plen, before, _ in step)
               and any(before < plen for _, plen, before, _ in step) for step in log)
    assert_no_leak(engine)


@pytest.mark.parametrize("name", TINY_DENSE_PRESETS)
def test_greedy_matches_hf_under_preemption(name):
    # 16 blocks of 4 = 64 tokens: the longest sequence (40 + 12) fits alone, the batch does not. tiny-mistral's
    # window of 8 releases a sequence's old blocks as it goes: 11 blocks and 8-token steps still preempt
    kw = dict(num_kv_blocks=11, max_num_batched_tokens=8) if name == "tiny-mistral" else dict(num_kv_blocks=16)
    engine = make_engine(name, block_size=4, **kw)
    outs = run(engine, PROMPTS)
    assert engine.stats["preemptions"] > 0
    for p, o in zip(PROMPTS, outs):
        assert o.outputs[0].finish_reason == "length"
        assert o.outputs[0].token_ids == hf_ref(name, tuple(p))
    assert_no_leak(engine)


def test_sliding_window_blocks_stay_bounded_by_the_window():
    """tiny-mistral attends to the last 8 tokens: a 90-token generation holds the blocks of its window, not of its
    length, and still equals HF (blocks of 4: the window and the block being written span at most 4 blocks)."""
    engine = make_engine("tiny-mistral", num_kv_blocks=64, block_size=4)
    assert engine.scheduler.config.attention_window == 8
    prompt = random_prompts(21, [30])[0]
    engine.add_request("w", {"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=90,
                                                                      ignore_eos=True))
    in_use, out = [], None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o if o.finished else out
        in_use.append(engine.block_manager.num_used_blocks)
    assert max(in_use[2:]) <= 4 < -(-120 // 4)  # after the prompt's step: bounded by the window
    assert out.outputs[0].token_ids == hf_ref("tiny-mistral", tuple(prompt), 90)
    assert_no_leak(engine)


# ---------------------------------------------------------------------- real weights: SmolLM2-135M


@pytest.fixture(scope="module")
def smol():
    return make_engine(SMOL)


def test_smollm2_greedy_matches_hf(smol):
    tok = smol.tokenizer
    texts = ["Paris is", "The three primary colors are red, yellow and",
             "Once upon a time, in a small village at the foot of a mountain, there lived an old clockmaker "
             "who had never left his workshop. One morning,"]
    prompts = [tok.encode(t) for t in texts]
    assert len({len(p) for p in prompts}) == 3
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = run(smol, prompts, params)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_ref(SMOL, tuple(p), 24)
        assert o.outputs[0].text == tok.decode(o.outputs[0].token_ids, skip_special_tokens=True)
    assert_no_leak(smol)


def test_smollm2_chat_answer(smol):
    ids = smol.tokenizer.apply_chat_template(FRANCE, add_generation_prompt=True, tokenize=True,
                                             return_dict=False)
    (out,) = run(smol, [{"prompt_token_ids": list(ids)}], SamplingParams(temperature=0.0, max_tokens=64))
    assert out.outputs[0].text == "The capital of France is Paris."
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason is None  # EOS
    assert_no_leak(smol)


def test_smollm2_stop_string(smol):
    ids = smol.tokenizer.apply_chat_template(FRANCE, add_generation_prompt=True, tokenize=True,
                                             return_dict=False)
    params = SamplingParams(temperature=0.0, max_tokens=64, stop=["Paris", "Berlin"])
    (out,) = run(smol, [{"prompt_token_ids": list(ids)}], params)
    c = out.outputs[0]
    assert c.text == "The capital of France is "
    assert c.finish_reason == "stop" and c.stop_reason == "Paris"
    params.include_stop_str_in_output = True
    (out,) = run(smol, [{"prompt_token_ids": list(ids)}], params, prefix="inc")
    assert out.outputs[0].text == "The capital of France is Paris"
    assert_no_leak(smol)


def test_smollm2_seed_reproduces_text_and_n_samples(smol):
    def sample(seed, n=1, prefix="s"):
        p = SamplingParams(temperature=1.0, max_tokens=10, seed=seed, n=n, ignore_eos=True)
        return run(smol, ["Once upon a time"], p, prefix=prefix)[0]

    a, b, c = sample(7, prefix="a"), sample(7, prefix="b"), sample(8, prefix="c")
    assert a.outputs[0].text == b.outputs[0].text and a.outputs[0].token_ids == b.outputs[0].token_ids
    assert a.outputs[0].token_ids != c.outputs[0].token_ids
    # a seeded request samples the same in a batch with others as alone
    p = SamplingParams(temperature=1.0, max_tokens=10, seed=7, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)
    outs = run(smol, ["Once upon a time", "Hello there", "Once upon a time"], [p, other, other], prefix="m")
    assert outs[0].outputs[0].token_ids == a.outputs[0].token_ids
    three = sample(11, n=3, prefix="n")
    assert [c.index for c in three.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 10 and c.text for c in three.outputs)
    assert len({tuple(c.token_ids) for c in three.outputs}) > 1
    assert_no_leak(smol)


# ---------------------------------------------------------------------- sampling options, tiny-llama

LLAMA = "tiny-llama"


@pytest.fixture(scope="module")
def llama():
    return make_engine(LLAMA)


def test_stop_token_ids_and_min_tokens(llama):
    p = PROMPTS[1]
    ref = hf_ref(LLAMA, tuple(p))
    # the first position whose token did not occur before it
    k = next(i for i in range(2, NEW) if ref[i] not in ref[:i])
    stop_id = ref[k]
    (out,) = run(llama, [p], SamplingParams(temperature=0.0, max_tokens=NEW, stop_token_ids=[stop_id]))
    c = out.outputs[0]
    assert c.token_ids == ref[: k + 1]
    assert c.finish_reason == "stop" and c.stop_reason == stop_id
    # min_tokens bans the stop id until k + 2 tokens exist: the output diverges and runs past position k
    params = SamplingParams(temperature=0.0, max_tokens=NEW, stop_token_ids=[stop_id], min_tokens=k + 2)
    (out,) = run(llama, [p], params, prefix="m")
    c = out.outputs[0]
    assert len(c.token_ids) >= k + 2 and stop_id not in c.token_ids[: k + 2]
    assert c.token_ids[:k] == ref[:k] and c.token_ids[k] != stop_id
    # EOS (id 2 for tiny presets) stops unless ignore_eos; min_tokens bans it too
    assert llama.eos_token_ids == {2}
    assert_no_leak(llama)


def test_eos_stops_generation(llama):
    p = PROMPTS[3]
    ref = hf_ref(LLAMA, tuple(p))
    llama.eos_token_ids = {ref[4]}  # pretend the 5th greedy token is EOS
    try:
        (out,) = run(llama, [p], SamplingParams(temperature=0.0, max_tokens=NEW))
        (ign,) = run(llama, [p], SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True), prefix="i")
    finally:
        llama.eos_token_ids = {2}
    assert out.outputs[0].token_ids == ref[:5] and out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].stop_reason is None
    assert ign.outputs[0].token_ids == ref


def test_logprobs_match_eager_log_softmax(llama):
    p = PROMPTS[1]
    (out,) = run(llama, [p], SamplingParams(temperature=0.0, max_tokens=6, logprobs=3))
    c = out.outputs[0]
    assert len(c.logprobs) == len(c.token_ids) == 6
    ref = hf_logprobs(LLAMA, p + c.token_ids)
    total = 0.0
    for j, (tok, entry) in enumerate(zip(c.token_ids, c.logprobs)):
        row = ref[len(p) - 1 + j]
        assert len(entry) >= 3 and tok in entry
        assert entry[tok].rank == 1  # greedy: the sampled token is the most likely
        top = row.topk(3)
        assert set(top.indices.tolist()) <= set(entry)
        for t, lp in entry.items():
            assert abs(lp.logprob - row[t].item()) < 1e-4
        total += entry[tok].logprob
    assert c.cumulative_logprob == pytest.approx(total, abs=1e-4)
    # logprobs=0: only the sampled token; None: no logprobs at all
    (out,) = run(llama, [p], SamplingParams(temperature=0.0, max_tokens=3, logprobs=0), prefix="z")
    assert all(list(e) == [t] for e, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids))
    (out,) = run(llama, [p], SamplingParams(temperature=0.0, max_tokens=3), prefix="n")
    assert out.outputs[0].logprobs is None and out.outputs[0].cumulative_logprob is None


def check_prompt_logprobs(out: RequestOutput, prompt: list[int], k: int) -> None:
    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == len(prompt) and plp[0] is None
    ref = hf_logprobs(LLAMA, prompt)
    for j in range(1, len(prompt)):
        entry, row = plp[j], ref[j - 1]
        assert prompt[j] in entry and len(entry) >= k
        assert set(row.topk(k).indices.tolist()) <= set(entry)
        for t, lp in entry.items():
            assert abs(lp.logprob - row[t].item()) < 1e-4, f"position {j}, token {t}"


def test_prompt_logprobs_match_eager_log_softmax(llama):
    p = PROMPTS[2]
    (out,) = run(llama, [p], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2))
    check_prompt_logprobs(out, p, 2)
    (out,) = run(llama, [[7]], SamplingParams(max_tokens=1, prompt_logprobs=1), prefix="one")
    assert out.prompt_logprobs == [None]


def test_prompt_logprobs_skip_prefix_cache_hits():
    engine = make_engine(LLAMA, enable_prefix_caching=True)
    p = PROMPTS[2]
    run(engine, [p], prefix="warm")  # the whole prompt is now cached
    hits = engine.block_manager.prefix_cache_hits
    (out,) = run(engine, [p], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1))
    check_prompt_logprobs(out, p, 1)
    assert out.num_cached_tokens == 0 and engine.block_manager.prefix_cache_hits == hits
    (again,) = run(engine, [p], SamplingParams(temperature=0.0, max_tokens=2), prefix="hit")
    assert again.num_cached_tokens > 0  # requests without prompt logprobs still hit
    assert_no_leak(engine)


def test_prompt_logprobs_with_chunked_prefill_and_preemption():
    engine = make_engine(LLAMA, max_num_batched_tokens=8, num_kv_blocks=16, block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, prompt_logprobs=2)
    outs = run(engine, PROMPTS, params)
    assert engine.stats["preemptions"] > 0
    for p, o in zip(PROMPTS, outs):
        check_prompt_logprobs(o, p, 2)
        assert o.outputs[0].token_ids == hf_ref(LLAMA, tuple(p))
    assert_no_leak(engine)


# ---------------------------------------------------------------------- leaks, aborts


def test_no_leak_after_finish_and_abort():
    engine = make_engine(LLAMA, num_kv_blocks=24, block_size=4, max_num_batched_tokens=16)
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, long if i < 2 else GREEDY)
    col = Collector(engine)
    for _ in range(4):
        col.step()
    assert engine.block_manager.num_used_blocks > 0
    assert engine.abort_request("r0") and not engine.abort_request("r0")
    assert not engine.abort_request("nope")
    engine.add_request("late", PROMPTS[0], GREEDY)
    assert engine.abort_request("late")  # aborted while waiting
    for _ in range(3):
        col.step()
    assert engine.abort_request("r1")  # aborted mid-generation
    final = col.drain([f"r{i}" for i in range(2, 5)])
    for i in range(2, 5):
        assert final[f"r{i}"].outputs[0].token_ids == hf_ref(LLAMA, tuple(PROMPTS[i]))
    assert "r0" not in final and "r1" not in final
    assert_no_leak(engine)


def test_generation_is_capped_by_max_model_len_and_by_the_cache():
    engine = make_engine(LLAMA, max_model_len=16)
    unbounded = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    (out,) = run(engine, [PROMPTS[0]], unbounded)  # 3 prompt tokens: 13 generated, then max_model_len
    assert out.outputs[0].finish_reason == "length"
    assert out.outputs[0].token_ids == hf_ref(LLAMA, tuple(PROMPTS[0]), 13)
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time
    assert_no_leak(engine)
    small = make_engine(LLAMA, num_kv_blocks=4, block_size=4)  # 16 tokens of cache in all
    (out,) = run(small, [PROMPTS[3]], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    assert out.outputs[0].finish_reason == "length" and out.error is None
    ids = out.outputs[0].token_ids  # KV for 16 tokens (the last sampled token needs none)
    assert 16 - len(PROMPTS[3]) <= len(ids) <= 17 - len(PROMPTS[3])
    assert ids == hf_ref(LLAMA, tuple(PROMPTS[3]), len(ids))
    assert out.metrics.finished_time is not None
    assert_no_leak(small)


# ---------------------------------------------------------------------- bad input


def _mutated(**fields) -> SamplingParams:
    """Valid params changed after construction, so the engine's own validation must catch them."""
    p = SamplingParams()
    for k, v in fields.items():
        setattr(p, k, v)
    return p


@pytest.mark.parametrize(("prompt", "params", "field"), [
    ([], None, "prompt"),
    ("", None, "prompt"),
    ({"prompt_token_ids": []}, None, "prompt"),
    (list(range(1, 65)), None, "max_model_len"),
    ([1, 2, 3], _mutated(max_tokens=0), "max_tokens"),
    ([1, 2, 3], _mutated(max_tokens=-3), "max_tokens"),
    ([1, 2, 3], _mutated(temperature=-0.5), "temperature"),
    ([1, 2, 3], _mutated(top_p=0.0), "top_p"),
    ([1, 2, 3], _mutated(top_p=1.5), "top_p"),
    ([1, 2, 3], _mutated(n=0), "n"),
    ([1, 2, 512], None, "prompt_token_ids"),
    ([1, -1, 3], None, "prompt_token_ids"),
    ([1, 2.5, 3], None, "prompt_token_ids"),
    ([1, 2, 3], _mutated(stop=[f"s{i}" for i in range(65)]), "stop"),
    ([1, 2, 3], _mutated(stop_token_ids=[600]), "stop_token_ids"),
    ("hello", None, "tokenizer"),
    ({"text": [1, 2]}, None, "prompt"),
    ([1, 2, 3], _mutated(stop=["x"]), "stop"),  # stop strings need a tokenizer
])
def test_bad_requests_are_refused_and_the_engine_keeps_serving(prompt, params, field):
    engine = make_engine(LLAMA, max_model_len=64)
    with pytest.raises(ValueError, match=field):
        engine.add_request("bad", prompt, params)
    assert not engine.requests and not engine.has_unfinished_requests()
    (out,) = run(engine, [PROMPTS[1]], prefix="bad")  # the same id is free again, and serving works
    assert out.outputs[0].token_ids == hf_ref(LLAMA, tuple(PROMPTS[1]))
    assert_no_leak(engine)


@pytest.mark.parametrize(("fields", "name"), [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-1.0), "temperature"), (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.01), "top_p"), (dict(n=0), "n"), (dict(stop=[str(i) for i in range(65)]), "stop"),
])
def test_sampling_params_refuse_bad_values(fields, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**fields)


def test_prompt_longer_than_the_cache_is_refused():
    engine = make_engine(LLAMA, num_kv_blocks=4, block_size=4)  # 16 tokens of cache
    with pytest.raises(ValueError, match="KV cache"):
        engine.add_request("big", list(range(1, 18)), GREEDY)
    (out,) = run(engine, [[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4))
    assert out.outputs[0].token_ids == hf_ref(LLAMA, (5, 6, 7), 4)


def test_duplicate_request_id_is_refused(llama):
    llama.add_request("dup", [1, 2, 3], GREEDY)
    with pytest.raises(ValueError, match="request_id"):
        llama.add_request("dup", [4, 5, 6], GREEDY)
    drain(llama, ["dup"])
    assert_no_leak(llama)


# ---------------------------------------------------------------------- a failing step


def test_failing_step_fails_only_its_requests(llama, monkeypatch):
    runner = llama.runner
    real = runner.execute
    calls = {"n": 0}

    def flaky(inputs, plan, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected device failure")
        return real(inputs, plan, **kw)

    monkeypatch.setattr(runner, "execute", flaky)
    llama.add_request("a", PROMPTS[0], GREEDY)
    llama.step()
    llama.step()
    assert llama.block_manager.num_used_blocks > 0
    outs = llama.step()  # the third forward raises
    (failed,) = [o for o in outs if o.request_id == "a"]
    assert failed.finished and failed.outputs[0].finish_reason == "error"
    assert "injected device failure" in failed.error
    assert llama.block_manager.num_used_blocks == 0 and not llama.has_unfinished_requests()
    (out,) = run(llama, [PROMPTS[3]], prefix="after")
    assert out.outputs[0].token_ids == hf_ref(LLAMA, tuple(PROMPTS[3])) and out.error is None
    assert_no_leak(llama)


def test_failing_step_with_several_requests(monkeypatch):
    """Every request in the failing step fails, with all its samples (also one not scheduled in that
    step); a request waiting outside the step is untouched; one added later is served."""
    engine = make_engine(LLAMA, max_num_seqs=2)
    real = engine.runner.execute
    state = {"fail": True}

    def flaky(inputs, plan, **kw):
        if state["fail"]:
            state["fail"] = False
            raise RuntimeError("boom")
        return real(inputs, plan, **kw)

    monkeypatch.setattr(engine.runner, "execute", flaky)
    col = Collector(engine)
    engine.add_request("x", PROMPTS[0], GREEDY)
    engine.add_request("y", PROMPTS[1], SamplingParams(temperature=1.0, n=2, max_tokens=4))  # y[1] waits
    engine.add_request("z", PROMPTS[2], GREEDY)
    outs = {o.request_id: o for o in col.step()}
    assert set(outs) == {"x", "y"}
    assert all(o.finished and c.finish_reason == "error" and "boom" in o.error
               for o in outs.values() for c in o.outputs)
    final = col.drain(["z"])
    assert final["z"].outputs[0].token_ids == hf_ref(LLAMA, tuple(PROMPTS[2])) and final["z"].error is None
    assert_no_leak(engine)
    (out,) = run(engine, [PROMPTS[4]], prefix="later")
    assert out.outputs[0].token_ids == hf_ref(LLAMA, tuple(PROMPTS[4]))
    assert_no_leak(engine)
