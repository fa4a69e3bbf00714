"""`mini_infer::fused_moe_mxfp4`: `mini_infer::fused_moe` with MXFP4 expert weights (weight-only, bf16/fp16/fp32
activations): the experts read a quarter of a 16-bit expert's bytes (4.25 bits a weight).

MXFP4 (OCP microscaling, the format OpenAI publishes gpt-oss in): each run of 32 consecutive weights along the
reduction dimension K shares one power-of-two scale 2^(s - 127), s an unsigned byte (E8M0); each weight is an FP4
E2M1 value: sign, 2 exponent bits, 1 mantissa bit, magnitudes {0, 0.5, 1, 1.5, 2, 3, 4, 6}. A weight is
value(nibble) * 2^(s - 127). Two weights a byte, the lower K index in the low nibble (transformers'
`convert_moe_packed_tensors` reads gpt-oss checkpoints the same way). Shapes, for fused_moe's w13 [E, 2I, H] and
w2 [E, H, I]:
    w13_blocks [E, 2I, H/2] uint8, w13_scales [E, 2I, H/32] uint8, w2_blocks [E, H, I/2], w2_scales [E, H, I/32];
H and I multiples of 32. Everything else (routing, biases, activations, expert_map) is fused_moe's (fused_moe.py's
docstring): the result is fused_moe's on the dequantized weights (to the summation order, below), which are exact
in every dtype whose exponent range holds 2^(s - 127) * 6 (bf16 and fp32 always; fp16 for scales near 127 only).

`quantize_mxfp4` makes the blocks and scales from float weights: the scale is the smallest power of two that
brings the group's largest magnitude to at most 6 (no value is clipped), each weight rounded to the nearest FP4
value (ties toward zero). Weights that were MXFP4 to begin with (a gpt-oss checkpoint, dequantized at load) come
back exactly: their values, over the new scale, are FP4 values again. `dequantize_mxfp4` is the inverse.

Two implementations:
  * `fused_moe_mxfp4_reference`: dequantizes the weights to hidden's dtype and runs `fused_moe_reference`
    (the CPU path and the oracle; it holds a 16-bit copy of every expert while it runs).
  * `fused_moe_mxfp4_triton`, no host sync, three paths chosen by shape:
    - up to _GEMV_MAX_PAIRS (token, slot) pairs (decode), two grouped GEMVs in the manner of _moe_gemv.py (no
      align step, no slot sum): each program reads 32-bit words of packed bytes (8 weights), turns two nibbles at
      a time into FP16 bit patterns with one shift-and-mask (`_mx_gemv_step`), multiplies in fp32 and applies
      the group scale once a word. On an H200 (bench/kernel_moe.py --mxfp4) gpt-oss-20b's experts at batch 1
      take 53 us against 71 us in bf16 and 210 us in the grouped GEMMs below; still ALU-bound (about a quarter
      of the copy bandwidth over the MXFP4 bytes).
    - between, fused_moe_triton's grouped-GEMM path (its align step or pair-per-block mode, its tiles, its
      slot-sum kernel) with this module's GEMM kernel, which loads each K step's packed bytes and scales and
      decodes them to hidden's dtype in registers before the dot: the same per-pair products as
      fused_moe_triton on the dequantized weights at the same tiles, so the same output bits. No loads before
      the PDL wait, no slot sum inside the down GEMM, and fused_moe's bf16 tiles narrowed to what builds without
      spills (`mxfp4_tiles`). Slow: on an H200 gpt-oss-20b's experts at 64 tokens take 1.2-1.4 ms against 0.42
      in bf16 (the decode in the [K, N] tile is not pipelined; a tile sweep found at most 1.4x; Triton's
      `tl.dot_scaled` upcast was no faster, and wrong on the GPU at a 32-wide K step, so it is not used).
    - from _DEQUANT_MIN_PAIRS pairs (long prefill chunks), the experts dequantized into a scratch by one kernel
      and fused_moe_triton run on it (the same bits as fused_moe_triton on the dequantized weights): gpt-oss-20b
      at 2,048 tokens 1.95 ms against 4.26 in the grouped GEMMs and 0.96 in bf16.
    The decode GEMVs sum a token's slots in fp32 before rounding (as _moe_gemv.py's do); the other two paths
    give fused_moe_triton's bits on the dequantized weights.

Must not import anything from mini_infer outside `mini_infer.ops`.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from mini_infer.ops._moe_gemv import SWIGLU_ALPHA, SWIGLU_LIMIT, GemvTile, MoeGemvConfig, epilogue_args
from mini_infer.ops._triton_support import (
    HAS_TRITON,
    WEIGHT_EVICTION,
    await_producers,
    pdl_args,
    tl,
    triton,
    use_triton,
)
from mini_infer.ops.fused_moe import (
    GemmTile,
    MoeTileConfig,
    _check_args,
    _map_args,
    _RawIds,
    fused_moe_reference,
    fused_moe_triton,
    launch_fitting,
    moe_tile_config,
    pair_rows,
    sum_slots,
)

if HAS_TRITON:
    from mini_infer.ops._moe_gemv import _slot_expert, add_slot_biases, store_gated
    from mini_infer.ops.fused_moe import (
        _a_tile,
        _bias_and_activation,
        _block_operands,
        _dot_step,
        _tile_of,
    )

__all__ = ["DEQUANTIZE", "GROUP", "dequantize_mxfp4", "dequantize_mxfp4_triton", "fused_moe_mxfp4",
           "fused_moe_mxfp4_reference", "fused_moe_mxfp4_triton", "mxfp4_gemv_config", "mxfp4_tiles", "quantize_mxfp4",
           "round_to_mxfp4"]

GROUP = 32  # weights a scale
FP4_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # nibble & 7 -> |value|; bit 3 is the sign
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # rounding boundaries between neighbouring magnitudes


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Float weights [..., K] (K a multiple of 32) -> (blocks [..., K/2] uint8, scales [..., K/32] uint8): each
    group of 32 along K scaled by the smallest power of two that brings its largest magnitude to at most 6, each
    weight rounded to the nearest FP4 value (ties toward zero). Exact for weights that are MXFP4 values already."""
    if w.shape[-1] % GROUP or not w.dtype.is_floating_point:
        raise ValueError(f"quantize_mxfp4: weights must be float [..., K] with K a multiple of {GROUP}, got "
                         f"{w.dtype} {tuple(w.shape)}")
    groups = w.float().reshape(*w.shape[:-1], -1, GROUP)
    amax = groups.abs().amax(-1, keepdim=True)
    # exponent e with amax / 2^e <= 6, the smallest such (frexp: amax / 6 = m * 2^x, m in [0.5, 1): e = x, or x - 1
    # when m == 0.5 exactly); an all-zero group takes scale 1
    mant, expo = torch.frexp(amax / 6)
    expo = torch.where(mant == 0.5, expo - 1, expo)
    expo = torch.where(amax > 0, expo, torch.zeros_like(expo)).clamp(-127, 127)
    scaled = groups / torch.ldexp(torch.ones_like(groups[..., :1]), expo)
    mag = torch.bucketize(scaled.abs().contiguous(), torch.tensor(_MIDPOINTS, device=w.device))  # 0..7; a tie goes down
    nibble = (mag | torch.where(scaled < 0, 8, 0)).to(torch.uint8).reshape(*w.shape[:-1], -1)
    blocks = nibble[..., 0::2] | (nibble[..., 1::2] << 4)
    return blocks.contiguous(), (expo + 127).to(torch.uint8).squeeze(-1).contiguous()


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(blocks [..., K/2] uint8, scales [..., K/32] uint8) -> weights [..., K] of `dtype`."""
    lut = torch.tensor(FP4_MAGNITUDES + tuple(-m for m in FP4_MAGNITUDES), dtype=torch.float32, device=blocks.device)
    values = torch.stack((lut[(blocks & 15).long()], lut[(blocks >> 4).long()]), -1).flatten(-2)
    groups = values.reshape(*values.shape[:-1], -1, GROUP)
    out = torch.ldexp(groups, scales.to(torch.int32)[..., None] - 127)
    return out.reshape(values.shape).to(dtype)


def round_to_mxfp4(w: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """`w` with every value replaced by its MXFP4 value (groups of 32 along `dim`), in w's dtype: weights that a
    quantization to MXFP4 keeps exactly (what a gpt-oss checkpoint's experts are once dequantized)."""
    rows = w.transpose(dim, -1)
    return dequantize_mxfp4(*quantize_mxfp4(rows), w.dtype).transpose(dim, -1)


def _check_mxfp4(hidden: torch.Tensor, w13_blocks: torch.Tensor, w13_scales: torch.Tensor, w2_blocks: torch.Tensor,
                 w2_scales: torch.Tensor) -> tuple[int, int, int]:
    """The packed weights' shapes and dtypes (ValueError naming the argument); returns (E, H, I)."""
    packed = {"w13_blocks": w13_blocks, "w13_scales": w13_scales, "w2_blocks": w2_blocks, "w2_scales": w2_scales}
    for name, x in packed.items():
        if x.dtype != torch.uint8 or x.dim() != 3:
            raise ValueError(f"fused_moe_mxfp4: {name} must be a 3-d uint8 tensor, got {x.dtype} {tuple(x.shape)}")
    h = hidden.shape[-1]
    e, two_i = w13_blocks.shape[0], w13_blocks.shape[1]
    if h % GROUP or two_i % (2 * GROUP):
        raise ValueError(f"fused_moe_mxfp4: H={h} and I={two_i // 2} must be multiples of {GROUP}")
    inter = two_i // 2
    want = {"w13_blocks": (e, two_i, h // 2), "w13_scales": (e, two_i, h // GROUP),
            "w2_blocks": (e, h, inter // 2), "w2_scales": (e, h, inter // GROUP)}
    for name, x in packed.items():
        if tuple(x.shape) != want[name]:
            raise ValueError(f"fused_moe_mxfp4: {name} must be {list(want[name])} (E, rows, K/2 bytes or K/{GROUP} "
                             f"scales for H={h}, I={inter}), got {list(x.shape)}")
    return e, h, inter


def _stand_ins(hidden: torch.Tensor, e: int, h: int, inter: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Meta tensors shaped as the dequantized w13 / w2, for fused_moe's own argument checks."""
    return (torch.empty(e, 2 * inter, h, dtype=hidden.dtype, device="meta"),
            torch.empty(e, h, inter, dtype=hidden.dtype, device="meta"))


def fused_moe_mxfp4_reference(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                              w13_blocks: torch.Tensor, w13_scales: torch.Tensor, w2_blocks: torch.Tensor,
                              w2_scales: torch.Tensor, activation: str = "silu",
                              expert_map: torch.Tensor | None = None, w13_bias: torch.Tensor | None = None,
                              w2_bias: torch.Tensor | None = None, swiglu_alpha: float = SWIGLU_ALPHA,
                              swiglu_limit: float = SWIGLU_LIMIT) -> torch.Tensor:
    """`fused_moe_reference` on the dequantized weights."""
    _check_mxfp4(hidden, w13_blocks, w13_scales, w2_blocks, w2_scales)
    w13 = dequantize_mxfp4(w13_blocks, w13_scales, hidden.dtype)
    w2 = dequantize_mxfp4(w2_blocks, w2_scales, hidden.dtype)
    return fused_moe_reference(hidden, topk_weights, topk_ids, w13, w2, activation, expert_map, w13_bias, w2_bias,
                               swiglu_alpha, swiglu_limit)


# --------------------------------------------------------------------------------------------------
# Triton

if HAS_TRITON:

    @triton.jit
    def _fp4_values(nibble):
        """E2M1 nibbles (int32, 0..15) -> fp32 values: the magnitude's bits built directly (1.m * 2^(e-1), or
        0.5 * m for e == 0), bit 3 to the sign bit."""
        mag = nibble & 7
        e = mag >> 1
        m = mag & 1
        bits = tl.where(e == 0, m * (126 << 23), ((e + 126) << 23) | (m << 22))
        return (bits | ((nibble & 8) << 28)).to(tl.float32, bitcast=True)

    @triton.jit
    def _mx_b_tile(q_ptrs, s_ptrs, col_ok, half_ok, group_ok, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                   OUT_DTYPE: tl.constexpr, EVICT: tl.constexpr):  # fmt: skip
        """One K step's B tile [BLOCK_K, BLOCK_N] in OUT_DTYPE from its packed bytes (q_ptrs [BLOCK_K/2, BLOCK_N]:
        byte i holds K rows 2i, low nibble, and 2i + 1) and scales (s_ptrs [BLOCK_K/32, BLOCK_N]); rows past K
        (half_ok / group_ok false) read as zero."""
        q = tl.load(q_ptrs, mask=half_ok[:, None] & col_ok[None, :], other=0, eviction_policy=EVICT).to(tl.int32)
        s = tl.load(s_ptrs, mask=group_ok[:, None] & col_ok[None, :], other=127, eviction_policy=EVICT)
        pairs = tl.join(_fp4_values(q & 15), _fp4_values(q >> 4))  # [BLOCK_K/2, BLOCK_N, 2]
        values = tl.reshape(tl.permute(pairs, (0, 2, 1)), (BLOCK_K, BLOCK_N))
        scale = (s.to(tl.int32) << 23).to(tl.float32, bitcast=True)  # 2^(s - 127)
        scale = tl.reshape(tl.broadcast_to(scale[:, None, :], (BLOCK_K // 32, 32, BLOCK_N)), (BLOCK_K, BLOCK_N))
        return (values * scale).to(OUT_DTYPE)

    @triton.jit
    def _moe_mxfp4_gemm_kernel(
        a_ptr, q_ptr, s_ptr, c_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, weight_ptr,
        num_pairs, n_out, k_in, rows_per_a, num_pid_m, up_rows,
        stride_am, stride_qe, stride_qn, stride_se, stride_sn, stride_cm,
        num_experts, map_ptr, num_global, bias_ptr,
        GATED: tl.constexpr, MUL_WEIGHT: tl.constexpr, DOT_FP32: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        PAIR_BLOCKS: tl.constexpr, HAS_MAP: tl.constexpr, USE_GDC: tl.constexpr, B_EVICT: tl.constexpr = "",
        HAS_BIAS: tl.constexpr = False, ACTIVATION: tl.constexpr = 0, ALPHA: tl.constexpr = SWIGLU_ALPHA,
        LIMIT: tl.constexpr = SWIGLU_LIMIT,
    ):  # fmt: skip
        """fused_moe's `_moe_gemm_kernel` (C[pair] = A[pair // rows_per_a] @ B[expert].T over one block's
        expert-sorted pairs; GATED: B's up rows start `up_rows` rows down, C = act(gate, up); MUL_WEIGHT; bias;
        PAIR_BLOCKS / HAS_MAP) with B in MXFP4: q_ptr the packed bytes [E, N, K/2], s_ptr the scales [E, N, K/32]."""
        pid_m, pid_n = _tile_of(tl.program_id(0), num_pid_m, n_out, BLOCK_N, GROUP_M)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < n_out
        ks = tl.arange(0, BLOCK_K)
        await_producers(USE_GDC)
        padded_end = tl.load(num_padded_ptr)
        if pid_m * BLOCK_M >= padded_end:
            return  # past the padded end (this launch was sized for the worst case)
        pair, row_ok, live, _, expert = _block_operands(
            pid_m, rows, cols, ks, padded_end, sorted_ptr, block_expert_ptr, q_ptr, map_ptr, num_pairs, num_experts,
            num_global, 0, 0, 0, BLOCK_M, PAIR_BLOCKS, HAS_MAP, MASKED=False)  # fmt: skip
        if not live:
            return  # (PAIR_BLOCKS) a slot with no (local) expert: its rows stay unwritten
        a_row = (pair // rows_per_a).to(tl.int64)
        a_ptrs = a_ptr + a_row[:, None] * stride_am + ks[None, :]
        halves = tl.arange(0, BLOCK_K // 2)
        groups = tl.arange(0, BLOCK_K // 32)
        n64 = cols[None, :].to(tl.int64)
        q_ptrs = q_ptr + expert * stride_qe + n64 * stride_qn + halves[:, None]
        s_ptrs = s_ptr + expert * stride_se + n64 * stride_sn + groups[:, None]
        b_dtype = a_ptr.dtype.element_ty
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, k_in, BLOCK_K):
            k_left = k_in - k0
            half_ok = halves * 2 < k_left
            group_ok = groups * 32 < k_left
            a = _a_tile(a_ptrs, row_ok, ks < k_left, False, DOT_FP32)
            b = _mx_b_tile(q_ptrs, s_ptrs, col_ok, half_ok, group_ok, BLOCK_K, BLOCK_N, b_dtype, B_EVICT)
            acc = _dot_step(a, b, acc, DOT_FP32)
            if GATED:
                b_up = _mx_b_tile(q_ptrs + up_rows * stride_qn, s_ptrs + up_rows * stride_sn, col_ok, half_ok,
                                  group_ok, BLOCK_K, BLOCK_N, b_dtype, B_EVICT)
                acc_up = _dot_step(a, b_up, acc_up, DOT_FP32)
            a_ptrs += BLOCK_K
            q_ptrs += BLOCK_K // 2
            s_ptrs += BLOCK_K // 32
        acc = _bias_and_activation(acc, acc_up, expert, cols, col_ok, n_out, bias_ptr, GATED, HAS_BIAS, ACTIVATION,
                                   ALPHA, LIMIT)
        if MUL_WEIGHT:
            acc = acc * tl.load(weight_ptr + pair, mask=row_ok, other=0.0).to(tl.float32)[:, None]
        c_ptrs = c_ptr + pair[:, None].to(tl.int64) * stride_cm + cols[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def _mx_pair(q, J: tl.constexpr):
        """Nibbles J and J + 4 of 32-bit words `q` (uint32) as fp32: FP4 value * 2^-14, exactly. Both are shifted
        into the halves of one 32-bit word as FP16 bit patterns by one shift-and-mask (sign to bit 15; the 3
        magnitude bits to the lowest two exponent bits and the top mantissa bit, so FP4's subnormal 0.5 lands on
        an FP16 subnormal)."""
        if J == 3:
            mag = q >> 3
        else:
            mag = q << (9 - 4 * J)
        bits = (mag & 0x0E000E00) | ((q << (12 - 4 * J)) & 0x80008000)
        lo = bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (bits >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        return lo, hi

    @triton.jit
    def _mx_gemv_step(acc, q_rows, s_rows, row_ok, words, word_ok, x_ptr, x_mul):
        """acc [R, W] + one K step of R MXFP4 rows dotted with x: `words` [W] the step's 32-bit words of packed
        bytes (8 weights each, K = 8 * word + i in nibble i, which exist where `word_ok`) at q_rows [R, 1] (uint32
        pointers), their scales at s_rows [R, 1] (one byte a group of 4 words); x (times the scalar x_mul) at
        x_ptr[8 * word + i], loaded as one [W, 8] tile and split into its 8 columns. Nibbles j and j + 4 of a word
        are decoded together (`_mx_pair`), so one shift-and-mask serves two weights; the products are summed per
        word and scaled by 2^(s - 127) * 2^14 * x_mul once a word."""
        ok = row_ok[:, None] & word_ok[None, :]
        q = tl.load(q_rows + words[None, :], mask=ok, other=0)
        s = tl.load(s_rows + (words // 4)[None, :], mask=ok, other=127).to(tl.int32)
        xs = tl.load(x_ptr + words[:, None] * 8 + tl.arange(0, 8)[None, :], mask=word_ok[:, None], other=0.0)
        # xs[w, 4a + 2b + c] split on c, then on b, then on a: x's columns for nibble j = 2b + c (a = 0) and j + 4
        c0, c1 = tl.split(tl.reshape(xs.to(tl.float32), (xs.shape[0], 2, 2, 2)))
        c0b0, c0b1 = tl.split(c0)
        c1b0, c1b1 = tl.split(c1)
        part = tl.zeros(acc.shape, tl.float32)
        for j in tl.static_range(4):
            if j == 0:
                x_lo, x_hi = tl.split(c0b0)
            elif j == 1:
                x_lo, x_hi = tl.split(c1b0)
            elif j == 2:
                x_lo, x_hi = tl.split(c0b1)
            else:
                x_lo, x_hi = tl.split(c1b1)
            lo, hi = _mx_pair(q, j)
            part += lo * x_lo[None, :] + hi * x_hi[None, :]
        scale = (s << 23).to(tl.float32, bitcast=True)  # 2^(s - 127)
        return acc + part * (scale * (16384.0 * x_mul))

    @triton.jit
    def _mx_dequant_kernel(q_ptr, s_ptr, out_ptr, rows, n_words, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
        """out[r, 8w : 8w + 8] = the 8 weights of 32-bit word w of packed row r (q_ptr [rows, n_words] uint32
        words, s_ptr [rows, n_words / 4] scales), in out's dtype: program (row block, word block). `_mx_pair`'s
        values times 2^(s - 127) * 2^14 in fp32, interleaved back into K order in registers (join) and stored as
        8 consecutive values a word."""
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
        ok = (r < rows)[:, None] & (w < n_words)[None, :]
        r64 = r[:, None].to(tl.int64)
        q = tl.load(q_ptr.to(tl.pointer_type(tl.uint32)) + r64 * n_words + w[None, :], mask=ok, other=0)
        s = tl.load(s_ptr + r64 * (n_words // 4) + (w // 4)[None, :], mask=ok, other=127).to(tl.int32)
        scale = (s << 23).to(tl.float32, bitcast=True) * 16384.0
        # K offset 4a + 2b + c of a word holds nibble j = 2b + c's lo (a = 0) or hi (a = 1) value: joined over a,
        # then b, then c, so that c is the last index
        lo, hi = _mx_pair(q, 0)
        j0 = tl.join(lo * scale, hi * scale)
        lo, hi = _mx_pair(q, 1)
        j1 = tl.join(lo * scale, hi * scale)
        lo, hi = _mx_pair(q, 2)
        j2 = tl.join(lo * scale, hi * scale)
        lo, hi = _mx_pair(q, 3)
        j3 = tl.join(lo * scale, hi * scale)
        values = tl.join(tl.join(j0, j2), tl.join(j1, j3))  # [R, W, 2 (a), 2 (b), 2 (c)]
        values = tl.reshape(values, (BLOCK_R, BLOCK_W * 8)).to(out_ptr.dtype.element_ty)
        k = tl.program_id(1) * (BLOCK_W * 8) + tl.arange(0, BLOCK_W * 8)  # the words' 8 weights each, in order
        tl.store(out_ptr + r64 * (n_words * 8) + k[None, :], values, mask=(r < rows)[:, None] & (k < n_words * 8)[None, :])

    @triton.jit
    def _mx_gemv_gate_up_kernel(
        x_ptr, q_ptr, s_ptr, act_ptr, ids_ptr, map_ptr, num_global, num_experts, top_k, inter, hidden,
        stride_xm, word_stride_qe, word_stride_qn, stride_se, stride_sn, bias_ptr,
        HAS_MAP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_GDC: tl.constexpr,
        HAS_BIAS: tl.constexpr = False, ACTIVATION: tl.constexpr = 0, ALPHA: tl.constexpr = SWIGLU_ALPHA,
        LIMIT: tl.constexpr = SWIGLU_LIMIT,
    ):  # fmt: skip
        """_moe_gemv.py's gate/up GEMV (pair p = program_id(0), a tile of BLOCK_N gate and BLOCK_N up rows) with
        W13 in MXFP4: q_ptr the packed bytes [E, 2I, H/2] read as 32-bit words (strides in words), s_ptr the
        scales [E, 2I, H/32]; BLOCK_K weights a K step."""
        await_producers(USE_GDC)
        pair = tl.program_id(0)
        expert = _slot_expert(ids_ptr, pair, map_ptr, num_global, HAS_MAP)
        if (expert < 0) | (expert >= num_experts):
            return  # another rank's expert, or none: the down kernel skips this slot too
        stack = tl.arange(0, 2 * BLOCK_N)  # the tile's gate rows, then its up rows
        row = tl.program_id(1) * BLOCK_N + stack % BLOCK_N
        row_ok = row < inter
        full_row = (row + stack // BLOCK_N * inter)[:, None].to(tl.int64)
        q_rows = q_ptr.to(tl.pointer_type(tl.uint32)) + expert * word_stride_qe + full_row * word_stride_qn
        s_rows = s_ptr + expert * stride_se + full_row * stride_sn
        x_row = x_ptr + (pair // top_k).to(tl.int64) * stride_xm
        acc = tl.zeros([2 * BLOCK_N, BLOCK_K // 8], tl.float32)
        n_words = hidden // 8
        for w0 in range(0, n_words, BLOCK_K // 8):
            words = w0 + tl.arange(0, BLOCK_K // 8)
            acc = _mx_gemv_step(acc, q_rows, s_rows, row_ok, words, words < n_words, x_row, 1.0)
        store_gated(tl.sum(acc, axis=1), expert, pair, stack, row, inter, bias_ptr, act_ptr, BLOCK_N, HAS_BIAS,
                    ACTIVATION, ALPHA, LIMIT)

    @triton.jit
    def _mx_gemv_down_kernel(
        act_ptr, q_ptr, s_ptr, out_ptr, weights_ptr, ids_ptr, map_ptr, num_global, num_experts, hidden, inter,
        stride_om, word_stride_qe, word_stride_qn, stride_se, stride_sn, bias_ptr,
        TOP_K: tl.constexpr, HAS_MAP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        USE_GDC: tl.constexpr, HAS_BIAS: tl.constexpr = False,
    ):  # fmt: skip
        """_moe_gemv.py's down GEMV (token t = program_id(0), BLOCK_N output rows: the sum over its TOP_K slots of
        weight * W2[e] act, slot by slot in fp32, slots without a (local) expert skipped; HAS_BIAS: then each
        slot's weight times its expert's bias row) with W2 in MXFP4 (q_ptr [E, H, I/2] as words, s_ptr
        [E, H, I/32])."""
        await_producers(USE_GDC)
        t = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < hidden
        q_base = q_ptr.to(tl.pointer_type(tl.uint32)) + rows[:, None].to(tl.int64) * word_stride_qn
        s_base = s_ptr + rows[:, None].to(tl.int64) * stride_sn
        acc = tl.zeros([BLOCK_N, BLOCK_K // 8], tl.float32)
        n_words = inter // 8
        for j in tl.static_range(TOP_K):
            pair = t * TOP_K + j
            expert = _slot_expert(ids_ptr, pair, map_ptr, num_global, HAS_MAP)
            if (expert >= 0) & (expert < num_experts):
                weight = tl.load(weights_ptr + pair).to(tl.float32)
                q_rows = q_base + expert * word_stride_qe
                s_rows = s_base + expert * stride_se
                a_row = act_ptr + pair.to(tl.int64) * inter
                for w0 in range(0, n_words, BLOCK_K // 8):
                    words = w0 + tl.arange(0, BLOCK_K // 8)
                    acc = _mx_gemv_step(acc, q_rows, s_rows, row_ok, words, words < n_words, a_row, weight)
        out = tl.sum(acc, axis=1)
        if HAS_BIAS:
            out = add_slot_biases(out, t, rows, weights_ptr, ids_ptr, map_ptr, num_global, num_experts, hidden,
                                  bias_ptr, TOP_K, HAS_MAP)
        tl.store(out_ptr + t.to(tl.int64) * stride_om + rows, out.to(out_ptr.dtype.element_ty), mask=row_ok)


_TILE_OK: dict[tuple, GemmTile] = {}  # launch shapes that compiled, per (dtype, gemm, tile) key
# The B tile is decoded in registers: fused_moe's tiles (up to 128 x 128 at 4 warps, 256 x 64 at 8) spill on sm_90
# here (gpt-oss-20b's gate/up at T = 8: 255 registers and 1,000 bytes of stack at 128 x 128 / 4 warps). At most 64 K
# rows, 128 columns and 8 warps they build without spills (tests/ops/compile_fused_moe_sm90.py mxfp4: 80-183
# registers at gpt-oss's shapes, Triton 3.6). On an H200 (forty-eighth session) a 24-tile sweep at one token found at
# most 1.3x over these (bench/results/s48_kernel_moe_mxfp4_sweep.txt); they now serve only 65-2,047 pairs.
_MAX_BLOCK_K, _MAX_BLOCK_N, _NUM_WARPS = 64, 128, 8


# The decode GEMVs (`_mx_gemv_*`) serve calls of at most this many (token, slot) pairs. H200 (forty-eighth session,
# bench/kernel_moe.py --mxfp4): gpt-oss-20b's experts at batch 1 (4 pairs) 53-67 us against 210 in the grouped
# GEMMs (71 in bf16), at batch 8 (32 pairs) 302-324 against 818-936; qwen3-30b-a3b's at 64 pairs 161-305 against
# 522-575.
_GEMV_MAX_PAIRS = 64
_GEMV_TILES = MoeGemvConfig(GemvTile(2, 1024, 4, 1), GemvTile(8, 512, 4, 1))  # that sweep's best of each


# Calls of at least this many pairs (prefill chunks) dequantize the experts into a scratch of hidden's dtype in one
# kernel (`dequantize_mxfp4_triton`) and run fused_moe_triton on it, as vLLM's AWQ layers dequantize before a GEMM
# at 256 rows or more. The scratch is every local expert (gpt-oss-20b: 1.6 GB in bf16), allocated per call (the
# engine's activation profile at its token budget sees it). H200, forty-eighth session (bench/kernel_moe.py
# --mxfp4): gpt-oss-20b 1,951 us against 4,264 in the grouped GEMMs at 2,048 tokens (8,192 pairs), but 1,472
# against 1,060 at 256 tokens (1,024 pairs; the dequantization alone costs about 1 ms); qwen3-30b-a3b 985 against
# 1,306 at 256 tokens (2,048 pairs).
_DEQUANT_MIN_PAIRS = 2048
DEQUANTIZE = "dequantize"  # fused_moe_mxfp4_triton's `config` that forces that path (fused_moe's tiles by shape)


def mxfp4_gemv_config(num_tokens: int, top_k: int) -> MoeGemvConfig | None:
    """The decode GEMVs' tiles for a call of this many pairs, or None when the grouped GEMMs serve it (by shapes
    alone: a CUDA graph keeps its kernels)."""
    return _GEMV_TILES if num_tokens * top_k <= _GEMV_MAX_PAIRS else None


def _as_words(blocks: torch.Tensor) -> torch.Tensor:
    """`blocks` if its kernels can read it as 32-bit words (address and row strides multiples of 4 bytes, unit
    last stride), else a contiguous copy (a view sliced along K; never the case for the pass's own tensors)."""
    aligned = blocks.data_ptr() % 4 == 0 and all(st % 4 == 0 for st in blocks.stride()[:-1])
    return blocks if aligned and blocks.stride(-1) == 1 else blocks.clone(memory_format=torch.contiguous_format)


def dequantize_mxfp4_triton(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`dequantize_mxfp4` in one Triton kernel (no fp32 intermediate): blocks [..., K/2] and scales [..., K/32]
    contiguous, K a multiple of 32 -> [..., K] of `dtype`; the same values."""
    blocks, scales = _as_words(blocks.contiguous()), scales.contiguous()
    k = blocks.shape[-1] * 2
    out = torch.empty(*blocks.shape[:-1], k, dtype=dtype, device=blocks.device)
    rows = blocks.numel() // blocks.shape[-1] if blocks.numel() else 0
    if rows == 0:
        return out
    n_words = k // 8
    block_w = min(64, triton.next_power_of_2(n_words))
    _mx_dequant_kernel[(triton.cdiv(rows, 4), triton.cdiv(n_words, block_w))](
        blocks, scales, out, rows, n_words, BLOCK_R=4, BLOCK_W=block_w, num_warps=4)
    return out


def _mx_gemv(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, q13: torch.Tensor, s13: torch.Tensor,
             q2: torch.Tensor, s2: torch.Tensor, expert_map: torch.Tensor | None, config: MoeGemvConfig,
             b13: torch.Tensor | None, b2: torch.Tensor | None, activation: str, swiglu_alpha: float,
             swiglu_limit: float) -> torch.Tensor:
    """The decode GEMVs (`_mx_gemv_gate_up_kernel`, `_mx_gemv_down_kernel`) for validated, contiguous arguments:
    out [T, H] in x's dtype."""
    t, h = x.shape
    e, inter, k = q2.shape[0], q2.shape[2] * 2, ids.numel() // t
    emap, n_global = _map_args(ids, expert_map)
    act = torch.empty(t * k, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(t, h, dtype=x.dtype, device=x.device)
    gu, dn = config.gate_up, config.down
    _mx_gemv_gate_up_kernel[(t * k, triton.cdiv(inter, gu.block_n))](
        x, q13, s13, act, ids, emap, n_global, e, k, inter, h, x.stride(0), q13.stride(0) // 4, q13.stride(1) // 4,
        s13.stride(0), s13.stride(1), b13, HAS_MAP=expert_map is not None, BLOCK_N=gu.block_n, BLOCK_K=gu.block_k,
        num_warps=gu.num_warps, num_stages=gu.num_stages, **epilogue_args(b13, activation, swiglu_alpha,
                                                                          swiglu_limit),
        **pdl_args(x, trigger_first=False))
    _mx_gemv_down_kernel[(t, triton.cdiv(h, dn.block_n))](
        act, q2, s2, out, weights, ids, emap, n_global, e, h, inter, out.stride(0), q2.stride(0) // 4,
        q2.stride(1) // 4, s2.stride(0), s2.stride(1), b2, TOP_K=k, HAS_MAP=expert_map is not None,
        BLOCK_N=dn.block_n, BLOCK_K=dn.block_k, num_warps=dn.num_warps, num_stages=dn.num_stages,
        **epilogue_args(b2), **pdl_args(act, trigger_first=False))
    return out


def mxfp4_tiles(cfg: MoeTileConfig) -> MoeTileConfig:
    """fused_moe's tiles for a call, narrowed to what this kernel builds without spills."""
    def narrow(tile: GemmTile) -> GemmTile:
        return replace(tile, block_k=min(tile.block_k, _MAX_BLOCK_K), block_n=min(tile.block_n, _MAX_BLOCK_N),
                       num_warps=_NUM_WARPS)

    return replace(cfg, gate_up=narrow(cfg.gate_up), down=narrow(cfg.down))


def _mx_grouped_gemm(a, q, s, c, sorted_pairs, block_expert, num_padded, weights, num_pairs, rows_per_a, gated,
                     block_m, tile: GemmTile, raw_ids: _RawIds | None, evict: str, bias, epilogue: dict) -> None:
    """Launch `_moe_mxfp4_gemm_kernel` over every block of the worst-case padded row list (raw_ids: pair-per-block
    mode, `pair_rows`'); a tile that does not fit is retried smaller."""
    n_out = q.shape[1] // 2 if gated else q.shape[1]
    k_in = q.shape[2] * 2
    num_pid_m = triton.cdiv(sorted_pairs.numel(), block_m)
    key = (a.dtype, gated, n_out, k_in, block_m, tile, evict, tuple(sorted(epilogue.items())))

    def launch(t: GemmTile) -> None:
        _moe_mxfp4_gemm_kernel[(num_pid_m * triton.cdiv(n_out, t.block_n),)](
            a, q, s, c, sorted_pairs, block_expert, num_padded, weights,
            num_pairs, n_out, k_in, rows_per_a, num_pid_m, n_out,
            a.stride(0), q.stride(0), q.stride(1), s.stride(0), s.stride(1), c.stride(0),
            *((raw_ids.num_experts, raw_ids.emap, raw_ids.num_global) if raw_ids else (0, block_expert, 0)), bias,
            GATED=gated, MUL_WEIGHT=weights is not None, DOT_FP32=a.dtype == torch.float32 or not a.is_cuda,
            BLOCK_M=block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=t.group_m,
            PAIR_BLOCKS=raw_ids is not None, HAS_MAP=raw_ids is not None and raw_ids.has_map, B_EVICT=evict,
            num_warps=t.num_warps, num_stages=t.num_stages, **epilogue, **pdl_args(a, trigger_first=False),
        )  # fmt: skip

    launch_fitting(_TILE_OK, key, tile, launch, "fused_moe_mxfp4_triton", min_block_k=GROUP)


def fused_moe_mxfp4_triton(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                           w13_blocks: torch.Tensor, w13_scales: torch.Tensor, w2_blocks: torch.Tensor,
                           w2_scales: torch.Tensor, activation: str = "silu", expert_map: torch.Tensor | None = None,
                           w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                           swiglu_alpha: float = SWIGLU_ALPHA, swiglu_limit: float = SWIGLU_LIMIT,
                           config: MoeTileConfig | MoeGemvConfig | str | None = None,
                           pair_blocks: bool | None = None) -> torch.Tensor:
    """The CUDA path (or CPU under TRITON_INTERPRET=1), no host sync: fused_moe_triton's grouped-GEMM path with
    MXFP4 weights, at few pairs the decode GEMVs, at many the experts dequantized for fused_moe_triton (module
    docstring). `config` / `pair_blocks` as fused_moe_triton takes them, or DEQUANTIZE (None: by shape,
    `mxfp4_gemv_config`'s, else DEQUANTIZE from _DEQUANT_MIN_PAIRS pairs, else `mxfp4_tiles` of
    `moe_tile_config`'s)."""
    if not HAS_TRITON:
        raise RuntimeError("fused_moe_mxfp4_triton needs triton")
    e, h, inter = _check_mxfp4(hidden, w13_blocks, w13_scales, w2_blocks, w2_scales)
    t, _, _, _, k = _check_args(hidden, topk_weights, topk_ids, *_stand_ins(hidden, e, h, inter), activation,
                                expert_map, w13_bias, w2_bias, swiglu_alpha, swiglu_limit)
    if t == 0:
        return hidden.new_empty(0, h)
    q13, s13, q2, s2 = (w if w.stride(2) == 1 else w.contiguous() for w in (w13_blocks, w13_scales, w2_blocks,
                                                                              w2_scales))
    b13, b2 = (b if b is None or b.is_contiguous() else b.contiguous() for b in (w13_bias, w2_bias))
    num_global = e if expert_map is None else expert_map.shape[0]
    x = hidden if hidden.stride(1) == 1 else hidden.contiguous()
    weights = topk_weights.reshape(-1).contiguous()
    ids = topk_ids.reshape(-1).contiguous()
    config = config or mxfp4_gemv_config(t, k) or (DEQUANTIZE if t * k >= _DEQUANT_MIN_PAIRS else None)
    if config == DEQUANTIZE:
        w13, w2 = (dequantize_mxfp4_triton(q, sc, hidden.dtype) for q, sc in ((q13, s13), (q2, s2)))
        return fused_moe_triton(x, topk_weights, topk_ids, w13, w2, activation, expert_map, b13, b2, swiglu_alpha,
                                swiglu_limit, pair_blocks=pair_blocks)
    if isinstance(config, MoeGemvConfig):
        return _mx_gemv(x, weights, ids, _as_words(q13), s13, _as_words(q2), s2, expert_map, config, b13, b2,
                        activation, swiglu_alpha, swiglu_limit)
    cfg = config or mxfp4_tiles(moe_tile_config(t, num_global, k, h, inter, local_experts=e))
    num_pairs = t * k
    sorted_pairs, block_expert, num_padded, raw_ids = pair_rows(ids, expert_map, e, num_global, k, cfg.block_m,
                                                                pair_blocks)
    evict = WEIGHT_EVICTION if cfg.kind == "decode" else ""
    act = torch.empty(num_pairs, inter, dtype=hidden.dtype, device=hidden.device)
    _mx_grouped_gemm(x, q13, s13, act, sorted_pairs, block_expert, num_padded, None, num_pairs, k, True, cfg.block_m,
                     cfg.gate_up, raw_ids, evict, b13, epilogue_args(b13, activation, swiglu_alpha, swiglu_limit))
    out = (torch.zeros if k == 1 else torch.empty)(t, h, dtype=hidden.dtype, device=hidden.device)
    per_slot = out if k == 1 else torch.empty(num_pairs, h, dtype=hidden.dtype, device=hidden.device)
    _mx_grouped_gemm(act, q2, s2, per_slot, sorted_pairs, block_expert, num_padded, weights, num_pairs, 1, False,
                     cfg.block_m, cfg.down, raw_ids, evict, b2, epilogue_args(b2))
    if k > 1:
        sum_slots(per_slot, ids, out, e, k, expert_map, preload=False)
    return out


# --------------------------------------------------------------------------------------------------
# The registered op.


@torch.library.custom_op("mini_infer::fused_moe_mxfp4", mutates_args=())
def fused_moe_mxfp4(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    w13_blocks: torch.Tensor, w13_scales: torch.Tensor, w2_blocks: torch.Tensor,
                    w2_scales: torch.Tensor, activation: str = "silu", expert_map: torch.Tensor | None = None,
                    w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                    swiglu_alpha: float = SWIGLU_ALPHA, swiglu_limit: float = SWIGLU_LIMIT) -> torch.Tensor:
    """The routed experts with MXFP4 weights (module docstring): Triton on CUDA when available, else the torch
    reference."""
    args = (hidden, topk_weights, topk_ids, w13_blocks, w13_scales, w2_blocks, w2_scales, activation, expert_map,
            w13_bias, w2_bias, swiglu_alpha, swiglu_limit)
    if use_triton(hidden):
        return fused_moe_mxfp4_triton(*args)
    return fused_moe_mxfp4_reference(*args)


@fused_moe_mxfp4.register_fake
def _(hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13_blocks: torch.Tensor,
      w13_scales: torch.Tensor, w2_blocks: torch.Tensor, w2_scales: torch.Tensor, activation: str = "silu",
      expert_map: torch.Tensor | None = None, w13_bias: torch.Tensor | None = None,
      w2_bias: torch.Tensor | None = None, swiglu_alpha: float = SWIGLU_ALPHA,
      swiglu_limit: float = SWIGLU_LIMIT) -> torch.Tensor:
    e, h, inter = _check_mxfp4(hidden, w13_blocks, w13_scales, w2_blocks, w2_scales)
    _check_args(hidden, topk_weights, topk_ids, *_stand_ins(hidden, e, h, inter), activation, expert_map, w13_bias,
                w2_bias, swiglu_alpha, swiglu_limit)
    return hidden.new_empty(hidden.shape)
