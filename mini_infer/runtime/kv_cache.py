"""The paged KV cache tensors: one K and one V tensor per attention layer, laid out as the attention pass
declared (`KVCacheSpec`), sized from a memory budget.

Allocation and sizing only: block bookkeeping is the block manager's, attention the ops'.
"""

from __future__ import annotations

import torch

from mini_infer.passes.base import KVCacheSpec

DEFAULT_CPU_KV_BYTES = 1 << 30  # 1 GiB


def bytes_per_block(specs: list[KVCacheSpec], block_size: int) -> int:
    return sum(s.bytes_per_token() for s in specs) * block_size


def num_blocks_for_budget(specs: list[KVCacheSpec], block_size: int, budget_bytes: int) -> int:
    per_block = bytes_per_block(specs, block_size)
    return int(budget_bytes // per_block) if per_block else 0


def cuda_kv_budget(device: torch.device, gpu_memory_utilization: float, reserve_bytes: int) -> int:
    """Bytes left for the cache: `gpu_memory_utilization` of the GPU, minus what is used now (weights,
    allocator) and `reserve_bytes` for activations."""
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    return int(total * gpu_memory_utilization - used - reserve_bytes)


class KVCache:
    """Allocates `[num_blocks, block_size, num_kv_heads, head_size]` K and V tensors per layer."""

    def __init__(self, specs: list[KVCacheSpec], num_blocks: int, block_size: int, device: torch.device) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got num_blocks={num_blocks}")
        self.specs = specs
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.tensors: dict[str, torch.Tensor] = {}
        for s in specs:
            self.tensors[s.k_input] = torch.zeros(num_blocks, block_size, s.num_kv_heads, s.head_size,
                                                  dtype=s.dtype, device=device)
            self.tensors[s.v_input] = torch.zeros(num_blocks, block_size, s.num_kv_heads, s.head_size_v,
                                                  dtype=s.dtype, device=device)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks src → dst in every layer (copy-on-write after a fork)."""
        if not pairs:
            return
        src = torch.tensor([p[0] for p in pairs], device=next(iter(self.tensors.values())).device)
        dst = torch.tensor([p[1] for p in pairs], device=src.device)
        for t in self.tensors.values():
            t.index_copy_(0, dst, t.index_select(0, src))
