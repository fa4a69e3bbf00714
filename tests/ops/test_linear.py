import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import mini_infer.ops  # noqa: F401  (registers torch.ops.mini_infer.*)
from mini_infer.ops import linear as linear_mod
from mini_infer.ops.linear import GEMV_MAX_K, gemv_triton, linear_reference, linear_triton
from tests.ops.helpers import DEVICE, assert_close, assert_loop_sums, requires_triton, run_uninterpreted

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "k"), [(40, 96), (33, 1000), (7, 64), (130, 520)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_reference(dtype, n, k, bias):
    torch.manual_seed(n + k)
    w = (torch.randn(n, k, device=DEVICE) / k**0.5).to(dtype)
    b = torch.randn(n, device=DEVICE).to(dtype) if bias else None
    x = torch.randn(1, 1, k, device=DEVICE).to(dtype)  # the packed [1, T=1, K] layout
    out = gemv_triton(x, w, b)
    assert out.shape == (1, 1, n)
    assert_close(out, linear_reference(x, w, b))


@requires_triton
def test_gemv_strided_input_and_tile_configs():
    torch.manual_seed(0)
    w = torch.randn(50, 300, device=DEVICE)
    x = torch.randn(1, 600, device=DEVICE)[:, ::2]  # a non-contiguous row
    for cfg in [(4, 512, 4, 1), (8, 256, 4, 3), (16, 1024, 8, 4)]:
        assert_close(gemv_triton(x, w, None, cfg), F.linear(x, w))


@requires_triton
@pytest.mark.parametrize("k", [300, 1024])
def test_small_weight_preload_equals_the_k_loop(monkeypatch, k):
    """A plain GEMV whose weight is within LINEAR_PRELOAD_MAX_BYTES loads its rows before the PDL wait
    (`preload_width` asked, and not 0) and gives the K loop's sums; one byte over the limit, it waits first."""
    torch.manual_seed(k)
    w = torch.randn(40, k, device=DEVICE)
    x = torch.randn(1, k, device=DEVICE)
    widths = []
    real = linear_mod.preload_width
    monkeypatch.setattr(linear_mod, "preload_width", lambda *a: widths.append(real(*a)) or widths[-1])
    nbytes = w.numel() * w.element_size()
    monkeypatch.setattr(linear_mod, "LINEAR_PRELOAD_MAX_BYTES", nbytes)
    preloaded = gemv_triton(x, w, None)
    assert len(widths) == 1 and widths[0] >= k
    monkeypatch.setattr(linear_mod, "LINEAR_PRELOAD_MAX_BYTES", nbytes - 1)
    looped = gemv_triton(x, w, None)
    assert len(widths) == 1
    assert_loop_sums(preloaded, looped)
    assert_close(preloaded, F.linear(x, w))


def test_default_tile_by_shape():
    """Rows under 1024 elements: 4 x 512; 1024-2047 elements over a vocabulary-wide N: 4 x 512 in two pipelined
    steps (the lm_head of a 1024 hidden size); otherwise 2 x 1024 (H200 measurements in linear.py)."""
    assert linear_mod.gemv_config(576, 49152) == linear_mod.GEMV_CONFIG_SHORT_K
    assert linear_mod.gemv_config(1024, 151936) == linear_mod.GEMV_CONFIG_WIDE_1K
    assert linear_mod.gemv_config(1024, 4096) == linear_mod.GEMV_CONFIG_LONG_K
    assert linear_mod.gemv_config(2048, 151936) == linear_mod.GEMV_CONFIG_LONG_K
    assert linear_mod.gemv_config(1024) == linear_mod.GEMV_CONFIG_LONG_K  # N unknown


@requires_triton
def test_gemv_wide_tile_matches_reference():
    """The wide tile (two K steps of 512) on a 1024-element row: the reference's values."""
    torch.manual_seed(0)
    w = torch.randn(70, 1024, device=DEVICE)
    x = torch.randn(1, 1024, device=DEVICE)
    out = gemv_triton(x, w, None, config=linear_mod.GEMV_CONFIG_WIDE_1K)
    assert_close(out, F.linear(x, w))


@requires_triton
def test_dispatch_by_shape(monkeypatch):
    """One row with K <= GEMV_MAX_K takes the GEMV; more rows, longer rows or mixed dtypes take F.linear."""
    calls = []
    real = linear_mod.gemv_triton
    monkeypatch.setattr(linear_mod, "gemv_triton", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    w = torch.randn(24, 64, device=DEVICE)
    x1 = torch.randn(1, 1, 64, device=DEVICE)
    assert_close(linear_triton(x1, w, None), F.linear(x1, w))
    assert calls == [1]
    x3 = torch.randn(1, 3, 64, device=DEVICE)
    assert_close(linear_triton(x3, w, None), F.linear(x3, w))
    assert calls == [1]
    wl = torch.randn(4, GEMV_MAX_K + 1, device=DEVICE)
    xl = torch.randn(1, GEMV_MAX_K + 1, device=DEVICE)
    assert_close(linear_triton(xl, wl, None), F.linear(xl, wl))
    assert calls == [1]


def test_registered_op_and_fake():
    torch.manual_seed(3)
    x, w, b = torch.randn(2, 5, 16), torch.randn(8, 16), torch.randn(8)
    assert_close(torch.ops.mini_infer.linear(x, w, b), F.linear(x, w, b))
    assert_close(torch.ops.mini_infer.linear(x, w, None), F.linear(x, w))
    with FakeTensorMode():
        out = torch.ops.mini_infer.linear(torch.empty(1, 7, 64, dtype=torch.bfloat16),
                                          torch.empty(96, 64, dtype=torch.bfloat16), None)
    assert out.shape == (1, 7, 96) and out.dtype == torch.bfloat16


def test_preload_width_covers_k_in_one_two_or_four_chunks(monkeypatch):
    """A power of two covering K, 1, 2 or 4 of the tile's BLOCK_K; 0 past PRELOAD_MAX_K or with more chunks."""
    monkeypatch.setattr(linear_mod, "PRELOAD_MAX_K", 3072)
    long, short = linear_mod.GEMV_CONFIG_LONG_K, linear_mod.GEMV_CONFIG_SHORT_K
    assert [linear_mod.preload_width(k, long) for k in (96, 512, 1500, 2048, 2500, 3072)] == [1024, 1024, 2048, 2048,
                                                                                               4096, 4096]
    assert [linear_mod.preload_width(k, short) for k in (96, 1000, 2048, 3072)] == [512, 1024, 2048, 0]
    assert linear_mod.preload_width(3073, long) == 0
    assert linear_mod.preload_width(3000, (2, 256, 4, 1)) == 0  # 16 chunks of 256: the loop after the wait


def test_prefix_preload_width(monkeypatch):
    """The prefix of a row not preloaded whole: 1, 2 or 4 K steps within PREFIX_PRELOAD_K and shorter than the row;
    0 when off."""
    tile = linear_mod.GEMV_CONFIG_XLONG_K  # BLOCK_K 1024
    monkeypatch.setattr(linear_mod, "PREFIX_PRELOAD_K", 0)
    assert linear_mod.prefix_preload_width(14336, tile) == 0
    monkeypatch.setattr(linear_mod, "PREFIX_PRELOAD_K", 4096)
    assert [linear_mod.prefix_preload_width(k, tile) for k in (1000, 1500, 3000, 5000, 14336)] == [0, 1024, 2048,
                                                                                                     4096, 4096]
    monkeypatch.setattr(linear_mod, "PREFIX_PRELOAD_K", 3000)
    assert linear_mod.prefix_preload_width(14336, tile) == 2048
    monkeypatch.setattr(linear_mod, "PREFIX_PRELOAD_K", 65536)
    assert linear_mod.prefix_preload_width(14336, tile) == 4096


def test_preload_kernels_compile_for_sm90():
    """Both one-row kernels that take the weight preload build for sm_90 with one, two and four chunks preloaded
    (and without) and no spills (tests/ops/compile_gemv_preload_sm90.py; skipped without Triton's CUDA backend)."""
    report = run_uninterpreted(["-m", "tests.ops.compile_gemv_preload_sm90"])
    preloads = {}
    for case in report["cases"]:
        preloads.setdefault(case["kernel"], []).append(case["preload_k"] // case["block_k"])
        # no spills: ptxas puts them on the stack (STACK:), LOCAL stays 0 when it spills
        assert case["resources"] == "" or ("LOCAL:0 " in case["resources"] and "STACK:0 " in case["resources"]), case
    whole = {name: chunks for name, chunks in preloads.items() if ":" not in name}
    assert len(whole) == 2 and all(0 in chunks and 2 in chunks and 4 in chunks for chunks in whole.values())
    assert preloads["linear_add._gemv_add_kernel:prefix"] == [2, 4]  # a prefix of a longer row (PRELOAD_PREFIX)


def test_opcheck():
    torch.library.opcheck(torch.ops.mini_infer.linear.default, (torch.randn(3, 16), torch.randn(8, 16), torch.randn(8)))
