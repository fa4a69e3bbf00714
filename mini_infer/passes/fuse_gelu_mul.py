"""FuseGeluMul: the GeLU-tanh gate `gelu(gate, approximate="tanh") * up` → `mini_infer.gelu_tanh_and_mul(gate, up)`.

transformers' `gelu_pytorch_tanh` MLPs (Gemma, Gemma 2, Gemma 3) capture as `aten.gelu(g, approximate='tanh')` then
`aten.mul` with the up projection, with no cast between them in any dtype (torch's gelu rounds its fp32 result to
the input's dtype itself; the op rounds the same way). Matches only an elementwise product of two same-shape
tensors where one side is such a gelu that nothing else reads; after merge_projections gate and up are the two
halves of the merged gate_up output, and the op takes them as they are (views with the merged row stride).

Must not match: plain (erf) GeLU (`approximate='none'`, HF's `gelu`: another function), SiLU (fuse_silu_mul's), a
gelu read by anything besides the product, or a product that broadcasts.
"""

from __future__ import annotations

import torch
import torch.fx as fx

import mini_infer.ops  # noqa: F401
from mini_infer.passes.base import GraphPass, PassContext, PassResult
from mini_infer.passes.fuse_silu_mul import fuse_gated_products
from mini_infer.passes.pattern import aten, is_op, kwarg_or_arg

ops = torch.ops.mini_infer


def _is_gelu_tanh(node: fx.Node) -> bool:
    """`aten.gelu(x, approximate='tanh')`, the approximation given positionally or by keyword."""
    return (is_op(node, aten.gelu.default) and set(node.kwargs) <= {"approximate"}
            and kwarg_or_arg(node, 1, "approximate", "none") == "tanh")


class FuseGeluMul(GraphPass):
    """mul(gelu(a, approximate='tanh'), b) → gelu_tanh_and_mul(a, b)."""

    name = "fuse_gelu_mul"
    stage = "fusion"
    requires = ("cleanup",)

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        return PassResult(fuse_gated_products(gm, _is_gelu_tanh, ops.gelu_tanh_and_mul.default))
