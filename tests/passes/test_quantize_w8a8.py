"""QuantizeW8A8: linears → quantize_per_token + int8_linear with per-channel int8 weights, SmoothQuant folded in.

Per dense tiny preset (L = 2 layers, 7 linears each, lm_head left in float): alone and in the full
w8a8 pipeline, the match count, the ops in the graph and in its dump, the weights (one owner, int8 with a scale per
row, bytes about half of bf16), and logits within QUANT_REL of eager HF at token counts and positions the capture
never saw. The DeepSeek MLA presets (kv_b_proj kept in float for mla_latent_cache) and the MoE presets (routers
in float) run the full pipeline too. SmoothQuant: on a model whose float function is unchanged but whose
activations carry 100x outlier channels (at the norms' outputs and at down_proj's input), the logits error
without smoothing is several times the error with it; the folds are exact (alpha=0 with all factors 1 changes
nothing). Refusals: unknown mode, a skip pattern matching nothing, empty or bad calibration, alpha out of range.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mini_infer.compiler import compile_model
from mini_infer.models.loader import load_model
from mini_infer.models.presets import TINY_DENSE_PRESETS
from mini_infer.passes import PassConfigError, PassContext, recommended_passes
from mini_infer.passes.manager import PassError
from mini_infer.passes.quantize_w8a8 import QuantizeW8A8, quantize_weight_int8
from mini_infer.passes.smoothquant import calibration_ids
from mini_infer.runtime.engine import EngineConfig
from tests.passes.helpers import (
    ARCHS,
    CPU,
    FEW,
    NUM_LAYERS,
    assert_logits_close,
    aten,
    bound_copy,
    check_against_eager,
    eager_logits,
    graph_logits,
    loaded,
    mi,
    num_tokens,
    op_counts,
    positions,
    random_ids,
    run_passes,
    start_pos,
)

L = NUM_LAYERS
QUANT_REL = 0.05  # max |logits - eager| <= 5% of the logits' scale (measured: 0.6-1.7% on the tiny presets)
CAL = [[3, 17, 101, 250, 7, 9, 480, 33, 64, 12, 5, 300], [11, 22, 33, 44, 55, 66, 77, 88]]  # small: fast tests
MLA = ("tiny-deepseek-v2", "tiny-deepseek-v3")
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def w8a8_pipeline(name: str, **quantize_args) -> list:
    """The recommended pipeline for quantization="w8a8" without its leading cleanup, the quantize pass built
    with `quantize_args` (small calibration by default)."""
    ctx = PassContext(config=loaded(name).config, device=CPU, dtype=torch.float32, quantization="w8a8")
    quantize_args.setdefault("calibrate", CAL)
    passes = [QuantizeW8A8(**quantize_args) if p.name == "quantize_w8a8" else p for p in recommended_passes(ctx)]
    assert passes[0].name == "cleanup"
    return passes[1:]


@functools.cache
def alone(name: str):
    return run_passes(name, ["select_logits", QuantizeW8A8(calibrate=CAL)])


@functools.cache
def full(name: str):
    return run_passes(name, w8a8_pipeline(name))


def row(stats, name: str):
    return next(s for s in stats if s.name == name)


def graph_tensors(gm) -> dict[str, torch.Tensor]:
    return dict(gm.named_parameters()) | dict(gm.named_buffers())


# -- the graph ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", TINY_DENSE_PRESETS)
def test_alone_quantizes_every_linear_but_lm_head(name):
    gm, ctx, stats = alone(name)
    q = row(stats, "quantize_w8a8")
    assert q.num_matches == 7 * L
    assert q.note.startswith(f"{7 * L} of {7 * L + 1} linears int8")
    assert "SmoothQuant alpha=0.5: 6 inputs smoothed (4 into norms, 2 into up_proj) on 2 prompts / 20 tokens" \
        in q.note
    counts = op_counts(gm)
    assert counts[mi.int8_linear.default] == 7 * L
    assert counts[mi.quantize_per_token.default] == 4 * L  # q/k/v share one, gate/up share one, o, down
    assert counts[aten.linear.default] == 1  # lm_head
    # weights have one owner: no float projection weight is left in the graph
    names = list(graph_tensors(gm))
    assert not [n for n in names if n.endswith(tuple(f"{p}_weight" for p in PROJ))]
    assert len([n for n in names if n.endswith("_qweight")]) == 7 * L
    # the int8 weights are the per-channel quantization of W * s: dequantized, within half a step of a row
    # whose columns were scaled; without SmoothQuant, of W itself (checked on layer 0's o_proj: not smoothed)
    w = loaded(name).model.model.layers[0].self_attn.o_proj.weight
    t = graph_tensors(gm)
    w_q, scale = t["model_layers_0_self_attn_o_proj_qweight"], t["model_layers_0_self_attn_o_proj_weight_scale"]
    assert w_q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (w.shape[0],)
    assert ((w_q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-7).all()
    assert torch.equal(scale, w.abs().amax(1) / 127)


@pytest.mark.parametrize("name", TINY_DENSE_PRESETS)
def test_full_pipeline_graph(name):
    gm, ctx, stats = full(name)
    assert [s.name for s in stats] == ["select_logits", "quantize_w8a8", "fuse_rmsnorm", "fuse_gemma_rmsnorm",
                                       "fuse_rotary", "fuse_qk_rotary", "merge_projections", "fuse_silu_mul",
                                       "fuse_gelu_mul", "fuse_act_quant", "paged_attention", "rotary_table", "gemv_linear"]
    assert row(stats, "quantize_w8a8").num_matches == 7 * L
    assert row(stats, "merge_projections").num_matches == 2 * L  # int8 q/k/v and gate/up
    assert row(stats, "fuse_act_quant").note == "1 rms_norm, 3 fused_add_rms_norm, 2 silu_and_mul"
    counts = op_counts(gm)
    assert counts[mi.int8_linear.default] == 4 * L  # qkv, o, gate_up, down
    assert counts[mi.rms_norm_quant.default] == 1  # layer 0's input norm
    assert counts[mi.fused_add_rms_norm_quant.default] == 2 * L - 1
    assert counts[mi.silu_and_mul_quant.default] == L
    assert counts[mi.quantize_per_token.default] == L  # o_proj's input (attention output) stays a separate op
    assert counts[mi.linear.default] == 1  # lm_head, lowered by gemv_linear
    assert counts[mi.rms_norm.default] + counts[mi.fused_add_rms_norm.default] == 1  # the final norm
    assert counts[mi.qk_rotary.default] == L  # (with Qwen3's q/k norms)


@pytest.mark.parametrize("name", TINY_DENSE_PRESETS)
def test_merged_int8_weights_are_the_concatenation(name):
    """merge_projections concatenates the int8 weights and their per-row scales."""
    gm, _, _ = run_passes(name, ["select_logits", QuantizeW8A8(smoothquant=False), "merge_projections"])
    t = graph_tensors(gm)
    hf = loaded(name).model.model.layers[1].mlp
    parts = [quantize_weight_int8(hf.gate_proj.weight), quantize_weight_int8(hf.up_proj.weight)]
    merged = [(n, v) for n, v in t.items() if n.startswith("merged_") and n.endswith("_weight")]
    scales = [v for n, v in t.items() if n.startswith("merged_") and n.endswith("_weight_scale")]
    assert len(merged) == len(scales) == 2 * L
    assert any(torch.equal(v, torch.cat([parts[0][0], parts[1][0]])) for _, v in merged)
    assert any(torch.equal(v, torch.cat([parts[0][1], parts[1][1]])) for v in scales)


def test_graph_dump_shows_the_quantized_ops(tmp_path):
    cm = compile_model(loaded("tiny-llama").model, passes=["cleanup", *w8a8_pipeline("tiny-llama")],
                       dump_dir=tmp_path, quantization="w8a8")
    after = (tmp_path / "03_quantize_w8a8.after.txt").read_text()
    assert after.count("torch.ops.mini_infer.int8_linear.default(") == 7 * L
    assert "torch.ops.mini_infer.quantize_per_token.default(" in after and "i8[" in after
    (final,) = [f.read_text() for f in tmp_path.glob("*_fuse_act_quant.after.txt")]
    for op in ("rms_norm_quant", "fused_add_rms_norm_quant", "silu_and_mul_quant", "int8_linear"):
        assert f"torch.ops.mini_infer.{op}.default(" in final
    assert "quantize_w8a8" in cm.summary() and "14 of 15 linears int8" in (tmp_path / "summary.txt").read_text()


def test_default_pipeline_only_with_w8a8():
    config = loaded("tiny-llama").config
    for mode, has in ((None, False), ("w8a8", True), ("fp8", False)):
        names = [p.name for p in recommended_passes(PassContext(config=config, device=CPU, dtype=torch.float32,
                                                                quantization=mode))]
        assert ("quantize_w8a8" in names) is has
        assert ("fuse_act_quant" in names) is (mode is not None)


# -- logits -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", TINY_DENSE_PRESETS)
@given(num=num_tokens, start=start_pos)
@FEW
def test_alone_close_to_eager(name, num, start):
    gm, ctx, _ = alone(name)
    check_against_eager(name, gm, ctx, num, start, seed=num + 7 * start, rel=QUANT_REL)


@pytest.mark.parametrize("name", ARCHS)
@given(num=num_tokens, start=start_pos)
@FEW
def test_full_pipeline_close_to_eager(name, num, start):
    gm, ctx, _ = full(name)
    check_against_eager(name, gm, ctx, num, start, seed=3 * num + start, rel=QUANT_REL)


@pytest.mark.parametrize("name", TINY_DENSE_PRESETS)
def test_merged_equals_unmerged(name):
    """Merging int8 linears changes no bit (exact int32 products, the same epilogue per output)."""
    ids, pos = random_ids(13, 5), positions(0, 13)
    merged = run_passes(name, ["select_logits", QuantizeW8A8(calibrate=CAL), "merge_projections"])
    rows = torch.arange(13)
    assert torch.equal(graph_logits(*merged[:2], ids, pos, logits_indices=rows),
                       graph_logits(*alone(name)[:2], ids, pos, logits_indices=rows))


def test_triton_kernels_in_the_graph():
    """The full w8a8 graph bound to the Triton launchers (what a GPU runs; the interpreter here: int8_linear,
    rms_norm_quant, fused_add_rms_norm_quant, silu_and_mul_quant, quantize_per_token) gives the reference-bound
    graph's logits, for a prefill of 11 tokens."""
    gm, ctx, _ = full("tiny-llama")
    ids, pos = random_ids(11, 8), positions(0, 11)
    outs = {}
    for backend in ("reference", "triton"):
        bound, names = bound_copy(gm, backend)
        assert {f"{op}_{backend}" for op in ("int8_linear", "rms_norm_quant", "fused_add_rms_norm_quant",
                                             "silu_and_mul_quant", "quantize_per_token")} <= names
        outs[backend] = graph_logits(bound, ctx, ids, pos, logits_indices=torch.arange(11))
    assert_logits_close(outs["triton"], outs["reference"], rel=1e-4)


