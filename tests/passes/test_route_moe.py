"""RouteMoe: HF MoE blocks → mini_infer.moe_topk + mini_infer.fused_moe.

Checked on the five tiny MoE presets (Mixtral; Qwen2-MoE with its gated shared expert; Qwen3-MoE; DeepSeek-V2 and
V3 with a dense first layer and shared experts, V3 with sigmoid + correction bias and grouped top-k): the graph
(one match per MoE layer, the routing arguments read from the config, HF's routing and grouped-mm nodes gone,
HF's stacked expert tensors taken as they are, the shared experts fused by the later passes), logits equal eager
HF alone and in the full pipeline, config variants (grouped DeepSeek-V2, scaled and unnormalized DeepSeek-V3,
renormalized Qwen2-MoE, non-contiguous expert weights), weight bytes and the summary's note, the Triton kernels
bound in the graph (interpreter), the refusals (config fields before capture and in the pass, unknown MoE
modules, a router or experts that are not HF's), and through the engine: greedy == HF with prefix caching and
chunked prefill. Routing itself (kernel == reference on exact and 1-ulp near-ties; reference == HF's routers) is
tests/ops/test_moe_topk.py's.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from hypothesis import given

import mini_infer.compiler as compiler
from mini_infer.compiler import compile_model
from mini_infer.passes import PassContext, recommended_passes
from mini_infer.passes.manager import PassError, PassManager
from mini_infer.passes.pattern import module_chain
from mini_infer.passes.route_moe import RouteMoe
from mini_infer.runtime.engine import EngineConfig, LLMEngine
from mini_infer.sampling_params import SamplingParams
from tests import _model_cache as mc
from tests.passes.helpers import (
    CPU,
    FEW,
    ToyLM,
    assert_logits_close,
    aten,
    bound_copy,
    check_against_eager,
    copy_gm,
    full_pipeline,
    loaded,
    mi,
    num_tokens,
    op_counts,
    position_tables,
    positions,
    random_ids,
    run_graph,
    run_passes,
    single_pass,
    start_pos,
    variant_model,
)
from tests.runtime.test_engine import assert_no_leak, hf_ref, random_prompts, record_schedules, run

# preset -> (MoE blocks, block class, moe_topk arguments after the logits: top_k, scoring, renormalize, scale,
# n_group, topk_group)
MOE = {
    "tiny-mixtral": (2, "MixtralSparseMoeBlock", (2, "softmax", True, 1.0, 1, 1)),
    "tiny-qwen2-moe": (2, "Qwen2MoeSparseMoeBlock", (2, "softmax", False, 1.0, 1, 1)),
    "tiny-qwen3-moe": (2, "Qwen3MoeSparseMoeBlock", (2, "softmax", True, 1.0, 1, 1)),
    "tiny-deepseek-v2": (1, "DeepseekV2Moe", (2, "softmax", False, 1.0, 1, 1)),  # first_k_dense_replace=1
    "tiny-deepseek-v3": (1, "DeepseekV3MoE", (2, "sigmoid", True, 1.0, 2, 1)),
}
NAMES = tuple(MOE)
HF_ROUTING_OPS = (aten.topk.default, aten.sort.default, aten.histc.default, aten._grouped_mm.default)


def _hf_layer(name: str, i: int):
    return loaded(name).model.model.layers[i]


def _moe_layers(name: str) -> list[int]:
    return [i for i in range(2) if hasattr(_hf_layer(name, i).mlp, "experts")]


# -- the graph ------------------------------------------------------------------------------------------------


def _check_graph(name, gm, num_matches, note):
    blocks, block_class, args = MOE[name]
    counts = op_counts(gm)
    assert num_matches == blocks == len(_moe_layers(name))
    assert counts[mi.moe_topk.default] == counts[mi.fused_moe.default] == blocks
    assert not any(counts[op] for op in HF_ROUTING_OPS)
    assert not [n for n in gm.graph.nodes if "grouped_mm" in str(n.target)]  # transformers' CPU fallback op
    assert not [n for n in gm.graph.nodes if any(c.endswith("Experts") for _, c in module_chain(n))]
    topks = [n for n in gm.graph.nodes if n.target is mi.moe_topk.default]
    fused = [n for n in gm.graph.nodes if n.target is mi.fused_moe.default]
    attrs = dict(gm.named_parameters()) | dict(gm.named_buffers())
    for i, topk, moe in zip(_moe_layers(name), topks, fused):
        assert tuple(topk.args[1:7]) == args
        mlp = _hf_layer(name, i).mlp
        bias = topk.args[7]
        if args[1] == "sigmoid":
            assert attrs[bias.target] is mlp.gate.e_score_correction_bias
        else:
            assert bias is None
        # one copy of each expert weight: HF's own stacked tensors, not a copy beside them
        assert attrs[moe.args[3].target] is mlp.experts.gate_up_proj
        assert attrs[moe.args[4].target] is mlp.experts.down_proj
    expert_mb = sum(_hf_layer(name, i).mlp.experts.gate_up_proj.numel() * 3 // 2 for i in _moe_layers(name)) * 4 / 1e6
    assert note.startswith(f"{blocks} MoE blocks ({block_class} x{blocks}): 4 experts, top-2 {args[1]}")
    assert f"expert weights {expert_mb:.3f} MB before stacking, {expert_mb:.3f} MB after" in note


@pytest.mark.parametrize("name", NAMES)
def test_graph_alone(name):
    gm, ctx, stats = single_pass(name, "route_moe")
    _check_graph(name, gm, stats[0].num_matches, stats[0].note)


@pytest.mark.parametrize("name", NAMES)
def test_graph_in_full_pipeline(name):
    gm, ctx, stats = full_pipeline(name)
    order = [s.name for s in stats]
    assert order.index("route_moe") == order.index("merge_projections") - 1
    row = stats[order.index("route_moe")]
    _check_graph(name, gm, row.num_matches, row.note)
    # shared experts (and DeepSeek's dense first layer) stayed graph nodes: fuse_silu_mul fused their gates
    silu_mul = op_counts(gm)[mi.silu_and_mul.default]
    assert silu_mul == {"tiny-qwen2-moe": 2, "tiny-deepseek-v2": 2, "tiny-deepseek-v3": 2}.get(name, 0)


def test_default_pipeline_only_for_moe_configs():
    for name, has in (("tiny-llama", False), ("tiny-qwen3", False), *((n, True) for n in NAMES)):
        ctx = PassContext(config=loaded(name).config, device=CPU, dtype=torch.float32)
        assert ("route_moe" in [p.name for p in recommended_passes(ctx)]) is has


def test_dense_model_no_match():
    gm, ctx, stats = single_pass("tiny-llama", "route_moe")
    assert stats[0].num_matches == 0 and stats[0].note == "no MoE blocks in the graph"


# -- logits against eager HF ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
@given(num=num_tokens, start=start_pos)
@FEW
def test_alone_equals_eager(name, num, start):
    gm, ctx, _ = single_pass(name, "route_moe")
    check_against_eager(name, gm, ctx, num, start, seed=num + 17 * start)


@pytest.mark.parametrize("name", NAMES)
@given(num=num_tokens, start=start_pos)
@FEW
def test_full_pipeline_equals_eager(name, num, start):
    gm, ctx, _ = full_pipeline(name)
    check_against_eager(name, gm, ctx, num, start, seed=5 * num + start)


@pytest.mark.parametrize("name", ["tiny-qwen2-moe", "tiny-deepseek-v3"])
def test_triton_kernels_in_the_graph(name):
    """The graph bound to the Triton launchers (what a GPU runs; the interpreter here) gives the reference-bound
    graph's logits, with the pass's real layouts (the router's logits, a view of the normed hidden states)."""
    gm, ctx, _ = full_pipeline(name)
    ids, pos = random_ids(9, 4), positions(3, 9)
    outs = {}
    for backend in ("reference", "triton"):
        bound, names = bound_copy(gm, backend)
        assert f"moe_topk_{backend}" in names and f"fused_moe_{backend}" in names
        inputs = ctx.example_inputs(ids, pos)
        inputs["logits_indices"] = torch.arange(9)
        outs[backend] = run_graph(bound, inputs)
    assert_logits_close(outs["triton"], outs["reference"])


def test_after_merge_and_silu_fusion_too():
    """Listed after merge_projections / fuse_silu_mul (same stage), the pass still finds the router's logits (now a
    slice of a merged GEMM) and the experts (their gate fused): same rewrite, same logits."""
    name = "tiny-qwen2-moe"
    gm, ctx, stats = run_passes(name, ["merge_projections", "fuse_silu_mul", "route_moe"])
    assert stats[-1].num_matches == 2 and op_counts(gm)[mi.fused_moe.default] == 2
    check_against_eager(name, gm, ctx, 13, 20, seed=4)


@pytest.mark.parametrize("name", ["tiny-qwen2-moe", "tiny-deepseek-v3"])
def test_bf16_grouped_mm_capture(name):
    """In bf16 transformers captures its experts as aten._grouped_mm (the form a GPU sees; fp32 takes its CPU
    fallback op): matched alike. Qwen's routing weights are rounded to bf16 as HF does; DeepSeek's stay fp32."""
    from mini_infer.compiler import logits_tolerance
    from mini_infer.models.loader import load_model

    model = load_model(name, dtype="bf16", device="cpu").model
    captured = compile_model(model, passes=["cleanup"], device=CPU)
    assert any(n.target is aten._grouped_mm.default for n in captured.graph_module.graph.nodes)
    cm = compile_model(model, passes=["cleanup", "route_moe"], device=CPU)
    fused = [n for n in cm.graph_module.graph.nodes if n.meta.get("op") is mi.fused_moe.default]
    assert len(fused) == MOE[name][0]
    topks = [n.args[1].args[0] for n in fused]  # getitem(moe_topk(...), 0): the weights straight from the op
    assert all(t.meta.get("op") is mi.moe_topk.default for t in topks)
    rounded = [len(t.args) > 8 and t.args[8] == torch.bfloat16 for t in topks]
    assert rounded == [name == "tiny-qwen2-moe"] * len(fused)
    ids, pos = random_ids(21, 2), positions(30, 21)
    with torch.no_grad():
        ref = model(input_ids=ids, position_ids=pos, use_cache=False).logits.float()
    err = (cm(**cm.example_inputs(ids, pos)).float() - ref).abs().max().item()
    assert err <= logits_tolerance(torch.bfloat16, ref.abs().max().item())


# -- config variants -----------------------------------------------------------------------------------------


def _compiled_equals_eager(model, passes=("cleanup", "route_moe")):
    cm = compile_model(model, passes=list(passes), device=CPU)
    for num, start in ((1, 0), (19, 40)):
        ids, pos = random_ids(num, seed=num + 3), positions(start, num)
        with torch.no_grad():
            ref = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        assert_logits_close(cm(**cm.example_inputs(ids, pos)), ref)
    return cm


@pytest.mark.parametrize("preset,fields,args", [
    ("tiny-deepseek-v2", dict(n_routed_experts=8, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                              num_experts_per_tok=3, routed_scaling_factor=2.5), (3, "softmax", False, 2.5, 4, 2)),
    ("tiny-deepseek-v3", dict(n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3,
                              norm_topk_prob=False, routed_scaling_factor=2.5), (3, "sigmoid", False, 2.5, 4, 2)),
    ("tiny-qwen2-moe", dict(norm_topk_prob=True, num_experts=6, num_experts_per_tok=3),
     (3, "softmax", True, 1.0, 1, 1)),
])
def test_config_variants_equal_eager(preset, fields, args):
    model = variant_model(preset, **fields, seed=2)
    if preset == "tiny-deepseek-v3":  # a correction bias that changes the choice
        with torch.no_grad():
            for layer in model.model.layers[1:]:
                layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.5)
    cm = _compiled_equals_eager(model)
    topks = [n.meta["op"] for n in cm.graph_module.graph.nodes if n.meta.get("op") is mi.moe_topk.default]
    (row,) = [s for s in cm.stats if s.name == "route_moe"]
    assert row.num_matches == len(topks) == len([m for m in model.model.layers if hasattr(m.mlp, "experts")])
    assert [tuple(n.args[1:7]) for n in cm.graph_module.graph.nodes if n.meta.get("op") is mi.moe_topk.default] \
        == [args] * len(topks)


