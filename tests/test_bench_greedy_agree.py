"""bench/greedy_agree.py: its agreement measure, and one run over a tiny preset whose switch changes no value."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def greedy_agree(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import greedy_agree

    return greedy_agree


@pytest.mark.parametrize("ids, first, expected", [
    ([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 5]], (2, 5, 2.5)),
    ([[1, 9, 3], [4, 5]], [[1, 2, 3], [4, 5]], (1, 4, 1.5)),  # a flip at position 1, the rest equal again
    ([[7, 2, 3], [4, 6]], [[1, 2, 3], [4, 5]], (0, 3, 0.5)),
])
def test_agreement(greedy_agree, ids, first, expected):
    a = greedy_agree.agreement(ids, first)
    assert (a["sequences_equal"], a["tokens_equal"], a["mean_equal_prefix"]) == expected
    assert a["tokens"] == sum(map(len, ids))


def test_a_switch_that_changes_no_value_agrees(tmp_path):
    """tiny-qwen3 over an fp8 cache, V tokens-contiguous (the default) against the usual layout: every token equal,
    every KV block back in the pool."""
    cmd = [sys.executable, str(ROOT / "bench" / "greedy_agree.py"), "--model", "tiny-qwen3", "--max-model-len",
           "1024", "--num-prompts", "3", "--max-tokens", "4", "--kv-cache-dtype", "fp8", "--switch",
           "paged_attention.FP8_V_KEYS_CONTIGUOUS=0", "--out", str(tmp_path)]
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    rows = json.loads((tmp_path / "greedy_agree.json").read_text())["rows"]
    assert [r["switch"] for r in rows] == ["default", "paged_attention.FP8_V_KEYS_CONTIGUOUS=0"]
    assert all(r["sequences_equal"] == 3 and r["tokens_equal"] == r["tokens"] == 12 for r in rows)
    assert all(r["all_blocks_free"] for r in rows)
