"""FuseMlpPersistent: a dense layer's whole gated MLP, as the CUDA pipeline lowers it, → one persistent op.

    gu = rms_norm_linear(x, nw, eps, W_gu, b_gu);  g, u = split_with_sizes(gu, [I, I], -1)
    y = linear_add(silu_and_mul(g, u), W_d, b_d, r)         → y = mlp_persistent(x, nw, eps, W_gu, b_gu, W_d, b_d, r)

That chain is every down_proj but the last of a dense decoder after fuse_residual_gemvs (the post-attention norm in
the merged gate_up GEMV's prologue, the residual add in the down GEMV's epilogue); at batch-1 decode it is three
launches, each GEMV losing ~2-3 us to ramp and tail on an H200. The op (ops/mlp_persistent.py) runs it as one
persistent launch with a grid barrier between the gate_up and down phases, with the chain's roundings; several rows
run the unfused kernels, and the CPU reference is the unfused references (issue #14's "megakernel" experiment).

Runs in the lowering stage after fuse_residual_gemvs (whose rms_norm_linear and linear_add it matches), and so after
merge_projections (the merged gate_up and its split) and fuse_silu_mul (the activation). It leaves alone: any link
of the chain with another reader (the gate_up output, the split, a half, the activation), halves not read as
(gate, up) = (first, second), a last layer's down_proj (fuse_gemv_norm's linear_add_rms_norm), an MLP already taken
by fuse_silu_gemv (no silu_and_mul left), and the quantized paths (no `mini_infer.linear` family ops there).

Opt-in (named in `passes=[...]` / `--passes`): not measured on a GPU yet; bench/kernel_mlp_persistent.py times the
op against the three kernels, `bench/latency.py --with fuse_mlp_persistent` the engine with and without it.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

import mini_infer.ops  # noqa: F401  (registers torch.ops.mini_infer)
from mini_infer.passes.base import GraphPass, PassContext, PassResult, replace_with_call
from mini_infer.passes.pattern import aten, is_last_dim, is_op, ndim, only_user, shape

ops = torch.ops.mini_infer


def _halves(act: fx.Node) -> fx.Node | None:
    """The rms_norm_linear whose output `act` (a silu_and_mul) reads as (first half, second half) of one split in
    two equal parts along the last dim, when no other node reads any link of that; else None."""
    if len(act.args) != 2 or act.kwargs:
        return None
    gate, up = act.args
    if gate is up or not all(is_op(h, operator.getitem) and only_user(h, act) for h in (gate, up)):
        return None
    split = gate.args[0]
    if up.args[0] is not split or (gate.args[1], up.args[1]) != (0, 1) or len(split.users) != 2:
        return None
    if not is_op(split, aten.split_with_sizes.default) or len(split.args) != 3 or split.kwargs:
        return None
    gate_up, sizes, dim = split.args
    if len(sizes) != 2 or sizes[0] != sizes[1] or not is_last_dim(dim, ndim(gate_up)):
        return None
    if not is_op(gate_up, ops.rms_norm_linear.default) or len(gate_up.args) != 5 or gate_up.kwargs:
        return None
    return gate_up if only_user(gate_up, split) else None


class FuseMlpPersistent(GraphPass):
    """rms_norm_linear → split → silu_and_mul → linear_add ⇒ mlp_persistent."""

    name = "fuse_mlp_persistent"
    stage = "lowering"
    requires = ("merge_projections", "fuse_silu_mul", "fuse_residual_gemvs")

    @classmethod
    def default_for(cls, ctx: PassContext) -> GraphPass | None:
        return None  # opt-in: an experiment not measured yet (module docstring)

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        graph = gm.graph
        n = 0
        for down in list(graph.nodes):
            if not is_op(down, ops.linear_add.default) or len(down.args) != 4 or down.kwargs:
                continue
            act, w_d, b_d, residual = down.args
            if not is_op(act, ops.silu_and_mul.default) or not only_user(act, down) or act in down.args[1:]:
                continue
            if (gate_up := _halves(act)) is None or shape(act) is None or shape(w_d) is None \
                    or str(shape(act)[-1]) != str(shape(w_d)[-1]):
                continue
            split = act.args[0].args[0]
            replace_with_call(gm, down, ops.mlp_persistent.default, (*gate_up.args, w_d, b_d, residual))
            for dead in (down, act, *act.args, split, gate_up):
                graph.erase_node(dead)
            n += 1
        return PassResult(n, f"{n} MLP blocks" if n else "")