@pytest.mark.parametrize("name,kept", [
    ("tiny-deepseek-v2", {"lm_head": 1, "kv_b_proj": L, "gate": 1}),  # layer 0 is dense (first_k_dense_replace)
    ("tiny-deepseek-v3", {"lm_head": 1, "kv_b_proj": L, "gate": 1}),
    ("tiny-qwen2-moe", {"lm_head": 1, "gate": L, "shared_expert_gate": L}),
    ("tiny-mixtral", {"lm_head": 1, "gate": L}),
])
def test_kept_in_float(name, kept):
    """MLA's kv_b_proj (absorbed by mla_latent_cache) and MoE routers stay float linears; the rest is int8."""
    gm, _, stats = alone(name)
    names = [n.args[1].target.removesuffix(".weight").rsplit(".", 1)[-1] for n in gm.graph.nodes
             if n.target is aten.linear.default]
    assert {k: names.count(k) for k in set(names)} == kept
    total = row(stats, "quantize_w8a8").num_matches + sum(kept.values())
    assert row(stats, "quantize_w8a8").note.startswith(f"{total - sum(kept.values())} of {total} linears int8")
    if name in MLA:  # and the latent attention still finds its way through the int8 projections
        _, _, stats = full(name)
        assert row(stats, "mla_latent_cache").num_matches == L


