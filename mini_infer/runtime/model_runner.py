"""Turns one scheduled step into the compiled graph's inputs and runs it.

For every scheduled (sequence, n) it packs the n tokens after the sequence's computed ones into a `StepBatch`
(positions, cache slots, block tables, context lengths, query offsets, and the rows whose logits the engine
needs: each sampling sequence's last row, plus prompt rows for prompt logprobs), then builds every graph input
the passes declared through its `InputSpec` builder, on the host (`StepInputs`). Where they go depends on how the
step runs: a captured shape's staging buffer (cuda_graphs.py: one copy, already padded), or one packed copy for
an uncaptured step; the caches are added by name. Input ids that are still on the device (async scheduling:
the previous step's sampled ids) are written into the step's device input ids after the copy. It knows no
pass's inputs; it never inspects the graph or samples.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from mini_infer.compiler import CompiledModel
from mini_infer.contract import StepBatch
from mini_infer.contract.inputs import INPUT_IDS, UNCAPTURED_QUERY_ROWS
from mini_infer.runtime.kv_cache import KVCache
from mini_infer.runtime.sequence import Sequence
from mini_infer.runtime.transfer import to_device, to_device_many


@dataclass
class StepPlan:
    """Where each scheduled sequence's logits land in the output rows."""

    sample_rows: list[int] = field(default_factory=list)  # one per sampling sequence, in scheduled order
    # seq_id -> (first output row, number of rows, position of the first row) for prompt logprobs
    prompt_rows: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    num_tokens: int = 0
    num_seqs: int = 0
    num_logits: int = 0
    max_query_len: int = 0  # the longest query run of the step


@dataclass
class PendingIds:
    """Input ids still on the device: row `src[i]` of `source` is the step's token `dst[i]`."""

    dst: list[int]
    src: list[int]
    source: torch.Tensor  # [rows] on the device (the previous step's sampled ids)


@dataclass
class StepInputs:
    """One step's declared graph inputs as host values (not yet on the device), and its pending ids."""

    host: dict[str, np.ndarray]
    pending: PendingIds | None = None

    def feed(self, device_inputs: dict[str, torch.Tensor]) -> None:
        """Write the pending ids into the step's device input ids: one device copy when both row sets are
        contiguous ranges (every decode step of an unchanged batch), else one index copy and a scatter."""
        p = self.pending
        if p is None:
            return
        ids = device_inputs[INPUT_IDS.name][0]
        n = len(p.dst)
        if p.dst == list(range(p.dst[0], p.dst[0] + n)) and p.src == list(range(p.src[0], p.src[0] + n)):
            ids[p.dst[0]: p.dst[0] + n].copy_(p.source[p.src[0]: p.src[0] + n])
            return
        index = to_device(np.array([p.dst, p.src], dtype=np.int64), torch.int64, p.source.device)
        ids[index[0]] = p.source[index[1]].to(ids.dtype)


