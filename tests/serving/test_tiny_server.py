"""Error handling of a real server over HTTP: every bad input gets OpenAI's error body with the right status
(400/401/404/405/413/503), none gets a 500, and the engine keeps serving. Then schemathesis fuzzes the
whole OpenAPI schema looking for 5xx.

One `tiny-llama` server (random weights, no tokenizer: token-id prompts only, async scheduling as on a GPU) with
an API key, a 128-token context, at most 2 running sequences and 2 waiting ones (so overload is easy to reach),
and a 64 KiB body limit.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess

import httpx
import pytest

from tests.serving.conftest import ServerProcess

KEY = "test-key-123"
MAX_LEN = 128
BODY_LIMIT = 65536


@pytest.fixture(scope="module")
def server():
    # async scheduling, as on a GPU (its default there): outputs streamed while a step is in flight
    srv = ServerProcess(["tiny-llama", "--async-scheduling", "--max-model-len", str(MAX_LEN),
                         "--kv-cache-memory-bytes", "8000000",
                         "--max-num-seqs", "2", "--max-waiting-requests", "2",
                         "--max-request-body-bytes", str(BODY_LIMIT)], api_key=KEY)
    try:
        yield srv.wait_ready(timeout=240)
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as c:
        yield c


def assert_error(r: httpx.Response, status: int, param: str | None = "any", code: str | None = "any") -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    if param != "any":
        assert err["param"] == param, err
    if code != "any":
        assert err["code"] == code, err
    return err


def completion(client, **body):
    return client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4, **body})


# ------------------------------------------------------------------------------------ health and auth
def test_health_is_503_while_loading_then_200(server):
    assert server.health_statuses[-1] == 200
    assert 503 in server.health_statuses, server.health_statuses  # uvicorn listens before the engine is up
    err = server.health_bodies[0]["error"]
    assert "loading" in err["message"] and err["type"] == "service_unavailable"
    assert httpx.get(f"{server.url}/health").status_code == 200  # no key needed for /health


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                                     {"Authorization": f"Basic {KEY}"}])
@pytest.mark.parametrize("method,path", [("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/metrics"),
                                         ("GET", "/openapi.json"), ("POST", "/tokenize")])
def test_api_key_required_everywhere_but_health(server, headers, method, path):
    r = httpx.request(method, f"{server.url}{path}", headers=headers, json={"prompt": [1, 2]})
    assert_error(r, 401, code="invalid_api_key")
    assert r.headers["www-authenticate"] == "Bearer"


def test_models_version_with_key(client):
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny-llama"
    assert models["data"][0]["max_model_len"] == MAX_LEN
    assert client.get("/version").json()["version"]


# ------------------------------------------------------------------------------------ malformed requests
def test_invalid_json(client):
    r = client.post("/v1/completions", content=b'{"prompt": [1, 2', headers={"Content-Type": "application/json"})
    assert_error(r, 400, code="invalid_json")
    r = client.post("/v1/completions", content=b"[1, 2]", headers={"Content-Type": "application/json"})
    assert_error(r, 400)


def test_wrong_content_type(client):
    r = client.post("/v1/completions", content=json.dumps({"prompt": [1, 2]}),
                    headers={"Content-Type": "text/plain"})
    err = assert_error(r, 400, code="invalid_content_type")
    assert "application/json" in err["message"]


def test_body_too_large(client):
    big = json.dumps({"prompt": [1] * (BODY_LIMIT // 2)}).encode()
    assert len(big) > BODY_LIMIT
    err = assert_error(client.post("/v1/completions", content=big, headers={"Content-Type": "application/json"}),
                       413, code="request_too_large")
    assert str(BODY_LIMIT) in err["message"]

    def chunks():  # no Content-Length: the limit is enforced on the bytes actually read
        for i in range(0, len(big), 8192):
            yield big[i:i + 8192]

    r = client.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert "content-length" not in r.request.headers
    assert_error(r, 413, code="request_too_large")


def test_unknown_route_and_method(client):
    assert_error(client.get("/v1/nothing"), 404)
    assert_error(client.delete("/v1/completions"), 405)


def test_unknown_model_is_404(client):
    err = assert_error(completion(client, model="gpt-4o"), 404, param="model", code="model_not_found")
    assert "gpt-4o" in err["message"]
    r = client.post("/v1/chat/completions", json={"model": "nope", "messages": [{"role": "user", "content": "x"}]})
    assert_error(r, 404, param="model")


# ------------------------------------------------------------------------------------ bad values: all 400
@pytest.mark.parametrize("body,param", [
    ({"suffix": "tail"}, "suffix"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"n": 129}, "n"),
    ({"n": 2, "best_of": 3}, "best_of"),
    ({"logprobs": 21}, "logprobs"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_tokens": 10}, "min_tokens"),
    ({"stop_token_ids": [10**6]}, "stop_token_ids"),
    ({"seed": 2**70}, "seed"),
    ({"stop": "x"}, "stop"),  # no tokenizer: stop strings cannot work
    ({"logit_bias": {"5": 1.0}}, "logit_bias"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": [1, 2, 10**6]}, "prompt"),
    ({"prompt": [1, -2]}, "prompt"),
    ({"prompt": "text needs a tokenizer"}, "prompt"),
    ({"prompt": {"a": 1}}, "prompt"),
])
def test_bad_completion_values_are_400(client, body, param):
    assert_error(completion(client, **body), 400, param=param)


def test_context_length_message_gives_the_numbers(client):
    err = assert_error(completion(client, max_tokens=10**12), 400, param="max_tokens",
                       code="context_length_exceeded")
    assert f"maximum context length is {MAX_LEN} tokens" in err["message"]
    assert f"{10**12 + 3} tokens (3 in the prompt, {10**12} in the completion)" in err["message"]
    err = assert_error(completion(client, prompt=list(range(1, 201)), max_tokens=1), 400, param="prompt")
    assert "200 in the prompt" in err["message"]
    assert_error(completion(client, prompt=list(range(1, 120)), max_tokens=20), 400, param="max_tokens")


@pytest.mark.parametrize("messages,param", [
    ([], "messages"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]}],
     "messages.0.content.0"),
    ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "messages.0.content.0"),
    ([{"role": "user", "content": 123}], "messages.0.content"),
    ([{"role": "robot", "content": "hi"}], "messages.0.role"),
    ([{"role": "user", "content": "no tokenizer"}], "messages"),
])
def test_bad_chat_requests_are_400(client, messages, param):
    r = client.post("/v1/chat/completions", json={"messages": messages})
    assert_error(r, 400, param=param)


def test_chat_top_logprobs_needs_logprobs(client):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                  "top_logprobs": 2})
    assert_error(r, 400, param="top_logprobs")


def test_text_endpoints_without_tokenizer_are_400(client):
    assert_error(client.post("/tokenize", json={"prompt": "hello"}), 400, code="no_tokenizer")
    assert_error(client.post("/detokenize", json={"tokens": [1, 2]}), 400, code="no_tokenizer")
    assert_error(client.post("/tokenize", json={}), 400, param="prompt")
    assert_error(client.get("/tokenizer_info"), 400, code="no_tokenizer")


# ------------------------------------------------------------------------------------ what works
def test_token_id_completion_and_prompt_logprobs(client):
    r = completion(client, prompt=[[5, 6, 7], [8, 9]], max_tokens=0, echo=True, logprobs=1, temperature=0)
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    lp = body["choices"][0]["logprobs"]
    assert lp["tokens"] == ["token_id:5", "token_id:6", "token_id:7"]
    assert lp["token_logprobs"][0] is None and all(isinstance(x, float) for x in lp["token_logprobs"][1:])
    assert lp["top_logprobs"][0] is None and len(lp["top_logprobs"][1]) in (1, 2)
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 0, "total_tokens": 5}
    r = completion(client, max_tokens=5, n=2, ignore_eos=True, seed=1)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 10


def test_streaming_several_prompts_and_samples(client):
    """2 prompts x n=2, echo + logprobs: every choice index streams its tokens once and finishes once, and
    the streamed tokens equal the non-streaming response's."""
    body = {"prompt": [[5, 6, 7], [8, 9]], "n": 2, "max_tokens": 5, "echo": True, "logprobs": 2,
            "temperature": 0, "ignore_eos": True}
    full = client.post("/v1/completions", json=body).json()
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    tokens: dict[int, list[str]] = {}
    finishes: dict[int, list[str]] = {}
    for e in events[:-1]:
        chunk = json.loads(e)
        assert chunk["object"] == "text_completion" and chunk["id"] == json.loads(events[0])["id"]
        (c,) = chunk["choices"]
        tokens.setdefault(c["index"], []).extend(c["logprobs"]["tokens"])
        if c["finish_reason"]:
            finishes.setdefault(c["index"], []).append(c["finish_reason"])
    assert sorted(tokens) == [0, 1, 2, 3] and finishes == {i: ["length"] for i in range(4)}
    for choice in full["choices"]:
        assert tokens[choice["index"]] == choice["logprobs"]["tokens"]
        assert len(choice["logprobs"]["tokens"]) == (3 if choice["index"] < 2 else 2) + 5
    assert full["usage"] == {"prompt_tokens": 5, "completion_tokens": 20, "total_tokens": 25}