def test_verify_allows_the_declared_approximation():
    """compile_model(verify=True) passes a w8a8 pipeline: the quantized graph differs from eager by more than the
    float tolerance, within the 10% of the logits' scale quantize_w8a8 declares; later passes are held to that."""
    cm = compile_model(loaded("tiny-llama").model, passes=["cleanup", *w8a8_pipeline("tiny-llama")], verify=True,
                       quantization="w8a8")
    errors = {s.name: s.max_abs_err for s in cm.stats if s.max_abs_err is not None}
    assert errors["select_logits"] < 1e-4 < errors["quantize_w8a8"] < 0.1
    assert cm.context.info["approximation"] == QuantizeW8A8.approximation
    assert max(errors.values()) < 0.1


# -- options ----------------------------------------------------------------------------------------------------


def test_skip_lm_head_and_embeddings_options():
    name = "tiny-llama"
    gm, ctx, stats = run_passes(name, ["select_logits", QuantizeW8A8(skip=["down_proj", "layers.0.self_attn.o_proj"],
                                                                     lm_head=True, embeddings=True, calibrate=CAL)])
    note = row(stats, "quantize_w8a8").note
    assert note.startswith(f"{7 * L + 1 - L - 1} of {7 * L + 1} linears int8") and "1 embedding tables int8" in note
    kept = [n.args[1].target for n in gm.graph.nodes if n.target is aten.linear.default]
    assert sorted(kept) == ["model.model.layers.0.mlp.down_proj.weight", "model.model.layers.0.self_attn.o_proj.weight",
                            "model.model.layers.1.mlp.down_proj.weight"]
    assert "model_embed_tokens_qweight" in graph_tensors(gm)
    assert not [n for n in graph_tensors(gm) if "embed_tokens.weight" in n or "lm_head.weight" in n]
    check_against_eager(name, gm, ctx, 17, 3, rel=QUANT_REL)


