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

Under pytest-xdist (scripts/test.sh: `--dist loadfile --no-loadscope-reorder`) each test file is one unit of
work, except the files that compile the embedded SmolLM2 in this process, which form one unit
(`pytest_xdist_make_scheduler`): one worker compiles it for all of them instead of both doing it. Units are sent
slowest first (SECONDS), so that no long file starts when the other worker is nearly done.
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


# Files whose tests load and compile the embedded SmolLM2 in the test process (tests/_model_cache.py).
SMOLLM2_FILES = frozenset({
    "tests/passes/test_fp8_kv_cache.py", "tests/passes/test_quantize_w8a8_smollm2.py", "tests/runtime/test_engine.py",
    "tests/runtime/test_engine_async.py", "tests/serving/test_openai_server.py", "tests/test_cli.py",
    "tests/test_llm.py", "tests/test_readme.py"})
# Seconds per file (set-ups included), `--durations=0` of the suite on 2 busy cores (2026-11-30, at 5fab1b7);
# the rest take less.
SECONDS = {
    "tests/ops/test_paged_attention.py": 161, "tests/passes/test_shard_tensor_parallel.py": 83,
    "tests/distributed/test_tensor_parallel.py": 69, "tests/serving/test_server_process.py": 45,
    "tests/passes/test_route_moe.py": 39, "tests/passes/test_quantize_w8a8.py": 39,
    "tests/distributed/test_moe_tensor_parallel.py": 38, "tests/distributed/test_tp_shard_load.py": 35,
    "tests/ops/test_fused_moe_preload.py": 29, "tests/ops/test_gumbel_argmax.py": 28,
    "tests/passes/test_quantize_fp8.py": 25, "tests/ops/test_argmax.py": 24, "tests/passes/test_fuse_gemv_norm.py": 23,
    "tests/ops/test_fused_moe.py": 20, "tests/ops/test_all_reduce.py": 20, "tests/passes/test_fuse_lookups.py": 19,
    "tests/ops/test_fp8_linear.py": 19, "tests/ops/test_linear_add.py": 18, "tests/runtime/test_memory.py": 18,
}
SECONDS["smollm2"] = 372  # the SMOLLM2_FILES together


def _group(nodeid: str) -> str:
    """A test's unit of work under xdist: its file, or "smollm2" for SMOLLM2_FILES."""
    path = nodeid.split("::", 1)[0]
    return "smollm2" if path in SMOLLM2_FILES else path


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The groups slowest first; the tests of a file keep their order."""
    groups: dict[str, list[pytest.Item]] = {}
    for item in items:
        groups.setdefault(_group(item.nodeid), []).append(item)
    order = sorted(groups, key=lambda g: -SECONDS.get(g, 0))  # stable: the rest in collection order
    items[:] = [item for group in order for item in groups[group]]


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist (a dev extra)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`--dist loadfile` with SMOLLM2_FILES as one unit (xdist's loadgroup cannot mark groups under pytest 9,
    whose node ids it no longer rewrites)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FileGroups(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid)

    return FileGroups(config, log)


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
