"""Custom ops that the compiler passes insert into FX graphs (`torch.ops.mini_infer.<name>`).

Importing this package registers every op. Each op lives in a module of its own (or of its family: the
quantization ops in quant.py, the W8A8 linears in int8_linear.py / fp8_linear.py) with three parts: a fake
impl (shapes and dtypes only; works with torch.export's symbolic shapes), `<op>_reference` in plain
torch (the CPU run-time path and the test oracle), and `<op>_triton` (used when the tensors are on
CUDA). The registered op dispatches: CUDA tensors and Triton importable -> Triton, otherwise the
reference (`MINI_INFER_OPS_BACKEND=torch` forces the reference). Triton is optional. Ops import
nothing from mini_infer outside this package.

| op                                                    | returns             | semantics                                             |
|-------------------------------------------------------|---------------------|-------------------------------------------------------|
| rms_norm(x, weight, eps)                              | Tensor              | HF LlamaRMSNorm over the last dim                     |
| fused_add_rms_norm(x, residual, weight, eps)          | (Tensor, Tensor)    | s = x + residual; (rms_norm(s, weight, eps), s)       |
| gemma_rms_norm(x, weight, eps)                        | Tensor              | HF Gemma2RMSNorm: (normed fp32 * (1 + weight)) cast   |
| fused_add_gemma_rms_norm(x, residual, weight, eps)    | (Tensor, Tensor)    | s = x + residual; (gemma_rms_norm(s, weight, eps), s) |
| apply_rotary(x, cos, sin)                             | Tensor (contiguous) | x * cos + rotate_half(x) * sin (HF neox-style)        |
| apply_rotary_interleaved(x, cos, sin)                 | Tensor (contiguous) | GPT-J style: pairs (x[2i], x[2i+1]) turned by angle i;|
|                                                       |                     | cos/sin [..., D/2]; fp32 math, x's dtype (DeepSeek)   |
| qk_rotary(q, k, cos, sin, q_weight, k_weight, eps)    | (Tensor, Tensor)    | (apply_rotary(rms_norm(q, q_weight, eps)), same for k)|
|                                                       |  (contiguous)       | one launch; a None weight skips that norm (Qwen3)     |
| qk_rotary_kv_write(q, k, v, cos, sin, q_weight,       | Tensor (q_out)      | q_out, k_out = qk_rotary(...); k_out and v written at |
|   k_weight, eps, k_cache!, v_cache!, slot_mapping,    |                     | slot_mapping as paged_attention writes them (negative:|
|   k_scale=None, v_scale=None)                         |                     | skip; fp8 scaled); one launch; mutates the caches     |
| silu_and_mul(gate, up)                                | Tensor              | silu(gate) * up                                       |
| gelu_tanh_and_mul(gate, up)                           | Tensor              | gelu(gate, approximate='tanh') * up (HF's             |
|                                                       |                     | gelu_pytorch_tanh gate): the gelu in fp32 rounded to  |
|                                                       |                     | gate's dtype, then the product (the captured pair's)  |
| linear(x, weight, bias)                               | Tensor              | F.linear; a Triton GEMV for one row on CUDA           |
| linear_add(x, weight, bias, residual)                 | Tensor              | linear(x, weight, bias) + residual; the add in the    |
|                                                       |                     | GEMV's epilogue for one row                           |
| rms_norm_linear(x, norm_weight, eps, weight, bias)    | Tensor              | linear(rms_norm(x, norm_weight, eps), weight, bias);  |
|                                                       |                     | one Triton kernel (norm in the GEMV) for one row; the |
|                                                       |                     | normalized row kept in fp32 there (not bit-equal)     |
| fused_add_rms_norm_linear(x, residual, norm_weight,   | (Tensor, Tensor)    | n, s = fused_add_rms_norm(x, residual, ...);          |
|   eps, weight, bias)                                  |                     | (linear(n, weight, bias), s); as rms_norm_linear      |
| rms_norm_linear_silu(x, norm_weight, eps, weight,     | Tensor [.., I]      | silu_and_mul(g, u), g, u = rms_norm_linear(x, ...)'s  |
|   bias)                                               |                     | halves (weight: merged [2I, K] gate_up, gate first);  |
|                                                       |                     | the activation in the GEMV's epilogue for one row;    |
|                                                       |                     | the pair's roundings                                  |
| linear_silu(x, weight, bias)                          | Tensor [.., I]      | as rms_norm_linear_silu with linear(x, weight, bias)  |
| silu_mul_linear(gate, up, weight, bias, residual)     | Tensor              | linear(silu_and_mul(gate, up), weight, bias) (+       |
|                                                       |                     | residual, as linear_add); the activation in the       |
|                                                       |                     | GEMV's prologue for one row; the pair's roundings    |
| linear_add_rms_norm(x, weight, bias, residual,        | (Tensor, Tensor)    | fused_add_rms_norm(linear(x, weight, bias), residual, |
|   norm_weight, eps)                                   |                     | norm_weight, eps); the norm in the GEMV's launch      |
| attention(q, k, v, scale, softcap, sliding_window,    | Tensor [B,Hq,T,Dv]  | causal attention as HF's eager code: (q k^T) * scale, |
|   sinks=None)                                         |                     | tanh softcap (>0), sliding window (>0), fp32 softmax, |
|                                                       |                     | a per-head sink logit in it (GPT-OSS); GQA; the       |
|                                                       |                     | capture's node where SDPA cannot serve (no Triton     |
|                                                       |                     | kernel: paged_attention replaces it)                  |
| paged_attention(q, k, v, k_cache!, v_cache!,          | Tensor [T, Hq, Dv]  | write k/v at slot_mapping (negative: skip), then      |
|   slot_mapping, block_tables, seq_lens,               |                     | causal varlen attention over the paged cache; GQA,    |
|   query_start_loc, scale, sliding_window, softcap,    |                     | sliding window (>0), softcap (>0), sinks [Hq] (one    |
|   k_scale=None, v_scale=None, sinks=None)             |                     | logit a head in every softmax, its value zero);       |
|                                                       |                     | mutates the caches; fp8 caches store k / k_scale,     |
|                                                       |                     | reads multiply it back                                |
| paged_attention_cached(q, k_cache, v_cache,           | Tensor [T, Hq, Dv]  | paged_attention's attention without its write, over   |
|   block_tables, seq_lens, query_start_loc, scale,     |                     | caches already holding the step's keys (written by    |
|   sliding_window, softcap, k_scale=None, v_scale=None,|                     | qk_rotary_kv_write); mutates nothing                  |
|   sinks=None)                                         |                     |                                                       |
| rotary_paged_attention(q, k, v, cos, sin, q_weight,   | Tensor [T, Hq, Dv]  | q2, k2 = qk_rotary(q, k, cos, sin, q_weight, k_weight,|
|   k_weight, eps, k_cache!, v_cache!, slot_mapping,    |                     | eps); paged_attention(pack(q2), pack(k2), pack(v),    |
|   block_tables, seq_lens, query_start_loc, scale,     |                     | ...), pack = [1, H, T, D] -> [T, H, D]; a decode      |
|   sliding_window, softcap, k_scale=None, v_scale=None,|                     | step: one launch; mutates the caches                  |
|   sinks=None)                                         |                     |                                                       |
| mla_attention(q_nope, q_pe, c_kv, k_pe,               | Tensor [T, H, Dv]   | DeepSeek MLA: write cat(c_kv, k_pe) at slot_mapping   |
|   latent_cache!, slot_mapping, block_tables,          |                     | into the latent cache, then causal attention with     |
|   seq_lens, query_start_loc, w_uk, w_uv, scale)       |                     | k_h = cat(W_UK_h c, k_pe), v_h = W_UV_h c (absorbed   |
|                                                       |                     | for decode, expanded for prefill); mutates the cache  |
| moe_topk(router_logits, top_k, scoring, renormalize,  | (Tensor fp32 or     | MoE routing of HF's Mixtral / Qwen-MoE / DeepSeek-V2  |
|   routed_scaling_factor, n_group, topk_group,         |  weights_dtype,     | / V3 routers: softmax or sigmoid+bias, grouped top-k, |
|   correction_bias, weights_dtype=None)                |  Tensor int32)      | renormalize, scale; ties: lower expert index          |
| fused_moe(hidden, topk_weights, topk_ids, w13, w2,    | Tensor [T, H]       | sum_j w[t,j] * (W2[e] act(W13[e] x + b13[e]) + b2[e]),|
|   activation="silu", expert_map=None, w13_bias=None,  |                     | e = ids[t,j]; w13 = [gate; up] per expert [E, 2I, H]; |
|   w2_bias=None, swiglu_alpha=1.702,                   |                     | act: silu(g) * u, or "swigluoai" (GPT-OSS): g, u      |
|   swiglu_limit=7.0)                                   |                     | clamped, (u + 1) * g * sigmoid(alpha g); biases       |
|                                                       |                     | optional; expert_map: e = map[ids[t,j]], -1 = another |
|                                                       |                     | rank's                                                |
| fused_moe_mxfp4(hidden, topk_weights, topk_ids,       | Tensor [T, H]       | fused_moe over MXFP4 experts: w13 / w2 as uint8       |
|   w13_blocks, w13_scales, w2_blocks, w2_scales, ...)  |                     | blocks [E, N, K/2] (two FP4 values a byte) and scales |
|                                                       |                     | [E, N, K/32] (2^(s-127) per 32 along K); the rest as  |
|                                                       |                     | fused_moe's                                           |
| quantize_per_token(x, dtype)                          | (x_q, scale)        | symmetric per-row int8 / float8_e4m3fn, scale [.., 1] |
| rms_norm_quant(x, weight, eps, dtype)                 | (x_q, scale)        | quantize_per_token(rms_norm(x, weight, eps), dtype)   |
| fused_add_rms_norm_quant(x, residual, weight, eps,    | (x_q, scale, s)     | s = x + residual; quantize_per_token(rms_norm(s))     |
|   dtype)                                              |                     |                                                       |
| silu_and_mul_quant(gate, up, dtype)                   | (x_q, scale)        | quantize_per_token(silu(gate) * up, dtype)            |
| int8_linear(x_q, x_scale, w_q, w_scale, bias,         | Tensor [.., N]      | exact int32 x_q @ w_q.T, then (acc * x_scale *        |
|   out_dtype)                                          |                     | w_scale + bias) in fp32 -> out_dtype                  |
| w8a8_linear(x, w_q, w_scale, bias)                    | Tensor (x's dtype)  | int8_linear(*quantize_per_token(x, int8), ...)        |
| fp8_linear(x_q, x_scale, w_q, w_scale, bias,          | Tensor [.., N]      | as int8_linear with float8_e4m3fn operands, fp32      |
|   out_dtype)                                          |                     | accumulation; CUDA needs compute capability >= 8.9    |
| fp8_w8a8_linear(x, w_q, w_scale, bias)                | Tensor (x's dtype)  | fp8_linear(*quantize_per_token(x, fp8), ...)          |
| scaled_linear_add_rms_norm_quant(x_q, x_scale, w_q,   | (x_q, scale, s)     | fused_add_rms_norm_quant(int8_linear or fp8_linear by |
|   w_scale, bias, out_dtype, residual, norm_weight,    |                     | x_q's dtype (...), residual, norm_weight, eps, dtype);|
|   eps, dtype)                                         |                     | the norm + quantization in the GEMV's launch          |
| gather_rows(tables, indices)                          | Tensor[]            | [embedding(t, i) for t, i in zip(tables, indices)]:   |
|                                                       |                     | up to 4 table lookups (each its own dtype, width and  |
|                                                       |                     | index) in one launch                                  |
| argmax_rows(x)                                        | Tensor int64 [R]    | torch.argmax(x, dim=-1) of [R, V] x: first index of   |
|                                                       |                     | the maximum, NaN the largest (the greedy sampler's;   |
|                                                       |                     | one launch, the row split over programs)              |
| gumbel_argmax(x, inv_temperature, seed)               | Tensor int64 [R]    | one id per row drawn from softmax(x * inv_temperature)|
|                                                       |                     | by the Gumbel-max trick (argmax where inv_t <= 0);    |
|                                                       |                     | Philox noise in argmax_rows' launch (the sampler's)   |
| all_reduce_sum(x, group_name)                         | Tensor              | sum of x over the process group's ranks: one-shot over|
|                                                       |                     | symmetric memory for small CUDA messages, else        |
|                                                       |                     | torch.distributed (all_reduce.py); a collective       |

Layouts for paged_attention are in `mini_infer/ops/paged_attention.py`'s docstring, those for mla_attention
(and the arrangement of w_uk / w_uv from kv_b_proj) in `mini_infer/ops/mla_attention.py`'s; the routing rules per
model family in `moe_topk.py`'s, the expert weight layout in `fused_moe.py`'s. Extra Triton entry
points: `write_kv_cache_triton` and the `decode_only` / `num_splits` knobs of `paged_attention_triton`
(split-K flash-decoding); `write_latent_cache_triton`, `latent_attention_triton` (the absorbed path's kernel)
and the `path` / `num_splits` knobs of `mla_attention_triton`. The quantization scheme is in `quant.py`'s
docstring; `scaled_mm_triton` (int8_linear.py) is the GEMM kernel of both W8A8 linears and `scaled_gemv_triton`
their one-row (decode) kernel, `fp8_supported(device)`
(fp8_linear.py) says where the FP8 linears run.
"""

