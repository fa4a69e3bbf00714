"""The contract between passes and the runtime: declared graph inputs (`inputs.py`) and cache specs
(`caches.py`). Passes create these; the runtime reads them as data. Nothing here imports a pass or the runtime."""

from mini_infer.contract.caches import (
    DEFAULT_BLOCK_SIZE,
    CacheSpec,
    CacheTensor,
    FullAttentionSpec,
    LatentAttentionSpec,
    SlidingWindowSpec,
    attention_window,
    bytes_per_block,
    default_block_size,
    is_block_size,
)
from mini_infer.contract.inputs import DIMS, PADDED_DIMS, InputSpec, StepBatch

__all__ = ["DEFAULT_BLOCK_SIZE", "DIMS", "PADDED_DIMS", "CacheSpec", "CacheTensor", "FullAttentionSpec", "InputSpec",
           "LatentAttentionSpec", "SlidingWindowSpec", "StepBatch", "attention_window", "bytes_per_block",
           "default_block_size", "is_block_size"]
