"""The contract end to end: a pass defined here (not in mini_infer) adds a graph input and a cache the runtime
has never heard of, and the engine feeds and allocates them from the declarations alone — eagerly and
through the padded (CUDA-graph) path.

The test pass inserts `tests_contract::record_tokens` after the embedding: it returns the embeddings unchanged
and writes, at each token's cache slot, (token id, context length of its sequence in this step). The context
length is the new declared input (`token_context_len`, built from the step's sequence lengths), the records
live in the new declared cache (`record_cache`, one [2] int64 entry per token). Checked: greedy ids equal HF
(the pass changes nothing), every computed position of every running sequence holds its own token and the
context length of the step that computed it, and no other slot was written (padding wrote nothing).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mini_infer.contract import CacheSpec, CacheTensor, InputSpec
from mini_infer.contract.inputs import SLOT_MAPPING
from mini_infer.passes import GraphPass, PassResult
from mini_infer.passes.pattern import aten, is_op
from mini_infer.runtime.engine import EngineConfig, LLMEngine
from mini_infer.sampling_params import SamplingParams
from tests import _model_cache as mc

PIPELINE = ["cleanup", "select_logits", "fuse_rmsnorm", "fuse_rotary", "merge_projections", "fuse_silu_mul",
            "paged_attention", "gemv_linear"]


@torch.library.custom_op("tests_contract::record_tokens", mutates_args=("cache",))
def record_tokens(x: torch.Tensor, input_ids: torch.Tensor, context_len: torch.Tensor, cache: torch.Tensor,
                  slot_mapping: torch.Tensor) -> torch.Tensor:
    valid = slot_mapping >= 0
    rows = torch.stack([input_ids.reshape(-1), context_len.to(torch.int64)], dim=-1)
    cache.view(-1, 2)[slot_mapping[valid]] = rows[valid]
    return x.clone()


@record_tokens.register_fake
def _(x, input_ids, context_len, cache, slot_mapping):
    return torch.empty_like(x)


CONTEXT_LEN = InputSpec("token_context_len", torch.int32, ("tokens",),
                        lambda step: step.seq_lens[step.token_seq_index()], pad=0)


@dataclass(frozen=True)
class RecordSpec(CacheSpec):
    """One [token id, context length] entry per token."""

    layer_idx: int = 0

    def tensors(self) -> tuple[CacheTensor, ...]:
        return (CacheTensor("record_cache", (2,), torch.int64),)


class RecordTokens(GraphPass):
    name = "record_tokens"
    stage = "lowering"
    requires = ("cleanup",)

    def apply(self, gm, ctx):
        emb = next(n for n in gm.graph.nodes if is_op(n, aten.embedding.default))
        ids = next(n for n in gm.graph.nodes if n.op == "placeholder" and n.name == "input_ids")
        context_len = ctx.add_input(gm, CONTEXT_LEN)
        slots = ctx.add_input(gm, SLOT_MAPPING)  # already declared by paged_attention: the same node
        cache = ctx.add_cache(gm, RecordSpec())["record_cache"]
        with gm.graph.inserting_after(emb):
            rec = gm.graph.call_function(torch.ops.tests_contract.record_tokens.default,
                                         (emb, ids, context_len, cache, slots))
        rec.meta["val"] = emb.meta["val"]
        emb.replace_all_uses_with(rec, delete_user_cb=lambda user: user is not rec)
        return PassResult(1)


def _check_records(engine: LLMEngine, seqs, owned: set[int]) -> None:
    """Every computed position of `seqs` holds its record; their slots join `owned`."""
    cache = engine.kv_cache.tensors["record_cache"].view(-1, 2)
    bs = engine.config.block_size
    for seq in seqs:
        for p in range(seq.num_computed_tokens):
            slot = seq.block_table[p // bs] * bs + p % bs
            owned.add(slot)
            token, ctx_len = cache[slot].tolist()
            assert token == seq.token_ids[p], (seq.request_id, p)
            if p >= seq.num_prompt_tokens:  # a decode step: context is exactly up to this token
                assert ctx_len == p + 1, (seq.request_id, p, ctx_len)
            else:  # a prefill chunk ending after p
                assert p < ctx_len <= seq.num_prompt_tokens, (seq.request_id, p, ctx_len)


def _check_unowned(engine: LLMEngine, owned: set[int]) -> None:
    cache = engine.kv_cache.tensors["record_cache"].view(-1, 2)
    others = [s for s in range(cache.shape[0]) if s not in owned]
    assert (cache[others, 1] == 0).all(), "a slot no sequence owns was written (padding must write nothing)"


def _run(padded: bool):
    name = "tiny-llama"
    engine = LLMEngine(EngineConfig(model=name, device="cpu", num_kv_blocks=64, block_size=4, max_num_seqs=4,
                                    max_num_batched_tokens=16, async_scheduling=False,
                                    passes=[*PIPELINE, RecordTokens()]), loaded=mc.loaded(name))
    assert "token_context_len" in engine.compiled.input_names
    assert "record_cache" in engine.kv_cache.tensors and engine.kv_cache.tensors["record_cache"].shape == (64, 4, 2)
    assert engine.compiled.context.declared_by["record_cache"] == "record_tokens"
    shapes = []
    if padded:
        engine.runner.enable_cuda_graphs(4, engine.max_model_len, 16, force=True)
        real_run = engine.runner.cuda_graphs.run
        engine.runner.cuda_graphs.run = lambda inputs, plan, shape: shapes.append(shape) or real_run(
            inputs, plan, shape)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (5, 19, 2)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    finals = {}
    owned: set[int] = set()
    real_free = engine.block_manager.free

    def check_then_free(seq):  # a finishing sequence's last computed tokens, before its table goes
        _check_records(engine, [seq], owned)
        real_free(seq)

    engine.block_manager.free = check_then_free
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.outputs[0].token_ids
        _check_records(engine, list(engine.scheduler.running), owned)
        _check_unowned(engine, owned)
    assert len(owned) >= 19 + 5  # the long prompt and some of its decodes were checked
    for i, p in enumerate(prompts):
        assert finals[f"r{i}"] == mc.hf_greedy(mc.loaded(name).model, p, 6)
    return shapes


def test_declared_input_and_cache_eager():
    assert _run(padded=False) == []


def test_declared_input_and_cache_padded_graph_path():
    shapes = _run(padded=True)
    assert (16, 4) in shapes and any(s[0] == s[1] for s in shapes)  # mixed and decode buckets both ran
