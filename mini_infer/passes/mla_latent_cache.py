"""MlaLatentCache: DeepSeek-V2/V3 multi-head latent attention → `mini_infer.mla_attention` over a paged latent cache.

HF runs MLA by expanding the latent into per-head K/V (`kv_b_proj`) before SDPA, so `paged_attention` would cache
H x (Dn + Dr + Dv) values per token and layer. This pass replaces each `DeepseekV2Attention` /
`DeepseekV3Attention` (found by `node.meta["nn_module_stack"]`) from the latent on, and the cache then holds only
what the latent attention needs: the normalized latent `c` (kv_lora_rank = Dc) and the shared rotary key (Dr).

Kept as graph nodes (so the fusion passes before this one have fused and merged them): q's projection path
(`q_proj`, or `q_a_proj` → `q_a_layernorm` → `q_b_proj`), `kv_a_proj_with_mqa` and `kv_a_layernorm`. Added per
layer: q split into q_nope / q_pe, k_pe sliced from kv_a_proj_with_mqa's output, the rotary on q_pe and k_pe
(`apply_rotary_interleaved` for DeepSeek's GPT-J style pairs, `apply_rotary` for DeepSeek-V3 with
`rope_interleave=False`) with HF's own cos/sin tables (YaRN frequencies and attention factor included), then
`mla_attention` with `w_uk` / `w_uv` (`absorption_weights` of kv_b_proj's weight, which they replace: the original
is dropped) and HF's `scaling` read from the SDPA node (YaRN's mscale included). Declared: the attention metadata
(shared with `paged_attention`) and one `LatentAttentionSpec` per layer. HF's rotary application, `kv_b_proj`,
`expand_kv`, the mask and the SDPA die with the rewrite.

Refused with a ValueError naming the field (never a wrong answer): an fp8 `kv_cache_dtype`, a `rope_type` other
than default / yarn, an odd `qk_rope_head_dim`, non-positive MLA dims, an MLA module without SDPA, a kv_b_proj
that is not a plain linear over a float weight (e.g. quantized by an earlier pass). This module matches and
rewrites only; the math is `mini_infer/ops/mla_attention.py`'s.
"""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx

import mini_infer.ops  # noqa: F401
from mini_infer.contract import FullAttentionSpec, LatentAttentionSpec
from mini_infer.contract.caches import FP8_DTYPES
from mini_infer.contract.inputs import ATTENTION_METADATA
from mini_infer.ops.mla_attention import absorption_weights
from mini_infer.passes.base import GraphPass, PassContext, PassResult, erase_dead
from mini_infer.passes.pattern import aten, dtype, is_op, kwarg_or_arg, module_chain, shape

ops = torch.ops.mini_infer

MLA_MODULES = ("DeepseekV2Attention", "DeepseekV3Attention")
ROPE_TYPES = ("default", "yarn")
# shape-only ops a value passes through between two places the pass connects
_VIEW_OPS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.transpose.int,
             aten.permute.default, aten.slice.Tensor, aten.split_with_sizes.default, aten.split.Tensor,
             aten.contiguous.default, aten.clone.default, aten.unsqueeze.default, aten.squeeze.dim,
             aten.expand.default, aten.alias.default)
# single-input ops between HF's cos()/sin() and the table the attention reads (attention factor, dtype casts)
_TABLE_OPS = (aten.mul.Tensor, aten.mul.Scalar, aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default,
              aten.to.device)


