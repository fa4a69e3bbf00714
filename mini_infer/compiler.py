"""`compile_model`: capture a transformers causal LM and run the pass pipeline; `CompiledModel` holds the result.

This is the compiler's front door. It wires capture → passes → a callable graph, and owns verification
against the eager model. It never schedules requests or manages a KV cache (that is the runtime's job, using
the inputs and caches the passes declared on the context: `CompiledModel.input_specs` / `cache_specs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from mini_infer.contract import CacheSpec, InputSpec
from mini_infer.models.loader import shard_placeholders
from mini_infer.passes import GraphPass, PassContext, recommended_passes, resolve_passes
from mini_infer.passes.capture import capture
from mini_infer.passes.manager import PassManager, PassStats, check_pass_order, count_nodes, format_table


def logits_tolerance(dtype: torch.dtype, scale: float) -> float:
    """Allowed max |logits - eager|: 1e-4 of the logits' scale in fp32, 3e-2 in half precision."""
    rel = 1e-4 if dtype == torch.float32 else 3e-2
    return rel * max(scale, 1.0)


def tensor_bytes(tensors) -> int:
    """Bytes of distinct tensors (tied weights counted once)."""
    seen, total = set(), 0
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel()) if t.device.type != "meta" else id(t)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


class CompiledModel:
    """A captured and rewritten model: call it like the graph, read what the passes did and declared."""

    def __init__(self, gm: fx.GraphModule, ctx: PassContext, stats: list[PassStats], model_name: str = "") -> None:
        self.graph_module = gm
        self.context = ctx
        self.stats = stats
        self.config = ctx.config
        self.model_name = model_name
        self.input_names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        declared = set(ctx.input_specs) | {n for s in ctx.cache_specs for n in s.input_names()}
        undeclared = [n for n in self.input_names if n not in declared]
        if undeclared:
            raise ValueError(f"graph inputs {undeclared} were added without a declaration (InputSpec or CacheSpec)")

    @property
    def input_specs(self) -> list[InputSpec]:
        """The per-step inputs the runtime feeds (graph order), caches excluded."""
        return [self.context.input_specs[n] for n in self.input_names if n in self.context.input_specs]

    @property
    def cache_specs(self) -> list[CacheSpec]:
        return self.context.cache_specs

    @property
    def weight_bytes(self) -> int:
        """Bytes of the parameters and buffers the graph holds."""
        gm = self.graph_module
        return tensor_bytes([*gm.parameters(), *gm.buffers()])

    @property
    def logits_dtype(self) -> torch.dtype | None:
        """The dtype of the logits the graph returns (its first output, as capture and the passes recorded it in
        the node's meta), None where no pass left one."""
        out = next(n for n in reversed(self.graph_module.graph.nodes) if n.op == "output")
        first = out.args[0][0] if isinstance(out.args[0], (tuple, list)) else out.args[0]
        val = first.meta.get("val") if isinstance(first, fx.Node) else None
        return val.dtype if isinstance(val, torch.Tensor) else None

    def cache_bytes_per_token(self) -> int:
        """Cache bytes one token costs over every layer."""
        return sum(s.bytes_per_token() for s in self.cache_specs)

    def __call__(self, **inputs: torch.Tensor) -> torch.Tensor:
        """Run the graph; inputs by name (`input_ids`, `position_ids`, plus what the passes declared)."""
        missing = [n for n in self.input_names if n not in inputs]
        if missing:
            raise ValueError(f"missing graph inputs: {missing} (the graph takes {self.input_names})")
        with torch.inference_mode():
            return self.graph_module(*(inputs[n] for n in self.input_names))

    def example_inputs(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> dict:
        """Inputs that run `input_ids` ([1, T]) as one sequence from position 0."""
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        return self.context.example_inputs(input_ids, position_ids)

    def code(self) -> str:
        """The graph as readable Python."""
        return self.graph_module.print_readable(print_output=False, include_stride=False, include_device=False)

    def summary(self) -> str:
        """The per-pass table (matches, nodes before/after, time, error when verified), then what the graph
        holds: weight bytes, and the caches it declared with their bytes per token."""
        lines = [format_table(self.stats), "",
                 f"weights: {self.weight_bytes / 1e9:.3f} GB",
                 f"caches: {self.cache_bytes_per_token()} bytes per token over {len(self.cache_specs)} layer caches"]
        kinds: dict[str, int] = {}
        for s in self.cache_specs:
            kinds[type(s).__name__] = kinds.get(type(s).__name__, 0) + 1
        if kinds:
            first = {type(s).__name__: s for s in reversed(self.cache_specs)}
            lines += [f"  {n} x{c}: {first[n].describe()}" for n, c in kinds.items()]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"CompiledModel({self.model_name or type(self.config).__name__}, passes={self.context.applied})"


def _make_verifier(model: torch.nn.Module, device: torch.device, dtype: torch.dtype, num_tokens: int = 13,
                   seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (1, num_tokens), generator=gen).to(device)
    pos = torch.arange(num_tokens, device=device)[None]
    with torch.no_grad():
        ref = model(input_ids=ids, position_ids=pos, use_cache=False).logits.float()
    scale = ref.abs().max().item()

    def verify(gm: fx.GraphModule, ctx: PassContext) -> tuple[float, float]:
        # a lossy pass (quantization) widens the tolerance by the error it declares
        tol = logits_tolerance(dtype, scale) + ctx.info.get("approximation", 0.0) * max(scale, 1.0)
        inputs = ctx.example_inputs(ids, pos)
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        with torch.no_grad():
            out = gm(*(inputs[n] for n in names)).float()
        if out.shape[1] != ref.shape[1]:  # logits selected for the last token only
            return (out[:, -1] - ref[:, -1]).abs().max().item(), tol
        return (out - ref).abs().max().item(), tol

    return verify


def compile_model(model: torch.nn.Module, passes: Sequence[str | GraphPass] | None = None,
                  dump_dir: str | Path | None = None, verify: bool = False,
                  device: torch.device | str | None = None, model_name: str = "", *,
                  quantization: str | None = None, kv_cache_dtype: torch.dtype | None = None,
                  rank: int = 0, world_size: int = 1, expert_parallel: bool = False,
                  tokenizer: Any = None, max_positions: int | None = None) -> CompiledModel:
    """Capture `model` (a transformers causal LM) and rewrite it with `passes`.

    `passes` holds pass names and `GraphPass` instances with arguments (e.g. `QuantizeFP8(skip=["lm_head"])`),
    in stage order (capture → cleanup → sharding → quantization → fusion → attention → lowering; an out-of-order
    list, a repeated pass or a missing prerequisite is a ValueError naming the pass, before capture).
    `passes=None` runs the recommended pipeline for the model and options. `quantization`, `kv_cache_dtype`,
    `rank`, `world_size`, `expert_parallel` (MoE experts split whole over the ranks), `tokenizer` (for passes
    that calibrate on text) and `max_positions` (positions fed at run time are below it: the engine passes its
    max_model_len; None: the config's max_position_embeddings) reach the passes through the `PassContext`. `dump_dir` gets each pass's graph before
    and after plus a summary table. `verify=True` runs the eager model and the graph after every pass on the same
    tokens and raises PassError naming the first pass whose logits diverge beyond tolerance.
    The graph shares the model's weights until a pass replaces one; the caller should drop the model after
    compiling so that replaced weights are freed.
    """
    if verify and shard_placeholders(model):  # the eager reference would read placeholders, not weights
        raise ValueError("verify=True runs the eager model, but its sharded weights were loaded as per-rank "
                         "placeholders (load_model(..., tensor_parallel_size > 1)): load it with the default size")
    first = next(model.parameters())
    device = torch.device(device) if device is not None else first.device
    ctx = PassContext(config=model.config, device=device, dtype=first.dtype, rank=rank, world_size=world_size,
                      expert_parallel=expert_parallel, quantization=quantization, kv_cache_dtype=kv_cache_dtype,
                      tokenizer=tokenizer, max_positions=max_positions)
    pass_objs = recommended_passes(ctx) if passes is None else resolve_passes(passes)
    check_pass_order(pass_objs)  # an ordering mistake fails before the (slow) capture
    for p in pass_objs:  # and so does a config a pass cannot serve
        p.check_context(ctx)
    _check_options_served(ctx, pass_objs)
    manager = PassManager(pass_objs, dump_dir=dump_dir)
    gm = capture(model)
    captured_nodes = count_nodes(gm)
    ctx.info["capture_seconds"] = gm.meta.get("capture_seconds")
    manager.verifier = _make_verifier(model, device, first.dtype) if verify else None
    stats = manager.run(gm, ctx)
    unsliced = shard_placeholders(gm)
    if unsliced:
        raise ValueError(f"weights {unsliced[:4]} are shard placeholders that no pass sliced: the model was loaded "
                         f"for tensor parallelism; compile it with the sharding pass and its world size")
    capture_row = PassStats("capture", 0, 0, captured_nodes, ctx.info["capture_seconds"] or 0.0,
                            "torch.export (non-strict)")
    stats = [capture_row, *stats]
    bound = bind_kernels(gm, device)
    if bound.num_matches:
        stats.append(bound)
    return CompiledModel(gm, ctx, stats, model_name)


def _check_options_served(ctx: PassContext, passes: Sequence[GraphPass]) -> None:
    """A quantization mode must be implemented by a pass in the list, and a world size > 1 needs a sharding
    pass (never silently ignored)."""
    if ctx.world_size > 1 and not any(p.stage == "sharding" for p in passes):
        raise ValueError(f"world_size={ctx.world_size}: no sharding pass in the pipeline (add "
                         "'shard_tensor_parallel')")
    if ctx.quantization is None:
        return
    modes = {m for p in passes for m in p.quantization_modes}
    if ctx.quantization not in modes:
        from mini_infer.passes import PASSES

        known = sorted({m for cls in PASSES.values() for m in cls.quantization_modes})
        raise ValueError(f"quantization={ctx.quantization!r}: no pass in the pipeline implements it "
                         f"(modes the registered passes implement: {known or 'none'})")


def bind_kernels(gm: fx.GraphModule, device: torch.device, backend: str | None = None) -> PassStats:
    """Call each mini_infer op's kernel function directly instead of through the dispatcher.

    The op would run that same function (the torch reference on CPU, the Triton launcher on CUDA); the
    dispatcher and custom-op wrappers add about 80 us per call, ~15 ms per step of a 30-layer model, which
    on a GPU makes uncaptured steps host-bound. This runs after validation (kernels are not fake-tensor
    rules), so the graph was validated with the ops in it; dumps show the ops.
    """
    import time

    from mini_infer.ops import backend_for, kernel_impls

    start = time.perf_counter()
    backend = backend or backend_for(device)
    impls = kernel_impls(backend)
    n = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in impls:
            node.meta["op"] = node.target
            node.target = impls[node.target]
            n += 1
    gm.recompile()
    nodes = sum(1 for nd in gm.graph.nodes if nd.op not in ("placeholder", "output", "get_attr"))
    return PassStats("bind_kernels", n, nodes, nodes, time.perf_counter() - start,
                     f"ops call their {backend} kernels directly")
