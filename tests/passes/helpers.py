"""Shared bits of the pass tests (vLLM's TestBackend idea): capture each tiny model once per process, hand
every test its own copy of the cleaned graph, run passes on it, and compare logits with eager HF.

Capturing costs seconds per architecture, so models, captured graphs and pipelines are cached for the
whole test session (`functools.cache`); tests get fresh GraphModule copies that share the parameters.
"""

from __future__ import annotations

import copy
import functools
import math
import os
from collections import Counter

import pytest
import torch
import torch.fx as fx
from hypothesis import settings
from hypothesis import strategies as st

from mini_infer.models.loader import LoadedModel, load_model
from mini_infer.models.presets import TINY_PRESETS
from mini_infer.passes import PassContext, recommended_passes, resolve_passes
from mini_infer.passes.capture import capture
from mini_infer.passes.manager import PassManager, PassStats
from mini_infer.passes.rotary_table import TABLE_PREFIX

aten = torch.ops.aten
mi = torch.ops.mini_infer
CPU = torch.device("cpu")

ARCHS = tuple(TINY_PRESETS)  # all nine tiny presets
NUM_LAYERS = 2  # every tiny preset has two decoder layers
VOCAB = 512
METADATA_INPUTS = ("slot_mapping", "block_tables", "seq_lens", "query_start_loc")

# A few examples per property: each one runs eager HF and the graph, and the parametrization multiplies.
# Derandomized: the tiny MoE presets' random routers have near-ties (top-k gaps of ~1e-7 at some tokens, e.g.
# tiny-qwen3-moe at prompt=24/new=3/start=1 in test_two_steps_share_the_cache), where any reordering of a sum
# picks another expert and the logits legitimately differ; fixed draws keep CI from flaking on one.
FEW = settings(max_examples=4, deadline=None, derandomize=True)
num_tokens = st.integers(1, 40)
start_pos = st.integers(0, 200)


@functools.cache
def loaded(name: str) -> LoadedModel:
    lm = load_model(name, dtype="float32", device="cpu", seed=0)
    assert lm.config.num_hidden_layers == NUM_LAYERS
    return lm


@functools.cache
def captured(name: str) -> fx.GraphModule:
    """The raw capture of `name` (shared: never run a pass on it, take `copy_gm` first)."""
    return capture(loaded(name).model)


def copy_gm(gm: fx.GraphModule) -> fx.GraphModule:
    """A new GraphModule with a copy of `gm`'s graph; parameters and node fake values are shared."""
    new = fx.GraphModule(gm, copy.deepcopy(gm.graph))
    new.meta.update({k: v for k, v in gm.meta.items() if k != "_fake_attrs"})  # the manager's per-graph cache
    return new


def new_context(name: str, applied: tuple[str, ...] = ()) -> PassContext:
    lm = loaded(name)
    return PassContext(config=lm.config, device=CPU, dtype=torch.float32, applied=list(applied))


@functools.cache
def _cleaned(name: str) -> fx.GraphModule:
    gm = copy_gm(captured(name))
    PassManager(resolve_passes(["cleanup"])).run(gm, new_context(name))
    return gm


def run_passes(name: str, passes) -> tuple[fx.GraphModule, PassContext, list[PassStats]]:
    """A fresh copy of `name`'s cleaned graph with `passes` applied (cleanup already ran)."""
    gm = copy_gm(_cleaned(name))
    ctx = new_context(name, applied=("cleanup",))
    stats = PassManager(resolve_passes(passes)).run(gm, ctx)
    return gm, ctx, stats


@functools.cache
def single_pass(name: str, pass_name: str):
    """Cached `run_passes(name, [pass_name])` for tests that only read or run the result."""
    return run_passes(name, [pass_name])


@functools.cache
def full_pipeline(name: str):
    """The recommended pipeline on `name` (the cleanup that `run_passes` starts from included)."""
    passes = recommended_passes(new_context(name))
    assert passes[0].name == "cleanup"
    return run_passes(name, passes[1:])


def skip_unless_triton_interprets() -> None:
    """Skip the calling test unless Triton interprets its kernels (TRITON_INTERPRET=1, which tests/conftest.py sets on
    a machine without CUDA): Triton launchers bound to a CPU graph run only in the interpreter, and a process either
    interprets every kernel or compiles every one. On a GPU machine the same kernels run compiled on CUDA tensors in
    tests/ops and, in whole graphs, in bench/gpu_check.py (every tiny preset), bench/fp8_gpu_check.py and
    bench/quant_quality.py (the fp8 and w8a8 graphs)."""
    if not os.environ.get("TRITON_INTERPRET"):
        pytest.skip("Triton kernels bound to a CPU graph run only under TRITON_INTERPRET=1 (a machine without CUDA)")


