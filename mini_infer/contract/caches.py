"""Cache specs: what a pass tells the runtime about each per-layer cache its ops read and write.

Every cache is paged in the same blocks: a sequence's block table names, for every layer and every cache, the
blocks holding its tokens. A spec lists its paged tensors (shape per token, storage dtype; the runtime
allocates `[num_blocks, block_size, *shape]` for each, or that view of storage holding each block's tokens
contiguous, `CacheTensor.keys_contiguous`) and any fixed per-layer tensors (e.g. quantization scales), and
computes its bytes per token. The runtime sizes the pool from the sum over specs, allocates each spec's tensors
by calling `allocate`, passes them to the graph as the inputs they are named after, and frees blocks that every
layer's attention window has left behind (`attention_window`). A spec may name the block size its readers run
fastest at (`block_size_hint`); an engine not told a block size takes the largest hint (`default_block_size`).

Kinds (vLLM keeps the same split in `kv_cache_interface.py`): `FullAttentionSpec` (K and V per KV head; a
float8 storage dtype comes with per-layer K and V scales), `SlidingWindowSpec` (the same, attending to the last
`sliding_window` tokens), `LatentAttentionSpec` (one tensor per layer: DeepSeek MLA's normalized latent plus its
rotary key). A new kind subclasses `CacheSpec`; nothing in the runtime changes.

Data only: no graph and no block bookkeeping here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
DEFAULT_BLOCK_SIZE = 16  # tokens a block when no spec asks for another size (vLLM's default)


def is_block_size(value) -> bool:
    """Whether `value` can be a block size: an int (not a bool) that is a power of two >= 1."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1 and not value & (value - 1)


@dataclass(frozen=True)
class CacheTensor:
    """One paged tensor: graph input `name`, allocated `[num_blocks, block_size, *shape]` of `dtype`.
    `keys_contiguous`: stored `[num_blocks, *shape, block_size]` (each block's tokens side by side for every element
    of `shape`) and handed out as the `[num_blocks, block_size, *shape]` view of that storage, so that readers index
    it as any other cache and kernels see the layout in its strides (stride 1 along the block's tokens).
    `heads_outer`: stored `[num_blocks, shape[0], block_size, *shape[1:]]` (a block's tokens of one head, e.g. one KV
    head's keys, side by side) and handed out as the same view; not with `keys_contiguous`, which already keeps
    every element's tokens of a block together."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    keys_contiguous: bool = False
    heads_outer: bool = False

    def __post_init__(self) -> None:
        if self.heads_outer and (self.keys_contiguous or len(self.shape) < 2):
            raise ValueError(f"{self.name}: heads_outer needs a [heads, ...] shape and no keys_contiguous, got "
                             f"shape {self.shape}, keys_contiguous={self.keys_contiguous}")

    @property
    def bytes_per_token(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()

    def zeros(self, num_blocks: int, block_size: int, device: torch.device) -> torch.Tensor:
        """The zeroed tensor of `num_blocks` blocks, `[num_blocks, block_size, *shape]` (a view when
        `keys_contiguous`)."""
        if self.keys_contiguous:
            return torch.zeros(num_blocks, *self.shape, block_size, dtype=self.dtype, device=device).movedim(-1, 1)
        if self.heads_outer:
            return torch.zeros(num_blocks, self.shape[0], block_size, *self.shape[1:], dtype=self.dtype,
                               device=device).movedim(2, 1)
        return torch.zeros(num_blocks, block_size, *self.shape, dtype=self.dtype, device=device)


class CacheSpec:
    """Base class of cache specs. Subclasses implement `tensors()`; most are frozen dataclasses."""

    layer_idx: int
    # tokens a block, as the readers of this cache would have it (a power of two), or None: no preference
    block_size_hint: int | None = None

    def tensors(self) -> tuple[CacheTensor, ...]:
        """The paged tensors, in graph-input order."""
        raise NotImplementedError

    def fixed_tensors(self) -> dict[str, torch.Tensor]:
        """Per-layer tensors that are not paged (graph inputs too), as CPU tensors to copy to the device."""
        return {}

    @property
    def attention_window(self) -> int | None:
        """Tokens back from the newest that this layer's attention can still read; None: all of them."""
        return None

    def input_names(self) -> list[str]:
        return [t.name for t in self.tensors()] + list(self.fixed_tensors())

    def bytes_per_token(self) -> int:
        return sum(t.bytes_per_token for t in self.tensors())

    def allocate(self, num_blocks: int, block_size: int, device: torch.device) -> dict[str, torch.Tensor]:
        """Zeroed paged tensors for `num_blocks` blocks of `block_size` tokens, plus the fixed tensors."""
        out = {t.name: t.zeros(num_blocks, block_size, device) for t in self.tensors()}
        out.update({k: v.to(device) for k, v in self.fixed_tensors().items()})
        return out

    def describe(self) -> str:
        """One line for logs and summaries."""
        parts = ", ".join(f"{t.name} {list(t.shape)} {str(t.dtype).removeprefix('torch.')}"
                          f"{' (tokens contiguous)' if t.keys_contiguous else ''}"
                          f"{' (heads outer)' if t.heads_outer else ''}" for t in self.tensors())
        return f"layer {self.layer_idx}: {type(self).__name__}({parts}; {self.bytes_per_token()} B/token)"


