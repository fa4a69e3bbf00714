"""The staged inputs of CUDA-graph steps, on the CPU (where the padded shapes run eagerly through the same
static views, after the same staged copy).

Oracles: every input of every padded step, read back from the bucket's static views after the copy, against
the step's own host values (with the rows fed from the device) extended along each padded dimension by
concatenation with the spec's pad value (or its last real slice), not by the region writes under test; for
`pad` None inputs only the real part is compared (their padding is never read). And the order of the
staging buffer's own operations: a host buffer is handed out again only after waiting for the copy that last
read it, and never for the copy just queued.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mini_infer.contract import PADDED_DIMS
from mini_infer.runtime.transfer import ALIGN, StagedBuffer, pack, typed_views
from mini_infer.sampling_params import SamplingParams
from tests.runtime.test_engine import PROMPTS, assert_no_leak, hf_ref, make_engine, run


def _expected(spec, value: torch.Tensor, padded: tuple[int, ...]) -> torch.Tensor:
    """`value` grown to `padded` one dimension at a time by concatenation (pad value or last slice)."""
    out = value
    for dim, name in enumerate(spec.shape):
        missing = padded[dim] - out.shape[dim]
        if name not in PADDED_DIMS or missing <= 0:
            continue
        if spec.pad == "last":
            fill = out.narrow(dim, out.shape[dim] - 1, 1).repeat_interleave(missing, dim=dim)
        else:
            shape = list(out.shape)
            shape[dim] = missing
            fill = torch.full(shape, spec.pad, dtype=out.dtype)
        out = torch.cat([out, fill], dim=dim)
    return out


@pytest.mark.parametrize("step_tokens", [24, 16])
def test_staged_inputs_hold_each_step_padded_to_its_bucket(step_tokens):
    # async scheduling: decode rows take the previous step's ids on the device (fed after the copy); 5 prompts
    # finishing at different lengths: steps of a bucket shrink after larger ones (stale rows must be padded).
    # Every id the graph embeds, padding rows included, must be a token id: 16-token steps once uploaded a host
    # buffer's stale -1 placeholders into input_ids' padding (an index error in the embedding on a GPU)
    engine = make_engine("tiny-llama", max_num_seqs=8, max_num_batched_tokens=step_tokens, num_kv_blocks=40,
                         async_scheduling=True)
    engine.runner.enable_cuda_graphs(8, engine.max_model_len, step_tokens, force=True)
    graphs = engine.runner.cuda_graphs
    real_run = graphs.run
    checked, wrong, fed, last_seqs, shrunk = [], [], 0, {}, 0

    def check(inputs, plan, shape):
        logits = real_run(inputs, plan, shape)
        nonlocal fed, shrunk
        views = graphs.staged[shape].views
        ids = views["input_ids"]
        if not bool(((ids >= 0) & (ids < engine.vocab_size)).all()):
            wrong.append(("input_ids not token ids", shape, plan.num_seqs))
        for spec in graphs.specs:
            value = torch.as_tensor(np.asarray(inputs.host[spec.name])).to(spec.dtype)
            if spec.name == "input_ids" and inputs.pending is not None:
                p = inputs.pending
                value[0, p.dst] = p.source[p.src].to(value.dtype)
                fed += len(p.dst)
            if spec.pad is None:
                real = tuple(slice(0, n) for n in value.shape)
                if not torch.equal(views[spec.name][real], value):
                    wrong.append((spec.name, shape, plan.num_seqs))
                continue
            padded = graphs._padded(spec, tuple(value.shape), shape)
            got = views[spec.name][tuple(slice(0, n) for n in padded)]
            if not torch.equal(got, _expected(spec, value, padded)):
                wrong.append((spec.name, shape, plan.num_seqs))
        if plan.num_seqs < last_seqs.get(shape, 0):
            shrunk += 1
        last_seqs[shape] = plan.num_seqs
        checked.append(shape)
        return logits

    graphs.run = check
    outs = run(engine, PROMPTS)
    assert not wrong, wrong[:5]  # (input, bucket, sequences in the step)
    for p, o in zip(PROMPTS, outs):
        assert o.outputs[0].token_ids == hf_ref("tiny-llama", tuple(p)), f"prompt of {len(p)} tokens"
    assert any(t == s for t, s in checked) and (step_tokens, 8) in checked  # decode and mixed buckets
    assert fed and shrunk, (fed, shrunk)
    assert_no_leak(engine)


class _RecordedFence:
    """Stands in for the CUDA event a staging buffer records after each copy (this machine has no CUDA
    device, and CPU copies are synchronous): it logs when it is recorded and when it is waited on."""

    log: list[tuple[str, int]] = []
    made = 0

    def __init__(self) -> None:
        _RecordedFence.made += 1
        self.id = _RecordedFence.made

    def record(self) -> None:
        self.log.append(("record", self.id))

    def synchronize(self) -> None:
        self.log.append(("wait", self.id))


def test_staging_buffer_is_reused_only_after_its_copy_ran():
    _RecordedFence.log, _RecordedFence.made = [], 0
    staged = StagedBuffer([("a", torch.int64, (3,)), ("b", torch.int32, (2, 5))], torch.device("cpu"),
                          fence=_RecordedFence)
    assert staged.fields[1].offset % 64 == 0 and staged.nbytes == staged.fields[1].offset + 40
    handed = []
    for step in range(4):
        host = staged.begin()
        handed.append(host["a"])
        host["a"][:] = [step, step + 1, step + 2]
        host["b"][:] = step
        staged.upload()
        assert staged.views["a"].tolist() == [step, step + 1, step + 2]
        assert staged.views["b"].eq(step).all()
    # two host buffers in turn: the step being prepared never writes the buffer of the copy just queued
    assert not np.shares_memory(handed[0], handed[1]) and np.shares_memory(handed[0], handed[2])
    # one fence per host buffer: each buffer's reuse waits for the copy that last read it, recorded after
    # that copy (buffer 0's fence 1 before step 2, buffer 1's fence 2 before step 3)
    assert _RecordedFence.log == [("record", 1), ("record", 2), ("wait", 1), ("record", 1), ("wait", 2),
                                  ("record", 2)]


def test_staged_upload_copies_only_the_bytes_asked():
    staged = StagedBuffer([("a", torch.int64, (4,))], torch.device("cpu"))
    staged.begin()["a"][:] = [1, 2, 3, 4]
    staged.upload(16)  # the first two elements
    assert staged.views["a"].tolist() == [1, 2, 0, 0]


def test_pack_puts_every_value_in_one_aligned_buffer():
    # what an uncaptured step and a sampling batch send to a GPU in one copy
    values = {"ids": (np.arange(5), torch.int64), "table": (np.arange(6).reshape(2, 3), torch.int32),
              "w": ([[0.5, -2.0]], torch.bfloat16), "mask": ([True, False, True], torch.bool),
              "n": (np.int64(7), torch.int32)}
    host, fields = pack(values, pinned=False)
    assert all(f.offset % ALIGN == 0 for f in fields) and host.numel() == fields[-1].offset + fields[-1].nbytes
    views = typed_views(host, fields)
    for name, (value, dtype) in values.items():
        expected = torch.as_tensor(np.asarray(value)).to(dtype)
        assert views[name].dtype == dtype and torch.equal(views[name], expected), name


def _record_sampler_calls(engine) -> list[tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]]:
    """Wrap the engine's sampler: each call's (greedy ids given, logits rows, token ids returned)."""
    calls, real = [], engine.sampler

    class Recording:
        def __getattr__(self, name):
            return getattr(real, name)

        def __call__(self, logits, batch, greedy_ids=None):
            out = real(logits, batch, greedy_ids)
            calls.append((greedy_ids, logits.clone(), out.token_ids))
            return out

    engine.sampler = Recording()
    return calls


def _captured_engine_recording_its_sampler():
    """A tiny-llama engine with its CUDA-graph runner forced on (shapes of up to 8 sequences, 16 tokens), and the
    list its sampler's calls are recorded into (`_record_sampler_calls`)."""
    engine = make_engine("tiny-llama", max_num_seqs=8, max_num_batched_tokens=16, num_kv_blocks=40,
                         async_scheduling=True)
    engine.runner.enable_cuda_graphs(8, engine.max_model_len, 16, force=True)
    return engine, _record_sampler_calls(engine)


