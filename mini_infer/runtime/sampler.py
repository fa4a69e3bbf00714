"""Batched sampling on the device: one set of tensor ops for all rows, no per-request Python loop.

The engine gathers one logits row per sequence that samples this step, builds a `SamplingBatch` from the rows'
`SamplingParams` and token histories, and calls `Sampler()(logits, batch)`. Everything after `build` stays on the
device and never waits on it (no `.item()`, no `torch.multinomial`): the sampled ids come back as a device tensor
that the engine copies to the host once.

Order of operations, per row:

1. penalties on the raw logits (greedy rows too): repetition (prompt + output tokens, vLLM/CTRL style: positive
   logits divided, negative ones multiplied), then frequency and presence (output tokens only, OpenAI style);
2. `min_tokens`: EOS and `stop_token_ids` set to -inf while the row has fewer than `min_tokens` output tokens;
3. greedy rows (temperature < 1e-5 or top_k == 1): argmax, done (torch.argmax's ids: on CUDA the Triton
   `argmax_rows` kernel, one launch, where torch's reduce takes a memset and a longer kernel; else torch's);
4. other rows: divide by temperature, top-k, top-p (smallest set of most likely tokens whose mass >= top_p,
   computed after top-k), min-p (drop tokens whose probability < min_p * the largest probability), softmax;
   a batch with top-k or top-p, no seeded row and no "processed" logprobs does steps 4-5 on its rows' candidates
   alone (`top_k_top_p_candidates`: [R, largest k] sorted values and their ids; the whole vocab only when some row
   has top-p without top-k), never scattering them back over the vocab;
5. draw with the exponential race: argmax(p / E) with E ~ Exponential(1) i.i.d. picks token i with probability
   p_i. Rows with a seed draw E from their own `torch.Generator`, so a seeded row gets the same tokens whatever
   else shares its batch; other rows draw from the device's default generator.
   On CUDA, a batch with no top-k, top-p, min-p or "processed" logprobs skips steps 4-5's tensors:
   one `gumbel_argmax` launch draws argmax(logits / T + Gumbel noise), the same law (the Gumbel-max trick), from
   the logits as they are (greedy rows of a mixed batch: their argmax in the same launch), its Philox noise keyed
   by a seed drawn from torch's default CPU generator; its seeded rows alone are then redrawn as above, from their
   own generators. At 256 rows x 151,936 that is one read of the logits
   instead of seven passes over fp32 copies (`FUSED_DRAW`).

Log-probabilities (when any row asks for them) are by default those of the RAW model distribution, i.e.
log_softmax of the logits as the model gave them, before penalties, temperature and truncation: vLLM's default
(`raw_logprobs`), and what lm-evaluation-harness expects. `Sampler(logprobs_mode="processed")` instead returns
log-probabilities of the distribution actually sampled from (after penalties, temperature, top-k/top-p/min-p;
greedy rows: after penalties only).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from mini_infer.ops.argmax import greedy_argmax
from mini_infer.ops.gumbel_argmax import MAX_SEED, can_draw_on, gumbel_argmax_triton
from mini_infer.runtime.transfer import to_device, to_device_many
from mini_infer.sampling_params import SamplingParams

_TINY = 1e-20  # floor for the exponential noise, so that p / E never divides by zero
# The one-launch Gumbel draw for batches that allow it (module docstring, step 5); False: the torch path always
# (MINI_INFER_FUSED_DRAW=0 at import, for A/Bs).
FUSED_DRAW = os.environ.get("MINI_INFER_FUSED_DRAW", "1") != "0"


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator for one seeded request, on the device its logits live on."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def is_greedy(params: SamplingParams) -> bool:
    """Argmax rows: temperature below 1e-5 (dividing by it only risks overflow) or top_k == 1."""
    return params.greedy


def _token_counts(lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab] float32 counts of each token id: one scatter_add over the rows' ids laid end to end.

    Row i's ids land at flat index i * (vocab + 1) + id; ids outside [0, vocab) go to the extra pad column
    (i * (vocab + 1) + vocab), which is dropped. The flat index is built on the host with numpy (far faster
    than a Python loop of small tensors) and copied over once.
    """
    rows, width = len(lists), vocab_size + 1
    lengths = np.fromiter((len(x) for x in lists), dtype=np.int64, count=rows)
    total = int(lengths.sum())
    counts = torch.zeros(rows * width, dtype=torch.float32, device=device)
    if total:
        ids = np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int64, count=total)
        ids = np.where((ids >= 0) & (ids < vocab_size), ids, vocab_size)
        ids += np.repeat(np.arange(rows, dtype=np.int64) * width, lengths)
        index = to_device(ids, torch.int64, torch.device(device))
        counts.scatter_add_(0, index, torch.ones(total, dtype=torch.float32, device=device))
    return counts.view(rows, width)[:, :vocab_size]


