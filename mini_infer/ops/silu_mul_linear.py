"""`mini_infer::silu_mul_linear`: the gated-MLP activation `silu(gate) * up` folded into the prologue of the down
projection's GEMV (and, with a residual, the add in its epilogue).

    silu_mul_linear(g, u, W, b, None)     = linear(silu_and_mul(g, u), W, b)
    silu_mul_linear(g, u, W, b, residual) = linear_add(silu_and_mul(g, u), W, b, residual)

with the unfused pair's roundings on the one-row kernel: the activation is computed per K chunk exactly as
silu_and_mul's kernel computes it (`silu_mul_load`: fp32 math) and rounded to the activation's dtype before the dot
products, as the unfused activation row is stored then read back; the epilogue is linear_add's
(`store_linear_plus_residual`). So the result equals the pair bit for bit under the Triton interpreter (tested); on
a GPU the dot products' summation order follows the tile's register layout, so expect the pair's values to fp32
rounding of the sums (then the output dtype's rounding), as between two GEMV tiles. Inserted by
the FuseSiluGemv pass where a `silu_and_mul` output feeds only a down projection (`linear_add` as its x, or a
`mini_infer.linear`). gate and up may be views of the merged gate_up output (row stride 2 * width). Functional:
never writes into its inputs.

Why: at batch-1 decode silu_and_mul is a one-row elementwise kernel whose cost is almost all launch (1.3-2.3 us on
an H200), and the down GEMV reads its whole input row in every program anyway; reading gate and up instead and
multiplying them in registers removes that launch and the activation row's round trip through memory. On CUDA,
for one row that the GEMV takes (linear.py's `takes_gemv`) with gate, up and the weight of one dtype, one kernel
on linear.py's GEMV tiling (`gemv_rows` / `gemv_step`, launched by `launch_gemv`; tile `silu_mul_gemv_config`
or the caller's `config`). Anything else (several rows: prefill, batches; rows the GEMV does not take; mixed
dtypes; a residual of another shape) runs silu_and_mul's kernel then `linear` / `linear_add`'s. The choice
depends only on shapes and dtypes: CUDA-graph safe, no host syncs. On CPU the reference is the unfused references.
Imports nothing from mini_infer outside `mini_infer.ops`.
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
from mini_infer.ops.linear_add import linear_add_reference, linear_add_triton
from mini_infer.ops.silu_and_mul import silu_and_mul_reference, silu_and_mul_triton

__all__ = ["silu_mul_gemv_config", "silu_mul_linear", "silu_mul_linear_reference", "silu_mul_linear_triton"]


def silu_mul_linear_reference(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                              residual: torch.Tensor | None) -> torch.Tensor:
    """`linear(silu(gate) * up, weight, bias)` (+ residual) in plain torch."""
    act = silu_and_mul_reference(gate, up)
    if residual is None:
        return linear_reference(act, weight, bias)
    return linear_add_reference(act, weight, bias, residual)


if HAS_TRITON:
    from mini_infer.ops.linear import add_bias, gemv_rows, gemv_step, gemv_store
    from mini_infer.ops.linear_add import store_linear_plus_residual
    from mini_infer.ops.silu_and_mul import silu_mul_load

    @triton.jit
    def _silu_mul_gemv_kernel(
        g_ptr, u_ptr, w_ptr, b_ptr, r_ptr, y_ptr, N, K, stride_wn,
        HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        USE_GDC: tl.constexpr,
    ):  # fmt: skip
        await_producers(USE_GDC)
        rows, row_ok, w_rows, acc = gemv_rows(w_ptr, N, stride_wn, BLOCK_N, BLOCK_K)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            col_ok = cols < K
            # the activation chunk as silu_and_mul stores it (gate's dtype) and the GEMV reads it back (fp32)
            x = silu_mul_load(g_ptr + cols, u_ptr + cols, col_ok).to(g_ptr.dtype.element_ty).to(tl.float32)
            acc = gemv_step(acc, w_rows, row_ok, cols, col_ok, x)
        if HAS_RESIDUAL:
            y = add_bias(tl.sum(acc, axis=1), b_ptr, rows, row_ok, HAS_BIAS)
            store_linear_plus_residual(y, g_ptr, r_ptr, y_ptr, rows, row_ok)
        else:
            gemv_store(acc, b_ptr, y_ptr, rows, row_ok, HAS_BIAS)


def silu_mul_gemv_config(k: int) -> tuple[int, int, int, int]:
    """The one-row kernel's default tile (BLOCK_N, BLOCK_K, num_warps, num_stages) for rows of K elements: the
    plain GEMV's (`gemv_config`) with twice the weight rows per program. Every program reads the whole activation
    row, here gate AND up (twice the plain GEMV's input bytes, from L2); twice the rows per program keeps those
    reads per weight byte, and the sigmoids recomputed per program, where the plain GEMV has them. BLOCK_K stays
    the plain GEMV's, so each dot product adds the same K chunks as the unfused `linear`'s (bit-equal under the
    interpreter). Not measured yet: sweep with bench/kernel_silu_gemv.py."""
    bn, bk, warps, stages = gemv_config(k)
    return 2 * bn, bk, warps, stages


def _out_dtype(gate: torch.Tensor, up: torch.Tensor, residual: torch.Tensor | None) -> torch.dtype:
    """The unfused pair's output dtype: the activation's (torch promotion of gate and up), promoted with the
    residual's by the add."""
    act = torch.promote_types(gate.dtype, up.dtype)
    return act if residual is None else torch.promote_types(act, residual.dtype)


def _fuses(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> bool:
    """Whether the one-row kernel serves these shapes and dtypes, else the unfused kernels."""
    y_shape = (*gate.shape[:-1], weight.shape[0])
    return (gate.shape == up.shape and gate.dtype == up.dtype and takes_gemv(gate.numel(), gate.dtype, weight)
            and (residual is None or tuple(residual.shape) == y_shape))


def silu_mul_linear_triton(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           residual: torch.Tensor | None,
                           config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """The CUDA path: one GEMV kernel with the activation in its prologue (and the add in its epilogue) for a single
    row the GEMV takes, tile `config` (None: `silu_mul_gemv_config`); else silu_and_mul's kernel then `linear` /
    `linear_add`'s."""
    if not _fuses(gate, up, weight, residual):
        act = silu_and_mul_triton(gate, up)
        return linear_triton(act, weight, bias) if residual is None else linear_add_triton(act, weight, bias, residual)
    n, k = weight.shape
    w = weight if weight.stride(1) == 1 else weight.contiguous()
    y = torch.empty((*gate.shape[:-1], n), dtype=_out_dtype(gate, up, residual), device=gate.device)
    launch_gemv(
        _silu_mul_gemv_kernel, w, unit_stride_row(gate), unit_stride_row(up), w, bias if bias is not None else w,
        unit_stride_row(residual) if residual is not None else w, y.view(n), n, k, w.stride(0),
        HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, config=config or silu_mul_gemv_config(k),
    )  # fmt: skip
    return y


@torch.library.custom_op("mini_infer::silu_mul_linear", mutates_args=())
def silu_mul_linear(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    residual: torch.Tensor | None) -> torch.Tensor:
    """`linear(silu(gate) * up, weight, bias)` (+ residual): the activation in the GEMV's prologue for one row on
    CUDA."""
    if use_triton(gate):
        return silu_mul_linear_triton(gate, up, weight, bias, residual)
    return silu_mul_linear_reference(gate, up, weight, bias, residual)


@silu_mul_linear.register_fake
def _(gate, up, weight, bias, residual):
    y = gate.new_empty((*gate.shape[:-1], weight.shape[0]), dtype=torch.promote_types(gate.dtype, up.dtype))
    return y if residual is None else y + residual  # the add's shape and dtype
