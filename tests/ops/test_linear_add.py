"""linear_add: the residual add in a one-row GEMV's epilogue (one launch, the unfused linear-then-add's bits), the
linear then torch's add for several rows and rows the GEMV does not take; on CPU the registered op runs the
reference."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import mini_infer.ops  # noqa: F401  (registers torch.ops.mini_infer.*)
from mini_infer.ops import linear_add as mod
from mini_infer.ops.linear import GEMV_MAX_K, gemv_triton
from mini_infer.ops.linear_add import linear_add_reference, linear_add_triton
from tests.ops.helpers import (
    DEVICE,
    assert_close,
    assert_loop_sums,
    preloaded_and_looped,
    record_gemv_launches,
    requires_triton,
    without_preload,
)

mi = torch.ops.mini_infer
# (N, K): no N a multiple of the GEMV's rows per program, no K a multiple of its K step; K >= 1024 takes the long tile
SHAPES = [(42, 96), (301, 1000), (130, 1030)]


def _inputs(rows, n, k, dtype, bias, residual_dtype=None, seed=0):
    """x [1, rows, k], W [n, k], bias [n] or None, residual [1, rows, n] (of residual_dtype, default dtype)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0, to=dtype):
        return (torch.randn(shape, generator=gen) * scale).to(to).to(DEVICE)

    return (rand(1, rows, k), rand(n, k, scale=k**-0.5), rand(n) if bias else None,
            rand(1, rows, n, scale=2.0, to=residual_dtype or dtype))


@pytest.fixture
def launches(monkeypatch):
    """The kernels the op launches through `launch_gemv`, recorded."""
    return record_gemv_launches(monkeypatch, mod)


def _assert_same_sum(s: torch.Tensor, s_ref: torch.Tensor) -> None:
    """Bit for bit; except bf16 under the Triton interpreter, whose fp32 -> bf16 conversion truncates where torch's
    add (and a GPU's conversion) rounds to nearest: there the two may differ by one bf16 ulp."""
    assert s.dtype == s_ref.dtype and s.shape == s_ref.shape
    if DEVICE == "cpu" and s.dtype == torch.bfloat16:
        ulp = torch.finfo(torch.bfloat16).eps * s_ref.float().abs()
        assert ((s.float() - s_ref.float()).abs() <= ulp).all()
    else:
        assert torch.equal(s, s_ref)


@requires_triton
@pytest.mark.parametrize(("dtype", "residual_dtype"), [(torch.float32, None), (torch.float16, None),
                                                       (torch.bfloat16, None), (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_one_row_equals_linear_then_add(monkeypatch, launches, dtype, residual_dtype, n, k, bias):
    """One launch of the epilogue kernel, and the bits of gemv_triton then torch's add (the linear's output in x's
    dtype, the sum in the promoted dtype: an fp32 residual makes an fp32 sum). The K loop both ways (the preload's
    sums: test_preloaded_rows_equal_the_k_loop)."""
    without_preload(monkeypatch)
    x, w, b, r = _inputs(1, n, k, dtype, bias, residual_dtype, seed=n + k)
    s = linear_add_triton(x, w, b, r)
    assert launches == [mod._gemv_add_kernel]
    _assert_same_sum(s, gemv_triton(x, w, b) + r)


@requires_triton
@pytest.mark.parametrize(("k", "width"), [(96, 512), (1500, 2048), (4000, 4096)])  # one, two and four K chunks
def test_preloaded_rows_equal_the_k_loop(monkeypatch, k, width):
    """Rows loaded whole before the PDL wait (linear.py's `PRELOAD_MAX_K`) give the K loop's sums: its chunks added
    in its order (4000: four non-empty chunks)."""
    x, w, b, r = _inputs(1, 24, k, torch.float32, True, seed=k)
    on, off, widths = preloaded_and_looped(monkeypatch, lambda: linear_add_triton(x, w, b, r))
    assert widths == [width, 0]
    assert_loop_sums(on, off)


@requires_triton
@pytest.mark.parametrize(("k", "prefix", "width"), [(3000, 1024, 1024), (5000, 2048, 2048), (9000, 8192, 4096)])
def test_prefix_preload_equals_the_k_loop(monkeypatch, k, prefix, width):
    """Rows too long to preload whole (PRELOAD_MAX_K) with linear.py's PREFIX_PRELOAD_K: their first `width`
    columns before the wait (1, 2 or 4 K steps; at most 4: 9000), the rest in the loop after it, the K loop's sums."""
    from mini_infer.ops import linear

    monkeypatch.setattr(linear, "PRELOAD_MAX_K", 512)
    x, w, b, r = _inputs(1, 24, k, torch.float32, True, seed=k)
    off = linear_add_triton(x, w, b, r)
    widths = []
    real = linear.prefix_preload_width
    monkeypatch.setattr(linear, "prefix_preload_width", lambda *a: widths.append(real(*a)) or widths[-1])
    monkeypatch.setattr(linear, "PREFIX_PRELOAD_K", prefix)
    on = linear_add_triton(x, w, b, r)
    assert widths == [width]
    assert_loop_sums(on, off)


@requires_triton
@pytest.mark.parametrize(("rows", "k", "residual_rows"), [(3, 96, 3), (1, GEMV_MAX_K + 1, 1), (1, 96, 0)])
def test_other_shapes_run_linear_then_add(launches, rows, k, residual_rows):
    """Several rows (prefill), a row the GEMV does not take, a residual that broadcasts ([n]): no epilogue kernel,
    the linear's kernels then torch's add."""
    x, w, b, r = _inputs(rows, 24, k, torch.float32, True)
    if residual_rows == 0:
        r = r[0, 0]
    s = linear_add_triton(x, w, b, r)
    assert launches == []
    assert_close(s, linear_add_reference(x, w, b, r))


def test_registered_op_runs_the_reference_on_cpu():
    x, w, b, r = (t.cpu() for t in _inputs(5, 12, 32, torch.float32, bias=True))
    assert torch.equal(mi.linear_add(x, w, b, r), torch.nn.functional.linear(x, w, b) + r)


def test_fake_impl_and_opcheck():
    with FakeTensorMode():
        x, w = torch.empty(1, 7, 64, dtype=torch.bfloat16), torch.empty(96, 64, dtype=torch.bfloat16)
        s = mi.linear_add(x, w, None, torch.empty(1, 7, 96, dtype=torch.float32))
    assert s.shape == (1, 7, 96) and s.dtype == torch.float32  # the add promotes
    x, w, b, r = (t.cpu() for t in _inputs(3, 12, 16, torch.float32, bias=True))
    torch.library.opcheck(mi.linear_add.default, (x, w, b, r))
