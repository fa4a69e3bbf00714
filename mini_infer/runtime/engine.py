"""The engine: requests in, a step at a time, outputs out.

`LLMEngine` loads and compiles the model (then releases the HF model: the graph owns the weights it uses),
runs once the long query runs a pass declared uncaptured (runtime/warmup.py: their first use is paid at start-up),
measures the activation memory and sizes the caches the passes declared, and runs the loop:
schedule → run the compiled graph → sample → hand the tokens to the output processor (detokenization, stop
checks, logprobs, outputs; runtime/output_processor.py) → apply its stop decisions → report. Bad requests are refused
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

import dataclasses
import functools
import itertools
import logging
import operator
import time
from dataclasses import dataclass

import torch

from mini_infer.compiler import CompiledModel, compile_model
from mini_infer.contract import attention_window, bytes_per_block, default_block_size, is_block_size
from mini_infer.contract.inputs import MAX_POSITIONS, UNCAPTURED_QUERY_ROWS
from mini_infer.models.loader import LoadedModel, default_device, load_model
from mini_infer.outputs import RequestOutput
from mini_infer.runtime import distributed
from mini_infer.runtime.block_manager import BlockManager
from mini_infer.runtime.kv_cache import DEFAULT_CPU_KV_BYTES, KVCache, num_blocks_for_budget
from mini_infer.runtime.limits import fit_max_model_len, long_prefill_threshold
from mini_infer.runtime.memory import (
    MemoryReport,
    activation_reserve,
    gpu_budget_shortfall,
    gpu_cache_budget,
    profile_activations,
    release_host_memory,
)
from mini_infer.runtime.model_runner import ModelRunner, PendingIds, StepInputs
from mini_infer.runtime.output_processor import OutputProcessor, RequestState
from mini_infer.runtime.preflight import check_before_load
from mini_infer.runtime.sampler import Sampler, SamplerOutput, SamplingBatch, make_generator
from mini_infer.runtime.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from mini_infer.runtime.sequence import PLACEHOLDER, Sequence
from mini_infer.runtime.transfer import HostCopy, to_device
from mini_infer.runtime.warmup import LongRunWarmup, long_run_chunks, warm_long_runs
from mini_infer.sampling_params import GENERATION_CONFIG_MODES, SamplingParams, check_context_length

logger = logging.getLogger("mini_infer")


def _is_int(v) -> bool:
    """An integer token id (Python or numpy/torch integer scalar), not a bool."""
    if isinstance(v, bool):
        return False
    try:
        return operator.index(v) == v
    except TypeError:
        return False


KV_CACHE_DTYPES = {"auto": None, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
                   "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32,
                   "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn}
QUANTIZATION_MODES = ("w8a8", "fp8", "mxfp4")


def resolve_kv_cache_dtype(name: str) -> torch.dtype | None:
    """vLLM's `--kv-cache-dtype` names → a torch dtype (None: the model's dtype)."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {name!r}")
    return KV_CACHE_DTYPES[name]


