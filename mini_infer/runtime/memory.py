"""Start-up memory planning: how much the largest step needs beyond the weights, and what is left for the cache.

On a GPU the activation memory is measured, not guessed (vLLM's `profile_run`): the compiled graph runs once at
the largest step the engine will schedule — the token budget, every sequence slot, a logits row per sequence —
over a one-block cache whose metadata marks every token as padding (no cache reads or writes; every kernel
still runs and allocates at that shape), then the sampler samples those rows with every option on. The peak
above what was allocated before is the activation need. With CUDA graphs the captured graphs keep a private
pool of about one forward's peak, and uncaptured steps (prompt logprobs) need the same again from the default
pool, so both are reserved. A step holding a long query run that a pass sends down another path (uncaptured;
runtime/warmup.py runs the longest such steps at start-up and measures their peak) needs what that path allocates
beside the forward, which the padding step never shows: the default pool's share is the larger of the two.
This module measures and reports; it does not decide what to schedule.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from mini_infer.compiler import CompiledModel
from mini_infer.contract import StepBatch
from mini_infer.runtime.kv_cache import KVCache
from mini_infer.runtime.sampler import Sampler, SamplingBatch
from mini_infer.sampling_params import SamplingParams

logger = logging.getLogger("mini_infer")
GB = 1e9


def padding_step(num_tokens: int, num_seqs: int, block_size: int) -> StepBatch:
    """A step of `num_tokens` tokens and `num_seqs` sequences that reads and writes no cache: every token is
    padding (slot -1, owned by no sequence, position 0: the token budget may exceed max_model_len, and a graph
    may look positions up in a table of max_model_len rows), every sequence has length 0, one logits row per
    sequence."""
    return StepBatch(
        token_ids=np.zeros(num_tokens, dtype=np.int64), positions=np.zeros(num_tokens, dtype=np.int64),
        slot_mapping=np.full(num_tokens, -1, dtype=np.int64), seq_lens=np.zeros(num_seqs, dtype=np.int32),
        query_start_loc=np.zeros(num_seqs + 1, dtype=np.int32), block_tables=np.zeros((num_seqs, 1), np.int32),
        logits_indices=np.zeros(num_seqs, dtype=np.int64), block_size=block_size)


@dataclass
class ActivationProfile:
    """Peak bytes above the weights: one forward of the largest step, and that forward plus sampling."""

    forward_bytes: int
    step_bytes: int


def profile_activations(compiled: CompiledModel, num_tokens: int, num_seqs: int, block_size: int,
                        vocab_size: int, device: torch.device) -> ActivationProfile:
    """Run the largest step once (see the module docstring) and measure its peak memory on `device` (CUDA)."""
    from mini_infer.runtime.transfer import to_device

    cache = KVCache(compiled.cache_specs, 1, block_size, device)
    step = padding_step(num_tokens, num_seqs, block_size)
    inputs = {s.name: to_device(s.build(step), s.dtype, device) for s in compiled.input_specs}
    inputs.update(cache.tensors)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    logits = compiled(**inputs)[0]
    torch.cuda.synchronize(device)
    forward = torch.cuda.max_memory_allocated(device) - base
    worst = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, min_p=0.01, repetition_penalty=1.1,
                           presence_penalty=0.1, frequency_penalty=0.1, logprobs=20)
    rows = logits.shape[0]
    batch = SamplingBatch.build([worst] * rows, [([1, 2], [3])] * rows, None, vocab_size, device)
    Sampler()(logits, batch)
    torch.cuda.synchronize(device)
    step_peak = torch.cuda.max_memory_allocated(device) - base
    del logits, batch, inputs, cache
    torch.cuda.empty_cache()
    return ActivationProfile(forward_bytes=forward, step_bytes=step_peak)


def activation_reserve(profile: ActivationProfile, long_run_bytes: int, cuda_graphs: bool) -> int:
    """Bytes to keep free for steps: the default pool's need, the larger of the largest step with sampling and
    the longest query run's step (`long_run_bytes`, 0 when none was run), plus, with CUDA graphs, one forward's
    peak for the graphs' private pool."""
    return max(profile.step_bytes, long_run_bytes) + (profile.forward_bytes if cuda_graphs else 0)


def release_host_memory() -> None:
    """Return host memory freed by compilation (replaced weights, capture's temporaries) to the OS.

    Freed tensors go back to the C allocator, which keeps large freed regions of its heap mapped; without a
    trim the process holds the replaced originals' bytes long after they died. glibc only; elsewhere a no-op."""
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        trim = getattr(libc, "malloc_trim", None)
    except OSError:
        trim = None
    if trim is not None:
        trim(0)


def gpu_cache_budget(device: torch.device, gpu_memory_utilization: float, reserve_bytes: int) -> int:
    """Bytes left for the cache: `gpu_memory_utilization` of the GPU, minus what the process and others use
    now (weights, CUDA context), minus `reserve_bytes` for activations."""
    free, total = torch.cuda.mem_get_info(device)
    return int(total * gpu_memory_utilization - (total - free) - reserve_bytes)


def gpu_budget_shortfall(device: torch.device, gpu_memory_utilization: float, reserve_bytes: int) -> str:
    """Why `gpu_cache_budget` left nothing, in words: the share of the GPU allowed, what is in use, the activations'
    need."""
    free, total = torch.cuda.mem_get_info(device)
    return (f"gpu_memory_utilization={gpu_memory_utilization} of the GPU's {total / GB:.1f} GB allows "
            f"{total * gpu_memory_utilization / GB:.2f} GB, {(total - free) / GB:.2f} GB of the GPU are in use already "
            f"(this process's weights and CUDA context, and any other process's memory) and the activations need "
            f"{reserve_bytes / GB:.2f} GB")


@dataclass
class MemoryReport:
    """What start-up allocated, for the log line and benchmarks."""

    weights: int
    activations: int  # reserved for steps (measured peak; 0 where not measured)
    graphs: int  # CUDA-graph pools
    kv_cache: int
    kv_tokens: int
    kv_bytes_per_token: int

    def line(self) -> str:
        return (f"memory: weights {self.weights / GB:.2f} GB, activations {self.activations / GB:.2f} GB, "
                f"CUDA graphs {self.graphs / GB:.2f} GB, KV cache {self.kv_cache / GB:.2f} GB "
                f"({self.kv_tokens} tokens, {self.kv_bytes_per_token} bytes per token)")
