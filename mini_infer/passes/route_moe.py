"""RouteMoe: Hugging Face mixture-of-experts blocks → `mini_infer.moe_topk` + `mini_infer.fused_moe`.

transformers 5.x runs a MoE block as: router (a linear to per-expert logits, softmax or sigmoid, top-k, HF's
normalization) → experts module (the (token, slot) pairs sorted by expert, `grouped_mm` over the stacked weights,
or a batched / per-expert loop, depending on `config._experts_implementation`) → plus, in some families, shared
experts. The experts part sorts, histograms and gathers on data-dependent indices: slow, and not CUDA-graph safe.

Per block, found by `node.meta["nn_module_stack"]` (the block, its router and its experts module by class):
  * the router's logits stay (the router linear is an ordinary graph node: later passes may merge or rewrite it);
    what follows them (softmax/sigmoid, top-k, HF's normalization and scaling) is replaced by `moe_topk` with the
    family's rules read from the config (table below), cross-checked against the graph: the scoring op found in
    the router, a top-k of `num_experts_per_tok`, DeepSeek-V3's `e_score_correction_bias` added to the scores;
  * the experts module's output is replaced by `fused_moe(hidden, weights, ids, w13, w2)` where w13 / w2 are HF's
    `experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` [E, H, I] (I / N on each of N tensor-parallel ranks,
    as shard_tensor_parallel left them: fused_moe's output is then the rank's share, all-reduced after it). With
    expert parallelism (`ctx.expert_parallel`) shard_tensor_parallel left each rank E / N whole experts
    [E/N, 2I, H] (`tp_plan.local_experts`), and fused_moe also gets `expert_map` [E] (the local index of each
    global expert, -1 for another rank's: one int32 buffer per graph, shared by every block), so the rank
    computes only its experts' slots and its output is again its share. shard_tensor_parallel applies this
    rewrite itself then (HF's experts code cannot run on a subset of the experts), and this pass leaves the
    blocks it finds routed already (a fused_moe among their nodes). transformers 5.x already stores every
    family's experts stacked this way (checkpoints with per-expert tensors are stacked by its loader), so they
    are taken as they are; a non-contiguous one is copied once into a contiguous buffer that replaces it. Either
    way the graph holds one copy of each expert weight;
  * GPT-OSS (`GptOssMLP`) differs in three ways, each checked against the graph: its router linear has a bias
    (it stays in the logits moe_topk reads) and ranks the logits before the softmax, which then runs over the k
    top values (the same routing as Mixtral's softmax renormalized over the top k, up to fp32 rounding: moe_topk's
    docstring); its experts store `gate_up_proj` [E, H, 2I] transposed with gate and up interleaved on the last
    dim (gate = [..., ::2], up = [..., 1::2]) and `down_proj` [E, I, H], with biases `gate_up_proj_bias` [E, 2I]
    (added to the gate/up GEMM's output) and `down_proj_bias` [E, H] (added to the down GEMM's output before the
    routing weight multiplies it); and their activation is a clamped SwiGLU (gate <= swiglu_limit, up in
    [-swiglu_limit, swiglu_limit], (up + 1) * gate * sigmoid(swiglu_alpha * gate), with the config's constants).
    The pass re-lays the four tensors once into fused_moe's layout (w13 [E, 2I, H] = the de-interleaved gate rows
    over the up rows, w2 [E, H, I], w13_bias [E, 2I] = gate | up; down_proj_bias as it is when contiguous): new
    buffers (`PassContext.add_tensor`) that replace HF's in the graph, whose originals then have no graph use and
    are dropped from the graph module by the pass manager (freed once the HF model is released, as every replaced
    weight is; until then both copies are alive). fused_moe then runs with activation="swigluoai" and the biases.
    Under tensor parallelism shard_tensor_parallel (this project's GPT-OSS plan, `tp_plan.PROJECT_PLANS`) has
    left each rank the contiguous columns [2rI/N, 2(r+1)I/N) of gate_up_proj and its bias (whole gate/up pairs),
    rows [rI/N, (r+1)I/N) of down_proj, and down_proj_bias on rank 0 only (zeros elsewhere: added once by the
    all-reduce); the re-lay is the same on those I/N slices. With expert parallelism each rank holds its experts
    whole (biases included) and fused_moe gets the expert map, as for the other families;
  * shared experts (Qwen2-MoE's `shared_expert` with its sigmoid `shared_expert_gate`, DeepSeek's
    `shared_experts`) and dense layers (DeepSeek's `first_k_dense_replace`, Qwen2-MoE's `mlp_only_layers`) are
    left as ordinary graph nodes, which merge_projections and fuse_silu_mul (after this pass) then fuse.

| block (router)                               | scoring | renormalize    | groups              | bias | scaling |
|----------------------------------------------|---------|----------------|---------------------|------|---------|
| MixtralSparseMoeBlock (MixtralTopKRouter)    | softmax | yes            | -                   | -    | -       |
| Qwen2MoeSparseMoeBlock, Qwen3MoeSparseMoeBlock | softmax | norm_topk_prob | -                 | -    | -       |
| DeepseekV2Moe (DeepseekV2TopkRouter)         | softmax | no (as HF)     | group_limited_greedy| -    | yes     |
| DeepseekV3MoE (DeepseekV3TopkRouter)         | sigmoid | norm_topk_prob | n_group / topk_group| yes  | yes     |
| GptOssMLP (GptOssTopKRouter: top-k first)    | softmax | yes            | -                   | -    | -       |

("bias": DeepSeek-V3's e_score_correction_bias; GPT-OSS's router bias is its linear's, inside the logits.) The
experts: silu gates over HF's stacked weights taken as they are for all but GptOssMLP (GptOssExperts: clamped
SwiGLU, expert biases, weights re-laid at compile time; above).

Qwen's and GPT-OSS's routers round the routing weights to the logits' dtype (bf16 in a bf16 model): so does the
rewrite, through moe_topk's `weights_dtype` (the kernel stores them rounded: no cast kernel of its own).

Refused with a ValueError naming the field or module (never a wrong answer): a MoE-like module this pass does not
know (a class named *Moe / *MoE / *MoeBlock / *Experts / *Router, or a top-k / grouped-mm op outside a known
block), `num_experts_per_tok` outside [1, number of experts], a DeepSeek `topk_method` or `scoring_func` other
than HF's, groups that do not divide the experts, an activation other than silu (GPT-OSS: SwiGLU constants that
are not finite, or a limit <= 0), a known block whose router or
experts do not look as expected (other scoring op, no top-k of top_k, a softmax before GPT-OSS's top-k or after
another family's, no GPT-OSS router bias, expert biases outside GPT-OSS or not where GPT-OSS adds them, another
activation than the family's or other SwiGLU constants than the config's, weights of other shapes or dtypes).
The config checks also run before capture (`check_context`). This module matches and rewrites only: the
math is `mini_infer/ops/moe_topk.py`'s and `mini_infer/ops/fused_moe.py`'s.
"""