def test_tied_lm_head_and_embedding_share_one_int8_table():
    model = copy.deepcopy(loaded("tiny-llama").model)
    model.lm_head.weight = model.model.embed_tokens.weight
    cm = compile_model(model, passes=["cleanup", "select_logits", QuantizeW8A8(lm_head=True, embeddings=True,
                                                                               smoothquant=False)])
    gm = cm.graph_module
    (lin,) = [n for n in gm.graph.nodes if n.meta.get("op") is mi.int8_linear.default and n.args[2].target.startswith(
        "lm_head")]
    (emb,) = [n for n in gm.graph.nodes if n.target is aten.embedding.default and n.args[0].op == "get_attr"]
    assert PassContext.tensor_of(gm, lin.args[2]) is PassContext.tensor_of(gm, emb.args[0])
    float_bytes = compile_model(model, passes=["cleanup", "select_logits"]).weight_bytes
    # every fp32 matrix, the tied table included once, is held as int8 (4 bytes -> 1) with fp32 row scales
    matrices = [model.lm_head.weight] + [m.weight for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in PROJ]
    assert float_bytes - cm.weight_bytes == sum(w.numel() * 3 - w.shape[0] * 4 for w in matrices)
    ids, pos = random_ids(9, 2), positions(0, 9)
    with torch.no_grad():
        ref = model(input_ids=ids, position_ids=pos).logits
    assert_logits_close(cm(**cm.example_inputs(ids, pos) | {"logits_indices": torch.arange(9)}), ref, rel=QUANT_REL)


