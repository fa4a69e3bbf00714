"""Tensor-parallel plans: which linears of a model are split column- or row-wise, read from the config's
`base_model_tp_plan` (transformers' own, per module path: "layers.*.self_attn.q_proj": "colwise"), and the
checks that a world size fits the model (attention heads, KV heads, vocabulary).

Mixture-of-experts layers follow transformers' "moe_tp_experts" plan (tensor parallelism inside the experts):
the stacked `experts.gate_up_proj` [E, 2I, H] is "packed_colwise" (each rank keeps its rows of the gate half and
of the up half), `experts.down_proj` [E, H, I] is "rowwise" (its columns of I), and the experts module's output
is a partial sum. With expert parallelism (`expert_parallel=True`, vLLM's `--enable-expert-parallel`) the same
stacked weights are split along the experts instead: rank r keeps experts r*E/N .. (r+1)*E/N - 1 whole
(`local_experts`), and the experts module's output is again a partial sum. Nothing is guessed: a config without
a plan, or with an entry this project cannot shard (latent attention, expert-parallel and other styles), or
experts the ranks do not divide under expert parallelism, is a ValueError naming the field. One completion, from
transformers' own metadata: a config whose `base_model_tp_plan` names no experts module (transformers 5.17's
Qwen2-MoE) but whose `base_model_ep_plan` marks one "moe_tp_experts" with its stacked `gate_up_proj` and
`down_proj` gets those three entries (packed_colwise, rowwise, moe_tp_experts: the stacked layout every 5.x MoE
family shares); a model with routed experts that neither plan names is refused.

Where transformers' plan splits no attention for a model type (no colwise `self_attn.q_proj` entry), this
project's own plan for that type is used instead, written out below in `PROJECT_PLANS`: today GPT-OSS only
(transformers 5.24's `base_model_tp_plan` for gpt_oss names only `embed_tokens`, 5.17's has none, and both
`base_model_ep_plan`s mark the expert tensors "grouped_gemm"). Its entries use four styles of this project for
tensors transformers' styles do not describe: "transposed_colwise" (stacked [E, in, out] weights and [E, out]
biases whose output features are the last dim: each rank keeps a contiguous 1/N of the last dim; GPT-OSS's
`gate_up_proj` [E, H, 2I] and `gate_up_proj_bias` [E, 2I] interleave gate j at column 2j and up j at 2j+1, so
columns [2rI/N, 2(r+1)I/N) are the rank's I/N gate/up pairs), "transposed_rowwise" (stacked [E, in, out]
weights split on dim 1, the input features: `down_proj` [E, I, H]), "bias_once" (a bias added to a partial sum:
rank 0 keeps it, the other ranks hold zeros, so the sum over ranks adds it once: `down_proj_bias` [E, H], added
per (token, slot) before the routing weight) and "query_heads" (a per-query-head tensor [Hq] split like the
query heads: `self_attn.sinks`). With expert parallelism the three expert styles keep the rank's experts whole
(dim 0) instead, each expert's biases with it. A model type
with neither a plan that splits attention nor a project plan stays refused: nothing is guessed. The sharding pass
and the start-up checks both read the plan from here, so a model is refused before any weight loads. This module
reads configs only: it never touches a graph, a tensor or a process group.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Plan styles this project implements. "replicated_with_grad_allreduce" (Qwen3's q/k norms) is a per-head
# weight every rank keeps whole: nothing to do at inference. "embedding_rowwise" (a vocab-sharded input embedding,
# which transformers 5.17 adds to the plan of every config with tied word embeddings) is kept whole on every rank
# too: the same answers, at the cost of the embedding's memory on each rank (its shards are not implemented).
SHARDED_STYLES = ("colwise", "rowwise", "packed_colwise", "moe_tp_experts")
STACKED_STYLES = ("packed_colwise", "rowwise")  # styles of stacked expert parameters ("...experts.down_proj")
# this project's styles, used by PROJECT_PLANS only (see the module docstring): stacked expert tensors stored
# transposed ([E, in, out]) with their biases, and a per-query-head tensor
TRANSPOSED_STYLES = ("transposed_colwise", "transposed_rowwise", "bias_once")
HEADS_STYLE = "query_heads"
PROJECT_STYLES = (*TRANSPOSED_STYLES, HEADS_STYLE)
PARAMETER_STYLES = (*STACKED_STYLES, *PROJECT_STYLES)  # styles of a module's tensor, not of a linear module
EXPERTS_STYLE = "moe_tp_experts"  # an experts module whose output each rank computes a share of
REPLICATED_STYLES = ("replicated_with_grad_allreduce", "embedding_rowwise")
KV_PROJECTIONS = ("k_proj", "v_proj")  # the colwise linears whose rows are KV heads (may be replicated)
EXPERT_COUNT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")  # routed experts, by family


# This project's plans, per model_type, used only when transformers' plan splits no attention for it
# (`_splits_attention`). Entries not named are replicated (the router, norms, the embedding); lm_head is split
# over the vocabulary as for every model.
PROJECT_PLANS: dict[str, dict[str, str]] = {
    "gpt_oss": {
        "layers.*.self_attn.q_proj": "colwise",  # weight and bias: this rank's query heads
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",  # its bias added once, after the all-reduce
        "layers.*.self_attn.sinks": HEADS_STYLE,  # [Hq]: rank r keeps heads r*Hq/N .. (r+1)*Hq/N - 1
        "layers.*.mlp.experts.gate_up_proj": "transposed_colwise",  # [E, H, 2I] -> [E, H, 2I/N]
        "layers.*.mlp.experts.gate_up_proj_bias": "transposed_colwise",  # [E, 2I] -> [E, 2I/N]
        "layers.*.mlp.experts.down_proj": "transposed_rowwise",  # [E, I, H] -> [E, I/N, H]
        "layers.*.mlp.experts.down_proj_bias": "bias_once",  # [E, H]: rank 0's, zeros elsewhere (EP: its experts')
        "layers.*.mlp.experts": EXPERTS_STYLE,
    },
}


def _splits_attention(plan: dict[str, str]) -> bool:
    """Whether a plan splits attention: a colwise entry for a `self_attn.q_proj`."""
    return any(k.endswith("self_attn.q_proj") and v == "colwise" for k, v in plan.items())


def num_routed_experts(config) -> tuple[str, int] | None:
    """(field, value) of a config's routed-expert count, or None for a model without routed experts."""
    return next(((f, v) for f in EXPERT_COUNT_FIELDS
                 if isinstance(v := getattr(config, f, None), int) and not isinstance(v, bool) and v > 0), None)


