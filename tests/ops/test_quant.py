"""Per-token activation quantization (quant.py): semantics of the reference, Triton vs reference bit for bit,
the fused producers vs (existing op, then quantize), fake impls and opcheck."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import mini_infer.ops  # noqa: F401  (registers torch.ops.mini_infer.*)
from mini_infer.ops import quant
from mini_infer.ops.fused_add_rms_norm import fused_add_rms_norm_reference, fused_add_rms_norm_triton
from mini_infer.ops.rms_norm import rms_norm_reference, rms_norm_triton
from mini_infer.ops.silu_and_mul import silu_and_mul_reference, silu_and_mul_triton
from tests.ops.helpers import DEVICE, TOL, requires_triton

FP8 = torch.float8_e4m3fn
QDTYPES = [torch.int8, FP8]
XDTYPES = [torch.float32, torch.bfloat16, torch.float16]
ROWS = [1, 3, 17, 64]
EPS = 1e-6


def assert_same_as_unfused(fused: tuple, unfused: tuple, xdtype: torch.dtype) -> None:
    """A fused producer's (x_q, scale) against (existing Triton op, then quantize_per_token_triton): the same
    bits, except fp32 activations on a GPU, where the compiler may order the fp32 norm arithmetic differently
    in the two kernels (measured on an H100: x_q equal, a few scales one fp32 ulp apart; 16-bit activations
    are rounded to their dtype before quantization and come out identical)."""
    if xdtype != torch.float32 or DEVICE == "cpu":
        assert_same_quant(fused, unfused)
        return
    torch.testing.assert_close(fused[1], unfused[1], rtol=2.0**-21, atol=0)
    assert ((fused[0].float() - unfused[0].float()).abs() <= quant_error_bound(
        unfused[0].float(), torch.ones_like(unfused[1]), fused[0].dtype) * 2 + 1e-6).all()


def assert_same_quant(a: tuple, b: tuple) -> None:
    """(x_q, scale) pairs identical bit for bit (fp8 compared as bytes: -0 vs +0 and NaN count)."""
    (qa, sa), (qb, sb) = a[:2], b[:2]
    assert qa.dtype == qb.dtype and qa.shape == qb.shape
    assert torch.equal(qa.cpu().view(torch.uint8), qb.cpu().view(torch.uint8))
    assert sa.dtype == sb.dtype == torch.float32 and torch.equal(sa.cpu(), sb.cpu())


def quant_error_bound(y: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Largest |x_q * scale - y| rounding may cause: half a step (int8), half an e4m3 ulp (fp8), plus a few
    fp32 ulps of y (scale * inv is 1 only up to rounding)."""
    fp32_slack = y.abs() * 2.0**-21
    if dtype == torch.int8:
        return 0.5 * scale.expand_as(y) + fp32_slack
    return torch.maximum(y.abs() * 2.0**-4, 2.0**-10 * scale) + fp32_slack  # 3 mantissa bits; subnormal step 2**-9


