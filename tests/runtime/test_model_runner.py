"""ModelRunner's step inputs and the padded (CUDA-graph) shapes, on the CPU.

Oracles: block tables built the plain way (each sequence's table sliced to the blocks its context needs)
for the incrementally kept host mirror, across growth, resets (preemption gives a sequence a new table),
more sequences than mirror rows, and sequences leaving; and HF greedy ids for steps run in padded shapes
(on the CPU the padded graph runs eagerly through the same static buffers the CUDA graphs replay).
"""

from __future__ import annotations

import random

import pytest
import torch

from mini_infer.models.presets import TINY_DENSE_PRESETS
from mini_infer.runtime.cuda_graphs import decode_buckets, token_buckets
from mini_infer.runtime.kv_cache import KVCache
from mini_infer.runtime.model_runner import ModelRunner
from mini_infer.runtime.sequence import Sequence
from mini_infer.sampling_params import SamplingParams
from tests import _model_cache as mc
from tests.runtime.test_engine import PROMPTS, assert_no_leak, hf_ref, make_engine, run


def test_buckets():
    assert decode_buckets(256)[:6] == [1, 2, 4, 8, 16, 24] and decode_buckets(256)[-1] == 256
    assert decode_buckets(3) == [1, 2, 3]
    assert token_buckets(256, 8192) == [512, 768, 1024, 1280, 1536, 1792, 2048, 2560, 3072, 3584, 4096,
                                        5120, 6144, 7168, 8192]
    assert token_buckets(8, 24) == [24]
    assert token_buckets(8, 8) == []  # every step of at most 8 tokens fits a decode bucket or runs as is


def test_block_table_mirror_matches_plain_tables():
    compiled = mc.compiled("tiny-llama")
    cpu = torch.device("cpu")
    runner = ModelRunner(compiled, KVCache(compiled.cache_specs, 4096, 4, cpu), cpu)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1)
    live: list[Sequence] = []
    next_block = iter(range(10**9))
    for step in range(60):
        # sequences arrive and leave; over the run far more than the mirror's first 64 rows are used
        live = [s for s in live if rng.random() > 0.1]
        live += [Sequence(f"r{step}.{i}", [1] * rng.randint(1, 30), params) for i in range(rng.randint(0, 12))]
        scheduled = []
        for s in live:
            if rng.random() < 0.05:  # preempted and re-admitted: a new table, from token 0
                s.block_table = []
                s.num_computed_tokens = 0
            n = rng.randint(1, 6) if s.num_computed_tokens < s.num_prompt_tokens else 1
            n = min(n, s.num_tokens - s.num_computed_tokens) or 1
            while s.num_tokens < s.num_computed_tokens + n:
                s.append_token(1)
            need = -(-(s.num_computed_tokens + n) // 4)
            s.block_table.extend(next(next_block) % 4096 for _ in range(need - len(s.block_table)))
            scheduled.append((s, n))
        if not scheduled:
            continue
        rng.shuffle(scheduled)
        inputs, _ = runner.prepare(scheduled, [True] * len(scheduled))
        width = inputs.host["block_tables"].shape[1]
        for row, (s, n) in enumerate(scheduled):
            need = -(-(s.num_computed_tokens + n) // 4)
            assert inputs.host["block_tables"][row, :need].tolist() == s.block_table[:need], f"step {step}, row {row}"
        assert width == max(-(-(s.num_computed_tokens + n) // 4) for s, n in scheduled)
        for s, n in scheduled:
            s.num_computed_tokens += n
    assert runner._tables.shape[0] > 64  # the mirror grew past its first rows


@pytest.mark.parametrize("name", TINY_DENSE_PRESETS)
def test_greedy_matches_hf_in_padded_shapes(name):
    # 8 sequences at most, 24 tokens per step: prefill chunks mixed with decodes run padded to 24 tokens x 8
    # sequences, decode steps to the 1/2/4/8 buckets; a small cache forces preemption (tables reset)
    # (tiny-mistral's window of 8 releases old blocks as sequences advance: it needs a smaller cache to preempt)
    engine = make_engine(name, max_num_seqs=8, max_num_batched_tokens=24,
                         num_kv_blocks=11 if name == "tiny-mistral" else 20)
    engine.runner.enable_cuda_graphs(8, engine.max_model_len, 24, force=True)
    graphs = engine.runner.cuda_graphs
    shapes = []
    real_run = graphs.run

    def record(inputs, plan, shape):
        shapes.append((plan.num_tokens, plan.num_seqs, shape))
        return real_run(inputs, plan, shape)

    graphs.run = record
    outs = run(engine, PROMPTS)
    for p, o in zip(PROMPTS, outs):
        assert o.outputs[0].token_ids == hf_ref(name, tuple(p)), f"{name}: prompt of {len(p)} tokens"
    assert engine.stats["preemptions"] > 0
    padded_mixed = [s for s in shapes if s[2] == (24, 8) and s[0] < 24]
    padded_decode = [s for s in shapes if s[2][0] == s[2][1] and s[1] < s[2][1]]
    assert padded_mixed and padded_decode, shapes
    assert_no_leak(engine)


def test_steps_with_a_query_run_the_graph_declares_uncapturable_run_uncaptured(monkeypatch):
    """A pass declares UNCAPTURED_QUERY_ROWS when its op reads lengths on the host for long query runs (the
    paged-attention op's long-prefill route): steps holding such a run skip the captured shapes, the others
    still replay them, and the tokens do not change."""
    from mini_infer.contract.inputs import UNCAPTURED_QUERY_ROWS

    engine = make_engine("tiny-llama", max_num_seqs=8, max_num_batched_tokens=24, num_kv_blocks=40)
    # on the shared compiled model only for this test (later engines would warm such runs at start-up)
    monkeypatch.setitem(engine.compiled.context.info, UNCAPTURED_QUERY_ROWS, 10)
    engine.runner.enable_cuda_graphs(8, engine.max_model_len, 24, force=True)
    graphs = engine.runner.cuda_graphs
    replayed = []
    real_run = graphs.run

    def record(inputs, plan, shape):
        replayed.append(plan.max_query_len)
        return real_run(inputs, plan, shape)

    graphs.run = record
    outs = run(engine, PROMPTS)
    for p, o in zip(PROMPTS, outs):
        assert o.outputs[0].token_ids == hf_ref("tiny-llama", tuple(p)), f"prompt of {len(p)} tokens"
    assert replayed and max(replayed) < 10  # decodes and short chunks replayed; no run of 10+ rows did
    assert any(len(p) >= 10 for p in PROMPTS)
    assert_no_leak(engine)
