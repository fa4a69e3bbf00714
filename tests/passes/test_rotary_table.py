"""RotaryTable: the values computed from position_ids alone (rotary cos/sin, DeepSeek-V2's complex freqs) become
embedding lookups in tables built at compile time. Per preset: the tables (count, shape, dtype), nothing computed
from the positions left but the lookups, inv_freq gone; every surviving node bit-equal to the unrewritten graph's
on shuffled positions up to P - 1; the full pipeline's logits bit-equal to the same pipeline without the pass on
a packed batch of sequences at scattered positions, and equal to eager HF per sequence. Toys: HF's matmul form of
the rotary, a graph without position math, position math that is not per position.
"""

import copy
import functools

import pytest
import torch
import torch.fx as fx
from hypothesis import given
from hypothesis import strategies as st

from mini_infer.contract.inputs import MAX_POSITIONS
from mini_infer.models.presets import TINY_PRESETS
from mini_infer.passes import PassConfigError, PassContext, recommended_passes, resolve_passes
from mini_infer.passes.capture import capture
from mini_infer.passes.manager import PassManager
from mini_infer.passes.rotary_table import RotaryTable, position_only
from mini_infer.passes.rotary_table import _re_views as re_views
from tests.passes.helpers import (
    ARCHS,
    CPU,
    FEW,
    PagedCache,
    ToyLM,
    _cleaned,
    assert_logits_close,
    aten,
    check_against_eager,
    copy_gm,
    eager_logits,
    full_pipeline,
    loaded,
    mi,
    new_context,
    num_tokens,
    op_counts,
    placeholder_names,
    position_tables,
    random_ids,
    run_graph,
    run_passes,
    single_pass,
    step_inputs,
    variant_model,
)

P = 1024  # every tiny preset's max_position_embeddings: the table length
MASK = (aten.sub.Tensor, aten.diff.default, aten.ne.Scalar, aten.cumsum.default)  # HF's packed-sequence mask


# cos / sin of half the head dim, the rotation written on the halves (no cat); in the pipeline fuse_rotary has
# doubled each (a cat of its own), which the tables then take in
HALF_WIDTH = ("tiny-gpt-oss",)