from mini_infer.ops import all_reduce as _all_reduce_mod
from mini_infer.ops import apply_rotary as _apply_rotary_mod  # (importing a module registers its ops)
from mini_infer.ops import apply_rotary_interleaved as _apply_rotary_interleaved_mod
from mini_infer.ops import argmax as _argmax_mod
from mini_infer.ops import attention as _attention_mod
from mini_infer.ops import fp8_linear as _fp8_linear_mod
from mini_infer.ops import fused_add_rms_norm as _fused_add_rms_norm_mod
from mini_infer.ops import fused_moe as _fused_moe_mod
from mini_infer.ops import fused_moe_mxfp4 as _fused_moe_mxfp4_mod
from mini_infer.ops import gather_rows as _gather_rows_mod
from mini_infer.ops import gelu_tanh_and_mul as _gelu_tanh_and_mul_mod
from mini_infer.ops import gemma_rms_norm as _gemma_rms_norm_mod
from mini_infer.ops import gumbel_argmax as _gumbel_argmax_mod
from mini_infer.ops import int8_linear as _int8_linear_mod
from mini_infer.ops import linear as _linear_mod
from mini_infer.ops import linear_add as _linear_add_mod
from mini_infer.ops import linear_add_rms_norm as _linear_add_rms_norm_mod
from mini_infer.ops import mla_attention as _mla_attention_mod
from mini_infer.ops import moe_topk as _moe_topk_mod
from mini_infer.ops import paged_attention as _paged_attention_mod
from mini_infer.ops import qk_rotary as _qk_rotary_mod
from mini_infer.ops import qk_rotary_kv_write as _qk_rotary_kv_write_mod
from mini_infer.ops import quant as _quant_mod
from mini_infer.ops import rms_norm as _rms_norm_mod
from mini_infer.ops import rms_norm_linear as _rms_norm_linear_mod
from mini_infer.ops import rms_norm_linear_silu as _rms_norm_linear_silu_mod
from mini_infer.ops import rotary_paged_attention as _rotary_paged_attention_mod
from mini_infer.ops import silu_and_mul as _silu_and_mul_mod
from mini_infer.ops import silu_mul_linear as _silu_mul_linear_mod
from mini_infer.ops._triton_support import HAS_TRITON

