"""ShardTensorParallel: the graph each rank gets (in this process, no process group needed to compile), its
refusals, and its numbers on two real gloo ranks.

In-process, on every dense and MoE tiny preset: rank 0's graph of 2 has one all-reduce per attention and one per
MLP or MoE block (o_proj, down_proj, the experts' output together with a sharded shared expert), one all-gather
of the logits rows, per-rank caches of half the KV heads, about half the layer weights, and fuse_rmsnorm still
fuses every residual add + RMSNorm that follows an all-reduce. MoE: fused_moe runs over every expert's half of the
intermediate size (rank 1's gate rows are the second quarter of HF's gate_up_proj, its up rows the fourth); a
block whose output is a sum of shares gets one all-reduce of that output (tiny-qwen2-moe with its shared expert
sharded too), and one whose output adds a replicated value to a share all-reduces the share (tiny-qwen2-moe with
transformers' plan, which leaves the shared expert replicated). With expert parallelism rank 1 keeps experts
E/2 .. E-1 whole (half the expert bytes), fused_moe maps the router's ids to them, and the pass routes the blocks.
GPT-OSS (this project's plan, tp_plan.PROJECT_PLANS, since transformers' splits no attention): each rank's attention op
reads its heads' sinks, fused_moe its contiguous columns of the interleaved gate_up_proj and its bias (whole
gate/up pairs), its rows of down_proj, and down_proj_bias on rank 0 only (zeros on rank 1); expert parallelism is
refused. Refusals name the field: no tp plan, heads or KV heads that do not split, latent attention, expert-parallel
styles, more ranks than GPUs, a world size > 1 without a sharding pass, experts that do not split over the ranks
under expert parallelism.

On two gloo ranks (tests/distributed/helpers.py `run_ranks`), for every dense and MoE tiny preset (DeepSeek's
latent attention is refused) plus a llama with one KV head (replicated on both ranks) and a vocabulary of 511
(padded to 512), tiny-qwen2-moe with its shared expert sharded, and tiny-qwen3-moe with a dense first layer
(`mlp_only_layers`), and tiny-gpt-oss as initialized and with large random biases and sinks (a down bias added on
every rank, or sinks not split by head, is far off): the pass alone and the full pipeline give eager HF's logits on
both ranks, and the same as the TP=1 pipeline; the same for the MoE ones (not GPT-OSS) with expert parallelism.
Also with quantization="mxfp4" (tiny-qwen3-moe, TP and EP, and tiny-gpt-oss, each with I = 64 and experts rounded
to MXFP4 values): every rank's share of the experts packed (fused_moe_mxfp4), the logits still eager HF's.
"""

from __future__ import annotations

import operator

import pytest
import torch

from mini_infer.compiler import compile_model
from mini_infer.models.loader import build_random_model
from mini_infer.models.presets import TINY_DENSE_PRESETS, preset_config
from mini_infer.models.tp_plan import check_tensor_parallel_devices, tensor_parallel_plan
from mini_infer.passes import PassContext, recommended_passes, resolve_passes
from mini_infer.passes.capture import capture
from mini_infer.passes.manager import PassError, PassManager
from mini_infer.passes.pattern import module_chain
from mini_infer.passes.quantize_moe_mxfp4 import round_experts_to_mxfp4
from mini_infer.passes.shard_tensor_parallel import ShardTensorParallel
from mini_infer.runtime.engine import EngineConfig
from mini_infer.runtime.preflight import check_before_load
from tests.distributed.helpers import run_ranks
from tests.passes.helpers import (
    CPU,
    NUM_LAYERS,
    ToyLM,
    _cleaned,
    aten,
    copy_gm,
    full_pipeline,
    loaded,
    mi,
    op_counts,
    position_tables,
    positions,
    random_ids,
    run_graph,
)

c10d = torch.ops._c10d_functional
L = NUM_LAYERS
MOE_TP_PRESETS = ("tiny-mixtral", "tiny-qwen3-moe", "tiny-qwen2-moe")
TP_PRESETS = TINY_DENSE_PRESETS + MOE_TP_PRESETS


def _tp_pipeline(name: str, rank: int, world_size: int, expert_parallel: bool = False):
    """The recommended pipeline for rank `rank` of `world_size` on `name`'s cleaned graph (no process group)."""
    lm = loaded(name)
    ctx = PassContext(config=lm.config, device=CPU, dtype=torch.float32, rank=rank, world_size=world_size,
                      expert_parallel=expert_parallel, applied=["cleanup"])
    gm = copy_gm(_cleaned(name))
    stats = PassManager(recommended_passes(ctx)[1:]).run(gm, ctx)
    return gm, ctx, stats


