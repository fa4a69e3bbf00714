"""Tensor parallelism on one host: batch-1 decode with TP=1 and TP=N in the same run, greedy outputs compared,
and the all-reduce time of one decode step measured on its own.

1. Correctness (float32, TF32 off, CUDA graphs on): every dense tiny preset and the MoE ones tensor parallelism
   supports (tiny-mixtral, tiny-qwen3-moe, tiny-qwen2-moe: experts split inside, fused_moe on each rank's share),
   greedy tokens of TP=N must equal TP=1's (prompts of 5 / 17 / 64 / 130 tokens, 16 new each). Any mismatch is a
   bug, and exits 1 at the end. `--check-only` stops there; `--presets a,b` checks only those (one process per
   preset keeps every engine on the symmetric-memory all-reduce when it is switched on: it serves one process
   group per process).
2. Speed: `--model` (default the `qwen2.5-7b` preset: bf16, random weights), prompt 128, 256 new tokens, batch 1,
   TP=1 on GPU 0, then TP=N on GPUs 0..N-1 (the N-1 other ranks are started by the engine). Prints decode tok/s,
   ms/token, the speed-up and the weight-bandwidth floor of each (the weight bytes a token reads per rank, MoE: the
   top-k experts only, bench/active_bytes.py; + KV; over the copy bandwidth). The greedy
   tokens of the two runs are compared: bf16 sums in another order (the all-reduce) can flip a near-tie of random
   weights, so a divergence is reported with its position rather than failing the run.
   The TP=N engines use `mini_infer.all_reduce_sum` as compiled (by default the one-shot / two-shot paths over
   symmetric memory for messages up to 32 MiB, NCCL above; mini_infer/ops/all_reduce.py); the table's label says
   which ran ("symmetric" or "nccl": only the first engine of a process that sets symmetric memory up gets it).
   `--compare-nccl` adds a TP=N run with both paths off (MINI_INFER_ONE_SHOT_ALLREDUCE=0,
   MINI_INFER_TWO_SHOT_ALLREDUCE=0) before the default one, so that the default one is still the process's first
   to set symmetric memory up.
3. All-reduce cost: N ranks capture, in one CUDA graph, the 2 x layers all-reduces that one decode step runs, of
   [rows, hidden] bf16 for rows 1, 8 and 64, once through NCCL (`_c10d_functional.all_reduce` + `wait_tensor`)
   and once through the op's one-shot path, and time the replays: µs per call (the scale after each, timed
   alone, taken off), whether the one-shot path ran, and its largest difference from NCCL's sum (0 expected at
   N=2). `--allreduce-probe` runs this part alone (no engine; exit 1 if the one-shot path did not run or
   differed).

`--enable-expert-parallel` (MoE models): the check runs the MoE tiny presets with expert parallelism (each rank
E/N whole experts, fused_moe over them with an expert map) instead of every preset with the experts split
inside; the speed part runs TP=N twice, experts split inside and then expert-parallel, beside TP=1 in the same
run (one all-reduce per MoE block either way: docs/distributed.md, "when to choose which").

    python bench/tp.py                          # 2 GPUs, qwen2.5-7b
    python bench/tp.py --tp 2 --model llama-3.1-8b --skip-check
    python bench/tp.py --check-only                              # the float32 greedy check alone
    python bench/tp.py --model qwen3-30b-a3b --allreduce-probe   # NCCL vs one-shot all-reduce, shapes only
    python bench/tp.py --model qwen3-30b-a3b --skip-check --compare-nccl   # TP=1, TP=2 NCCL, TP=2 symmetric
    python bench/tp.py --model qwen1.5-moe-a2.7b --skip-check    # MoE decode speed (one all-reduce per MoE block)
    python bench/tp.py --model qwen3-30b-a3b --enable-expert-parallel   # MoE: TP=1, TP=2, TP=2 + EP; EP check
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from active_bytes import token_bytes  # noqa: E402  (the weight bytes a token reads)
from latency import copy_bandwidth  # noqa: E402

MOE_PRESETS = ("tiny-mixtral", "tiny-qwen3-moe", "tiny-qwen2-moe")  # the tiny MoE presets TP supports


def _text_config(model: str):
    """The text config of a preset name or a checkpoint path (hidden size and layers for the probe)."""
    from mini_infer.models.presets import ALL_PRESETS, preset_config

    if model in ALL_PRESETS:
        return preset_config(model).get_text_config()
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model).get_text_config()


def _greedy(llm, prompts: list[list[int]], new: int) -> list[list[int]]:
    from mini_infer.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in
            llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


def _release(llm) -> None:
    """Stop the engine's other ranks; the caller drops its last reference, then `_free()`."""
    llm.engine.close()


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def check_presets(tp: int, expert_parallel: bool = False, only: tuple[str, ...] = ()) -> list[str]:
    """Greedy TP=tp == TP=1 in float32 on every dense tiny preset and MOE_PRESETS (MOE_PRESETS alone, with
    expert parallelism, when `expert_parallel`), or on those of them named in `only`; returns the failures."""
    from mini_infer.llm import LLM
    from mini_infer.models.presets import TINY_DENSE_PRESETS
    from mini_infer.ops.all_reduce import symmetric_buffers

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (5, 17, 64, 130)]
    failures = []
    names = MOE_PRESETS if expert_parallel else (*TINY_DENSE_PRESETS, *MOE_PRESETS)
    unknown = set(only) - set(names)
    if unknown:
        raise SystemExit(f"--presets: {', '.join(sorted(unknown))} not among the checked presets ({', '.join(names)})")
    for name in (n for n in names if not only or n in only):
        opts = dict(dtype="float32", max_model_len=256, kv_cache_memory_bytes=64 << 20, max_num_batched_tokens=64,
                    max_num_seqs=8)
        try:
            llm = LLM(name, **opts)
            one = _greedy(llm, prompts, 16)
            _release(llm)
            del llm
            _free()
            llm = LLM(name, tensor_parallel_size=tp, enable_expert_parallel=expert_parallel, **opts)
            many = _greedy(llm, prompts, 16)
            graphs = len(llm.engine.runner.cuda_graphs.graphs) if llm.engine.runner.cuda_graphs else 0
            allreduce = "symmetric memory" if symmetric_buffers() else "the collective"  # rank 0's, before release
            _release(llm)
            del llm
            _free()
        except Exception as exc:  # noqa: BLE001 - reported as a failure with its error
            failures.append(f"{name}: {type(exc).__name__}: {exc}")
            print(f"[check] {name}: ERROR {type(exc).__name__}: {exc}", flush=True)
            continue
        ok = one == many
        print(f"[check] {name}: TP={tp}{' EP' if expert_parallel else ''} greedy {'==' if ok else '!='} TP=1 "
              f"({graphs} CUDA graphs on rank 0, all-reduce: {allreduce})", flush=True)
        if not ok:
            failures.append(f"{name}: TP={tp} {many} != TP=1 {one}")
    torch.backends.cuda.matmul.allow_tf32 = True
    return failures


