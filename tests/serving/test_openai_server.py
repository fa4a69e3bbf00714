"""The official `openai` client (sync and async, streaming and not), 50 concurrent streams, cancellation, and
lm-evaluation-harness's loglikelihood requests, against a real server of the embedded SmolLM2-135M-Instruct.

The module starts the server process first and, while it compiles, builds the in-process reference `LLM`
(same model, same options, float32, but the server schedules asynchronously, as it does by default on a GPU, and
the reference does not): greedy text through HTTP must equal `LLM.generate` / `LLM.chat`, and prompt logprobs must
equal log_softmax of the HF model's logits.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import shutil
import subprocess
import time

import httpx
import openai
import pytest
import torch

from mini_infer.llm import LLM
from mini_infer.sampling_params import SamplingParams
from tests import _model_cache as mc
from tests.serving.conftest import ServerProcess

MAX_LEN = 512
KV_BYTES = 160_000_000
NAME = "SmolLM2-135M-Instruct"
# float32 everywhere, so that prompt logprobs meet the fp32 HF oracle to 1e-3 on a GPU too (where "auto" is bf16: up
# to 0.22 nats apart on an H200); on a CPU "auto" is float32 already, and naming it would compile the model again
DTYPE = "float32" if torch.cuda.is_available() else "auto"
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def stack():
    srv = ServerProcess(["--async-scheduling", "--dtype", "float32", "--max-model-len", str(MAX_LEN),
                         "--kv-cache-memory-bytes", str(KV_BYTES)])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # share the cores with the server fairly (see ServerProcess)
    mp = pytest.MonkeyPatch()
    mc.patch_engine(mp)  # the reference LLM: the model loaded and compiled once per test process
    try:
        llm = LLM(max_model_len=MAX_LEN, kv_cache_memory_bytes=KV_BYTES, dtype=DTYPE)
        srv.wait_ready(timeout=300)
        yield srv, llm
    finally:
        mp.undo()
        torch.set_num_threads(threads)
        srv.stop()


@pytest.fixture(scope="module")
def server(stack):
    return stack[0]


@pytest.fixture(scope="module")
def llm(stack):
    return stack[1]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def metrics(server) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})? ([0-9.eE+-]+|NaN)$", line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def gauge(server, name: str) -> float:
    return metrics(server)[f'{name}{{model_name="{NAME}"}}']


# ------------------------------------------------------------------------------------ openai client
def test_completion_greedy_matches_llm_generate(client, llm):
    prompt = "The capital of France is"
    expected = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0)
    assert r.choices[0].text == expected.outputs[0].text
    assert r.choices[0].finish_reason == expected.outputs[0].finish_reason
    assert r.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert r.usage.completion_tokens == len(expected.outputs[0].token_ids)
    # streaming, sync client: the deltas add up to the same text
    chunks = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.outputs[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [r.choices[0].finish_reason]


def test_chat_through_template_sync_and_async_stream(client, server, llm):
    expected = llm.chat(FRANCE, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0].outputs[0].text
    r = client.chat.completions.create(model=NAME, messages=FRANCE, temperature=0, max_completion_tokens=24)
    text = r.choices[0].message.content
    assert "Paris" in text and text == expected
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason == "stop"
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    async def stream():
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        async with aclient:
            s = await aclient.chat.completions.create(
                model=NAME, messages=[{"role": "user", "content": [{"type": "text", "text": FRANCE[0]["content"]}]}],
                temperature=0, max_tokens=24, stream=True, stream_options={"include_usage": True})
            return [c async for c in s]

    chunks = asyncio.run(stream())
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c.choices[0].delta.content for c in chunks[1:] if c.choices and c.choices[0].delta.content]
    assert "".join(content) == text
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == "stop"
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_chat_n_logprobs_stop(client):
    r = client.chat.completions.create(model=NAME, messages=FRANCE, n=2, temperature=0.8, seed=3, max_tokens=6,
                                       logprobs=True, top_logprobs=3)
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        assert len(c.logprobs.content) >= 1
        for t in c.logprobs.content:
            assert len(t.top_logprobs) == 3 and t.logprob <= 0
            assert t.top_logprobs[0].logprob >= t.top_logprobs[-1].logprob
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)
    r = client.completions.create(model=NAME, prompt="One, two, three,", max_tokens=20, temperature=0, stop=[","])
    assert "," not in r.choices[0].text and r.choices[0].finish_reason == "stop"


def test_tokenize_detokenize_tokenizer_info(server, llm):
    tok = llm.get_tokenizer()
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello world"}).json()
    assert r["tokens"] == tok.encode("Hello world") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == MAX_LEN
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": FRANCE}).json()
    assert chat["tokens"] == list(tok.apply_chat_template(FRANCE, add_generation_prompt=True, tokenize=True,
                                                          return_dict=False))
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "Hello world"}
    info = httpx.get(f"{server.url}/tokenizer_info").json()
    assert info["eos_token"] == tok.eos_token and "im_start" in info["chat_template"]


# ------------------------------------------------------------------------------------ lm-evaluation-harness
def _reference_logprobs(llm, ids: list[int]) -> torch.Tensor:
    model = mc.loaded(None).model  # the HF model the engine compiled (the per-process cache keeps it)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_lm_eval_loglikelihood_request(server, llm, max_tokens):
    """Exactly what lm-eval's `local-completions` sends for loglikelihood (0.4.x sends max_tokens=1 and
    drops the last position; older clients send 0), and the fields its `parse_logprobs` reads."""
    tok = llm.get_tokenizer()
    prompts = [tok.encode("Question: What is the capital of France?\nAnswer: Paris"),
               tok.encode("The quick brown fox jumps over the lazy dog")]
    payload = {"model": NAME, "prompt": prompts, "temperature": 0, "max_tokens": max_tokens, "logprobs": 1,
               "seed": 1234, "echo": True}
    r = httpx.post(f"{server.url}/v1/completions", json=payload, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    choices = sorted(out["choices"], key=lambda c: c["index"])
    assert len(choices) == 2
    for ids, choice in zip(prompts, choices):
        lp = choice["logprobs"]
        n = len(ids) + max_tokens
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n
        assert len(lp["text_offset"]) == n
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert "".join(lp["tokens"][:len(ids)]) == tok.decode(ids)
        ref = _reference_logprobs(llm, ids)
        expected = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        got = torch.tensor(lp["token_logprobs"][1:len(ids)])
        torch.testing.assert_close(got, expected, atol=1e-3, rtol=0)
        for j in range(1, len(ids)):  # top-1 of each position, and the token itself
            top = lp["top_logprobs"][j]
            assert abs(max(top.values()) - ref[j - 1].max().item()) < 1e-3
            assert lp["token_logprobs"][j] in top.values()
        if max_tokens == 0:
            assert choice["text"] == tok.decode(ids)
    assert out["usage"]["completion_tokens"] == max_tokens * 2
    try:
        from lm_eval.models.openai_completions import LocalCompletionsAPI
    except Exception:  # noqa: BLE001 - lm-eval is optional
        return
    if max_tokens == 1:  # lm-eval's own parser on our response: context of 3 tokens, continuation the rest
        parsed = LocalCompletionsAPI.parse_logprobs(out, ctxlens=[3, 3])
        assert len(parsed) == 2 and all(isinstance(s, float) and isinstance(g, bool) for s, g in parsed)


TASK_YAML = """\
task: mini_capitals
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: What is the capital of {{{{country}}}}?\\nAnswer:"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
metadata:
  version: 1.0
