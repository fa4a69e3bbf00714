"""scaled_linear_silu_quant: a W8A8 gate_up GEMV with the activation and its amax in the epilogue, then one
quantization launch: the bits of int8_linear / fp8_linear then silu_and_mul_quant (int8 and fp8 operands, int8 and fp8
activations, rows shorter and longer than a quantization chunk, split K), the amax slots and counters zero after each
call, the unfused kernels for several rows; on CPU the registered op runs the reference; fakes and errors."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import mini_infer.ops  # noqa: F401  (registers torch.ops.mini_infer.*)
from mini_infer.ops import int8_linear as il
from mini_infer.ops import scaled_linear_silu_quant as mod
from mini_infer.ops._split_k import split_counters
from mini_infer.ops.fp8_linear import fp8_linear_triton, fp8_supported
from mini_infer.ops.int8_linear import int8_linear_triton
from mini_infer.ops.quant import SPLIT_CHUNK, silu_and_mul_quant_triton
from tests.ops.helpers import DEVICE, record_kernel_launches, requires_triton

mi = torch.ops.mini_infer
FP8 = torch.float8_e4m3fn
# (I, K): I below one quantization chunk, and above it with a tail; K no multiple of a GEMV step
SHAPES = [(44, 200), (SPLIT_CHUNK + 36, 264)]
HAS_FP8_GPU = torch.cuda.is_available() and fp8_supported("cuda")


def _inputs(rows, half, k, operand, bias, seed=0):
    """x_q [1, rows, k], x_scale [1, rows, 1], the merged gate_up weight [2 * half, k] of `operand`, its scales and
    bias [2 * half] or None."""
    g = torch.Generator().manual_seed(seed)
    if operand == torch.int8:
        x_q = torch.randint(-127, 128, (1, rows, k), generator=g, dtype=torch.int8)
        w_q = torch.randint(-127, 128, (2 * half, k), generator=g, dtype=torch.int8)
    else:
        x_q = (torch.randn(1, rows, k, generator=g) * 40).to(FP8)
        w_q = (torch.randn(2 * half, k, generator=g) * 40).to(FP8)
    x_scale = torch.rand(1, rows, 1, generator=g) * 0.02 + 1e-3
    w_scale = torch.rand(2 * half, generator=g) * 0.01 + 1e-3
    b = torch.randn(2 * half, generator=g) if bias else None
    return tuple(t.to(DEVICE) if t is not None else None for t in (x_q, x_scale, w_q, w_scale, b))


def _unfused(x_q, x_scale, w_q, w_scale, b, dtype):
    linear = int8_linear_triton if x_q.dtype == torch.int8 else fp8_linear_triton
    y = linear(x_q, x_scale, w_q, w_scale, b, torch.bfloat16)
    return silu_and_mul_quant_triton(*y.split(w_q.shape[0] // 2, -1), dtype)


def _skip_without_fp8(operand):
    if DEVICE == "cuda" and operand == FP8 and not HAS_FP8_GPU:
        pytest.skip("this GPU has no FP8")


def _assert_same(got, want):
    (q, s), (q_ref, s_ref) = got, want
    assert q.shape == q_ref.shape and q.dtype == q_ref.dtype and s.shape == s_ref.shape
    assert torch.equal(q.cpu().view(torch.uint8), q_ref.cpu().view(torch.uint8)) and torch.equal(s, s_ref)


def _assert_clean(device):
    assert not mod._amax_slots(device).any() and not split_counters(device, 1).any()


@pytest.fixture
def launches(monkeypatch):
    """The op's two kernels, as it launches them."""
    return record_kernel_launches(monkeypatch, mod, "_gemv_silu_amax_kernel", "_slot_quant_kernel")


