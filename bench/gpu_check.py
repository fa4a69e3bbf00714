"""GPU correctness check of the whole engine: greedy token ids from mini-infer (Triton kernels, CUDA graphs)
against HF `generate` on the same model, in float32 (TF32 off) so that any mismatch is a bug, not rounding.

For every tiny preset (every architecture family: dense, sliding window, MoE, DeepSeek) and any `--model` given,
one compile serves four engines: CUDA graphs (decode and mixed steps captured), CUDA graphs with 16-token steps
(chunked prefill mixed with decodes, padded into the captured mixed shape), the same without async scheduling
(the CUDA default is async), and eager; all must equal HF. For MoE models HF's CUDA experts backend
(`grouped_mm`) is not its fp32 expert loop; where ids differ from it, the loop (`eager` experts) is asked too,
and ids equal to the loop's pass with a note saying so. Prints one line per check and a summary table;
exits 1 on any mismatch or error (an architecture that fails to compile is a failure, with its error).

    python bench/gpu_check.py                       # every tiny-* preset
    python bench/gpu_check.py --model qwen3-0.6b    # plus a real-shape preset
    python bench/gpu_check.py --readme              # plus the README's GPU examples, run as written
    python bench/gpu_check.py --only tiny-qwen2-moe --reference-ops fused_moe   # bisect a mismatch to one op
    python bench/gpu_check.py --only tiny-qwen2-moe --passes paged_attention,route_moe   # ... or to a pass
    python bench/gpu_check.py --quantization mxfp4  # the MoE presets, experts packed to MXFP4 (fused_moe_mxfp4)

`--quantization mxfp4` checks the MoE tiny presets only, each with its expert weights first rounded to MXFP4 values
(as a gpt-oss checkpoint's are), which the packing then keeps exactly: HF on the rounded model is still the oracle.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
from readme_examples import README, gpu_commands  # the README parser tests/test_readme.py uses too


def use_reference_kernels(compiled, names: set[str]) -> int:
    """Rebind the compiled graph's nodes of the ops in `names` (e.g. {"fused_moe"}) to their plain-torch
    reference on the GPU, the rest keeping their Triton kernels: bisects a GPU-only mismatch to one op."""
    from mini_infer.ops import kernel_impls

    impls, n = kernel_impls("reference"), 0
    for node in compiled.graph_module.graph.nodes:
        op = node.meta.get("op")
        if op is not None and op.name().split("::")[-1].split(".")[0] in names:
            node.target = impls[op]
            n += 1
    compiled.graph_module.recompile()
    return n


def check_model(name: str, new_tokens: int, max_len: int, reference_ops: set[str] = frozenset(),
                passes: list[str] | None = None, with_: tuple[str, ...] | list[str] = (),
                quantization: str | None = None) -> tuple[bool, str]:
    from transformers import GenerationConfig

    from mini_infer.compiler import compile_model
    from mini_infer.llm import LLM
    from mini_infer.models import load_model
    from mini_infer.runtime.engine import EngineConfig, LLMEngine
    from mini_infer.sampling_params import SamplingParams

    loaded = load_model(name, dtype="float32", device="cuda")
    if quantization == "mxfp4":
        from mini_infer.passes.quantize_moe_mxfp4 import round_experts_to_mxfp4

        print(f"[{name}] {round_experts_to_mxfp4(loaded.model)} expert weights rounded to MXFP4 values")
    vocab = loaded.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(0)
    lengths = (5, 17, 64, 130, 1) if max_len < 1024 else (5, 17, 64, 130, 300, 1)
    prompts = [torch.randint(min(100, vocab // 4), min(5000, vocab), (n,), generator=gen).tolist() for n in lengths]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    t = time.perf_counter()
    if with_:  # the recommended pipeline (compile_model's for this model), then the opt-in passes named
        from mini_infer.passes import PassContext, add_passes, recommended_passes

        ctx = PassContext(config=loaded.model.config, device=torch.device("cuda"), dtype=torch.float32,
                          quantization=quantization)
        passes = add_passes(recommended_passes(ctx), with_)
    compiled = compile_model(loaded.model, device="cuda", model_name=name, passes=passes, quantization=quantization)
    print(f"[{name}] compiled in {time.perf_counter() - t:.1f}s")
    if reference_ops:
        print(f"[{name}] {use_reference_kernels(compiled, reference_ops)} nodes of {sorted(reference_ops)} run their "
              "torch reference")
    configs = {"graphs": {"max_num_batched_tokens": 512},
               "graphs, 16-token steps": {"max_num_batched_tokens": 16},
               "graphs, 16-token steps, sync": {"max_num_batched_tokens": 16, "async_scheduling": False},
               "eager": {"enforce_eager": True}}
    results = {}
    for cname, kw in configs.items():
        t = time.perf_counter()
        eng = LLMEngine(EngineConfig(model=name, max_num_seqs=8, max_model_len=max_len, quantization=quantization,
                                     kv_cache_memory_bytes=256 << 20, **kw), loaded=loaded, compiled=compiled)
        llm = LLM.__new__(LLM)
        llm.engine, llm._counter = eng, 0
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results[cname] = [o.outputs[0].token_ids for o in outs]
        graphs = eng.runner.cuda_graphs
        leaked = eng.block_manager.num_used_blocks
        print(f"[{name}] {cname}: {time.perf_counter() - t:.1f}s, graphs {len(graphs.graphs) if graphs else 0} "
              f"shapes; decode steps {eng.stats['decode_steps']}, mixed {eng.stats['mixed_steps']}; "
              f"blocks in use after: {leaked}")
        if leaked:
            return False, f"{cname}: {leaked} KV blocks leaked"
        del eng, llm
    ok, notes = True, []
    for cname in configs:
        if results[cname] != results["eager"]:
            ok = False
            notes.append(f"{cname} != eager")
    matched = 0
    experts = getattr(loaded.model.config, "_experts_implementation", None)

    def hf_ids(p: list[int], model=loaded.model) -> list[int]:
        # exactly new_tokens, with no EOS at all (as tests/_model_cache.hf_greedy): `min_new_tokens` would instead
        # forbid the EOS id until then, which `ignore_eos` does not (nor does vLLM's), so a model whose greedy
        # choice is EOS mid-way (tiny-qwen2-moe's prompt of 5 at token 11) would differ for that reason alone
        ids = torch.tensor([p], device="cuda")
        cfg = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, eos_token_id=[], pad_token_id=0)
        return model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg)[0, len(p):].tolist()

    for p, got in zip(prompts, results["graphs"]):
        ref = hf_ids(p)
        same = sum(1 for a, b in zip(got, ref) if a == b)
        if got != ref and experts not in (None, "eager"):
            # HF's CUDA experts backend (grouped_mm) is not the fp32 loop it runs on a CPU: ask the loop too
            _set_experts(loaded.model, "eager")
            loop_ref = hf_ids(p)
            _set_experts(loaded.model, experts)
            between = sum(a == b for a, b in zip(ref, loop_ref))
            if got == loop_ref:
                notes.append(f"prompt of {len(p)}: {same}/{len(ref)} ids equal HF's {experts} experts, all equal "
                             f"HF's eager experts loop ({between}/{len(ref)} between HF's two backends)")
                same, ref = len(got), loop_ref
            else:
                notes.append(f"prompt of {len(p)}: HF's eager experts loop gives {between}/{len(ref)} of its "
                             f"{experts} ids and {sum(a == b for a, b in zip(got, loop_ref))}/{len(ref)} of ours")
        matched += same
        if got != ref:
            ok = False
            first = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), None)
            notes.append(f"prompt of {len(p)}: {same}/{len(ref)} ids equal HF (first difference at {first})")
    notes.insert(0, f"{matched}/{len(prompts) * new_tokens} ids equal HF")
    del loaded, compiled
    torch.cuda.empty_cache()
    return ok, "; ".join(notes)


def _set_experts(model, implementation: str) -> None:
    """Switch HF's MoE experts backend (transformers >= 5: eager loop, grouped_mm, batched_mm)."""
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(implementation)
    else:
        model.config._experts_implementation = implementation


