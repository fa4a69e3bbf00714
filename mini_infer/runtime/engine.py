"""The engine: requests in, a step at a time, outputs out.

`LLMEngine` loads and compiles the model, sizes and allocates the paged KV cache, and runs the loop:
schedule → run the compiled graph → sample → detokenize and check stops → report. Bad requests are refused
with a ValueError naming the field and limit before anything is queued; a failing step fails only the
sequences in it (their blocks return to the pool) and the engine keeps serving. It is single-threaded;
the async server wraps it.

A step is launched (inputs built, graph and sampler queued on the device, counts advanced, a placeholder
token appended for every sampled sequence) and then completed (sampled ids read back, placeholders
replaced, stops checked). With `async_scheduling` the next step is scheduled and launched before the
previous one is completed, so the host's work overlaps the device's: the next step reads the previous
step's sampled ids on the device, and a sequence that stops meanwhile has its extra row discarded.
"""

from __future__ import annotations

import functools
import itertools
import logging
import operator
import time
from dataclasses import dataclass, field

import torch

from mini_infer.compiler import CompiledModel, compile_model
from mini_infer.models.loader import LoadedModel, default_device, load_embedded_tokenizer, load_model
from mini_infer.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from mini_infer.runtime.block_manager import BlockManager
from mini_infer.runtime.detokenizer import RequestDetokenizer
from mini_infer.runtime.kv_cache import DEFAULT_CPU_KV_BYTES, KVCache, cuda_kv_budget, num_blocks_for_budget
from mini_infer.runtime.model_runner import ModelRunner
from mini_infer.runtime.sampler import Sampler, SamplerOutput, SamplingBatch, make_generator
from mini_infer.runtime.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from mini_infer.runtime.sequence import Sequence
from mini_infer.runtime.transfer import HostCopy, to_device
from mini_infer.sampling_params import SamplingParams

logger = logging.getLogger("mini_infer")

_EMBEDDED_VOCAB = 49152


def _is_int(v) -> bool:
    """An integer token id (Python or numpy/torch integer scalar), not a bool."""
    if isinstance(v, bool):
        return False
    try:
        return operator.index(v) == v
    except TypeError:
        return False


@dataclass
class EngineConfig:
    """Engine options, under vLLM's names."""

    model: str | None = None
    dtype: str = "auto"
    device: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None  # CPU: the cache budget (default 1 GiB); GPU: overrides utilization
    num_kv_blocks: int | None = None  # exact block count (tests force preemption with a tiny cache)
    passes: list[str] | None = None
    scheduling_policy: str = "fcfs"
    seed: int = 0
    served_model_name: str | None = None
    enforce_eager: bool = False  # no CUDA graphs
    load_format: str = "auto"  # "dummy": the model's architecture with random weights
    # overlap the host's scheduling with the device's previous step; None: on for CUDA (on a CPU the device's
    # work is the host's, so there is nothing to overlap)
    async_scheduling: bool | None = None

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")


PLACEHOLDER = -1  # a sampled token id not read back from the device yet


@dataclass
class _Launched:
    """A step queued on the device, not yet completed."""

    out: SchedulerOutput
    sampling: list[Sequence]
    out_index: list[int]  # per sampling sequence: its placeholder's index in output_token_ids
    so: SamplerOutput | None  # device tensors
    kind: str  # "decode" or "mixed"
    so_host: HostCopy | None = None  # so's tensors on their way to the host

    @functools.cached_property
    def pending_rows(self) -> dict[int, tuple[int, int]]:
        """seq_id -> (row of its sampled id in so.token_ids, placeholder index in its output)."""
        return {seq.seq_id: (i, j) for i, (seq, j) in enumerate(zip(self.sampling, self.out_index))}


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detoks: list[RequestDetokenizer | None]
    metrics: RequestMetrics
    logprobs: list[list] = field(default_factory=list)
    cumulative_logprob: list[float] = field(default_factory=list)
    prompt_logprobs: list | None = None
    deltas: list[tuple[str, list[int]]] = field(default_factory=list)
    error: str | None = None

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


