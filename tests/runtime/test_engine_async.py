"""Every engine test again with `async_scheduling=True`: the next step is scheduled and launched before the
previous one's sampled ids are read back, so the same oracles (HF greedy ids under every scheduling regime,
stops, logprobs, penalties, aborts, failures, no leaks) now also check that ids fed on the device, extra
rows of stopping sequences and late stop checks change nothing a user sees.
"""

from __future__ import annotations

import pytest

from tests.runtime import test_engine
from tests.runtime.test_engine import *  # noqa: F403  (the tests themselves, collected again here)


@pytest.fixture(scope="module", autouse=True)
def _async_scheduling():
    """Module-scoped (and autouse, so it comes first): the module-scoped engine fixtures are async too."""
    test_engine.ASYNC_SCHEDULING = True
    yield
    test_engine.ASYNC_SCHEDULING = False


def test_async_scheduling_overlaps_steps():
    """The pipeline really runs ahead: while a step is in flight, the next one is launched with that
    step's sampled ids read on the device, and a sequence stopping by max_tokens is not scheduled again."""
    engine = test_engine.make_engine(test_engine.LLAMA)
    assert engine.async_scheduling
    fed = []
    real = engine._feed_pending

    def record(inputs, out, prev):
        fed.append(len(prev.sampling))
        return real(inputs, out, prev)

    engine._feed_pending = record
    outs = test_engine.run(engine, test_engine.PROMPTS)
    assert fed and max(fed) == len(test_engine.PROMPTS)
    for p, o in zip(test_engine.PROMPTS, outs):
        assert o.outputs[0].token_ids == test_engine.hf_ref(test_engine.LLAMA, tuple(p))
    # one forward row per generated token (the first comes with the prefill): no extra rows for max_tokens
    assert engine.stats["generation_tokens"] == test_engine.NEW * len(test_engine.PROMPTS)
    test_engine.assert_no_leak(engine)


def test_module_fixtures_are_async(llama):  # noqa: F811  (the imported fixture)
    assert llama.async_scheduling