# op name -> the module defining `<name>_reference` and `<name>_triton`
_MODULE_OF = {
    "attention": _attention_mod,
    "rms_norm": _rms_norm_mod,
    "fused_add_rms_norm": _fused_add_rms_norm_mod,
    "gemma_rms_norm": _gemma_rms_norm_mod,
    "fused_add_gemma_rms_norm": _gemma_rms_norm_mod,
    "apply_rotary": _apply_rotary_mod,
    "apply_rotary_interleaved": _apply_rotary_interleaved_mod,
    "qk_rotary": _qk_rotary_mod,
    "qk_rotary_kv_write": _qk_rotary_kv_write_mod,
    "silu_and_mul": _silu_and_mul_mod,
    "gelu_tanh_and_mul": _gelu_tanh_and_mul_mod,
    "paged_attention": _paged_attention_mod,
    "paged_attention_cached": _paged_attention_mod,
    "rotary_paged_attention": _rotary_paged_attention_mod,
    "linear": _linear_mod,
    "linear_add": _linear_add_mod,
    "rms_norm_linear": _rms_norm_linear_mod,
    "fused_add_rms_norm_linear": _rms_norm_linear_mod,
    "rms_norm_linear_silu": _rms_norm_linear_silu_mod,
    "linear_silu": _rms_norm_linear_silu_mod,
    "silu_mul_linear": _silu_mul_linear_mod,
    "linear_add_rms_norm": _linear_add_rms_norm_mod,
    "scaled_linear_add_rms_norm_quant": _linear_add_rms_norm_mod,
    "mla_attention": _mla_attention_mod,
    "moe_topk": _moe_topk_mod,
    "fused_moe": _fused_moe_mod,
    "fused_moe_mxfp4": _fused_moe_mxfp4_mod,
    "quantize_per_token": _quant_mod,
    "rms_norm_quant": _quant_mod,
    "fused_add_rms_norm_quant": _quant_mod,
    "silu_and_mul_quant": _quant_mod,
    "int8_linear": _int8_linear_mod,
    "w8a8_linear": _int8_linear_mod,
    "fp8_linear": _fp8_linear_mod,
    "fp8_w8a8_linear": _fp8_linear_mod,
    "all_reduce_sum": _all_reduce_mod,
    "argmax_rows": _argmax_mod,
    "gather_rows": _gather_rows_mod,
    "gumbel_argmax": _gumbel_argmax_mod,
}
OPS = tuple(_MODULE_OF)


