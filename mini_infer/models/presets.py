"""Named presets: the architecture configs of real models, built with random weights.

Presets let a user dry-run or benchmark a model's exact shapes without its weights, and give the tests
`tiny-<family>` versions (a few layers, small hidden size) of every supported family. This module only
describes configs; building and materializing models is loader.py's job.
"""

from __future__ import annotations

import copy
from typing import Any

from transformers import AutoConfig, PretrainedConfig

# what gpt-oss-20b's and gpt-oss-120b's published configs share
_GPT_OSS = dict(
    model_type="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_attention_heads=64,
    num_key_value_heads=8, head_dim=64, num_experts_per_tok=4, sliding_window=128, max_position_embeddings=131072,
    rope_theta=150000.0, rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0,
                                           truncate=False, original_max_position_embeddings=4096),
    rms_norm_eps=1e-5, attention_bias=True, swiglu_limit=7.0, tie_word_embeddings=False, eos_token_id=200002,
    pad_token_id=199999, torch_dtype="bfloat16",
)

# model_type, then config fields as in each model's published config.json.
PRESETS: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(
        model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16",
    ),
    "llama-3.1-8b": dict(
        model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_theta=500000.0, tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
        torch_dtype="bfloat16",
    ),
    "qwen2.5-7b": dict(
        model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768, rope_theta=1000000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False, bos_token_id=151643,
        eos_token_id=151643, torch_dtype="bfloat16",
    ),
    "qwen3-0.6b": dict(
        model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=151643,
        eos_token_id=151645, torch_dtype="bfloat16",
    ),
    "mistral-7b": dict(
        model_type="mistral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768, rope_theta=10000.0,
        rms_norm_eps=1e-5, sliding_window=4096, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        torch_dtype="bfloat16",
    ),
    "mixtral-8x7b": dict(
        model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-5, sliding_window=None,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16",
    ),
    "qwen1.5-moe-a2.7b": dict(
        model_type="qwen2_moe", vocab_size=151936, hidden_size=2048, intermediate_size=5632,
        moe_intermediate_size=1408, shared_expert_intermediate_size=5632, num_experts=60, num_experts_per_tok=4,
        num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=8192,
        rope_theta=1000000.0, rms_norm_eps=1e-6, decoder_sparse_step=1, norm_topk_prob=False,
        tie_word_embeddings=False, use_sliding_window=False, torch_dtype="bfloat16",
    ),
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
        head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
        max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=151643, eos_token_id=151645, torch_dtype="bfloat16",
    ),
    "deepseek-v2-lite": dict(
        model_type="deepseek_v2", vocab_size=102400, hidden_size=2048, intermediate_size=10944,
        moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
        kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1,
        moe_layer_freq=1, topk_method="greedy", routed_scaling_factor=1.0, norm_topk_prob=False,
        max_position_embeddings=163840, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_scaling=dict(rope_type="yarn", factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0,
                          beta_slow=1.0, mscale=0.707, mscale_all_dim=0.707),
        bos_token_id=100000, eos_token_id=100001, torch_dtype="bfloat16",
    ),
    "gemma-2-2b": dict(
        model_type="gemma2", vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=8192,
        rope_theta=10000.0, rms_norm_eps=1e-6, sliding_window=4096, query_pre_attn_scalar=256,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0, torch_dtype="bfloat16",
    ),
    # GPT-OSS: about 21B and 117B parameters (42 and 234 GB in bf16; the 120b needs -tp 2 on H200s)
    "gpt-oss-20b": dict(_GPT_OSS, num_hidden_layers=24, num_local_experts=32),
    "gpt-oss-120b": dict(_GPT_OSS, num_hidden_layers=36, num_local_experts=128),
}

_TINY_COMMON = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False,
    bos_token_id=1, eos_token_id=2, torch_dtype="float32",
)

# tiny-<family>: the same model_type with the smallest shapes that still exercise every feature (GQA,
# q/k norm, sliding window, soft-capped logits, experts, latent attention, attention sinks).
TINY_PRESETS: dict[str, dict[str, Any]] = {
    "tiny-llama": dict(_TINY_COMMON, model_type="llama", rope_theta=10000.0),
    "tiny-qwen2": dict(_TINY_COMMON, model_type="qwen2", rope_theta=1000000.0, use_sliding_window=False),
    "tiny-qwen3": dict(_TINY_COMMON, model_type="qwen3", head_dim=32, rope_theta=1000000.0),
    "tiny-mistral": dict(_TINY_COMMON, model_type="mistral", rope_theta=10000.0, sliding_window=8),
    "tiny-mixtral": dict(_TINY_COMMON, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2,
                         sliding_window=None),
    "tiny-qwen2-moe": dict(_TINY_COMMON, model_type="qwen2_moe", moe_intermediate_size=32,
                           shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                           decoder_sparse_step=1, use_sliding_window=False),
    "tiny-qwen3-moe": dict(_TINY_COMMON, model_type="qwen3_moe", head_dim=16, moe_intermediate_size=32,
                           num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1),
    "tiny-deepseek-v2": dict(_TINY_COMMON, model_type="deepseek_v2", num_key_value_heads=4, kv_lora_rank=32,
                             q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                             moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
                             num_experts_per_tok=2, first_k_dense_replace=1, moe_layer_freq=1,
                             topk_method="greedy", routed_scaling_factor=1.0, norm_topk_prob=False),
    "tiny-deepseek-v3": dict(_TINY_COMMON, model_type="deepseek_v3", num_key_value_heads=4, kv_lora_rank=32,
                             q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                             moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
                             num_experts_per_tok=2, first_k_dense_replace=1, n_group=2, topk_group=1,
                             routed_scaling_factor=1.0, norm_topk_prob=True),
    # soft caps below these random weights' logits (attention ~0.1, final ~0.7), so that they bend them
    "tiny-gemma2": dict(_TINY_COMMON, model_type="gemma2", head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                        attn_logit_softcapping=0.05, final_logit_softcapping=0.3,
                        hidden_activation="gelu_pytorch_tanh"),
    # attention sinks, every other layer a sliding window, YaRN rotary on half-dim cos / sin, biased experts with
    # the clamped SwiGLU
    "tiny-gpt-oss": dict(_TINY_COMMON, model_type="gpt_oss", head_dim=16, intermediate_size=32, num_local_experts=4,
                         num_experts_per_tok=2, sliding_window=8, rope_theta=150000.0,
                         rope_scaling=dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0,
                                           truncate=False, original_max_position_embeddings=256)),
}

ALL_PRESETS: dict[str, dict[str, Any]] = {**PRESETS, **TINY_PRESETS}

# Families whose dense decoder the passes fully support (the engine runs them end to end).
DENSE_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
TINY_DENSE_PRESETS = tuple(f"tiny-{f}" for f in DENSE_FAMILIES)


def preset_names() -> list[str]:
    """All valid preset names, real-model shapes first."""
    return list(PRESETS) + list(TINY_PRESETS)


def preset_config(name: str) -> PretrainedConfig:
    """Return the transformers config for preset `name`; ValueError listing valid names if unknown."""
    if name not in ALL_PRESETS:
        raise ValueError(f"unknown preset {name!r}; valid presets: {', '.join(preset_names())}")
    fields = copy.deepcopy(ALL_PRESETS[name])  # (transformers writes rope_theta into a rope_scaling dict it is given)
    model_type = fields.pop("model_type")
    dtype = fields.pop("torch_dtype")
    config = AutoConfig.for_model(model_type, **fields)
    config.dtype = dtype
    config.name_or_path = f"preset:{name}"
    return config
