"""`mini_infer::linear_moe_topk`: a MoE router's linear and its routing, the top-k in the router GEMV's launch.

    linear_moe_topk(x, W, b, top_k, scoring, renormalize, routed_scaling_factor, n_group, topk_group,
                    correction_bias, weights_dtype)
        = moe_topk(linear(x, W, b), top_k, scoring, ..., weights_dtype)         -> (topk_weights, topk_ids)
Inserted by the FuseRouterTopk pass where the router's logits (a `mini_infer.linear`) are read by moe_topk alone.
Functional: never writes into its inputs.

Why: at batch-1 decode the routing is a one-program kernel (moe_topk.py) whose cost is almost all launch. On CUDA,
for one row that the GEMV takes (linear.py's `takes_gemv`), softmax scoring (Mixtral, Qwen-MoE, DeepSeek-V2; any
grouping) and a routing the top-k kernel serves (at most KERNEL_MAX_EXPERTS experts, KERNEL_MAX_TOP_K slots), one
launch does both: every program runs the GEMV's body (`gemv_program`) and stores its logits to a scratch row, then
counts itself (`_split_k.split_counters` / `arrives_last`, as linear_add_rms_norm.py does for its norm); the
program that arrives last runs moe_topk's row body (`topk_row`) over the stored logits. The logits are therefore the
GEMV kernel's and the routing reads them as the routing kernel does: under the Triton interpreter the outputs equal
the unfused pair's bit for bit. On a GPU the launch runs with `num_warps` warps (default: the routing kernel's,
`topk_num_warps`, one warp up to 256 experts, which keeps the top-k's reductions in warp shuffles) where the
unfused GEMV has its tile's 4: the logits' fp32 row sums may then be ordered otherwise (one ulp before their
rounding to the logits' dtype); the routing of the same logits is the same (its maxima are exact; moe_topk's
docstring: 1 and 4 warps gave the same bits). Sigmoid scoring (DeepSeek-V3) keeps the unfused kernels: its
routing kernel runs without FMA contraction (portable_sigmoid), which the GEMV's products should keep. Anything
else (several rows, rows the GEMV does not take) runs the unfused ops' kernels. The choice depends only on
shapes, dtypes and the routing's arguments: CUDA-graph safe, no host syncs. One counter serves every launch
(launches on one stream run one after another; each leaves it zero), so two of these kernels must not run
concurrently on different streams. On CPU the reference is the two unfused references. Imports nothing from
mini_infer outside `mini_infer.ops`.
"""

from __future__ import annotations

import torch

from mini_infer.ops._split_k import split_counters
from mini_infer.ops._triton_support import HAS_TRITON, tl, triton, use_triton
from mini_infer.ops.linear import (
    gemv_config,
    launch_gemv,
    linear_reference,
    linear_triton,
    takes_gemv,
    unit_stride_row,
)
from mini_infer.ops.moe_topk import (
    KERNEL_MAX_EXPERTS,
    KERNEL_MAX_TOP_K,
    check_moe_topk_args,
    moe_topk_reference,
    moe_topk_triton,
    topk_num_warps,
    topk_outputs,
    topk_row_args,
)

__all__ = ["linear_moe_topk", "linear_moe_topk_reference", "linear_moe_topk_triton", "takes_fused_routing"]


