"""int8_linear / w8a8_linear: exact int32 GEMM, the fp32 epilogue, Triton vs reference, and the same bits for a
row whatever the M bucket (the one-row GEMV, decode tile, mid and large GEMM tiles)."""

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import mini_infer.ops  # noqa: F401  (registers torch.ops.mini_infer.*)
from mini_infer.ops import int8_linear as il
from mini_infer.ops.quant import quantize_per_token_reference
from tests.ops.helpers import DEVICE, requires_triton

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ROWS = [1, 3, 17, 64]
INTERPRETED = DEVICE == "cpu"
# one unit in the last place of each output dtype, relative: how far the kernel's fp32 epilogue (FMA
# contraction on a GPU, bf16 truncation under the interpreter) may move an output from the reference's
ULP = {torch.float32: 2.0**-22, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


def make_weights(n: int, k: int, seed: int = 0, bias_dtype=None):
    g = torch.Generator().manual_seed(seed)
    w_q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    w_scale = torch.rand(n, generator=g) * 0.01 + 1e-4
    bias = torch.randn(n, generator=g).to(bias_dtype) if bias_dtype is not None else None
    return w_q.to(DEVICE), w_scale.to(DEVICE), bias.to(DEVICE) if bias is not None else None


def quantized_x(m: int, k: int, dtype, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * torch.logspace(-2, 2, m)[:, None]).to(dtype)
    if m >= 3:
        x[1] = 0.0  # a zero row: its output is the bias
    x_q, x_scale = quantize_per_token_reference(x, torch.int8)
    return x.to(DEVICE), x_q.to(DEVICE), x_scale.to(DEVICE)


def assert_epilogue_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Same int32 accumulator, epilogue within one ulp of the output dtype (bit-identical under the
    interpreter for fp32/fp16 outputs: no FMA there, and numpy rounds those casts to nearest)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    got, want = got.cpu(), want.cpu()
    if INTERPRETED and got.dtype != torch.bfloat16:
        assert torch.equal(got, want)
    else:  # one ulp of the largest output: FMA moves a sum that cancels by an ulp of its larger terms
        want = want.float()
        torch.testing.assert_close(got.float(), want, rtol=ULP[got.dtype], atol=ULP[got.dtype] * float(want.abs().max()))


def test_int8_matmul_exact_at_the_extremes():
    k = 300
    a = torch.full((2, k), -128, dtype=torch.int8)
    w = torch.full((3, k), -128, dtype=torch.int8)
    w[1] = 127
    got = il.int8_matmul_exact(a, w)
    assert got.dtype == torch.int32
    assert torch.equal(got, (a.long() @ w.long().t()).int())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_reference_matches_dequantized_float_linear(dtype, bias):
    """x_q * x_scale @ (w_q * w_scale).T + bias, computed in float64, within the epilogue's rounding."""
    w_q, w_scale, b = make_weights(24, 80, bias_dtype=dtype if bias else None)
    _, x_q, x_scale = quantized_x(5, 80, dtype)
    got = il.int8_linear_reference(x_q.cpu(), x_scale.cpu(), w_q.cpu(), w_scale.cpu(),
                                   b.cpu() if bias else None, dtype)
    want = (x_q.cpu().double() * x_scale.cpu().double()) @ (w_q.cpu().double() * w_scale.cpu().double()[:, None]).t()
    if bias:
        want += b.cpu().double()
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want, rtol=2 * ULP[dtype], atol=1e-6)


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("bias", [False, True])
def test_triton_matches_reference(dtype, m, bias):
    w_q, w_scale, b = make_weights(40, 96, seed=m, bias_dtype=dtype if bias else None)
    _, x_q, x_scale = quantized_x(m, 96, dtype, seed=m)
    got = il.int8_linear_triton(x_q, x_scale, w_q, w_scale, b, dtype)
    want = il.int8_linear_reference(x_q.cpu(), x_scale.cpu(), w_q.cpu(), w_scale.cpu(),
                                    b.cpu() if bias else None, dtype)
    assert_epilogue_close(got, want)
    if m >= 3:  # the zero row: exactly the bias (or zero)
        assert torch.equal(got[1].cpu(), b.cpu() if bias else torch.zeros(40, dtype=dtype))


