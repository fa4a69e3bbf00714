"""QuantizeW8A8: linears → int8 weights (per output channel, computed here) x int8 activations (per token, at run
time), with SmoothQuant folded into the producers of the activations first.

Each selected `aten.linear(x, W, b)` over parameter weights becomes
    x_q, x_scale = mini_infer.quantize_per_token(x, int8)      (one per distinct x: q/k/v share theirs)
    y = mini_infer.int8_linear(x_q, x_scale, W_q, w_scale, b, y.dtype)
with `W_q = round(W / w_scale)`, `w_scale = max|W[n, :]| / 127` (symmetric, per output channel, fp32). W_q and
w_scale are new buffers; W is no longer referenced, so the graph owns one copy (the pass manager drops W). The
quantize nodes are what `fuse_act_quant` later fuses into rms_norm / fused_add_rms_norm / silu_and_mul, and
`merge_projections` merges the int8 q/k/v and gate/up linears (weights and scales).

Selected: every linear over a 2-D parameter weight except those passes/keep_float.py keeps in float (the policy
quantize_fp8 shares): the lm_head (`lm_head=True` to include it), MoE routers (as vLLM does), the DeepSeek MLA
`kv_b_proj` that mla_latent_cache absorbs as a float weight, and the `skip` patterns (fnmatch on the module path,
e.g. `model.layers.0.mlp.down_proj`, matched whole or as a dotted suffix: `down_proj`, `layers.0.*`; a pattern
that matches no linear is refused). Linears of activations (MoE experts indexed from stacked weights) are not
touched. `embeddings=True` also stores the token embedding as int8 with one scale per row (a tied lm_head, if
quantized, shares the same int8 table and scales).

SmoothQuant (`smoothquant=True`, default; see smoothquant.py) runs the float graph on the `calibrate` prompts
(default: a small built-in English set, as text and through the chat template) and divides each smoothable input by
s = max|x|^alpha / max|W|^(1-alpha) (folded into the RMSNorm weight, or, for down_proj's input unless
`smooth_down_proj=False`, into up_proj's rows) while the weights take `W * s` before quantization. Measured on
SmolLM2-135M (bench/quant_quality.py): see bench/RESULTS.md.
Refused: an empty `calibrate`, alpha outside [0, 1], a skip pattern that matches nothing.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

import mini_infer.ops  # noqa: F401
from mini_infer.ops.quant import AMAX_FLOOR, QMAX
from mini_infer.passes.base import GraphPass, PassContext, PassResult, replace_with_call
from mini_infer.passes.keep_float import kept_in_float, linear_name
from mini_infer.passes.pattern import aten, is_op, val
from mini_infer.passes.smoothquant import (
    NormFold,
    activation_amax,
    calibration_ids,
    default_calibration,
    find_fold,
    smoothing_factors,
)

ops = torch.ops.mini_infer


def quantize_weight_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: (w_q [N, K] int8, scale [N] fp32) with w ~= w_q * scale[:, None]; rows
    are computed in fp32, a zero row gets w_q = 0 and a tiny scale."""
    wf = w.detach().float()
    scale = wf.abs().amax(dim=1).clamp_min(AMAX_FLOOR) / QMAX[torch.int8]
    w_q = (wf / scale[:, None]).round_().clamp_(-QMAX[torch.int8], QMAX[torch.int8]).to(torch.int8)
    return w_q, scale


def quantized_activation(graph: fx.Graph, cache: dict[fx.Node, tuple[fx.Node, fx.Node]], x: fx.Node,
                         dtype: torch.dtype, before: fx.Node) -> tuple[fx.Node, fx.Node]:
    """The (x_q, x_scale) nodes of `quantize_per_token(x, dtype)`, inserted before `before` on x's first use and
    taken from `cache` after that (one quantization per distinct input: q/k/v share theirs). quantize_w8a8 and
    quantize_fp8 both emit their activations this way, so fuse_act_quant, merge_projections and the GEMV fusions
    see one pattern."""
    if x not in cache:
        with graph.inserting_before(before):
            q = graph.call_function(ops.quantize_per_token.default, (x, dtype))
            cache[x] = (graph.call_function(operator.getitem, (q, 0)), graph.call_function(operator.getitem, (q, 1)))
    return cache[x]


