"""FuseQKRotary: per layer, apply_rotary(q) + apply_rotary(k) (+ Qwen3's q_norm / k_norm rms_norms) → one qk_rotary.

On every tiny preset: after its prerequisites (fuse_rmsnorm, fuse_rotary) and in the recommended pipeline, one
qk_rotary per layer (DeepSeek: none, its MLA rotary is not this pattern), the head norms taken in for Qwen3, the
rotary and head-norm launches per layer down from 2 (4 with norms) to 1, logits equal eager HF (reference kernels,
and the Triton kernels under the interpreter). Without fuse_rmsnorm the norms stay as they were. Toys: norms with
different eps, one norm only, a norm with another reader, cos/sin with a head dimension.
"""

import functools

import pytest
import torch
from hypothesis import given

from mini_infer.passes import PassContext, recommended_passes
from mini_infer.passes.manager import write_graph
from tests.passes.helpers import (
    ARCHS,
    CPU,
    FEW,
    NUM_LAYERS,
    assert_logits_close,
    bound_copy,
    check_against_eager,
    eager_logits,
    full_pipeline,
    graph_logits,
    loaded,
    mi,
    num_tokens,
    op_counts,
    positions,
    random_ids,
    run_passes,
    run_toy,
    start_pos,
)

L = NUM_LAYERS
PREREQUISITES = ["fuse_rmsnorm", "fuse_rotary"]
# name -> (qk_rotary nodes, of which with q/k norms taken in)
EXPECTED = {name: (L, 0) for name in ARCHS}
EXPECTED["tiny-qwen3"] = EXPECTED["tiny-qwen3-moe"] = (L, L)  # q_norm and k_norm on head_dim
EXPECTED["tiny-deepseek-v2"] = EXPECTED["tiny-deepseek-v3"] = (0, 0)  # MLA, interleaved rotary: not this pattern
# the kernels this pass is about: rotary and (head) norms
LAUNCH_OPS = (mi.apply_rotary.default, mi.apply_rotary_interleaved.default, mi.qk_rotary.default,
              mi.rms_norm.default)


def _launches(gm) -> int:
    counts = op_counts(gm)
    return sum(counts[op] for op in LAUNCH_OPS)


@functools.cache
def with_prerequisites(name: str, fuse: bool = True):
    return run_passes(name, [*PREREQUISITES, *(["fuse_qk_rotary"] if fuse else [])])


def _check_graph(name, gm, row):
    fused, normed = EXPECTED[name]
    counts = op_counts(gm)
    assert row.num_matches == fused
    assert row.note == (f"{fused} layers ({normed} with q/k norms)" if fused else "")
    assert counts[mi.qk_rotary.default] == fused
    if fused:
        assert counts[mi.apply_rotary.default] == 0  # every q/k rotary went into a qk_rotary
    eps = loaded(name).config.rms_norm_eps
    for node in gm.graph.nodes:
        if node.target is mi.qk_rotary.default:
            q_w, k_w, node_eps = node.args[4:]
            assert all((w is not None and w.op == "get_attr") == bool(normed) for w in (q_w, k_w))
            assert node_eps == (eps if normed else 0.0)


@pytest.mark.parametrize("name", ARCHS)
def test_after_prerequisites(name):
    gm, ctx, stats = with_prerequisites(name)
    _check_graph(name, gm, stats[-1])
    before, _, _ = with_prerequisites(name, fuse=False)
    fused, normed = EXPECTED[name]
    # per fused layer: two rotary launches become one, and the two head norms go into it
    assert _launches(gm) == _launches(before) - fused - 2 * normed
    assert op_counts(gm)[mi.rms_norm.default] == op_counts(before)[mi.rms_norm.default] - 2 * normed


@pytest.mark.parametrize("name", ARCHS)
@given(num=num_tokens, start=start_pos)
@FEW
def test_logits_equal_eager(name, num, start):
    gm, ctx, _ = with_prerequisites(name)
    check_against_eager(name, gm, ctx, num, start, seed=num * 5 + start)


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-llama"])
def test_without_fuse_rmsnorm_norms_stay(name):
    """Run after fuse_rotary alone: the rotaries pair up, the (unfused) HF norm sub-graphs stay as they were."""
    gm, ctx, stats = run_passes(name, ["fuse_rotary", "fuse_qk_rotary"])
    assert stats[-1].num_matches == L and stats[-1].note == f"{L} layers (0 with q/k norms)"
    assert op_counts(gm)[torch.ops.aten.rsqrt.default] == 2 * L + 1 + (2 * L if name == "tiny-qwen3" else 0)
    check_against_eager(name, gm, ctx, 7, 11, seed=3)


@pytest.mark.parametrize("name", ARCHS)
def test_in_full_pipeline(name, tmp_path):
    gm, ctx, stats = full_pipeline(name)
    names = [s.name for s in stats]
    assert names[names.index("fuse_rotary") + 1] == "fuse_qk_rotary"
    _check_graph(name, gm, stats[names.index("fuse_qk_rotary")])
    check_against_eager(name, gm, ctx, 9, 5, seed=1)
    check_against_eager(name, gm, ctx, 1, 30, seed=2)  # one row: a decode step
    if EXPECTED[name][0]:
        write_graph(gm, tmp_path / "after.txt")
        dump = (tmp_path / "after.txt").read_text()
        assert "torch.ops.mini_infer.qk_rotary.default(" in dump and "q_rot" in dump and "k_rot" in dump


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-llama"])
def test_triton_kernels_in_the_graph(name):
    """The recommended pipeline's graph bound to the Triton launchers (the interpreter here) gives eager HF's logits
    for a prefill and a one-row step: the one-launch kernel on the graph's real layouts (views of the merged qkv)."""
    gm, ctx, _ = full_pipeline(name)
    bound, names = bound_copy(gm, "triton")
    assert "qk_rotary_triton" in names and "apply_rotary_triton" not in names
    for num, start in ((6, 0), (1, 17)):
        ids, pos = random_ids(num, num), positions(start, num)
        assert_logits_close(graph_logits(bound, ctx, ids, pos, logits_indices=torch.arange(num)),
                            eager_logits(name, ids, pos))


