"""RouteMoe on GPT-OSS: GptOssMLP (router linear with bias -> top-k -> softmax of the k values; GptOssExperts with
transposed, gate/up-interleaved weights, expert biases and a clamped SwiGLU) -> moe_topk + fused_moe.

A tiny GPT-OSS built here from its config (not a preset), its expert biases random and large enough that both
SwiGLU clamps bite: the graph (one match per layer, HF's routing and grouped-mm nodes gone, the routing and
activation arguments, the experts re-laid into fused_moe's layout with HF's originals dropped and the same weight
bytes), logits against the captured graph without the pass and against eager HF (fp32, a config variant with
other SwiGLU constants and top-3, bf16 through aten._grouped_mm, the graph bound to the Triton kernels under the
interpreter), and the refusals (expert parallelism, SwiGLU constants, a router or experts that are not
GPT-OSS's). The model keeps its random attention sinks (capture passes them to the attention op).
"""

from __future__ import annotations

import copy
import functools
from contextlib import ExitStack
from unittest import mock

import pytest
import torch
import torch.fx as fx

from mini_infer.compiler import compile_model, logits_tolerance
from mini_infer.passes import PassContext, resolve_passes
from mini_infer.passes.capture import capture
from mini_infer.passes.manager import PassError, PassManager
from mini_infer.passes.pattern import module_chain
from mini_infer.passes.route_moe import RouteMoe
from tests.passes.helpers import (
    CPU,
    assert_logits_close,
    aten,
    bound_copy,
    copy_gm,
    graph_logits,
    mi,
    op_counts,
    positions,
    random_ids,
    run_graph,
)

CONFIG = dict(vocab_size=512, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
              max_position_embeddings=1024, layer_types=["sliding_attention", "full_attention"])
HF_ROUTING_OPS = (aten.topk.default, aten.sort.default, aten.histc.default, aten._grouped_mm.default)
CASES = ((1, 0), (19, 40), (13, 3))  # (tokens, first position): decode-sized, past the sliding window, prefill


def _config(**fields):
    from transformers import AutoConfig

    return AutoConfig.for_model("gpt_oss", **{**CONFIG, **fields, "torch_dtype": "float32"})


