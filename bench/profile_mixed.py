"""Profile prefill/mixed steps (uncaptured) of the throughput workload's shape: host vs device time per op.

    python bench/profile_mixed.py [--model qwen3-0.6b] [--requests 256]
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--requests", type=int, default=256)
    args = ap.parse_args()
    from mini_infer.benchmark import Workload
    from mini_infer.llm import LLM
    from mini_infer.sampling_params import SamplingParams

    llm = LLM(args.model, max_num_seqs=args.requests, max_model_len=2304, enforce_eager=True)
    eng = llm.engine
    wl = Workload.random(args.requests, (100, 1024), (100, 1024), eng.vocab_size, seed=0)
    for p, n in zip(wl.prompts, wl.output_lens):
        eng.add_request(None, {"prompt_token_ids": p}, SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True))
    for _ in range(8):  # warm-up: Triton compiles
        eng.step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(5):
            eng.step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / 5
    print(f"mixed step wall {wall * 1e3:.1f} ms; running {eng.scheduler.num_running}, waiting {eng.scheduler.num_waiting}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=10, max_name_column_width=45))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10, max_name_column_width=45))


if __name__ == "__main__":
    main()