def run_readme_examples(readme: Path, timeout: float) -> list[tuple[str, bool, str]]:
    """Run each README GPU command as written (`mini-infer` through this interpreter's entry point, `python` as
    this interpreter); one row per command: (command, ok, note)."""
    rows = []
    for argv in gpu_commands(readme):
        cmd = [sys.executable, "-m", "mini_infer.cli", *argv[1:]] if argv[0] == "mini-infer" else \
            [sys.executable, *argv[1:]] if argv[0] in ("python", "python3") else argv
        t = time.perf_counter()
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=readme.parent)
            ok, note = r.returncode == 0, f"exit {r.returncode}"
            tail = (r.stdout + r.stderr).strip().splitlines()[-1:] or [""]
            note += f" in {time.perf_counter() - t:.0f}s; last line: {tail[0][:160]}"
        except subprocess.TimeoutExpired:
            ok, note = False, f"timed out after {timeout:g}s"
        rows.append((shlex.join(argv), ok, note))
        print(f"[README] {'PASSED' if ok else 'FAILED'}: {shlex.join(argv)}: {note}", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", action="append", default=[], help="real-shape presets to check too")
    ap.add_argument("--only", action="append", default=None, help="check only these presets")
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--reference-ops", default="",
                    help="comma list of op names (fused_moe, moe_topk, ...) to run as their torch reference on the "
                         "GPU while the others keep their Triton kernels (bisecting a mismatch)")
    ap.add_argument("--passes", default=None,
                    help="comma list of passes to compile with instead of the recommended pipeline (bisecting a "
                         "mismatch to a pass)")
    ap.add_argument("--with", dest="with_", default=None,
                    help="comma list of opt-in passes appended to the recommended pipeline (checking one before it "
                         "becomes a default, e.g. fuse_kv_write)")
    ap.add_argument("--quantization", choices=["mxfp4"], default=None,
                    help="mxfp4: the MoE tiny presets with their experts rounded to MXFP4 values, then packed")
    ap.add_argument("--readme", action="store_true",
                    help="also run the README's GPU examples as written (<!-- example: gpu --> blocks)")
    ap.add_argument("--readme-only", action="store_true", help="run only the README's GPU examples")
    ap.add_argument("--readme-timeout", type=float, default=900.0, help="seconds per README command")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    from mini_infer.models.presets import TINY_PRESETS

    names = [] if args.readme_only else args.only or [*TINY_PRESETS, *args.model]
    if args.quantization == "mxfp4" and not args.only:
        from mini_infer.models.model_info import inspect_model
        from mini_infer.passes.route_moe import is_moe_config

        names = [n for n in names if is_moe_config(inspect_model(n, count_weights=False).config)]
    rows = []
    for name in names:
        try:
            ok, note = check_model(name, args.new_tokens, 512 if name.startswith("tiny-") else 1024,
                                   set(args.reference_ops.split(",")) if args.reference_ops else set(),
                                   args.passes.split(",") if args.passes else None,
                                   args.with_.split(",") if args.with_ else (), args.quantization)
        except Exception as exc:  # one architecture's failure must not hide the others'
            traceback.print_exc()
            ok, note = False, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        rows.append((name, ok, note))
        print(f"[{name}] {'PASSED' if ok else 'FAILED'}: {note}", flush=True)
    print("\n| model | greedy == HF (fp32), graphs on/off, async/sync | notes |\n|---|---|---|")
    for name, ok, note in rows:
        print(f"| `{name}` | {'yes' if ok else '**no**'} | {note} |")
    if args.readme or args.readme_only:
        readme_rows = run_readme_examples(README, args.readme_timeout)
        print("\n| README GPU example | runs | notes |\n|---|---|---|")
        for cmd, ok, note in readme_rows:
            print(f"| `{cmd}` | {'yes' if ok else '**no**'} | {note} |")
        rows += readme_rows
    all_ok = all(ok for _, ok, _ in rows)
    print("GPU CHECK", "PASSED" if all_ok else "FAILED")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
