"""Host-to-device copies of step inputs that never make the host wait for the device.

A copy from ordinary (pageable) host memory may wait for the work already queued on the stream before it
can start, which would stall the host behind the device every step and defeat async scheduling. Values
go through page-locked (pinned) memory instead, and the copy is queued without waiting. Several values
that travel together are packed into one byte buffer and moved by ONE copy (`to_device_many`, and
`StagedBuffer` for inputs that live at fixed device addresses, e.g. a CUDA graph's), so a step queues one
copy, not one per value. This module only moves data; it does not decide what to move or what goes where
in a padded input.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

ALIGN = 64  # bytes: every packed field starts at a multiple of this (vector loads, any dtype)

HostView = np.ndarray | torch.Tensor  # numpy where the dtype has one (fast small writes), else torch


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


@dataclass(frozen=True)
class Field:
    """One typed tensor inside a packed byte buffer."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # bytes from the buffer's start, a multiple of ALIGN

    @functools.cached_property  # read every step by the staging runner: computed once
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def pack_layout(fields: Sequence[tuple[str, torch.dtype, tuple[int, ...]]]) -> tuple[list[Field], int]:
    """The fields laid end to end in the given order, each at an ALIGN boundary; and the total bytes."""
    out, end = [], 0
    for name, dtype, shape in fields:
        offset = -(-end // ALIGN) * ALIGN
        out.append(Field(name, dtype, tuple(shape), offset))
        end = offset + out[-1].nbytes
    return out, end


def typed_views(buffer: torch.Tensor, fields: Sequence[Field]) -> dict[str, torch.Tensor]:
    """Each field as a tensor viewing its bytes of `buffer` (a flat uint8 tensor)."""
    return {f.name: buffer[f.offset: f.offset + f.nbytes].view(f.dtype).view(f.shape) for f in fields}


def host_views(buffer: torch.Tensor, fields: Sequence[Field]) -> dict[str, HostView]:
    """Like `typed_views` for a host buffer, as numpy arrays where the dtype allows (writes cost far less)."""
    out: dict[str, HostView] = {}
    for name, view in typed_views(buffer, fields).items():
        try:
            out[name] = view.numpy()
        except TypeError:  # bfloat16 and other dtypes numpy lacks
            out[name] = view
    return out


def assign(dst: HostView, region: tuple[slice, ...], value) -> None:
    """dst[region] = value, for a numpy or torch destination and a list, array or tensor value."""
    if isinstance(dst, np.ndarray):
        dst[region] = value.numpy() if isinstance(value, torch.Tensor) else value
    else:
        dst[region] = value if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))


