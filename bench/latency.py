"""Batch-1 decode latency: mini-infer beside the bandwidth floor, HF eager `generate`, and HF
`generate(cache_implementation="static")` (its torch.compile path), in the same run on one GPU.

Default: the `qwen2.5-7b` preset (bf16, random weights), prompt 128 tokens, 256 new tokens. The floor is
(weight bytes + KV bytes read per step) / the device-to-device copy bandwidth measured in this run.
`--quantization none,w8a8` times mini-infer once per mode (each engine built, timed and freed in turn), each
beside its own floor (int8 weights: about half the bytes).

    python bench/latency.py [--model qwen2.5-7b] [--prompt-len 128] [--new-tokens 256] [--peers hf-eager,hf-static]
                            [--quantization none,w8a8]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import torch


def copy_bandwidth(nbytes: int = 4 << 30, iters: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + written)."""
    a = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    a.random_(0, 255)
    b.copy_(a)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        b.copy_(a)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    del a, b
    return nbytes / times[len(times) // 2]


def time_hf(model, ids: torch.Tensor, new: int, **kw) -> float:
    # warm-up at the timed length: HF's static cache (and its compiled graph) is sized by max_new_tokens
    model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, **kw)
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, **kw)
    torch.cuda.synchronize()
    assert out.shape[1] == ids.shape[1] + new
    return new / (time.perf_counter() - start)


def time_engine(args, quantization: str | None, prompt: list[int]) -> dict:
    """Build mini-infer's engine for `quantization`, time batch-1 decode of `prompt`, free the engine."""
    import gc

    from mini_infer.compiler import tensor_bytes
    from mini_infer.llm import LLM
    from mini_infer.sampling_params import SamplingParams

    t0 = time.perf_counter()
    llm = LLM(args.model, max_num_seqs=1, max_model_len=args.prompt_len + args.new_tokens + 16,
              kv_cache_memory_bytes=2 << 30, quantization=quantization)
    eng = llm.engine
    startup = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt[:16]}], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    torch.cuda.synchronize()
    total = time.perf_counter() - start
    first = out.metrics.first_token_time - out.metrics.arrival_time
    gm = eng.compiled.graph_module  # the weights the compiled graph reads (the engine released the HF model)
    weight_bytes = tensor_bytes([t for n, t in [*gm.named_parameters(), *gm.named_buffers()]
                                 if "embed_tokens" not in n])
    result = dict(decode_tok_s=(args.new_tokens - 1) / (total - first), ttft_s=first, startup_s=startup,
                  compile_s=eng.compile_seconds, capture_s=eng.capture_seconds, weight_bytes=weight_bytes,
                  kv_per_token=sum(s.bytes_per_token() for s in eng.compiled.cache_specs),
                  vocab=eng.vocab_size, tokens=list(out.outputs[0].token_ids))
    del llm, eng, gm, out
    gc.collect()
    torch.cuda.empty_cache()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-7b")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--peers", default="hf-eager,hf-static")
    ap.add_argument("--quantization", default="none",
                    help="comma-separated modes to time mini-infer with, 'none' for the model's dtype (e.g. none,w8a8)")
    ap.add_argument("--out", default="bench/out")
    args = ap.parse_args()

    from mini_infer.models import load_model
    from mini_infer.models.presets import ALL_PRESETS

    bw = copy_bandwidth()
    vocab = ALL_PRESETS[args.model]["vocab_size"] if args.model in ALL_PRESETS else 10000
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, min(vocab, 10000), (args.prompt_len,), generator=gen).tolist()
    mean_ctx = args.prompt_len + args.new_tokens / 2
    modes = [m.strip() for m in args.quantization.split(",") if m.strip()]
    runs, rows = {}, []
    for mode in modes:
        r = runs[mode] = time_engine(args, None if mode == "none" else mode, prompt)
        floor = bw / (r["weight_bytes"] + r["kv_per_token"] * mean_ctx)
        label = "" if mode == "none" else f" {mode}"
        rows += [(f"bandwidth floor{label}", floor, floor), (f"mini-infer{label}", r["decode_tok_s"], floor)]
    if len(runs) > 1:
        base = next(iter(runs.values()))["tokens"]
        for r in runs.values():  # random weights: agreement says little about quality (bench/quant_quality.py)
            r["greedy_tokens_equal_first"] = sum(a == b for a, b in zip(r["tokens"], base)) / len(base)
    first_run = next(iter(runs.values()))
    first = first_run["ttft_s"]
    ids = torch.tensor([prompt], device="cuda")
    peers = args.peers.split(",") if args.peers else []
    model = load_model(args.model, device="cuda").model if peers else None  # the same weights (seeded preset)
    for peer in peers:
        if peer == "hf-eager":
            rows.append(("hf-eager", time_hf(model, ids, args.new_tokens), rows[0][2]))
        elif peer == "hf-static":
            rows.append(("hf-static+compile", time_hf(model, ids, args.new_tokens, cache_implementation="static"),
                         rows[0][2]))
    startup, eng_compile, eng_capture = first_run["startup_s"], first_run["compile_s"], first_run["capture_s"]
    print(f"{args.model} bf16 batch 1, prompt {args.prompt_len}, {args.new_tokens} new tokens; "
          f"copy bandwidth {bw / 1e12:.2f} TB/s; startup {startup:.1f}s (compile {eng_compile:.1f}s, "
          f"cuda graphs {eng_capture:.1f}s); TTFT {first * 1e3:.1f} ms")
    for mode, r in runs.items():
        if mode != modes[0]:
            print(f"  {mode}: startup {r['startup_s']:.1f}s (compile {r['compile_s']:.1f}s), weights "
                  f"{r['weight_bytes'] / 1e9:.2f} GB (vs {first_run['weight_bytes'] / 1e9:.2f}), TTFT "
                  f"{r['ttft_s'] * 1e3:.1f} ms, greedy tokens equal to {modes[0]}'s: "
                  f"{r['greedy_tokens_equal_first']:.0%}")
    print(f"{'engine':<26}{'tok/s':>9}{'ms/token':>10}{'of floor':>10}  (each mode against its own floor)")
    for name, tps, floor in rows:
        print(f"{name:<26}{tps:>9.1f}{1e3 / tps:>10.2f}{tps / floor:>10.2f}")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    (out_dir / "latency.json").write_text(json.dumps({
        "model": args.model, "device": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": commit,
        "date": time.strftime("%Y-%m-%d"), "copy_bandwidth_Bps": bw, "startup_s": startup,
        "compile_s": eng_compile, "capture_s": eng_capture, "ttft_s": first,
        "runs": {m: {k: v for k, v in r.items() if k != "tokens"} for m, r in runs.items()},
        "results": {name: tps for name, tps, _ in rows}}, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3))
        colors = ["C7" if n.startswith("bandwidth") else "C0" if n.startswith("mini-infer") else "C1" for n, *_ in rows]
        ax.barh([r[0] for r in rows], [r[1] for r in rows], color=colors)
        ax.set_xlabel("decode tokens/s (batch 1)")
        ax.set_title(f"{args.model} latency ({torch.cuda.get_device_name()})")
        fig.tight_layout()
        fig.savefig(out_dir / "latency.png", dpi=120)
    except ImportError:
        pass


if __name__ == "__main__":
    main()
