"""bench/throughput.py's check for an engine whose prefill / mixed steps ran far slower than the others' (the
first engine of a fresh GPU machine's first process): flagged against the median of the others, never alone."""

from pathlib import Path

import pytest


@pytest.fixture
def throughput(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    import throughput

    return throughput


@pytest.mark.parametrize("mixed_ms, slow", [
    ([64.7, 20.4, 18.9, 19.9], [0]),  # the twenty-fifth session's call 3
    ([19.8, 20.2, 19.4, 20.1], []),
    ([20.0, 41.0], [1]),
    ([20.0, 39.0], []),  # under twice the other's
    ([63.0], []),  # one engine: nothing to compare with
    ([20.0, 20.0, 90.0, 95.0], [2, 3]),  # the median of the others, not their mean
])
def test_slow_mixed_steps(throughput, mixed_ms, slow):
    assert throughput.slow_mixed_steps(mixed_ms) == slow