def _report_check(failures: list[str], tp: int, expert_parallel: bool = False, only: tuple[str, ...] = ()) -> None:
    """The check's verdict, naming what it covered: the presets of `only`, else every preset of its kind."""
    covered = ", ".join(only) if only else ("every MoE tiny preset" if expert_parallel
                                            else "every dense and MoE tiny preset")
    if failures:
        print("float32 check FAILED:\n  " + "\n  ".join(failures))
    elif expert_parallel:
        print(f"float32 check: TP={tp} with expert parallelism greedy == TP=1 on {covered}")
    else:
        print(f"float32 check: TP={tp} greedy == TP=1 on {covered}")


def decode_run(model: str, tp: int, prompt: list[int], new: int, expert_parallel: bool = False,
               env: dict[str, str] | None = None) -> dict:
    """Batch-1 decode tok/s, tokens and weight bytes per rank of one engine; `env`: environment variables set
    for this engine only (its ranks inherit them), None = the process's."""
    from switches import environment

    with environment(env or {}):
        return _decode_run(model, tp, prompt, new, expert_parallel, env)


def _decode_run(model: str, tp: int, prompt: list[int], new: int, expert_parallel: bool,
                env: dict[str, str] | None) -> dict:
    from mini_infer.llm import LLM
    from mini_infer.ops.all_reduce import symmetric_buffers
    from mini_infer.sampling_params import SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model, max_num_seqs=1, max_model_len=len(prompt) + new + 16, kv_cache_memory_bytes=2 << 30,
              tensor_parallel_size=tp, enable_expert_parallel=expert_parallel)
    startup = time.perf_counter() - t0
    eng = llm.engine
    llm.generate([{"prompt_token_ids": prompt[:16]}], SamplingParams(max_tokens=8), use_tqdm=False)  # warm-up
    torch.cuda.synchronize()
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    start = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    torch.cuda.synchronize()
    total = time.perf_counter() - start
    first = out.metrics.first_token_time - out.metrics.arrival_time
    # the weight bytes one token reads on this rank (bench/active_bytes.py): all but the embedding, and for MoE
    # layers only the top-k experts' share (under expert parallelism: as if this rank held all k, the worst case)
    weights = token_bytes(eng.compiled.graph_module).active
    kv_per_token = sum(s.bytes_per_token() for s in eng.compiled.cache_specs)
    hidden = eng.model_config.get_text_config().hidden_size
    layers = eng.model_config.get_text_config().num_hidden_layers
    allreduce = "-" if tp == 1 else ("symmetric" if symmetric_buffers() else "nccl")
    label = f"{tp}{' EP' if expert_parallel else ''}{'' if tp == 1 else ' ' + allreduce}"
    result = dict(tp=tp, label=label, expert_parallel=expert_parallel, allreduce=allreduce,
                  env=env, tok_s=(new - 1) / (total - first), ttft_s=first, startup_s=startup,
                  active_weight_bytes_per_rank=weights, kv_bytes_per_token_per_rank=kv_per_token,
                  tokens=list(out.outputs[0].token_ids), hidden=hidden, layers=layers,
                  graphs=len(eng.runner.cuda_graphs.graphs) if eng.runner.cuda_graphs else 0)
    _release(llm)
    return result


