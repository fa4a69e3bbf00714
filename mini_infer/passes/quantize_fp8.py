"""QuantizeFP8: linears → `quantize_per_token` + `mini_infer.fp8_linear` over float8_e4m3fn weights
(`quantization="fp8"`).

vLLM's online "fp8" scheme (dynamic W8A8-FP8): each weight `W [N, K]` becomes `w_q = W / w_scale` rounded to
float8_e4m3fn with one fp32 scale per output channel, `w_scale[n] = max|W[n, :]| / 448` (the arithmetic of
`quantize_per_token` in mini_infer/ops/quant.py, applied to the weight's rows); the activation is quantized per
token at run time by a `quantize_per_token(x, float8_e4m3fn)` node (one per distinct input: q/k/v share theirs;
quantize_w8a8's `quantized_activation`, so both passes emit one pattern, which fuse_act_quant, merge_projections and
fuse_gemv_norm then fuse as for int8 — until 2026-11-24 the pass emitted `fp8_w8a8_linear`, which quantizes inside
the op, and none of those fusions applied: a qwen2.5-7b decode step was 406 launches against w8a8's 267), and the
GEMM accumulates in fp32 (`torch._scaled_mm` or Triton on CUDA, a
dequantizing reference on the CPU). No calibration data is needed. The quantized weight and its scales are new
buffers of the graph and the original is no longer referenced: the pass manager drops it, so the compiled model
holds one copy (a weight a skipped linear or the embedding still reads stays as it is).

Which linears: every `aten.linear` whose weight is a parameter, except those passes/keep_float.py keeps in float
(the policy quantize_w8a8 shares): the lm_head unless `lm_head=True`, MoE routers, the `kv_b_proj` that
`mla_latent_cache` absorbs, and linears named by `skip` (glob patterns over the HF module name, e.g. `"down_proj"`,
`"model.layers.0.*"`; a pattern that matches no linear is refused). The experts of an MoE run in `fused_moe` / HF's
grouped GEMM, which this pass does not touch: they stay in the model dtype.
Runs in stage "quantization", before `merge_projections` (which merges the fp8 weights with their scales).

On CUDA it needs FP8 tensor cores (compute capability >= 8.9: Ada, Hopper or later): anything older is refused
at compile time naming the device. On the CPU the ops' torch reference runs it (how the tests run).
This module rewrites linears only; the arithmetic is in ops/fp8_linear.py and ops/quant.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.fx as fx

import mini_infer.ops  # noqa: F401
from mini_infer.ops.fp8_linear import FP8_MIN_CAPABILITY, fp8_supported
from mini_infer.ops.quant import quantize_per_token_reference
from mini_infer.passes.base import GraphPass, PassContext, PassResult, replace_with_call
from mini_infer.passes.keep_float import kept_in_float
from mini_infer.passes.pattern import aten, is_op, val
from mini_infer.passes.quantize_w8a8 import quantized_activation

ops = torch.ops.mini_infer
FP8 = torch.float8_e4m3fn


def require_fp8_device(device: torch.device, what: str) -> None:
    """ValueError naming `device` when it cannot run FP8 kernels (CUDA below compute capability 8.9, or a
    device type other than CUDA and CPU); `what` names the option that asked for FP8."""
    dev = torch.device(device)
    if fp8_supported(dev):
        return
    need = ".".join(map(str, FP8_MIN_CAPABILITY))
    if dev.type == "cuda":
        major, minor = torch.cuda.get_device_capability(dev)
        raise ValueError(f"{what}: {torch.cuda.get_device_name(dev)} ({dev}) has compute capability "
                         f"{major}.{minor}; FP8 needs >= {need} (Ada, Hopper or later). On this GPU use "
                         "quantization='w8a8' (int8) or no quantization, and kv_cache_dtype='auto'")
    raise ValueError(f"{what}: device {dev} has no FP8 kernels (CUDA >= {need} or the CPU reference)")


def quantize_weight_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`W [N, K]` → (`w_q` float8_e4m3fn [N, K], `w_scale` fp32 [N]) with `W ≈ w_q * w_scale[:, None]`."""
    w_q, scale = quantize_per_token_reference(weight.detach(), FP8)
    return w_q, scale.reshape(weight.shape[0])


class QuantizeFP8(GraphPass):
    """Parameter linears → quantize_per_token + fp8_linear (e4m3 weights, per-channel scales, per-token activation
    scales)."""

    name = "quantize_fp8"
    stage = "quantization"
    requires = ("cleanup",)
    quantization_modes = ("fp8",)
    # verification against eager allows 10% of the logits' scale after this pass (as after quantize_w8a8): it
    # catches a broken graph, not a loss of quality, which bench/fp8_quality.py measures on real weights
    approximation = 0.1

    def __init__(self, skip: Sequence[str] = (), lm_head: bool = False) -> None:
        self.check_patterns("skip", skip)
        if not isinstance(lm_head, bool):
            raise self.invalid("lm_head", lm_head, "must be True or False")
        self.skip = tuple(skip)
        self.lm_head = lm_head

    @classmethod
    def default_for(cls, ctx: PassContext) -> GraphPass | None:
        return cls() if ctx.quantization == "fp8" else None

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        require_fp8_device(ctx.device, "quantization='fp8'")
        graph = gm.graph
        linears = [n for n in graph.nodes if is_op(n, aten.linear.default)
                   and isinstance(n.args[1], fx.Node) and n.args[1].op == "get_attr"]
        reasons = kept_in_float(gm, linears, self, self.skip, self.lm_head)
        kept: dict[str, int] = {}
        done: dict[str, tuple[fx.Node, fx.Node]] = {}  # weight attribute → its fp8 weight and scale nodes
        act: dict[fx.Node, tuple[fx.Node, fx.Node]] = {}  # x → (x_q, x_scale)
        n_quantized = 0
        for node in linears:
            reason = reasons.get(node)
            if reason is not None:
                kept[reason] = kept.get(reason, 0) + 1
                continue
            w_node = node.args[1]
            weight = PassContext.tensor_of(gm, w_node)
            if weight.dim() != 2 or not weight.is_floating_point():
                kept["not a float matrix"] = kept.get("not a float matrix", 0) + 1
                continue
            if w_node.target not in done:
                with torch.no_grad():
                    w_q, w_scale = quantize_weight_fp8(weight)
                base = str(w_node.target).removesuffix(".weight")
                done[w_node.target] = (PassContext.add_tensor(gm, f"{base}.weight_fp8", w_q, before=node),
                                       PassContext.add_tensor(gm, f"{base}.weight_scale", w_scale, before=node))
            q_node, s_node = done[w_node.target]
            bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
            x_q, x_scale = quantized_activation(graph, act, node.args[0], FP8, node)
            replace_with_call(gm, node, ops.fp8_linear.default, (x_q, x_scale, q_node, s_node, bias, val(node).dtype))
            n_quantized += 1
        note = f"{n_quantized} linears to fp8"
        if kept:
            note += "; kept: " + ", ".join(f"{k} x{v}" for k, v in kept.items())
        ctx.info["fp8_linears"] = n_quantized
        return PassResult(n_quantized, note)
