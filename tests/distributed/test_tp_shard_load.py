"""A tensor-parallel rank loads only its shard of a safetensors checkpoint (CPU, two gloo ranks).

A checkpoint written from the tiny-qwen2 preset (q/k/v biases, untied lm_head) into a temporary directory:

* `load_model(path, tensor_parallel_size=2)` + `compile_model` on each rank: the bytes the rank holds in memory
  of its own (the loaded model's tensors together with the compiled graph's, each storage once) are the
  replicated weights plus half of every sliced one (q/k/v weights and biases, o/gate/up/down weights, lm_head),
  not the whole model; the logits equal TP=1's.
* `LLM(path, tensor_parallel_size=2)` (the engine starts rank 1 itself): rank 0 loads for tensor parallelism
  (its log says how much stayed on the host) and greedy tokens equal TP=1's.
* `mini-infer dump-graph CKPT -tp 2` loads rank 0's shards the same way and dumps its graph.
* On a GPU (skipped without one): rank 0 of 2 of a 1.3 GB checkpoint peaks at its shard in the CUDA allocator.
* The start-up check asks a rank for memory for its shard of a checkpoint, not the whole model (presets, built
  whole on every rank, still need it all).
"""

from __future__ import annotations

import logging

import pytest
import torch

from mini_infer.compiler import compile_model
from mini_infer.llm import LLM
from mini_infer.models.loader import build_random_model, load_model
from mini_infer.models.model_info import inspect_model
from mini_infer.models.presets import preset_config
from mini_infer.runtime import preflight
from mini_infer.runtime.engine import EngineConfig
from mini_infer.runtime.preflight import check_before_load
from mini_infer.sampling_params import SamplingParams
from tests.distributed.helpers import run_ranks

# the tensors tiny-qwen2's tp plan splits (colwise weights and biases, rowwise weights) and the vocabulary-split
# lm_head; named here, not read from the plan, so that the expected bytes do not come from the code under test
SLICED = ("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias",
          "o_proj.weight", "gate_proj.weight", "up_proj.weight", "down_proj.weight", "lm_head.weight")
PASSES = ["cleanup", "shard_tensor_parallel"]  # the graph then holds weights only (no other buffers)
IDS = [[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """tiny-qwen2 saved as a HF directory (config.json + model.safetensors)."""
    path = tmp_path_factory.mktemp("tiny-qwen2-ckpt")
    load_model("tiny-qwen2", device="cpu").model.save_pretrained(path)
    assert (path / "model.safetensors").is_file()
    return path


def _own_bytes(*modules: torch.nn.Module) -> int:
    """Bytes of the distinct storages of the modules' parameters and buffers: the memory the rank allocated for
    them (a shard placeholder holds one element; tensors a host file mapping backs are not its tensors)."""
    seen: dict[int, int] = {}
    for m in modules:
        for t in [*m.parameters(), *m.buffers()]:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _load_compile_run(rank: int, world_size: int, path: str) -> dict:
    loaded = load_model(path, device="cpu", tensor_parallel_size=world_size)
    at_load = _own_bytes(loaded.model)
    compiled = compile_model(loaded.model, passes=PASSES, rank=rank, world_size=world_size)
    held = _own_bytes(loaded.model, compiled.graph_module)  # while both live: the most the rank holds at once
    ids = torch.tensor(IDS)
    logits = compiled(**compiled.example_inputs(ids))
    return dict(at_load=at_load, held=held, graph=compiled.weight_bytes, logits=logits)


def test_each_rank_holds_its_shard_and_gives_tp1_logits(checkpoint):
    whole = load_model(str(checkpoint), device="cpu").model
    named = dict(whole.named_parameters())
    sliced = sum(t.nbytes for n, t in named.items() if n.endswith(SLICED))
    params = sum(t.nbytes for t in named.values())
    assert 0.7 * params < sliced < params  # the test means something: most of the model is sliced
    (tp1,) = [_load_compile_run(0, 1, str(checkpoint))]
    whole_bytes = params + sum(t.nbytes for t in whole.buffers())  # + rotary tables
    assert tp1["at_load"] == tp1["held"] == whole_bytes and tp1["graph"] >= params

    ranks = run_ranks(_load_compile_run, 2, str(checkpoint))
    for rank, r in enumerate(ranks):
        # loading puts only the replicated weights (embedding, norms, rotary tables) in the rank's memory; a
        # shard placeholder costs one element
        assert whole_bytes - sliced <= r["at_load"] < whole_bytes - sliced + 1024, (rank, r, whole_bytes, sliced)
        # compiled: the replicated weights and half of each sliced one, and nothing more at any point
        assert r["graph"] == tp1["graph"] - sliced // 2, (rank, r, tp1, sliced)
        assert r["held"] < whole_bytes - sliced // 2 + 1024, (rank, r, whole_bytes, sliced)
        torch.testing.assert_close(r["logits"], tp1["logits"], rtol=1e-5, atol=1e-5)


def test_llm_on_a_checkpoint_greedy_equals_tp1(checkpoint, caplog):
    prompts = [{"prompt_token_ids": p} for p in (IDS[0], [7] * 3)]
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    options = dict(device="cpu", max_num_batched_tokens=16, max_num_seqs=4)
    tp1 = [list(o.outputs[0].token_ids) for o in LLM(str(checkpoint), **options).generate(prompts, greedy,
                                                                                           use_tqdm=False)]
    with caplog.at_level(logging.INFO, logger="mini_infer"):
        llm = LLM(str(checkpoint), tensor_parallel_size=2, **options)
    # rank 0's engine loaded for tensor parallelism: the sliced weights stayed on the host
    assert any("left on the host, sliced per rank" in r.getMessage() for r in caplog.records)
    try:
        tp2 = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)]
    finally:
        llm.engine.close()
    assert tp2 == tp1


