"""Batch-1 decode latency: mini-infer beside the bandwidth floor, HF eager `generate`, HF
`generate(cache_implementation="static")` (its torch.compile path) and vLLM, in the same run on one GPU.

Default: the `qwen2.5-7b` preset (bf16, random weights), prompt 128 tokens, 256 new tokens. The floor is
(weight bytes + KV bytes read per step) / the device-to-device copy bandwidth measured in this run; for MoE models
the weight bytes are the active ones: attention, router, shared experts and lm_head, and only the top-k routed
experts of each MoE layer (bench/active_bytes.py).

`--quantization` and `--kv-cache-dtype` take comma lists ("none" = no quantization): each combination is an
engine of its own, built, measured and freed one after the other in the same run, each beside its own floor
(fp8 weights read half the bytes, so their floor is higher). The HF peers are always the bf16 model.

`--peers vllm` runs vLLM (defaults, `load_format="dummy"` from the same config, in its own process once
mini-infer's engines are freed: bench/vllm_peer.py) on the same prompt; its decode rate is (new - 1) / (time for
`new` tokens - time for 1 token), medians of 3. mini-infer's row uses its own first-token timestamp instead; both
remove the prefill from the rate.

    python bench/latency.py [--model qwen2.5-7b] [--prompt-len 128] [--new-tokens 256] [--peers hf-eager,hf-static]
    python bench/latency.py --model qwen3-30b-a3b --peers hf-static   # MoE: the active-parameter floor
    python bench/latency.py --quantization none,fp8 --peers none          # fp8 weights vs bf16, same run
    python bench/latency.py --kv-cache-dtype auto,fp8 --peers none        # fp8 KV cache vs the model dtype
    python bench/latency.py --quantization none,w8a8 --quantize-lm-head --peers none   # also with an int8 lm_head
    python bench/latency.py --model qwen3-0.6b --peers vllm,hf-static     # vLLM beside us
    python bench/latency.py --model qwen3-0.6b --peers none --without fuse_norm_gemv   # one pass's gain
    python bench/latency.py --model qwen3-0.6b --peers none --without fuse_lookups --rounds 2  # ... alternated
    python bench/latency.py --model qwen3-0.6b --peers none --with fuse_kv_write  # an opt-in pass's
    python bench/latency.py --model qwen3-0.6b --peers none --switch paged_attention.ATTN_PRELOAD=0 --rounds 2
                                                      # a kernel switch's, engines alternated over two rounds
    python bench/latency.py --prompt-len 32000 --new-tokens 16 --peers none --repeat 2  # TTFT cold, then warm
    python bench/latency.py --model qwen3-0.6b --kv-cache-dtype fp8 --peers none --block-size 16  # every engine's
                                                      # KV block size (default: the engine's choice)

`--repeat N`: the TTFT of N prompts of --prompt-len (other random ids each, so no prefix-cache hit; the last is
the decode run's) in the same engine, in order: what a first prompt of that length pays once (cuDNN plans of the
prefill route, allocator growth) against what the next one pays.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch
from active_bytes import token_bytes  # the sibling script's count of the weight bytes a token reads
from kernel_norm import git_info  # the sibling script's HEAD and dirty files
from switches import check_switches, switched  # a kernel switch set for one engine's build


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


def random_prompt(vocab: int, n: int, seed: int = 0) -> list[int]:
    """The benchmark's prompt: n random ids (seed 0: the same for every engine of a run; --repeat's others 1..)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, min(vocab, 10000), (n,), generator=gen).tolist()


def step_loop_ms(eng, prompt: list[int], params) -> float:
    """The timed prompt once more, driven by `engine.step()` alone as bench/profile_decode.py drives it (no
    `LLM.generate` above it): ms per token after the first one."""
    eng.add_request("latency-step-loop", {"prompt_token_ids": prompt}, params)
    before = eng.stats["generation_tokens"]
    while eng.stats["generation_tokens"] == before:  # the prefill's token
        eng.step()
    torch.cuda.synchronize()
    first, start = eng.stats["generation_tokens"], time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / (eng.stats["generation_tokens"] - first)


