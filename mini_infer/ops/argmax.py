"""`mini_infer::argmax_rows`: the index of each row's maximum, exactly `torch.argmax(x, dim=-1)` for a 2-D x.

The greedy sampler's last step (runtime/sampler.py calls it through `greedy_argmax`). Semantics (must not change),
those of torch.argmax (ATen's `GreaterOrNan` comparator in SharedReduceOps.h, shared by its CPU and CUDA
reductions; tests/ops/test_argmax.py checks them on CPU):
  * the FIRST index of the row's maximum (ties: the lowest index wins; -0.0 == 0.0, so they tie);
  * NaN counts as larger than anything, +inf included: a row with a NaN gives the index of its first NaN;
  * a row of -inf only (nothing larger) gives 0, its first index;
  * the result is int64 [R]; R == 0 gives an empty result; V == 0 is refused, as torch refuses it.
Inputs are float16 / bfloat16 / float32 [R, V] with any row stride and a unit last stride (other layouts are
copied first). The comparisons happen in fp32, which holds every fp16 / bf16 value exactly.

The Triton kernel runs one launch over a grid (R, P): P programs split each row into P chunks of TILES x BLOCK
elements (BLOCK a power of two, a few thousand elements a program, P <= MAX_PROGRAMS). A program reduces its chunk
to a partial (value, first index), the value NaN where the chunk holds one; with P == 1 it writes the result at
once, else it stores the partial in a workspace and counts itself in a counter of its row (`_split_k`'s
`arrives_last`, counters from `split_counters`); the program that arrives last zeroes the counter and merges the
row's P partials in chunk order (deterministic, whatever the arrival order). No host sync and no data-dependent
shape: the op can be captured in a CUDA graph, once its first call of a shape (Triton's compile, the workspace's
growth) has happened outside the capture.

This file must not change the semantics above for speed (a sampler's greedy tokens must be torch's), nor import
anything from mini_infer outside `mini_infer.ops`.
"""

from __future__ import annotations

import torch

from mini_infer.ops._split_k import split_counters
from mini_infer.ops._triton_support import (
    HAS_TRITON,
    await_producers,
    next_pow2,
    pdl_args,
    tl,
    triton,
    use_triton,
)

__all__ = ["argmax_config", "argmax_rows", "check_rows", "argmax_rows_reference", "argmax_rows_triton", "greedy_argmax"]

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_BLOCK = 4096  # elements a program loads at once (8 KiB of bf16)
MAX_PROGRAMS = 64  # programs per row at most; longer rows give each program several tiles
MIN_BLOCK = 16