def test_preflight_asks_a_rank_for_its_shard_of_a_checkpoint(checkpoint, monkeypatch):
    """Memory for 2/3 of the weights: a checkpoint passes under TP=2 (a rank loads about half), not under TP=1;
    the tiny-qwen2 preset (built whole on every rank) does not pass under TP=2 either."""
    need = inspect_model(str(checkpoint)).weight_numel * 4  # float32 on a CPU
    monkeypatch.setattr(preflight, "available_memory", lambda device: need * 2 // 3)
    check_before_load(EngineConfig(model=str(checkpoint), device="cpu", tensor_parallel_size=2))
    with pytest.raises(ValueError, match="more than the"):
        check_before_load(EngineConfig(model=str(checkpoint), device="cpu"))
    with pytest.raises(ValueError, match="more than the"):
        check_before_load(EngineConfig(model="tiny-qwen2", device="cpu", tensor_parallel_size=2))
    monkeypatch.setattr(preflight, "available_memory", lambda device: need // 3)
    with pytest.raises(ValueError, match="per rank of 2, more than the"):
        check_before_load(EngineConfig(model=str(checkpoint), device="cpu", tensor_parallel_size=2))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="measures the CUDA allocator's peak")
def test_cuda_peak_of_a_rank_is_its_shard(tmp_path):
    """On one GPU, rank 0 of 2 loads and compiles (no process group is needed to compile) a 1.3 GB bf16
    llama-shaped checkpoint: the allocator's peak is the replicated weights plus half of the sliced ones (and
    less than one sliced weight more), while a TP=1 load peaks at the whole model."""
    config = preset_config("tiny-llama")
    for k, v in dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=8, num_attention_heads=16,
                     num_key_value_heads=8, vocab_size=32000).items():
        setattr(config, k, v)
    src = build_random_model(config, torch.bfloat16, torch.device("cpu"))
    src.save_pretrained(tmp_path)
    named = dict(src.named_parameters())
    sliced = sum(t.nbytes for n, t in named.items() if n.endswith(SLICED))
    params = sum(t.nbytes for t in named.values())
    largest = max(t.nbytes for n, t in named.items() if n.endswith(SLICED))
    del src
    cuda = torch.device("cuda")

    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loaded = load_model(str(tmp_path), dtype="bf16", device=cuda, tensor_parallel_size=2)
    compiled = compile_model(loaded.model, passes=PASSES, rank=0, world_size=2)
    peak = torch.cuda.max_memory_allocated() - base
    shard = params - sliced + sliced // 2
    assert compiled.weight_bytes >= shard
    assert shard <= peak < shard + largest, (peak / 1e9, shard / 1e9, params / 1e9)
    del loaded, compiled

    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    whole = load_model(str(tmp_path), dtype="bf16", device=cuda)
    assert torch.cuda.max_memory_allocated() - base >= params  # the reference: a TP=1 load holds it all
    del whole


def test_dump_graph_of_rank_0_loads_its_shard(checkpoint, tmp_path, caplog, capsys):
    """`mini-infer dump-graph CKPT -tp 2` loads as rank 0 of a `serve -tp 2` does: sliced weights stay on the host
    and the dumped graph holds rank 0's halves."""
    from mini_infer.cli import main

    with caplog.at_level(logging.INFO, logger="mini_infer"):
        assert main(["dump-graph", str(checkpoint), "--device", "cpu", "-tp", "2", "--out", str(tmp_path)]) == 0
    assert any("left on the host, sliced per rank" in r.getMessage() for r in caplog.records)
    out = capsys.readouterr().out
    assert "shard_tensor_parallel" in out
    config = preset_config("tiny-qwen2")
    q_rows = config.num_attention_heads * (config.hidden_size // config.num_attention_heads) // 2
    (after,) = tmp_path.glob("*_shard_tensor_parallel.after.txt")
    assert f'q_proj_tp0_weight: "f32[{q_rows}, {config.hidden_size}]"' in after.read_text()
