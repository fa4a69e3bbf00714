"""Incremental detokenization and stop strings, per sequence.

`IncrementalDetokenizer` turns a stream of token ids into a stream of text deltas. Decoding token by token is
wrong in two ways: a byte-level BPE token may hold only part of a UTF-8 character (an emoji or a CJK character
often spans 2-4 tokens), and SentencePiece-style decoders drop the leading space of whatever comes first in
the string they decode. So each step decodes two short windows of ids that start at the same token, the
"prefix" window (ids already turned into text) and the same window plus the new ids, and emits the difference.
Both windows start at the same token, so its leading-space treatment cancels out; while the longer window ends
in U+FFFD (an incomplete character), nothing is emitted and the ids wait for the rest of their bytes.

`StopChecker` finds stop strings in the text (also when one spans several deltas) and says how many trailing
characters to hold back because they could be the start of a stop string.

`RequestDetokenizer` puts the two together for the engine: `add_tokens(ids) -> (delta, stop_str | None)`,
with `text` always equal to the concatenation of the deltas returned so far.
"""

from __future__ import annotations

from collections.abc import Sequence

from mini_infer.sampling_params import SamplingParams

_REPLACEMENT = "\ufffd"
# Ids of context before the first new token: enough for any decoder's lookbehind (leading space, merges).
_PREFIX_CONTEXT = 5


class IncrementalDetokenizer:
    """Streams the text of generated ids; `add_tokens(new_ids)` returns only the new text.

    Works with a Hugging Face tokenizer (anything with `decode(ids, skip_special_tokens=...)`) or a raw
    `tokenizers.Tokenizer`. `spaces_between_special_tokens` is passed to tokenizers whose `decode` takes it
    (Python "slow" tokenizers); fast tokenizers decode special tokens their own way and ignore it, as in
    transformers itself. The concatenated deltas equal what decoding all ids at once gives (with the prompt's
    last tokens as context, so a SentencePiece leading space after a prompt is kept), except that a trailing
    incomplete character is held until its remaining bytes arrive (`flush()` releases it as U+FFFD).
    """

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._decode_kwargs: dict = {"skip_special_tokens": skip_special_tokens}
        if hasattr(tokenizer, "convert_ids_to_tokens"):  # a transformers tokenizer (a raw one has neither)
            # Windows are diffed, so decoding must be local: no clean-up pass that rewrites " ." into ".".
            self._decode_kwargs["clean_up_tokenization_spaces"] = False
            if not hasattr(tokenizer, "backend_tokenizer"):  # Python ("slow") tokenizer
                self._decode_kwargs["spaces_between_special_tokens"] = spaces_between_special_tokens
        context = list(prompt_token_ids)[-_PREFIX_CONTEXT:]
        self._ids: list[int] = context  # context ids, then every output id
        self.prefix_offset = 0  # start of the window decoded for comparison
        self.read_offset = len(context)  # ids before this are already text
        self.output_token_ids: list[int] = []
        self.text = ""  # all text emitted so far

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, **self._decode_kwargs) if ids else ""

    def add_tokens(self, new_ids: Sequence[int]) -> str:
        """Append ids; return the text they complete ("" while a character is still incomplete)."""
        if not new_ids:
            return ""
        new_ids = [int(t) for t in new_ids]
        self.output_token_ids += new_ids
        self._ids += new_ids
        prefix_text = self._decode(self._ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self._ids[self.prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT):
            return ""  # nothing new yet (special token skipped, or a character still missing bytes)
        delta = full_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self._ids)
        self._trim()
        self.text += delta
        return delta

    def flush(self) -> str:
        """Emit whatever is held back (an incomplete trailing character becomes U+FFFD). For the end."""
        if self.read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self._ids[self.prefix_offset :])
        delta = full_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self._ids)
        self.text += delta
        return delta

    def _trim(self) -> None:
        """Drop ids before the prefix window: memory stays bounded on long generations."""
        if self.prefix_offset > 4 * _PREFIX_CONTEXT:
            cut = self.prefix_offset
            del self._ids[:cut]
            self.prefix_offset -= cut
            self.read_offset -= cut


