"""FuseGateUpSiluQuant and FuseQuantGemvNorm: the W8A8 / FP8 decode chain's quantizations in the GEMVs' launches.

On every dense tiny preset, in the recommended CUDA pipeline for quantization "w8a8" (table-driven; an fp8 graph has
no split-out quantization for them to match today: quantize_fp8 emits fp8_w8a8_linear): every
gate_up's scaled linear + split + silu_and_mul_quant becomes scaled_linear_silu_quant, every o_proj's
quantize_per_token + scaled_linear_add_rms_norm_quant becomes quantize_linear_add_rms_norm_quant (counts asserted,
no silu_and_mul_quant / quantize_per_token left), the logits stay within the quantized tolerance of eager HF, and
they equal the pipeline's without the two passes bit for bit: with the references (CPU) and, for a one-row step, with
the Triton kernels under the interpreter (the fused kernels' case). Each pass alone leaves the other's pattern.
Default: on for CUDA targets with a quantization mode, after fuse_gemv_norm and fuse_gate_up_silu.
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
    bound_copy,
    check_against_eager,
    graph_logits,
    loaded,
    mi,
    op_counts,
    positions,
    random_ids,
    run_passes,
)
from tests.passes.test_fuse_gemv_norm import CAL
from tests.passes.test_quantize_w8a8 import QUANT_REL

L = NUM_LAYERS
PASSES = ("fuse_gate_up_silu_quant", "fuse_quant_gemv_norm")
MODES = {"w8a8": mi.int8_linear.default, "fp8": mi.fp8_linear.default}  # mode -> its scaled linear
CUDA = torch.device("cuda")


def cuda_passes(name: str, mode: str, without: tuple[str, ...] = ()) -> list:
    """The recommended CUDA pipeline for `mode` (cleanup aside; w8a8 with a small calibration), less `without`."""
    ctx = PassContext(config=loaded(name).config, device=CUDA, dtype=torch.float32, quantization=mode)
    passes = [QuantizeW8A8(calibrate=CAL) if p.name == "quantize_w8a8" else p for p in recommended_passes(ctx)][1:]
    return [p for p in passes if p.name not in without]


@functools.cache
def pipeline(name: str, mode: str, without: tuple[str, ...] = ()):
    return run_passes(name, cuda_passes(name, mode, without))


def _check_counts(gm, mode: str, gate_up: int, o_proj: int) -> None:
    counts = op_counts(gm)
    assert counts[mi.scaled_linear_silu_quant.default] == gate_up
    assert counts[mi.silu_and_mul_quant.default] == L - gate_up
    assert counts[mi.quantize_linear_add_rms_norm_quant.default] == o_proj
    assert counts[mi.quantize_per_token.default] == L - o_proj
    assert counts[mi.scaled_linear_add_rms_norm_quant.default] == 2 * L - 1 - o_proj  # down_projs but the last
    assert counts[MODES[mode]] == L + 1 + L - gate_up  # qkv, the last down_proj (final norm: float), gate_ups left
    other = MODES["fp8" if mode == "w8a8" else "w8a8"]
    assert counts[other] == 0


@pytest.mark.parametrize("mode", ["w8a8"])  # fp8: test_fp8_pipeline_has_no_split_quantization
@pytest.mark.parametrize("name", TINY_DENSE_PRESETS)
def test_fuses_each_layer_in_the_cuda_pipeline(name, mode):
    gm, ctx, stats = pipeline(name, mode)
    rows = {s.name: s for s in stats}
    assert [s.name for s in stats[-2:]] == list(PASSES)
    assert rows["fuse_gate_up_silu_quant"].num_matches == L and rows["fuse_gate_up_silu_quant"].note == f"{L} gate_up"
    assert rows["fuse_quant_gemv_norm"].num_matches == L and rows["fuse_quant_gemv_norm"].note == f"{L} o_proj"
    _check_counts(gm, mode, L, L)
    qdtype = torch.int8 if mode == "w8a8" else torch.float8_e4m3fn
    for node in gm.graph.nodes:
        if node.target is mi.scaled_linear_silu_quant.default:
            assert node.args[-1] is qdtype and node.args[2].meta["val"].shape[0] == 2 * loaded(name).config.intermediate_size
        if node.target is mi.quantize_linear_add_rms_norm_quant.default:
            assert node.args[1].meta["val"].dtype is qdtype and node.args[0].meta["val"].dtype is torch.float32
    check_against_eager(name, gm, ctx, 5, 3, seed=2, rel=QUANT_REL)
    unfused = pipeline(name, mode, PASSES)
    _check_counts(unfused[0], mode, 0, 0)
    ids, pos, rows_ = random_ids(7, 4), positions(3, 7), torch.arange(7)
    assert torch.equal(graph_logits(gm, ctx, ids, pos, logits_indices=rows_),
                       graph_logits(unfused[0], unfused[1], ids, pos, logits_indices=rows_))


@pytest.mark.parametrize("mode", ["w8a8"])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])  # qwen2: biases on q/k/v
def test_one_row_with_triton_kernels_equals_the_unfused_pipeline(name, mode):
    """Bound to the Triton kernels (interpreter): a one-row step runs both fused kernels and gives the unfused
    pipeline's logits bit for bit."""
    gm, ctx, _ = pipeline(name, mode)
    unfused = pipeline(name, mode, PASSES)
    (bound, names), (bound_ref, _) = bound_copy(gm, "triton"), bound_copy(unfused[0], "triton")
    assert {"scaled_linear_silu_quant_triton", "quantize_linear_add_rms_norm_quant_triton"} <= names
    ids, pos, one = random_ids(1, 5), positions(12, 1), torch.arange(1)
    assert torch.equal(graph_logits(bound, ctx, ids, pos, logits_indices=one),
                       graph_logits(bound_ref, unfused[1], ids, pos, logits_indices=one))


@pytest.mark.parametrize(("without", "gate_up", "o_proj"), [(("fuse_quant_gemv_norm",), L, 0),
                                                            (("fuse_gate_up_silu_quant",), 0, L)])
def test_each_pass_alone(without, gate_up, o_proj):
    gm, _, stats = pipeline("tiny-llama", "w8a8", without)
    _check_counts(gm, "w8a8", gate_up, o_proj)


def test_fp8_pipeline_has_no_split_quantization():
    """quantize_fp8 emits fp8_w8a8_linear (the activation quantized inside the op), so neither fuse_act_quant nor
    fuse_gemv_norm nor these passes find their patterns in an fp8 graph today (the ops take fp8 operands: their
    tests run both dtypes). Fails, on purpose, once quantize_fp8 splits the quantization out: then extend the
    pipeline tests above to "fp8"."""
    gm, _, stats = pipeline("tiny-llama", "fp8")
    assert [(s.name, s.num_matches) for s in stats[-2:]] == [(p, 0) for p in PASSES]
    assert op_counts(gm)[mi.fp8_w8a8_linear.default] == 4 * L


def test_default_on_cuda_with_quantization_only():
    config = loaded("tiny-llama").config
    for device in (CUDA, CPU):
        for mode in (None, "w8a8", "fp8"):
            names = [p.name for p in recommended_passes(PassContext(config=config, device=device,
                                                                    dtype=torch.float32, quantization=mode))]
            on = device.type == "cuda" and mode is not None
            assert all((p in names) == on for p in PASSES)
            if on:
                assert names[-3:] == ["fuse_gate_up_silu", *PASSES]
