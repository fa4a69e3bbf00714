"""Attention sinks (GPT-OSS's `s_aux`) end to end: capture → cleanup → paged_attention on a tiny GPT-OSS (sliding
and full layers, GQA 4/2, MoE left as captured graph nodes), and the fusions that re-emit the paged attention node.

GPT-OSS: its class has no SDPA path, so each attention is captured as one `mini_infer.attention` node carrying the
layer's sinks parameter (random non-zero values here: the initializer may leave them at zero); the paged_attention
pass hands that node to `paged_attention` as its last argument, after (None) scales. Logits equal eager HF for one
sequence past the 8-token window, for two sequences prefilled then decoded over NaN-filled paged caches (references,
and the Triton kernels under the interpreter), and disagree with eager once the sinks are zeroed. The long-run
route's query-row count is declared for it as for a model without sinks (the route applies them).

Fusions (on tiny-qwen3's graph, whose qk_rotary with head norms they match): with sinks put on its paged_attention
nodes, fuse_rotary_attention carries them to `rotary_paged_attention` and
fuse_kv_write to `paged_attention_cached`, and each fused graph gives the logits of the unfused graph with the same
sinks bit for bit (references; Triton kernels under the interpreter, the rotary inside the decode launch). And on
GPT-OSS's own graph (fuse_rotary takes its rotation on chunked halves, fuse_qk_rotary pairs it): each fusion takes
every layer with its sinks, and the logits equal eager HF.
"""

import dataclasses
import functools

import pytest
import torch

from mini_infer.contract.inputs import UNCAPTURED_QUERY_ROWS
from mini_infer.passes import PassContext, resolve_passes
from mini_infer.passes.capture import capture
from mini_infer.passes.manager import PassManager
from tests.ops.helpers import record_kernel_launches
from tests.passes.helpers import (
    CPU,
    NUM_LAYERS,
    VOCAB,
    _cleaned,
    assert_logits_close,
    bound_copy,
    copy_gm,
    graph_logits,
    loaded,
    mi,
    op_counts,
    positions,
    prefill_then_decode,
    random_ids,
    run_passes,
)
from tests.passes.test_fuse_kv_write import PREREQUISITES

L = NUM_LAYERS
WINDOW = 8
HQ = 4


@functools.cache
def gpt_oss() -> torch.nn.Module:
    """A tiny GPT-OSS (fp32, CPU, random weights) whose sinks are normal(0, 1), per layer and head."""
    from transformers import AutoConfig

    from mini_infer.models.loader import build_random_model

    config = AutoConfig.for_model(
        "gpt_oss", vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=L,
        num_attention_heads=HQ, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=WINDOW, max_position_embeddings=1024, torch_dtype="float32",
        layer_types=["sliding_attention", "full_attention"])
    model = build_random_model(config, torch.float32, CPU, seed=0)
    gen = torch.Generator().manual_seed(1)
    for layer in model.model.layers:
        layer.self_attn.sinks.copy_(torch.randn(HQ, generator=gen))
    return model


def context(model: torch.nn.Module, device: torch.device = CPU) -> PassContext:
    return PassContext(config=model.config, device=device, dtype=torch.float32)


@functools.cache
def captured() -> torch.fx.GraphModule:
    return capture(gpt_oss())


@functools.cache
def paged(device_type: str = "cpu"):
    """(graph, context, stats) of capture → cleanup → paged_attention (`device_type`: the pass context's target)."""
    gm = copy_gm(captured())
    ctx = context(gpt_oss(), torch.device(device_type))
    stats = PassManager(resolve_passes(["cleanup", "paged_attention"])).run(gm, ctx)
    return gm, ctx, stats