@dataclass
class _Linear:
    node: fx.Node
    name: str  # module path, e.g. "model.layers.0.self_attn.q_proj"
    x: fx.Node
    weight: fx.Node
    bias: fx.Node | None


def _module_path(weight: fx.Node) -> str:
    path = str(weight.target).removesuffix(".weight")
    return path.removeprefix("model.")  # capture's wrapper holds the HF model as `model`


def find_linears(gm: fx.GraphModule) -> list[_Linear]:
    """Every `aten.linear` over a 2-D floating-point parameter weight (and parameter bias, if any), in graph
    order."""
    out = []
    for node in gm.graph.nodes:
        if not is_op(node, aten.linear.default):
            continue
        x, w = node.args[0], node.args[1]
        b = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        if not (isinstance(w, fx.Node) and w.op == "get_attr") or (b is not None and b.op != "get_attr"):
            continue
        t = PassContext.tensor_of(gm, w)
        if t.dim() == 2 and t.is_floating_point():
            out.append(_Linear(node, linear_name(node), x, w, b))
    return out


class QuantizeW8A8(GraphPass):
    """Linears → quantize_per_token + int8_linear with per-channel int8 weights; SmoothQuant folded in first."""

    name = "quantize_w8a8"
    stage = "quantization"
    requires = ("cleanup",)
    quantization_modes = ("w8a8",)
    # verification against eager allows 10% of the logits' scale after this pass: it catches a broken graph (an
    # error of the logits' own size), not a loss of quality, which bench/quant_quality.py measures on real weights
    approximation = 0.1

    def __init__(self, skip: list[str] | tuple[str, ...] = (), lm_head: bool = False, embeddings: bool = False,
                 smoothquant: bool = True, calibrate: list | tuple | None = None, alpha: float = 0.5,
                 smooth_down_proj: bool = True) -> None:
        self.check_patterns("skip", skip)
        if not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
            raise self.invalid("alpha", alpha, "must be a number in [0, 1]")
        if calibrate is not None:
            if isinstance(calibrate, str) or not isinstance(calibrate, (list, tuple)):
                raise self.invalid("calibrate", calibrate, "must be a list of prompts (strings or token-id lists)")
            if not calibrate:
                raise self.invalid("calibrate", calibrate, "is empty: SmoothQuant needs at least one calibration "
                                   "prompt (or pass smoothquant=False)")
            for p in calibrate:
                if not (isinstance(p, str) or (isinstance(p, (list, tuple)) and all(isinstance(t, int) for t in p))) \
                        or len(p) == 0:
                    raise self.invalid("calibrate", calibrate, f"prompt {p!r} is not a non-empty string or "
                                       "token-id list")
        self.skip = list(skip)
        self.lm_head = bool(lm_head)
        self.embeddings = bool(embeddings)
        self.smoothquant = bool(smoothquant)
        self.calibrate = list(calibrate) if calibrate is not None else None
        self.alpha = float(alpha)
        self.smooth_down_proj = bool(smooth_down_proj)

    @classmethod
    def default_for(cls, ctx: PassContext) -> GraphPass | None:
        return cls() if ctx.quantization == "w8a8" else None

    # -- selection ------------------------------------------------------------------------------------------
    def select(self, gm: fx.GraphModule, linears: list[_Linear]) -> list[_Linear]:
        """The linears to quantize (all but those keep_float keeps in float); PassConfigError naming a skip pattern
        that matches no linear."""
        kept = kept_in_float(gm, [lin.node for lin in linears], self, self.skip, self.lm_head)
        return [lin for lin in linears if lin.node not in kept]

    # -- the pass -------------------------------------------------------------------------------------------
    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        linears = find_linears(gm)
        chosen = self.select(gm, linears)
        biases = {lin.node: PassContext.tensor_of(gm, lin.bias) for lin in linears if lin.bias is not None}
        before = sum(PassContext.tensor_of(gm, lin.weight).nbytes for lin in chosen)
        cols: dict[fx.Node, torch.Tensor] = {}  # SmoothQuant factors: weight columns times, rows divided by
        rows: dict[fx.Node, torch.Tensor] = {}
        smooth_note = self._smooth(gm, ctx, linears, chosen, cols, rows, biases) if self.smoothquant and chosen \
            else ""
        graph = gm.graph
        act: dict[fx.Node, tuple[fx.Node, fx.Node]] = {}  # x -> (x_q, x_scale)
        shared: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}  # quantized unscaled weights by storage
        after = 0
        for lin in chosen:
            x = lin.node.args[0]  # not lin.x: an input made by a linear rewritten above is now its int8_linear
            x_q, x_scale = quantized_activation(graph, act, x, torch.int8, lin.node)
            w = PassContext.tensor_of(gm, lin.weight)
            if lin.node in cols or lin.node in rows:  # one fp32 copy at a time, freed once quantized
                w_q, w_scale = quantize_weight_int8(_scaled(w, cols.get(lin.node), rows.get(lin.node)))
            else:
                key = _storage_key(w)
                if key not in shared:
                    shared[key] = quantize_weight_int8(w)
                w_q, w_scale = shared[key]
            after += w_q.nbytes + w_scale.nbytes
            wq_node = ctx.add_tensor(gm, f"{lin.name}.qweight", w_q, before=lin.node)
            ws_node = ctx.add_tensor(gm, f"{lin.name}.weight_scale", w_scale, before=lin.node)
            bias = lin.bias
            if lin.node in biases and biases[lin.node] is not PassContext.tensor_of(gm, lin.bias):
                bias = ctx.add_tensor(gm, f"{lin.name}.bias", biases[lin.node], before=lin.node)
            out_dtype = val(lin.node).dtype
            replace_with_call(gm, lin.node, ops.int8_linear.default,
                              (x_q, x_scale, wq_node, ws_node, bias, out_dtype))
        emb_note = self._quantize_embeddings(gm, ctx, shared) if self.embeddings else ""
        note = f"{len(chosen)} of {len(linears)} linears int8 ({before / 1e6:.2f} -> {after / 1e6:.2f} MB)"
        return PassResult(len(chosen), "; ".join(n for n in (note, smooth_note, emb_note) if n))

    def _smooth(self, gm: fx.GraphModule, ctx: PassContext, linears: list[_Linear], chosen: list[_Linear],
                cols: dict, rows: dict, biases: dict) -> str:
        """Calibrate, then plan the SmoothQuant folds: each smoothed linear's column factors go in `cols`, up_proj
        row factors (down_proj's input) in `rows` and its bias in `biases` (in its dtype); smoothed norms, and
        float linears whose rows changed, are repointed at new tensors here. All factors come from the original
        weights (each fold is exact, so the order does not matter)."""
        chosen_nodes = {lin.node for lin in chosen}
        groups: dict[fx.Node, list[_Linear]] = {}
        for lin in chosen:
            groups.setdefault(lin.x, []).append(lin)
        folds = {}
        for x in groups:
            if set(x.users) <= chosen_nodes:  # every reader of x takes the smoothed weights
                fold = find_fold(x)
                if fold is not None and (self.smooth_down_proj or isinstance(fold, NormFold)):
                    folds[x] = fold
        if not folds:
            return "SmoothQuant: no input to smooth"
        prompts = self.calibrate if self.calibrate is not None else default_calibration(ctx.tokenizer)
        vocab = ctx.config.get_text_config().vocab_size
        ids = calibration_ids(prompts, ctx.tokenizer, vocab)
        amax = activation_amax(gm, ctx, set(folds), ids)
        by_node = {lin.node: lin for lin in linears}
        head = next(n for n in gm.graph.nodes if n.op != "placeholder")  # where the captured weights are read:
        # fusions may move a norm above its current place (fuse_rmsnorm puts fused_add_rms_norm at the add)
        for x, fold in folds.items():
            group = groups[x]
            s = smoothing_factors(amax[x], [PassContext.tensor_of(gm, lin.weight) for lin in group], self.alpha)
            for lin in group:
                cols[lin.node] = s
            if isinstance(fold, NormFold):
                w = PassContext.tensor_of(gm, fold.weight)
                new = ctx.add_tensor(gm, f"{fold.weight.target}.smoothed", (w.detach().float() / s).to(w.dtype),
                                     before=head)
                fold.norm.replace_input_with(fold.weight, new)
                continue
            up = fold.up
            rows[up] = s
            if up in biases:
                biases[up] = (biases[up].detach().float() / s).to(biases[up].dtype)
        for up in [n for n in rows if n not in chosen_nodes]:  # a skipped up_proj carries down_proj's factors
            lin = by_node[up]
            w = PassContext.tensor_of(gm, lin.weight)
            scaled = _scaled(w, cols.get(up), rows[up]).to(w.dtype)
            up.replace_input_with(lin.weight, ctx.add_tensor(gm, f"{lin.name}.weight_smoothed", scaled, before=up))
            if lin.bias is not None:
                up.replace_input_with(lin.bias, ctx.add_tensor(gm, f"{lin.name}.bias_smoothed", biases[up],
                                                               before=up))
        tokens = sum(t.shape[1] for t in ids)
        kinds = sum(isinstance(f, NormFold) for f in folds.values())
        return (f"SmoothQuant alpha={self.alpha}: {len(folds)} inputs smoothed ({kinds} into norms, "
                f"{len(folds) - kinds} into up_proj) on {len(ids)} prompts / {tokens} tokens")

    def _quantize_embeddings(self, gm: fx.GraphModule, ctx: PassContext, shared: dict) -> str:
        """Token embedding tables → int8 rows with one fp32 scale each, dequantized after the lookup."""
        graph = gm.graph
        n = 0
        for node in list(graph.nodes):
            if not is_op(node, aten.embedding.default) or node.args[0].op != "get_attr":
                continue
            w = PassContext.tensor_of(gm, node.args[0])
            if w.dim() != 2 or not w.is_floating_point():
                continue
            key = _storage_key(w)
            if key not in shared:
                shared[key] = quantize_weight_int8(w)
            w_q, scale = shared[key]
            name = _module_path(node.args[0])
            wq_node = ctx.add_tensor(gm, f"{name}.qweight", w_q, before=node)
            ws_node = ctx.add_tensor(gm, f"{name}.weight_scale", scale, before=node)
            with graph.inserting_before(node):
                rows = graph.call_function(aten.embedding.default, (wq_node, *node.args[1:]))
                col = graph.call_function(aten.unsqueeze.default, (ws_node, -1))
                scales = graph.call_function(aten.embedding.default, (col, *node.args[1:]))
                deq = graph.call_function(aten.mul.Tensor, (
                    graph.call_function(aten._to_copy.default, (rows,), {"dtype": torch.float32}), scales))
                out = graph.call_function(aten._to_copy.default, (deq,), {"dtype": w.dtype})
            node.replace_all_uses_with(out)
            n += 1
        return f"{n} embedding tables int8" if n else ""


def _scaled(w: torch.Tensor, col: torch.Tensor | None, row: torch.Tensor | None) -> torch.Tensor:
    """`w * col[None, :] / row[:, None]` in fp32 (a factor None: 1)."""
    wf = w.detach().float()
    if col is not None:
        wf = wf * col[None, :]
    if row is not None:
        wf = wf / row[:, None]
    return wf


def _storage_key(t: torch.Tensor) -> tuple:
    """Identity of a tensor's data (tied weights share it): quantize once, store once."""
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.dtype)
