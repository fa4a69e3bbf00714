"""DeepSeek MLA: the largest batch the KV cache holds at a context length, with and without the latent cache.

    python bench/mla_capacity.py [--model deepseek-v2-lite] [--context 4096] [--enforce-eager] [--verify]
    python bench/mla_capacity.py --tiny     # CPU: tiny-deepseek-v2, a 1 MiB cache, context 64 (numbers mean nothing)

Variants, each one engine started in turn with the same options (the HF model is released between them):
  latent    the recommended pipeline: `mla_latent_cache` keeps kv_lora_rank + qk_rope_head_dim values per token and
            layer (one `LatentAttentionSpec` per layer)
  per-head  the same passes without `mla_latent_cache`: `paged_attention` caches HF's expanded per-head K and V,
            H x (qk_nope + qk_rope + v_head_dim) values per token and layer

Per variant: KV bytes per token, the cache's size and capacity in tokens (what start-up measured: the GPU budget is
gpu_memory_utilization of the card minus weights and the profiled activations), and the largest batch of sequences
of --context tokens the cache holds at once (whole blocks per sequence: num_blocks // ceil(context / block_size)).
--verify then runs that batch (capped by --max-num-seqs): prompts of context - new_tokens random tokens and
new_tokens greedy outputs each, all admitted together, and reports preemptions (0: every sequence held its whole
context in the cache at once), the wall time and the mean decode-step time. Writes JSON to --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import time
from pathlib import Path

import torch
from kernel_norm import git_info  # the sibling script's HEAD and dirty files

VARIANTS = ("latent", "per-head")


def start_engine(args, passes):
    from mini_infer.llm import LLM

    kw = dict(max_model_len=args.context, max_num_seqs=args.max_num_seqs, enforce_eager=args.enforce_eager,
              gpu_memory_utilization=args.gpu_memory_utilization, passes=passes)
    if args.tiny:
        kw.update(device="cpu", kv_cache_memory_bytes=1 << 20, block_size=4)
    t0 = time.perf_counter()
    llm = LLM(args.model, **kw)
    return llm, time.perf_counter() - t0


def measure(args, variant: str, passes) -> tuple[dict, list[str]]:
    """Start the variant's engine, read its cache, optionally run the largest batch; returns (row, passes run)."""
    llm, startup = start_engine(args, passes)
    eng = llm.engine
    applied = list(eng.compiled.context.applied)
    bs = eng.config.block_size
    batch = eng.kv_cache.num_blocks // math.ceil(args.context / bs)
    kinds = sorted({type(s).__name__ for s in eng.compiled.cache_specs})
    row = {"variant": variant, "cache_kinds": kinds, "kv_bytes_per_token": eng.compiled.cache_bytes_per_token(),
           "kv_cache_gb": eng.memory.kv_cache / 1e9, "kv_tokens": eng.memory.kv_tokens,
           "weights_gb": eng.memory.weights / 1e9, "activations_gb": eng.memory.activations / 1e9,
           "largest_batch": batch, "startup_s": startup, "compile_s": eng.compile_seconds}
    print(f"{variant}: {kinds}, {row['kv_bytes_per_token']} B/token, KV cache {row['kv_cache_gb']:.2f} GB = "
          f"{row['kv_tokens']} tokens -> {batch} sequences of {args.context} tokens (startup {startup:.0f}s)",
          flush=True)
    if args.verify and batch > 0:
        row.update(run_batch(args, llm, min(batch, args.max_num_seqs)))
    del llm, eng
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row, applied


def run_batch(args, llm, batch: int) -> dict:
    """`batch` sequences of `context` tokens at once: prompts of context - new random tokens, new greedy outputs."""
    from mini_infer.sampling_params import SamplingParams

    eng = llm.engine
    g = torch.Generator().manual_seed(0)
    vocab = min(eng.vocab_size, 10000)
    prompts = [{"prompt_token_ids": torch.randint(100, vocab, (args.context - args.new_tokens,), generator=g).tolist()}
               for _ in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    before = dict(eng.stats)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    st = {k: eng.stats[k] - before.get(k, 0) for k in ("preemptions", "decode_steps", "decode_seconds")}
    assert all(len(o.outputs[0].token_ids) == args.new_tokens for o in outs)
    step_ms = 1e3 * st["decode_seconds"] / max(st["decode_steps"], 1)
    print(f"  ran {batch} x {args.context} tokens: {seconds:.1f}s, {st['preemptions']} preemptions, "
          f"{st['decode_steps']} decode steps of {step_ms:.1f} ms", flush=True)
    return {"verified_batch": batch, "verify_s": seconds, "preemptions": st["preemptions"],
            "decode_steps": st["decode_steps"], "decode_step_ms": step_ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default deepseek-v2-lite (--tiny: tiny-deepseek-v2)")
    ap.add_argument("--context", type=int, default=None, help="tokens per sequence (default 4096; --tiny 64)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--max-num-seqs", type=int, default=512, help="engine max_num_seqs (caps --verify's batch)")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (faster start-up; no graph pool)")
    ap.add_argument("--verify", action="store_true", help="run the largest batch and count preemptions")
    ap.add_argument("--new-tokens", type=int, default=16, help="--verify: greedy tokens per sequence")
    ap.add_argument("--tiny", action="store_true", help="CPU, tiny-deepseek-v2, 1 MiB cache")
    ap.add_argument("--out", default="bench/out")
    args = ap.parse_args()
    args.model = args.model or ("tiny-deepseek-v2" if args.tiny else "deepseek-v2-lite")
    args.context = args.context or (64 if args.tiny else 4096)
    variants = args.variants.split(",")
    if not set(variants) <= set(VARIANTS):
        raise SystemExit(f"--variants: choose from {', '.join(VARIANTS)}")

    rows, recommended = [], None
    for variant in sorted(variants, key=VARIANTS.index):  # latent first: its pass list names the per-head one
        if variant == "latent":
            row, recommended = measure(args, variant, None)
        else:
            if recommended is None:
                _, recommended = measure(args, "latent", None)
            if "mla_latent_cache" not in recommended:
                raise SystemExit(f"{args.model}: the recommended pipeline has no mla_latent_cache (not an MLA model)")
            row, _ = measure(args, variant, [p for p in recommended if p != "mla_latent_cache"])
        rows.append(row)

    print(f"\n{args.model}, context {args.context}, gpu_memory_utilization {args.gpu_memory_utilization}"
          f"{', eager' if args.enforce_eager else ''}")
    print(f"{'variant':<10}{'B/token':>10}{'KV GB':>8}{'KV tokens':>11}{'largest batch':>15}{'preemptions':>13}")
    for r in rows:
        print(f"{r['variant']:<10}{r['kv_bytes_per_token']:>10}{r['kv_cache_gb']:>8.2f}{r['kv_tokens']:>11}"
              f"{r['largest_batch']:>15}{str(r.get('preemptions', '-')):>13}")
    if len(rows) == 2 and rows[1]["largest_batch"]:
        print(f"latent / per-head: {rows[0]['largest_batch'] / rows[1]['largest_batch']:.1f}x the batch, "
              f"{rows[1]['kv_bytes_per_token'] / rows[0]['kv_bytes_per_token']:.1f}x fewer bytes per token")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.tiny else "cpu"
    (out / f"mla_capacity_{args.model}.json").write_text(json.dumps({
        "model": args.model, "context": args.context, "device": device, **git_info(),
        "date": time.strftime("%Y-%m-%d"), "gpu_memory_utilization": args.gpu_memory_utilization,
        "enforce_eager": args.enforce_eager, "max_num_seqs": args.max_num_seqs, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
