"""Families beyond the presets: tiny Hugging Face checkpoints of other decoder-only architectures (GPT-2, GPT-NeoX,
Phi, Gemma, OLMo, Falcon, OPT, ...) written with `save_pretrained`, loaded by `LLM` from the directory as a user's
checkpoint is, compiled by the default pipeline and run by the engine: every attention layer becomes a paged one and
greedy tokens equal HF `generate`'s, with two prompts sharing a prefix (prefix caching) and prompts longer than a
step's token budget (chunked prefill). A family HF cannot run through an attention function mini-infer captures
(BLOOM's ALiBi) is refused at load time, naming the class.

Random weights, drawn at a larger scale than HF's initializer so that greedy continuations vary from token to token
(HF's 0.02 makes most of them repeat one token, which would check little); Falcon and Gemma 3 untied, else their
scaled token embedding outweighs the layers and the greedy token is the input token again."""

from __future__ import annotations

import re

import pytest
import torch
import transformers as hf

from mini_infer import LLM, SamplingParams
from mini_infer.models.loader import attention_implementation
from mini_infer.models.model_info import ModelLoadError
from tests._model_cache import hf_greedy

_SMALL = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
              max_position_embeddings=256)
_GQA = dict(_SMALL, num_key_value_heads=2)

# model_type -> its config: 2 layers, hidden 64, GQA where the family has it
CONFIGS = {
    "gpt2": lambda: hf.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=256),
    "gpt_neox": lambda: hf.GPTNeoXConfig(**_SMALL),
    "gptj": lambda: hf.GPTJConfig(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=256, rotary_dim=8),
    "opt": lambda: hf.OPTConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                ffn_dim=128, max_position_embeddings=256, word_embed_proj_dim=64),
    "falcon": lambda: hf.FalconConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      tie_word_embeddings=False),
    "phi": lambda: hf.PhiConfig(**_SMALL),
    "phi3": lambda: hf.Phi3Config(**_GQA, pad_token_id=0),
    "gemma": lambda: hf.GemmaConfig(**_GQA, head_dim=16),
    # soft caps low enough to bend these weights' logits (the published 50 / 30 would barely touch them)
    "gemma2": lambda: hf.Gemma2Config(**_GQA, head_dim=16, sliding_window=8, tie_word_embeddings=False,
                                      attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
    "gemma3_text": lambda: hf.Gemma3TextConfig(**_GQA, head_dim=16, sliding_window=8, tie_word_embeddings=False),
    "olmo": lambda: hf.OlmoConfig(**_SMALL),
    "olmo2": lambda: hf.Olmo2Config(**_GQA),
    "starcoder2": lambda: hf.Starcoder2Config(**_GQA),
    "stablelm": lambda: hf.StableLmConfig(**_GQA),
    "granite": lambda: hf.GraniteConfig(**_GQA),
    "cohere": lambda: hf.CohereConfig(**_GQA),
}

PROMPTS = ([5, 17, 99, 3, 42, 7, 61, 200, 13, 77, 150, 9, 31],  # 13 tokens: two chunks of the 8-token budget
           [5, 17, 99, 3, 42, 7, 61, 200, 13, 77, 150, 9, 31, 88, 2, 240, 101])  # the first + 4 more: a shared prefix
NEW_TOKENS = 8


def write_checkpoint(config, path) -> torch.nn.Module:
    """A tiny model of `config` with seeded N(0, 0.3) weights, saved to `path`; returns it (eval, float32) with
    HF's eager attention, the oracle (transformers 5.17 would give Gemma 2 SDPA by default, which drops its cap)."""
    model = hf.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_checkpoint_of_another_family_runs_greedy_equal_to_hf(model_type, tmp_path):
    config = CONFIGS[model_type]()
    assert config.model_type == model_type
    try:
        attention_implementation(config)
    except ModelLoadError as exc:  # e.g. GPT-J under transformers 5.17, whose attention is its own code there
        write_checkpoint(config, tmp_path)
        with pytest.raises(ModelLoadError, match=re.escape(str(exc))):
            LLM(str(tmp_path), dtype="float32")
        pytest.skip(f"refused under transformers {hf.__version__}: {exc}")
    model = write_checkpoint(config, tmp_path)
    expected = [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]

    llm = LLM(str(tmp_path), dtype="float32", block_size=4, max_num_batched_tokens=8, max_num_seqs=2,
              enable_prefix_caching=True)
    assert llm.engine.compiled.context.info["attention_layers"] == config.num_hidden_layers
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    blocks = llm.engine.block_manager
    for _ in range(2):  # the second round reads the first round's prompts from the prefix cache
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == expected
        assert blocks.num_used_blocks == 0
    assert blocks.prefix_cache_hits > 0


def test_family_without_a_capturable_attention_is_refused_naming_the_class(tmp_path):
    write_checkpoint(hf.BloomConfig(vocab_size=256, hidden_size=64, n_layer=2, n_head=4), tmp_path)
    with pytest.raises(ModelLoadError, match="BloomForCausalLM"):
        LLM(str(tmp_path), dtype="float32")
