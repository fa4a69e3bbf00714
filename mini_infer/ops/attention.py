"""`mini_infer::attention`: causal attention over contiguous q / k / v, as Hugging Face's eager attention computes it.

The capture (passes/capture.py) routes a model whose class cannot run through `scaled_dot_product_attention` (Gemma 2:
its attention logits are soft-capped, which SDPA cannot express) through this op instead, so that its attention is
one graph node, as SDPA is for the others; so is GPT-OSS, whose class has no SDPA path: its attention sinks (HF's
`s_aux`) are this op's `sinks`. The PagedAttention pass replaces it with `paged_attention` (which takes the scale,
softcap, sliding window and sinks from it). Semantics (must not change; HF's `eager_attention_forward` with a
causal, optionally sliding-window mask; GPT-OSS's with its sinks):

    q [B, Hq, T, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv], Hq a multiple of Hkv (GQA: each kv head serves Hq / Hkv
    consecutive q heads), query row i at position S - T + i;
    w = (q @ k^T) * scale;  w = tanh(w / softcap) * softcap when softcap > 0;
    key j visible to row i when j <= S - T + i and, when sliding_window > 0, (S - T + i) - j < sliding_window;
    p = softmax(w over the visible keys, in fp32) in q's dtype;  out = p @ v  -> [B, Hq, T, Dv].
    sinks [Hq] (optional, any float dtype, taken in fp32): one more logit per query head in every row's softmax,
    whose probability is then dropped (its value is zero): p = softmax([w_visible..., sinks[h]])[:-1], i.e.
    out = out_without_sinks * sigmoid(lse - sinks[h]), lse the log-sum-exp of the row's visible logits.

There is no Triton kernel: compiled graphs never run this op (the attention pass replaces every node of it), and a
graph that keeps it (a pipeline without `paged_attention`) runs the plain-torch reference on any device. Imports
nothing from mini_infer outside `mini_infer.ops`.
"""

from __future__ import annotations

import torch

__all__ = ["attention", "attention_reference", "attention_triton"]


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, softcap: float,
                        sliding_window: int, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch, in HF eager attention's order of operations (see the module docstring)."""
    hq, hkv = q.shape[1], k.shape[1]
    if hq % hkv:
        raise ValueError(f"attention: {hq} query heads are not a multiple of {hkv} kv heads")
    if hq != hkv:
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
    w = torch.matmul(q, k.transpose(2, 3)) * scale
    if softcap > 0:
        w = torch.tanh(w / softcap) * softcap
    t, s = q.shape[2], k.shape[2]
    rows = torch.arange(t, device=q.device)[:, None] + (s - t)
    cols = torch.arange(s, device=q.device)[None, :]
    visible = cols <= rows
    if sliding_window > 0:
        visible = visible & (rows - cols < sliding_window)
    w = w.masked_fill(~visible, float("-inf"))
    if sinks is None:
        p = torch.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    else:  # GPT-OSS's eager code: the sink as one more logit of each row, its probability dropped (fp32 here)
        if sinks.shape != (q.shape[1],):
            raise ValueError(f"attention: sinks of shape {tuple(sinks.shape)}, expected ({q.shape[1]},) (one a "
                             f"query head)")
        sink = sinks.to(torch.float32).reshape(1, -1, 1, 1).expand(w.shape[0], -1, t, 1)
        combined = torch.cat([w.to(torch.float32), sink], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        p = torch.softmax(combined, dim=-1)[..., :-1].to(q.dtype)
    return torch.matmul(p, v)


# No kernel of its own (module docstring): on CUDA too the op runs the reference.
attention_triton = attention_reference


@torch.library.custom_op("mini_infer::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, softcap: float,
              sliding_window: int, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention as HF's eager code computes it (soft-capped logits, sliding window, attention sinks); see
    the module."""
    return attention_reference(q, k, v, scale, softcap, sliding_window, sinks)


@attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, softcap: float,
      sliding_window: int, sinks: torch.Tensor | None = None) -> torch.Tensor:
    return q.new_empty((q.shape[0], q.shape[1], q.shape[2], v.shape[3]))
