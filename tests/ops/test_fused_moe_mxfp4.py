"""fused_moe_mxfp4: fused_moe with MXFP4 expert weights (32 FP4 E2M1 values a power-of-two scale along K).

The format against transformers' own dequantizer of gpt-oss checkpoints (`convert_moe_packed_tensors`: nibble
order, scale bias, value table); `quantize_mxfp4` exact on MXFP4 values and nearest-value elsewhere; the Triton
kernel (interpreter on CPU) bit-equal to fused_moe_triton on the dequantized weights at the same tiles (sorted and
pair-per-block, decode and prefill tiles, fp32 and bf16, GPT-OSS's biases and SwiGLU, an expert map, a K that the
K step does not divide); the decode GEMVs (few pairs) equal to the reference to fp32 rounding, picked by shape;
the reference equal to fused_moe_reference on the dequantized weights; bad arguments named; fake and opcheck; the
kernels build for sm_90 without spills.
"""

import pytest
import torch

import mini_infer.ops  # noqa: F401  (registers torch.ops.mini_infer.*)
from mini_infer.ops._moe_gemv import GemvTile, MoeGemvConfig
from mini_infer.ops.fused_moe import GemmTile, MoeTileConfig, fused_moe_reference, fused_moe_triton
from mini_infer.ops.fused_moe_mxfp4 import (
    FP4_MAGNITUDES,
    dequantize_mxfp4,
    fused_moe_mxfp4_reference,
    fused_moe_mxfp4_triton,
    quantize_mxfp4,
)
from tests.ops.helpers import DEVICE, requires_triton

E, H, INTER = 6, 96, 64  # H = 96: a 64-wide K step leaves a 32-wide tail
DECODE = MoeTileConfig("decode", 16, GemmTile(32, 64, 1, 4, 2), GemmTile(32, 64, 1, 4, 2))
PREFILL = MoeTileConfig("prefill", 64, GemmTile(32, 32, 4, 4, 2), GemmTile(64, 64, 4, 4, 2))


def _experts(seed=0, num_experts=E, hidden=H, inter=INTER):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5
    b13 = torch.randn(num_experts, 2 * inter, generator=g)
    b2 = torch.randn(num_experts, hidden, generator=g) * 0.1
    return w13, w2, b13, b2


def _routing(tokens, top_k, seed=0):
    g = torch.Generator().manual_seed(seed)
    values, ids = torch.randn(tokens, E, generator=g).topk(top_k)
    ids = ids.to(torch.int32)
    if tokens > 2:
        ids[1, -1] = E  # a dropped slot
    return torch.softmax(values, -1), ids


# -- the format ------------------------------------------------------------------------------------------------

