"""FuseGateUpSiluQuant: int8_linear / fp8_linear → split into two equal halves → silu_and_mul_quant ⇒
scaled_linear_silu_quant.

On every dense tiny preset, W8A8 and FP8: added to the end of the recommended pipeline (the CUDA tail included), every
layer's merged gate_up fuses (count asserted) and no silu_and_mul_quant is left; the logits equal the pipeline's
without the pass bit for bit, with the references and with the Triton kernels under the interpreter for a one-row
step (the fused kernels' case). Without quantization it finds nothing. Opt-in: in no recommended pipeline.
"""

import pytest
import torch

from mini_infer.models.presets import TINY_DENSE_PRESETS
from mini_infer.passes import PassContext, recommended_passes
from mini_infer.passes.quantize_fp8 import QuantizeFP8
from mini_infer.passes.quantize_w8a8 import QuantizeW8A8
from tests.passes.helpers import (
    CPU,
    NUM_LAYERS,
    assert_unfused_bits,
    loaded,
    mi,
    op_counts,
    run_passes,
)
from tests.passes.test_fuse_silu_gemv import CUDA_TAIL

L = NUM_LAYERS
CAL = [[3, 17, 101, 250, 7, 9, 480, 33, 64, 12, 5, 300], [11, 22, 33, 44, 55, 66, 77, 88]]  # small: fast tests
PRODUCER = {"w8a8": "int8_linear", "fp8": "fp8_linear"}


def _pipeline(name: str, mode: str, with_pass: bool):
    """The recommended `mode` pipeline (small calibration for w8a8), the CUDA tail after it, then the pass or not."""
    ctx = PassContext(config=loaded(name).config, device=CPU, dtype=torch.float32, quantization=mode)
    swap = {"quantize_w8a8": lambda: QuantizeW8A8(calibrate=CAL), "quantize_fp8": lambda: QuantizeFP8()}
    passes = [swap[p.name]() if p.name in swap else p for p in recommended_passes(ctx)][1:]
    present = {p.name for p in passes}
    passes += [p for p in CUDA_TAIL if p not in present]
    return run_passes(name, [*passes, "fuse_gate_up_silu_quant"] if with_pass else passes)


@pytest.mark.parametrize("name", sorted(TINY_DENSE_PRESETS))
@pytest.mark.parametrize("mode", ["w8a8", "fp8"])
def test_every_gate_up_fuses_with_the_unfused_bits(name, mode):
    unfused, fused = _pipeline(name, mode, False), _pipeline(name, mode, True)
    gm, stats = fused[0], fused[2]
    assert stats[-1].name == "fuse_gate_up_silu_quant"
    assert stats[-1].num_matches == L and stats[-1].note == f"{L} {PRODUCER[mode]}"
    counts = op_counts(gm)
    assert counts[mi.scaled_linear_silu_quant.default] == L and counts[mi.silu_and_mul_quant.default] == 0
    assert op_counts(unfused[0])[mi.silu_and_mul_quant.default] == L
    assert_unfused_bits(fused, unfused, "scaled_linear_silu_quant_triton")


def test_nothing_to_fuse_without_quantization_and_opt_in():
    """A float graph has no silu_and_mul_quant: nothing matches; no recommended pipeline (CUDA, W8A8) runs the pass."""
    name = "tiny-llama"
    ctx = PassContext(config=loaded(name).config, device=torch.device("cuda"), dtype=torch.float32,
                      quantization="w8a8")
    assert "fuse_gate_up_silu_quant" not in [p.name for p in recommended_passes(ctx)]
    _, _, stats = run_passes(name, ["fuse_rmsnorm", "merge_projections", "fuse_silu_mul", "fuse_act_quant",
                                    "gemv_linear", "fuse_gate_up_silu_quant"])
    assert stats[-1].num_matches == 0
