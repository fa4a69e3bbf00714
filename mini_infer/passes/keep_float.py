"""Which linear modules a quantization pass keeps in float, and why: the one policy of quantize_w8a8 and quantize_fp8.

A linear stays in the model dtype for the first of these reasons (the label is what the passes' notes count):
  * "lm_head": the linear that makes the graph's logits (found from the output back through per-row ops and
    views, see `lm_head_of`; a tied head may carry the embedding's weight), or a module named `lm_head`, unless the
    pass was told `lm_head=True`. vLLM leaves it unquantized too: logits are where rounding shows first.
  * "moe gate": MoE routers: a module named `gate` or `*_gate` (Qwen2-MoE's `shared_expert_gate`), or one whose
    class is a router (`MixtralTopKRouter`, `DeepseekV3TopkRouter`, ...). Their GEMMs are tiny and a rounding
    flips an expert choice at a near-tie (vLLM builds them unquantized).
  * "mla kv_b_proj": `kv_b_proj` traced inside a DeepSeek MLA attention module (`mla_module`): exactly the linears
    `mla_latent_cache` absorbs as float weights into the latent attention (it refuses a quantized one). A
    `kv_b_proj` that pass would not rewrite is quantized like any other linear.
  * "skip": a `skip` pattern of the pass matches the module name (`pattern_matches`: whole or as a dotted suffix).
    A pattern that matches no linear of the model is refused (PassConfigError naming the pass and the pattern).

Names are HF module paths without capture's wrapper prefix (`model.layers.0.mlp.down_proj`, `lm_head`). This
module decides and explains only: it never edits the graph nor quantizes anything.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch.fx as fx

from mini_infer.passes.base import GraphPass
from mini_infer.passes.mla_latent_cache import mla_module
from mini_infer.passes.pattern import VIEWS, is_op, lm_head_of, module_chain, pattern_matches

_CAPTURE_PREFIX = "model."  # capture wraps the HF model as attribute `model` (passes/capture.py)


def linear_name(node: fx.Node) -> str:
    """The HF module name of a linear (`model.layers.0.self_attn.q_proj`), from the innermost module it was traced
    in, else from its weight's attribute path."""
    chain = module_chain(node)
    path = chain[-1][0] if chain else str(node.args[1].target).removesuffix(".weight")
    return path.removeprefix(_CAPTURE_PREFIX)


def _logits_heads(gm: fx.GraphModule) -> set[fx.Node]:
    """The linears whose results are the graph's outputs, through views and then per-row ops."""
    heads = set()
    for out in gm.graph.output_node().all_input_nodes:
        while is_op(out, *VIEWS):
            out = out.args[0]
        head = lm_head_of(out)
        if head is not None:
            heads.add(head)
    return heads


def _is_router(node: fx.Node, last: str) -> bool:
    chain = module_chain(node)
    return last == "gate" or last.endswith("_gate") or bool(chain and "router" in chain[-1][1].lower())


def kept_in_float(gm: fx.GraphModule, linears: Iterable[fx.Node], owner: GraphPass, skip: Sequence[str] = (),
                  lm_head: bool = False) -> dict[fx.Node, str]:
    """The linears among `linears` (aten.linear nodes of `gm` over parameter weights) that the quantization pass
    `owner` leaves in float, each with its reason; PassConfigError from `owner` naming the first `skip` pattern that
    matches none of `linears`."""
    names = {node: linear_name(node) for node in linears}
    for p in skip:
        if not any(pattern_matches(p, name) for name in names.values()):
            sample = ", ".join(sorted({".".join(name.split(".")[-2:]) for name in names.values()})[:8])
            raise owner.invalid("skip", p, f"matches no linear of this model (names like: {sample})")
    heads = set() if lm_head else _logits_heads(gm)
    kept = {}
    for node, name in names.items():
        last = name.rsplit(".", 1)[-1]
        if node in heads or (last == "lm_head" and not lm_head):
            kept[node] = "lm_head"
        elif _is_router(node, last):
            kept[node] = "moe gate"
        elif last == "kv_b_proj" and mla_module(node) is not None:
            kept[node] = "mla kv_b_proj"
        elif any(pattern_matches(p, name) for p in skip):
            kept[node] = "skip"
    return kept
