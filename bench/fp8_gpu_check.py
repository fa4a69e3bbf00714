"""GPU check of the FP8 paths in the compiled graph: fp8 weights (`quantization="fp8"`) and the fp8 KV cache,
Triton / `torch._scaled_mm` kernels against the same graph bound to the plain-torch references, on the GPU.

For every tiny preset (float32, TF32 off; DeepSeek with fp8 weights only: its latent cache refuses fp8) one
compile on CUDA, then the graph as compiled (bound to the CUDA kernels) and a copy bound to the references run
the same single sequences: a 37-token prefill (M > 16: the GEMM path) and a 1-token step (M = 1: the skinny
Triton tile, the decode attention kernel). Both must agree within TOL of the logits' scale (fp32 accumulation
order differs between the kernels; the quantization itself is bit-exact between them). Then an engine with CUDA
graphs and chunked prefill generates greedily for 5 prompts: it must run, leak no block, and its tokens are
compared with an eager engine's (reported; fp8 GEMM tiles differ by M bucket, so a near-tie may flip).

`--model qwen3-0.6b` adds a real-shape preset in bfloat16: errors and top-1 agreement are reported, not
judged (over 28 layers a last-bit difference moves fp8 roundings, see tests/passes/test_fp8_kv_cache.py).
Exits 1 on a mismatch beyond TOL, a leak or an error. Needs compute capability >= 8.9.

    python bench/fp8_gpu_check.py
    python bench/fp8_gpu_check.py --model qwen3-0.6b
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback

import torch
import torch.fx as fx

TOL = 1e-3  # max |triton - reference| / max(1, max |reference|), fp32 models


def rebound(gm: fx.GraphModule, backend: str) -> fx.GraphModule:
    """A copy of a compiled graph whose ops call their `backend` kernels."""
    from mini_infer.compiler import bind_kernels

    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    for node in graph.nodes:
        if "op" in node.meta:
            node.target = node.meta["op"]  # the op bind_kernels replaced
    copy = fx.GraphModule(gm, graph)
    bind_kernels(copy, torch.device("cuda"), backend=backend)
    return copy


def run(gm: fx.GraphModule, inputs: dict) -> torch.Tensor:
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    with torch.no_grad():
        return gm(*(inputs[n] for n in names)).float()


def check(name: str, dtype: str, judged: bool) -> tuple[bool, str]:
    from mini_infer.compiler import compile_model
    from mini_infer.llm import LLM
    from mini_infer.models import load_model
    from mini_infer.passes.mla_latent_cache import is_mla_config
    from mini_infer.runtime.engine import EngineConfig, LLMEngine
    from mini_infer.sampling_params import SamplingParams

    loaded = load_model(name, dtype=dtype, device="cuda")
    kv = None if is_mla_config(loaded.config.get_text_config()) else torch.float8_e4m3fn
    t = time.perf_counter()
    cm = compile_model(loaded.model, device="cuda", model_name=name, quantization="fp8", kv_cache_dtype=kv)
    print(f"[{name}] compiled in {time.perf_counter() - t:.1f}s (fp8 weights, KV cache {kv or 'model dtype'})")
    vocab = loaded.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(0)
    ok, notes = True, []
    ref_gm = rebound(cm.graph_module, "reference")
    for num in (37, 1):
        ids = torch.randint(0, min(vocab, 5000), (1, num), generator=gen).cuda()
        pos = torch.arange(num, device="cuda")[None]
        inputs = cm.example_inputs(ids, pos)
        inputs["logits_indices"] = torch.arange(num, device="cuda")
        fast = run(cm.graph_module, inputs)
        ref = run(ref_gm, cm.example_inputs(ids, pos) | {"logits_indices": inputs["logits_indices"]})
        err = (fast - ref).abs().max().item() / max(1.0, ref.abs().max().item())
        top1 = (fast.argmax(-1) == ref.argmax(-1)).float().mean().item()
        bad = judged and not err <= TOL
        ok &= not bad
        notes.append(f"T={num}: err {err:.1e}, top-1 {top1:.2f}{' MISMATCH' if bad else ''}")
        print(f"[{name}] {notes[-1]}")
    prompts = [torch.randint(0, min(vocab, 5000), (n,), generator=gen).tolist() for n in (5, 17, 64, 130, 1)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    tokens = {}
    for cname, kw in (("graphs", {"max_num_batched_tokens": 16}), ("eager", {"enforce_eager": True})):
        eng = LLMEngine(EngineConfig(model=name, max_num_seqs=8, max_model_len=512, kv_cache_memory_bytes=256 << 20,
                                     quantization="fp8", kv_cache_dtype="fp8" if kv else "auto", **kw),
                        loaded=loaded, compiled=cm)
        llm = LLM.__new__(LLM)
        llm.engine, llm._counter = eng, 0
        tokens[cname] = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
        if eng.block_manager.num_used_blocks:
            ok = False
            notes.append(f"{cname}: {eng.block_manager.num_used_blocks} blocks leaked")
        del eng, llm
    same = sum(a == b for x, y in zip(tokens["graphs"], tokens["eager"]) for a, b in zip(x, y))
    notes.append(f"graphs vs eager greedy: {same}/{24 * len(prompts)}")
    print(f"[{name}] {notes[-1]}")
    return ok, "; ".join(notes)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", default=[], help="real-shape presets to add (bfloat16, reported)")
    ap.add_argument("--only", action="append", default=None, help="check only these tiny presets")
    args = ap.parse_args()
    from mini_infer.models.presets import TINY_PRESETS
    from mini_infer.ops.fp8_linear import fp8_supported

    if not fp8_supported("cuda"):
        print(f"{torch.cuda.get_device_name()}: no FP8 (compute capability < 8.9)", file=sys.stderr)
        return 1
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    runs = [(n, "float32", True) for n in (args.only or TINY_PRESETS)] + [(m, "bfloat16", False) for m in args.model]
    rows = []
    for name, dtype, judged in runs:
        try:
            ok, note = check(name, dtype, judged)
        except Exception as exc:  # a preset that fails to compile or run is a failure, with its error
            traceback.print_exc()
            ok, note = False, f"{type(exc).__name__}: {exc}"
        rows.append((name, ok, note))
        torch.cuda.empty_cache()
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for name, ok, note in rows:
        print(f"{name:<20}{'ok' if ok else 'FAIL':<6}{note}")
    return 0 if all(ok for _, ok, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
