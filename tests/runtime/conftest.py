"""test_engine_async.py collects every engine test again with async scheduling on. The tests parametrized over
the tiny presets check the model architectures (q/k norms, biases, sliding windows) under each scheduling regime
in test_engine.py; with async scheduling, what changes is the scheduling, not the model, so there they run on two
presets only: tiny-qwen3 (q/k norms) and tiny-mistral (sliding window). This keeps the suite in its time budget."""

from __future__ import annotations

import pytest

ASYNC_PRESETS = ("tiny-qwen3", "tiny-mistral")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    dropped, kept = [], []
    for item in items:
        preset = getattr(item, "callspec", None) and item.callspec.params.get("name")
        in_async = item.nodeid.startswith("tests/runtime/test_engine_async.py::")
        is_preset = isinstance(preset, str) and preset.startswith("tiny-")
        (dropped if in_async and is_preset and preset not in ASYNC_PRESETS else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
