"""The output side of the engine: per-request state, detokenization, stop checks, logprobs, and the
`RequestOutput`s handed to callers.

The engine tells it what happened (a token was sampled for a sequence, with its logprobs; prompt logprobs were
computed; a sequence ended) and asks it for outputs. It decides when a sampled token ends a sequence (stop
token, EOS, stop string, length) but never touches the scheduler, the cache or the device: the engine applies
the decision.

Text is made when it is read. Only stop strings need each token's text as it comes; a sequence without them
keeps its new ids pending and detokenizes them in one call when an output is asked for or the sequence ends.
A streaming caller asks every step (one id a call, as before); `LLM.generate` asks once, at the end, so a
long generation costs one detokenizer call instead of one per token. The text is the same either way: the
incremental detokenizer's deltas do not depend on how the ids are grouped (runtime/detokenizer.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from mini_infer.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from mini_infer.runtime.detokenizer import RequestDetokenizer
from mini_infer.runtime.sampler import SamplerOutput
from mini_infer.runtime.sequence import Sequence
from mini_infer.sampling_params import SamplingParams


@dataclass
class RequestState:
    """One request as the engine tracks it: its samples (sequences), their detokenizers, metrics, logprobs and
    the text/ids produced since the last output."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    detoks: list[RequestDetokenizer | None]
    metrics: RequestMetrics
    logprobs: list[list] = field(default_factory=list)
    cumulative_logprob: list[float] = field(default_factory=list)
    prompt_logprobs: list | None = None
    deltas: list[tuple[int, str, list[int]]] = field(default_factory=list)
    error: str | None = None
    # per sample: sampled ids not yet detokenized (samples without stop strings; see the module docstring)
    pending: list[list[int]] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