def _per_row_eos(eos_token_ids, rows: int) -> list[frozenset[int]]:
    if eos_token_ids is None:
        return [frozenset()] * rows
    if isinstance(eos_token_ids, int):
        return [frozenset((eos_token_ids,))] * rows
    items = list(eos_token_ids)
    if all(isinstance(x, int) for x in items):  # one shared set of ids
        return [frozenset(items)] * rows
    if len(items) != rows:
        raise ValueError(f"eos_token_ids has {len(items)} entries for {rows} rows")
    return [frozenset(() if x is None else ((x,) if isinstance(x, int) else x)) for x in items]


@dataclass
class SamplingBatch:
    """Per-row sampling state as device tensors. Optional tensors are None when no row needs them.

    Build it with `SamplingBatch.build`; the flags (`all_greedy`, `needs_penalties`, ...) are plain Python
    values decided on the host, so the sampler picks its path without touching the device. All its per-row
    tensors reach the device in one copy; an all-greedy batch needs none (`greedy`, `temperature` None).
    """

    num_rows: int
    vocab_size: int
    greedy: torch.Tensor | None  # [R] bool; None when all rows are greedy or none is (only a mix reads it)
    temperature: torch.Tensor | None  # [R] float32, 1.0 on greedy rows; None when all rows are greedy
    inv_temperature: torch.Tensor | None  # [R] float32 1 / temperature, 0.0 on greedy rows; as temperature
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None = None  # [R] int64 in [1, V]; V where disabled
    top_k_max: int = 0
    top_p: torch.Tensor | None = None  # [R] float32; 1.0 where disabled
    min_p: torch.Tensor | None = None  # [R] float32; 0.0 where disabled
    repetition_penalty: torch.Tensor | None = None  # [R] float32
    presence_penalty: torch.Tensor | None = None  # [R] float32
    frequency_penalty: torch.Tensor | None = None  # [R] float32
    output_counts: torch.Tensor | None = None  # [R, V] float32, output tokens only
    prompt_mask: torch.Tensor | None = None  # [R, V] bool, token appears in the prompt
    banned_rows: torch.Tensor | None = None  # [N] int64 \ (row, token) pairs set to -inf (min_tokens)
    banned_ids: torch.Tensor | None = None  # [N] int64 /
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # seeded non-greedy rows
    num_logprobs: list[int | None] = field(default_factory=list)  # per row, as requested
    max_num_logprobs: int | None = None  # None: no row wants logprobs

    @property
    def needs_penalties(self) -> bool:
        return self.output_counts is not None

    @property
    def needs_topk(self) -> bool:
        return self.top_k is not None

    @property
    def needs_topp(self) -> bool:
        return self.top_p is not None

    @property
    def needs_minp(self) -> bool:
        return self.min_p is not None

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        token_histories: Sequence[tuple[Sequence[int], Sequence[int]]],
        generators: Sequence[torch.Generator | None] | None,
        vocab_size: int,
        device: torch.device | str,
        eos_token_ids: Iterable[int] | Sequence[Iterable[int] | int | None] | int | None = None,
    ) -> SamplingBatch:
        """Gather the rows' options into device tensors.

        `token_histories[i]` is row i's (prompt ids, output ids so far): output lengths drive `min_tokens`,
        and the ids are read only for rows with a penalty. `generators[i]` is row i's own generator (for
        requests with a seed, see `make_generator`) or None. `eos_token_ids` is either one collection of ids
        shared by all rows or one collection per row; rows with `ignore_eos` do not get them banned under
        `min_tokens` (their `stop_token_ids` still are).
        """
        device = torch.device(device)
        rows = len(params)
        if len(token_histories) != rows:
            raise ValueError(f"token_histories has {len(token_histories)} entries for {rows} rows")
        generators = list(generators) if generators is not None else [None] * rows
        if len(generators) != rows:
            raise ValueError(f"generators has {len(generators)} entries for {rows} rows")
        eos = _per_row_eos(eos_token_ids, rows)

        greedy = [is_greedy(p) for p in params]
        batch = cls(num_rows=rows, vocab_size=vocab_size, greedy=None, temperature=None, inv_temperature=None,
                    all_greedy=all(greedy), all_random=not any(greedy))
        host: dict[str, tuple[list, torch.dtype]] = {}  # field -> per-row values: one copy to the device, below
        random_rows = [p for p, g in zip(params, greedy) if not g]
        if random_rows:
            host["temperature"] = ([1.0 if g else p.temperature for p, g in zip(params, greedy)], torch.float32)
            host["inv_temperature"] = ([0.0 if g else 1.0 / p.temperature for p, g in zip(params, greedy)],
                                       torch.float32)
            if not batch.all_random:
                host["greedy"] = (greedy, torch.bool)
        if any(p.top_k not in (-1, 0) and p.top_k < vocab_size for p in random_rows):
            ks = [
                vocab_size if g or p.top_k < 1 else min(p.top_k, vocab_size) for p, g in zip(params, greedy)
            ]
            host["top_k"] = (ks, torch.int64)
            batch.top_k_max = max(k for k, g in zip(ks, greedy) if not g)
        if any(p.top_p < 1.0 for p in random_rows):
            host["top_p"] = ([1.0 if g else p.top_p for p, g in zip(params, greedy)], torch.float32)
        if any(p.min_p > 0.0 for p in random_rows):
            host["min_p"] = ([0.0 if g else p.min_p for p, g in zip(params, greedy)], torch.float32)

        rep = [p.repetition_penalty != 1.0 for p in params]
        pen = [p.has_penalties for p in params]
        if any(pen):
            batch.output_counts = _token_counts(
                [h[1] if w else () for h, w in zip(token_histories, pen)], vocab_size, device
            )
            if any(p.frequency_penalty != 0.0 for p in params):
                host["frequency_penalty"] = ([p.frequency_penalty for p in params], torch.float32)
            if any(p.presence_penalty != 0.0 for p in params):
                host["presence_penalty"] = ([p.presence_penalty for p in params], torch.float32)
            if any(rep):
                host["repetition_penalty"] = ([p.repetition_penalty for p in params], torch.float32)
                batch.prompt_mask = (
                    _token_counts(
                        [h[0] if r else () for h, r in zip(token_histories, rep)], vocab_size, device
                    )
                    > 0
                )

        ban_rows: list[int] = []
        ban_ids: list[int] = []
        for i, (p, h) in enumerate(zip(params, token_histories)):
            if p.min_tokens and len(h[1]) < p.min_tokens:
                ids = set(p.stop_token_ids or ())
                if not p.ignore_eos:
                    ids |= eos[i]
                ids = sorted(t for t in ids if 0 <= t < vocab_size)
                ban_rows += [i] * len(ids)
                ban_ids += ids
        if ban_ids:
            host["banned_rows"] = (ban_rows, torch.int64)
            host["banned_ids"] = (ban_ids, torch.int64)
        if host:
            for name, tensor in to_device_many(host, device).items():
                setattr(batch, name, tensor)

        batch.generators = {i: g for i, g in enumerate(generators) if g is not None and not greedy[i]}
        batch.num_logprobs = [p.logprobs for p in params]
        wanted = [k for k in batch.num_logprobs if k is not None]
        batch.max_num_logprobs = max(wanted) if wanted else None
        return batch


