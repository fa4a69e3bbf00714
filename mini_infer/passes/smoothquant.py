"""SmoothQuant helpers for the quantization passes: calibrate linear inputs, compute smoothing factors, find where
the activations' 1/s folds.

SmoothQuant (Xiao et al., 2022, arXiv:2211.10438) moves the difficulty of quantizing activations with outlier
channels into the weights: for `y = x @ W.T`, `y = (x / s) @ (W * s).T` for any positive per-input-channel `s`,
and with `s_c = max|x_c|^alpha / max|W[:, c]|^(1 - alpha)` both `x / s` and `W * s` quantize well. The division
must cost nothing at run time, so it is folded into the op that produces `x`:
  - an RMSNorm (`weight * normed`, the pre-fusion form `fuse_rmsnorm` matches): its weight becomes `weight / s`
    (q/k/v after input_layernorm, gate/up after post_attention_layernorm, DeepSeek's q_b after q_a_layernorm);
  - a SwiGLU product `silu(gate(h)) * up(h)` feeding down_proj: up's output rows (and bias) are divided by `s`,
    which divides the product by `s` exactly (down_proj's input, smoothed through up_proj).
Every fold is exact in real arithmetic, so statistics taken once on the float graph stay valid while several folds
are applied. An input is smoothed only when all its users are linears being quantized (the fold changes the value
every user sees); o_proj is not smoothed (its input comes out of attention: a fold into v_proj would have to tie the
factors of the query heads sharing a KV head).

Calibration runs the float graph on token ids (text prompts through the model's tokenizer, and through its chat
template too by default; with no tokenizer, the text's UTF-8 bytes taken as ids, which only random-weight presets
lack a tokenizer for) under an fx Interpreter that records each watched node's per-channel abs-max. A channel the
calibration never saw large gets a small s and is amplified at run time: calibrate on text of the form the model
will be served. This module computes and matches; the pass rewrites.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from mini_infer.chat_template import chat_prompt_ids
from mini_infer.passes.base import PassContext
from mini_infer.passes.fuse_rmsnorm import match_rms_norm
from mini_infer.passes.pattern import VIEWS, aten, is_op, only_user, shape

# A few short English texts of different kinds (prose, dialogue, code, lists, numbers): what an instruction model
# sees. Written for this project; kept short so that calibration costs a few forward passes at start-up.
DEFAULT_CALIBRATION_PROMPTS: tuple[str, ...] = (
    "The committee met on Tuesday to review the budget, and after a long discussion it agreed to fund the new "
    "library wing, provided that construction starts before the end of the year.",
    "User: Can you explain why the sky looks blue during the day but red at sunset?\nAssistant: Sunlight is "
    "scattered by the molecules of the air, and shorter wavelengths scatter much more strongly.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
    "Ingredients: 2 cups of flour, 1 teaspoon of salt, 3 eggs, 250 ml of milk. Whisk the eggs and milk, then "
    "fold in the flour slowly until the batter is smooth.",
    "In 1969, Apollo 11 landed on the Moon. Neil Armstrong and Buzz Aldrin spent about two and a half hours "
    "outside the lunar module, collecting 21.5 kg of samples.",
    "Dear Maria, thank you for your letter. I am sorry to hear about the delay; the shipment should arrive by "
    "Friday, and I will call you as soon as it does. Best regards, Tom",
    "Photosynthesis converts light energy into chemical energy: plants take in carbon dioxide and water and "
    "release oxygen, storing the energy in sugars such as glucose.",
    "Q: What is 17 times 23? A: 17 times 23 is 391. Q: And the square root of 144? A: It is 12.",
)

def default_calibration(tokenizer) -> list[str | list[int]]:
    """The built-in prompts as text and, when the tokenizer has a chat template, also as a user turn through it:
    an instruct model is served in that form, and its first tokens (the template's `<|im_start|>system ...`)
    carry activations that plain text never shows (SmolLM2's down_proj input: a max error 1.7x larger when
    calibrated on plain text only)."""
    prompts: list[str | list[int]] = list(DEFAULT_CALIBRATION_PROMPTS)
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        prompts += [chat_prompt_ids(tokenizer, [{"role": "user", "content": p}]) for p in DEFAULT_CALIBRATION_PROMPTS]
    return prompts


_EPS = 1e-5  # floor of the amax values in the factor (as SmoothQuant's reference code)


def calibration_ids(prompts: Sequence[str | Sequence[int]], tokenizer, vocab_size: int) -> list[torch.Tensor]:
    """Each prompt as token ids [1, T]: text through `tokenizer` (or, without one, its UTF-8 bytes mod the
    vocabulary), id lists as given; ValueError naming the prompt that is empty or has ids out of range."""
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            ids = list(tokenizer(p).input_ids) if tokenizer is not None else [b % vocab_size for b in p.encode()]
        else:
            ids = [int(t) for t in p]
        if not ids:
            raise ValueError(f"calibration prompt {i} ({p!r}) has no tokens")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"calibration prompt {i}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        out.append(torch.tensor([ids]))
    return out


class _AbsMaxRecorder(fx.Interpreter):
    """Runs the graph, keeping the running per-channel (last dim) abs-max of the watched nodes' values."""

    def __init__(self, gm: fx.GraphModule, watch: set[fx.Node]) -> None:
        super().__init__(gm)
        self.watch = watch
        self.amax: dict[fx.Node, torch.Tensor] = {}

    def run_node(self, n: fx.Node):
        out = super().run_node(n)
        if n in self.watch:
            a = out.detach().abs().reshape(-1, out.shape[-1]).amax(0).float()
            prev = self.amax.get(n)
            self.amax[n] = a if prev is None else torch.maximum(prev, a)
        return out


def activation_amax(gm: fx.GraphModule, ctx: PassContext, watch: set[fx.Node],
                    prompts: list[torch.Tensor]) -> dict[fx.Node, torch.Tensor]:
    """Per-channel max |value| of each node in `watch` over the calibration prompts (each run as one sequence
    with the graph inputs the passes so far declared)."""
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    rec = _AbsMaxRecorder(gm, watch)
    with torch.inference_mode():
        for ids in prompts:
            ids = ids.to(ctx.device)
            inputs = ctx.example_inputs(ids, torch.arange(ids.shape[1], device=ctx.device)[None])
            rec.run(*(inputs[n] for n in names))
    return rec.amax


def smoothing_factors(act_amax: torch.Tensor, weights: Sequence[torch.Tensor], alpha: float) -> torch.Tensor:
    """s = max|x|^alpha / max|W|^(1 - alpha) per input channel (fp32), the weight max taken over every linear
    reading x; 1 where a channel is all zero in the calibration or the weights (nothing to balance)."""
    w_amax = torch.stack([w.detach().abs().amax(0).float() for w in weights]).amax(0)
    act = act_amax.to(w_amax.device)
    s = act.clamp_min(_EPS).pow(alpha) / w_amax.clamp_min(_EPS).pow(1.0 - alpha)
    return torch.where((act > 0) & (w_amax > 0), s, torch.ones_like(s))


@dataclass
class NormFold:
    """x is `weight * normed` (an RMSNorm, possibly seen through views): 1/s goes into the norm weight."""

    norm: fx.Node  # the mul node
    weight: fx.Node  # its weight get_attr


@dataclass
class UpProjFold:
    """x is `silu(gate) * up` with `up` a linear read only there: 1/s goes into up's output rows (and bias)."""

    up: fx.Node  # the aten.linear node


def find_fold(x: fx.Node) -> NormFold | UpProjFold | None:
    """Where a per-channel division of `x` (along its last dim) can be folded exactly, or None."""
    node = x
    while is_op(node, *VIEWS) and len(node.args[0].users) == 1:  # views that keep the channel dim
        parent = node.args[0]
        ps, xs = shape(parent), shape(x)
        if ps is None or xs is None or str(ps[-1]) != str(xs[-1]):
            return None
        node = parent
    m = match_rms_norm(node)
    if m is not None:
        return NormFold(node, m[1])
    if is_op(node, aten.mul.Tensor) and len(node.args) == 2 and all(isinstance(a, fx.Node) for a in node.args):
        for act, up in (node.args, node.args[::-1]):
            if is_op(act, aten.silu.default) and is_op(up, aten.linear.default) and only_user(up, node) \
                    and isinstance(up.args[1], fx.Node) and up.args[1].op == "get_attr" \
                    and str(shape(up)[-1]) == str(shape(x)[-1]):
                return UpProjFold(up)
    return None


__all__ = ["DEFAULT_CALIBRATION_PROMPTS", "NormFold", "UpProjFold", "activation_amax", "calibration_ids",
           "default_calibration", "find_fold", "smoothing_factors"]