"""
CAPITALS = [("France", [" Paris", " Berlin", " Madrid", " Rome"], 0),
            ("Germany", [" Rome", " Berlin", " Lisbon", " Paris"], 1),
            ("Italy", [" Madrid", " Vienna", " Rome", " Oslo"], 2),
            ("Japan", [" Beijing", " Seoul", " Bangkok", " Tokyo"], 3)]


@pytest.mark.skipif(shutil.which("lm_eval") is None, reason="lm-evaluation-harness (lm_eval) not installed")
def test_lm_eval_harness_end_to_end(server, tmp_path):
    """lm_eval's local-completions against the server, on a 4-question task whose data is a local file (no
    hub), with the server's tokenizer (/tokenizer_info, /tokenize)."""
    data = tmp_path / "capitals.jsonl"
    data.write_text("".join(json.dumps({"country": c, "choices": ch, "answer": a}) + "\n" for c, ch, a in CAPITALS))
    (tmp_path / "mini_capitals.yaml").write_text(TASK_YAML.format(data=data))
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"),
               OMP_NUM_THREADS="1")
    cmd = [shutil.which("lm_eval"), "--model", "local-completions", "--model_args",
           f"model={NAME},base_url={server.url}/v1/completions,tokenizer_backend=remote,max_length={MAX_LEN},"
           "num_concurrent=4,max_retries=1", "--batch_size", "4", "--tasks", "mini_capitals", "--include_path",
           str(tmp_path), "--output_path", str(tmp_path / "out")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    results = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())["results"]
    assert results["mini_capitals"]["acc,none"] >= 0.75  # the real model knows these capitals


