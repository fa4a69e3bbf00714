"""compile_model / CompiledModel: the recommended pipeline end to end with verification, dumps and the
summary; a wrong pass caught by verify; the full pipeline on every tiny architecture against eager HF."""

import math

import pytest
import torch
from hypothesis import given

import mini_infer.compiler as compiler
from mini_infer.compiler import CompiledModel, compile_model, logits_tolerance
from mini_infer.passes import STAGES, GraphPass, PassContext, PassResult, add_passes, recommended_passes
from mini_infer.passes.manager import PassError
from mini_infer.passes.route_moe import is_moe_config
from tests.passes.helpers import (
    ARCHS,
    CPU,
    FEW,
    assert_logits_close,
    aten,
    captured,
    check_against_eager,
    copy_gm,
    eager_logits,
    full_pipeline,
    loaded,
    num_tokens,
    positions,
    random_ids,
    skip_unless_triton_interprets,
    start_pos,
)

PIPELINE = ["cleanup", "select_logits", "fuse_rmsnorm", "fuse_gemma_rmsnorm", "fuse_rotary", "fuse_qk_rotary",
            "merge_projections", "fuse_silu_mul", "fuse_gelu_mul", "paged_attention", "rotary_table", "gemv_linear"]
# MoE models route their experts (route_moe, before merge_projections); DeepSeek's latent attention gets its own
# attention pass, before paged_attention (which then matches nothing)
MOE_PIPELINE = [*PIPELINE[:6], "route_moe", *PIPELINE[6:]]
MLA_PIPELINE = [*MOE_PIPELINE[:10], "mla_latent_cache", *MOE_PIPELINE[10:]]  # the attention stage's first


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """tiny-llama through the real front door: capture, recommended passes, verify, dumps."""
    dump = tmp_path_factory.mktemp("dump")
    cm = compile_model(loaded("tiny-llama").model, verify=True, dump_dir=dump, model_name="tiny-llama")
    return cm, dump


@pytest.fixture
def cached_capture(monkeypatch):
    """compile_model without re-exporting: capture returns a copy of the session's cached graph."""
    by_model = {id(loaded(n).model): n for n in ARCHS}
    monkeypatch.setattr(compiler, "capture", lambda model: copy_gm(captured(by_model[id(model)])))


def test_recommended_pipeline():
    ctx = PassContext(config=loaded("tiny-llama").config, device=CPU, dtype=torch.float32)
    assert [p.name for p in recommended_passes(ctx)] == PIPELINE


def test_add_passes_places_each_by_stage():
    """An opt-in pass joins a pipeline after the passes of its own and earlier stages, names and instances kept."""
    ctx = PassContext(config=loaded("tiny-llama").config, device=CPU, dtype=torch.float32)
    pipeline = recommended_passes(ctx)
    added = add_passes(pipeline, ["fuse_gelu_mul"])
    fusion_end = max(i for i, p in enumerate(pipeline) if STAGES.index(p.stage) <= STAGES.index("fusion"))
    assert added[:fusion_end + 1] == pipeline[:fusion_end + 1]
    assert added[fusion_end + 1] == "fuse_gelu_mul" and added[fusion_end + 2:] == pipeline[fusion_end + 1:]
    assert add_passes(["paged_attention"], ["cleanup"]) == ["cleanup", "paged_attention"]
    with pytest.raises(ValueError, match="unknown pass 'fuse_everything'"):
        add_passes(pipeline, ["fuse_everything"])


def test_logits_tolerance():
    assert logits_tolerance(torch.float32, 50.0) == pytest.approx(5e-3)
    assert logits_tolerance(torch.float32, 0.2) == pytest.approx(1e-4)  # scale floored at 1
    assert logits_tolerance(torch.bfloat16, 2.0) == pytest.approx(6e-2)


def test_summary_lists_every_pass(compiled):
    cm, _ = compiled
    # the ops are bound to their kernels (torch references on CPU) after the verified passes
    assert [s.name for s in cm.stats] == ["capture", *PIPELINE, "bind_kernels"]
    table, footer = cm.summary().split("\n\n")
    lines = table.splitlines()
    assert "max |err|" in lines[0]
    assert [line.split()[0] for line in lines[2:]] == ["capture", *PIPELINE, "bind_kernels"]
    # what the graph holds: every weight once, and the caches the passes declared
    assert f"weights: {cm.weight_bytes / 1e9:.3f} GB" in footer
    assert "caches: 512 bytes per token over 2 layer caches" in footer  # 2 layers x K+V x 2 heads x 16 x 4 B
    assert "FullAttentionSpec x2" in footer
    assert all(s.max_abs_err is not None and s.max_abs_err <= 1e-4 for s in cm.stats[1:-1])
    # norms, rotaries (one qk_rotary per layer), silu_and_mul, attentions, weight linears (qkv, o, gate_up, down
    # per layer; lm_head)
    assert cm.stats[-1].num_matches == 5 + 2 + 2 + 2 + 9
    matches = {s.name: s.num_matches for s in cm.stats}
    assert (matches["fuse_rmsnorm"], matches["fuse_rotary"], matches["fuse_silu_mul"],
            matches["paged_attention"], matches["select_logits"], matches["gemv_linear"]) == (5, 4, 2, 2, 1, 9)
    assert cm.context.applied == PIPELINE
    assert repr(cm) == f"CompiledModel(tiny-llama, passes={PIPELINE})"
    assert "paged_attention_reference" in cm.code()


