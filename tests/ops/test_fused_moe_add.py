"""fused_moe_add: the routed experts plus the residual, the add where the slots are summed.

Every launch path of fused_moe (pair-per-block with the slot sum in the down GEMM, the slot-sum kernel after the
sorted path or with MOE_MERGE_SLOTS off, the decode path's down GEMV, one slot a token) gives the unfused
`fused_moe` then torch's add bit for bit, with an expert map and ids of no expert too, and with the add in the
kernel (HAS_RESIDUAL) where the path has one; the reference is `fused_moe_reference` plus the residual; the fake
and opcheck hold; bad residuals are named. fp16 and fp32 (the interpreter's fp32 -> bf16 conversion truncates,
where torch's add rounds to nearest: on a GPU bf16 is the same case).
"""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import mini_infer.ops  # noqa: F401  (registers torch.ops.mini_infer.*)
from mini_infer.ops import _moe_gemv as moe_gemv_mod
from mini_infer.ops import fused_moe as fused_moe_mod
from mini_infer.ops.fused_moe import fused_moe_reference, fused_moe_triton
from mini_infer.ops.fused_moe_add import fused_moe_add_reference, fused_moe_add_triton
from tests.ops.helpers import DEVICE, record_kernel_launches, requires_triton
from tests.ops.test_fused_moe import DECODE, GEMV, PLACEMENTS, _expert_map, _rank_case

# (config, pair_blocks, merge, tokens, top_k, placement) -> the kernel that must add the residual
CASES = {
    "merged_slot_sum": (DECODE, True, True, 1, 4, None, "_moe_gemm_kernel"),
    "merged_slot_sum_rank": (DECODE, True, True, 2, 3, "round robin", "_moe_gemm_kernel"),
    "sum_kernel": (DECODE, False, True, 5, 2, None, "_moe_sum_kernel"),
    "sum_kernel_no_merge": (DECODE, True, False, 1, 4, None, "_moe_sum_kernel"),
    "gemv_down": (GEMV, None, True, 2, 2, None, "_moe_gemv_down_kernel"),
    "one_slot": (DECODE, False, True, 3, 1, None, None),
}


def _case(tokens, top_k, placement, dtype=torch.float16, num_experts=8):
    x, weights, ids, w13, w2 = _rank_case(num_experts, tokens, top_k=top_k, dtype=dtype, seed=31)
    emap = None
    if placement is not None:
        held = list(PLACEMENTS[placement])
        emap = _expert_map(num_experts, PLACEMENTS[placement]).to(DEVICE)
        w13, w2 = w13[held].contiguous(), w2[held].contiguous()
    residual = (torch.randn(tokens, x.shape[1], generator=torch.Generator().manual_seed(4)) * 4).to(dtype)
    return x, weights, ids, w13, w2, emap, residual.to(DEVICE)


@requires_triton
@pytest.mark.parametrize("name", CASES)
def test_each_path_gives_the_unfused_bits(name, monkeypatch):
    config, pair_blocks, merge, tokens, top_k, placement, adder = CASES[name]
    x, weights, ids, w13, w2, emap, residual = _case(tokens, top_k, placement)
    monkeypatch.setattr(fused_moe_mod, "MOE_MERGE_SLOTS", merge)
    unfused = fused_moe_triton(x, weights, ids, w13, w2, "silu", emap, config=config, pair_blocks=pair_blocks)
    launches = []
    record_kernel_launches(monkeypatch, fused_moe_mod, "_moe_gemm_kernel", "_moe_sum_kernel", launches=launches,
                           arguments=True)
    record_kernel_launches(monkeypatch, moe_gemv_mod, "_moe_gemv_down_kernel", launches=launches, arguments=True)
    fused = fused_moe_triton(x, weights, ids, w13, w2, "silu", emap, config=config, pair_blocks=pair_blocks,
                             residual=residual)
    assert torch.equal(fused, unfused + residual)
    adding = [kw.get("HAS_RESIDUAL", False) for _, kw in launches]
    assert sum(adding) == (adder is not None)  # one launch adds it, or (k == 1) torch's add after the op
    if adder is not None:
        assert not any(adding[:-1]) and adding[-1]  # the last launch, which sums the slots


@requires_triton
def test_op_triton_path_and_reference():
    """The Triton launcher equals the unfused pair (fp32 too, and with a residual of another dtype: torch's add);
    the reference is fused_moe_reference plus the residual, and close to the Triton output."""
    for dtype in (torch.float32, torch.float16):
        x, weights, ids, w13, w2, emap, residual = _case(2, 2, None, dtype=dtype)
        out = fused_moe_add_triton(x, weights, ids, w13, w2, residual)
        assert torch.equal(out, fused_moe_triton(x, weights, ids, w13, w2) + residual)
        ref = fused_moe_add_reference(x.cpu(), weights.cpu(), ids.cpu(), w13.cpu(), w2.cpu(), residual.cpu())
        assert torch.equal(ref, fused_moe_reference(x.cpu(), weights.cpu(), ids.cpu(), w13.cpu(), w2.cpu())
                           + residual.cpu())
        torch.testing.assert_close(out.cpu(), ref, rtol=1e-2 if dtype == torch.float16 else 1e-5, atol=1e-2)
    wide = residual.float()
    out = fused_moe_add_triton(x, weights, ids, w13, w2, wide)
    assert out.dtype == torch.float32 and torch.equal(out, fused_moe_triton(x, weights, ids, w13, w2) + wide)


def test_registered_op_fake_opcheck_and_errors():
    x, weights, ids, w13, w2, emap, residual = (t.cpu() if t is not None else None
                                                for t in _case(3, 2, None, dtype=torch.float32))
    args = (x, weights, ids, w13, w2, residual)
    assert torch.equal(torch.ops.mini_infer.fused_moe_add(*args), fused_moe_add_reference(*args))
    torch.library.opcheck(torch.ops.mini_infer.fused_moe_add.default, args)
    with FakeTensorMode():
        out = torch.ops.mini_infer.fused_moe_add(
            torch.empty(7, 64, dtype=torch.bfloat16), torch.empty(7, 2), torch.empty(7, 2, dtype=torch.int32),
            torch.empty(8, 96, 64, dtype=torch.bfloat16), torch.empty(8, 64, 48, dtype=torch.bfloat16),
            torch.empty(7, 64, dtype=torch.bfloat16))
    assert out.shape == (7, 64) and out.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="residual"):
        fused_moe_add_reference(x, weights, ids, w13, w2, residual[:2])
    with pytest.raises(ValueError, match="residual"):
        fused_moe_mod._check_residual(residual.half(), 3, x.shape[1], x.dtype)
