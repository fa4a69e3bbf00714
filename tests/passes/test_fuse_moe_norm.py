"""FuseMoeNorm: a MoE block's routed output feeding only the residual add + next norm → fused_moe_add_rms_norm.

Qwen3-MoE and Mixtral: each layer's fused_moe (through HF's reshape back to [1, T, H]) fuses into the norm after it
(the next layer's input norm, then the final norm): with its prerequisites alone and at the end of the recommended
pipeline, node counts asserted, logits equal eager HF (references); bound to the Triton kernels (interpreter) at a
step with a slot sum (the fused kernel's case) and at one row (tiny presets' 2 pairs: fused_moe's GEMV path, the
unfused kernels), logits equal the reference-bound graph's. Qwen2-MoE and DeepSeek (a shared expert's output is
added to the routed one first) are left unchanged. An experts output with a second reader is left alone. Default:
on for MoE models on CUDA targets only, after fuse_gemv_norm.
"""

import pytest
import torch

from mini_infer.ops import fused_moe_add_rms_norm as fused_moe_add_rms_norm_mod
from mini_infer.passes import PassContext, recommended_passes
from mini_infer.passes.fuse_moe_norm import FuseMoeNorm
from tests.passes.helpers import (
    CPU,
    NUM_LAYERS,
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

L = NUM_LAYERS
PREREQUISITES = ["fuse_rmsnorm", "route_moe"]
FUSED = {"tiny-qwen3-moe": L, "tiny-mixtral": L}  # every MoE layer
UNCHANGED = ("tiny-qwen2-moe", "tiny-deepseek-v2", "tiny-deepseek-v3")  # shared experts added before the norm


def _check_graph(name, gm, row, before):
    fused = FUSED.get(name, 0)
    counts = op_counts(gm)
    assert row.num_matches == fused
    assert counts[mi.fused_moe_add_rms_norm.default] == fused
    assert counts[mi.fused_moe.default] == before[mi.fused_moe.default] - fused
    assert counts[mi.fused_add_rms_norm.default] == before[mi.fused_add_rms_norm.default] - fused
    config = loaded(name).config
    for node in gm.graph.nodes:
        if node.target is mi.fused_moe_add_rms_norm.default:
            hidden, w, ids, w13, w2, residual, norm_w, eps, act, emap = node.args
            assert eps == config.rms_norm_eps and norm_w.op == w13.op == w2.op == "get_attr" and emap is None
            assert act == "silu" and residual.meta["val"].shape[-1] == config.hidden_size


@pytest.mark.parametrize("name", [*FUSED, *UNCHANGED])
def test_alone(name):
    before = op_counts(run_passes(name, PREREQUISITES)[0])
    gm, ctx, stats = run_passes(name, [*PREREQUISITES, "fuse_moe_norm"])
    _check_graph(name, gm, stats[-1], before)
    if name in FUSED:
        assert stats[-1].note == f"{L} MoE outputs + norm"
        check_against_eager(name, gm, ctx, 7, 3, seed=3)
        check_against_eager(name, gm, ctx, 1, 20, seed=4)


def _pipeline(name, with_pass=True):
    """The recommended pipeline (a CPU context, which leaves the pass out; cleanup aside, as run_passes starts from
    it), with fuse_moe_norm named at its end or not."""
    passes = recommended_passes(new_context(name))[1:]
    return run_passes(name, [*passes, "fuse_moe_norm"] if with_pass else passes)


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-mixtral", "tiny-qwen2-moe"])
def test_last_in_full_pipeline(name):
    before = op_counts(_pipeline(name, with_pass=False)[0])
    gm, ctx, stats = _pipeline(name)
    assert stats[-1].name == "fuse_moe_norm"
    _check_graph(name, gm, stats[-1], before)
    check_against_eager(name, gm, ctx, 9, 5, seed=1)
    check_against_eager(name, gm, ctx, 1, 30, seed=2)  # one row: a decode step


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU graph under the interpreter; on a GPU: bench/gpu_check.py")
@pytest.mark.parametrize("num", [3, 1], ids=["slot_sum", "gemv_path"])
def test_triton_kernels_in_the_graph(num, monkeypatch):
    """The full pipeline's graph bound to the Triton launchers (interpreter): a 3-row step (6 pairs: the grouped
    GEMMs and the fused slot-sum + norm kernel) and a one-row step (2 pairs: fused_moe's GEMV path, then the unfused
    norm) give the reference-bound graph's logits and eager HF's."""
    name = "tiny-qwen3-moe"
    gm, ctx, _ = _pipeline(name)
    ids, pos = random_ids(num, 6), positions(4, num)
    unfused, real = [], fused_moe_add_rms_norm_mod.fused_add_rms_norm_triton
    monkeypatch.setattr(fused_moe_add_rms_norm_mod, "fused_add_rms_norm_triton",
                        lambda *a: unfused.append(1) or real(*a))
    outs = {}
    for backend in ("reference", "triton"):
        bound, names = bound_copy(gm, backend)
        assert f"fused_moe_add_rms_norm_{backend}" in names
        outs[backend] = graph_logits(bound, ctx, ids, pos, logits_indices=torch.arange(num))
    assert len(unfused) == (0 if num > 1 else L)  # the unfused norm after the GEMV path only
    assert_logits_close(outs["triton"], outs["reference"])
    assert_logits_close(outs["triton"], eager_logits(name, ids, pos))


def test_second_reader_is_left_alone():
    """An experts output read by something else too (here a clone) keeps its fused_moe and norm; the other layer
    still fuses."""
    name = "tiny-qwen3-moe"
    gm, ctx, _ = run_passes(name, PREREQUISITES)
    moe = next(n for n in gm.graph.nodes if n.target is mi.fused_moe.default)
    with gm.graph.inserting_after(moe):
        gm.graph.call_function(aten.clone.default, (moe,))
    result = FuseMoeNorm().apply(gm, ctx)
    assert result.num_matches == L - 1
    assert moe in gm.graph.nodes and op_counts(gm)[mi.fused_moe_add_rms_norm.default] == L - 1


def test_default_on_cuda_for_moe_models_only():
    for name, device, on in (("tiny-qwen3-moe", torch.device("cuda"), True), ("tiny-qwen3-moe", CPU, False),
                             ("tiny-llama", torch.device("cuda"), False)):
        ctx = PassContext(config=loaded(name).config, device=device, dtype=torch.float32)
        names = [p.name for p in recommended_passes(ctx)]
        assert ("fuse_moe_norm" in names) == on
        if on:
            assert names.index("fuse_moe_norm") == names.index("fuse_gemv_norm") + 1
