"""FuseKVWrite: a layer's `qk_rotary` whose k output only feeds its `paged_attention`'s k, and that attention →
`qk_rotary_kv_write` (the rotary's programs of k rows store the rotated k and the matching v rows into the paged
caches) + `paged_attention_cached` (the attention without its cache write): one launch per layer fewer.

    q_rot, k_rot = qk_rotary(q, k, cos, sin, qw, kw, eps)
    paged_attention(pack(q_rot), pack(k_rot), pack(v), k_cache, v_cache, slot_mapping, meta..., scale, window,
                    softcap[, k_scale, v_scale[, sinks]])
  → q_rot = qk_rotary_kv_write(q, k, v, cos, sin, qw, kw, eps, k_cache, v_cache, slot_mapping[, k_scale, v_scale])
    paged_attention_cached(pack(q_rot), k_cache, v_cache, meta..., scale, window, softcap[, k_scale, v_scale
                           [, sinks]])

`pack(x)` is `transpose(select(x, 0, 0), 0, 1)`, the [1, H, T, D] -> [T, H, D] views the paged_attention pass puts
before the op; k_rot must reach the attention's k argument through exactly those two views, each read by nothing
else, and v must be such a view of a 4-D node (the op reads v [1, Hk, T, Dv] as the rotary reads k). The write
node goes right after the later of the rotary and v (before every reader of q_rot), so it precedes the attention
in the graph, which is the order the caches need: the attention reads what the write stored. Same values: the op
writes the cache bytes the attention's own write wrote, and the attention code is the same (ops/paged_attention.py).
Left alone: MLA (mla_latent_cache's `mla_attention`), attentions whose k is no qk_rotary output (apply_rotary
alone, interleaved rotary, no rotary), a k_rot or its views with another reader, any other layout. Runs after
paged_attention (whose nodes it matches) and, to find anything, fuse_qk_rotary. The graph dump shows
`qk_rotary_kv_write(...)` and `paged_attention_cached(...)`. The runtime sees no difference: the caches,
slot_mapping and scales are the inputs paged_attention declared. Attention sinks (GPT-OSS) are an argument of the
attention alone: they go to `paged_attention_cached` as they came (the write does not read them).

Default: off (opt-in by name in `passes=[...]`). It removes the KV-write launch before each attention (210 -> 182
kernels a step for qwen3-0.6b), but on an H200 (2026-11-24, bf16, batch 1, same process) it gained nothing:
qwen3-0.6b 1,035.9 tok/s with it, 1,047.0 without; qwen2.5-7b 244.1 and 244.6. With programmatic dependent launch
the write kernel's launch is hidden behind the rotary's, and the fused kernel (5.5 us) costs about what the two did
(3.8 + 2.3). Since then the decode attention launch writes the step's keys itself (ops/paged_attention.py,
DECODE_WRITE_IN_KERNEL): without a pass, no write launch is left for this one to remove at batch-1 decode. On other
devices the op runs qk_rotary's and the write's references one after the other.
"""

from __future__ import annotations

import torch
import torch.fx as fx

import mini_infer.ops  # noqa: F401  (registers torch.ops.mini_infer)
from mini_infer.passes.base import GraphPass, PassContext, PassResult
from mini_infer.passes.pattern import is_op, rotary_attention

ops = torch.ops.mini_infer


class FuseKVWrite(GraphPass):
    """qk_rotary + paged_attention (its k) → qk_rotary_kv_write + paged_attention_cached."""

    name = "fuse_kv_write"
    stage = "lowering"
    requires = ("paged_attention",)

    @classmethod
    def default_for(cls, ctx: PassContext) -> GraphPass | None:
        # opt-in: no gain on an H200 (module docstring)
        return None

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        graph = gm.graph
        order = {n: i for i, n in enumerate(graph.nodes)}
        fused = 0
        for attn in [n for n in graph.nodes if is_op(n, ops.paged_attention.default)]:
            match = rotary_attention(attn, order)
            if match is None:
                continue
            rot, q_rot, v, anchor = match.rot, match.q_rot, match.v, match.anchor
            q, k, cos, sin, q_w, k_w, eps = rot.args
            k_cache, v_cache, slot_mapping, block_tables, seq_lens, qsl, scale, window, softcap = attn.args[3:12]
            scales = tuple(attn.args[12:14])  # (k_scale, v_scale) (None, None without an fp8 cache but with sinks)
            rest = tuple(attn.args[12:])  # the scales, then the attention sinks where the layer has them
            with graph.inserting_after(anchor):
                write = graph.call_function(ops.qk_rotary_kv_write.default, (
                    q, k, v, cos, sin, q_w, k_w, eps, k_cache, v_cache, slot_mapping, *scales))
            write.meta["val"] = q_rot.meta.get("val")
            q_rot.replace_all_uses_with(write)
            with graph.inserting_before(attn):
                cached = graph.call_function(ops.paged_attention_cached.default, (
                    attn.args[0], k_cache, v_cache, block_tables, seq_lens, qsl, scale, window, softcap, *rest))
            cached.meta["val"] = attn.meta.get("val")
            attn.replace_all_uses_with(cached)
            graph.erase_node(attn)  # it mutates the caches: dead-code elimination would keep it
            fused += 1
        return PassResult(fused, f"{fused} layers" if fused else "")
