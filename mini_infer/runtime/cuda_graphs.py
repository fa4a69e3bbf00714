"""CUDA graphs for decode and mixed (prefill + decode) steps: the compiled graph captured once per padded
shape, replayed with static input buffers.

A step's shape is (T tokens, S sequences, L logits rows). Two families of padded shapes are captured:
  * decode buckets: T = S = L = b for b in 1, 2, 4, 8, 16, 24, 32, ... max_num_seqs (one new token per
    sequence, every sequence sampled);
  * mixed buckets: T in token buckets above max_num_seqs up to max_num_batched_tokens, with S = L =
    max_num_seqs (any mix of prefill chunks and decodes, at most one logits row per sequence).
A step runs in the smallest bucket that holds it. Every graph input the passes declared (`InputSpec`) gets a
static buffer per bucket, at that bucket's size: all of a bucket's static inputs are typed views of one device
byte buffer (`StagedBuffer`), and the graph is captured on those views. A step's values fill the leading part
of each input and the rest of every padded dimension (tokens, sequences, logits rows) holds the spec's `pad`
value: token rows get input id 0 (the embedding reads them) and, for the attention metadata, slot -1 (nothing
written) and belong to no sequence (query
offsets repeat the last one), so attention yields zeros for them; sequence rows get length 0; logits rows
index 0, ignored. Those values and that padding are written on the host into a pinned buffer laid out exactly
like the bucket's device buffer, and ONE non-blocking copy moves them (no device tensor in between, no
device-to-device copy, no device-side fill); inputs whose padding is never read (`pad` None) come last, so
the copy stops after the step's last real element of them (a block table's unused rows are not copied). Input
ids still on the device (async scheduling: the previous step's sampled ids) are then written into the static
input ids by one device op (`StepInputs.feed`). The graph is replayed and the first L rows of its logits are
the answer: the graph's own output tensor, kept alive, for buckets of at most `OWN_LOGITS_MAX_ROWS` rows, else a
buffer shared by all buckets that the graph copies its output into (so that large outputs' memory is reused).
Decode buckets of at most `GRAPH_ARGMAX_MAX_ROWS` rows also capture their rows' greedy argmax (`last_ids`), which an
all-greedy step takes as its sampled ids; work on another stream that still reads them (the engine's copy to the
host) is fenced (`fence_ids`): the next replay waits for it on the device before it rewrites them.
Steps that fit no bucket (prompt logprobs, more tokens than the token budget) run uncaptured. A shape whose
capture fails (out of memory, or an op that cannot be captured) is logged and its steps run uncaptured. Inputs
that are already on the device (a tensor-parallel rank's, received from rank 0) are written into the same views
with device copies instead.

Memory: one device buffer per bucket plus two pinned host twins. For max_num_seqs=256,
max_num_batched_tokens=8192, max_model_len 4096 (block size 16: 256-entry block tables) and the standard
inputs, the 50 buckets take 9.2 MiB on the device and 18.4 MiB pinned on the host (one static set at the
largest size took 0.44 MiB); a batch-1 decode step copies under 1.4 KB.

On a CPU device nothing is captured: the padded shape runs eagerly through the same static buffers, after
the same staged copy, which is how the padding and the layout are tested without a GPU. This module captures
and replays; it does not build step inputs (model_runner.py) or choose what to run (the engine).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from mini_infer.compiler import CompiledModel
from mini_infer.contract import PADDED_DIMS, InputSpec
from mini_infer.ops.argmax import greedy_argmax
from mini_infer.runtime.kv_cache import KVCache
from mini_infer.runtime.transfer import HostView, StagedBuffer, assign

if TYPE_CHECKING:
    from mini_infer.runtime.model_runner import StepInputs

logger = logging.getLogger(__name__)


# Buckets of at most this many logits rows (sequences) keep the captured graph's own logits output alive and return
# it, instead of copying it into the shared `logits` buffer inside the graph (at qwen3-0.6b batch 1 that copy was a
# 1.8 us kernel of a 656 us step); larger buckets copy, so that their outputs' memory is reused by the next capture.
# Read at capture.
OWN_LOGITS_MAX_ROWS = 8
# Decode buckets of at most this many sequences also capture the greedy argmax of their logits rows (the sampler's
# own `greedy_argmax`: the same kernel, the same ids), and a step they replay answers with those ids too
# (`last_ids`), so that an all-greedy step whose logits nothing changes samples without a launch of its own after
# the replay: inside the graph the argmax starts while lm_head finishes (programmatic dependent launch) and no
# launch gap separates them. At qwen3-0.6b batch 1 on an H200 the argmax after the replay was a 3.4 us kernel of a
# ~660 us token (bench/RESULTS.md, twentieth and thirty-fifth sessions). Read at capture; 0 turns it off.
GRAPH_ARGMAX_MAX_ROWS = 8


def decode_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, 32, ... up to max_num_seqs (always included)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 8))
    return sorted(set(sizes + [max_num_seqs]))


def token_buckets(max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
    """Token counts for mixed steps: above max_num_seqs (so attention takes its prefill tiling), in steps
    of 256 up to 2048, 512 up to 4096, then 1024; max_num_batched_tokens always included."""
    sizes, t = [], 256
    while t < max_num_batched_tokens:
        if t > max_num_seqs:
            sizes.append(t)
        t += 256 if t < 2048 else 512 if t < 4096 else 1024
    return sizes + [max_num_batched_tokens] if max_num_batched_tokens > max_num_seqs else sizes


class CUDAGraphRunner:
    """Captured graphs keyed by padded shape (T, S), sharing one memory pool; each has its own staged static
    inputs."""

    def __init__(self, compiled: CompiledModel, kv_cache: KVCache, max_num_seqs: int, max_blocks_per_seq: int,
                 device: torch.device, max_num_batched_tokens: int = 0) -> None:
        self.compiled = compiled
        self.kv_cache = kv_cache
        self.device = device
        self.max_num_seqs = max_num_seqs
        self.max_blocks = max_blocks_per_seq
        self.decode_sizes = decode_buckets(max_num_seqs)
        self.token_sizes = token_buckets(max_num_seqs, max_num_batched_tokens) if max_num_batched_tokens else []
        self.specs: list[InputSpec] = compiled.input_specs
        # per bucket: its static inputs (views of one device byte buffer) and their pinned host twins, and
        # each input's spec with its place in that buffer
        self._layout: dict[tuple[int, int], list] = {}
        self._extents: dict[tuple, tuple[tuple[int, ...], int]] = {}  # see _extent
        self.staged: dict[tuple[int, int], StagedBuffer] = {shape: self._staged_buffer(shape)
                                                            for shape in self.shapes()}
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        # Every graph copies its logits into this one buffer (rows [0, L)), so that no graph keeps an output of
        # its own alive: a [L, vocab] output per captured shape was ~1.9 GB for a 7B model's ~40 shapes.
        # Replays run in stream order and a step's logits are consumed before the next replay, as they already
        # were when one shape replayed twice in a row.
        self.logits: torch.Tensor | None = None
        self.own_logits: dict[tuple[int, int], torch.Tensor] = {}  # buckets of <= OWN_LOGITS_MAX_ROWS logits rows
        self.own_ids: dict[tuple[int, int], torch.Tensor] = {}  # decode buckets of <= GRAPH_ARGMAX_MAX_ROWS rows
        self.last_ids: torch.Tensor | None = None  # the last replay's greedy ids (None: its bucket has none)
        self._ids_fence = None  # an event ending work (on another stream) that still reads last_ids: fence_ids
        self.capture_seconds = 0.0
        self.use_graphs = device.type == "cuda"

    def release(self) -> None:
        """Free every captured graph; later steps run uncaptured. A tensor-parallel group calls it before its
        NCCL communicators are destroyed: their teardown waits while a graph holding their kernels lives
        (pytorch/pytorch#115388)."""
        torch.cuda.synchronize(self.device)
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.decode_sizes, self.token_sizes, self.use_graphs = [], [], False

    def _sizes(self, spec: InputSpec, shape: tuple[int, int]) -> tuple[int, ...]:
        """The buffer's shape in bucket (T, S): logits rows are at most one per sequence, tables full width."""
        t, s = shape
        return spec.sizes(tokens=t, seqs=s, logits=s, blocks=self.max_blocks)

    def _staged_buffer(self, shape: tuple[int, int]) -> StagedBuffer:
        """Bucket `shape`'s static inputs in one staged buffer: inputs with read padding first (copied whole
        every step), then those whose padding is never read, smallest first (a step's copy stops after its
        last real element of them). They hold an all-padding step until the first real one."""
        def key(spec: InputSpec) -> tuple[bool, int]:
            if spec.pad is not None:
                return False, 0
            return True, int(np.prod(self._sizes(spec, shape))) * spec.dtype.itemsize

        order = sorted(self.specs, key=key)
        staged = StagedBuffer([(s.name, s.dtype, self._sizes(s, shape)) for s in order], self.device)
        self._layout[shape] = list(zip(order, staged.fields))
        for spec in self.specs:
            if spec.pad is not None and spec.pad != "last":
                staged.views[spec.name].fill_(spec.pad)
        return staged

    def staged_bytes(self) -> tuple[int, int]:
        """(device, pinned host) bytes the staged inputs of every bucket take."""
        return (sum(b.nbytes for b in self.staged.values()), sum(b.host_nbytes for b in self.staged.values()))

    # ------------------------------------------------------------------ shapes
    def shapes(self) -> list[tuple[int, int]]:
        """Every (T, S) bucket, decode ones first, each family in increasing size."""
        return [(b, b) for b in self.decode_sizes] + [(t, self.max_num_seqs) for t in self.token_sizes]

    def bucket_for(self, num_tokens: int, num_seqs: int, num_logits: int, decode: bool) -> tuple[int, int] | None:
        """The smallest captured shape holding a step, or None (run it uncaptured)."""
        if num_logits > num_seqs or num_seqs > self.max_num_seqs:
            return None
        if decode:
            for b in self.decode_sizes:
                if b >= num_seqs:
                    return (b, b)
        for t in self.token_sizes:
            if t >= num_tokens:
                return (t, self.max_num_seqs)
        return None

    @staticmethod
    def takes_argmax(shape: tuple[int, int]) -> bool:
        """Whether bucket `shape` computes its rows' greedy ids too: a decode bucket (T == S; a mixed bucket has
        more tokens than sequences) of at most GRAPH_ARGMAX_MAX_ROWS sequences."""
        return shape[0] == shape[1] <= GRAPH_ARGMAX_MAX_ROWS

    def _inputs(self, shape: tuple[int, int]) -> dict[str, torch.Tensor]:
        """Bucket `shape`'s graph inputs: its static views and the caches."""
        return {**self.staged[shape].views, **self.kv_cache.tensors}

    # ------------------------------------------------------------------ capture
    def capture(self) -> None:
        """Capture every shape, largest first (so smaller ones reuse its memory pool). A shape whose capture
        fails (out of memory, an op that cannot run in a graph) is skipped (its steps run uncaptured) and
        logged."""
        if not self.use_graphs:
            return
        start = time.perf_counter()
        pool = None
        for shape in sorted(self.shapes(), reverse=True):
            inputs = self._inputs(shape)
            argmax = self.takes_argmax(shape)
            try:
                for _ in range(2):  # warm-up: Triton compiles and autotunes outside the capture
                    warm = self.compiled(**inputs)[0]
                    if argmax:  # (its first call also sizes the kernel's workspace, outside the capture)
                        greedy_argmax(warm)
                if self.logits is None:  # the largest shape comes first: its rows are the most any graph has
                    self.logits = torch.empty((self.max_num_seqs, *warm.shape[1:]), dtype=warm.dtype,
                                              device=self.device)
                del warm
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                keep = shape[1] <= OWN_LOGITS_MAX_ROWS  # a small bucket answers with the graph's own output
                with torch.cuda.graph(graph, pool=pool):
                    out = self.compiled(**inputs)[0]
                    ids = greedy_argmax(out) if argmax else None
                    if not keep:
                        self.logits[:out.shape[0]].copy_(out)
                if keep:
                    self.own_logits[shape] = out
                if ids is not None:
                    self.own_ids[shape] = ids
                del out  # unless kept, its memory goes back to the pool, for the next (smaller) capture to reuse
            except torch.OutOfMemoryError:
                logger.warning("CUDA graph for %d tokens x %d sequences: out of memory, runs uncaptured", *shape)
                torch.cuda.empty_cache()
                continue
            except RuntimeError as exc:  # e.g. a host sync inside an op: not capturable
                logger.warning("CUDA graph for %d tokens x %d sequences could not be captured (%s: %s); its steps "
                               "run uncaptured", *shape, type(exc).__name__, str(exc).splitlines()[0])
                torch.cuda.synchronize(self.device)
                continue
            pool = graph.pool()
            self.graphs[shape] = graph
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start
        self.staged = {shape: staged for shape, staged in self.staged.items() if shape in self.graphs}
        self.decode_sizes = [b for b in self.decode_sizes if (b, b) in self.graphs]
        self.token_sizes = [t for t in self.token_sizes if (t, self.max_num_seqs) in self.graphs]

    # ------------------------------------------------------------------ replay
    def _padded(self, spec: InputSpec, real: tuple[int, ...], shape: tuple[int, int]) -> tuple[int, ...]:
        """The extent of `spec`'s input that a step of extent `real` fills in bucket `shape`: the bucket's size
        along padded dimensions, the step's own along the others (a block table's columns)."""
        return tuple(p if name in PADDED_DIMS else r for p, r, name in zip(self._sizes(spec, shape), real, spec.shape))

    def _extent(self, spec: InputSpec, field, real: tuple[int, ...], shape: tuple[int, int]
                ) -> tuple[tuple[int, ...], int]:
        """(`_padded`, the byte just past what the copy of a step of extent `real` must move for this input),
        memoized: a decode step asks the same every time (only a block table's width changes, one column per
        block_size tokens), and computing it took a third of the staging's host time."""
        key = (shape, spec.name, real)
        hit = self._extents.get(key)
        if hit is None:
            if len(self._extents) >= 4096:  # mixed steps have a token count per step: keep the memo bounded
                self._extents.clear()
            used = field.nbytes if spec.pad is not None else _prefix_elements(real, field.shape) * spec.dtype.itemsize
            hit = self._extents[key] = (self._padded(spec, real, shape), field.offset + used)
        return hit

    def run(self, inputs: StepInputs, plan, shape: tuple[int, int]) -> torch.Tensor:
        """Run a step (its inputs on the host; `plan` gives its sizes) in padded shape `shape`: its values and
        padding written into the bucket's host staging buffer, one copy to the static inputs, the pending ids
        fed on the device, then the replay; returns its logits rows."""
        staged = self.staged[shape]
        host = staged.begin()
        end = 0
        for spec, field in self._layout[shape]:
            value = inputs.host[spec.name]
            real = _shape(value)
            padded, extent = self._extent(spec, field, real, shape)
            write_padded(host[spec.name], spec, value, real, padded)
            end = max(end, extent)
        staged.upload(end)
        inputs.feed(staged.views)
        return self._replay(plan, shape)

    def run_device(self, inputs: dict[str, torch.Tensor], plan, shape: tuple[int, int]) -> torch.Tensor:
        """`run` for inputs already on the device (a tensor-parallel rank's): device copies into the views."""
        views = self.staged[shape].views
        for spec in self.specs:
            value = inputs[spec.name]
            real = tuple(value.shape)
            write_padded(views[spec.name], spec, value, real, self._padded(spec, real, shape))
        return self._replay(plan, shape)

    def fence_ids(self, event) -> None:
        """The ids of the last replay (`last_ids`) are read by work on another stream that ends at `event` (the
        engine's copy of them to the host): the next replay, which may rewrite them, waits for it on the device
        (the host does not wait)."""
        self._ids_fence = event

    def _replay(self, plan, shape: tuple[int, int]) -> torch.Tensor:
        """Replay bucket `shape` (on a CPU: run it eagerly); its first num_logits logits rows, and in `last_ids`
        their greedy ids where the bucket `takes_argmax` (else None)."""
        n = plan.num_logits
        if self.use_graphs:
            if self._ids_fence is not None:
                torch.cuda.current_stream(self.device).wait_event(self._ids_fence)
                self._ids_fence = None
            self.graphs[shape].replay()
            ids = self.own_ids.get(shape)
            self.last_ids = ids[:n] if ids is not None else None
            return self.own_logits.get(shape, self.logits)[:n]
        out = self.compiled(**self._inputs(shape))[0]
        self.last_ids = greedy_argmax(out)[:n] if self.takes_argmax(shape) else None
        return out[:n]


def _shape(value) -> tuple[int, ...]:
    return tuple(value.shape) if isinstance(value, (np.ndarray, torch.Tensor)) else np.shape(value)


def _prefix_elements(real: tuple[int, ...], full: tuple[int, ...]) -> int:
    """Elements of a C-contiguous `full`-shaped array up to and including the last one of its leading `real`
    region (0 when that region is empty)."""
    if not all(real):
        return 0
    strides = np.cumprod((1,) + tuple(full[:0:-1]))[::-1]
    return int(sum((r - 1) * st for r, st in zip(real, strides))) + 1


def write_padded(dst: HostView, spec: InputSpec, value, real: tuple[int, ...], padded: tuple[int, ...]) -> None:
    """Write `value` into the leading `real` part of `dst` (host or device) and pad the rest of each padded
    dimension up to `padded` with the spec's `pad` (None: left as it was)."""
    assign(dst, tuple(slice(0, n) for n in real), value)
    if spec.pad is None:
        return
    for dim, name in enumerate(spec.shape):
        if name not in PADDED_DIMS or real[dim] >= padded[dim]:
            continue
        region = tuple(slice(0, padded[i]) if i != dim else slice(real[dim], padded[dim]) for i in range(len(real)))
        if spec.pad == "last":  # repeat the last real element along this dimension
            dst[region] = dst[tuple(slice(0, padded[i]) if i != dim else slice(real[dim] - 1, real[dim])
                                    for i in range(len(real)))]
        else:
            dst[region] = spec.pad