def _expected(name, in_pipeline=False):
    """(nodes replaced, tables, row width, dtype, cats the tables take in) of a tiny preset."""
    cfg = TINY_PRESETS[name]
    if name == "tiny-deepseek-v2":  # HF's complex freqs (polar), cos and sin read from one complex table
        return 1, 1, cfg["qk_rope_head_dim"] // 2, torch.complex64, 0
    width = cfg.get("qk_rope_head_dim") or cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    if name in HALF_WIDTH:
        return (2, 2, width, torch.float32, 2) if in_pipeline else (2, 2, width // 2, torch.float32, 0)
    return 2, 2, width, torch.float32, 1  # HF's cat((freqs, freqs), -1), which cos and sin share


def _row(stats):
    (row,) = [s for s in stats if s.name == "rotary_table"]
    return row


@functools.cache
def _without(name):
    """The recommended pipeline on `name` without rotary_table (the reference the pass must equal bit for bit)."""
    passes = [p for p in recommended_passes(new_context(name)) if p.name not in ("cleanup", "rotary_table")]
    return run_passes(name, passes)


def _check_rewritten(name, gm, row, ref_gm, in_pipeline=False):
    matches, tables, width, dtype, cats = _expected(name, in_pipeline)
    assert row.num_matches == matches
    kind = f"[{P}, {width}] {str(dtype).removeprefix('torch.')}"
    assert row.note.startswith(f"{tables} table{'s' if tables > 1 else ''} {kind}, "), row.note
    found = position_tables(gm)
    assert len(found) == tables and all(t.shape == (P, width) and t.dtype == dtype for t in found.values())
    assert not any("inv_freq" in n for n, _ in gm.named_buffers())  # dropped with the sub-graph that read it
    assert any("inv_freq" in n for n, _ in ref_gm.named_buffers())
    counts, before = op_counts(gm), op_counts(ref_gm)
    assert counts[aten.cos.default] == counts[aten.sin.default] == counts[aten.polar.default] == 0
    assert before[aten.cos.default] + before[aten.polar.default] > 0
    # the rotary's cat((freqs, freqs), -1) is gone (DeepSeek-V2 has none); every other cat stays
    assert counts[aten.cat.default] == before[aten.cat.default] - cats
    assert counts[aten.embedding.default] == before[aten.embedding.default] + tables
    # what is still computed from position_ids alone: the lookups and views of them (and, before paged_attention,
    # HF's packed-sequence mask, which is not per position)
    pos = next(n for n in gm.graph.nodes if n.name == "position_ids")
    derived, _ = position_only(gm.graph, pos)
    lookups = [n for n in derived if n.target is aten.embedding.default]
    assert len(lookups) == tables
    assert not [n.format_node() for n in derived if n not in lookups and not re_views(n) and n.target not in MASK]


@pytest.mark.parametrize("name", ARCHS)
def test_alone(name):
    gm, ctx, stats = single_pass(name, "rotary_table")
    _check_rewritten(name, gm, stats[0], _cleaned(name))
    # HF's packed-sequence mask (diff / cumsum of the positions) is position-only too, but not per position;
    # attention captured through mini_infer.attention (Gemma 2, GPT-OSS) has no mask
    if any(n.target is mi.attention.default for n in _cleaned(name).graph.nodes):
        assert name in ("tiny-gemma2", "tiny-gpt-oss") and "left" not in stats[0].note
    else:
        assert stats[0].note.endswith("left cumsum (not per position)")
    assert ctx.info[MAX_POSITIONS] == P


@pytest.mark.parametrize("name", ARCHS)
def test_in_full_pipeline(name):
    gm, ctx, stats = full_pipeline(name)
    row = _row(stats)
    _check_rewritten(name, gm, row, _without(name)[0], in_pipeline=True)
    assert "left" not in row.note  # after paged_attention / mla_latent_cache the mask's position math is gone
    # the rotary fusions consume the cos/sin values, not their producers: they matched before this pass
    matches = {s.name: s.num_matches for s in stats}
    assert matches == {s.name: s.num_matches for s in _without(name)[2]} | {"rotary_table": row.num_matches}


class _Recorder(fx.Interpreter):
    def run_node(self, n):
        out = super().run_node(n)
        self.seen[n.name] = out
        return out


def _node_values(gm, inputs):
    rec = _Recorder(gm)
    rec.seen = {}
    with torch.no_grad():
        rec.run(*(inputs[n] for n in placeholder_names(gm)))
    return rec.seen


def _bits(t):
    t = torch.view_as_real(t) if t.is_complex() else t
    return t.contiguous().view(torch.int32) if t.dtype == torch.float32 else t


@pytest.mark.parametrize("name", ARCHS)
@given(num=num_tokens, seed=st.integers(0, 2**16))
@FEW
def test_nodes_bit_equal_on_shuffled_positions(name, num, seed):
    """Every node the pass kept computes the same bits as in the unrewritten graph, at scattered positions that
    include the table's last row: the readers of cos/sin among them."""
    gm, _, _ = single_pass(name, "rotary_table")
    ref = _cleaned(name)
    gen = torch.Generator().manual_seed(seed)
    pos = torch.cat([torch.tensor([P - 1]), torch.randint(0, P, (num - 1,), generator=gen)])[None]
    inputs = {"input_ids": random_ids(num, seed), "position_ids": pos}
    got, want = _node_values(gm, inputs), _node_values(ref, inputs)
    readers = {u.name for t in gm.graph.nodes if t.target is aten.embedding.default
               and t.args[1].name == "position_ids" for u in t.users}
    assert readers and readers <= set(got) & set(want)
    for node, value in got.items():
        if node in want and isinstance(value, torch.Tensor):
            assert torch.equal(_bits(value), _bits(want[node])), node


@pytest.mark.parametrize("name", ARCHS)
@given(num=num_tokens, start=st.integers(0, P - 40))
@FEW
def test_logits_equal_eager(name, num, start):
    gm, ctx, _ = single_pass(name, "rotary_table")
    check_against_eager(name, gm, ctx, num, start, seed=num * 7 + start)


# three sequences prefilled in one step: (positions start, tokens); the packed row's positions are not contiguous
# and reach the table's last row
PACKED = ((P - 5, 5), (3, 3), (517, 1))


def _packed_step(ctx, seed=3):
    ids = [random_ids(n, seed + i) for i, (_, n) in enumerate(PACKED)]
    pos = [torch.arange(s, s + n)[None] for s, n in PACKED]
    cache = PagedCache(ctx, 8, seed)
    chunks = [(0, n) for _, n in PACKED]
    tables = [cache.table(n) for _, n in PACKED]
    packed_ids, packed_pos = torch.cat(ids, 1), torch.cat(pos, 1)
    inputs = step_inputs(packed_ids, packed_pos, chunks, tables, cache)
    inputs["logits_indices"] = torch.arange(packed_ids.shape[1])
    return inputs, ids, pos


def _run_fresh(gm, inputs):
    return run_graph(gm, copy.deepcopy(inputs))  # the caches are written in place


def _check_packed(eager, gm, ctx, ref_gm):
    inputs, ids, pos = _packed_step(ctx)
    out = _run_fresh(gm, inputs)
    assert torch.equal(out, _run_fresh(ref_gm, inputs))
    row = 0
    for i, p in zip(ids, pos):
        assert_logits_close(out[:, row:row + i.shape[1]], eager(i, p))
        row += i.shape[1]


@pytest.mark.parametrize("name", ARCHS)
def test_packed_batch_in_full_pipeline(name):
    gm, ctx, _ = full_pipeline(name)
    _check_packed(functools.partial(eager_logits, name), gm, ctx, _without(name)[0])


# rope scaling the tiny presets do not have: Llama 3's frequency bands, YaRN with an attention factor != 1
VARIANTS = {
    "llama3": ("tiny-llama", dict(rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                    high_freq_factor=4.0, original_max_position_embeddings=128))),
    "yarn": ("tiny-deepseek-v3", dict(rope_scaling=dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0,
                                                        original_max_position_embeddings=256, mscale=1.0,
                                                        mscale_all_dim=0.0))),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_rope_scaling_variants(variant):
    preset, fields = VARIANTS[variant]
    model = variant_model(preset, **fields).eval()
    if variant == "yarn":
        assert model.model.rotary_emb.attention_scaling != 1.0
    gm = capture(model)
    ctx = PassContext(config=model.config, device=CPU, dtype=torch.float32)
    passes = recommended_passes(ctx)
    ref, ref_ctx = copy_gm(gm), PassContext(config=model.config, device=CPU, dtype=torch.float32)
    PassManager([p for p in passes if p.name != "rotary_table"]).run(ref, ref_ctx)
    row = _row(PassManager(passes).run(gm, ctx))
    assert row.num_matches == 2 and len(position_tables(gm)) == 2

    def eager(ids, pos):
        with torch.no_grad():
            return model(input_ids=ids, position_ids=pos, use_cache=False).logits

    _check_packed(eager, gm, ctx, ref)


