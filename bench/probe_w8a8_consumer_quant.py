"""Probe (issue #12): would the W8A8 batch-1 decode chain run faster if the int8 GEMVs that read a normalized
row quantized it themselves, so that the GEMVs before them end without the norm + quantization tail?

At qwen2.5-7b batch 1 the w8a8 step's o_proj and down_proj kernels (`scaled_linear_add_rms_norm_quant`: the GEMV,
the residual add, then the last program to arrive normalizes and quantizes the whole row) are exposed ~5 us a layer
each above their bytes in the step's timeline (bench/RESULTS.md, forty-third session), where the bf16 engine's
o_proj / down_proj (`linear_add`: the GEMV and the add only; the norm is in the next GEMV's one-pass prologue) take
about their bytes' time. This probe times one layer's four int8 GEMVs and the two quantizations between them,
chained over 28 layers in one CUDA graph (no attention: q/k/v's first columns stand in for its output), two ways:

  * "engine": the engine's ops as the w8a8 graph runs them at batch 1: int8_linear (q/k/v), quantize_per_token,
    scaled_linear_add_rms_norm_quant (o_proj), int8_linear (gate/up), silu_and_mul_quant,
    scaled_linear_add_rms_norm_quant (down_proj);
  * "consumer": o_proj and down_proj end after the add (`_producer_kernel`: each program stores its rows of the
    sum s and of t = s * norm weight, and its rows' max |t| and sum of s^2 in a slot of its own: no counter, no
    tail); q/k/v and gate/up (`_quantizing_gemv_kernel`) reduce those slots after their PDL wait (the row's amax
    and 1 / rms), quantize each K-step of t to int8 on the fly (t * 127 / amax, rounded half away from zero),
    multiply by dp4a and scale by amax / 127 * (1 / rms) * w_scale. The quantized values are the engine's up to
    rounding (the engine rounds the normalized row to bf16 before its amax; 1 / rms factors out of the
    quantization).

Every program of a consuming GEMV reads the whole t row (bf16) and the producer's slots, where the engine's read the
int8 row: more L2 traffic, fewer programs with wider tiles (`--consumer-rows`). Outputs of the consumer kernel are
checked against a torch reference of the same arithmetic; the chains' last rows are compared loosely (random
weights: after 28 layers they differ entirely). `--one-slot` also times the consumers with one ready slot instead
of the producer's (timing only: the cost of reducing the slots after the wait).

    python bench/probe_w8a8_consumer_quant.py [--layers 28] [--one-slot] [--out DIR]   # GPU
    TRITON_INTERPRET=1 python bench/probe_w8a8_consumer_quant.py --check               # CPU: both kernels, small
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mini_infer.ops._triton_support import await_producers, next_pow2, pdl_args, tl, triton  # noqa: E402
from mini_infer.ops.int8_linear import _dot4  # noqa: E402
from mini_infer.ops.linear import gemv_load, gemv_rows  # noqa: E402

HIDDEN, QKV, INTER = 3584, 4608, 18944  # qwen2.5-7b
EPS = 1e-6


@triton.jit
def _packed_dots(x_ptr, w_ptr, N, K, stride_wn, ASM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The int32 dot products of one packed int8 row x [K words] with BLOCK_N packed weight rows (dp4a)."""
    rows, row_ok, w_rows, acc = gemv_rows(w_ptr, N, stride_wn, BLOCK_N, BLOCK_K, tl.int32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_ok = cols < K
        x = tl.load(x_ptr + cols, mask=col_ok, other=0)
        acc = _dot4(acc, gemv_load(w_rows, row_ok, cols, col_ok), tl.broadcast_to(x[None, :], (BLOCK_N, BLOCK_K)), ASM)
    return rows, row_ok, tl.sum(acc, axis=1)


@triton.jit
def _producer_kernel(
    x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, r_ptr, nw_ptr, s_ptr, t_ptr, slot_ptr, N, K, stride_wn,
    ASM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_GDC: tl.constexpr,
):  # fmt: skip
    """y = dots * x_scale * w_scale (bf16), s = y + residual (bf16, stored), t = s * nw (bf16, stored); this
    program's slot: (max |t|, sum s^2) of its rows at slot_ptr[pid], slot_ptr[P + pid]."""
    await_producers(USE_GDC)
    rows, row_ok, dots = _packed_dots(x_ptr, w_ptr, N, K, stride_wn, ASM, BLOCK_N, BLOCK_K)
    y = (dots.to(tl.float32) * tl.load(x_scale_ptr) * tl.load(w_scale_ptr + rows, mask=row_ok, other=0.0))
    s = (y.to(s_ptr.dtype.element_ty).to(tl.float32) + tl.load(r_ptr + rows, mask=row_ok, other=0.0).to(tl.float32))
    s = s.to(s_ptr.dtype.element_ty).to(tl.float32)
    tl.store(s_ptr + rows, s.to(s_ptr.dtype.element_ty), mask=row_ok)
    t = (s * tl.load(nw_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)).to(t_ptr.dtype.element_ty)
    tl.store(t_ptr + rows, t, mask=row_ok)
    pid = tl.program_id(0)
    tl.store(slot_ptr + pid, tl.max(tl.abs(t.to(tl.float32)), axis=0))
    tl.store(slot_ptr + tl.num_programs(0) + pid, tl.sum(s * s, axis=0))


@triton.jit
def _quantizing_gemv_kernel(
    t_ptr, slot_ptr, n_slots, w_ptr, w_scale_ptr, y_ptr, N, K, stride_wn, eps,
    ASM: tl.constexpr, SLOTS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_GDC: tl.constexpr,
):  # fmt: skip
    """y = W_q (t quantized per token to int8) * scales, t [K * 4] bf16 (K counts int32 words of the weights): the
    row's amax and sum of s^2 from the producer's n_slots slots, each K-step of t quantized as it is read."""
    await_producers(USE_GDC)
    sl = tl.arange(0, SLOTS)
    sl_ok = sl < n_slots
    amax = tl.max(tl.load(slot_ptr + sl, mask=sl_ok, other=0.0), axis=0)
    sumsq = tl.sum(tl.load(slot_ptr + n_slots + sl, mask=sl_ok, other=0.0), axis=0)
    amax = tl.maximum(amax, 2.0**-100)
    inv = 127.0 / amax
    inv_rms = 1.0 / tl.sqrt(sumsq / (K * 4) + eps)
    rows, row_ok, w_rows, acc = gemv_rows(w_ptr, N, stride_wn, BLOCK_N, BLOCK_K, tl.int32)
    byte = tl.arange(0, 4)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_ok = cols < K
        t = tl.load(t_ptr + cols[:, None] * 4 + byte[None, :], mask=col_ok[:, None], other=0.0).to(tl.float32)
        v = t * inv
        q = tl.minimum(tl.maximum(tl.where(v >= 0, v + 0.5, v - 0.5).to(tl.int32), -127), 127)  # half away from 0
        x = tl.sum((q & 255) << (byte * 8)[None, :], axis=1)  # four bytes a word (disjoint fields: sum == or)
        acc = _dot4(acc, gemv_load(w_rows, row_ok, cols, col_ok), tl.broadcast_to(x[None, :], (BLOCK_N, BLOCK_K)), ASM)
    dots = tl.sum(acc, axis=1).to(tl.float32)
    y = dots * (amax / 127.0) * inv_rms * tl.load(w_scale_ptr + rows, mask=row_ok, other=0.0)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)


