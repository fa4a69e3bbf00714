"""FuseActQuant: quantize_per_token after rms_norm / fused_add_rms_norm / silu_and_mul → the producer's *_quant op.

On every dense tiny preset after quantize_w8a8 and the norm/activation fusions: the counts (every norm that feeds
only a quantization and every SwiGLU product fused; o_proj's input, produced by attention, keeps its own
quantize op), the fused ops carry the quantization dtype, and the logits are bit-identical to the unfused graph
(the fused ops compute the same bits); a producer with another reader (a linear left in float by `skip`) stays as
it is; the pass joins the recommended pipeline only with a quantization mode.
"""

from __future__ import annotations

import functools

import pytest
import torch

from mini_infer.models.presets import TINY_DENSE_PRESETS
from mini_infer.passes import PassContext, recommended_passes
from mini_infer.passes.quantize_w8a8 import QuantizeW8A8
from tests.passes.helpers import (
    CPU,
    NUM_LAYERS,
    graph_logits,
    loaded,
    mi,
    op_counts,
    positions,
    random_ids,
    run_passes,
)
from tests.passes.test_quantize_w8a8 import CAL

L = NUM_LAYERS
BEFORE = ["select_logits", "fuse_rmsnorm", "merge_projections", "fuse_silu_mul"]  # around quantize_w8a8


@functools.cache
def pipelines(name: str, skip: tuple[str, ...] = ()):
    """(unfused, fused) graphs: quantize_w8a8 and the producer fusions, without and with fuse_act_quant."""
    def passes():
        return [BEFORE[0], QuantizeW8A8(calibrate=CAL, skip=list(skip)), *BEFORE[1:]]
    return run_passes(name, passes()), run_passes(name, [*passes(), "fuse_act_quant"])


def _assert_same_logits(name, unfused, fused):
    ids, pos = random_ids(21, 4), positions(3, 21)
    rows = torch.arange(21)
    assert torch.equal(graph_logits(*fused[:2], ids, pos, logits_indices=rows),
                       graph_logits(*unfused[:2], ids, pos, logits_indices=rows))


@pytest.mark.parametrize("name", TINY_DENSE_PRESETS)
def test_fuses_every_quantized_producer(name):
    unfused, fused = pipelines(name)
    gm, _, stats = fused
    assert stats[-1].num_matches == 3 * L
    assert stats[-1].note == "1 rms_norm, 3 fused_add_rms_norm, 2 silu_and_mul"
    before, after = op_counts(unfused[0]), op_counts(gm)
    assert before[mi.quantize_per_token.default] == 4 * L
    assert after[mi.quantize_per_token.default] == L  # o_proj's input comes out of attention
    assert after[mi.rms_norm_quant.default] == 1 and after[mi.fused_add_rms_norm_quant.default] == 2 * L - 1
    assert after[mi.silu_and_mul_quant.default] == L
    assert after[mi.silu_and_mul.default] == 0
    assert after[mi.fused_add_rms_norm.default] == 1  # the final norm feeds the float lm_head
    for node in gm.graph.nodes:
        if node.target in (mi.rms_norm_quant.default, mi.fused_add_rms_norm_quant.default,
                           mi.silu_and_mul_quant.default):
            assert node.args[-1] is torch.int8
    _assert_same_logits(name, unfused, fused)


def test_producer_with_another_reader_is_left():
    """With k_proj in float, the input norms feed a float linear too: only post-attention norms and SwiGLU fuse."""
    unfused, fused = pipelines("tiny-llama", skip=("k_proj",))
    assert fused[2][-1].note == f"{L} fused_add_rms_norm, {L} silu_and_mul"
    counts = op_counts(fused[0])
    assert counts[mi.rms_norm.default] == 1 and counts[mi.rms_norm_quant.default] == 0
    _assert_same_logits("tiny-llama", unfused, fused)


def test_default_pipeline_only_with_a_quantization_mode():
    config = loaded("tiny-llama").config
    for mode in (None, "w8a8"):
        ctx = PassContext(config=config, device=CPU, dtype=torch.float32, quantization=mode)
        names = [p.name for p in recommended_passes(ctx)]
        assert ("fuse_act_quant" in names) is (mode is not None)
        if mode:
            assert names.index("fuse_act_quant") == names.index("fuse_gelu_mul") + 1 == names.index("fuse_silu_mul") + 2
