"""Start-up runs of the long query runs that CUDA graphs never replay, so no request pays their first use.

A pass whose op takes query runs of `info[UNCAPTURED_QUERY_ROWS]` rows or more down another path (one that reads
the step's lengths on the host: paged_attention's long-prefill route) makes every step holding such a run
uncaptured. Whatever that path sets up on its first use (library handles, backend probes, kernel plans per
shape) would otherwise land on the first long prompt's first token, and what it allocates is not in the
padding step's profile (runtime/memory.py: every token there is padding, no sequence has a run). So, before the
cache is sized, the engine runs the compiled graph on the steps a lone prompt's longest chunks make: the
largest chunk a lone prompt gets, min(token budget, max_model_len) tokens, at context 0, then after contexts
doubling from one chunk, then after the longest context it can follow. Kernels that set up per context length
do it per range of lengths (cuDNN's plan key holds the context rounded up to a power of two: a doubling ladder
from a power-of-two chunk meets every range up to the longest), so a prompt of any length then finds its chunks'
set-up done; what that costs is logged (a forward per step: 4 for a 32,032-token model with 8,192-token
chunks). Each runs over a scratch cache of its own blocks (the real cache does not exist yet and is never
touched), and its peak memory on a GPU is measured for the activation reserve (the longest context's step
gathers the most).

This module picks those steps and runs them through the compiled graph; it reads nothing of the path they warm
but the declared run length, and it does not decide the reserve (the engine adds the peak to memory.py's
profile).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from mini_infer.compiler import CompiledModel
from mini_infer.contract import StepBatch
from mini_infer.runtime.kv_cache import KVCache
from mini_infer.runtime.transfer import to_device


@dataclass
class LongRunWarmup:
    """What the start-up runs did: the (context, new tokens) of each step, their wall time, and the largest
    step's peak memory above what was allocated before it (0 off CUDA, where nothing is measured)."""

    chunks: list[tuple[int, int]]
    seconds: float
    peak_bytes: int

    def line(self) -> str:
        contexts = ", ".join(str(c) for c, _ in self.chunks)
        return (f"long query runs warmed at start-up: {len(self.chunks)} step(s) of {self.chunks[0][1]} tokens "
                f"(context {contexts}) in {self.seconds:.2f}s, peak {self.peak_bytes / 1e9:.2f} GB")


def long_run_chunks(min_rows: int | None, max_num_batched_tokens: int, max_model_len: int,
                    block_size: int) -> list[tuple[int, int]]:
    """The (context, new tokens) steps to run at start-up: none when no pass declared a run length (`min_rows`
    None) or a lone prompt's largest chunk, min(max_num_batched_tokens, max_model_len) tokens, is shorter than
    it; else that chunk at context 0, after contexts of 1, 2, 4, ... chunks (in whole blocks) shorter than the
    longest context, and after the longest context it can follow (max_model_len less the chunk, rounded down to
    a whole block), when there is one."""
    chunk = min(max_num_batched_tokens, max_model_len)
    if min_rows is None or chunk < min_rows:
        return []
    longest = (max_model_len - chunk) // block_size * block_size
    contexts = [0]
    context = -(-chunk // block_size) * block_size
    while context < longest:
        contexts.append(context)
        context *= 2
    if longest > 0:
        contexts.append(longest)
    return [(c, chunk) for c in contexts]


def lone_chunk_step(context: int, num_tokens: int, block_size: int) -> tuple[StepBatch, int]:
    """One sequence's step of `num_tokens` new tokens at positions context .. context + num_tokens - 1 after
    `context` cached ones (a multiple of `block_size`), its last row's logits asked for, and the number of blocks
    of the scratch cache it runs on: the new tokens' own blocks, written as a prefill writes them, and one more,
    which every context entry of the block table names (read as the context, never written)."""
    if context % block_size:
        raise ValueError(f"context {context} is not a multiple of the block size {block_size}")
    new_blocks = -(-num_tokens // block_size)
    table = np.concatenate([np.full(context // block_size, new_blocks, dtype=np.int32),
                            np.arange(new_blocks, dtype=np.int32)])[None]
    positions = np.arange(context, context + num_tokens, dtype=np.int64)
    slots = table[0, positions // block_size].astype(np.int64) * block_size + positions % block_size
    step = StepBatch(
        token_ids=np.zeros(num_tokens, dtype=np.int64), positions=positions, slot_mapping=slots,
        seq_lens=np.array([context + num_tokens], dtype=np.int32),
        query_start_loc=np.array([0, num_tokens], dtype=np.int32), block_tables=table,
        logits_indices=np.array([num_tokens - 1], dtype=np.int64), block_size=block_size)
    return step, new_blocks + 1


def warm_long_runs(compiled: CompiledModel, chunks: list[tuple[int, int]], block_size: int,
                   device: torch.device) -> LongRunWarmup:
    """Run the compiled graph once per (context, new tokens) step of `chunks` (`lone_chunk_step`), each over a
    scratch cache freed after it; on CUDA, measure each step's peak above what was allocated before it."""
    cuda = device.type == "cuda"
    peak = 0
    t0 = time.perf_counter()
    for context, num_tokens in chunks:
        step, num_blocks = lone_chunk_step(context, num_tokens, block_size)
        cache = KVCache(compiled.cache_specs, num_blocks, block_size, device)
        inputs = {s.name: to_device(s.build(step), s.dtype, device) for s in compiled.input_specs}
        inputs.update(cache.tensors)
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        compiled(**inputs)
        if cuda:
            torch.cuda.synchronize(device)
            peak = max(peak, torch.cuda.max_memory_allocated(device) - base)
        del inputs, cache
    if cuda:
        torch.cuda.empty_cache()
    return LongRunWarmup(list(chunks), time.perf_counter() - t0, peak)
