"""passes/keep_float.py: quantize_w8a8 and quantize_fp8 leave the same linears in float, for the same reasons.

On every tiny preset both passes, alone after cleanup, leave exactly the linears `kept_in_float` names (lm_head,
MoE routers, MLA kv_b_proj). On a toy LM whose head is called `head` (found as the linear making the logits, not
by name) and whose body has a `*_gate` linear (a router by name), both passes keep those two and quantize the
rest; `lm_head=True` quantizes the head, `skip` keeps what it names. A skip pattern that matches nothing is refused
with one message whichever pass got it.
"""

from __future__ import annotations

import pytest
import torch

from mini_infer.passes import PassContext
from mini_infer.passes.keep_float import kept_in_float, linear_name
from mini_infer.passes.manager import PassError, PassManager
from mini_infer.passes.quantize_fp8 import QuantizeFP8
from mini_infer.passes.quantize_w8a8 import QuantizeW8A8
from tests.passes.helpers import ARCHS, CPU, _cleaned, aten, run_passes, run_toy

# the two passes with the same keep-float options (w8a8 without SmoothQuant: no calibration needed)
PASSES = {"w8a8": lambda **kw: QuantizeW8A8(smoothquant=False, **kw), "fp8": QuantizeFP8}


def float_linears(gm: torch.fx.GraphModule) -> list[str]:
    return sorted(linear_name(n) for n in gm.graph.nodes if n.target is aten.linear.default)


@pytest.mark.parametrize("name", ARCHS)
def test_both_passes_keep_what_the_policy_names(name):
    gm = _cleaned(name)
    linears = [n for n in gm.graph.nodes if n.target is aten.linear.default]
    policy = sorted(linear_name(n) for n in kept_in_float(gm, linears, QuantizeFP8()))
    assert "lm_head" in policy
    for make in PASSES.values():
        quantized, _, _ = run_passes(name, [make()])
        assert float_linears(quantized) == policy


class GatedBody(torch.nn.Module):
    """up(x) scaled by a sigmoid gate from a linear named `*_gate`."""

    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        self.up = torch.nn.Linear(hidden, hidden)
        self.down = torch.nn.Linear(hidden, hidden)
        self.expert_gate = torch.nn.Linear(hidden, 1, bias=False)

    def forward(self, x, position_ids):
        return self.down(self.up(x) * torch.sigmoid(self.expert_gate(x)))


def quantize_toy(make, **kw) -> torch.fx.GraphModule:
    """A fresh cleaned ToyLM(GatedBody()) graph after the pass `make(**kw)`."""
    gm, _, model = run_toy(GatedBody(), [])
    ctx = PassContext(config=model.config, device=CPU, dtype=torch.float32, applied=["cleanup"])
    PassManager([make(**kw)]).run(gm, ctx)
    return gm


@pytest.mark.parametrize("mode", PASSES)
def test_toy_head_and_gate_stay_float(mode):
    assert float_linears(quantize_toy(PASSES[mode])) == ["body.expert_gate", "head"]
    assert float_linears(quantize_toy(PASSES[mode], lm_head=True)) == ["body.expert_gate"]
    assert float_linears(quantize_toy(PASSES[mode], skip=["up"])) == ["body.expert_gate", "body.up", "head"]


@pytest.mark.parametrize("mode", PASSES)
def test_skip_pattern_matching_nothing_has_one_message(mode):
    make = PASSES[mode]
    with pytest.raises(PassError, match=rf"pass 'quantize_{mode}': invalid skip='dwon': matches no linear of this "
                       r"model \(names like: body.down, body.expert_gate, body.up, head\)"):
        quantize_toy(make, skip=["up", "dwon"])