def test_weight_bytes_halve_for_bf16():
    model = load_model("tiny-llama", dtype="bfloat16", device="cpu", seed=0).model
    before = compile_model(model, passes=["cleanup", "select_logits"])
    after = compile_model(model, passes=["cleanup", "select_logits", QuantizeW8A8(calibrate=CAL)])
    linears = [m.weight for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in PROJ]
    bf16 = sum(w.numel() * 2 for w in linears)
    int8 = sum(w.numel() + 4 * w.shape[0] for w in linears)
    # smoothed norm weights replace the originals (same bytes): only the linears change
    assert before.weight_bytes - after.weight_bytes == bf16 - int8
    assert int8 / bf16 < 0.55
    assert f"weights: {after.weight_bytes / 1e9:.3f} GB" in after.summary()


@given(rows=st.integers(1, 9), cols=st.integers(1, 40), seed=st.integers(0, 2**16),
       log_scale=st.floats(-20, 20), zero_row=st.booleans())
@FEW
def test_weight_quantization_properties(rows, cols, seed, log_scale, zero_row):
    """Per output row: the largest |w| maps to +-127, every value dequantizes within half a step, a zero row
    stays zero (with a positive scale)."""
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 2.0**log_scale
    if zero_row:
        w[0] = 0
    w_q, scale = quantize_weight_int8(w)
    assert w_q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (rows,) and (scale > 0).all()
    assert ((w_q.float() * scale[:, None] - w).abs() <= scale[:, None] * (0.5 + 1e-5)).all()
    nonzero = w.abs().amax(1) > 0
    assert (w_q.abs().amax(1)[nonzero] == 127).all()
    assert not w_q[~nonzero].any()


def test_calibration_ids():
    assert [t.tolist() for t in calibration_ids(["ab"], None, 512)] == [[[97, 98]]]  # UTF-8 bytes, no tokenizer
    assert [t.tolist() for t in calibration_ids(["\u00e9"], None, 100)] == [[[195 % 100, 169 % 100]]]
    assert calibration_ids([[5, 6]], None, 10)[0].tolist() == [[5, 6]]
    with pytest.raises(ValueError, match="token id 10 is outside the vocabulary"):
        calibration_ids([[5, 10]], None, 10)


def test_default_calibration_runs_without_tokenizer():
    _, _, stats = run_passes("tiny-qwen2", ["select_logits", QuantizeW8A8()])
    assert "on 8 prompts" in row(stats, "quantize_w8a8").note


# -- SmoothQuant --------------------------------------------------------------------------------------------------


def _with_outliers(name: str, factor: float = 100.0):
    """`name`'s model with the same float function but activation channels `factor` times larger: channel 5 of
    each norm's output (its weight up, the reading linears' columns down) and channel 3 of down_proj's input
    (up_proj's row up, down_proj's column down)."""
    model = copy.deepcopy(loaded(name).model)
    with torch.no_grad():
        for layer in model.model.layers:
            for norm, readers in ((layer.input_layernorm, (layer.self_attn.q_proj, layer.self_attn.k_proj,
                                                           layer.self_attn.v_proj)),
                                  (layer.post_attention_layernorm, (layer.mlp.gate_proj, layer.mlp.up_proj))):
                norm.weight[5] *= factor
                for lin in readers:
                    lin.weight[:, 5] /= factor
            layer.mlp.up_proj.weight[3] *= factor
            layer.mlp.down_proj.weight[:, 3] /= factor
    return model


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_smoothquant_tames_outlier_channels(name):
    model = _with_outliers(name)
    ids, pos = random_ids(24, 1), positions(0, 24)
    with torch.no_grad():
        ref = model(input_ids=ids, position_ids=pos).logits
    assert_logits_close(ref, eager_logits(name, ids, pos), rel=1e-4)  # the float function did not change
    errors = {}
    for smooth in (False, True):
        cm = compile_model(model, passes=["cleanup", "select_logits", QuantizeW8A8(smoothquant=smooth,
                                                                                   calibrate=CAL)])
        inputs = cm.example_inputs(ids, pos) | {"logits_indices": torch.arange(24)}
        errors[smooth] = (cm(**inputs) - ref).abs().max().item()
    assert errors[True] * 4 < errors[False], errors
    assert errors[True] <= QUANT_REL * ref.abs().max().item()


