"""Offline throughput: mini-infer against Hugging Face transformers on the same prompts, in the same run.

Workloads:
  * `cpu16` (default on CPU): 16 concurrent prompts of 64-256 random tokens, 64 output tokens each, the
    embedded SmolLM2-135M-Instruct; peer: HF batched `generate` (left-padded, greedy, fixed length).
  * `nanovllm` (default on GPU): nano-vllm's bench.py workload drawn exactly as it draws it (256 sequences,
    `random.seed(0)`, prompt ids `randint(0, 10000)`, prompt and output lengths `randint(100, 1024)`: 133,966
    output tokens), temperature 0.6, ignore_eos, on the `qwen3-0.6b` preset; peer: HF continuous batching
    (`model.generate_batch`, attention `paged|sdpa`).
Peers: `hf-generate`, `hf-generate_batch`, and `vllm` (vLLM in its own process after mini-infer has freed the
GPU, defaults, `load_format="dummy"` from the same config: bench/vllm_peer.py).
Prints a table, writes JSON and a PNG bar chart to --out (default bench/out/).

    python bench/throughput.py                       # CPU: cpu16 workload
    python bench/throughput.py --workload nanovllm   # GPU
    python bench/throughput.py --workload nanovllm --peers vllm   # vLLM beside us (needs vllm importable)
    python bench/throughput.py --workload nanovllm --kv-cache-dtype auto,fp8 --peers none   # fp8 KV cache vs not

`--parallel` (a comma list of `1`, `N` and `Nep`: one GPU, tensor parallelism over N, and N with expert parallelism;
default `1`) adds one engine per entry, each run on the same workload in the same process, the other ranks started
by the engine and stopped before the next engine (rows `mini-infer[..,tp=N]` / `[..,tp=N ep]`): throughput scaling
of a model over GPUs, e.g. `--model qwen3-30b-a3b --parallel 1,2,2ep --peers none` on two GPUs.

`--quantization` and `--kv-cache-dtype` take comma lists ("none" = no quantization): each combination is an
engine of its own, run on the same workload one after the other in the same run (rows `mini-infer[q=..,kv=..]`).
`--kv-cache-memory-bytes` caps the KV cache (to see what a cache of half the bytes per token buys when memory is
short); the peers always run the unquantized model. `--switch` (bench/switches.py, as bench/latency.py takes it) adds
one more engine per combination, built and run with a kernel switch set, e.g.
`--kv-cache-dtype fp8 --switch "paged_attention._CONFIG[decode_fp8][maxnreg]=128"`. `--block-size` (a comma list,
"default" = the engine's choice from its cache specs) adds one engine per KV block size, e.g. `--kv-cache-dtype
auto,fp8 --block-size default,16,128`.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import platform
import time
from pathlib import Path

import torch
from jit_watch import JitWatch  # Triton variants first used inside the timed run
from kernel_norm import git_info  # the sibling script's HEAD and dirty files
from switches import check_switches, switched  # a kernel switch set for one engine's build

from mini_infer.benchmark import BenchResult, Workload, run_engine

WARMUP_PROMPTS = 32  # prompts of the workload the --warmup-engine run takes


def hf_batched_generate(model, workload: Workload, pad_id: int) -> BenchResult:
    """HF `generate` on the whole batch at once (left padding), greedy, every row to its max length."""
    device = next(model.parameters()).device
    width = max(len(p) for p in workload.prompts)
    ids = torch.full((len(workload.prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(workload.prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    new = max(workload.output_lens)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=pad_id)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    produced = (out.shape[1] - width) * len(workload.prompts)
    return BenchResult("hf-generate", len(workload.prompts), produced, seconds)


def hf_generate_batch(model, workload: Workload, temperature: float) -> BenchResult:
    """HF continuous batching (`generate_batch`, paged|sdpa attention)."""
    from transformers import GenerationConfig

    model.set_attn_implementation("paged|sdpa")
    # generate_batch takes one max_new_tokens for all requests: the workload's mean, so that the total
    # number of generated tokens matches.
    mean_out = round(sum(workload.output_lens) / len(workload.output_lens))
    cfg = GenerationConfig(max_new_tokens=mean_out, do_sample=temperature > 0,
                           temperature=temperature or None, eos_token_id=-1)
    start = time.perf_counter()
    outs = model.generate_batch(inputs=workload.prompts, generation_config=cfg)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    model.set_attn_implementation("sdpa")
    produced = sum(len(o.generated_tokens) for o in outs.values())
    return BenchResult("hf-generate_batch", len(workload.prompts), produced, seconds)


@contextlib.contextmanager
def step_times(engine, into: list):
    """Times every `engine.step()` call inside the block: appends (ordinal, kind, ms) to `into`, kind being that of
    the step the call launched ("mixed", "decode", or None for a call that only completed the step in flight), so
    that a slow kind of step shows whether one call or all of them took the time."""
    real = engine.step

    def timed(*args, **kwargs):
        before = engine.stats["mixed_steps"], engine.stats["decode_steps"]
        t0 = time.perf_counter()
        out = real(*args, **kwargs)
        ms = 1e3 * (time.perf_counter() - t0)
        kind = ("mixed" if engine.stats["mixed_steps"] > before[0] else
                "decode" if engine.stats["decode_steps"] > before[1] else None)
        into.append((len(into), kind, ms))
        return out

    engine.step = timed
    try:
        yield into
    finally:
        del engine.step  # the instance attribute goes; the class's method is back


def step_ms(stats: dict, kind: str) -> float:
    """The mean wall time (ms) of an engine's steps of one kind ("mixed" or "decode") from its stats."""
    return 1e3 * stats[f"{kind}_seconds"] / max(stats[f"{kind}_steps"], 1)


