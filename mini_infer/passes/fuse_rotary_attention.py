"""FuseRotaryAttention: a layer's `qk_rotary` whose outputs only feed its `paged_attention` (as q and k), and that
attention → one `rotary_paged_attention`: at decode the attention launch applies the q/k norms and the rotary
itself (ops/rotary_paged_attention.py), so no qk_rotary launch is left.

    q_rot, k_rot = qk_rotary(q, k, cos, sin, qw, kw, eps)
    out = paged_attention(pack(q_rot), pack(k_rot), pack(v), k_cache, v_cache, slot_mapping, meta..., scale,
                          window, softcap[, k_scale, v_scale[, sinks]])
  → out = rotary_paged_attention(q, k, v, cos, sin, qw, kw, eps, k_cache, v_cache, slot_mapping, meta..., scale,
                                 window, softcap[, k_scale, v_scale[, sinks]])

`pack(x)` is `transpose(select(x, 0, 0), 0, 1)`, the [1, H, T, D] -> [T, H, D] views the paged_attention pass puts
before the op. The match is FuseKVWrite's (`pattern.rotary_attention`: k_rot reaches the attention's k through
exactly those views, read by nothing else; v is such a view of a 4-D node), and q_rot must likewise reach the
attention's q alone. The new node takes the attention's place (after q, k, v, cos and sin; the caches see the same
order of writes and reads). Same values: the op's semantics are the pair's (the references in sequence; on the
Triton path one kernel with the pair's roundings at decode, the two ops at other shapes). Left alone: MLA
(mla_latent_cache's `mla_attention`), attentions whose q/k are no qk_rotary outputs (apply_rotary alone,
interleaved rotary, no rotary), a q_rot / k_rot or their views with another reader, keyword calls, any other
layout. Runs after paged_attention (whose nodes it matches) and, to find anything, fuse_qk_rotary; registered
before fuse_kv_write, which then finds nothing where this pass matched. The graph dump shows
`rotary_paged_attention(...)`. The runtime sees no difference: the caches, slot_mapping and scales are the inputs
paged_attention declared. Attention sinks (GPT-OSS), the attention's last argument, are the new op's last argument
too (every argument after q, k, v moves over as it is).

Default: on for CUDA targets, where a decode step's attention launch absorbs the qk_rotary launch (1.2 to 1.5 us a
layer on the critical path by bench/kernel_layer_chain.py on an H200: the gain this pass is for). End to end on an
H200 (2026-11-24, bf16, batch 1, with / without this pass in one run) it won at small query groups and lost at large
ones: qwen3-0.6b (2 q heads a kv head) 1,258.0 vs 1,245.6 tok/s, qwen2.5-7b (7) 249.1 vs 249.0, qwen3-30b-a3b (8)
339.4 vs 345.3. Split launches (small batches) took groups up to 8 once they loaded their first tile before the
wait (ops/rotary_paged_attention.py's ROTARY_MAX_GROUP_SPLIT); one-split launches (large batches) take none
(ROTARY_MAX_GROUP 0: the nano-vllm throughput workload ran 5.4% faster with the two kernels there, 2026-11-29). Off
on other devices: there the op runs the two references one after the other and saves nothing.
"""

from __future__ import annotations

import torch
import torch.fx as fx

import mini_infer.ops  # noqa: F401  (registers torch.ops.mini_infer)
from mini_infer.passes.base import GraphPass, PassContext, PassResult
from mini_infer.passes.pattern import is_op, only_user, rotary_attention, unpacked

ops = torch.ops.mini_infer


def _q_only_for(attn: fx.Node, q_rot: fx.Node) -> bool:
    """Whether the attention's q is q_rot packed, with q_rot and its packing views read by nothing else."""
    found = unpacked(attn.args[0])
    if found is None or found[0] is not q_rot:
        return False
    q_packed, sel = attn.args[0], found[1]
    return only_user(q_packed, attn) and only_user(sel, q_packed) and only_user(q_rot, sel)


class FuseRotaryAttention(GraphPass):
    """qk_rotary + paged_attention (its q and k) → rotary_paged_attention."""

    name = "fuse_rotary_attention"
    stage = "lowering"
    requires = ("paged_attention",)

    @classmethod
    def default_for(cls, ctx: PassContext) -> GraphPass | None:
        # on CUDA only, where the decode attention launch applies the rotary; elsewhere the op runs the references
        return cls() if ctx.device.type == "cuda" else None

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        graph = gm.graph
        order = {n: i for i, n in enumerate(graph.nodes)}
        fused = 0
        for attn in [n for n in graph.nodes if is_op(n, ops.paged_attention.default)]:
            match = rotary_attention(attn, order)
            if match is None or not _q_only_for(attn, match.q_rot):
                continue
            q, k, cos, sin, q_w, k_w, eps = match.rot.args
            with graph.inserting_before(attn):
                fused_node = graph.call_function(ops.rotary_paged_attention.default, (
                    q, k, match.v, cos, sin, q_w, k_w, eps, *attn.args[3:]))
            fused_node.meta["val"] = attn.meta.get("val")
            attn.replace_all_uses_with(fused_node)
            # the attention mutates the caches (dead-code elimination would keep it); then its packing views and
            # the rotary, read by nothing now
            dead = [attn, attn.args[0], attn.args[1]]
            dead += [dead[1].args[0], dead[2].args[0], match.q_rot, match.k_rot, match.rot]
            for node in dead:
                graph.erase_node(node)
            fused += 1
        return PassResult(fused, f"{fused} layers" if fused else "")
