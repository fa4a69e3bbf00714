"""A real `mini-infer serve` process on a free loopback port, for the HTTP tests.

`ServerProcess.start(...)` launches `python -m mini_infer.cli serve ...` with its output in a log file, and
`wait_ready()` polls GET /health (bounded) until 200, recording every status it saw on the way; on timeout
or early exit the log tail is in the error. `stop()` terminates the process (kill after a grace period).
Each test module starts one server (module-scoped fixture) and reuses it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tests._gpu_memory import release_for_child_processes


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, args: list[str], api_key: str | None = None, threads: int | None = 1) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log_path = Path(tempfile.mkstemp(prefix="mini-infer-serve-", suffix=".log")[1])
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        cmd = [sys.executable, "-m", "mini_infer.cli", "serve", *args, "--host", "127.0.0.1",
               "--port", str(self.port)]
        if api_key:
            cmd += ["--api-key", api_key]
        env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
        if threads is not None:
            # The test process and the server share the machine; on a small, busy one, torch's thread
            # pool oversubscribes the cores and CPU matmuls run ~10x slower than with one thread.
            env["OMP_NUM_THREADS"] = str(threads)
        release_for_child_processes()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     stdin=subprocess.DEVNULL)
        self.health_statuses: list[int] = []
        self.health_bodies: list[dict] = []

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log_tail(self, n: int = 4000) -> str:
        self._log.flush()
        return self.log_path.read_bytes()[-n:].decode(errors="replace")

    def wait_ready(self, timeout: float = 300.0) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                r = httpx.get(f"{self.url}/health", timeout=5)
            except httpx.HTTPError:
                time.sleep(0.5)
                continue
            self.health_statuses.append(r.status_code)
            if r.status_code != 200:
                self.health_bodies.append(r.json())
            if r.status_code == 200:
                return self
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"server not healthy after {timeout:.0f}s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
        self._log.close()
