"""MlaLatentCache: DeepSeek-V2/V3 attention → mini_infer.mla_attention over a paged latent cache.

Checked on tiny-deepseek-v2 (no q_lora_rank) and tiny-deepseek-v3 (q_lora_rank, interleaved rotary): the graph
(one match per layer, no SDPA or kv_b_proj left, kv_b_proj's weight replaced by w_uk / w_uv, the latent caches
and metadata declared, kv_a_layernorm fused in the full pipeline), logits equal eager HF alone and in the full
pipeline (one sequence at new token counts and positions; prefill then decode or a chunk over one cache; the
Triton kernels bound in the graph, under the interpreter; a packed step mixing a decode, a prefill and a chunk is
test_paged_attention's mixed-batch test), config variants (V3 with neox rotary; V2 with q_lora_rank, YaRN with an
attention factor and attention_bias), refusals naming the field, and through the engine: greedy == HF with prefix
caching, chunked prefill (8-token steps), preemption and the padded (CUDA-graph) path, with cache bytes per token
read from the allocated tensors and the start-up log.
"""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
from hypothesis import given

from mini_infer.compiler import compile_model
from mini_infer.contract import LatentAttentionSpec
from mini_infer.ops.mla_attention import absorption_weights
from mini_infer.passes import PassContext, recommended_passes
from mini_infer.passes.manager import PassError, PassManager
from mini_infer.passes.mla_latent_cache import MlaLatentCache
from mini_infer.passes.pattern import is_op
from mini_infer.runtime.engine import EngineConfig, LLMEngine
from mini_infer.sampling_params import SamplingParams
from tests import _model_cache as mc
from tests.passes.helpers import (
    CACHE_BLOCK,
    CPU,
    FEW,
    METADATA_INPUTS,
    NUM_LAYERS,
    PagedCache,
    assert_logits_close,
    aten,
    bound_copy,
    check_against_eager,
    copy_gm,
    eager_logits,
    full_pipeline,
    loaded,
    mi,
    num_tokens,
    op_counts,
    placeholder_names,
    positions,
    random_ids,
    run_graph,
    run_passes,
    single_pass,
    start_pos,
    step_inputs,
    variant_model,
)
from tests.runtime.test_engine import assert_no_leak, hf_ref, random_prompts, record_schedules, run

MLA = ("tiny-deepseek-v2", "tiny-deepseek-v3")
L = NUM_LAYERS
H, DC, DR, DN, DV = 4, 32, 8, 16, 16  # heads, kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim
LATENT_BYTES = (DC + DR) * 4 * L  # fp32, every layer
FULL_BYTES = H * (DN + DR + DV) * 4 * L  # what per-head K/V (paged_attention) would hold


# -- the graph ------------------------------------------------------------------------------------------------


def _check_graph(name, gm, ctx, num_matches, note):
    counts = op_counts(gm)
    assert num_matches == L
    assert counts[mi.mla_attention.default] == L
    assert counts[mi.apply_rotary_interleaved.default] == 2 * L  # q_pe and k_pe of every layer
    assert counts[aten.scaled_dot_product_attention.default] == 0
    names = placeholder_names(gm)
    assert [n for n in names if n not in ("input_ids", "position_ids", "logits_indices")] == [
        *METADATA_INPUTS, *(f"latent_cache_{i}" for i in range(L))]
    assert [type(s) for s in ctx.cache_specs] == [LatentAttentionSpec] * L
    assert [(s.layer_idx, s.kv_lora_rank, s.qk_rope_head_dim, s.dtype) for s in ctx.cache_specs] == [
        (i, DC, DR, torch.float32) for i in range(L)]
    assert {ctx.declared_by[f"latent_cache_{i}"] for i in range(L)} == {"mla_latent_cache"}
    # kv_b_proj's weight has one owner: the absorbed w_uk / w_uv, equal to its rearrangement
    weights = dict(gm.named_parameters()) | dict(gm.named_buffers())
    assert not [n for n in weights if "kv_b_proj.weight" in n]
    hf = loaded(name).model.model.layers
    for i in range(L):
        w_uk, w_uv = absorption_weights(hf[i].self_attn.kv_b_proj.weight, H, DN, DV)
        prefix = f"model_model_layers_{i}_self_attn_kv_b_proj"
        assert torch.equal(weights[f"{prefix}_w_uk"], w_uk) and torch.equal(weights[f"{prefix}_w_uv"], w_uv)
    mla = [n for n in gm.graph.nodes if n.target is mi.mla_attention.default]
    assert [n.args[4].name for n in mla] == [f"latent_cache_{i}" for i in range(L)]
    assert [n.args[11] for n in mla] == pytest.approx([(DN + DR) ** -0.5] * L)  # HF's scaling, from its SDPA
    assert f"KV cache {LATENT_BYTES} B/token" in note and f"instead of {FULL_BYTES} B/token" in note