def test_in_recommended_pipeline():
    ctx = PassContext(config=loaded("tiny-qwen3").config, device=CPU, dtype=torch.float32)
    names = [p.name for p in recommended_passes(ctx)]
    assert names.index("fuse_rmsnorm") < names.index("fuse_rotary") < names.index("fuse_qk_rotary")
    assert names.index("fuse_qk_rotary") < names.index("paged_attention")


class _Attention(torch.nn.Module):
    """One HF-style attention on the toy's [1, T, 16] hidden states: q/k/v projections viewed as heads, optional
    Qwen3 head norms (eps per norm; `reread_q_norm` adds a second reader of the normed q), HF's rotary and repeat_kv,
    SDPA, o_proj. `head_cos` gives cos/sin one row per head (needs as many k heads as q heads)."""

    def __init__(self, norms=(True, True), eps=(1e-6, 1e-6), heads=(4, 2), d=8, reread_q_norm=False, head_cos=False):
        super().__init__()
        from transformers.models.qwen3 import modeling_qwen3 as qwen3

        self.hf = qwen3
        self.hq, self.hk, self.d = *heads, d
        self.q_proj = torch.nn.Linear(16, self.hq * d, bias=False)
        self.k_proj = torch.nn.Linear(16, self.hk * d, bias=False)
        self.v_proj = torch.nn.Linear(16, self.hk * d, bias=False)
        self.o_proj = torch.nn.Linear(self.hq * d, 16, bias=False)
        self.q_norm = qwen3.Qwen3RMSNorm(d, eps[0]) if norms[0] else None
        self.k_norm = qwen3.Qwen3RMSNorm(d, eps[1]) if norms[1] else None
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                torch.nn.init.normal_(norm.weight, 1.0, 0.3)
        self.inv_freq = torch.nn.Buffer(1.0 / 10000 ** (torch.arange(0, d, 2).float() / d), persistent=False)
        self.reread_q_norm, self.head_cos = reread_q_norm, head_cos

    def forward(self, x, pos):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.hq, self.d)
        k = self.k_proj(x).view(b, t, self.hk, self.d)
        v = self.v_proj(x).view(b, t, self.hk, self.d).transpose(1, 2)
        q = (self.q_norm(q) if self.q_norm is not None else q).transpose(1, 2)
        k = (self.k_norm(k) if self.k_norm is not None else k).transpose(1, 2)
        freqs = pos[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), -1)
        cos, sin = emb.cos(), emb.sin()
        if self.head_cos:  # [B, H, T, D] angles, unsqueeze_dim 1 gives [B, 1, H, T, D]: broadcast by hand instead
            cos, sin = cos[:, None].expand(b, self.hq, t, self.d), sin[:, None].expand(b, self.hq, t, self.d)
            q_rot = q * cos + self.hf.rotate_half(q) * sin
            k_rot = k * cos + self.hf.rotate_half(k) * sin
        else:
            q_rot, k_rot = self.hf.apply_rotary_pos_emb(q, k, cos, sin)
        k_rot, v = self.hf.repeat_kv(k_rot, self.hq // self.hk), self.hf.repeat_kv(v, self.hq // self.hk)
        out = torch.nn.functional.scaled_dot_product_attention(q_rot, k_rot, v, is_causal=True)
        out = self.o_proj(out.transpose(1, 2).reshape(b, t, -1))
        return out + q.mean() if self.reread_q_norm else out


def _toy(**kwargs):
    gm, stats, _ = run_toy(_Attention(**kwargs), [*PREREQUISITES, "fuse_qk_rotary"])
    (node,) = [n for n in gm.graph.nodes if n.target is mi.qk_rotary.default] or [None]
    return stats[-1], node, op_counts(gm)


@pytest.mark.parametrize("heads", [(4, 2), (4, 1), (2, 2)])
def test_toy_qwen3_attention(heads):
    row, node, counts = _toy(heads=heads)
    assert row.num_matches == 1 and row.note == "1 layers (1 with q/k norms)"
    assert counts[mi.rms_norm.default] == 0 and counts[mi.apply_rotary.default] == 0
    assert node.args[4].op == "get_attr" and node.args[5].op == "get_attr" and node.args[6] == 1e-6


def test_toy_norms_with_different_eps_stay():
    row, node, counts = _toy(eps=(1e-6, 1e-5))
    assert row.num_matches == 1 and row.note == "1 layers (0 with q/k norms)"
    assert counts[mi.rms_norm.default] == 2 and node.args[4:] == (None, None, 0.0)


@pytest.mark.parametrize("norms", [(True, False), (False, True)])
def test_toy_one_norm(norms):
    row, node, counts = _toy(norms=norms)
    assert row.num_matches == 1 and counts[mi.rms_norm.default] == 0
    assert [w is not None for w in node.args[4:6]] == list(norms)


def test_toy_norm_with_another_reader_stays():
    row, node, counts = _toy(reread_q_norm=True)
    assert row.num_matches == 1 and counts[mi.rms_norm.default] == 1  # q's norm is read by the mean too
    assert node.args[4] is None and node.args[5] is not None


def test_toy_cos_with_heads_left_alone():
    row, node, counts = _toy(heads=(2, 2), head_cos=True)
    assert row.num_matches == 0 and node is None
    assert counts[mi.apply_rotary.default] == 2 and counts[mi.rms_norm.default] == 2