# ------------------------------------------------------------------------------------ load and cancellation
def test_fifty_concurrent_streams(server):
    async def one(aclient, i):
        stream = await aclient.completions.create(
            model=NAME, prompt=f"Count to {i}:", max_tokens=4, temperature=0.7, seed=i, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        chunks = [c async for c in stream]
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        return chunks[-1].usage, finish

    async def main():
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=240,
                                     http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=64),
                                                                   timeout=240))
        async with aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(50)))

    results = asyncio.run(main())
    assert len(results) == 50
    for usage, finish in results:
        assert usage.completion_tokens == 4 and usage.prompt_tokens > 0
        assert finish == ["length"]


def test_cancelled_requests_free_the_kv_cache(server, client):
    long = {"model": NAME, "prompt": "Write a very long story about a dragon.", "max_tokens": 490,
            "ignore_eos": True, "temperature": 1.0, "seed": 0}

    async def stream_then_leave(c, i):
        async with c.stream("POST", "/v1/completions", json={**long, "stream": True, "seed": i}) as r:
            assert r.status_code == 200
            seen = 0
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    seen += 1
                    if seen == 2:
                        return seen  # leaving the block closes the connection mid-stream
        return seen

    async def post_then_leave(c):  # non-streaming: the client times out and disconnects (before the ~0.7 s that
        # the 490 tokens take on an H200)
        with pytest.raises(httpx.ReadTimeout):
            await c.post("/v1/completions", json=long, timeout=httpx.Timeout(120, read=0.25))

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as c:
            got = await asyncio.gather(*(stream_then_leave(c, i) for i in range(6)), post_then_leave(c))
        assert got[:6] == [2] * 6

    asyncio.run(main())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        usage, running = gauge(server, "mini_infer:kv_cache_usage_perc"), gauge(server, "mini_infer:num_requests_running")
        if usage == 0 and running == 0:
            break
        time.sleep(0.25)
    assert (usage, running) == (0, 0), (usage, running)
    m = metrics(server)
    assert m[f'mini_infer:request_success_total{{finished_reason="abort",model_name="{NAME}"}}'] >= 7
    # still serving
    r = client.completions.create(model=NAME, prompt="Hi", max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2


def test_metrics_exposition(server, client):
    client.completions.create(model=NAME, prompt="Hello", max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    m = metrics(server)
    names = {k.split("{")[0] for k in m}
    for name in ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
                 "time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                 "e2e_request_latency_seconds_count", "request_success_total"]:
        assert f"mini_infer:{name}" in names, name
    assert m[f'mini_infer:generation_tokens_total{{model_name="{NAME}"}}'] >= 3
    assert m[f'mini_infer:prompt_tokens_total{{model_name="{NAME}"}}'] >= 1
    assert m[f'mini_infer:time_to_first_token_seconds_count{{model_name="{NAME}"}}'] >= 1
    assert m[f'mini_infer:e2e_request_latency_seconds_count{{model_name="{NAME}"}}'] >= 1
    assert m[f'mini_infer:inter_token_latency_seconds_count{{model_name="{NAME}"}}'] >= 2
    assert m[f'mini_infer:request_success_total{{finished_reason="length",model_name="{NAME}"}}'] >= 1
    assert m[f'mini_infer:prefix_cache_queries_total{{model_name="{NAME}"}}'] > 0
    assert m[f'mini_infer:num_requests_waiting{{model_name="{NAME}"}}'] == 0


def test_openai_client_sees_errors(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=NAME, messages=FRANCE, max_completion_tokens=10**6)
    err = info.value.body
    assert err["code"] == "context_length_exceeded" and err["param"] == "max_completion_tokens"
    assert f"maximum context length is {MAX_LEN} tokens" in err["message"] and "in the messages" in err["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-5", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=NAME, messages=[])


# ------------------------------------------------------------------------------------ hostile input
def _on_one_connection(server, requests: list[tuple[str, bytes]]) -> list[tuple[int, dict]]:
    """POST each (path, raw JSON body) in turn on ONE keep-alive connection; (status, body) of each. Fails if the
    server closed the connection on the way."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    results, local = [], None
    for path, body in requests:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        results.append((resp.status, json.loads(data) if data.startswith(b"{") else data.decode()))
        port = conn.sock.getsockname()[1] if conn.sock is not None else None
        assert port is not None and local in (None, port), f"the connection was closed after {path} {body!r}"
        local = port
    conn.close()
    return results


def test_lone_surrogates_are_400_and_the_connection_lives_on(server):
    bad = [("/v1/completions", rb'{"prompt": "\ud800", "max_tokens": 2}', "prompt"),
           ("/v1/completions", rb'{"prompt": ["fine", "x\udc00"], "max_tokens": 2}', "prompt.1"),
           ("/v1/completions", rb'{"prompt": "\ud800", "max_tokens": 2, "stream": true}', "prompt"),
           ("/v1/completions", b'{"prompt": "\xed\xa0\x80", "max_tokens": 2}', "prompt"),  # raw, not escaped
           ("/v1/completions", rb'{"model": "\ud800", "prompt": "hi", "max_tokens": 2}', "model"),
           ("/v1/completions", rb'{"prompt": "hi", "max_tokens": 2, "stop": ["\udfff"]}', "stop.0"),
           ("/tokenize", rb'{"prompt": "a\ud800b"}', "prompt"),
           ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": "\ud800"}], "max_tokens": 2}',
            "messages.0.content")]
    good = [("/v1/completions", rb'{"prompt": "smile \ud83d\ude00", "max_tokens": 2}'),  # a valid pair
            ("/tokenize", b'{"prompt": "hello"}')]
    results = _on_one_connection(server, [(p, b) for p, b, _ in bad] + good)
    for (path, body, param), (status, err) in zip(bad, results):
        assert status == 400, (path, body, status, err)
        assert err["error"]["param"] == param and err["error"]["code"] == "invalid_unicode", err
    assert [status for status, _ in results[len(bad):]] == [200, 200]
    assert "Traceback" not in server.log_tail(200_000)


def test_stop_string_over_the_limit_names_stop(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=NAME, prompt="hi", max_tokens=2, stop=["x" * 1025])
    assert info.value.body["param"] == "stop" and "1024" in info.value.body["message"]
