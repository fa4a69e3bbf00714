"""Offline throughput measurement of the engine on random-token prompts (used by `mini-infer bench` and
bench/throughput.py). It measures; it does not compare with peers (the bench scripts do that).
"""

from __future__ import annotations

import contextlib
import random
import time
from dataclasses import asdict, dataclass


@dataclass
class Workload:
    """Prompts of random token ids with per-request prompt and output lengths."""

    prompts: list[list[int]]
    output_lens: list[int]

    @classmethod
    def random(cls, num_prompts: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab_size: int,
               seed: int = 0) -> Workload:
        rng = random.Random(seed)
        prompts = [[rng.randrange(100, min(vocab_size, 10000)) for _ in range(rng.randint(*input_len))]
                   for _ in range(num_prompts)]
        outs = [rng.randint(*output_len) for _ in range(num_prompts)]
        return cls(prompts, outs)

    @classmethod
    def nanovllm(cls, num_prompts: int = 256, seed: int = 0) -> Workload:
        """nano-vllm's bench.py draw, exactly: `random.seed(seed)`, then every prompt (length `randint(100,
        1024)`, ids `randint(0, 10000)`), then every output length (`randint(100, 1024)`); for 256 prompts and
        seed 0 that is 142,827 prompt and 133,966 output tokens."""
        rng = random.Random(seed)
        prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))] for _ in range(num_prompts)]
        outs = [rng.randint(100, 1024) for _ in range(num_prompts)]
        return cls(prompts, outs)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass
class BenchResult:
    name: str
    num_requests: int
    output_tokens: int
    seconds: float
    startup_seconds: float = 0.0

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict:
        return asdict(self) | {"output_tok_s": self.output_tok_s}

    def table(self) -> str:
        return (f"{'engine':<14}{'requests':>9}{'out tokens':>12}{'seconds':>10}{'out tok/s':>11}\n"
                f"{self.name:<14}{self.num_requests:>9}{self.output_tokens:>12}{self.seconds:>10.2f}"
                f"{self.output_tok_s:>11.1f}")


def run_engine(llm, workload: Workload, temperature: float = 0.0, warmup: bool = True,
               around_timed: contextlib.AbstractContextManager | None = None) -> BenchResult:
    """Generate the workload with an `LLM` (ignore_eos, exact output lengths); returns timing. `warmup`: one short
    request first, sampled as the workload is (its sampler kernels' first use not timed); `around_timed`: a context
    entered around the timed generate only (a benchmark's watch on it)."""
    from mini_infer.sampling_params import SamplingParams

    params = [SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True)
              for n in workload.output_lens]
    if warmup:
        llm.generate([{"prompt_token_ids": workload.prompts[0][:16]}],
                     SamplingParams(temperature=temperature, max_tokens=4), use_tqdm=False)
    with around_timed if around_timed is not None else contextlib.nullcontext():
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in workload.prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    if produced != workload.num_output_tokens:
        raise RuntimeError(f"engine produced {produced} tokens, expected {workload.num_output_tokens}")
    return BenchResult("mini-infer", len(outs), produced, seconds)


def run_offline_benchmark(engine_kwargs: dict, num_prompts: int = 16, input_len: int = 128, output_len: int = 64,
                          seed: int = 0) -> BenchResult:
    """Build an engine from `engine_kwargs` and time `num_prompts` random prompts."""
    from mini_infer.llm import LLM

    start = time.perf_counter()
    llm = LLM(**engine_kwargs)
    startup = time.perf_counter() - start
    wl = Workload.random(num_prompts, (input_len, input_len), (output_len, output_len), llm.engine.vocab_size, seed)
    result = run_engine(llm, wl)
    result.startup_seconds = startup
    return result
