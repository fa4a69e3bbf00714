"""FuseKVWrite: per layer, qk_rotary + paged_attention → qk_rotary_kv_write + paged_attention_cached.

Table-driven over the dense tiny presets, one MoE preset and one MLA preset (left alone): after its prerequisites
and in the full pipeline (the CPU pipeline plus this pass, which is on by default only on CUDA), the layers matched,
no qk_rotary / paged_attention left where it matched, the write before the attention in graph order, logits equal
eager HF (references: in the full pipeline also a decode step of two sequences over the keys their prefill wrote;
and the Triton kernels under the interpreter on tiny-qwen3's real graph layouts). A k_rot with another reader is
left alone. Greedy generation through `LLM` (prefix caching, chunked prefill) equals HF.
"""

import functools

import pytest
import torch

from mini_infer.llm import LLM
from mini_infer.passes import PassContext, recommended_passes, resolve_passes
from mini_infer.passes.fuse_kv_write import FuseKVWrite
from mini_infer.passes.manager import PassManager, check_pass_order, propagate_fake, write_graph
from mini_infer.sampling_params import SamplingParams
from tests import _model_cache as mc
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
    graph_logits,
    loaded,
    mi,
    new_context,
    op_counts,
    positions,
    prefill_then_decode,
    random_ids,
    run_passes,
)
from tests.runtime.test_engine import assert_no_leak, hf_ref, random_prompts

L = NUM_LAYERS
PREREQUISITES = ["fuse_rmsnorm", "fuse_rotary", "fuse_qk_rotary", "paged_attention"]
# preset -> layers fused (DeepSeek's MLA has no qk_rotary nor paged_attention: left alone)
EXPECTED = {"tiny-llama": L, "tiny-qwen2": L, "tiny-qwen3": L, "tiny-mistral": L, "tiny-qwen3-moe": L,
            "tiny-deepseek-v2": 0, "tiny-gpt-oss": L}  # (GPT-OSS: with its sinks)


def with_fuse_kv_write(name: str) -> list[str]:
    """The recommended CPU pipeline of `name` (after cleanup) with fuse_kv_write where CUDA runs it."""
    names = [p.name for p in recommended_passes(new_context(name))][1:]
    i = names.index("paged_attention") + 1 if "paged_attention" in names else len(names)
    return [*names[:i], "fuse_kv_write", *names[i:]]


@functools.cache
def full_pipeline_fused(name: str):
    return run_passes(name, with_fuse_kv_write(name))


def _check_graph(name, gm, row):
    fused = EXPECTED[name]
    counts = op_counts(gm)
    assert row.name == "fuse_kv_write" and row.num_matches == fused
    assert counts[mi.qk_rotary_kv_write.default] == counts[mi.paged_attention_cached.default] == fused
    if fused:
        assert counts[mi.qk_rotary.default] == 0 and counts[mi.paged_attention.default] == 0
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    writes = [n for n in gm.graph.nodes if n.target is mi.qk_rotary_kv_write.default]
    attns = [n for n in gm.graph.nodes if n.target is mi.paged_attention_cached.default]
    for write, attn in zip(writes, attns):  # each layer's write comes before its attention, on the same caches
        assert order[write] < order[attn] and write.args[8:10] == attn.args[1:3]
        assert write.args[2].op != "placeholder" and write.args[10].name == "slot_mapping"


@pytest.mark.parametrize("name", list(EXPECTED))
def test_after_prerequisites(name):
    gm, ctx, stats = run_passes(name, [*PREREQUISITES, "fuse_kv_write"])
    _check_graph(name, gm, stats[-1])
    check_against_eager(name, gm, ctx, 7, 3, seed=4)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_in_full_pipeline(name, tmp_path):
    gm, ctx, stats = full_pipeline_fused(name)
    _check_graph(name, gm, next(s for s in stats if s.name == "fuse_kv_write"))
    check_against_eager(name, gm, ctx, 9, 5, seed=1)
    # a decode step of two sequences over the keys their prefill wrote into shuffled blocks (a one-row input
    # attends only to its own key: it cannot tell a k rotated wrongly); eager's rows of the prompt's last token
    # and of the decoded one
    prefilled, decoded, seqs = prefill_then_decode(gm, ctx)
    for i, (ids, pos) in enumerate(seqs):
        want = eager_logits(name, ids, pos)
        assert_logits_close(prefilled[:, i], want[:, -2])
        assert_logits_close(decoded[:, i], want[:, -1])
    if EXPECTED[name]:
        write_graph(gm, tmp_path / "after.txt")
        dump = (tmp_path / "after.txt").read_text()
        assert "torch.ops.mini_infer.qk_rotary_kv_write.default(" in dump
        assert "torch.ops.mini_infer.paged_attention_cached.default(" in dump


