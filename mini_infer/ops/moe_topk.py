"""`mini_infer::moe_topk`: mixture-of-experts routing, the top_k experts of each token and their weights.

Meant for the pass that replaces Hugging Face MoE blocks: it feeds the router's logits here and the result to
`mini_infer::fused_moe`. It covers the routers of transformers 5.x:

| family (HF router)                    | scoring  | renormalize     | n_group / topk_group | bias | scaling |
|---------------------------------------|----------|-----------------|----------------------|------|---------|
| Mixtral (`MixtralTopKRouter`)         | softmax  | True            | 1 / 1                | -    | 1.0     |
| Qwen2-MoE, Qwen3-MoE (`*TopKRouter`)  | softmax  | norm_topk_prob  | 1 / 1                | -    | 1.0     |
| DeepSeek-V2 `greedy`                  | softmax  | False           | 1 / 1                | -    | yes     |
| DeepSeek-V2 `group_limited_greedy`    | softmax  | False           | n_group / topk_group | -    | yes     |
| DeepSeek-V3 (`noaux_tc`)              | sigmoid  | norm_topk_prob  | n_group / topk_group | yes  | yes     |
| GPT-OSS (`GptOssTopKRouter`)          | softmax  | True            | 1 / 1                | -    | 1.0     |

Rules, for router_logits [T, E] of any float dtype (computed in fp32 throughout, as HF does):
  * softmax: weights = softmax(logits) over all E experts. Experts are chosen by the logits themselves (softmax
    is monotonic, so this is the same choice without rounding; see "Ties"). Grouped (n_group > 1, DeepSeek-V2):
    a group's score is its largest score; the experts of all but the best topk_group groups are masked out.
  * sigmoid (DeepSeek-V3): s = sigmoid(logits); experts are chosen by s + correction_bias, weighted by s (without
    the bias). Grouped: a group's score is the sum of its two largest s + bias.
  * then, if renormalize: w / (sum of the top_k w + eps), eps = 0 for softmax (Mixtral, Qwen) and 1e-20 for
    sigmoid (DeepSeek-V3); then w * routed_scaling_factor (normalize first, then scale, as HF).
GPT-OSS's router ranks the logits first and takes the softmax of the k top values: the softmax rule renormalized,
the same experts, weights equal up to fp32 rounding (exp(l - max) / Z, renormalized over the top k, against
exp(l - max) over its sum on the top k: a few ulp apart, not bit for bit). Its router linear's bias (not a correction bias) is part of the
logits given here; its weights are rounded to the logits' dtype (`weights_dtype`), as Qwen's.
Outputs: topk_weights [T, top_k] float32 (or rounded to `weights_dtype`: HF's Qwen routers cast the weights to
the logits' dtype, and the kernel's store does that cast instead of a kernel of its own) and topk_ids [T, top_k]
int32, slots in decreasing order of the choice score. DeepSeek-V2/V3 return them in any order (topk
sorted=False): callers that need that do so themselves.

Ties: the larger choice score wins, and among exactly equal scores the LOWER expert index (likewise for groups;
-0.0 equals 0.0). torch.topk itself gives no such rule on CPU (std::partial_sort / nth_element: topk of
[3, 3, 3, 3] with k=1 returns index 2), so the reference runs torch.topk on int64 keys that order by (score,
-index) and are all distinct; the kernel takes maxima and breaks ties by the smallest index. For the sigmoid
rule both implementations use `portable_sigmoid`, built from IEEE-rounded +, *, / only (the exp is a
Cody-Waite reduction and a degree-7 polynomial; within 2 ulp of the true sigmoid, and within 4 ulp of
torch.sigmoid), so that the kernel and the reference see bit-identical scores: torch's, numpy's and CUDA's
exp differ in the last bit for about half of all inputs, which would flip near-ties. The kernel is launched
with fp contraction off so no FMA changes the rounding. Logits below -87 give sigmoid(-87) ~ 1.6e-38 (torch
gives smaller denormals there). Against HF's own routers, ids can therefore differ only where HF's scores tie
or lie within a few ulp of each other.

Must not import anything from mini_infer outside `mini_infer.ops`.
"""

from __future__ import annotations

