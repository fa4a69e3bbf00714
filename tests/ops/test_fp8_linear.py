"""fp8_linear / fp8_w8a8_linear: the dequantizing reference, the Triton kernels (the one-row GEMV and the tile;
interpreter here, and on GPUs with FP8), torch._scaled_mm on GPUs, the capability check, fakes and opcheck."""

import os

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import mini_infer.ops  # noqa: F401  (registers torch.ops.mini_infer.*)
from mini_infer.ops import fp8_linear as fl
from mini_infer.ops.quant import quantize_per_token_reference
from tests.ops.helpers import DEVICE, ROOT, TOL, requires_triton, run_uninterpreted

FP8 = torch.float8_e4m3fn
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ROWS = [1, 3, 17, 64]
HAS_FP8_GPU = torch.cuda.is_available() and fl.fp8_supported("cuda")


def make_weights(n: int, k: int, seed: int = 0, bias_dtype=None):
    """Per-output-channel fp8 weights of a random float matrix: (w_q, w_scale, bias)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) / k**0.5
    w_q, w_scale = quantize_per_token_reference(w, FP8)  # rowwise = per output channel
    bias = torch.randn(n, generator=g).to(bias_dtype) if bias_dtype is not None else None
    return w_q, w_scale.view(n), bias


def quantized_x(m: int, k: int, dtype, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * torch.logspace(-2, 2, m)[:, None]).to(dtype)
    if m >= 3:
        x[1] = 0.0
    return (x, *quantize_per_token_reference(x, FP8))


def on(device, *ts):
    return [t.to(device) if t is not None else None for t in ts]


def assert_fp32_acc_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32 accumulation in another order (tensor cores on a GPU): the output dtype's tolerance, relative to
    the output's largest magnitude (an output near zero is a cancellation of much larger products)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    atol, rtol = TOL[want.dtype]
    want = want.cpu().float()
    torch.testing.assert_close(got.cpu().float(), want, atol=atol + rtol * float(want.abs().max()), rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
def test_reference_is_the_dequantized_product(dtype, bias):
    w_q, w_scale, b = make_weights(24, 80, bias_dtype=dtype if bias else None)
    _, x_q, x_scale = quantized_x(5, 80, dtype)
    got = fl.fp8_linear_reference(x_q, x_scale, w_q, w_scale, b, dtype)
    want = (x_q.double() * x_scale.double()) @ (w_q.double() * w_scale.double()[:, None]).t()
    if bias:
        want += b.double()
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want, rtol=TOL[dtype][1], atol=1e-5)
    assert (got[1] == (b if bias else torch.zeros(24, dtype=dtype))).all()  # the zero row


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("bias", [False, True])
def test_triton_matches_reference(dtype, m, bias):
    w_q, w_scale, b = make_weights(40, 96, seed=m, bias_dtype=dtype if bias else None)
    _, x_q, x_scale = quantized_x(m, 96, dtype, seed=m)
    want = fl.fp8_linear_reference(x_q, x_scale, w_q, w_scale, b, dtype)
    if DEVICE == "cuda" and not HAS_FP8_GPU:
        pytest.skip("this GPU has no FP8 (see test_capability_check)")
    got = fl.fp8_linear_triton(*on(DEVICE, x_q, x_scale, w_q, w_scale, b), dtype)
    assert_fp32_acc_close(got, want)


@requires_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_kernel_every_tile(dtype):
    """The Triton kernel itself (what CUDA runs for M <= FP8_TRITON_MAX_M, and where _scaled_mm cannot)
    at M buckets of all four tiles, with a K tail (200) and an N tail (33)."""
    if DEVICE == "cuda" and not HAS_FP8_GPU:
        pytest.skip("this GPU has no FP8")
    from mini_infer.ops.int8_linear import scaled_mm_config, scaled_mm_triton

    w_q, w_scale, b = make_weights(33, 200, seed=4, bias_dtype=dtype)
    _, x_q, x_scale = quantized_x(300, 200, dtype, seed=5)
    want = fl.fp8_linear_reference(x_q, x_scale, w_q, w_scale, b, dtype)
    for m in (1, 17, 130, 300):
        assert_fp32_acc_close(scaled_mm_triton(*on(DEVICE, x_q[:m], x_scale[:m], w_q, w_scale, b), dtype), want[:m])
    assert len({scaled_mm_config(m, fp8=True) for m in (1, 17, 130, 300)}) == 4


@requires_triton
@pytest.mark.parametrize(("n", "k"), [(33, 200), (7, 203), (130, 1500), (5, 8200)])  # 8200: the long-K tile
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_reference(n, k, bias):
    """The one-row GEMV (fp32 sums of exact fp8 products, in another order than the reference's): within the
    fp32 accumulation tolerance, for N and K that divide no tile (both default tiles) and with and without a bias."""
    if DEVICE == "cuda" and not HAS_FP8_GPU:
        pytest.skip("this GPU has no FP8")
    from mini_infer.ops.int8_linear import scaled_gemv_triton

    w_q, w_scale, b = make_weights(n, k, seed=n, bias_dtype=torch.float32 if bias else None)
    _, x_q, x_scale = quantized_x(1, k, torch.float32, seed=k)
    for out_dtype in (torch.float32, torch.bfloat16):
        want = fl.fp8_linear_reference(x_q, x_scale, w_q, w_scale, b, out_dtype)
        assert_fp32_acc_close(scaled_gemv_triton(*on(DEVICE, x_q, x_scale, w_q, w_scale, b), out_dtype), want)


@requires_triton
@pytest.mark.parametrize(("n", "k"), [(33, 200), (7, 203), (130, 1500)])
@pytest.mark.parametrize("bias", [False, True])
def test_dot_gemv_matches_reference(n, k, bias):
    """The tensor-core GEMV (fp8_gemv="dot"): within the fp32 accumulation tolerance of the reference, at its
    default tile (weights as the dot's A, x padded to a B tile), a tile with fewer rows than DOT_ROWS (x padded to
    an A tile, weights as B), and one whose K step is one mma's K; N odd or not a multiple of the tile, K not a
    multiple of the K step, x of shape [1, K] and [K]."""
    if DEVICE == "cuda" and not HAS_FP8_GPU:
        pytest.skip("this GPU has no FP8")
    from mini_infer.ops import int8_linear as il

    w_q, w_scale, b = make_weights(n, k, seed=n, bias_dtype=torch.bfloat16 if bias else None)
    _, x_q, x_scale = quantized_x(1, k, torch.float32, seed=k)
    args = on(DEVICE, x_q, x_scale, w_q, w_scale, b)
    assert il.SCALED_GEMV_CONFIG_FP8_DOT[0] >= il.DOT_ROWS  # the default tile is the weights-as-A layout
    for config in (None, (16, 64, 4, 2), (64, 32, 4, 1)):
        for out_dtype in (torch.float32, torch.bfloat16):
            want = fl.fp8_linear_reference(x_q, x_scale, w_q, w_scale, b, out_dtype)
            got = il.scaled_gemv_triton(*args, out_dtype, config, fp8_gemv="dot")
            assert_fp32_acc_close(got, want)
    got = il.scaled_gemv_triton(args[0][0], *args[1:], torch.float32, fp8_gemv="dot")
    assert_fp32_acc_close(got, fl.fp8_linear_reference(x_q[0], x_scale[0], w_q, w_scale, b, torch.float32))


# e4m3 bytes the bit-operation unpacking must get right: zero, negative zero, the smallest and largest denormals of
# both signs, the smallest normal, 1.0, and +-448 (the largest finite)
SPECIAL_E4M3 = (0x00, 0x80, 0x01, 0x81, 0x04, 0x07, 0x87, 0x08, 0x88, 0x38, 0x7E, 0xFE)


def with_special_bytes(t: torch.Tensor, seed: int) -> torch.Tensor:
    """fp8 `t` with every fifth element (from a seed-dependent offset) replaced by SPECIAL_E4M3's bytes in turn."""
    b = t.view(torch.uint8).clone().reshape(-1)
    idx = torch.arange(seed % 5, b.numel(), 5)
    b[idx] = torch.tensor(SPECIAL_E4M3, dtype=torch.uint8).repeat(-(-idx.numel() // len(SPECIAL_E4M3)))[:idx.numel()]
    return b.view(FP8).reshape(t.shape)


def special_operands(n: int, k: int, seed: int, bias: bool):
    """One fp8 row x [1, K] and weights [N, K] of wide magnitudes with SPECIAL_E4M3 bytes among them, their fp32
    scales, a bias or None."""
    g = torch.Generator().manual_seed(seed)
    x_q = with_special_bytes((torch.randn(1, k, generator=g) * 100).clamp(-448, 448).to(FP8), seed)
    w_q = with_special_bytes((torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(FP8), seed + 1)
    x_scale = torch.rand(1, 1, generator=g) * 0.01 + 0.001
    w_scale = torch.rand(n, generator=g) * 0.01 / k**0.5 + 1e-4
    return x_q, x_scale, w_q, w_scale, torch.randn(n, generator=g) if bias else None


def assert_same_sums(got: torch.Tensor, want: torch.Tensor) -> None:
    """The same bits under the interpreter (same additions in the same order); on a GPU, where the row sum's reduction
    tree may follow another layout, within the fp32 accumulation tolerance."""
    if DEVICE == "cpu":
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    else:
        assert_fp32_acc_close(got, want)


def record_packed(monkeypatch) -> list:
    """The PACKED flag of every W8A8 GEMV launch from now on (each still runs), in order."""
    from mini_infer.ops import int8_linear as il

    packed = []
    real = il.launch_gemv
    monkeypatch.setattr(il, "launch_gemv", lambda *a, **kw: packed.append(kw["PACKED"]) or real(*a, **kw))
    return packed


# (N, K, tile or None for the default, whether the row packs into words): N not a multiple of BLOCK_N (4), K not a
# multiple of the K step; K 8,200 takes the long-K tile, K 203 (not a multiple of 4) the cvt path whatever the switch
UNPACK_CASES = [(7, 200, (4, 64, 4, 1), True), (130, 1500, None, True), (33, 8200, None, True),
                (6, 1028, (2, 256, 4, 1), True), (7, 203, None, False)]


@requires_triton
@pytest.mark.parametrize(("n", "k", "config", "packs"), UNPACK_CASES)
@pytest.mark.parametrize("bias", [False, True])
def test_unpacked_fp8_gemv_equals_the_cvt_path(monkeypatch, n, k, config, packs, bias):
    """FP8_UNPACK (read at the launch): the CUDA-core fp8 GEMV unpacking int32 words by bit operations gives the cvt
    path's outputs (`assert_same_sums`), weights and x with e4m3 denormals, zeros, negative zeros and +-448 among
    them, and the reference's within the fp32 accumulation tolerance; rows that do not pack into words (K % 4) keep
    the cvt path."""
    if DEVICE == "cuda" and not HAS_FP8_GPU:
        pytest.skip("this GPU has no FP8")
    from mini_infer.ops import int8_linear as il

    ops = special_operands(n, k, seed=n + k, bias=bias)
    args = on(DEVICE, *ops)
    packed = record_packed(monkeypatch)
    for out_dtype in (torch.float32, torch.bfloat16):
        monkeypatch.setattr(il, "FP8_UNPACK", False)
        off = il.scaled_gemv_triton(*args, out_dtype, config, fp8_gemv="cuda-cores")
        monkeypatch.setattr(il, "FP8_UNPACK", True)
        got = il.scaled_gemv_triton(*args, out_dtype, config, fp8_gemv="cuda-cores")
        assert_same_sums(got, off)
        assert_fp32_acc_close(got, fl.fp8_linear_reference(*ops, out_dtype))
    assert packed == [False, packs] * 2


@requires_triton
def test_unpacked_fp8_gemv_switch_and_argument(monkeypatch):
    """fp8_linear's one-row path with a long row (FP8_GEMV "auto": CUDA cores) follows FP8_UNPACK at each call, and
    scaled_gemv_triton's `fp8_unpack` overrides it; short rows ("auto": tensor cores) and int8 never unpack fp8."""
    if DEVICE == "cuda" and not HAS_FP8_GPU:
        pytest.skip("this GPU has no FP8")
    from mini_infer.ops import int8_linear as il

    ops = special_operands(5, 8196, seed=3, bias=True)
    args = on(DEVICE, *ops)
    packed = record_packed(monkeypatch)
    assert il.FP8_UNPACK is False  # the default (MINI_INFER_FP8_UNPACK unset)
    off = fl.fp8_linear_triton(*args, torch.float32)
    monkeypatch.setattr(il, "FP8_UNPACK", True)
    assert_same_sums(fl.fp8_linear_triton(*args, torch.float32), off)
    assert_same_sums(il.scaled_gemv_triton(*args, torch.float32, fp8_unpack=False), off)
    monkeypatch.setattr(il, "FP8_UNPACK", False)
    assert_same_sums(il.scaled_gemv_triton(*args, torch.float32, fp8_unpack=True), off)
    assert packed == [False, True, False, True]
    assert not il.fp8_unpacks(FP8, 64, fp8_unpack=True)  # "auto" at K 64: tensor cores
    assert il.fp8_unpacks(FP8, 64, "cuda-cores", True) and not il.fp8_unpacks(torch.int8, 64, "cuda-cores", True)


@requires_triton
@pytest.mark.parametrize(("n", "k", "packs"), [(42, 8200, True), (130, 1000, True), (9, 203, False)])
def test_unpacked_fp8_gemv_in_the_fused_add_rms_norm(monkeypatch, n, k, packs):
    """linear_add_rms_norm.py's fused o_proj / down_proj + add + rms_norm + quantization kernel runs the same GEMV body
    (`launch_scaled_gemv`): with FP8_UNPACK its outputs are the cvt path's (`assert_same_sums`; the quantized row
    follows from the same sums) and close to the reference's."""
    if DEVICE == "cuda" and not HAS_FP8_GPU:
        pytest.skip("this GPU has no FP8")
    from mini_infer.ops import int8_linear as il
    from mini_infer.ops import linear_add_rms_norm as lar

    monkeypatch.setattr(il, "FP8_GEMV", "cuda-cores")
    x_q, x_scale, w_q, w_scale, b = special_operands(n, k, seed=k, bias=True)
    g = torch.Generator().manual_seed(n)
    r = torch.randn(1, 1, n, generator=g).to(torch.bfloat16)
    nw = (torch.rand(n, generator=g) + 0.5).to(torch.bfloat16)
    tensors = (x_q[None], x_scale[None], w_q, w_scale, b.to(torch.bfloat16))
    tail = (torch.bfloat16, *on(DEVICE, r, nw), 1e-6, FP8)  # out_dtype, residual, norm weight, eps, quantized dtype
    packed = record_packed(monkeypatch)
    off = lar.scaled_linear_add_rms_norm_quant_triton(*on(DEVICE, *tensors), *tail)
    monkeypatch.setattr(il, "FP8_UNPACK", True)
    got = lar.scaled_linear_add_rms_norm_quant_triton(*on(DEVICE, *tensors), *tail)
    assert packed == [False, packs]
    if DEVICE == "cpu":
        assert all(torch.equal(on_.view(torch.uint8), off_.view(torch.uint8)) for on_, off_ in zip(got, off))
    _, scale_ref, s_ref = lar.scaled_linear_add_rms_norm_quant_reference(*tensors, torch.bfloat16, r, nw, 1e-6, FP8)
    torch.testing.assert_close(got[2].cpu().float(), s_ref.float(), atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(got[1].cpu(), scale_ref, atol=0, rtol=2e-2)


def test_fp8_unpack_env_is_read_at_import():
    """MINI_INFER_FP8_UNPACK=1 sets int8_linear.FP8_UNPACK when the module is imported (unset: False)."""
    import subprocess
    import sys

    code = "import mini_infer.ops.int8_linear as il; print(il.FP8_UNPACK)"
    env = {**os.environ, "MINI_INFER_FP8_UNPACK": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env)
    assert run.returncode == 0 and run.stdout.strip() == "True", run.stderr[-2000:]


@requires_triton
def test_fp8_gemv_mode_picks_the_kernel_path(monkeypatch):
    """fp8_linear's one-row GEMV runs its products on tensor cores (the kernel's DOT), on the dot tile, when FP8_GEMV
    is "dot", or "auto" (the MINI_INFER_FP8_GEMV default) and the row is shorter than FP8_GEMV_LONG_K; on CUDA
    cores for "cuda-cores" and for "auto" with long rows; int8 never; unknown modes are refused by name."""
    if DEVICE == "cuda" and not HAS_FP8_GPU:
        pytest.skip("this GPU has no FP8")
    from mini_infer.ops import int8_linear as il

    launches = []
    real = il.launch_gemv
    monkeypatch.setattr(il, "launch_gemv", lambda *a, **kw: launches.append((kw["DOT"], kw["config"])) or real(*a, **kw))
    w_q, w_scale, b = make_weights(24, 64, bias_dtype=torch.float32)
    _, x_q, x_scale = quantized_x(1, 64, torch.float32)
    args = on(DEVICE, x_q, x_scale, w_q, w_scale, b)
    want = fl.fp8_linear_reference(x_q, x_scale, w_q, w_scale, b, torch.float32)
    assert il.FP8_GEMV == "auto"  # the default
    for mode in ("cuda-cores", "dot", "auto"):
        monkeypatch.setattr(il, "FP8_GEMV", mode)
        assert_fp32_acc_close(fl.fp8_linear_triton(*args, torch.float32), want)
    monkeypatch.setattr(il, "FP8_GEMV_LONG_K", 64)  # "auto" with rows of 64 now long: CUDA cores, the long-K tile
    assert_fp32_acc_close(fl.fp8_linear_triton(*args, torch.float32), want)
    x8 = torch.ones(1, 64, dtype=torch.int8, device=DEVICE)
    il.int8_linear_triton(x8, args[1], x8.expand(24, 64).contiguous(), args[3], None, torch.float32)
    dot_tile = il.SCALED_GEMV_CONFIG_FP8_DOT
    int8_tile = il.SCALED_GEMV_CONFIG[:1] + (il.SCALED_GEMV_CONFIG[1] // 4,) + il.SCALED_GEMV_CONFIG[2:]
    assert launches == [(False, il.SCALED_GEMV_CONFIG_FP8), (True, dot_tile), (True, dot_tile),
                        (False, il.SCALED_GEMV_CONFIG_FP8_LONG_K), (False, int8_tile)]
    with pytest.raises(ValueError, match="fp8_gemv"):
        il.scaled_gemv_triton(*args, torch.float32, fp8_gemv="tensor")
    with pytest.raises(ValueError, match="BLOCK_K"):
        il.scaled_gemv_triton(*args, torch.float32, (64, 16, 4, 1), fp8_gemv="dot")


def test_fp8_gemv_env_is_read_at_import():
    """MINI_INFER_FP8_GEMV sets int8_linear.FP8_GEMV when the module is imported; an unknown mode stops the import."""
    import subprocess
    import sys

    code = "import mini_infer.ops.int8_linear as il; print(il.FP8_GEMV)"
    for mode, ok in (("dot", True), ("cuda-cores", True), ("auto", True), ("tensor", False)):
        env = {**os.environ, "MINI_INFER_FP8_GEMV": mode,
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env)
        assert (run.returncode == 0) == ok, run.stderr[-2000:]
        assert run.stdout.strip() == mode if ok else "MINI_INFER_FP8_GEMV" in run.stderr


@pytest.fixture(scope="module")
def sm90_report() -> dict:
    """tests/ops/compile_fp8_gemv_sm90.py's report of its default cases (built once for this module's tests)."""
    return run_uninterpreted(["-m", "tests.ops.compile_fp8_gemv_sm90"])


@requires_triton
def test_dot_gemv_compiles_to_e4m3_tensor_cores_sm90(sm90_report):
    """Compiled for sm_90 (no GPU needed; tests/ops/compile_fp8_gemv_sm90.py): the "dot" GEMV's PTX (alone and in
    linear_add_rms_norm's fused kernel) has an e4m3 tensor-core instruction, alone no e4m3 conversion, no register spills, and its K loop runs tensor-core
    instructions and fewer instructions per weight byte than the CUDA-core fp8 GEMV, which converts."""
    report = sm90_report
    dot, cuda_cores, long_k, _, fused = report["cases"][:5]
    assert dot["mode"] == "fp8-dot" and cuda_cores["mode"] == long_k["mode"] == "fp8-cuda-cores"
    for case in (dot, fused):  # the GEMV, and its body inside linear_add_rms_norm's fused kernel
        assert any(".e4m3.e4m3" in i for i in case["ptx_e4m3_tensor_core"]), case["ptx_e4m3_tensor_core"]
    assert dot["ptx_cvt_e4m3"] == 0 and dot["k_loop"]["convert"] == 0 and dot["k_loop"]["tensor"] > 0
    assert not cuda_cores["ptx_e4m3_tensor_core"] and cuda_cores["k_loop"]["convert"] > 0
    for case in report["cases"]:
        assert "LOCAL:0 " in case["usage"], case
    assert dot["per_weight_byte"]["total"] < min(cuda_cores["per_weight_byte"]["total"],
                                                 long_k["per_weight_byte"]["total"]) / 2


@requires_triton
def test_unpacked_fp8_gemv_compiles_without_cvt_sm90(sm90_report):
    """Compiled for sm_90 at the long-K tile, alone and in linear_add_rms_norm's fused kernel: the FP8_UNPACK GEMV's K
    loop converts no e4m3 (no cvt in its PTX, no conversion instruction in its SASS) and runs its fp32 FMAs without
    flushing denormals (no .ftz: denormal weights unpack to fp32 denormals), as many as the cvt path's, with no
    register spills; the cvt path's K loop does convert e4m3."""
    from mini_infer.ops import int8_linear as il

    cases = {c["mode"]: c for c in sm90_report["cases"] if c["tile"] == list(il.SCALED_GEMV_CONFIG_FP8_LONG_K)}
    cvt = cases["fp8-cuda-cores"]
    assert cvt["ptx_k_loop_cvt_e4m3"] > 0
    for mode in ("fp8-unpack", "fp8-unpack-fused"):
        case = cases[mode]
        assert case["ptx_k_loop_cvt_e4m3"] == 0 and case["k_loop"]["convert"] == 0, case
        assert case["ptx_k_loop_ftz_f32"] == 0 and case["ptx_k_loop_fma_f32"] == cvt["ptx_k_loop_fma_f32"] > 0, case
        assert "LOCAL:0 " in case["usage"], case
    assert cases["fp8-unpack"]["ptx_cvt_e4m3"] == 0  # none in the whole kernel (the fused one quantizes its output)



@requires_triton
def test_gemv_taken_for_one_row_only(monkeypatch):
    """fp8_linear runs the GEMV for one row and the Triton tile (or torch._scaled_mm) for more."""
    if DEVICE == "cuda" and not HAS_FP8_GPU:
        pytest.skip("this GPU has no FP8")
    from mini_infer.ops import int8_linear as il

    calls = []
    real = il.scaled_gemv_triton
    monkeypatch.setattr(il, "scaled_gemv_triton", lambda *a, **kw: calls.append(tuple(a[0].shape)) or real(*a, **kw))
    w_q, w_scale, b = make_weights(24, 64, bias_dtype=torch.float32)
    _, x_q, x_scale = quantized_x(3, 64, torch.float32)
    x_q, x_scale, w_q, w_scale, b = on(DEVICE, x_q, x_scale, w_q, w_scale, b)
    for m in (1, 2, 3):
        fl.fp8_linear_triton(x_q[None, :m], x_scale[None, :m], w_q, w_scale, b, torch.float32)
    assert calls == [(1, 1, 64)]


@requires_triton
@pytest.mark.parametrize("fp8_dot", [0, 32, "fp16"])
def test_triton_kernel_fp8_dot_choices(fp8_dot):
    """The fp8 dot's accumulation choices that promise fp32 accuracy (mma.sync, a wgmma partial added every 32
    products, an exact fp16 upcast; bench/fp8_gpu_check.py measures these and the rest on a GPU) give the
    fp32-accumulated product in the GEMM tiles (M = 37: BLOCK_K 256, M = 300: BLOCK_K 128); a value the tile
    cannot take is refused by name."""
    if DEVICE == "cuda" and not HAS_FP8_GPU:
        pytest.skip("this GPU has no FP8")
    from mini_infer.ops.int8_linear import scaled_mm_triton

    w_q, w_scale, b = make_weights(33, 200, seed=6, bias_dtype=torch.float32)
    _, x_q, x_scale = quantized_x(300, 200, torch.float32, seed=7)
    want = fl.fp8_linear_reference(x_q, x_scale, w_q, w_scale, b, torch.float32)
    for m in (37, 300):
        got = scaled_mm_triton(*on(DEVICE, x_q[:m], x_scale[:m], w_q, w_scale, b), torch.float32, fp8_dot=fp8_dot)
        assert_fp32_acc_close(got, want[:m])
    for bad in (129, "bf16", -1):  # 129 > the M = 300 tile's BLOCK_K
        with pytest.raises(ValueError, match="fp8_dot must be"):
            scaled_mm_triton(*on(DEVICE, x_q, x_scale, w_q, w_scale, b), torch.float32, fp8_dot=bad)


@requires_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_w8a8_linear_close_to_float_linear(dtype):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 128, generator=g) / 128**0.5
    w_q, w_scale = quantize_per_token_reference(w, FP8)
    x = torch.randn(3, 128, generator=g).to(dtype)
    b = torch.randn(48, generator=g).to(dtype)
    want = fl.fp8_w8a8_linear_reference(x, w_q, w_scale.view(48), b)
    exact = F.linear(x.double(), w.double(), b.double())
    assert (want.double() - exact).norm() / exact.norm() < 0.05  # e4m3: ~3% per element, averaging down
    if DEVICE == "cuda" and not HAS_FP8_GPU:
        return
    got = fl.fp8_w8a8_linear_triton(*on(DEVICE, x, w_q, w_scale.view(48), b))
    assert got.dtype == dtype
    assert_fp32_acc_close(got, want)


@pytest.mark.skipif(not HAS_FP8_GPU, reason="torch._scaled_mm needs a GPU with FP8 (compute capability >= 8.9)")
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias_dtype", [None, "out", torch.float32])
def test_scaled_mm_path_on_gpu(out_dtype, bias_dtype):
    """M > FP8_TRITON_MAX_M goes through torch._scaled_mm (bias fused when it has out_dtype, else added)."""
    bd = out_dtype if bias_dtype == "out" else bias_dtype
    w_q, w_scale, b = make_weights(96, 128, seed=1, bias_dtype=bd)
    _, x_q, x_scale = quantized_x(48, 128, out_dtype, seed=2)
    want = fl.fp8_linear_reference(x_q, x_scale, w_q, w_scale, b, out_dtype)
    args = on("cuda", x_q, x_scale, w_q, w_scale, b)
    assert_fp32_acc_close(fl.scaled_mm_fp8(*args, out_dtype), want)
    assert_fp32_acc_close(fl.fp8_linear_triton(*args, out_dtype), want)


def test_capability_check(monkeypatch):
    assert fl.fp8_supported("cpu")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    assert not fl.fp8_supported("cuda")
    with pytest.raises(RuntimeError, match=r"compute capability 8\.0; FP8 GEMMs need >= 8\.9"):
        fl._require_fp8_device(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert fl.fp8_supported("cuda")


def test_errors_name_the_field():
    w_q, w_scale, _ = make_weights(8, 32)
    _, x_q, x_scale = quantized_x(2, 32, torch.float32)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fl.fp8_linear_reference(x_q.float(), x_scale, w_q, w_scale, None, torch.float32)
    with pytest.raises(ValueError, match="w_scale must be fp32"):
        fl.fp8_linear_reference(x_q, x_scale, w_q, w_scale[:4], None, torch.float32)


def test_registered_ops_and_fakes():
    w_q, w_scale, b = make_weights(8, 32, bias_dtype=torch.bfloat16)
    x, x_q, x_scale = quantized_x(3, 32, torch.bfloat16)
    ops = torch.ops.mini_infer
    assert torch.equal(ops.fp8_linear(x_q, x_scale, w_q, w_scale, b, torch.bfloat16),
                       fl.fp8_linear_reference(x_q, x_scale, w_q, w_scale, b, torch.bfloat16))
    assert torch.equal(ops.fp8_w8a8_linear(x, w_q, w_scale, b), fl.fp8_w8a8_linear_reference(x, w_q, w_scale, b))
    with FakeTensorMode():
        xq = torch.empty(1, 7, 64, dtype=FP8)
        xs = torch.empty(1, 7, 1, dtype=torch.float32)
        wq = torch.empty(96, 64, dtype=FP8)
        ws = torch.empty(96, dtype=torch.float32)
        out = ops.fp8_linear(xq, xs, wq, ws, None, torch.bfloat16)
        assert out.shape == (1, 7, 96) and out.dtype == torch.bfloat16
        out = ops.fp8_w8a8_linear(torch.empty(1, 7, 64, dtype=torch.float16), wq, ws, None)
        assert out.shape == (1, 7, 96) and out.dtype == torch.float16


def test_opcheck():
    w_q, w_scale, b = make_weights(8, 32, bias_dtype=torch.float32)
    x, x_q, x_scale = quantized_x(3, 32, torch.float32)
    # test_schema is left out (fp8 inputs): torch's schema checker multiplies the inputs, which CPU torch
    # does not implement for float8_e4m3fn ("mul_cpu_reduced_float")
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    ops = torch.ops.mini_infer
    torch.library.opcheck(ops.fp8_linear.default, (x_q, x_scale, w_q, w_scale, b, torch.float32), test_utils=utils)
    torch.library.opcheck(ops.fp8_w8a8_linear.default, (x, w_q, w_scale, None), test_utils=utils)
