"""PagedAttention: each `scaled_dot_product_attention` → `mini_infer.paged_attention` over a paged KV cache.

The captured graph attends over its own T tokens with a mask built from position_ids; after this pass each
attention writes the step's K/V into the layer's cache and attends over every sequence's cached plus new
tokens, so one graph serves prefill, chunked prefill, decode, and any mix of sequences in one packed row.
The pass adds graph inputs: the attention metadata shared by all layers (`slot_mapping`, `block_tables`,
`seq_lens`, `query_start_loc`) and per layer `k_cache_<i>` / `v_cache_<i>`, and declares each layer's cache
layout (KV heads, head sizes, dtype, sliding window) on the context for the runtime to allocate. The mask
sub-graph and HF's repeat_kv expansion die with the SDPA node. Everything the kernel reads at run time
comes in through those inputs (static buffers on GPU), nothing through Python state.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

import mini_infer.ops  # noqa: F401
from mini_infer.passes.base import GraphPass, KVCacheSpec, PassContext, PassResult
from mini_infer.passes.pattern import aten, is_op, kwarg_or_arg, shape

ops = torch.ops.mini_infer
METADATA_INPUTS = ("slot_mapping", "block_tables", "seq_lens", "query_start_loc")
VERIFY_BLOCK_SIZE = 16


def _unrepeat_kv(node: fx.Node) -> fx.Node:
    """Undo HF's repeat_kv: reshape(expand(unsqueeze(x, 2), [B, Hkv, n_rep, T, D]), [B, H, T, D]) → x."""
    if is_op(node, aten.reshape.default, aten.view.default, aten._unsafe_view.default):
        e = node.args[0]
        if is_op(e, aten.expand.default) and is_op(e.args[0], aten.unsqueeze.default) and e.args[0].args[1] == 2:
            return e.args[0].args[0]
    return node


def layer_sliding_window(config, layer_idx: int) -> int | None:
    """The sliding window (tokens) of layer `layer_idx`, from the config as transformers reads it."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    return window if getattr(config, "use_sliding_window", True) else None


def _single_sequence_builders(ctx: PassContext):
    """Example metadata running the verification tokens as one sequence (for verify and tests)."""
    bs = VERIFY_BLOCK_SIZE

    def nblocks(ids: torch.Tensor) -> int:
        return max(1, math.ceil(ids.shape[1] / bs))

    return {
        "slot_mapping": lambda ids, pos: torch.arange(ids.shape[1], device=ids.device, dtype=torch.int64),
        "block_tables": lambda ids, pos: torch.arange(nblocks(ids), device=ids.device, dtype=torch.int32)[None],
        "seq_lens": lambda ids, pos: torch.tensor([ids.shape[1]], device=ids.device, dtype=torch.int32),
        "query_start_loc": lambda ids, pos: torch.tensor([0, ids.shape[1]], device=ids.device, dtype=torch.int32),
    }


class PagedAttention(GraphPass):
    """SDPA (+ mask + repeat_kv) → paged_attention with per-layer paged caches as graph inputs."""

    name = "paged_attention"
    requires = ("cleanup",)

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        graph = gm.graph
        sdpas = [n for n in graph.nodes if is_op(n, aten.scaled_dot_product_attention.default)]
        if not sdpas:
            return PassResult(0, "no scaled_dot_product_attention in the graph")
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        ids_val = placeholders[0].meta["val"]
        fake_mode = detect_fake_mode([p.meta["val"] for p in placeholders])
        num_tokens = ids_val.shape[1]
        device = ids_val.device  # the fakes' device (validation runs on CPU fakes)

        def fake(shape_, dtype):
            with fake_mode:
                return torch.empty(shape_, dtype=dtype, device=device)

        last = placeholders[-1]
        meta_nodes: dict[str, fx.Node] = {}
        meta_vals = {
            "slot_mapping": fake((num_tokens,), torch.int64),
            "block_tables": fake((4, 8), torch.int32),
            "seq_lens": fake((4,), torch.int32),
            "query_start_loc": fake((5,), torch.int32),
        }
        builders = _single_sequence_builders(ctx)
        for name in METADATA_INPUTS:
            with graph.inserting_after(last):
                node = graph.placeholder(name)
            node.meta["val"] = meta_vals[name]
            meta_nodes[name] = last = node
            ctx.declare_input(name, builders[name])

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
            spec = KVCacheSpec(layer_idx, f"k_cache_{layer_idx}", f"v_cache_{layer_idx}", hkv, d, dv, ctx.dtype,
                               window)
            ctx.declare_kv_cache(spec)
            cache_nodes = []
            for cname, hd in ((spec.k_input, d), (spec.v_input, dv)):
                with graph.inserting_after(last):
                    node = graph.placeholder(cname)
                node.meta["val"] = fake((2, VERIFY_BLOCK_SIZE, hkv, hd), ctx.dtype)
                ctx.declare_input(cname, lambda ids, pos, hkv=hkv, hd=hd: torch.zeros(
                    max(1, math.ceil(ids.shape[1] / VERIFY_BLOCK_SIZE)), VERIFY_BLOCK_SIZE, hkv, hd,
                    dtype=ctx.dtype, device=ids.device))
                cache_nodes.append(node)
                last = node
            with graph.inserting_before(sdpa):
                packed = []
                for x in (q, k, v):  # [1, H, T, D] → [T, H, D]
                    sel = graph.call_function(aten.select.int, (x, 0, 0))
                    packed.append(graph.call_function(aten.transpose.int, (sel, 0, 1)))
                attn = graph.call_function(ops.paged_attention.default, (
                    *packed, *cache_nodes, *(meta_nodes[n] for n in METADATA_INPUTS),
                    scale, window or 0, softcap))
                back = graph.call_function(aten.transpose.int, (attn, 0, 1))  # [H, T, Dv]
                out = graph.call_function(aten.unsqueeze.default, (back, 0))
            sdpa.replace_all_uses_with(out)
            graph.erase_node(sdpa)
        ctx.info["attention_layers"] = len(sdpas)
        windows = sorted({s.sliding_window for s in ctx.kv_cache_specs if s.sliding_window})
        note = f"{len(sdpas)} layers" + (f", sliding window {windows}" if windows else "")
        return PassResult(len(sdpas), note)
