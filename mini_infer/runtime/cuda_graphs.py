"""CUDA graphs for decode steps: the compiled graph captured once per batch-size bucket, replayed with
static input buffers.

A decode step (one new token per sequence, every sequence sampled) of B sequences runs in the smallest
captured bucket b >= B: the step's inputs are copied into the first B rows of static buffers, rows B..b-1
are padding (slot -1: nothing written; sequence length 0: nothing attended), and the graph is replayed;
logits rows 0..B-1 are the answer. Prefill and mixed steps never come here. This module captures and
replays; it does not build step inputs (model_runner.py) or choose what to run (the engine).
"""

from __future__ import annotations

import time

import torch

from mini_infer.compiler import CompiledModel
from mini_infer.runtime.kv_cache import KVCache

_STEP_INPUTS = ("input_ids", "position_ids", "slot_mapping", "block_tables", "seq_lens", "query_start_loc",
                "logits_indices")


def decode_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, 32, ... up to max_num_seqs (always included)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 8))
    return sorted(set(sizes + [max_num_seqs]))


class CUDAGraphDecoder:
    """Captured decode graphs, one per bucket, sharing one memory pool and one set of static inputs."""

    def __init__(self, compiled: CompiledModel, kv_cache: KVCache, max_num_seqs: int, max_blocks_per_seq: int,
                 device: torch.device) -> None:
        self.compiled = compiled
        self.kv_cache = kv_cache
        self.device = device
        self.buckets = decode_buckets(max_num_seqs)
        b = self.buckets[-1]
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        self.static = {
            "input_ids": torch.zeros(1, b, **i64),
            "position_ids": torch.zeros(1, b, **i64),
            "slot_mapping": torch.full((b,), -1, **i64),
            "block_tables": torch.zeros(b, max_blocks_per_seq, **i32),
            "seq_lens": torch.zeros(b, **i32),
            "query_start_loc": torch.zeros(b + 1, **i32),
            "logits_indices": torch.arange(b, **i64),
        }
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture_seconds = 0.0

    def _inputs(self, b: int) -> dict[str, torch.Tensor]:
        s = self.static
        views = {
            "input_ids": s["input_ids"][:, :b], "position_ids": s["position_ids"][:, :b],
            "slot_mapping": s["slot_mapping"][:b], "block_tables": s["block_tables"][:b],
            "seq_lens": s["seq_lens"][:b], "query_start_loc": s["query_start_loc"][: b + 1],
            "logits_indices": s["logits_indices"][:b],
        }
        views.update(self.kv_cache.tensors)
        return views

    def capture(self) -> None:
        """Capture every bucket, largest first (so smaller ones reuse its memory pool)."""
        start = time.perf_counter()
        pool = None
        # all-padding inputs: no cache writes, no attention; the graph still runs every kernel
        self.static["slot_mapping"].fill_(-1)
        self.static["seq_lens"].zero_()
        self.static["query_start_loc"].zero_()
        for b in reversed(self.buckets):
            inputs = self._inputs(b)
            for _ in range(2):  # warm-up: Triton compiles and autotunes outside the capture
                self.compiled(**inputs)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.compiled(**inputs)
            pool = graph.pool()
            self.graphs[b] = graph
            self.outputs[b] = out
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start

    def bucket_for(self, num_seqs: int) -> int | None:
        for b in self.buckets:
            if b >= num_seqs:
                return b
        return None

    def run(self, inputs: dict[str, torch.Tensor], num_seqs: int) -> torch.Tensor:
        """Replay for a decode step of `num_seqs` sequences; `inputs` as the eager graph takes them."""
        b = self.bucket_for(num_seqs)
        if b is None:
            raise ValueError(f"no captured decode graph for {num_seqs} sequences (largest {self.buckets[-1]})")
        s, n = self.static, num_seqs
        s["input_ids"][:, :n].copy_(inputs["input_ids"])
        s["position_ids"][:, :n].copy_(inputs["position_ids"])
        s["slot_mapping"][:n].copy_(inputs["slot_mapping"])
        width = inputs["block_tables"].shape[1]
        s["block_tables"][:n, :width].copy_(inputs["block_tables"])
        s["seq_lens"][:n].copy_(inputs["seq_lens"])
        s["query_start_loc"][: n + 1].copy_(inputs["query_start_loc"])
        if b > n:
            s["slot_mapping"][n:b].fill_(-1)
            s["seq_lens"][n:b].zero_()
            s["query_start_loc"][n + 1: b + 1].fill_(n)
        self.graphs[b].replay()
        return self.outputs[b][0, :n]
