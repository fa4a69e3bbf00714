"""FuseRotary: `x * cos + rotate_half(x) * sin`, or the same rotation on chunked halves (GPT-OSS), →
mini_infer.apply_rotary, once for q and once for k per layer. DeepSeek's HF code applies rotary in its interleaved
form (no rotate_half): documented as not matched, so 0 there, and the graph must still be exact.
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
EXPECTED = {name: 2 * L for name in ARCHS}  # q and k of every layer
EXPECTED["tiny-deepseek-v2"] = EXPECTED["tiny-deepseek-v3"] = 0  # interleaved rotary: not this pattern


def _check_counts(name, gm, num_matches):
    counts = op_counts(gm)
    assert num_matches == EXPECTED[name]
    # in the full pipeline fuse_qk_rotary puts each layer's q and k rotaries into one qk_rotary
    assert counts[mi.apply_rotary.default] + 2 * counts[mi.qk_rotary.default] == EXPECTED[name]
    if EXPECTED[name]:
        assert counts[aten.neg.default] == 0  # every rotate_half went with its match


@pytest.mark.parametrize("name", ARCHS)
def test_counts(name):
    gm, ctx, stats = single_pass(name, "fuse_rotary")
    _check_counts(name, gm, stats[0].num_matches)


@pytest.mark.parametrize("name", ARCHS)
@given(num=num_tokens, start=start_pos)
@FEW
def test_logits_equal_eager(name, num, start):
    gm, ctx, _ = single_pass(name, "fuse_rotary")
    check_against_eager(name, gm, ctx, num, start, seed=num * 7 + start)


@pytest.mark.parametrize("name", ARCHS)
def test_counts_in_full_pipeline(name):
    gm, ctx, stats = full_pipeline(name)
    (row,) = [s for s in stats if s.name == "fuse_rotary"]
    _check_counts(name, gm, row.num_matches)


class _Rotary(torch.nn.Module):
    """q/k-like [1, H, T, D] tensors rotated HF-style; `swap` uses the wrong halves (not rotate_half)."""

    def __init__(self, swap=False, d=8):
        super().__init__()
        self.swap = swap
        self.d = d
        self.inv_freq = torch.nn.Buffer(1.0 / 10000 ** (torch.arange(0, d, 2).float() / d), persistent=False)

    def forward(self, x, pos):
        freqs = pos[..., None].float() * self.inv_freq  # [1, T, d/2]
        emb = torch.cat((freqs, freqs), -1)
        cos, sin = emb.cos()[:, None], emb.sin()[:, None]
        h = x.view(1, x.shape[1], 2, self.d).transpose(1, 2)  # [1, 2, T, d]
        a, b = h[..., : self.d // 2], h[..., self.d // 2:]
        rot = torch.cat((-a, b), -1) if self.swap else torch.cat((-b, a), -1)
        out = h * cos + rot * sin
        return out.transpose(1, 2).reshape(x.shape)


@pytest.mark.parametrize("swap", [False, True])
def test_matches_rotate_half_only(swap):
    gm, stats, _ = run_toy(_Rotary(swap), ["fuse_rotary"])
    assert stats[0].num_matches == (0 if swap else 1)
    assert op_counts(gm)[mi.apply_rotary.default] == (0 if swap else 1)


class _HalvesRotary(torch.nn.Module):
    """GPT-OSS's form: cos / sin of half the head dim, x chunked into halves, cat([x1 c - x2 s, x2 c + x1 s]);
    `wrong` pairs the halves the other way round (x2 c - x1 s first), a different rotation."""

    def __init__(self, wrong=False, d=8):
        super().__init__()
        self.wrong = wrong
        self.d = d
        self.inv_freq = torch.nn.Buffer(1.0 / 10000 ** (torch.arange(0, d, 2).float() / d), persistent=False)

    def forward(self, x, pos):
        freqs = pos[..., None].float() * self.inv_freq  # [1, T, d/2]
        cos, sin = freqs.cos()[:, None], freqs.sin()[:, None]
        h = x.view(1, x.shape[1], 2, self.d).transpose(1, 2)  # [1, 2, T, d]
        x1, x2 = torch.chunk(h, 2, dim=-1)
        if self.wrong:
            x1, x2 = x2, x1
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return out.transpose(1, 2).reshape(x.shape)


@pytest.mark.parametrize("wrong", [False, True])
def test_matches_chunked_halves(wrong):
    gm, stats, _ = run_toy(_HalvesRotary(wrong), ["fuse_rotary"])  # (run_toy checks the logits against eager)
    assert stats[0].num_matches == (0 if wrong else 1)
    counts = op_counts(gm)
    assert counts[mi.apply_rotary.default] == (0 if wrong else 1)
    assert counts[aten.chunk.default] == (1 if wrong else 0)
