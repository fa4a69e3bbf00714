"""MergeProjections: sibling linears that read the same input become one GEMM.

q/k/v projections (3 GEMMs) and the SwiGLU gate/up projections (2 GEMMs) each read one tensor; one GEMM with
the weights concatenated along the output dimension reads that input once and launches once, then
`split_with_sizes` hands each former consumer its slice (a view, no copy). At batch 1 decode a 7B model's
step is dominated by these small GEMMs. Merged weights are new buffers of the graph and the originals are
no longer referenced: the pass manager drops them from the graph, and once the engine releases the HF model
they are freed, so the model's weights are held once (while merging, one group's originals and its merged
copy coexist). Only linears whose weights are parameters of the same dtype, all with or all without bias, merge.

Quantized linears (`mini_infer.int8_linear` / `fp8_linear` from the quantization passes) merge the same way when
they read the same quantized activation and scale and have the same output dtype: their weights and per-channel
weight scales are concatenated along the output dimension (each row keeps its own scale, so the merged GEMM
computes exactly what the separate ones did).
"""

from __future__ import annotations

import operator
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx

import mini_infer.ops  # noqa: F401
from mini_infer.passes.base import GraphPass, PassContext, PassResult
from mini_infer.passes.pattern import aten, is_op

ops = torch.ops.mini_infer
# quantized linears: (x_q, x_scale, w_q, w_scale, bias, out_dtype), weight and scale one row per output channel
SCALED_LINEARS = (ops.int8_linear.default, ops.fp8_linear.default)


@dataclass
class _Parts:
    """What a mergeable linear is made of: the group key (what must be equal to merge), the get_attr tensors
    concatenated along dim 0 (weight, and the weight scale of a quantized linear), its bias, and how to rebuild
    the call from the merged tensors."""

    key: tuple
    rows: list[fx.Node]
    bias: fx.Node | None
    build: Callable[[list[fx.Node], fx.Node | None], tuple]


def _parts(node: fx.Node) -> _Parts | None:
    if is_op(node, aten.linear.default):
        x, w = node.args[0], node.args[1]
        b = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        return _Parts((node.target, x), [w], b, lambda rows, bias: (x, rows[0]) if bias is None else (x, rows[0], bias))
    if is_op(node, *SCALED_LINEARS):
        x_q, x_s, w_q, w_s, b, out_dtype = node.args
        return _Parts((node.target, x_q, x_s, out_dtype), [w_q, w_s], b,
                      lambda rows, bias: (x_q, x_s, rows[0], rows[1], bias, out_dtype))
    return None


def _is_param(node) -> bool:
    return isinstance(node, fx.Node) and node.op == "get_attr"


class MergeProjections(GraphPass):
    """Linears sharing an input (q/k/v, gate/up) → one linear + split; quantized linears too."""

    name = "merge_projections"
    stage = "fusion"
    requires = ("cleanup",)

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        graph = gm.graph
        groups: dict[tuple, list[tuple[fx.Node, _Parts]]] = defaultdict(list)
        for node in graph.nodes:
            parts = _parts(node)
            if parts is not None and all(_is_param(r) for r in parts.rows) and \
                    (parts.bias is None or _is_param(parts.bias)):
                groups[parts.key].append((node, parts))
        merged = 0
        gemms_removed = 0
        for members in groups.values():
            if len(members) < 2:
                continue
            linears = [n for n, _ in members]
            tensors = [[PassContext.tensor_of(gm, r) for r in p.rows] for _, p in members]
            biases = [p.bias for _, p in members]
            weights = [t[0] for t in tensors]
            if len({w.dtype for w in weights}) != 1 or len({w.shape[1] for w in weights}) != 1:
                continue
            if any(t.shape[0] != w.shape[0] for w, ts in zip(weights, tensors) for t in ts):
                continue  # a scale that is not one per output row (per-tensor) cannot be concatenated
            if any(b is None for b in biases) != all(b is None for b in biases):
                continue
            first = linears[0]
            suffixes = ("weight", "weight_scale")
            with torch.no_grad():
                cats = [torch.cat([ts[i] for ts in tensors], 0) for i in range(len(tensors[0]))]
                b_cat = torch.cat([PassContext.tensor_of(gm, b) for b in biases], 0) if biases[0] is not None \
                    else None
            rows = [PassContext.add_tensor(gm, f"merged_{first.name}_{suffixes[i]}", t, before=first)
                    for i, t in enumerate(cats)]
            bias = PassContext.add_tensor(gm, f"merged_{first.name}_bias", b_cat, before=first) \
                if b_cat is not None else None
            sizes = [w.shape[0] for w in weights]
            with graph.inserting_before(first):
                fused = graph.call_function(first.target, members[0][1].build(rows, bias))
                parts = graph.call_function(aten.split_with_sizes.default, (fused, sizes, -1))
                outs = [graph.call_function(operator.getitem, (parts, i)) for i in range(len(linears))]
            for lin, out in zip(linears, outs):
                out.meta["val"] = lin.meta.get("val")
                lin.replace_all_uses_with(out)
            merged += 1
            gemms_removed += len(linears) - 1
        return PassResult(merged, f"{gemms_removed} GEMMs fewer")
