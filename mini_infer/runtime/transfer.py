"""Host-to-device copies of step inputs that never make the host wait for the device.

A copy from ordinary (pageable) host memory may wait for the work already queued on the stream before it
can start, which would stall the host behind the device every step and defeat async scheduling. Values
go through page-locked (pinned) memory from PyTorch's caching host allocator instead, and the copy is queued
without waiting. This module only moves data; it does not decide what to move.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def to_device(values: Sequence | np.ndarray | torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` as a `dtype` tensor on `device`; on CUDA through pinned memory, without a host sync."""
    if isinstance(values, torch.Tensor):
        t = values.to(dtype)
    elif isinstance(values, np.ndarray):
        t = torch.from_numpy(values).to(dtype)
    else:
        t = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return t
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


class HostCopy:
    """Device tensors copied to the host now (queued on the stream), read later without waiting for work
    queued after them: `wait()` waits only for this copy, not for the rest of the stream.

    (`tensor.tolist()` later would queue its copy behind everything launched since, e.g. the next step.)
    """

    def __init__(self, tensors: Sequence[torch.Tensor | None]) -> None:
        self.event = None
        self.host: list[torch.Tensor | None] = []
        for t in tensors:
            if t is None or t.device.type != "cuda":
                self.host.append(t)
                continue
            h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            h.copy_(t, non_blocking=True)
            self.host.append(h)
            if self.event is None:
                self.event = torch.cuda.Event()
        if self.event is not None:
            self.event.record()

    def wait(self) -> list[torch.Tensor | None]:
        """The host copies, once they have landed."""
        if self.event is not None:
            self.event.synchronize()
        return self.host
