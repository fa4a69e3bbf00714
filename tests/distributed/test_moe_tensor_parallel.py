"""Mixture-of-experts models under tensor parallelism, end to end on CPU with two gloo ranks.

* `LLM(preset, tensor_parallel_size=2)` on tiny-mixtral, tiny-qwen3-moe and tiny-qwen2-moe (the engine starts
  rank 1 itself): greedy tokens equal TP=1's (prefill in chunks, decode, several sequences).
* `mini-infer dump-graph CKPT -tp 2` on a tiny-mixtral checkpoint: a rank's loader leaves the stacked expert
  weights on the host (sliced per rank like the linears; the router is replicated), and the dumped graph of rank 0 shows fused_moe over its half of every
  expert's intermediate size, one all-reduce after each attention and each MoE block, the logits all-gather.
"""

from __future__ import annotations

import logging
import re

import pytest

from mini_infer.llm import LLM
from mini_infer.models.loader import load_model, shard_placeholders
from mini_infer.models.presets import preset_config
from tests.distributed.helpers import LLM_OPTIONS, greedy_tokens


@pytest.mark.parametrize("name", ["tiny-mixtral", "tiny-qwen3-moe", "tiny-qwen2-moe"])
def test_llm_greedy_equals_tp1(name):
    tp1 = greedy_tokens(LLM(name, **LLM_OPTIONS))
    llm = LLM(name, tensor_parallel_size=2, **LLM_OPTIONS)
    try:
        assert len(llm.engine.parallel.workers) == 1  # rank 1 runs in its own process
        assert greedy_tokens(llm) == tp1
    finally:
        llm.engine.close()


def test_dump_graph_shows_the_experts_shard_and_the_collectives(tmp_path, caplog, capsys):
    from mini_infer.cli import main

    ckpt = tmp_path / "ckpt"
    load_model("tiny-mixtral", device="cpu").model.save_pretrained(ckpt)
    # a rank's loader leaves the stacked expert weights on the host, as the linears it slices
    held_back = shard_placeholders(load_model(str(ckpt), device="cpu", tensor_parallel_size=2).model)
    assert {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"} <= set(held_back)
    assert "model.layers.0.mlp.gate.weight" not in held_back  # the router is replicated
    out_dir = tmp_path / "dump"
    with caplog.at_level(logging.INFO, logger="mini_infer"):
        assert main(["dump-graph", str(ckpt), "--device", "cpu", "-tp", "2", "--out", str(out_dir)]) == 0
    assert any("left on the host, sliced per rank" in r.getMessage() for r in caplog.records)
    assert "shard_tensor_parallel" in capsys.readouterr().out
    config = preset_config("tiny-mixtral")
    e, h, inter = config.num_local_experts, config.hidden_size, config.intermediate_size
    (after,) = out_dir.glob("*_shard_tensor_parallel.after.txt")
    text = after.read_text()
    assert re.search(rf'experts_gate_up_proj_tp0: "f32\[{e}, {inter}, {h}\]"', text), text[:2000]  # 2I / 2
    assert re.search(rf'experts_down_proj_tp0: "f32\[{e}, {h}, {inter // 2}\]"', text)
    final = sorted(out_dir.glob("*.after.txt"))[-1].read_text()
    layers = config.num_hidden_layers
    assert final.count("_c10d_functional.all_reduce.default(") == 2 * layers  # attention + MoE block
    assert final.count("_c10d_functional.all_gather_into_tensor.default(") == 1
    assert final.count("mini_infer.fused_moe.default(") == layers
