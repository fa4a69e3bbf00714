"""mlp_persistent: a dense layer's gated MLP for one row in one persistent kernel (under the interpreter: its two
phase launches), bit for bit the unfused kernels it replaces (rms_norm_linear, silu_and_mul, linear_add); the unfused
kernels for rows it does not take; the reference on CPU; and the GPU build (PHASES=3: the grid barrier) compiled
for sm_90 without a GPU, where Triton's CUDA backend and ptxas are installed."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import mini_infer.ops  # noqa: F401  (registers torch.ops.mini_infer.*)
from mini_infer.ops import linear as linear_mod
from mini_infer.ops import mlp_persistent as mod
from mini_infer.ops.linear_add import linear_add_triton
from mini_infer.ops.mlp_persistent import MlpTile, mlp_persistent_reference, mlp_persistent_triton
from mini_infer.ops.rms_norm_linear import rms_norm_linear_triton
from mini_infer.ops.silu_and_mul import silu_and_mul_triton
from tests.ops.helpers import DEVICE, assert_close, requires_triton, run_uninterpreted

mi = torch.ops.mini_infer
EPS = 1e-6


def _inputs(rows, h, i, dtype, bias=False, residual_dtype=None, seed=0):
    """x [1, rows, h], norm weight [h], gate_up weight [2i, h] (+ bias [2i]), down weight [h, i] (+ bias [h]),
    residual [1, rows, h] (residual_dtype, default dtype)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0, shift=0.0, to=dtype):
        return (torch.randn(shape, generator=gen) * scale + shift).to(to).to(DEVICE)

    return (rand(1, rows, h, scale=2.0), rand(h, scale=0.2, shift=1.0), EPS, rand(2 * i, h, scale=h**-0.5),
            rand(2 * i) if bias else None, rand(h, i, scale=i**-0.5), rand(h) if bias else None,
            rand(1, rows, h, to=residual_dtype or dtype))


def _unfused(x, nw, eps, wgu, bgu, wd, bd, r):
    """The three kernels the default CUDA pipeline runs for the MLP of a decode row."""
    gate, up = rms_norm_linear_triton(x, nw, eps, wgu, bgu).split(wd.shape[1], -1)
    return linear_add_triton(silu_and_mul_triton(gate, up), wd, bd, r)


@pytest.fixture
def launches(monkeypatch):
    """The grids the persistent kernel is launched with (each launch still runs)."""
    calls = []
    real = mod._mlp_persistent_kernel

    class Recorder:
        def __getitem__(self, grid):
            calls.append(grid)
            return real[grid]

    monkeypatch.setattr(mod, "_mlp_persistent_kernel", Recorder())
    return calls


# (H, I): neither a multiple of the rows per tile, I >= 1024 takes the long K step in phase B
SHAPES = [(96, 150), (130, 1030)]