def slowest(steps: list, kind: str, n: int = 5) -> list:
    """The `n` slowest (ordinal, ms) of `steps` (step_times' records) of one kind, slowest first."""
    return sorted(((i, round(ms, 1)) for i, k, ms in steps if k == kind), key=lambda x: -x[1])[:n]


def slow_mixed_steps(mixed_ms: list[float], factor: float = 2.0) -> list[int]:
    """Indices of the engines whose prefill / mixed steps took more than `factor` times the median of the other
    engines' (ms a step each): on an H200 the first engine of a fresh machine's first process ran them at ~63 ms
    against ~20 ms for every later one (bench/RESULTS.md, twenty-fifth session: the sampler's draw kernel compiled
    in the first sampled step, which the engine's start-up now does), which flatters the later engines'
    whole-workload ratios; kept to catch any such first-use cost again. Empty with fewer than two engines."""
    slow = []
    for i, ms in enumerate(mixed_ms):
        others = sorted(m for j, m in enumerate(mixed_ms) if j != i)
        if others and ms > factor * others[len(others) // 2]:
            slow.append(i)
    return slow


def parallel_variants(text: str) -> list[tuple[int, bool]]:
    """`--parallel`'s comma list ("1", "2", "2ep", ...) as (tensor_parallel_size, enable_expert_parallel) pairs."""
    out = []
    for item in text.split(","):
        item = item.strip()
        ep = item.endswith("ep")
        size = item[:-2] if ep else item
        if not size.isdigit() or int(size) < 1 or (ep and int(size) < 2):
            raise argparse.ArgumentTypeError(f"--parallel: {item!r} is not N or Nep (N >= 1; Nep needs N >= 2)")
        out.append((int(size), ep))
    return out


def parallel_label(tp: int, ep: bool) -> str:
    """The engine-name suffix of a parallel variant: nothing on one GPU."""
    return "" if tp == 1 else f",tp={tp}{' ep' if ep else ''}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    on_gpu = torch.cuda.is_available()
    ap.add_argument("--workload", choices=["cpu16", "nanovllm"], default="nanovllm" if on_gpu else "cpu16")
    ap.add_argument("--model", default=None, help="default: SmolLM2 (cpu16) or qwen3-0.6b (nanovllm)")
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--peers", default="auto", help="comma list of hf-generate,hf-generate_batch,vllm, or none")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="step token budget (engine default)")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                    help="overlap host scheduling with the device (engine default: on for CUDA)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--quantization", default="none", help="comma list of none, fp8, w8a8")
    ap.add_argument("--kv-cache-dtype", default="auto", help="comma list of auto, fp8, bfloat16, ...")
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="KV cache budget (engine default)")
    ap.add_argument("--block-size", default="default",
                    help="comma list of KV cache block sizes (tokens a block; 'default': the engine's)")
    ap.add_argument("--switch", action="append", default=[],
                    help="`module.ATTR=int`, `module.TABLE[key][field]=int` or `env:NAME=value` (the kind that "
                         "reaches tensor-parallel ranks; bench/switches.py; several for one engine joined by commas): "
                         "one more engine per --quantization / --kv-cache-dtype / --parallel variant, built with "
                         "that switch set (restored after); repeatable")
    ap.add_argument("--parallel", default="1", type=parallel_variants,
                    help="comma list of 1, N (tensor parallelism over N GPUs) and Nep (with expert parallelism)")
    ap.add_argument("--warmup-engine", action="store_true",
                    help="build and run a throwaway engine (the first variant's, a slice of the workload) first")
    ap.add_argument("--out", default="bench/out")
    args = ap.parse_args()
    check_switches(args.switch)  # every switch parsed and found before the first engine
    if args.threads:
        torch.set_num_threads(args.threads)

    from mini_infer.llm import LLM

    if args.workload == "cpu16":
        model, n, inp, outp, temp = args.model, args.num_prompts or 16, (64, 256), (64, 64), 0.0
        peers = ["hf-generate"]
    else:
        model, n, inp, outp, temp = args.model or "qwen3-0.6b", args.num_prompts or 256, (100, 1024), (100, 1024), 0.6
        peers = ["hf-generate_batch"]
    if args.peers != "auto":
        peers = [] if args.peers == "none" else args.peers.split(",")

    variants = [(None if q == "none" else q, kv, switch, par, None if bs == "default" else int(bs))
                for switch in [None, *args.switch] for par in args.parallel for bs in args.block_size.split(",")
                for q in args.quantization.split(",") for kv in args.kv_cache_dtype.split(",")]
    results, engine_meta, llm = [], [], None
    # a throwaway engine first (the first variant's, on the workload's first WARMUP_PROMPTS prompts): on an H200 the
    # first engine of a process ran its prefill / mixed steps ~3x slower than every later one until the engine's
    # start-up built the sampler's kernels (RESULTS, twenty-seventh session); for any other first-use cost
    runs = [(*variants[0], False)] * args.warmup_engine + [(*v, True) for v in variants]
    for quantization, kv_cache_dtype, switch, (tp, ep), block_size, timed in runs:
        llm = None  # free the previous engine before building the next
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        t0 = time.perf_counter()
        with switched(switch) if switch else contextlib.nullcontext():  # for the build and the eager launches too
            llm = LLM(model, max_num_seqs=max(n, 16), max_model_len=inp[1] + outp[1] + 256,  # 2304: nano-vllm's
                      max_num_batched_tokens=args.max_num_batched_tokens, async_scheduling=args.async_scheduling,
                      quantization=quantization, kv_cache_dtype=kv_cache_dtype,
                      kv_cache_memory_bytes=args.kv_cache_memory_bytes, tensor_parallel_size=tp,
                      enable_expert_parallel=ep, **({"block_size": block_size} if block_size else {}))
            startup = time.perf_counter() - t0
            wl = (Workload.nanovllm(n) if args.workload == "nanovllm"
                  else Workload.random(n, inp, outp, llm.engine.vocab_size, seed=0))
            jit, steps, watch = JitWatch(), [], contextlib.ExitStack()
            watch.enter_context(jit)
            watch.enter_context(step_times(llm.engine, steps))
            if not timed:
                part = Workload(wl.prompts[:WARMUP_PROMPTS], wl.output_lens[:WARMUP_PROMPTS])
                r = run_engine(llm, part, temperature=temp, around_timed=watch)
                st = llm.engine.stats
                print(f"warm-up engine (not timed): {len(part.prompts)} prompts, {r.seconds:.1f}s; "
                      f"{step_ms(st, 'mixed'):.1f} ms a prefill / mixed step; "
                      f"slowest mixed-step calls (ordinal, ms): {slowest(steps, 'mixed')}; {jit.line()}", flush=True)
                for v in jit.variants:
                    print(f"  first used: {v}", flush=True)
                llm.engine.close()
                continue
            r = run_engine(llm, wl, temperature=temp, around_timed=watch)
        if len(variants) > 1:
            r.name = (f"mini-infer[q={quantization or 'none'},kv={kv_cache_dtype}{',' + switch if switch else ''}"
                      f"{f',block={block_size}' if block_size else ''}"
                      f"{parallel_label(tp, ep)}]")
        r.startup_seconds = startup
        results.append(r)
        st = llm.engine.stats
        kv_tokens = llm.engine.kv_cache.num_blocks * llm.engine.config.block_size
        engine_meta.append(dict(name=r.name, quantization=quantization, kv_cache_dtype=kv_cache_dtype, switch=switch,
                                block_size=llm.engine.config.block_size,
                                tensor_parallel_size=tp, expert_parallel=ep,
                                kv_cache_tokens=kv_tokens, preemptions=st.get("preemptions", 0),
                                kv_bytes_per_token=llm.engine.compiled.cache_bytes_per_token(),
                                weight_bytes=llm.engine.compiled.weight_bytes))
        # the host's own share of the steps' wall time (the rest waited on the device for sampled ids): near 1, the
        # host bounds the run, not the GPU
        step_s = st["decode_seconds"] + st["mixed_seconds"]
        engine_meta[-1]["host_busy_share"] = (step_s - st["device_wait_seconds"]) / step_s if step_s else None
        engine_meta[-1]["triton_first_uses_timed"] = jit.first_uses  # variants loaded or compiled inside the timing
        engine_meta[-1]["triton_first_use_variants"] = jit.variants  # their signatures and constants
        engine_meta[-1]["mixed_step_ms"] = step_ms(st, "mixed")
        # (ordinal among the timed run's step calls, ms) of the slowest calls that launched a mixed step
        engine_meta[-1]["slowest_mixed_calls"] = slowest(steps, "mixed")
        allreduce = ""
        if tp > 1:  # which all-reduce rank 0 ran: a symmetric buffer set up, or the collective (ops/all_reduce.py:
            # only the first engine of a process that sets one up gets it)
            from mini_infer.ops.all_reduce import symmetric_buffers

            symmetric = sum(symmetric_buffers().values())
            engine_meta[-1]["symmetric_allreduce_bytes"] = symmetric
            way = f"symmetric memory ({symmetric} B)" if symmetric else "the collective (NCCL / gloo)"
            allreduce = f"; all-reduce: {way}"
        print(f"{r.name} step time: {st['decode_steps']} decode-only steps {st['decode_seconds']:.1f}s "
              f"({step_ms(st, 'decode'):.1f} ms each), {st['mixed_steps']} "
              f"prefill/mixed steps {st['mixed_seconds']:.1f}s "
              f"({engine_meta[-1]['mixed_step_ms']:.1f} ms each); KV cache {kv_tokens} tokens "
              f"({engine_meta[-1]['kv_bytes_per_token']} B/token), {engine_meta[-1]['preemptions']} preemptions; "
              f"host busy {100 * (engine_meta[-1]['host_busy_share'] or 0):.0f}% of the step time{allreduce}",
              flush=True)
        print(f"{r.name} timed run: {jit.line()}; slowest mixed-step calls (ordinal, ms): "
              f"{engine_meta[-1]['slowest_mixed_calls']}", flush=True)
        for v in jit.variants:
            print(f"  first used: {v}", flush=True)
        print(f"{r.name}: {r.output_tok_s:.1f} output tok/s ({r.seconds:.1f}s; startup "
              f"{startup:.1f}s, compile {llm.engine.compile_seconds:.1f}s, graphs {llm.engine.capture_seconds:.1f}s)",
              flush=True)
        llm.engine.close()  # the other ranks stop (nothing to do at tp=1)
    pad = llm.engine.tokenizer.pad_token_id if llm.engine.tokenizer is not None else None
    async_scheduling = llm.engine.async_scheduling
    del llm  # the GPU is the next engine's
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    peer_meta = {}
    if "vllm" in peers:  # first, while this process holds no model: vLLM takes 90% of the device
        from vllm_peer import model_dir, run_offline

        res = peer_meta["vllm"] = run_offline("throughput", dict(
            model_dir=str(model_dir(model)), max_model_len=2304, temperature=temp, prompts=wl.prompts,
            output_lens=wl.output_lens, out=args.out))
        if "error" in res:
            print(f"vllm: did not run: {res['error']}", flush=True)
        else:
            results.append(BenchResult(f"vllm {res['version']}", len(wl.prompts), res["output_tokens"],
                                       res["seconds"], res["startup_seconds"]))
            print(f"{results[-1].name}: {results[-1].output_tok_s:.1f} output tok/s ({res['seconds']:.1f}s; startup "
                  f"{res['startup_seconds']:.1f}s)", flush=True)
    hf_peers = [p for p in peers if p != "vllm"]
    if hf_peers:  # a second copy of the same (seeded) model: the engine released its HF model after compiling
        from mini_infer.models import load_model

        hf_model = load_model(model, device="cuda" if torch.cuda.is_available() else "cpu").model
    for peer in hf_peers:
        if peer == "hf-generate":
            results.append(hf_batched_generate(hf_model, wl, pad if pad is not None else 0))
        elif peer == "hf-generate_batch":
            results.append(hf_generate_batch(hf_model, wl, temp))
        else:
            raise SystemExit(f"unknown peer {peer!r}")

    for i in slow_mixed_steps([e["mixed_step_ms"] for e in engine_meta]):
        engine_meta[i]["slow_mixed_steps"] = True
        print(f"note: {engine_meta[i]['name']}'s prefill / mixed steps ({engine_meta[i]['mixed_step_ms']:.1f} ms each) "
              f"took over twice the other engines' median: its whole-workload rate is not comparable with theirs "
              f"(compare the decode steps; bench/RESULTS.md, twenty-fifth session)", flush=True)
    base = results[0].output_tok_s
    print(f"workload {args.workload}: {n} requests, prompt {inp}, output {outp}, model {model or 'SmolLM2-135M'}")
    width = max(20, *(len(r.name) + 2 for r in results))
    print(f"{'engine':<{width}}{'out tokens':>11}{'seconds':>10}{'out tok/s':>11}{'mini-infer x':>14}")
    for r in results:
        print(f"{r.name:<{width}}{r.output_tokens:>11}{r.seconds:>10.2f}{r.output_tok_s:>11.1f}"
              f"{base / r.output_tok_s if r.output_tok_s else float('nan'):>14.2f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"engines": engine_meta, "peers": peer_meta, "async_scheduling": async_scheduling, "workload": args.workload, "model": model, "num_prompts": n, "device": torch.cuda.get_device_name()
            if on_gpu else platform.processor() or "cpu", "threads": torch.get_num_threads(),
            "torch": torch.__version__, **git_info(), "date": time.strftime("%Y-%m-%d")}
    (out / f"throughput_{args.workload}.json").write_text(json.dumps(
        {"meta": meta, "results": [r.as_dict() for r in results]}, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 1 + 0.5 * len(results)))
        ax.barh([r.name for r in results], [r.output_tok_s for r in results],
                color=["C0"] * len(variants) + ["C7"] * (len(results) - len(variants)))
        ax.set_xlabel("output tokens/s")
        ax.set_title(f"throughput, {args.workload} ({meta['device']})")
        fig.tight_layout()
        fig.savefig(out / f"throughput_{args.workload}.png", dpi=120)
    except ImportError:
        print("matplotlib not installed: no plot")


if __name__ == "__main__":
    main()
