"""ShardTensorParallel: split the model's linears over `ctx.world_size` ranks (Megatron-style tensor parallelism),
following the config's `base_model_tp_plan` (transformers' plan, read by `mini_infer.models.tp_plan`).

For rank `ctx.rank`:
  * colwise linears (q/k/v, gate/up) keep their rows of the output: this rank's query heads, its KV heads (one
    replicated KV head per rank when there are fewer KV heads than ranks), its slice of the intermediate size;
  * rowwise linears (o_proj, down_proj) keep the matching columns of their input, and their partial sums are
    added over ranks by an all-reduce right after the GEMM (a bias is added once, after it);
  * mixture-of-experts blocks ("moe_tp_experts" in the plan: tensor parallelism inside the experts, as vLLM does
    by default): every rank keeps every expert, with its slice of the expert intermediate size: the stacked
    `experts.gate_up_proj` [E, 2I, H] ("packed_colwise") keeps rows r*I/N.. of the gate half and of the up half,
    `experts.down_proj` [E, H, I] ("rowwise") the matching columns. The router stays replicated, so every rank
    routes identically, and the experts module's output is this rank's share of the sum. When the block's output
    is a sum of such shares (routed experts + a sharded shared expert: adds, views, a product with a replicated
    gate), one all-reduce of the block's output serves them all; otherwise each share is all-reduced where it is
    computed (Qwen2-MoE, whose shared expert the plan leaves replicated). HF's experts code runs unchanged on the
    sliced weights (route_moe later replaces it by fused_moe over them);
  * with expert parallelism (`ctx.expert_parallel`, vLLM's `--enable-expert-parallel`) the same two stacked
    weights are split along the experts instead: rank r keeps experts r*E/N .. (r+1)*E/N - 1 whole
    (`tp_plan.local_experts`), everything else (router, shared experts, attention) as above, and the experts
    module's output is again this rank's share, all-reduced by the same rule. HF's experts code cannot run on a
    subset of the experts (it indexes them by the router's global ids), so this pass then applies route_moe's
    rewrite to those blocks itself: moe_topk (every rank routes identically) + fused_moe over the rank's experts
    with the map of global ids to them; the graph it leaves runs and gives the model's logits, and the route_moe
    pass later finds those blocks routed;
  * GPT-OSS, under this project's plan (`tp_plan.PROJECT_PLANS`): its experts store their weights transposed,
    `gate_up_proj` [E, H, 2I] with gate and up interleaved on the last dim and `down_proj` [E, I, H], with biases
    `gate_up_proj_bias` [E, 2I] and `down_proj_bias` [E, H]. "transposed_colwise" keeps the contiguous columns
    [2rI/N, 2(r+1)I/N) of gate_up_proj's last dim and of its bias (the rank's I/N gate/up pairs),
    "transposed_rowwise" the rows [rI/N, (r+1)I/N) of down_proj's dim 1, and "bias_once" keeps down_proj_bias on
    rank 0 and zeros on the others: GptOssExperts adds it to each (token, slot) row before the routing weight
    multiplies it, so it is part of the share, and the all-reduce of the shares adds it exactly once (as
    o_proj's bias is added once, after its all-reduce). With expert parallelism all four keep the rank's experts
    whole along dim 0 (each expert's biases with it: the rank that computes an expert's slots adds its down bias,
    and no other rank does). The per-head attention sinks ("query_heads", `self_attn.sinks` [Hq]) keep this rank's query heads;
  * lm_head is column-parallel over the vocabulary (padded to a multiple of the world size) and its selected
    logits rows are all-gathered, so every rank returns the full [1, rows, vocab]; the token embedding stays
    replicated (one full table per rank: simpler than a vocabulary-parallel lookup, which would need a mask
    and one more all-reduce);
  * the literal head counts in view/reshape/expand nodes between a colwise and a rowwise linear (HF's repeat_kv
    expands to [B, Hkv, n_rep, T, D] and reshapes to [B, H, T, D]) are rewritten to this rank's counts, so the
    attention pass later declares caches of this rank's KV heads.
Collectives are graph nodes (the all-reduces `mini_infer.all_reduce_sum`, whose body picks a one-shot all-reduce
over symmetric memory for small CUDA messages and torch.distributed otherwise; the all-gather
`torch.ops._c10d_functional.all_gather_into_tensor` + `wait_tensor`), so the graph stays one exportable, CUDA-graph
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

import mini_infer.ops.all_reduce  # noqa: F401  (registers torch.ops.mini_infer.all_reduce_sum)
from mini_infer.models.loader import host_weight
from mini_infer.models.tp_plan import (
    EXPERTS_STYLE,
    HEADS_STYLE,
    KV_PROJECTIONS,
    PARAMETER_STYLES,
    STACKED_STYLES,
    TensorParallelPlan,
    local_experts,
    tensor_parallel_plan,
)
from mini_infer.passes.base import GraphPass, PassContext, PassResult
from mini_infer.passes.pattern import aten, is_op, lm_head_of, module_chain, repeat_kv_source
from mini_infer.passes.route_moe import RouteMoe

c10d = torch.ops._c10d_functional
DEFAULT_GROUP_NAME = "0"  # torch.distributed's name for the default (WORLD) process group
_SHAPE_OPS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default)
# ops that keep a sum over ranks a sum over ranks: op(sum_r x_r) == sum_r op(x_r)
_SUM_PRESERVING = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default,
                   aten.squeeze.dim)


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


def _is_tensor(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


class _Sharder:
    """One application of the pass: the plan, the rank, and the bookkeeping of what was split."""

    def __init__(self, gm: fx.GraphModule, ctx: PassContext, plan: TensorParallelPlan, group: str) -> None:
        self.gm, self.graph, self.ctx, self.plan, self.group = gm, gm.graph, ctx, plan, group
        self.rank, self.ws = ctx.rank, ctx.world_size
        self.region: dict[fx.Node, str] = {}  # node -> "q" / "kv" / "col": downstream of a colwise linear
        self.col_sizes: dict[int, int] = {}  # out features of non-attention colwise linears -> per rank
        self.counts = {"colwise": 0, "rowwise": 0, "views": 0, "experts": 0, "expert_biases": 0, "heads": 0,
                       "all_reduce": 0}
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

    def rowwise(self, node: fx.Node) -> fx.Node | None:
        """Keep this rank's input columns of a row-parallel linear. With a bias, the output is all-reduced here and
        the bias added once after the sum (returns None); without one, returns the new linear, whose output is
        this rank's share of the sum for `reduce_shares` to all-reduce."""
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
            out = graph.call_function(aten.linear.default, (x, w_node))
            out.meta.update(node.meta)
            share = out
            if b is not None:  # the bias once, after the sum
                out = graph.call_function(aten.add.Tensor, (self.all_reduce(out), b))
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        self.counts["rowwise"] += 1
        return share if b is None else None

    # -- experts ---------------------------------------------------------------------------------------------
    def stacked_expert_weight(self, node: fx.Node, style: str) -> None:
        """A stacked experts parameter: packed_colwise [E, 2I, H] keeps rows r*I/N .. (r+1)*I/N - 1 of the gate
        half and of the up half; rowwise [E, H, I] keeps the matching columns of I. With expert parallelism,
        either keeps its experts r*E/N .. (r+1)*E/N - 1 whole."""
        weight, device = self._whole(node)
        path = str(node.target)
        if weight.dim() != 3:
            raise ValueError(f"{path}: {style} is supported on stacked expert weights [experts, out, in], this one "
                             f"is {tuple(weight.shape)}")
        if self.plan.expert_parallel:
            self._local_experts(node, path, weight, device)
            return
        size = weight.shape[1] if style == "packed_colwise" else weight.shape[2]
        parts = 2 if style == "packed_colwise" else 1
        if size % (parts * self.ws):
            raise ValueError(f"{path}: tensor_parallel_size={self.ws} does not divide its expert intermediate size "
                             f"{size // parts}")
        span, n = size // parts, size // (parts * self.ws)
        with torch.no_grad():
            if style == "packed_colwise":
                value = torch.cat([weight[:, h * span + self.rank * n:h * span + (self.rank + 1) * n]
                                   for h in range(parts)], dim=1)
            else:
                value = weight[:, :, self.rank * n:(self.rank + 1) * n]
            new = PassContext.add_tensor(self.gm, f"{path}_tp{self.rank}", self._slice_to(value, device), before=node)
        node.replace_all_uses_with(new)
        self.counts["experts"] += 1

    def transposed_expert_tensor(self, node: fx.Node, style: str) -> None:
        """A stacked experts tensor stored transposed (GPT-OSS): "transposed_colwise" keeps the contiguous 1/N of
        the last dim of a weight [E, in, out] or a bias [E, out] (whole gate/up pairs when they are interleaved
        there), "transposed_rowwise" the rows r*I/N .. (r+1)*I/N - 1 of dim 1 of a weight [E, I, out], and
        "bias_once" keeps a bias of a partial sum whole on rank 0 and zeros on the other ranks (the all-reduce of
        the shares adds it once). Under expert parallelism every one of these styles keeps this rank's experts
        whole instead (dim 0 of the weights and biases): each expert's bias, the down one too, then lives on the
        one rank that computes that expert's slots."""
        tensor, device = self._whole(node)
        path = str(node.target)
        if self.plan.expert_parallel and tensor.dim() == 2:
            self._local_experts(node, path, tensor, device, "expert_biases")
            return
        if self.plan.expert_parallel:
            self._local_experts(node, path, tensor, device)
            return
        if tensor.dim() not in ((3,) if style == "transposed_rowwise" else (2, 3)):
            raise ValueError(f"{path}: {style} is supported on stacked expert weights [experts, in, out] "
                             f"{'' if style == 'transposed_rowwise' else 'and biases [experts, out] '}"
                             f"only, this one is {tuple(tensor.shape)}")
        with torch.no_grad():
            if style == "bias_once":
                value = tensor if self.rank == 0 else torch.zeros(tensor.shape, dtype=tensor.dtype)
            else:
                dim = 1 if style == "transposed_rowwise" else tensor.dim() - 1
                size, parts = tensor.shape[dim], 1 if style == "transposed_rowwise" else 2  # gate/up pairs whole
                if size % (parts * self.ws):
                    raise ValueError(f"{path}: tensor_parallel_size={self.ws} does not divide its expert "
                                     f"intermediate size {size // parts}")
                n = size // self.ws
                value = tensor.narrow(dim, self.rank * n, n)
            new = PassContext.add_tensor(self.gm, f"{path}_tp{self.rank}", self._slice_to(value, device), before=node)
        node.replace_all_uses_with(new)
        self.counts["experts" if tensor.dim() == 3 else "expert_biases"] += 1

    def query_heads(self, node: fx.Node) -> None:
        """A per-query-head tensor [Hq] (GPT-OSS's attention sinks): this rank's heads r*Hq/N .. (r+1)*Hq/N - 1."""
        tensor, device = self._whole(node)
        p, path = self.plan, str(node.target)
        if tensor.dim() != 1 or tensor.shape[0] != p.num_heads:
            raise ValueError(f"{path}: {HEADS_STYLE} expects one value per query head [{p.num_heads}], this tensor "
                             f"is {tuple(tensor.shape)}")
        hl = p.heads_per_rank
        with torch.no_grad():
            value = self._slice_to(tensor[self.rank * hl:(self.rank + 1) * hl], device)
            new = PassContext.add_tensor(self.gm, f"{path}_tp{self.rank}", value, before=node)
        node.replace_all_uses_with(new)
        self.counts["heads"] += 1

    def _local_experts(self, node: fx.Node, path: str, weight: torch.Tensor, device: torch.device,
                       count_as: str = "experts") -> None:
        """Expert parallelism: this rank's experts of a stacked [E, ...] weight (or bias), whole."""
        if weight.shape[0] != self.plan.num_experts:
            raise ValueError(f"{path}: {weight.shape[0]} stacked experts, but the config routes to "
                             f"{self.plan.num_experts}")
        first, count = local_experts(self.plan.num_experts, self.rank, self.ws)
        with torch.no_grad():
            new = PassContext.add_tensor(self.gm, f"{path}_ep{self.rank}",
                                         self._slice_to(weight[first:first + count], device), before=node)
        node.replace_all_uses_with(new)
        self.counts[count_as] += 1

    def experts_outputs(self) -> dict[str, fx.Node]:
        """The output node of every "moe_tp_experts" module of the graph (the one value its nodes hand on), by
        module path; ValueError when a module has no single output."""
        groups: dict[str, set[fx.Node]] = {}
        for node in self.graph.nodes:
            path = next((p for p, _ in module_chain(node) if self.plan.style_of(p) == EXPERTS_STYLE), None)
            if path is not None:
                groups.setdefault(path, set()).add(node)
        outs = {}
        for path, inside in groups.items():
            found = [n for n in inside if _is_tensor(n) and any(u not in inside for u in n.users)]
            if len(found) != 1:
                raise ValueError(f"shard_tensor_parallel: the experts module {path} hands on {len(found)} tensors "
                                 f"({[n.name for n in found]}); expected its one output")
            outs[path] = found[0]
        return outs

    # -- all-reduces -----------------------------------------------------------------------------------------
    def reduce_shares(self, shares: list[fx.Node], experts_paths: list[str]) -> None:
        """All-reduce every share (a node holding this rank's part of a sum over ranks). The shares of one MoE
        block (the module holding an experts module) whose only way out is the block's output, through ops that
        keep a sum a sum, get one all-reduce of that output; every other share is all-reduced where it is."""
        blocks = sorted({p.rsplit(".", 1)[0] for p in experts_paths}, key=len, reverse=True)
        by_block: dict[str, list[fx.Node]] = {}
        for share in shares:
            paths = [p for p, _ in module_chain(share)]
            block = next((b for b in blocks if b in paths), None)
            by_block.setdefault(block, []).append(share)
        for block, members in by_block.items():
            out = None if block is None else self._sum_of_shares(block, members)
            for node in [out] if out is not None else members:
                self._all_reduce_after(node)

    def _sum_of_shares(self, block: str, shares: list[fx.Node]) -> fx.Node | None:
        """The block's output node when it is a sum over ranks of `shares` and nothing else reads them, else None."""
        inside = {n for n in self.graph.nodes if block in (p for p, _ in module_chain(n))}
        outs = [n for n in inside if _is_tensor(n) and any(u not in inside for u in n.users)]
        summed = set(shares)
        for node in self.graph.nodes:  # in order: what the shares flow into, inside the block
            if node in summed or node not in inside or not any(a in summed for a in node.all_input_nodes):
                continue
            a, b = (isinstance(x, fx.Node) and x in summed for x in (node.args + (None, None))[:2])
            if node.kwargs:
                return None
            if is_op(node, aten.add.Tensor) and a and b:
                summed.add(node)
            elif is_op(node, aten.mul.Tensor) and a != b and not any(x in self.region for x in node.all_input_nodes):
                summed.add(node)  # a share times a replicated factor (Qwen2-MoE's shared-expert gate)
            elif is_op(node, *_SUM_PRESERVING) and a and not b:
                summed.add(node)
            else:
                return None
        if len(outs) != 1 or outs[0] not in summed:
            return None
        out = outs[0]  # and no share but through it leaves the block
        return out if all(u in summed for n in summed - {out} for u in n.users) else None

    def _all_reduce_after(self, node: fx.Node) -> None:
        users = list(node.users)
        with self.graph.inserting_before(node.next):
            out = self.all_reduce(node)
        for user in users:
            user.replace_input_with(node, out)

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
        """sum over ranks of `x` (inserted at the current insertion point): one `mini_infer.all_reduce_sum` node,
        which picks one-shot over symmetric memory or torch.distributed when it runs (ops/all_reduce.py)."""
        self.counts["all_reduce"] += 1
        return self.graph.call_function(torch.ops.mini_infer.all_reduce_sum.default, (x, self.group))

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
            # where head_dim equals a head count, the last size is the head dim (attention's views end in it:
            # [b, s, -1, D], [b, H, s, D]) and any other is the heads'
            last = len(sizes) - 1
            new = [mapping[s] if isinstance(s, int) and s in mapping and not (tag != "col" and s == d and i == last)
                   else s for i, s in enumerate(sizes)]
            if new == sizes:
                continue
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
        plan = tensor_parallel_plan(ctx.config, ctx.world_size, ctx.expert_parallel)
        group = self.group_name or default_group_name(ctx.rank, ctx.world_size)
        sharder = _Sharder(gm, ctx, plan, group)
        head = lm_head_of(gm.graph.output_node().args[0])
        if head is None:
            raise ValueError("shard_tensor_parallel: could not find the lm_head linear feeding the output")
        experts = sharder.experts_outputs()
        rowwise = []
        for node in list(gm.graph.nodes):
            tensor_style = plan.style_of(str(node.target)) if node.op == "get_attr" else None
            if tensor_style == HEADS_STYLE:
                sharder.query_heads(node)
                continue
            if tensor_style in PARAMETER_STYLES:
                self._check_inside_experts(node, experts)
                if tensor_style in STACKED_STYLES:
                    sharder.stacked_expert_weight(node, tensor_style)
                else:
                    sharder.transposed_expert_tensor(node, tensor_style)
                continue
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
            elif style is not None:
                raise ValueError(f"shard_tensor_parallel: {_module_path(w)} is a linear with tp style {style!r}, which "
                                 "this pass implements on stacked expert weights only")
        if not sharder.counts["colwise"] or not rowwise:
            raise ValueError(f"shard_tensor_parallel: the tp plan {sorted(plan.styles)} matched "
                             f"{sharder.counts['colwise']} colwise and {len(rowwise)} rowwise linears of the graph")
        if experts and sharder.counts["experts"] != 2 * len(experts):
            raise ValueError(f"shard_tensor_parallel: {len(experts)} experts modules but {sharder.counts['experts']} "
                             "stacked expert weights split (expected a gate_up_proj and a down_proj each)")
        sharder.tag_regions(set(rowwise) | {head})
        unfed = [n.name for n in rowwise if n.args[0] not in sharder.region]
        if unfed:
            raise ValueError(f"shard_tensor_parallel: rowwise linears {unfed} do not read a colwise linear's output")
        sharder.rewrite_shapes()
        shares = [share for node in rowwise if (share := sharder.rowwise(node)) is not None]
        sharder.reduce_shares(shares + list(experts.values()), list(experts))
        routed = ""
        if plan.expert_parallel and experts:  # HF's experts code cannot run on this rank's subset of the experts
            routed = f"; {RouteMoe().apply(gm, ctx).num_matches} MoE blocks routed over this rank's experts"
        head_note = sharder.lm_head(head)
        c = sharder.counts
        biases = f", {c['expert_biases']} expert biases" if c["expert_biases"] else ""
        moe = f", {len(experts)} MoE experts modules ({c['experts']} stacked weights{biases}" \
              f"{self._split(plan, ctx)})" if experts else ""
        heads = f", {c['heads']} per-head tensors" if c["heads"] else ""
        note = (f"{c['colwise']} colwise, {c['rowwise']} rowwise{moe}{heads}, {c['all_reduce']} all_reduce, {c['views']} "
                f"shape args{routed}; {head_note}")
        return PassResult(c["colwise"] + c["rowwise"] + c["experts"] + c["expert_biases"] + c["heads"] + 1, note)

    @staticmethod
    def _split(plan: TensorParallelPlan, ctx: PassContext) -> str:
        """How the stacked expert weights were split, for the summary."""
        if not plan.expert_parallel:
            return ", each expert's intermediate size split"
        first, count = local_experts(plan.num_experts, ctx.rank, ctx.world_size)
        return f", expert parallel: experts {first}..{first + count - 1} of {plan.num_experts} on this rank"

    @staticmethod
    def _check_inside_experts(weight: fx.Node, experts: dict[str, fx.Node]) -> None:
        """A stacked expert weight must be read only inside a "moe_tp_experts" module (whose output is then
        all-reduced); ValueError naming it otherwise."""
        for user in weight.users:
            if not any(p in experts for p, _ in module_chain(user)):
                raise ValueError(f"shard_tensor_parallel: {weight.target} is split by the tp plan but read by "
                                 f"{user.name} outside a moe_tp_experts module, whose output would not be summed "
                                 "over ranks")

__all__ = ["ShardTensorParallel", "default_group_name"]