def kernel_impls(backend: str) -> dict:
    """Each registered op overload → the function it dispatches to for `backend` ("reference": the plain-torch
    version, what the ops run on CPU; "triton": the Triton launcher, what they run on CUDA), for callers
    that skip the dispatcher's per-call cost (about 80 us per call)."""
    import torch

    if backend not in ("reference", "triton"):
        raise ValueError(f"backend must be 'reference' or 'triton', got {backend!r}")
    return {getattr(torch.ops.mini_infer, name).default: _entry(name, backend) for name in OPS}


def _entry(name: str, backend: str):
    """What op `name` runs for `backend`: its module's `<name>_<backend>_entry` where the op's body does more
    than call one kernel (paged_attention routes long query runs elsewhere), else `<name>_<backend>`."""
    mod = _MODULE_OF[name]
    return getattr(mod, f"{name}_{backend}_entry", None) or getattr(mod, f"{name}_{backend}")


def backend_for(device) -> str:
    """The backend the ops pick on `device` (same rule as their dispatch: Triton on CUDA when available)."""
    import os

    import torch

    dev = torch.device(device)
    if dev.type == "cuda" and HAS_TRITON and os.environ.get("MINI_INFER_OPS_BACKEND", "") != "torch":
        return "triton"
    return "reference"


__all__ = ["HAS_TRITON", "OPS", "backend_for", "kernel_impls"]