@requires_triton
@pytest.mark.parametrize(("dtype", "residual_dtype"), [(torch.float32, None), (torch.bfloat16, None),
                                                       (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize(("h", "i"), SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_one_row_equals_the_unfused_kernels(launches, dtype, residual_dtype, h, i, bias):
    """The persistent kernel (few programs, each looping over tiles), the unfused kernels' bits; in fp32 the
    references' values too."""
    args = _inputs(1, h, i, dtype, bias, residual_dtype, seed=h + i)
    y = mlp_persistent_triton(*args)
    phases = 2 if DEVICE == "cpu" else 1
    assert len(launches) == phases and all(g == launches[0] for g in launches)
    assert launches[0][0] < max(i // 4, h // 2)  # fewer programs than tiles: the loops run
    expected = _unfused(*args)
    assert y.dtype == expected.dtype and torch.equal(y, expected)
    if dtype == torch.float32:
        assert_close(y, mlp_persistent_reference(*args))


@requires_triton
@pytest.mark.parametrize(("tile", "programs"), [(MlpTile(1, 1), 1), (MlpTile(8, 4), 7), (MlpTile(), 10_000)])
def test_any_tile_and_grid(launches, tile, programs):
    """One program doing every tile, a ragged split, and more programs than tiles (capped at the tiles needed)."""
    args = _inputs(1, 40, 70, torch.float32, bias=True, seed=3)
    y = mod.launch_mlp_persistent(*args, tile=tile, num_programs=programs)
    needed = max(-(-70 // tile.gate_rows), -(-40 // tile.down_rows))
    assert launches[0] == (min(programs, needed),)
    assert torch.equal(y, _unfused(*args))


@requires_triton
@pytest.mark.parametrize("case", ["rows", "long_k", "broadcast_residual"])
def test_other_shapes_run_the_unfused_kernels(launches, monkeypatch, case):
    """Several rows (prefill), a down row longer than the GEMV takes (its limit lowered to 64: the interpreter is
    slow), a residual that broadcasts: no persistent launch, the unfused kernels' values."""
    monkeypatch.setattr(linear_mod, "GEMV_MAX_K", 64)
    rows, i = (3, 24) if case == "rows" else (1, 65) if case == "long_k" else (1, 24)
    x, nw, eps, wgu, bgu, wd, bd, r = _inputs(rows, 16, i, torch.float32, bias=True)
    if case == "broadcast_residual":
        r = r[0, 0]
    y = mlp_persistent_triton(x, nw, eps, wgu, bgu, wd, bd, r)
    assert launches == []
    assert_close(y, mlp_persistent_reference(x, nw, eps, wgu, bgu, wd, bd, r))


def test_registered_op_runs_the_reference_on_cpu():
    args = [t.cpu() if isinstance(t, torch.Tensor) else t for t in _inputs(5, 12, 20, torch.float32, bias=True)]
    x, nw, eps, wgu, bgu, wd, bd, r = args
    h = nw * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    gate, up = torch.nn.functional.linear(h, wgu, bgu).chunk(2, -1)
    expected = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, wd, bd) + r
    assert torch.equal(mi.mlp_persistent(*args), expected)


def test_fake_impl_and_opcheck():
    with FakeTensorMode():
        x = torch.empty(1, 7, 64, dtype=torch.bfloat16)
        wgu, wd = torch.empty(96, 64, dtype=torch.bfloat16), torch.empty(64, 48, dtype=torch.bfloat16)
        s = mi.mlp_persistent(x, x[0, 0], 1e-6, wgu, None, wd, None, torch.empty(1, 7, 64, dtype=torch.float32))
    assert s.shape == (1, 7, 64) and s.dtype == torch.float32  # the add promotes
    args = [t.cpu() if isinstance(t, torch.Tensor) else t for t in _inputs(3, 12, 16, torch.float32, bias=True)]
    torch.library.opcheck(mi.mlp_persistent.default, tuple(args))


# -- the GPU build: PHASES=3 (the grid barrier) and programmatic dependent launch, compiled for sm_90 ----------------


@requires_triton
@pytest.mark.parametrize("tile", [(4, 2, 4, 1), (8, 4, 8, 2)])
def test_gpu_build_compiles_for_sm90_with_the_barrier(tile):
    """In a process without the interpreter (tests/ops/compile_sm90.py): the barrier's atomics and PDL's
    griddepcontrol are in the PTX, and nothing spills (cuobjdump's LOCAL:0)."""
    report = run_uninterpreted(["-m", "tests.ops.compile_sm90", *map(str, tile), "3072"])
    print(f"sm_90 bf16 tile {tile}: {report['usage']}")  # pytest -s shows it
    assert all(report["ptx"].values()), report["ptx"]
    assert not report["usage"] or "LOCAL:0 " in report["usage"]


def test_barrier_words_are_one_buffer_per_device_however_it_is_named(monkeypatch):
    """"cuda" and "cuda:<current>" name the same barrier words: the timeout counter the benchmark reads (with
    "cuda") is the one the launches (on x.device, "cuda:0") count into. Checked on the key the cache uses."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert mod._resolved("cuda") == mod._resolved(torch.device("cuda", 3)) == torch.device("cuda", 3)
    assert mod._resolved("cuda:1") == torch.device("cuda", 1)
    assert mod._resolved("cpu") == torch.device("cpu")
    assert mod._barrier_words("cpu") is mod._barrier_words(torch.device("cpu"))
