"""capture(): every tiny architecture exports to a plain GraphModule in the packed layout whose logits equal
eager HF at any token count and positions (T is dynamic), sharing the model's parameters."""

import pytest
import torch
from hypothesis import given
from transformers import PretrainedConfig

from mini_infer.passes.capture import CaptureError, capture
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
    assert any(n.target is torch.ops.aten.scaled_dot_product_attention.default for n in gm.graph.nodes)


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
