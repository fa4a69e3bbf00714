"""W8A8 on real weights: the embedded SmolLM2-135M-Instruct compiled with quantization="w8a8" (the engine's
pipeline, SmoothQuant calibrated on the built-in English prompts through the model's tokenizer) against the
unquantized graph.

A smaller version of bench/quant_quality.py (20 prompts x 64 tokens there: 95.0% teacher-forced agreement with
SmoothQuant, 91.2% without, perplexity +0.16% / +1.25%): 8 prompts x 16 tokens of HF's greedy continuation,
teacher-forced top-1 agreement >= 90%, perplexity of the fixed English text within 3%, and the chat answer of the
CLI unchanged. The weights the graph holds drop by the int8 share of the linears.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from mini_infer.cli import main
from mini_infer.quality import perplexity, teacher_forced_agreement
from tests import _model_cache as mc
from tests.test_cli import ANSWER

DATA = json.loads((Path(__file__).parents[2] / "bench" / "data" / "english_eval.json").read_text())
PROMPTS, NEW = 8, 16


@functools.cache
def models():
    """(loaded SmolLM2, its float graph, its w8a8 graph), the latter compiled as the engine compiles it."""
    lm = mc.loaded(None)
    quant = mc.cached_compile(lm.model, device=torch.device("cpu"), model_name=lm.name, quantization="w8a8",
                              kv_cache_dtype=None, tokenizer=lm.tokenizer)
    return lm, mc.compiled(None), quant


def test_teacher_forced_agreement_and_perplexity():
    lm, ref, quant = models()
    note = next(s.note for s in quant.stats if s.name == "quantize_w8a8")
    assert note.startswith("210 of 211 linears int8") and "90 inputs smoothed (60 into norms, 30 into up_proj) " \
        "on 16 prompts" in note  # 30 layers; the tied lm_head stays float
    prompts = [lm.tokenizer(p).input_ids for p in DATA["prompts"][:PROMPTS]]
    sequences = [(p + mc.hf_greedy(lm.model, p, NEW), len(p)) for p in prompts]
    agreement = teacher_forced_agreement(quant, ref, sequences)
    assert agreement.total == PROMPTS * NEW
    assert agreement.rate >= 0.90, agreement
    text = lm.tokenizer(DATA["perplexity_text"]).input_ids
    ppl, ppl_ref = perplexity(quant, text), perplexity(ref, text)
    assert abs(ppl / ppl_ref - 1) <= 0.03, (ppl, ppl_ref)
    # int8 linears (1 byte per weight + 4 per row) in place of fp32 ones (4 bytes); embedding/lm_head unchanged
    linears = [m.weight for n, m in lm.model.named_modules() if n.endswith("_proj")]
    saved = sum(w.numel() * 3 - w.shape[0] * 4 for w in linears)
    assert ref.weight_bytes - quant.weight_bytes == saved


def test_cli_generate_with_quantization(monkeypatch, capsys):
    mc.patch_engine(monkeypatch)  # the engine compiles through the same cache as models()
    assert main(["generate", "--quantization", "w8a8", "--max-model-len", "1024",
                 "--kv-cache-memory-bytes", str(64 << 20)]) == 0
    assert capsys.readouterr().out.strip().splitlines() == [ANSWER]
