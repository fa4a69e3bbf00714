"""fused_moe_add_rms_norm: fused_moe's output added to the residual and normalized, the add + norm in the slot sum's
launch. Under the interpreter the fused kernel gives the unfused kernels' bits (fused_moe_triton, then
fused_add_rms_norm_triton) at decode shapes (T = 1, 2; pair-per-block mode), at a multi-program prefill shape (the
norm tile's rows, a masked tail), with dropped slots and an expert map; shapes without a slot sum (k == 1, the
decode GEMV path) run the unfused kernels, and the test checks which ran. On CPU the registered op runs the two
references; its fake gives the residual's shape. The chain's fused kernels compile for sm_90 without spills."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import mini_infer.ops  # noqa: F401  (registers torch.ops.mini_infer.*)
from mini_infer.ops import fused_moe_add_rms_norm as mod
from mini_infer.ops.fused_add_rms_norm import fused_add_rms_norm_reference, fused_add_rms_norm_triton
from mini_infer.ops.fused_moe import fused_moe_reference, fused_moe_triton
from mini_infer.ops.fused_moe_add_rms_norm import (
    fused_moe_add_rms_norm_reference,
    fused_moe_add_rms_norm_triton,
)
from tests.ops.helpers import DEVICE, requires_triton, run_uninterpreted

mi = torch.ops.mini_infer
EPS = 1e-6
HIDDEN, INTER, EXPERTS = 40, 32, 16  # H not a power of two: the norm tile's masked columns


def _case(tokens, top_k, dtype, nw_dtype=None, seed=0):
    """(hidden [T, H], weights [T, k] fp32, ids [T, k] int32 (distinct experts per token), w13, w2,
    residual [1, T, H], norm weight [H])."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0, shift=0.0):
        return (torch.randn(shape, generator=gen) * scale + shift).to(dtype).to(DEVICE)

    w, ids = torch.softmax(torch.randn(tokens, EXPERTS, generator=gen), -1).topk(top_k)
    nw = (torch.rand(HIDDEN, generator=gen) + 0.5).to(nw_dtype or dtype).to(DEVICE)
    return (rand(tokens, HIDDEN), w.to(DEVICE), ids.int().to(DEVICE), rand(EXPERTS, 2 * INTER, HIDDEN,
            scale=HIDDEN**-0.5), rand(EXPERTS, HIDDEN, INTER, scale=INTER**-0.5), rand(1, tokens, HIDDEN, scale=2.0),
            nw)  # fmt: skip


def _unfused(fused_moe_impl, add_norm_impl, x, w, ids, w13, w2, residual, nw, expert_map=None):
    y = fused_moe_impl(x, w, ids, w13, w2, "silu", expert_map)
    return add_norm_impl(residual, y.view(residual.shape), nw, EPS)


def _assert_same_bits(got, expected):
    for g, e in zip(got, expected, strict=True):
        assert g.shape == e.shape and g.dtype == e.dtype, (g.shape, e.shape, g.dtype, e.dtype)
        assert torch.equal(g, e), (g - e).abs().max()


def _record_unfused_norms(monkeypatch) -> list:
    """Calls of the unfused add + norm from the fused op from now on (each still runs)."""
    calls = []
    real = mod.fused_add_rms_norm_triton
    monkeypatch.setattr(mod, "fused_add_rms_norm_triton", lambda *a: calls.append(1) or real(*a))
    return calls


@requires_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("tokens", "top_k"), [(1, 4), (2, 3), (19, 2)], ids=["T1", "T2", "T19"])
def test_fused_launch_equals_unfused_kernels(dtype, tokens, top_k, monkeypatch):
    """Where fused_moe ends in a slot sum, the add + norm run in its launch (no unfused norm called) and give the
    unfused kernels' outputs bit for bit: decode (T = 1, 2: pair-per-block mode) and 19 tokens (several programs of
    the norm tile's rows, the last one short), with one slot of "no expert" (id E)."""
    x, w, ids, w13, w2, residual, nw = _case(tokens, top_k, dtype, seed=tokens)
    ids[-1, -1] = EXPERTS
    calls = _record_unfused_norms(monkeypatch)
    got = fused_moe_add_rms_norm_triton(x, w, ids, w13, w2, residual, nw, EPS)
    assert calls == []
    _assert_same_bits(got, _unfused(fused_moe_triton, fused_add_rms_norm_triton, x, w, ids, w13, w2, residual, nw))


