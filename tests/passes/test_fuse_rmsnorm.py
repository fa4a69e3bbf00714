"""FuseRMSNorm: every HF RMSNorm → mini_infer.rms_norm, residual add + norm → fused_add_rms_norm.

Counts per architecture (L = 2 layers) were read off the graphs once and are hard-coded, so a matcher
regression that finds fewer norms fails here.
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
    loaded,
    mi,
    num_tokens,
    op_counts,
    run_toy,
    single_pass,
    start_pos,
)

L = NUM_LAYERS
# name -> (plain rms_norm, fused_add_rms_norm)
EXPECTED = {
    # final norm plain; input_layernorm and post_attention_layernorm of every layer fused with the residual add
    "tiny-llama": (1, 2 * L),
    "tiny-qwen2": (1, 2 * L),
    "tiny-mistral": (1, 2 * L),
    "tiny-mixtral": (1, 2 * L),
    "tiny-qwen2-moe": (1, 2 * L),
    # + q_norm and k_norm per layer (on head_dim, plain)
    "tiny-qwen3": (1 + 2 * L, 2 * L),
    "tiny-qwen3-moe": (1 + 2 * L, 2 * L),
    # + kv_a_layernorm per layer (q_lora_rank=None: no q_a_layernorm)
    "tiny-deepseek-v2": (1 + L, 2 * L),
    # + kv_a_layernorm and q_a_layernorm per layer
    "tiny-deepseek-v3": (1 + 2 * L, 2 * L),
    # Gemma's RMSNorm (x * (1 + w) in fp32) is not HF's Llama one: not matched
    "tiny-gemma2": (0, 0),
    # GPT-OSS: as Llama (in fp32; its weight multiplies before the cast back, as Gemma's does)
    "tiny-gpt-oss": (1, 2 * L),
}
assert set(EXPECTED) == set(ARCHS)
# norms the pass leaves as captured (their rsqrt stays when it runs alone; fuse_gemma_rmsnorm takes them in the
# full pipeline): Gemma 2's four a layer and the final one
UNMATCHED = {"tiny-gemma2": 4 * L + 1}


def _check_counts(name, gm, num_matches, unmatched=0):
    plain, fused = EXPECTED[name]
    counts = op_counts(gm)
    assert num_matches == plain + fused
    # in the full pipeline fuse_norm_gemv folds some norms into the linear reading them, fuse_qk_rotary the q/k head
    # norms into qk_rotary (its weight arguments): they count as norms here
    head_norms = sum(w is not None for n in gm.graph.nodes if n.target is mi.qk_rotary.default for w in n.args[4:6])
    assert counts[mi.rms_norm.default] + counts[mi.rms_norm_linear.default] + head_norms == plain
    assert counts[mi.fused_add_rms_norm.default] + counts[mi.fused_add_rms_norm_linear.default] == fused
    assert counts[aten.rsqrt.default] == unmatched  # no norm left behind but the unmatched
    eps = loaded(name).config.rms_norm_eps
    for node in gm.graph.nodes:
        if node.target in (mi.rms_norm.default, mi.fused_add_rms_norm.default):
            assert node.args[-1] == eps
            assert node.args[-2].op == "get_attr"  # the norm's weight


@pytest.mark.parametrize("name", ARCHS)
def test_counts(name):
    gm, ctx, stats = single_pass(name, "fuse_rmsnorm")
    _check_counts(name, gm, stats[0].num_matches, UNMATCHED.get(name, 0))
    plain, fused = EXPECTED[name]
    assert stats[0].note == f"{plain} rms_norm, {fused} fused_add_rms_norm"


@pytest.mark.parametrize("name", ARCHS)
@given(num=num_tokens, start=start_pos)
@FEW
def test_logits_equal_eager(name, num, start):
    gm, ctx, _ = single_pass(name, "fuse_rmsnorm")
    check_against_eager(name, gm, ctx, num, start, seed=num + start)


@pytest.mark.parametrize("name", ARCHS)
def test_counts_in_full_pipeline(name):
    gm, ctx, stats = full_pipeline(name)
    (row,) = [s for s in stats if s.name == "fuse_rmsnorm"]
    _check_counts(name, gm, row.num_matches)


class _LlamaNorm(torch.nn.Module):
    def __init__(self, n=16, gemma=False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n) * 0.1 + 1)
        self.gemma = gemma

    def forward(self, x, pos):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
        return (1 + self.weight) * h if self.gemma else self.weight * h.to(x.dtype)


def test_matches_hf_form_only():
    gm, stats, _ = run_toy(_LlamaNorm(), ["fuse_rmsnorm"])
    assert stats[0].num_matches == 1 and op_counts(gm)[mi.rms_norm.default] == 1
    gm, stats, _ = run_toy(_LlamaNorm(gemma=True), ["fuse_rmsnorm"])  # (1 + weight): a different op
    assert stats[0].num_matches == 0 and op_counts(gm)[aten.rsqrt.default] == 1


class _ResidualNorm(torch.nn.Module):
    def __init__(self, broadcast):
        super().__init__()
        self.norm = _LlamaNorm()
        self.bias = torch.nn.Parameter(torch.randn(16))
        self.broadcast = broadcast

    def forward(self, x, pos):
        s = x + (self.bias if self.broadcast else x * 0.5)
        return self.norm(s, pos) + s


@pytest.mark.parametrize("broadcast", [False, True])
def test_residual_fusion_needs_same_shape_operands(broadcast):
    gm, stats, _ = run_toy(_ResidualNorm(broadcast), ["fuse_rmsnorm"])
    counts = op_counts(gm)
    assert stats[0].num_matches == 1
    assert counts[mi.fused_add_rms_norm.default] == (0 if broadcast else 1)
    assert counts[mi.rms_norm.default] == (1 if broadcast else 0)


@pytest.mark.parametrize("name, norms", [("tiny-llama", 1 + 2 * L), ("tiny-gpt-oss", 0)])
def test_bf16_norm_rounding_decides_the_match(name, norms):
    """In bf16 Llama's norm casts the normalized row before the weight multiplies (rms_norm's rounding); GPT-OSS's
    multiplies the weight in fp32 and casts after, a different rounding: left (to fuse_gemma_rmsnorm)."""
    from mini_infer.compiler import compile_model
    from mini_infer.models.loader import load_model

    model = load_model(name, dtype="bf16", device="cpu").model
    cm = compile_model(model, passes=["cleanup", "fuse_rmsnorm"], device=torch.device("cpu"))
    (row,) = [s for s in cm.stats if s.name == "fuse_rmsnorm"]
    assert row.num_matches == norms
    assert op_counts(cm.graph_module)[aten.rsqrt.default] == 1 + 2 * L - norms