def test_smoothing_folds():
    """The folds carry the factors s the weights were multiplied by: a skipped (float) up_proj's rows are
    W_up / s_down while down_proj's int8 columns dequantize to W_down * s_down; the input norm's weight is
    w / s_in. A reader left in float (the skipped up_proj) keeps the gate/up input unsmoothed."""
    name = "tiny-llama"
    gm, _, _ = run_passes(name, ["select_logits", QuantizeW8A8(calibrate=CAL, skip=["up_proj"])])
    t = graph_tensors(gm)
    hf = loaded(name).model.model.layers[0]
    up = t["model_layers_0_mlp_up_proj_weight_smoothed"]
    s_down = hf.mlp.up_proj.weight[:, 0] / up[:, 0]
    assert (s_down > 0).all() and not torch.allclose(s_down, torch.ones_like(s_down))
    torch.testing.assert_close(hf.mlp.up_proj.weight / s_down[:, None], up)
    w_scale = t["model_layers_0_mlp_down_proj_weight_scale"]
    deq = t["model_layers_0_mlp_down_proj_qweight"].float() * w_scale[:, None]
    step = (w_scale[:, None] / s_down[None, :]).expand_as(deq)  # half an int8 step, in W_down's units, x2
    assert ((deq / s_down[None, :] - hf.mlp.down_proj.weight).abs() <= step / 2 * (1 + 1e-5)).all()
    assert "model_model_layers_0_post_attention_layernorm_weight_smoothed" not in t
    s_in = hf.input_layernorm.weight / t["model_model_layers_0_input_layernorm_weight_smoothed"]
    assert (s_in > 0).all() and not torch.allclose(s_in, torch.ones_like(s_in))


# -- refusals -----------------------------------------------------------------------------------------------------


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="quantization='int4': no pass in the pipeline implements it.*'w8a8'"):
        compile_model(loaded("tiny-llama").model, quantization="int4")
    with pytest.raises(ValueError, match="quantization must be one of w8a8, fp8, mxfp4 or None; got 'int4'"):
        EngineConfig(quantization="int4")


def test_skip_pattern_matching_nothing_is_refused():
    with pytest.raises(PassError, match=r"pass 'quantize_w8a8': invalid skip='dwon_proj': matches no linear of this "
                       r"model \(names like: lm_head, mlp.down_proj, mlp.gate_proj"):
        run_passes("tiny-llama", [QuantizeW8A8(skip=["dwon_proj"], calibrate=CAL)])


@pytest.mark.parametrize("args,match", [
    (dict(calibrate=[]), "invalid calibrate=\\[\\]: is empty"),
    (dict(calibrate=["ok", ""]), "invalid calibrate=\\['ok', ''\\]: prompt '' is not a non-empty string"),
    (dict(calibrate="one prompt"), "invalid calibrate='one prompt': must be a list of prompts"),
    (dict(alpha=1.5), "invalid alpha=1.5"),
    (dict(skip="down_proj"), "invalid skip='down_proj'"),
])
def test_bad_arguments_are_refused(args, match):
    with pytest.raises(PassConfigError, match=f"pass 'quantize_w8a8': {match}"):
        QuantizeW8A8(**args)


def test_calibration_ids_out_of_range_are_refused():
    with pytest.raises(PassError, match="calibration prompt 0: token id 512 is outside the vocabulary"):
        run_passes("tiny-llama", [QuantizeW8A8(calibrate=[[1, 512]])])