def _model(dtype=torch.float32, seed=0, **fields):
    """The tiny GPT-OSS with random router and expert biases (gate/up std 4: both clamps bite) and sinks."""
    from mini_infer.models.loader import build_random_model

    model = build_random_model(_config(**fields), dtype, CPU, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for layer in model.model.layers:
            experts = layer.mlp.experts
            experts.gate_up_proj_bias.copy_(torch.randn(experts.gate_up_proj_bias.shape, generator=g) * 4)
            experts.down_proj_bias.copy_(torch.randn(experts.down_proj_bias.shape, generator=g) * 0.5)
            layer.mlp.router.bias.copy_(torch.randn(layer.mlp.router.bias.shape, generator=g))
            layer.self_attn.sinks.copy_(torch.randn(layer.self_attn.sinks.shape, generator=g))
    return model


def _compile(model, passes):
    return compile_model(model, passes=list(passes), device=CPU)


@functools.cache
def _base():
    """(model, cleaned graph, its context): the fp32 model, captured once for the file."""
    model = _model()
    gm = capture(model)
    ctx = PassContext(config=model.config, device=CPU, dtype=torch.float32)
    PassManager(resolve_passes(["cleanup"])).run(gm, ctx)
    return model, gm, ctx


def _routed():
    """A copy of the cleaned graph with route_moe applied: (graph, context, the pass's stats row)."""
    model, gm, _ = _base()
    gm = copy_gm(gm)
    ctx = PassContext(config=model.config, device=CPU, dtype=torch.float32, applied=["cleanup"])
    (row,) = PassManager([RouteMoe()]).run(gm, ctx)
    return gm, ctx, row


def _eager(model, ids, pos, record=None):
    """HF's logits; `record` collects the inputs of GptOssExperts' activation (gate/up rows)."""
    with torch.no_grad(), ExitStack() as stack:
        for layer in model.model.layers if record is not None else ():
            apply = layer.mlp.experts._apply_gate
            stack.enter_context(mock.patch.object(layer.mlp.experts, "_apply_gate",
                                                  lambda gate_up, f=apply: record.append(gate_up) or f(gate_up)))
        return model(input_ids=ids, position_ids=pos, use_cache=False).logits


# -- the graph ------------------------------------------------------------------------------------------------


def test_graph_routing_activation_and_relaid_experts():
    model, plain, _ = _base()
    gm, ctx, row = _routed()
    counts = op_counts(gm)
    assert row.num_matches == counts[mi.moe_topk.default] == counts[mi.fused_moe.default] == 2
    assert not any(counts[op] for op in HF_ROUTING_OPS)
    assert not [n for n in gm.graph.nodes if "grouped_mm" in str(n.target)]
    assert not [n for n in gm.graph.nodes if any(c in ("GptOssExperts",) for _, c in module_chain(n))]
    assert row.note.startswith("2 MoE blocks (GptOssMLP x2): 4 experts, top-2 softmax, renormalized")
    assert "swigluoai alpha=1.702 limit=7" in row.note
    attrs = dict(gm.named_parameters()) | dict(gm.named_buffers())
    topks = [n for n in gm.graph.nodes if n.target is mi.moe_topk.default]
    fused = [n for n in gm.graph.nodes if n.target is mi.fused_moe.default]
    for layer, topk, moe in zip(model.model.layers, topks, fused):
        assert tuple(topk.args[1:]) == (2, "softmax", True, 1.0, 1, 1, None, None)  # fp32: weights in fp32
        assert topk.args[0].target is aten.linear.default and len(topk.args[0].args) == 3  # the router with bias
        assert moe.args[5:7] == ("swigluoai", None) and moe.args[9:] == (1.702, 7.0)
        experts = layer.mlp.experts
        w13, w2, b13, b2 = (attrs[moe.args[i].target] for i in (3, 4, 7, 8))
        gate_up, bias = experts.gate_up_proj, experts.gate_up_proj_bias  # gate = [..., ::2], up = [..., 1::2]
        assert w13.is_contiguous() and w2.is_contiguous() and b13.is_contiguous()
        assert torch.equal(w13, torch.cat([gate_up[..., ::2], gate_up[..., 1::2]], 2).transpose(1, 2))
        assert torch.equal(w2, experts.down_proj.transpose(1, 2))
        assert torch.equal(b13, torch.cat([bias[:, ::2], bias[:, 1::2]], 1))
        assert b2 is experts.down_proj_bias  # contiguous: taken as it is
    names = list(attrs)
    assert not [n for n in names if n.endswith(("experts.gate_up_proj", "experts.down_proj",
                                                "experts.gate_up_proj_bias"))]  # HF's originals dropped
    before = sum(t.numel() * t.element_size() for n, t in plain.named_parameters() if "experts" in n)
    after = sum(t.numel() * t.element_size() for n, t in attrs.items() if "experts" in n)
    assert before == after  # one copy of each expert tensor


def test_weight_bytes_are_the_captured_graphs():
    model = _base()[0]
    assert _compile(model, ["cleanup", "route_moe"]).weight_bytes == _compile(model, ["cleanup"]).weight_bytes


# -- logits ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("num", "start"), CASES)
def test_logits_equal_the_captured_graph_and_eager(num, start):
    model, plain, plain_ctx = _base()
    gm, ctx, _ = _routed()
    ids, pos = random_ids(num, seed=num + start), positions(start, num)
    got = graph_logits(gm, ctx, ids, pos)
    assert_logits_close(got, graph_logits(plain, plain_ctx, ids, pos))
    gate_up = []
    assert_logits_close(got, _eager(model, ids, pos, record=gate_up))
    gate_up = torch.cat(gate_up)
    limit = model.model.layers[0].mlp.experts.limit  # (the config's swiglu_limit; transformers 5.17 hard-codes 7)
    assert (gate_up[:, ::2] > limit).any() and (gate_up[:, 1::2].abs() > limit).any()  # both clamps bite


def test_config_variant_equals_eager():
    """Other SwiGLU constants (read from the config, checked against the graph) and top-3 of 4 experts."""
    model = _model(seed=3, swiglu_limit=2.5, swiglu_alpha=1.25, num_experts_per_tok=3)
    if model.model.layers[0].mlp.experts.limit != 2.5:
        pytest.skip("this transformers hard-codes GptOssExperts' constants (5.17: alpha 1.702, limit 7)")
    cm = _compile(model, ["cleanup", "route_moe"])
    (fused,) = {tuple(n.args[5:6] + n.args[9:]) for n in cm.graph_module.graph.nodes
                if n.meta.get("op") is mi.fused_moe.default}
    assert fused == ("swigluoai", 1.25, 2.5)
    for num, start in CASES[1:]:
        ids, pos = random_ids(num, seed=num), positions(start, num)
        assert_logits_close(cm(**cm.example_inputs(ids, pos)), _eager(model, ids, pos))


def test_bf16_grouped_mm_capture():
    """In bf16 transformers captures the experts as aten._grouped_mm: matched alike; the routing weights rounded to
    bf16 as HF's router rounds them."""
    model = _model(torch.bfloat16)
    assert any(n.target is aten._grouped_mm.default for n in _compile(model, ["cleanup"]).graph_module.graph.nodes)
    cm = _compile(model, ["cleanup", "route_moe"])
    topks = [n for n in cm.graph_module.graph.nodes if n.meta.get("op") is mi.moe_topk.default]
    assert len(topks) == 2 and all(n.args[8] == torch.bfloat16 for n in topks)
    ids, pos = random_ids(21, 2), positions(30, 21)
    ref = _eager(model, ids, pos).float()
    err = (cm(**cm.example_inputs(ids, pos)).float() - ref).abs().max().item()
    assert err <= logits_tolerance(torch.bfloat16, ref.abs().max().item())


def test_triton_kernels_in_the_graph():
    """The graph bound to the Triton launchers (the interpreter here) gives the reference-bound graph's logits."""
    gm, ctx, _ = _routed()
    outs = {}
    for num, start in ((1, 5), (9, 3)):  # 2 pairs: the decode GEMVs; 18 pairs: the grouped GEMMs
        ids, pos = random_ids(num, 4), positions(start, num)
        for backend in ("reference", "triton"):
            bound, names = bound_copy(gm, backend)
            assert f"moe_topk_{backend}" in names and f"fused_moe_{backend}" in names
            outs[backend] = run_graph(bound, ctx.example_inputs(ids, pos))
        assert_logits_close(outs["triton"], outs["reference"])


# -- refusals -------------------------------------------------------------------------------------------------


def _node(gm: fx.GraphModule, pred) -> fx.Node:
    return next(n for n in gm.graph.nodes if pred(n))


def _drop_plus_one(gm):  # (up + 1) -> up
    add = _node(gm, lambda n: n.target is aten.add.Tensor and n.args[1] == 1 and "experts" in str(module_chain(n)))
    add.replace_all_uses_with(add.args[0])
    gm.graph.erase_node(add)


def _softmax_over_all_logits(gm):  # softmax(top-k values) -> softmax(logits): another family's order
    softmax = _node(gm, lambda n: n.target is aten.softmax.int)
    softmax.args = (softmax.args[0].args[0].args[0], *softmax.args[1:])


def _drop_down_bias(gm):  # down GEMM + down_proj_bias -> the down GEMM alone
    add = _node(gm, lambda n: n.target is aten.add_.Tensor and "down_proj_bias" in str(n.args[1].args[0].target))
    add.replace_all_uses_with(add.args[0])
    gm.graph.erase_node(add)


REFUSALS = [
    ("no_plus_one", _drop_plus_one, {}, r"activation has no up \+ 1"),
    ("softmax_first", _softmax_over_all_logits, {}, "the router's softmax reads linear"),
    ("no_down_bias", _drop_down_bias, {}, "down_proj_bias.*is not added to the output"),
    ("other_limit", None, {"swiglu_limit": 5.0}, r"no gate clamp to <= 5.0"),
    ("other_alpha", None, {"swiglu_alpha": 1.0}, r"no gate \* 1.0"),
    ("zero_limit", None, {"swiglu_limit": 0.0}, r"config.swiglu_limit=0.0; expected > 0"),
]


@pytest.mark.parametrize(("edit", "fields", "message"), [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_not_gpt_oss_is_refused(edit, fields, message):
    model, gm, _ = _base()
    gm = copy_gm(gm)
    if edit is not None:
        edit(gm)
    config = copy.deepcopy(model.config)
    for k, v in fields.items():
        setattr(config, k, v)
    ctx = PassContext(config=config, device=CPU, dtype=torch.float32, applied=["cleanup"])
    with pytest.raises(PassError, match=message):
        PassManager([RouteMoe()]).run(gm, ctx)
