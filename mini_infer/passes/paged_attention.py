"""PagedAttention: each `scaled_dot_product_attention` → `mini_infer.paged_attention` over a paged KV cache.

The capture's `mini_infer.attention` nodes (models that cannot run through SDPA, e.g. Gemma 2, GPT-OSS) are replaced
the same way, with the scale, softcap, sliding window and attention sinks they carry (an SDPA node's softcap and
window are the config's: `attn_logit_softcapping`, the layer's sliding window; so is the window of a node that
carries none; SDPA nodes have no sinks). A layer's sinks ([Hq] parameter node, GPT-OSS's `s_aux`) become the op's
last argument, after its k_scale / v_scale (None for a cache that takes none); a layer without sinks gets the
op's arguments as before. The op's long-prefill route's row count (UNCAPTURED_QUERY_ROWS) is declared on CUDA
(the route applies sinks too).

The captured graph attends over its own T tokens with a mask built from position_ids; after this pass each
attention writes the step's K/V into the layer's cache and attends over every sequence's cached plus new
tokens, so one graph serves prefill, chunked prefill, decode, and any mix of sequences in one packed row.
The pass adds graph inputs: the attention metadata shared by all layers (`slot_mapping`, `block_tables`,
`seq_lens`, `query_start_loc`, declared as `InputSpec`s) and per layer `k_cache_<i>` / `v_cache_<i>`, declared
as a `FullAttentionSpec` or `SlidingWindowSpec` (KV heads, head sizes, the context's cache dtype, window) that
the runtime allocates. The mask
sub-graph and HF's repeat_kv expansion die with the SDPA node. Everything the kernel reads at run time
comes in through those inputs (static buffers on GPU), nothing through Python state.

FP8 KV cache (`kv_cache_dtype="fp8"`, float8_e4m3fn): the spec is declared with `scales=(k_scale, v_scale)`
per layer, which the runtime passes as the fixed inputs `k_scale_<i>` / `v_scale_<i>` ([1] fp32) and this pass
hands to the op (which stores `k / k_scale` saturated to +-448 and multiplies it back on every read). The
scales are 1.0 unless given (`PagedAttention(kv_scales=...)`, e.g. from a checkpoint's calibrated k/v scales):
vLLM's default for an uncalibrated fp8 cache. Why not calibrate here: e4m3's relative precision (3 mantissa
bits) is the same at every magnitude between 2**-6 and 448, so a per-tensor scale only matters for values
outside that range. SmolLM2-135M's keys stay below 20 and its values below 11 (no saturation); only layer 0's
values sit mostly below 2**-6 (subnormal steps). Per-layer scales from max|K|, max|V| / 448 over the prompts of
bench/fp8_quality.py moved its teacher-forced greedy agreement from 0.963 to 0.964 (free running 0.31 -> 0.40,
within the spread of that measure): not worth a calibration step whose result depends on its sample (vLLM's
`calculate_kv_scales` takes the first batch). Calibrated scales from a checkpoint go in through `kv_scales`. The cache halves K/V bytes against 16-bit caches; prefix
caching, chunked prefill, preemption and sliding windows are unchanged (bytes per token is all they see).
On CUDA the fp8 cache needs compute capability >= 8.9 (the kernels convert e4m3 in hardware): refused below.
With the op module's FP8_V_KEYS_CONTIGUOUS at 1 (the default since it was timed on an H200; read when the pass
runs) the fp8 specs of full-attention layers declare V with each block's tokens contiguous
(`FullAttentionSpec.v_keys_contiguous`), the layout in which the decode kernel's P @ V reads its value tiles as
Q @ K^T reads keys (ops/paged_attention.py); at 2 the sliding-window layers' specs too, at 0 none. Those specs
also ask for 64-token blocks (`block_size_hint`, the op module's FP8_V_KEYS_BLOCK_SIZE: runs of 64 contiguous V
bytes a row), which an engine not told a block size takes. With the op module's KV_HEADS_OUTER (off by default:
+1.0% over an fp8 cache in one H200 run, within the spread) the specs store each KV head's tokens of a block side by
side (`FullAttentionSpec.heads_outer`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.fx as fx

import mini_infer.ops  # noqa: F401
from mini_infer.contract import FullAttentionSpec, SlidingWindowSpec
from mini_infer.contract.caches import FP8_DTYPES
from mini_infer.contract.inputs import ATTENTION_METADATA, UNCAPTURED_QUERY_ROWS
from mini_infer.ops import paged_attention as paged_attention_op
from mini_infer.ops.paged_attention import route_min_query_rows
from mini_infer.passes.base import GraphPass, PassContext, PassResult
from mini_infer.passes.pattern import aten, attention_calls, attention_fields, repeat_kv_source, shape
from mini_infer.passes.quantize_fp8 import require_fp8_device

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


def fp8_v_keys_contiguous(window: int | None) -> bool:
    """Whether the fp8 cache spec of a layer with this sliding window (None: full attention) stores V
    tokens-contiguous: the op module's FP8_V_KEYS_CONTIGUOUS, 1 for full-attention layers, 2 for all, 0 for none."""
    mode = int(paged_attention_op.FP8_V_KEYS_CONTIGUOUS)
    return mode >= 2 or (mode == 1 and not window)