@pytest.mark.parametrize("name", TP_PRESETS)
def test_rank_graph(name):
    gm, ctx, stats = _tp_pipeline(name, 0, 2)
    counts = op_counts(gm)
    assert counts[mi.all_reduce_sum.default] == 2 * L  # after o_proj and down_proj (or the MoE block) of each layer
    assert counts[c10d.all_reduce.default] == 0  # every all-reduce is the op, which picks its path when it runs
    assert counts[c10d.all_gather_into_tensor.default] == 1  # the logits rows
    assert counts[c10d.wait_tensor.default] == 1
    row = next(s for s in stats if s.name == "shard_tensor_parallel")
    assert f"{L if name in MOE_TP_PRESETS else 2 * L} rowwise" in row.note  # o_proj (and down_proj if dense)
    assert "embedding replicated" in row.note
    # the caches hold this rank's KV heads: 2 KV heads over 2 ranks
    assert {s.num_kv_heads for s in ctx.cache_specs} == {1}
    _, ctx1, _ = full_pipeline(name)
    assert {s.num_kv_heads for s in ctx1.cache_specs} == {2}
    # layer weights are split: every linear weight but the embedding is at most half of TP=1's (the position
    # tables, replicated, aside)
    gm1 = full_pipeline(name)[0]

    def elements(g):
        tables = position_tables(g)
        return sum(t.numel() for n, t in [*g.named_buffers(), *g.named_parameters()] if n not in tables)

    assert elements(gm) < 0.7 * elements(gm1)


@pytest.mark.parametrize("name", TP_PRESETS)
def test_add_rmsnorm_fuses_across_the_all_reduce(name):
    """Each all-reduce's result is the residual add of a fused_add_rms_norm, as many fused norms as TP=1 (some of
    them folded into the sharded linear after them by fuse_norm_gemv, as at TP=1); Qwen2-MoE's routed share is
    added to its replicated shared expert's output first."""
    gm, _, _ = _tp_pipeline(name, 1, 2)
    norms = (mi.fused_add_rms_norm.default, mi.fused_add_rms_norm_linear.default)
    fused = [n for n in gm.graph.nodes if n.target in norms]
    tp1 = op_counts(full_pipeline(name)[0])
    assert [sum(n.target is t for n in fused) for t in norms] == [tp1[t] for t in norms]
    assert len(fused) == 2 * L
    sums = [n for n in gm.graph.nodes if n.target is mi.all_reduce_sum.default]
    assert len(sums) == 2 * L
    for w in sums:
        users = list(w.users)
        if name == "tiny-qwen2-moe" and [u.target for u in users] == [aten.add.Tensor]:
            # the routed share's sum + the replicated shared expert, reshaped to [1, T, H], then the norm
            users = [v for u in users[0].users for v in (u.users if u.target is aten.reshape.default else [u])]
        assert any(u.target in norms for u in users), f"{w.name} feeds {list(w.users)}"
    assert not any(n.target is operator.add for n in gm.graph.nodes)


def _fused_moe_weights(gm) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(PassContext.tensor_of(gm, n.args[3]), PassContext.tensor_of(gm, n.args[4]))
            for n in gm.graph.nodes if n.target is mi.fused_moe.default]


@pytest.mark.parametrize("name", MOE_TP_PRESETS)
def test_experts_keep_their_share_of_the_intermediate_size(name):
    """Rank 1 of 2: fused_moe reads, for every expert, rows I/2..I-1 (gate) and 3I/2..2I-1 (up) of HF's
    gate_up_proj [E, 2I, H] and columns I/2..I-1 of down_proj [E, H, I]."""
    gm, _, _ = _tp_pipeline(name, 1, 2)
    hf = loaded(name).model.model.layers
    weights = _fused_moe_weights(gm)
    assert len(weights) == L
    for layer, (w13, w2) in zip(hf, weights, strict=True):
        gate_up, down = layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj
        inter = down.shape[2]
        half = inter // 2
        assert torch.equal(w13, torch.cat([gate_up[:, half:inter], gate_up[:, inter + half:]], dim=1))
        assert torch.equal(w2, down[:, :, half:])