import numpy as np
import torch

from mini_infer.ops._triton_support import (
    HAS_TRITON,
    await_producers,
    next_pow2,
    pdl_args,
    tl,
    triton,
    use_triton,
)

__all__ = [
    "KERNEL_MAX_EXPERTS",
    "KERNEL_MAX_TOP_K",
    "SCORINGS",
    "check_moe_topk_args",
    "moe_topk",
    "moe_topk_reference",
    "moe_topk_triton",
    "portable_sigmoid",
]

SCORINGS = ("softmax", "sigmoid")
KERNEL_MAX_EXPERTS = 1024  # one row of scores per program, in registers
KERNEL_MAX_TOP_K = 32  # the selection loop is unrolled top_k times
_RENORM_EPS = {"softmax": 0.0, "sigmoid": 1e-20}  # DeepSeek-V3 adds 1e-20 to the denominator; Mixtral/Qwen don't


def _f32(v: float) -> float:
    return float(np.float32(v))


# portable_sigmoid's constants, each exactly an fp32 value, shared by the torch and the Triton versions
_SIG_CLAMP = 87.0  # |exp argument| bound: keeps 2^n and exp() normal fp32 numbers
_LOG2E = _f32(1.4426950408889634)
_LN2_HI = 0.693359375  # 9 significant bits: n * _LN2_HI is exact for |n| <= 127 (Cody-Waite)
_LN2_LO = _f32(-2.12194440e-4)  # ln 2 - _LN2_HI
_EXP_POLY = tuple(_f32(1.0 / f) for f in (5040, 720, 120, 24, 6, 2, 1, 1))  # Taylor of exp(r), r^7 first


def check_moe_topk_args(num_experts: int, top_k: int, scoring: str, n_group: int, topk_group: int,
                        correction_bias: torch.Tensor | None) -> None:
    """Raise ValueError, naming the argument and its value, for a routing configuration moe_topk does not define."""
    if scoring not in SCORINGS:
        raise ValueError(f"moe_topk: scoring must be one of {SCORINGS}, got {scoring!r}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"moe_topk: top_k must be in [1, num_experts={num_experts}], got {top_k}")
    if n_group < 1 or num_experts % n_group:
        raise ValueError(f"moe_topk: n_group must be >= 1 and divide num_experts={num_experts}, got {n_group}")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"moe_topk: topk_group must be in [1, n_group={n_group}], got {topk_group}")
    group_size = num_experts // n_group
    if top_k > topk_group * group_size:
        raise ValueError(f"moe_topk: top_k={top_k} exceeds the experts of the topk_group={topk_group} groups kept "
                         f"({topk_group} x {group_size})")
    if scoring == "sigmoid":
        if correction_bias is None:
            raise ValueError("moe_topk: scoring='sigmoid' (DeepSeek-V3 noaux_tc) needs correction_bias, got None")
        if n_group > 1 and group_size < 2:
            raise ValueError(f"moe_topk: scoring='sigmoid' scores a group by its top 2 experts; n_group={n_group} "
                             f"leaves {group_size} expert per group")
    elif correction_bias is not None:
        raise ValueError("moe_topk: correction_bias is only defined for scoring='sigmoid', got one with 'softmax'")
    if correction_bias is not None and tuple(correction_bias.shape) != (num_experts,):
        raise ValueError(f"moe_topk: correction_bias must have shape ({num_experts},), got "
                         f"{tuple(correction_bias.shape)}")


def _check_logits(router_logits: torch.Tensor) -> None:
    if router_logits.dim() != 2 or not router_logits.dtype.is_floating_point:
        raise ValueError(f"moe_topk: router_logits must be a float [T, E] tensor, got {router_logits.dtype} "
                         f"{tuple(router_logits.shape)}")


# --------------------------------------------------------------------------------------------------
# Reference (plain torch): the CPU path and the oracle.


def _weights_dtype(weights_dtype: torch.dtype | None) -> torch.dtype:
    """The routing weights' output dtype: fp32 unless a float dtype is asked for (Qwen's routers round the weights
    to the logits' dtype; the rounding of fp32 is the kernel's store and the reference's `.to`, both to nearest)."""
    if weights_dtype is None:
        return torch.float32
    if weights_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"moe_topk: weights_dtype must be float32, bfloat16 or float16, got {weights_dtype}")
    return weights_dtype


