"""The README's examples, run as written.

Every fenced block of README.md is marked (`<!-- example: KIND ... -->` just before it): `cpu` blocks run here
— shell lines through the `mini-infer` entry point (`mini_infer.cli.main`, what the console script calls),
Python blocks with `exec` — in a scratch directory; `gpu` blocks need a GPU and are run by
`python bench/gpu_check.py --readme` (both read the blocks through bench/readme_examples.py); `setup` blocks
install or run the suite (their `mini-infer` line runs here); `output` is printed output and `network` needs the
hub. Models load and compile once per test process (tests/_model_cache.py):
the commands and code are the README's, only the compile is shared.
"""

from __future__ import annotations

import re
import shlex
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

import mini_infer.serving.launcher as launcher
from bench.readme_examples import README, blocks, commands, gpu_commands
from mini_infer.cli import main
from tests import _model_cache as mc

KINDS = {"cpu", "gpu", "setup", "output", "network"}


def test_every_block_is_marked():
    found = blocks()
    assert len(found) == README.read_text().count("```") // 2
    unmarked = [line for line, kind, *_ in found if kind not in KINDS]
    assert not unmarked, f"README blocks without an <!-- example: {'|'.join(sorted(KINDS))} --> mark: lines {unmarked}"
    assert ["mini-infer", "generate", "--model", "qwen2.5-7b", "--dry-run", "hi"] in gpu_commands()


@pytest.fixture
def scratch(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    mc.patch_engine(monkeypatch)
    return tmp_path


def _run_cli(argv: list[str]) -> None:
    assert argv[0] == "mini-infer", argv
    assert main(argv[1:]) == 0, argv


STANDALONE = [(line, lang, code) for line, kind, note, lang, code in blocks()
              if kind == "cpu" and "serve" not in code and "client" not in note]


@pytest.mark.parametrize("line, lang, code", STANDALONE, ids=[f"line{b[0]}" for b in STANDALONE])
def test_cpu_example(scratch, capsys, line, lang, code):
    if lang == "python":
        exec(compile(code, f"README.md:{line}", "exec"), {"__name__": "__readme__"})
    else:
        for argv in commands(code):
            _run_cli(argv)
    out = capsys.readouterr().out
    assert out.strip(), f"README.md:{line} printed nothing"
    if "dump-graph" in code:
        assert (scratch / "dumps" / "summary.txt").is_file()
    if "--prompt-token-ids" in code:
        assert re.fullmatch(r"\[(\d+, ){7}\d+\]", out.strip().splitlines()[-1])


def test_setup_block_generate_line(scratch, capsys):
    (code,) = [code for _, kind, _, _, code in blocks() if kind == "setup" and "mini-infer generate" in code]
    command, expected = code.split("&&", 1)[1].split("# →")
    argv = shlex.split(command)
    argv[0] = Path(argv[0]).name  # .venv/bin/mini-infer: the same entry point
    _run_cli(argv)
    assert capsys.readouterr().out.strip() == expected.strip()


class _Recorded(launcher.GracefulServer):
    instances: list = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _Recorded.instances.append(self)


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class _Serving:
    """`mini-infer serve ...` (argv as written) in a thread of this process, until stop()."""

    def __init__(self, argv: list[str]) -> None:
        self.port = int(argv[argv.index("--port") + 1]) if "--port" in argv else 8000
        self.status: list[int] = []
        self.thread = threading.Thread(target=lambda: self.status.append(main(argv[1:])), daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert self.thread.is_alive(), f"{shlex.join(argv)} exited with {self.status}"
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"{shlex.join(argv)} not healthy")

    def stop(self) -> None:
        _Recorded.instances[-1].should_exit = True
        self.thread.join(60)
        assert self.status == [0]


SERVING = [b for b in blocks() if b[1] == "cpu" and ("serve" in b[4] or "client" in b[2])]


def test_server_examples(scratch, monkeypatch, capsys):
    monkeypatch.setattr(launcher, "GracefulServer", _Recorded)
    for port in {8000, *(int(a[a.index("--port") + 1]) for *_, c in SERVING for a in commands(c) if "--port" in a)}:
        if not _port_free(port):
            pytest.skip(f"port {port} (the README's) is in use on this machine")
    running = None
    for line, _, note, lang, code in SERVING:
        if lang == "python":  # the client of the server started by the block before it
            assert running is not None, f"README.md:{line}: no server runs for this client"
            exec(compile(code, f"README.md:{line}", "exec"), {"__name__": "__readme__"})
            assert "Paris" in capsys.readouterr().out
            running.stop()
            running = None
            continue
        (argv,) = commands(code)
        running = _Serving(argv)
        if "serves the client" in note:
            continue
        url = f"http://127.0.0.1:{running.port}"
        if "--api-key" in argv:
            key = argv[argv.index("--api-key") + 1]
            assert httpx.get(f"{url}/v1/models", timeout=10).status_code == 401
            models = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10)
            assert models.status_code == 200 and models.json()["data"][0]["max_model_len"] == 1024
        running.stop()
        running = None
    assert running is None