@dataclass(frozen=True)
class MlaDims:
    """The MLA sizes of a config (Dc, Dn, Dr, Dv) and HF's rotary layout for this model type."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    interleaved: bool  # GPT-J style pairs (DeepSeek-V2 always; V3 unless rope_interleave=False)


def is_mla_config(config) -> bool:
    """True for configs with a latent KV (DeepSeek-V2/V3 and models built on their attention)."""
    return getattr(config, "kv_lora_rank", None) is not None


def rope_type(config) -> str:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return params.get("rope_type", params.get("type", "default"))


def mla_dims(config, module_class: str) -> MlaDims:
    """The config's MLA dims, validated; ValueError naming the field this pass cannot serve."""
    fields = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    values = {f: getattr(config, f, None) for f in fields}
    for f, v in values.items():
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"mla_latent_cache: config.{f}={v!r}; the latent cache needs a positive int")
    if values["qk_rope_head_dim"] % 2:
        raise ValueError(f"mla_latent_cache: config.qk_rope_head_dim={values['qk_rope_head_dim']} is odd; the "
                         "rotary turns pairs of values")
    rope = rope_type(config)
    if rope not in ROPE_TYPES:
        raise ValueError(f"mla_latent_cache: config rope_type={rope!r} is not supported (supported: "
                         f"{', '.join(ROPE_TYPES)})")
    interleaved = module_class == "DeepseekV2Attention" or bool(getattr(config, "rope_interleave", True))
    return MlaDims(**values, interleaved=interleaved)


# -- matching helpers ---------------------------------------------------------------------------------------


def mla_module(node: fx.Node) -> tuple[str, str] | None:
    """(path, class name) of the innermost MLA attention module `node` was traced in, or None."""
    return next(((path, cls) for path, cls in reversed(module_chain(node)) if cls in MLA_MODULES), None)


def _in_rotary_module(node: fx.Node) -> bool:
    chain = module_chain(node)
    return bool(chain) and chain[-1][1].endswith("RotaryEmbedding")


def _ancestor(start: fx.Node, found: Callable[[fx.Node], bool],
              through: Callable[[fx.Node], bool] = lambda n: True) -> fx.Node | None:
    """The nearest node at or above `start` (breadth first over inputs) with `found`, expanding only nodes that
    pass `through`."""
    seen, queue = {start}, deque([start])
    while queue:
        node = queue.popleft()
        if found(node):
            return node
        if node.op != "call_function" or not through(node):
            continue
        for arg in node.all_input_nodes:
            if arg not in seen:
                seen.add(arg)
                queue.append(arg)
    return None


def _is_view(node: fx.Node) -> bool:
    return is_op(node, *_VIEW_OPS) or (node.op == "call_function" and node.target is operator.getitem)


def _last_dim(size: int) -> Callable[[fx.Node], bool]:
    """A rank-3 [1, T, size] value (a projection's output in the packed layout)."""
    def pred(node: fx.Node) -> bool:
        s = shape(node)
        return s is not None and len(s) == 3 and s[0] == 1 and isinstance(s[2], int) and s[2] == size
    return pred


def _rotary_tables(query: fx.Node, q_flat: fx.Node) -> tuple[fx.Node, ...]:
    """The rotary embedding module's outputs that the query reads (HF's cos/sin or complex freqs), in graph
    order: the nearest nodes above `query` traced in a `*RotaryEmbedding` module, not looking above q's
    projection."""
    found, seen, queue = [], {query}, deque([query])
    while queue:
        node = queue.popleft()
        if _in_rotary_module(node):
            found.append(node)
            continue
        if node.op != "call_function" or node is q_flat:
            continue
        for arg in node.all_input_nodes:
            if arg not in seen:
                seen.add(arg)
                queue.append(arg)
    order = {n: i for i, n in enumerate(query.graph.nodes)}
    return tuple(sorted(found, key=order.__getitem__))


def _trig_of(node: fx.Node) -> str | None:
    """"cos" / "sin" when `node` is HF's cos()/sin() table through single-input scalings and casts."""
    for _ in range(8):
        if is_op(node, aten.cos.default):
            return "cos"
        if is_op(node, aten.sin.default):
            return "sin"
        if not is_op(node, *_TABLE_OPS) or len(node.all_input_nodes) != 1:
            return None
        node = node.all_input_nodes[0]
    return None


