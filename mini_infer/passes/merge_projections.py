"""MergeProjections: sibling linears that read the same input become one GEMM.

q/k/v projections (3 GEMMs) and the SwiGLU gate/up projections (2 GEMMs) each read one tensor; one GEMM with
the weights concatenated along the output dimension reads that input once and launches once, then
`split_with_sizes` hands each former consumer its slice (a view, no copy). At batch 1 decode a 7B model's
step is dominated by these small GEMMs. Merged weights are new buffers of the graph and the originals are
no longer referenced: the pass manager drops them from the graph, and once the engine releases the HF model
they are freed, so the model's weights are held once (while merging, one group's originals and its merged
copy coexist). Only linears whose weights are parameters of the same dtype, all with or all without bias, merge.
"""

from __future__ import annotations

import operator
from collections import defaultdict

import torch
import torch.fx as fx

from mini_infer.passes.base import GraphPass, PassContext, PassResult
from mini_infer.passes.pattern import aten, is_op


def _linear_parts(node: fx.Node):
    x, w = node.args[0], node.args[1]
    b = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    return x, w, b


class MergeProjections(GraphPass):
    """Linears sharing an input (q/k/v, gate/up) → one linear + split."""

    name = "merge_projections"
    stage = "fusion"
    requires = ("cleanup",)

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        graph = gm.graph
        groups: dict[fx.Node, list[fx.Node]] = defaultdict(list)
        for node in graph.nodes:
            if is_op(node, aten.linear.default):
                x, w, b = _linear_parts(node)
                if isinstance(w, fx.Node) and w.op == "get_attr" and (b is None or b.op == "get_attr"):
                    groups[x].append(node)
        merged = 0
        gemms_removed = 0
        for x, linears in groups.items():
            if len(linears) < 2:
                continue
            weights = [PassContext.tensor_of(gm, _linear_parts(n)[1]) for n in linears]
            biases = [_linear_parts(n)[2] for n in linears]
            if len({w.dtype for w in weights}) != 1 or len({w.shape[1] for w in weights}) != 1:
                continue
            if any(b is None for b in biases) != all(b is None for b in biases):
                continue
            first = linears[0]
            with torch.no_grad():
                w_cat = torch.cat(weights, 0)
                b_cat = torch.cat([PassContext.tensor_of(gm, b) for b in biases], 0) if biases[0] is not None \
                    else None
            w_node = PassContext.add_tensor(gm, f"merged_{first.name}_weight", w_cat, before=first)
            args = (x, w_node) if b_cat is None else \
                (x, w_node, PassContext.add_tensor(gm, f"merged_{first.name}_bias", b_cat, before=first))
            sizes = [w.shape[0] for w in weights]
            with graph.inserting_before(first):
                fused = graph.call_function(aten.linear.default, args)
                parts = graph.call_function(aten.split_with_sizes.default, (fused, sizes, -1))
                outs = [graph.call_function(operator.getitem, (parts, i)) for i in range(len(linears))]
            for lin, out in zip(linears, outs):
                out.meta["val"] = lin.meta.get("val")
                lin.replace_all_uses_with(out)
            merged += 1
            gemms_removed += len(linears) - 1
        return PassResult(merged, f"{gemms_removed} GEMMs fewer")
