"""FuseRouterTopk: a MoE router's linear whose logits only moe_topk reads → linear_moe_topk.

Softmax routers (Qwen3-MoE, Mixtral, Qwen2-MoE, DeepSeek-V2): every MoE layer's router fuses with the pass's
prerequisites alone, and at the end of the recommended pipeline (with fuse_moe_norm too) except Qwen2-MoE's, which
merge_projections merged with the shared expert's gate; DeepSeek-V3 (sigmoid) is left unchanged. Node counts
asserted, logits equal eager HF (references); bound to the Triton kernels (interpreter), a one-row step (the fused
launch) and a three-row one (the unfused kernels) give the reference-bound graph's logits. Logits with a second reader are left alone.
Default: on for MoE models on CUDA targets only, after fuse_moe_norm.
"""

import pytest
import torch

from mini_infer.ops import linear_moe_topk as linear_moe_topk_mod
from mini_infer.passes import PassContext, recommended_passes
from mini_infer.passes.fuse_router_topk import FuseRouterTopk
from tests.passes.helpers import (
    CPU,
    assert_logits_close,
    aten,
    bound_copy,
    check_against_eager,
    eager_logits,
    graph_logits,
    loaded,
    mi,
    new_context,
    op_counts,
    positions,
    random_ids,
    run_passes,
)

PREREQUISITES = ["route_moe", "gemv_linear"]
# routers fused alone: every MoE layer's (DeepSeek-V2: one dense first layer), none of the sigmoid DeepSeek-V3
FUSED = {"tiny-qwen3-moe": 2, "tiny-mixtral": 2, "tiny-deepseek-v2": 1, "tiny-qwen2-moe": 2, "tiny-deepseek-v3": 0}
# in the pipeline, merge_projections has merged Qwen2-MoE's router with its shared expert's gate: left alone
IN_PIPELINE = {"tiny-qwen3-moe": 2, "tiny-deepseek-v2": 1, "tiny-qwen2-moe": 0}


def _check_graph(name, gm, row, before, fused):
    counts = op_counts(gm)
    assert row.num_matches == fused and row.note == (f"{fused} router{'s' if fused != 1 else ''}" if fused else "")
    assert counts[mi.linear_moe_topk.default] == fused
    assert counts[mi.moe_topk.default] == before[mi.moe_topk.default] - fused
    assert counts[mi.linear.default] == before[mi.linear.default] - fused
    config = loaded(name).config
    for node in gm.graph.nodes:
        if node.target is mi.linear_moe_topk.default:
            x, w, b, top_k, scoring = node.args[:5]
            assert w.op == "get_attr" and b is None and top_k == config.num_experts_per_tok and scoring == "softmax"


@pytest.mark.parametrize("name", FUSED)
def test_alone(name):
    before = op_counts(run_passes(name, PREREQUISITES)[0])
    gm, ctx, stats = run_passes(name, [*PREREQUISITES, "fuse_router_topk"])
    _check_graph(name, gm, stats[-1], before, FUSED[name])
    if FUSED[name]:
        check_against_eager(name, gm, ctx, 7, 3, seed=3)
        check_against_eager(name, gm, ctx, 1, 20, seed=4)


def _pipeline(name, with_passes=True):
    """The recommended pipeline (a CPU context, which leaves both MoE fusions out; cleanup aside), with fuse_moe_norm
    and fuse_router_topk named at its end or not."""
    passes = recommended_passes(new_context(name))[1:]
    return run_passes(name, [*passes, "fuse_moe_norm", "fuse_router_topk"] if with_passes else passes)


@pytest.mark.parametrize("name", IN_PIPELINE)
def test_last_in_full_pipeline(name):
    before = op_counts(_pipeline(name, with_passes=False)[0])
    gm, ctx, stats = _pipeline(name)
    assert [s.name for s in stats[-2:]] == ["fuse_moe_norm", "fuse_router_topk"]
    _check_graph(name, gm, stats[-1], before, IN_PIPELINE[name])
    check_against_eager(name, gm, ctx, 9, 5, seed=1)
    check_against_eager(name, gm, ctx, 1, 30, seed=2)  # one row: a decode step


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU graph under the interpreter; on a GPU: bench/gpu_check.py")
@pytest.mark.parametrize("num", [1, 3], ids=["one_launch", "several_rows"])
def test_triton_kernels_in_the_graph(num, monkeypatch):
    """Both MoE fusions in the graph, bound to the Triton launchers (interpreter): a one-row step runs the fused router
    launch, a three-row one the unfused kernels; both give the reference-bound graph's logits and eager HF's."""
    name = "tiny-qwen3-moe"
    gm, ctx, _ = _pipeline(name)
    ids, pos = random_ids(num, 8), positions(6, num)
    unfused, real = [], linear_moe_topk_mod.moe_topk_triton
    monkeypatch.setattr(linear_moe_topk_mod, "moe_topk_triton", lambda *a: unfused.append(1) or real(*a))
    outs = {}
    for backend in ("reference", "triton"):
        bound, names = bound_copy(gm, backend)
        assert {f"linear_moe_topk_{backend}", f"fused_moe_add_rms_norm_{backend}"} <= names
        outs[backend] = graph_logits(bound, ctx, ids, pos, logits_indices=torch.arange(num))
    assert len(unfused) == (0 if num == 1 else FUSED[name])
    assert_logits_close(outs["triton"], outs["reference"])
    assert_logits_close(outs["triton"], eager_logits(name, ids, pos))


def test_second_reader_is_left_alone():
    """Router logits read by something else too (here a clone) keep their linear and moe_topk; the other layer still
    fuses."""
    gm, ctx, _ = run_passes("tiny-qwen3-moe", PREREQUISITES)
    topk = next(n for n in gm.graph.nodes if n.target is mi.moe_topk.default)
    with gm.graph.inserting_after(topk):
        gm.graph.call_function(aten.clone.default, (topk.args[0],))
    assert FuseRouterTopk().apply(gm, ctx).num_matches == 1
    assert topk in gm.graph.nodes and op_counts(gm)[mi.linear_moe_topk.default] == 1


def test_default_on_cuda_for_moe_models_only():
    for name, device, on in (("tiny-mixtral", torch.device("cuda"), True), ("tiny-mixtral", CPU, False),
                             ("tiny-qwen3", torch.device("cuda"), False)):
        ctx = PassContext(config=loaded(name).config, device=device, dtype=torch.float32)
        names = [p.name for p in recommended_passes(ctx)]
        assert ("fuse_router_topk" in names) == on
        if on:
            assert names.index("fuse_router_topk") == names.index("fuse_moe_norm") + 1