from __future__ import annotations

import math
import operator
import re
from collections import Counter
from dataclasses import dataclass

import torch
import torch.fx as fx

import mini_infer.ops  # noqa: F401
from mini_infer.models.tp_plan import local_experts, num_routed_experts
from mini_infer.ops._moe_gemv import SWIGLU_ALPHA, SWIGLU_LIMIT
from mini_infer.ops.moe_topk import check_moe_topk_args
from mini_infer.passes.base import GraphPass, PassContext, PassResult, erase_dead
from mini_infer.passes.pattern import aten, dtype, is_op, module_chain, same_shape, shape

ops = torch.ops.mini_infer

_CASTS = (aten.to.dtype, aten.to.dtype_layout, aten._to_copy.default)
_SOFTMAX = (aten.softmax.int, aten._softmax.default)
# class names of modules that belong to some MoE block (used to refuse blocks this pass does not know)
_MOE_LIKE = re.compile(r"(Moe|MoE|MoeBlock|Experts|Router)$")
# ops that only a MoE block's routing or experts run in a causal LM's forward
_MOE_OPS = (aten.topk.default, aten.histc.default)


@dataclass(frozen=True)
class MoeFamily:
    """How one transformers MoE block is built and routed."""

    block: str  # class of the MoE block
    router: str  # class of its router
    experts: str  # class of its experts module
    model_type: str
    experts_field: str  # config field holding the number of routed experts
    inter_field: str  # config field holding one expert's intermediate size
    scoring: str  # "softmax" or "sigmoid"
    weights_in_logits_dtype: bool  # HF rounds the routing weights to the logits' dtype (Qwen, GPT-OSS)
    # GPT-OSS: the router ranks its logits, then softmaxes the k top values (others score all, then rank)
    topk_first: bool = False
    # "stacked": gate_up_proj [E, 2I, H] (gate rows over up rows), down_proj [E, H, I], no biases, silu gates
    # (config.hidden_act); "gpt_oss": gate_up_proj [E, H, 2I] (gate / up interleaved), down_proj [E, I, H], their
    # biases [E, 2I] / [E, H], clamped SwiGLU (config.swiglu_alpha / swiglu_limit), re-laid by the pass
    experts_layout: str = "stacked"


FAMILIES = {f.block: f for f in (
    MoeFamily("MixtralSparseMoeBlock", "MixtralTopKRouter", "MixtralExperts", "mixtral", "num_local_experts",
              "intermediate_size", "softmax", False),
    MoeFamily("Qwen2MoeSparseMoeBlock", "Qwen2MoeTopKRouter", "Qwen2MoeExperts", "qwen2_moe", "num_experts",
              "moe_intermediate_size", "softmax", True),
    MoeFamily("Qwen3MoeSparseMoeBlock", "Qwen3MoeTopKRouter", "Qwen3MoeExperts", "qwen3_moe", "num_experts",
              "moe_intermediate_size", "softmax", True),
    MoeFamily("DeepseekV2Moe", "DeepseekV2TopkRouter", "DeepseekV2Experts", "deepseek_v2", "n_routed_experts",
              "moe_intermediate_size", "softmax", False),
    MoeFamily("DeepseekV3MoE", "DeepseekV3TopkRouter", "DeepseekV3Experts", "deepseek_v3", "n_routed_experts",
              "moe_intermediate_size", "sigmoid", False),
    MoeFamily("GptOssMLP", "GptOssTopKRouter", "GptOssExperts", "gpt_oss", "num_local_experts", "intermediate_size",
              "softmax", True, topk_first=True, experts_layout="gpt_oss"),
)}
_BY_MODEL_TYPE = {f.model_type: f for f in FAMILIES.values()}
DEEPSEEK_V2_TOPK_METHODS = ("greedy", "group_limited_greedy")