@dataclass
class SamplerOutput:
    """Sampled ids and, when any row asked, log-probabilities; all device tensors.

    `topk_ids`/`topk_logprobs` hold the batch's largest requested k; row i uses its first
    `batch.num_logprobs[i]` columns (sorted by decreasing log-probability).
    """

    token_ids: torch.Tensor  # [R] int64
    logprobs: torch.Tensor | None = None  # [R] float32, of the sampled token
    ranks: torch.Tensor | None = None  # [R] int64: 1 + count of tokens more likely than the sampled one
    topk_ids: torch.Tensor | None = None  # [R, K] int64
    topk_logprobs: torch.Tensor | None = None  # [R, K] float32


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Repetition, frequency and presence penalties (out of place)."""
    counts = batch.output_counts
    if counts is None:
        return logits
    if batch.repetition_penalty is not None:
        seen = batch.prompt_mask | (counts > 0)
        rp = batch.repetition_penalty[:, None]
        logits = torch.where(seen, torch.where(logits > 0, logits / rp, logits * rp), logits)
    if batch.frequency_penalty is not None:
        logits = logits - batch.frequency_penalty[:, None] * counts
    if batch.presence_penalty is not None:
        logits = logits - batch.presence_penalty[:, None] * (counts > 0).to(logits.dtype)
    return logits


def top_k_top_p_candidates(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, top_k_max: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's candidates after top-k, then top-p: (values [R, C], their token ids [R, C]), sorted by decreasing
    value, -inf where a candidate is dropped; C is `top_k_max` when it is below the vocab, else the whole vocab.

    `top_k_max` is the largest k among the rows that are sampled (0: unknown). When it is below the vocab,
    every such row keeps at most that many tokens, so the work happens on `topk(top_k_max)` (sorted)
    instead of a full sort of the vocab; top-p needs a full sort only when some sampled row has no top-k.
    Ties at the k-th value are broken by position (exactly k tokens kept).
    """
    vocab = logits.shape[-1]
    neg_inf = float("-inf")
    kmax = min(top_k_max or vocab, vocab) if top_k is not None else vocab
    if kmax < vocab:
        values, order = logits.topk(kmax, dim=-1)  # sorted, largest first
    else:
        values, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        pos = torch.arange(values.shape[-1], device=logits.device)
        values = values.masked_fill(pos[None, :] >= top_k[:, None], neg_inf)
    if top_p is not None:
        probs = values.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # Drop a token when the more likely ones already reach top_p; the most likely token always stays.
        drop = (mass_before >= top_p[:, None]) & (top_p < 1.0)[:, None]
        drop[:, 0] = False
        values = values.masked_fill(drop, neg_inf)
    return values, order


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, top_k_max: int = 0
) -> torch.Tensor:
    """Set to -inf every token outside each row's top-k, then outside its top-p nucleus (out of place): the
    candidates of `top_k_top_p_candidates` scattered back over the vocab."""
    if top_k is None and top_p is None:
        return logits
    values, order = top_k_top_p_candidates(logits, top_k, top_p, top_k_max)
    return torch.full_like(logits, float("-inf")).scatter_(1, order, values)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor | None) -> torch.Tensor:
    """Set to -inf tokens whose probability is below min_p times the row's largest probability."""
    if min_p is None:
        return logits
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))


