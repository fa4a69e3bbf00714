"""`LLM`: the offline API with vLLM's names, on the embedded SmolLM2-135M-Instruct.

Prompt forms (text, token ids, dicts), per-prompt SamplingParams, outputs in prompt order whatever the
finishing order, chat through the model's template, and fast failures for what cannot be loaded or run.
Greedy ids are checked against HF `generate` on the same model object.
"""

from __future__ import annotations

import time

import pytest

from mini_infer.llm import LLM
from mini_infer.models.loader import ModelNotFoundError
from mini_infer.sampling_params import SamplingParams
from tests import _model_cache as mc

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
GERMANY = [{"role": "user", "content": "What is the capital of Germany?"}]
TEXTS = ["The capital of France is", "Water boils at a temperature of", "1, 2, 3, 4,"]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    mp = pytest.MonkeyPatch()
    mc.patch_engine(mp)  # the model is loaded and compiled once per test process
    try:
        yield LLM(max_model_len=1024, kv_cache_memory_bytes=64 << 20)
    finally:
        mp.undo()


def hf(llm: LLM, ids: list[int], n: int) -> list[int]:
    return mc.hf_greedy(mc.loaded(None).model, ids, n)


def test_text_prompts(llm):
    tok = llm.get_tokenizer()
    outs = llm.generate(TEXTS, greedy(6), use_tqdm=False)
    assert len(outs) == 3
    for text, out in zip(TEXTS, outs):
        ids = tok.encode(text)
        assert out.prompt == text and out.prompt_token_ids == ids and out.finished
        c = out.outputs[0]
        assert c.token_ids == hf(llm, ids, 6)
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
        assert c.finish_reason == "length"
    (single,) = llm.generate(TEXTS[0], greedy(6), use_tqdm=False)  # one prompt, not in a list
    assert single.outputs[0].token_ids == outs[0].outputs[0].token_ids
    assert not llm.engine.has_unfinished_requests()


def test_token_id_and_dict_prompts(llm):
    tok = llm.get_tokenizer()
    ids = [tok.encode(t) for t in TEXTS]
    by_text = [o.outputs[0].token_ids for o in llm.generate(TEXTS, greedy(5), use_tqdm=False)]
    by_ids = [o.outputs[0].token_ids for o in llm.generate(ids, greedy(5), use_tqdm=False)]
    (one,) = llm.generate(ids[1], greedy(5), use_tqdm=False)  # a single list of ids
    dicts = llm.generate([{"prompt_token_ids": ids[0]}, {"prompt": TEXTS[1]}, {"prompt_token_ids": ids[2]}],
                         greedy(5), use_tqdm=False)
    assert by_ids == by_text == [o.outputs[0].token_ids for o in dicts]
    assert one.outputs[0].token_ids == by_text[1] and one.prompt is None
    assert dicts[1].prompt == TEXTS[1] and dicts[0].prompt is None and dicts[0].prompt_token_ids == ids[0]


def test_per_prompt_params_and_prompt_order(llm):
    # the first prompt runs longest, so requests finish in a different order than they were given
    params = [greedy(12), greedy(2), SamplingParams(temperature=0.8, max_tokens=7, seed=3, ignore_eos=True)]
    outs = llm.generate(TEXTS, params, use_tqdm=False)
    assert [o.prompt for o in outs] == TEXTS
    assert [len(o.outputs[0].token_ids) for o in outs] == [12, 2, 7]
    tok = llm.get_tokenizer()
    assert outs[0].outputs[0].token_ids == hf(llm, tok.encode(TEXTS[0]), 12)
    again = llm.generate(TEXTS[2], params[2], use_tqdm=False)[0]
    assert again.outputs[0].token_ids == outs[2].outputs[0].token_ids  # seeded
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(TEXTS, params[:2], use_tqdm=False)
    assert llm.generate([], greedy(2), use_tqdm=False) == []


def test_final_text_as_streamed(llm):
    # LLM.generate detokenizes a sequence without stop strings once, at its end; a stop string still ends it at
    # the token completing it: both as the engine's streamed outputs (asked for every step) give them
    eng, tok = llm.engine, llm.get_tokenizer()
    ids = tok.apply_chat_template(FRANCE, add_generation_prompt=True, tokenize=True, return_dict=False)
    for params in (SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                   SamplingParams(temperature=0.0, max_tokens=64, stop=["Paris"])):
        (final,) = llm.generate({"prompt_token_ids": list(ids)}, params, use_tqdm=False)
        eng.add_request("streamed", {"prompt_token_ids": list(ids)}, params)
        deltas, last = [], None
        while eng.has_unfinished_requests():
            for out in eng.step():
                deltas.append(out.deltas[0][0])
                last = out
        got, want = final.outputs[0], last.outputs[0]
        assert (got.text, got.token_ids, got.finish_reason, got.stop_reason) == \
            (want.text, want.token_ids, want.finish_reason, want.stop_reason) and "".join(deltas) == want.text
    assert got.text == "The capital of France is " and got.stop_reason == "Paris"


def test_n_samples(llm):
    (out,) = llm.generate("Once upon a time", SamplingParams(n=3, temperature=1.0, max_tokens=5, seed=0),
                          use_tqdm=False)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(1 <= len(c.token_ids) <= 5 for c in out.outputs)