# -- toys ---------------------------------------------------------------------------------------------------


def _run_toy(body, passes=("rotary_table",), max_positions=64):
    """Capture ToyLM(body), run cleanup then `passes` with a table length of `max_positions`; check the logits
    against eager at positions up to max_positions - 1."""
    torch.manual_seed(0)
    model = ToyLM(body).eval().requires_grad_(False)
    if max_positions is not None:
        model.config.max_position_embeddings = max_positions
    gm = capture(model)
    ctx = PassContext(config=model.config, device=CPU, dtype=torch.float32)
    stats = PassManager(resolve_passes(["cleanup", *passes])).run(gm, ctx)
    ids = torch.randint(0, 32, (1, 9))
    pos = torch.tensor([[63, 0, 5, 6, 7, 40, 41, 2, 63]]) % (max_positions or 64)
    with torch.no_grad():
        assert torch.equal(gm(ids, pos), model(ids, pos).logits)
    return gm, stats[1:], model


class _MatmulRotary(torch.nn.Module):
    """The transformers 4.x form: `inv_freq_expanded @ position_ids_expanded` (fp32), transposed, cat, cos/sin
    times an attention factor, cast to x's dtype; applied to x as x * cos + x * sin."""

    def __init__(self, d=16):
        super().__init__()
        self.inv_freq = torch.nn.Buffer(1.0 / 500000 ** (torch.arange(0, d, 2).float() / d), persistent=False)

    def forward(self, x, pos):
        inv = self.inv_freq[None, :, None].float().expand(pos.shape[0], -1, 1)
        freqs = (inv @ pos[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = (emb.cos() * 0.9).to(x.dtype), (emb.sin() * 0.9).to(x.dtype)
        return x * cos + x * sin


def test_matmul_form():
    gm, stats, _ = _run_toy(_MatmulRotary())
    assert stats[0].num_matches == 2 and stats[0].note == "2 tables [64, 16] float32, 8.2 KB"
    assert op_counts(gm)[aten.bmm.default] + op_counts(gm)[aten.matmul.default] == 0


class _TwoCopies(torch.nn.Module):
    """One table read through two copies (each a math node of its own): one table, one lookup, two matches."""

    def __init__(self, d=16):
        super().__init__()
        self.inv_freq = torch.nn.Buffer(1.0 / 10000 ** (torch.arange(0, d, 2).float() / d), persistent=False)

    def forward(self, x, pos):
        freqs = pos[..., None].float() * self.inv_freq
        cos = torch.cat((freqs, freqs), -1).cos()
        return x * cos.clone() + x.flip(-1) * cos.clone()


def test_equal_tables_shared():
    gm, stats, _ = _run_toy(_TwoCopies())
    assert stats[0].num_matches == 2 and stats[0].note == "1 table [64, 16] float32, 4.1 KB"
    assert len(position_tables(gm)) == 1 and op_counts(gm)[aten.embedding.default] == 2  # the tokens' and the table's


def test_table_too_large_or_length_unknown():
    _, stats, _ = _run_toy(_MatmulRotary(), passes=(RotaryTable(max_table_bytes=4000),))
    assert stats[0].num_matches == 0 and stats[0].note.count("4.1 KB > max_table_bytes") == 2
    _, stats, _ = _run_toy(_MatmulRotary(), max_positions=None)
    assert stats[0].num_matches == 0 and "table length unknown" in stats[0].note
    with pytest.raises(PassConfigError, match="max_table_bytes"):
        RotaryTable(max_table_bytes=-1)


class _NoPositions(torch.nn.Module):
    def forward(self, x, pos):
        return x * 2


class _NotPerPosition(torch.nn.Module):
    """Position math whose rows depend on the other positions (each position less the step's smallest)."""

    def forward(self, x, pos):
        return x * (pos - pos.min()).float()[..., None]


class _ViewsOnly(torch.nn.Module):
    """position_ids cast and viewed, no math: nothing to table."""

    def forward(self, x, pos):
        return x * pos.float()[..., None]


@pytest.mark.parametrize("body", [_NoPositions, _NotPerPosition, _ViewsOnly])
def test_left_alone(body):
    gm, stats, _ = _run_toy(body())
    assert stats[0].num_matches == 0 and not position_tables(gm)
    assert stats[0].note == ("left to (not per position)" if body is _NotPerPosition else "")


# -- the table length: the context, compile_model and the engine ----------------------------------------------


def test_table_length_from_the_engine(monkeypatch):
    import mini_infer.compiler as compiler
    import mini_infer.runtime.engine as engine_mod
    from mini_infer.compiler import compile_model
    from mini_infer.runtime.engine import EngineConfig, LLMEngine
    from tests.passes.helpers import captured

    assert new_context("tiny-llama").max_positions == P  # the config's max_position_embeddings by default
    monkeypatch.setattr(compiler, "capture", lambda model: copy_gm(captured("tiny-llama")))
    lm = loaded("tiny-llama")
    cm = compile_model(lm.model, max_positions=64)
    assert cm.context.info[MAX_POSITIONS] == 64 and {tuple(t.shape) for t in position_tables(cm.graph_module).values()} \
        == {(64, 16)}
    ids = random_ids(4, 0)
    assert_logits_close(cm(**cm.example_inputs(ids, torch.arange(60, 64)[None])),
                        eager_logits("tiny-llama", ids, torch.arange(60, 64)[None])[:, -1:])
    with pytest.raises(IndexError):  # past the table: an error, never another row
        cm(**cm.example_inputs(ids, torch.arange(61, 65)[None]))
    # the engine refuses a compiled model whose tables are shorter than its max_model_len ...
    with pytest.raises(ValueError, match="answers only positions below 64"):
        LLMEngine(EngineConfig(model="tiny-llama", device="cpu", max_model_len=128), loaded=lm, compiled=cm)
    # ... and compiles its own with max_positions = its max_model_len
    seen = {}

    class _Stop(Exception):
        pass

    def record(model, **kw):
        seen.update(kw)
        raise _Stop

    monkeypatch.setattr(engine_mod, "compile_model", record)
    with pytest.raises(_Stop):
        LLMEngine(EngineConfig(model="tiny-llama", device="cpu", max_model_len=128), loaded=lm)
    assert seen["max_positions"] == 128
