"""The `mini-infer` command: generate (default model and prompt), dump-graph, errors, the console script."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mini_infer.cli import main
from tests import _model_cache as mc

ANSWER = "The capital of France is Paris."


def test_generate_default_model_and_prompt(monkeypatch, capsys):
    mc.patch_engine(monkeypatch)  # same code path, the model compiled once per test process
    assert main(["generate", "--max-model-len", "1024", "--kv-cache-memory-bytes", str(64 << 20)]) == 0
    out = capsys.readouterr().out
    assert out.strip().splitlines() == [ANSWER]


def test_generate_several_prompts_no_chat(monkeypatch, capsys):
    mc.patch_engine(monkeypatch)
    rc = main(["generate", "The capital of France is", "1, 2, 3,", "--no-chat", "--max-tokens", "4",
               "--max-model-len", "1024", "--kv-cache-memory-bytes", str(64 << 20)])
    assert rc == 0
    lines = capsys.readouterr().out.splitlines()
    headers = [line for line in lines if line.startswith("--- ")]
    assert headers == ["--- 'The capital of France is' [0] (length)", "--- '1, 2, 3,' [0] (length)"]
    assert lines[0] == headers[0]


def test_dump_graph_writes_dumps_and_summary(tmp_path, capsys):
    out_dir = tmp_path / "dumps"
    assert main(["dump-graph", "tiny-llama", "--out", str(out_dir), "--passes", "cleanup,fuse_rmsnorm"]) == 0
    names = sorted(p.name for p in out_dir.iterdir())
    assert names == ["00_captured.txt", "01_cleanup.after.txt", "01_cleanup.before.txt",
                     "02_fuse_rmsnorm.after.txt", "02_fuse_rmsnorm.before.txt", "summary.txt"]
    summary = (out_dir / "summary.txt").read_text()
    assert "cleanup" in summary and "fuse_rmsnorm" in summary and "paged_attention" not in summary
    assert "rms_norm" in (out_dir / "02_fuse_rmsnorm.after.txt").read_text()
    assert "rms_norm" not in (out_dir / "01_cleanup.after.txt").read_text().replace("rms_norm_eps", "")
    printed = capsys.readouterr().out
    assert "fuse_rmsnorm" in printed and str(out_dir) in printed


@pytest.mark.parametrize("argv", [
    ["generate", "--model", "HuggingFaceTB/SmolLM2-135M-Instruct"],
    ["dump-graph", "Qwen/Qwen2.5-7B-Instruct", "--out", "unused"],
])
def test_hub_id_exits_2_with_a_clear_message(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "hub id" in err and "does not download" in err and "presets" in err


def test_unknown_pass_exits_2(tmp_path, capsys):
    assert main(["dump-graph", "tiny-llama", "--out", str(tmp_path), "--passes", "cleanup,no_such_pass"]) == 2
    assert "no_such_pass" in capsys.readouterr().err


def test_console_script():
    exe = shutil.which("mini-infer") or str(Path(sys.executable).with_name("mini-infer"))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([exe, "generate", "What is the capital of France?", "--max-model-len", "1024"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == ANSWER
