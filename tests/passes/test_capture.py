"""capture(): every tiny architecture exports to a plain GraphModule in the packed layout whose logits equal
eager HF at any token count and positions (T is dynamic), sharing the model's parameters."""

import pytest
import torch
from hypothesis import given
from transformers import PretrainedConfig

from mini_infer.passes.capture import CaptureError, capture
from mini_infer.passes.pattern import attention_calls
from tests.passes.helpers import (
    ARCHS,
    FEW,
    VOCAB,
    assert_logits_close,
    captured,
    eager_logits,
    loaded,
    num_tokens,
    placeholder_names,
    positions,
    random_ids,
    run_graph,
    start_pos,
)


@pytest.mark.parametrize("name", ARCHS)
def test_captures_packed_signature(name):
    gm = captured(name)
    assert placeholder_names(gm) == ["input_ids", "position_ids"]
    assert gm.meta["capture_seconds"] > 0
    assert gm.meta["model_config"] is loaded(name).config
    # the token dimension is symbolic in every input and in the output
    ids_val = next(n for n in gm.graph.nodes if n.op == "placeholder").meta["val"]
    out = gm.graph.output_node().args[0]
    assert isinstance(out, torch.fx.Node)
    t = ids_val.shape[1]
    assert isinstance(t, torch.SymInt)
    assert str(out.meta["val"].shape[1]) == str(t)
    assert out.meta["val"].shape[0] == 1 and out.meta["val"].shape[2] == VOCAB
    assert len(attention_calls(gm.graph)) == loaded(name).config.num_hidden_layers  # SDPA or mini_infer.attention


@pytest.mark.parametrize("name", ARCHS)
def test_parameters_are_shared_not_copied(name):
    gm = captured(name)
    model_ptrs = {p.data_ptr() for p in loaded(name).model.parameters()}
    graph_ptrs = {p.data_ptr() for p in gm.parameters()} | {b.data_ptr() for b in gm.buffers()}
    assert model_ptrs <= graph_ptrs


@pytest.mark.parametrize("name", ARCHS)
@given(num=num_tokens, start=start_pos)
@FEW
def test_captured_graph_equals_eager(name, num, start):
    ids, pos = random_ids(num, seed=num), positions(start, num)
    out = run_graph(captured(name), {"input_ids": ids, "position_ids": pos})
    # nothing rewritten yet: the same ops as eager, up to op-order rounding
    assert_logits_close(out, eager_logits(name, ids, pos), rel=1e-5)


def test_not_a_transformers_model():
    with pytest.raises(CaptureError, match="not a transformers model"):
        capture(torch.nn.Linear(4, 4))


class _DataDependent(torch.nn.Module):
    """Looks like a causal LM (has a config) but branches on a tensor value: export cannot trace it."""

    def __init__(self):
        super().__init__()
        self.config = PretrainedConfig(vocab_size=16)
        self.emb = torch.nn.Embedding(16, 8)

    def forward(self, input_ids, position_ids, use_cache=False):
        h = self.emb(input_ids)
        if h.sum() > 0:
            h = h * 2
        return type("Out", (), {"logits": h})()


def test_export_failure_is_a_capture_error():
    with pytest.raises(CaptureError, match="could not capture _DataDependent") as info:
        capture(_DataDependent())
    assert info.value.__cause__ is not None


def _tiny(config_cls, **fields):
    """A tiny model of `config_cls` loaded as mini-infer's loader loads it (attention_implementation)."""
    from transformers import AutoModelForCausalLM

    from mini_infer.models.loader import attention_implementation

    config = config_cls(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=128, **fields)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attention_implementation(config)).eval()


def _attention_nodes(gm):
    return [n for n in gm.graph.nodes if n.target is torch.ops.mini_infer.attention.default]


def test_model_without_sdpa_is_captured_through_mini_infer_attention():
    """Gemma 2 cannot run through SDPA (soft-capped logits): one mini_infer.attention node a layer carries its
    scale, cap and window; the graph equals eager HF (HF's own eager attention), and the model keeps its setting."""
    from transformers import Gemma2Config

    model = _tiny(Gemma2Config, head_dim=16, sliding_window=4, attn_logit_softcapping=2.0, query_pre_attn_scalar=8)
    assert model.config._attn_implementation == "eager"
    gm = capture(model)
    assert model.config._attn_implementation == "eager"
    nodes = _attention_nodes(gm)
    assert [n.args[3:] for n in nodes] == [(8 ** -0.5, 2.0, 4), (8 ** -0.5, 2.0, 0)]  # layer 0 slides
    assert not any(n.target is torch.ops.aten.scaled_dot_product_attention.default for n in gm.graph.nodes)
    ids, pos = random_ids(11, seed=3), positions(2, 11)
    with torch.no_grad():
        expected = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    assert_logits_close(run_graph(gm, {"input_ids": ids, "position_ids": pos}), expected, rel=1e-5)


def test_soft_capped_model_set_to_sdpa_is_captured_with_its_cap(monkeypatch):
    """Under transformers 5.17 Gemma 2 could be set to SDPA, which drops the cap: capture still goes through
    mini_infer.attention, with the cap, and leaves the model's setting as it was."""
    from transformers import AutoModelForCausalLM, Gemma2Config, Gemma2PreTrainedModel

    monkeypatch.setattr(Gemma2PreTrainedModel, "_supports_sdpa", True)
    config = Gemma2Config(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, intermediate_size=128, head_dim=16, attn_logit_softcapping=2.0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()
    gm = capture(model)
    assert [n.args[4] for n in _attention_nodes(gm)] == [2.0, 2.0]
    assert model.config._attn_implementation == "sdpa"


def test_a_model_a_user_loaded_eager_is_captured_the_same_way():
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    gm = capture(model)
    assert len(_attention_nodes(gm)) == 2 and model.config._attn_implementation == "eager"
    ids, pos = random_ids(9, seed=4), positions(0, 9)
    with torch.no_grad():
        expected = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    assert_logits_close(run_graph(gm, {"input_ids": ids, "position_ids": pos}), expected, rel=1e-5)


def test_attention_sinks_are_captured_on_the_attention_node():
    """GPT-OSS (no SDPA path): each layer's sinks (HF's s_aux) are its mini_infer.attention node's last argument, the
    model's own parameter; the graph equals eager HF (GPT-OSS's eager attention), and the model keeps its setting."""
    from transformers import GptOssConfig

    model = _tiny(GptOssConfig, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # the initializer's sinks are close to zero: make them count
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.randn(4, generator=gen))
    gm = capture(model)
    assert model.config._attn_implementation == "eager"
    nodes = _attention_nodes(gm)
    params = dict(gm.named_parameters())
    assert [params[n.args[6].target] for n in nodes] == [layer.self_attn.sinks for layer in model.model.layers]
    ids, pos = random_ids(11, seed=3), positions(2, 11)
    with torch.no_grad():
        expected = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    assert_logits_close(run_graph(gm, {"input_ids": ids, "position_ids": pos}), expected, rel=1e-5)


def test_attention_dropout_in_training_is_refused_naming_the_module():
    from transformers import GptOssConfig

    model = _tiny(GptOssConfig, head_dim=16, num_local_experts=4, num_experts_per_tok=2, attention_dropout=0.1)
    model.train()
    with pytest.raises(CaptureError, match=r"GptOssAttention: attention dropout 0.1 \(the model is in training mode\)"):
        capture(model)
    assert model.config._attn_implementation == "eager"