def linear_moe_topk_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int, scoring: str, renormalize: bool,
    routed_scaling_factor: float = 1.0, n_group: int = 1, topk_group: int = 1,
    correction_bias: torch.Tensor | None = None, weights_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`moe_topk(linear(x, weight, bias), ...)` with the two references."""
    return moe_topk_reference(linear_reference(x, weight, bias), top_k, scoring, renormalize, routed_scaling_factor,
                              n_group, topk_group, correction_bias, weights_dtype)


if HAS_TRITON:
    from mini_infer.ops._split_k import arrives_last
    from mini_infer.ops.linear import gemv_program
    from mini_infer.ops.moe_topk import topk_row

    @triton.jit
    def _gemv_moe_topk_kernel(
        x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_wn, cb_ptr, tw_ptr, ti_ptr, cnt_ptr,
        n_group, group_size, topk_group, scale, eps,
        HAS_BIAS: tl.constexpr, TOP_K: tl.constexpr, SIGMOID: tl.constexpr, GROUPED: tl.constexpr,
        RENORMALIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_SLOTS: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_GDC: tl.constexpr,
    ):  # fmt: skip
        """The router GEMV (logits stored at y_ptr), then, in the program that arrives last, the routing of that one
        row (`topk_row`; BLOCK_SLOTS is its BLOCK_K: slots, the GEMV's BLOCK_K is K elements per step)."""
        gemv_program(x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_wn, HAS_BIAS, BLOCK_N, BLOCK_K, USE_GDC)
        if arrives_last(cnt_ptr, tl.num_programs(0)):
            topk_row(y_ptr, cb_ptr, tw_ptr, ti_ptr, 0, N, n_group, group_size, topk_group, scale, eps, TOP_K, SIGMOID,
                     GROUPED, RENORMALIZE, BLOCK_G, BLOCK_S, BLOCK_SLOTS)


def takes_fused_routing(x: torch.Tensor, weight: torch.Tensor, top_k: int, scoring: str) -> bool:
    """Whether `linear_moe_topk_triton` runs the one fused launch for these operands (module docstring)."""
    return (takes_gemv(x.numel(), x.dtype, weight) and scoring == "softmax"
            and weight.shape[0] <= KERNEL_MAX_EXPERTS and top_k <= KERNEL_MAX_TOP_K)


def linear_moe_topk_triton(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int, scoring: str, renormalize: bool,
    routed_scaling_factor: float = 1.0, n_group: int = 1, topk_group: int = 1,
    correction_bias: torch.Tensor | None = None, weights_dtype: torch.dtype | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The CUDA path: one launch for a single row the GEMV takes with softmax scoring, else `linear` then
    `moe_topk` (their kernels). `num_warps`: the fused launch's warps (None: `topk_num_warps` of the experts)."""
    if not takes_fused_routing(x, weight, top_k, scoring):
        return moe_topk_triton(linear_triton(x, weight, bias).reshape(-1, weight.shape[0]), top_k, scoring,
                               renormalize, routed_scaling_factor, n_group, topk_group, correction_bias,
                               weights_dtype)
    n, k = weight.shape
    check_moe_topk_args(n, top_k, scoring, n_group, topk_group, correction_bias)
    xr = unit_stride_row(x)
    w = weight if weight.stride(1) == 1 else weight.contiguous()
    logits = torch.empty(n, dtype=x.dtype, device=x.device)
    weights, ids = topk_outputs(1, top_k, weights_dtype, x.device)
    scalars, constexprs = topk_row_args(n, top_k, scoring, renormalize, routed_scaling_factor, n_group, topk_group)
    constexprs["BLOCK_SLOTS"] = constexprs.pop("BLOCK_K")  # the GEMV's tile takes that name
    bn, bk, _, stages = gemv_config(k, n)
    launch_gemv(
        _gemv_moe_topk_kernel, w,
        xr, w, bias if bias is not None else w, logits, n, k, w.stride(0), logits, weights, ids,
        split_counters(x.device, 1), *scalars,
        config=(bn, bk, num_warps or topk_num_warps(n), stages), HAS_BIAS=bias is not None, **constexprs,
    )  # fmt: skip
    return weights, ids


@torch.library.custom_op("mini_infer::linear_moe_topk", mutates_args=())
def linear_moe_topk(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, top_k: int, scoring: str, renormalize: bool,
    routed_scaling_factor: float = 1.0, n_group: int = 1, topk_group: int = 1,
    correction_bias: torch.Tensor | None = None, weights_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`moe_topk(linear(x, weight, bias), ...)`: one launch for one row on CUDA (module docstring)."""
    impl = linear_moe_topk_triton if use_triton(x) else linear_moe_topk_reference
    return impl(x, weight, bias, top_k, scoring, renormalize, routed_scaling_factor, n_group, topk_group,
                correction_bias, weights_dtype)


@linear_moe_topk.register_fake
def _(x, weight, bias, top_k, scoring, renormalize, routed_scaling_factor=1.0, n_group=1, topk_group=1,
      correction_bias=None, weights_dtype=None):
    logits = x.new_empty((*x.shape[:-1], weight.shape[0])).reshape(-1, weight.shape[0])
    return torch.ops.mini_infer.moe_topk.default(logits, top_k, scoring, renormalize, routed_scaling_factor, n_group,
                                                 topk_group, correction_bias, weights_dtype)