@requires_triton
@pytest.mark.parametrize("operand", [torch.int8, FP8])
@pytest.mark.parametrize("dtype", [torch.int8, FP8])
@pytest.mark.parametrize(("half", "k"), SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_one_row_equals_the_unfused_kernels(launches, operand, dtype, half, k, bias):
    """Two launches, the unfused chain's bytes and scale, twice in a row (the slots left zero for the next call)."""
    _skip_without_fp8(operand)
    args = _inputs(1, half, k, operand, bias, seed=half + k)
    want = _unfused(*args, dtype)
    for _ in range(2):
        launches.clear()
        got = mod.scaled_linear_silu_quant_triton(*args, torch.bfloat16, dtype)
        assert launches == ["_gemv_silu_amax_kernel", "_slot_quant_kernel"]
        _assert_same(got, want)
        _assert_clean(got[0].device)


@requires_triton
@pytest.mark.parametrize("split", [2, 3])
def test_split_k_fp8_gemv(monkeypatch, split):
    """With the fp8 tensor-core GEMV cut into splits (a 5-element tile), a row block's last split runs the epilogue:
    the same bits as the unfused chain at that tile; every counter zero after it."""
    _skip_without_fp8(FP8)
    tile = (32, 64, 4, 2, split)
    monkeypatch.setattr(il, "FP8_GEMV", "dot")
    monkeypatch.setattr(il, "SCALED_GEMV_CONFIG_FP8_DOT", tile)
    args = _inputs(1, 100, 300, FP8, True, seed=split)
    want = _unfused(*args, FP8)
    got = mod.scaled_linear_silu_quant_triton(*args, torch.bfloat16, FP8)
    _assert_same(got, want)
    _assert_clean(got[0].device)
    assert not split_counters(got[0].device, 1 + -(-200 // tile[0])).any()


@requires_triton
def test_several_rows_run_the_unfused_kernels(launches):
    args = _inputs(3, 20, 64, torch.int8, True)
    _assert_same(mod.scaled_linear_silu_quant_triton(*args, torch.bfloat16, torch.int8), _unfused(*args, torch.int8))
    assert launches == []


def test_registered_op_runs_the_reference_on_cpu():
    x_q, x_scale, w_q, w_scale, b = (t.cpu() for t in _inputs(3, 12, 32, torch.int8, True))
    y = il.int8_linear_reference(x_q, x_scale, w_q, w_scale, b, torch.bfloat16)
    want = mi.silu_and_mul_quant(y[..., :12], y[..., 12:], torch.int8)
    _assert_same(mi.scaled_linear_silu_quant(x_q, x_scale, w_q, w_scale, b, torch.bfloat16, torch.int8), want)


def test_fake_impl_errors_and_opcheck():
    with FakeTensorMode():
        q, s = mi.scaled_linear_silu_quant(torch.empty(1, 7, 64, dtype=torch.int8), torch.empty(1, 7, 1),
                                           torch.empty(96, 64, dtype=torch.int8), torch.empty(96), None,
                                           torch.bfloat16, FP8)
    assert q.shape == (1, 7, 48) and q.dtype == FP8 and s.shape == (1, 7, 1) and s.dtype == torch.float32
    x_q, x_scale, w_q, w_scale, b = (t.cpu() for t in _inputs(2, 8, 16, torch.int8, True))
    with pytest.raises(ValueError, match="even row count"):
        mod.scaled_linear_silu_quant_reference(x_q, x_scale, w_q[:15], w_scale[:15], b[:15], torch.bfloat16,
                                               torch.int8)
    with pytest.raises(ValueError, match="x_q must be int8 or float8_e4m3fn"):
        mod.scaled_linear_silu_quant_reference(x_q.float(), x_scale, w_q, w_scale, b, torch.bfloat16, torch.int8)
    with pytest.raises(ValueError, match="quantization dtype"):
        mod.scaled_linear_silu_quant_reference(x_q, x_scale, w_q, w_scale, b, torch.bfloat16, torch.float16)
    torch.library.opcheck(mi.scaled_linear_silu_quant.default, (x_q, x_scale, w_q, w_scale, b, torch.bfloat16,
                                                                torch.int8))


def test_kernels_compile_for_sm90():
    """tests/ops/compile_scaled_linear_silu_quant_sm90.py (no GPU needed): at qwen2.5-7b's gate_up, the int8 GEMV keeps
    dp4a and the fp8 one e4m3 wgmma with the epilogue in, each its one relaxed atomic max a program, no spills."""
    from tests.ops.helpers import run_uninterpreted

    report = run_uninterpreted(["-m", "tests.ops.compile_scaled_linear_silu_quant_sm90"])
    cases = {(c["kernel"], c["operand"]): c for c in report["cases"]}
    for case in cases.values():
        assert case["stack"] == 0, case
    int8, fp8 = cases["_gemv_silu_amax_kernel", "int8"], cases["_gemv_silu_amax_kernel", "float8_e4m3fn"]
    assert int8["ops"].get("dp4a.s32.s32", 0) > 0, int8
    assert any(op.startswith("wgmma") and op.endswith("e4m3.e4m3") for op in fp8["ops"]), fp8
    for case in (int8, fp8):
        assert sum(n for op, n in case["ops"].items() if "relaxed" in op and "max" in op) >= 1, case