@dataclass
class EngineConfig:
    """Engine options, under vLLM's names."""

    model: str | None = None
    dtype: str = "auto"
    device: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    # tokens a KV block (a power of two); None: what the compiled model's cache specs ask for (contract's
    # `default_block_size`: 64 over an fp8 cache whose V is stored tokens-contiguous, else 16, vLLM's)
    block_size: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None  # CPU: the cache budget (default 1 GiB); GPU: overrides utilization
    num_kv_blocks: int | None = None  # exact block count (tests force preemption with a tiny cache)
    passes: list | None = None  # pass names and/or GraphPass instances; None: the recommended pipeline
    quantization: str | None = None  # "w8a8" / "fp8" / "mxfp4" (vLLM's names), through the quantization passes
    kv_cache_dtype: str = "auto"  # "auto" (the model dtype), "bfloat16", "float16", "float32", "fp8"
    scheduling_policy: str = "fcfs"
    seed: int = 0
    enforce_eager: bool = False  # no CUDA graphs
    load_format: str = "auto"  # "dummy": the model's architecture with random weights
    # overlap the host's scheduling with the device's previous step; None: on for CUDA (on a CPU the device's
    # work is the host's, so there is nothing to overlap)
    async_scheduling: bool | None = None
    # "auto": sampling defaults from the model's generation_config (vLLM's); "vllm": SamplingParams' own
    generation_config: str = "auto"
    # most prompt tokens one sequence prefills per step; None: 4% of max_model_len (vLLM's rule, see
    # runtime/limits.py), 0: no cap
    long_prefill_token_threshold: int | None = None
    # ranks the model is split over (one process, and one GPU, each; runtime/distributed.py)
    tensor_parallel_size: int = 1
    # MoE experts split whole over those ranks (E/N each) instead of each expert's intermediate size (vLLM's name)
    enable_expert_parallel: bool = False

    def __post_init__(self) -> None:
        resolve_kv_cache_dtype(self.kv_cache_dtype)
        if isinstance(self.tensor_parallel_size, bool) or not isinstance(self.tensor_parallel_size, int) \
                or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be an int >= 1, got {self.tensor_parallel_size!r}")
        if not isinstance(self.enable_expert_parallel, bool):
            raise ValueError(f"enable_expert_parallel must be a bool, got {self.enable_expert_parallel!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_MODES:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_MODES)} or None; "
                             f"got {self.quantization!r}")
        if self.block_size is not None and not is_block_size(self.block_size):
            raise ValueError(f"block_size must be a power of two >= 1 (or None: the caches' choice), got "
                             f"{self.block_size!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "kv_cache_memory_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.long_prefill_token_threshold is not None and self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0 (0: no cap), got "
                             f"{self.long_prefill_token_threshold}")
        if self.generation_config not in GENERATION_CONFIG_MODES:
            raise ValueError(f"generation_config must be one of {', '.join(GENERATION_CONFIG_MODES)}, got "
                             f"{self.generation_config!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")


# On CUDA a step sampling at most this many rows sends its sampled ids (and logprobs) to the host by copies on a
# stream of their own, so that the next step's input copy and replay, queued on the compute stream while they run,
# do not wait behind them (a batch-1 decode token otherwise spends the copy and its launch gap between two replays:
# +0.5% at qwen3-0.6b on an H200, bench/RESULTS.md forty-first session). Larger steps run for milliseconds, where the
# copy is noise: they keep it on the compute stream and spare the host the stream switching (their host was busy
# 63% of the nano-vllm workload's step time with every step's copy on the side stream, 51% without). 0 turns it off;
# read at engine start (whether there is a copy stream) and at each step.
SIDE_STREAM_COPIES = 8


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


