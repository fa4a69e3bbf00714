"""PagedAttention: each `scaled_dot_product_attention` → `mini_infer.paged_attention` over a paged KV cache.

The captured graph attends over its own T tokens with a mask built from position_ids; after this pass each
attention writes the step's K/V into the layer's cache and attends over every sequence's cached plus new
tokens, so one graph serves prefill, chunked prefill, decode, and any mix of sequences in one packed row.
The pass adds graph inputs: the attention metadata shared by all layers (`slot_mapping`, `block_tables`,
`seq_lens`, `query_start_loc`, declared as `InputSpec`s) and per layer `k_cache_<i>` / `v_cache_<i>`, declared
as a `FullAttentionSpec` or `SlidingWindowSpec` (KV heads, head sizes, the context's cache dtype, window) that
the runtime allocates. The mask
sub-graph and HF's repeat_kv expansion die with the SDPA node. Everything the kernel reads at run time
comes in through those inputs (static buffers on GPU), nothing through Python state.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

import mini_infer.ops  # noqa: F401
from mini_infer.contract import FullAttentionSpec, SlidingWindowSpec
from mini_infer.contract.caches import FP8_DTYPES
from mini_infer.contract.inputs import ATTENTION_METADATA
from mini_infer.passes.base import GraphPass, PassContext, PassResult
from mini_infer.passes.pattern import aten, is_op, kwarg_or_arg, repeat_kv_source, shape

ops = torch.ops.mini_infer


def _unrepeat_kv(node: fx.Node) -> fx.Node:
    """Undo HF's repeat_kv (see `repeat_kv_source`)."""
    return repeat_kv_source(node) or node


def layer_sliding_window(config, layer_idx: int) -> int | None:
    """The sliding window (tokens) of layer `layer_idx`, from the config as transformers reads it."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    return window if getattr(config, "use_sliding_window", True) else None


class PagedAttention(GraphPass):
    """SDPA (+ mask + repeat_kv) → paged_attention with per-layer paged caches as graph inputs."""

    name = "paged_attention"
    stage = "attention"
    requires = ("cleanup",)

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        graph = gm.graph
        sdpas = [n for n in graph.nodes if is_op(n, aten.scaled_dot_product_attention.default)]
        if not sdpas:
            return PassResult(0, "no scaled_dot_product_attention in the graph")
        if ctx.cache_dtype in FP8_DTYPES:
            raise ValueError(f"paged_attention: KV-cache dtype {ctx.cache_dtype} is not supported by this pass")
        meta = [ctx.add_input(gm, spec) for spec in ATTENTION_METADATA]

        for layer_idx, sdpa in enumerate(sdpas):
            q, k, v = sdpa.args[:3]
            k, v = _unrepeat_kv(k), _unrepeat_kv(v)
            qs, ks, vs = shape(q), shape(k), shape(v)
            if qs is None or ks is None or vs is None or len(qs) != 4 or qs[0] != 1:
                raise ValueError(f"attention #{layer_idx} ({sdpa.name}): expected q of shape [1, H, T, D], got {qs}")
            hq, hkv, d, dv = qs[1], ks[1], qs[3], vs[3]
            if hq % hkv:
                raise ValueError(f"attention #{layer_idx}: {hq} query heads not a multiple of {hkv} KV heads")
            scale = kwarg_or_arg(sdpa, 6, "scale")
            scale = float(scale) if scale is not None else 1.0 / math.sqrt(d)
            window = layer_sliding_window(ctx.config, layer_idx)
            softcap = float(getattr(ctx.config, "attn_logit_softcapping", None) or 0.0)
            spec = SlidingWindowSpec(layer_idx, hkv, d, dv, ctx.cache_dtype, sliding_window=window) if window \
                else FullAttentionSpec(layer_idx, hkv, d, dv, ctx.cache_dtype)
            caches = ctx.add_cache(gm, spec)
            with graph.inserting_before(sdpa):
                packed = []
                for x in (q, k, v):  # [1, H, T, D] → [T, H, D]
                    sel = graph.call_function(aten.select.int, (x, 0, 0))
                    packed.append(graph.call_function(aten.transpose.int, (sel, 0, 1)))
                attn = graph.call_function(ops.paged_attention.default, (
                    *packed, caches[spec.k_input], caches[spec.v_input], *meta, scale, window or 0, softcap))
                back = graph.call_function(aten.transpose.int, (attn, 0, 1))  # [H, T, Dv]
                out = graph.call_function(aten.unsqueeze.default, (back, 0))
            sdpa.replace_all_uses_with(out)
            graph.erase_node(sdpa)
        ctx.info["attention_layers"] = len(sdpas)
        windows = sorted({s.attention_window for s in ctx.cache_specs if s.attention_window})
        note = f"{len(sdpas)} layers" + (f", sliding window {windows}" if windows else "")
        return PassResult(len(sdpas), note)