@dataclass(frozen=True)
class Routing:
    """moe_topk's arguments for one model."""

    num_experts: int
    top_k: int
    scoring: str
    renormalize: bool
    scale: float
    n_group: int = 1
    topk_group: int = 1

    def describe(self) -> str:
        parts = [f"{self.num_experts} experts, top-{self.top_k} {self.scoring}"]
        if self.n_group > 1:
            parts.append(f"{self.topk_group} of {self.n_group} groups")
        if self.renormalize:
            parts.append("renormalized")
        if self.scale != 1.0:
            parts.append(f"x{self.scale:g}")
        return ", ".join(parts)


def is_moe_config(config) -> bool:
    """True for configs with routed experts (any family: the pass then refuses the ones it does not know)."""
    return num_routed_experts(config) is not None


def _positive_int(config, field: str) -> int:
    v = getattr(config, field, None)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"route_moe: config.{field}={v!r}; expected a positive int")
    return v


@dataclass(frozen=True)
class Activation:
    """fused_moe's activation arguments for one model."""

    name: str  # "silu" or "swigluoai"
    alpha: float = SWIGLU_ALPHA  # SwiGLU constants (read by fused_moe only with "swigluoai")
    limit: float = SWIGLU_LIMIT


def activation_for(config, family: MoeFamily) -> Activation:
    """The experts' activation with this config's values; ValueError naming the field fused_moe cannot serve."""
    if family.experts_layout != "gpt_oss":
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"route_moe: config.hidden_act={act!r} is not supported (fused_moe implements silu)")
        return Activation("silu")
    values = {}
    # HF's GptOssExperts reads both from the config; transformers 5.17 has neither field and hard-codes these
    # defaults in the module. Either way _check_swiglu finds the same constants in the graph, or refuses.
    for field, default in (("swiglu_alpha", SWIGLU_ALPHA), ("swiglu_limit", SWIGLU_LIMIT)):
        v = getattr(config, field, default)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            raise ValueError(f"route_moe: config.{field}={v!r}; expected a finite float")
        values[field] = float(v)
    if values["swiglu_limit"] <= 0:
        raise ValueError(f"route_moe: config.swiglu_limit={values['swiglu_limit']!r}; expected > 0")
    return Activation("swigluoai", values["swiglu_alpha"], values["swiglu_limit"])


def routing_for(config, family: MoeFamily) -> Routing:
    """The family's routing rules with this config's values; ValueError naming the field this pass (and HF's
    router) cannot serve."""
    activation_for(config, family)
    num_experts = _positive_int(config, family.experts_field)
    top_k = getattr(config, "num_experts_per_tok", None)
    if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
        raise ValueError(f"route_moe: config.num_experts_per_tok={top_k!r} must be in [1, "
                         f"config.{family.experts_field}={num_experts}]")
    scoring_func = getattr(config, "scoring_func", None)
    if scoring_func is not None and scoring_func != family.scoring:
        raise ValueError(f"route_moe: config.scoring_func={scoring_func!r} is not {family.model_type}'s scoring "
                         f"({family.scoring!r}, what {family.router} computes)")
    n_group, topk_group, renormalize, scale = 1, 1, True, 1.0
    if family.model_type in ("qwen2_moe", "qwen3_moe"):
        renormalize = bool(getattr(config, "norm_topk_prob", False))
    elif family.model_type == "deepseek_v2":
        method = getattr(config, "topk_method", "greedy")
        if method not in DEEPSEEK_V2_TOPK_METHODS:
            raise ValueError(f"route_moe: config.topk_method={method!r} is not supported (DeepSeek-V2 routings: "
                             f"{', '.join(DEEPSEEK_V2_TOPK_METHODS)})")
        if method == "group_limited_greedy":
            n_group, topk_group = _positive_int(config, "n_group"), _positive_int(config, "topk_group")
        renormalize, scale = False, float(config.routed_scaling_factor)  # HF's V2 router never renormalizes
    elif family.model_type == "deepseek_v3":
        method = getattr(config, "topk_method", None)
        if method is not None and method != "noaux_tc":
            raise ValueError(f"route_moe: config.topk_method={method!r} is not supported (DeepSeek-V3 routes "
                             "by 'noaux_tc')")
        n_group, topk_group = _positive_int(config, "n_group"), _positive_int(config, "topk_group")
        renormalize, scale = bool(config.norm_topk_prob), float(config.routed_scaling_factor)
    bias = torch.empty(num_experts, device="meta") if family.scoring == "sigmoid" else None
    try:
        check_moe_topk_args(num_experts, top_k, family.scoring, n_group, topk_group, bias)
    except ValueError as exc:
        raise ValueError(f"route_moe: config ({family.experts_field}={num_experts}, num_experts_per_tok={top_k}, "
                         f"n_group={n_group}, topk_group={topk_group}): {exc}") from exc
    return Routing(num_experts, top_k, family.scoring, renormalize, scale, n_group, topk_group)


# -- matching -----------------------------------------------------------------------------------------------


def _uncast(node):
    while is_op(node, *_CASTS):
        node = node.args[0]
    return node


