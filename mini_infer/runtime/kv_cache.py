"""The paged cache tensors: whatever each declared `CacheSpec` allocates, for one shared pool of blocks, sized
from a memory budget.

Allocation and sizing only: block bookkeeping is the block manager's, attention the ops', and what a cache
holds is its spec's business (`mini_infer.contract.caches`).
"""

from __future__ import annotations

import torch

from mini_infer.contract import CacheSpec, bytes_per_block

DEFAULT_CPU_KV_BYTES = 1 << 30  # 1 GiB


def num_blocks_for_budget(specs: list[CacheSpec], block_size: int, budget_bytes: int) -> int:
    per_block = bytes_per_block(specs, block_size)
    return max(int(budget_bytes // per_block), 0) if per_block else 0


class KVCache:
    """Every spec's tensors for `num_blocks` blocks of `block_size` tokens, by graph-input name."""

    def __init__(self, specs: list[CacheSpec], num_blocks: int, block_size: int, device: torch.device) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got num_blocks={num_blocks}")
        self.specs = specs
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.tensors: dict[str, torch.Tensor] = {}
        for s in specs:
            self.tensors.update(s.allocate(num_blocks, block_size, device))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size