@requires_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_same_bits_for_every_m_bucket(dtype):
    """Rows computed alone (M = 1, decode tile), in batches of 3, 17 and 130 (the mid GEMM tiles) and 300 (the
    large tile): identical outputs, so greedy decoding does not depend on the batch bucket. K = 200 is not a
    multiple of any tile's K step (masked tail) and N = 33 not of any N tile."""
    w_q, w_scale, b = make_weights(33, 200, seed=5, bias_dtype=dtype)
    _, x_q, x_scale = quantized_x(300, 200, dtype, seed=6)
    full = il.int8_linear_triton(x_q, x_scale, w_q, w_scale, b, dtype)
    assert len({il.scaled_mm_config(m) for m in (1, 17, 130, 300)}) == 4  # four different tiles
    for m in (1, 3, 17, 130):
        part = il.int8_linear_triton(x_q[:m], x_scale[:m], w_q, w_scale, b, dtype)
        assert torch.equal(part, full[:m]), m
    alone = torch.cat([il.int8_linear_triton(x_q[i : i + 1], x_scale[i : i + 1], w_q, w_scale, b, dtype)
                       for i in (0, 64, 299)])
    assert torch.equal(alone, full[[0, 64, 299]])


@requires_triton
@pytest.mark.parametrize(("n", "k"), [(33, 200), (7, 203), (130, 1500)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_same_bits_as_the_tile(n, k, bias):
    """The one-row GEMV gives the skinny tile's bits (same exact int32, same epilogue), read as int32 words
    (K % 4 == 0) or byte by byte (K = 203, a row that starts at an odd address, or pack_int8=False); N and K
    divide no tile, and the operands' extremes (-128 * -128 over half a row) stay exact."""
    w_q, w_scale, b = make_weights(n, k, seed=n, bias_dtype=torch.bfloat16 if bias else None)
    _, x_q, x_scale = quantized_x(1, k, torch.bfloat16, seed=k)
    w_q[0], x_q[0, : k // 2] = -128, -128
    w_q[1] = 127
    odd = torch.zeros(k + 1, dtype=torch.int8, device=DEVICE)[1:]
    odd.copy_(x_q[0])
    assert il._packs_int8(x_q[0], w_q) == (k % 4 == 0) and not il._packs_int8(odd, w_q)
    for out_dtype in (torch.bfloat16, torch.float32):  # fp32: the epilogue's every bit shows
        tile = il.scaled_mm_triton(x_q, x_scale, w_q, w_scale, b, out_dtype, il.scaled_mm_config(1))
        want = il.int8_linear_reference(x_q.cpu(), x_scale.cpu(), w_q.cpu(), w_scale.cpu(), b.cpu() if bias else None,
                                        out_dtype)
        assert_epilogue_close(tile, want)
        for x, pack in ((x_q, True), (x_q, False), (odd[None], True)):
            got = il.scaled_gemv_triton(x, x_scale, w_q, w_scale, b, out_dtype, pack_int8=pack)
            assert torch.equal(got, tile), (out_dtype, pack, x.data_ptr() % 4)


@requires_triton
@pytest.mark.parametrize(("n", "k"), [(33, 200), (130, 1500)])
@pytest.mark.parametrize("split", [2, 3, 8])
def test_split_tensor_core_gemv(n, k, split):
    """The fp8 tensor-core GEMV (FP8_GEMV "dot") with K cut into splits (more splits than K has steps included: the
    empty ones add zero) gives the unsplit GEMV's products up to the fp32 sums' order, at 64-row tiles (weights as A)
    and 32-row ones (x as A), the same bits on a second call; every counter it used is zero again after it."""
    from mini_infer.ops._split_k import split_counters

    fp8 = torch.float8_e4m3fn
    g = torch.Generator().manual_seed(n + split)
    w_q = (torch.randn(n, k, generator=g) * 40).to(fp8).to(DEVICE)
    x_q = (torch.randn(1, k, generator=g) * 40).to(fp8).to(DEVICE)
    w_scale, x_scale = (torch.rand(n, generator=g) * 0.01 + 1e-4).to(DEVICE), torch.full((1, 1), 0.02, device=DEVICE)
    b = torch.randn(n, generator=g).to(DEVICE)
    exact = il.scaled_linear_reference("t", fp8, x_q.cpu(), x_scale.cpu(), w_q.cpu(), w_scale.cpu(), b.cpu(),
                                       torch.float32)
    for block_n in (64, 32):
        whole = il.scaled_gemv_triton(x_q, x_scale, w_q, w_scale, b, torch.float32, (block_n, 64, 4, 2),
                                      fp8_gemv="dot")
        first = il.scaled_gemv_triton(x_q, x_scale, w_q, w_scale, b, torch.float32, (block_n, 64, 4, 2, split),
                                      fp8_gemv="dot")
        again = il.scaled_gemv_triton(x_q, x_scale, w_q, w_scale, b, torch.float32, (block_n, 64, 4, 2, split),
                                      fp8_gemv="dot")
        assert torch.equal(first, again)
        # Hopper's wgmma adds fp8 products in fewer bits than fp32 within a BLOCK_K step (int8_linear.FP8_DOT)
        atol = (1e-5 if INTERPRETED else 2e-3) * float(exact.abs().max())
        for got in (whole, first):
            torch.testing.assert_close(got.cpu(), exact, rtol=0, atol=atol)
        assert not split_counters(first.device, 1).any()


@requires_triton
@pytest.mark.parametrize("split", [1, 3])
def test_gemv_program_says_which_programs_stored(split):
    """`scaled_gemv_program`'s flag, which kernels built on it (linear_add_rms_norm.py's) use to count only the
    programs that stored outputs: every program without splits, exactly one split of each row block with them (fp8
    operands on tensor cores, the GEMV that splits)."""
    import triton
    import triton.language as tl

    from mini_infer.ops._split_k import split_counters

    @triton.jit
    def flagging_kernel(x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, b_ptr, y_ptr, N, K, stride_wn, ws_ptr, cnt_ptr,
                        flags_ptr, HAS_BIAS: tl.constexpr, ACC_DTYPE: tl.constexpr, PACKED: tl.constexpr,
                        ASM: tl.constexpr, DOT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        USE_GDC: tl.constexpr, SPLIT_K: tl.constexpr = 1):  # fmt: skip
        stored = il.scaled_gemv_program(x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, b_ptr, y_ptr, N, K, stride_wn, ws_ptr,
                                        cnt_ptr, HAS_BIAS, ACC_DTYPE, PACKED, ASM, DOT, BLOCK_N, BLOCK_K, USE_GDC,
                                        SPLIT_K)
        tl.store(flags_ptr + tl.program_id(0) * SPLIT_K + tl.program_id(1), stored.to(tl.int32))

    n, k = 130, 1500
    w_q, w_scale, _ = make_weights(n, k, seed=3)
    _, x_q, x_scale = quantized_x(1, k, torch.bfloat16, seed=4)
    w_q, x_q = w_q.to(torch.float8_e4m3fn), x_q.to(torch.float8_e4m3fn)
    blocks = -(-n // 64)
    flags = torch.full((blocks * split,), -1, dtype=torch.int32, device=DEVICE)
    y = torch.empty(n, dtype=torch.float32, device=DEVICE)
    il.launch_scaled_gemv(flagging_kernel, x_q, x_scale, w_q, w_scale, None, y, flags, config=(64, 64, 4, 2, split),
                          fp8_gemv="dot")
    assert flags.view(blocks, split).sum(1).tolist() == [1] * blocks
    assert torch.equal(y, il.scaled_gemv_triton(x_q, x_scale, w_q, w_scale, None, torch.float32,
                                                (64, 64, 4, 2, split), fp8_gemv="dot")[0])
    assert not split_counters(y.device, 1 + blocks).any()


@requires_triton
def test_gemv_split_rule(monkeypatch):
    """`gemv_split_k`: a config's fifth element wins; else no split off CUDA, with GEMV_DOT_SPLIT_PER_SM at 0, or for
    launches of enough row blocks; otherwise a power of two keeping within that many programs per SM, capped so that
    each split keeps GEMV_DOT_MIN_SPLIT_STEPS steps of BLOCK_K: the largest power of two within both."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(il, "num_sms", lambda index: 132)
    assert il.gemv_split_k(3584, 18944, (64, 256, 4, 4, 3), torch.device("cpu")) == 3
    monkeypatch.setattr(il, "GEMV_DOT_SPLIT_PER_SM", 0)
    assert il.gemv_split_k(3584, 18944, (64, 256, 4, 4), cuda) == 1
    monkeypatch.setattr(il, "GEMV_DOT_SPLIT_PER_SM", 3)
    monkeypatch.setattr(il, "GEMV_DOT_MIN_SPLIT_STEPS", 4)
    assert il.gemv_split_k(3584, 18944, (64, 128, 4, 4), torch.device("cpu")) == 1
    assert il.gemv_split_k(3584, 18944, (64, 128, 4, 4), cuda) == 4  # 56 blocks: 396 / 56 = 7 -> 4
    assert il.gemv_split_k(4608, 3584, (64, 128, 4, 4), cuda) == 4  # 72 blocks: 5 -> 4
    assert il.gemv_split_k(3584, 3584, (64, 256, 4, 4), cuda) == 2  # 3584 / (4 x 256): 3 steps -> 2
    assert il.gemv_split_k(37888, 3584, (64, 128, 4, 4), cuda) == 1  # 592 blocks
    assert il.gemv_split_k(3584, 512, (64, 128, 4, 4), cuda) == 1  # one split's worth of steps


@requires_triton
def test_gemv_taken_for_one_row_only(monkeypatch):
    """int8_linear runs the GEMV for one row ([1, 1, K] packed or [K]) and the tile for more rows."""
    calls = []
    real = il.scaled_gemv_triton
    monkeypatch.setattr(il, "scaled_gemv_triton", lambda *a, **kw: calls.append(tuple(a[0].shape)) or real(*a, **kw))
    w_q, w_scale, b = make_weights(24, 64, bias_dtype=torch.float32)
    _, x_q, x_scale = quantized_x(3, 64, torch.float32)
    for m in (1, 2, 3):
        got = il.int8_linear_triton(x_q[None, :m], x_scale[None, :m], w_q, w_scale, b, torch.float32)
        assert torch.equal(got[0], il.scaled_mm_triton(x_q[:m], x_scale[:m], w_q, w_scale, b, torch.float32))
    il.int8_linear_triton(x_q[0], x_scale[0], w_q, w_scale, b, torch.float32)
    assert calls == [(1, 1, 64), (64,)]
    assert il.takes_scaled_gemv(1, 64, 24) and not il.takes_scaled_gemv(2, 64, 24)
    assert not il.takes_scaled_gemv(1, 0, 24) and not il.takes_scaled_gemv(1, 64, 0)  # empty: the tile's special case


@requires_triton
@pytest.mark.parametrize("m", [1, 5])
def test_split_k_same_bits_and_workspace_left_clean(m):
    """Split-K (int32 partials added atomically, the last split runs the epilogue) gives the bits of the
    unsplit tile, also on a second call (the workspace and counters are zeroed again by the kernel)."""
    w_q, w_scale, b = make_weights(40, 200, seed=9, bias_dtype=torch.bfloat16)
    _, x_q, x_scale = quantized_x(m, 200, torch.bfloat16, seed=10)
    plain = il.scaled_mm_triton(x_q, x_scale, w_q, w_scale, b, torch.bfloat16, (16, 32, 64, 1, 4, 2, 1))
    for _ in range(2):
        split = il.scaled_mm_triton(x_q, x_scale, w_q, w_scale, b, torch.bfloat16, (16, 32, 64, 1, 4, 2, 3))
        assert torch.equal(split, plain)
    ws, cnt = il._SPLIT_K_WORKSPACE[split.device]
    assert not ws.any() and not cnt.any()


@requires_triton
def test_triton_packed_layout_and_strided_rows():
    """[1, T, K] packed activations, and x_q rows that are a strided view, give [1, T, N]."""
    w_q, w_scale, _ = make_weights(16, 64, seed=2)
    _, x_q, x_scale = quantized_x(6, 64, torch.float16, seed=3)
    want = il.int8_linear_reference(x_q.cpu(), x_scale.cpu(), w_q.cpu(), w_scale.cpu(), None, torch.float16)
    got = il.int8_linear_triton(x_q[None], x_scale[None], w_q, w_scale, None, torch.float16)
    assert got.shape == (1, 6, 16)
    assert_epilogue_close(got[0], want)
    wide = torch.zeros(6, 128, dtype=torch.int8, device=DEVICE)
    wide[:, 32:96] = x_q
    assert_epilogue_close(il.int8_linear_triton(wide[:, 32:96], x_scale, w_q, w_scale, None, torch.float16), want)


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 17])
def test_w8a8_linear_triton_and_accuracy(dtype, m):
    """quantize + GEMM as one call: Triton vs reference, and close to the float linear it replaces."""
    g = torch.Generator().manual_seed(m)
    w = torch.randn(48, 128, generator=g) / 128**0.5
    w_scale = w.abs().amax(1) / 127
    w_q = (w / w_scale[:, None]).round().to(torch.int8)
    x = torch.randn(m, 128, generator=g).to(dtype)
    b = torch.randn(48, generator=g).to(dtype)
    want = il.w8a8_linear_reference(x, w_q, w_scale, b)
    got = il.w8a8_linear_triton(x.to(DEVICE), w_q.to(DEVICE), w_scale.to(DEVICE), b.to(DEVICE))
    assert got.dtype == dtype
    assert_epilogue_close(got, want)
    exact = F.linear(x.double(), (w_q.double() * w_scale.double()[:, None]), b.double())
    rel = (want.double() - exact).norm() / exact.norm()
    assert rel < 0.02  # int8 activations: ~0.5% error per product, averaging down


def test_errors_name_the_field_and_limit():
    w_q, w_scale, _ = make_weights(8, 32)
    _, x_q, x_scale = quantized_x(2, 32, torch.float32)
    args = (x_q.cpu(), x_scale.cpu(), w_q.cpu(), w_scale.cpu(), None, torch.float32)
    with pytest.raises(ValueError, match="x_scale must be fp32"):
        il.int8_linear_reference(args[0], args[1].half(), *args[2:])
    with pytest.raises(ValueError, match="w_q"):
        il.int8_linear_reference(args[0], args[1], args[2][:, :16], *args[3:])
    with pytest.raises(ValueError, match="must be int8"):
        il.int8_linear_reference(args[0].float(), *args[1:])
    k = il.INT8_MAX_K + 1
    with pytest.raises(ValueError, match="INT8_MAX_K"):
        il.int8_linear_reference(torch.zeros(1, k, dtype=torch.int8), torch.ones(1, 1),
                                 torch.zeros(1, k, dtype=torch.int8), torch.ones(1), None, torch.float32)


def test_registered_ops_and_fakes():
    w_q, w_scale, b = make_weights(8, 32, bias_dtype=torch.bfloat16)
    x, x_q, x_scale = quantized_x(3, 32, torch.bfloat16)
    w_q, w_scale, b, x, x_q, x_scale = (t.cpu() for t in (w_q, w_scale, b, x, x_q, x_scale))
    ops = torch.ops.mini_infer
    assert torch.equal(ops.int8_linear(x_q, x_scale, w_q, w_scale, b, torch.bfloat16),
                       il.int8_linear_reference(x_q, x_scale, w_q, w_scale, b, torch.bfloat16))
    assert torch.equal(ops.w8a8_linear(x, w_q, w_scale, b), il.w8a8_linear_reference(x, w_q, w_scale, b))
    with FakeTensorMode():
        xq = torch.empty(1, 7, 64, dtype=torch.int8)
        xs = torch.empty(1, 7, 1, dtype=torch.float32)
        wq = torch.empty(96, 64, dtype=torch.int8)
        ws = torch.empty(96, dtype=torch.float32)
        out = ops.int8_linear(xq, xs, wq, ws, None, torch.float16)
        assert out.shape == (1, 7, 96) and out.dtype == torch.float16
        out = ops.w8a8_linear(torch.empty(1, 7, 64, dtype=torch.bfloat16), wq, ws, None)
        assert out.shape == (1, 7, 96) and out.dtype == torch.bfloat16
        with pytest.raises(ValueError, match="w_scale"):
            ops.int8_linear(xq, xs, wq, torch.empty(95), None, torch.float16)


def test_opcheck():
    w_q, w_scale, b = make_weights(8, 32, bias_dtype=torch.float32)
    x, x_q, x_scale = quantized_x(3, 32, torch.float32)
    w_q, w_scale, b, x, x_q, x_scale = (t.cpu() for t in (w_q, w_scale, b, x, x_q, x_scale))
    torch.library.opcheck(torch.ops.mini_infer.int8_linear.default, (x_q, x_scale, w_q, w_scale, b, torch.float32))
    torch.library.opcheck(torch.ops.mini_infer.w8a8_linear.default, (x, w_q, w_scale, None))
