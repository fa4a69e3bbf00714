"""QuantizeFP8 (`quantization="fp8"`): parameter linears → quantize_per_token + fp8_linear over e4m3 weights,
per-channel scales (one activation quantization per distinct input, as quantize_w8a8 emits).

Oracle: the eager HF model whose quantized linears are replaced by their fake-quantized version (weight rounded
to e4m3 with its per-channel scale and dequantized; input quantized per token and dequantized; an fp32 GEMM):
the scheme exactly, so the graph must match it to the fp32 contract (1e-4 of the logits' scale), alone and in
the full pipeline (merged q/k/v and gate/up fp8 weights), on every tiny preset. Against the unquantized model
the logits move by what fp8 costs: relative RMS error <= RMS_BOUND and max error <= MAX_BOUND x max(1, |logits|)
(measured 0.03-0.06 and 0.02-0.04 on the dense presets). Also: the per-preset matches and what was kept
(lm_head, MoE gates, MLA kv_b_proj), the originals dropped, the graph dump showing fp8 ops, `skip` / `lm_head`,
and bad input (a pattern that matches nothing, a GPU below compute capability 8.9).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from hypothesis import given

from mini_infer.compiler import compile_model
from mini_infer.models.presets import TINY_DENSE_PRESETS
from mini_infer.ops.quant import quantize_per_token_reference
from mini_infer.passes import PassConfigError, PassContext, recommended_passes
from mini_infer.passes.keep_float import linear_name
from mini_infer.passes.manager import PassError, PassManager
from mini_infer.passes.quantize_fp8 import QuantizeFP8, quantize_weight_fp8
from tests.passes.helpers import (
    ARCHS,
    CPU,
    FEW,
    NUM_LAYERS,
    _cleaned,
    assert_logits_close,
    aten,
    bound_copy,
    copy_gm,
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

FP8 = torch.float8_e4m3fn
L = NUM_LAYERS
RMS_BOUND, MAX_BOUND = 0.1, 0.1
# preset -> (linears quantized alone, what stayed in the model dtype, fp8 linears left after merge_projections)
EXPECTED = {
    "tiny-llama": (14, "lm_head x1", 8),
    "tiny-qwen2": (14, "lm_head x1", 8),
    "tiny-qwen3": (14, "lm_head x1", 8),
    "tiny-mistral": (14, "lm_head x1", 8),
    "tiny-mixtral": (8, "moe gate x2, lm_head x1", 4),
    "tiny-qwen2-moe": (14, "moe gate x4, lm_head x1", 8),
    "tiny-qwen3-moe": (8, "moe gate x2, lm_head x1", 4),
    "tiny-deepseek-v2": (12, "mla kv_b_proj x2, moe gate x1, lm_head x1", 8),
    "tiny-deepseek-v3": (14, "mla kv_b_proj x2, moe gate x1, lm_head x1", 10),
    "tiny-gemma2": (14, "lm_head x1", 8),
    "tiny-gpt-oss": (8, "moe gate x2, lm_head x1", 4),  # the biased experts are fused_moe's, not linears
}
assert set(EXPECTED) == set(ARCHS)


# -- the oracle: HF with fake-quantized linears -----------------------------------------------------------------


class FakeQuantLinear(torch.nn.Module):
    """What fp8_w8a8_linear computes, in plain torch: e4m3 weight and per-token e4m3 input, dequantized."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        w_q, w_scale = quantize_weight_fp8(linear.weight)
        self.weight = w_q.float() * w_scale[:, None]
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_q, x_scale = quantize_per_token_reference(x, FP8)
        y = (x_q.float() @ self.weight.t()) * x_scale
        return (y + self.bias if self.bias is not None else y).to(x.dtype)


@functools.cache
def oracle(name: str, names: tuple[str, ...]) -> torch.nn.Module:
    model = copy.deepcopy(loaded(name).model)
    for n in names:
        parent, _, attr = n.rpartition(".")
        setattr(model.get_submodule(parent), attr, FakeQuantLinear(model.get_submodule(n)))
    return model


@functools.cache
def quantized(name: str, full: bool = False):
    """quantize_fp8 alone (after cleanup), or the recommended pipeline for quantization="fp8"."""
    if not full:
        return run_passes(name, ["quantize_fp8"])
    gm = copy_gm(_cleaned(name))
    ctx = PassContext(config=loaded(name).config, device=CPU, dtype=torch.float32, quantization="fp8",
                      applied=["cleanup"])
    stats = PassManager(recommended_passes(ctx)[1:]).run(gm, ctx)
    return gm, ctx, stats


@functools.cache
def quantized_names(name: str) -> tuple[str, ...]:
    gm, _, _ = quantized(name)
    return tuple(linear_name(n) for n in gm.graph.nodes if n.target is mi.fp8_linear.default)