class ModelRunner:
    """Runs the compiled graph over a packed batch with the paged cache."""

    def __init__(self, compiled: CompiledModel, kv_cache: KVCache, device: torch.device) -> None:
        self.compiled = compiled
        self.kv_cache = kv_cache
        self.device = device
        self.block_size = kv_cache.block_size
        self.cuda_graphs = None  # a CUDAGraphRunner once enable_cuda_graphs() ran
        self.last_greedy_ids: torch.Tensor | None = None  # see execute()
        # Host mirror of block tables, one row per recently scheduled sequence, updated incrementally:
        # a sequence's table only grows in place (the block manager gives a reset table a new list).
        self._tables = np.zeros((64, 8), dtype=np.int32)
        self._table_rows: dict[int, list] = {}  # seq_id -> [row, the table list, entries mirrored]
        self._free_rows = list(range(63, -1, -1))
        self.input_specs = compiled.input_specs
        cache_names = set(kv_cache.tensors)
        missing = [n for n in compiled.input_names if n not in cache_names
                   and n not in {s.name for s in self.input_specs}]
        if missing:
            raise ValueError(f"the compiled graph takes inputs {missing} that no cache provides")
        if "logits_indices" not in {s.name for s in self.input_specs}:
            raise ValueError("the compiled graph returns logits for every token: the engine needs the "
                             "select_logits pass")

    def _mirror_rows(self, seqs: list[Sequence], width: int) -> np.ndarray:
        """Rows of the host block-table mirror holding `seqs`' tables (at least `width` columns synced)."""
        if width > self._tables.shape[1]:
            self._grow_tables(self._tables.shape[0], max(width, 2 * self._tables.shape[1]))
        rows = np.empty(len(seqs), dtype=np.int64)
        for i, seq in enumerate(seqs):
            table = seq.block_table
            entry = self._table_rows.get(seq.seq_id)
            if entry is None or entry[1] is not table:  # new to the mirror, or its table was reset
                if entry is None and not self._free_rows:
                    self._evict_rows({s.seq_id for s in seqs}, len(seqs))
                row = entry[0] if entry is not None else self._free_rows.pop()
                entry = self._table_rows[seq.seq_id] = [row, table, 0]
            n = len(table)
            if entry[2] < n:
                m = min(n, self._tables.shape[1])
                self._tables[entry[0], entry[2]:m] = table[entry[2]:m]
                entry[2] = m
            rows[i] = entry[0]
        return rows

    def _evict_rows(self, keep: set[int], needed: int) -> None:
        """Free the mirror rows of sequences not in `keep`; grow the mirror if a step needs more rows."""
        for seq_id in [k for k in self._table_rows if k not in keep]:
            self._free_rows.append(self._table_rows.pop(seq_id)[0])
        have = self._tables.shape[0]
        if have < needed:
            self._grow_tables(2 * needed, self._tables.shape[1])
            self._free_rows.extend(range(2 * needed - 1, have - 1, -1))

    def _grow_tables(self, rows: int, cols: int) -> None:
        grown = np.zeros((rows, cols), dtype=np.int32)
        grown[: self._tables.shape[0], : self._tables.shape[1]] = self._tables
        self._tables = grown

    @staticmethod
    def _token_slice(seq: Sequence, start: int, end: int) -> list[int]:
        """seq.token_ids[start:end] without concatenating the whole prompt and output."""
        prompt = seq.prompt_token_ids
        p = len(prompt)
        if end <= p:
            return prompt[start:end]
        if start >= p:
            return seq.output_token_ids[start - p: end - p]
        return prompt[start:] + seq.output_token_ids[: end - p]

    def prepare(self, scheduled: list[tuple[Sequence, int]], sample: list[bool],
                prompt_logprob_seqs: set[int] | None = None) -> tuple[StepInputs, StepPlan]:
        """Graph inputs for one step (on the host) and where each needed logits row will be."""
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        qsl = [0]
        logits_idx: list[int] = []
        plan = StepPlan()
        prompt_logprob_seqs = prompt_logprob_seqs or set()
        for (seq, n), samples in zip(scheduled, sample):
            start = seq.num_computed_tokens
            end = start + n
            row0 = len(ids)
            table = seq.block_table
            if n == 1:  # decode: no ranges
                ids.append(self._token_slice(seq, start, end)[0])
                pos.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                ids.extend(self._token_slice(seq, start, end))
                pos.extend(range(start, end))
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            seq_lens.append(end)
            qsl.append(len(ids))
            if seq.seq_id in prompt_logprob_seqs:
                # rows predicting prompt tokens start+1 .. min(end, P-1): positions start .. min(end, P-1)-1
                last = min(end, seq.num_prompt_tokens - 1)
                if last > start:
                    plan.prompt_rows[seq.seq_id] = (len(logits_idx), last - start, start)
                    logits_idx.extend(range(row0, row0 + last - start))
            if samples:
                plan.sample_rows.append(len(logits_idx))
                logits_idx.append(len(ids) - 1)
        width = -(-max(seq_lens) // bs)
        rows = self._mirror_rows([seq for seq, _ in scheduled], width)
        step = StepBatch(
            token_ids=np.asarray(ids, dtype=np.int64), positions=np.asarray(pos, dtype=np.int64),
            slot_mapping=np.asarray(slots, dtype=np.int64), seq_lens=np.asarray(seq_lens, dtype=np.int32),
            query_start_loc=np.asarray(qsl, dtype=np.int32), block_tables=self._tables[rows, :width],
            logits_indices=np.asarray(logits_idx or [len(ids) - 1], dtype=np.int64), block_size=bs)
        plan.num_tokens, plan.num_seqs, plan.num_logits = step.num_tokens, step.num_seqs, step.num_logits
        plan.max_query_len = max(n for _, n in scheduled)
        return StepInputs({spec.name: spec.build(step) for spec in self.input_specs}), plan

    def device_inputs(self, inputs: StepInputs) -> dict[str, torch.Tensor]:
        """Every graph input of an uncaptured step on the device: the declared ones in one packed copy (the
        pending ids fed after it), then the caches."""
        values = {spec.name: (inputs.host[spec.name], spec.dtype) for spec in self.input_specs}
        on_device = to_device_many(values, self.device)
        inputs.feed(on_device)
        on_device.update(self.kv_cache.tensors)
        return on_device

    def enable_cuda_graphs(self, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int = 0,
                           force: bool = False) -> float:
        """Capture decode steps (and, with `max_num_batched_tokens`, mixed steps up to that many tokens) as
        CUDA graphs; returns the capture time in seconds. On CPU nothing is captured unless `force`, which
        runs steps eagerly in their padded shapes (to test the padding)."""
        from mini_infer.runtime.cuda_graphs import CUDAGraphRunner

        if self.device.type != "cuda" and not force:
            return 0.0
        max_blocks = -(-max_model_len // self.block_size)
        self.cuda_graphs = CUDAGraphRunner(self.compiled, self.kv_cache, max_num_seqs, max_blocks, self.device,
                                           max_num_batched_tokens)
        self.cuda_graphs.capture()
        return self.cuda_graphs.capture_seconds

    def fence_greedy_ids(self, event) -> None:
        """`last_greedy_ids` are read by work on another stream ending at `event` (cuda_graphs.py, `fence_ids`)."""
        if self.cuda_graphs is not None:
            self.cuda_graphs.fence_ids(event)

    def _has_uncapturable_run(self, plan: StepPlan) -> bool:
        """Whether the step holds a query run at least as long as a pass declared its op handles on the host
        (UNCAPTURED_QUERY_ROWS: paged_attention's long-prefill route), which a captured graph cannot replay."""
        rows = self.compiled.context.info.get(UNCAPTURED_QUERY_ROWS)
        return rows is not None and plan.max_query_len >= rows

    def execute(self, inputs: StepInputs | dict[str, torch.Tensor], plan: StepPlan, decode: bool = False,
                padded: bool = True) -> torch.Tensor:
        """Run the graph; returns logits [rows, vocab]. `inputs` come from `prepare` (host values), or are every
        graph input already on the device (a tensor-parallel rank's). `decode` marks a pure decode step (one
        token per sequence, each sampled). With graphs enabled and `padded`, a step that fits a captured shape
        replays it; otherwise (prompt logprobs, oversized steps, a query run `_has_uncapturable_run`) the graph
        runs as is. `last_greedy_ids` then holds the greedy ids of the returned rows where the replayed bucket
        computed them (cuda_graphs.py, GRAPH_ARGMAX_MAX_ROWS), else None."""
        graphs = self.cuda_graphs
        on_host = isinstance(inputs, StepInputs)
        self.last_greedy_ids = None
        if graphs is not None and padded and not self._has_uncapturable_run(plan):
            shape = graphs.bucket_for(plan.num_tokens, plan.num_seqs, plan.num_logits, decode)
            if shape is not None:
                logits = graphs.run(inputs, plan, shape) if on_host else graphs.run_device(inputs, plan, shape)
                self.last_greedy_ids = graphs.last_ids
                return logits
        return self.compiled(**(self.device_inputs(inputs) if on_host else inputs))[0]
