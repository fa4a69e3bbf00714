"""Test helper: hand this process's cached GPU memory back before a test starts a child process that loads a model.

An engine built in the test process (the in-process CLI and server tests) takes most of the GPU for its KV cache;
once it is gone its memory stays in torch's caching allocator, where a child process cannot have it. No-op without
a GPU."""

from __future__ import annotations

import gc

import torch


def release_for_child_processes() -> None:
    """Collect dead engines and return their cached CUDA memory to the driver."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
