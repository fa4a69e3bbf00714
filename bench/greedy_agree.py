"""Greedy agreement between kernel switches at a large batch: the same prompts generated greedily by one engine
per variant (the default build, then one per `--switch`), every variant's tokens compared with the first's.

Where bench/latency.py compares greedy tokens at batch 1 (split decode launches), this runs the batch-N decode
launches (one split at large batches) and chunked prefill of the nano-vllm draw, shortened. For a switch that
should not change a value (a cache layout, a launch shape that keeps the reduction order) every sequence must
match; for one that changes roundings, the share shows how far they carry. Prints a table, writes JSON to --out.

    python bench/greedy_agree.py --kv-cache-dtype fp8 --switch paged_attention.FP8_V_KEYS_CONTIGUOUS=0
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
from pathlib import Path

import torch
from kernel_norm import git_info  # the sibling script's HEAD and dirty files
from switches import check_switches, switched  # a kernel switch set for one engine's build

from mini_infer.benchmark import Workload


def agreement(ids: list[list[int]], first: list[list[int]]) -> dict:
    """How far one engine's greedy tokens (a list a sequence) equal the first engine's: whole sequences, tokens at
    the same positions, and the mean length of the equal prefix (where a rounding first flipped a token)."""
    prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
              for a, b in zip(ids, first, strict=True)]
    return dict(sequences_equal=sum(a == b for a, b in zip(ids, first)),
                tokens_equal=sum(x == y for a, b in zip(ids, first) for x, y in zip(a, b)),
                tokens=sum(map(len, ids)), mean_equal_prefix=sum(prefix) / max(len(prefix), 1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=128, help="output tokens a sequence")
    ap.add_argument("--max-model-len", type=int, default=2304)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--switch", action="append", default=[], help="as bench/throughput.py's (bench/switches.py)")
    ap.add_argument("--out", default="bench/out")
    args = ap.parse_args()
    check_switches(args.switch)  # every switch parsed and found before the first engine

    from mini_infer.llm import LLM
    from mini_infer.sampling_params import SamplingParams

    draw = Workload.nanovllm(args.num_prompts).prompts
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    rows, first = [], None
    for switch in [None, *args.switch]:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        with switched(switch) if switch else contextlib.nullcontext():
            llm = LLM(args.model, max_num_seqs=args.num_prompts, max_model_len=args.max_model_len,
                      kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization)
            vocab = llm.engine.vocab_size  # the draw's ids are below 10,000: a tiny preset's vocabulary may be smaller
            prompts = [{"prompt_token_ids": [t % vocab for t in p]} for p in draw]
            ids = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        bm = llm.engine.block_manager
        free = bm.num_free_blocks == bm.num_blocks
        del llm
        if first is None:
            first = ids
        rows.append(dict(switch=switch or "default", **agreement(ids, first), all_blocks_free=free))
        r = rows[-1]
        print(f"{r['switch']}: {r['sequences_equal']}/{len(ids)} sequences, {r['tokens_equal']}/{r['tokens']} tokens "
              f"equal to the first engine's (mean equal prefix {r['mean_equal_prefix']:.1f}); KV blocks all free: "
              f"{free}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "greedy_agree.json").write_text(json.dumps(dict(args=vars(args), git=git_info(), rows=rows), indent=2))


if __name__ == "__main__":
    main()
