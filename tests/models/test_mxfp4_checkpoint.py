"""A GPT-OSS checkpoint directory with MXFP4 experts, as OpenAI publishes gpt-oss-20b / 120b, loads dequantized
and runs; a checkpoint of any other pre-quantized method is refused at start-up, naming it.

The checkpoint is fabricated: the tiny-gpt-oss preset with seeded random weights, its experts' `gate_up_proj` /
`down_proj` packed to MXFP4 in the on-disk layout transformers reads (`*_blocks`: uint8, two FP4 codes a byte, the
low nibble first, 16 bytes per block of 32 values along the input dimension; `*_scales`: uint8, the block's power of
two + 127), the rest in bf16, and the published config's `quantization_config`. transformers only has the packer
behind its `kernels` package (`quantize_to_mxfp4` calls triton_kernels' `downcast_to_mxfp_torch`, fetched from the
hub), so the packer (`_pack_mxfp4`: mini-infer's own `quantize_mxfp4` in the checkpoint's layout) is checked against
its dequantizer, `convert_moe_packed_tensors`, and the packed shapes
against its `Mxfp4GptOssExperts`. Oracles: the loaded experts equal `convert_moe_packed_tensors` of the file's
tensors exactly, and the engine's greedy tokens equal HF `generate` on the loaded model (also with the experts packed
back to MXFP4 by quantization="mxfp4").
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.integrations.mxfp4 import FP4_VALUES, Mxfp4GptOssExperts, convert_moe_packed_tensors
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
from transformers.quantizers.quantizer_mxfp4 import Mxfp4HfQuantizer

from mini_infer.models.loader import ModelLoadError, build_random_model, load_model
from mini_infer.models.presets import preset_config
from mini_infer.ops.fused_moe_mxfp4 import quantize_mxfp4
from mini_infer.runtime.engine import EngineConfig, LLMEngine
from mini_infer.sampling_params import SamplingParams
from tests import _model_cache as mc
from tests.runtime.test_engine import assert_no_leak, random_prompts, run

CPU = torch.device("cpu")
PROJS = ("gate_up_proj", "down_proj")
# gpt-oss-20b's config.json, as published
QUANTIZATION_CONFIG = {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                  "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"}


def _pack_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GptOssExperts' [experts, in, out] weight → (blocks [experts, out, in / 32, 16], scales [experts, out, in / 32]),
    uint8, in the checkpoint's layout: mini-infer's `quantize_mxfp4` (each block of 32 inputs scaled by the power of
    two that brings its largest magnitude to at most 6, FP4's largest; every value rounded to the nearest FP4 value)
    of the [experts, out, in] rows."""
    e, n_in, n_out = w.shape
    blocks, scales = quantize_mxfp4(w.transpose(1, 2))
    return blocks.reshape(e, n_out, n_in // 32, 16), scales


def _write_checkpoint(where: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """tiny-gpt-oss with random weights as a published-style MXFP4 checkpoint in `where`; returns its tensors."""
    config = preset_config("tiny-gpt-oss")
    model = build_random_model(config, torch.float32, CPU, seed)
    tensors = {}
    for name, t in model.state_dict().items():
        if name.rsplit(".", 1)[-1] in PROJS:
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = _pack_mxfp4(t)
        else:
            tensors[name] = t.to(torch.bfloat16).contiguous()
    where.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(where / "model.safetensors"), metadata={"format": "pt"})
    config.quantization_config = dict(QUANTIZATION_CONFIG)
    config.dtype = "bfloat16"
    config.save_pretrained(where)
    return tensors


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    _write_checkpoint(where)
    return where


def _expert_weights(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """transformers' dequantization of each expert weight in `tensors`, by parameter name."""
    return {name.removesuffix("_blocks"): convert_moe_packed_tensors(t, tensors[name.replace("_blocks", "_scales")],
                                                                     dtype=dtype)
            for name, t in tensors.items() if name.endswith("_blocks")}


# -- the fabricated checkpoint ---------------------------------------------------------------------------------

def test_packer_round_trips_through_transformers_dequantizer():
    config = preset_config("tiny-gpt-oss")
    w = torch.randn(3, 64, 96, generator=torch.Generator().manual_seed(0)) * 0.02
    w[0, :32, 0] = 0.0  # an all-zero block
    blocks, scales = _pack_mxfp4(w)
    assert (blocks.shape, scales.shape) == ((3, 96, 2, 16), (3, 96, 2))
    deq = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert deq.shape == w.shape
    # every value is its nearest FP4 value times its block's power of two: within half FP4's widest step (2, from
    # 4 to 6) of it. A swapped nibble order, a transposed layout or a wrong scale bias lands far from w.
    step = torch.exp2(scales.float() - 127).repeat_interleave(32, -1).transpose(1, 2)
    assert ((w - deq).abs() <= step).all()
    assert torch.isin(deq / step, torch.tensor(FP4_VALUES)).all()
    assert torch.equal(deq[0, :32, 0], torch.zeros(32))
    assert (w - deq).norm() / w.norm() < 0.2
    # idempotent: packing dequantized values gives them back exactly
    assert torch.equal(convert_moe_packed_tensors(*_pack_mxfp4(deq), dtype=torch.float32), deq)
    # the shapes transformers' packed experts declare for these tensors (5.17: blocks as stored; 5.2x: flattened)
    packed = Mxfp4GptOssExperts(config)
    for proj in PROJS:
        b, s = _pack_mxfp4(torch.zeros(getattr(GptOssExperts(config), proj).shape))
        assert getattr(packed, proj).numel() == b.numel()
        assert getattr(packed, proj).shape[:2] == b.shape[:2] == s.shape[:2]


def test_checkpoint_files_look_like_the_published_ones(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["quantization_config"] == QUANTIZATION_CONFIG and config["model_type"] == "gpt_oss"
    tensors = load_file(str(checkpoint / "model.safetensors"))
    layer = "model.layers.0.mlp.experts."
    e, h, i = config["num_local_experts"], config["hidden_size"], config["intermediate_size"]
    assert tensors[layer + "gate_up_proj_blocks"].shape == (e, 2 * i, h // 32, 16)
    assert tensors[layer + "gate_up_proj_scales"].shape == (e, 2 * i, h // 32)
    assert tensors[layer + "down_proj_blocks"].shape == (e, h, i // 32, 16)
    assert tensors[layer + "down_proj_scales"].shape == (e, h, i // 32)
    assert not any(name.endswith(PROJS) for name in tensors)
    assert {t.dtype for name, t in tensors.items() if "_blocks" in name or "_scales" in name} == {torch.uint8}


# -- load_model ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype, expected", [("auto", torch.float32), ("bf16", torch.bfloat16)])
def test_mxfp4_checkpoint_loads_dequantized(checkpoint, dtype, expected, caplog):
    with caplog.at_level(logging.INFO, logger="mini_infer"):
        lm = load_model(str(checkpoint), dtype=dtype, device="cpu")
    lines = [r.getMessage() for r in caplog.records if "MXFP4" in r.getMessage()]
    assert len(lines) == 1 and "'mxfp4'" in lines[0] and f"dequantized to {str(expected)[6:]}" in lines[0]
    assert lm.source == "hf-dir" and getattr(lm.config, "quantization_config", None) is None
    experts = [m for m in lm.model.modules() if "Experts" in type(m).__name__]
    assert len(experts) == 2 and all(type(m) is GptOssExperts for m in experts)
    assert {p.dtype for p in lm.model.parameters() if p.dim() > 1} == {expected}
    tensors = load_file(str(checkpoint / "model.safetensors"))
    state = lm.model.state_dict()
    for name, want in _expert_weights(tensors, expected).items():
        assert state[name].dtype == expected and torch.equal(state[name], want), name
    for name, t in tensors.items():
        if not name.endswith(("_blocks", "_scales")):
            assert torch.equal(state[name].float(), t.float()), name


def test_dequantization_is_asked_for_not_left_to_the_environment(checkpoint, monkeypatch):
    """With transformers' `kernels` package and a GPU, its quantizer keeps the experts packed unless the
    quantization config it gets says dequantize: the loader must say so itself (on a CPU, transformers
    dequantizes anyway, so the loaded model alone cannot show it)."""
    seen = []
    validate = Mxfp4HfQuantizer.validate_environment

    def recording(self, *args, **kwargs):
        seen.append(self.quantization_config.dequantize)
        return validate(self, *args, **kwargs)

    monkeypatch.setattr(Mxfp4HfQuantizer, "validate_environment", recording)
    load_model(str(checkpoint), device="cpu")
    assert seen == [True]


# -- through the engine ----------------------------------------------------------------------------------------

NEW = 8


@pytest.mark.parametrize("quantization", [None, "mxfp4"])
def test_engine_greedy_on_the_mxfp4_checkpoint_matches_hf(checkpoint, quantization):
    """Dequantized, or (quantization="mxfp4") packed again at compile time, which gives the checkpoint's own values
    back: either way HF's greedy tokens on the dequantized model."""
    engine = LLMEngine(EngineConfig(model=str(checkpoint), device="cpu", async_scheduling=False, num_kv_blocks=64,
                                    block_size=4, max_num_batched_tokens=8, enable_chunked_prefill=True,
                                    quantization=quantization))
    assert "route_moe" in engine.compiled.context.applied
    assert ("quantize_moe_mxfp4" in engine.compiled.context.applied) is (quantization == "mxfp4")
    prompts = random_prompts(5, (3, 13, 21))
    outs = run(engine, prompts, SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))
    hf = load_model(str(checkpoint), device="cpu").model  # (the engine lets go of the eager model it compiled)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == mc.hf_greedy(hf, p, NEW), f"prompt of {len(p)} tokens"
    assert_no_leak(engine)


# -- other pre-quantized checkpoints ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def plain_checkpoint(tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("tiny-llama")
    build_random_model(preset_config("tiny-llama"), torch.float32, CPU).save_pretrained(where)
    return where


def _with_quantization_config(src: Path, dst: Path, quantization_config: dict) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).symlink_to(f)
    (dst / "config.json").unlink()
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    return dst


@pytest.mark.parametrize("quantization_config", [
    {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True},
    {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
    {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    {"quant_method": "bitsandbytes", "load_in_4bit": True},
    {"quant_method": "no-such-method"},
], ids=lambda qc: qc["quant_method"])
def test_other_quant_methods_are_refused_naming_the_method(plain_checkpoint, tmp_path, quantization_config):
    where = _with_quantization_config(plain_checkpoint, tmp_path / "q", quantization_config)
    method = quantization_config["quant_method"]
    with pytest.raises(ModelLoadError, match=rf"quantization_config\.quant_method is '{method}'"):
        load_model(str(where), device="cpu")


def test_quantization_config_without_a_method_is_refused(plain_checkpoint, tmp_path):
    where = _with_quantization_config(plain_checkpoint, tmp_path / "q", {"bits": 4})
    with pytest.raises(ModelLoadError, match="quantization_config has no quant_method"):
        load_model(str(where), device="cpu")


def test_engine_start_up_refuses_a_gptq_checkpoint(plain_checkpoint, tmp_path):
    where = _with_quantization_config(plain_checkpoint, tmp_path / "q", {"quant_method": "gptq", "bits": 4})
    with pytest.raises(ModelLoadError, match="quant_method is 'gptq'"):
        LLMEngine(EngineConfig(model=str(where), device="cpu", num_kv_blocks=16, block_size=4))


def test_dummy_load_of_an_mxfp4_config_builds_the_plain_architecture(checkpoint):
    lm = load_model(str(checkpoint), device="cpu", load_format="dummy")  # random weights: nothing to dequantize
    assert all(type(m) is GptOssExperts for m in lm.model.modules() if "Experts" in type(m).__name__)
    assert lm.model.model.layers[0].mlp.experts.gate_up_proj.shape == (4, 64, 64)


def test_checkpoint_numel_counts_the_dequantized_values(checkpoint):
    """The start-up memory check reads the parameter count from the files' headers: the packed blocks count two
    values a byte and the scales none, so the count is the dequantized model's."""
    from mini_infer.models.model_info import checkpoint_numel

    model = load_model(str(checkpoint), dtype="bf16", device="cpu").model
    assert checkpoint_numel(checkpoint) == sum(p.numel() for p in model.parameters())
