"""Probe: does an L2 persisting window over part of lm_head shorten a batch-1 decode step? (issue #14)

A CUDA graph of one step's weight GEMVs at a preset's shapes (every layer's q/k/v, o_proj, gate/up and down, then
lm_head; the engine's `mini_infer::linear`, so its PDL launches and preloads) is replayed with and without a
persisting window (CUDA's access policy window, set below through libcuda) over lm_head: the window set on the capture stream, set on
the captured graph's kernel nodes, spread over the largest window (hit ratio) or the first bytes only. Prints us per
replay, the device's L2 limits and the bytes a step reads; the outputs of every variant must equal the first's.
Measured on an H200 (bench/RESULTS.md, twenty-ninth session): no gain, so nothing in the engine uses it.

    python bench/probe_l2_persist.py [--model qwen3-0.6b] [--replays 50]
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import sys
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mini_infer.models.presets import preset_config  # noqa: E402
from mini_infer.ops._triton_support import cuda_index  # noqa: E402
from mini_infer.ops.linear import linear  # noqa: E402

# The driver-API plumbing (ctypes on libcuda): the device's limits, the set-aside, a stream's window, a captured
# graph's kernel nodes' windows, the reset of persisting lines (cuda.h values).
_ATTR_L2_CACHE_SIZE = 38
_ATTR_MAX_PERSISTING_L2 = 108
_ATTR_MAX_WINDOW = 109
_LIMIT_PERSISTING_L2 = 0x06
_LAUNCH_ATTR_ACCESS_POLICY_WINDOW = 1
_ACCESS_NORMAL, _ACCESS_STREAMING, _ACCESS_PERSISTING = 0, 1, 2
_GRAPH_NODE_KERNEL = 0


class _Window(ctypes.Structure):
    _fields_ = [("base_ptr", ctypes.c_void_p), ("num_bytes", ctypes.c_size_t), ("hit_ratio", ctypes.c_float),
                ("hit_prop", ctypes.c_int), ("miss_prop", ctypes.c_int)]


class _AttrValue(ctypes.Union):  # CUlaunchAttributeValue: 64 bytes, the window first
    _fields_ = [("pad", ctypes.c_char * 64), ("window", _Window)]


@dataclass(frozen=True)
class L2Limits:
    """A device's L2 size, the most it lets a process set aside for persisting lines, and the largest window."""
    l2_bytes: int
    max_persisting_bytes: int
    max_window_bytes: int


@dataclass(frozen=True)
class Window:
    """An address range [base, base + num_bytes) whose reads persist in L2 for `hit_ratio` of its lines."""
    base: int
    num_bytes: int
    hit_ratio: float


@functools.cache
def _libcuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _check(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"{what} failed with CUresult {result}")


def limits(device: torch.device) -> L2Limits:
    """The L2 limits of a CUDA device (its context must exist: any CUDA tensor made it)."""
    index = cuda_index(device)
    values = []
    for attr in (_ATTR_L2_CACHE_SIZE, _ATTR_MAX_PERSISTING_L2, _ATTR_MAX_WINDOW):
        out = ctypes.c_int()
        _check(_libcuda().cuDeviceGetAttribute(ctypes.byref(out), attr, index), f"cuDeviceGetAttribute({attr})")
        values.append(out.value)
    return L2Limits(*values)


def set_aside(num_bytes: int) -> None:
    """Set `num_bytes` of the current context's L2 aside for persisting lines (0: none); the driver rounds it."""
    _check(_libcuda().cuCtxSetLimit(_LIMIT_PERSISTING_L2, ctypes.c_size_t(num_bytes)), "cuCtxSetLimit")


def reset_persisting_lines() -> None:
    """Turn every persisting line of the current context back into a normal one."""
    _check(_libcuda().cuCtxResetPersistingL2Cache(), "cuCtxResetPersistingL2Cache")


def weight_window(weight: torch.Tensor, persist_bytes: int, max_window_bytes: int) -> Window:
    """A window over the start of `weight` (at most `max_window_bytes` of it) whose hit ratio spreads
    `persist_bytes` of persisting lines over it, so that reads of the kept lines and of the streamed ones mix."""
    span = min(weight.numel() * weight.element_size(), max_window_bytes)
    return Window(weight.data_ptr(), span, min(1.0, persist_bytes / span))


def _value(window: Window | None) -> _AttrValue:
    value = _AttrValue()
    if window is not None:
        value.window = _Window(window.base, window.num_bytes, window.hit_ratio, _ACCESS_PERSISTING, _ACCESS_STREAMING)
    return value  # all zeros: no window (0 bytes)


def set_stream_window(stream: torch.cuda.Stream, window: Window | None) -> None:
    """Give (or, with None, take away) `stream`'s window: kernels launched into it later take it."""
    value = _value(window)
    _check(_libcuda().cuStreamSetAttribute(ctypes.c_void_p(stream.cuda_stream), _LAUNCH_ATTR_ACCESS_POLICY_WINDOW,
                                           ctypes.byref(value)), "cuStreamSetAttribute")


