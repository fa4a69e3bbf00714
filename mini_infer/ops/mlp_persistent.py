"""`mini_infer::mlp_persistent`: a decoder layer's whole gated MLP for one row in ONE persistent launch (the
"megakernel" experiment of issue #14).

    mlp_persistent(x, nw, eps, W_gu, b_gu, W_d, b_d, r)
        = linear_add(silu_and_mul(*split(rms_norm_linear(x, nw, eps, W_gu, b_gu), [I, I])), W_d, b_d, r)

W_gu is the merged gate_up weight [2I, H] (gate rows, then up rows), W_d the down weight [H', I], r the residual the
down GEMV adds. That is the chain the default CUDA pipeline runs for a dense layer's MLP (rms_norm_linear -> split
-> silu_and_mul -> linear_add), with its roundings: the gate / up outputs rounded to their dtype, the activation
rounded to its dtype (silu_and_mul's), the down GEMV's output to the activation's dtype before the residual add
(linear_add's). Inserted by the opt-in FuseMlpPersistent pass. Functional: never writes into its inputs.

On CUDA, for one row whose two GEMVs linear.py's `takes_gemv` takes (anything else: several rows, longer rows, mixed
dtypes, a residual of another shape: the three unfused kernels), one launch of grid = min(tiles needed, SMs x
programs_per_sm) programs, each looping over tiles (grid-stride):
  phase A: a tile is BLOCK_N gate rows j.. AND the same up rows I + j.., with rms_norm_linear's one-pass norm
    prologue (the row's 1 / rms computed once per program from the same BLOCK_K chunks, so the same value); the
    epilogue rounds g and u as the gate_up output is stored, then stores silu(g) * u (silu_and_mul's formula and
    rounding) into an [I] activation buffer;
  a grid-wide barrier: sense-reversing, on two int32 words of a per-device buffer that lives as long as the process
    (`barrier_words`: arrival counter, reset by the last arrival, then a generation word bumped with release
    semantics; the others spin on the generation with volatile loads and take an acquire atomic when it moves).
    The words are left as they were found (counter 0), so CUDA-graph replays need no host reset. Correct only
    while every program is resident at once: the grid never exceeds SMs x programs_per_sm, and programs_per_sm must
    fit the SM's occupancy (1 always does). A spin gives up after MAX_SPINS polls and counts a timeout in a third
    word (`barrier_timeouts`): a wrong answer and a count instead of a hung GPU;
  phase B: the down GEMV over the activation row, tiles of BLOCK_N rows, with linear_add's epilogue
    (`store_linear_plus_residual`).
Under the Triton interpreter (no GPU: programs run one after another, a spin would never end) the same kernel runs
as two launches, PHASES=1 then PHASES=2, the barrier compiled out. The K steps are the unfused kernels' (phase A:
rms_norm_linear's GEMV_CONFIG_SHORT_K step; phase B: linear_add's `gemv_config` step), so each dot product adds
the same chunks: the result equals the unfused kernels bit for bit under the interpreter (tested); on a GPU expect
them to fp32 rounding of the sums, as between two GEMV tiles. On CPU the reference is the unfused references.
Imports nothing from mini_infer outside `mini_infer.ops`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from mini_infer.ops._triton_support import (
    HAS_TRITON,
    await_producers,
    num_sms,
    pdl_args,
    tl,
    triton,
    use_triton,
)
from mini_infer.ops.linear import GEMV_CONFIG_SHORT_K, gemv_config, takes_gemv, unit_stride_row
from mini_infer.ops.linear_add import linear_add_reference, linear_add_triton
from mini_infer.ops.rms_norm_linear import rms_norm_linear_reference, rms_norm_linear_triton
from mini_infer.ops.silu_and_mul import silu_and_mul_reference, silu_and_mul_triton

__all__ = ["MlpTile", "barrier_timeouts", "launch_mlp_persistent", "mlp_persistent", "mlp_persistent_reference",
           "mlp_persistent_triton", "mlp_takes_persistent"]

MAX_SPINS = 1 << 16  # polls of the generation word before a program gives up waiting (~50 ms on an H200)
INTERPRETER_PROGRAMS = 3  # the interpreter's grid: few programs, so each loops over several tiles (as on a GPU)


class MlpTile(NamedTuple):
    """The persistent kernel's launch shape: gate (and up) rows per phase-A tile, down rows per phase-B tile, warps,
    pipeline stages, programs per SM (more than 1 only where that many fit on an SM at once: the barrier needs
    every program resident), and whether to launch it as a cooperative grid (Triton's `launch_cooperative_grid`:
    the driver then refuses a grid that cannot be resident at once instead of letting it hang; not measured yet,
    nor known to combine with PDL and CUDA graphs). The K steps are not free: they are the unfused kernels' (bit-equal
    sums)."""

    gate_rows: int = 4
    down_rows: int = 2
    num_warps: int = 4
    num_stages: int = 1
    programs_per_sm: int = 1
    cooperative: bool = False


def mlp_persistent_reference(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate_up_weight: torch.Tensor,
                             gate_up_bias: torch.Tensor | None, down_weight: torch.Tensor,
                             down_bias: torch.Tensor | None, residual: torch.Tensor) -> torch.Tensor:
    """The unfused references: rms_norm_linear, split into gate / up, silu_and_mul, linear_add."""
    gate_up = rms_norm_linear_reference(x, norm_weight, eps, gate_up_weight, gate_up_bias)
    gate, up = gate_up.split(gate_up_weight.shape[0] // 2, -1)
    return linear_add_reference(silu_and_mul_reference(gate, up), down_weight, down_bias, residual)


if HAS_TRITON:
    from mini_infer.ops._moe_gemv import _dot_rows
    from mini_infer.ops.linear import add_bias, gemv_step
    from mini_infer.ops.linear_add import store_linear_plus_residual
    from mini_infer.ops.rms_norm import norm_input, rms_inverse
    from mini_infer.ops.silu_and_mul import silu_mul

    @triton.jit
    def _tile_rows(w_ptr, tile, n_rows, stride_wn, BLOCK_N: tl.constexpr):
        """Tile `tile`'s BLOCK_N weight rows: (row indices, which exist, their pointers [BLOCK_N, 1])."""
        rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        return rows, rows < n_rows, w_ptr + rows[:, None].to(tl.int64) * stride_wn

    @triton.jit
    def _row_rms_inverse(x_ptr, n_hidden, eps, BLOCK_K: tl.constexpr):
        """1 / rms of the row x [n_hidden], its squares summed over the same BLOCK_K chunks as rms_norm_linear's
        kernel sums them (the same fp32 value)."""
        sq = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, n_hidden, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            x = norm_input(x_ptr + cols, x_ptr + cols, x_ptr + cols, cols < n_hidden, False)
            sq += x * x
        return rms_inverse(tl.sum(sq, axis=0), n_hidden, eps)

    @triton.jit
    def _gate_up_silu_tiles(
        x_ptr, nw_ptr, w_ptr, b_ptr, act_ptr, n_hidden, n_inter, stride_wn, eps,
        HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """Phase A: for each of this program's tiles, gate rows j.. and up rows n_inter + j.. of the normalized row
        (rms_norm_linear's prologue: `inv_rms * (W @ (x * nw)) + b`), each rounded to the activation's dtype (the
        gate_up output's), then act[j..] = silu(g) * u rounded as silu_and_mul stores it."""
        inv_rms = _row_rms_inverse(x_ptr, n_hidden, eps, BLOCK_K)
        for tile in range(tl.program_id(0), tl.cdiv(n_inter, BLOCK_N), tl.num_programs(0)):
            rows, row_ok, g_rows = _tile_rows(w_ptr, tile, n_inter, stride_wn, BLOCK_N)
            u_rows = w_ptr + (n_inter + rows)[:, None].to(tl.int64) * stride_wn
            acc_g = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
            acc_u = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
            for k0 in range(0, n_hidden, BLOCK_K):
                cols = k0 + tl.arange(0, BLOCK_K)
                col_ok = cols < n_hidden
                x = norm_input(x_ptr + cols, x_ptr + cols, x_ptr + cols, col_ok, False)
                xn = x * tl.load(nw_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
                acc_g = gemv_step(acc_g, g_rows, row_ok, cols, col_ok, xn)
                acc_u = gemv_step(acc_u, u_rows, row_ok, cols, col_ok, xn)
            g = add_bias(tl.sum(acc_g, axis=1) * inv_rms, b_ptr, rows, row_ok, HAS_BIAS)
            u = add_bias(tl.sum(acc_u, axis=1) * inv_rms, b_ptr + n_inter, rows, row_ok, HAS_BIAS)
            g = g.to(act_ptr.dtype.element_ty).to(tl.float32)
            u = u.to(act_ptr.dtype.element_ty).to(tl.float32)
            tl.store(act_ptr + rows, silu_mul(g, u).to(act_ptr.dtype.element_ty), mask=row_ok)

    @triton.jit
    def _grid_barrier(words_ptr, MAX_SPINS: tl.constexpr):
        """Wait until every program of the grid has arrived; what each stored before is then visible to all.
        words: [arrivals, generation, timeouts] (int32). Sense-reversing: the last arrival resets the counter and
        bumps the generation (release); the others poll the generation they saw before arriving."""
        tl.debug_barrier()  # all this program's threads' stores precede its arrival (bar.sync, then release)
        gen = tl.load(words_ptr + 1, volatile=True)  # read before arriving: it cannot move until we have
        if tl.atomic_add(words_ptr, 1, sem="acq_rel") == tl.num_programs(0) - 1:
            tl.atomic_xchg(words_ptr, 0, sem="relaxed")
            tl.atomic_add(words_ptr + 1, 1, sem="release")
        else:
            spins = 0
            while (tl.load(words_ptr + 1, volatile=True) == gen) & (spins < MAX_SPINS):
                spins += 1
            if spins == MAX_SPINS:
                tl.atomic_add(words_ptr + 2, 1, sem="relaxed")
            tl.atomic_add(words_ptr + 1, 0, sem="acquire")  # synchronizes with the last arrival's release
        tl.debug_barrier()  # the acquire (one thread's) before any thread's loads

    @triton.jit
    def _down_add_tiles(
        act_ptr, w_ptr, b_ptr, r_ptr, s_ptr, n_out, n_inter, stride_wn,
        HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """Phase B: for each of this program's tiles, s[rows] = act . W_d[row] (+ bias) + residual[rows], with
        the dense GEMV's K loop (`_dot_rows`, as linear_add's `gemv_accumulate`) and linear_add's epilogue."""
        for tile in range(tl.program_id(0), tl.cdiv(n_out, BLOCK_N), tl.num_programs(0)):
            rows, row_ok, w_rows = _tile_rows(w_ptr, tile, n_out, stride_wn, BLOCK_N)
            y = add_bias(_dot_rows(w_rows, row_ok, act_ptr, n_inter, BLOCK_N, BLOCK_K), b_ptr, rows, row_ok, HAS_BIAS)
            store_linear_plus_residual(y, act_ptr, r_ptr, s_ptr, rows, row_ok)

    @triton.jit
    def _mlp_persistent_kernel(
        x_ptr, nw_ptr, wgu_ptr, bgu_ptr, wd_ptr, bd_ptr, r_ptr, act_ptr, s_ptr, words_ptr, n_hidden, n_inter, n_out,
        stride_gu, stride_d, eps,
        HAS_GU_BIAS: tl.constexpr, HAS_D_BIAS: tl.constexpr, BLOCK_N_A: tl.constexpr, BLOCK_K_A: tl.constexpr,
        BLOCK_N_B: tl.constexpr, BLOCK_K_B: tl.constexpr, PHASES: tl.constexpr, MAX_SPINS: tl.constexpr,
        USE_GDC: tl.constexpr,
    ):  # fmt: skip
        """PHASES: 1 = phase A only, 2 = phase B only (the interpreter's two launches), 3 = A, the grid barrier,
        B (one launch on a GPU)."""
        await_producers(USE_GDC)
        if PHASES != 2:
            _gate_up_silu_tiles(x_ptr, nw_ptr, wgu_ptr, bgu_ptr, act_ptr, n_hidden, n_inter, stride_gu, eps,
                                HAS_GU_BIAS, BLOCK_N_A, BLOCK_K_A)
        if PHASES == 3:
            _grid_barrier(words_ptr, MAX_SPINS)
        if PHASES != 1:
            _down_add_tiles(act_ptr, wd_ptr, bd_ptr, r_ptr, s_ptr, n_out, n_inter, stride_d, HAS_D_BIAS, BLOCK_N_B,
                            BLOCK_K_B)


def _resolved(device: torch.device | str) -> torch.device:
    """`device` with its index: "cuda" alone means the current CUDA device (one barrier buffer per GPU, whichever
    way the caller names it)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


@functools.cache
def _words_on(device: torch.device) -> torch.Tensor:
    return torch.zeros(3, dtype=torch.int32, device=device)


def _barrier_words(device: torch.device | str) -> torch.Tensor:
    """The grid barrier's int32 words [arrivals, generation, timeouts] on `device`, zeroed once and kept for the
    process (shared by every launch there: launches on one stream run one after another, and each leaves the
    arrival counter at 0)."""
    return _words_on(_resolved(device))


def barrier_timeouts(device: torch.device | str) -> int:
    """How many program waits at the grid barrier on `device` gave up (MAX_SPINS polls) so far: anything but 0 means
    the grid was not all resident at once and those results are wrong. Syncs the device."""
    return int(_barrier_words(device)[2].item())


def _out_dtypes(x: torch.Tensor, norm_weight: torch.Tensor, residual: torch.Tensor) -> tuple[torch.dtype, torch.dtype]:
    """(the gate_up output's and activation's dtype, the sum's): as rms_norm_linear, silu_and_mul, linear_add
    promote."""
    act = torch.promote_types(norm_weight.dtype, x.dtype)
    return act, torch.promote_types(act, residual.dtype)


def mlp_takes_persistent(x: torch.Tensor, norm_weight: torch.Tensor, gate_up_weight: torch.Tensor,
                         down_weight: torch.Tensor, residual: torch.Tensor) -> bool:
    """Whether the persistent kernel serves these shapes and dtypes: one row whose gate_up GEMV and down GEMV
    (I = the down weight's K) the GEMV kernel takes, gate_up = 2 I rows, a residual of the output's shape. Else
    the unfused kernels. A choice by shapes and dtypes only (CUDA-graph safe)."""
    act, _ = _out_dtypes(x, norm_weight, residual)
    i, y_shape = down_weight.shape[1], (*x.shape[:-1], down_weight.shape[0])
    return (norm_weight.shape == x.shape[-1:] and gate_up_weight.shape[0] == 2 * i
            and takes_gemv(x.numel(), act, gate_up_weight) and takes_gemv(i, act, down_weight)
            and tuple(residual.shape) == y_shape)


def launch_mlp_persistent(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate_up_weight: torch.Tensor,
                          gate_up_bias: torch.Tensor | None, down_weight: torch.Tensor, down_bias: torch.Tensor | None,
                          residual: torch.Tensor, tile: MlpTile | None = None,
                          num_programs: int | None = None) -> torch.Tensor:
    """The persistent kernel on one row, without `mlp_takes_persistent`'s check (the caller's business: the
    benchmark also runs it on down rows longer than the GEMV takes). `num_programs` caps the grid (None: SMs x
    tile.programs_per_sm on CUDA, INTERPRETER_PROGRAMS under the interpreter)."""
    tile = tile or MlpTile()
    h, i, n = x.numel(), down_weight.shape[1], down_weight.shape[0]
    act_dtype, sum_dtype = _out_dtypes(x, norm_weight, residual)
    act = torch.empty(i, dtype=act_dtype, device=x.device)
    s = torch.empty((*x.shape[:-1], n), dtype=sum_dtype, device=x.device)
    wgu = gate_up_weight if gate_up_weight.stride(1) == 1 else gate_up_weight.contiguous()
    wd = down_weight if down_weight.stride(1) == 1 else down_weight.contiguous()
    bk_a, bk_b = GEMV_CONFIG_SHORT_K[1], gemv_config(i, n)[1]  # the unfused kernels' K steps (module docstring)
    needed = max(triton.cdiv(i, tile.gate_rows), triton.cdiv(n, tile.down_rows))
    if num_programs is None:
        num_programs = (num_sms(x.device.index if x.device.index is not None else torch.cuda.current_device())
                        * tile.programs_per_sm if x.is_cuda else INTERPRETER_PROGRAMS)
    args = (unit_stride_row(x), norm_weight.contiguous(), wgu, gate_up_bias if gate_up_bias is not None else wgu,
            wd, down_bias if down_bias is not None else wd, unit_stride_row(residual), act, s.view(n),
            _barrier_words(x.device), h, i, n, wgu.stride(0), wd.stride(0), float(eps))
    constexprs = dict(HAS_GU_BIAS=gate_up_bias is not None, HAS_D_BIAS=down_bias is not None,
                      BLOCK_N_A=tile.gate_rows, BLOCK_K_A=bk_a, BLOCK_N_B=tile.down_rows, BLOCK_K_B=bk_b,
                      MAX_SPINS=MAX_SPINS, num_warps=tile.num_warps, num_stages=tile.num_stages)
    grid = (min(needed, num_programs),)
    if x.is_cuda:
        coop = {"launch_cooperative_grid": True} if tile.cooperative else {}
        _mlp_persistent_kernel[grid](*args, **constexprs, PHASES=3, **pdl_args(x), **coop)
    else:  # the interpreter runs programs one after another: a barrier would never open; two launches instead
        for phases in (1, 2):
            _mlp_persistent_kernel[grid](*args, **constexprs, PHASES=phases, USE_GDC=False)
    return s


def mlp_persistent_triton(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate_up_weight: torch.Tensor,
                          gate_up_bias: torch.Tensor | None, down_weight: torch.Tensor, down_bias: torch.Tensor | None,
                          residual: torch.Tensor, tile: MlpTile | None = None) -> torch.Tensor:
    """The CUDA path: one persistent launch for a row `mlp_takes_persistent` takes, else the three unfused kernels
    (rms_norm_linear, silu_and_mul, linear_add: theirs or their fallbacks)."""
    if mlp_takes_persistent(x, norm_weight, gate_up_weight, down_weight, residual):
        return launch_mlp_persistent(x, norm_weight, eps, gate_up_weight, gate_up_bias, down_weight, down_bias,
                                     residual, tile)
    gate_up = rms_norm_linear_triton(x, norm_weight, eps, gate_up_weight, gate_up_bias)
    gate, up = gate_up.split(gate_up_weight.shape[0] // 2, -1)
    return linear_add_triton(silu_and_mul_triton(gate, up), down_weight, down_bias, residual)


@torch.library.custom_op("mini_infer::mlp_persistent", mutates_args=())
def mlp_persistent(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, gate_up_weight: torch.Tensor,
                   gate_up_bias: torch.Tensor | None, down_weight: torch.Tensor, down_bias: torch.Tensor | None,
                   residual: torch.Tensor) -> torch.Tensor:
    """`linear_add(silu_and_mul(*split(rms_norm_linear(x, ...), 2)), down_weight, down_bias, residual)`: one
    persistent launch for one row on CUDA."""
    if use_triton(x):
        return mlp_persistent_triton(x, norm_weight, eps, gate_up_weight, gate_up_bias, down_weight, down_bias,
                                     residual)
    return mlp_persistent_reference(x, norm_weight, eps, gate_up_weight, gate_up_bias, down_weight, down_bias,
                                    residual)


@mlp_persistent.register_fake
def _(x, norm_weight, eps, gate_up_weight, gate_up_bias, down_weight, down_bias, residual):
    torch._check(gate_up_weight.shape[0] == 2 * down_weight.shape[1],
                 lambda: "mlp_persistent: gate_up_weight needs twice the down weight's K rows")
    act, _ = _out_dtypes(x, norm_weight, residual)
    return x.new_empty((*x.shape[:-1], down_weight.shape[0]), dtype=act) + residual  # the add's shape and dtype