@dataclass(frozen=True)
class FullAttentionSpec(CacheSpec):
    """K `[num_kv_heads, head_size]` and V `[num_kv_heads, head_size_v]` per token. A float8 `dtype` is a
    quantized cache: values are stored divided by `scales` = (k_scale, v_scale) and read back multiplied.
    `v_keys_contiguous`: V stored with each block's tokens contiguous (`CacheTensor.keys_contiguous`).
    `block_size_hint`: the block size the pass's attention kernels read this cache fastest at (None: any).
    `heads_outer`: K (and V, unless stored tokens-contiguous) stored with each KV head's tokens of a block side by
    side (`CacheTensor.heads_outer`)."""

    layer_idx: int
    num_kv_heads: int
    head_size: int
    head_size_v: int
    dtype: torch.dtype
    scales: tuple[float, float] | None = None
    v_keys_contiguous: bool = False
    block_size_hint: int | None = None
    heads_outer: bool = False

    def __post_init__(self) -> None:
        check_block_size_hint(self.layer_idx, self.block_size_hint)
        if self.dtype in FP8_DTYPES and self.scales is None:
            raise ValueError(f"layer {self.layer_idx}: a {self.dtype} KV cache needs scales (k_scale, v_scale)")
        if self.scales is not None and self.dtype not in FP8_DTYPES:
            raise ValueError(f"layer {self.layer_idx}: scales are for float8 caches, not {self.dtype}")
        if self.scales is not None and not all(s > 0 for s in self.scales):
            raise ValueError(f"layer {self.layer_idx}: KV-cache scales must be > 0, got {self.scales}")

    @property
    def k_input(self) -> str:
        return f"k_cache_{self.layer_idx}"

    @property
    def v_input(self) -> str:
        return f"v_cache_{self.layer_idx}"

    @property
    def quantized(self) -> bool:
        return self.scales is not None

    def tensors(self) -> tuple[CacheTensor, ...]:
        return (CacheTensor(self.k_input, (self.num_kv_heads, self.head_size), self.dtype, False, self.heads_outer),
                CacheTensor(self.v_input, (self.num_kv_heads, self.head_size_v), self.dtype, self.v_keys_contiguous,
                            self.heads_outer and not self.v_keys_contiguous))

    def fixed_tensors(self) -> dict[str, torch.Tensor]:
        if self.scales is None:
            return {}
        return {f"k_scale_{self.layer_idx}": torch.tensor([self.scales[0]], dtype=torch.float32),
                f"v_scale_{self.layer_idx}": torch.tensor([self.scales[1]], dtype=torch.float32)}


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    """A full-attention cache whose layer attends only to the last `sliding_window` tokens."""

    sliding_window: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sliding_window < 1:
            raise ValueError(f"layer {self.layer_idx}: sliding_window must be >= 1, got {self.sliding_window}")

    @property
    def attention_window(self) -> int | None:
        return self.sliding_window


@dataclass(frozen=True)
class LatentAttentionSpec(CacheSpec):
    """Multi-head latent attention (DeepSeek-V2/V3): one tensor per token holding the normalized KV latent
    (`kv_lora_rank` values) followed by the rotary key part (`qk_rope_head_dim` values), shared by all heads."""

    layer_idx: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    dtype: torch.dtype

    @property
    def latent_input(self) -> str:
        return f"latent_cache_{self.layer_idx}"

    def tensors(self) -> tuple[CacheTensor, ...]:
        return (CacheTensor(self.latent_input, (self.kv_lora_rank + self.qk_rope_head_dim,), self.dtype),)


def check_block_size_hint(layer_idx: int, hint: int | None) -> None:
    """A spec's `block_size_hint` is None or a power of two >= 1 (the engine's rule for block sizes)."""
    if hint is not None and not is_block_size(hint):
        raise ValueError(f"layer {layer_idx}: block_size_hint must be a power of two >= 1 or None, got {hint!r}")


def default_block_size(specs: list[CacheSpec], fallback: int = DEFAULT_BLOCK_SIZE) -> int:
    """The block size of an engine not told one: the largest any spec's readers ask for (`block_size_hint`), else
    `fallback` (DEFAULT_BLOCK_SIZE). Every layer shares the blocks, so one hint decides for all."""
    return max((s.block_size_hint for s in specs if s.block_size_hint), default=fallback)


def bytes_per_block(specs: list[CacheSpec], block_size: int) -> int:
    """Bytes one block costs across every layer's caches."""
    return sum(s.bytes_per_token() for s in specs) * block_size


def attention_window(specs: list[CacheSpec]) -> int | None:
    """Tokens back that some layer can still read, when every layer has a window (blocks older than that can
    be freed); None when any layer attends to everything."""
    windows = [s.attention_window for s in specs]
    if not windows or any(w is None for w in windows):
        return None
    return max(windows)