def set_graph_window(raw_graph: int, window: Window | None) -> int:
    """Give every kernel node of a captured, not yet instantiated graph (`CUDAGraph.raw_cuda_graph()`) the window;
    returns how many nodes took it."""
    lib = _libcuda()
    count = ctypes.c_size_t(0)
    _check(lib.cuGraphGetNodes(ctypes.c_void_p(raw_graph), None, ctypes.byref(count)), "cuGraphGetNodes")
    nodes = (ctypes.c_void_p * count.value)()
    _check(lib.cuGraphGetNodes(ctypes.c_void_p(raw_graph), nodes, ctypes.byref(count)), "cuGraphGetNodes")
    value, taken = _value(window), 0
    for node in nodes:
        kind = ctypes.c_int()
        _check(lib.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)), "cuGraphNodeGetType")
        if kind.value == _GRAPH_NODE_KERNEL:
            _check(lib.cuGraphKernelNodeSetAttribute(ctypes.c_void_p(node), _LAUNCH_ATTR_ACCESS_POLICY_WINDOW,
                                                     ctypes.byref(value)), "cuGraphKernelNodeSetAttribute")
            taken += 1
    return taken


def step_weights(model: str) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Random bf16 weights at a dense preset's batch-1 GEMV shapes: (every layer's four, lm_head)."""
    c = preset_config(model)
    h = c.hidden_size
    d = getattr(c, "head_dim", None) or h // c.num_attention_heads
    q, kv, inter = c.num_attention_heads * d, c.num_key_value_heads * d, c.intermediate_size
    make = lambda n, k: torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5  # noqa: E731
    layers = []
    for _ in range(c.num_hidden_layers):
        layers += [make(q + 2 * kv, h), make(h, q), make(2 * inter, h), make(h, inter)]
    return layers, make(c.vocab_size, h)


def capture(layers, lm_head, xs, stream, node_window=None):
    """One step's GEMVs in a graph captured on `stream`; with `node_window`, every kernel node gets it before
    the graph is instantiated. Returns (graph, its lm_head output, nodes given the window)."""
    graph = torch.cuda.CUDAGraph(keep_graph=node_window is not None)
    with torch.cuda.graph(graph, stream=stream):
        for w in layers:
            linear(xs[w.shape[1]], w, None)
        out = linear(xs[lm_head.shape[1]], lm_head, None)
    taken = 0
    if node_window is not None:
        taken = set_graph_window(graph.raw_cuda_graph(), node_window)
        graph.instantiate()
    return graph, out, taken


def replay_us(graph, replays: int) -> float:
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / replays


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--replays", type=int, default=50)
    p.add_argument("--out", default=None, help="JSON path")
    args = p.parse_args()

    torch.manual_seed(0)
    layers, lm_head = step_weights(args.model)
    ks = {w.shape[1] for w in layers} | {lm_head.shape[1]}
    xs = {k: torch.randn(1, k, device="cuda", dtype=torch.bfloat16) for k in ks}
    lim = limits(torch.device("cuda"))
    step_bytes = sum(w.numel() * 2 for w in layers) + lm_head.numel() * 2
    print(f"{torch.cuda.get_device_name()} | {args.model}: {len(layers)} layer GEMVs + lm_head "
          f"{tuple(lm_head.shape)}, {step_bytes / 1e6:.1f} MB a step | L2 {lim.l2_bytes / 2**20:.1f} MiB, "
          f"persisting at most {lim.max_persisting_bytes / 2**20:.1f} MiB, window at most "
          f"{lim.max_window_bytes / 2**20:.1f} MiB")
    for w in layers + [lm_head]:  # build every GEMV variant outside the captures
        linear(xs[w.shape[1]], w, None)
    torch.cuda.synchronize()

    persist = lim.max_persisting_bytes
    lm_bytes = lm_head.numel() * 2
    spread = weight_window(lm_head, persist, lim.max_window_bytes)
    first = Window(lm_head.data_ptr(), min(persist, lm_bytes), 1.0)
    last = Window(lm_head.data_ptr() + lm_bytes - min(persist, lm_bytes), min(persist, lm_bytes), 1.0)
    variants = [("off", None, None, False), ("stream window, spread", spread, None, False),
                ("stream window, first bytes", first, None, False), ("stream window, last bytes", last, None, False),
                ("node windows, spread", None, spread, False), ("off again", None, None, False),
                ("lm_head alone, off", None, None, True), ("lm_head alone, stream window spread", spread, None, True)]
    rows, ref = [], None
    for name, stream_window, node_window, alone in variants:
        reset_persisting_lines()
        set_aside(persist if (stream_window or node_window) else 0)
        stream = torch.cuda.Stream()
        set_stream_window(stream, stream_window)
        try:
            graph, out, taken = capture([] if alone else layers, lm_head, xs, stream, node_window)
        except Exception as exc:  # noqa: BLE001 (a probe: report and go on)
            print(f"{name:40s} failed: {type(exc).__name__}: {exc}")
            rows.append({"variant": name, "error": str(exc)})
            continue
        us = replay_us(graph, args.replays)
        same = None if ref is None else bool(torch.equal(out, ref))
        ref = out.clone() if ref is None else ref
        gbps = (lm_bytes if alone else step_bytes) / us / 1e3
        print(f"{name:40s} {us:8.1f} us a replay ({gbps:6.0f} GB/s of its bytes)"
              + (f", nodes given the window {taken}" if node_window else "") + f", lm_head output equal: {same}")
        rows.append({"variant": name, "us": us, "gb_per_s": gbps, "nodes": taken, "equal": same})
        del graph
    reset_persisting_lines()
    set_aside(0)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "model": args.model, "limits": vars(lim),
                       "step_bytes": step_bytes, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
