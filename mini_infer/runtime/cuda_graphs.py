"""CUDA graphs for decode and mixed (prefill + decode) steps: the compiled graph captured once per padded
shape, replayed with static input buffers.

A step's shape is (T tokens, S sequences, L logits rows). Two families of padded shapes are captured:
  * decode buckets: T = S = L = b for b in 1, 2, 4, 8, 16, 24, 32, ... max_num_seqs (one new token per
    sequence, every sequence sampled);
  * mixed buckets: T in token buckets above max_num_seqs up to max_num_batched_tokens, with S = L =
    max_num_seqs (any mix of prefill chunks and decodes, at most one logits row per sequence).
A step runs in the smallest bucket that holds it: its inputs fill the first rows of the static buffers and
the rest is padding (token rows: slot -1, nothing written, owned by no sequence so attention yields zeros;
sequence rows: length 0, no query rows; logits rows: index 0, ignored). The graph is replayed and the first
L rows of its logits are the answer. Steps that fit no bucket (prompt logprobs, more tokens than the token
budget) run uncaptured.

On a CPU device nothing is captured: the padded shape runs eagerly through the same static buffers, which
is how the padding rules are tested without a GPU. This module captures and replays; it does not build
step inputs (model_runner.py) or choose what to run (the engine).
"""

from __future__ import annotations

import logging
import time

import torch

from mini_infer.compiler import CompiledModel
from mini_infer.runtime.kv_cache import KVCache

logger = logging.getLogger(__name__)


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
    """Captured graphs keyed by padded shape (T, S), sharing one memory pool and one set of static inputs."""

    def __init__(self, compiled: CompiledModel, kv_cache: KVCache, max_num_seqs: int, max_blocks_per_seq: int,
                 device: torch.device, max_num_batched_tokens: int = 0) -> None:
        self.compiled = compiled
        self.kv_cache = kv_cache
        self.device = device
        self.max_num_seqs = max_num_seqs
        self.decode_sizes = decode_buckets(max_num_seqs)
        self.token_sizes = token_buckets(max_num_seqs, max_num_batched_tokens) if max_num_batched_tokens else []
        t_max = max([max_num_seqs, *self.token_sizes])
        s = max_num_seqs
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        self.static = {
            "input_ids": torch.zeros(1, t_max, **i64),
            "position_ids": torch.zeros(1, t_max, **i64),
            "slot_mapping": torch.full((t_max,), -1, **i64),
            "block_tables": torch.zeros(s, max_blocks_per_seq, **i32),
            "seq_lens": torch.zeros(s, **i32),
            "query_start_loc": torch.zeros(s + 1, **i32),
            "logits_indices": torch.zeros(s, **i64),
        }
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.capture_seconds = 0.0
        self.use_graphs = device.type == "cuda"

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

    def _inputs(self, shape: tuple[int, int]) -> dict[str, torch.Tensor]:
        t, s = shape
        st = self.static
        views = {
            "input_ids": st["input_ids"][:, :t], "position_ids": st["position_ids"][:, :t],
            "slot_mapping": st["slot_mapping"][:t], "block_tables": st["block_tables"][:s],
            "seq_lens": st["seq_lens"][:s], "query_start_loc": st["query_start_loc"][: s + 1],
            "logits_indices": st["logits_indices"][:s],
        }
        views.update(self.kv_cache.tensors)
        return views

    # ------------------------------------------------------------------ capture
    def capture(self) -> None:
        """Capture every shape, largest first (so smaller ones reuse its memory pool). A shape whose capture
        runs out of memory is skipped (its steps run uncaptured) and logged."""
        if not self.use_graphs:
            return
        start = time.perf_counter()
        pool = None
        # all-padding inputs: no cache writes, no attention; the graph still runs every kernel
        self.static["slot_mapping"].fill_(-1)
        self.static["seq_lens"].zero_()
        self.static["query_start_loc"].zero_()
        self.static["logits_indices"].zero_()
        for shape in sorted(self.shapes(), reverse=True):
            inputs = self._inputs(shape)
            try:
                for _ in range(2):  # warm-up: Triton compiles and autotunes outside the capture
                    self.compiled(**inputs)
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self.compiled(**inputs)
            except torch.OutOfMemoryError:
                logger.warning("CUDA graph for %d tokens x %d sequences: out of memory, runs uncaptured", *shape)
                torch.cuda.empty_cache()
                continue
            pool = graph.pool()
            self.graphs[shape] = graph
            self.outputs[shape] = out
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start
        self.decode_sizes = [b for b in self.decode_sizes if (b, b) in self.graphs]
        self.token_sizes = [t for t in self.token_sizes if (t, self.max_num_seqs) in self.graphs]

    # ------------------------------------------------------------------ replay
    def run(self, inputs: dict[str, torch.Tensor], shape: tuple[int, int]) -> torch.Tensor:
        """Run a step (inputs as the eager graph takes them) in padded shape `shape`; returns its logits rows."""
        t_pad, s_pad = shape
        st = self.static
        t = inputs["input_ids"].shape[1]
        s = inputs["seq_lens"].shape[0]
        n_logits = inputs["logits_indices"].shape[0]
        st["input_ids"][:, :t].copy_(inputs["input_ids"])
        st["position_ids"][:, :t].copy_(inputs["position_ids"])
        st["slot_mapping"][:t].copy_(inputs["slot_mapping"])
        width = inputs["block_tables"].shape[1]
        st["block_tables"][:s, :width].copy_(inputs["block_tables"])
        st["seq_lens"][:s].copy_(inputs["seq_lens"])
        st["query_start_loc"][: s + 1].copy_(inputs["query_start_loc"])
        st["logits_indices"][:n_logits].copy_(inputs["logits_indices"])
        if t_pad > t:
            st["slot_mapping"][t:t_pad].fill_(-1)
        if s_pad > s:
            st["seq_lens"][s:s_pad].zero_()
            st["query_start_loc"][s + 1: s_pad + 1].fill_(t)
        if s_pad > n_logits:
            st["logits_indices"][n_logits:s_pad].zero_()
        if self.use_graphs:
            self.graphs[shape].replay()
            out = self.outputs[shape]
        else:
            out = self.compiled(**self._inputs(shape))
        return out[0][:n_logits]
