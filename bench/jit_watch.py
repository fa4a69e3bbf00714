"""Which Triton kernel variants a timed window of a benchmark used for the first time in its process.

A variant's first use in a process loads it from Triton's on-disk cache or, on a machine whose cache is cold (a fresh
GPU lease), compiles it: a stall of up to about a second inside the timed run. CUDA-graph replays launch nothing
from Python and never show here; what does are the kernels run outside the graphs (the sampler's, uncaptured
steps'). The twenty-first session found one this way: the sampler's draw kernel specialized on its per-step random
seed (bench/RESULTS.md).

    with JitWatch() as jit:
        ...timed work...
    print(jit.line())

Installs Triton's cache-miss hook (`triton.knobs.runtime.jit_cache_hook`, or `JITFunction.cache_hook` on older
Triton) for the window, calling any hook that was there before, and restores it after. Without Triton it records
nothing. Used by the bench scripts only.
"""

from __future__ import annotations

from collections import Counter

try:
    import triton
except ImportError:  # pragma: no cover - CPU machines without triton
    triton = None


def _hook_owner():
    """(object, attribute) holding Triton's cache-miss hook, or None."""
    if triton is None:
        return None
    knobs = getattr(triton, "knobs", None)
    if knobs is not None and hasattr(knobs.runtime, "jit_cache_hook"):
        return knobs.runtime, "jit_cache_hook"
    from triton.runtime.jit import JITFunction

    return (JITFunction, "cache_hook") if hasattr(JITFunction, "cache_hook") else None


class JitWatch:
    """Context manager: the names of the Triton kernels whose variants were first used inside it (`first_uses`, in
    order, one entry per variant), and each variant's description as Triton gives it (`variants`: the signature and
    constants, which tell why it was new)."""

    def __init__(self) -> None:
        self.first_uses: list[str] = []
        self.variants: list[str] = []
        self._owner = _hook_owner()
        self._previous = None

    def _hook(self, *args, **kwargs):
        fn = kwargs.get("fn")
        self.first_uses.append(getattr(fn, "name", None) or str(kwargs.get("repr", "?")).split("[")[0])
        # Triton 3.6's repr can lose the argument types (it zips the parameters with the key's string); the key has them
        self.variants.append(f"{kwargs.get('repr', '?')} | key {kwargs.get('key', '?')}")
        return self._previous(*args, **kwargs) if self._previous is not None else None

    def __enter__(self) -> JitWatch:
        if self._owner is not None:
            obj, attr = self._owner
            self._previous = getattr(obj, attr)
            setattr(obj, attr, self._hook)
        return self

    def __exit__(self, *exc) -> None:
        if self._owner is not None:
            obj, attr = self._owner
            setattr(obj, attr, self._previous)

    def line(self) -> str:
        """One line for a report: how many variants, and of which kernels."""
        if self._owner is None:
            return "Triton kernel variants first used: not watched (no Triton hook)"
        counts = Counter(self.first_uses)
        names = ", ".join(f"{n} x{c}" if c > 1 else n for n, c in counts.most_common())
        return f"Triton kernel variants first used: {len(self.first_uses)}" + (f" ({names})" if names else "")


def main() -> None:
    """Which variants an engine first uses after its start-up: a short request (as bench/throughput.py's warm-up),
    then a slice of the nano-vllm workload; each phase's first-used variants (with Triton's description) and
    seconds."""
    import argparse
    import time

    from mini_infer.benchmark import Workload
    from mini_infer.llm import LLM
    from mini_infer.sampling_params import SamplingParams

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.6)
    args = ap.parse_args()
    llm = LLM(args.model, max_num_seqs=256, max_model_len=2304)
    wl = Workload.nanovllm(args.num_prompts)
    phases = [("one short request", [wl.prompts[0][:16]], [4]), (f"{args.num_prompts} workload prompts",
                                                                 wl.prompts, wl.output_lens)]
    for name, prompts, lens in phases:
        params = [SamplingParams(temperature=args.temperature, max_tokens=n, ignore_eos=True) for n in lens]
        with JitWatch() as jit:
            t0 = time.perf_counter()
            llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            seconds = time.perf_counter() - t0
        print(f"{name}: {seconds:.2f}s; {jit.line()}", flush=True)
        for v in jit.variants:
            print(f"  {v}", flush=True)


if __name__ == "__main__":
    main()