def test_small_decode_buckets_answer_with_their_own_greedy_ids():
    # decode buckets of up to GRAPH_ARGMAX_MAX_ROWS rows compute their rows' argmax with the logits; an all-greedy
    # step takes those ids (the very tensor) instead of another argmax: they must be the rows' argmax, row for row
    engine, calls = _captured_engine_recording_its_sampler()
    outs = run(engine, PROMPTS)
    for p, o in zip(PROMPTS, outs):
        assert o.outputs[0].token_ids == hf_ref("tiny-llama", tuple(p)), f"prompt of {len(p)} tokens"
    given = [(ids, logits, tokens) for ids, logits, tokens in calls if ids is not None]
    assert given and len(given) < len(calls)  # decode steps took them; mixed (prefill) steps did not
    for ids, logits, tokens in given:
        assert tokens is ids and torch.equal(ids, logits.argmax(dim=-1))
    assert_no_leak(engine)


def test_greedy_ids_of_the_graph_are_not_taken_where_the_logits_change():
    # a repetition penalty changes the logits before the argmax: the graph's ids (of the raw logits) must not
    # be the answer; the penalized tokens equal an engine's without captured shapes
    penalized = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.8)
    plain = make_engine("tiny-llama", max_num_seqs=8, num_kv_blocks=40, async_scheduling=True)
    expected = [o.outputs[0].token_ids for o in run(plain, PROMPTS, penalized)]
    engine, calls = _captured_engine_recording_its_sampler()
    got = [o.outputs[0].token_ids for o in run(engine, PROMPTS, penalized)]
    assert got == expected
    # the graph's ids were offered, and the penalty moved some token away from them
    offered = [(ids, tokens) for ids, _, tokens in calls if ids is not None]
    assert offered and any(not torch.equal(ids, tokens) for ids, tokens in offered)
    assert_no_leak(engine)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a copy stream needs a CUDA device")
def test_host_copy_on_a_side_stream_reads_the_values_before_they_are_overwritten():
    from mini_infer.runtime.transfer import HostCopy

    side = torch.cuda.Stream()
    for step in range(20):
        t = torch.full((8,), step, dtype=torch.int64, device="cuda")
        torch.cuda._sleep(200_000)  # the copy must wait for the work queued before it on the current stream
        t.add_(1)
        copy = HostCopy([t, None], stream=side)
        torch.cuda.current_stream().wait_event(copy.event)  # what the graph's fence does before rewriting
        t.zero_()
        host = copy.wait()
        assert host[1] is None and host[0].tolist() == [step + 1] * 8
