"""`mini_infer::rms_norm_linear_silu` and `mini_infer::linear_silu`: the gated-MLP activation `silu(gate) * up` in
the epilogue of the merged gate_up GEMV that produces gate and up.

    rms_norm_linear_silu(x, nw, eps, W, b) = silu_and_mul(g, u),  g, u = rms_norm_linear(x, nw, eps, W, b).split(I, -1)
    linear_silu(x, W, b)                   = silu_and_mul(g, u),  g, u = linear(x, W, b).split(I, -1)

W is the merged [2I, K] gate_up weight, gate rows first (b: the merged [2I] bias, or None); the result is [.., I].
Inserted by the FuseGateUpSilu pass where a `silu_and_mul` reads the two halves of one gate_up output and nothing
else does (rms_norm_linear: a dense decoder's gate_up after fuse_residual_gemvs; linear: a tensor-parallel
gate_up, or a DeepSeek shared expert's). Functional: never writes into its inputs.

Why: at batch-1 decode silu_and_mul is a one-row elementwise launch of its own (chained MLPs in one CUDA graph on an
H200: 0.70 us a layer on qwen3-0.6b, 1.2 us on qwen2.5-7b / llama-3.1-8b). Unlike silu_mul_linear.py (the activation
in the DOWN GEMV's prologue, where every program recomputes the whole activation row), here each program already
holds what its outputs need: on CUDA, for one row that the GEMV takes (linear.py's `takes_gemv`; with the norm, the
condition rms_norm_linear.py's one-pass kernel has), ONE kernel on linear.py's GEMV tiling gives a program gate rows
n..n+BN AND the matching up rows I+n..I+n+BN, two accumulators fed by the same K chunk of the input (with the norm,
rms_norm_linear.py's one-pass prologue `norm_gemv_input`: `x * nw`, the 1 / rms applied at the end), and stores
silu(g) * u for its BN outputs only: the [2I] gate_up row is never written. Measured on an H200 (2026-11-24,
bench/kernel_gate_up_silu.py, a model's MLPs chained in one CUDA graph, us per layer): qwen3-0.6b (I = 3072) 9.32
fused at (4, 512, 4, 1) vs 9.85 unfused; qwen2.5-7b (I = 18944) 106.16 at its best tile vs 104.41 unfused. So the
one kernel serves gate_up weights of up to GATE_UP_SILU_MAX_I outputs per half; wider ones run the unfused kernels.
Numerics are the unfused pair's: g and u are rounded to the output dtype as the producer stores its row
(`inv_rms * dot + bias`, or `dot + bias`), then silu_and_mul's math (`silu_mul`, fp32) and rounding; the default tile keeps the producer's BLOCK_K, so under the
Triton interpreter the fused op equals the producer then silu_and_mul bit for bit (tested). On a GPU the dot
products' summation order follows the tile's register layout, as between two GEMV tiles. Anything else (several
rows: prefill, batches; rows the GEMV does not take; halves wider than GATE_UP_SILU_MAX_I; mixed dtypes) runs
the unfused kernels (the producer, then silu_and_mul's); the choice depends only on shapes and dtypes: CUDA-graph
safe, no host syncs. On CPU the reference is the unfused references. Imports nothing from mini_infer outside `mini_infer.ops`.
"""

from __future__ import annotations

import torch

from mini_infer.ops._triton_support import HAS_TRITON, await_producers, tl, triton, use_triton
from mini_infer.ops.linear import (
    gemv_config,
    launch_gemv,
    linear_reference,
    linear_triton,
    takes_gemv,
    unit_stride_row,
)
from mini_infer.ops.rms_norm_linear import norm_gemv_config, rms_norm_linear_reference, rms_norm_linear_triton
from mini_infer.ops.silu_and_mul import silu_and_mul_reference, silu_and_mul_triton

__all__ = ["GATE_UP_SILU_MAX_I", "gate_up_silu_config", "linear_silu", "linear_silu_reference", "linear_silu_triton", "rms_norm_linear_silu",
           "rms_norm_linear_silu_reference", "rms_norm_linear_silu_triton"]


def _half(width: int) -> int:
    """I, the width of each half of a merged gate_up output `width` wide (ValueError when it is odd)."""
    if width % 2:
        raise ValueError(f"a merged gate_up output has an even width (gate rows, then as many up rows), got {width}")
    return width // 2