def test_format_is_transformers_gpt_oss_format():
    """Our blocks / scales, laid out as a gpt-oss checkpoint stores them ([.., N, K/32, 16] bytes), dequantize under
    transformers' `convert_moe_packed_tensors` to what `dequantize_mxfp4` gives."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    w = torch.randn(3, 40, 64, generator=torch.Generator().manual_seed(1))
    blocks, scales = quantize_mxfp4(w)
    assert blocks.shape == (3, 40, 32) and scales.shape == (3, 40, 2) and blocks.dtype == scales.dtype == torch.uint8
    theirs = convert_moe_packed_tensors(blocks.reshape(3, 40, 2, 16), scales, dtype=torch.float32)
    assert torch.equal(theirs.transpose(1, 2), dequantize_mxfp4(blocks, scales, torch.float32))


def test_quantize_is_exact_on_mxfp4_values_and_nearest_elsewhere():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(4, 128, generator=g) * torch.logspace(-3, 2, 4)[:, None]
    w[0, :32] = 0.0  # an all-zero group
    blocks, scales = quantize_mxfp4(w)
    deq = dequantize_mxfp4(blocks, scales, torch.float32)
    assert torch.equal(deq[0, :32], torch.zeros(32))
    step = torch.ldexp(torch.ones(scales.shape), scales.int() - 127).repeat_interleave(32, -1)
    grid = torch.tensor(FP4_MAGNITUDES)
    # each value is the FP4 value nearest to w / step, times step: no nearer one exists
    nearest = grid[((w / step).abs()[..., None] - grid).abs().argmin(-1)] * torch.sign(w)
    assert torch.equal(deq, nearest * step)
    assert ((w / step).abs() <= 6).all()  # the scale clips nothing
    again = quantize_mxfp4(deq)
    assert torch.equal(dequantize_mxfp4(*again, torch.float32), deq)  # MXFP4 values come back exactly
    for dtype in (torch.bfloat16, torch.float16):
        assert torch.equal(dequantize_mxfp4(blocks, scales, dtype).float(), deq)  # exact in 16-bit dtypes here


def test_bad_weights_are_named():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp4(torch.randn(4, 48))
    w13, w2, _, _ = _experts()
    q13, s13 = quantize_mxfp4(w13)
    q2, s2 = quantize_mxfp4(w2)
    x, (weights, ids) = torch.randn(3, H), _routing(3, 2)
    with pytest.raises(ValueError, match="w13_scales must be"):
        fused_moe_mxfp4_reference(x, weights, ids, q13, s13[:, :, :1], q2, s2)
    with pytest.raises(ValueError, match="w2_blocks must be a 3-d uint8"):
        fused_moe_mxfp4_reference(x, weights, ids, q13, s13, q2.float(), s2)
    with pytest.raises(ValueError, match="w2_blocks must be"):
        fused_moe_mxfp4_reference(x, weights, ids, q13, s13, q2[:, :, :8], s2)
    with pytest.raises(ValueError, match="topk_ids"):
        fused_moe_mxfp4_reference(x, weights, ids[:2], q13, s13, q2, s2)


# -- the op --------------------------------------------------------------------------------------------------------

VARIANTS = {"silu": (False, "silu", None), "gpt_oss": (True, "swigluoai", None), "expert_map": (False, "silu", "map")}
CASES = [  # (tokens, top_k, tiles, pair blocks, dtype, variant)
    (1, 2, DECODE, True, torch.bfloat16, "gpt_oss"), (1, 4, None, None, torch.bfloat16, "silu"),
    (5, 2, DECODE, False, torch.float32, "silu"), (5, 2, DECODE, False, torch.bfloat16, "gpt_oss"),
    (9, 1, DECODE, False, torch.float32, "gpt_oss"), (3, 2, DECODE, True, torch.float32, "expert_map"),
    (19, 2, PREFILL, False, torch.bfloat16, "gpt_oss"), (19, 2, PREFILL, False, torch.float32, "expert_map"),
]


@requires_triton
@pytest.mark.parametrize(("tokens", "top_k", "config", "pair_blocks", "dtype", "variant"), CASES,
                         ids=[f"T{c[0]}k{c[1]}-{'auto' if c[2] is None else c[2].kind}-"
                              f"{'pairs' if c[3] else 'sorted' if c[3] is False else 'auto'}-{str(c[4])[6:]}-{c[5]}"
                              for c in CASES])
def test_triton_equals_fused_moe_on_dequantized_weights(tokens, top_k, config, pair_blocks, dtype, variant):
    """The same per-pair products as fused_moe_triton over the dequantized weights at the same tiles: the same bits
    (so everything fused_moe's tests show of those carries over); and close to the reference."""
    biases, activation, emap = VARIANTS[variant]
    w13, w2, b13, b2 = _experts(seed=tokens)
    (q13, s13), (q2, s2) = quantize_mxfp4(w13), quantize_mxfp4(w2)
    d13, d2 = dequantize_mxfp4(q13, s13, dtype), dequantize_mxfp4(q2, s2, dtype)
    b13, b2 = (b13.to(dtype), b2.to(dtype)) if biases else (None, None)
    expert_map = None
    if emap:  # this rank holds global experts 2..5 as local 0..3
        expert_map = torch.tensor([-1, -1, 0, 1, 2, 3, -1, -1], dtype=torch.int32)
        q13, s13, q2, s2, d13, d2 = (t[:4].contiguous() for t in (q13, s13, q2, s2, d13, d2))
    weights, ids = _routing(tokens, top_k, seed=tokens + top_k)
    if emap:
        ids = ids % 8
    x = (torch.randn(tokens, H, generator=torch.Generator().manual_seed(3)) * 2).to(dtype)
    dev = [t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in (x, weights, ids)]
    emap_dev = None if expert_map is None else expert_map.to(DEVICE)
    tail = (activation, emap_dev, *(None if b is None else b.to(DEVICE) for b in (b13, b2)))
    mx = fused_moe_mxfp4_triton(*dev, *(t.to(DEVICE) for t in (q13, s13, q2, s2)), *tail, config=config,
                                pair_blocks=pair_blocks)
    if config is not None:  # (by shape, few pairs take the decode GEMVs: test_decode_gemvs_*)
        plain = fused_moe_triton(*dev, d13.to(DEVICE), d2.to(DEVICE), *tail, config=config, pair_blocks=pair_blocks)
        assert torch.equal(mx, plain)
    ref = fused_moe_mxfp4_reference(x, weights, ids, q13, s13, q2, s2, activation, expert_map, b13, b2)
    assert torch.equal(ref, fused_moe_reference(x, weights, ids, d13, d2, activation, expert_map, b13, b2))
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    scale = max(1.0, ref.abs().max().item())
    torch.testing.assert_close(mx.float().cpu(), ref.float(), atol=tol * scale, rtol=tol)


GEMV_SMALL = MoeGemvConfig(GemvTile(4, 64, 4, 1), GemvTile(8, 128, 4, 1))  # K steps of 8 and 16 words: H = 96 is
# 12 words (a half step masked), I = 64 is 8 (the down step half masked)
GEMV_CASES = [  # (tokens, top_k, tiles, dtype, variant)
    (1, 2, GEMV_SMALL, torch.float32, "silu"), (1, 4, None, torch.bfloat16, "gpt_oss"),
    (3, 2, GEMV_SMALL, torch.float32, "gpt_oss"), (5, 2, GEMV_SMALL, torch.bfloat16, "silu"),
    (3, 2, GEMV_SMALL, torch.float32, "expert_map"), (9, 1, "default", torch.float32, "gpt_oss"),
]


@requires_triton
@pytest.mark.parametrize(("tokens", "top_k", "config", "dtype", "variant"), GEMV_CASES,
                         ids=[f"T{c[0]}k{c[1]}-{'auto' if c[2] is None else 'default' if c[2] == 'default' else 'small'}"
                              f"-{str(c[3])[6:]}-{c[4]}" for c in GEMV_CASES])
def test_decode_gemvs_equal_the_reference(tokens, top_k, config, dtype, variant):
    """The decode GEMVs (`_mx_gemv_*`: the FP4 pairs decoded as FP16 bit patterns, one scale a word): the reference
    on the dequantized weights to fp32 rounding (each slot summed in fp32, not rounded to the dtype before the
    sum), with dropped slots, an expert map, biases and GPT-OSS's SwiGLU; at few pairs fused_moe_mxfp4 picks them
    by itself (config None: the same bits as with their tiles given)."""
    from mini_infer.ops import fused_moe_mxfp4 as fmx

    biases, activation, emap = VARIANTS[variant]
    w13, w2, b13, b2 = _experts(seed=tokens + 7)
    (q13, s13), (q2, s2) = quantize_mxfp4(w13), quantize_mxfp4(w2)
    b13, b2 = (b13.to(dtype), b2.to(dtype)) if biases else (None, None)
    expert_map = None
    if emap:  # this rank holds global experts 2..5 as local 0..3
        expert_map = torch.tensor([-1, -1, 0, 1, 2, 3, -1, -1], dtype=torch.int32)
        q13, s13, q2, s2 = (t[:4].contiguous() for t in (q13, s13, q2, s2))
    weights, ids = _routing(tokens, top_k, seed=tokens * top_k)
    if emap:
        ids = ids % 8
    x = (torch.randn(tokens, H, generator=torch.Generator().manual_seed(5)) * 2).to(dtype)
    dev = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    args = (dev(x), dev(weights), dev(ids), *(dev(t) for t in (q13, s13, q2, s2)), activation, dev(expert_map),
            dev(b13), dev(b2))
    tiles = fmx._GEMV_TILES if config in (None, "default") else config
    got = fused_moe_mxfp4_triton(*args, config=tiles)
    if config is None:
        assert fmx.mxfp4_gemv_config(tokens, top_k) == fmx._GEMV_TILES
        assert torch.equal(fused_moe_mxfp4_triton(*args), got)
    ref = fused_moe_mxfp4_reference(x.float(), weights, ids, q13, s13, q2, s2, activation, expert_map,
                                    *(None if b is None else b.float() for b in (b13, b2)))
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float().cpu(), ref, atol=tol * max(1.0, ref.abs().max().item()), rtol=tol)


