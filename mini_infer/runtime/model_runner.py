"""Turns one scheduled step into the compiled graph's inputs and runs it.

For every scheduled (sequence, n) it packs the n tokens after the sequence's computed ones into the row,
with their positions, cache slots, block tables, context lengths and query offsets, and asks for logits at
the rows the engine needs (each sampling sequence's last row, plus prompt rows for prompt logprobs). It
knows the graph's inputs by name only; it never inspects the graph or samples.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mini_infer.compiler import CompiledModel
from mini_infer.runtime.kv_cache import KVCache
from mini_infer.runtime.sequence import Sequence


@dataclass
class StepPlan:
    """Where each scheduled sequence's logits land in the output rows."""

    sample_rows: list[int] = field(default_factory=list)  # one per sampling sequence, in scheduled order
    # seq_id -> (first output row, number of rows, position of the first row) for prompt logprobs
    prompt_rows: dict[int, tuple[int, int, int]] = field(default_factory=dict)


class ModelRunner:
    """Runs the compiled graph over a packed batch with the paged cache."""

    def __init__(self, compiled: CompiledModel, kv_cache: KVCache, device: torch.device) -> None:
        self.compiled = compiled
        self.kv_cache = kv_cache
        self.device = device
        self.block_size = kv_cache.block_size
        self.cuda_graphs = None  # a CUDAGraphDecoder once enable_cuda_graphs() ran
        names = set(compiled.input_names)
        for required in ("slot_mapping", "block_tables", "seq_lens", "query_start_loc", "logits_indices"):
            if required not in names:
                raise ValueError(f"the compiled graph lacks input {required!r}: the engine needs the "
                                 "paged_attention and select_logits passes")

    def _tensor(self, data, dtype: torch.dtype) -> torch.Tensor:
        t = torch.tensor(data, dtype=dtype)
        return t.to(self.device, non_blocking=True) if self.device.type != "cpu" else t

    def prepare(self, scheduled: list[tuple[Sequence, int]], sample: list[bool],
                prompt_logprob_seqs: set[int] | None = None) -> tuple[dict[str, torch.Tensor], StepPlan]:
        """Graph inputs for one step and where each needed logits row will be."""
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        qsl = [0]
        tables: list[list[int]] = []
        logits_idx: list[int] = []
        plan = StepPlan()
        prompt_logprob_seqs = prompt_logprob_seqs or set()
        for (seq, n), samples in zip(scheduled, sample):
            start = seq.num_computed_tokens
            end = start + n
            row0 = len(ids)
            ids.extend(seq.token_ids[start:end])
            positions = range(start, end)
            pos.extend(positions)
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in positions)
            seq_lens.append(end)
            qsl.append(len(ids))
            tables.append(table[: -(-end // bs)])
            if seq.seq_id in prompt_logprob_seqs:
                # rows predicting prompt tokens start+1 .. min(end, P-1): positions start .. min(end, P-1)-1
                last = min(end, seq.num_prompt_tokens - 1)
                if last > start:
                    plan.prompt_rows[seq.seq_id] = (len(logits_idx), last - start, start)
                    logits_idx.extend(range(row0, row0 + last - start))
            if samples:
                plan.sample_rows.append(len(logits_idx))
                logits_idx.append(len(ids) - 1)
        width = max(len(t) for t in tables)
        block_tables = [t + [0] * (width - len(t)) for t in tables]
        inputs = {
            "input_ids": self._tensor(ids, torch.int64)[None],
            "position_ids": self._tensor(pos, torch.int64)[None],
            "slot_mapping": self._tensor(slots, torch.int64),
            "block_tables": self._tensor(block_tables, torch.int32),
            "seq_lens": self._tensor(seq_lens, torch.int32),
            "query_start_loc": self._tensor(qsl, torch.int32),
            "logits_indices": self._tensor(logits_idx or [len(ids) - 1], torch.int64),
        }
        inputs.update(self.kv_cache.tensors)
        return inputs, plan

    def enable_cuda_graphs(self, max_num_seqs: int, max_model_len: int) -> float:
        """Capture decode steps as CUDA graphs (CUDA only); returns the capture time in seconds."""
        from mini_infer.runtime.cuda_graphs import CUDAGraphDecoder

        if self.device.type != "cuda":
            return 0.0
        max_blocks = -(-max_model_len // self.block_size)
        self.cuda_graphs = CUDAGraphDecoder(self.compiled, self.kv_cache, max_num_seqs, max_blocks, self.device)
        self.cuda_graphs.capture()
        return self.cuda_graphs.capture_seconds

    def execute(self, inputs: dict[str, torch.Tensor], decode_seqs: int = 0) -> torch.Tensor:
        """Run the graph; returns logits [rows, vocab]. `decode_seqs` > 0 marks a pure decode step of that
        many sequences (one token each, each sampled), which replays a captured CUDA graph when one fits."""
        graphs = self.cuda_graphs
        if decode_seqs and graphs is not None and graphs.bucket_for(decode_seqs) is not None:
            return graphs.run(inputs, decode_seqs)
        return self.compiled(**inputs)[0]
