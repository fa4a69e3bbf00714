"""Probe (issue #14): where LLM.generate's decode window goes beyond its engine steps, batch 1.

bench/latency.py's decode rate is 255 / (generate's wall time - TTFT); its engine steps (`decode_seconds`) account
for less. This wraps `engine.step` to time every call of one generate and prints: the window, the calls inside it,
the time outside any call, the slowest calls, and Python GC pauses inside the window.

    python bench/probe_generate_window.py [--model qwen3-0.6b] [--rounds 3]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from mini_infer.llm import LLM  # noqa: E402
from mini_infer.sampling_params import SamplingParams  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--freeze", action="store_true", help="gc.freeze() after start-up")
    args = ap.parse_args()
    llm = LLM(args.model, max_num_seqs=1, max_model_len=400, kv_cache_memory_bytes=2 << 30)
    eng = llm.engine
    calls, pauses = [], []
    orig = eng.step

    def step(*a, **k):
        t = time.perf_counter()
        r = orig(*a, **k)
        calls.append((t, time.perf_counter(), eng.stats["decode_steps"]))
        return r

    def on_gc(phase, info):
        if phase == "start":
            pauses.append([time.perf_counter(), 0.0, info["generation"]])
        else:
            pauses[-1][1] = time.perf_counter()

    eng.step = step
    gc.callbacks.append(on_gc)
    params = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
    prompt = torch.randint(3, eng.vocab_size - 1, (128,), generator=torch.Generator().manual_seed(0)).tolist()
    llm.generate([{"prompt_token_ids": prompt[:16]}], SamplingParams(max_tokens=8), use_tqdm=False)
    if args.freeze:
        gc.collect()
        gc.freeze()
    print(f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'} | {args.model} | gc tracked "
          f"{len(gc.get_objects())}, frozen {gc.get_freeze_count()}")
    for _ in range(args.rounds):
        calls.clear()
        pauses.clear()
        s0 = dict(eng.stats)
        sync()
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        sync()
        t_end = time.perf_counter()
        m = out.metrics
        t_first = t0 + (m.first_token_time - m.arrival_time)  # the window as bench/latency.py measures it
        window = t_end - t_first
        inside = sum(min(b, t_end) - max(a, t_first) for a, b, _ in calls if b > t_first)
        durs = sorted(((b - a) * 1e3, i) for i, (a, b, _) in enumerate(calls))
        dsec = eng.stats["decode_seconds"] - s0["decode_seconds"]
        steps = eng.stats["decode_steps"] - s0["decode_steps"]
        last_end = calls[-1][1]
        first_in = next(i for i, (a, b, _) in enumerate(calls) if b > t_first)
        gcs = [(round((b - a) * 1e3, 3), g) for a, b, g in pauses if b > t_first]
        print(f"window {window * 1e3:.2f} ms ({window * 1e3 / 255:.4f} ms/token) | step calls {len(calls)}, first "
              f"in window #{first_in} | inside calls {inside * 1e3:.2f} | outside {(window - inside) * 1e3:.2f} | "
              f"after last call {(t_end - last_end) * 1e3:.3f} | decode_seconds {dsec * 1e3:.2f} over {steps} steps "
              f"({dsec * 1e3 / max(steps, 1):.4f})")
        print(f"  slowest calls (ms, #): {[(round(d, 3), i) for d, i in durs[-6:]]} | median "
              f"{durs[len(durs) // 2][0]:.4f} | first 3 {[round((b - a) * 1e3, 3) for a, b, _ in calls[:3]]} | last 3 "
              f"{[round((b - a) * 1e3, 3) for a, b, _ in calls[-3:]]} | gc in window {gcs}")


if __name__ == "__main__":
    main()