def _exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One draw per row from `probs` (rows need not be normalised) without a host sync."""
    noise = torch.empty_like(probs).exponential_()
    for row, gen in generators.items():  # only seeded rows: each draws from its own stream
        noise[row].exponential_(generator=gen)
    return (probs / noise.clamp_min_(_TINY)).argmax(dim=-1)


def _logprob_outputs(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int):
    sampled = logprobs.gather(1, token_ids[:, None]).squeeze(1)
    ranks = (logprobs > sampled[:, None]).sum(dim=-1) + 1
    if k > 0:
        top_lp, top_ids = logprobs.topk(k, dim=-1)
    else:
        top_lp = logprobs.new_empty((logprobs.shape[0], 0))
        top_ids = torch.empty((logprobs.shape[0], 0), dtype=torch.int64, device=logprobs.device)
    return sampled, ranks, top_ids, top_lp


class Sampler:
    """Turns a [rows, vocab] logits tensor into one token id per row (see the module docstring)."""

    def __init__(self, logprobs_mode: str = "raw") -> None:
        if logprobs_mode not in ("raw", "processed"):
            raise ValueError(f"logprobs_mode must be 'raw' or 'processed', got {logprobs_mode!r}")
        self.logprobs_mode = logprobs_mode

    def fused_draw(self, logits: torch.Tensor, batch: SamplingBatch) -> bool:
        """Whether `batch` draws with one `gumbel_argmax` launch (module docstring, step 5)."""
        return (FUSED_DRAW and not batch.all_greedy and batch.top_k is None and batch.top_p is None
                and batch.min_p is None
                and not (batch.max_num_logprobs is not None and self.logprobs_mode == "processed")
                and can_draw_on(logits))

    def draws_among_candidates(self, batch: SamplingBatch) -> bool:
        """Whether a truncated batch draws among its rows' top-k / top-p candidates only (the same law: the dropped
        tokens have probability 0): no seeded row (whose noise must not depend on the batch's widest k) and no
        "processed" logprobs (which need the whole truncated vocab)."""
        return ((batch.top_k is not None or batch.top_p is not None) and not batch.generators
                and not (batch.max_num_logprobs is not None and self.logprobs_mode == "processed"))

    @staticmethod
    def _seeded_rows(logits: torch.Tensor, batch: SamplingBatch, token_ids: torch.Tensor) -> torch.Tensor:
        """`token_ids` with the seeded rows of a fused-draw batch (untruncated) replaced by the torch path's draw
        from each row's own generator: the same noise and probabilities as when the whole batch takes that path,
        so a seeded row's tokens do not depend on what shares its batch."""
        rows = list(batch.generators)
        index = to_device(rows, torch.int64, logits.device)
        probs = (logits.index_select(0, index) / batch.temperature.index_select(0, index)[:, None]).softmax(dim=-1)
        drawn = _exponential_race(probs, {i: batch.generators[r] for i, r in enumerate(rows)})
        return token_ids.index_copy(0, index, drawn)

    def warm_up(self, vocab_size: int, dtype: torch.dtype, device: torch.device) -> None:
        """Draw once greedily and once at temperature 1 from a row of zero logits of the model's (`dtype`, width
        `vocab_size`): the two draws that launch Triton kernels (`greedy_argmax`, the fused Gumbel draw), built
        here for the logits' dtype and width rather than in the first request (a compile of ~0.6-0.9 s on an H200
        with a cold kernel cache: bench/RESULTS.md, twenty-seventh session). The other paths run torch ops."""
        logits = torch.zeros(1, vocab_size, dtype=dtype, device=device)
        for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)):
            self(logits, SamplingBatch.build([params], [((), ())], None, vocab_size, device))

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch,
                 greedy_ids: torch.Tensor | None = None) -> SamplerOutput:
        """Sample one token a row of `logits` (the module docstring's steps). `greedy_ids`: the argmax of these
        very rows, computed already (a CUDA graph's, cuda_graphs.py), taken as the answer of an all-greedy batch
        whose logits nothing changes (no penalties, no banned ids) instead of computing it again."""
        if logits.dim() != 2 or logits.shape[0] != batch.num_rows:
            raise ValueError(f"logits must be [{batch.num_rows}, vocab], got {tuple(logits.shape)}")
        want_lp = batch.max_num_logprobs is not None
        fused = self.fused_draw(logits, batch)
        if want_lp or batch.needs_penalties or batch.banned_ids is not None or not (batch.all_greedy or fused):
            logits = logits.float()  # everything below is out of place: the caller's tensor is never modified
        # (else one kernel is all: it reads the rows in the logits' own dtype, without a cast)
        raw_logprobs = logits.log_softmax(dim=-1) if want_lp and self.logprobs_mode == "raw" else None

        logits = apply_penalties(logits, batch)
        if batch.banned_ids is not None:
            # the -inf values are filled on the device: a Python scalar here would be a host-to-device copy
            neg_inf = torch.full(batch.banned_ids.shape, float("-inf"), device=logits.device)
            logits = logits.index_put((batch.banned_rows, batch.banned_ids), neg_inf)

        processed = logits
        if batch.all_greedy:
            unchanged = not batch.needs_penalties and batch.banned_ids is None
            token_ids = greedy_ids if greedy_ids is not None and unchanged else greedy_argmax(logits)
        elif fused:  # (processed logprobs never come here)
            seed = int(torch.randint(MAX_SEED, (1,)).item())  # the default CPU generator: no device sync
            token_ids = gumbel_argmax_triton(logits, batch.inv_temperature, seed)
            if batch.generators:  # seeded rows: redrawn from their own generators, as the torch path draws them
                token_ids = self._seeded_rows(logits, batch, token_ids)
        elif self.draws_among_candidates(batch):
            # truncated, unseeded, no processed logprobs: the draw among each row's candidates, never the whole vocab
            values, order = top_k_top_p_candidates(logits / batch.temperature[:, None], batch.top_k, batch.top_p,
                                                   batch.top_k_max)
            picked = _exponential_race(apply_min_p(values, batch.min_p).softmax(dim=-1), {})
            token_ids = order.gather(1, picked[:, None]).squeeze(1)
            if not batch.all_random:
                token_ids = torch.where(batch.greedy, greedy_argmax(logits), token_ids)
        else:
            scaled = logits / batch.temperature[:, None]
            scaled = apply_top_k_top_p(scaled, batch.top_k, batch.top_p, batch.top_k_max)
            scaled = apply_min_p(scaled, batch.min_p)
            probs = scaled.softmax(dim=-1)
            token_ids = _exponential_race(probs, batch.generators)
            if not batch.all_random:
                token_ids = torch.where(batch.greedy, greedy_argmax(logits), token_ids)
                processed = torch.where(batch.greedy[:, None], logits, scaled)
            else:
                processed = scaled

        out = SamplerOutput(token_ids=token_ids)
        if want_lp:
            lp = raw_logprobs if raw_logprobs is not None else processed.log_softmax(dim=-1)
            out.logprobs, out.ranks, out.topk_ids, out.topk_logprobs = _logprob_outputs(
                lp, token_ids, batch.max_num_logprobs
            )
        return out


