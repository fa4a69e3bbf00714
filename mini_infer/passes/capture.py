"""Capture: a transformers causal LM → a plain FX GraphModule in the packed token layout.

The graph takes `input_ids [1, T]` and `position_ids [1, T]` (all tokens of a step in one row, T dynamic) and
returns `logits [1, T, vocab]`; transformers runs with `use_cache=False`, so the graph holds no cache of its own
(the attention pass adds the paged one). We use torch.export in non-strict mode, the route of TensorRT-LLM's
AutoDeploy: it traces the HF Python code as is, keeps aten-level ops such as `scaled_dot_product_attention` visible
for pattern matching, and gives every node fake-tensor metadata with a symbolic T. A model whose class cannot run
through SDPA, or whose attention logits are soft-capped (which SDPA would drop), but that takes any registered
attention function (Gemma 2; GPT-OSS, whose attention sinks, HF's `s_aux`, become the node's `sinks`) runs, for the
export only, through `ATTENTION_FUNCTION`, which makes each attention one `mini_infer.attention` node
(ops/attention.py) for the attention pass to find; the model's own setting is restored after. An explicit mask, a
non-causal module and dropout are refused naming the module. This module captures only; rewriting is the passes'
job.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch
import torch.fx as fx
from torch.export import Dim
from torch.nn.attention import SDPBackend, sdpa_kernel

DEFAULT_MAX_TOKENS = 1 << 16
ATTENTION_FUNCTION = "mini_infer"  # the name under which transformers' AttentionInterface knows _attention_node


class CaptureError(RuntimeError):
    """The model could not be captured; the message names the module and op when they are known."""


class _PackedCausalLM(torch.nn.Module):
    """Calls the HF model in the packed layout and returns only the logits."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits


def _attention_node(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                    softcap: float | None = None, sliding_window: int | None = None,
                    **kwargs) -> tuple[torch.Tensor, None]:
    """An HF attention function (transformers' AttentionInterface signature): causal attention as one
    `mini_infer.attention` node, output [B, T, H, Dv] as HF's attention functions return it. No mask arrives (the
    name has no mask function registered, so HF builds none): causality and the window are the op's. GPT-OSS's
    attention sinks (`s_aux`, one logit a query head) are the op's last argument, given only when the model has
    them (the node of a model without is as before)."""
    name = type(module).__name__
    if attention_mask is not None or not getattr(module, "is_causal", True):
        raise CaptureError(f"{name}: only causal attention without an explicit mask can be captured")
    if dropout:
        raise CaptureError(f"{name}: attention dropout {dropout} (the model is in training mode)")
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    sinks = kwargs.get("s_aux")
    args = (query, key, value, scale, float(softcap or 0.0), int(sliding_window or 0))
    out = torch.ops.mini_infer.attention(*args, *(() if sinks is None else (sinks,)))
    return out.transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def _capturable_attention(model: torch.nn.Module) -> Iterator[None]:
    """Run `model` through `_attention_node` while the block runs when its class takes a registered attention
    function and it is not set to SDPA (its class cannot take it, or the user loaded it eager) or its config caps
    the attention logits (SDPA would drop the cap); else leave it as it is."""
    current = getattr(model.config, "_attn_implementation", None)
    capped = bool(getattr(model.config.get_text_config(), "attn_logit_softcapping", None))
    if (current == "sdpa" and not capped) or not getattr(type(model), "_supports_attention_backend", False):
        yield
        return
    from transformers import AttentionInterface

    import mini_infer.ops  # noqa: F401 - registers mini_infer.attention

    AttentionInterface.register(ATTENTION_FUNCTION, _attention_node)
    model.set_attn_implementation(ATTENTION_FUNCTION)
    try:
        yield
    finally:
        model.set_attn_implementation(current)


def _plain_graph_module(ep: torch.export.ExportedProgram) -> fx.GraphModule:
    """ExportedProgram → GraphModule with a plain `forward(input_ids, position_ids)` signature."""
    gm = ep.module()
    gm._forward_pre_hooks.clear()  # export's input checks: the runtime feeds every token count
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            graph.erase_node(node)
    if hasattr(gm, "_guards_fn"):
        delattr(gm, "_guards_fn")
    graph._codegen = fx.graph.CodeGen()
    out = graph.output_node()
    if isinstance(out.args[0], (tuple, list)) and len(out.args[0]) == 1:
        out.args = (out.args[0][0],)
    gm.recompile()
    return gm


def _describe_failure(model: torch.nn.Module, exc: Exception) -> str:
    text = str(exc)
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        self_obj = tb.tb_frame.f_locals.get("self")
        if isinstance(self_obj, torch.nn.Module) and self_obj is not model:
            frames.append(f"{type(self_obj).__name__} ({code.co_filename}:{tb.tb_lineno})")
        tb = tb.tb_next
    where = f" in module {frames[-1]}" if frames else ""
    return f"could not capture {type(model).__name__}{where}: {type(exc).__name__}: {text[:2000]}"


def capture(model: torch.nn.Module, example_num_tokens: int = 8,
            max_num_tokens: int = DEFAULT_MAX_TOKENS) -> fx.GraphModule:
    """Export `model` (a transformers causal LM) into a GraphModule with a dynamic token dimension.

    The result's parameters and buffers are the model's own tensors (no copy); node `meta["val"]` holds
    fake tensors with a symbolic token count.
    """
    if not hasattr(model, "config") or not callable(getattr(model, "forward", None)):
        raise CaptureError(f"{type(model).__name__} is not a transformers model (it has no config)")
    device = next(model.parameters()).device
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, min(vocab, 100), (1, example_num_tokens), device=device)
    pos = torch.arange(example_num_tokens, device=device)[None]
    start = time.perf_counter()
    ep = None
    # First a named dim; guards export cannot prove over the whole range (CUDA's stride reasoning emits
    # some that hold for every T >= 1) become runtime asserts instead of errors. Failing that, Dim.AUTO, and
    # then we check that T stayed symbolic: a graph specialized to the example's T is refused.
    attempts = (Dim("num_tokens", min=1, max=max_num_tokens), Dim.AUTO)
    for i, tokens in enumerate(attempts):
        try:
            # The math SDPA backend: CUDA's fused backends check alignment on T and would guard it away
            # (the attention pass replaces SDPA anyway).
            with torch.no_grad(), sdpa_kernel([SDPBackend.MATH]), _capturable_attention(model):
                ep = torch.export.export(
                    _PackedCausalLM(model), (ids, pos),
                    dynamic_shapes={"input_ids": {1: tokens}, "position_ids": {1: tokens}}, strict=False,
                    prefer_deferred_runtime_asserts_over_guards=True,
                )
            break
        except Exception as exc:  # report what and where, never fall back silently to eager
            if i == len(attempts) - 1 or "Constraints violated" not in str(exc):
                raise CaptureError(_describe_failure(model, exc)) from exc
    in_val = next(n for n in ep.graph.nodes if n.op == "placeholder" and n.name.endswith("input_ids")).meta["val"]
    if isinstance(in_val.shape[1], int):
        raise CaptureError(f"could not capture {type(model).__name__} with a dynamic token count: export "
                           f"specialized it to {in_val.shape[1]}")
    gm = _plain_graph_module(ep)
    from mini_infer.passes.manager import _signature

    for node in gm.graph.nodes:  # export's fake values are current: later propagation starts from them
        node.meta["_sig"] = _signature(node)
    gm.meta["capture_seconds"] = time.perf_counter() - start
    gm.meta["model_config"] = model.config
    return gm
