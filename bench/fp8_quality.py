"""FP8 quality on real weights: greedy tokens of the embedded SmolLM2-135M-Instruct with an fp8 KV cache and/or
fp8 weights against the unquantized model, on the same prompts in the same run (not a test: minutes on a CPU).

    python bench/fp8_quality.py                                   # 20 prompts x 64 tokens, variants kv,weights
    python bench/fp8_quality.py --variants kv --min-teacher-forced 0.9   # exit 1 below 90% (teacher-forced)
    python bench/fp8_quality.py --device cuda                     # the same on a GPU (needs the gguf package)

Variants: `kv` = kv_cache_dtype="fp8", `weights` = quantization="fp8", `both`; yardsticks `bf16-kv`
(kv_cache_dtype="bfloat16") and `bf16` (the whole model in bfloat16): what 16-bit rounding alone does to the
same measures (the CPU reference runs in float32). Every engine runs with prefix caching and chunked prefill (a
64-token step budget, so prompts are split and decodes mix with prefill chunks). The prompts are the 20 English
openings in PROMPTS (raw text, no chat template), each continued greedily for --tokens tokens with ignore_eos.
Reported per variant, against the unquantized engine's tokens:

  agreement       fraction of the prompts x tokens positions where the variant's greedy token equals the
                  reference's, free running: after a first difference the two continuations diverge, so one
                  flip at a near-tie costs every later position of its prompt. It measures how soon greedy
                  decoding diverges more than quality: the all-bf16 model scores 0.58 on it.
  teacher-forced  fraction of positions where the variant's top-1 token, given the reference's own continuation
                  as context, is the reference's token (prompt_logprobs=1 over prompt + reference continuation,
                  through chunked prefill over the variant's cache): each flip counts once.
  identical       prompts whose continuations are equal throughout

Measured on the CPU (2 cores, a1bf050, 20 prompts x 64 tokens):

  variant   agreement  teacher-forced  identical  KV B/token
  kv          0.312        0.963          0/20       11520   (fp32 reference: 46080)
  weights     0.191        0.924          0/20       46080
  both        0.181        0.924          1/20       11520
  bf16-kv     0.965        0.998         17/20       23040
  bf16        0.578        0.995          5/20       23040

So the fp8 cache flips the greedy token at 3.7% of positions (bf16 KV: 0.2%): near-ties of this 135M model
(top-2 logit gaps under 0.2 are common) meet fp8's logit noise (0.1-0.5). `--min-teacher-forced 0.9` is the
bound that holds (tests/passes/test_fp8_kv_cache.py checks it in CI on 4 prompts x 32 tokens); free-running
agreement >= 0.9 does not hold for fp8 on this model.

Writes JSON to --out (default bench/out/fp8_quality.json).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

PROMPTS = [
    "The history of the printing press begins",
    "To bake a loaf of sourdough bread, you first need",
    "The three laws of motion described by Newton are",
    "In the middle of the ocean, far from any coast, a small boat",
    "Photosynthesis is the process by which plants",
    "The city council met on Tuesday to discuss",
    "A good night's sleep is important because",
    "The first computers were large machines that",
    "Once upon a time, in a kingdom by the sea, there lived",
    "Water boils at 100 degrees Celsius at sea level, but",
    "The main causes of the French Revolution were",
    "When learning a new programming language, it helps to",
    "The Amazon rainforest is home to",
    "Dear customer, thank you for your recent purchase. We",
    "The moon orbits the Earth once every",
    "Here is a simple recipe for tomato soup:",
    "The football match ended in a draw after",
    "Electric cars differ from petrol cars in that",
    "The old lighthouse keeper climbed the stairs and",
    "In mathematics, a prime number is",
]
VARIANTS = {"kv": dict(kv_cache_dtype="fp8"), "weights": dict(quantization="fp8"),
            "both": dict(kv_cache_dtype="fp8", quantization="fp8"),
            # yardsticks: what 16-bit rounding alone does to the same measures (the CPU reference is fp32)
            "bf16-kv": dict(kv_cache_dtype="bfloat16"), "bf16": dict(dtype="bfloat16")}


def greedy_agreement(ref: list[list[int]], out: list[list[int]]) -> float:
    """Fraction of positions where the two token lists agree (position by position, all prompts)."""
    same = sum(a == b for r, o in zip(ref, out) for a, b in zip(r, o))
    return same / sum(len(r) for r in ref)


def make_llm(device: str, **options):
    from mini_infer.llm import LLM

    return LLM(None, device=device, max_model_len=1024, kv_cache_memory_bytes=64 << 20,
               enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=64, **options)


def continuations(llm, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    from mini_infer.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def teacher_forced(llm, prompts: list[list[int]], refs: list[list[int]]) -> float:
    """Fraction of reference tokens that are the variant's top-1 given the reference's context."""
    from mini_infer.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p + r} for p, r in zip(prompts, refs)], params, use_tqdm=False)
    hits = total = 0
    for p, r, o in zip(prompts, refs, outs):
        for j, tok in enumerate(r):
            entry = o.prompt_logprobs[len(p) + j]
            top = max(entry, key=lambda t: entry[t].logprob)
            hits += top == tok
            total += 1
    return hits / total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="kv,weights", help=f"comma list of {', '.join(VARIANTS)}")
    ap.add_argument("--prompts", type=int, default=20, help=f"how many of the {len(PROMPTS)} prompts")
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--min-agreement", type=float, default=None,
                    help="exit 1 if a variant's free-running agreement is lower")
    ap.add_argument("--min-teacher-forced", type=float, default=None,
                    help="exit 1 if a variant's teacher-forced agreement is lower")
    ap.add_argument("--out", default="bench/out")
    args = ap.parse_args()
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variant {unknown[0]!r}; choose from {', '.join(VARIANTS)}")

    start = time.perf_counter()
    ref_llm = make_llm(args.device)
    tok = ref_llm.get_tokenizer()
    prompts = [tok.encode(t) for t in PROMPTS[:args.prompts]]
    refs = continuations(ref_llm, prompts, args.tokens)
    ref_bytes = ref_llm.engine.compiled.cache_bytes_per_token()
    del ref_llm
    rows = []
    for name in variants:
        llm = make_llm(args.device, **VARIANTS[name])
        outs = continuations(llm, prompts, args.tokens)
        rows.append(dict(
            variant=name, options=VARIANTS[name], agreement=greedy_agreement(refs, outs),
            teacher_forced=teacher_forced(llm, prompts, refs),
            identical=sum(r == o for r, o in zip(refs, outs)),
            kv_bytes_per_token=llm.engine.compiled.cache_bytes_per_token(),
            weight_bytes=llm.engine.compiled.weight_bytes,
            sample=tok.decode(outs[0])))
        del llm
    seconds = time.perf_counter() - start
    print(f"SmolLM2-135M-Instruct on {args.device}: {len(prompts)} prompts x {args.tokens} greedy tokens, "
          f"reference = unquantized ({ref_bytes} KV bytes/token); {seconds:.0f}s")
    print(f"{'variant':<10}{'agreement':>11}{'teacher-forced':>16}{'identical':>11}{'KV B/token':>12}")
    for r in rows:
        print(f"{r['variant']:<10}{r['agreement']:>11.3f}{r['teacher_forced']:>16.3f}"
              f"{r['identical']:>8}/{len(prompts):<2}{r['kv_bytes_per_token']:>12}")
    print(f"reference continuation of prompt 0: {tok.decode(refs[0])!r}")
    for r in rows:
        print(f"{r['variant']} continuation of prompt 0: {r['sample']!r}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp8_quality.json").write_text(json.dumps(
        {"device": args.device, "prompts": len(prompts), "tokens": args.tokens, "seconds": seconds,
         "reference_kv_bytes_per_token": ref_bytes, "results": rows}, indent=2))
    failed = False
    for key, bound in (("agreement", args.min_agreement), ("teacher_forced", args.min_teacher_forced)):
        low = [r["variant"] for r in rows if bound is not None and r[key] < bound]
        if low:
            print(f"{key} below {bound}: {', '.join(low)}", file=sys.stderr)
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