def test_graph_validates_on_cuda_fakes():
    gm, _, _ = full_pipeline_fused("tiny-qwen3-moe")
    propagate_fake(copy_gm(gm), "cuda")


def test_triton_kernels_in_the_graph():
    """The graph bound to the Triton launchers (the interpreter here): the one-launch kernel on the graph's real
    layouts (views of the merged qkv projection) gives eager HF's logits, prefill and a one-row step."""
    name = "tiny-qwen3"
    gm, ctx, _ = full_pipeline_fused(name)
    bound, names = bound_copy(gm, "triton")
    assert {"qk_rotary_kv_write_triton", "paged_attention_cached_triton_entry"} <= names
    for num, start in ((6, 0), (1, 17)):
        ids, pos = random_ids(num, num), positions(start, num)
        assert_logits_close(graph_logits(bound, ctx, ids, pos, logits_indices=torch.arange(num)),
                            eager_logits(name, ids, pos))


def test_k_with_another_reader_is_left_alone():
    gm, ctx, _ = run_passes("tiny-qwen3", PREREQUISITES)
    k_rot = next(n for n in gm.graph.nodes if n.name == "k_rot")  # layer 0's
    with gm.graph.inserting_after(k_rot):
        gm.graph.call_function(aten.clone.default, (k_rot,))
    assert FuseKVWrite().apply(gm, ctx).num_matches == L - 1


def test_opt_in():
    """Off by default (no gain on an H200): named, it runs right after paged_attention."""
    ctx = PassContext(config=loaded("tiny-qwen3").config, device=torch.device("cuda"), dtype=torch.bfloat16)
    names = [p.name for p in recommended_passes(ctx)]
    assert "fuse_kv_write" not in names
    assert "fuse_kv_write" not in [p.name for p in recommended_passes(new_context("tiny-qwen3"))]
    check_pass_order(resolve_passes([*names, "fuse_kv_write"]))  # named after the default pipeline: a valid order


def test_generate_with_prefix_cache_and_chunked_prefill(monkeypatch):
    """Through the engine: chunked prefill (8-token steps mixing prefill chunks with decodes) over blocks shared by
    the prefix cache, each step's keys written by qk_rotary_kv_write: greedy ids equal HF's."""
    mc.patch_engine(monkeypatch)
    name = "tiny-qwen3"
    common = random_prompts(1, [16])[0]  # 4 whole blocks shared
    prompts = [common + p for p in random_prompts(2, (5, 11))] + random_prompts(3, (26, 9))
    llm = LLM(name, device="cpu", async_scheduling=False, passes=["cleanup", *with_fuse_kv_write(name)],
              enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=8, num_kv_blocks=64,
              block_size=4)
    bound_ops = [n.meta.get("op") for n in llm.engine.compiled.graph_module.graph.nodes]
    assert bound_ops.count(mi.qk_rotary_kv_write.default) == bound_ops.count(mi.paged_attention_cached.default) == L
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], greedy, use_tqdm=False)  # its full blocks stay cached
    hits = llm.engine.block_manager.prefix_cache_hits
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    assert llm.engine.block_manager.prefix_cache_hits - hits >= 4 * 2
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf_ref(name, tuple(p), 12) for p in prompts]
    assert_no_leak(llm.engine)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_fp8_cache_logits_bitwise_as_unfused(backend):
    """An fp8 KV cache (the scales reach the write as they reached the attention): the graph with the pass gives
    the logits of the graph without it bit for bit, on the references and on the Triton kernels (interpreter)."""
    name = "tiny-qwen3"
    ids, pos = random_ids(10, 7), positions(3, 10)
    logits = []
    for passes in (PREREQUISITES, [*PREREQUISITES, "fuse_kv_write"]):
        gm = copy_gm(_cleaned(name))
        ctx = PassContext(config=loaded(name).config, device=CPU, dtype=torch.float32, applied=["cleanup"],
                          kv_cache_dtype=torch.float8_e4m3fn)
        stats = PassManager(resolve_passes(passes)).run(gm, ctx)
        bound, _ = bound_copy(gm, backend)
        logits.append(graph_logits(bound, ctx, ids, pos))
    assert stats[-1].num_matches == L and "k_scale_0" in {a.name for a in gm.graph.find_nodes(
        op="call_function", target=mi.qk_rotary_kv_write.default)[0].all_input_nodes}
    assert torch.equal(logits[0], logits[1])
