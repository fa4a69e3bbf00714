"""`fused_moe_add`: fused_moe's output plus the residual, bit-equal to the unfused pair (fused_moe, then torch's add)
on every path of the Triton op: the grouped GEMMs with the add in the slot sum (top-k > 1), top-1 (torch's add
after), the decode path's two down kernels (the add in the down GEMV), a residual of another dtype (torch's add
after); the reference; the registered op and its fake."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import mini_infer.ops  # noqa: F401  (registers torch.ops.mini_infer.*)
from mini_infer.ops import _moe_gemv as moe_gemv_mod
from mini_infer.ops.fused_moe import fused_moe_reference, fused_moe_triton
from mini_infer.ops.fused_moe_add import fused_moe_add_reference, fused_moe_add_triton
from tests.ops.helpers import DEVICE, requires_triton
from tests.ops.test_fused_moe import DECODE, GEMV, GEMV_BOTH_SLOTS, _experts, _routing

mi = torch.ops.mini_infer


def assert_pair_bits(got: torch.Tensor, pair: torch.Tensor) -> None:
    """got equals the unfused pair bit for bit, except where Triton's interpreter rounds the epilogue's fp32 sum to a
    16-bit dtype by truncation (a GPU rounds to nearest, as torch's add does): there within one ulp of the pair."""
    assert got.dtype == pair.dtype and got.shape == pair.shape
    if pair.dtype == torch.float32 or got.is_cuda:
        assert torch.equal(got, pair)
    else:
        ulp = torch.finfo(pair.dtype).eps * pair.float().abs()
        assert ((got.float() - pair.float()).abs() <= ulp).all()


def _case(tokens, num_experts, top_k, dtype, residual_dtype=None, seed=0):
    torch.manual_seed(seed)
    x = torch.randn(tokens, 32, device=DEVICE).to(dtype)
    w13, w2 = _experts(num_experts, 32, 48, dtype, seed=seed)
    weights, ids = _routing(tokens, num_experts, top_k, seed=seed)
    r = torch.randn(tokens, 32, device=DEVICE).to(residual_dtype or dtype)
    return x, weights, ids, w13, w2, r


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("config", "top_k", "slots"), [(DECODE, 2, False), (DECODE, 1, False), (GEMV, 2, False),
                                                       (GEMV_BOTH_SLOTS, 3, True)],
                         ids=["grouped_sum", "grouped_top1", "gemv", "gemv_slots"])
def test_triton_equals_fused_moe_then_add(dtype, config, top_k, slots, monkeypatch):
    """The add in the last kernel's epilogue gives the pair's bits (the MoE output rounded first, as the pair
    rounds it); the op picked by shape too."""
    x, weights, ids, w13, w2, r = _case(5, 8, top_k, dtype, seed=3)
    assert_pair_bits(fused_moe_triton(x, weights, ids, w13, w2, config=config, residual=r),
                     fused_moe_triton(x, weights, ids, w13, w2, config=config) + r)
    assert_pair_bits(fused_moe_add_triton(x, weights, ids, w13, w2, r), fused_moe_triton(x, weights, ids, w13, w2) + r)


@requires_triton
def test_a_residual_of_another_dtype_is_added_after():
    """A float32 residual beside bf16 hidden states: torch's add after the op (promoted to float32), not the
    epilogue (which stores in hidden's dtype)."""
    x, weights, ids, w13, w2, r = _case(3, 8, 2, torch.bfloat16, torch.float32, seed=4)
    got = fused_moe_triton(x, weights, ids, w13, w2, config=DECODE, residual=r)
    assert got.dtype == torch.float32
    assert torch.equal(got, fused_moe_triton(x, weights, ids, w13, w2, config=DECODE) + r)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_fused_moe_then_add(dtype):
    x, weights, ids, w13, w2, r = _case(4, 8, 2, dtype, seed=5)
    assert torch.equal(fused_moe_add_reference(x, weights, ids, w13, w2, r),
                       fused_moe_reference(x, weights, ids, w13, w2) + r)


def test_registered_op_and_fake():
    x, weights, ids, w13, w2, r = (t.cpu() for t in _case(3, 8, 2, torch.float32, seed=6))
    assert torch.equal(mi.fused_moe_add(x, weights, ids, w13, w2, r), fused_moe_reference(x, weights, ids, w13, w2) + r)
    real = (x.bfloat16(), weights, ids, w13.bfloat16(), w2.bfloat16(), r)
    with FakeTensorMode() as mode:
        out = mi.fused_moe_add(*(mode.from_tensor(t) for t in real))
    assert out.shape == (3, 32) and out.dtype == torch.float32  # the add promotes bf16 + fp32
    torch.library.opcheck(mi.fused_moe_add.default, (x, weights, ids, w13, w2, r))


@requires_triton
def test_slots_switches_take_the_residual_too(monkeypatch):
    """The decode path picked by shape (one token, two pairs) with both slots kernels switched on: the add in the
    slots down GEMV."""
    monkeypatch.setattr(moe_gemv_mod, "DOWN_SLOTS", True)
    monkeypatch.setattr(moe_gemv_mod, "GATE_UP_SLOTS", True)
    x, weights, ids, w13, w2, r = _case(1, 8, 2, torch.bfloat16, seed=7)
    assert_pair_bits(fused_moe_add_triton(x, weights, ids, w13, w2, r), fused_moe_triton(x, weights, ids, w13, w2) + r)