@requires_triton
@pytest.mark.parametrize("shape", [(3, 40, 64), (2, 5, 96), (7, 32)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_dequantize_kernel_equals_dequantize(shape, dtype):
    """`dequantize_mxfp4_triton` (one kernel; rows not a multiple of its row block, K of 1, 3 scale groups): the
    very values of `dequantize_mxfp4`."""
    from mini_infer.ops.fused_moe_mxfp4 import dequantize_mxfp4_triton

    w = torch.randn(*shape, generator=torch.Generator().manual_seed(len(shape))) * 3
    w.view(-1)[:32] = 0.0  # an all-zero group (scale 2^0)
    blocks, scales = quantize_mxfp4(w)
    got = dequantize_mxfp4_triton(blocks.to(DEVICE), scales.to(DEVICE), dtype)
    assert got.dtype == dtype and torch.equal(got.cpu(), dequantize_mxfp4(blocks, scales, dtype))


@requires_triton
@pytest.mark.parametrize("variant", ["gpt_oss", "expert_map"])
def test_many_pairs_dequantize_then_fused_moe(monkeypatch, variant):
    """From _DEQUANT_MIN_PAIRS pairs (lowered here) the experts are dequantized and fused_moe_triton runs on them:
    its very bits on the dequantized weights."""
    from mini_infer.ops import fused_moe_mxfp4 as fmx

    monkeypatch.setattr(fmx, "_DEQUANT_MIN_PAIRS", 12)
    biases, activation, emap = VARIANTS[variant]
    w13, w2, b13, b2 = _experts(seed=11)
    (q13, s13), (q2, s2) = quantize_mxfp4(w13), quantize_mxfp4(w2)
    dtype = torch.bfloat16
    b13, b2 = (b13.to(dtype), b2.to(dtype)) if biases else (None, None)
    expert_map = None
    if emap:
        expert_map = torch.tensor([-1, -1, 0, 1, 2, 3, -1, -1], dtype=torch.int32)
        q13, s13, q2, s2 = (t[:4].contiguous() for t in (q13, s13, q2, s2))
    weights, ids = _routing(7, 2, seed=4)
    if emap:
        ids = ids % 8
    x = torch.randn(7, H, generator=torch.Generator().manual_seed(6)).to(dtype)
    dev = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    args = (dev(x), dev(weights), dev(ids), *(dev(t) for t in (q13, s13, q2, s2)), activation, dev(expert_map),
            dev(b13), dev(b2))
    monkeypatch.setattr(fmx, "_GEMV_MAX_PAIRS", 8)  # 14 pairs: past the GEMVs' (lowered) limit
    got = fused_moe_mxfp4_triton(*args)
    d13, d2 = (dequantize_mxfp4(q, s, dtype) for q, s in ((q13, s13), (q2, s2)))
    want = fused_moe_triton(args[0], args[1], args[2], dev(d13), dev(d2), activation, dev(expert_map), dev(b13),
                            dev(b2))
    assert torch.equal(got, want)
    assert torch.equal(fused_moe_mxfp4_triton(*args, config=fmx.DEQUANTIZE), want)


@requires_triton
def test_packed_views_not_word_aligned_are_read_right():
    """Packed weights whose address is not a multiple of 4 bytes (a view one byte into a buffer) are copied for the
    kernels that read them as 32-bit words: the GEMVs and the dequantizing kernel give the aligned tensors' bits."""
    from mini_infer.ops import fused_moe_mxfp4 as fmx

    w13, w2, _, _ = _experts(seed=3)
    (q13, s13), (q2, s2) = quantize_mxfp4(w13), quantize_mxfp4(w2)

    def misaligned(t):
        buf = torch.zeros(t.numel() + 1, dtype=torch.uint8, device=DEVICE)
        view = buf[1:].view(t.shape)
        view.copy_(t)
        assert view.data_ptr() % 4 != 0
        return view

    # the interpreter reads unaligned words anyway (a GPU faults): the copy itself is what is checked here
    q = q13.to(DEVICE)
    assert fmx._as_words(q) is q and fmx._as_words(misaligned(q13)).data_ptr() % 4 == 0
    weights, ids = _routing(3, 2, seed=9)
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    args = (x, weights.to(DEVICE), ids.to(DEVICE))
    aligned = fused_moe_mxfp4_triton(*args, *(t.to(DEVICE) for t in (q13, s13, q2, s2)), config=GEMV_SMALL)
    shifted = fused_moe_mxfp4_triton(*args, misaligned(q13), s13.to(DEVICE), misaligned(q2), s2.to(DEVICE),
                                     config=GEMV_SMALL)
    assert torch.equal(aligned, shifted)
    assert torch.equal(fmx.dequantize_mxfp4_triton(misaligned(q2), s2.to(DEVICE), torch.float32).cpu(),
                       dequantize_mxfp4(q2, s2, torch.float32))


def test_decode_gemvs_serve_few_pairs_only():
    from mini_infer.ops import fused_moe_mxfp4 as fmx

    assert fmx.mxfp4_gemv_config(1, 4) == fmx.mxfp4_gemv_config(8, 8) == fmx._GEMV_TILES  # 4 and 64 pairs
    assert fmx.mxfp4_gemv_config(9, 8) is None and fmx.mxfp4_gemv_config(512, 4) is None


def test_registered_op_fake_and_opcheck():
    w13, w2, b13, b2 = _experts()
    (q13, s13), (q2, s2) = quantize_mxfp4(w13), quantize_mxfp4(w2)
    x, (weights, ids) = torch.randn(4, H), _routing(4, 2)
    args = (x, weights, ids, q13, s13, q2, s2, "swigluoai", None, b13, b2, 1.702, 7.0)
    out = torch.ops.mini_infer.fused_moe_mxfp4(*args)
    assert torch.equal(out, fused_moe_mxfp4_reference(*args))
    torch.library.opcheck(torch.ops.mini_infer.fused_moe_mxfp4.default, args)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = torch.ops.mini_infer.fused_moe_mxfp4(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                                                      for a in args))
    assert fake.shape == x.shape and fake.dtype == x.dtype


def test_gpt_oss_launches_compile_sm90_without_spills():
    """Every kernel fused_moe_mxfp4_triton launches for gpt-oss-20b's experts at 1, 8, 512 and 8,192 tokens, built
    for sm_90 (no GPU needed; `python -m tests.ops.compile_fused_moe_sm90 mxfp4`): the B tile decoded in registers
    fits without spills at `mxfp4_tiles`' tiles (fused_moe's own spilled: 1,000 bytes of stack at T = 8)."""
    from tests.ops.helpers import run_uninterpreted

    report = run_uninterpreted(["-m", "tests.ops.compile_fused_moe_sm90", "mxfp4"])
    for case in report["cases"]:
        assert "STACK:0 " in case["resources"] and "LOCAL:0 " in case["resources"], (report["triton"], case)
    gemms = [c for c in report["cases"] if c["kernel"] == "_moe_mxfp4_gemm_kernel"]
    assert sorted((c["tokens"], c["gated"]) for c in gemms) == [(t, g) for t in (1, 8, 512, 8192) for g in (False, True)]
    assert all(c["block_k"] <= 64 and c["block_n"] <= 128 for c in gemms)


@pytest.mark.parametrize(("path", "kernels"), [
    ("gemv", [(t, k) for t in (1, 8) for k in ("_mx_gemv_down_kernel", "_mx_gemv_gate_up_kernel")]),
    ("dequant", [(2048, "_mx_dequant_kernel")] * 2)])
def test_gpt_oss_gemvs_and_dequantize_compile_sm90_without_spills(path, kernels):
    """The decode GEMVs as fused_moe_mxfp4_triton launches them for gpt-oss-20b at 1 and 8 tokens (4 and 32
    pairs), and its dequantizing kernel at 2,048 tokens (w13, then w2), built for sm_90 (`python -m
    tests.ops.compile_fused_moe_sm90 mxfp4 gemv` / `dequant`): no spills."""
    from tests.ops.helpers import run_uninterpreted

    report = run_uninterpreted(["-m", "tests.ops.compile_fused_moe_sm90", "mxfp4", path])
    assert sorted((c["tokens"], c["kernel"]) for c in report["cases"]) == kernels
    for case in report["cases"]:
        assert "STACK:0 " in case["resources"] and "LOCAL:0 " in case["resources"], (report["triton"], case)