def kv_heads_outer(fp8: bool) -> bool:
    """Whether a layer's K/V caches are stored heads-outer (`FullAttentionSpec.heads_outer`): the op module's
    KV_HEADS_OUTER, 1 for fp8 caches, 2 for all, 0 for none."""
    mode = int(paged_attention_op.KV_HEADS_OUTER)
    return mode >= 2 or (mode == 1 and fp8)


class PagedAttention(GraphPass):
    """SDPA (+ mask + repeat_kv) → paged_attention with per-layer paged caches as graph inputs."""

    name = "paged_attention"
    stage = "attention"
    requires = ("cleanup",)

    def __init__(self, kv_scales: tuple[float, float] | Mapping[int, tuple[float, float]] = (1.0, 1.0)) -> None:
        per_layer = dict(kv_scales) if isinstance(kv_scales, Mapping) else {None: kv_scales}
        for layer, pair in per_layer.items():
            ok = isinstance(pair, (tuple, list)) and len(pair) == 2 and all(
                isinstance(x, (int, float)) and math.isfinite(x) and x > 0 for x in pair)
            if not ok or not (layer is None or isinstance(layer, int)):
                raise self.invalid("kv_scales", kv_scales, "must be (k_scale, v_scale), finite and > 0, or a "
                                   "dict of such pairs by layer index")
        self.kv_scales = kv_scales

    def _layer_scales(self, layer_idx: int) -> tuple[float, float]:
        if isinstance(self.kv_scales, Mapping):
            if layer_idx not in self.kv_scales:
                raise self.invalid("kv_scales", sorted(self.kv_scales), f"has no scales for layer {layer_idx}")
            k, v = self.kv_scales[layer_idx]
        else:
            k, v = self.kv_scales
        return float(k), float(v)

    def _check_cache_dtype(self, ctx: PassContext) -> bool:
        """True for an fp8 cache (and a device that runs it); ValueError for fp8 kinds the op lacks."""
        if ctx.cache_dtype not in FP8_DTYPES:
            if self.kv_scales != (1.0, 1.0):
                raise self.invalid("kv_scales", self.kv_scales, f"scales apply to an fp8 KV cache, the cache "
                                   f"dtype is {ctx.cache_dtype}")
            return False
        if ctx.cache_dtype != torch.float8_e4m3fn:
            raise ValueError(f"paged_attention: kv_cache_dtype={ctx.cache_dtype} is not supported; the fp8 KV "
                             "cache is float8_e4m3fn (kv_cache_dtype='fp8' or 'fp8_e4m3')")
        require_fp8_device(ctx.device, "kv_cache_dtype='fp8'")
        return True

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        graph = gm.graph
        sdpas = attention_calls(graph)
        if not sdpas:
            return PassResult(0, "no scaled_dot_product_attention (or mini_infer.attention) in the graph")
        fp8 = self._check_cache_dtype(ctx)
        # an fp8 cache rounds K and V: verification then allows 10% of the logits' scale, as after quantize_fp8
        # (catching a broken graph; bench/fp8_quality.py measures the quality on real weights)
        self.approximation = 0.1 if fp8 else 0.0
        meta = [ctx.add_input(gm, spec) for spec in ATTENTION_METADATA]
        with_sinks = 0

        for layer_idx, sdpa in enumerate(sdpas):
            q, k, v = sdpa.args[:3]
            k, v = _unrepeat_kv(k), _unrepeat_kv(v)
            qs, ks, vs = shape(q), shape(k), shape(v)
            if qs is None or ks is None or vs is None or len(qs) != 4 or qs[0] != 1:
                raise ValueError(f"attention #{layer_idx} ({sdpa.name}): expected q of shape [1, H, T, D], got {qs}")
            hq, hkv, d, dv = qs[1], ks[1], qs[3], vs[3]
            if hq % hkv:
                raise ValueError(f"attention #{layer_idx}: {hq} query heads not a multiple of {hkv} KV heads")
            fields = attention_fields(sdpa)
            scale = fields.scale if fields.scale is not None else 1.0 / math.sqrt(d)
            # a node's window, else the config's (SDPA nodes say none; HF passes it to attention functions)
            window = fields.sliding_window or layer_sliding_window(ctx.config, layer_idx)
            softcap = fields.softcap if fields.softcap is not None \
                else float(getattr(ctx.config, "attn_logit_softcapping", None) or 0.0)
            scales = self._layer_scales(layer_idx) if fp8 else None
            v_keys = fp8 and fp8_v_keys_contiguous(window)
            hint = int(paged_attention_op.FP8_V_KEYS_BLOCK_SIZE) if v_keys else None
            outer = kv_heads_outer(fp8)
            spec = SlidingWindowSpec(layer_idx, hkv, d, dv, ctx.cache_dtype, scales, v_keys, hint, outer,
                                     sliding_window=window) \
                if window else FullAttentionSpec(layer_idx, hkv, d, dv, ctx.cache_dtype, scales, v_keys, hint, outer)
            caches = ctx.add_cache(gm, spec)
            kv_scales = tuple(caches[name] for name in spec.fixed_tensors())  # (k_scale_i, v_scale_i) or ()
            if fields.sinks is not None:  # the op's last argument, after the (possibly None) scales
                kv_scales = (*(kv_scales or (None, None)), fields.sinks)
                with_sinks += 1
            with graph.inserting_before(sdpa):
                packed = []
                for x in (q, k, v):  # [1, H, T, D] → [T, H, D]
                    sel = graph.call_function(aten.select.int, (x, 0, 0))
                    packed.append(graph.call_function(aten.transpose.int, (sel, 0, 1)))
                attn = graph.call_function(ops.paged_attention.default, (
                    *packed, caches[spec.k_input], caches[spec.v_input], *meta, scale, window or 0, softcap,
                    *kv_scales))
                back = graph.call_function(aten.transpose.int, (attn, 0, 1))  # [H, T, Dv]
                out = graph.call_function(aten.unsqueeze.default, (back, 0))
            sdpa.replace_all_uses_with(out)
            graph.erase_node(sdpa)
        ctx.info["attention_layers"] = len(sdpas)
        # the op's long-prefill route reads lengths on the host (steps with such runs run uncaptured)
        if (rows := route_min_query_rows(ctx.device)) is not None:
            ctx.info[UNCAPTURED_QUERY_ROWS] = rows
        windows = sorted({s.attention_window for s in ctx.cache_specs if s.attention_window})
        note = f"{len(sdpas)} layers" + (f", sliding window {windows}" if windows else "")
        if with_sinks:
            note += f", attention sinks in {with_sinks}"
        if fp8:
            note += ", fp8 KV cache " + ("(k/v scales 1.0)" if self.kv_scales == (1.0, 1.0) else "(given k/v scales)")
        return PassResult(len(sdpas), note)
