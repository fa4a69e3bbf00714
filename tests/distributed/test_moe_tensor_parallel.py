"""Mixture-of-experts models under tensor parallelism, end to end on CPU with two gloo ranks.

* `LLM(preset, tensor_parallel_size=2)` on tiny-mixtral, tiny-qwen3-moe and tiny-qwen2-moe (the engine starts
  rank 1 itself): greedy tokens equal TP=1's (prefill in chunks, decode, several sequences).
* `mini-infer dump-graph CKPT -tp 2` on a tiny-mixtral checkpoint: a rank's loader leaves the stacked expert
  weights on the host (sliced per rank like the linears; the router is replicated), and the dumped graph of rank 0 shows fused_moe over its half of every
  expert's intermediate size, one all-reduce after each attention and each MoE block, the logits all-gather.
* Expert parallelism (`enable_expert_parallel=True`, `--enable-expert-parallel`): greedy tokens equal TP=1's on
  tiny-mixtral and tiny-gpt-oss (each rank its experts whole, GPT-OSS's biases with them); rank 0 compiled from a checkpoint holds experts 0 .. E/2-1 whole and nothing of the others
  (the checkpoint's bytes of those experts exactly); `dump-graph -tp 2 --enable-expert-parallel` shows them, the
  expert map and the same collectives; a size that does not divide the experts is refused at start-up.
* GPT-OSS (this project's tp plan) from a checkpoint, rank 1 of 2: the loader leaves on the host exactly what the
  pass slices, and the compiled graph reads its heads' sinks, its half of every expert's intermediate size and a
  zero down bias (rank 0 adds it once).
"""

from __future__ import annotations

import logging
import re

import pytest
import torch

from mini_infer.compiler import compile_model
from mini_infer.llm import LLM
from mini_infer.models.loader import load_model, shard_placeholders
from mini_infer.models.presets import preset_config
from mini_infer.passes import PassContext
from tests.distributed.helpers import LLM_OPTIONS, greedy_tokens


# one preset end to end (~10 s each of the suite's 15-minute budget): tiny-qwen2-moe, whose replicated shared expert
# is the odd case; tests/passes/test_shard_tensor_parallel.py's 2-rank test compares all three MoE presets' logits
# with eager HF and TP=1
@pytest.mark.parametrize("name", ["tiny-qwen2-moe"])
def test_llm_greedy_equals_tp1(name):
    tp1 = greedy_tokens(LLM(name, **LLM_OPTIONS))
    llm = LLM(name, tensor_parallel_size=2, **LLM_OPTIONS)
    try:
        assert len(llm.engine.parallel.workers) == 1  # rank 1 runs in its own process
        assert greedy_tokens(llm) == tp1
    finally:
        llm.engine.close()


# one preset end to end (each is ~11 s of the suite's budget): tests/passes/test_shard_tensor_parallel.py's 2-rank
# expert-parallel test compares all three MoE presets' logits with eager HF and TP=1; tiny-mixtral is the one whose
# greedy ids changed when the expert map was broken on purpose
@pytest.mark.parametrize("name", ["tiny-mixtral", "tiny-gpt-oss"])
def test_llm_expert_parallel_greedy_equals_tp1(name):
    tp1 = greedy_tokens(LLM(name, **LLM_OPTIONS))
    llm = LLM(name, tensor_parallel_size=2, enable_expert_parallel=True, **LLM_OPTIONS)
    try:
        assert llm.engine.config.enable_expert_parallel and len(llm.engine.parallel.workers) == 1
        moe = [n for n in llm.engine.compiled.graph_module.graph.nodes if "fused_moe" in str(n.meta.get("op", ""))]
        assert moe and all(len(n.args) >= 7 and n.args[6] is not None for n in moe)  # rank 0's take the expert map
        assert greedy_tokens(llm) == tp1
    finally:
        llm.engine.close()


