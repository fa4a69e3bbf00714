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


@requires_triton
def test_fp8_gemv_mode_picks_the_kernel_path(monkeypatch):
    """fp8_linear's one-row GEMV runs its products on tensor cores (the kernel's DOT), on the dot tile, when FP8_GEMV
    is "dot", or "auto" (the MINI_INFER_FP8_GEMV default) and the row is shorter than FP8_GEMV_DOT_MAX_K; on CUDA
    cores for "cuda-cores" and for "auto" past it, with the long-K tile for rows of FP8_GEMV_LONG_K and more; int8
    never; unknown modes are refused by name."""
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
    monkeypatch.setattr(il, "FP8_GEMV_DOT_MAX_K", 64)  # "auto" with rows of 64 now past tensor cores: CUDA cores,
    monkeypatch.setattr(il, "FP8_GEMV_LONG_K", 64)  # and long for them: the long-K tile
    assert_fp32_acc_close(fl.fp8_linear_triton(*args, torch.float32), want)
    x8 = torch.ones(1, 64, dtype=torch.int8, device=DEVICE)
    il.int8_linear_triton(x8, args[1], x8.expand(24, 64).contiguous(), args[3], None, torch.float32)
    dot_tile = il.SCALED_GEMV_CONFIG_FP8_DOT
    int8_tile = il.SCALED_GEMV_CONFIG[:1] + (il.SCALED_GEMV_CONFIG[1] // 4,) + il.SCALED_GEMV_CONFIG[2:]
    assert launches == [(False, il.SCALED_GEMV_CONFIG_FP8), (True, dot_tile), (True, dot_tile),
                        (False, il.SCALED_GEMV_CONFIG_FP8_LONG_K), (False, int8_tile)]
    monkeypatch.undo()  # the defaults: CUDA cores keep their long-K tile for long rows ("auto" no longer takes them)
    assert il.scaled_gemv_config(FP8, 18944, "cuda-cores") == il.SCALED_GEMV_CONFIG_FP8_LONG_K
    assert il.scaled_gemv_config(FP8, 18944, "auto") == il.SCALED_GEMV_CONFIG_FP8_DOT
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


@requires_triton
def test_dot_gemv_compiles_to_e4m3_tensor_cores_sm90():
    """Compiled for sm_90 (no GPU needed; tests/ops/compile_fp8_gemv_sm90.py): the "dot" GEMV's PTX (alone, in
    linear_add_rms_norm's fused kernel and cut into splits of K) has an e4m3 tensor-core instruction, alone no e4m3
    conversion, no register spills, and its K loop runs tensor-core instructions and fewer instructions per weight
    byte than the CUDA-core fp8 GEMV, which converts."""
    report = run_uninterpreted(["-m", "tests.ops.compile_fp8_gemv_sm90"])
    dot, cuda_cores, long_k, _, fused, fp8_split = report["cases"]
    assert dot["mode"] == "fp8-dot" and cuda_cores["mode"] == long_k["mode"] == "fp8-cuda-cores"
    for case in (dot, fused, fp8_split):  # the GEMV, its body inside linear_add_rms_norm's kernel, split K
        assert any(".e4m3.e4m3" in i for i in case["ptx_e4m3_tensor_core"]), case["ptx_e4m3_tensor_core"]
    assert dot["ptx_cvt_e4m3"] == 0 and dot["k_loop"]["convert"] == 0 and dot["k_loop"]["tensor"] > 0
    assert not cuda_cores["ptx_e4m3_tensor_core"] and cuda_cores["k_loop"]["convert"] > 0
    for case in report["cases"]:
        # no spills: ptxas puts them on the stack (STACK:), LOCAL stays 0 when it spills
        assert "LOCAL:0 " in case["usage"] and "STACK:0 " in case["usage"], case
    assert dot["per_weight_byte"]["total"] < min(cuda_cores["per_weight_byte"]["total"],
                                                 long_k["per_weight_byte"]["total"]) / 2


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