PROBE_ROWS = (1, 8, 64)  # [rows, hidden] bf16: batch-1 decode, a small batch, the one-shot limit at hidden 2048


def _graph_us(fn, replays: int = 20) -> float:
    """Median µs of one replay of a CUDA graph capturing `fn()` (warmed up eagerly first; ranks start together)."""
    import torch.distributed as dist

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(replays):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    dist.barrier()
    graph.reset()  # NCCL's teardown waits while a graph holding its kernels lives (pytorch#115388)
    times.sort()
    return times[len(times) // 2]


def _chain(x: torch.Tensor, reduce, group: str, count: int):
    """A step of `count` all-reduces of `x` by `reduce(y, group)`, each followed by a scale (as the residual add
    follows it)."""
    def step():
        y = x
        for _ in range(count):
            y = reduce(y, group) * 0.5
        return y
    return step


def _allreduce_rank(rank: int, tp: int, port: int, hidden: int, count: int, queue,
                    rows_list: tuple = PROBE_ROWS) -> None:
    """One rank of the probe: for each [rows, hidden] bf16 shape, `count` chained all-reduces (each followed by a
    scale, as the residual add follows it) in one CUDA graph, through NCCL and through the one-shot path; the
    scales alone are timed too and taken off. Rank 0 puts {rows: {...}} on `queue`."""
    import os

    import torch.distributed as dist

    from mini_infer.ops.all_reduce import (
        ONE_SHOT_ENV,
        all_reduce_sum_collective,
        all_reduce_sum_impl,
        all_reduce_sum_two_shot,
        has_two_shot,
        release_symmetric_buffers,
        symmetric_buffer,
        symmetric_buffers,
        symmetric_memory_missing,
    )

    os.environ[ONE_SHOT_ENV] = str(max(rows_list) * hidden * 2)  # let every probed shape take the one-shot path
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp)
    group = dist.group.WORLD.group_name
    results = {}
    for rows in rows_list:
        gen = torch.Generator(device="cuda").manual_seed(rank)
        x = torch.randn(rows, hidden, dtype=torch.bfloat16, device="cuda", generator=gen)

        one, nccl = all_reduce_sum_impl(x, group), all_reduce_sum_collective(x, group)  # sets up the buffer
        one_shot = bool(symmetric_buffers())
        row = {"one_shot_taken": one_shot, "max_abs_diff": (one.float() - nccl.float()).abs().max().item(),
               "scale_us": _graph_us(_chain(x, lambda y, g: y, group, count)) / count,
               "nccl_us": _graph_us(_chain(x, all_reduce_sum_collective, group, count)) / count,
               "one_shot_us": _graph_us(_chain(x, all_reduce_sum_impl, group, count)) / count}
        buf = symmetric_buffer(x, group) if has_two_shot() else None
        if buf is not None:  # torch's two-shot kernel over the same buffer (not a path the op takes)
            two = all_reduce_sum_two_shot(x, buf, group)
            row["two_shot_max_abs_diff"] = (two.float() - nccl.float()).abs().max().item()
            row["two_shot_us"] = _graph_us(_chain(x, lambda y, g, b=buf: all_reduce_sum_two_shot(y, b, g), group,
                                                  count)) / count
        results[rows] = row
    if rank == 0:
        queue.put({"results": results, "missing": symmetric_memory_missing()})
    dist.barrier()
    release_symmetric_buffers()
    dist.destroy_process_group()