def portable_sigmoid(x: torch.Tensor) -> torch.Tensor:
    """sigmoid(x) of an fp32 tensor from IEEE-rounded +, *, / and floor only: bit-identical on every device and
    in the Triton kernel (`_portable_sigmoid`). exp(-x) = 2^n * p(r), n = floor(-x log2 e + 1/2),
    r = -x - n ln 2 in two parts (Cody-Waite), p the degree-7 Taylor polynomial of exp on |r| <= ln2 / 2."""
    y = torch.clamp(-x, -_SIG_CLAMP, _SIG_CLAMP)
    n = torch.floor(y * _LOG2E + 0.5)
    r = (y - n * _LN2_HI) - n * _LN2_LO
    p = torch.full_like(r, _EXP_POLY[0])
    for c in _EXP_POLY[1:]:
        p = p * r + c
    two_n = ((n.to(torch.int32) + 127) << 23).view(torch.float32)
    return 1.0 / (1.0 + p * two_n)


def _topk_lowest_index(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [.., k] of the k largest fp32 scores along the last dim, larger first, the lower index first among
    equal scores: torch.topk over distinct int64 keys (order-preserving int32 image of the score, then -index)."""
    bits = (scores + 0.0).view(torch.int32)  # + 0.0 turns -0.0 into +0.0
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(torch.int64)  # int order == float order
    index = torch.arange(scores.shape[-1], device=scores.device, dtype=torch.int64)
    keys = ordered * (1 << 32) + ((1 << 32) - 1 - index)
    return torch.topk(keys, k, dim=-1).indices


def moe_topk_reference(router_logits: torch.Tensor, top_k: int, scoring: str, renormalize: bool,
                       routed_scaling_factor: float = 1.0, n_group: int = 1, topk_group: int = 1,
                       correction_bias: torch.Tensor | None = None,
                       weights_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-torch routing (the rules and tie-breaking in the module docstring): (weights fp32, or rounded to
    `weights_dtype`, ids int32)."""
    _check_logits(router_logits)
    t, e = router_logits.shape
    check_moe_topk_args(e, top_k, scoring, n_group, topk_group, correction_bias)
    x = router_logits.float()
    if scoring == "softmax":
        weights_all = torch.softmax(x, dim=-1)
        choice = x
    else:
        weights_all = portable_sigmoid(x)
        choice = weights_all + correction_bias.float()
    if n_group > 1:
        grouped = choice.view(t, n_group, e // n_group)
        if scoring == "softmax":
            group_scores = grouped.max(dim=-1).values
        else:
            top2 = grouped.topk(2, dim=-1).values
            group_scores = top2[..., 0] + top2[..., 1]
        keep = torch.zeros(t, n_group, dtype=torch.bool, device=x.device)
        keep.scatter_(1, _topk_lowest_index(group_scores, topk_group), True)
        choice = choice.masked_fill(~keep.repeat_interleave(e // n_group, dim=1), float("-inf"))
    ids = _topk_lowest_index(choice, top_k)
    weights = weights_all.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + _RENORM_EPS[scoring])
    weights = weights * routed_scaling_factor
    return weights.to(_weights_dtype(weights_dtype)), ids.to(torch.int32)


# --------------------------------------------------------------------------------------------------
# Triton: one program per token row.

if HAS_TRITON:
    _SIG_CLAMP_C = tl.constexpr(_SIG_CLAMP)
    _LOG2E_C = tl.constexpr(_LOG2E)
    _LN2_HI_C = tl.constexpr(_LN2_HI)
    _LN2_LO_C = tl.constexpr(_LN2_LO)
    _P0, _P1, _P2, _P3, _P4, _P5, _P6, _P7 = (tl.constexpr(c) for c in _EXP_POLY)

    @triton.jit
    def _portable_sigmoid(x):
        """The kernel twin of `portable_sigmoid` (same operations in the same order, same fp32 constants)."""
        y = tl.minimum(tl.maximum(-x, -_SIG_CLAMP_C), _SIG_CLAMP_C)
        n = tl.floor(y * _LOG2E_C + 0.5)
        r = (y - n * _LN2_HI_C) - n * _LN2_LO_C
        p = tl.full(r.shape, _P0, tl.float32)
        p = p * r + _P1
        p = p * r + _P2
        p = p * r + _P3
        p = p * r + _P4
        p = p * r + _P5
        p = p * r + _P6
        p = p * r + _P7
        two_n = ((n.to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)
        return tl.math.div_rn(tl.full(r.shape, 1.0, tl.float32), 1.0 + p * two_n)

    @triton.jit
    def _moe_topk_kernel(
        logits_ptr, bias_ptr, w_ptr, ids_ptr, stride_t, n_group, group_size, topk_group, scale, eps,
        TOP_K: tl.constexpr, SIGMOID: tl.constexpr, GROUPED: tl.constexpr, RENORMALIZE: tl.constexpr,
        BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr, USE_GDC: tl.constexpr,
    ):  # fmt: skip
        await_producers(USE_GDC)
        # Scores as a [group, expert-in-group] tile; expert index = g * group_size + s.
        row = tl.program_id(0).to(tl.int64)
        g = tl.arange(0, BLOCK_G)[:, None]
        s = tl.arange(0, BLOCK_S)[None, :]
        expert = g * group_size + s
        valid = (g < n_group) & (s < group_size)
        big: tl.constexpr = 1 << 30
        neg_inf = float("-inf")
        x = tl.load(logits_ptr + row * stride_t + expert, mask=valid, other=neg_inf).to(tl.float32)
        if SIGMOID:
            weight_all = _portable_sigmoid(x)
            choice = weight_all + tl.load(bias_ptr + expert, mask=valid, other=0.0).to(tl.float32)
        else:
            ex = tl.where(valid, tl.exp(x - tl.max(x)), 0.0)
            weight_all = ex / tl.sum(ex)
            choice = x
        choice = tl.where(valid, choice, neg_inf)
        if GROUPED:
            top1 = tl.max(choice, axis=1)
            if SIGMOID:  # sum of the two largest of the group: drop one instance of the largest, take the max again
                first = tl.min(tl.where(valid & (choice == top1[:, None]), s, big), axis=1)
                top2 = tl.max(tl.where(valid & (s != first[:, None]), choice, neg_inf), axis=1)
                group_score = top1 + top2
            else:
                group_score = top1
            g1 = tl.arange(0, BLOCK_G)
            open_group = g1 < n_group
            kept = g1 < 0
            for _ in range(topk_group):
                best = tl.max(tl.where(open_group, group_score, neg_inf))
                pick = tl.min(tl.where(open_group & (group_score == best), g1, big))
                kept = kept | (g1 == pick)
                open_group = open_group & (g1 != pick)
            choice = tl.where(kept[:, None], choice, neg_inf)
        open_expert = valid
        slot = tl.arange(0, BLOCK_K)
        slot_w = tl.zeros([BLOCK_K], tl.float32)
        slot_id = tl.zeros([BLOCK_K], tl.int32)
        for j in tl.static_range(TOP_K):
            best = tl.max(tl.where(open_expert, choice, neg_inf))
            pick = tl.min(tl.where(open_expert & (choice == best), expert, big))
            w = tl.sum(tl.where(expert == pick, weight_all, 0.0))
            open_expert = open_expert & (expert != pick)
            slot_w = tl.where(slot == j, w, slot_w)
            slot_id = tl.where(slot == j, pick, slot_id)
        if RENORMALIZE:
            slot_w = slot_w / (tl.sum(slot_w) + eps)
        slot_w = slot_w * scale
        tl.store(ids_ptr + row * TOP_K + slot, slot_id, mask=slot < TOP_K)
        # weights_dtype: rounded to nearest on a GPU, as torch casts (the CPU interpreter truncates fp32 -> bf16)
        tl.store(w_ptr + row * TOP_K + slot, slot_w.to(w_ptr.dtype.element_ty), mask=slot < TOP_K)


def topk_num_warps(num_experts: int) -> int:
    """Warps of `_moe_topk_kernel`'s one program per token, by expert count. One warp up to 256 experts: its
    reductions (eight arg-max rounds for top-8) stay in warp shuffles, no shared-memory barriers. H200, 2026-11-24,
    T = 1: qwen3-30b-a3b (128 experts, top-8) 2.17 us against 4.08 with 4 warps, deepseek-v2-lite (64, top-6)
    1.87 against 3.31, DeepSeek-V3 grouped sigmoid (256, top-8) 4.00 against 5.35; the same outputs bit for bit."""
    return 1 if num_experts <= 256 else 8


def moe_topk_triton(router_logits: torch.Tensor, top_k: int, scoring: str, renormalize: bool,
                    routed_scaling_factor: float = 1.0, n_group: int = 1, topk_group: int = 1,
                    correction_bias: torch.Tensor | None = None,
                    weights_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The CUDA path (or CPU under TRITON_INTERPRET=1): the routing kernel, one program per token (the weights
    stored in `weights_dtype`); more than KERNEL_MAX_EXPERTS experts or KERNEL_MAX_TOP_K slots go to the
    reference (also graph-safe: no host sync)."""
    _check_logits(router_logits)
    t, e = router_logits.shape
    check_moe_topk_args(e, top_k, scoring, n_group, topk_group, correction_bias)
    if not HAS_TRITON or e > KERNEL_MAX_EXPERTS or top_k > KERNEL_MAX_TOP_K:
        return moe_topk_reference(router_logits, top_k, scoring, renormalize, routed_scaling_factor, n_group,
                                  topk_group, correction_bias, weights_dtype)
    weights = torch.empty(t, top_k, dtype=_weights_dtype(weights_dtype), device=router_logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=router_logits.device)
    if t == 0:
        return weights, ids
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    bias = correction_bias.contiguous() if correction_bias is not None else logits
    group_size = e // n_group
    _moe_topk_kernel[(t,)](
        logits, bias, weights, ids, logits.stride(0), n_group, group_size, topk_group,
        float(routed_scaling_factor), _RENORM_EPS[scoring],
        TOP_K=top_k, SIGMOID=scoring == "sigmoid", GROUPED=n_group > 1, RENORMALIZE=renormalize,
        BLOCK_G=next_pow2(n_group), BLOCK_S=next_pow2(group_size), BLOCK_K=next_pow2(top_k),
        num_warps=topk_num_warps(e), **pdl_args(logits, trigger_first=False),
        enable_fp_fusion=False,  # no FMA: portable_sigmoid must round exactly as the reference does
    )  # fmt: skip
    return weights, ids


# --------------------------------------------------------------------------------------------------
# The registered op.


@torch.library.custom_op("mini_infer::moe_topk", mutates_args=())
def moe_topk(router_logits: torch.Tensor, top_k: int, scoring: str, renormalize: bool,
             routed_scaling_factor: float = 1.0, n_group: int = 1, topk_group: int = 1,
             correction_bias: torch.Tensor | None = None,
             weights_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """MoE routing (module docstring): (topk_weights [T, top_k] fp32, or rounded to `weights_dtype`, topk_ids
    [T, top_k] int32). Triton on CUDA when available, else the torch reference."""
    if use_triton(router_logits):
        return moe_topk_triton(router_logits, top_k, scoring, renormalize, routed_scaling_factor, n_group,
                               topk_group, correction_bias, weights_dtype)
    return moe_topk_reference(router_logits, top_k, scoring, renormalize, routed_scaling_factor, n_group,
                              topk_group, correction_bias, weights_dtype)


@moe_topk.register_fake
def _(router_logits: torch.Tensor, top_k: int, scoring: str, renormalize: bool, routed_scaling_factor: float = 1.0,
      n_group: int = 1, topk_group: int = 1,
      correction_bias: torch.Tensor | None = None,
      weights_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    _check_logits(router_logits)
    t, e = router_logits.shape
    if isinstance(e, int):  # the expert count is static in any real graph; T may be symbolic
        check_moe_topk_args(e, top_k, scoring, n_group, topk_group, correction_bias)
    return (router_logits.new_empty((t, top_k), dtype=_weights_dtype(weights_dtype)),
            router_logits.new_empty((t, top_k), dtype=torch.int32))