def compute_prompt_logprobs(
    logits: torch.Tensor, next_token_ids: torch.Tensor, k: int, chunk_size: int = 1024
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities of prompt tokens from the logits that predicted them.

    `logits[t]` is the model's output at prompt position t and `next_token_ids[t]` the token at position t+1.
    Returns (token_logprobs [T], topk_ids [T, k], topk_logprobs [T, k]) from the raw log_softmax, working
    `chunk_size` rows at a time so that a long prompt never materialises a [T, vocab] float32 copy at once.
    """
    if logits.dim() != 2 or next_token_ids.shape != (logits.shape[0],):
        raise ValueError(
            f"need logits [T, vocab] and next_token_ids [T], got {tuple(logits.shape)} and "
            f"{tuple(next_token_ids.shape)}"
        )
    num, device = logits.shape[0], logits.device
    token_lp = torch.empty(num, dtype=torch.float32, device=device)
    top_ids = torch.empty(num, k, dtype=torch.int64, device=device)
    top_lp = torch.empty(num, k, dtype=torch.float32, device=device)
    ids = next_token_ids.to(device=device, dtype=torch.int64)
    for start in range(0, num, chunk_size):
        end = min(start + chunk_size, num)
        lp = logits[start:end].float().log_softmax(dim=-1)
        token_lp[start:end] = lp.gather(1, ids[start:end, None]).squeeze(1)
        if k > 0:
            top_lp[start:end], top_ids[start:end] = lp.topk(k, dim=-1)
    return token_lp, top_ids, top_lp
