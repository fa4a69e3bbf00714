"""QuantizeMoeMxfp4 (`quantization="mxfp4"`): every fused_moe → fused_moe_mxfp4 over MXFP4 expert weights.

Oracle: on each MoE tiny preset whose expert weights are MXFP4 values already (rounded through the format, as a
gpt-oss checkpoint's are once dequantized), the compiled graph equals eager HF to the fp32 contract: the pass
loses nothing there. On the presets' own random weights the logits move by what 4-bit experts cost (bounded
here, not zero: the quantization happened). Also: the pipeline it joins, the 16-bit experts dropped from the graph,
one quantization per shared weight, a dense model and a K that is not a multiple of 32 refused naming the mode.
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch

from mini_infer.compiler import compile_model
from mini_infer.models.loader import build_random_model
from mini_infer.models.presets import preset_config
from mini_infer.passes import PassContext, recommended_passes
from mini_infer.passes.quantize_moe_mxfp4 import round_experts_to_mxfp4
from mini_infer.passes.route_moe import is_moe_config
from tests.passes.helpers import ARCHS, CPU, assert_logits_close, loaded, op_counts, positions, random_ids

MOE_ARCHS = [name for name in ARCHS if is_moe_config(loaded(name).config)]


def _mxfp4_valued(name: str) -> torch.nn.Module:
    """A copy of `name`'s model whose expert weights are rounded through MXFP4 along their reduction dimension
    (GPT-OSS stores its experts transposed: [E, in, out])."""
    model = copy.deepcopy(loaded(name).model)
    assert round_experts_to_mxfp4(model) > 0
    return model


def _logits(model, cm, num: int = 13, start: int = 4):
    ids, pos = random_ids(num, 7), positions(start, num)
    inputs = cm.example_inputs(ids, pos)
    inputs["logits_indices"] = torch.arange(num)
    with torch.no_grad():
        want = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    return cm(**inputs), want


def test_moe_archs_are_covered():
    assert set(MOE_ARCHS) == {"tiny-mixtral", "tiny-qwen2-moe", "tiny-qwen3-moe", "tiny-deepseek-v2",
                              "tiny-deepseek-v3", "tiny-gpt-oss"}


def test_joins_the_pipeline_after_route_moe_only_when_asked():
    config = loaded("tiny-qwen3-moe").config
    for mode in (None, "w8a8", "fp8", "mxfp4"):
        names = [p.name for p in recommended_passes(PassContext(config=config, device=CPU, dtype=torch.float32,
                                                                quantization=mode))]
        assert ("quantize_moe_mxfp4" in names) is (mode == "mxfp4")
        if mode == "mxfp4":
            assert names.index("quantize_moe_mxfp4") == names.index("route_moe") + 1
            assert "fuse_act_quant" not in names and "quantize_w8a8" not in names  # weight-only


@pytest.mark.parametrize("name", MOE_ARCHS)
def test_mxfp4_valued_experts_compile_to_eager_logits(name):
    """The full recommended pipeline with quantization="mxfp4" on experts that are MXFP4 values: eager's logits
    (fp32 contract), every fused_moe now fused_moe_mxfp4 over uint8 buffers, no 16-bit expert weight left."""
    model = _mxfp4_valued(name)
    cm = compile_model(model, quantization="mxfp4")
    (row,) = [s for s in cm.stats if s.name == "quantize_moe_mxfp4"]
    layers = row.num_matches
    # (compile_model binds each op node to the function it dispatches to: the references on CPU)
    counts = Counter(getattr(t, "__name__", str(t)) for t in op_counts(cm.graph_module).elements())
    assert counts["fused_moe_mxfp4_reference"] == layers >= 1 and counts["fused_moe_reference"] == 0
    buffers = dict(cm.graph_module.named_buffers())
    packed = {k: v for k, v in buffers.items() if k.endswith(("_mxfp4", "_mxfp4_scales"))}
    assert len(packed) == 4 * layers and {v.dtype for v in packed.values()} == {torch.uint8}
    float_experts = [k for k, v in {**buffers, **dict(cm.graph_module.named_parameters())}.items()
                     if "experts" in k and v.is_floating_point() and v.dim() == 3]
    assert float_experts == []  # the 16-bit experts were dropped: one copy, packed
    out, want = _logits(model, cm)
    assert_logits_close(out, want)


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-gpt-oss"])
def test_random_experts_lose_what_4_bits_cost(name):
    """On weights that are not MXFP4 values the logits move (the quantization happened), within a bound."""
    model = loaded(name).model
    cm = compile_model(model, quantization="mxfp4")
    out, want = _logits(model, cm)
    err = (out - want).norm() / want.norm()
    assert 1e-4 < err.item() < 0.15, err.item()


def test_dense_model_refused_naming_the_mode():
    with pytest.raises(Exception, match="quantization='mxfp4' quantizes the routed experts of MoE models"):
        compile_model(loaded("tiny-llama").model, quantization="mxfp4")


def test_reduction_dimension_not_a_multiple_of_32_refused():
    config = preset_config("tiny-qwen3-moe")
    config.moe_intermediate_size = 48
    model = build_random_model(config, torch.float32, CPU, 0)
    with pytest.raises(Exception, match=r"down_proj.*reduction dimension 48 that is not a multiple of 32"):
        compile_model(model, quantization="mxfp4")


def test_bench_active_bytes_counts_top_k_packed_experts(monkeypatch):
    """bench/active_bytes.py (bench/latency.py's floor) counts a token's top_k of E experts' packed bytes."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench"))
    import active_bytes

    cm = compile_model(loaded("tiny-qwen3-moe").model, quantization="mxfp4")
    counted = active_bytes.token_bytes(cm.graph_module)
    packed = sum(v.numel() for k, v in cm.graph_module.named_buffers() if k.endswith(("_mxfp4", "_mxfp4_scales")))
    assert (counted.moe_layers, counted.experts, counted.top_k) == (2, 4, 2)
    assert counted.total - counted.active == packed // 2  # top-2 of 4 experts: half the packed bytes unread