def host_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """A zeroed flat uint8 host buffer, pinned when it feeds a CUDA device."""
    return torch.zeros(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")


Values = Mapping[str, tuple[Sequence | np.ndarray | torch.Tensor, torch.dtype]]


def pack(values: Values, pinned: bool) -> tuple[torch.Tensor, list[Field]]:
    """Every (value, dtype) written into one flat host byte buffer (pinned if asked), and where each is."""
    shaped = {name: (v if isinstance(v, (np.ndarray, torch.Tensor)) else np.asarray(v), dtype)
              for name, (v, dtype) in values.items()}
    fields, total = pack_layout([(name, dtype, tuple(v.shape)) for name, (v, dtype) in shaped.items()])
    host = torch.empty(total, dtype=torch.uint8, pin_memory=pinned)
    for name, view in host_views(host, fields).items():
        assign(view, (slice(None),) * view.ndim if view.ndim else (), shaped[name][0])
    return host, fields


def to_device_many(values: Values, device: torch.device) -> dict[str, torch.Tensor]:
    """Every (value, dtype) as a tensor on `device`. On CUDA they are packed into one pinned buffer and moved
    by ONE non-blocking copy (the results view one device allocation); elsewhere no copy is needed."""
    if device.type != "cuda":
        return {name: to_device(v, dtype, device) for name, (v, dtype) in values.items()}
    host, fields = pack(values, pinned=True)
    return typed_views(host.to(device, non_blocking=True), fields)


class StagedBuffer:
    """Device tensors at fixed addresses (typed views of one device byte buffer), fed from the host by ONE
    non-blocking copy from a matching pinned buffer.

    The host buffers (`copies` of them, used in turn) are laid out exactly like the device one: `begin()`
    hands out the next one's typed views to write, `upload(nbytes)` queues the copy of its first `nbytes`.
    A host buffer is handed out again only once the copy that last read it has run (`fence`: a CUDA event
    recorded after it, waited on by `begin`), so the host may prepare the next step while the device still
    owes the previous copy. With two buffers the wait is normally already over: a step's copy runs before its
    forward, and the host prepares step N+1 only after queueing step N.
    """

    def __init__(self, fields: Sequence[tuple[str, torch.dtype, tuple[int, ...]]], device: torch.device,
                 copies: int = 2, fence: Callable[[], object] | None = None) -> None:
        self.fields, self.nbytes = pack_layout(fields)
        self.device = device
        self.device_buffer = torch.zeros(self.nbytes, dtype=torch.uint8, device=device)
        self.views = typed_views(self.device_buffer, self.fields)
        self._host = [host_buffer(self.nbytes, device) for _ in range(copies)]
        self._host_views = [host_views(h, self.fields) for h in self._host]
        # per host buffer, a fence (an object with record() and synchronize(), by default a CUDA event) recorded
        # after each copy from it; none on a CPU device, where copies are synchronous
        fence = fence or (torch.cuda.Event if device.type == "cuda" else None)
        self._fences = [fence() for _ in range(copies)] if fence is not None else None
        self._pending = [False] * copies  # whether a copy from the buffer was queued since the host last waited
        self._current = copies - 1

    @property
    def host_nbytes(self) -> int:
        return self.nbytes * len(self._host)

    def begin(self) -> dict[str, HostView]:
        """The next host buffer's views, once no queued copy still reads it."""
        self._current = (self._current + 1) % len(self._host)
        if self._pending[self._current]:
            self._fences[self._current].synchronize()
            self._pending[self._current] = False
        return self._host_views[self._current]

    def upload(self, nbytes: int | None = None) -> None:
        """Queue one copy of the current host buffer's first `nbytes` (all by default) to the device buffer."""
        n = self.nbytes if nbytes is None else nbytes
        self.device_buffer[:n].copy_(self._host[self._current][:n], non_blocking=True)
        if self._fences is not None:
            self._fences[self._current].record()
            self._pending[self._current] = True


class HostCopy:
    """Device tensors copied to the host now (queued on the stream), read later without waiting for work
    queued after them: `wait()` waits only for this copy, not for the rest of the stream.

    (`tensor.tolist()` later would queue its copy behind everything launched since, e.g. the next step.)
    With `stream` (a CUDA stream other than the current one) the copies run there, after the current stream's
    work so far, so that what the current stream queues next (the next step's inputs and replay) does not wait
    behind them; the device tensors are kept alive until `wait()` has seen the copies land. `event` marks their
    end on the device: work that will overwrite the tensors must wait for it (cuda_graphs.py, `fence_ids`).
    """

    def __init__(self, tensors: Sequence[torch.Tensor | None], stream: torch.cuda.Stream | None = None) -> None:
        self.event = None
        self.host: list[torch.Tensor | None] = []
        on_device = [t for t in tensors if t is not None and t.device.type == "cuda"]
        side = stream if on_device else None
        self._sources = on_device if side is not None else []  # alive until the side copies land
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(on_device[0].device))
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            for t in tensors:
                if t is None or t.device.type != "cuda":
                    self.host.append(t)
                    continue
                h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                h.copy_(t, non_blocking=True)
                self.host.append(h)
            if on_device:
                self.event = torch.cuda.Event()
                self.event.record()

    def wait(self) -> list[torch.Tensor | None]:
        """The host copies, once they have landed."""
        if self.event is not None:
            self.event.synchronize()
        self._sources = []
        return self.host
