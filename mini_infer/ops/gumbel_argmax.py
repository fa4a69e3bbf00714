"""`mini_infer::gumbel_argmax`: one token drawn per row from softmax(x / T) in a single pass over the logits.

    gumbel_argmax(x [R, V], inv_temperature [R] fp32, seed) -> ids [R] int64
      row r with inv_temperature[r] > 0: argmax_j (x[r, j] * inv_temperature[r] + g[r, j]), g i.i.d. standard Gumbel
      row r with inv_temperature[r] <= 0: argmax_j x[r, j]   (a greedy row: torch.argmax's id exactly)

The Gumbel-max trick: argmax(x / T + g) is distributed as softmax(x / T), the same law as the sampler's exponential
race argmax(p / E) (E = exp(-g) is Exponential(1), and the softmax's normalization does not move an argmax), without
the probabilities, the noise or a float32 copy of the logits ever being written: the sampler's unseeded,
untruncated rows (runtime/sampler.py) read the [R, V] logits once instead of the seven passes of the torch path
(cast, divide, softmax, noise, clamp, divide, argmax: about 0.5 ms a step at 256 x 151,936 on an H200).

Noise: Philox (`tl.rand4x`), keyed by `seed` (an int below 2**31): element j of row r is lane e % 4 of counter
e // 4, e = r * V4 + j with V4 = V rounded up to a multiple of 4 (argmax.py's `gumbel_noise`: one Philox call per four
elements; int32, so rows past 2**31 / V4 elements reuse counters of earlier rows). The same (x, inv_temperature,
seed) gives the same ids on any GPU and under TRITON_INTERPRET=1. NaN logits win, as in argmax_rows (a NaN score is
the largest).

Two implementations:
  * `gumbel_argmax_triton`: argmax.py's kernel with its NOISE switch (one launch, rows split over up to 64 programs
    merged by the last to arrive; no host sync, no data-dependent shape);
  * `gumbel_argmax_reference`: plain torch, the CPU path: the same formula with uniforms from a `torch.Generator`
    seeded with `seed`, so the same law but not the Triton kernel's draws (Philox streams differ).
Imports nothing from mini_infer outside `mini_infer.ops`.
"""

from __future__ import annotations

import torch

from mini_infer.ops._triton_support import HAS_TRITON, use_triton
from mini_infer.ops.argmax import DTYPES, argmax_rows_triton, check_rows

__all__ = ["MAX_SEED", "can_draw_on", "gumbel_argmax", "gumbel_argmax_reference", "gumbel_argmax_triton"]

MAX_SEED = 2**31 - 1  # seeds are in [0, MAX_SEED)


def _check(x: torch.Tensor, inv_temperature: torch.Tensor, seed: int) -> None:
    check_rows(x, op="gumbel_argmax")
    if inv_temperature.shape != (x.shape[0],) or inv_temperature.dtype != torch.float32:
        raise ValueError(f"gumbel_argmax: inv_temperature must be float32 [{x.shape[0]}], got "
                         f"{inv_temperature.dtype} {tuple(inv_temperature.shape)}")
    if not 0 <= seed < MAX_SEED:
        raise ValueError(f"gumbel_argmax: seed must be in [0, {MAX_SEED}), got {seed}")


def gumbel_argmax_reference(x: torch.Tensor, inv_temperature: torch.Tensor, seed: int) -> torch.Tensor:
    """Plain torch (fp32): the definition, with torch's uniforms (the same law as the kernel's, other draws)."""
    _check(x, inv_temperature, seed)
    gen = torch.Generator(device=x.device)
    gen.manual_seed(seed)
    u = torch.rand(x.shape, generator=gen, device=x.device, dtype=torch.float32)
    scores = x.float() * inv_temperature[:, None] - torch.log(-torch.log(u))
    scores = torch.where(inv_temperature[:, None] > 0, scores, x.float())
    return torch.argmax(scores, dim=-1)


def gumbel_argmax_triton(x: torch.Tensor, inv_temperature: torch.Tensor, seed: int) -> torch.Tensor:
    """The Triton kernel (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1)."""
    if not HAS_TRITON:
        raise RuntimeError("gumbel_argmax_triton needs triton")
    _check(x, inv_temperature, seed)
    return argmax_rows_triton(x, noise=(inv_temperature.contiguous(), seed))


@torch.library.custom_op("mini_infer::gumbel_argmax", mutates_args=())
def gumbel_argmax(x: torch.Tensor, inv_temperature: torch.Tensor, seed: int) -> torch.Tensor:
    """One id per row of x drawn from softmax(x * inv_temperature) (argmax where inv_temperature <= 0): Triton on
    CUDA when available, else the torch reference."""
    if use_triton(x):
        return gumbel_argmax_triton(x, inv_temperature, seed)
    return gumbel_argmax_reference(x, inv_temperature, seed)


@gumbel_argmax.register_fake
def _(x: torch.Tensor, inv_temperature: torch.Tensor, seed: int) -> torch.Tensor:
    return x.new_empty((x.shape[0],), dtype=torch.int64)


def can_draw_on(logits: torch.Tensor) -> bool:
    """Whether the sampler's logits take the Triton draw: where the ops would run Triton and the logits fit the
    kernel (the sampler then calls `gumbel_argmax_triton` directly, with no dispatcher cost); else it keeps its
    torch path."""
    return use_triton(logits) and logits.dim() == 2 and logits.dtype in DTYPES and logits.shape[1] > 0