@requires_triton
def test_fused_launch_with_expert_map_and_wider_norm_weight(monkeypatch):
    """An expert map (this rank holds every other expert: the others' slots contribute nothing) and an fp32 norm
    weight on bf16 activations (the normed output is fp32, as fused_add_rms_norm promotes it)."""
    x, w, ids, w13, w2, residual, nw = _case(2, 4, torch.bfloat16, nw_dtype=torch.float32, seed=5)
    held = list(range(1, EXPERTS, 2))
    emap = torch.full((EXPERTS,), -1, dtype=torch.int32)
    emap[held] = torch.arange(len(held), dtype=torch.int32)
    emap = emap.to(DEVICE)
    w13, w2 = w13[held], w2[held]
    calls = _record_unfused_norms(monkeypatch)
    got = fused_moe_add_rms_norm_triton(x, w, ids, w13, w2, residual, nw, EPS, "silu", emap)
    assert calls == [] and got[0].dtype == torch.float32
    _assert_same_bits(got, _unfused(fused_moe_triton, fused_add_rms_norm_triton, x, w, ids, w13, w2, residual, nw,
                                    emap))


@requires_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("tokens", "top_k"), [(1, 2), (5, 1)], ids=["gemv_path", "one_slot"])
def test_no_slot_sum_runs_the_unfused_kernels(dtype, tokens, top_k, monkeypatch):
    """Shapes where fused_moe has no slot sum (its decode GEMV path at two pairs; k == 1, whose down GEMM writes the
    output) run fused_moe's kernels, then fused_add_rms_norm's: the unfused outputs exactly."""
    x, w, ids, w13, w2, residual, nw = _case(tokens, top_k, dtype, seed=7)
    calls = _record_unfused_norms(monkeypatch)
    got = fused_moe_add_rms_norm_triton(x, w, ids, w13, w2, residual, nw, EPS)
    assert calls == [1]
    _assert_same_bits(got, _unfused(fused_moe_triton, fused_add_rms_norm_triton, x, w, ids, w13, w2, residual, nw))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_registered_op_on_cpu_is_the_two_references(dtype):
    x, w, ids, w13, w2, residual, nw = (t.cpu() for t in _case(3, 2, dtype, seed=3))
    expected = _unfused(fused_moe_reference, fused_add_rms_norm_reference, x, w, ids, w13, w2, residual, nw)
    _assert_same_bits(mi.fused_moe_add_rms_norm(x, w, ids, w13, w2, residual, nw, EPS), expected)
    _assert_same_bits(fused_moe_add_rms_norm_reference(x, w, ids, w13, w2, residual, nw, EPS), expected)


def test_fake_and_bad_shapes():
    x, w, ids, w13, w2, residual, nw = (t.cpu() for t in _case(3, 2, torch.bfloat16))
    with FakeTensorMode() as mode:
        normed, s = mi.fused_moe_add_rms_norm(*(mode.from_tensor(t) for t in (x, w, ids, w13, w2, residual, nw)), EPS)
    assert normed.shape == s.shape == residual.shape and normed.dtype == s.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="residual"):
        fused_moe_add_rms_norm_reference(x, w, ids, w13, w2, residual[:, :2], nw, EPS)
    with pytest.raises(ValueError, match="norm_weight"):
        fused_moe_add_rms_norm_reference(x, w, ids, w13, w2, residual, nw[:-1], EPS)


@requires_triton
def test_moe_chain_kernels_compile_for_sm90_without_spills():
    """Compiled for sm_90 at qwen3-30b-a3b's batch-1 launches (no GPU needed; tests/ops/compile_moe_chain_sm90.py):
    the slot sum + add + norm kernel and the router GEMV + routing kernel build, as do the unfused kernels whose
    bodies they share, with no register spills."""
    report = run_uninterpreted(["-m", "tests.ops.compile_moe_chain_sm90"])
    assert [c["kernel"] for c in report["cases"]] == ["moe_sum", "moe_sum_add_rms_norm", "moe_topk", "gemv_moe_topk"]
    for case in report["cases"]:
        assert "LOCAL:0 " in case["usage"], case
