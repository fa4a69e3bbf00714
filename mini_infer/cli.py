"""The `mini-infer` command: `generate`, `dump-graph`, `serve`, `bench`.

Argument parsing and printing only; each command calls the public Python API (LLM, compile_model, the
server, the benchmark module). Flags use `vllm serve`'s names where one exists.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
import time


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", dest="model_flag", default=None,
                   help="local HF dir, .gguf file or preset (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", help="auto, bfloat16, float16, float32")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--block-size", type=int, default=None,
                   help="tokens a KV block (default: 64 over an fp8 KV cache, else 16)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    p.add_argument("--passes", default=None, help="comma-separated pass names (default: recommended pipeline)")
    p.add_argument("--quantization", "-q", default=None,
                   help="fp8: float8 e4m3 weights with per-channel scales and per-token dynamic activation scales "
                        "(CUDA compute capability >= 8.9, or the CPU); w8a8: int8 weights and activations, "
                        "SmoothQuant calibrated at start-up; mxfp4: MoE experts only, 4-bit weights with a "
                        "power-of-two scale a 32 (gpt-oss's published format) (default: none)")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="auto (the model dtype), bfloat16, float16, float32, or fp8 (= fp8_e4m3: half a 16-bit "
                        "cache's bytes per token, k/v scales 1.0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (steps run the graph eagerly)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule and launch the next step before the previous one's sampled ids are read back "
                        "(default: on for CUDA)")
    p.add_argument("--dry-run", action="store_true",
                   help="random weights in the model's architecture (vLLM's --load-format dummy); with no model, "
                        "the smollm2-135m preset")
    p.add_argument("--generation-config", choices=["auto", "vllm"], default="auto",
                   help="auto: sampling defaults (temperature, top_p, top_k, min_p, repetition_penalty, "
                        "max_new_tokens) from the model's generation_config.json; vllm: none")
    p.add_argument("--long-prefill-token-threshold", type=int, default=None,
                   help="most prompt tokens one sequence prefills per step, so short requests are not stuck "
                        "behind a long prompt (default: 4%% of max-model-len, at least 256, at most half the "
                        "step budget, applied only in steps shared with other requests; 0: no cap; a value: "
                        "that cap in every step)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model over this many ranks, one process and one GPU each (started here, or "
                        "by torchrun: see docs/distributed.md)")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="with -tp N, each rank keeps E/N whole MoE experts instead of 1/N of every expert "
                        "(attention stays tensor-parallel; see docs/distributed.md)")


def _engine_kwargs(args: argparse.Namespace) -> dict:
    model = getattr(args, "model", None) or args.model_flag
    return dict(
        model=model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size, enable_prefix_caching=args.enable_prefix_caching,
        enable_chunked_prefill=args.enable_chunked_prefill, gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        passes=args.passes.split(",") if args.passes else None, seed=args.seed, enforce_eager=args.enforce_eager,
        quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
        async_scheduling=args.async_scheduling,
        load_format="dummy" if args.dry_run else "auto", generation_config=args.generation_config,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        tensor_parallel_size=args.tensor_parallel_size, enable_expert_parallel=args.enable_expert_parallel,
    )


def _token_ids(text: str) -> list[int]:
    """`--prompt-token-ids 1,2,3` as a list of ints."""
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids like 1,2,3, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("expected at least one token id")
    return ids


def cmd_generate(args: argparse.Namespace) -> int:
    from mini_infer.llm import LLM
    from mini_infer.runtime.engine import EngineConfig
    from mini_infer.runtime.preflight import check_before_load
    from mini_infer.sampling_params import SamplingParams

    token_prompts = args.prompt_token_ids or []
    texts = args.prompt or ([] if token_prompts else ["What is the capital of France?"])
    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.sampling_seed, stop=args.stop or None,
                            ignore_eos=args.ignore_eos)
    kwargs = _engine_kwargs(args)
    info = check_before_load(EngineConfig(**kwargs))  # seconds before loading: bad options, files, prompts
    if texts and not info.has_tokenizer:
        raise ValueError(f"model {info.source.name!r} has no tokenizer, so it cannot take the text prompt "
                         f"{texts[0]!r}: pass token ids, e.g. --prompt-token-ids 1,2,3")
    llm = LLM(**kwargs)
    tok = llm.get_tokenizer()
    use_chat = not args.no_chat and tok is not None and getattr(tok, "chat_template", None)
    start = time.perf_counter()
    outs = []
    if texts and use_chat:
        outs += llm.chat([[{"role": "user", "content": p}] for p in texts], params, use_tqdm=False)
    elif texts:
        outs += llm.generate(texts, params, use_tqdm=False)
    if token_prompts:
        outs += llm.generate([{"prompt_token_ids": ids} for ids in token_prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    prompts = [*texts, *(",".join(map(str, ids)) for ids in token_prompts)]
    for prompt, out in zip(prompts, outs):
        for c in out.outputs:
            if len(prompts) > 1 or args.n > 1:
                print(f"--- {prompt!r} [{c.index}] ({c.finish_reason})")
            print(c.text if tok is not None else c.token_ids)
    if args.verbose:
        n_tok = sum(len(c.token_ids) for o in outs for c in o.outputs)
        print(f"[{n_tok} tokens in {seconds:.2f}s, {n_tok / seconds:.1f} tok/s]", file=sys.stderr)
    return 0


def cmd_dump_graph(args: argparse.Namespace) -> int:
    from mini_infer.compiler import compile_model
    from mini_infer.models import load_model
    from mini_infer.runtime.engine import EngineConfig, resolve_kv_cache_dtype

    EngineConfig(quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                 enable_expert_parallel=args.enable_expert_parallel)  # options named when bad
    size = args.tensor_parallel_size
    if size > 1 and args.verify:
        raise ValueError(f"--verify runs the graph, which needs all {size} ranks: dump without it (the graphs "
                         "written are rank 0's)")
    # rank 0's shards only, as a rank of `serve -tp` loads them (a checkpoint; presets are built whole)
    loaded = load_model(args.model or args.model_flag, dtype=args.dtype, device=args.device,
                        tensor_parallel_size=size)
    passes = args.passes.split(",") if args.passes else None
    cm = compile_model(loaded.model, passes=passes, dump_dir=args.out, verify=args.verify, model_name=loaded.name,
                       quantization=args.quantization, kv_cache_dtype=resolve_kv_cache_dtype(args.kv_cache_dtype),
                       rank=0, world_size=size, expert_parallel=args.enable_expert_parallel,
                       tokenizer=loaded.tokenizer)
    print(cm.summary())
    print(f"graphs written to {args.out}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    if threading.current_thread() is threading.main_thread():
        # SIGTERM stops the server as Ctrl-C does, at any moment (uvicorn takes both over once it runs)
        signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        from mini_infer.serving.launcher import serve
    except ImportError as exc:
        print(f"mini-infer serve needs the 'serve' extra (fastapi, uvicorn, prometheus-client): {exc}",
              file=sys.stderr)
        return 2
    return serve(args, _engine_kwargs(args))


def cmd_bench(args: argparse.Namespace) -> int:
    from mini_infer.benchmark import run_offline_benchmark

    result = run_offline_benchmark(_engine_kwargs(args), num_prompts=args.num_prompts, input_len=args.input_len,
                                   output_len=args.output_len, seed=args.seed)
    print(result.table())
    return 0


def _torchrun_rank() -> int:
    from mini_infer.runtime.distributed import torchrun_rank, under_torchrun

    return torchrun_rank() if under_torchrun() else 0


def _serve_rank(args: argparse.Namespace) -> int:
    """Under torchrun, ranks > 0 of generate/serve/bench build the engine and run rank 0's steps (no prompts,
    no port): `LLMEngine` returns only through SystemExit once rank 0 stops the group."""
    from mini_infer.runtime.engine import EngineConfig, LLMEngine

    LLMEngine(EngineConfig(**_engine_kwargs(args)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mini-infer", description="compiler-style LLM inference engine")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one or more prompts")
    g.add_argument("prompt", nargs="*", help="prompt(s); run through the chat template unless --no-chat")
    _add_engine_args(g)
    g.add_argument("--prompt-token-ids", type=_token_ids, action="append", default=None, metavar="IDS",
                   help="a prompt as comma-separated token ids (e.g. 1,2,3; repeat for more prompts): for models "
                        "without a tokenizer; the output is token ids too")
    g.add_argument("--no-chat", action="store_true", help="send prompts as raw text, no chat template")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--n", type=int, default=1)
    g.add_argument("--sampling-seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.set_defaults(func=cmd_generate)

    d = sub.add_parser("dump-graph", help="compile a model and write each pass's graph before/after")
    d.add_argument("model", nargs="?", default=None)
    _add_engine_args(d)
    d.add_argument("--out", required=True, help="directory for the dumps")
    d.add_argument("--verify", action="store_true", help="compare with eager HF after every pass")
    d.set_defaults(func=cmd_dump_graph)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    s.add_argument("model", nargs="?", default=None)
    _add_engine_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", default=None)
    s.add_argument("--api-key", default=None)
    s.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="past this many queued requests, answer 503 with Retry-After")
    s.add_argument("--max-request-body-bytes", type=int, default=10 * 2**20,
                   help="larger request bodies get 413")
    s.add_argument("--shutdown-timeout", type=float, default=5.0,
                   help="on SIGINT/SIGTERM, seconds the requests in flight get to finish before they are ended "
                        "(streams get an error event)")
    s.add_argument("--request-read-timeout", type=float, default=30.0,
                   help="seconds a client has to send a request's headers (and between reads of its body) "
                        "before its connection is closed")
    s.set_defaults(func=cmd_serve)

    b = sub.add_parser("bench", help="offline throughput of the engine on random prompts")
    b.add_argument("model", nargs="?", default=None)
    _add_engine_args(b)
    b.add_argument("--num-prompts", type=int, default=16)
    b.add_argument("--input-len", type=int, default=128)
    b.add_argument("--output-len", type=int, default=64)
    b.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not args.verbose:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    try:
        if args.command in ("generate", "serve", "bench") and _torchrun_rank() > 0:
            return _serve_rank(args)
        return args.func(args)
    except (ValueError, RuntimeError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        print(f"mini-infer {args.command}: error: {first}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C (and, for serve, SIGTERM): a requested stop, not a crash
        print(f"mini-infer {args.command}: interrupted", file=sys.stderr)
        return 0 if args.command == "serve" else 130


if __name__ == "__main__":
    sys.exit(main())