def _asm(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.version.hip is None and not os.environ.get("TRITON_INTERPRET")


def produce(x_q, x_scale, w_q, w_scale, residual, nw, rows: int, block_k: int = 1024):
    """`_producer_kernel` over packed int8 x_q [K] and w_q [N, K]: (s, t, slots [2, P])."""
    n, k = w_q.shape
    s = torch.empty(n, dtype=torch.bfloat16, device=w_q.device)
    t = torch.empty_like(s)
    programs = triton.cdiv(n, rows)
    slots = torch.empty(2 * programs, dtype=torch.float32, device=w_q.device)
    w32 = w_q.view(torch.int32)
    _producer_kernel[(programs,)](
        x_q.view(torch.int32), x_scale, w32, w_scale, residual, nw, s, t, slots, n, k // 4, w32.stride(0),
        ASM=_asm(w_q), BLOCK_N=rows, BLOCK_K=block_k // 4, num_warps=4, num_stages=1, **pdl_args(w_q),
    )  # fmt: skip
    return s, t, slots


def consume(t, slots, w_q, w_scale, rows: int, block_k: int = 1024):
    """`_quantizing_gemv_kernel`: W_q t (t quantized per token on the fly) as bf16 [N]."""
    n, k = w_q.shape
    y = torch.empty(n, dtype=torch.bfloat16, device=w_q.device)
    w32 = w_q.view(torch.int32)
    n_slots = slots.numel() // 2
    _quantizing_gemv_kernel[(triton.cdiv(n, rows),)](
        t, slots, n_slots, w32, w_scale, y, n, k // 4, w32.stride(0), EPS,
        ASM=_asm(w_q), SLOTS=next_pow2(n_slots), BLOCK_N=rows, BLOCK_K=block_k // 4, num_warps=4, num_stages=1,
        **pdl_args(w_q),
    )  # fmt: skip
    return y


def consume_reference(t, slots, w_q, w_scale) -> torch.Tensor:
    """The consumer's arithmetic in torch (fp64 sums of exact int products)."""
    n_slots = slots.numel() // 2
    amax = max(float(slots[:n_slots].max()), 2.0**-100)
    inv_rms = 1.0 / (float(slots[n_slots:].sum()) / t.numel() + EPS) ** 0.5
    v = t.double() * (127.0 / amax)
    q = torch.where(v >= 0, v + 0.5, v - 0.5).trunc().clamp(-127, 127)
    dots = (w_q.double() @ q)
    return dots * (amax / 127.0) * inv_rms * w_scale.double()


def weights(n: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randint(-127, 128, (n, k), dtype=torch.int8, device=device),
            torch.rand(n, device=device) * 2e-3 + 1e-4)


def layer_weights(n_layers: int, device) -> list[dict]:
    """Random int8 weights (per-row scales) and norm weights of n_layers qwen2.5-7b-shaped layers."""
    return [dict(qkv=weights(QKV, HIDDEN, device), o=weights(HIDDEN, HIDDEN, device),
                 gu=weights(2 * INTER, HIDDEN, device), down=weights(HIDDEN, INTER, device),
                 nw1=(torch.rand(HIDDEN, device=device) + 0.5).to(torch.bfloat16),
                 nw2=(torch.rand(HIDDEN, device=device) + 0.5).to(torch.bfloat16)) for _ in range(n_layers)]


def engine_chain_of(layers: list[dict], residual0: torch.Tensor):
    """The engine's ops as the w8a8 graph runs a layer's GEMVs at batch 1 (no attention: q/k/v's first columns
    stand in for its output), chained over `layers`; returns the chain (a callable returning the last q/k/v row)."""
    ops, i8 = torch.ops.mini_infer, torch.int8
    x_q0, x_s0 = ops.quantize_per_token(residual0, i8)

    def chain():
        x_q, x_s, res = x_q0, x_s0, residual0
        for w in layers:
            qkv = ops.int8_linear(x_q, x_s, *w["qkv"], None, torch.bfloat16)
            a_q, a_s = ops.quantize_per_token(qkv[:, :HIDDEN], i8)
            h_q, h_s, res = ops.scaled_linear_add_rms_norm_quant(a_q, a_s, *w["o"], None, torch.bfloat16, res,
                                                                w["nw2"], EPS, i8)
            gu = ops.int8_linear(h_q, h_s, *w["gu"], None, torch.bfloat16)
            m_q, m_s = ops.silu_and_mul_quant(gu[:, :INTER], gu[:, INTER:], i8)
            x_q, x_s, res = ops.scaled_linear_add_rms_norm_quant(m_q, m_s, *w["down"], None, torch.bfloat16, res,
                                                                w["nw1"], EPS, i8)
        return qkv
    return chain


def check(device: str) -> int:
    """Both kernels on small shapes against torch (CPU under the interpreter, or a GPU)."""
    torch.manual_seed(0)
    n, k, n2 = 96, 512, 160
    wo, so = weights(n, k, device)
    x_q = torch.randint(-127, 128, (k,), dtype=torch.int8, device=device)
    x_scale = torch.tensor([0.01], device=device)
    residual = torch.randn(n, device=device).to(torch.bfloat16)
    nw = (torch.rand(n, device=device) + 0.5).to(torch.bfloat16)
    s, t, slots = produce(x_q, x_scale, wo, so, residual, nw, rows=8, block_k=128)
    y_ref = (wo.double() @ x_q.double()) * 0.01 * so.double()
    s_ref = (y_ref.to(torch.bfloat16).float() + residual.float()).to(torch.bfloat16)
    t_ref = (s_ref.float() * nw.float()).to(torch.bfloat16)
    # within a bf16 rounding or two of y and s (the interpreter's fp32 -> bf16 cast truncates; a GPU's rounds)
    close = dict(rtol=2**-6, atol=2**-6)
    ok = torch.allclose(s.float(), s_ref.float(), **close) and torch.allclose(t.float(), t_ref.float(), **close)
    ok &= torch.allclose(slots[: n // 8].max(), t_ref.float().abs().max(), rtol=2**-6)
    ok &= torch.allclose(slots[n // 8:].sum(), (s_ref.float() ** 2).sum(), rtol=2**-6)
    wg, sg = weights(n2, n, device)
    for rows in (4, 16):
        y = consume(t, slots, wg, sg, rows=rows, block_k=32)
        ref = consume_reference(t, slots, wg, sg)
        err = float((y.double() - ref).abs().max() / ref.abs().max())
        print(f"consumer rows {rows}: max rel err {err:.1e}")
        ok &= err < 1e-2
    print("producer s / t / slots and consumer outputs", "match" if ok else "DIFFER")
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="check both kernels on small shapes, no timing")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--consumer-rows", default="4,8,16", help="weight rows a program of the consuming GEMVs")
    ap.add_argument("--producer-rows", default="4,16", help="weight rows a program of o_proj / down_proj")
    ap.add_argument("--one-slot", action="store_true",
                    help="also time each variant with its consumers handed one ready (amax, sum s^2) slot instead "
                         "of the producer's (wrong numbers: what the slots' reduction costs)")
    ap.add_argument("--out", default=None, help="directory for probe_w8a8_consumer_quant.json")
    args = ap.parse_args()
    if args.check:
        return check("cuda" if torch.cuda.is_available() else "cpu")
    from kernel_norm import time_calls, write_gpu_report

    import mini_infer.ops  # noqa: F401  (registers torch.ops.mini_infer.*)

    ops = torch.ops.mini_infer
    dev = "cuda"
    torch.manual_seed(0)
    i8 = torch.int8
    layers = layer_weights(args.layers, dev)
    residual0 = torch.randn(1, HIDDEN, device=dev).to(torch.bfloat16)
    engine_chain = engine_chain_of(layers, residual0)

    one_slot = torch.tensor([4.0, 3584.0], device=dev)  # --one-slot: (amax, sum s^2) as if reduced already

    def consumer_chain(crows: int, prows: int, reduced: bool = False):
        def run():
            res = residual0.view(-1)
            t = (residual0.float() * layers[0]["nw1"].float()).to(torch.bfloat16).view(-1)
            slots = torch.stack([t.float().abs().max(), (residual0.float() ** 2).sum()])
            for w in layers:
                qkv = consume(t, one_slot if reduced else slots, *w["qkv"], rows=crows)
                a_q, a_s = ops.quantize_per_token(qkv[None, :HIDDEN], i8)
                res, t, slots = produce(a_q, a_s, *w["o"], res, w["nw2"], rows=prows)
                gu = consume(t, one_slot if reduced else slots, *w["gu"], rows=crows)
                m_q, m_s = ops.silu_and_mul_quant(gu[None, :INTER], gu[None, INTER:], i8)
                res, t, slots = produce(m_q, m_s, *w["down"], res, w["nw1"], rows=prows)
            return qkv
        return run

    print(f"{torch.cuda.get_device_name()} | qwen2.5-7b shapes, {args.layers} layers chained in one CUDA graph (four "
          f"int8 GEMVs and two quantizations a layer, no attention), us a layer (median of 5)")
    rows = []
    us = time_calls([engine_chain], 300.0, 5)[0] * 1e3 / args.layers
    ref_last = engine_chain().float()
    print(f"  engine ops (tails in o_proj / down_proj)          : {us:7.2f} us a layer")
    rows.append({"chain": "engine", "us_per_layer": us})
    variants = [(p, c, False) for p in map(int, args.producer_rows.split(","))
                for c in map(int, args.consumer_rows.split(","))]
    if args.one_slot:
        variants += [(p, c, True) for p, c, _ in variants]
    for prows, crows, reduced in variants:
        run = consumer_chain(crows, prows, reduced)
        us = time_calls([run], 300.0, 5)[0] * 1e3 / args.layers
        last = run().float().view(-1)
        rel = float((last - ref_last.view(-1)).norm() / ref_last.norm())
        print(f"  consumer quantizes: producer {prows:2d} rows, consumer {crows:2d} rows"
              f"{', one slot (timing only)' if reduced else ''}: {us:7.2f} us a layer (last q/k/v row vs the "
              f"engine chain's: rel. diff {rel:.1e})")
        rows.append({"chain": "consumer", "producer_rows": prows, "consumer_rows": crows, "one_slot": reduced,
                     "us_per_layer": us, "rel_diff_last_row": rel})
    if args.out:
        write_gpu_report(args.out, "probe_w8a8_consumer_quant.json", {"rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
