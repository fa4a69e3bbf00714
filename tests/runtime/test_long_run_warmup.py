"""The start-up runs of long query runs (runtime/warmup.py): which steps are picked, that the engine runs them
once before any request when a pass declared an uncaptured run length (paged_attention's long-prefill route),
on scratch blocks (the real cache untouched, the outputs unchanged), and that nothing runs when no length was
declared (the route off, or "auto" on a CPU).

On CPU the route is forced as in tests/ops/test_paged_attention_prefill_sdpa.py (`ROUTE = "on"`, 8 rows), and
tiny-llama is compiled under it, so the paged_attention pass declares the length as it does on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from mini_infer.compiler import CompiledModel, compile_model
from mini_infer.contract.inputs import UNCAPTURED_QUERY_ROWS
from mini_infer.ops import _prefill_sdpa
from mini_infer.runtime.engine import EngineConfig, LLMEngine
from mini_infer.runtime.memory import ActivationProfile, activation_reserve
from mini_infer.runtime.warmup import lone_chunk_step, long_run_chunks
from tests import _model_cache as mc
from tests.runtime.test_engine import GREEDY, hf_ref, random_prompts, run

MIN_ROWS = 8
NAME = "tiny-llama"
LAYERS = 2  # tiny-llama's attention layers


def compiled_under(route: str) -> CompiledModel:
    """tiny-llama compiled with the route switched to `route` (its pass reads it at compile time)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_prefill_sdpa, "ROUTE", route)
        mp.setattr(_prefill_sdpa, "MIN_QUERY_ROWS", MIN_ROWS)
        return compile_model(mc.loaded(NAME).model, device="cpu", model_name=NAME)


@pytest.fixture(scope="module")
def routed():
    return compiled_under("on")


@pytest.fixture
def attended(monkeypatch):
    """The route forced on at run time; records (query rows, context rows) of every run it attends."""
    monkeypatch.setattr(_prefill_sdpa, "ROUTE", "on")
    monkeypatch.setattr(_prefill_sdpa, "MIN_QUERY_ROWS", MIN_ROWS)
    seen: list[tuple[int, int]] = []
    attend_run = _prefill_sdpa.attend_run

    def spy(q, k, v, k_ctx, v_ctx, *rest):
        seen.append((q.shape[0], k_ctx.shape[0]))
        return attend_run(q, k, v, k_ctx, v_ctx, *rest)

    monkeypatch.setattr(_prefill_sdpa, "attend_run", spy)
    return seen


def make(compiled: CompiledModel, **kw) -> LLMEngine:
    if "kv_cache_memory_bytes" not in kw:
        kw.setdefault("num_kv_blocks", 64)
    return LLMEngine(EngineConfig(model=NAME, device="cpu", block_size=4, max_model_len=64, max_num_batched_tokens=24,
                                  async_scheduling=False, **kw), loaded=mc.loaded(NAME), compiled=compiled)


# ---------------------------------------------------------------------- which steps


def test_chunks_are_a_lone_prompts_largest_after_doubling_contexts_up_to_the_longest():
    assert long_run_chunks(None, 8192, 32032, 16) == []  # nothing declared
    assert long_run_chunks(4096, 2048, 32032, 16) == []  # no chunk reaches the declared length
    ladder = [(c, 8192) for c in (0, 8192, 16384, 23840)]
    assert long_run_chunks(4096, 8192, 32032, 16) == ladder
    assert long_run_chunks(4096, 8192, 32040, 16) == ladder  # whole blocks of context
    assert long_run_chunks(4096, 8192, 16384, 16) == [(0, 8192), (8192, 8192)]  # the ladder's end is the longest
    assert long_run_chunks(4096, 8192, 131072, 16) == [(c, 8192) for c in (0, 8192, 16384, 32768, 65536, 122880)]
    assert long_run_chunks(4096, 8192, 6000, 16) == [(0, 6000)]  # the whole model length in one chunk
    assert long_run_chunks(8, 24, 64, 4) == [(0, 24), (24, 24), (40, 24)]
    assert long_run_chunks(8, 10, 64, 4) == [(0, 10), (12, 10), (24, 10), (48, 10), (52, 10)]  # whole blocks


def test_the_ladder_meets_every_power_of_two_context_group_of_a_prompt():
    """Each chunk of a lone prompt of any length has its context's power-of-two group warmed (cuDNN's plan key
    under TORCH_CUDNN_SDPA_AVOID_RECOMPILE, ops/_prefill_sdpa.py)."""
    def group(c: int) -> int:
        return 1 << (c - 1).bit_length() if c else 0

    chunk, max_len = 8192, 131072
    warmed = {group(c) for c, _ in long_run_chunks(4096, chunk, max_len, 16)}
    assert all(group(c) in warmed for c in range(0, max_len - chunk + 1, chunk))