def test_dump_dir(compiled):
    _, dump = compiled
    expected = {"00_captured.txt", "summary.txt"}
    for i, name in enumerate(PIPELINE, start=1):
        expected |= {f"{i:02d}_{name}.before.txt", f"{i:02d}_{name}.after.txt"}
    assert {p.name for p in dump.iterdir()} == expected
    rows = (dump / "summary.txt").read_text().splitlines()[2:]
    assert [r.split()[0] for r in rows] == PIPELINE
    paged = f"{PIPELINE.index('paged_attention') + 1:02d}_paged_attention"
    assert "scaled_dot_product_attention" in (dump / f"{paged}.before.txt").read_text()
    assert "scaled_dot_product_attention" not in (dump / f"{paged}.after.txt").read_text()


def test_inputs_and_cache_specs(compiled):
    cm, _ = compiled
    assert cm.input_names == ["input_ids", "position_ids", "logits_indices", "slot_mapping", "block_tables",
                              "seq_lens", "query_start_loc", "k_cache_0", "v_cache_0", "k_cache_1", "v_cache_1"]
    assert [(s.k_input, s.num_kv_heads, s.head_size, s.attention_window) for s in cm.cache_specs] == [
        ("k_cache_0", 2, 16, None), ("k_cache_1", 2, 16, None)]
    with pytest.raises(ValueError, match="missing graph inputs: \\['logits_indices', 'slot_mapping'"):
        cm(input_ids=random_ids(3, 0), position_ids=positions(0, 3))


def test_call_prefill_then_decode(compiled):
    """Through CompiledModel.__call__: the default example inputs, then a decode step on their cache."""
    cm, _ = compiled
    ids = random_ids(10, 5)
    inputs = cm.example_inputs(ids[:, :9])  # one sequence from position 0, last row selected
    assert cm.logits_dtype == cm(**inputs).dtype == torch.float32
    assert torch.equal(inputs["position_ids"], positions(0, 9))
    ref = eager_logits("tiny-llama", ids, positions(0, 10))
    assert_logits_close(cm(**inputs), ref[:, 8:9])
    # decode token 10 into the same cache (block size 16: slot 9 of block 0)
    step = dict(inputs, input_ids=ids[:, 9:], position_ids=positions(9, 1), slot_mapping=torch.tensor([9]),
                seq_lens=torch.tensor([10], dtype=torch.int32),
                query_start_loc=torch.tensor([0, 1], dtype=torch.int32), logits_indices=torch.tensor([0]))
    assert_logits_close(cm(**step), ref[:, 9:10])


class _ScaleLogits(GraphPass):
    """Multiplies the logits by 1.01: a valid graph with the wrong output."""

    name = "scale_logits"

    def apply(self, gm, ctx):
        out = gm.graph.output_node()
        with gm.graph.inserting_before(out):
            scaled = gm.graph.call_function(aten.mul.Tensor, (out.args[0], 1.01))
        out.args = (scaled,)
        return PassResult(1)


def test_verify_names_the_wrong_pass(cached_capture, tmp_path):
    passes = ["cleanup", "fuse_rmsnorm", _ScaleLogits(), "fuse_rotary"]
    with pytest.raises(PassError, match="pass 'scale_logits' changed the model's output") as info:
        compile_model(loaded("tiny-qwen2").model, passes=passes, verify=True, dump_dir=tmp_path)
    assert "['cleanup', 'fuse_rmsnorm']" in str(info.value)
    assert not (tmp_path / "03_scale_logits.after.txt").exists()
    # without verify the same pipeline compiles (and is wrong): verification is what catches it
    cm = compile_model(loaded("tiny-qwen2").model, passes=passes)
    assert [s.name for s in cm.stats] == ["capture", "cleanup", "fuse_rmsnorm", "scale_logits", "fuse_rotary",
                                          "bind_kernels"]


def test_unknown_pass_fails_before_capture(monkeypatch):
    def no_capture(model):
        raise AssertionError("captured before checking the pass names")

    monkeypatch.setattr(compiler, "capture", no_capture)
    with pytest.raises(ValueError, match="unknown pass 'fuse_magic'; valid passes: cleanup, "):
        compile_model(loaded("tiny-llama").model, passes=["cleanup", "fuse_magic"])