def warm_up(llm, prompt: list[int], new_tokens: int) -> None:
    """Before an engine is timed: one greedy decode as long as the timed one, from the prompt's first 16 ids. The
    first long decode after a machine starts runs ~1.7% slower, once, whatever the engine (bench/RESULTS.md,
    fortieth session): an 8-token warm-up left that to the first timed engine of a run."""
    from mini_infer.sampling_params import SamplingParams

    llm.generate([{"prompt_token_ids": prompt[:16]}], SamplingParams(temperature=0.0, max_tokens=new_tokens,
                                                                     ignore_eos=True), use_tqdm=False)


def progress(e: dict) -> None:
    """One line on stderr as soon as an engine is timed (the table comes at the end: a run cut short by a time
    limit still shows what it measured)."""
    print(f"[timed] q={e['quantization'] or 'none'} kv={e['kv_cache_dtype']}{e.get('tag', '')}: "
          f"{e['decode_tok_s']:.1f} tok/s (floor {e['floor_tok_s']:.1f})", file=sys.stderr, flush=True)


def measure_engine(args, bw: float, quantization: str | None, kv_cache_dtype: str,
                   passes: list[str] | None = None, tag: str = "") -> dict:
    """Build one engine (`passes`: None for the recommended pipeline), time batch-1 decode of the benchmark
    prompt, report it (`progress`, with `tag`: what sets it apart from the first engine), free it; the numbers and
    the engine's floor."""
    import gc

    from mini_infer.llm import LLM
    from mini_infer.passes import PASSES
    from mini_infer.sampling_params import SamplingParams

    t0 = time.perf_counter()
    llm = LLM(args.model, max_num_seqs=1, max_model_len=args.prompt_len + args.new_tokens + 16,
              kv_cache_memory_bytes=2 << 30, quantization=quantization, kv_cache_dtype=kv_cache_dtype, passes=passes,
              **({"block_size": args.block_size} if args.block_size else {}))
    eng = llm.engine
    startup = time.perf_counter() - t0
    prompt = random_prompt(eng.vocab_size, args.prompt_len)
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    warm_up(llm, prompt, args.new_tokens)
    ttfts = []
    for seed in range(1, args.repeat):  # earlier prompts of the same length (--repeat): their TTFTs
        other = random_prompt(eng.vocab_size, args.prompt_len, seed)
        done = llm.generate([{"prompt_token_ids": other}], SamplingParams(max_tokens=1), use_tqdm=False)[0]
        ttfts.append(done.metrics.first_token_time - done.metrics.arrival_time)
    torch.cuda.synchronize()
    stats0 = dict(eng.stats)
    start = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    torch.cuda.synchronize()
    total = time.perf_counter() - start
    first = out.metrics.first_token_time - out.metrics.arrival_time
    # inside that generate, per decode step: the engine's wall time and the host's own share of it (the rest
    # waited for the device's sampled ids); a host share near the step time means the host is the bottleneck
    steps = max(eng.stats["decode_steps"] - stats0["decode_steps"], 1)
    step_ms = (eng.stats["decode_seconds"] - stats0["decode_seconds"]) * 1e3 / steps
    wait_ms = (eng.stats["device_wait_seconds"] - stats0["device_wait_seconds"]) * 1e3 / steps
    loop_ms = step_loop_ms(eng, prompt, params)
    # the weights one token reads from the compiled graph (the engine released the HF model): all but the
    # embedding, and for MoE layers only the top-k experts (bench/active_bytes.py)
    weights = token_bytes(eng.compiled.graph_module)
    kv_per_token = eng.compiled.cache_bytes_per_token()
    mean_ctx = args.prompt_len + args.new_tokens / 2
    result = dict(quantization=quantization, kv_cache_dtype=kv_cache_dtype, block_size=eng.config.block_size,
                  startup_s=startup,
                  compile_s=eng.compile_seconds, capture_s=eng.capture_seconds, warmup_s=eng.warmup_seconds,
                  ttft_s=first,
                  ttft_runs_s=[*ttfts, first], decode_tok_s=(args.new_tokens - 1) / (total - first),
                  decode_step_ms=step_ms, host_busy_ms=step_ms - wait_ms, step_loop_ms=loop_ms,
                  weight_bytes=weights.total, active_weight_bytes=weights.active,
                  moe_layers=weights.moe_layers, weights_read=weights.describe(),
                  kv_bytes_per_token=kv_per_token, floor_tok_s=bw / (weights.active + kv_per_token * mean_ctx),
                  tokens=list(out.outputs[0].token_ids), prompt=prompt,
                  passes=[r.name for r in eng.compiled.stats if r.name in PASSES], tag=tag)
    progress(result)
    del llm, eng, out
    gc.collect()
    torch.cuda.empty_cache()
    return result


