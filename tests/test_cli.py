"""The `mini-infer` command: generate (default model and prompt, token-id prompts), dump-graph, the console
script; bad options and broken models refused in one line with status 2 before anything loads; Ctrl-C."""

from __future__ import annotations

import ast
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mini_infer.cli import main
from tests import _model_cache as mc
from tests._gpu_memory import release_for_child_processes

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


def test_dump_graph_with_fp8_weights_and_kv_cache(tmp_path, capsys):
    out_dir = tmp_path / "dumps"
    assert main(["dump-graph", "tiny-llama", "--out", str(out_dir), "--quantization", "fp8",
                 "--kv-cache-dtype", "fp8"]) == 0
    after = next(out_dir.glob("*_quantize_fp8.after.txt")).read_text()
    assert after.count("torch.ops.mini_infer.fp8_linear.default(") == 14
    printed = capsys.readouterr().out
    assert "14 linears to fp8" in printed and "fp8 KV cache" in printed
    assert "k_cache_0 [2, 16] float8_e4m3fn" in printed and "caches: 128 bytes per token" in printed


def test_generate_with_fp8_options(monkeypatch, capsys):
    mc.patch_engine(monkeypatch)
    assert main(["generate", "--model", "tiny-llama", "--prompt-token-ids", "5,6,7", "--max-tokens", "4",
                 "--ignore-eos", "--quantization", "fp8", "--kv-cache-dtype", "fp8_e4m3"]) == 0
    (line,) = capsys.readouterr().out.strip().splitlines()
    assert len(ast.literal_eval(line)) == 4  # the printed token-id list


def test_dump_graph_with_quantization(tmp_path, capsys):
    assert main(["dump-graph", "tiny-llama", "--out", str(tmp_path), "--quantization", "w8a8", "--verify"]) == 0
    printed = capsys.readouterr().out
    assert "quantize_w8a8" in printed and "fuse_act_quant" in printed and "max |err|" in printed
    assert "int8_linear" in (tmp_path / "03_quantize_w8a8.after.txt").read_text()


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
    release_for_child_processes()
    proc = subprocess.run([exe, "generate", "What is the capital of France?", "--max-model-len", "1024"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == ANSWER


def test_generate_token_ids_on_a_preset_without_tokenizer(monkeypatch, capsys):
    mc.patch_engine(monkeypatch)
    # on the CPU, where the oracle is: a preset's random weights are drawn on the device it loads to
    assert main(["generate", "--model", "tiny-llama", "--prompt-token-ids", "5,6,7", "--max-tokens", "4",
                 "--ignore-eos", "--device", "cpu"]) == 0
    (line,) = capsys.readouterr().out.strip().splitlines()
    expected = mc.hf_greedy(mc.loaded("tiny-llama").model, [5, 6, 7], 4)
    assert line == str(expected)


@pytest.fixture
def no_loading(monkeypatch):
    import mini_infer.runtime.engine as engine_mod

    def refuse(*args, **kwargs):
        raise AssertionError("load_model ran: the check came too late")

    monkeypatch.setattr(engine_mod, "load_model", refuse)


def _broken_checkpoint(path, weights: bytes | None) -> str:
    mc.loaded("tiny-llama").model.config.save_pretrained(path)
    if weights is not None:
        (path / "model.safetensors").write_bytes(weights)
    return str(path)


@pytest.mark.parametrize("case", ["text to a model without tokenizer", "max-num-seqs 0", "max-model-len too big",
                                  "kv-cache-memory-bytes 1", "device cuda", "only config.json",
                                  "random safetensors", "missing absolute path", "kv-cache-dtype fp4",
                                  "quantization int4"])
def test_bad_setups_are_one_line_and_status_2_before_loading(no_loading, tmp_path, capsys, case):
    if case == "device cuda" and __import__("torch").cuda.is_available():
        pytest.skip("this machine has a GPU")
    argv = {
        "text to a model without tokenizer": ["--model", "tiny-llama", "hello"],
        "max-num-seqs 0": ["--max-num-seqs", "0", "hello"],
        "max-model-len too big": ["--model", "tiny-llama", "--max-model-len", "4096", "--prompt-token-ids", "1,2"],
        "kv-cache-memory-bytes 1": ["--kv-cache-memory-bytes", "1", "hello"],
        "device cuda": ["--device", "cuda", "hello"],
        "only config.json": ["--model", _broken_checkpoint(tmp_path / "a", None), "--prompt-token-ids", "1,2"],
        "random safetensors": ["--model", _broken_checkpoint(tmp_path / "b", bytes(range(256)) * 40),
                               "--prompt-token-ids", "1,2"],
        "missing absolute path": ["--model", str(tmp_path / "nothing" / "here"), "hello"],
        "kv-cache-dtype fp4": ["--kv-cache-dtype", "fp4", "hello"],
        "quantization int4": ["--quantization", "int4", "hello"],
    }[case]
    start = time.perf_counter()
    assert main(["generate", *argv]) == 2
    assert time.perf_counter() - start < 2.0
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("mini-infer generate: error: "), err
    expected = {"text to a model without tokenizer": "--prompt-token-ids", "max-num-seqs 0": "max_num_seqs",
                "max-model-len too big": "max_model_len=4096", "kv-cache-memory-bytes 1": "kv_cache_memory_bytes=1",
                "device cuda": "device='cuda'", "only config.json": "no weights",
                "random safetensors": "model.safetensors", "missing absolute path": "no such file or directory",
                "kv-cache-dtype fp4": "kv_cache_dtype must be one of", "quantization int4": "quantization must be one of w8a8, fp8, mxfp4 or None; got 'int4'"}
    assert expected[case] in err


def _as_from_a_terminal() -> None:
    """In the child before exec: SIGINT delivered and handled as a shell's foreground job gets it. The pytest
    process may carry SIGINT blocked or ignored by then (the test failed only late in the full suite, never
    alone), and a child inherits both; mini-infer rightly keeps an inherited SIG_IGN (nohup, `cmd &`)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_during_generate_is_one_line(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    release_for_child_processes()
    proc = subprocess.Popen([sys.executable, "-m", "mini_infer.cli", "-v", "generate", "--model", "tiny-llama",
                             "--prompt-token-ids", "1,2,3", "--n", "32", "--max-tokens", "1000", "--ignore-eos"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=_as_from_a_terminal)
    lines = []
    for line in proc.stderr:  # the engine is up (INFO log line): generation is running
        lines.append(line)
        if "engine ready" in line:
            break
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    _, rest = proc.communicate(timeout=120)
    err = "".join(lines) + rest
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "mini-infer generate: interrupted"


@pytest.mark.parametrize("flag", [["--quantization", "fp8"], ["--kv-cache-dtype", "fp8"]])
def test_dump_graph_verify_allows_the_declared_fp8_approximation(tmp_path, capsys, flag):
    """--verify after a lossy fp8 pass allows its declared approximation (it failed at 1e-4 before)."""
    assert main(["dump-graph", "tiny-llama", "--out", str(tmp_path), "--verify", *flag]) == 0
    assert "max |err|" in capsys.readouterr().out