@dataclass
class _Layer:
    """What one MLA attention module contributes to the rewrite."""

    sdpa: fx.Node
    path: str
    heads: int
    scale: float
    q_flat: fx.Node  # q's projection output [1, T, H * (Dn + Dr)]
    latent: fx.Node  # kv_b_proj's input: the normalized latent, [.., T, Dc]
    compressed_kv: fx.Node  # kv_a_proj_with_mqa's output [1, T, Dc + Dr]
    kv_b: fx.Node  # the kv_b_proj linear
    tables: tuple[fx.Node, ...]  # HF's rotary tables: (freqs_cis,) complex, or (cos, sin)


def _match_layer(gm: fx.GraphModule, sdpa: fx.Node, path: str, dims: MlaDims) -> _Layer:
    """Find the latent, q, the rotary tables and kv_b_proj of the attention around `sdpa`; ValueError naming the
    layer when HF's MLA structure is not there."""
    dc, dn, dr, dv = dims.kv_lora_rank, dims.qk_nope_head_dim, dims.qk_rope_head_dim, dims.v_head_dim
    query, value = sdpa.args[0], sdpa.args[2]
    qs, vs = shape(query), shape(value)
    if qs is None or vs is None or len(qs) != 4 or qs[0] != 1 or qs[3] != dn + dr or vs[3] != dv:
        raise ValueError(f"{path}: SDPA query {qs} / value {vs} are not [1, H, T, qk_nope_head_dim + "
                         f"qk_rope_head_dim = {dn + dr}] / [1, H, T, v_head_dim = {dv}]")
    heads = qs[1]
    q_flat = _ancestor(query, _last_dim(heads * (dn + dr)))
    kv_b = _ancestor(value, lambda n: is_op(n, aten.linear.default), through=_is_view)
    if q_flat is None:
        raise ValueError(f"{path}: no q projection output [1, T, {heads * (dn + dr)}] above the SDPA query")
    if kv_b is None:
        raise ValueError(f"{path}: the SDPA value is not a view of a linear (kv_b_proj); was kv_b_proj rewritten "
                         "(e.g. quantized) before mla_latent_cache?")
    weight = kv_b.args[1]
    w = PassContext.tensor_of(gm, weight) if isinstance(weight, fx.Node) and \
        weight.op == "get_attr" else None
    has_bias = (len(kv_b.args) > 2 and kv_b.args[2] is not None) or kv_b.kwargs.get("bias") is not None
    if w is None or not w.is_floating_point() or tuple(w.shape) != (heads * (dn + dv), dc) or has_bias:
        raise ValueError(f"{path}: kv_b_proj must be a linear without bias over a float weight "
                         f"[{heads * (dn + dv)}, {dc}], got weight {None if w is None else tuple(w.shape)}")
    latent = kv_b.args[0]
    compressed_kv = _ancestor(latent, _last_dim(dc + dr), through=lambda n: not is_op(n, aten.linear.default))
    if compressed_kv is None:
        raise ValueError(f"{path}: no kv_a_proj_with_mqa output [1, T, kv_lora_rank + qk_rope_head_dim = "
                         f"{dc + dr}] above kv_a_layernorm")
    tables = _rotary_tables(query, q_flat)
    scale = kwarg_or_arg(sdpa, 6, "scale")
    scale = float(scale) if scale is not None else (dn + dr) ** -0.5
    return _Layer(sdpa, path, heads, scale, q_flat, latent, compressed_kv, kv_b, tuple(tables))


