"""FuseQuantGemvNorm on its own terms: a quantization with another reader stays (the pipeline tests, counts and
logits of both chain passes, are in test_fuse_gate_up_silu_quant.py)."""

from __future__ import annotations

import torch

from mini_infer.passes.base import PassContext
from mini_infer.passes.fuse_quant_gemv_norm import FuseQuantGemvNorm
from tests.passes.helpers import copy_gm, mi, op_counts
from tests.passes.test_fuse_gate_up_silu_quant import L, pipeline


def test_quantization_with_another_reader_is_left():
    """Give one o_proj quantization's scale a second reader: that layer keeps quantize_per_token, the other fuses."""
    gm = copy_gm(pipeline("tiny-llama", "w8a8", ("fuse_quant_gemv_norm",))[0])
    quant = next(n for n in gm.graph.nodes if n.target is mi.quantize_per_token.default)
    scale = next(u for u in quant.users if u.args[1] == 1)
    with gm.graph.inserting_after(scale):
        extra = gm.graph.call_function(torch.ops.aten.clone.default, (scale,))
    out = next(n for n in gm.graph.nodes if n.op == "output")
    out.args = ((out.args[0], extra),)
    ctx = PassContext(config=None, device=torch.device("cpu"), dtype=torch.float32)
    result = FuseQuantGemvNorm().apply(gm, ctx)
    assert result.num_matches == L - 1
    counts = op_counts(gm)
    assert counts[mi.quantize_per_token.default] == 1 and counts[mi.quantize_linear_add_rms_norm_quant.default] == L - 1
