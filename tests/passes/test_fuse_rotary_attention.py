"""FuseRotaryAttention: per layer, qk_rotary + paged_attention → rotary_paged_attention.

Table-driven over the dense tiny presets, one MoE preset and one MLA preset (left alone): after its prerequisites
and in the recommended pipeline as CUDA runs it (where it is on by default), the layers matched, no qk_rotary /
paged_attention left where it matched, the node count (each layer: the pair, the rotary's two outputs and the
packing views of q, k and v, 9 nodes, become one), logits equal eager HF (references). On tiny-qwen3's real graph
layouts (views of the merged qkv projection) the Triton kernels under the interpreter give the logits of the
pipeline without the pass bit for bit, a decode step (the attention launch applying the rotary) and a prefill; with
an fp8 KV cache too. A q_rot or k_rot with another reader is left alone. Off on CPU, on for CUDA after
paged_attention and before fuse_kv_write.
"""

import functools

import pytest
import torch

from mini_infer.passes import PassContext, recommended_passes, resolve_passes
from mini_infer.passes.fuse_rotary_attention import FuseRotaryAttention
from mini_infer.passes.manager import PassManager, propagate_fake, write_graph
from tests.passes.helpers import (
    CPU,
    NUM_LAYERS,
    _cleaned,
    assert_logits_close,
    aten,
    bound_copy,
    check_against_eager,
    copy_gm,
    eager_logits,
    loaded,
    mi,
    op_counts,
    prefill_then_decode,
    run_passes,
)
from tests.passes.test_fuse_kv_write import EXPECTED, PREREQUISITES  # the same pairs, the same presets

L = NUM_LAYERS
NODES_PER_LAYER = 9  # qk_rotary, its 2 getitems, select + transpose of q, k and v, paged_attention → 1 node


def cuda_names(name: str, without: tuple[str, ...] = ()) -> list[str]:
    """The recommended pipeline of `name` for a CUDA target (after cleanup), less `without`."""
    ctx = PassContext(config=loaded(name).config, device=torch.device("cuda"), dtype=torch.float32)
    return [p.name for p in recommended_passes(ctx)[1:] if p.name not in without]


@functools.cache
def cuda_pipeline(name: str, without: tuple[str, ...] = ()):
    return run_passes(name, cuda_names(name, without))


def _check_graph(name, gm, row):
    fused = EXPECTED[name]
    counts = op_counts(gm)
    assert row.name == "fuse_rotary_attention" and row.num_matches == fused
    assert row.nodes_before - row.nodes_after == NODES_PER_LAYER * fused
    assert counts[mi.rotary_paged_attention.default] == fused
    if fused:
        assert counts[mi.qk_rotary.default] == 0 and counts[mi.paged_attention.default] == 0
        for node in gm.graph.find_nodes(op="call_function", target=mi.rotary_paged_attention.default):
            q, k, v = node.args[:3]
            assert all(x.meta["val"].dim() == 4 for x in (q, k, v)) and node.args[10].name == "slot_mapping"


@pytest.mark.parametrize("name", list(EXPECTED))
def test_after_prerequisites(name):
    gm, ctx, stats = run_passes(name, [*PREREQUISITES, "fuse_rotary_attention"])
    _check_graph(name, gm, stats[-1])
    check_against_eager(name, gm, ctx, 7, 3, seed=4)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_in_cuda_pipeline(name, tmp_path):
    gm, ctx, stats = cuda_pipeline(name)
    _check_graph(name, gm, next(s for s in stats if s.name == "fuse_rotary_attention"))
    check_against_eager(name, gm, ctx, 9, 5, seed=1)
    _, decoded, seqs = prefill_then_decode(gm, ctx)  # a decode step over cached keys
    for i, (ids, pos) in enumerate(seqs):
        assert_logits_close(decoded[:, i], eager_logits(name, ids, pos)[:, -1])
    if not EXPECTED[name]:  # MLA: mla_latent_cache's op, as it was
        assert op_counts(gm)[mi.mla_attention.default] == L
    else:
        write_graph(gm, tmp_path / "after.txt")
        assert "torch.ops.mini_infer.rotary_paged_attention.default(" in (tmp_path / "after.txt").read_text()


def test_graph_validates_on_cuda_fakes():
    gm, _, _ = cuda_pipeline("tiny-qwen3-moe")
    propagate_fake(copy_gm(gm), "cuda")


def test_triton_kernels_in_the_graph_bitwise_as_unfused():
    """The graphs bound to the Triton launchers (the interpreter here), on the graph's real layouts: a prefill (the
    unfused kernels) and a decode step over its keys (one launch a layer) give the logits of the pipeline without
    the pass."""
    name = "tiny-qwen3"
    fused, ctx, _ = cuda_pipeline(name)
    unfused, _, _ = cuda_pipeline(name, ("fuse_rotary_attention",))
    bound, names = bound_copy(fused, "triton")
    assert "rotary_paged_attention_triton_entry" in names
    bound_unfused, _ = bound_copy(unfused, "triton")
    got, want = (prefill_then_decode(gm, ctx)[:2] for gm in (bound, bound_unfused))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("reader", ["q_rot", "k_rot"])
def test_rotary_output_with_another_reader_is_left_alone(reader):
    gm, ctx, _ = run_passes("tiny-qwen3", PREREQUISITES)
    node = next(n for n in gm.graph.nodes if n.name == reader)  # layer 0's
    with gm.graph.inserting_after(node):
        gm.graph.call_function(aten.clone.default, (node,))
    assert FuseRotaryAttention().apply(gm, ctx).num_matches == L - 1


def test_default_on_cuda_only():
    names = cuda_names("tiny-qwen3")
    assert names.index("paged_attention") < names.index("fuse_rotary_attention")
    cpu_ctx = PassContext(config=loaded("tiny-qwen3").config, device=CPU, dtype=torch.float32)
    assert "fuse_rotary_attention" not in [p.name for p in recommended_passes(cpu_ctx)]
    # named with fuse_kv_write, in registration order: this pass takes the pairs, fuse_kv_write finds none
    gm, _, stats = run_passes("tiny-qwen3", [*PREREQUISITES, "fuse_rotary_attention", "fuse_kv_write"])
    assert [s.num_matches for s in stats[-2:]] == [L, 0]


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_fp8_cache_logits_bitwise_as_unfused(backend):
    """An fp8 KV cache (the scales reach the op as they reached the attention): the graph with the pass gives the
    logits of the graph without it bit for bit, a prefill and a decode step over its keys."""
    name = "tiny-qwen3"
    bound = []
    for passes in (PREREQUISITES, [*PREREQUISITES, "fuse_rotary_attention"]):
        gm = copy_gm(_cleaned(name))
        ctx = PassContext(config=loaded(name).config, device=CPU, dtype=torch.float32, applied=["cleanup"],
                          kv_cache_dtype=torch.float8_e4m3fn)
        stats = PassManager(resolve_passes(passes)).run(gm, ctx)
        bound.append(bound_copy(gm, backend)[0])
    assert stats[-1].num_matches == L and "k_scale_0" in {a.name for a in gm.graph.find_nodes(
        op="call_function", target=mi.rotary_paged_attention.default)[0].all_input_nodes}
    got, want = (prefill_then_decode(gm, ctx)[:2] for gm in bound)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