class StopChecker:
    """Finds the earliest stop string in a growing text and what must be held back from streaming."""

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        self.stop = [s for s in stop if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self.max_len = max((len(s) for s in self.stop), default=0)

    def find(self, text: str, new_chars: int, min_start: int = 0) -> tuple[int, str] | None:
        """Earliest (position, stop string) whose match ends within the last `new_chars` characters.

        Matches starting before `min_start` are ignored (text there was already streamed). Among stop strings
        matching at the same position the longest wins.
        """
        if not self.stop or new_chars <= 0:
            return None
        old_len = len(text) - new_chars
        best: tuple[int, str] | None = None
        for s in self.stop:
            # first occurrence starting late enough to end among the new characters
            i = text.find(s, max(min_start, old_len - len(s) + 1, 0))
            if i != -1 and (best is None or i < best[0] or (i == best[0] and len(s) > len(best[1]))):
                best = (i, s)
        return best

    def truncate(self, text: str, match: tuple[int, str]) -> str:
        """The text up to the stop string (through it with include_stop_str_in_output)."""
        pos, s = match
        return text[: pos + len(s)] if self.include_stop_str_in_output else text[:pos]

    def holdback(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string.

        Those characters may turn out to be the start of a stop string that gets cut, so they are not streamed
        yet. With include_stop_str_in_output nothing needs holding: a stop string is kept in the output, so
        its start can be shown early.
        """
        if self.include_stop_str_in_output:
            return 0
        n = len(text)
        best = 0
        for s in self.stop:
            first = s[0]
            j = text.find(first, max(0, n - len(s) + 1))
            while j != -1 and n - j > best:
                if s.startswith(text[j:]):
                    best = n - j  # earliest start = longest suffix for this stop string
                    break
                j = text.find(first, j + 1)
        return best


class RequestDetokenizer:
    """One sequence's text as the engine streams it: detokenization, stop strings and hold-back.

    Each step, `add_tokens(new_ids)` returns `(delta, stop)`: `delta` is the new text to send, `stop` the
    stop string that ended the sequence (None while it goes on). `text` is always the concatenation of the
    deltas returned. Pass `finished=True` with the last ids when the sequence ends for another reason (length,
    EOS, a stop token, abort) so that held-back text is released; pass `stop_terminated=True` when the last id
    is EOS or one of `stop_token_ids` (its text is then left out unless include_stop_str_in_output). As in
    vLLM, stop strings are only looked for once the sequence has more than `min_tokens` output tokens.
    """

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self.detok = IncrementalDetokenizer(
            tokenizer,
            prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.extra.get("spaces_between_special_tokens", True),
        )
        self.stop_checker = StopChecker(params.stop or [], params.include_stop_str_in_output)
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.num_output_tokens = 0
        self._full = ""  # detokenized text, possibly past what is emitted
        self.text = ""  # emitted text
        self.stop_reason: str | None = None
        self.finished = False

    def add_tokens(
        self, new_ids: Sequence[int], *, stop_terminated: bool = False, finished: bool = False
    ) -> tuple[str, str | None]:
        if self.finished:
            raise RuntimeError("add_tokens after the sequence finished")
        new_ids = list(new_ids)
        self.num_output_tokens += len(new_ids)
        if stop_terminated and new_ids and not self.include_stop_str_in_output:
            new_ids = new_ids[:-1]  # the stop token's own text is not shown
        finished = finished or stop_terminated
        new_text = self.detok.add_tokens(new_ids)
        if finished:
            new_text += self.detok.flush()
        self._full += new_text

        if self.num_output_tokens > self.min_tokens:
            # Without include_stop_str_in_output, hold-back guarantees no stop string starts inside text
            # already streamed; min_start makes that explicit. With it, a stop string may start there.
            min_start = 0 if self.include_stop_str_in_output else len(self.text)
            match = self.stop_checker.find(self._full, len(new_text), min_start=min_start)
            if match is not None:
                self._full = self.stop_checker.truncate(self._full, match)
                self.stop_reason = match[1]
                self.finished = True
                return self._emit(len(self._full)), match[1]

        if finished:
            self.finished = True
            return self._emit(len(self._full)), None
        return self._emit(len(self._full) - self.stop_checker.holdback(self._full)), None

    def flush(self) -> str:
        """End the sequence here (length limit, abort): returns the held-back text."""
        if self.finished:
            return ""
        delta, _ = self.add_tokens([], finished=True)
        return delta

    def _emit(self, upto: int) -> str:
        if upto <= len(self.text):
            return ""
        delta = self._full[len(self.text) : upto]
        self.text = self._full[:upto]
        return delta