def test_chat(llm):
    (out,) = llm.chat(FRANCE, SamplingParams(temperature=0.0, max_tokens=64), use_tqdm=False)
    assert out.outputs[0].text == "The capital of France is Paris."
    assert out.outputs[0].finish_reason == "stop"
    both = llm.chat([FRANCE, GERMANY], SamplingParams(temperature=0.0, max_tokens=64), use_tqdm=False)
    assert both[0].outputs[0].text == "The capital of France is Paris."
    assert "Berlin" in both[1].outputs[0].text


def test_bad_prompt_in_a_batch_queues_nothing(llm):
    too_long = list(range(1, 1100))  # max_model_len is 1024
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([TEXTS[0], too_long, TEXTS[1]], greedy(4), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests() and llm.engine.block_manager.num_used_blocks == 0
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([TEXTS[0], ""], greedy(4), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    (ok,) = llm.generate(TEXTS[0], greedy(4), use_tqdm=False)  # still serving
    assert ok.outputs[0].token_ids == hf(llm, llm.get_tokenizer().encode(TEXTS[0]), 4)


@pytest.mark.parametrize("name", ["no-such-model", "HuggingFaceTB/SmolLM2-135M-Instruct", "/no/such/dir"])
def test_unknown_model_fails_fast(name):
    start = time.perf_counter()
    with pytest.raises(ModelNotFoundError, match="cannot load model") as info:
        LLM(name)
    assert isinstance(info.value, ValueError)
    assert time.perf_counter() - start < 5.0
    if "/" in name and not name.startswith("/"):
        assert "hub id" in str(info.value)


def test_preset_without_tokenizer_runs_on_token_ids():
    mp = pytest.MonkeyPatch()
    mc.patch_engine(mp)
    try:
        # on the CPU, where the oracle is: a preset's random weights are drawn on the device it loads to
        llm = LLM("tiny-llama", num_kv_blocks=64, block_size=4, device="cpu")
    finally:
        mp.undo()
    assert llm.get_tokenizer() is None
    (out,) = llm.generate([[5, 6, 7, 8]], greedy(6), use_tqdm=False)
    assert out.outputs[0].token_ids == mc.hf_greedy(mc.loaded("tiny-llama").model, [5, 6, 7, 8], 6)
    assert out.outputs[0].text == ""
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate("text needs a tokenizer", use_tqdm=False)
    with pytest.raises(ValueError, match="tokenizer"):
        llm.chat(FRANCE, use_tqdm=False)


def test_library_refuses_max_tokens_past_the_context_as_the_server_does(llm):
    """The server's context rule: prompt + max_tokens within max_model_len, else ValueError at once (not a
    request that runs for hours)."""
    start = time.perf_counter()
    with pytest.raises(ValueError, match="maximum context length is 1024 tokens") as info:
        llm.generate(TEXTS[0], SamplingParams(max_tokens=10**9), use_tqdm=False)
    assert time.perf_counter() - start < 1.0
    assert "in the completion" in str(info.value)
    assert not llm.engine.has_unfinished_requests()


def test_bad_arguments_name_the_argument(llm):
    with pytest.raises(ValueError, match="prompts must be"):
        llm.generate(None, use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompts\[1\] must be"):
        llm.generate([TEXTS[0], None], use_tqdm=False)
    with pytest.raises(ValueError, match="messages.0.content"):
        llm.chat([{"role": "user", "content": None}], use_tqdm=False)
    with pytest.raises(ValueError, match="messages.1.role"):
        llm.chat([{"role": "user", "content": "hi"}, {"content": "no role"}], use_tqdm=False)
    with pytest.raises(ValueError, match="messages must be"):
        llm.chat(None, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("path", ["/no/such/checkpoint", "/tmp/no-such-org/model", "./no/such/dir"])
def test_missing_path_is_called_a_missing_path(path):
    with pytest.raises(ModelNotFoundError, match="no such file or directory") as info:
        LLM(path)
    assert "hub id" not in str(info.value)


def test_sampling_defaults_come_from_the_generation_config(tmp_path):
    """vLLM's --generation-config auto: a checkpoint's generation_config.json sets the defaults of
    generate() without sampling params; "vllm" ignores it."""
    from transformers import GenerationConfig

    mc.loaded("tiny-llama").model.save_pretrained(tmp_path, safe_serialization=True)
    GenerationConfig(max_new_tokens=3, top_k=1, temperature=0.5, do_sample=True).save_pretrained(tmp_path)
    mp = pytest.MonkeyPatch()
    mc.patch_engine(mp)
    try:
        llm = LLM(str(tmp_path), num_kv_blocks=64, block_size=4)
        plain = LLM(str(tmp_path), num_kv_blocks=64, block_size=4, generation_config="vllm")
    finally:
        mp.undo()
    p = llm.get_default_sampling_params()
    assert (p.max_tokens, p.top_k, p.temperature) == (3, 1, 0.5)
    (out,) = llm.generate([[5, 6, 7]], use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3 and out.outputs[0].finish_reason in ("length", "stop")
    assert plain.get_default_sampling_params() == SamplingParams()