def variant_runs(first_passes: list, without: str | None, with_: str | None, switches: list[str],
                 rounds: int) -> list[tuple[str, list | None, str | None]]:
    """The engines built after the first one, in order, as (tag, passes or None for the first engine's, switch or
    None): each round (the first engine again from the second round on) then every variant (`--without`, `--with`,
    each `--switch`); nothing when there is no variant."""
    from mini_infer.passes import add_passes

    variants = []
    if without:
        off = without.split(",")
        variants.append((f",without={'+'.join(off)}", [p for p in first_passes if p not in off], None))
    if with_:
        on = with_.split(",")
        variants.append((f",with={'+'.join(on)}", add_passes(first_passes, on), None))
    variants += [(f",{switch}", None, switch) for switch in switches]
    runs = []
    for rnd in range(rounds if variants else 0):
        suffix = f",round={rnd + 1}" if rnd else ""
        if rnd:
            runs.append((suffix, None, None))
        runs += [(tag + suffix, passes, switch) for tag, passes, switch in variants]
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-7b")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=None, help="KV cache block size, every engine (engine default)")
    ap.add_argument("--peers", default="hf-eager,hf-static", help="comma list of hf-eager,hf-static,vllm, or none")
    ap.add_argument("--quantization", default="none", help="comma list of none, fp8, w8a8, mxfp4 (MoE models)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="comma list of auto, fp8, bfloat16, ...")
    ap.add_argument("--without", default=None,
                    help="comma list of passes: one more engine, the first one's pipeline without them (their gain)")
    ap.add_argument("--with", dest="with_", default=None,
                    help="comma list of opt-in passes: one more engine, the first one's pipeline plus them, appended")
    ap.add_argument("--quantize-lm-head", action="store_true",
                    help="one more engine per quantized one: its pipeline with the lm_head quantized too (lm_head=True)")
    ap.add_argument("--switch", action="append", default=[],
                    help="`module.ATTR=int` of a mini_infer.ops module (e.g. paged_attention.ATTN_PRELOAD=0), or "
                         "`module.TABLE[key][field]=int` (e.g. paged_attention._CONFIG[decode_split][num_warps]=4), or "
                         "`env:NAME=value` (an environment variable); "
                         "several for one engine joined by commas: one more engine, the first one's, built with that "
                         "switch set (restored after); repeatable (bench/switches.py)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="with --switch / --without / --with: build and time the first engine and the other ones "
                         "this many times, alternated")
    ap.add_argument("--repeat", type=int, default=1,
                    help="TTFT of this many prompts of --prompt-len in the same engine (the last one decodes)")
    ap.add_argument("--out", default="bench/out")
    args = ap.parse_args()
    check_switches(args.switch)  # every switch parsed and found before the first engine

    from mini_infer.models import load_model

    bw = copy_bandwidth()
    engines = []
    for q in args.quantization.split(","):
        for kv in args.kv_cache_dtype.split(","):
            engines.append(measure_engine(args, bw, None if q == "none" else q, kv))
    if args.quantize_lm_head:
        from mini_infer.passes import PASSES

        for e in [e for e in engines if e["quantization"]]:
            name = f"quantize_{e['quantization']}"
            passes = [PASSES[name](lm_head=True) if p == name else p for p in e["passes"]]
            engines.append(measure_engine(args, bw, e["quantization"], e["kv_cache_dtype"], passes, ",lm_head"))
    first = engines[0]
    for tag, passes, switch in variant_runs(first["passes"], args.without, args.with_, args.switch, args.rounds):
        with switched(switch) if switch else contextlib.nullcontext():
            engines.append(measure_engine(args, bw, first["quantization"], first["kv_cache_dtype"], passes, tag))
    prompt = engines[0]["prompt"]
    rows = []
    for e in engines:
        tag = f"q={e['quantization'] or 'none'},kv={e['kv_cache_dtype']}{e['tag']}"
        rows += [(f"floor [{tag}]", e["floor_tok_s"]), (f"mini-infer [{tag}]", e["decode_tok_s"])]
    floor_tok_s = engines[0]["floor_tok_s"]  # the peers' floor: the first engine (bf16 unless told otherwise)
    peers = args.peers.split(",") if args.peers and args.peers != "none" else []
    peer_meta = {}
    if "vllm" in peers:  # first, while this process holds no model: vLLM takes 90% of the device
        from vllm_peer import model_dir, run_offline

        res = run_offline("latency", dict(model_dir=str(model_dir(args.model)), prompt=prompt,
                                          new_tokens=args.new_tokens, out=args.out,
                                          max_model_len=args.prompt_len + args.new_tokens + 16))
        peer_meta["vllm"] = res
        if "error" in res:
            print(f"vllm: did not run: {res['error']}", flush=True)
        else:
            rows.append((f"vllm {res['version']}", res["decode_tok_s"]))
    hf_peers = [p for p in peers if p != "vllm"]
    ids = torch.tensor([prompt], device="cuda") if hf_peers else None
    # the same weights (seeded preset)
    model = load_model(args.model, device="cuda").model if hf_peers else None
    hf_kwargs = {"hf-eager": {}, "hf-static": {"cache_implementation": "static"}}
    for peer in hf_peers:
        if peer not in hf_kwargs:
            raise SystemExit(f"unknown peer {peer!r}")
        try:  # a peer that cannot run this model (HF's compile of an MoE block) loses its row, not the run's
            rows.append(({"hf-static": "hf-static+compile"}.get(peer, peer),
                         time_hf(model, ids, args.new_tokens, **hf_kwargs[peer])))
        except Exception as exc:  # noqa: BLE001 - reported and recorded
            peer_meta[peer] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            print(f"{peer}: did not run: {peer_meta[peer]['error']}", flush=True)
    print(f"{args.model} batch 1, prompt {args.prompt_len}, {args.new_tokens} new tokens; copy bandwidth "
          f"{bw / 1e12:.2f} TB/s")
    for e in engines:
        same = sum(a == b for a, b in zip(e["tokens"], engines[0]["tokens"]))
        print(f"  q={e['quantization'] or 'none'} kv={e['kv_cache_dtype']}{e['tag']}: startup {e['startup_s']:.1f}s (compile "
              f"{e['compile_s']:.1f}s, long-run warm-up {e['warmup_s']:.1f}s, cuda graphs {e['capture_s']:.1f}s); TTFT {' then '.join(f'{t * 1e3:.1f}' for t in e['ttft_runs_s'])} ms; weights "
              f"{e['weights_read']}; KV {e['kv_bytes_per_token']} B/token; greedy tokens equal to the "
              f"first engine's: {same}/{len(e['tokens'])}")
        print(f"    decode ms/token: LLM.generate {1e3 / e['decode_tok_s']:.3f}, engine.step() loop "
              f"{e['step_loop_ms']:.3f} (same engine and prompt); inside generate a decode step "
              f"{e['decode_step_ms']:.3f} ms wall, of it host busy {e['host_busy_ms']:.3f} (the rest waits on the "
              "device)")
    print(f"{'engine':<54}{'tok/s':>9}{'ms/token':>10}{'of floor':>10}")
    for name, tps in rows:
        own = next((e["floor_tok_s"] for e in engines if name.endswith(
            f"[q={e['quantization'] or 'none'},kv={e['kv_cache_dtype']}{e['tag']}]")), floor_tok_s)
        print(f"{name:<54}{tps:>9.1f}{1e3 / tps:>10.2f}{tps / own:>10.3f}")  # 3 places: 0.448 is not 0.45
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "latency.json").write_text(json.dumps({
        "model": args.model, "device": torch.cuda.get_device_name(), "torch": torch.__version__, **git_info(),
        "date": time.strftime("%Y-%m-%d"), "copy_bandwidth_Bps": bw, "peers": peer_meta,
        "engines": [{k: v for k, v in e.items() if k not in ("tokens", "prompt")} for e in engines],
        "results": {name: tps for name, tps in rows}}, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 1 + 0.4 * len(rows)))
        colors = ["C7" if r[0].startswith("floor") else "C0" if r[0].startswith("mini-infer") else "C1" for r in rows]
        ax.barh([r[0] for r in rows], [r[1] for r in rows], color=colors)
        ax.set_xlabel("decode tokens/s (batch 1)")
        ax.set_title(f"{args.model} latency ({torch.cuda.get_device_name()})")
        fig.tight_layout()
        fig.savefig(out_dir / "latency.png", dpi=120)
    except ImportError:
        pass


if __name__ == "__main__":
    main()