def test_requires_order(cached_capture):
    with pytest.raises(ValueError, match="'fuse_rmsnorm' requires \\['cleanup'\\]"):
        compile_model(loaded("tiny-llama").model, passes=["fuse_rmsnorm", "cleanup"])


def test_no_passes(cached_capture):
    cm = compile_model(loaded("tiny-llama").model, passes=[])
    assert [s.name for s in cm.stats] == ["capture"] and cm.input_names == ["input_ids", "position_ids"]
    ids, pos = random_ids(5, 1), positions(7, 5)
    assert_logits_close(cm(input_ids=ids, position_ids=pos), eager_logits("tiny-llama", ids, pos), rel=1e-6)


def test_bf16_pipeline_matches_like_fp32():
    """In bf16 the norms keep their fp32 casts: the matchers must find the same places, within bf16 tolerance."""
    from mini_infer.models.loader import load_model

    model = load_model("tiny-qwen3", dtype="bf16", device="cpu").model
    cm = compile_model(model, verify=True)
    matches = {s.name: s.num_matches for s in cm.stats}
    assert (matches["fuse_rmsnorm"], matches["fuse_rotary"], matches["fuse_silu_mul"],
            matches["paged_attention"]) == (9, 4, 2, 2)
    assert {s.dtype for s in cm.cache_specs} == {torch.bfloat16}
    ids = random_ids(21, 2)
    inputs = cm.example_inputs(ids, positions(30, 21))
    inputs["logits_indices"] = torch.arange(21)
    with torch.no_grad():
        ref = model(input_ids=ids, position_ids=positions(30, 21), use_cache=False).logits.float()
    out = cm(**inputs)
    assert cm.logits_dtype == out.dtype == torch.bfloat16  # declared as the graph returns them (sampler warm-up)
    out = out.float()
    assert (out - ref).abs().max().item() <= logits_tolerance(torch.bfloat16, ref.abs().max().item())


@pytest.mark.parametrize("name", ARCHS)
def test_verify_passes_on_every_architecture(cached_capture, name):
    cm = compile_model(loaded(name).model, verify=True)
    pipeline = MLA_PIPELINE if name.startswith("tiny-deepseek") else MOE_PIPELINE if is_moe_config(
        loaded(name).config) else PIPELINE
    assert [s.name for s in cm.stats] == ["capture", *pipeline, "bind_kernels"]
    assert isinstance(cm, CompiledModel) and len(cm.cache_specs) == 2


@pytest.mark.parametrize("name", ARCHS)
@given(num=num_tokens, start=start_pos)
@FEW
def test_full_pipeline_equals_eager(name, num, start):
    gm, ctx, _ = full_pipeline(name)
    check_against_eager(name, gm, ctx, num, start, seed=num * 13 + start)
    # block size of the example inputs is 16: the cache covers every token
    first_cache = ctx.cache_specs[0].input_names()[0]  # k_cache_0, or latent_cache_0 for DeepSeek
    assert ctx.example_inputs(random_ids(num, 0), positions(0, num))[first_cache].shape[0] == math.ceil(num / 16)


def test_bound_kernels_match_the_ops():
    """bind_kernels swaps op nodes for the functions the ops dispatch to; the Triton-bound graph (under the
    interpreter here) gives the reference-bound graph's logits, and no mini_infer op node is left."""
    import torch.fx as fx

    from mini_infer.compiler import bind_kernels

    skip_unless_triton_interprets()
    cm = compile_model(loaded("tiny-llama").model)
    ids, pos = random_ids(6, 3), positions(0, 6)
    ref = cm(**cm.example_inputs(ids, pos))
    assert not any(getattr(n.target, "namespace", None) == "mini_infer" for n in cm.graph_module.graph.nodes)
    graph = fx.Graph()
    graph.output(graph.graph_copy(cm.graph_module.graph, {}))
    gm = fx.GraphModule(cm.graph_module, graph)  # same weights, its own nodes
    for node in gm.graph.nodes:  # back to the ops, then to the Triton launchers
        if "op" in node.meta:
            node.target = node.meta["op"]
    stats = bind_kernels(gm, torch.device("cpu"), backend="triton")
    assert stats.num_matches == 5 + 2 + 2 + 2 + 9  # ... and the weight linears (the lm_head's one row: GEMV)
    names = [n.target.__name__ for n in gm.graph.nodes if n.op == "call_function" and callable(n.target)]
    assert "paged_attention_triton_entry" in names and "rms_norm_triton" in names and "linear_triton" in names
    inputs = cm.example_inputs(ids, pos)
    out = gm(*(inputs[n] for n in cm.input_names))
    assert_logits_close(out, ref, rel=1e-4)