def _logits(name, full, num, start):
    gm, ctx, _ = quantized(name, full)
    ids, pos = random_ids(num, seed=num + 3 * start), positions(start, num)
    return graph_logits(gm, ctx, ids, pos, logits_indices=torch.arange(num)), ids, pos


# -- the graph --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ARCHS)
def test_matches_kept_and_originals_dropped(name):
    gm, ctx, stats = quantized(name)
    n, kept, _ = EXPECTED[name]
    assert stats[0].num_matches == n and stats[0].note == f"{n} linears to fp8; kept: {kept}"
    assert op_counts(gm)[mi.fp8_linear.default] == n
    nodes = [nd for nd in gm.graph.nodes if nd.target is mi.fp8_linear.default]
    for nd in nodes:
        w_q, w_scale = (ctx.tensor_of(gm, a) for a in nd.args[2:4])
        assert nd.args[0].args[0].target is mi.quantize_per_token.default and nd.args[0].args[0].args[1] == FP8
        assert w_q.dtype == FP8 and w_scale.dtype == torch.float32 and w_scale.shape == (w_q.shape[0],)
    params = dict(gm.named_parameters())
    assert not any(name_.endswith(q.replace(".", "_")) or name_.endswith(f"{q}.weight")
                   for name_ in params for q in quantized_names(name))  # one owner: the fp8 copy
    assert sum(t.dtype == FP8 for t in gm.buffers()) == n


@pytest.mark.parametrize("name", ARCHS)
def test_full_pipeline_merges_fp8_weights_with_their_scales(name):
    gm, ctx, stats = quantized(name, full=True)
    rows = {s.name: s for s in stats}
    assert rows["quantize_fp8"].num_matches == EXPECTED[name][0]
    assert op_counts(gm)[mi.fp8_linear.default] == EXPECTED[name][2]
    if name in TINY_DENSE_PRESETS:  # q/k/v ((4 + 2 x 2) heads) and gate/up (2 x 128 rows) of each layer merged
        merged = [n for n in gm.graph.nodes if n.target is mi.fp8_linear.default
                  and n.args[2].target.startswith("merged_")]
        head_dim = 32 if name == "tiny-qwen3" else 16
        shapes = sorted((ctx.tensor_of(gm, n.args[2]).shape[0], ctx.tensor_of(gm, n.args[3]).shape[0])
                        for n in merged)
        assert shapes == sorted([(8 * head_dim, 8 * head_dim), (256, 256)] * L)
        assert all(ctx.tensor_of(gm, n.args[2]).dtype == FP8 for n in merged)


@pytest.mark.parametrize("full", [False, True], ids=["alone", "pipeline"])
@pytest.mark.parametrize("name", ARCHS)
@given(num=num_tokens, start=start_pos)
@FEW
def test_logits_equal_fake_quantized_oracle(name, full, num, start):
    out, ids, pos = _logits(name, full, num, start)
    with torch.no_grad():
        ref = oracle(name, quantized_names(name))(input_ids=ids, position_ids=pos, use_cache=False).logits
    assert_logits_close(out, ref)


@pytest.mark.parametrize("name", TINY_DENSE_PRESETS)
def test_logits_within_fp8_error_of_the_unquantized_model(name):
    for num, start in ((1, 0), (23, 40)):
        out, ids, pos = _logits(name, True, num, start)
        ref = eager_logits(name, ids, pos)
        rms = ((out - ref).norm() / ref.norm()).item()
        worst = (out - ref).abs().max().item() / max(1.0, ref.abs().max().item())
        assert 0 < rms <= RMS_BOUND and worst <= MAX_BOUND, (rms, worst)


def test_graph_dump_and_summary_show_fp8(tmp_path):
    cm = compile_model(loaded("tiny-llama").model, device="cpu", quantization="fp8", dump_dir=tmp_path)
    after = next(tmp_path.glob("*_quantize_fp8.after.txt")).read_text()
    assert after.count("mini_infer.fp8_linear.default(") == 14 and after.count("f8e4m3fn[") == 14 + 4 * L  # weights, activations
    # one activation quantization per distinct input: q/k/v share one, gate/up one, o_proj and down_proj theirs
    assert after.count("mini_infer.quantize_per_token.default(") == 4 * L
    assert "fp8_linear" not in next(tmp_path.glob("*_quantize_fp8.before.txt")).read_text()
    summary = (tmp_path / "summary.txt").read_text()
    assert "14 linears to fp8; kept: lm_head x1" in summary and "14 linears to fp8" in cm.summary()
    plain = compile_model(loaded("tiny-llama").model, device="cpu")
    buffers = dict(cm.graph_module.named_buffers())
    fp8_elems = sum(t.numel() for t in buffers.values() if t.dtype == FP8)
    scales = sum(t.numel() for n, t in buffers.items() if n.endswith("_scale"))
    assert fp8_elems == 2 * (64 * (64 + 32 + 32 + 64) + 3 * 64 * 128) and scales == 2 * (128 + 64 + 256 + 64)
    assert cm.weight_bytes == plain.weight_bytes - 3 * fp8_elems + 4 * scales  # fp32 -> e4m3, one copy each


