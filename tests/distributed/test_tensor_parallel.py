"""The tensor-parallel runtime end to end, on CPU with two gloo ranks (tiny presets, a few tokens).

* `LLM(..., tensor_parallel_size=2)` starts its second rank itself; greedy outputs equal TP=1's (prefill in
  chunks, decode, several sequences); a dead rank makes the next step raise `WorkerDiedError` within seconds
  and nothing is left running; a normal close stops the rank with exit code 0.
* `mini-infer serve -tp 2`: one request answers what TP=1 answers; when rank 1 is killed, /health and requests
  get 503 within seconds instead of hanging, and stopping the server leaves no process behind; when rank 0 is
  killed, rank 1 exits by itself.
* torchrun: two "nodes" of one rank each, rendezvous over loopback (`--nnodes 2 --rdzv-backend c10d`), run
  `mini-infer generate -tp 2` and print TP=1's tokens.
"""

from __future__ import annotations

import gc
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import weakref
from types import SimpleNamespace

import httpx
import pytest

from mini_infer.llm import LLM
from mini_infer.runtime.distributed import WorkerDiedError
from tests.distributed.helpers import (
    LLM_OPTIONS,
    PROMPTS,
    ROOT,
    alive,
    cli_env,
    descendants,
    greedy_tokens,
    spawned_ranks,
    wait_until,
)
from tests.serving.conftest import ServerProcess, free_port

MAX_TOKENS = 6  # greedy_tokens' default


@pytest.fixture(scope="module")
def tp1_tokens():
    return greedy_tokens(LLM("tiny-qwen3", **LLM_OPTIONS))


def test_llm_greedy_equals_tp1_then_a_dead_rank_fails_fast(tp1_tokens):
    llm = LLM("tiny-qwen3", tensor_parallel_size=2, **LLM_OPTIONS)
    try:
        (worker,) = llm.engine.parallel.workers
        assert worker.pid in descendants(os.getpid())
        assert greedy_tokens(llm) == tp1_tokens
        os.kill(worker.pid, signal.SIGKILL)
        took = wait_until(lambda: llm.engine.failure is not None, 5, "the engine notices the dead rank")
        assert took < 5
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match="rank 1 .* exited with code -9"):
            greedy_tokens(llm)
        assert time.monotonic() - start < 5
        assert not alive(worker.pid)
    finally:
        llm.engine.close()


def test_close_stops_the_ranks_and_frees_the_engine(tp1_tokens):
    """A closed engine is freed once the caller drops it: nothing (the exit hook, the group state) keeps its
    compiled model, and so its weights and CUDA graphs, alive."""
    llm = LLM("tiny-qwen3", tensor_parallel_size=2, **LLM_OPTIONS)
    (worker,) = llm.engine.parallel.workers
    assert greedy_tokens(llm)[:1] == tp1_tokens[:1]
    # what `attach` keeps on a GPU (none here): the CUDA-graph runner, which holds the compiled model and the KV cache
    llm.engine.parallel._graphs = SimpleNamespace(graphs={}, compiled=llm.engine.compiled)
    refs = [weakref.ref(x) for x in (llm.engine, llm.engine.parallel, llm.engine.compiled.graph_module)]
    llm.engine.close()
    assert worker.exitcode == 0
    del llm
    gc.collect()
    assert [r() is None for r in refs] == [True, True, True]


def _tokens(r: httpx.Response) -> list[int]:
    assert r.status_code == 200, r.text
    return [int(t.removeprefix("token_id:")) for t in r.json()["choices"][0]["logprobs"]["tokens"]]


def _complete(url: str, prompt: list[int]) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=30, json={
        "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 0, "ignore_eos": True})


def test_server_answers_then_503_when_a_rank_dies(tp1_tokens):
    srv = ServerProcess(["tiny-qwen3", "--device", "cpu", "-tp", "2", "--max-num-seqs", "4"])
    try:
        srv.wait_ready(timeout=240)
        assert _tokens(_complete(srv.url, PROMPTS[0])) == tp1_tokens[0]
        (rank1,) = spawned_ranks(srv.proc.pid)
        children = descendants(srv.proc.pid)
        os.kill(rank1, signal.SIGKILL)
        took = wait_until(lambda: httpx.get(f"{srv.url}/health", timeout=5).status_code == 503, 5,
                          "health turns 503")
        assert took < 5
        r = _complete(srv.url, PROMPTS[0])
        assert r.status_code == 503 and "rank 1" in r.json()["error"]["message"], r.text
    finally:
        srv.stop()
    assert srv.proc.returncode is not None
    wait_until(lambda: not any(alive(p) for p in children), 5, "every process of the server exits")


def test_rank1_exits_when_rank0_is_killed():
    srv = ServerProcess(["tiny-llama", "--device", "cpu", "-tp", "2", "--max-num-seqs", "2"])
    try:
        srv.wait_ready(timeout=240)
        (rank1,) = spawned_ranks(srv.proc.pid)
        srv.proc.kill()
        wait_until(lambda: not alive(rank1), 5, "rank 1 exits after rank 0 was killed")
        assert "mini-infer tensor-parallel rank 1: " in srv.log_tail(), srv.log_tail()  # and says why
    finally:
        srv.stop()
        if alive(rank1):  # do not leave it behind even when the test fails
            os.kill(rank1, signal.SIGKILL)


@pytest.mark.skipif(shutil.which("torchrun") is None and not os.path.exists(os.path.join(
    os.path.dirname(sys.executable), "torchrun")), reason="torchrun is not installed")
def test_torchrun_two_nodes_over_loopback(tp1_tokens):
    torchrun = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
    port = free_port()
    args = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
            f"127.0.0.1:{port}", "--rdzv-id", "mini-infer-test", "-m", "mini_infer.cli", "generate", "--model", "tiny-qwen3",
            "-tp", "2", "--device", "cpu", "--max-tokens", str(MAX_TOKENS), "--ignore-eos",
            "--prompt-token-ids", ",".join(map(str, PROMPTS[0]))]
    nodes = [subprocess.Popen([torchrun, "--node-rank", str(i), *args], cwd=ROOT, env=cli_env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              stdin=subprocess.DEVNULL) for i in range(2)]
    try:
        outs = [n.communicate(timeout=300)[0] for n in nodes]
    finally:
        for n in nodes:
            if n.poll() is None:
                n.kill()
    assert [n.returncode for n in nodes] == [0, 0], outs
    # rank 0 (whichever node the rendezvous made it) prints the tokens; torch's own log lines also start with "[",
    # e.g. "[W1124 ... TCPStore.cpp:115] ... recvVector failed" when the rendezvous store closes under load
    printed = [line for out in outs for line in out.splitlines() if re.fullmatch(r"\[[\d, ]*\]", line)]
    assert printed == [str(tp1_tokens[0])], outs