class OutputProcessor:
    """Turns sampled tokens into text, stop decisions, logprobs and outputs (see the module docstring)."""

    def __init__(self, tokenizer, eos_token_ids: set[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids

    def new_request(self, request_id: str, prompt: str | None, token_ids: list[int], params: SamplingParams,
                    seqs: list[Sequence], arrival: float) -> RequestState:
        detoks = [RequestDetokenizer(self.tokenizer, token_ids, params) if self.tokenizer is not None else None
                  for _ in seqs]
        return RequestState(request_id, prompt, list(token_ids), params, seqs, detoks, RequestMetrics(arrival),
                            logprobs=[[] for _ in seqs], cumulative_logprob=[0.0 for _ in seqs],
                            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
                            pending=[[] for _ in seqs])

    # ------------------------------------------------------------------ sampled tokens
    def sample_logprobs(self, so: SamplerOutput, sampling: list[Sequence]) -> list[tuple[dict | None, float]]:
        """Per sampled row: (the logprobs entry the request asked for, or None; the sampled token's logprob)."""
        lps = so.logprobs.tolist()
        ranks = so.ranks.tolist()
        top_ids = so.topk_ids.tolist()
        top_lps = so.topk_logprobs.tolist()
        result = []
        for i, seq in enumerate(sampling):
            k = seq.sampling_params.logprobs
            tok = int(so.token_ids[i])
            entry = {tok: Logprob(lps[i], ranks[i], self._decode_one(tok))}
            if k:
                for tid, lp in zip(top_ids[i][:k], top_lps[i][:k]):
                    entry.setdefault(tid, Logprob(lp, None, self._decode_one(tid)))
                for r, tid in enumerate(top_ids[i][:k], start=1):
                    entry[tid].rank = r
            result.append((entry if k is not None else None, lps[i]))
        return result

    def add_token(self, req: RequestState, seq: Sequence, token: int, now: float,
                  logprob: tuple[dict | None, float] | None, reaches_length: bool) -> str | None:
        """Record sampled `token` of `seq` (metrics, logprobs, text delta) and return the finish reason it
        causes, or None. Sets `seq.stop_reason` for a stop token or stop string."""
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        req.metrics.last_token_time = now
        if logprob is not None:
            entry, value = logprob
            req.logprobs[seq.index].append(entry)
            req.cumulative_logprob[seq.index] += value
        p = seq.sampling_params
        reason, stop_reason, stop_token = None, None, False
        if token in p.stop_token_ids:
            reason, stop_reason, stop_token = "stop", token, True
        elif token in self.eos_token_ids and not p.ignore_eos:
            reason, stop_token = "stop", True
        elif reaches_length:
            reason = "length"
        detok = req.detoks[seq.index]
        delta = ""
        if detok is not None and detok.stop_checker.stop:  # stop strings: this token's text is needed now
            delta, stop_str = detok.add_tokens([token], stop_terminated=stop_token, finished=reason is not None)
            if stop_str is not None:
                reason, stop_reason = "stop", stop_str
        elif detok is not None:
            req.pending[seq.index].append(token)
            if reason is not None:
                delta = self._detokenize_pending(req, seq.index, stop_terminated=stop_token, finished=True)
        req.deltas.append((seq.index, delta, [token]))
        if reason is not None:
            seq.stop_reason = stop_reason
        return reason

    def flush(self, req: RequestState, seq: Sequence) -> None:
        """`seq` ended without a token (aborted, failed, capped): release the text its detokenizer held back."""
        detok = req.detoks[seq.index]
        if detok is not None:
            text = self._detokenize_pending(req, seq.index, finished=True) if req.pending[seq.index] \
                else detok.flush()
            req.deltas.append((seq.index, text, []))

    def _detokenize_pending(self, req: RequestState, index: int, stop_terminated: bool = False,
                            finished: bool = False) -> str:
        """Sample `index`'s pending ids through its detokenizer in one call; the text they complete."""
        ids, req.pending[index] = req.pending[index], []
        delta, _ = req.detoks[index].add_tokens(ids, stop_terminated=stop_terminated, finished=finished)
        return delta

    # ------------------------------------------------------------------ prompt logprobs
    def add_prompt_logprobs(self, req: RequestState, seq: Sequence, first_pos: int, count: int,
                            compute: Callable[[int, int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
                            ) -> None:
        """Record prompt logprobs for prompt positions `first_pos + 1 ... first_pos + count` (the tokens that
        rows `first_pos ... first_pos + count - 1` predict). `compute(skip, count, k)` returns (token logprobs,
        top-k ids, top-k logprobs) for rows `skip ... skip + count - 1` of this range. After a preemption the
        prompt is computed again: entries recorded the first time are kept."""
        skip = len(req.prompt_logprobs) - 1 - first_pos
        if skip < 0:  # positions before first_pos were never computed (a prefix-cache hit)
            raise RuntimeError(f"request {req.request_id!r}: prompt logprobs missing for positions "
                               f"{len(req.prompt_logprobs)}..{first_pos}")
        if skip >= count:
            return
        first_pos, count = first_pos + skip, count - skip
        k = seq.sampling_params.prompt_logprobs or 0
        tok_lp, top_ids, top_lp = (t.tolist() for t in compute(skip, count, k))
        for j in range(count):
            tid = seq.prompt_token_ids[first_pos + 1 + j]
            entry = {tid: Logprob(tok_lp[j], None, self._decode_one(tid))}
            for r, (t, lp) in enumerate(zip(top_ids[j], top_lp[j]), start=1):
                entry.setdefault(t, Logprob(lp, r, self._decode_one(t)))
                entry[t].rank = r
            req.prompt_logprobs.append(entry)

    # ------------------------------------------------------------------ outputs
    def output(self, req: RequestState) -> RequestOutput:
        """The request's output now: full text and ids so far, plus the deltas since the last output."""
        for index, ids in enumerate(req.pending):
            if ids:
                req.deltas.append((index, self._detokenize_pending(req, index), []))
        outputs = []
        for seq, detok in zip(req.seqs, req.detoks):
            outputs.append(CompletionOutput(
                index=seq.index, text=detok.text if detok is not None else "",
                token_ids=seq.known_output_token_ids,
                cumulative_logprob=req.cumulative_logprob[seq.index] if req.params.logprobs is not None else None,
                logprobs=req.logprobs[seq.index] if req.params.logprobs is not None else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason))
        per_sample: dict[int, tuple[str, list[int]]] = {}
        for index, text, ids in req.deltas:
            t, i = per_sample.get(index, ("", []))
            per_sample[index] = (t + text, i + ids)
        req.deltas = []
        finished = req.finished
        if finished and req.metrics.finished_time is None:  # finished by the scheduler or a failed step
            req.metrics.finished_time = time.monotonic()
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
            outputs=outputs, finished=finished, prompt_logprobs=req.prompt_logprobs, metrics=req.metrics,
            num_cached_tokens=req.metrics.num_cached_tokens, error=req.error,
            deltas=[per_sample.get(i, ("", [])) for i in range(len(req.seqs))])

    def _decode_one(self, token_id: int) -> str | None:
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else None
