"""Shared pytest set-up.

Without a GPU, Triton kernels run under the CPU interpreter: TRITON_INTERPRET must be set before the
first `import triton`, so it is set here, at collection time (importing torch does not import triton).

Tests run torch on one intra-op thread: the test models' ops are microseconds of work, and with two OpenMP
threads on a busy two-core machine each op waits for a descheduled peer (a 17-token forward of a tiny model
took 0.5 s instead of 3 ms).

Between test modules, what is still alive is collected once and then frozen (`gc.freeze`): by then it is what the
process keeps for good (the memoized models of tests/_model_cache.py, module-level caches, imported modules),
and the cyclic collector stops scanning it. Without this every full collection walks millions of objects
(~1 s each late in the suite), and `LLMEngine` runs one per engine built (`release_host_memory`): two thirds of
tests/runtime/test_engine.py's time was spent there. Objects a test creates stay young and collectable, so
anything a test checks about collection or memory is unchanged; only garbage cycles among objects alive at a
module boundary (a module's fixtures and its last test's arguments are released before it) are never freed.
"""

import gc
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session", autouse=True)
def _one_thread():  # session scope: module- and session-scoped fixtures (model compiles) run under it too
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


_last_module: list = [None]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before a module's first test (the previous module's fixtures and last test's arguments are released)."""
    if _last_module[0] is not None and item.path != _last_module[0]:
        gc.collect()
        gc.freeze()
    _last_module[0] = item.path


def pytest_unconfigure(config: pytest.Config) -> None:
    gc.unfreeze()  # the interpreter's shutdown collects as usual (nanobind reports frozen Triton objects as leaked)