def _unmasked(node):
    """x when `node` is `x.masked_fill(mask, 0)`: transformers 5.17's grouped-mm path zeroes the rows of slots
    whose expert is out of range (none on one rank: the router's ids are all < E) after each bias add."""
    while is_op(node, aten.masked_fill.Scalar) and node.args[2] == 0:
        node = _uncast(node.args[0])
    return node


def _is_tensor(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


@dataclass
class _Block:
    """One MoE block and the nodes the rewrite connects."""

    path: str
    family: MoeFamily
    routing: Routing
    nodes: set[fx.Node]  # the router's and the experts module's nodes (erased once dead)
    logits: fx.Node  # the router's logits [T, E]
    bias: fx.Node | None  # DeepSeek-V3's e_score_correction_bias [E]
    hidden: fx.Node  # the experts module's input [T, H]
    w13: fx.Node  # get_attr of gate_up_proj [E, 2I, H] (GPT-OSS: [E, H, 2I] interleaved, until re-laid)
    w2: fx.Node  # get_attr of down_proj [E, H, I] (GPT-OSS: [E, I, H], until re-laid)
    output: fx.Node  # the experts module's output [T, H]
    experts: tuple[int, int]  # (first, count) of the routed experts w13 / w2 hold: all but under expert parallelism
    activation: Activation
    b13: fx.Node | None = None  # GPT-OSS: get_attr of gate_up_proj_bias [E, 2I] (interleaved, until re-laid)
    b2: fx.Node | None = None  # GPT-OSS: get_attr of down_proj_bias [E, H]


def _group_by_block(gm: fx.GraphModule) -> dict[str, tuple[MoeFamily, list[fx.Node]]]:
    """Nodes of each known MoE block, by block path; ValueError naming a MoE-like module this pass does not know."""
    blocks: dict[str, tuple[MoeFamily, list[fx.Node]]] = {}
    for node in gm.graph.nodes:
        chain = module_chain(node)
        known = next(((path, cls) for path, cls in chain if cls in FAMILIES), None)
        if known is not None:
            blocks.setdefault(known[0], (FAMILIES[known[1]], []))[1].append(node)
            continue
        unknown = next(((path, cls) for path, cls in reversed(chain) if _MOE_LIKE.search(cls)), None)
        if unknown is None and (is_op(node, *_MOE_OPS) or "grouped_mm" in str(node.target)):
            unknown = chain[-1] if chain else ("<top level>", "?")
        if unknown is not None:
            raise ValueError(f"route_moe: {unknown[0]} ({unknown[1]}) is not a MoE block this pass recognizes "
                             f"(known: {', '.join(FAMILIES)}); node {node.name} ({node.target})")
    return blocks


def _in_module(node: fx.Node, block_path: str, cls: str) -> bool:
    return any(c == cls and p.startswith(block_path + ".") for p, c in module_chain(node))


def _match_block(gm: fx.GraphModule, config, path: str, family: MoeFamily, nodes: list[fx.Node],
                 ctx: PassContext) -> _Block:
    """Find the logits, the experts' input, weights and output of one block; ValueError naming the block when its
    router or experts are not HF's. With `ctx.world_size` ranks the expert weights hold this rank's share of the
    intermediate size, or with `ctx.expert_parallel` its experts whole (shard_tensor_parallel split them)."""
    where = f"{path} ({family.block})"
    routing = routing_for(config, family)
    activation = activation_for(config, family)
    h, inter = _positive_int(config, "hidden_size"), _positive_int(config, family.inter_field)
    held = (0, routing.num_experts)
    if ctx.world_size > 1 and ctx.expert_parallel:
        held = local_experts(routing.num_experts, ctx.rank, ctx.world_size)
    else:
        inter //= ctx.world_size
    e = held[1]
    router = [n for n in nodes if _in_module(n, path, family.router)]
    experts = [n for n in nodes if _in_module(n, path, family.experts)]
    if not router or not experts:
        raise ValueError(f"{where}: no {family.router if not router else family.experts} nodes in the graph")
    # the router: logits -> softmax / sigmoid -> ... -> top-k (GPT-OSS: logits -> top-k -> softmax of the values)
    scoring = next((n for n in router if is_op(n, *_SOFTMAX, aten.sigmoid.default)), None)
    found = None if scoring is None else "sigmoid" if is_op(scoring, aten.sigmoid.default) else "softmax"
    if found != routing.scoring:
        raise ValueError(f"{where}: the router computes {found or 'neither softmax nor sigmoid'}; "
                         f"{family.model_type} routing is {routing.scoring}")
    ks = sorted({n.args[1] for n in router if is_op(n, aten.topk.default)})
    if routing.top_k not in ks:
        raise ValueError(f"{where}: the router takes top-{ks} experts, not num_experts_per_tok={routing.top_k}")
    logits = _router_logits(where, family, routing, router, scoring)
    ls = shape(logits)
    if ls is None or len(ls) != 2 or ls[1] != routing.num_experts:
        raise ValueError(f"{where}: router logits {ls} are not [T, {family.experts_field}={routing.num_experts}]")
    bias = None
    if routing.scoring == "sigmoid":
        adds = [a for n in router if is_op(n, aten.add.Tensor) and scoring in n.args
                for a in map(_uncast, n.args) if a is not scoring]
        bias = next((a for a in adds if isinstance(a, fx.Node) and a.op == "get_attr"
                     and shape(a) == (routing.num_experts,)), None)
        if bias is None:
            raise ValueError(f"{where}: no e_score_correction_bias [{routing.num_experts}] added to the router's "
                             "sigmoid scores")
    if family.topk_first and not any(shape(a) == (routing.num_experts,)
                                     for a in _params_upstream(logits, set(router))):
        raise ValueError(f"{where}: the router's logits {logits.name} take no bias [{routing.num_experts}] "
                         f"({family.router} is a linear with a bias)")
    # the experts: stacked weights, one input of activations besides the routing, one output
    inside = set(experts)
    params = {a for n in experts for a in n.all_input_nodes if a.op == "get_attr"}
    by_shape = {shape(p): p for p in params}
    b13 = b2 = None
    if family.experts_layout == "gpt_oss":
        w13, w2 = by_shape.get((e, h, 2 * inter)), by_shape.get((e, inter, h))
        if w13 is None or w2 is None or len(params) != 4:
            raise ValueError(f"{where}: expected the experts' gate_up_proj [{e}, {h}, {2 * inter}], down_proj "
                             f"[{e}, {inter}, {h}] and their biases [{e}, {2 * inter}] / [{e}, {h}], found "
                             f"{sorted(str(shape(p)) for p in params)}")
        b13, b2 = _expert_biases(where, params - {w13, w2}, w13, w2, inside, (e, 2 * inter), (e, h))
        _check_down_bias_before_weights(where, b2, scoring, inside, set(nodes))
        _check_swiglu(where, b13, experts, activation)
    else:
        w13, w2 = by_shape.get((e, 2 * inter, h)), by_shape.get((e, h, inter))
        if w13 is None or w2 is None or len(params) != 2:
            raise ValueError(f"{where}: expected the experts' gate_up_proj [{e}, {2 * inter}, {h}] and down_proj "
                             f"[{e}, {h}, {inter}] only, found {sorted(str(shape(p)) for p in params)} (expert "
                             "biases or another layout are not supported)")
        if not any(is_op(n, aten.silu.default, ops.silu_and_mul.default) for n in experts):
            raise ValueError(f"{where}: the experts apply no silu (fused_moe implements silu gates only)")
    routed = _downstream(router, set(nodes))
    ext = {a for n in experts for a in n.all_input_nodes
           if a not in inside and a.op != "get_attr" and _is_tensor(a) and a not in routed}
    hidden = next(iter(ext)) if len(ext) == 1 else None
    if hidden is None or len(shape(hidden)) != 2 or shape(hidden)[1] != h:
        raise ValueError(f"{where}: expected one [T, {h}] activation input of the experts besides the routing, "
                         f"found {[(a.name, shape(a)) for a in ext]}")
    outs = [n for n in experts if _is_tensor(n) and any(u not in inside for u in n.users)]
    if len(outs) != 1 or not same_shape(outs[0], hidden) or dtype(outs[0]) != dtype(hidden):
        raise ValueError(f"{where}: expected one experts output shaped like its input {shape(hidden)}, found "
                         f"{[(n.name, shape(n), dtype(n)) for n in outs]}")
    for w in (w13, w2, b13, b2):
        t = None if w is None else PassContext.tensor_of(gm, w)
        if t is not None and t.dtype != dtype(hidden):
            raise ValueError(f"{where}: expert weight {w.target} is {t.dtype}, the activations "
                             f"{dtype(hidden)} (fused_moe needs both in one float dtype)")
    return _Block(path, family, routing, set(router) | inside, logits, bias, hidden, w13, w2, outs[0], held,
                  activation, b13, b2)


def _router_logits(where: str, family: MoeFamily, routing: Routing, router: list[fx.Node],
                   scoring: fx.Node) -> fx.Node:
    """The logits the router scores. Most families score the logits (softmax / sigmoid of them) before ranking;
    GPT-OSS (`topk_first`) ranks them and softmaxes the top-k values, its getitem 0, along the last dim."""
    if not family.topk_first:
        return _uncast(scoring.args[0])
    values = _uncast(scoring.args[0])
    topk = values.args[0] if values.target is operator.getitem and values.args[1] == 0 else None
    if not is_op(topk, aten.topk.default) or topk not in router or topk.args[1] != routing.top_k:
        raise ValueError(f"{where}: the router's softmax reads {values.name}, not the values of its top-"
                         f"{routing.top_k} ({family.router} ranks the logits, then softmaxes the k top values)")
    rank = len(shape(values))
    dims = {"softmax": scoring.args[1] % rank, "top-k": (topk.args[2] if len(topk.args) > 2 else -1) % rank}
    if any(d != rank - 1 for d in dims.values()):
        raise ValueError(f"{where}: the router's {dims} dims are not the experts' (the last)")
    return _uncast(topk.args[0])


def _params_upstream(node: fx.Node, within: set[fx.Node]) -> set[fx.Node]:
    """The get_attr nodes `node` reads, directly or through nodes of `within`."""
    seen, stack, params = {node}, [node], set()
    while stack:
        for a in stack.pop().all_input_nodes:
            if a.op == "get_attr":
                params.add(a)
            elif a in within and a not in seen:
                seen.add(a)
                stack.append(a)
    return params


# ops a GPT-OSS expert bias goes through on its way to its add: the gather of the pairs' rows, casts, views
_BIAS_PATH = (aten.index.Tensor, aten.index_select.default, aten.embedding.default, *_CASTS, aten.view.default,
              aten.reshape.default, aten.unsqueeze.default, aten.expand.default)
_ADDS = (aten.add.Tensor, aten.add_.Tensor)


def _bias_add(bias: fx.Node, inside: set[fx.Node]) -> fx.Node | None:
    """The add of the experts module that `bias` reaches through gathers, casts and views (None if it reaches
    anything else or no add)."""
    node = bias
    while True:
        users = [u for u in node.users if u in inside and not is_op(u, aten._assert_tensor_metadata.default)]
        if len(users) != 1:
            return None
        node = users[0]
        if is_op(node, *_ADDS):
            return node
        if not is_op(node, *_BIAS_PATH):
            return None


def _expert_biases(where: str, biases: set[fx.Node], w13: fx.Node, w2: fx.Node, inside: set[fx.Node],
                   b13_shape: tuple[int, int], b2_shape: tuple[int, int]) -> tuple[fx.Node, fx.Node]:
    """GPT-OSS's (gate_up_proj_bias, down_proj_bias) get_attr nodes, told apart by the GEMM output each is added to
    (their shapes agree when H = 2I): the gate/up bias to a product of gate_up_proj and not of down_proj, the down
    bias to a product of down_proj. ValueError otherwise."""
    found: dict[str, fx.Node] = {}
    for bias in biases:
        add = _bias_add(bias, inside)
        other = None if add is None else next((a for a in add.args[:2] if isinstance(a, fx.Node)
                                              and bias not in _params_upstream(a, inside) and a is not bias), None)
        reads = set() if other is None else _params_upstream(other, inside)
        kind = "b2" if w2 in reads else "b13" if w13 in reads else None
        if kind is None or kind in found:
            also = f" (as {found[kind].target} is)" if kind in found else ""
            raise ValueError(f"{where}: expert bias {bias.target} {shape(bias)} is not added to the output of the "
                             f"gate/up GEMM or of the down GEMM alone{also} (GptOssExperts adds gate_up_proj_bias to "
                             "the first and down_proj_bias to the second)")
        found[kind] = bias
    b13, b2 = found.get("b13"), found.get("b2")
    if b13 is None or b2 is None or shape(b13) != b13_shape or shape(b2) != b2_shape:
        raise ValueError(f"{where}: expected gate_up_proj_bias {list(b13_shape)} added to the gate/up GEMM and "
                         f"down_proj_bias {list(b2_shape)} to the down GEMM, found "
                         f"{ {k: shape(v) for k, v in found.items()} }")
    return b13, b2


def _check_down_bias_before_weights(where: str, b2: fx.Node, scoring: fx.Node, inside: set[fx.Node],
                                    block: set[fx.Node]) -> None:
    """The down bias is added to each (token, slot) row before the routing weight multiplies it (fused_moe's order,
    and HF's: weight * (down + bias)); ValueError otherwise."""
    add = _bias_add(b2, inside)
    weighted = _downstream([scoring], block)
    after = _downstream([add], inside)
    if add in weighted or not any(is_op(n, aten.mul.Tensor, aten.mul_.Tensor)
                                  and any(a in after for a in n.args[:2]) and any(a in weighted for a in n.args[:2])
                                  for n in after):
        raise ValueError(f"{where}: down_proj_bias is not added before the routing weights multiply the down GEMM's "
                         "rows (fused_moe computes weight * (down + bias))")


def _clamp_bounds(node: fx.Node) -> tuple[float | None, float | None] | None:
    """(min, max) of a clamp node (None for a missing bound), or None for another node."""
    if is_op(node, aten.clamp.default):
        args = [*node.args[1:], None, None]
        return node.kwargs.get("min", args[0]), node.kwargs.get("max", args[1])
    if is_op(node, aten.clamp_min.default):
        return node.args[1], None
    if is_op(node, aten.clamp_max.default):
        return None, node.args[1]
    return None


def _check_swiglu(where: str, b13: fx.Node, experts: list[fx.Node], activation: Activation) -> None:
    """GptOssExperts' activation on the gate/up GEMM's output (the b13 add): gate = the even columns clamped to at
    most `limit`, up = the odd ones clamped to [-limit, limit], (up + 1) * (gate * sigmoid(gate * alpha)), with
    the config's alpha and limit; ValueError naming the first piece not found."""
    inside = set(experts)
    gate_up = _bias_add(b13, inside)
    alpha, limit = activation.alpha, activation.limit

    def close(a, b) -> bool:
        return isinstance(a, (int, float)) and b is not None and math.isclose(a, b, rel_tol=1e-6)

    def find(what: str, pred) -> fx.Node:
        node = next((n for n in experts if pred(n)), None)
        if node is None:
            raise ValueError(f"{where}: the experts' activation has no {what} (GptOssExperts' clamped SwiGLU with "
                             f"swiglu_alpha={alpha}, swiglu_limit={limit}; fused_moe's 'swigluoai')")
        return node

    def operands(n: fx.Node) -> list:
        return [_uncast(a) if isinstance(a, fx.Node) else a for a in n.args[:2]]

    def reads(n: fx.Node, node: fx.Node) -> bool:  # n's first argument is `node` (casts and row masks aside)
        return bool(n.args) and isinstance(n.args[0], fx.Node) and _unmasked(_uncast(n.args[0])) is node

    def half(start: int):  # gate_up[:, start::2]
        return lambda n: (is_op(n, aten.slice.Tensor) and reads(n, gate_up) and len(shape(gate_up)) == 2
                          and n.args[1] in (1, -1) and n.args[2] == start and (n.args[4:] or (1,))[0] == 2)

    gate_half, up_half = find("gate = gate_up[..., ::2]", half(0)), find("up = gate_up[..., 1::2]", half(1))
    gate = find(f"gate clamp to <= {limit}", lambda n: reads(n, gate_half)
                and (b := _clamp_bounds(n)) is not None and b[0] is None and close(b[1], limit))
    up = find(f"up clamp to [-{limit}, {limit}]", lambda n: reads(n, up_half)
              and (b := _clamp_bounds(n)) is not None and close(b[0], -limit) and close(b[1], limit))
    scaled = find(f"gate * {alpha}", lambda n: is_op(n, aten.mul.Tensor) and gate in operands(n)
                  and any(close(a, alpha) for a in operands(n)))
    sig = find(f"sigmoid(gate * {alpha})", lambda n: is_op(n, aten.sigmoid.default) and reads(n, scaled))
    glu = find("gate * sigmoid(...)", lambda n: is_op(n, aten.mul.Tensor) and set(operands(n)) == {gate, sig})
    plus1 = find("up + 1", lambda n: is_op(n, aten.add.Tensor) and operands(n)[0] is up and close(operands(n)[1], 1.0)
                 and n.kwargs.get("alpha", 1) == 1)
    find("(up + 1) * glu", lambda n: is_op(n, aten.mul.Tensor) and set(operands(n)) == {plus1, glu})


def _downstream(start: list[fx.Node], within: set[fx.Node]) -> set[fx.Node]:
    """`start` and every node of `within` that reads one of them, transitively."""
    seen, stack = set(start), list(start)
    while stack:
        for user in stack.pop().users:
            if user in within and user not in seen:
                seen.add(user)
                stack.append(user)
    return seen


# -- the pass -----------------------------------------------------------------------------------------------


class RouteMoe(GraphPass):
    """HF MoE blocks (router + experts) → moe_topk + fused_moe over stacked expert weights."""

    name = "route_moe"
    stage = "fusion"
    requires = ("cleanup",)

    @classmethod
    def default_for(cls, ctx: PassContext) -> GraphPass | None:
        return cls() if is_moe_config(ctx.config) else None

    def check_context(self, ctx: PassContext) -> None:
        family = _BY_MODEL_TYPE.get(getattr(ctx.config, "model_type", None))
        if family is not None:
            routing_for(ctx.config, family)

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        groups = _group_by_block(gm)
        if not groups:
            return PassResult(0, "no MoE blocks in the graph")
        routed = [p for p, (_, nodes) in groups.items() if any(is_op(n, ops.fused_moe.default) for n in nodes)]
        groups = {p: g for p, g in groups.items() if p not in routed}
        if not groups:
            return PassResult(0, f"{len(routed)} MoE blocks routed already (by shard_tensor_parallel: expert "
                                 "parallelism)")
        blocks = [_match_block(gm, ctx.config, path, family, nodes, ctx)
                  for path, (family, nodes) in groups.items()]
        before = _bytes(gm, {n for b in blocks for n in (b.w13, b.w2, b.b13, b.b2) if n is not None})
        copies = 0
        maps: dict[tuple[int, int, int], fx.Node] = {}  # (first, count, E) -> the expert map's get_attr
        for block in blocks:
            copies += self._stack(gm, ctx, block)
            self._rewrite(gm, block, self._expert_map(gm, block, maps))
            erase_dead(gm, block.nodes.__contains__, block.family.block)
            alive = set(gm.graph.nodes)
            left = [n.name for n in block.nodes
                    if n in alive and _is_tensor(n) and _in_module(n, block.path, block.family.experts)]
            if left:
                raise ValueError(f"{block.path} ({block.family.block}): experts nodes {left[:3]} are still used "
                                 "after the rewrite")
        fused = [n for n in gm.graph.nodes if is_op(n, ops.fused_moe.default)]
        after = _bytes(gm, {a for n in fused for a in (*n.args[3:5], *n.args[7:9]) if isinstance(a, fx.Node)})
        return PassResult(len(blocks), self._note(blocks, before, after, copies))

    @staticmethod
    def _stack(gm: fx.GraphModule, ctx: PassContext, block: _Block) -> int:
        """Make w13 / w2 contiguous stacked buffers (a copy replaces a non-contiguous original; GPT-OSS's four
        tensors re-laid: `_relay_gpt_oss`); returns the tensors copied."""
        if block.family.experts_layout == "gpt_oss":
            return RouteMoe._relay_gpt_oss(gm, ctx, block)
        copies = 0
        for attr in ("w13", "w2"):
            node = getattr(block, attr)
            t = PassContext.tensor_of(gm, node)
            if not t.is_contiguous():
                with torch.no_grad():
                    setattr(block, attr, ctx.add_tensor(gm, f"{node.target}_stacked", t.contiguous(),
                                                        before=block.output))
                copies += 1
        return copies

    @staticmethod
    def _relay_gpt_oss(gm: fx.GraphModule, ctx: PassContext, block: _Block) -> int:
        """GPT-OSS's experts into fused_moe's layout, each tensor copied once into a new contiguous buffer that
        replaces HF's in the graph (the originals are then dropped from the graph module): gate_up_proj
        [E, H, 2I] (gate = [..., ::2], up = [..., 1::2]) -> w13 [E, 2I, H] (gate rows, then up rows);
        down_proj [E, I, H] -> w2 [E, H, I]; gate_up_proj_bias [E, 2I] -> [E, 2I] gate | up; down_proj_bias
        [E, H] taken as it is when contiguous. Returns the tensors copied."""
        tensors = {k: PassContext.tensor_of(gm, getattr(block, k)) for k in ("w13", "w2", "b13", "b2")}
        gate_up, down, gate_up_bias = tensors["w13"], tensors["w2"], tensors["b13"]
        e, h, two_i = gate_up.shape
        inter = two_i // 2
        with torch.no_grad():
            w13 = gate_up.new_empty(e, two_i, h)  # filled from strided views: no temporary copy
            w13[:, :inter].copy_(gate_up[..., 0::2].transpose(1, 2))
            w13[:, inter:].copy_(gate_up[..., 1::2].transpose(1, 2))
            b13 = torch.cat([gate_up_bias[:, 0::2], gate_up_bias[:, 1::2]], dim=1)
            relaid = {"w13": w13, "w2": down.transpose(1, 2).contiguous(), "b13": b13}
            if not tensors["b2"].is_contiguous():
                relaid["b2"] = tensors["b2"].contiguous()
        for attr, value in relaid.items():
            node = getattr(block, attr)
            setattr(block, attr, ctx.add_tensor(gm, f"{node.target}_relaid", value, before=block.output))
        return len(relaid)

    @staticmethod
    def _expert_map(gm: fx.GraphModule, block: _Block, maps: dict[tuple[int, int, int], fx.Node]) -> fx.Node | None:
        """The expert map of a block whose weights hold only some experts (expert parallelism): global id ->
        local index, -1 for the experts of other ranks; one buffer for all blocks that hold the same experts,
        placed before the first graph node (so every block can read it). None when the block holds them all."""
        (first, count), total = block.experts, block.routing.num_experts
        if count == total:
            return None
        key = (first, count, total)
        if key not in maps:
            device = PassContext.tensor_of(gm, block.w13).device
            value = torch.full((total,), -1, dtype=torch.int32, device=device)
            value[first:first + count] = torch.arange(count, dtype=torch.int32, device=device)
            first_node = next(n for n in gm.graph.nodes if n.op != "placeholder")
            maps[key] = PassContext.add_tensor(gm, f"moe_expert_map_{first}_{first + count - 1}", value,
                                               before=first_node)
        return maps[key]

    @staticmethod
    def _rewrite(gm: fx.GraphModule, block: _Block, expert_map: fx.Node | None) -> None:
        graph, r = gm.graph, block.routing
        with graph.inserting_before(block.output):
            logits_dtype = dtype(block.logits)
            rounded = block.family.weights_in_logits_dtype and logits_dtype != torch.float32
            topk = graph.call_function(ops.moe_topk.default, (
                block.logits, r.top_k, r.scoring, r.renormalize, r.scale, r.n_group, r.topk_group, block.bias,
                logits_dtype if rounded else None))  # Qwen: the weights rounded as HF does, by the kernel's store
            weights = graph.call_function(operator.getitem, (topk, 0))
            ids = graph.call_function(operator.getitem, (topk, 1))
            new = [topk, weights, ids]
            args = (block.hidden, weights, ids, block.w13, block.w2)
            act = block.activation
            if act.name != "silu" or block.b13 is not None or block.b2 is not None:  # GPT-OSS
                args = (*args, act.name, expert_map, block.b13, block.b2, act.alpha, act.limit)
            elif expert_map is not None:
                args = (*args, "silu", expert_map)
            out = graph.call_function(ops.fused_moe.default, args)
            new.append(out)
        stack = {k: v for k, v in (block.output.meta.get("nn_module_stack") or {}).items()
                 if v[0] == block.path or not v[0].startswith(block.path)}
        for node in new:
            node.meta["nn_module_stack"] = dict(stack)
        block.output.replace_all_uses_with(out)

    @staticmethod
    def _note(blocks: list[_Block], before: int, after: int, copies: int) -> str:
        kinds = Counter(b.family.block for b in blocks)
        what = ", ".join(f"{k} x{n}" for k, n in kinds.items())
        how = f"{copies} made contiguous" if copies else "HF's stacked gate_up_proj/down_proj taken as they are"
        if any(b.family.experts_layout == "gpt_oss" for b in blocks):
            act = blocks[0].activation
            how = (f"{copies} re-laid: gate_up_proj de-interleaved and transposed to [E, 2I, H], down_proj to "
                   f"[E, H, I], biases alongside; swigluoai alpha={act.alpha:g} limit={act.limit:g}")
        (first, count), total = blocks[0].experts, blocks[0].routing.num_experts
        held = f"; experts {first}..{first + count - 1} on this rank (expert map)" if count != total else ""
        return (f"{len(blocks)} MoE blocks ({what}): {blocks[0].routing.describe()}{held}; expert weights "
                f"{before / 1e6:.3f} MB before stacking, {after / 1e6:.3f} MB after ({how})")


def _bytes(gm: fx.GraphModule, nodes) -> int:
    seen, total = set(), 0
    for node in nodes:
        t = PassContext.tensor_of(gm, node)
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total
