"""Dynamic per-token activation quantization (int8 / float8_e4m3fn) and its producer-fused variants.

Ops (`torch.ops.mini_infer.*`), each returning the quantized activation and one fp32 scale per row:
  quantize_per_token(x, dtype)                          -> (x_q, scale)
  rms_norm_quant(x, weight, eps, dtype)                 -> (x_q, scale)           = quantize(rms_norm(x))
  fused_add_rms_norm_quant(x, residual, weight, eps, dtype) -> (x_q, scale, s)    s = x + residual
  silu_and_mul_quant(gate, up, dtype)                   -> (x_q, scale)           = quantize(silu_and_mul(g, u))
The fused variants write the quantized activation once instead of a bf16 activation that a second kernel
reads back; they are the existing op (rms_norm.py, fused_add_rms_norm.py, silu_and_mul.py) followed by
`quantize_per_token`, and their Triton kernels run those ops' arithmetic (the norms call rms_norm.py's row body
`rms_norm_tile`, with the same tiles), so the fused kernel's bits equal the two kernels run one after the other
(measured on an H100 for bf16 activations; with fp32 activations the compiler may order the norm's fp32
arithmetic differently: a scale one ulp apart).

The scheme (symmetric, per row of the last dim; QMAX = 127 for int8, 448 for float8_e4m3fn):
    amax  = max(|x_row|) in fp32, floored at AMAX_FLOOR (2**-100: a zero row divides by nothing, gets
            x_q = 0 and a tiny scale, and dequantizes to exactly 0)
    scale = amax / QMAX,  inv = QMAX / amax          (correctly rounded fp32 divisions)
    x_q   = round(x * inv), clamped to [-QMAX, QMAX]  (the fp32 product, rounded half to EVEN: torch.round
            for int8, the nearest e4m3 value for fp8 as torch's cast does)
so x ~= x_q * scale. The reference (plain torch) and the Triton kernels agree bit for bit on x_q and scale
for the same input values: the kernels round with integer arithmetic on the product's bits, which also keeps
the compiler from fusing the multiply into an FMA (and works under the Triton interpreter, whose own
fp32 -> fp8 cast is wrong: no carry into the exponent, ties away from zero, no saturation).

`round_to_fp8_e4m3` (a @triton.jit helper) is shared with the FP8 KV-cache write in paged_attention.py.
Imports nothing from mini_infer outside `mini_infer.ops`.
"""

from __future__ import annotations

import torch

from mini_infer.ops._triton_support import (
    HAS_TRITON,
    await_producers,
    next_pow2,
    pdl_args,
    tl,
    triton,
    use_triton,
)
from mini_infer.ops.fused_add_rms_norm import fused_add_rms_norm_reference
from mini_infer.ops.rms_norm import _rows, norm_tile, rms_norm_reference
from mini_infer.ops.silu_and_mul import silu_and_mul_reference

__all__ = [
    "AMAX_FLOOR",
    "QMAX",
    "check_quant_dtype",
    "fused_add_rms_norm_quant",
    "fused_add_rms_norm_quant_reference",
    "fused_add_rms_norm_quant_triton",
    "quantize_per_token",
    "quantize_per_token_reference",
    "quantize_per_token_triton",
    "rms_norm_quant",
    "rms_norm_quant_reference",
    "rms_norm_quant_triton",
    "silu_and_mul_quant",
    "silu_and_mul_quant_reference",
    "silu_and_mul_quant_triton",
]

QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
AMAX_FLOOR = 2.0**-100  # amax is floored here: QMAX / amax stays finite, a zero row quantizes to zeros


def check_quant_dtype(dtype: torch.dtype) -> None:
    """Raise unless `dtype` is a quantized activation dtype these ops produce (int8, float8_e4m3fn)."""
    if dtype not in QMAX:
        raise ValueError(f"quantization dtype must be torch.int8 or torch.float8_e4m3fn, got {dtype}")


# --------------------------------------------------------------------------------------------------
# reference (plain torch)
# --------------------------------------------------------------------------------------------------


