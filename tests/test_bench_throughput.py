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


class _FakeEngine:
    """Counts steps as the engine's stats do: a call launches a mixed step, a decode step, or only completes."""

    def __init__(self, kinds):
        self.kinds, self.stats = list(kinds), {"mixed_steps": 0, "decode_steps": 0}

    def step(self, final_only=False):
        kind = self.kinds.pop(0)
        if kind:
            self.stats[f"{kind}_steps"] += 1
        return [kind]


def test_step_times_records_each_call_by_the_kind_it_launched(throughput):
    engine = _FakeEngine(["mixed", "decode", None, "mixed"])
    with throughput.step_times(engine, []) as steps:
        assert [engine.step(final_only=True) for _ in range(4)] == [["mixed"], ["decode"], [None], ["mixed"]]
    assert [(i, k) for i, k, _ in steps] == [(0, "mixed"), (1, "decode"), (2, None), (3, "mixed")]
    assert "step" not in vars(engine)  # the class's method is back
    assert [i for i, _ in throughput.slowest(steps, "mixed")] in ([0, 3], [3, 0])
    assert throughput.slowest([(0, "mixed", 5.0), (1, "mixed", 60.0), (2, "decode", 99.0)], "mixed", n=1) == [(1, 60.0)]


@pytest.mark.parametrize("text, variants", [
    ("1", [(1, False)]),
    ("1,2,2ep", [(1, False), (2, False), (2, True)]),
    (" 4ep , 8", [(4, True), (8, False)]),
])
def test_parallel_variants(throughput, text, variants):
    assert throughput.parallel_variants(text) == variants


def test_parallel_label_names_the_engine_row(throughput):
    assert [throughput.parallel_label(*v) for v in [(1, False), (2, False), (2, True)]] == ["", ",tp=2", ",tp=2 ep"]


@pytest.mark.parametrize("text", ["0", "1ep", "two", "2,", "ep", "-2"])
def test_parallel_variants_refuses_naming_the_entry(throughput, text):
    import argparse

    with pytest.raises(argparse.ArgumentTypeError, match="--parallel"):
        throughput.parallel_variants(text)