def eager(ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return gpt_oss()(input_ids=ids, position_ids=pos, use_cache=False).logits


def test_capture_carries_each_layers_sinks():
    nodes = [n for n in captured().graph.nodes if n.target is mi.attention.default]
    assert [n.args[3:6] for n in nodes] == [(16 ** -0.5, 0.0, WINDOW), (16 ** -0.5, 0.0, 0)]
    params = dict(captured().named_parameters())
    for i, n in enumerate(nodes):
        assert n.args[6].op == "get_attr" and n.args[6].target.endswith(f"layers.{i}.self_attn.sinks")
        assert params[n.args[6].target] is gpt_oss().model.layers[i].self_attn.sinks


def test_paged_attention_takes_the_sinks_last():
    gm, ctx, stats = paged()
    assert stats[-1].num_matches == L and "attention sinks in 2" in stats[-1].note
    nodes = [n for n in gm.graph.nodes if n.target is mi.paged_attention.default]
    assert op_counts(gm)[mi.attention.default] == 0 and len(nodes) == L
    for i, n in enumerate(nodes):  # (..., scale, window, softcap, k_scale, v_scale, sinks)
        assert n.args[10:14] == ((WINDOW, 0)[i], 0.0, None, None)
        assert n.args[14].op == "get_attr" and n.args[14].target.endswith(f"layers.{i}.self_attn.sinks")
    assert [s.attention_window for s in ctx.cache_specs] == [WINDOW, None]


def test_route_rows_declared_with_sinks():
    """On CUDA the pass declares the long-run route's row count (steps with such runs run uncaptured) for a graph
    whose layers have sinks as for one without: the route applies them (its full-attention layers take it)."""
    _, ctx, _ = paged("cuda")
    llama = PassContext(config=loaded("tiny-llama").config, device=torch.device("cuda"), dtype=torch.float32,
                        applied=["cleanup"])  # a model without sinks
    PassManager(resolve_passes(["paged_attention"])).run(copy_gm(_cleaned("tiny-llama")), llama)
    assert ctx.info[UNCAPTURED_QUERY_ROWS] == llama.info[UNCAPTURED_QUERY_ROWS] > 0


@pytest.mark.parametrize("num,start", [(20, 5), (1, 30), (13, 0)])
def test_logits_equal_eager(num, start):
    gm, ctx, _ = paged()
    ids, pos = random_ids(num, seed=num + start), positions(start, num)
    assert_logits_close(graph_logits(gm, ctx, ids, pos), eager(ids, pos))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_prefill_then_decode_equals_eager(backend):
    """Two prompts (11 and 6 tokens: past the window) prefilled into NaN-filled paged caches, then a decode step of
    each over them; the graph bound to the torch references or to the Triton kernels (interpreter)."""
    gm, ctx, _ = paged()
    bound, names = bound_copy(gm, backend)
    assert f"paged_attention_{backend}_entry" in names
    prefilled, decoded, seqs = prefill_then_decode(bound, ctx)
    for i, (ids, pos) in enumerate(seqs):
        want = eager(ids, pos)
        assert_logits_close(prefilled[:, i], want[:, -2])
        assert_logits_close(decoded[:, i], want[:, -1])


def test_sinks_matter():
    """With a layer's sinks zeroed in a copy of the graph's parameters the logits no longer match eager."""
    gm, ctx, _ = paged()
    zeroed = copy_gm(gm)
    node = next(n for n in zeroed.graph.nodes if n.target is mi.paged_attention.default).args[14]
    zeroed.register_buffer("zero_sinks", torch.zeros(HQ))
    node.target = "zero_sinks"
    zeroed.recompile()
    ids, pos = random_ids(12, seed=3), positions(2, 12)
    assert_logits_close(graph_logits(gm, ctx, ids, pos), eager(ids, pos))
    with pytest.raises(AssertionError, match="max \\|logits - eager\\|"):
        assert_logits_close(graph_logits(zeroed, ctx, ids, pos), eager(ids, pos))


# -- the fusions that re-emit the paged attention node -------------------------------------------------------


def with_sinks(gm: torch.fx.GraphModule, seed: int = 0) -> list[torch.fx.Node]:
    """Give every paged_attention node of `gm` sinks (normal(0, 2), one a query head) as its last argument, after
    (None) scales, as the paged_attention pass emits a captured node's sinks; returns the sinks nodes."""
    gen = torch.Generator().manual_seed(seed)
    added = []
    for i, attn in enumerate(n for n in list(gm.graph.nodes) if n.target is mi.paged_attention.default):
        hq = attn.args[0].meta["val"].shape[1]
        node = PassContext.add_tensor(gm, f"sinks_{i}", torch.randn(hq, generator=gen) * 2, attn)
        attn.args = (*attn.args[:12], *(attn.args[12:14] or (None, None)), node)
        added.append(node)
    gm.recompile()
    return added


@functools.cache
def qwen3_with_sinks():
    """tiny-qwen3 after fuse_kv_write's / fuse_rotary_attention's prerequisites, its attentions given sinks."""
    gm, ctx, _ = run_passes("tiny-qwen3", PREREQUISITES)
    return gm, ctx, with_sinks(gm)


def fused(pass_name: str):
    base, ctx, sinks = qwen3_with_sinks()
    gm = copy_gm(base)
    ctx = dataclasses.replace(ctx, applied=list(ctx.applied))
    stats = PassManager(resolve_passes([pass_name])).run(gm, ctx)
    return gm, ctx, stats[0]


# pass -> (the op it emits in the attention's place, where that op takes the sinks)
FUSIONS = {"fuse_rotary_attention": (mi.rotary_paged_attention.default, 19),
           "fuse_kv_write": (mi.paged_attention_cached.default, 11)}


@pytest.mark.parametrize("pass_name", list(FUSIONS))
def test_fusion_carries_the_sinks(pass_name):
    gm, _, row = fused(pass_name)
    op, at = FUSIONS[pass_name]
    nodes = [n for n in gm.graph.nodes if n.target is op]
    assert row.num_matches == L and len(nodes) == L and op_counts(gm)[mi.paged_attention.default] == 0
    assert [n.args[at].target for n in nodes] == [s.target for s in qwen3_with_sinks()[2]]
    assert len(nodes[0].args) == at + 1 and nodes[0].args[at - 2 : at] == (None, None)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("pass_name", list(FUSIONS))
def test_fused_graph_is_the_unfused_graph_with_sinks_bitwise(monkeypatch, pass_name, backend):
    """A prefill of two prompts and a decode step over their keys: the fused graph's logits are the unfused
    graph's (with the same sinks) bit for bit; with the Triton kernels the decode launch applies the rotary itself
    (the one-kernel path allowed at every group here), and the sinks change the logits."""
    from mini_infer.ops import paged_attention as pa
    from mini_infer.ops import rotary_paged_attention as rpa

    monkeypatch.setattr(rpa, "ROTARY_MAX_GROUP", 64)
    gm, ctx, _ = fused(pass_name)
    base = qwen3_with_sinks()[0]
    launches = record_kernel_launches(monkeypatch, pa, "_paged_attn_kernel", arguments=True)
    got = prefill_then_decode(bound_copy(gm, backend)[0], ctx)[:2]
    want = prefill_then_decode(bound_copy(base, backend)[0], ctx)[:2]
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    if backend == "triton":  # every attention launch took its layer's sinks; the fused decode step in one launch
        assert launches and all(kw["USE_SINKS"] for _, kw in launches)
        assert any(kw["ROTARY"] for _, kw in launches) == (pass_name == "fuse_rotary_attention")
    if backend == "reference" and pass_name == "fuse_kv_write":  # the sinks matter in this graph
        plain, plain_ctx, _ = run_passes("tiny-qwen3", PREREQUISITES)
        without = prefill_then_decode(plain, plain_ctx)[1]
        assert not torch.allclose(without, want[1], atol=1e-3)


@pytest.mark.parametrize("pass_name,backend", [("fuse_rotary_attention", "reference"),
                                               ("fuse_rotary_attention", "triton"), ("fuse_kv_write", "reference")])
def test_gpt_oss_fused_equals_eager(monkeypatch, pass_name, backend):
    """GPT-OSS's own graph through fuse_rotary (its rotation on chunked halves), fuse_qk_rotary, paged_attention and
    a fusion: every layer fused, its sinks carried, and a prefill then a decode step equal eager HF (with the
    Triton kernels the decode launch applies the rotary and the sinks itself)."""
    from mini_infer.ops import paged_attention as pa
    from mini_infer.ops import rotary_paged_attention as rpa

    monkeypatch.setattr(rpa, "ROTARY_MAX_GROUP", 64)
    gm, ctx = copy_gm(captured()), context(gpt_oss())
    stats = PassManager(resolve_passes(["cleanup", "fuse_rotary", "fuse_qk_rotary", "paged_attention",
                                        pass_name])).run(gm, ctx)
    assert [s.num_matches for s in stats[2:]] == [L, L, L]
    op, at = FUSIONS[pass_name]
    assert all(n.args[at].op == "get_attr" for n in gm.graph.nodes if n.target is op)
    launches = record_kernel_launches(monkeypatch, pa, "_paged_attn_kernel", arguments=True)
    prefilled, decoded, seqs = prefill_then_decode(bound_copy(gm, backend)[0], ctx)
    for i, (ids, pos) in enumerate(seqs):
        want = eager(ids, pos)
        assert_logits_close(prefilled[:, i], want[:, -2])
        assert_logits_close(decoded[:, i], want[:, -1])
    if backend == "triton":
        assert any(kw["ROTARY"] and kw["USE_SINKS"] for _, kw in launches)
