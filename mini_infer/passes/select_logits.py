"""SelectLogits: run lm_head only on the rows the sampler needs.

The captured graph computes logits for every token of the packed row; a prefill of 1,000 tokens needs
only its last. This pass adds the graph input `logits_indices` ([R] int64, positions in the packed row; declared as
`LOGITS_INDICES`) and
gathers those hidden states before the final projection, so the graph returns [1, R, vocab]. Whatever
follows lm_head (scaling, softcapping) is per row and stays correct. It runs right after cleanup (stage
"cleanup"), so later passes (quantization, sharding, lowering) see the lm_head linear on the selected rows.
"""

from __future__ import annotations

import torch.fx as fx

from mini_infer.contract.inputs import LOGITS_INDICES
from mini_infer.passes.base import GraphPass, PassContext, PassResult
from mini_infer.passes.pattern import aten, is_op

_ELEMENTWISE = (aten.mul.Tensor, aten.div.Tensor, aten.tanh.default, aten.to.dtype, aten._to_copy.default,
                aten.add.Tensor, aten.mul.Scalar, aten.div.Scalar)


def find_lm_head(out: fx.Node) -> fx.Node | None:
    """The `linear` whose output reaches the graph output `out` through elementwise ops only (the lm_head)."""
    node = out
    while isinstance(node, fx.Node):
        if is_op(node, aten.linear.default):
            return node
        if not is_op(node, *_ELEMENTWISE):
            return None
        node = node.args[0]
    return None


class SelectLogits(GraphPass):
    """Gather the rows named by `logits_indices` before lm_head."""

    name = "select_logits"
    stage = "cleanup"
    requires = ("cleanup",)

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        graph = gm.graph
        out_node = graph.output_node()
        logits = out_node.args[0]
        head = find_lm_head(logits)
        if head is None:
            raise ValueError(f"select_logits: could not find the lm_head linear feeding the output {logits}")
        idx = ctx.add_input(gm, LOGITS_INDICES)
        with graph.inserting_before(head):
            picked = graph.call_function(aten.index_select.default, (head.args[0], 1, idx))
        head.replace_input_with(head.args[0], picked)
        return PassResult(1)
