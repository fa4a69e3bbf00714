"""Engine logprobs (token id -> `Logprob` per position) in OpenAI's two shapes: the legacy completions
`logprobs` object and chat's `logprobs.content` list. Formatting only: no engine calls, no routes."""

from __future__ import annotations

from mini_infer.outputs import PositionLogprobs
from mini_infer.serving import protocol as P


class TokenText:
    """Token id -> text for logprobs, caching decodes; 'token_id:N' when there is no tokenizer."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, tid: int, entry: PositionLogprobs | None = None) -> str:
        if entry is not None and tid in entry and entry[tid].decoded_token is not None:
            return entry[tid].decoded_token
        s = self.cache.get(tid)
        if s is None:
            s = self.tokenizer.decode([tid]) if self.tokenizer is not None else f"token_id:{tid}"
            self.cache[tid] = s
        return s


def completion_logprobs(items: list[tuple[int, PositionLogprobs | None]], k: int, text: TokenText,
                        offset: int) -> tuple[P.CompletionLogProbs, int]:
    """The legacy completions logprobs of (token id, position logprobs) pairs whose text starts at `offset`;
    also returns the offset after them."""
    lp = P.CompletionLogProbs()
    for tid, entry in items:
        s = text(tid, entry)
        lp.tokens.append(s)
        lp.text_offset.append(offset)
        offset += len(s)
        if entry is None:
            lp.token_logprobs.append(None)
            lp.top_logprobs.append(None)
            continue
        lp.token_logprobs.append(entry[tid].logprob)
        top: dict[str, float] = {}
        for t, prob in entry.items():
            if t == tid or (prob.rank is not None and prob.rank <= k):
                key = text(t, entry)
                top[key] = max(top.get(key, float("-inf")), prob.logprob)
        lp.top_logprobs.append(top)
    return lp, offset


def chat_logprobs(items: list[tuple[int, PositionLogprobs]], k: int, text: TokenText) -> list[P.ChatTokenLogprob]:
    """Chat's `logprobs.content` entries of (token id, position logprobs) pairs, with the top `k` of each."""
    content = []
    for tid, entry in items:
        s = text(tid, entry)
        ranked = sorted(((lp.rank, t, lp.logprob) for t, lp in entry.items()
                         if lp.rank is not None and lp.rank <= k), key=lambda r: r[0])
        top = [P.TopLogprob(token=text(t, entry), logprob=lp, bytes=list(text(t, entry).encode()))
               for _, t, lp in ranked]
        content.append(P.ChatTokenLogprob(token=s, logprob=entry[tid].logprob, bytes=list(s.encode()),
                                          top_logprobs=top))
    return content