def _silu_of_halves(gate_up: torch.Tensor, silu_and_mul_fn) -> torch.Tensor:
    """`silu_and_mul_fn(gate, up)` of the two halves (gate first) of a merged gate_up output's last dim."""
    gate, up = gate_up.split(_half(gate_up.shape[-1]), -1)
    return silu_and_mul_fn(gate, up)


def rms_norm_linear_silu_reference(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                                   bias: torch.Tensor | None) -> torch.Tensor:
    """`silu_and_mul` of the halves of `rms_norm_linear(x, norm_weight, eps, weight, bias)` in plain torch."""
    return _silu_of_halves(rms_norm_linear_reference(x, norm_weight, eps, weight, bias), silu_and_mul_reference)


def linear_silu_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`silu_and_mul` of the halves of `linear(x, weight, bias)` in plain torch."""
    return _silu_of_halves(linear_reference(x, weight, bias), silu_and_mul_reference)


if HAS_TRITON:
    from mini_infer.ops.linear import add_bias, gemv_rows, gemv_step
    from mini_infer.ops.rms_norm import rms_inverse
    from mini_infer.ops.rms_norm_linear import norm_gemv_input
    from mini_infer.ops.silu_and_mul import silu_mul

    @triton.jit
    def _stored_half(acc, scale, b_ptr, rows, row_ok, out_ptr, HAS_BIAS: tl.constexpr):
        """One half's outputs at `rows` as the unfused producer stores them (`scale * dot + bias` rounded to the
        output dtype), read back in fp32 as silu_and_mul reads them."""
        y = add_bias(tl.sum(acc, axis=1) * scale, b_ptr, rows, row_ok, HAS_BIAS)
        return y.to(out_ptr.dtype.element_ty).to(tl.float32)

    @triton.jit
    def _gate_up_silu_kernel(
        x_ptr, nw_ptr, w_ptr, b_ptr, out_ptr, HALF, K, stride_wn, eps,
        HAS_NORM: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        USE_GDC: tl.constexpr,
    ):  # fmt: skip
        await_producers(USE_GDC)
        # this program's BLOCK_N gate rows and the BLOCK_N up rows HALF further down, one shared input chunk per step
        rows, row_ok, w_gate, acc_g = gemv_rows(w_ptr, HALF, stride_wn, BLOCK_N, BLOCK_K)
        w_up = w_ptr + (rows[:, None] + HALF).to(tl.int64) * stride_wn
        acc_u = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        sq = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            col_ok = cols < K
            if HAS_NORM:  # rms_norm_linear's one-pass prologue (no residual: the sum is not asked for)
                x_sq, xk = norm_gemv_input(x_ptr, x_ptr, x_ptr, nw_ptr, cols, col_ok, False)
                sq += x_sq
            else:
                xk = tl.load(x_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
            acc_g = gemv_step(acc_g, w_gate, row_ok, cols, col_ok, xk)
            acc_u = gemv_step(acc_u, w_up, row_ok, cols, col_ok, xk)
        scale = rms_inverse(tl.sum(sq, axis=0), K, eps) if HAS_NORM else 1.0
        g = _stored_half(acc_g, scale, b_ptr, rows, row_ok, out_ptr, HAS_BIAS)
        u = _stored_half(acc_u, scale, b_ptr, rows + HALF, row_ok, out_ptr, HAS_BIAS)
        tl.store(out_ptr + rows, silu_mul(g, u).to(out_ptr.dtype.element_ty), mask=row_ok)


# Widest half (I) the one kernel takes: it won at qwen3-0.6b's 3072 and lost at qwen2.5-7b's 18944 (module
# docstring); between them nothing is measured, so the limit sits near the measured win.
GATE_UP_SILU_MAX_I = 4096


def gate_up_silu_config(k: int, n: int, has_norm: bool) -> tuple[int, int, int, int]:
    """The one-row kernel's default tile (BLOCK_N rows per half, BLOCK_K, num_warps, num_stages) over a [n, k]
    gate_up weight: the unfused producer's tile (rms_norm_linear's `norm_gemv_config`; linear's `gemv_config`),
    BLOCK_N rows of each half, so a program reads twice the producer's rows per K step and there are half as many
    programs. BLOCK_K stays the producer's, so each dot product adds the same K chunks (bit-equal under the
    interpreter). The H200 sweep's best at qwen3-0.6b ((4, 512, 4, 1): 9.32 us a layer; the producer's BLOCK_N
    halved, (2, 512, 4, 1), took 10.94)."""
    return norm_gemv_config() if has_norm else gemv_config(k, n)


def _fuses(x: torch.Tensor, norm_weight: torch.Tensor | None, weight: torch.Tensor) -> bool:
    """Whether the one-row kernel serves these shapes and dtypes (one row the GEMV takes, with the norm
    rms_norm_linear's one-pass condition; halves of at most GATE_UP_SILU_MAX_I rows), else the unfused kernels."""
    if weight.shape[0] > 2 * GATE_UP_SILU_MAX_I:
        return False
    if norm_weight is None:
        return takes_gemv(x.numel(), x.dtype, weight)
    return norm_weight.shape == x.shape[-1:] and takes_gemv(
        x.numel(), torch.promote_types(norm_weight.dtype, x.dtype), weight)


def _launch_gate_up_silu(x, norm_weight, eps, weight, bias, config) -> torch.Tensor:
    n, k = weight.shape
    half = _half(n)
    out_dtype = x.dtype if norm_weight is None else torch.promote_types(norm_weight.dtype, x.dtype)
    out = torch.empty((*x.shape[:-1], half), dtype=out_dtype, device=x.device)
    xr = unit_stride_row(x)
    w = weight if weight.stride(1) == 1 else weight.contiguous()
    launch_gemv(
        _gate_up_silu_kernel, w[:half],  # the grid: one program per BLOCK_N gate rows (each takes its up rows too)
        xr, norm_weight.contiguous() if norm_weight is not None else xr, w, bias if bias is not None else w,
        out.view(half), half, k, w.stride(0), float(eps),
        HAS_NORM=norm_weight is not None, HAS_BIAS=bias is not None,
        config=config or gate_up_silu_config(k, n, norm_weight is not None),
    )  # fmt: skip
    return out


def rms_norm_linear_silu_triton(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                                bias: torch.Tensor | None,
                                config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """The CUDA path: one kernel (tile `config`; None: `gate_up_silu_config`) for a single row the one-pass norm
    GEMV takes, else `rms_norm_linear` then `silu_and_mul` (their kernels)."""
    if _fuses(x, norm_weight, weight):
        return _launch_gate_up_silu(x, norm_weight, eps, weight, bias, config)
    return _silu_of_halves(rms_norm_linear_triton(x, norm_weight, eps, weight, bias), silu_and_mul_triton)


def linear_silu_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """The CUDA path: one kernel (tile `config`; None: `gate_up_silu_config`) for a single row the GEMV takes, else
    `linear` then `silu_and_mul` (their kernels)."""
    if _fuses(x, None, weight):
        return _launch_gate_up_silu(x, None, 0.0, weight, bias, config)
    return _silu_of_halves(linear_triton(x, weight, bias), silu_and_mul_triton)


def _fake_out(x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    torch._check(weight.shape[0] % 2 == 0, lambda: f"gate_up weight has an odd row count {weight.shape[0]}")
    return x.new_empty((*x.shape[:-1], weight.shape[0] // 2), dtype=dtype)


@torch.library.custom_op("mini_infer::rms_norm_linear_silu", mutates_args=())
def rms_norm_linear_silu(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                         bias: torch.Tensor | None) -> torch.Tensor:
    """`silu(g) * u` of `g, u = rms_norm_linear(x, norm_weight, eps, weight, bias)`'s halves: one Triton kernel for
    a single row on CUDA."""
    if use_triton(x):
        return rms_norm_linear_silu_triton(x, norm_weight, eps, weight, bias)
    return rms_norm_linear_silu_reference(x, norm_weight, eps, weight, bias)


@rms_norm_linear_silu.register_fake
def _(x, norm_weight, eps, weight, bias):
    return _fake_out(x, weight, torch.promote_types(norm_weight.dtype, x.dtype))


@torch.library.custom_op("mini_infer::linear_silu", mutates_args=())
def linear_silu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`silu(g) * u` of `g, u = linear(x, weight, bias)`'s halves: one Triton kernel for a single row on CUDA."""
    if use_triton(x):
        return linear_silu_triton(x, weight, bias)
    return linear_silu_reference(x, weight, bias)


@linear_silu.register_fake
def _(x, weight, bias):
    return _fake_out(x, weight, x.dtype)
