"""Run these tests' tiny models on one intra-op thread.

The tiny models' matmuls are microseconds of work; with two OpenMP threads on a busy two-core machine
each op waits for a descheduled peer thread and a 17-token forward takes 0.5 s instead of 3 ms.
"""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
