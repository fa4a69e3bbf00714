"""A real `mini-infer serve` process from start to exit: a busy port and a broken model are one line and status
2 before anything claims to serve; SIGINT / SIGTERM while the model loads exit at once with status 0 (no abort);
slow clients (nothing sent, half the headers, a body shorter than its Content-Length) are disconnected after
--request-read-timeout; and on SIGTERM the requests in flight get --shutdown-timeout seconds, then open streams
end with an error event and [DONE], new connections are refused, the log has no traceback, status 0.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.serving.conftest import ServerProcess, free_port


def _serve_once(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "mini_infer.cli", "serve", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, stdin=subprocess.DEVNULL)


def test_busy_port_is_one_line_before_serving():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = _serve_once(["tiny-llama", "--port", str(port)])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "serving" not in proc.stdout
    (line,) = proc.stderr.strip().splitlines()
    assert f"cannot listen on 127.0.0.1:{port}" in line and "in use" in line


def test_broken_model_is_one_line_before_serving(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                                      "hidden_size": 64, "num_attention_heads": 4,
                                                      "num_hidden_layers": 2, "vocab_size": 512}))
    proc = _serve_once([str(tmp_path), "--port", str(free_port())])
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "serving" not in proc.stdout and "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("mini-infer serve: error: ") and "no weights" in line


# The SmolLM2-shaped preset compiles for many seconds: a signal lands inside torch's compile (where an interrupted
# interpreter used to abort: "terminate called without an active exception", status -6); SIGTERM used to end
# the process with its own status (-15).
@pytest.mark.parametrize("sig, args", [(signal.SIGINT, ["--dry-run"]), (signal.SIGTERM, ["tiny-llama"])],
                         ids=["SIGINT", "SIGTERM"])
def test_signal_while_loading_exits_cleanly(sig, args):
    srv = ServerProcess(args)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:  # listening, the model still loading
            assert srv.proc.poll() is None, srv.log_tail()
            try:
                r = httpx.get(f"{srv.url}/health", timeout=5)
            except httpx.HTTPError:
                time.sleep(0.2)
                continue
            assert r.status_code == 503, "loaded before the signal could be sent"
            break
        time.sleep(1.0)
        srv.proc.send_signal(sig)
        assert srv.proc.wait(timeout=60) == 0, srv.log_tail()
        log = srv.log_tail(100_000)
        assert "terminate called" not in log and "Traceback" not in log, log
        assert "stopped while loading" in log
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(["tiny-llama", "--max-model-len", "1024", "--shutdown-timeout", "0.5",
                         "--request-read-timeout", "1"])
    try:
        yield srv.wait_ready(timeout=240)
    finally:
        srv.stop()


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n",
                                  b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                  b"Content-Length: 100\r\n\r\n{\"prompt\": [1, 2"],
                         ids=["nothing", "partial headers", "short body"])
def test_slow_clients_are_disconnected(server, sent):
    with socket.create_connection(("127.0.0.1", server.port)) as c:
        c.sendall(sent)
        c.settimeout(15)
        start = time.monotonic()
        assert c.recv(1024) == b""  # closed by the server, with nothing to say
        assert 0.5 < time.monotonic() - start < 10
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def _stream(url: str, body: dict, events: list, first: threading.Event) -> None:
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    first.set()
    except httpx.HTTPError as exc:  # a cut connection: what the drain must not do
        events.append(f"cut: {exc!r}")
    first.set()


def test_sigterm_drains_then_ends_streams(server):
    """Runs last in this module: it stops the module's server."""
    body = {"prompt": [1, 2, 3], "ignore_eos": True, "logprobs": 0, "temperature": 0}
    longs = [([], threading.Event()) for _ in range(3)]
    threads = [threading.Thread(target=_stream, args=(server.url, {**body, "max_tokens": 1000}, ev, first))
               for ev, first in longs]
    short, short_first = [], threading.Event()
    threads.append(threading.Thread(target=_stream, args=(server.url, {**body, "max_tokens": 20}, short,
                                                          short_first)))
    for t in threads:
        t.start()
    for _, first in [*longs, (short, short_first)]:
        assert first.wait(60)
    server.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # new connections are refused once the signal is handled
        try:
            httpx.get(f"{server.url}/health", timeout=5)
        except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
            # refused, or reset: a connection the kernel had queued as the listening socket closed
            break
        time.sleep(0.05)
    else:
        raise AssertionError("still accepting connections 10 s after SIGTERM")
    for t in threads:
        t.join(60)
    assert server.proc.wait(timeout=60) == 0, server.log_tail()
    assert short[-1] == "[DONE]" and json.loads(short[-2])["choices"][0]["finish_reason"] == "length", short[-3:]
    for events, _ in longs:
        assert events[-1] == "[DONE]", events[-3:]
        err = json.loads(events[-2])["error"]
        assert "shutting down" in err["message"] and err["code"] == "aborted", err
        assert len(events) > 2  # tokens had streamed before the end
    log = server.log_tail(100_000)
    assert "Traceback" not in log and "ASGI" not in log, log
    assert "ending 3 request(s) still running" in log and len(log.strip().splitlines()) <= 6, log