@pytest.mark.parametrize("name", MLA)
def test_graph_alone(name):
    gm, ctx, stats = single_pass(name, "mla_latent_cache")
    _check_graph(name, gm, ctx, stats[0].num_matches, stats[0].note)


@pytest.mark.parametrize("name", MLA)
def test_graph_in_full_pipeline(name):
    gm, ctx, stats = full_pipeline(name)
    rows = {s.name: s for s in stats}
    assert list(rows).index("mla_latent_cache") == list(rows).index("paged_attention") - 1
    assert rows["paged_attention"].num_matches == 0 and "paged_attention" not in ctx.declared_by.values()
    _check_graph(name, gm, ctx, rows["mla_latent_cache"].num_matches, rows["mla_latent_cache"].note)
    # kv_a_layernorm (and q_a_layernorm for V3) stayed graph nodes: fuse_rmsnorm fused them; each latent the op
    # gets is one of those norms' outputs
    norms = [n for n in gm.graph.nodes if n.target is mi.rms_norm.default]
    for mla in (n for n in gm.graph.nodes if n.target is mi.mla_attention.default):
        latent = mla.args[2]
        while is_op(latent, aten.view.default, aten.reshape.default):
            latent = latent.args[0]
        assert latent in norms
    # layer 0's input norm, kv_a (and q_a) norms; fuse_norm_gemv folds those read by one linear (q_a into q_b_proj)
    folded = op_counts(gm)[mi.rms_norm_linear.default]
    assert len(norms) + folded == 1 + L * (2 if name == "tiny-deepseek-v3" else 1)


def test_default_pipeline_only_for_mla_configs():
    for name, has in (("tiny-llama", False), ("tiny-deepseek-v2", True), ("tiny-deepseek-v3", True)):
        ctx = PassContext(config=loaded(name).config, device=CPU, dtype=torch.float32)
        assert ("mla_latent_cache" in [p.name for p in recommended_passes(ctx)]) is has


# -- logits against eager HF ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", MLA)
@given(num=num_tokens, start=start_pos)
@FEW
def test_alone_equals_eager(name, num, start):
    gm, ctx, _ = single_pass(name, "mla_latent_cache")
    check_against_eager(name, gm, ctx, num, start, seed=num + 11 * start)


@pytest.mark.parametrize("name", MLA)
@given(num=num_tokens, start=start_pos)
@FEW
def test_full_pipeline_equals_eager(name, num, start):
    gm, ctx, _ = full_pipeline(name)
    check_against_eager(name, gm, ctx, num, start, seed=3 * num + start)


def _step(cache, ids, pos, chunks, tables):
    """Inputs for one step (`chunks` = [(context before, new tokens)] per sequence), logits at every row."""
    return {**step_inputs(ids, pos, chunks, tables, cache), "logits_indices": torch.arange(ids.shape[1])}