def dequant(x_q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x_q.float() * scale


def make_x(rows: int, cols: int, dtype: torch.dtype, seed: int = 0, top: float = 3.0) -> torch.Tensor:
    """Rows of magnitudes 1e-3 ... 10**top, one of them all zeros (when there are 3 or more)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.logspace(-3, top, rows)[:, None]
    if rows >= 3:
        x[1] = 0.0
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("xdtype", XDTYPES)
def test_reference_semantics(qdtype, xdtype):
    x = make_x(9, 70, xdtype).cpu()
    x_q, scale = quant.quantize_per_token_reference(x, qdtype)
    qmax = quant.QMAX[qdtype]
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)
    assert x_q.dtype == qdtype and x_q.shape == x.shape and scale.shape == (9, 1)
    nonzero = amax[:, 0] > 0
    torch.testing.assert_close(scale[nonzero], amax[nonzero] / qmax, rtol=0, atol=0)
    assert (x_q.float().abs().amax(-1)[nonzero] == qmax).all()  # the row's max hits the grid's end
    assert (x_q.float().abs() <= qmax).all()
    err = (dequant(x_q, scale) - xf).abs()
    assert (err <= quant_error_bound(xf, scale, qdtype)).all()


@pytest.mark.parametrize("qdtype", QDTYPES)
def test_zero_rows_and_empty(qdtype):
    x = torch.zeros(4, 32, device=DEVICE)
    impls = [quant.quantize_per_token_reference] + ([quant.quantize_per_token_triton] if quant.HAS_TRITON else [])
    for fn in impls:
        x_q, scale = fn(x, qdtype)
        assert (x_q.float() == 0).all() and torch.isfinite(scale).all() and (scale > 0).all()
        assert (dequant(x_q, scale) == 0).all()
        e_q, e_s = fn(torch.zeros(0, 32, device=DEVICE), qdtype)
        assert e_q.shape == (0, 32) and e_s.shape == (0, 1)


def test_rejects_other_dtypes():
    with pytest.raises(ValueError, match="int8 or torch.float8_e4m3fn"):
        quant.quantize_per_token_reference(torch.randn(2, 8), torch.float16)


@pytest.mark.parametrize(
    "qdtype,values,expected",
    [
        # amax 127 -> inv 1: x * inv is x itself; ties go to even
        (torch.int8, [127.0, 2.5, 3.5, -0.5, -1.5, 0.49, -126.5], [127, 2, 4, 0, -2, 0, -126]),
        # amax 448 -> inv 1: e4m3 neighbours 16/18 (17 -> 16), 18/20 (19 -> 20), 1/1.125, subnormal step 2**-9,
        # 2**-10 is half a step (-> 0), 3 * 2**-10 between 2**-9 and 2**-8 (-> 2**-8), carry 15.5 -> 16
        (FP8, [448.0, 17.0, 19.0, 1.0625, 2.0**-10, 3 * 2.0**-10, 15.5, -17.0],
         [448.0, 16.0, 20.0, 1.0, 0.0, 2.0**-8, 16.0, -16.0]),
    ],
)
def test_round_half_even_ties(qdtype, values, expected):
    x = torch.tensor([values], device=DEVICE)
    impls = [quant.quantize_per_token_reference] + ([quant.quantize_per_token_triton] if quant.HAS_TRITON else [])
    for fn in impls:
        x_q, scale = fn(x, qdtype)
        assert scale.item() == 1.0
        assert x_q.float().cpu()[0].tolist() == expected, fn.__name__


@requires_triton
@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("xdtype", XDTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_triton_matches_reference_exactly(qdtype, xdtype, rows):
    x = make_x(rows, 96, xdtype, seed=rows)
    assert_same_quant(quant.quantize_per_token_triton(x, qdtype), quant.quantize_per_token_reference(x, qdtype))


@requires_triton
@pytest.mark.parametrize("qdtype", QDTYPES)
def test_triton_long_rows_and_strided_input(qdtype):
    """Rows longer than one chunk (4096) take the kernel's chunk loop; a strided view is read in place."""
    x = make_x(2, 5000, torch.bfloat16, seed=7)
    assert_same_quant(quant.quantize_per_token_triton(x, qdtype), quant.quantize_per_token_reference(x, qdtype))
    wide = make_x(3, 200, torch.float16, seed=8)
    view = wide[:, 50:150]  # row stride 200
    assert_same_quant(quant.quantize_per_token_triton(view, qdtype), quant.quantize_per_token_reference(view, qdtype))


@requires_triton
@pytest.mark.parametrize("qdtype", QDTYPES)
def test_triton_fp8_grid_every_magnitude(qdtype):
    """Values across the whole e4m3 range (subnormals to 448) and the int8 range round like torch."""
    g = torch.Generator().manual_seed(3)
    mags = torch.exp2(torch.linspace(-14, 8.8, 4096))
    x = (mags * torch.randn(4096, generator=g).sign()).view(8, 512).to(DEVICE)
    x[:, 0] = 448.0  # amax 448: inv is exactly 1, the values reach the kernel's rounding unchanged
    assert_same_quant(quant.quantize_per_token_triton(x, qdtype), quant.quantize_per_token_reference(x, qdtype))


def _check_close_to_reference(got: tuple, y_ref: torch.Tensor, qdtype) -> None:
    """Dequantized Triton output within quantization error (plus the producer's own tolerance) of y_ref,
    the unquantized reference output."""
    x_q, scale = got[0].cpu(), got[1].cpu()
    y = y_ref.float().cpu()
    atol, rtol = TOL[y_ref.dtype]
    bound = quant_error_bound(y, scale, qdtype) * (1 + 1e-3) + atol + rtol * y.abs()
    assert ((dequant(x_q, scale) - y).abs() <= bound).all()


@requires_triton
@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("xdtype", XDTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_rms_norm_quant(qdtype, xdtype, rows):
    x = make_x(rows, 96, xdtype, seed=rows)
    w = (1 + 0.1 * torch.randn(96)).to(xdtype).to(DEVICE)
    got = quant.rms_norm_quant_triton(x, w, EPS, qdtype)
    assert_same_as_unfused(got, quant.quantize_per_token_triton(rms_norm_triton(x, w, EPS), qdtype), xdtype)
    _check_close_to_reference(got, rms_norm_reference(x, w, EPS), qdtype)
    ref = quant.rms_norm_quant_reference(x.cpu(), w.cpu(), EPS, qdtype)
    assert_same_quant(ref, quant.quantize_per_token_reference(rms_norm_reference(x.cpu(), w.cpu(), EPS), qdtype))


@requires_triton
@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("xdtype", XDTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_fused_add_rms_norm_quant(qdtype, xdtype, rows):
    x = make_x(rows, 96, xdtype, seed=rows)
    r = make_x(rows, 96, xdtype, seed=rows + 100)
    w = (1 + 0.1 * torch.randn(96)).to(xdtype).to(DEVICE)
    x_q, scale, s = quant.fused_add_rms_norm_quant_triton(x, r, w, EPS, qdtype)
    normed, s_unfused = fused_add_rms_norm_triton(x, r, w, EPS)
    assert torch.equal(s, s_unfused)
    assert_same_as_unfused((x_q, scale), quant.quantize_per_token_triton(normed, qdtype), xdtype)
    normed_ref, s_ref = fused_add_rms_norm_reference(x, r, w, EPS)
    _check_close_to_reference((x_q, scale), normed_ref, qdtype)
    torch.testing.assert_close(s.float(), s_ref.float(), atol=TOL[xdtype][0], rtol=TOL[xdtype][1])
    ref = quant.fused_add_rms_norm_quant_reference(x.cpu(), r.cpu(), w.cpu(), EPS, qdtype)
    assert torch.equal(ref[2], s_ref.cpu())


@requires_triton
@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("xdtype", XDTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_silu_and_mul_quant(qdtype, xdtype, rows):
    gate_up = make_x(rows, 2 * 80, xdtype, seed=rows, top=1.0)  # gate and up: views of one fused projection
    g, u = gate_up[:, :80], gate_up[:, 80:]
    got = quant.silu_and_mul_quant_triton(g, u, qdtype)
    assert_same_quant(got, quant.quantize_per_token_triton(silu_and_mul_triton(g, u), qdtype))
    _check_close_to_reference(got, silu_and_mul_reference(g, u), qdtype)


@requires_triton
def test_silu_and_mul_quant_long_rows():
    g, u = make_x(2, 4500, torch.bfloat16, seed=1), make_x(2, 4500, torch.bfloat16, seed=2)
    got = quant.silu_and_mul_quant_triton(g, u, torch.int8)
    assert_same_quant(got, quant.quantize_per_token_triton(silu_and_mul_triton(g, u), torch.int8))


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("rows", [1, 3])
def test_split_rows_equal_the_one_program_kernel(monkeypatch, qdtype, rows):
    """A few long rows go over programs of SPLIT_CHUNK columns (chunk amaxes, then the quantization): the same
    bits as one program per row, plain and gated (silu_and_mul_quant), and as the reference."""
    g, u = make_x(rows, 1000, torch.bfloat16, seed=1), make_x(rows, 1000, torch.bfloat16, seed=2)
    g[0, 777] = 40.0  # the row's amax in the last, partial chunk
    monkeypatch.setattr(quant, "SPLIT_CHUNK", 256)
    taken = []
    real = quant._launch_split_rows
    monkeypatch.setattr(quant, "_launch_split_rows", lambda *a: (taken.append(a[4:6]), real(*a)))
    monkeypatch.setattr(quant, "SPLIT_MIN_COLS", 512)
    split = (quant.quantize_per_token_triton(g, qdtype), quant.silu_and_mul_quant_triton(g, u, qdtype))
    assert taken == [(rows, 1000)] * 2
    monkeypatch.setattr(quant, "SPLIT_MIN_COLS", 1 << 30)
    whole = (quant.quantize_per_token_triton(g, qdtype), quant.silu_and_mul_quant_triton(g, u, qdtype))
    assert len(taken) == 2
    for a, b in zip(split, whole):
        assert_same_quant(a, b)
    assert_same_quant(split[0], quant.quantize_per_token_reference(g, qdtype))


def test_registered_ops_run_the_reference_on_cpu():
    x, r = make_x(5, 32, torch.bfloat16).cpu(), make_x(5, 32, torch.bfloat16, seed=1).cpu()
    w = torch.ones(32, dtype=torch.bfloat16)
    ops = torch.ops.mini_infer
    for qdtype in QDTYPES:
        assert_same_quant(ops.quantize_per_token(x, qdtype), quant.quantize_per_token_reference(x, qdtype))
        assert_same_quant(ops.rms_norm_quant(x, w, EPS, qdtype), quant.rms_norm_quant_reference(x, w, EPS, qdtype))
        got = ops.fused_add_rms_norm_quant(x, r, w, EPS, qdtype)
        want = quant.fused_add_rms_norm_quant_reference(x, r, w, EPS, qdtype)
        assert_same_quant(got, want) and torch.equal(got[2], want[2])
        assert_same_quant(ops.silu_and_mul_quant(x, r, qdtype), quant.silu_and_mul_quant_reference(x, r, qdtype))


@pytest.mark.parametrize("qdtype", QDTYPES)
def test_fake_impls(qdtype):
    ops = torch.ops.mini_infer
    with FakeTensorMode():
        x = torch.empty(1, 7, 64, dtype=torch.bfloat16)
        r = torch.empty(1, 7, 64, dtype=torch.float32)
        w = torch.empty(64, dtype=torch.bfloat16)
        outs = [ops.quantize_per_token(x, qdtype), ops.rms_norm_quant(x, w, EPS, qdtype),
                ops.fused_add_rms_norm_quant(x, r, w, EPS, qdtype), ops.silu_and_mul_quant(x, x, qdtype)]
        for out in outs:
            assert out[0].shape == (1, 7, 64) and out[0].dtype == qdtype
            assert out[1].shape == (1, 7, 1) and out[1].dtype == torch.float32
        assert outs[2][2].shape == (1, 7, 64) and outs[2][2].dtype == torch.float32  # bf16 + fp32 residual
        with pytest.raises(ValueError, match="quantization dtype"):
            ops.quantize_per_token(x, torch.bfloat16)


@pytest.mark.parametrize("qdtype", QDTYPES)
def test_opcheck(qdtype):
    x, r = torch.randn(3, 16), torch.randn(3, 16)
    w = torch.rand(16) + 0.5
    ops = torch.ops.mini_infer
    torch.library.opcheck(ops.quantize_per_token.default, (x, qdtype))
    torch.library.opcheck(ops.rms_norm_quant.default, (x, w, EPS, qdtype))
    torch.library.opcheck(ops.fused_add_rms_norm_quant.default, (x, r, w, EPS, qdtype))
    torch.library.opcheck(ops.silu_and_mul_quant.default, (x, r, qdtype))