if HAS_TRITON:
    from mini_infer.ops._split_k import arrives_last

    NO_INDEX = tl.constexpr(2147483647)  # above every index: "none here" in the min-index reductions

    @triton.jit
    def gumbel_noise(seed, first, BLOCK: tl.constexpr):
        """Standard Gumbel noise -log(-log(u)) for elements first .. first + BLOCK - 1 of a noise stream (first a
        multiple of 4): element e takes lane e % 4 of Philox counter e // 4 (`tl.rand4x`, key `seed`), so one
        Philox call serves four elements. u uniform in [0, 1): u == 0 gives -inf (a draw that never wins), u near 1
        at most about 22.2."""
        u0, u1, u2, u3 = tl.rand4x(seed, first // 4 + tl.arange(0, BLOCK // 4))
        # [BLOCK // 4, 2, 2] laid out as element 4k + 2a + b: (u0, u1, u2, u3)[k] in order
        u = tl.reshape(tl.join(tl.join(u0, u2), tl.join(u1, u3)), (BLOCK,))
        return -tl.log(-tl.log(u))

    @triton.jit
    def _first_max(vals, idx, ok):
        """(value, index) of the first maximum of `vals` (fp32) among the lanes where `ok`, NaN the largest:
        the first NaN's index and NaN if there is one, else the row maximum and the lowest index holding it
        (lanes not ok are never picked; with no lane ok the index is NO_INDEX)."""
        is_nan = ok & (vals != vals)
        nan_idx = tl.min(tl.where(is_nan, idx, NO_INDEX), axis=0)
        v = tl.where(ok & (vals == vals), vals, float("-inf"))
        v_max = tl.max(v, axis=0)
        max_idx = tl.min(tl.where(ok & (v == v_max), idx, NO_INDEX), axis=0)
        has_nan = nan_idx < NO_INDEX
        return tl.where(has_nan, float("nan"), v_max), tl.where(has_nan, nan_idx, max_idx)

    # `seed` (a fresh random value every sampling step) is not specialized: Triton would otherwise build another
    # variant of the kernel the first time a seed divisible by 16 (or equal to 1) comes, a compile of about a second
    # in the middle of serving on a machine whose kernel cache is cold (bench/RESULTS.md, twenty-first session).
    @triton.jit(do_not_specialize=["seed"])
    def _argmax_rows_kernel(
        x_ptr, out_ptr, ws_val_ptr, ws_idx_ptr, cnt_ptr, n_cols, s_xr, inv_t_ptr, seed,
        NUM_PROGRAMS: tl.constexpr, P_POW2: tl.constexpr, TILES: tl.constexpr, BLOCK: tl.constexpr,
        USE_GDC: tl.constexpr, NOISE: tl.constexpr = False,
    ):  # fmt: skip
        """argmax_rows' kernel; with NOISE (gumbel_argmax.py's op), the argmax of x * inv_t[row] + Gumbel noise
        (`gumbel_noise`, key `seed`, element row * V4 + column of its stream, V4 = n_cols rounded up to a multiple of
        4) on rows whose inv_t > 0, and of x itself on the others."""
        await_producers(USE_GDC)
        row = tl.program_id(0)
        part = tl.program_id(1)
        x_row = x_ptr + row.to(tl.int64) * s_xr
        start = part * (TILES * BLOCK)
        cols = tl.arange(0, BLOCK)
        if NOISE:
            inv_t = tl.load(inv_t_ptr + row)
            noise_row = row * ((n_cols + 3) // 4 * 4)
        # the chunk's running (value, index): tiles in order, a later tile taking over only when strictly larger
        # (or the first NaN); the chunk's first element is never past the row, so the index starts there
        best_v = tl.full((), float("-inf"), tl.float32)
        best_i = start
        nan_i = tl.full((), NO_INDEX, tl.int32)
        for t in tl.static_range(TILES):
            c = start + t * BLOCK + cols
            ok = c < n_cols
            v = tl.load(x_row + c, mask=ok, other=float("-inf")).to(tl.float32)
            if NOISE:  # greedy rows (inv_t <= 0): v * 1 + 0, the logit itself
                noisy = inv_t > 0
                g = gumbel_noise(seed, noise_row + start + t * BLOCK, BLOCK)
                v = v * tl.where(noisy, inv_t, 1.0) + tl.where(noisy, g, 0.0)
            tv, ti = _first_max(v, c, ok)
            is_nan = tv != tv
            nan_i = tl.where(is_nan & (nan_i == NO_INDEX), ti, nan_i)
            take = (tv > best_v) & (ti < NO_INDEX)
            best_v = tl.where(take, tv, best_v)
            best_i = tl.where(take, ti, best_i)
        has_nan = nan_i < NO_INDEX
        best_i = tl.where(has_nan, nan_i, best_i)
        if NUM_PROGRAMS == 1:
            tl.store(out_ptr + row, best_i.to(tl.int64))
        else:
            best_v = tl.where(has_nan, float("nan"), best_v)
            w = row.to(tl.int64) * NUM_PROGRAMS
            tl.store(ws_val_ptr + w + part, best_v)
            tl.store(ws_idx_ptr + w + part, best_i)
            if arrives_last(cnt_ptr + row, NUM_PROGRAMS):
                p = tl.arange(0, P_POW2)
                p_ok = p < NUM_PROGRAMS
                # through L2 (.cg): the partials come from other programs of this launch
                vals = tl.load(ws_val_ptr + w + p, mask=p_ok, other=float("-inf"), cache_modifier=".cg")
                idx = tl.load(ws_idx_ptr + w + p, mask=p_ok, other=NO_INDEX, cache_modifier=".cg")
                # chunks are in index order, so the lowest index among equal partials is the earliest chunk's
                _, i = _first_max(vals, idx, p_ok)
                tl.store(out_ptr + row, i.to(tl.int64))


def argmax_rows_reference(x: torch.Tensor) -> torch.Tensor:
    """Plain torch: the definition."""
    return torch.argmax(x, dim=-1)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def argmax_config(n_cols: int) -> tuple[int, int, int, int]:
    """(BLOCK, TILES, programs per row P, num_warps) for rows of n_cols: BLOCK a power of two up to MAX_BLOCK
    (at least MIN_BLOCK), TILES blocks a program, so that P = cdiv(n_cols, TILES * BLOCK) <= MAX_PROGRAMS and
    every program's chunk starts inside the row."""
    block = min(MAX_BLOCK, max(MIN_BLOCK, next_pow2(n_cols)))
    tiles = _cdiv(_cdiv(n_cols, block), MAX_PROGRAMS)
    programs = _cdiv(n_cols, tiles * block)
    return block, tiles, programs, 8 if block >= 4096 else 4


_WORKSPACE: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # device -> (fp32 values, int32 indices)


def _workspace(device: torch.device, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """At least n partials (values, indices) on `device`, kept per device (each launch writes before it reads: no
    zeroing needed). Grown on first need: make the first call of each shape before capturing a CUDA graph."""
    vals, idx = _WORKSPACE.get(device, (None, None))
    if vals is None or vals.numel() < n:
        n = max(n, 4096, 2 * vals.numel() if vals is not None else 0)
        vals = torch.empty(n, dtype=torch.float32, device=device)
        idx = torch.empty(n, dtype=torch.int32, device=device)
        _WORKSPACE[device] = (vals, idx)
    return vals, idx


def check_rows(x: torch.Tensor, cols: bool = True, op: str = "argmax_rows") -> None:
    """Refuse the x that `op` (argmax_rows, or gumbel_argmax.py's op on this kernel) does not take; `cols`: rows of
    no column too (not in the fake impl: no guard on a symbolic vocab)."""
    if x.dim() != 2:
        raise ValueError(f"{op}: x must be [rows, cols], got shape {tuple(x.shape)}")
    if x.dtype not in DTYPES:
        raise ValueError(f"{op}: x must be float16, bfloat16 or float32, got {x.dtype}")
    if cols and x.shape[1] == 0:
        raise ValueError(f"{op}: rows of 0 columns have no maximum (torch.argmax refuses them too)")


def argmax_rows_triton(x: torch.Tensor, config: tuple[int, int] | None = None,
                       noise: tuple[torch.Tensor, int] | None = None) -> torch.Tensor:
    """Triton argmax over the last dim (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1). `config`:
    (BLOCK, TILES) instead of `argmax_config`'s (tests: many chunks in a short row; benchmarks). `noise`:
    (inv_temperature [R] fp32, seed), gumbel_argmax.py's draw (see the kernel) instead of the plain argmax."""
    if not HAS_TRITON:
        raise RuntimeError("argmax_rows_triton needs triton")
    check_rows(x)
    n_rows, n_cols = x.shape
    out = torch.empty(n_rows, dtype=torch.int64, device=x.device)
    if n_rows == 0:
        return out
    if x.stride(1) != 1 and n_cols > 1:
        x = x.contiguous()
    block, tiles, programs, num_warps = argmax_config(n_cols)
    if config is not None:
        block, tiles = config
        if block < 1 or block & (block - 1) or tiles < 1:
            raise ValueError(f"argmax_rows_triton: config (BLOCK, TILES) needs a power-of-two BLOCK, got {config}")
        programs = _cdiv(n_cols, block * tiles)
    noisy = noise is not None
    noise = (noise[0], int(noise[1])) if noisy else (out, 0)  # (the placeholder pointer is unread)
    if programs == 1:
        ws_val, ws_idx, cnt = out, out, out  # unread
    else:
        ws_val, ws_idx = _workspace(x.device, n_rows * programs)
        cnt = split_counters(x.device, n_rows)
    _argmax_rows_kernel[(n_rows, programs)](
        x, out, ws_val, ws_idx, cnt, n_cols, x.stride(0), *noise,
        NUM_PROGRAMS=programs, P_POW2=next_pow2(programs), TILES=tiles, BLOCK=block, num_warps=num_warps,
        NOISE=noisy, **pdl_args(x),
    )  # fmt: skip
    return out


@torch.library.custom_op("mini_infer::argmax_rows", mutates_args=())
def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) of a [R, V] tensor: Triton on CUDA when available, else the torch reference."""
    if use_triton(x):
        return argmax_rows_triton(x)
    check_rows(x)
    return argmax_rows_reference(x)


@argmax_rows.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    check_rows(x, cols=False)
    return x.new_empty((x.shape[0],), dtype=torch.int64)


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, dim=-1) of [R, V] logits as the sampler takes it: the Triton kernel where the ops
    would run Triton (`use_triton`: CUDA, Triton importable, no MINI_INFER_OPS_BACKEND=torch) and the logits fit
    it, else torch.argmax itself; the launcher is called directly (no dispatcher cost on the sampler's path)."""
    if use_triton(logits) and logits.dim() == 2 and logits.dtype in DTYPES and logits.shape[1] > 0:
        return argmax_rows_triton(logits)
    return logits.argmax(dim=-1)