@pytest.mark.parametrize("name", MLA)
@pytest.mark.parametrize("prompt,new", [(13, 1), (6, 5)])  # then a decode (absorbed) or a chunk (expanded)
def test_two_steps_share_the_latent_cache(name, prompt, new):
    gm, ctx, _ = single_pass(name, "mla_latent_cache")
    total = prompt + new
    ids, pos = random_ids(total, seed=prompt * 5 + new), positions(7, total)
    cache = PagedCache(ctx, math.ceil(total / CACHE_BLOCK) + 2, seed=total)
    assert sorted(cache.caches) == [f"latent_cache_{i}" for i in range(L)]
    table = cache.table(total)
    first = run_graph(gm, _step(cache, ids[:, :prompt], pos[:, :prompt], [(0, prompt)], [table]))
    second = run_graph(gm, _step(cache, ids[:, prompt:], pos[:, prompt:], [(prompt, new)], [table]))
    assert_logits_close(first, eager_logits(name, ids[:, :prompt], pos[:, :prompt]))
    assert_logits_close(second, eager_logits(name, ids, pos)[:, prompt:])
    written = torch.cat([c.view(-1, DC + DR)[[table[p // CACHE_BLOCK] * CACHE_BLOCK + p % CACHE_BLOCK for p in range(total)]]
                         for c in cache.caches.values()])
    assert torch.isfinite(written).all()


# -- config variants: handled, or refused naming the field ---------------------------------------------------


# mscale != mscale_all_dim: the cos/sin tables carry an attention factor, the scaling an mscale
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=256, beta_fast=32.0, beta_slow=1.0,
            mscale=1.0, mscale_all_dim=0.707)


@pytest.mark.parametrize("preset,fields,rotary", [
    ("tiny-deepseek-v3", dict(rope_interleave=False), mi.apply_rotary.default),  # neox halves
    ("tiny-deepseek-v2", dict(q_lora_rank=24, rope_theta=10000.0, rope_scaling=YARN, attention_bias=True),
     mi.apply_rotary_interleaved.default),
])
def test_config_variants_equal_eager(preset, fields, rotary):
    model = variant_model(preset, **fields)
    cm = compile_model(model, passes=["cleanup", "mla_latent_cache"], device=CPU)
    (row,) = [s for s in cm.stats if s.name == "mla_latent_cache"]
    bound = [n.meta.get("op") for n in cm.graph_module.graph.nodes]  # the ops, before bind_kernels
    assert row.num_matches == L and bound.count(rotary) == 2 * L
    for num, start in ((1, 0), (21, 300)):  # past YaRN's original 256 positions
        ids, pos = random_ids(num, seed=num), positions(start, num)
        with torch.no_grad():
            ref = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        assert_logits_close(cm(**cm.example_inputs(ids, pos)), ref)


def _run_pass(name, config=None, **ctx_fields):
    gm = copy_gm(single_pass(name, "fuse_rmsnorm")[0])  # cleaned, no attention pass yet
    ctx = PassContext(config=config or loaded(name).config, device=CPU, dtype=torch.float32,
                      applied=["cleanup", "fuse_rmsnorm"], **ctx_fields)
    PassManager([MlaLatentCache()]).run(gm, ctx)


@pytest.mark.parametrize("field,value,message", [
    ("rope_parameters", dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0), "rope_type='dynamic'"),
    ("qk_rope_head_dim", 7, "qk_rope_head_dim=7 is odd"),
    ("kv_lora_rank", 0, "kv_lora_rank=0"),
])
def test_unsupported_config_is_refused(field, value, message):
    config = copy.deepcopy(loaded("tiny-deepseek-v3").config)
    setattr(config, field, value)
    with pytest.raises(PassError, match=message):
        _run_pass("tiny-deepseek-v3", config)


def test_fp8_cache_is_refused():
    with pytest.raises(PassError, match="kv_cache_dtype=torch.float8_e4m3fn"):
        _run_pass("tiny-deepseek-v2", kv_cache_dtype=torch.float8_e4m3fn)


def test_rewritten_kv_b_proj_is_refused():
    """A kv_b_proj that an earlier pass turned into another op (e.g. quantized): no absorbed weights to build."""
    gm = copy_gm(single_pass("tiny-deepseek-v2", "fuse_rmsnorm")[0])
    for n in gm.graph.nodes:
        if is_op(n, aten.linear.default) and "kv_b_proj" in str(n.args[1].target):
            n.target = mi.linear.default
    ctx = PassContext(config=loaded("tiny-deepseek-v2").config, device=CPU, dtype=torch.float32,
                      applied=["cleanup", "fuse_rmsnorm"])
    with pytest.raises(PassError, match="kv_b_proj"):
        PassManager([MlaLatentCache()]).run(gm, ctx)


def test_no_mla_no_match():
    gm, ctx, stats = run_passes("tiny-llama", ["mla_latent_cache"])
    assert stats[0].num_matches == 0 and not ctx.cache_specs and placeholder_names(gm) == [
        "input_ids", "position_ids"]


# -- through the engine ---------------------------------------------------------------------------------------

NEW = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


def _engine(name, **kw):
    kw.setdefault("num_kv_blocks", 64)
    kw.setdefault("block_size", CACHE_BLOCK)
    return LLMEngine(EngineConfig(model=name, device="cpu", async_scheduling=False, **kw), loaded=mc.loaded(name),
                     compiled=mc.compiled(name))


def _assert_greedy_matches(name, prompts, outs):
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_ref(name, tuple(p), NEW), f"{name}: prompt of {len(p)} tokens"


@pytest.mark.parametrize("name", MLA)
def test_engine_cache_bytes_summary_and_startup_log(name, caplog):
    with caplog.at_level(logging.INFO, logger="mini_infer"):
        engine = _engine(name)
    tensors = engine.kv_cache.tensors
    assert sorted(tensors) == [f"latent_cache_{i}" for i in range(L)]
    per_token = sum(t[0, 0].numel() * t.element_size() for t in tensors.values())
    assert per_token == (DC + DR) * 4 * L == engine.memory.kv_bytes_per_token
    assert all(t.shape == (64, CACHE_BLOCK, DC + DR) for t in tensors.values())
    summary = engine.compiled.summary()  # the pass's note (before and after) and the caches the graph declared
    assert f"caches: {per_token} bytes per token over {L} layer caches" in summary
    assert f"KV cache {per_token} B/token" in summary and f"instead of {FULL_BYTES} B/token" in summary
    logged = caplog.text
    assert f"{64 * CACHE_BLOCK} tokens, {per_token} bytes per token" in logged
    assert f"mla_latent_cache: {L} layers; KV cache {per_token} B/token" in logged and str(FULL_BYTES) in logged


@pytest.mark.parametrize("name", MLA)
def test_engine_greedy_with_prefix_cache_and_chunked_prefill(name):
    common = random_prompts(1, [16])[0]  # 4 whole blocks
    prompts = [common + s for s in random_prompts(2, (0, 5, 11))] + random_prompts(3, (3, 26))
    engine = _engine(name, enable_prefix_caching=True, max_num_batched_tokens=8, enable_chunked_prefill=True)
    log = record_schedules(engine)
    run(engine, [prompts[1]], GREEDY, prefix="warm")  # its full blocks stay cached
    hits = engine.block_manager.prefix_cache_hits
    outs = run(engine, prompts, GREEDY)
    _assert_greedy_matches(name, prompts, outs)
    assert engine.block_manager.prefix_cache_hits - hits >= 12 * 3
    assert all(sum(n for n, *_ in step) <= 8 for step in log)
    assert any(0 < before < plen and n > 0 for step in log for n, plen, before, _ in step)  # a prompt was split
    assert any(any(before >= plen for _, plen, before, _ in step)  # a decode beside a prefill chunk
               and any(before < plen for _, plen, before, _ in step) for step in log)
    assert_no_leak(engine)


@pytest.mark.parametrize("name", MLA)
def test_engine_greedy_under_preemption(name):
    prompts = random_prompts(4, (30, 9, 22, 14))
    engine = _engine(name, num_kv_blocks=14)  # 56 tokens: the longest sequence (40) fits alone, the batch not
    outs = run(engine, prompts, GREEDY)
    assert engine.stats["preemptions"] > 0
    _assert_greedy_matches(name, prompts, outs)
    assert_no_leak(engine)


def test_engine_padded_graph_path():
    """The CUDA-graph runner's padded buffers (run eagerly on a CPU): padding rows and sequences reach the op."""
    name = "tiny-deepseek-v2"
    engine = _engine(name, max_num_seqs=4, max_num_batched_tokens=16)
    engine.runner.enable_cuda_graphs(4, engine.max_model_len, 16, force=True)
    shapes = []
    real_run = engine.runner.cuda_graphs.run
    engine.runner.cuda_graphs.run = lambda inputs, plan, shape: shapes.append(shape) or real_run(inputs, plan, shape)
    prompts = random_prompts(5, (5, 19, 2))
    outs = run(engine, prompts, GREEDY)
    assert (16, 4) in shapes and any(s[0] == s[1] for s in shapes)  # mixed and decode buckets both ran
    _assert_greedy_matches(name, prompts, outs)
    assert_no_leak(engine)


@pytest.mark.parametrize("name", MLA)
def test_triton_kernels_in_the_graph(name):
    """The graph bound to the Triton launchers (what a GPU runs; the interpreter here) gives the reference-bound
    graph's logits on the pass's real layouts (q_nope / q_pe slices of q, k_pe a slice of kv_a_proj's output),
    for a prefill (expanded path) and a decode over it (absorbed path)."""
    gm, ctx, _ = full_pipeline(name)
    outs = {}
    for backend in ("reference", "triton"):
        bound, names = bound_copy(gm, backend)
        assert f"mla_attention_{backend}" in names and f"apply_rotary_interleaved_{backend}" in names
        ids, pos = random_ids(10, 9), positions(2, 10)
        cache = PagedCache(ctx, 6, seed=1)
        table = cache.table(10)
        first = run_graph(bound, _step(cache, ids[:, :9], pos[:, :9], [(0, 9)], [table]))
        second = run_graph(bound, _step(cache, ids[:, 9:], pos[:, 9:], [(9, 1)], [table]))
        outs[backend] = (first, second)
    for ref, tri in zip(outs["reference"], outs["triton"]):
        assert_logits_close(tri, ref)
