"""GPU correctness check of the whole engine: greedy token ids from mini-infer (Triton kernels, CUDA graphs)
against HF `generate` on the same model, in float32 (TF32 off) so that any mismatch is a bug, not rounding.
Runs four engines: CUDA graphs (decode and mixed steps captured), CUDA graphs with 64-token steps (chunked
prefill mixed with decodes, padded into the captured mixed shape), the same without async scheduling (the CUDA default), and eager; all must equal HF. Prints one line
per check; exits 1 on a mismatch.

    python bench/gpu_check.py [--model qwen3-0.6b]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    from mini_infer.llm import LLM
    from mini_infer.models import load_model
    from mini_infer.sampling_params import SamplingParams

    loaded = load_model(args.model, dtype="float32", device="cuda")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 5000, (n,), generator=gen).tolist() for n in (5, 17, 64, 130, 300, 1)]
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    results = {}
    configs = {"graphs": {}, "graphs, 64-token steps": {"max_num_batched_tokens": 64},
               "graphs, 64-token steps, sync scheduling": {"max_num_batched_tokens": 64, "async_scheduling": False},
               "eager": {"enforce_eager": True}}
    from mini_infer.runtime.engine import EngineConfig, LLMEngine

    for name, kw in configs.items():
        t = time.perf_counter()
        eng = LLMEngine(EngineConfig(model=args.model, max_num_seqs=8, max_model_len=1024,
                                     kv_cache_memory_bytes=1 << 30, **kw), loaded=loaded)
        llm = LLM.__new__(LLM)
        llm.engine, llm._counter = eng, 0
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results[name] = [o.outputs[0].token_ids for o in outs]
        graphs = eng.runner.cuda_graphs
        print(f"engine ({name}): {time.perf_counter() - t:.1f}s incl. compile {eng.compile_seconds:.1f}s, "
              f"graphs {eng.capture_seconds:.1f}s ({len(graphs.graphs) if graphs else 0} shapes); "
              f"decode steps {eng.stats['decode_steps']}, mixed steps {eng.stats['mixed_steps']}; "
              f"blocks in use after: {eng.block_manager.num_used_blocks}")
        del eng, llm
    ok = True
    for name in configs:
        same = results[name] == results["eager"]
        print(f"{name} == eager: {same}")
        ok &= same
    model = loaded.model
    for p, got in zip(prompts, results["graphs"]):
        ref = model.generate(torch.tensor([p], device="cuda"), max_new_tokens=args.new_tokens,
                             min_new_tokens=args.new_tokens, do_sample=False)[0, len(p):].tolist()
        match = sum(1 for a, b in zip(got, ref) if a == b)
        first_diff = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), None)
        print(f"prompt {len(p):>4} tokens: {match}/{len(ref)} ids equal HF (first difference at {first_diff})")
        ok &= got == ref
    print("GPU CHECK", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