# -- options ----------------------------------------------------------------------------------------------------


def _run(name, pass_, **ctx_fields):
    gm = copy_gm(_cleaned(name))
    ctx = PassContext(config=loaded(name).config, device=ctx_fields.pop("device", CPU), dtype=torch.float32,
                      applied=["cleanup"], **ctx_fields)
    return gm, ctx, PassManager([pass_]).run(gm, ctx)


def test_lm_head_and_skip_patterns():
    _, _, stats = _run("tiny-llama", QuantizeFP8(lm_head=True))
    assert stats[0].num_matches == 15 and "kept" not in stats[0].note
    gm, _, stats = _run("tiny-llama", QuantizeFP8(skip=["down_proj", "model.layers.1.self_attn.*"]))
    assert stats[0].num_matches == 14 - 2 - 4 and "skip x6" in stats[0].note
    kept = [linear_name(n) for n in gm.graph.nodes if n.target is aten.linear.default]
    assert "model.layers.0.mlp.down_proj" in kept and "model.layers.1.self_attn.o_proj" in kept


def test_skip_pattern_matching_nothing_is_refused():
    with pytest.raises(PassError, match=r"pass 'quantize_fp8': invalid skip='donw_proj': matches no linear of this "
                       r"model \(names like: lm_head, mlp.down_proj, mlp.gate_proj"):
        _run("tiny-llama", QuantizeFP8(skip=["donw_proj"]))


@pytest.mark.parametrize("kwargs", [dict(skip="lm_head"), dict(skip=[""]), dict(lm_head="yes")])
def test_bad_arguments_are_refused(kwargs):
    with pytest.raises(PassConfigError, match="pass 'quantize_fp8': invalid"):
        QuantizeFP8(**kwargs)


def test_default_pipeline_runs_it_only_for_fp8():
    ctx = PassContext(config=loaded("tiny-llama").config, device=CPU, dtype=torch.float32)
    assert "quantize_fp8" not in [p.name for p in recommended_passes(ctx)]
    ctx.quantization = "fp8"
    names = [p.name for p in recommended_passes(ctx)]
    assert names.index("select_logits") < names.index("quantize_fp8") < names.index("merge_projections")
    with pytest.raises(ValueError, match="quantization='fp8': no pass in the pipeline implements it"):
        compile_model(loaded("tiny-llama").model, passes=["cleanup"], device="cpu", quantization="fp8")


def test_gpu_below_8_9_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA GeForce RTX 3090")
    gm = copy_gm(_cleaned("tiny-llama"))
    ctx = PassContext(config=loaded("tiny-llama").config, device=torch.device("cuda"), dtype=torch.float32,
                      quantization="fp8", applied=["cleanup"])
    with pytest.raises(ValueError, match=r"quantization='fp8': NVIDIA GeForce RTX 3090 \(cuda\) has compute "
                                         r"capability 8\.6; FP8 needs >= 8\.9"):
        QuantizeFP8().apply(gm, ctx)


def test_preflight_refuses_fp8_on_a_gpu_below_8_9(monkeypatch):
    from mini_infer.runtime import preflight
    from mini_infer.runtime.engine import EngineConfig

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    config = EngineConfig(quantization="fp8", kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match=r"quantization='fp8' and kv_cache_dtype='fp8': NVIDIA A100-SXM4-80GB"):
        preflight._check_fp8(config, torch.device("cuda"))
    preflight._check_fp8(EngineConfig(), torch.device("cuda"))  # nothing asked for fp8: nothing to refuse


def test_triton_kernels_in_the_graph():
    """fp8 weights and the fp8 KV cache with every op bound to its Triton launcher (what a GPU runs; the
    interpreter here) give the reference-bound graph's logits, for a prefill (M > 16) and a one-token step."""
    name = "tiny-llama"
    gm = copy_gm(_cleaned(name))
    ctx = PassContext(config=loaded(name).config, device=CPU, dtype=torch.float32, quantization="fp8",
                      kv_cache_dtype=FP8, applied=["cleanup"])
    PassManager(recommended_passes(ctx)[1:]).run(gm, ctx)
    outs = {}
    for backend in ("reference", "triton"):
        bound, names = bound_copy(gm, backend)
        assert f"fp8_linear_{backend}" in names and f"paged_attention_{backend}_entry" in names
        outs[backend] = [graph_logits(bound, ctx, random_ids(n, n), positions(0, n), logits_indices=torch.arange(n))
                         for n in (37, 1)]
    for ref, tri in zip(outs["reference"], outs["triton"]):
        assert_logits_close(tri, ref)
