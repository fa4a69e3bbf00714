"""The output processor's text: the same whether outputs are asked for every step (streaming) or only at the
end (`LLM.generate`, where a sequence without stop strings is detokenized once, when it ends), and the same as
the per-token detokenizer (the oracle: `RequestDetokenizer` fed one id a call). Stop strings still end a
sequence at the token that completes them when no output is asked for before the end.

Tokenizers: test_detokenizer.py's (SmolLM2's byte-level BPE, a trained byte-level BPE, and SentencePiece-style
ones with byte fallback).
"""

from __future__ import annotations

import pytest

from mini_infer.runtime.detokenizer import RequestDetokenizer
from mini_infer.runtime.output_processor import OutputProcessor
from mini_infer.runtime.sequence import Sequence, SequenceStatus
from mini_infer.sampling_params import SamplingParams
from tests.runtime.test_detokenizer import SAMPLES, _bytelevel, encode, eos_id, tok  # noqa: F401 (tok: the fixture)

ENDS = ("length", "eos", "capped")  # last token reaches max_tokens / last token is EOS / ended with no token


def drive(tokenizer, prompt: list[int], ids: list[int], params: SamplingParams, eos: int, end: str,
          every_step: bool):
    """Feed `ids` to an OutputProcessor as the engine does; ask for an output after every token or only once the
    sequence ended. Returns (the final output, the concatenation of every output's text delta, the index of
    the token that ended it or None)."""
    op = OutputProcessor(tokenizer, {eos})
    seq = Sequence("r", list(prompt), params)
    seq.index = 0
    req = op.new_request("r", None, prompt, params, [seq], 0.0)
    streamed, ended_at, out = [], None, None
    for i, token in enumerate(ids):
        seq.append_token(token)
        reason = op.add_token(req, seq, token, 0.0, None, reaches_length=end == "length" and i == len(ids) - 1)
        if reason is not None:
            seq.status, seq.finish_reason, ended_at = SequenceStatus.FINISHED, reason, i
        if every_step or reason is not None:
            out = op.output(req)
            streamed.append(out.deltas[0][0])
        if reason is not None:
            break
    if ended_at is None:  # capped by the scheduler (or the stream ran out): no token ends it
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, "length"
        op.flush(req, seq)
        out = op.output(req)
        streamed.append(out.deltas[0][0])
    return out, "".join(streamed), ended_at


def per_token_text(tokenizer, prompt, ids, params, stop_terminated: bool) -> str:
    """The oracle: one id a call through the sequence's detokenizer, the last call marked as the end."""
    detok = RequestDetokenizer(tokenizer, prompt, params)
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        detok.add_tokens([token], stop_terminated=last and stop_terminated, finished=last)
    return detok.text


@pytest.mark.parametrize("include_stop", [False, True])
@pytest.mark.parametrize("skip_special", [True, False])
@pytest.mark.parametrize("end", ENDS)
def test_text_same_streamed_final_only_and_per_token(tok, end, skip_special, include_stop):  # noqa: F811
    eos = eos_id(tok)
    prompt = encode(tok, "Say:")
    for sample in SAMPLES:
        # ignoring EOS, one inside the text: a special token the decoder may skip, between multi-byte pieces
        ids = encode(tok, sample) + [eos] + (encode(tok, " 😀 more") if end != "eos" else [])
        ignore_eos = end != "eos"
        params = SamplingParams(max_tokens=None, ignore_eos=ignore_eos, skip_special_tokens=skip_special,
                                include_stop_str_in_output=include_stop)
        streamed, streamed_deltas, at_streamed = drive(tok, prompt, ids, params, eos, end, every_step=True)
        final, final_deltas, at_final = drive(tok, prompt, ids, params, eos, end, every_step=False)
        want = per_token_text(tok, prompt, ids, params, stop_terminated=end == "eos")
        assert at_streamed == at_final == (None if end == "capped" else len(ids) - 1)
        assert streamed.outputs[0].text == final.outputs[0].text == want, sample
        assert streamed_deltas == final_deltas == want, sample
        assert streamed.outputs[0].token_ids == final.outputs[0].token_ids == ids


def test_final_only_detokenizes_once():
    # what the deferral is for: 40 tokens asked for once cost one detokenizer call (two decodes), not 40
    class Counting:
        def __init__(self, inner):
            self.inner, self.calls = inner, 0

        def decode(self, ids, **kw):
            self.calls += 1
            return self.inner.decode(ids, **kw)

    counting = Counting(_bytelevel())
    ids = encode(counting.inner, "The quick brown fox jumps over the lazy dog! Hello world, this is a corpus.")
    assert len(ids) >= 20
    params = SamplingParams(max_tokens=None, ignore_eos=True)
    out, _, _ = drive(counting, [], ids, params, eos_id(counting.inner), "length", every_step=False)
    assert out.outputs[0].text == counting.inner.decode(ids)
    assert counting.calls <= 4, counting.calls
    counting.calls = 0
    drive(counting, [], ids, params, eos_id(counting.inner), "length", every_step=True)  # streaming: per token
    assert counting.calls >= len(ids)


@pytest.mark.parametrize("every_step", [True, False])
def test_stop_string_ends_at_its_token_without_outputs(tok, every_step):  # noqa: F811
    eos = eos_id(tok)
    ids = encode(tok, "Hello world, this is a small corpus. The quick brown fox")
    params = SamplingParams(max_tokens=None, stop=["small"])
    out, deltas, ended_at = drive(tok, [], ids, params, eos, "length", every_step=every_step)
    # the oracle: the first prefix of the ids whose text holds the stop string
    first = next(i for i in range(len(ids)) if "small" in tok.decode(ids[: i + 1]))
    assert ended_at == first
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == "small"
    assert out.outputs[0].text == deltas == "Hello world, this is a "