def bound_copy(gm: fx.GraphModule, backend: str) -> tuple[fx.GraphModule, set[str]]:
    """A copy of `gm` whose mini_infer ops call their `backend` kernels ("reference" or "triton": the Triton
    launchers, under the interpreter on a CPU; skips the test where Triton compiles instead), and the names of the
    functions its nodes call."""
    from mini_infer.compiler import bind_kernels

    if backend == "triton":
        skip_unless_triton_interprets()

    graph = fx.Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    bound = fx.GraphModule(gm, graph)
    bind_kernels(bound, CPU, backend=backend)
    return bound, {getattr(n.target, "__name__", "") for n in bound.graph.nodes if n.op == "call_function"}


def op_counts(gm: fx.GraphModule) -> Counter:
    return Counter(n.target for n in gm.graph.nodes if n.op == "call_function")


def position_tables(gm: fx.GraphModule) -> dict[str, torch.Tensor]:
    """rotary_table's tables in a graph, by buffer name."""
    return {n: b for n, b in gm.named_buffers() if n.startswith(TABLE_PREFIX)}


def placeholder_names(gm: fx.GraphModule) -> list[str]:
    return [n.name for n in gm.graph.nodes if n.op == "placeholder"]


def random_ids(num: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (1, num), generator=gen)


def positions(start: int, num: int) -> torch.Tensor:
    return (start + torch.arange(num))[None]