def test_auto_route_on_cuda_declares_the_length_the_warm_up_starts_from(monkeypatch):
    """What the engine reads on a GPU by default: the route's length for CUDA only (no GPU needed to ask)."""
    monkeypatch.setattr(_prefill_sdpa, "ROUTE", "auto")
    rows = _prefill_sdpa.route_min_query_rows(torch.device("cuda"))
    assert rows == _prefill_sdpa.MIN_QUERY_ROWS
    assert _prefill_sdpa.route_min_query_rows(torch.device("cpu")) is None
    # bench/latency.py --prompt-len 32000 --new-tokens 16: max_model_len 32032, the GPU's 8,192-token budget
    assert long_run_chunks(rows, 8192, 32032, 16) == [(c, 8192) for c in (0, 8192, 16384, 23840)]


def test_lone_chunk_step_writes_its_own_blocks_and_reads_the_spare_one_as_context():
    step, blocks = lone_chunk_step(8, 6, 4)
    assert blocks == 3  # the 6 new tokens' two blocks, then the spare one
    assert step.block_tables.tolist() == [[2, 2, 0, 1]]
    assert step.positions.tolist() == list(range(8, 14))
    assert step.slot_mapping.tolist() == [0, 1, 2, 3, 4, 5]
    assert step.seq_lens.tolist() == [14] and step.query_start_loc.tolist() == [0, 6]
    assert step.logits_indices.tolist() == [5]
    with pytest.raises(ValueError, match="multiple of the block size"):
        lone_chunk_step(6, 6, 4)


def test_reserve_takes_the_larger_default_pool_need_plus_the_graph_pool():
    prof = ActivationProfile(forward_bytes=100, step_bytes=130)
    assert activation_reserve(prof, 0, cuda_graphs=True) == 230
    assert activation_reserve(prof, 500, cuda_graphs=True) == 600
    assert activation_reserve(prof, 500, cuda_graphs=False) == 500


# ---------------------------------------------------------------------- the engine


def test_routed_pass_declares_the_run_length(routed):
    assert routed.context.info[UNCAPTURED_QUERY_ROWS] == MIN_ROWS


@pytest.mark.parametrize("budget", [dict(num_kv_blocks=64), dict(kv_cache_memory_bytes=1 << 20)],
                         ids=["num_kv_blocks", "kv_cache_memory_bytes"])
def test_engine_runs_the_long_runs_once_at_start_up(routed, attended, budget):
    """Before any request, every layer attends the 24-token chunk through the route at contexts 0, 24 and 40; the
    real cache is untouched, and greedy outputs (prompts chunked through the route) still equal HF's."""
    engine = make(routed, **budget)
    assert attended == [(24, 0)] * LAYERS + [(24, 24)] * LAYERS + [(24, 40)] * LAYERS
    assert engine.long_run_warmup.chunks == [(0, 24), (24, 24), (40, 24)]
    assert engine.warmup_seconds > 0
    assert all(not t.any() for t in engine.kv_cache.tensors.values())
    attended.clear()
    prompts = random_prompts(3, (30, 9, 50))
    outs = run(engine, prompts)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_ref(NAME, tuple(p)), f"prompt of {len(p)} tokens"
    assert attended  # the requests took the route too
    attended.clear()
    make(routed, **budget)  # a second engine of the process warms its own start-up again, once
    assert len(attended) == 3 * LAYERS


@pytest.mark.parametrize("route", ["off", "auto"])
def test_nothing_runs_at_start_up_without_a_declared_length(route, monkeypatch):
    """The route off (or "auto" on a CPU): no length declared, no step runs before the first request."""
    compiled = compiled_under(route)
    assert UNCAPTURED_QUERY_ROWS not in compiled.context.info
    calls = []
    call = CompiledModel.__call__
    monkeypatch.setattr(CompiledModel, "__call__", lambda self, **kw: calls.append(1) or call(self, **kw))
    engine = make(compiled)
    assert calls == [] and engine.long_run_warmup is None and engine.warmup_seconds == 0.0
    prompt = random_prompts(4, (30,))[0]
    assert run(engine, [prompt], GREEDY)[0].outputs[0].token_ids == hf_ref(NAME, tuple(prompt))
