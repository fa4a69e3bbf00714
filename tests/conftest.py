"""Shared pytest set-up.

Without a GPU, Triton kernels run under the CPU interpreter: TRITON_INTERPRET must be set before the
first `import triton`, so it is set here, at collection time (importing torch does not import triton).

Tests run torch on one intra-op thread: the test models' ops are microseconds of work, and with two OpenMP
threads on a busy two-core machine each op waits for a descheduled peer (a 17-token forward of a tiny model
took 0.5 s instead of 3 ms).
"""

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