def test_non_contiguous_experts_are_stacked_once():
    """Expert tensors that are views (here: transposed storage) are copied into contiguous buffers that replace
    them: the graph holds one copy (weight bytes as without the pass), the originals are gone from it."""
    model = variant_model("tiny-qwen3-moe", seed=2)
    with torch.no_grad():
        for layer in model.model.layers:
            for attr in ("gate_up_proj", "down_proj"):
                p = getattr(layer.mlp.experts, attr)
                p.data = p.data.transpose(1, 2).contiguous().transpose(1, 2)
                assert not p.is_contiguous()
    plain = compile_model(model, passes=["cleanup"], device=CPU)
    cm = _compiled_equals_eager(model)
    (row,) = [s for s in cm.stats if s.name == "route_moe"]
    assert "4 made contiguous" in row.note
    names = [n for n, _ in cm.graph_module.named_buffers()] + [n for n, _ in cm.graph_module.named_parameters()]
    assert not [n for n in names if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    stacked = [t for n, t in cm.graph_module.named_buffers() if n.endswith("_stacked")]
    assert len(stacked) == 4 and all(t.is_contiguous() for t in stacked)
    assert cm.weight_bytes == plain.weight_bytes


# -- weights and the summary -----------------------------------------------------------------------------------


def _position_table_bytes(gm):
    return sum(t.numel() * t.element_size() for t in position_tables(gm).values())


@pytest.mark.parametrize("name", ["tiny-mixtral", "tiny-deepseek-v3"])
def test_weight_bytes_and_summary(name):
    """transformers 5.x holds experts stacked already: the rewrite keeps exactly the bytes of the captured graph
    (no copy beside the originals), alone and in the full pipeline (where rotary_table's position tables replace
    inv_freq)."""
    model = mc.loaded(name).model
    captured = mc.cached_compile(model, passes=["cleanup"], device="cpu").weight_bytes
    assert mc.cached_compile(model, passes=["cleanup", "route_moe"], device="cpu").weight_bytes == captured
    cm = mc.compiled(name)
    inv_freq = model.model.rotary_emb.inv_freq
    assert cm.weight_bytes == captured - inv_freq.numel() * 4 + _position_table_bytes(cm.graph_module)
    blocks, block_class, _ = MOE[name]
    summary = cm.summary()
    row = next(line for line in summary.splitlines() if line.startswith("route_moe"))
    assert f"{blocks} MoE blocks ({block_class} x{blocks})" in row and "MB before stacking" in row


def test_bench_active_bytes_counts_top_k_experts(monkeypatch):
    """bench/active_bytes.py (the batch-1 floor of bench/latency.py): a token reads top_k of E experts' weights."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench"))  # as the tests/test_bench_* do
    import active_bytes as module
    for name in ("tiny-qwen3-moe", "tiny-llama"):
        gm = mc.compiled(name).graph_module
        counted = module.token_bytes(gm)
        embed = mc.loaded(name).model.model.embed_tokens.weight
        # the embedding and the position tables aside: a token reads one row of each
        assert counted.total == mc.compiled(name).weight_bytes - embed.numel() * 4 - _position_table_bytes(gm)
        experts = sum(_hf_layer(name, i).mlp.experts.gate_up_proj.numel() * 3 // 2 * 4 for i in _moe_layers(name)) \
            if name in MOE else 0
        assert counted.active == counted.total - experts // 2  # top-2 of 4 experts
        assert counted.moe_layers == (2 if experts else 0)
    # GPT-OSS: its experts re-laid by the pass, their biases read with them
    gm = mc.compiled("tiny-gpt-oss").graph_module
    counted, experts = module.token_bytes(gm), mc.loaded("tiny-gpt-oss").model.model.layers[0].mlp.experts
    per_layer = sum(t.numel() * 4 for t in (experts.gate_up_proj, experts.gate_up_proj_bias, experts.down_proj,
                                             experts.down_proj_bias))
    assert (counted.moe_layers, counted.experts, counted.top_k) == (2, 4, 2)
    assert counted.active == counted.total - 2 * per_layer // 2
    gm = copy_gm(gm)
    relaid = next(n for n in gm.graph.nodes if n.op == "get_attr" and str(n.target).endswith("gate_up_proj_relaid"))
    with gm.graph.inserting_after(relaid):
        gm.graph.call_function(torch.ops.aten.sum.default, (relaid,))
    with pytest.raises(ValueError, match=f"stacked expert weights {relaid.target} feed"):
        module.token_bytes(gm)
    # stacked expert weights read by an op it does not count: an error naming the weights, not a dense floor
    gm = copy_gm(mc.compiled("tiny-qwen3-moe").graph_module)
    moe = next(n for n in gm.graph.nodes if n.op == "call_function" and torch.ops.mini_infer.fused_moe.default in
               (n.target, n.meta.get("op")))
    w13 = moe.args[3]
    with gm.graph.inserting_after(moe):
        gm.graph.call_function(torch.ops.aten.sum.default, (w13,))
    with pytest.raises(ValueError, match=f"stacked expert weights {w13.target} feed"):
        module.token_bytes(gm)


# -- refusals -------------------------------------------------------------------------------------------------


def _run_pass(name, config):
    gm = copy_gm(single_pass(name, "fuse_rmsnorm")[0])
    ctx = PassContext(config=config, device=CPU, dtype=torch.float32, applied=["cleanup", "fuse_rmsnorm"])
    PassManager([RouteMoe()]).run(gm, ctx)


BAD_CONFIGS = [
    ("tiny-mixtral", dict(num_experts_per_tok=5), r"num_experts_per_tok=5 must be in \[1, config.num_local_experts=4\]"),
    ("tiny-qwen3-moe", dict(num_experts_per_tok=0), r"num_experts_per_tok=0 must be in \[1, config.num_experts=4\]"),
    ("tiny-deepseek-v2", dict(topk_method="noaux_tc"), "topk_method='noaux_tc' is not supported"),
    ("tiny-deepseek-v2", dict(scoring_func="sigmoid"), "scoring_func='sigmoid'"),
    ("tiny-deepseek-v3", dict(scoring_func="softmax"), "scoring_func='softmax'"),
    ("tiny-deepseek-v3", dict(n_group=3), "n_group must be >= 1 and divide num_experts=4, got 3"),
    ("tiny-deepseek-v3", dict(topk_group=2, n_group=4), "scores a group by its top 2 experts"),
    ("tiny-qwen2-moe", dict(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
]


@pytest.mark.parametrize("name,fields,message", BAD_CONFIGS, ids=[f"{c[0]}-{next(iter(c[1]))}" for c in BAD_CONFIGS])
def test_bad_config_is_refused_by_the_pass(name, fields, message):
    config = copy.deepcopy(loaded(name).config)
    for k, v in fields.items():
        setattr(config, k, v)
    with pytest.raises(PassError, match=message):
        _run_pass(name, config)


@pytest.mark.parametrize("name,fields,message", BAD_CONFIGS[:3], ids=["mixtral-top_k", "qwen3-top_k", "v2-method"])
def test_bad_config_is_refused_before_capture(name, fields, message, monkeypatch):
    def no_capture(model):
        raise AssertionError("captured before checking the config")

    monkeypatch.setattr(compiler, "capture", no_capture)
    model = loaded(name).model
    for k, v in fields.items():
        monkeypatch.setattr(model.config, k, v)
    with pytest.raises(ValueError, match=message):
        compile_model(model, device=CPU)


def test_other_router_scoring_is_refused():
    """A MixtralSparseMoeBlock whose router scores by sigmoid is not HF's: refused, not routed by softmax."""
    name = "tiny-mixtral"
    gm = copy_gm(single_pass(name, "fuse_rmsnorm")[0])
    softmax = next(n for n in gm.graph.nodes if n.target is aten.softmax.int)
    softmax.target, softmax.args = aten.sigmoid.default, (softmax.args[0],)
    ctx = PassContext(config=loaded(name).config, device=CPU, dtype=torch.float32, applied=["cleanup"])
    with pytest.raises(PassError, match=r"layers.0.mlp \(MixtralSparseMoeBlock\): the router computes sigmoid"):
        PassManager([RouteMoe()]).run(gm, ctx)


def test_other_expert_shapes_are_refused():
    config = copy.deepcopy(loaded("tiny-qwen3-moe").config)
    config.moe_intermediate_size = 48  # the graph's experts are [4, 64, 64] / [4, 64, 32]
    with pytest.raises(PassError, match=r"expected the experts' gate_up_proj \[4, 96, 64\]"):
        _run_pass("tiny-qwen3-moe", config)


class ToySparseMoeBlock(torch.nn.Module):
    """A MoE block of no known family: top-1 of 4 experts, each a linear."""

    def __init__(self, hidden: int = 16):
        super().__init__()
        self.gate = torch.nn.Linear(hidden, 4, bias=False)
        self.experts = torch.nn.Parameter(torch.randn(4, hidden, hidden) / 4)

    def forward(self, x, pos):
        flat = x.view(-1, x.shape[-1])
        ids = self.gate(flat).softmax(-1).topk(1).indices[:, 0]
        return torch.bmm(self.experts[ids], flat.unsqueeze(-1)).squeeze(-1).view(x.shape)


class _Routed(torch.nn.Module):
    """The same routing in a module whose name says nothing: the top-k op gives it away."""

    def __init__(self):
        super().__init__()
        self.inner = ToySparseMoeBlock()

    def forward(self, x, pos):
        return self.inner.forward(x, pos)


@pytest.mark.parametrize("body,cls", [(ToySparseMoeBlock, "ToySparseMoeBlock"), (_Routed, "_Routed")])
def test_unknown_moe_block_is_refused(body, cls):
    from mini_infer.passes.capture import capture

    torch.manual_seed(0)
    model = ToyLM(body()).eval().requires_grad_(False)
    model.config.num_local_experts = 4
    gm = capture(model)
    ctx = PassContext(config=model.config, device=CPU, dtype=torch.float32)
    assert "route_moe" in [p.name for p in recommended_passes(ctx)]
    with pytest.raises(PassError, match=rf"\({cls}\) is not a MoE block this pass recognizes"):
        PassManager([*recommended_passes(ctx)[:1], RouteMoe()]).run(gm, ctx)


# -- through the engine ---------------------------------------------------------------------------------------

NEW = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


@pytest.mark.parametrize("name", [*NAMES, "tiny-gpt-oss"])  # GPT-OSS's graph checks: test_route_moe_gpt_oss.py
def test_engine_greedy_with_prefix_cache_and_chunked_prefill(name):
    common = random_prompts(1, [16])[0]  # 4 whole blocks of 4
    prompts = [common + s for s in random_prompts(2, (0, 5, 11))] + random_prompts(3, (3, 26))
    engine = LLMEngine(EngineConfig(model=name, device="cpu", async_scheduling=False, num_kv_blocks=64, block_size=4,
                                    enable_prefix_caching=True, max_num_batched_tokens=8,
                                    enable_chunked_prefill=True), loaded=mc.loaded(name), compiled=mc.compiled(name))
    assert "route_moe" in engine.compiled.context.applied
    log = record_schedules(engine)
    run(engine, [prompts[1]], GREEDY, prefix="warm")  # its full blocks stay cached
    hits = engine.block_manager.prefix_cache_hits
    outs = run(engine, prompts, GREEDY)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_ref(name, tuple(p), NEW), f"{name}: prompt of {len(p)} tokens"
    assert engine.block_manager.prefix_cache_hits - hits >= 12 * 3
    assert all(sum(n for n, *_ in step) <= 8 for step in log)
    assert any(0 < before < plen and n > 0 for step in log for n, plen, before, _ in step)  # a prompt was split
    assert_no_leak(engine)
