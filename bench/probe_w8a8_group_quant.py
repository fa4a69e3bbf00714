"""Probe (issue #12): would the W8A8 batch-1 decode chain run faster with activation scales per group of the rows
one GEMV program produces, instead of per token?

Per-token scales need the whole row's amax before any element is quantized: at qwen2.5-7b batch 1 that reduction
costs three quantization launches a layer (~1.4 us each) and o_proj's / down_proj's last-program norm +
quantization tails (~2.4 us each); with both left out (timing only) w8a8 ran 1.70x the bf16 engine against 1.52x
(bench/RESULTS.md, forty-fourth session). Scales per group of G consecutive values, where G is the rows one program
of the producing GEMV computes, need no exchange between programs: each program quantizes its own outputs. The
norm's 1 / rms is a common factor of a row, so a group of t = s * norm weight is quantized without it (its scale
is max |t| / 127 over the group), each program stores its rows' sum of s^2 in a slot, and the consuming GEMV
reduces the slots after its wait and multiplies its dots by 1 / rms. The consumer's K loop turns each dp4a word's
int32 into fp32 times its group's scale (two instructions a word more).

`_group_gemv_kernel`, four modes, one layer's chain (no attention; q/k/v's first columns stand in for its output,
quantized per group by the q/k/v kernel itself as the attention's epilogue would):
  0 q/k/v: input (h_q, its group scales, its sum-of-squares slots) -> bf16 q/k/v, its first HIDDEN rows quantized;
  1 o_proj / down_proj: s = y + residual (stored), t = s * norm weight quantized, a sum-of-squares slot a program;
  2 gate/up: a program's G gate rows and the G up rows beside them, silu(g) * u quantized.
Timed against the engine's ops in the same graph shape (`engine_chain_of`, bench/probe_w8a8_consumer_quant.py)
and against the four GEMVs alone (int8_linear on fixed inputs: no quantization at all), over 28 layers in one
CUDA graph. The arithmetic is checked against torch on small shapes (`--check`).

    python bench/probe_w8a8_group_quant.py [--groups 8,16,32] [--layers 28] [--out DIR]   # GPU
    TRITON_INTERPRET=1 python bench/probe_w8a8_group_quant.py --check                   # CPU: the kernel, small
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from probe_w8a8_consumer_quant import EPS, HIDDEN, INTER, _asm, engine_chain_of, layer_weights  # noqa: E402

from mini_infer.ops._triton_support import await_producers, next_pow2, pdl_args, tl, triton  # noqa: E402
from mini_infer.ops.int8_linear import _dot4  # noqa: E402
from mini_infer.ops.linear import gemv_load  # noqa: E402

QKV_ROWS, RESIDUAL, GATED = 0, 1, 2  # the kernel's modes


@triton.jit
def _group_dots(x_ptr, gs_ptr, w_rows, row_ok, K, G_WORDS: tl.constexpr, ASM: tl.constexpr,
                ROWS: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """sum over K of (x . w[row]) with x's groups of G_WORDS words scaled by their scales, fp32 [ROWS]."""
    acc = tl.zeros([ROWS, BLOCK_K], tl.float32)
    zero = tl.zeros([ROWS, BLOCK_K], tl.int32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_ok = cols < K
        x = tl.load(x_ptr + cols, mask=col_ok, other=0)
        sc = tl.load(gs_ptr + cols // G_WORDS, mask=col_ok, other=0.0)
        d = _dot4(zero, gemv_load(w_rows, row_ok, cols, col_ok), tl.broadcast_to(x[None, :], (ROWS, BLOCK_K)), ASM)
        acc += d.to(tl.float32) * sc[None, :]
    return tl.sum(acc, axis=1)


@triton.jit
def _group_gemv_kernel(
    x_ptr, gs_ptr, slot_in_ptr, n_slots_in, w_ptr, ws_ptr, N, K, stride_wn,
    r_ptr, nw_ptr, s_ptr, y_ptr, q_ptr, qs_ptr, slot_out_ptr, n_quant_rows, eps,
    G_WORDS: tl.constexpr, IN_RSTD: tl.constexpr, MODE: tl.constexpr, SLOTS: tl.constexpr, ASM: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_GDC: tl.constexpr,
):  # fmt: skip
    """One program: BLOCK_N output rows (a group), see the module docstring. K counts int32 words of x and w."""
    await_producers(USE_GDC)
    pid = tl.program_id(0)
    ROWS: tl.constexpr = 2 * BLOCK_N if MODE == 2 else BLOCK_N
    r = tl.arange(0, ROWS)
    own = pid * BLOCK_N + r % BLOCK_N  # the output row each tile row serves
    w_row = own + N * (r // BLOCK_N)  # gate rows, then (GATED) the up rows N further
    row_ok = own < N
    dots = _group_dots(x_ptr, gs_ptr, w_ptr + w_row[:, None].to(tl.int64) * stride_wn, row_ok, K, G_WORDS, ASM,
                       ROWS, BLOCK_K)
    y = dots * tl.load(ws_ptr + w_row, mask=row_ok, other=0.0)
    if IN_RSTD:  # the input was t = s * norm weight: times 1 / rms(s) from the producer's slots
        sl = tl.arange(0, SLOTS)
        sumsq = tl.sum(tl.load(slot_in_ptr + sl, mask=sl < n_slots_in, other=0.0), axis=0)
        y = y * (1.0 / tl.sqrt(sumsq / (K * 4) + eps))
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = rows < N
    if MODE == 2:
        pair = tl.reshape(y, (2, BLOCK_N))
        first = (tl.arange(0, 2) == 0)[:, None]
        g = tl.sum(tl.where(first, pair, 0.0), axis=0)
        u = tl.sum(tl.where(first, 0.0, pair), axis=0)
        v = g / (1.0 + tl.exp(-g)) * u
    elif MODE == 1:
        s = y.to(s_ptr.dtype.element_ty).to(tl.float32) + tl.load(r_ptr + rows, mask=ok, other=0.0).to(tl.float32)
        s = s.to(s_ptr.dtype.element_ty).to(tl.float32)
        tl.store(s_ptr + rows, s.to(s_ptr.dtype.element_ty), mask=ok)
        tl.store(slot_out_ptr + pid, tl.sum(tl.where(ok, s * s, 0.0), axis=0))
        v = s * tl.load(nw_ptr + rows, mask=ok, other=0.0).to(tl.float32)
    else:
        tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=ok)
        v = y
    if MODE != 0 or pid * BLOCK_N < n_quant_rows:
        amax = tl.maximum(tl.max(tl.where(ok, tl.abs(v), 0.0), axis=0), 2.0**-100)
        w = v * (127.0 / amax)
        q = tl.minimum(tl.maximum(tl.where(w >= 0, w + 0.5, w - 0.5).to(tl.int32), -127), 127)
        tl.store(q_ptr + rows, q.to(tl.int8), mask=ok)
        tl.store(qs_ptr + pid, amax / 127.0)


def group_gemv(x_q, gs, w_q, w_scale, mode: int, group: int, slots_in=None, residual=None, nw=None,
               n_quant_rows: int = 0, block_k: int | None = None):
    """`_group_gemv_kernel` over int8 x_q [K] (groups of x_q.numel() // gs.numel() values) and w_q [N or 2N, K]:
    (y or s or None, q [N], group scales [N / group], slots or None). block_k (bytes a K-step) defaults to the
    engine's 1,024, less for groups over 16 rows (a tile of at most 4,096 words)."""
    block_k = block_k or min(1024, 16384 // group)
    k = w_q.shape[1]
    n = w_q.shape[0] // 2 if mode == GATED else w_q.shape[0]
    dev = w_q.device
    programs = triton.cdiv(n, group)
    out = torch.empty(n, dtype=torch.bfloat16, device=dev) if mode != GATED else None
    q = torch.empty(n, dtype=torch.int8, device=dev)
    qs = torch.empty(programs, dtype=torch.float32, device=dev)
    slots = torch.empty(programs, dtype=torch.float32, device=dev) if mode == RESIDUAL else None
    w32 = w_q.view(torch.int32)
    g_in = x_q.numel() // gs.numel()
    dummy = qs
    _group_gemv_kernel[(programs,)](
        x_q.view(torch.int32), gs, slots_in if slots_in is not None else dummy,
        slots_in.numel() if slots_in is not None else 0, w32, w_scale, n, k // 4, w32.stride(0),
        residual if residual is not None else dummy, nw if nw is not None else dummy,
        out if out is not None else dummy, out if out is not None else dummy, q, qs,
        slots if slots is not None else dummy, n_quant_rows, EPS,
        G_WORDS=g_in // 4, IN_RSTD=slots_in is not None, MODE=mode,
        SLOTS=next_pow2(slots_in.numel()) if slots_in is not None else 1, ASM=_asm(w_q), BLOCK_N=group,
        BLOCK_K=block_k // 4, num_warps=4, num_stages=1, **pdl_args(w_q),
    )  # fmt: skip
    return out, q, qs, slots


def reference(x_q, gs, w_q, w_scale, mode: int, group: int, slots_in=None, residual=None, nw=None):
    """The kernel's arithmetic in float64: (v before quantization, s for RESIDUAL else None)."""
    g_in = x_q.numel() // gs.numel()
    x = x_q.double() * gs.double().repeat_interleave(g_in)
    y = (w_q.double() @ x) * w_scale.double()
    if slots_in is not None:
        y = y / (slots_in.double().sum() / x_q.numel() + EPS) ** 0.5
    if mode == GATED:
        n = w_q.shape[0] // 2
        g, u = y[:n], y[n:]
        return g / (1 + torch.exp(-g)) * u, None
    if mode == RESIDUAL:
        s = (y.to(torch.bfloat16).double() + residual.double()).to(torch.bfloat16).double()
        return s * nw.double(), s
    return y, None


def check(device: str) -> int:
    """Each mode on small shapes against `reference` (CPU under the interpreter, or a GPU)."""
    torch.manual_seed(0)
    k, n, group = 256, 96, 16
    ok = True
    x_q = torch.randint(-127, 128, (k,), dtype=torch.int8, device=device)
    gs = torch.rand(k // 32, device=device) * 1e-2 + 1e-3
    slots_in = torch.rand(6, device=device) * 50
    for mode, rows, rstd in ((QKV_ROWS, n, True), (RESIDUAL, n, False), (GATED, 2 * n, True)):
        w_q = torch.randint(-127, 128, (rows, k), dtype=torch.int8, device=device)
        w_s = torch.rand(rows, device=device) * 2e-3 + 1e-4
        residual = torch.randn(n, device=device).to(torch.bfloat16)
        nw = (torch.rand(n, device=device) + 0.5).to(torch.bfloat16)
        kw = dict(slots_in=slots_in if rstd else None, residual=residual, nw=nw)
        out, q, qs, slots = group_gemv(x_q, gs, w_q, w_s, mode, group, n_quant_rows=64, block_k=64, **kw)
        v, s = reference(x_q, gs, w_q, w_s, mode, group, **kw)
        quantized = 64 if mode == QKV_ROWS else n
        deq = q[:quantized].double() * qs.double().repeat_interleave(group)[:quantized]
        err = float((deq - v[:quantized]).abs().max() / v[:quantized].abs().max())
        good = err < 1.5e-2  # int8 rounding: half a step of the group's amax / 127
        if s is not None:  # within a bf16 rounding of s (the interpreter's fp32 -> bf16 cast truncates; a GPU's rounds)
            good &= torch.allclose(out.double(), s, rtol=2**-6, atol=2**-6)
            good &= torch.allclose(slots.double().sum(), (s ** 2).sum(), rtol=2**-6)
        if mode == QKV_ROWS:
            good &= torch.allclose(out.double(), v, rtol=2**-6, atol=2**-6 * float(v.abs().max()))
        print(f"mode {mode}: dequantized output vs reference, max rel err {err:.1e}", "ok" if good else "DIFFERS")
        ok &= bool(good)
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="check the kernel's modes on small shapes, no timing")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--groups", default="8,16,32", help="rows a program (the group) of every producing GEMV")
    ap.add_argument("--out", default=None, help="directory for probe_w8a8_group_quant.json")
    args = ap.parse_args()
    if args.check:
        return check("cuda" if torch.cuda.is_available() else "cpu")
    from kernel_norm import time_calls, write_gpu_report

    import mini_infer.ops  # noqa: F401  (registers torch.ops.mini_infer.*)

    ops, dev = torch.ops.mini_infer, "cuda"
    torch.manual_seed(0)
    layers = layer_weights(args.layers, dev)
    residual0 = torch.randn(1, HIDDEN, device=dev).to(torch.bfloat16)
    engine_chain = engine_chain_of(layers, residual0)

    # the four GEMVs alone: fixed quantized inputs, no quantization between them (the bound of any scheme)
    fixed = {n: ops.quantize_per_token(torch.randn(1, n, device=dev).to(torch.bfloat16), torch.int8)
             for n in (HIDDEN, INTER)}

    def gemvs_only():
        for w in layers:
            for name, k in (("qkv", HIDDEN), ("o", HIDDEN), ("gu", HIDDEN), ("down", INTER)):
                y = ops.int8_linear(*fixed[k], *w[name], None, torch.bfloat16)
        return y

    def group_chain(group: int):
        def run():
            res = residual0.view(-1)
            t = res.float() * layers[0]["nw1"].float()
            h_q = (t * 127 / t.abs().max()).round().to(torch.int8)
            h_s = (t.abs().max() / 127).expand(HIDDEN // group).contiguous()
            slots = (res.float() ** 2).sum().view(1)
            for w in layers:
                qkv, a_q, a_s, _ = group_gemv(h_q, h_s, *w["qkv"], QKV_ROWS, group, slots_in=slots,
                                              n_quant_rows=HIDDEN)
                res, h_q, h_s, slots = group_gemv(a_q[:HIDDEN], a_s[: HIDDEN // group], *w["o"], RESIDUAL, group,
                                                  residual=res, nw=w["nw2"])
                _, m_q, m_s, _ = group_gemv(h_q, h_s, *w["gu"], GATED, group, slots_in=slots)
                res, h_q, h_s, slots = group_gemv(m_q, m_s, *w["down"], RESIDUAL, group, residual=res, nw=w["nw1"])
            return qkv
        return run

    print(f"{torch.cuda.get_device_name()} | qwen2.5-7b shapes, {args.layers} layers chained in one CUDA graph (four "
          f"int8 GEMVs a layer and what quantizes between them, no attention), us a layer (median of 5)")
    rows = []
    for name, run in [("engine ops (per-token scales: 3 launches + 2 tails a layer)", engine_chain),
                      ("the four GEMVs alone (no quantization)", gemvs_only),
                      *[(f"group scales, {g} rows a program", group_chain(g)) for g in map(int, args.groups.split(","))]]:
        us = time_calls([run], 300.0, 5)[0] * 1e3 / args.layers
        print(f"  {name:62s}: {us:7.2f} us a layer")
        rows.append({"chain": name, "us_per_layer": us})
    if args.out:
        write_gpu_report(args.out, "probe_w8a8_group_quant.json", {"rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