def test_overload_gives_503_with_retry_after(server):
    async def main():
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=120) as c:
            return await asyncio.gather(*(
                c.post("/v1/completions", json={"prompt": [1, 2, 3 + i], "max_tokens": 24, "ignore_eos": True})
                for i in range(16)))

    responses = asyncio.run(main())
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 503}, codes
    rejected = [r for r in responses if r.status_code == 503]
    assert rejected and 200 in codes, codes
    for r in rejected:
        assert_error(r, 503, code="overloaded")
        assert int(r.headers["retry-after"]) >= 1
    for r in responses:
        if r.status_code == 200:
            assert r.json()["usage"]["completion_tokens"] == 24


# ------------------------------------------------------------------------------------ fuzzing
@pytest.mark.skipif(shutil.which("schemathesis") is None, reason="schemathesis not installed")
def test_schemathesis_finds_no_server_error(server, client, tmp_path):
    schema = client.get("/openapi.json").json()
    # Bound the work per generated request (n up to 4, at most 16 tokens): the point is input handling.
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = schema["components"]["schemas"][name]["properties"]
        props["n"]["maximum"] = 4
        for key in ("max_tokens", "max_completion_tokens", "best_of"):
            if key in props:
                for variant in props[key].get("anyOf", [props[key]]):
                    if variant.get("type") == "integer":
                        variant["maximum"] = 16
    path = tmp_path / "openapi.json"
    path.write_text(json.dumps(schema))
    proc = subprocess.run(
        [shutil.which("schemathesis"), "run", str(path), "--url", server.url, "--checks", "not_a_server_error,status_code_conformance",
         "--max-examples", "10", "--seed", "1", "-H", f"Authorization: Bearer {KEY}", "--no-color"],
        capture_output=True, text=True, timeout=240)
    out = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, out
    assert "passed" in out


def test_still_serving_after_everything(client, server):
    assert client.get("/health").status_code == 200
    r = completion(client, max_tokens=3, ignore_eos=True)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert server.proc.poll() is None
    assert "Traceback" not in server.log_tail(200_000), server.log_tail()
