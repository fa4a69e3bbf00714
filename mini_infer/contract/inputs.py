"""Declared graph inputs: what a pass tells the runtime about each input it adds to the graph.

A pass that adds a graph input declares an `InputSpec`: its dtype, its shape in terms of the step (`"tokens"`,
`"seqs"`, `"seqs+1"`, `"logits"`, `"blocks"` or fixed ints), the value that fills padded rows of a CUDA-graph
buffer, and the builder that computes it from a `StepBatch` — the host-side description of one step that the
runtime assembles (packed token ids and positions, per-sequence lengths and block tables, cache slots, the rows
whose logits are needed). The runtime fills every declared input generically through its builder; no pass's
input name appears in the runtime. Verification and tests run the same builders on a one-sequence batch
(`StepBatch.single_sequence`), so the example inputs are the runtime's own.

This module is data and small pure functions: it never touches a graph, a cache or a device queue.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

# Symbolic dimensions of a step: T packed tokens, S sequences, L logits rows, W block-table columns.
DIMS = ("tokens", "seqs", "seqs+1", "logits", "blocks")
# Dimensions whose CUDA-graph buffer is padded to the captured bucket (blocks keep their full width).
PADDED_DIMS = ("tokens", "seqs", "seqs+1", "logits")
Dim = str | int


@dataclass
class StepBatch:
    """One step, on the host: the packed row of tokens and what each sequence in it needs.

    Sequence s owns tokens `query_start_loc[s] : query_start_loc[s+1]` of the row; its context (cached plus
    new tokens) is `seq_lens[s]` long and lives in the blocks `block_tables[s]`. Token i is written to the
    flat cache slot `slot_mapping[i]` (negative: nowhere). Logits are wanted at rows `logits_indices`.
    """

    token_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    seq_lens: np.ndarray  # [S] int32
    query_start_loc: np.ndarray  # [S+1] int32
    block_tables: np.ndarray  # [S, W] int32
    logits_indices: np.ndarray  # [L] int64
    block_size: int

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_logits(self) -> int:
        return int(self.logits_indices.shape[0])

    def token_seq_index(self) -> np.ndarray:
        """[T] int32: the sequence that owns each token."""
        counts = np.diff(self.query_start_loc)
        return np.repeat(np.arange(self.num_seqs, dtype=np.int32), counts)

    @classmethod
    def single_sequence(cls, token_ids: torch.Tensor, position_ids: torch.Tensor, block_size: int) -> StepBatch:
        """`token_ids` ([1, T]) as one sequence whose context is exactly these tokens, in blocks 0, 1, 2, ...
        (what verification and tests run). Positions are taken as given; the context length is T."""
        ids = token_ids.reshape(-1).cpu().numpy().astype(np.int64)
        pos = position_ids.reshape(-1).cpu().numpy().astype(np.int64)
        t = ids.shape[0]
        num_blocks = max(1, -(-t // block_size))
        return cls(token_ids=ids, positions=pos, slot_mapping=np.arange(t, dtype=np.int64),
                   seq_lens=np.array([t], dtype=np.int32), query_start_loc=np.array([0, t], dtype=np.int32),
                   block_tables=np.arange(num_blocks, dtype=np.int32)[None],
                   logits_indices=np.array([t - 1], dtype=np.int64), block_size=block_size)


# A builder computes an input's host value for a step (array or anything `torch.as_tensor` takes).
InputBuilder = Callable[[StepBatch], np.ndarray]
Pad = int | float | str | None  # a fill value, "last" (repeat the last real element), or None (left stale)


@dataclass(frozen=True)
class InputSpec:
    """A graph input the runtime feeds every step.

    `shape` names each dimension (see `DIMS`) or fixes it. `pad` is what a CUDA-graph buffer holds past the
    step's real extent along padded dimensions: a value, `"last"` (the last real element repeated, e.g. query
    offsets), or None when the consumers never read padding (it is then left as it was). `build` computes the
    value from the step.
    """

    name: str
    dtype: torch.dtype
    shape: tuple[Dim, ...]
    build: InputBuilder
    pad: Pad = 0

    def __post_init__(self) -> None:
        bad = [d for d in self.shape if not isinstance(d, int) and d not in DIMS]
        if bad:
            raise ValueError(f"input {self.name!r}: unknown dimension(s) {bad}; use ints or {DIMS}")
        if isinstance(self.pad, str) and self.pad != "last":
            raise ValueError(f"input {self.name!r}: pad must be a number, 'last' or None, got {self.pad!r}")

    def value(self, step: StepBatch) -> torch.Tensor:
        """The host tensor for `step` (checked against the declared shape)."""
        t = torch.as_tensor(self.build(step), dtype=self.dtype)
        sizes = self.sizes(step.num_tokens, step.num_seqs, step.num_logits, None)
        if t.dim() != len(sizes) or any(s is not None and s != n for s, n in zip(sizes, t.shape)):
            raise ValueError(f"input {self.name!r}: builder returned shape {tuple(t.shape)}, declared "
                             f"{self.shape} = {sizes} for this step")
        return t

    def sizes(self, tokens: int, seqs: int, logits: int, blocks: int | None) -> tuple[int | None, ...]:
        """The concrete shape for a step of these sizes (None where `blocks` is not given)."""
        table = {"tokens": tokens, "seqs": seqs, "seqs+1": seqs + 1, "logits": logits, "blocks": blocks}
        return tuple(d if isinstance(d, int) else table[d] for d in self.shape)


def _array(field: str) -> InputBuilder:
    return lambda step: getattr(step, field)


# The graph's own inputs (capture) and the attention metadata every paged attention op reads. Padding token rows
# of input_ids are embedded like real ones (their outputs discarded), so they must hold a token id: 0.
INPUT_IDS = InputSpec("input_ids", torch.int64, (1, "tokens"), lambda s: s.token_ids[None], pad=0)
POSITION_IDS = InputSpec("position_ids", torch.int64, (1, "tokens"), lambda s: s.positions[None], pad=None)
SLOT_MAPPING = InputSpec("slot_mapping", torch.int64, ("tokens",), _array("slot_mapping"), pad=-1)
BLOCK_TABLES = InputSpec("block_tables", torch.int32, ("seqs", "blocks"), _array("block_tables"), pad=None)
SEQ_LENS = InputSpec("seq_lens", torch.int32, ("seqs",), _array("seq_lens"), pad=0)
QUERY_START_LOC = InputSpec("query_start_loc", torch.int32, ("seqs+1",), _array("query_start_loc"), pad="last")
LOGITS_INDICES = InputSpec("logits_indices", torch.int64, ("logits",), _array("logits_indices"), pad=0)
ATTENTION_METADATA = (SLOT_MAPPING, BLOCK_TABLES, SEQ_LENS, QUERY_START_LOC)

# A pass whose op reads step lengths on the host for long query runs (which a CUDA graph cannot replay) declares
# in `PassContext.info[UNCAPTURED_QUERY_ROWS]` the run length from which that happens: the runtime runs steps
# holding a query run at least that long uncaptured.
UNCAPTURED_QUERY_ROWS = "uncaptured_query_rows"

# A pass whose graph has an answer only for positions below n (rotary_table: rows of a table computed at compile
# time) declares n in `PassContext.info[MAX_POSITIONS]`: the engine refuses a max_model_len above it.
MAX_POSITIONS = "max_positions"