def allreduce_probe(tp: int, hidden: int, layers: int, rows: tuple = PROBE_ROWS) -> dict:
    """Per-call µs of the 2 x layers all-reduces of a decode step ([rows, hidden] bf16 for each of `rows`),
    CUDA-graph captured on `tp` ranks, through NCCL and through the one-shot path (the scale after each is taken
    off); with whether the one-shot path ran and its largest difference from NCCL's sum."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_allreduce_rank, args=(r, tp, port, hidden, 2 * layers, queue, rows))
             for r in range(tp)]
    for p in procs:
        p.start()
    out = queue.get(timeout=300)
    for p in procs:
        p.join(60)
        if p.is_alive():  # a rank stuck in its teardown must not keep the script from exiting
            p.kill()
    return out


def report_probe(probe: dict, tp: int, hidden: int, layers: int, step_ms: float | None = None) -> None:
    if probe["missing"]:
        print(f"one-shot all-reduce unavailable: {probe['missing']}")
    print(f"all-reduce per call (TP={tp}, {2 * layers} chained in one CUDA graph, bf16, the scale after each "
          "taken off):")
    print(f"{'shape':<14}{'NCCL us':>9}{'one-shot us':>13}{'speed-up':>10}{'one-shot ran':>14}{'max |diff|':>12}"
          f"{'two-shot us':>13}{'max |diff|':>12}")
    for rows, r in probe["results"].items():
        nccl, one = r["nccl_us"] - r["scale_us"], r["one_shot_us"] - r["scale_us"]
        two = f"{r['two_shot_us'] - r['scale_us']:>13.2f}{r['two_shot_max_abs_diff']:>12.3g}" if "two_shot_us" in r \
            else f"{'-':>13}{'-':>12}"
        print(f"{f'[{rows}, {hidden}]':<14}{nccl:>9.2f}{one:>13.2f}{nccl / one:>10.2f}{str(r['one_shot_taken']):>14}"
              f"{r['max_abs_diff']:>12.3g}{two}")
        print(f"{'':<14}NCCL: {nccl * 2 * layers / 1e3:.2f} ms of all-reduce a step of {rows} tokens")
    if step_ms is not None and 1 in probe["results"]:
        r = probe["results"][1]
        for name, key in (("NCCL", "nccl_us"), ("one-shot", "one_shot_us")):
            us = (r[key] - r["scale_us"]) * 2 * layers
            print(f"  batch-1 decode step, {name}: {us:.0f} us of all-reduce = {us / 1e3 / step_ms:.0%} of the "
                  f"TP={tp} step")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-7b")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--skip-check", action="store_true", help="skip the float32 tiny-preset check")
    ap.add_argument("--check-only", action="store_true", help="run the float32 tiny-preset check only")
    ap.add_argument("--presets", default="",
                    help="comma list: check only these tiny presets (e.g. one per process: the symmetric-memory "
                         "all-reduce serves one process group per process, mini_infer/ops/all_reduce.py)")
    ap.add_argument("--enable-expert-parallel", action="store_true",
                    help="MoE: check the MoE presets with expert parallelism, and time TP=N with it too")
    ap.add_argument("--allreduce-probe", action="store_true",
                    help="time NCCL vs the one-shot all-reduce on the model's shapes only (no engine)")
    ap.add_argument("--probe-rows", default=",".join(map(str, PROBE_ROWS)),
                    help="the probe's message rows, comma list (e.g. 1,64,256,2048: a throughput run's decode and "
                         "prefill steps)")
    ap.add_argument("--compare-nccl", action="store_true",
                    help="also time TP=N with the symmetric-memory all-reduce paths off (NCCL), before the default")
    ap.add_argument("--out", default="bench/out")
    args = ap.parse_args()
    if torch.cuda.device_count() < args.tp:
        print(f"--tp {args.tp} needs {args.tp} GPUs; this machine has {torch.cuda.device_count()}")
        return 2

    if args.allreduce_probe:
        text = _text_config(args.model)
        rows = tuple(int(r) for r in args.probe_rows.split(","))
        probe = allreduce_probe(args.tp, text.hidden_size, text.num_hidden_layers, rows)
        report_probe(probe, args.tp, text.hidden_size, text.num_hidden_layers)
        return 0 if all(r["one_shot_taken"] and r["max_abs_diff"] == 0 for r in probe["results"].values()) else 1
    ep = args.enable_expert_parallel
    only = tuple(p for p in args.presets.split(",") if p)
    failures = [] if args.skip_check else check_presets(args.tp, ep, only)
    if args.check_only:
        _report_check(failures, args.tp, ep, only)
        return 1 if failures else 0
    bw = copy_bandwidth()
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 10000, (args.prompt_len,), generator=gen).tolist()
    from mini_infer.ops.all_reduce import ONE_SHOT_ENV, TWO_SHOT_ENV

    nccl_only = {ONE_SHOT_ENV: "0", TWO_SHOT_ENV: "0"}  # both symmetric-memory paths off
    runs = []
    variants = [(1, False, None), *([(args.tp, False, nccl_only)] if args.compare_nccl else []),
                (args.tp, False, None), *([(args.tp, True, None)] if ep else [])]
    for tp, with_ep, env in variants:
        runs.append(decode_run(args.model, tp, prompt, args.new_tokens, with_ep, env=env))
        _free()
    probe = allreduce_probe(args.tp, runs[0]["hidden"], runs[0]["layers"])
    a = runs[0]["tokens"]
    mean_ctx = args.prompt_len + args.new_tokens / 2
    print(f"\n{args.model} bf16 batch 1, prompt {args.prompt_len}, {args.new_tokens} new tokens; copy bandwidth "
          f"{bw / 1e12:.2f} TB/s per GPU; {torch.cuda.get_device_name()}")
    print(f"{'TP':<14}{'tok/s':>9}{'ms/token':>10}{'floor tok/s':>13}{'of floor':>10}{'speed-up':>10}"
          f"{'startup s':>11}{'graphs':>8}")
    for r in runs:
        floor = bw / (r["active_weight_bytes_per_rank"] + r["kv_bytes_per_token_per_rank"] * mean_ctx)
        r["floor_tok_s"] = floor
        print(f"{r['label']:<14}{r['tok_s']:>9.1f}{1e3 / r['tok_s']:>10.2f}{floor:>13.1f}{r['tok_s'] / floor:>10.2f}"
              f"{r['tok_s'] / runs[0]['tok_s']:>10.2f}{r['startup_s']:>11.1f}{r['graphs']:>8}")
    step_ms = 1e3 / runs[1]["tok_s"]
    report_probe(probe, args.tp, runs[0]["hidden"], runs[0]["layers"], step_ms)
    for r in runs[1:]:
        b = r["tokens"]
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        r["greedy_first_difference"] = same
        verdict = "identical" if same is None else f"first differ at token {same} of {len(a)} (bf16 sum order)"
        print(f"greedy tokens TP=1 vs TP={r['label']}: {verdict}")
    if not args.skip_check:
        _report_check(failures, args.tp, ep, only)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    from kernel_norm import git_info  # HEAD and the files that differ from it
    for r in runs:
        r.pop("tokens")
    (out_dir / "tp.json").write_text(json.dumps({
        "model": args.model, "device": torch.cuda.get_device_name(), "torch": torch.__version__, **git_info(),
        "date": time.strftime("%Y-%m-%d"), "copy_bandwidth_Bps": bw, "runs": runs, "allreduce_probe": probe,
        "greedy_first_difference": runs[1]["greedy_first_difference"], "expert_parallel_checked": ep,
        "check_failures": failures}, indent=2))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
