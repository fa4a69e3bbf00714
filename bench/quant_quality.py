"""Quality of W8A8 int8 quantization against the unquantized model, on real weights (default: the embedded
SmolLM2-135M-Instruct), with and without SmoothQuant, in one run.

For each variant (w8a8 + SmoothQuant, w8a8 without it) beside the unquantized model:
  * teacher-forced top-1 agreement: the unquantized model generates greedy continuations of the 20 prompts of
    bench/data/english_eval.json (`--new-tokens`, default 64); then at every position of each continuation both
    models predict the next token from the same context and we count equal argmaxes (the figure the quality
    bar is stated in: >= 90% with SmoothQuant);
  * free-running greedy agreement: the variant generates its own continuations; tokens equal at the same position,
    and the mean common prefix (fraction of the continuation before the first different token);
  * perplexity of the fixed English text of the same file, and its change against the unquantized model.
Prints a markdown table ready for bench/RESULTS.md and writes JSON to --out.

    python bench/quant_quality.py                       # CPU, the embedded SmolLM2, 20 prompts x 64 tokens
    python bench/quant_quality.py --device cuda         # the same through the Triton kernels and CUDA graphs
    python bench/quant_quality.py --device cuda --dtype bfloat16
    python bench/quant_quality.py --lm-head             # also with the lm_head quantized (what bench/latency.py's
                                                        # --quantize-lm-head times)
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from kernel_norm import git_info  # the sibling script's HEAD and dirty files

DATA = Path(__file__).parent / "data" / "english_eval.json"


def load_eval_data() -> dict:
    """The prompts and the perplexity text (bench/data/english_eval.json)."""
    return json.loads(DATA.read_text())


def w8a8_passes(config, device: str, dtype: torch.dtype, **quantize_args) -> list:
    """The recommended pipeline for quantization="w8a8", its quantize pass built with `quantize_args`."""
    from mini_infer.passes import PassContext, recommended_passes
    from mini_infer.passes.quantize_w8a8 import QuantizeW8A8

    ctx = PassContext(config=config, device=torch.device(device), dtype=dtype, quantization="w8a8")
    return [QuantizeW8A8(**quantize_args) if p.name == "quantize_w8a8" else p for p in recommended_passes(ctx)]


def generate(llm, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    from mini_infer.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--prompts", type=int, default=20, help="how many of the 20 prompts")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--alpha", type=float, default=0.5, help="SmoothQuant's migration strength")
    ap.add_argument("--lm-head", action="store_true",
                    help="one more variant: w8a8 + SmoothQuant with the lm_head quantized too (lm_head=True)")
    ap.add_argument("--out", default="bench/out")
    args = ap.parse_args()

    from mini_infer.llm import LLM
    from mini_infer.quality import greedy_agreement, perplexity, teacher_forced_agreement

    data = load_eval_data()
    common = dict(device=args.device, dtype=args.dtype, max_num_seqs=args.prompts, kv_cache_memory_bytes=256 << 20,
                  enforce_eager=args.device == "cpu")  # on a GPU: the Triton kernels inside CUDA graphs
    t0 = time.perf_counter()
    ref_llm = LLM(args.model, **common)
    tok = ref_llm.get_tokenizer()
    if tok is None:
        raise SystemExit(f"{args.model}: no tokenizer; this benchmark needs text")
    prompts = [tok(p).input_ids for p in data["prompts"][:args.prompts]]
    text_ids = tok(data["perplexity_text"]).input_ids
    ref_out = generate(ref_llm, prompts, args.new_tokens)
    ref = ref_llm.engine.compiled
    sequences = [(p + o, len(p)) for p, o in zip(prompts, ref_out)]
    ref_ppl = perplexity(ref, text_ids)
    dtype = ref.context.dtype
    rows = []
    variants = [("w8a8 + SmoothQuant", dict(alpha=args.alpha)), ("w8a8, no SmoothQuant", dict(smoothquant=False))]
    if args.lm_head:
        variants.append(("w8a8 + SmoothQuant, int8 lm_head", dict(alpha=args.alpha, lm_head=True)))
    for label, quantize_args in variants:
        start = time.perf_counter()
        llm = LLM(args.model, quantization="w8a8", passes=w8a8_passes(ref.config, args.device, dtype, **quantize_args),
                  **common)
        compile_s = time.perf_counter() - start
        cm = llm.engine.compiled
        tf = teacher_forced_agreement(cm, ref, sequences)
        free, prefix = greedy_agreement(generate(llm, prompts, args.new_tokens), ref_out)
        ppl = perplexity(cm, text_ids)
        rows.append(dict(variant=label, teacher_forced=tf.rate, teacher_forced_tokens=tf.total,
                         free_running=free.rate, common_prefix=prefix, perplexity=ppl,
                         perplexity_change=ppl / ref_ppl - 1, weight_bytes=cm.weight_bytes,
                         startup_s=compile_s, quantize_note=next(s.note for s in cm.stats if s.name == "quantize_w8a8")))
        del llm, cm
    name = args.model or "SmolLM2-135M-Instruct (embedded)"
    print(f"{name}, {args.device} {dtype}, {len(prompts)} prompts x {args.new_tokens} tokens, perplexity text "
          f"{len(text_ids)} tokens; unquantized: perplexity {ref_ppl:.3f}, weights {ref.weight_bytes / 1e6:.1f} MB; "
          f"total {time.perf_counter() - t0:.0f} s")
    print()
    print("| variant | teacher-forced top-1 agreement | free-running tokens equal | common prefix | perplexity "
          "(change) | weights MB |")
    print("|---|---|---|---|---|---|")
    print(f"| unquantized ({dtype}) | 100% | 100% | 100% | {ref_ppl:.3f} | {ref.weight_bytes / 1e6:.1f} |")
    for r in rows:
        print(f"| {r['variant']} | {r['teacher_forced']:.1%} | {r['free_running']:.1%} | {r['common_prefix']:.1%} | "
              f"{r['perplexity']:.3f} ({r['perplexity_change']:+.2%}) | {r['weight_bytes'] / 1e6:.1f} |")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "quant_quality.json").write_text(json.dumps({
        "model": name, "device": args.device, "dtype": str(dtype), "torch": torch.__version__, **git_info(),
        "date": time.strftime("%Y-%m-%d"), "prompts": len(prompts), "new_tokens": args.new_tokens,
        "reference_perplexity": ref_ppl, "reference_weight_bytes": ref.weight_bytes, "results": rows}, indent=2))


if __name__ == "__main__":
    main()
