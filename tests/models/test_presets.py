"""Presets: every named config builds with its model_type and published fields; tiny presets keep the
features the passes must handle; unknown names list the valid ones. Only configs are built here."""

import copy

import pytest
import torch

from mini_infer.models.loader import build_random_model
from mini_infer.models.presets import (
    ALL_PRESETS,
    PRESETS,
    TINY_DENSE_PRESETS,
    TINY_PRESETS,
    preset_config,
    preset_names,
)


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_builds_its_config(name):
    fields = ALL_PRESETS[name]
    config = preset_config(name)
    assert config.model_type == fields["model_type"]
    assert config.name_or_path == f"preset:{name}"
    assert config.dtype == fields["torch_dtype"]
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings"):
        assert getattr(config, key) == fields[key], key
    # building the config does not consume the preset table
    assert "model_type" in ALL_PRESETS[name] and "torch_dtype" in ALL_PRESETS[name]


def test_names_real_shapes_first():
    names = preset_names()
    assert names == list(PRESETS) + list(TINY_PRESETS)
    assert len(set(names)) == len(names)
    assert set(TINY_DENSE_PRESETS) <= set(TINY_PRESETS)
    assert {"qwen2.5-7b", "llama-3.1-8b", "tiny-llama", "tiny-deepseek-v3"} <= set(names)


def test_unknown_preset_lists_valid_names():
    with pytest.raises(ValueError, match="unknown preset 'tiny-gpt5'") as info:
        preset_config("tiny-gpt5")
    for name in preset_names():
        assert name in str(info.value)


def test_tiny_presets_cover_every_family():
    types = {preset_config(n).model_type for n in TINY_PRESETS}
    assert types == {"llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2",
                     "deepseek_v3", "gemma2", "gpt_oss"}
    for name in TINY_PRESETS:
        c = preset_config(name)
        assert c.num_hidden_layers == 2 and c.dtype == "float32" and c.vocab_size == 512


def test_tiny_features():
    assert preset_config("tiny-mistral").sliding_window == 8
    assert preset_config("tiny-qwen3").head_dim == 32
    assert preset_config("tiny-deepseek-v2").q_lora_rank is None
    assert preset_config("tiny-deepseek-v3").q_lora_rank == 32
    for name in ("tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral", "tiny-mixtral", "tiny-qwen3-moe"):
        c = preset_config(name)
        assert c.num_key_value_heads < c.num_attention_heads  # GQA
    assert preset_config("tiny-mixtral").num_local_experts == 4
    oss = preset_config("tiny-gpt-oss")  # sliding and full layers alternate, YaRN, biased q/k/v/o
    assert oss.layer_types == ["sliding_attention", "full_attention"] and oss.sliding_window == 8
    assert oss.rope_parameters["rope_type"] == "yarn" and oss.attention_bias


def test_real_shapes_keep_rope_scaling():
    oss = preset_config("gpt-oss-20b")
    assert oss.rope_parameters == dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                                       original_max_position_embeddings=4096, rope_theta=150000.0)
    assert oss.layer_types[:2] == ["sliding_attention", "full_attention"] and len(oss.layer_types) == 24
    llama = preset_config("llama-3.1-8b")
    assert llama.rope_parameters["rope_type"] == "llama3" and llama.rope_parameters["factor"] == 8.0
    assert llama.rope_parameters["rope_theta"] == 500000.0
    ds = preset_config("deepseek-v2-lite")
    assert ds.rope_parameters["rope_type"] == "yarn" and ds.kv_lora_rank == 512
    q = preset_config("qwen2.5-7b")
    assert (q.hidden_size, q.intermediate_size, q.num_hidden_layers) == (3584, 18944, 28)
    assert set(q.layer_types) == {"full_attention"}
    assert preset_config("mistral-7b").sliding_window == 4096


def test_real_shape_parameter_count_on_meta():
    """qwen2.5-7b's shapes give its published 7.6B parameters (built on the meta device: no memory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(preset_config("qwen2.5-7b"))
    n = sum(p.numel() for p in model.parameters())
    assert 7.6e9 < n < 7.7e9


def test_build_random_model_rejects_non_causal_config():
    from transformers import T5Config

    config = T5Config(vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2)
    with pytest.raises(ValueError, match="not a causal language model"):
        build_random_model(config, torch.float32, torch.device("cpu"))


def test_building_a_config_leaves_the_presets_as_written():
    """transformers writes rope_theta into the rope_scaling dict it is given: each config gets a copy, so the table
    (and the gpt-oss presets' shared YaRN dict) stays as written."""
    before = copy.deepcopy(ALL_PRESETS)
    for name in ("llama-3.1-8b", "gpt-oss-20b", "gpt-oss-120b", "tiny-gpt-oss"):
        preset_config(name)
    assert ALL_PRESETS == before