class _Rotary:
    """Builds (once per table) the cos/sin our rotary ops read from HF's tables, and applies the rotary."""

    def __init__(self, graph: fx.Graph, dims: MlaDims) -> None:
        self.graph, self.dims = graph, dims
        self._made: dict[tuple, tuple[fx.Node, fx.Node]] = {}

    def cos_sin(self, layer: _Layer) -> tuple[fx.Node, fx.Node]:
        """[T, Dr/2] (interleaved) or [T, Dr] (neox) cos and sin, inserted before this layer's SDPA."""
        if layer.tables in self._made:
            return self._made[layer.tables]
        g, dr = self.graph, self.dims.qk_rope_head_dim
        complex_tables = [t for t in layer.tables if dtype(t) is not None and dtype(t).is_complex]
        trig = {_trig_of(t): t for t in layer.tables if t not in complex_tables}
        if len(layer.tables) == 1 and complex_tables and self.dims.interleaved:
            real = g.call_function(aten.view_as_real.default, (complex_tables[0],))  # [1, T, Dr/2, 2]
            pair = [g.call_function(aten.select.int, (real, -1, i)) for i in (0, 1)]
        elif len(layer.tables) == 2 and set(trig) == {"cos", "sin"}:
            pair = [trig["cos"], trig["sin"]]
            if self.dims.interleaved:  # HF's tables are cat(freqs, freqs): one angle per pair in the first half
                pair = [g.call_function(aten.slice.Tensor, (t, -1, 0, dr // 2)) for t in pair]
        else:
            raise ValueError(f"{layer.path}: unrecognized rotary tables {[t.name for t in layer.tables]} "
                             f"(interleaved={self.dims.interleaved})")
        width = dr // 2 if self.dims.interleaved else dr
        made = tuple(g.call_function(aten.reshape.default, (t, [-1, width])) for t in pair)
        self._made[layer.tables] = made
        return made

    def apply(self, x: fx.Node, cos: fx.Node, sin: fx.Node) -> fx.Node:
        op = ops.apply_rotary_interleaved.default if self.dims.interleaved else ops.apply_rotary.default
        return self.graph.call_function(op, (x, cos, sin))


class MlaLatentCache(GraphPass):
    """DeepSeek MLA attention (from the latent on) → mla_attention over a paged latent cache."""

    name = "mla_latent_cache"
    stage = "attention"
    requires = ("cleanup",)

    @classmethod
    def default_for(cls, ctx: PassContext) -> GraphPass | None:
        return cls() if is_mla_config(ctx.config) else None

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        graph = gm.graph
        sdpas, modules = [], {}
        for node in graph.nodes:
            module = mla_module(node)
            if module is not None:
                modules.setdefault(module[0], module[1])
                if is_op(node, aten.scaled_dot_product_attention.default):
                    sdpas.append((node, module[0]))
        if not modules:
            return PassResult(0, "no DeepSeek MLA attention in the graph")
        missing = sorted(set(modules) - {p for _, p in sdpas})
        if missing:
            raise ValueError(f"mla_latent_cache: {missing[0]} has no scaled_dot_product_attention (config "
                             f"_attn_implementation={getattr(ctx.config, '_attn_implementation', None)!r}); load "
                             "the model with attn_implementation='sdpa'")
        if ctx.cache_dtype in FP8_DTYPES:
            raise ValueError(f"mla_latent_cache: kv_cache_dtype={ctx.cache_dtype} is not supported (the latent "
                             "cache has no fp8 scales); MLA models (DeepSeek-V2/V3) need kv_cache_dtype='auto'")
        dims = mla_dims(ctx.config, next(iter(modules.values())))
        layers = [_match_layer(gm, sdpa, path, dims) for sdpa, path in sdpas]
        meta = [ctx.add_input(gm, spec) for spec in ATTENTION_METADATA]
        rotary = _Rotary(graph, dims)
        for i, layer in enumerate(layers):
            spec = LatentAttentionSpec(i, dims.kv_lora_rank, dims.qk_rope_head_dim, ctx.cache_dtype)
            cache = ctx.add_cache(gm, spec)[spec.latent_input]
            self._rewrite(gm, ctx, layer, dims, rotary, cache, meta)
        paths = {layer.path for layer in layers}
        erase_dead(gm, lambda n: (m := mla_module(n)) is not None and m[0] in paths, "attention")
        leftover = [layer.path for layer in layers if layer.kv_b in graph.nodes]
        if leftover:
            raise ValueError(f"{leftover[0]}: kv_b_proj is still used after the rewrite; its weight would be held "
                             "twice")
        return PassResult(len(layers), self._note(ctx, layers, dims))

    @staticmethod
    def _rewrite(gm: fx.GraphModule, ctx: PassContext, layer: _Layer, dims: MlaDims, rotary: _Rotary,
                 cache: fx.Node, meta: list[fx.Node]) -> None:
        graph, h = gm.graph, layer.heads
        dc, dn, dr = dims.kv_lora_rank, dims.qk_nope_head_dim, dims.qk_rope_head_dim
        w_uk, w_uv = absorption_weights(PassContext.tensor_of(gm, layer.kv_b.args[1]).detach(), h, dn,
                                        dims.v_head_dim)
        base = str(layer.kv_b.args[1].target).removesuffix(".weight")
        w_uk_node = ctx.add_tensor(gm, f"{base}_w_uk", w_uk, before=layer.sdpa)
        w_uv_node = ctx.add_tensor(gm, f"{base}_w_uv", w_uv, before=layer.sdpa)
        kv_rank = len(shape(layer.compressed_kv))
        with graph.inserting_before(layer.sdpa):
            cos, sin = rotary.cos_sin(layer)
            q = graph.call_function(aten.reshape.default, (layer.q_flat, [-1, h, dn + dr]))
            q_nope = graph.call_function(aten.slice.Tensor, (q, 2, 0, dn))
            q_pe = graph.call_function(aten.slice.Tensor, (q, 2, dn, dn + dr))
            k_pe = graph.call_function(aten.slice.Tensor, (layer.compressed_kv, kv_rank - 1, dc, dc + dr))
            k_pe = graph.call_function(aten.reshape.default, (k_pe, [-1, dr]))
            latent = graph.call_function(aten.reshape.default, (layer.latent, [-1, dc]))
            q_cos = graph.call_function(aten.unsqueeze.default, (cos, 1))
            q_sin = graph.call_function(aten.unsqueeze.default, (sin, 1))
            q_pe = rotary.apply(q_pe, q_cos, q_sin)
            k_pe = rotary.apply(k_pe, cos, sin)
            attn = graph.call_function(ops.mla_attention.default, (
                q_nope, q_pe, latent, k_pe, cache, *meta, w_uk_node, w_uv_node, layer.scale))  # [T, H, Dv]
            back = graph.call_function(aten.transpose.int, (attn, 0, 1))
            out = graph.call_function(aten.unsqueeze.default, (back, 0))  # [1, H, T, Dv] as SDPA's
        stack = layer.sdpa.meta.get("nn_module_stack")
        for node in (q_nope, q_pe, k_pe, latent, attn, back, out):
            if stack is not None:
                node.meta["nn_module_stack"] = dict(stack)
        layer.sdpa.replace_all_uses_with(out)

    @staticmethod
    def _note(ctx: PassContext, layers: list[_Layer], dims: MlaDims) -> str:
        """Cache bytes per token over all layers: the latent cache, and per-head K/V as paged_attention would
        keep them."""
        latent = sum(s.bytes_per_token() for s in ctx.cache_specs if isinstance(s, LatentAttentionSpec))
        full = sum(FullAttentionSpec(i, layer.heads, dims.qk_nope_head_dim + dims.qk_rope_head_dim,
                                     dims.v_head_dim, ctx.cache_dtype).bytes_per_token()
                   for i, layer in enumerate(layers))
        return (f"{len(layers)} layers; KV cache {latent} B/token (latent {dims.kv_lora_rank} + rope "
                f"{dims.qk_rope_head_dim}) instead of {full} B/token of per-head K/V ({full / latent:.1f}x smaller)")