@pytest.mark.parametrize("name", MOE_TP_PRESETS)
def test_expert_parallel_rank_holds_its_experts_whole(name):
    """Expert parallelism, rank 1 of 2: fused_moe reads experts E/2 .. E-1 of HF's gate_up_proj and down_proj
    whole, maps the router's global ids to them (experts of rank 0 -> -1), and the graph's expert weights are
    half of TP=1's bytes; attention is split as without it, with the same one all-reduce per MoE block."""
    gm, _, stats = _tp_pipeline(name, 1, 2, expert_parallel=True)
    hf = loaded(name).model.model.layers
    e = hf[0].mlp.experts.gate_up_proj.shape[0]
    weights = _fused_moe_weights(gm)
    assert len(weights) == L
    for layer, (w13, w2) in zip(hf, weights, strict=True):
        assert torch.equal(w13, layer.mlp.experts.gate_up_proj[e // 2:])
        assert torch.equal(w2, layer.mlp.experts.down_proj[e // 2:])
    maps = {n.args[6] for n in gm.graph.nodes if n.target is mi.fused_moe.default}
    assert len(maps) == 1  # one buffer shared by every block
    assert PassContext.tensor_of(gm, maps.pop()).tolist() == [-1] * (e // 2) + list(range(e // 2))
    expert_bytes = sum(w.nbytes for pair in weights for w in pair)
    tp1 = sum(w.nbytes for pair in _fused_moe_weights(full_pipeline(name)[0]) for w in pair)
    assert expert_bytes * 2 == tp1
    counts = op_counts(gm)
    assert counts[mi.all_reduce_sum.default] == 2 * L and counts[mi.moe_topk.default] == L
    notes = {s.name: s.note for s in stats}
    assert f"expert parallel: experts {e // 2}..{e - 1} of {e} on this rank" in notes["shard_tensor_parallel"]
    assert "routed already" in notes["route_moe"]


def _moe_rank_graph(config, rank: int = 0):
    """Rank `rank` of 2's graph of a random model of `config`, through the recommended pipeline."""
    model = build_random_model(config, torch.float32, CPU, seed=0)
    ctx = PassContext(config=model.config, device=CPU, dtype=torch.float32, rank=rank, world_size=2)
    gm = capture(model)
    PassManager(recommended_passes(ctx)).run(gm, ctx)
    return gm


# Qwen2-MoE with its shared expert sharded too (transformers' plan leaves it replicated)
SHARED_SHARDED = {**preset_config("tiny-qwen2-moe").base_model_tp_plan,
                  "layers.*.mlp.shared_expert.gate_proj": "colwise", "layers.*.mlp.shared_expert.up_proj": "colwise",
                  "layers.*.mlp.shared_expert.down_proj": "rowwise"}


@pytest.mark.parametrize(("plan", "reduced"), [(None, "share"), (SHARED_SHARDED, "block")])
def test_moe_block_all_reduce_placement(plan, reduced):
    """The replicated shared expert is added after the routed share's all-reduce; a sharded one is summed with
    the routed share first, and the block's output is all-reduced once."""
    config = _config("tiny-qwen2-moe", **({"base_model_tp_plan": plan} if plan else {}))
    gm = _moe_rank_graph(config)
    reads = [n.args[0] for n in gm.graph.nodes if n.target is mi.all_reduce_sum.default]
    assert len(reads) == 2 * L
    moe = [r for r in reads if any(cls == "Qwen2MoeSparseMoeBlock" for _, cls in module_chain(r))]
    assert len(moe) == L
    if reduced == "share":
        assert all(r.target is mi.fused_moe.default for r in moe), [r.target for r in moe]
    else:
        assert all(r.target is not mi.fused_moe.default for r in moe)
        assert all(any(u.target is mi.all_reduce_sum.default for u in r.users) for r in moe)
        shared = [n for n in gm.graph.nodes if n.op == "get_attr" and "shared_expert_down_proj" in str(n.target)]
        assert shared and all(PassContext.tensor_of(gm, n).shape[-1] == 32 for n in shared)  # 64 / 2


def _gpt_oss_rank_graph(rank: int):
    """(model with large biases and sinks, rank `rank` of 2's graph through the recommended pipeline, its stats)."""
    model = build_random_model(preset_config("tiny-gpt-oss"), torch.float32, CPU, seed=0)
    _large_gpt_oss_biases(model)
    ctx = PassContext(config=model.config, device=CPU, dtype=torch.float32, rank=rank, world_size=2)
    gm = capture(model)
    stats = PassManager(recommended_passes(ctx)).run(gm, ctx)
    return model, gm, stats


@pytest.mark.parametrize("rank", [0, 1])
def test_gpt_oss_rank_keeps_its_heads_sinks_and_expert_slices(rank):
    """GPT-OSS under the project's plan, rank r of 2: the attention op reads sinks of heads 2r, 2r+1; fused_moe reads
    columns [2rI/2, 2(r+1)I/2) of gate_up_proj [E, H, 2I] and of its bias (whole gate/up pairs, de-interleaved),
    rows [rI/2, (r+1)I/2) of down_proj [E, I, H], and down_proj_bias whole on rank 0, zeros on rank 1 (added once
    by the all-reduce); one all-reduce per attention and per MoE block."""
    model, gm, stats = _gpt_oss_rank_graph(rank)
    counts = op_counts(gm)
    assert counts[mi.all_reduce_sum.default] == 2 * L and counts[mi.fused_moe.default] == L
    note = next(s.note for s in stats if s.name == "shard_tensor_parallel")
    assert f"{L} MoE experts modules ({2 * L} stacked weights, {2 * L} expert biases" in note
    assert f"{L} per-head tensors" in note
    attention = [n for n in gm.graph.nodes if "attention" in str(n.target) and n.op == "call_function"
                 and n.args and isinstance(n.args[-1], torch.fx.Node) and "sinks" in str(n.args[-1].target)]
    fused = [n for n in gm.graph.nodes if n.target is mi.fused_moe.default]
    assert len(attention) == len(fused) == L
    for layer, attn, moe in zip(model.model.layers, attention, fused, strict=True):
        sinks = PassContext.tensor_of(gm, attn.args[-1])
        assert torch.equal(sinks, layer.self_attn.sinks[2 * rank:2 * rank + 2])
        experts = layer.mlp.experts
        two_i = experts.gate_up_proj.shape[2]
        n, inter = two_i // 2, two_i // 4  # this rank's columns of the interleaved 2I, its I/2
        gate_up = experts.gate_up_proj[..., rank * n:(rank + 1) * n]
        bias = experts.gate_up_proj_bias[:, rank * n:(rank + 1) * n]
        w13, w2, b13, b2 = (PassContext.tensor_of(gm, moe.args[i]) for i in (3, 4, 7, 8))
        assert torch.equal(w13, torch.cat([gate_up[..., ::2], gate_up[..., 1::2]], 2).transpose(1, 2))
        assert torch.equal(b13, torch.cat([bias[:, ::2], bias[:, 1::2]], 1))
        assert torch.equal(w2, experts.down_proj[:, rank * inter:(rank + 1) * inter].transpose(1, 2))
        down_bias = experts.down_proj_bias
        assert down_bias.abs().max() > 1
        assert torch.equal(b2, down_bias if rank == 0 else torch.zeros_like(down_bias))


def test_gpt_oss_project_plan():
    """transformers' gpt_oss plans split no attention (5.24: embed_tokens only; 5.17: none), so the project's plan
    is used; a gpt_oss config whose plan splits attention keeps its own; the project's styles are refused in a
    config's plan; expert parallelism is accepted by the plan, route_moe and the start-up checks."""
    from mini_infer.models.tp_plan import PROJECT_PLANS
    from mini_infer.passes.route_moe import RouteMoe

    for plan in ({"embed_tokens": "embedding_rowwise"}, None):
        tp = tensor_parallel_plan(_config("tiny-gpt-oss", base_model_tp_plan=plan), 2)
        assert tp.styles == PROJECT_PLANS["gpt_oss"]
        assert tp.slices("model.layers.0.self_attn", "sinks") and tp.slices("model.layers.1.mlp.experts",
                                                                             "down_proj_bias")
        assert not tp.slices("model.layers.0.mlp.router", "weight")  # the router is replicated
    own = {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
           "layers.*.mlp.experts": "moe_tp_experts"}
    assert tensor_parallel_plan(_config("tiny-gpt-oss", base_model_tp_plan=own), 2).styles == own
    with pytest.raises(ValueError, match=r"\['layers.\*.self_attn.sinks'\] = 'query_heads' is not supported"):
        tensor_parallel_plan(_config("tiny-llama", base_model_tp_plan={
            **preset_config("tiny-llama").base_model_tp_plan, "layers.*.self_attn.sinks": "query_heads"}), 2)
    config = preset_config("tiny-gpt-oss")
    ctx = PassContext(config=config, device=CPU, dtype=torch.float32, world_size=2, expert_parallel=True)
    RouteMoe().check_context(ctx)  # expert parallelism: accepted (its numbers: the two-rank tests below)
    assert tensor_parallel_plan(config, 2, expert_parallel=True).expert_parallel
    check_before_load(EngineConfig(model="tiny-gpt-oss", device="cpu", tensor_parallel_size=2,
                                   enable_expert_parallel=True))


@pytest.mark.parametrize("rank", [0, 1])
def test_gpt_oss_expert_parallel_rank_holds_its_experts_and_biases_whole(rank):
    """GPT-OSS with expert parallelism, rank r of 2: fused_moe reads experts rE/2 .. (r+1)E/2 - 1 whole (every
    column of gate_up_proj and its bias, de-interleaved; all of down_proj), the down bias of those experts on this
    rank (not rank 0's whole bias), and the map of global ids to them; attention as under tensor parallelism."""
    model = build_random_model(preset_config("tiny-gpt-oss"), torch.float32, CPU, seed=0)
    _large_gpt_oss_biases(model)
    ctx = PassContext(config=model.config, device=CPU, dtype=torch.float32, rank=rank, world_size=2,
                      expert_parallel=True)
    gm = capture(model)
    stats = PassManager(recommended_passes(ctx)).run(gm, ctx)
    note = next(s.note for s in stats if s.name == "shard_tensor_parallel")
    assert f"{2 * L} stacked weights, {2 * L} expert biases" in note and "expert parallel: experts" in note
    fused = [n for n in gm.graph.nodes if n.target is mi.fused_moe.default]
    assert len(fused) == L
    for layer, moe in zip(model.model.layers, fused, strict=True):
        experts = layer.mlp.experts
        e = experts.gate_up_proj.shape[0]
        mine = slice(rank * e // 2, (rank + 1) * e // 2)
        gate_up, bias = experts.gate_up_proj[mine], experts.gate_up_proj_bias[mine]
        w13, w2, emap, b13, b2 = (PassContext.tensor_of(gm, moe.args[i]) for i in (3, 4, 6, 7, 8))
        assert torch.equal(w13, torch.cat([gate_up[..., ::2], gate_up[..., 1::2]], 2).transpose(1, 2))
        assert torch.equal(b13, torch.cat([bias[:, ::2], bias[:, 1::2]], 1))
        assert torch.equal(w2, experts.down_proj[mine].transpose(1, 2))
        assert torch.equal(b2, experts.down_proj_bias[mine])
        local = [-1] * (e // 2)
        assert emap.tolist() == (list(range(e // 2)) + local if rank == 0 else local + list(range(e // 2)))


def _config(name: str, **fields):
    config = preset_config(name)
    for k, v in fields.items():
        setattr(config, k, v)
    return config


@pytest.mark.parametrize(("config", "size", "message"), [
    (_config("tiny-llama", base_model_tp_plan=None), 2, "has no base_model_tp_plan"),
    (_config("tiny-llama"), 3, "does not divide num_attention_heads=4"),
    (_config("tiny-llama", num_attention_heads=6, num_key_value_heads=4, hidden_size=96), 3,
     "num_key_value_heads=4"),
    (_config("tiny-llama", intermediate_size=129), 2, "does not divide intermediate_size=129"),
    (_config("tiny-mixtral", base_model_tp_plan={**preset_config("tiny-mixtral").base_model_tp_plan,
                                                 "layers.*.mlp.experts.gate_up_proj": "grouped_gemm"}), 2,
     "'layers.*.mlp.experts.gate_up_proj'] = 'grouped_gemm' is not supported"),
    (_config("tiny-qwen3-moe", moe_intermediate_size=33), 2, "does not divide moe_intermediate_size=33"),
    (_config("tiny-deepseek-v2"), 2, "latent attention (MLA"),
    (_config("tiny-llama"), 0, "tensor_parallel_size must be an int >= 1"),
])
def test_plan_refusals(config, size, message):
    with pytest.raises(ValueError, match=message.replace("*", r"\*").replace("(", r"\(")):
        tensor_parallel_plan(config, size)


def test_expert_parallel_refusals():
    """The experts must split evenly over the ranks (named with both numbers); the intermediate size of whole
    experts need not; latent attention stays refused."""
    config = _config("tiny-mixtral", num_local_experts=5)
    tensor_parallel_plan(config, 2)  # inside the experts, 5 of them split fine
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 does not divide the 5 routed experts "
                                         r"\(num_local_experts=5\)"):
        tensor_parallel_plan(config, 2, expert_parallel=True)
    odd = _config("tiny-qwen3-moe", moe_intermediate_size=33)
    assert tensor_parallel_plan(odd, 2, expert_parallel=True).expert_parallel
    with pytest.raises(ValueError, match="latent attention"):
        tensor_parallel_plan(_config("tiny-deepseek-v2"), 2, expert_parallel=True)
    with pytest.raises(ValueError, match="latent attention"):
        check_before_load(EngineConfig(model="tiny-deepseek-v2", device="cpu", tensor_parallel_size=2,
                                       enable_expert_parallel=True))
    with pytest.raises(ValueError, match="enable_expert_parallel must be a bool"):
        EngineConfig(enable_expert_parallel=1)


# Qwen2MoeConfig's class plans in transformers 5.17 (the device image's release): the tp plan leaves the experts
# out, the ep plan names them
PLANS_5_17 = dict(
    base_model_tp_plan={k: v for k, v in preset_config("tiny-qwen2-moe").base_model_tp_plan.items() if "experts" not in k},
    base_model_ep_plan={"layers.*.mlp.gate": "ep_router", "layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
                        "layers.*.mlp.experts.down_proj": "grouped_gemm", "layers.*.mlp.experts": "moe_tp_experts"})


def test_experts_completed_from_the_ep_plan():
    """A tp plan without the experts gets them from the ep plan (both ways of splitting them); a model with routed
    experts that neither plan names is refused, naming both plans (route_moe could not match its rank's graph)."""
    experts = {"layers.*.mlp.experts.gate_up_proj": "packed_colwise", "layers.*.mlp.experts.down_proj": "rowwise",
               "layers.*.mlp.experts": "moe_tp_experts"}
    for expert_parallel in (False, True):
        plan = tensor_parallel_plan(_config("tiny-qwen2-moe", **PLANS_5_17), 2, expert_parallel=expert_parallel)
        assert plan.styles == {**PLANS_5_17["base_model_tp_plan"], **experts}
        assert plan.slices("model.model.layers.3.mlp.experts", "gate_up_proj")
    bare = _config("tiny-qwen2-moe", base_model_tp_plan=PLANS_5_17["base_model_tp_plan"], base_model_ep_plan=None)
    for expert_parallel in (False, True):
        with pytest.raises(ValueError, match=r"tensor_parallel_size=2: the 'qwen2_moe' config's base_model_tp_plan "
                                             r"and base_model_ep_plan name no experts module \('moe_tp_experts'\) "
                                             r"for its 4 routed experts \(num_experts\)"):
            tensor_parallel_plan(bare, 2, expert_parallel=expert_parallel)


def test_plan_arithmetic():
    plan = tensor_parallel_plan(_config("tiny-llama", num_key_value_heads=1, vocab_size=511), 2)
    assert (plan.heads_per_rank, plan.kv_heads_per_rank, plan.kv_replicated) == (2, 1, True)
    assert [plan.first_kv_head(r) for r in (0, 1)] == [0, 0]
    assert plan.padded_vocab == 512
    plan = tensor_parallel_plan(_config("tiny-llama", num_attention_heads=8, num_key_value_heads=2), 4)
    assert [plan.first_kv_head(r) for r in range(4)] == [0, 0, 1, 1]
    assert plan.style_of("model.model.layers.11.self_attn.o_proj") == "rowwise"
    assert plan.style_of("model.model.layers.1.self_attn.q_norm") is None  # replicated
    assert plan.style_of("model.lm_head") is None


def test_more_ranks_than_gpus():
    with pytest.raises(ValueError, match="tensor_parallel_size=4, but this machine has 2 CUDA GPU"):
        check_tensor_parallel_devices(4, "cuda", 2)
    check_tensor_parallel_devices(2, "cuda", 2)
    check_tensor_parallel_devices(8, "cpu", 0)  # CPU ranks share the host


def test_preflight_refuses_before_loading():
    with pytest.raises(ValueError, match="latent attention"):
        check_before_load(EngineConfig(model="tiny-deepseek-v2", device="cpu", tensor_parallel_size=2))
    check_before_load(EngineConfig(model="tiny-mixtral", device="cpu", tensor_parallel_size=2))
    with pytest.raises(ValueError, match="does not divide num_attention_heads"):
        check_before_load(EngineConfig(model="tiny-llama", device="cpu", tensor_parallel_size=3))
    with pytest.raises(ValueError, match="tensor_parallel_size must be"):
        EngineConfig(tensor_parallel_size=0)


class _Skip(torch.nn.Module):
    def forward(self, x, position_ids):
        return x


def test_compile_refusals():
    model = ToyLM(_Skip()).eval()
    with pytest.raises(PassError, match="no base_model_tp_plan"):
        compile_model(model, passes=["cleanup", "shard_tensor_parallel"], world_size=2)
    with pytest.raises(ValueError, match="no sharding pass"):
        compile_model(model, passes=["cleanup"], world_size=2)
    with pytest.raises(ValueError, match="group_name"):
        ShardTensorParallel(group_name=3)


# -- numbers on two gloo ranks ---------------------------------------------------------------------------------

VARIANTS = {name: (name, {}) for name in TP_PRESETS}
VARIANTS["tiny-llama kv1 vocab511"] = ("tiny-llama", dict(num_key_value_heads=1, vocab_size=511))
VARIANTS["tiny-gemma2"] = ("tiny-gemma2", {})  # attention captured as mini_infer.attention, soft caps, Gemma norms
VARIANTS["tiny-qwen2-moe shared expert sharded"] = ("tiny-qwen2-moe", dict(base_model_tp_plan=SHARED_SHARDED))
VARIANTS["tiny-qwen3-moe dense layer 0"] = ("tiny-qwen3-moe", dict(mlp_only_layers=[0]))  # a dense MLP, then MoE
VARIANTS["tiny-qwen2-moe transformers 5.17 plans"] = ("tiny-qwen2-moe", PLANS_5_17)  # experts only in the ep plan
# GPT-OSS under this project's plan (tp_plan.PROJECT_PLANS): attention with biases and sinks, transposed experts
# with biases; once as initialized, once with large router / expert biases and sinks (`_large_gpt_oss_biases`:
# a down bias added on every rank, or sinks not sliced per rank, would be far off)
VARIANTS["tiny-gpt-oss"] = ("tiny-gpt-oss", {})
VARIANTS["tiny-gpt-oss large biases and sinks"] = ("tiny-gpt-oss", {})
LARGE_BIASES = {"tiny-gpt-oss large biases and sinks"}
# quantization="mxfp4" on the sharded experts (I = 64: 32 a rank, one MXFP4 group; the experts rounded to MXFP4 values
# first, so that the packing is exact and eager HF stays the oracle)
VARIANTS["tiny-qwen3-moe mxfp4"] = ("tiny-qwen3-moe", dict(moe_intermediate_size=64))
VARIANTS["tiny-gpt-oss mxfp4"] = ("tiny-gpt-oss", dict(intermediate_size=64))
MXFP4 = {"tiny-qwen3-moe mxfp4", "tiny-gpt-oss mxfp4"}
# tied embeddings with the plan entry transformers 5.17 adds for them (kept whole on every rank), and as many
# query heads as the head dim (16): the views' last size is the head dim, the others the heads
VARIANTS["tiny-llama tied, 5.17 embedding plan, heads == head_dim"] = ("tiny-llama", dict(
    tie_word_embeddings=True, num_attention_heads=16, num_key_value_heads=16,
    base_model_tp_plan={**preset_config("tiny-llama").base_model_tp_plan, "embed_tokens": "embedding_rowwise"}))
SHARD_ALONE = ["cleanup", "select_logits", "shard_tensor_parallel"]


EP_VARIANTS = [*MOE_TP_PRESETS, "tiny-qwen2-moe shared expert sharded", "tiny-qwen3-moe dense layer 0",
               "tiny-qwen2-moe transformers 5.17 plans", "tiny-qwen3-moe mxfp4", "tiny-gpt-oss",
               "tiny-gpt-oss large biases and sinks", "tiny-gpt-oss mxfp4"]


def _errors(rank: int, world_size: int) -> dict:
    """On each rank, for VARIANTS ("tp") and, with expert parallelism, EP_VARIANTS ("ep"): max |logits - eager| of
    the pass alone and of the full pipeline, and |TP=N - TP=1| (one capture, one eager run and one TP=1 pipeline per
    model, each pipeline on a copy of the capture). One launch of the ranks serves both tests: spawning them and
    capturing each model are most of the time."""
    out: dict = {"tp": {}, "ep": {}}
    for label, (preset, fields) in VARIANTS.items():
        model = build_random_model(_config(preset, **fields), torch.float32, CPU, seed=0)
        if label in LARGE_BIASES:
            _large_gpt_oss_biases(model)
        quantization = "mxfp4" if label in MXFP4 else None
        if quantization:
            round_experts_to_mxfp4(model)
        captured = capture(model)
        num, start = 11, 5
        ids = random_ids(num, seed=1) % model.config.vocab_size
        pos = positions(start, num)
        with torch.no_grad():
            ref = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        tp1 = _pipeline_logits(model, captured, ids, pos, "tp1", 0, 1, False, quantization)
        for key, expert_parallel in (("tp", False), ("ep", True)):
            if expert_parallel and label not in EP_VARIANTS:
                continue
            row = {"tol": 1e-4 * max(1.0, ref.abs().max().item()), "tp1_all_reduces": tp1[1]}
            logits = {"tp1": tp1[0]}
            for kind in ("alone", "full"):
                logits[kind], row[f"{kind}_all_reduces"] = _pipeline_logits(model, captured, ids, pos, kind, rank,
                                                                            world_size, expert_parallel, quantization)
            row["alone"] = (logits["alone"] - ref).abs().max().item()
            row["full"] = (logits["full"] - ref).abs().max().item()
            row["vs_tp1"] = (logits["full"] - logits["tp1"]).abs().max().item()
            out[key][label] = row
    return out


def _large_gpt_oss_biases(model, seed: int = 1) -> None:
    """GPT-OSS's biases and sinks set to large random values (seeded): attention q/k/v/o biases, the router's
    bias, gate_up_proj_bias (std 4: both SwiGLU clamps bite), down_proj_bias (std 2) and the sinks (std 2)."""
    g = torch.Generator().manual_seed(seed)

    def fill(t: torch.Tensor, std: float) -> None:
        t.copy_(torch.randn(t.shape, generator=g) * std)

    with torch.no_grad():
        for layer in model.model.layers:
            attn, experts = layer.self_attn, layer.mlp.experts
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
                fill(proj.bias, 1.0)
            fill(attn.sinks, 2.0)
            fill(layer.mlp.router.bias, 1.0)
            fill(experts.gate_up_proj_bias, 4.0)
            fill(experts.down_proj_bias, 2.0)


def _pipeline_logits(model, captured, ids, pos, kind: str, rank: int, size: int, expert_parallel: bool,
                     quantization: str | None = None):
    """(logits, all-reduce count) of the shard pass alone ("alone") or the recommended pipeline ("full", "tp1", with
    `quantization`'s passes) for rank `rank` of `size`, run on a copy of the captured graph."""
    ctx = PassContext(config=model.config, device=CPU, dtype=torch.float32, rank=rank, world_size=size,
                      expert_parallel=expert_parallel, quantization=quantization)
    passes = resolve_passes(SHARD_ALONE) if kind == "alone" else recommended_passes(ctx)
    gm = copy_gm(captured)
    PassManager(passes).run(gm, ctx)
    inputs = ctx.example_inputs(ids, pos)
    inputs["logits_indices"] = torch.arange(ids.shape[-1])
    counts = op_counts(gm)
    if kind != "alone":  # the experts packed where asked (the pass alone leaves fused_moe to route_moe)
        assert counts[mi.fused_moe_mxfp4.default] == (L if quantization else 0), (kind, quantization)
    return run_graph(gm, inputs), counts[mi.all_reduce_sum.default]


@pytest.fixture(scope="module")
def two_rank_errors() -> list[dict]:
    return run_ranks(_errors, 2)


def _check_errors(results: list[dict]) -> None:
    for rank, rows in enumerate(results):
        for label, row in rows.items():
            where = f"rank {rank}, {label}"
            assert row["alone"] <= row["tol"], f"{where}: the pass alone is off by {row['alone']:.2e}"
            assert row["full"] <= row["tol"], f"{where}: the full pipeline is off by {row['full']:.2e}"
            assert row["vs_tp1"] <= row["tol"], f"{where}: TP=2 and TP=1 differ by {row['vs_tp1']:.2e}"
            assert row["alone_all_reduces"] == row["full_all_reduces"] == 2 * L, where
            assert row["tp1_all_reduces"] == 0, where


def test_two_ranks_match_eager_and_tp1(two_rank_errors):
    results = [r["tp"] for r in two_rank_errors]
    assert all(set(rows) == set(VARIANTS) for rows in results)
    _check_errors(results)


def test_two_ranks_expert_parallel_match_eager_and_tp1(two_rank_errors):
    """Expert parallelism: each rank runs its half of the experts whole (the pass alone routes them, since HF's
    experts code cannot run on half of them); both ranks give eager HF's logits and TP=1's."""
    results = [r["ep"] for r in two_rank_errors]
    assert all(set(rows) == set(EP_VARIANTS) for rows in results)
    _check_errors(results)
