import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import mini_infer.ops  # noqa: F401  (registers torch.ops.mini_infer.*)
from mini_infer.ops import fused_moe as fused_moe_mod
from mini_infer.ops import moe_topk as moe_topk_mod
from mini_infer.ops.fused_moe import fused_moe_routed_triton, fused_moe_triton, routes_in_gemms
from mini_infer.ops.fused_moe_routed import fused_moe_routed_reference
from mini_infer.ops.moe_topk import moe_topk_triton
from tests.ops.helpers import DEVICE, assert_close, record_kernel_launches, requires_triton

H, I = 64, 48  # noqa: E741  (I: the experts' intermediate size)


def _inputs(tokens, num_experts, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, H, generator=g).to(dtype)
    logits = torch.randn(tokens, num_experts, generator=g).to(dtype)
    w13 = (torch.randn(num_experts, 2 * I, H, generator=g) / H**0.5).to(dtype)
    w2 = (torch.randn(num_experts, H, I, generator=g) / I**0.5).to(dtype)
    return tuple(t.to(DEVICE) for t in (hidden, logits, w13, w2))


def _unfused(hidden, logits, w13, w2, top_k, renormalize, scale, weights_dtype):
    weights, ids = moe_topk_triton(logits, top_k, "softmax", renormalize, scale, weights_dtype=weights_dtype)
    return fused_moe_triton(hidden, weights, ids, w13, w2)


@requires_triton
@pytest.mark.parametrize(("tokens", "num_experts", "top_k", "renormalize", "scale", "weights_dtype"), [
    (1, 16, 4, True, 1.0, torch.bfloat16),  # Qwen-MoE: renormalized, the weights rounded to the logits' dtype
    (1, 64, 6, False, 1.0, None),  # DeepSeek-V2 greedy: not renormalized, fp32 weights
    (2, 64, 4, True, 2.5, None),  # two tokens (still one block a pair), a scaling factor
    (1, 128, 8, True, 1.0, torch.bfloat16),  # qwen3-30b-a3b's routing at ROUTE_MAX_EXPERTS
])
def test_routed_blocks_equal_the_routing_kernel_then_fused_moe(monkeypatch, tokens, num_experts, top_k, renormalize,
                                                                scale, weights_dtype):
    """At the pair-per-block shapes no routing kernel runs, only the two GEMMs; each block's expert is the routing
    kernel's (ties included: two equal logits, and a tie at the k-th place), its weight within fp32 rounding (the
    same bits under the interpreter), so the output is the unfused pair's."""
    hidden, logits, w13, w2 = _inputs(tokens, num_experts, seed=num_experts + top_k)
    logits[0, 1] = logits[0, 2] = logits[0].max()  # a tie for the first place: the lower index first
    order = logits[-1].float().argsort(descending=True)
    logits[-1, order[top_k]] = logits[-1, order[top_k - 1]]  # a tie at the k-th place: the lower index taken
    assert routes_in_gemms(tokens, top_k, num_experts, H, I)
    launches = record_kernel_launches(monkeypatch, fused_moe_mod, "_moe_gemm_kernel", "_moe_sum_kernel",
                                      "_align_single_kernel", "_align_count_kernel")
    record_kernel_launches(monkeypatch, moe_topk_mod, "_moe_topk_kernel", launches=launches)
    got = fused_moe_routed_triton(hidden, logits, w13, w2, top_k, renormalize, scale, weights_dtype)
    assert launches == ["_moe_gemm_kernel", "_moe_gemm_kernel"]
    want = _unfused(hidden, logits, w13, w2, top_k, renormalize, scale, weights_dtype)
    if DEVICE == "cpu":
        assert torch.equal(got, want)
    else:
        assert_close(got, want)
    assert_close(got, fused_moe_routed_reference(hidden.cpu(), logits.cpu(), w13.cpu(), w2.cpu(), top_k, renormalize,
                                                 scale, weights_dtype).to(DEVICE))


@requires_triton
@pytest.mark.parametrize(("tokens", "num_experts", "top_k"), [(4, 16, 4), (1, 160, 4), (1, 8, 2)])
def test_other_shapes_run_the_two_ops(tokens, num_experts, top_k):
    """Several tokens sharing experts, more experts than ROUTE_MAX_EXPERTS, or pairs the decode-path GEMVs take: the
    routing kernel, then fused_moe's kernels, bit for bit."""
    hidden, logits, w13, w2 = _inputs(tokens, num_experts, seed=tokens)
    assert not routes_in_gemms(tokens, top_k, num_experts, H, I)
    got = fused_moe_routed_triton(hidden, logits, w13, w2, top_k, True)
    assert torch.equal(got, _unfused(hidden, logits, w13, w2, top_k, True, 1.0, None))


def test_routes_in_gemms_by_shape():
    """Pair-per-block shapes of at most ROUTE_MAX_EXPERTS experts whose pairs the decode-path GEMVs do not take."""
    assert routes_in_gemms(1, 8, 128, 2048, 768)  # qwen3-30b-a3b, batch 1
    assert routes_in_gemms(2, 8, 128, 2048, 768)
    assert not routes_in_gemms(3, 8, 128, 2048, 768)  # past the pair-per-block shapes
    assert not routes_in_gemms(1, 8, moe_topk_mod.ROUTE_MAX_EXPERTS * 2, 2048, 768)
    assert not routes_in_gemms(1, 2, 8, 4096, 14336)  # mixtral-8x7b, batch 1: the decode-path GEMVs


def test_errors_name_the_argument():
    hidden, logits, w13, w2 = (t.cpu() for t in _inputs(1, 8, seed=0))
    with pytest.raises(ValueError, match="router_logits"):
        torch.ops.mini_infer.fused_moe_routed(hidden, logits[:, :7], w13, w2, 2, True)
    with pytest.raises(ValueError, match="top_k"):
        torch.ops.mini_infer.fused_moe_routed(hidden, logits, w13, w2, 9, True)


def test_registered_op_runs_the_reference_on_cpu_and_fakes():
    hidden, logits, w13, w2 = (t.cpu() for t in _inputs(3, 8, seed=1))
    out = torch.ops.mini_infer.fused_moe_routed(hidden, logits, w13, w2, 2, True, 1.0, torch.bfloat16)
    assert torch.equal(out, fused_moe_routed_reference(hidden, logits, w13, w2, 2, True, 1.0, torch.bfloat16))
    with FakeTensorMode() as mode:
        fake = torch.ops.mini_infer.fused_moe_routed(*(mode.from_tensor(t) for t in (hidden, logits, w13, w2)), 2, True)
    assert fake.shape == hidden.shape and fake.dtype == hidden.dtype
    torch.library.opcheck(torch.ops.mini_infer.fused_moe_routed.default, (hidden, logits, w13, w2, 2, True, 1.0, None))