class LLMEngine:
    """Continuous-batching engine over a compiled model and a paged KV cache."""

    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None,
                 compiled: CompiledModel | None = None) -> None:
        self.config = config = config or EngineConfig()
        check_before_load(config, loaded)  # options, device, model files: refused before anything loads
        if config.tensor_parallel_size > 1 and (loaded is not None or compiled is not None):
            raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size}: every rank loads and compiles "
                             "its own shard; pass the model by name, not as `loaded` / `compiled`")
        self.parallel = distributed.start(config)  # None without tensor parallelism
        try:
            self._build(config, loaded, compiled)
        except BaseException:
            if self.parallel is not None:
                self.parallel.close(abort=True)
            raise
        if self.parallel is not None and self.parallel.rank > 0:
            self.parallel.serve(self)  # runs rank 0's steps, then exits the process

    def _build(self, config: EngineConfig, loaded: LoadedModel | None, compiled: CompiledModel | None) -> None:
        self.device = self.parallel.device if self.parallel is not None else \
            torch.device(config.device) if config.device else default_device()
        t0 = time.perf_counter()
        self.loaded = loaded or load_model(config.model, dtype=config.dtype, device=self.device, seed=config.seed,
                                           load_format=config.load_format,
                                           tensor_parallel_size=config.tensor_parallel_size)  # the rank's shards
        self.model_config = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        text_cfg = self.model_config.get_text_config()
        self.vocab_size = text_cfg.vocab_size
        self.load_seconds = time.perf_counter() - t0
        # the longest context a sequence may reach (lowered below if the KV cache holds less); position tables
        # (the rotary_table pass) are built for it
        self.max_model_len = config.max_model_len or getattr(text_cfg, "max_position_embeddings", 4096)
        t1 = time.perf_counter()
        self.compiled = compiled or compile_model(
            self.loaded.model, passes=config.passes, device=self.device, model_name=self.loaded.name,
            quantization=config.quantization, kv_cache_dtype=resolve_kv_cache_dtype(config.kv_cache_dtype),
            rank=self.parallel.rank if self.parallel else 0, world_size=config.tensor_parallel_size,
            expert_parallel=config.enable_expert_parallel, tokenizer=self.tokenizer,
            max_positions=self.max_model_len)
        positions = self.compiled.context.info.get(MAX_POSITIONS)
        if positions is not None and self.max_model_len > positions:  # a compiled model given with shorter tables
            raise ValueError(f"max_model_len={self.max_model_len}, but the compiled model answers only positions "
                             f"below {positions} (tables built at compile time): compile it with "
                             f"max_positions >= max_model_len")
        self.compile_seconds = time.perf_counter() - t1
        if config.block_size is None:  # the block size the declared caches' readers ask for (16 when none asks)
            self.config = config = dataclasses.replace(config, block_size=default_block_size(self.compiled.cache_specs))
        # The compiled graph owns the weights it uses; release the HF model so that weights a pass replaced
        # (merged, stacked, quantized) are freed. A caller that passed `loaded` keeps its own reference.
        self.generation_config = getattr(self.loaded.model, "generation_config", None)
        self.loaded = dataclasses.replace(self.loaded, model=None)
        release_host_memory()
        # vLLM's defaults: a larger token budget on a GPU (fewer, fuller prefill steps), 2048 elsewhere
        default_batched = 8192 if self.device.type == "cuda" else 2048
        max_batched = config.max_num_batched_tokens or max(default_batched, config.max_num_seqs)
        if not config.enable_chunked_prefill and config.max_num_batched_tokens is None:
            max_batched = max(max_batched, self.max_model_len)  # a whole prompt must fit one step (as vLLM)
        self.max_num_batched_tokens = max_batched
        self.long_run_warmup = self._warm_long_runs()  # before the cache is sized: its peak joins the reserve
        self.kv_cache = self._allocate_kv_cache()
        self.block_manager = BlockManager(self.kv_cache.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=max_batched,
            max_model_len=self.max_model_len, enable_chunked_prefill=config.enable_chunked_prefill,
            policy=config.scheduling_policy, attention_window=attention_window(self.compiled.cache_specs),
            long_prefill_token_threshold=long_prefill_threshold(
                config.long_prefill_token_threshold, config.enable_chunked_prefill, self.max_model_len,
                max_batched),
            long_prefill_only_when_shared=config.long_prefill_token_threshold is None), self.block_manager)
        self.runner = ModelRunner(self.compiled, self.kv_cache, self.device)
        graphs_before = torch.cuda.memory_reserved(self.device) if self.device.type == "cuda" else 0
        self.capture_seconds = 0.0 if config.enforce_eager else \
            self.runner.enable_cuda_graphs(config.max_num_seqs, self.max_model_len, min(max_batched, 16384))
        if self.parallel is not None:  # rank 0's runner sends every step to the other ranks
            self.runner = self.parallel.attach(self.runner)
        graph_bytes = torch.cuda.memory_reserved(self.device) - graphs_before if self.device.type == "cuda" else 0
        self.memory = MemoryReport(
            weights=self.compiled.weight_bytes, activations=self._activation_reserve, graphs=graph_bytes,
            kv_cache=self.kv_cache.nbytes, kv_tokens=self.kv_cache.capacity_tokens,
            kv_bytes_per_token=self.compiled.cache_bytes_per_token())
        self.sampler = Sampler()
        if self.device.type == "cuda" and self.compiled.logits_dtype is not None:
            self.sampler.warm_up(self.vocab_size, self.compiled.logits_dtype, self.device)  # (rank 0 samples)
        self.output_processor = OutputProcessor(self.tokenizer, self._eos_ids())
        self.requests: dict[str, RequestState] = {}
        self.async_scheduling = config.async_scheduling if config.async_scheduling is not None \
            else self.device.type == "cuda"
        self._inflight: _Launched | None = None  # async scheduling: the step launched, not completed
        self._copy_stream = torch.cuda.Stream(self.device) \
            if self.device.type == "cuda" and SIDE_STREAM_COPIES else None  # see SIDE_STREAM_COPIES
        self._touched: dict[str, RequestState] = {}  # requests with news since the last step() returned
        self._ids = itertools.count()
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0, "preemptions": 0,
                      "finished_requests": 0, "decode_steps": 0, "decode_seconds": 0.0, "mixed_steps": 0,
                      "mixed_seconds": 0.0, "device_wait_seconds": 0.0}
        logger.info("engine ready: load %.1fs, compile %.1fs, long-run warm-up %.1fs, CUDA graphs %.1fs; KV cache "
                    "%d blocks x %d tokens", self.load_seconds, self.compile_seconds, self.warmup_seconds,
                    self.capture_seconds, self.kv_cache.num_blocks, config.block_size)
        logger.info(self.memory.line())
        cache_passes = {self.compiled.context.declared_by.get(n) for spec in self.compiled.cache_specs
                        for n in spec.input_names()}
        for row in self.compiled.stats:  # what the passes that declared the caches say about them
            if row.name in cache_passes and row.note:
                logger.info("%s: %s", row.name, row.note)

    @property
    def failure(self) -> BaseException | None:
        """Why the engine can run no more steps (a tensor-parallel rank died), or None."""
        return self.parallel.failure if self.parallel is not None else None

    def close(self) -> None:
        """Stop the other tensor-parallel ranks, if any (also done at exit)."""
        if self.parallel is not None:
            self.parallel.close()

    @property
    def eos_token_ids(self) -> set[int]:
        """Token ids that end a sequence (unless `ignore_eos`); held by the output processor, which checks stops."""
        return self.output_processor.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: set[int]) -> None:
        self.output_processor.eos_token_ids = set(ids)

    # ------------------------------------------------------------------ set-up
    @property
    def warmup_seconds(self) -> float:
        """Start-up seconds spent running long query runs (`_warm_long_runs`; 0.0 when none ran)."""
        return self.long_run_warmup.seconds if self.long_run_warmup is not None else 0.0

    def _warm_long_runs(self) -> LongRunWarmup | None:
        """When a pass declared that query runs of `info[UNCAPTURED_QUERY_ROWS]` rows or more take an uncaptured
        path and a lone prompt's chunk can be that long, run such chunks once now (runtime/warmup.py): the path's
        first-use costs are paid at start-up, not by the first long prompt. Every rank of a tensor-parallel
        group runs the same steps (same config, same declaration)."""
        chunks = long_run_chunks(self.compiled.context.info.get(UNCAPTURED_QUERY_ROWS), self.max_num_batched_tokens,
                                 self.max_model_len, self.config.block_size)
        if not chunks:
            return None
        warm = warm_long_runs(self.compiled, chunks, self.config.block_size, self.device)
        logger.info(warm.line())
        return warm

    def _cache_budget(self) -> int:
        """Bytes for the cache: `kv_cache_memory_bytes` if set; on a GPU what `gpu_memory_utilization` leaves
        after the weights and the measured activation need (see runtime/memory.py); 1 GiB on a CPU."""
        cfg = self.config
        self._activation_reserve = 0
        if cfg.kv_cache_memory_bytes is not None:
            return cfg.kv_cache_memory_bytes
        if self.device.type != "cuda":
            return DEFAULT_CPU_KV_BYTES
        prof = profile_activations(self.compiled, self.max_num_batched_tokens, self.config.max_num_seqs,
                                   cfg.block_size, self.vocab_size, self.device)
        long_run = self.long_run_warmup.peak_bytes if self.long_run_warmup is not None else 0
        self._activation_reserve = activation_reserve(prof, long_run, cuda_graphs=not cfg.enforce_eager)
        logger.info("activations: %.2f GB at the largest step (%d tokens, %d sequences), %.2f GB with sampling, "
                    "%.2f GB at the longest query run", prof.forward_bytes / 1e9, self.max_num_batched_tokens,
                    cfg.max_num_seqs, prof.step_bytes / 1e9, long_run / 1e9)
        return gpu_cache_budget(self.device, cfg.gpu_memory_utilization, self._activation_reserve)

    def _allocate_kv_cache(self) -> KVCache:
        cfg, specs = self.config, self.compiled.cache_specs
        if not specs:
            raise ValueError("the compiled model declares no cache: run the paged_attention pass")
        if cfg.num_kv_blocks is not None:
            self._activation_reserve = 0
            return KVCache(specs, cfg.num_kv_blocks, cfg.block_size, self.device)
        budget = self._cache_budget()
        if self.parallel is not None:  # every rank allocates the same blocks
            budget = self.parallel.agree_min(budget)
        num_blocks = num_blocks_for_budget(specs, cfg.block_size, budget)
        if num_blocks == 0 and budget <= 0 and self.device.type == "cuda" and cfg.kv_cache_memory_bytes is None:
            raise ValueError("no GPU memory is left for the KV cache: " + gpu_budget_shortfall(
                self.device, cfg.gpu_memory_utilization, self._activation_reserve) + ": raise gpu_memory_utilization, "
                "free the GPU of other processes, or set kv_cache_memory_bytes")
        if num_blocks == 0:
            raise ValueError(f"the KV cache budget ({budget} bytes) cannot hold one block of block_size="
                             f"{cfg.block_size} tokens ({bytes_per_block(specs, cfg.block_size)} bytes): raise "
                             f"kv_cache_memory_bytes / gpu_memory_utilization or lower block_size")
        try:
            self.max_model_len = fit_max_model_len(self.max_model_len, cfg.max_model_len is not None,
                                                   num_blocks * cfg.block_size, budget)
        except ValueError as exc:
            per_token = sum(s.bytes_per_token() for s in specs)
            owners = sorted({self.compiled.context.declared_by.get(s.input_names()[0], "?") for s in specs})
            raise ValueError(f"{exc} (caches of {per_token} bytes per token, declared by {owners})") from None
        return KVCache(specs, num_blocks, cfg.block_size, self.device)

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        gen = self.generation_config
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
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        capacity = self.kv_cache.num_blocks * self.config.block_size
        if len(token_ids) >= capacity:
            raise ValueError(f"prompt is {len(token_ids)} tokens; the KV cache holds {capacity} tokens in all, "
                             "which must leave room for at least one generated token")
        params.validate(self.vocab_size)
        check_context_length(len(token_ids), params.max_tokens, self.max_model_len)  # the server's rule too
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
        seqs = []
        for i in range(params.n):
            seq = Sequence(request_id, list(ids), params, arrival_time=arrival, priority=priority)
            seq.index = i
            seq.generator = make_generator(params.seed + i, self.device) if params.seed is not None else None
            seqs.append(seq)
        req = self.output_processor.new_request(request_id, text, ids, params, seqs, arrival)
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
            except distributed.WorkerDiedError:  # no step can run any more: the caller (server) must know
                raise
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
        logits = self.runner.execute(inputs, plan, decode=decode, padded=not plan.prompt_rows)
        sampling = [seq for (seq, _), s in zip(out.scheduled, out.sample) if s]
        so = greedy_ids = None
        if sampling:
            batch = SamplingBatch.build(
                [s.sampling_params for s in sampling], [(s.prompt_token_ids, s.output_token_ids) for s in sampling],
                [getattr(s, "generator", None) for s in sampling], self.vocab_size, self.device,
                eos_token_ids=self.eos_token_ids)
            rows = plan.sample_rows
            if rows == list(range(rows[0], rows[0] + len(rows))):  # contiguous (every decode step): a view
                sample_logits = logits[rows[0]: rows[0] + len(rows)]
                ids = self.runner.last_greedy_ids  # the replay's own argmax of its rows, if it has one
                greedy_ids = ids[rows[0]: rows[0] + len(rows)] if ids is not None else None
            else:
                sample_logits = logits[to_device(rows, torch.int64, logits.device)]
            so = self.sampler(sample_logits, batch, greedy_ids)
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
        so_host = None
        if so is not None:
            side = self._copy_stream if len(sampling) <= SIDE_STREAM_COPIES else None
            so_host = HostCopy([so.token_ids, so.logprobs, so.ranks, so.topk_ids, so.topk_logprobs], stream=side)
            if greedy_ids is not None and so.token_ids is greedy_ids and so_host.event is not None:
                self.runner.fence_greedy_ids(so_host.event)  # the graph's own ids: its next replay rewrites them
        return _Launched(out, sampling, out_index, so, "decode" if decode else "mixed", so_host)

    def _feed_pending(self, inputs: StepInputs, out, prev: _Launched) -> None:
        """Mark this step's input rows holding placeholders to take the in-flight step's sampled ids (on the
        device, once the step's inputs are there)."""
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
            inputs.pending = PendingIds(dst, src, prev.so.token_ids)

    def _complete_safely(self, launched: _Launched) -> None:
        try:
            self._complete(launched)
        except Exception as exc:
            self._fail(launched.out.scheduled, exc)

    def _complete(self, launched: _Launched) -> None:
        """Read the sampled ids back, replace the placeholders, record logprobs, check stops."""
        sampling, so = launched.sampling, None
        if launched.so_host is not None:
            t0 = time.perf_counter()
            so = SamplerOutput(*launched.so_host.wait())
            # the host idle until the device caught up: step seconds less this are the host's own work
            self.stats["device_wait_seconds"] += time.perf_counter() - t0
        token_ids = so.token_ids.tolist() if so is not None else []
        sample_lp = self.output_processor.sample_logprobs(so, sampling) \
            if so is not None and so.logprobs is not None else None
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
            n_out = idx + 1
            reason = self.output_processor.add_token(req, seq, token, now, sample_lp[i] if sample_lp else None,
                                                     self._reaches_length(seq, n_out))
            if reason is not None:
                del seq.output_token_ids[n_out:]  # a placeholder of a step still in flight
                seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens)
                self.scheduler.finish(seq, reason)
                if req.finished:
                    req.metrics.finished_time = time.monotonic()
            touched[req.request_id] = req

    def _record_prompt_logprobs(self, out, plan, logits: torch.Tensor) -> None:
        from mini_infer.runtime.sampler import compute_prompt_logprobs

        for seq, _ in out.scheduled:
            if seq.seq_id not in plan.prompt_rows:
                continue
            req = self.requests.get(seq.request_id)
            row0, count, first_pos = plan.prompt_rows[seq.seq_id]

            def compute(skip, n, k, row0=row0, first_pos=first_pos, seq=seq):
                nxt = torch.tensor(seq.prompt_token_ids[first_pos + skip + 1: first_pos + skip + 1 + n],
                                   device=logits.device)
                return compute_prompt_logprobs(logits[row0 + skip: row0 + skip + n], nxt, k)

            self.output_processor.add_prompt_logprobs(req, seq, first_pos, count, compute)

    def _reaches_length(self, seq: Sequence, n_out: int) -> bool:
        """Whether output token number `n_out` is the sequence's last by length: max_tokens, max_model_len, or
        more tokens than the cache can hold for one sequence."""
        p = seq.sampling_params
        num_tokens = seq.num_prompt_tokens + n_out
        return (p.max_tokens is not None and n_out >= p.max_tokens) or num_tokens >= self.max_model_len \
            or num_tokens > self.scheduler.max_tokens_per_seq

    def _flush(self, req: RequestState, seq: Sequence) -> None:
        self.output_processor.flush(req, seq)

    def _output(self, req: RequestState) -> RequestOutput:
        out = self.output_processor.output(req)
        if out.finished:
            self.requests.pop(req.request_id, None)
            self.stats["finished_requests"] += 1
        return out
