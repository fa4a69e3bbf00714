"""A GPU timeline from a torch profiler run: which GPU work ran between CUDA-graph replays, and, inside one replay,
each kernel's start, duration and the time it adds to the critical path.

Read from the profiler's chrome trace (events of category kernel / gpu_memcpy / gpu_memset, and the runtime calls
whose correlation ids launched them), so it needs nothing but the trace. A kernel's "exposed" time is its end minus
the latest end of the kernels before it (0 when it ends inside another's span): under programmatic dependent
launch kernels start early and wait, so their own durations overlap and do not add up to the step; exposed times
do. Used by `profile_decode.py --timeline`; has no timing of its own.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import defaultdict
from dataclasses import dataclass

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


@dataclass
class GpuOp:
    """One kernel, copy or fill on the GPU: name, start and duration (us), and the runtime call that issued it."""

    name: str
    start: float
    dur: float
    launcher: str
    correlation: int = -1

    @property
    def end(self) -> float:
        return self.start + self.dur


def gpu_ops(trace: dict) -> list[GpuOp]:
    """The trace's GPU operations in start order, each with the name of the runtime call that issued it."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    launcher = {e["args"]["correlation"]: e["name"] for e in events
                if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    ops = [GpuOp(e["name"], float(e["ts"]), float(e["dur"]), launcher.get(e["args"].get("correlation"), "?"),
                 e["args"].get("correlation", -1))
           for e in events if e.get("cat") in GPU_CATS and "args" in e]
    return sorted(ops, key=lambda o: o.start)


def exposed_times(ops: list[GpuOp]) -> list[float]:
    """Per op: its end minus the latest end before it (never negative); the first op counts whole."""
    out, latest = [], None
    for o in ops:
        out.append(o.dur if latest is None else max(0.0, o.end - max(latest, o.start)))
        latest = o.end if latest is None else max(latest, o.end)
    return out


def replays(ops: list[GpuOp]) -> list[list[GpuOp]]:
    """The ops grouped into runs issued by one cudaGraphLaunch each (consecutive ops of one launch's correlation
    id), in order; every other op is a run of its own."""
    runs: list[list[GpuOp]] = []
    for o in ops:
        if runs and o.launcher == "cudaGraphLaunch" and runs[-1][-1].correlation == o.correlation:
            runs[-1].append(o)
        else:
            runs.append([o])
    return runs


def _short(name: str, width: int = 58) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def print_timeline(prof, trace_out: str | None = None, detail_kernels: int = 40) -> None:
    """Print the between-replay GPU work and the last full replay's kernels (the first `detail_kernels` in
    order, then exposed time summed by name)."""
    path = trace_out or os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        ops = gpu_ops(json.load(f))
    runs = replays(ops)
    graph_runs = [i for i, r in enumerate(runs) if r[0].launcher == "cudaGraphLaunch" and len(r) > 1]
    if len(graph_runs) < 2:
        print(f"timeline: {len(graph_runs)} graph replays found in {len(ops)} GPU ops; nothing to show")
        return
    print(f"\ntimeline: {len(graph_runs)} replays, {len(ops)} GPU ops")
    for a, b in zip(graph_runs, graph_runs[1:]):
        first, nxt = runs[a], runs[b]
        span = first[-1].end - first[0].start
        between = [o for r in runs[a + 1: b] for o in r]
        gap = nxt[0].start - first[-1].end
        parts = ", ".join(f"{_short(o.name, 30)} {o.dur:.1f}" for o in between) or "nothing"
        print(f"  replay {span:7.1f} us ({len(first)} kernels); then {gap:6.1f} us until the next: {parts}")
    last = runs[graph_runs[-2]]
    t0, exp = last[0].start, exposed_times(last)
    print(f"\none replay, kernel by kernel (start / duration / exposed, us; first {detail_kernels}):")
    for i, (o, x) in enumerate(zip(last, exp)):
        if i >= detail_kernels:
            break
        print(f"  {i:4d} {_short(o.name):58s} {o.start - t0:8.1f} {o.dur:7.2f} {x:7.2f}")
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for o, x in zip(last, exp):
        row = by_name[o.name]
        row[0] += 1
        row[1] += o.dur
        row[2] += x
    total = sum(exp)
    print(f"\nexposed time by kernel (one replay, {total:.1f} us exposed of a {last[-1].end - t0:.1f} us span):")
    print(f"  {'kernel':58s} {'calls':>5s} {'busy us':>9s} {'exposed us':>10s} {'share':>6s}")
    for name, (n, busy, x) in sorted(by_name.items(), key=lambda kv: -kv[1][2]):
        print(f"  {_short(name):58s} {n:5d} {busy:9.1f} {x:10.1f} {x / total:6.1%}")