@pytest.fixture(scope="module")
def mixtral_checkpoint(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("tiny-mixtral-ckpt")
    load_model("tiny-mixtral", device="cpu").model.save_pretrained(ckpt)
    return ckpt


def test_expert_parallel_rank_loads_only_its_experts(mixtral_checkpoint):
    """Rank 0 of 2 from a checkpoint: the stacked experts stay on the host at load; compiled, the graph holds
    experts 0 .. E/2-1 of every layer as the checkpoint has them, and its expert weights are exactly their
    bytes (half of all experts)."""
    whole = load_model(str(mixtral_checkpoint), device="cpu").model
    stacks = {n: t for n, t in whole.named_parameters() if n.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    e = next(iter(stacks.values())).shape[0]
    loaded = load_model(str(mixtral_checkpoint), device="cpu", tensor_parallel_size=2)
    assert set(stacks) <= set(shard_placeholders(loaded.model))
    gm = compile_model(loaded.model, rank=0, world_size=2, expert_parallel=True).graph_module
    moe = [n for n in gm.graph.nodes if n.meta.get("op") is torch.ops.mini_infer.fused_moe.default]
    held = [PassContext.tensor_of(gm, a) for n in moe for a in n.args[3:5]]
    layers = whole.config.num_hidden_layers
    assert len(moe) == layers
    for i, n in enumerate(moe):
        w13, w2 = (PassContext.tensor_of(gm, a) for a in n.args[3:5])
        assert torch.equal(w13, stacks[f"model.layers.{i}.mlp.experts.gate_up_proj"][:e // 2])
        assert torch.equal(w2, stacks[f"model.layers.{i}.mlp.experts.down_proj"][:e // 2])
    assert sum(t.nbytes for t in held) * 2 == sum(t.nbytes for t in stacks.values())


def test_expert_parallel_refused_at_start_up_when_the_experts_do_not_split(tmp_path):
    """Five experts over two ranks: refused before loading, naming both numbers; fine with the experts split
    inside (tensor parallelism), which needs no even count of experts."""
    from mini_infer.models.loader import build_random_model
    from mini_infer.runtime.engine import EngineConfig
    from mini_infer.runtime.preflight import check_before_load

    config = preset_config("tiny-mixtral")
    config.num_local_experts = 5
    build_random_model(config, torch.float32, torch.device("cpu")).save_pretrained(tmp_path)
    options = dict(model=str(tmp_path), device="cpu", tensor_parallel_size=2)
    check_before_load(EngineConfig(**options))
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 does not divide the 5 routed experts"):
        check_before_load(EngineConfig(**options, enable_expert_parallel=True))


def test_dump_graph_shows_the_expert_parallel_shard(mixtral_checkpoint, tmp_path, capsys):
    from mini_infer.cli import main

    out_dir = tmp_path / "dump"
    assert main(["dump-graph", str(mixtral_checkpoint), "--device", "cpu", "-tp", "2", "--enable-expert-parallel",
                 "--out", str(out_dir)]) == 0
    assert "expert parallel: experts 0..1 of 4 on this rank" in capsys.readouterr().out
    config = preset_config("tiny-mixtral")
    e, h, inter = config.num_local_experts, config.hidden_size, config.intermediate_size
    (after,) = out_dir.glob("*_shard_tensor_parallel.after.txt")
    text = after.read_text()
    assert re.search(rf'experts_gate_up_proj_ep0: "f32\[{e // 2}, {2 * inter}, {h}\]"', text), text[:2000]
    assert re.search(rf'experts_down_proj_ep0: "f32\[{e // 2}, {h}, {inter}\]"', text)
    assert re.search(rf'moe_expert_map_0_{e // 2 - 1}: "i32\[{e}\]"', text)
    final = sorted(out_dir.glob("*.after.txt"))[-1].read_text()
    layers = config.num_hidden_layers
    assert final.count("mini_infer.all_reduce_sum.default(") == 2 * layers  # attention + MoE block
    assert final.count("_c10d_functional.all_gather_into_tensor.default(") == 1
    assert len(re.findall(r"mini_infer\.fused_moe\.default\(.*moe_expert_map", final)) == layers


def test_dump_graph_shows_the_experts_shard_and_the_collectives(mixtral_checkpoint, tmp_path, caplog, capsys):
    from mini_infer.cli import main

    ckpt = mixtral_checkpoint
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
    assert final.count("mini_infer.all_reduce_sum.default(") == 2 * layers  # attention + MoE block
    assert final.count("_c10d_functional.all_gather_into_tensor.default(") == 1
    assert final.count("mini_infer.fused_moe.default(") == layers


def test_gpt_oss_rank_loads_and_compiles_its_slices(tmp_path):
    """GPT-OSS (this project's tp plan) from a checkpoint with large biases and sinks, rank 1 of 2: the loader
    leaves on the host exactly what the pass slices (q/k/v weights and biases, o_proj's weight, the sinks, the
    four expert tensors, lm_head), and the compiled graph reads heads 2, 3 of the sinks, the second half of every
    expert's intermediate size (whole gate/up pairs of the interleaved gate_up_proj) and a zero down bias (rank 0
    adds it, once)."""
    from mini_infer.models.loader import build_random_model
    from tests.passes.test_shard_tensor_parallel import _large_gpt_oss_biases

    src = build_random_model(preset_config("tiny-gpt-oss"), torch.float32, torch.device("cpu"), seed=0)
    _large_gpt_oss_biases(src)
    src.save_pretrained(tmp_path)
    whole = dict(src.named_parameters())
    loaded = load_model(str(tmp_path), device="cpu", tensor_parallel_size=2)
    sliced = ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias",
              "o_proj.weight", "self_attn.sinks", "experts.gate_up_proj", "experts.gate_up_proj_bias",
              "experts.down_proj", "experts.down_proj_bias")
    assert sorted(shard_placeholders(loaded.model)) == sorted(
        n for n in whole if n.endswith(sliced) or n == "lm_head.weight")
    gm = compile_model(loaded.model, rank=1, world_size=2).graph_module
    moe = [n for n in gm.graph.nodes if n.meta.get("op") is torch.ops.mini_infer.fused_moe.default]
    assert len(moe) == loaded.model.config.num_hidden_layers
    sinks = [PassContext.tensor_of(gm, a) for n in gm.graph.nodes for a in n.args
             if isinstance(a, torch.fx.Node) and a.op == "get_attr" and "sinks" in str(a.target)]
    assert len(sinks) == len(moe)
    for i, (n, s) in enumerate(zip(moe, sinks, strict=True)):
        p = f"model.layers.{i}.mlp.experts."
        assert torch.equal(s, whole[f"model.layers.{i}.self_attn.sinks"][2:])
        two_i = whole[p + "gate_up_proj"].shape[2]
        gate_up, bias = whole[p + "gate_up_proj"][..., two_i // 2:], whole[p + "gate_up_proj_bias"][:, two_i // 2:]
        w13, w2, b13, b2 = (PassContext.tensor_of(gm, n.args[j]) for j in (3, 4, 7, 8))
        assert torch.equal(w13, torch.cat([gate_up[..., ::2], gate_up[..., 1::2]], 2).transpose(1, 2))
        assert torch.equal(b13, torch.cat([bias[:, ::2], bias[:, 1::2]], 1))
        assert torch.equal(w2, whole[p + "down_proj"][:, two_i // 4:].transpose(1, 2))
        assert not b2.any() and whole[p + "down_proj_bias"].abs().max() > 1
