"""`argmax_rows`: exactly torch.argmax(x, dim=-1) (the same indices, not close ones) for the greedy sampler, under
the Triton interpreter here: every dtype, rows that do and do not fill the last block, many rows, strided rows, ties
and NaNs in different chunks and tiles, -inf rows, and the per-row counters left at zero for the next launch."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

import mini_infer.ops  # noqa: F401  (registers torch.ops.mini_infer.*)
from mini_infer.ops import argmax as argmax_mod
from mini_infer.ops._split_k import split_counters
from mini_infer.ops.argmax import argmax_config, argmax_rows_reference, argmax_rows_triton
from tests.ops.helpers import DEVICE, requires_triton, run_uninterpreted

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
NAN, INF = float("nan"), float("inf")


def assert_argmax(x: torch.Tensor, config: tuple[int, int] | None = None) -> torch.Tensor:
    """The kernel's indices equal torch.argmax's (computed on the CPU, whatever device x is on)."""
    got = argmax_rows_triton(x, config)
    want = x.cpu().argmax(dim=-1)
    assert got.dtype == torch.int64 and got.shape == want.shape
    assert torch.equal(got.cpu(), want), (got.cpu(), want)
    return got


def test_torch_semantics_that_the_op_matches():
    """What torch.argmax does and the op's docstring promises: first index of the maximum, -0.0 ties 0.0, the
    first NaN beats everything (+inf included), a row of -inf only gives 0."""
    for dtype in DTYPES:
        x = torch.tensor([[1, 3, 3, 2], [1, NAN, 3, NAN], [-INF, -INF, -INF, -INF], [NAN, NAN, NAN, NAN],
                          [INF, 1, INF, NAN], [INF, INF, 1, 2], [-0.0, 0.0, -1, -2]], dtype=dtype)
        assert argmax_rows_reference(x).tolist() == [1, 1, 0, 0, 3, 0, 0]


def test_config_splits_the_row():
    """P programs of TILES x BLOCK elements cover the row, each chunk starting inside it; never more than needed."""
    for n in (1, 7, 16, 17, 1000, 4096, 4097, 32000, 151936, 256000, 262145, 1 << 20):
        block, tiles, programs, _ = argmax_config(n)
        assert block & (block - 1) == 0 and 1 <= programs <= argmax_mod.MAX_PROGRAMS
        assert (programs - 1) * tiles * block < n <= programs * tiles * block
    assert argmax_config(1000)[2] == 1 and argmax_config(151936)[2] == 38


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_cols", [1, 7, 1000, 32000, 151936])
def test_matches_torch(dtype, n_cols):
    torch.manual_seed(n_cols)
    rows = 1 if n_cols == 151936 else 3
    assert_argmax((torch.randn(rows, n_cols) * 4).to(dtype).to(DEVICE))


@requires_triton
@pytest.mark.parametrize("rows", [1, 2, 5, 13, 20])
def test_many_rows_many_chunks(rows):
    """Short rows cut into many chunks and tiles (BLOCK 32, 3 tiles a program: 11 programs a row of 1,000)."""
    torch.manual_seed(rows)
    x = torch.randint(-50, 50, (rows, 1000)).to(torch.bfloat16).to(DEVICE)  # plenty of exact ties
    assert_argmax(x, (32, 3))
    assert_argmax(x)


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_rows(dtype):
    """Rows of a wider tensor (a column slice), every other row, and a transposed (column-major) copy."""
    torch.manual_seed(7)
    base = torch.randn(10, 1200).to(dtype).to(DEVICE)
    assert_argmax(base[:, 100:1100], (64, 2))
    assert_argmax(base[::3, 5:1005], (64, 2))
    assert_argmax(base.t().contiguous().t()[:, :999], (64, 2))  # last stride 10: copied, still right
    assert_argmax(base[:, 100:1100])


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_in_different_chunks_first_wins(dtype):
    """Equal maxima in several chunks (and tiles of one chunk): the lowest index wins, whatever the chunk order."""
    x = torch.zeros(4, 32000, dtype=dtype)
    x[0, [31999, 20000, 9000]] = 5  # chunks 7, 4, 2 of the default config (4096-element chunks)
    x[1, [4096, 4095]] = 5  # the first two chunks' edges
    x[2, [31999]] = 5  # only in the last, partial chunk
    x[3, :] = 5  # every element ties
    got = assert_argmax(x.to(DEVICE))
    assert got.tolist() == [9000, 4095, 31999, 0]
    assert_argmax(x.to(DEVICE), (1024, 4))  # 8 chunks of 4 tiles: ties across tiles of one chunk too
    short = torch.zeros(2, 1500, dtype=dtype)
    short[0, [1499, 777, 300]] = 1  # 24 chunks of 4 tiles of 16: ties in chunks 23, 12 and 4
    short[1, [64, 63, 70]] = 1  # the edge of chunks 0 and 1, and within chunk 1
    assert assert_argmax(short.to(DEVICE), (16, 4)).tolist() == [300, 63]


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_is_the_maximum(dtype):
    x = torch.randn(6, 3000).to(dtype)
    x[0, 2500] = NAN  # one NaN
    x[1, [2999, 1700, 1701]] = NAN  # several, in different chunks: the first
    x[2, 40] = INF
    x[2, 2000] = NAN  # NaN beats +inf before it
    x[3, :] = NAN  # only NaN
    x[4, :] = -INF
    x[4, 2999] = NAN  # NaN among -inf, last element
    x[5, [0, 1]] = NAN  # first element
    got = assert_argmax(x.to(DEVICE), (256, 2))
    assert got.tolist() == [2500, 1700, 2000, 0, 2999, 0]
    assert_argmax(x.to(DEVICE))


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_minus_inf_rows(dtype):
    x = torch.full((3, 5000), -INF, dtype=dtype)
    x[1, 4999] = -1e4  # one finite value, in the last chunk
    x[2, 4500] = INF
    got = assert_argmax(x.to(DEVICE), (128, 4))
    assert got.tolist() == [0, 4999, 4500]
    assert_argmax(x.to(DEVICE))


@requires_triton
def test_counters_back_to_zero():
    """The last program of each row zeroes its counter: the next call (any shape) starts from zero and is right."""
    torch.manual_seed(3)
    first = torch.randn(7, 2000).to(DEVICE)
    assert_argmax(first, (64, 2))
    assert int(split_counters(first.device, 7)[:7].abs().sum()) == 0
    second = torch.randn(7, 2000).to(DEVICE)
    assert_argmax(second, (64, 2))
    assert_argmax(torch.randn(9, 3000).to(DEVICE), (128, 1))
    assert int(split_counters(first.device, 9)[:9].abs().sum()) == 0


@requires_triton
def test_empty_rows_and_bad_inputs():
    assert argmax_rows_triton(torch.empty(0, 50, device=DEVICE)).shape == (0,)
    with pytest.raises(ValueError, match="0 columns"):
        argmax_rows_triton(torch.empty(3, 0, device=DEVICE))
    with pytest.raises(ValueError, match=r"\[rows, cols\]"):
        argmax_rows_triton(torch.empty(3, 4, 5, device=DEVICE))
    with pytest.raises(ValueError, match="float16"):
        argmax_rows_triton(torch.zeros(3, 4, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="power-of-two"):
        argmax_rows_triton(torch.zeros(3, 4, device=DEVICE), (24, 1))


POOL = [NAN, INF, -INF, 0.0, -0.0, 1.0, -1.0, 2.5, 1e4, -1e4]


@st.composite
def cases(draw):
    rows = draw(st.integers(1, 6))
    cols = draw(st.integers(1, 300))
    n_distinct = draw(st.integers(1, 6))
    pool = draw(st.lists(st.sampled_from(POOL), min_size=n_distinct, max_size=n_distinct))
    picks = draw(st.lists(st.integers(0, n_distinct - 1), min_size=rows * cols, max_size=rows * cols))
    dtype = draw(st.sampled_from(DTYPES))
    config = draw(st.sampled_from([None, (16, 1), (16, 3), (32, 2), (64, 1)]))
    x = torch.tensor([pool[i] for i in picks], dtype=torch.float32).view(rows, cols).to(dtype)
    return x, config


@requires_triton
@settings(derandomize=True, deadline=None, max_examples=60)
@given(cases())
def test_property_matches_torch(case):
    """Random shapes and chunkings; values from a few distinct ones (NaN, +-inf, +-0 among them): many ties."""
    x, config = case
    assert_argmax(x.to(DEVICE), config)


def test_registered_op():
    torch.manual_seed(4)
    x = torch.randn(4, 5000, device=DEVICE).to(torch.bfloat16)
    assert torch.equal(torch.ops.mini_infer.argmax_rows(x).cpu(), x.cpu().argmax(-1))


def test_fake_impl():
    with FakeTensorMode():
        out = torch.ops.mini_infer.argmax_rows(torch.empty(5, 151936, dtype=torch.bfloat16))
    assert out.shape == (5,) and out.dtype == torch.int64


def test_opcheck():
    torch.library.opcheck(torch.ops.mini_infer.argmax_rows.default, (torch.randn(3, 100),))


def test_kernel_compiles_for_sm90():
    """The kernel builds for sm_90 at `argmax_config`'s tiles without spills; a merged row counts arrivals with an
    acq_rel atomic at gpu scope and reads the partials through L2 (.cg), a one-program row has neither
    (tests/ops/compile_argmax_sm90.py; skipped without Triton's CUDA backend)."""
    report = run_uninterpreted(["-m", "tests.ops.compile_argmax_sm90"])
    assert len(report["cases"]) == 6 and report["cases"][-1]["noise"]
    for case in report["cases"]:
        # no spills: ptxas puts them on the stack (STACK:), LOCAL stays 0 when it spills
        assert case["resources"] == "" or ("LOCAL:0 " in case["resources"] and "STACK:0 " in case["resources"]), case
        if case["programs"] == 1:
            assert case["atomics"] == [] and "ld.global.cg.b32" not in case["loads"], case
        else:
            assert case["atomics"] == ["atom.global.gpu.acq_rel.add.u32"], case
            assert "ld.global.cg.b32" in case["loads"], case
    assert {c["tiles"] for c in report["cases"]} == {1, 2}


@requires_triton
def test_bench_script_checks_and_parses(monkeypatch):
    """bench/kernel_argmax.py (GPU timings) imports here, parses its options, and its --check cases (ties across
    chunks, NaN, -inf rows) pass."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "bench"))
    import kernel_argmax

    args = kernel_argmax.parse_args(["--rows", "1,8", "--vocab", "32000", "--check"])
    assert args.rows == [1, 8] and args.vocab == [32000] and args.check and args.dtype == "bf16"
    with pytest.raises(SystemExit):
        kernel_argmax.parse_args(["--rows", "0"])
    assert kernel_argmax.check_shape(3, 5000, torch.bfloat16, DEVICE) == []