class LLMEngine:
    """Continuous-batching engine over a compiled model and a paged KV cache."""

    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None,
                 compiled: CompiledModel | None = None) -> None:
        self.config = config = config or EngineConfig()
        self.device = torch.device(config.device) if config.device else default_device()
        t0 = time.perf_counter()
        self.loaded = loaded or load_model(config.model, dtype=config.dtype, device=self.device, seed=config.seed,
                                           load_format=config.load_format)
        self.model_config = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        text_cfg = self.model_config.get_text_config()
        self.vocab_size = text_cfg.vocab_size
        if self.tokenizer is None and self.loaded.source == "preset" and self.vocab_size == _EMBEDDED_VOCAB:
            self.tokenizer = load_embedded_tokenizer()  # presets have no tokenizer: borrow SmolLM2's for text
        self.load_seconds = time.perf_counter() - t0
        t1 = time.perf_counter()
        self.compiled = compiled or compile_model(self.loaded.model, passes=config.passes, device=self.device,
                                                  model_name=self.loaded.name)
        self.compile_seconds = time.perf_counter() - t1
        self.max_model_len = config.max_model_len or getattr(text_cfg, "max_position_embeddings", 4096)
        self.kv_cache = self._allocate_kv_cache()
        # vLLM's defaults: a larger token budget on a GPU (fewer, fuller prefill steps), 2048 elsewhere
        default_batched = 8192 if self.device.type == "cuda" else 2048
        max_batched = config.max_num_batched_tokens or max(default_batched, config.max_num_seqs)
        if not config.enable_chunked_prefill and config.max_num_batched_tokens is None:
            max_batched = max(max_batched, self.max_model_len)  # a whole prompt must fit one step (as vLLM)
        self.block_manager = BlockManager(self.kv_cache.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=max_batched,
            max_model_len=self.max_model_len, enable_chunked_prefill=config.enable_chunked_prefill,
            policy=config.scheduling_policy), self.block_manager)
        self.runner = ModelRunner(self.compiled, self.kv_cache, self.device)
        self.capture_seconds = 0.0 if config.enforce_eager else \
            self.runner.enable_cuda_graphs(config.max_num_seqs, self.max_model_len, min(max_batched, 16384))
        self.sampler = Sampler()
        self.eos_token_ids = self._eos_ids()
        self.requests: dict[str, _Request] = {}
        self.async_scheduling = config.async_scheduling if config.async_scheduling is not None \
            else self.device.type == "cuda"
        self._inflight: _Launched | None = None  # async scheduling: the step launched, not completed
        self._touched: dict[str, _Request] = {}  # requests with news since the last step() returned
        self._ids = itertools.count()
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0, "preemptions": 0,
                      "finished_requests": 0, "decode_steps": 0, "decode_seconds": 0.0, "mixed_steps": 0,
                      "mixed_seconds": 0.0}
        logger.info("engine ready: load %.1fs, compile %.1fs, KV cache %d blocks x %d tokens (%.1f MiB)",
                    self.load_seconds, self.compile_seconds, self.kv_cache.num_blocks, config.block_size,
                    self.kv_cache.nbytes / 2**20)

    # ------------------------------------------------------------------ set-up
    def _allocate_kv_cache(self) -> KVCache:
        cfg, specs = self.config, self.compiled.kv_cache_specs
        if not specs:
            raise ValueError("the compiled model declares no KV cache: run the paged_attention pass")
        if cfg.num_kv_blocks is not None:
            num_blocks = cfg.num_kv_blocks
        else:
            if cfg.kv_cache_memory_bytes is not None:
                budget = cfg.kv_cache_memory_bytes
            elif self.device.type == "cuda":
                budget = cuda_kv_budget(self.device, cfg.gpu_memory_utilization, reserve_bytes=1 << 30)
            else:
                budget = DEFAULT_CPU_KV_BYTES
            num_blocks = num_blocks_for_budget(specs, cfg.block_size, budget)
            needed = -(-self.max_model_len // cfg.block_size)
            if num_blocks < needed:
                raise ValueError(
                    f"the KV cache budget ({budget / 2**20:.0f} MiB) holds {num_blocks * cfg.block_size} tokens, "
                    f"fewer than max_model_len={self.max_model_len}: lower max_model_len or raise "
                    "gpu_memory_utilization / kv_cache_memory_bytes")
        return KVCache(specs, num_blocks, cfg.block_size, self.device)

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        gen = getattr(self.loaded.model, "generation_config", None)
        for src in (getattr(gen, "eos_token_id", None), getattr(self.model_config, "eos_token_id", None),
                    getattr(self.tokenizer, "eos_token_id", None)):
            if isinstance(src, int):
                ids.add(src)
            elif isinstance(src, (list, tuple)):
                ids.update(int(i) for i in src)
        return {i for i in ids if 0 <= i < self.vocab_size}

    # ------------------------------------------------------------------ requests
    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"model {self.loaded.name!r} has no tokenizer: pass prompts as "
                             "{'prompt_token_ids': [...]}")
        return list(self.tokenizer.encode(prompt))

    def validate_prompt(self, token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError naming the field and limit for a prompt or options the engine cannot run."""
        if not token_ids:
            raise ValueError("prompt must not be empty (0 tokens)")
        bad = [t for t in token_ids if not _is_int(t) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids must be integers in [0, {self.vocab_size}); got {bad[:5]}")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt is {len(token_ids)} tokens; max_model_len is {self.max_model_len}, which "
                             "must leave room for at least one generated token")
        capacity = self.kv_cache.num_blocks * self.config.block_size
        if len(token_ids) >= capacity:
            raise ValueError(f"prompt is {len(token_ids)} tokens; the KV cache holds {capacity} tokens in all, "
                             "which must leave room for at least one generated token")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        params.validate(self.vocab_size)
        if params.stop and self.tokenizer is None:
            raise ValueError(f"stop strings need a tokenizer and model {self.loaded.name!r} has none: "
                             "use stop_token_ids")

    def add_request(self, request_id: str | None, prompt: str | list[int] | dict,
                    params: SamplingParams | None = None, priority: int = 0,
                    arrival_time: float | None = None) -> str:
        """Queue a request. `prompt` is text, a list of token ids, or {"prompt_token_ids": [...]}."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text = None
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                text = prompt["prompt"]
                ids = self.tokenize(text)
            else:
                raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
        elif isinstance(prompt, str):
            text = prompt
            ids = self.tokenize(prompt) if prompt else []
        else:
            ids = list(prompt)
        self.validate_prompt(ids, params)
        ids = [operator.index(t) for t in ids]
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        seqs, detoks = [], []
        for i in range(params.n):
            seq = Sequence(request_id, list(ids), params, arrival_time=arrival, priority=priority)
            seq.index = i
            seq.generator = make_generator(params.seed + i, self.device) if params.seed is not None else None
            seqs.append(seq)
            detoks.append(RequestDetokenizer(self.tokenizer, ids, params) if self.tokenizer is not None else None)
        req = _Request(request_id, text, list(ids), params, seqs, detoks, RequestMetrics(arrival),
                       logprobs=[[] for _ in seqs], cumulative_logprob=[0.0 for _ in seqs],
                       prompt_logprobs=[None] if params.prompt_logprobs is not None else None)
        self.requests[request_id] = req
        self.stats["prompt_tokens"] += len(ids)
        for seq in seqs:
            self.scheduler.add(seq)
        return request_id

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now; its KV blocks return to the pool. False if it is unknown or already done."""
        if request_id not in self.requests:
            return False
        self._drain()  # its sampled ids in flight land first (no placeholder reaches the prefix cache)
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        self._touched.pop(request_id, None)
        self.scheduler.abort(request_id)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or self.scheduler.has_unfinished() or self._inflight is not None

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ------------------------------------------------------------------ the step
    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """Run one scheduled step; returns the outputs of every request that changed (with `final_only`,
        of every request that finished: the offline path, which reads no partial outputs). With
        `async_scheduling` the outputs are those of the step launched by the previous call."""
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        self.stats["steps"] += 1
        self.stats["preemptions"] += len(out.preempted)
        touched = self._touched
        prev, self._inflight = self._inflight, None
        if prev is not None and self._needs_tokens_now(out, prev):
            self._complete_safely(prev)
            prev = None
        for seq in out.finished:  # the scheduler refused or capped these
            req = self.requests.get(seq.request_id)
            if req is not None:
                if getattr(seq, "error", None):
                    req.error = seq.error
                self._flush(req, seq)
                touched[req.request_id] = req
        launched = None
        if out.scheduled:
            try:
                launched = self._launch(out, prev)
            except Exception as exc:  # fail this step's sequences, keep serving the rest
                self._fail(out.scheduled, exc)
        if prev is not None:
            self._complete_safely(prev)
        if launched is not None:
            self.scheduler.update_after_step(out)  # after prev completed: no placeholder below the computed count
            if self.async_scheduling:
                self._inflight = launched
            else:
                self._complete_safely(launched)
        # wall time per kind of step launched (each call ends in a host sync); a call that only completes the
        # last step in flight adds its time to that step's kind
        if launched is not None:
            self.stats[f"{launched.kind}_steps"] += 1
        kind = launched.kind if launched is not None else prev.kind if prev is not None else None
        if kind is not None:
            self.stats[f"{kind}_seconds"] += time.perf_counter() - t0
        self._touched = {}
        if final_only:
            for req in touched.values():
                if not req.finished:
                    req.deltas.clear()
            return [self._output(req) for req in touched.values() if req.finished]
        return [self._output(req) for req in touched.values()]

    def _drain(self) -> None:
        """Complete the step in flight, if any (its outputs come with the next step())."""
        prev, self._inflight = self._inflight, None
        if prev is not None:
            self._complete_safely(prev)

    def _needs_tokens_now(self, out, prev: _Launched) -> bool:
        """Whether this step needs the in-flight step's ids on the host before it launches: penalties
        read the output ids, and a sequence capped by the scheduler must report its last id."""
        pending = prev.pending_rows
        if any(s.seq_id in pending for s in out.finished):
            return True
        return any(seq.seq_id in pending and seq.sampling_params.has_penalties for seq, _ in out.scheduled)

    def _fail(self, scheduled, exc: Exception) -> None:
        logger.exception("step failed")
        for seq, _ in scheduled:
            req = self.requests.get(seq.request_id)
            if req is None:
                continue
            req.error = req.error or f"{type(exc).__name__}: {exc}"
            for s in req.seqs:  # all samples of the request, scheduled this step or not
                if not s.is_finished:
                    self.scheduler.finish(s, "error")
                    self._flush(req, s)
            self._touched[req.request_id] = req

    def _launch(self, out, prev: _Launched | None) -> _Launched:
        """Build inputs, queue the graph and the sampler, advance the computed counts and append a
        placeholder for every sampled sequence. Ids still in flight from `prev` are read on the device."""
        now = time.monotonic()
        plp = {s.seq_id for s, _ in out.scheduled
               if s.sampling_params.prompt_logprobs is not None and s.num_computed_tokens < s.num_prompt_tokens
               and getattr(s, "index", 0) == 0}
        inputs, plan = self.runner.prepare(out.scheduled, out.sample, plp)
        if prev is not None:
            self._feed_pending(inputs, out, prev)
        decode = all(n == 1 for _, n in out.scheduled) and all(out.sample)
        logits = self.runner.execute(inputs, decode=decode, padded=not plan.prompt_rows)
        sampling = [seq for (seq, _), s in zip(out.scheduled, out.sample) if s]
        so = None
        if sampling:
            batch = SamplingBatch.build(
                [s.sampling_params for s in sampling], [(s.prompt_token_ids, s.output_token_ids) for s in sampling],
                [getattr(s, "generator", None) for s in sampling], self.vocab_size, self.device,
                eos_token_ids=self.eos_token_ids)
            rows = plan.sample_rows
            if rows == list(range(rows[0], rows[0] + len(rows))):  # contiguous (every decode step): a view
                sample_logits = logits[rows[0]: rows[0] + len(rows)]
            else:
                sample_logits = logits[to_device(rows, torch.int64, logits.device)]
            so = self.sampler(sample_logits, batch)
        if plan.prompt_rows:
            self._record_prompt_logprobs(out, plan, logits)
        for seq, n in out.scheduled:
            seq.num_computed_tokens += n
            req = self.requests.get(seq.request_id)
            if req is not None and req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
                req.metrics.num_cached_tokens = seq.num_cached_tokens
        out_index = []
        for seq in sampling:
            out_index.append(len(seq.output_token_ids))
            seq.append_token(PLACEHOLDER)
            if self._reaches_length(seq, len(seq.output_token_ids)):
                seq.stop_pending = True  # its last token is in flight: not scheduled again
        so_host = HostCopy([so.token_ids, so.logprobs, so.ranks, so.topk_ids, so.topk_logprobs]) \
            if so is not None else None
        return _Launched(out, sampling, out_index, so, "decode" if decode else "mixed", so_host)

    def _feed_pending(self, inputs: dict[str, torch.Tensor], out, prev: _Launched) -> None:
        """Copy the in-flight step's sampled ids into this step's input rows holding their placeholders."""
        pending = prev.pending_rows
        dst, src = [], []
        row0 = 0
        for seq, n in out.scheduled:
            hit = pending.get(seq.seq_id)
            if hit is not None:
                offset = seq.num_prompt_tokens + hit[1] - seq.num_computed_tokens
                if 0 <= offset < n:
                    dst.append(row0 + offset)
                    src.append(hit[0])
            row0 += n
        if dst:
            dev = prev.so.token_ids.device
            ids = inputs["input_ids"]
            ids[0, to_device(dst, torch.int64, dev)] = prev.so.token_ids[to_device(src, torch.int64, dev)].to(ids.dtype)

    def _complete_safely(self, launched: _Launched) -> None:
        try:
            self._complete(launched)
        except Exception as exc:
            self._fail(launched.out.scheduled, exc)

    def _complete(self, launched: _Launched) -> None:
        """Read the sampled ids back, replace the placeholders, record logprobs, check stops."""
        sampling, so = launched.sampling, None
        if launched.so_host is not None:
            so = SamplerOutput(*launched.so_host.wait())
        token_ids = so.token_ids.tolist() if so is not None else []
        sample_lp = self._sample_logprobs(so, sampling) if so is not None and so.logprobs is not None else None
        now = time.monotonic()
        touched = self._touched
        for i, seq in enumerate(sampling):
            idx, token = launched.out_index[i], token_ids[i]
            outs = seq.output_token_ids
            if idx < len(outs) and outs[idx] == PLACEHOLDER:
                outs[idx] = token
            if seq.is_finished:  # aborted, failed or stopped while this step was in flight
                continue
            req = self.requests.get(seq.request_id)
            if req is None:
                continue
            self.stats["generation_tokens"] += 1
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            req.metrics.last_token_time = now
            if sample_lp is not None:
                lp_entry, lp_value = sample_lp[i]
                req.logprobs[seq.index].append(lp_entry)
                req.cumulative_logprob[seq.index] += lp_value
            self._check_stop(req, seq, token, idx + 1)
            touched[req.request_id] = req

    def _sample_logprobs(self, so, sampling: list[Sequence]):
        lps = so.logprobs.tolist()
        ranks = so.ranks.tolist()
        top_ids = so.topk_ids.tolist()
        top_lps = so.topk_logprobs.tolist()
        result = []
        for i, seq in enumerate(sampling):
            k = seq.sampling_params.logprobs
            tok = int(so.token_ids[i])
            entry = {tok: Logprob(lps[i], ranks[i], self._decode_one(tok))}
            if k:
                for tid, lp in zip(top_ids[i][:k], top_lps[i][:k]):
                    entry.setdefault(tid, Logprob(lp, None, self._decode_one(tid)))
                for r, tid in enumerate(top_ids[i][:k], start=1):
                    entry[tid].rank = r
            result.append((entry if k is not None else None, lps[i]))
        return result

    def _decode_one(self, token_id: int) -> str | None:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else None

    def _record_prompt_logprobs(self, out, plan, logits: torch.Tensor) -> None:
        from mini_infer.runtime.sampler import compute_prompt_logprobs

        for seq, _ in out.scheduled:
            if seq.seq_id not in plan.prompt_rows:
                continue
            req = self.requests.get(seq.request_id)
            row0, count, first_pos = plan.prompt_rows[seq.seq_id]
            # After a preemption the prompt is computed again: keep the entries recorded the first time.
            skip = len(req.prompt_logprobs) - 1 - first_pos
            if skip < 0:  # positions before first_pos were never computed (a prefix-cache hit)
                raise RuntimeError(f"request {req.request_id!r}: prompt logprobs missing for positions "
                                   f"{len(req.prompt_logprobs)}..{first_pos}")
            if skip >= count:
                continue
            if skip > 0:
                row0, count, first_pos = row0 + skip, count - skip, first_pos + skip
            k = seq.sampling_params.prompt_logprobs or 0
            nxt = torch.tensor(seq.prompt_token_ids[first_pos + 1: first_pos + 1 + count], device=logits.device)
            tok_lp, top_ids, top_lp = compute_prompt_logprobs(logits[row0: row0 + count], nxt, k)
            tok_lp, top_ids, top_lp = tok_lp.tolist(), top_ids.tolist(), top_lp.tolist()
            for j in range(count):
                tid = seq.prompt_token_ids[first_pos + 1 + j]
                entry = {tid: Logprob(tok_lp[j], None, self._decode_one(tid))}
                for r, (t, lp) in enumerate(zip(top_ids[j], top_lp[j]), start=1):
                    entry.setdefault(t, Logprob(lp, r, self._decode_one(t)))
                    entry[t].rank = r
                req.prompt_logprobs.append(entry)

    def _reaches_length(self, seq: Sequence, n_out: int) -> bool:
        """Whether output token number `n_out` is the sequence's last by length: max_tokens, max_model_len, or
        more tokens than the cache can hold for one sequence."""
        p = seq.sampling_params
        num_tokens = seq.num_prompt_tokens + n_out
        return (p.max_tokens is not None and n_out >= p.max_tokens) or num_tokens >= self.max_model_len \
            or num_tokens > self.scheduler.max_tokens_per_seq

    def _check_stop(self, req: _Request, seq: Sequence, token: int, n_out: int) -> None:
        """Stops after output token number `n_out` (= `token`); later placeholders are dropped on a stop."""
        p = seq.sampling_params
        reason, stop_reason, stop_token = None, None, False
        if token in p.stop_token_ids:
            reason, stop_reason, stop_token = "stop", token, True
        elif token in self.eos_token_ids and not p.ignore_eos:
            reason, stop_token = "stop", True
        elif self._reaches_length(seq, n_out):
            reason = "length"
        detok = req.detoks[seq.index]
        delta = ""
        if detok is not None:
            delta, stop_str = detok.add_tokens([token], stop_terminated=stop_token, finished=reason is not None)
            if stop_str is not None:
                reason, stop_reason = "stop", stop_str
        req.deltas.append((seq.index, delta, [token]))
        if reason is not None:
            del seq.output_token_ids[n_out:]  # a placeholder of a step still in flight
            seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens)
            seq.stop_reason = stop_reason
            self.scheduler.finish(seq, reason)
            if req.finished:
                req.metrics.finished_time = time.monotonic()

    def _flush(self, req: _Request, seq: Sequence) -> None:
        detok = req.detoks[seq.index]
        if detok is not None:
            req.deltas.append((seq.index, detok.flush(), []))

    def _output(self, req: _Request) -> RequestOutput:
        outputs = []
        for seq, detok in zip(req.seqs, req.detoks):
            outputs.append(CompletionOutput(
                index=seq.index, text=detok.text if detok is not None else "",
                token_ids=list(seq.output_token_ids),
                cumulative_logprob=req.cumulative_logprob[seq.index] if req.params.logprobs is not None else None,
                logprobs=req.logprobs[seq.index] if req.params.logprobs is not None else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason))
        per_sample: dict[int, tuple[str, list[int]]] = {}
        for index, text, ids in req.deltas:
            t, i = per_sample.get(index, ("", []))
            per_sample[index] = (t + text, i + ids)
        req.deltas = []
        finished = req.finished
        if finished:
            self.requests.pop(req.request_id, None)
            self.stats["finished_requests"] += 1
            if req.metrics.finished_time is None:  # finished by the scheduler or a failed step
                req.metrics.finished_time = time.monotonic()
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
            outputs=outputs, finished=finished, prompt_logprobs=req.prompt_logprobs, metrics=req.metrics,
            num_cached_tokens=req.metrics.num_cached_tokens, error=req.error,
            deltas=[per_sample.get(i, ("", [])) for i in range(len(req.seqs))])
