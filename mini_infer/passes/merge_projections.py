"""MergeProjections: sibling linears that read the same input become one GEMM.

q/k/v projections (3 GEMMs) and the SwiGLU gate/up projections (2 GEMMs) each read one tensor; one GEMM with
the weights concatenated along the output dimension reads that input once and launches once, then
`split_with_sizes` hands each former consumer its slice (a view, no copy). At batch 1 decode a 7B model's
step is dominated by these small GEMMs. Merged weights are new buffers of the graph and the originals are
no longer referenced: the pass manager drops them from the graph, and once the engine releases the HF model
they are freed, so the model's weights are held once (while merging, one group's originals and its merged
copy coexist). Only linears whose weights are parameters of the same dtype, all with or all without bias, merge.

Quantized linears merge the same way: `MERGEABLE` lists, per linear op, how many leading arguments are the
activation input(s) the siblings share and how many follow that are per-output-channel tensors (weight rows,
per-channel scales, bias: each concatenated along dim 0); any later arguments (e.g. an output dtype) must be
equal. A quantization pass whose linear op has that layout adds one entry.
"""

from __future__ import annotations

import operator
from collections import defaultdict

import torch
import torch.fx as fx

import mini_infer.ops  # noqa: F401  (registers the quantized linears named in MERGEABLE)
from mini_infer.passes.base import GraphPass, PassContext, PassResult
from mini_infer.passes.pattern import aten

# linear op -> (number of leading activation inputs, number of per-output-channel tensor arguments after them)
MERGEABLE: dict = {
    aten.linear.default: (1, 2),  # (x, weight, bias)
    torch.ops.mini_infer.fp8_w8a8_linear.default: (1, 3),  # (x, w_q, w_scale, bias)
    torch.ops.mini_infer.w8a8_linear.default: (1, 3),  # (x, w_q, w_scale, bias)
    torch.ops.mini_infer.fp8_linear.default: (2, 3),  # (x_q, x_scale, w_q, w_scale, bias, out_dtype)
    torch.ops.mini_infer.int8_linear.default: (2, 3),  # (x_q, x_scale, w_q, w_scale, bias, out_dtype)
}


def _parts(node: fx.Node) -> tuple[tuple, tuple, tuple]:
    """(activation inputs, per-output-channel tensors (None where absent), remaining arguments) of a linear."""
    n_in, n_ch = MERGEABLE[node.target]
    schema = node.target._schema.arguments
    args = [node.args[i] if i < len(node.args) else node.kwargs.get(a.name, a.default_value)
            for i, a in enumerate(schema)]
    return tuple(args[:n_in]), tuple(args[n_in:n_in + n_ch]), tuple(args[n_in + n_ch:])


def _is_param(v) -> bool:
    return isinstance(v, fx.Node) and v.op == "get_attr"


class MergeProjections(GraphPass):
    """Linears sharing an input (q/k/v, gate/up) → one linear + split; quantized linears too."""

    name = "merge_projections"
    stage = "fusion"
    requires = ("cleanup",)

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        graph = gm.graph
        groups: dict[tuple, list[fx.Node]] = defaultdict(list)
        for node in graph.nodes:
            if node.op == "call_function" and node.target in MERGEABLE:
                inputs, channel, rest = _parts(node)
                if _is_param(channel[0]) and all(c is None or _is_param(c) for c in channel[1:]):
                    groups[(node.target, inputs, rest)].append(node)
        merged = 0
        gemms_removed = 0
        for (target, inputs, rest), linears in groups.items():
            if len(linears) < 2:
                continue
            columns = list(zip(*(_parts(n)[1] for n in linears)))  # per argument position, every sibling's
            tensors = [[None if c is None else PassContext.tensor_of(gm, c) for c in col] for col in columns]
            weights = tensors[0]
            if len({w.shape[1:] for w in weights}) != 1:
                continue
            if any(len({t is None for t in col}) != 1 or len({t.dtype for t in col if t is not None}) > 1
                   for col in tensors):
                continue  # some with and some without bias, or mixed dtypes
            if any(t is not None and t.shape[0] != w.shape[0] for col in tensors[1:] for w, t in zip(weights, col)):
                continue  # a scale that is not one per output row (per-tensor) cannot be concatenated
            first = linears[0]
            new_args = []
            for i, col in enumerate(tensors):
                if col[0] is None:
                    new_args.append(None)
                    continue
                with torch.no_grad():
                    cat = torch.cat(col, 0)
                suffix = "weight" if i == 0 else ("bias" if i == len(tensors) - 1 else "weight_scale")
                new_args.append(PassContext.add_tensor(gm, f"merged_{first.name}_{suffix}", cat, before=first))
            if target is aten.linear.default and new_args[-1] is None:
                new_args.pop()  # aten.linear(x, w) as the captured graphs write it
            sizes = [w.shape[0] for w in weights]
            with graph.inserting_before(first):
                fused = graph.call_function(target, (*inputs, *new_args, *rest))
                parts = graph.call_function(aten.split_with_sizes.default, (fused, sizes, -1))
                outs = [graph.call_function(operator.getitem, (parts, i)) for i in range(len(linears))]
            for lin, out in zip(linears, outs):
                out.meta["val"] = lin.meta.get("val")
                lin.replace_all_uses_with(out)
            merged += 1
            gemms_removed += len(linears) - 1
        return PassResult(merged, f"{gemms_removed} GEMMs fewer")
