"""ShardTensorParallel: split the model's linears over `ctx.world_size` ranks (Megatron-style tensor parallelism),
following the config's `base_model_tp_plan` (transformers' plan, read by `mini_infer.models.tp_plan`).

For rank `ctx.rank`:
  * colwise linears (q/k/v, gate/up) keep their rows of the output: this rank's query heads, its KV heads (one
    replicated KV head per rank when there are fewer KV heads than ranks), its slice of the intermediate size;
  * rowwise linears (o_proj, down_proj) keep the matching columns of their input, and their partial sums are
    added over ranks by an all-reduce right after the GEMM (a bias is added once, after it);
  * lm_head is column-parallel over the vocabulary (padded to a multiple of the world size) and its selected
    logits rows are all-gathered, so every rank returns the full [1, rows, vocab]; the token embedding stays
    replicated (one full table per rank: simpler than a vocabulary-parallel lookup, which would need a mask
    and one more all-reduce);
  * the literal head counts in view/reshape/expand nodes between a colwise and a rowwise linear (HF's repeat_kv
    expands to [B, Hkv, n_rep, T, D] and reshapes to [B, H, T, D]) are rewritten to this rank's counts, so the
    attention pass later declares caches of this rank's KV heads.
Collectives are graph nodes (`torch.ops._c10d_functional.all_reduce` / `all_gather_into_tensor` + `wait_tensor`,
the ops behind `torch.distributed._functional_collectives`), so the graph stays one exportable, CUDA-graph
capturable callable, and an all-reduce followed by the residual add and RMSNorm still matches fuse_rmsnorm.
Each sharded weight is a new buffer on the weight's device (`PassContext.add_tensor`); the full originals lose
their last graph use and are dropped. A weight loaded as a shard placeholder (the loader of a tensor-parallel
rank leaves the whole tensor on the host: `mini_infer.models.loader.host_weight`) is sliced from its host tensor,
so only the rank's slice is ever copied to the device. The pass matches and rewrites only: which process group
runs the collectives is the runtime's (`mini_infer/runtime/distributed.py`); the graph names the default group.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from mini_infer.models.loader import host_weight
from mini_infer.models.tp_plan import KV_PROJECTIONS, TensorParallelPlan, tensor_parallel_plan
from mini_infer.passes.base import GraphPass, PassContext, PassResult
from mini_infer.passes.pattern import aten, is_op, lm_head_of, repeat_kv_source

c10d = torch.ops._c10d_functional
DEFAULT_GROUP_NAME = "0"  # torch.distributed's name for the default (WORLD) process group
_SHAPE_OPS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default)


def default_group_name(rank: int, world_size: int) -> str:
    """The name of the process group the collectives run in: the default group, checked against the ranks the
    graph is compiled for when one is initialized (without one the graph can be inspected, not run)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return DEFAULT_GROUP_NAME
    if (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
        raise ValueError(f"compiling rank {rank} of {world_size}, but this process is rank {dist.get_rank()} of "
                         f"a process group of {dist.get_world_size()}")
    return dist.group.WORLD.group_name


def _linear_parts(node: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node | None]:
    x, w = node.args[0], node.args[1]
    b = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    return x, w, b


def _module_path(weight: fx.Node) -> str:
    return str(weight.target).removesuffix(".weight")


class _Sharder:
    """One application of the pass: the plan, the rank, and the bookkeeping of what was split."""

    def __init__(self, gm: fx.GraphModule, ctx: PassContext, plan: TensorParallelPlan, group: str) -> None:
        self.gm, self.graph, self.ctx, self.plan, self.group = gm, gm.graph, ctx, plan, group
        self.rank, self.ws = ctx.rank, ctx.world_size
        self.region: dict[fx.Node, str] = {}  # node -> "q" / "kv" / "col": downstream of a colwise linear
        self.col_sizes: dict[int, int] = {}  # out features of non-attention colwise linears -> per rank
        self.counts = {"colwise": 0, "rowwise": 0, "views": 0}
        self.rewritten: set[fx.Node] = set()  # shape nodes already given this rank's sizes

    # -- weights ---------------------------------------------------------------------------------------------
    def _whole(self, node: fx.Node) -> tuple[torch.Tensor, torch.device]:
        """The whole weight `node` reads (its host tensor for a shard placeholder) and the device it runs on."""
        on_device = PassContext.tensor_of(self.gm, node)
        host = host_weight(on_device)
        return (on_device if host is None else host), on_device.device

    @staticmethod
    def _slice_to(value: torch.Tensor, device: torch.device, size: tuple[int, ...] | None = None) -> torch.Tensor:
        """A new tensor on `device` holding `value` (a slice of a whole weight) at its start, zero-padded to
        `size` when given."""
        out = torch.zeros(size, dtype=value.dtype, device=device) if size is not None else \
            torch.empty(value.shape, dtype=value.dtype, device=device)
        out[tuple(slice(0, n) for n in value.shape)].copy_(value)
        return out

    def _replace(self, node: fx.Node, old: fx.Node, value: torch.Tensor, tag: str) -> fx.Node:
        new = PassContext.add_tensor(self.gm, f"{_module_path(old)}_tp{self.rank}_{tag}", value, before=node)
        node.replace_input_with(old, new)
        return new

    def _rows(self, path: str, out: int) -> tuple[int, int, str]:
        """(first row, row count, region) of a colwise linear's output that this rank keeps."""
        p = self.plan
        last = path.rsplit(".", 1)[-1]
        if last in KV_PROJECTIONS:
            if out != p.num_kv_heads * p.head_dim:
                raise ValueError(f"{path}: {out} output features, expected num_key_value_heads x head_dim = "
                                 f"{p.num_kv_heads} x {p.head_dim}")
            return p.first_kv_head(self.rank) * p.head_dim, p.kv_heads_per_rank * p.head_dim, "kv"
        if out % self.ws:
            raise ValueError(f"{path}: tensor_parallel_size={self.ws} does not divide its {out} output features")
        region = "q" if last == "q_proj" else "col"
        if region == "q" and out != p.num_heads * p.head_dim:
            raise ValueError(f"{path}: {out} output features, expected num_attention_heads x head_dim = "
                             f"{p.num_heads} x {p.head_dim}")
        if region == "col":
            self.col_sizes[out] = out // self.ws
        return self.rank * (out // self.ws), out // self.ws, region

    def colwise(self, node: fx.Node) -> None:
        _, w, b = _linear_parts(node)
        weight, device = self._whole(w)
        start, n, region = self._rows(_module_path(w), weight.shape[0])
        with torch.no_grad():
            self._replace(node, w, self._slice_to(weight[start:start + n], device), "weight")
            if b is not None:
                self._replace(node, b, self._slice_to(self._whole(b)[0][start:start + n], device), "bias")
        self.region[node] = region
        self.counts["colwise"] += 1

    def rowwise(self, node: fx.Node) -> None:
        x, w, b = _linear_parts(node)
        weight, device = self._whole(w)
        cols = weight.shape[1]
        if cols % self.ws:
            raise ValueError(f"{_module_path(w)}: tensor_parallel_size={self.ws} does not divide its {cols} input "
                             "features")
        n = cols // self.ws
        with torch.no_grad():
            w_node = self._replace(node, w, self._slice_to(weight[:, self.rank * n:(self.rank + 1) * n], device),
                                   "weight")
        graph = self.graph
        with graph.inserting_before(node.next):
            out = self.all_reduce(graph.call_function(aten.linear.default, (x, w_node)))
            if b is not None:  # the bias once, after the sum
                out = graph.call_function(aten.add.Tensor, (out, b))
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        self.counts["rowwise"] += 1

    def lm_head(self, node: fx.Node) -> str:
        """Column-parallel over the (padded) vocabulary, then all-gather the rows into [1, R, vocab]; returns a
        note for the summary."""
        _, w, b = _linear_parts(node)
        p = self.plan
        weight, device = self._whole(w)
        vocab = weight.shape[0]
        per_rank = -(-vocab // self.ws)
        start, stop = self.rank * per_rank, max(self.rank * per_rank, min((self.rank + 1) * per_rank, vocab))
        with torch.no_grad():  # rows past the vocabulary are zeros (dropped after the gather)
            self._replace(node, w, self._slice_to(weight[start:stop], device, (per_rank, weight.shape[1])), "weight")
            if b is not None:
                self._replace(node, b, self._slice_to(self._whole(b)[0][start:stop], device, (per_rank,)), "bias")
        graph = self.graph
        users = list(node.users)
        with graph.inserting_before(node.next):  # in order after lm_head:
            gathered = graph.call_function(c10d.all_gather_into_tensor.default, (node, self.ws, self.group))
            waited = graph.call_function(c10d.wait_tensor.default, (gathered,))  # [N*1, R, V/N]
            rows = graph.call_function(aten.permute.default, (waited, [1, 0, 2]))  # [R, N, V/N]
            flat = graph.call_function(aten.flatten.using_ints, (rows, 1, 2))  # [R, V_pad]
            out = graph.call_function(aten.unsqueeze.default, (flat, 0))  # [1, R, V_pad]
            if per_rank * self.ws != vocab:
                out = graph.call_function(aten.slice.Tensor, (out, 2, 0, vocab))
        for user in users:
            user.replace_input_with(node, out)
        return f"lm_head vocab {vocab} -> {per_rank} per rank" + \
            (f" (padded to {per_rank * self.ws})" if per_rank * self.ws != vocab else "") + \
            f", embedding replicated; KV heads {p.kv_heads_per_rank} per rank" + \
            (" (replicated)" if p.kv_replicated else "")

    def all_reduce(self, x: fx.Node) -> fx.Node:
        """sum over ranks of `x` (inserted at the current insertion point)."""
        reduced = self.graph.call_function(c10d.all_reduce.default, (x, "sum", self.group))
        return self.graph.call_function(c10d.wait_tensor.default, (reduced,))

    # -- shapes ----------------------------------------------------------------------------------------------
    def tag_regions(self, stops: set[fx.Node]) -> None:
        """Tag every node downstream of a colwise linear (up to rowwise linears and lm_head) with its region:
        "q" when any input carries query heads (attention outputs do), else "kv", else "col"."""
        for node in self.graph.nodes:
            if node in self.region or node.op != "call_function" or node in stops:
                continue
            tags = {self.region.get(a) for a in node.all_input_nodes if a not in stops} - {None}
            if repeat_kv_source(node) is not None and "kv" in tags:
                tags = {"q"}  # the KV heads repeated to the query heads
            for tag in ("q", "kv", "col"):
                if tag in tags:
                    self.region[node] = tag
                    break

    def rewrite_shapes(self) -> None:
        """Literal sizes in view/reshape/expand nodes of the sharded regions → this rank's sizes."""
        p = self.plan
        hl, kvl, d = p.heads_per_rank, p.kv_heads_per_rank, p.head_dim
        for node in list(self.graph.nodes):
            if node in self.region and repeat_kv_source(node) is not None:
                self._rewrite_repeat_kv(node)
        maps = {"q": {p.num_heads: hl, p.num_heads * d: hl * d},
                "kv": {p.num_kv_heads: kvl, p.num_kv_heads * d: kvl * d}, "col": self.col_sizes}
        for node, tag in self.region.items():
            if not is_op(node, *_SHAPE_OPS) or node in self.rewritten:
                continue
            sizes = list(node.args[1])
            mapping = maps[tag]
            new = [mapping.get(s, s) if isinstance(s, int) else s for s in sizes]
            if new == sizes:
                continue
            if tag != "col" and any(isinstance(s, int) and s in mapping and s == d for s in sizes):
                raise ValueError(f"shard_tensor_parallel: cannot tell which size of {node.name} {sizes} counts heads "
                                 f"(head_dim {d} equals a head count)")
            node.args = (node.args[0], new, *node.args[2:])
            self.counts["views"] += 1

    def _rewrite_repeat_kv(self, reshape: fx.Node) -> None:
        p = self.plan
        expand = reshape.args[0]
        b, _, _, t, d = expand.args[1]
        hl, kvl = p.heads_per_rank, p.kv_heads_per_rank
        expand.args = (expand.args[0], [b, kvl, hl // kvl, t, d], *expand.args[2:])
        rb, _, rt, rd = reshape.args[1]
        reshape.args = (expand, [rb, hl, rt, rd], *reshape.args[2:])
        self.rewritten.update((expand, reshape))
        self.counts["views"] += 2


class ShardTensorParallel(GraphPass):
    """Column-/row-parallel linears per the config's tp plan, all-reduces after row-parallel ones, a
    vocabulary-parallel lm_head with an all-gather of its rows."""

    name = "shard_tensor_parallel"
    stage = "sharding"
    requires = ("cleanup",)

    def __init__(self, group_name: str | None = None) -> None:
        if group_name is not None and not isinstance(group_name, str):
            raise self.invalid("group_name", group_name, "must be a process group's name (str) or None")
        self.group_name = group_name

    @classmethod
    def default_for(cls, ctx: PassContext) -> GraphPass | None:
        return cls() if ctx.world_size > 1 else None

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        if ctx.world_size == 1:
            return PassResult(0, "world size 1: nothing to shard")
        if not 0 <= ctx.rank < ctx.world_size:
            raise ValueError(f"rank {ctx.rank} is not in [0, {ctx.world_size})")
        plan = tensor_parallel_plan(ctx.config, ctx.world_size)
        group = self.group_name or default_group_name(ctx.rank, ctx.world_size)
        sharder = _Sharder(gm, ctx, plan, group)
        head = lm_head_of(gm.graph.output_node().args[0])
        if head is None:
            raise ValueError("shard_tensor_parallel: could not find the lm_head linear feeding the output")
        rowwise = []
        for node in list(gm.graph.nodes):
            if node is head or not is_op(node, aten.linear.default):
                continue
            _, w, b = _linear_parts(node)
            if not (isinstance(w, fx.Node) and w.op == "get_attr") or (b is not None and b.op != "get_attr"):
                continue
            style = plan.style_of(_module_path(w))
            if style == "colwise":
                sharder.colwise(node)
            elif style == "rowwise":
                rowwise.append(node)
        if not sharder.counts["colwise"] or not rowwise:
            raise ValueError(f"shard_tensor_parallel: the tp plan {sorted(plan.styles)} matched "
                             f"{sharder.counts['colwise']} colwise and {len(rowwise)} rowwise linears of the graph")
        sharder.tag_regions(set(rowwise) | {head})
        unfed = [n.name for n in rowwise if n.args[0] not in sharder.region]
        if unfed:
            raise ValueError(f"shard_tensor_parallel: rowwise linears {unfed} do not read a colwise linear's output")
        sharder.rewrite_shapes()
        for node in rowwise:
            sharder.rowwise(node)
        head_note = sharder.lm_head(head)
        c = sharder.counts
        note = f"{c['colwise']} colwise, {c['rowwise']} rowwise (+all_reduce), {c['views']} shape args; {head_note}"
        return PassResult(c["colwise"] + c["rowwise"] + 1, note)


__all__ = ["ShardTensorParallel", "default_group_name"]