def local_experts(num_experts: int, rank: int, world_size: int) -> tuple[int, int]:
    """(first expert, count) that rank `rank` of `world_size` keeps under expert parallelism: a contiguous run
    of num_experts / world_size (vLLM's "linear" placement)."""
    count = num_experts // world_size
    return rank * count, count


@dataclass(frozen=True)
class TensorParallelPlan:
    """A model's split over `world_size` ranks: the plan's entries and the head and vocabulary arithmetic.

    Query heads are split evenly (rank r has heads r*H/N ... (r+1)*H/N - 1). KV heads are split evenly when N
    divides them; when there are fewer KV heads than ranks (and N is a multiple of them) each rank keeps the
    one KV head its query heads read (vLLM's rule). The vocabulary of lm_head is split evenly after padding it
    to a multiple of N (padding rows are dropped after the all-gather).
    """

    world_size: int
    styles: dict[str, str]  # plan pattern ("layers.*.self_attn.q_proj") -> style
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    expert_parallel: bool = False  # stacked expert weights split along the experts, not the intermediate size
    num_experts: int = 0  # routed experts (0: none)

    @property
    def heads_per_rank(self) -> int:
        return self.num_heads // self.world_size

    @property
    def kv_replicated(self) -> bool:
        return self.num_kv_heads < self.world_size

    @property
    def kv_heads_per_rank(self) -> int:
        return 1 if self.kv_replicated else self.num_kv_heads // self.world_size

    def first_kv_head(self, rank: int) -> int:
        """The first KV head rank `rank` keeps."""
        if self.kv_replicated:
            return rank * self.num_kv_heads // self.world_size
        return rank * self.kv_heads_per_rank

    @property
    def padded_vocab(self) -> int:
        return -(-self.vocab_size // self.world_size) * self.world_size

    def slices(self, module_path: str, tensor_name: str, is_lm_head: bool = False) -> bool:
        """Whether the sharding pass keeps only a slice of `module_path`'s tensor `tensor_name` ("weight",
        "bias", or a stacked expert parameter's name): colwise weights and biases, rowwise weights (a rowwise
        bias is added whole, once), the lm_head's weight and bias (split over the vocabulary), and tensors other
        than a weight or bias whose own path has a stacked-expert or project style (a "bias_once" tensor is
        kept whole on rank 0 and zeroed on the others: the pass reads it too). Every other tensor is
        replicated."""
        if is_lm_head:
            return tensor_name in ("weight", "bias")
        if tensor_name not in ("weight", "bias") and \
                self.style_of(f"{module_path}.{tensor_name}") in PARAMETER_STYLES:
            return True
        style = self.style_of(module_path)
        if style == "colwise":
            return tensor_name in ("weight", "bias")
        return style == "rowwise" and tensor_name == "weight"

    def style_of(self, module_path: str) -> str | None:
        """The plan's style for a module path (any prefix: "model.model.layers.0.mlp.up_proj"), or None."""
        for pattern, style in self.styles.items():
            if _pattern_regex(pattern).search(module_path):
                return style
        return None


def experts_from_ep_plan(text) -> dict[str, str]:
    """Experts entries completed from a config's `base_model_ep_plan`: for an experts module pattern it marks
    "moe_tp_experts" and whose `.gate_up_proj` and `.down_proj` it lists too, those three as the tp plan names
    them (packed_colwise, rowwise, moe_tp_experts); {} when it has none."""
    ep_plan = getattr(text, "base_model_ep_plan", None) or {}
    out: dict[str, str] = {}
    for module, style in ep_plan.items():
        if style == EXPERTS_STYLE and f"{module}.gate_up_proj" in ep_plan and f"{module}.down_proj" in ep_plan:
            out |= {f"{module}.gate_up_proj": "packed_colwise", f"{module}.down_proj": "rowwise",
                    module: EXPERTS_STYLE}
    return out


def _pattern_regex(pattern: str) -> re.Pattern:
    """transformers' plan patterns ('*' is one layer index) matched at the end of a dotted module path."""
    body = r"\.".join(r"\d+" if part == "*" else re.escape(part) for part in pattern.split("."))
    return re.compile(rf"(^|\.){body}$")


def tensor_parallel_plan(config, world_size: int, expert_parallel: bool = False) -> TensorParallelPlan:
    """The plan for `config` (a transformers config) over `world_size` ranks, with expert parallelism for the
    MoE experts when `expert_parallel`; ValueError naming the field and the limit when the model cannot be split
    that way."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"tensor_parallel_size must be an int >= 1, got {world_size!r}")
    text = config.get_text_config()
    model_type = getattr(text, "model_type", type(text).__name__)
    plan = getattr(text, "base_model_tp_plan", None)
    if model_type in PROJECT_PLANS and not _splits_attention(plan or {}):
        plan = PROJECT_PLANS[model_type]  # transformers' plan splits no attention for it: this project's
    if not plan:
        raise ValueError(f"tensor_parallel_size={world_size}: the {model_type!r} config has no base_model_tp_plan "
                         "(transformers' tensor-parallel plan), so mini-infer cannot tell how to split it; run it "
                         "with tensor_parallel_size=1")
    if getattr(text, "kv_lora_rank", None) is not None:
        raise ValueError(f"tensor_parallel_size={world_size}: {model_type!r} uses latent attention (MLA, "
                         f"kv_lora_rank={text.kv_lora_rank}), which the shard_tensor_parallel pass does not split "
                         "(its experts would shard; the latent attention and its cache do not yet): run it with "
                         "tensor_parallel_size=1")
    own = plan is PROJECT_PLANS.get(model_type)  # the project's styles are valid in its own plans only
    known = SHARDED_STYLES + REPLICATED_STYLES + (PROJECT_STYLES if own else ())
    unsupported = {k: v for k, v in plan.items() if v not in known}
    if unsupported:
        key, style = next(iter(unsupported.items()))
        raise ValueError(f"tensor_parallel_size={world_size}: config.base_model_tp_plan[{key!r}] = {style!r} is "
                         f"not supported (the shard_tensor_parallel pass implements {', '.join(SHARDED_STYLES)}; "
                         "expert parallelism and other styles are not sharded): run this model with "
                         "tensor_parallel_size=1")
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    if heads % world_size:
        raise ValueError(f"tensor_parallel_size={world_size} does not divide num_attention_heads={heads}: pick a "
                         f"size that divides it")
    if kv_heads % world_size and world_size % kv_heads:
        raise ValueError(f"tensor_parallel_size={world_size} and num_key_value_heads={kv_heads}: the size must "
                         "divide the KV heads, or be a multiple of them (each rank then keeps one KV head)")
    experts = num_routed_experts(text)
    if expert_parallel and experts is not None and experts[1] % world_size:
        raise ValueError(f"enable_expert_parallel: tensor_parallel_size={world_size} does not divide the "
                         f"{experts[1]} routed experts ({experts[0]}={experts[1]}): every rank must keep the same "
                         "number of whole experts; pick a size that divides them, or leave expert parallelism off")
    # with expert parallelism the experts keep their whole intermediate size
    fields = ("intermediate_size",) if expert_parallel else ("intermediate_size", "moe_intermediate_size")
    for field in fields:
        value = getattr(text, field, None)
        if isinstance(value, int) and value % world_size:
            raise ValueError(f"tensor_parallel_size={world_size} does not divide {field}={value}")
    styles = {k: v for k, v in plan.items() if v in SHARDED_STYLES + PROJECT_STYLES}
    if experts is not None and EXPERTS_STYLE not in styles.values():
        styles |= experts_from_ep_plan(text)  # from base_model_ep_plan, where the tp plan leaves the experts out
    if experts is not None and EXPERTS_STYLE not in styles.values():
        raise ValueError(f"tensor_parallel_size={world_size}: the {model_type!r} config's base_model_tp_plan and "
                         f"base_model_ep_plan name no experts module ('moe_tp_experts') for its {experts[1]} routed "
                         f"experts ({experts[0]}), so mini-infer cannot tell how to split them; use a transformers "
                         "release whose plan names them, or tensor_parallel_size=1")
    return TensorParallelPlan(world_size, styles, heads, kv_heads, head_dim, text.vocab_size, expert_parallel,
                              experts[1] if experts is not None else 0)


def check_tensor_parallel_devices(world_size: int, device_type: str, num_gpus: int) -> None:
    """ValueError when `world_size` ranks cannot each have a GPU of this machine (one GPU per rank)."""
    if device_type == "cuda" and world_size > num_gpus:
        raise ValueError(f"tensor_parallel_size={world_size}, but this machine has {num_gpus} CUDA GPU(s): one "
                         "rank per GPU (for several machines, start each with torchrun; see docs/distributed.md)")
