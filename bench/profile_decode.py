"""Where a batch-1 decode step's time goes: host work (schedule, input prep, sampling, bookkeeping) versus
the GPU replay of the captured graph, measured with CUDA events around the replay over many steps, and the
kernels one replay launches. With `--prefill N`, instead: one N-token prompt's prefill (chunked as the engine
chunks it), its time to first token and the kernels it spends it in. With `--timeline N`, also: N engine steps
under the profiler, read back as a GPU timeline (`timeline.py`): the GPU's work between two replays, and the
replay's kernels in order with their start, duration and the time each adds to the critical path (its end minus
the previous kernel's end: under programmatic dependent launch kernels overlap, so a kernel's own duration says
little), summed by kernel name.

    python bench/profile_decode.py [--model qwen2.5-7b] [--steps 200] [--quantization w8a8]
    python bench/profile_decode.py --model qwen3-0.6b --prefill 10000
    python bench/profile_decode.py --model qwen3-0.6b --timeline 6 [--trace-out trace.json]
    python bench/profile_decode.py --model qwen3-0.6b --batch 256 --prompt-len 600 --temperature 0.6 --timeline 2
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch
from switches import switched  # a kernel switch set for the run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-7b")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--prefill", type=int, default=0, help="profile one prompt of this many tokens instead")
    ap.add_argument("--quantization", default=None, help="w8a8 or fp8 (default: none)")
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto or fp8")
    ap.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    ap.add_argument("--without", default=None, help="comma list of passes left out of the recommended pipeline")
    ap.add_argument("--with", dest="with_", default=None,
                    help="comma list of opt-in passes appended to the recommended pipeline")
    ap.add_argument("--timeline", type=int, default=0, help="also profile this many engine steps as a GPU timeline")
    ap.add_argument("--trace-out", default=None, help="write the --timeline steps' chrome trace here")
    ap.add_argument("--switch", default=None,
                    help="`module.ATTR=int` or `module.TABLE[key][field]=int` (bench/switches.py; several joined by "
                         "commas): set for the whole run")
    args = ap.parse_args()
    with switched(args.switch) if args.switch else contextlib.nullcontext():  # the engine built and profiled under it
        profile(args)


def profile(args: argparse.Namespace) -> None:
    """main's run for its parsed arguments (a switch, if any, already set)."""
    if args.prefill:
        profile_prefill(args.model, args.prefill)
        return
    from mini_infer.llm import LLM
    from mini_infer.sampling_params import SamplingParams

    passes = None
    if args.without or args.with_:  # the recommended pipeline's pass names for this model and options, less
        # --without's, plus --with's
        from mini_infer.models.loader import resolve_dtype
        from mini_infer.models.model_info import inspect_model
        from mini_infer.passes import PassContext, add_passes, recommended_passes

        off = set(args.without.split(",")) if args.without else set()
        config, device = inspect_model(args.model, count_weights=False).config, torch.device("cuda")
        ctx = PassContext(config=config, device=device, dtype=resolve_dtype("auto", config, device),
                          quantization=args.quantization)
        passes = [p.name for p in recommended_passes(ctx) if p.name not in off]
        passes = add_passes(passes, args.with_.split(",") if args.with_ else [])
    llm = LLM(args.model, max_num_seqs=max(args.batch, 1), max_model_len=args.prompt_len + args.steps + 64,
              quantization=args.quantization, passes=passes, kv_cache_dtype=args.kv_cache_dtype)
    eng = llm.engine
    params = SamplingParams(temperature=args.temperature, max_tokens=args.steps + 20, ignore_eos=True)
    for i in range(args.batch):
        eng.add_request(None, {"prompt_token_ids": list(range(1000 + i, 1000 + args.prompt_len + i))}, params)
    while eng.stats["decode_steps"] < 5:  # all prompts prefilled, a few decode steps done
        eng.step()
    graphs = eng.runner.cuda_graphs
    replay = graphs.graphs[graphs.bucket_for(args.batch, args.batch, args.batch, decode=True)]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(50):
        replay.replay()
    end.record()
    torch.cuda.synchronize()
    gpu_ms = start.elapsed_time(end) / 50
    t0 = time.perf_counter()
    for _ in range(args.steps):
        eng.step()
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - t0) / args.steps * 1e3
    # host-only time of the parts around the forward
    out = eng.scheduler.schedule()
    t1 = time.perf_counter()
    for _ in range(100):
        eng.runner.prepare(out.scheduled, out.sample)
    prep_ms = (time.perf_counter() - t1) / 100 * 1e3
    print(f"{args.model} batch {args.batch}: step {step_ms:.2f} ms = graph replay {gpu_ms:.2f} ms (GPU) "
          f"+ {step_ms - gpu_ms:.2f} ms other; input prep alone {prep_ms:.3f} ms (host)")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        replay.replay()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    print(f"kernels per decode step (one replay): {len(kernels)}; host time per step outside the replay: "
          f"{step_ms - gpu_ms:.2f} ms")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=60))
    if args.timeline:
        from timeline import print_timeline

        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(args.timeline):
                eng.step()
            torch.cuda.synchronize()
        print_timeline(prof, trace_out=args.trace_out)


def profile_prefill(model: str, tokens: int) -> None:
    """Time to first token of one `tokens`-long prompt (after a warm-up prompt of the same length) and the
    kernels of its prefill steps, by GPU time."""
    from mini_infer.llm import LLM
    from mini_infer.sampling_params import SamplingParams

    llm = LLM(model, max_num_seqs=4, max_model_len=tokens + 64)
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def first_token(offset: int) -> tuple[float, int]:
        eng.add_request(None, {"prompt_token_ids": [(offset + i) % 30000 + 100 for i in range(tokens)]}, params)
        torch.cuda.synchronize()
        t0, steps = time.perf_counter(), 0
        while eng.has_unfinished_requests():
            eng.step()
            steps += 1
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3, steps

    first_token(0)  # warm-up: Triton compiles, allocator
    ttft, steps = first_token(7)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        first_token(13)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_ms = sum(e.device_time for e in kernels) / 1e3
    print(f"{model} prefill of {tokens} tokens: TTFT {ttft:.1f} ms in {steps} steps; kernels {len(kernels)}, "
          f"GPU time {gpu_ms:.1f} ms (profiled run)")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20, max_name_column_width=60))


if __name__ == "__main__":
    main()
