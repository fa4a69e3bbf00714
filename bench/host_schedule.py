"""Host time the scheduler spends on a decode step, without a model: `Scheduler.schedule()` then
`update_after_step()` (what `LLMEngine.step` calls around every launch), for a batch of decoding sequences, not a test.

The sequences are the nano-vllm workload's shape (prompts of 100-1,024 random tokens, prefix caching on), prefilled
first, then timed over --steps decode steps each (the engine's part reduced to advancing `num_computed_tokens` and
appending a token). With async scheduling the host's step overlaps the device's, so this time matters once it nears
the device step (bench/throughput.py prints the host's busy share per engine). Prints a table, writes
host_schedule.json to --out.

    python bench/host_schedule.py [--batch 1,64,256] [--block-size 16,64] [--steps 300] [--out bench/out]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from kernel_norm import git_info, int_list  # the sibling script's helpers

from mini_infer.runtime.block_manager import BlockManager
from mini_infer.runtime.scheduler import Scheduler, SchedulerConfig
from mini_infer.runtime.sequence import Sequence
from mini_infer.sampling_params import SamplingParams


def decode_step_ms(batch: int, block_size: int, steps: int, seed: int = 0) -> float:
    """Mean ms of schedule() + update_after_step() over `steps` decode steps of `batch` sequences."""
    rng = random.Random(seed)
    bm = BlockManager(batch * (2304 // block_size + 2), block_size, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=8192, max_model_len=4096), bm)
    for i in range(batch):
        prompt = [rng.randrange(10000) for _ in range(rng.randint(100, 1024))]
        sched.add(Sequence(f"r{i}", prompt, SamplingParams(max_tokens=4096)))

    def step() -> bool:
        out = sched.schedule()
        for (seq, n), sample in zip(out.scheduled, out.sample):
            seq.num_computed_tokens += n
            if sample:
                seq.output_token_ids.append(7)
        sched.update_after_step(out)
        return all(n == 1 for _, n in out.scheduled)

    while not step():  # prefill until every sequence decodes
        pass
    for _ in range(20):
        step()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t0) / steps * 1e3


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int_list, default=[1, 64, 256])
    ap.add_argument("--block-size", type=int_list, default=[16, 64])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3, help="the best of this many runs per row")
    ap.add_argument("--out", default="bench/out")
    args = ap.parse_args(argv)
    rows = []
    print(f"{'batch':>6} {'block':>6} {'ms a step':>10} {'us a sequence':>14}")
    for batch in args.batch:
        for bs in args.block_size:
            ms = min(decode_step_ms(batch, bs, args.steps) for _ in range(args.rounds))
            rows.append(dict(batch=batch, block_size=bs, ms_per_step=ms, us_per_sequence=ms * 1e3 / batch))
            print(f"{batch:>6} {bs:>6} {ms:>10.3f} {ms * 1e3 / batch:>14.2f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "host_schedule.json").write_text(json.dumps({"meta": git_info(), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