def eager_logits(name: str, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return loaded(name).model(input_ids=ids, position_ids=pos, use_cache=False).logits


def run_graph(gm: fx.GraphModule, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    names = placeholder_names(gm)
    missing = [n for n in names if n not in inputs]
    assert not missing, f"no value for graph inputs {missing}"
    with torch.no_grad():
        return gm(*(inputs[n] for n in names))


def graph_logits(gm: fx.GraphModule, ctx: PassContext, ids: torch.Tensor, pos: torch.Tensor,
                 **overrides: torch.Tensor) -> torch.Tensor:
    """Run `gm` on one sequence with the example inputs the passes declared (overridable by name)."""
    inputs = ctx.example_inputs(ids, pos)
    inputs.update(overrides)
    return run_graph(gm, inputs)


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-4) -> None:
    """fp32 contract: max |actual - expected| <= rel * max(1, max |expected|)."""
    assert actual.shape == expected.shape, (tuple(actual.shape), tuple(expected.shape))
    assert torch.isfinite(actual).all(), "non-finite logits"
    err = (actual.float() - expected.float()).abs().max().item()
    tol = rel * max(1.0, expected.abs().max().item())
    assert err <= tol, f"max |logits - eager| = {err:.3e} > {tol:.3e}"


def assert_unfused_bits(fused: tuple, unfused: tuple, kernel: str) -> None:
    """A fusion pass's graph (`fused`: run_passes's (gm, ctx, stats)) gives the logits of the same pipeline without
    it (`unfused`) bit for bit: with the references over a 9-token prefill, and bound to the Triton kernels
    (interpreter) for a one-row step, whose graph runs `kernel` (the fused op's Triton implementation)."""
    gm, ctx = fused[0], fused[1]
    rows = torch.arange(9)
    ids, pos = random_ids(9, 4), positions(3, 9)
    assert torch.equal(graph_logits(gm, ctx, ids, pos, logits_indices=rows),
                       graph_logits(unfused[0], unfused[1], ids, pos, logits_indices=rows))
    (bound, names), (bound_ref, _) = bound_copy(gm, "triton"), bound_copy(unfused[0], "triton")
    assert kernel in names
    ids, pos, one = random_ids(1, 5), positions(12, 1), torch.arange(1)
    assert torch.equal(graph_logits(bound, ctx, ids, pos, logits_indices=one),
                       graph_logits(bound_ref, unfused[1], ids, pos, logits_indices=one))


def check_against_eager(name: str, gm: fx.GraphModule, ctx: PassContext, num: int, start: int, seed: int = 0,
                        rel: float = 1e-4, **overrides: torch.Tensor) -> None:
    """Graph logits at a new token count and new positions equal eager HF's (all rows, or the selected), within
    `rel` of the logits' scale (see assert_logits_close)."""
    ids, pos = random_ids(num, seed), positions(start, num)
    if "logits_indices" in placeholder_names(gm) and "logits_indices" not in overrides:
        overrides["logits_indices"] = torch.arange(num)
    assert_logits_close(graph_logits(gm, ctx, ids, pos, **overrides), eager_logits(name, ids, pos), rel=rel)


CACHE_BLOCK = 4  # the block size of the hand-built paged caches below


class PagedCache:
    """Every declared cache tensor (NaN in every slot not yet written) and a shuffled block allocator."""

    def __init__(self, ctx, num_blocks, seed):
        self.caches = {t.name: torch.full((num_blocks, CACHE_BLOCK, *t.shape), float("nan"), dtype=t.dtype)
                       for s in ctx.cache_specs for t in s.tensors()}
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()

    def table(self, num_tokens):
        return [self.free.pop() for _ in range(math.ceil(num_tokens / CACHE_BLOCK))]


def step_inputs(ids, pos, chunks, tables, cache):
    """Inputs for one step: `chunks` = [(context length before, new tokens)] per sequence, in packing order."""
    width = max(len(t) for t in tables) + 1  # a padding column of -1 that must never be read
    block_tables = torch.full((len(tables), width), -1, dtype=torch.int32)
    slots, seq_lens, qsl = [], [], [0]
    for s, ((done, new), table) in enumerate(zip(chunks, tables)):
        block_tables[s, :len(table)] = torch.tensor(table, dtype=torch.int32)
        slots += [table[p // CACHE_BLOCK] * CACHE_BLOCK + p % CACHE_BLOCK for p in range(done, done + new)]
        seq_lens.append(done + new)
        qsl.append(qsl[-1] + new)
    return {"input_ids": ids, "position_ids": pos, "slot_mapping": torch.tensor(slots, dtype=torch.int64),
            "block_tables": block_tables, "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
            "query_start_loc": torch.tensor(qsl, dtype=torch.int32), **cache.caches}


PREFILL_LENS = (11, 6)  # prefill_then_decode's two prompts: step 1 prefills them, step 2 decodes one token of each


def prefill_then_decode(gm: fx.GraphModule, ctx: PassContext, seed: int = 5):
    """Step 1 prefills two sequences (PREFILL_LENS) into NaN-filled paged caches (block size 4, shuffled blocks),
    step 2 decodes one more token of each (a decode-shaped launch: T = S = 2) reading step 1's keys: (step 1's
    logits at each prompt's last row, step 2's logits [1, 2, V], the two sequences' (ids, positions))."""
    lens = PREFILL_LENS
    cache = PagedCache(ctx, 12, seed)
    seqs = [(random_ids(n + 1, seed + i), positions(3 * i, n + 1)) for i, n in enumerate(lens)]
    tables = [cache.table(n + 1) for n in lens]
    outs = []
    for part, chunks, rows in ((slice(0, -1), [(0, n) for n in lens], [lens[0] - 1, sum(lens) - 1]),
                               (slice(-1, None), [(n, 1) for n in lens], [0, 1])):
        ids, pos = (torch.cat([x[:, part] for x in xs], 1) for xs in zip(*seqs))
        inputs = {**ctx.example_inputs(ids, pos), **step_inputs(ids, pos, chunks, tables, cache)}
        out = run_graph(gm, {**inputs, "logits_indices": torch.tensor(rows)})
        outs.append(out if out.shape[1] == 2 else out[:, rows])  # graphs without select_logits: every row
    return outs[0], outs[1], seqs


def variant_model(preset: str, seed: int = 1, **fields) -> torch.nn.Module:
    """A tiny preset's model (fp32, CPU, random weights) with some config fields changed."""
    from transformers import AutoConfig

    from mini_infer.models.loader import build_random_model
    from mini_infer.models.presets import TINY_PRESETS

    fields = dict(TINY_PRESETS[preset], **fields)
    model_type, dtype = fields.pop("model_type"), fields.pop("torch_dtype")
    config = AutoConfig.for_model(model_type, **fields)
    config.dtype = dtype
    return build_random_model(config, torch.float32, CPU, seed=seed)


def blocks_for(num: int, block_size: int) -> int:
    return max(1, math.ceil(num / block_size))


# -- toy "causal LMs" for matcher unit tests: a config, an embedding, a body, a head ----------------------


class ToyLM(torch.nn.Module):
    """Just enough of a transformers causal LM for `capture`: `config`, and `.logits` from a forward."""

    def __init__(self, body: torch.nn.Module, hidden: int = 16, vocab: int = 32) -> None:
        super().__init__()
        from transformers import PretrainedConfig

        self.config = PretrainedConfig(vocab_size=vocab)
        self.emb = torch.nn.Embedding(vocab, hidden)
        self.body = body
        self.head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids, position_ids, use_cache=False):
        from types import SimpleNamespace

        return SimpleNamespace(logits=self.head(self.body(self.emb(input_ids), position_ids)))


class ToyRMSNorm(torch.nn.Module):
    """HF's RMSNorm (eps 1e-6) over n features, for toy bodies of `run_toy`."""

    def __init__(self, n: int = 16) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n) * 0.1 + 1)

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * h.to(x.dtype)


def run_toy(body: torch.nn.Module, passes, hidden: int = 16):
    """Capture ToyLM(body), run cleanup then `passes`; return (gm, stats of `passes`, eager model)."""
    torch.manual_seed(0)
    model = ToyLM(body, hidden).eval().requires_grad_(False)
    gm = capture(model)
    ctx = PassContext(config=model.config, device=CPU, dtype=torch.float32)
    stats = PassManager(resolve_passes(["cleanup", *passes])).run(gm, ctx)
    ids = torch.randint(0, 32, (1, 11))
    pos = positions(3, 11)
    with torch.no_grad():
        torch.testing.assert_close(gm(ids, pos), model(ids, pos).logits, atol=1e-5, rtol=1e-5)
    return gm, stats[1:], model
