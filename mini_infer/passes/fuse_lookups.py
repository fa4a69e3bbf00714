"""FuseLookups: the table lookups a step starts with → one `gather_rows` launch.

    e = embedding(embed_tokens, input_ids);  c = embedding(cos_table, position_ids);  s = embedding(sin_table, ..)
        → e, c, s = gather_rows([embed_tokens, cos_table, sin_table], [input_ids, position_ids, position_ids])

After rotary_table a decoder's graph looks rows up in a few tables before its first layer: the token embedding by
`input_ids` and, per rotary table, the cos / sin rows by `position_ids`. torch runs each `aten.embedding` as a
kernel of its own, one after the other, before anything else of the step can start (three kernels of 2.0-2.2 us
at qwen3-0.6b batch 1 on an H200, 1% of the step). `gather_rows` (ops/gather_rows.py) does them all in one
launch, bit-equal to the lookups.

Matches `aten.embedding(table, index)` where the table is a 2-D parameter or buffer (not complex: DeepSeek-V2's
complex rotary table stays) and the index a graph input, so that every lookup it merges can run where the first
of them stands. Lookups are merged in graph order, `gather_rows.MAX_TABLES` to a launch; a group of one is left as
it is. What it leaves: lookups by computed indices (a tensor-parallel vocabulary shard's masked ids), and tables
computed in the graph.

Runs in the lowering stage after rotary_table (which makes the position lookups; registered after it, so the
recommended pipeline runs it later in the stage). Default: on for CUDA targets, where the op's Triton kernel
replaces the lookups' launches; off elsewhere, where the op runs the same lookups one by one.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

import mini_infer.ops  # noqa: F401  (registers torch.ops.mini_infer)
from mini_infer.ops.gather_rows import MAX_TABLES
from mini_infer.passes.base import GraphPass, PassContext, PassResult
from mini_infer.passes.pattern import aten, is_op, val

ops = torch.ops.mini_infer


def _lookup(node: fx.Node, gm: fx.GraphModule) -> bool:
    """`node` is `aten.embedding(table, index)` of a 2-D real table held by the graph and a graph input index."""
    if not is_op(node, aten.embedding.default) or len(node.args) < 2:
        return False
    table, index = node.args[0], node.args[1]
    if not (isinstance(table, fx.Node) and table.op == "get_attr" and isinstance(index, fx.Node)
            and index.op == "placeholder"):
        return False
    t = PassContext.tensor_of(gm, table)
    return t.dim() == 2 and not t.is_complex() and isinstance(val(node), torch.Tensor)


class FuseLookups(GraphPass):
    """aten.embedding(get_attr, placeholder) x n ⇒ one gather_rows (up to MAX_TABLES lookups a launch)."""

    name = "fuse_lookups"
    stage = "lowering"

    @classmethod
    def default_for(cls, ctx: PassContext) -> GraphPass | None:
        # on CUDA only, where one Triton launch replaces the lookups' kernels; elsewhere the op runs them one by one
        return cls() if ctx.device.type == "cuda" else None

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        lookups = [n for n in gm.graph.nodes if _lookup(n, gm)]
        groups = [lookups[i:i + MAX_TABLES] for i in range(0, len(lookups), MAX_TABLES)]
        merged = [g for g in groups if len(g) > 1]
        for group in merged:
            self._merge(gm, group)
        if not merged:
            return PassResult(0, f"{len(lookups)} lookup, nothing to merge" if lookups else "")
        n = sum(len(g) for g in merged)
        return PassResult(n, f"{n} lookups in {len(merged)} launch{'es' if len(merged) > 1 else ''}")

    @staticmethod
    def _merge(gm: fx.GraphModule, group: list[fx.Node]) -> None:
        """One gather_rows where the group's first lookup stands; each lookup's users read its row of it."""
        graph = gm.graph
        with graph.inserting_before(group[0]):
            tables = []
            for node in group:  # fresh get_attrs: a table's own node may stand after the first lookup
                table = graph.get_attr(node.args[0].target)
                table.meta.update(node.args[0].meta)
                tables.append(table)
            fused = graph.call_function(ops.gather_rows.default, ([*tables], [n.args[1] for n in group]))
            fused.meta["val"] = [val(n) for n in group]
            for j, node in enumerate(group):
                row = graph.call_function(operator.getitem, (fused, j))
                row.meta.update(node.meta)
                node.replace_all_uses_with(row)
        for node in group:
            graph.erase_node(node)