def quantize_per_token_reference(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row quantization of x's last dim to `dtype`: (x_q, scale [.., 1] fp32). See the module
    docstring for the exact arithmetic."""
    check_quant_dtype(dtype)
    qmax = QMAX[dtype]
    xf = x.to(torch.float32)
    if x.shape[-1] == 0:
        return torch.empty(x.shape, dtype=dtype, device=x.device), xf.new_full((*x.shape[:-1], 1), AMAX_FLOOR / qmax)
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp_min(AMAX_FLOOR)
    # tensor / tensor: torch turns `scalar / t` into reciprocal(t) * scalar, and on CUDA `t / scalar` into
    # t * (1 / scalar), neither of them the correctly rounded quotient the kernels compute
    q = torch.full_like(amax, qmax)
    scale = amax / q
    y = xf * (q / amax)
    if dtype == torch.int8:
        x_q = y.round().clamp_(-qmax, qmax).to(torch.int8)
    else:
        x_q = y.clamp_(-qmax, qmax).to(dtype)  # torch's cast rounds to nearest, ties to even
    return x_q, scale


def rms_norm_quant_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_per_token(rms_norm(x, weight, eps), dtype)` in plain torch."""
    return quantize_per_token_reference(rms_norm_reference(x, weight, eps), dtype)


def fused_add_rms_norm_quant_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`s = x + residual; (x_q, scale) = quantize_per_token(rms_norm(s)); return x_q, scale, s` in plain torch."""
    normed, s = fused_add_rms_norm_reference(x, residual, weight, eps)
    return (*quantize_per_token_reference(normed, dtype), s)


def silu_and_mul_quant_reference(
    gate: torch.Tensor, up: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_per_token(silu(gate) * up, dtype)` in plain torch."""
    return quantize_per_token_reference(silu_and_mul_reference(gate, up), dtype)


# --------------------------------------------------------------------------------------------------
# Triton
# --------------------------------------------------------------------------------------------------

if HAS_TRITON:
    from mini_infer.ops.rms_norm import rms_norm_tile

    @triton.jit
    def _round_to_pow2_grid(y, k):
        """fp32 `y` rounded to the nearest multiple of 2**k (int32 tensor `k`), ties to even, by integer
        arithmetic on y's bits. Callers guarantee y's ulp is at most 2**(k - 17) (|y| < 2**(k + 7))."""
        bits = y.to(tl.int32, bitcast=True)
        mag = bits & 0x7FFFFFFF
        e = (mag >> 23) - 127  # y's binary exponent (-127 for zero)
        m = (mag & 0x7FFFFF) | 0x800000  # 24-bit significand: |y| = m * 2**(e - 23)
        s = tl.minimum(k - e + 23, 25)  # significand bits below the grid (>= 25: |y| < half a step -> 0)
        q = m >> s
        rem = m & ((1 << s) - 1)
        half = 1 << (s - 1)
        q += ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
        r = q.to(tl.float32) * ((k + 127) << 23).to(tl.float32, bitcast=True)  # q * 2**k, exact
        # y's sign bit onto r (also on a zero: -0.0 like torch; Triton's `-r` is 0 - r, which gives +0.0)
        return (r.to(tl.int32, bitcast=True) | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)

    @triton.jit
    def round_to_fp8_e4m3(y):
        """fp32 `y` saturated to +-448 and rounded to the nearest float8_e4m3fn value (ties to even), as an
        fp32 tensor whose cast to fp8 is exact. Equals torch's `y.clamp(-448, 448).to(torch.float8_e4m3fn)`."""
        y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        e = ((y.to(tl.int32, bitcast=True) & 0x7FFFFFFF) >> 23) - 127
        # e4m3: 3 mantissa bits; below the smallest normal (2**-6) a fixed step of 2**-9
        return _round_to_pow2_grid(y, tl.maximum(e, -6) - 3)

    @triton.jit
    def _quantize_values(y, inv, IS_FP8: tl.constexpr):
        """fp32 values of `y * inv` on the target grid (int8: integers in [-127, 127]; fp8: e4m3 values)."""
        p = y * inv
        if IS_FP8:
            return round_to_fp8_e4m3(p)
        r = _round_to_pow2_grid(p, tl.zeros(p.shape, dtype=tl.int32))
        return tl.minimum(tl.maximum(r, -127.0), 127.0)

    @triton.jit
    def _scale_and_inverse(amax, QMAX: tl.constexpr):
        amax = tl.maximum(amax, 2.0**-100)  # AMAX_FLOOR
        return tl.math.div_rn(amax, QMAX), tl.math.div_rn(amax * 0 + QMAX, amax)

    @triton.jit
    def _row_values(x_rows, u_rows, cols, mask, GATED: tl.constexpr):
        """A [rows, cols] chunk as fp32: x, or silu_and_mul's output (rounded to its dtype, as that op stores it)."""
        x = tl.load(x_rows + cols, mask=mask, other=0.0).to(tl.float32)
        if GATED:
            u = tl.load(u_rows + cols, mask=mask, other=0.0).to(tl.float32)
            x = (x * tl.sigmoid(x) * u).to(x_rows.dtype.element_ty).to(tl.float32)  # as silu_and_mul.py
        return x

    @triton.jit
    def _quant_rows_kernel(
        x_ptr, u_ptr, q_ptr, scale_ptr, n_rows, n_cols, stride_x, stride_u, stride_q,
        GATED: tl.constexpr, IS_FP8: tl.constexpr, QMAX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, USE_GDC: tl.constexpr,
    ):  # fmt: skip
        """BLOCK_M rows per program, in column chunks: pass 1 finds each row's amax, pass 2 re-reads (L2),
        quantizes, stores."""
        await_producers(USE_GDC)
        rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_ok = rows < n_rows
        x_rows = x_ptr + rows[:, None] * stride_x
        u_rows = u_ptr + rows[:, None] * stride_u
        amax = tl.zeros([BLOCK_M], tl.float32)
        for c0 in range(0, n_cols, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            mask = row_ok[:, None] & (cols < n_cols)[None, :]
            v = _row_values(x_rows, u_rows, cols[None, :], mask, GATED)
            amax = tl.maximum(amax, tl.max(tl.abs(v), axis=1))
        scale, inv = _scale_and_inverse(amax, QMAX)
        tl.store(scale_ptr + rows, scale, mask=row_ok)
        for c0 in range(0, n_cols, BLOCK):
            cols = c0 + tl.arange(0, BLOCK)
            mask = row_ok[:, None] & (cols < n_cols)[None, :]
            v = _quantize_values(_row_values(x_rows, u_rows, cols[None, :], mask, GATED), inv[:, None], IS_FP8)
            tl.store(q_ptr + rows[:, None] * stride_q + cols[None, :], v.to(q_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _chunk_amax_kernel(
        x_ptr, u_ptr, part_ptr, n_cols, n_chunks, stride_x, stride_u, GATED: tl.constexpr, CHUNK: tl.constexpr, USE_GDC: tl.constexpr,
    ):  # fmt: skip
        """Split rows, pass 1: program (row, c) writes the amax of the row's chunk c."""
        await_producers(USE_GDC)
        row, c = tl.program_id(0).to(tl.int64), tl.program_id(1)
        cols = c * CHUNK + tl.arange(0, CHUNK)
        mask = cols < n_cols
        v = _row_values(x_ptr + row * stride_x, u_ptr + row * stride_u, cols, mask, GATED)
        tl.store(part_ptr + row * n_chunks + c, tl.max(tl.abs(v), axis=0))

    @triton.jit
    def _chunk_quant_kernel(
        x_ptr, u_ptr, part_ptr, q_ptr, scale_ptr, n_cols, n_chunks, stride_x, stride_u, stride_q,
        GATED: tl.constexpr, IS_FP8: tl.constexpr, QMAX: tl.constexpr, CHUNK: tl.constexpr, PARTS: tl.constexpr, USE_GDC: tl.constexpr,
    ):  # fmt: skip
        """Split rows, pass 2: program (row, c) takes the row's amax from the chunks' (max is exact: the scale
        is the one-program kernel's), quantizes chunk c; chunk 0 stores the scale."""
        await_producers(USE_GDC)
        row, c = tl.program_id(0).to(tl.int64), tl.program_id(1)
        parts = tl.arange(0, PARTS)
        amax = tl.max(tl.load(part_ptr + row * n_chunks + parts, mask=parts < n_chunks, other=0.0), axis=0)
        scale, inv = _scale_and_inverse(amax, QMAX)
        if c == 0:
            tl.store(scale_ptr + row, scale)
        cols = c * CHUNK + tl.arange(0, CHUNK)
        mask = cols < n_cols
        v = _quantize_values(_row_values(x_ptr + row * stride_x, u_ptr + row * stride_u, cols, mask, GATED), inv,
                             IS_FP8)
        tl.store(q_ptr + row * stride_q + cols, v.to(q_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rms_norm_quant_kernel(
        x_ptr, r_ptr, w_ptr, q_ptr, scale_ptr, s_ptr,
        n_rows, n_cols, stride_x, stride_r, stride_q, stride_s, eps,
        HAS_RESIDUAL: tl.constexpr, NORM_DTYPE: tl.constexpr, IS_FP8: tl.constexpr, QMAX: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_GDC: tl.constexpr,
    ):  # fmt: skip
        """rms_norm.py's row body (`rms_norm_tile`, its output rounded to NORM_DTYPE as rms_norm stores it), then
        quantized."""
        await_producers(USE_GDC)
        y, rows, cols, mask = rms_norm_tile(x_ptr, r_ptr, w_ptr, s_ptr, n_rows, n_cols, stride_x, stride_r,
                                            stride_s, eps, HAS_RESIDUAL, BLOCK_M, BLOCK_N)
        store_quantized_norm(y, rows, cols, mask, n_rows, q_ptr, scale_ptr, stride_q, NORM_DTYPE, IS_FP8, QMAX)

    @triton.jit
    def store_quantized_norm(
        y, rows, cols, mask, n_rows, q_ptr, scale_ptr, stride_q,
        NORM_DTYPE: tl.constexpr, IS_FP8: tl.constexpr, QMAX: tl.constexpr,
    ):  # fmt: skip
        """The end of a quantizing norm: rows of the norm's fp32 output y (`rms_norm_tile` / `rms_norm_rows`,
        padding columns 0) rounded to NORM_DTYPE as rms_norm stores them, quantized per row; stores x_q and the
        scales. Shared with linear_add_rms_norm.py's GEMV + norm kernel."""
        y = y.to(NORM_DTYPE).to(tl.float32)  # what rms_norm stores
        row_ok = rows < n_rows
        scale, inv = _scale_and_inverse(tl.max(tl.abs(y), axis=1), QMAX)  # padding columns hold 0
        tl.store(scale_ptr + rows, scale, mask=row_ok)
        v = _quantize_values(y, inv[:, None], IS_FP8)
        tl.store(q_ptr + rows[:, None] * stride_q + cols[None, :], v.to(q_ptr.dtype.element_ty), mask=mask)


_TL_DTYPE = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _tl_dtype(dtype: torch.dtype):
    if dtype not in _TL_DTYPE:
        raise ValueError(f"quantization kernels take fp32/fp16/bf16 activations, got {dtype}")
    return tl.dtype(_TL_DTYPE[dtype])


def _outputs(shape, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty(shape, dtype=dtype, device=device),
            torch.empty((*shape[:-1], 1), dtype=torch.float32, device=device))


# A few long rows (batch-1 decode's down_proj input: 18,944 columns in qwen2.5-7b) are split over programs of
# SPLIT_CHUNK columns in two launches (chunk amaxes, then the quantization), instead of one program walking the
# whole row twice; the bits are the one-program kernel's (checked on an H200 too). There (2026-11-23,
# bench/kernel_quant.py --ms 1, "int8+q" minus "int8") down_proj's input quantization took 3.8 us against 8.4.
SPLIT_MAX_ROWS = 8
SPLIT_MIN_COLS = 8192
SPLIT_CHUNK = 1024


def _launch_split_rows(x2, u2, q2, scale, n_rows: int, n_cols: int, gated: bool, dtype: torch.dtype) -> None:
    n_chunks = triton.cdiv(n_cols, SPLIT_CHUNK)
    parts = torch.empty((n_rows, n_chunks), dtype=torch.float32, device=x2.device)
    grid = (n_rows, n_chunks)
    _chunk_amax_kernel[grid](x2, u2, parts, n_cols, n_chunks, x2.stride(0), u2.stride(0), GATED=gated,
                             CHUNK=SPLIT_CHUNK, num_warps=4, **pdl_args(x2))
    _chunk_quant_kernel[grid](x2, u2, parts, q2, scale, n_cols, n_chunks, x2.stride(0), u2.stride(0), q2.stride(0),
                              GATED=gated, IS_FP8=dtype == torch.float8_e4m3fn, QMAX=QMAX[dtype], CHUNK=SPLIT_CHUNK,
                              PARTS=next_pow2(n_chunks), num_warps=4, **pdl_args(x2))


def _launch_quant_rows(x: torch.Tensor, up: torch.Tensor | None, dtype: torch.dtype):
    check_quant_dtype(dtype)
    if not HAS_TRITON:
        raise RuntimeError("the quantization kernels need triton")
    _tl_dtype(x.dtype)
    x_q, scale = _outputs(x.shape, dtype, x.device)
    n_cols = x.shape[-1]
    if x.numel() == 0:
        scale.fill_(AMAX_FLOOR / QMAX[dtype])
        return x_q, scale
    x2 = _rows(x, n_cols)
    u2 = _rows(up, n_cols) if up is not None else x2
    q2 = x_q.view(-1, n_cols)
    n_rows = x2.shape[0]
    if n_rows <= SPLIT_MAX_ROWS and n_cols >= SPLIT_MIN_COLS:
        _launch_split_rows(x2, u2, q2, scale, n_rows, n_cols, up is not None, dtype)
        return x_q, scale
    block = min(4096, next_pow2(n_cols))
    block_m = max(1, min(16, 4096 // block))  # short rows: several per program
    _quant_rows_kernel[(triton.cdiv(n_rows, block_m),)](
        x2, u2, q2, scale, n_rows, n_cols, x2.stride(0), u2.stride(0), q2.stride(0),
        GATED=up is not None, IS_FP8=dtype == torch.float8_e4m3fn, QMAX=QMAX[dtype], BLOCK_M=block_m, BLOCK=block,
        num_warps=4 if block_m * block <= 1024 else 8, **pdl_args(x2),
    )  # fmt: skip
    return x_q, scale


def quantize_per_token_triton(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton per-token quantization (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1)."""
    return _launch_quant_rows(x, None, dtype)


def silu_and_mul_quant_triton(
    gate: torch.Tensor, up: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `silu(gate) * up` quantized per token, the activation never stored in 16 bits."""
    if gate.shape != up.shape:
        raise ValueError(f"silu_and_mul_quant: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    act = torch.promote_types(gate.dtype, up.dtype)  # silu_and_mul's output dtype; widening casts are exact
    return _launch_quant_rows(gate.to(act), up.to(act), dtype)


def _launch_rms_norm_quant(x, residual, weight, eps, dtype):
    check_quant_dtype(dtype)
    if not HAS_TRITON:
        raise RuntimeError("the quantization kernels need triton")
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm_quant: weight {tuple(weight.shape)} does not match last dim of x {tuple(x.shape)}")
    s_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    norm_dtype = torch.promote_types(weight.dtype, s_dtype)  # rms_norm's output dtype
    x_q, scale = _outputs(x.shape, dtype, x.device)
    s = torch.empty(x.shape, dtype=s_dtype, device=x.device) if residual is not None else None
    n_cols = x.shape[-1]
    x2 = _rows(x, n_cols)
    n_rows = x2.shape[0]
    if n_rows == 0 or n_cols == 0:
        scale.fill_(AMAX_FLOOR / QMAX[dtype])
        return x_q, scale, s
    q2, r2 = x_q.view(-1, n_cols), _rows(residual, n_cols) if residual is not None else x2
    s2 = s.view(-1, n_cols) if s is not None else q2
    # the tile of rms_norm.py's launcher: the same reduction tree, so the normalized values are the same bits
    block_m, block_n, num_warps = norm_tile(n_cols)
    _rms_norm_quant_kernel[(triton.cdiv(n_rows, block_m),)](
        x2, r2, weight.contiguous(), q2, scale, s2,
        n_rows, n_cols, x2.stride(0), r2.stride(0), q2.stride(0), s2.stride(0), float(eps),
        HAS_RESIDUAL=residual is not None, NORM_DTYPE=_tl_dtype(norm_dtype), IS_FP8=dtype == torch.float8_e4m3fn,
        QMAX=QMAX[dtype], BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, **pdl_args(x2),
    )  # fmt: skip
    return x_q, scale, s


def rms_norm_quant_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton RMSNorm whose output is quantized per token in the same kernel."""
    x_q, scale, _ = _launch_rms_norm_quant(x, None, weight, eps, dtype)
    return x_q, scale


def fused_add_rms_norm_quant_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton residual add + RMSNorm + per-token quantization in one kernel: (x_q, scale, x + residual)."""
    if x.shape != residual.shape:
        raise ValueError(f"fused_add_rms_norm_quant: x {tuple(x.shape)} and residual {tuple(residual.shape)} differ")
    return _launch_rms_norm_quant(x, residual, weight, eps, dtype)


# --------------------------------------------------------------------------------------------------
# the registered ops
# --------------------------------------------------------------------------------------------------


@torch.library.custom_op("mini_infer::quantize_per_token", mutates_args=())
def quantize_per_token(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric quantization to int8 / float8_e4m3fn: (x_q, scale [.., 1] fp32)."""
    if use_triton(x):
        return quantize_per_token_triton(x, dtype)
    return quantize_per_token_reference(x, dtype)


@quantize_per_token.register_fake
def _(x, dtype):
    check_quant_dtype(dtype)
    return x.new_empty(x.shape, dtype=dtype), x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)


@torch.library.custom_op("mini_infer::rms_norm_quant", mutates_args=())
def rms_norm_quant(
    x: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_per_token(rms_norm(x, weight, eps), dtype)` in one kernel on CUDA."""
    if use_triton(x):
        return rms_norm_quant_triton(x, weight, eps, dtype)
    return rms_norm_quant_reference(x, weight, eps, dtype)


@rms_norm_quant.register_fake
def _(x, weight, eps, dtype):
    check_quant_dtype(dtype)
    return x.new_empty(x.shape, dtype=dtype), x.new_empty((*x.shape[:-1], 1), dtype=torch.float32)


@torch.library.custom_op("mini_infer::fused_add_rms_norm_quant", mutates_args=())
def fused_add_rms_norm_quant(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`s = x + residual`; (quantize_per_token(rms_norm(s)), s) in one kernel on CUDA."""
    if use_triton(x):
        return fused_add_rms_norm_quant_triton(x, residual, weight, eps, dtype)
    return fused_add_rms_norm_quant_reference(x, residual, weight, eps, dtype)


@fused_add_rms_norm_quant.register_fake
def _(x, residual, weight, eps, dtype):
    check_quant_dtype(dtype)
    s = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype))
    return x.new_empty(x.shape, dtype=dtype), x.new_empty((*x.shape[:-1], 1), dtype=torch.float32), s


@torch.library.custom_op("mini_infer::silu_and_mul_quant", mutates_args=())
def silu_and_mul_quant(gate: torch.Tensor, up: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_per_token(silu(gate) * up, dtype)` in one kernel on CUDA."""
    if use_triton(gate):
        return silu_and_mul_quant_triton(gate, up, dtype)
    return silu_and_mul_quant_reference(gate, up, dtype)


@silu_and_mul_quant.register_fake
def _(gate, up, dtype):
    check_quant_dtype(dtype)
    return gate.new_empty(gate.shape, dtype=dtype), gate.new_empty((*gate.shape[:-1], 1), dtype=torch.float32)
