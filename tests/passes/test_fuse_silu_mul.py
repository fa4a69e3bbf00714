"""FuseSiluMul: the SwiGLU gate `silu(gate) * up` → mini_infer.silu_and_mul.

Per layer (L = 2): one MLP in the dense families; MoE graphs as observed: Mixtral and Qwen3-MoE compute
their routed experts with one gated product per layer, Qwen2-MoE adds its shared expert (2 per layer), and
DeepSeek has a dense first layer (first_k_dense_replace=1) then experts + shared experts (1 + 2). In the full
pipeline route_moe runs first and the routed experts' gates are inside mini_infer.fused_moe: one fewer per MoE layer.
"""

import pytest
import torch
from hypothesis import given

from tests.passes.helpers import (
    ARCHS,
    FEW,
    NUM_LAYERS,
    aten,
    check_against_eager,
    full_pipeline,
    mi,
    num_tokens,
    op_counts,
    run_toy,
    single_pass,
    start_pos,
)

L = NUM_LAYERS
EXPECTED = {
    "tiny-llama": L,
    "tiny-qwen2": L,
    "tiny-qwen3": L,
    "tiny-mistral": L,
    "tiny-mixtral": L,
    "tiny-qwen2-moe": 2 * L,
    "tiny-qwen3-moe": L,
    "tiny-deepseek-v2": 1 + 2 * (L - 1),
    "tiny-deepseek-v3": 1 + 2 * (L - 1),
    "tiny-gemma2": 0,  # GeLU (tanh) gate, not SiLU
    "tiny-gpt-oss": 0,  # experts only, their gate a clamped x * sigmoid(alpha x) (route_moe's), not SiLU
}
assert set(EXPECTED) == set(ARCHS)
MOE_LAYERS = {"tiny-mixtral": L, "tiny-qwen2-moe": L, "tiny-qwen3-moe": L, "tiny-deepseek-v2": L - 1,
              "tiny-deepseek-v3": L - 1}
IN_PIPELINE = {name: n - MOE_LAYERS.get(name, 0) for name, n in EXPECTED.items()}


def _check_counts(name, gm, num_matches, expected=EXPECTED):
    counts = op_counts(gm)
    assert num_matches == expected[name]
    assert counts[mi.silu_and_mul.default] == expected[name]
    assert counts[aten.silu.default] == 0


@pytest.mark.parametrize("name", ARCHS)
def test_counts(name):
    gm, ctx, stats = single_pass(name, "fuse_silu_mul")
    _check_counts(name, gm, stats[0].num_matches)


@pytest.mark.parametrize("name", ARCHS)
@given(num=num_tokens, start=start_pos)
@FEW
def test_logits_equal_eager(name, num, start):
    gm, ctx, _ = single_pass(name, "fuse_silu_mul")
    check_against_eager(name, gm, ctx, num, start, seed=num * 3 + start)


@pytest.mark.parametrize("name", ARCHS)
def test_counts_in_full_pipeline(name):
    gm, ctx, stats = full_pipeline(name)
    (row,) = [s for s in stats if s.name == "fuse_silu_mul"]
    _check_counts(name, gm, row.num_matches, IN_PIPELINE)


class _Gated(torch.nn.Module):
    def __init__(self, act="silu", reuse=False):
        super().__init__()
        self.gate = torch.nn.Linear(16, 24, bias=False)
        self.up = torch.nn.Linear(16, 24, bias=False)
        self.down = torch.nn.Linear(24, 16, bias=False)
        self.act = torch.nn.functional.silu if act == "silu" else torch.nn.functional.gelu
        self.reuse = reuse

    def forward(self, x, pos):
        g = self.act(self.gate(x))
        out = self.down(g * self.up(x))
        return out + self.down(g) if self.reuse else out


@pytest.mark.parametrize("act, reuse, expected", [("silu", False, 1), ("gelu", False, 0), ("silu", True, 0)])
def test_matches_silu_gate_only(act, reuse, expected):
    # a GELU gate is another op; a silu whose output is also used elsewhere must stay
    gm, stats, _ = run_toy(_Gated(act, reuse), ["fuse_silu_mul"])
    assert stats[0].num_matches == expected
    assert op_counts(gm)[mi.silu_and_mul.default] == expected
