"""What every graph pass shares: the `GraphPass` base class and its stages, its result, and the `PassContext`.

A pass is a small object with a `name`, a `stage`, optional constructor arguments (validated when it is built)
and `apply(gm, ctx) -> PassResult`; it rewrites the GraphModule in place and reports how many places it matched.
The context is the pass's window on everything beyond the graph: the model config, target device and dtype,
the distributed rank and world size (and whether MoE experts are split by expert parallelism), the
quantization mode and KV-cache dtype the user asked for, how many positions the runtime may feed
(`max_positions`), parameters by node, and the declarations the runtime reads as data — the graph inputs a
pass adds (`InputSpec`) and the caches its ops use (`CacheSpec`, see `mini_infer.contract`). Passes never import
the runtime.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from mini_infer.contract import CacheSpec, InputSpec, StepBatch
from mini_infer.contract.inputs import INPUT_IDS, POSITION_IDS

# Passes run in stages, in this order; a pass list is validated against it (see PassManager).
STAGES = ("capture", "cleanup", "sharding", "quantization", "fusion", "attention", "lowering")
# Fake sizes of the step dimensions other than the token count (validation only: no op's shape rule reads them).
_FAKE_DIMS = {"seqs": 4, "seqs+1": 5, "logits": 3, "blocks": 8}
FAKE_BLOCK_SIZE = 16  # block size of caches in fake values and in `example_inputs`


class PassConfigError(ValueError):
    """A pass was given an invalid argument; the message names the pass, the argument and the value."""


@dataclass
class PassResult:
    """What a pass did: the number of matches, and a free-form note for the summary table."""

    num_matches: int
    note: str = ""


@dataclass
class PassContext:
    """Everything a pass may read or declare beyond the graph itself."""

    config: Any
    device: torch.device
    dtype: torch.dtype
    rank: int = 0
    world_size: int = 1
    expert_parallel: bool = False  # MoE experts split whole over the ranks instead of inside (world_size > 1)
    quantization: str | None = None  # "w8a8", "fp8" or None
    kv_cache_dtype: torch.dtype | None = None  # None: the model dtype
    tokenizer: Any = None  # the model's tokenizer, if it has one (calibration prompts are text)
    # positions the runtime may feed are below this (the engine's max_model_len); None: the config's
    # max_position_embeddings, filled in when the context is made (still None if the config has none)
    max_positions: int | None = None
    input_specs: dict[str, InputSpec] = field(default_factory=lambda: {s.name: s for s in (INPUT_IDS, POSITION_IDS)})
    cache_specs: list[CacheSpec] = field(default_factory=list)
    declared_by: dict[str, str] = field(default_factory=dict)  # input or cache name -> pass that declared it
    applied: list[str] = field(default_factory=list)
    current_pass: str = ""
    info: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_positions is None:
            text = self.config.get_text_config() if hasattr(self.config, "get_text_config") else self.config
            self.max_positions = getattr(text, "max_position_embeddings", None)

    @property
    def cache_dtype(self) -> torch.dtype:
        """The dtype caches store (the KV-cache dtype if set, else the model dtype)."""
        return self.kv_cache_dtype or self.dtype

    # -- parameters and buffers by node -------------------------------------------------------------
    @staticmethod
    def tensor_of(gm: fx.GraphModule, node: fx.Node) -> torch.Tensor:
        """The parameter or buffer a `get_attr` node refers to."""
        if node.op != "get_attr":
            raise TypeError(f"node {node.name} is a {node.op}, not a get_attr (parameter/buffer)")
        obj: Any = gm
        for part in str(node.target).split("."):
            obj = getattr(obj, part)
        return obj

    @staticmethod
    def add_tensor(gm: fx.GraphModule, name: str, value: torch.Tensor, before: fx.Node) -> fx.Node:
        """Register `value` as a new buffer of `gm` (unique name) and return a get_attr node for it.

        A pass that derives a weight from others (merged, stacked, quantized, sharded) adds the result here and
        stops referring to the originals; the pass manager then drops every tensor no node refers to, so the
        graph owns one copy (see `drop_unused_tensors`)."""
        base = name.replace(".", "_")
        target, i = base, 0
        while hasattr(gm, target):
            i += 1
            target = f"{base}_{i}"
        gm.register_buffer(target, value)
        with gm.graph.inserting_before(before):
            node = gm.graph.get_attr(target)
        node.meta["val"] = value
        return node

    # -- declarations for the runtime ---------------------------------------------------------------
    def declare_input(self, spec: InputSpec) -> None:
        """Declare a graph input the runtime must feed every step (idempotent for an identical spec)."""
        old = self.input_specs.get(spec.name)
        if old is not None and (old.dtype, old.shape, old.pad) != (spec.dtype, spec.shape, spec.pad):
            raise ValueError(f"pass {self.current_pass!r} declares input {spec.name!r} as {spec}, but "
                             f"{self.declared_by.get(spec.name, 'capture')!r} declared it as {old}")
        if old is None:
            self.input_specs[spec.name] = spec
            self.declared_by[spec.name] = self.current_pass

    def declare_cache(self, spec: CacheSpec) -> None:
        """Declare a per-layer cache the runtime must allocate and pass in (by its tensors' names)."""
        taken = [n for n in spec.input_names() if n in self.declared_by or n in self.input_specs]
        if taken:
            raise ValueError(f"pass {self.current_pass!r}: cache inputs {taken} are already declared")
        self.cache_specs.append(spec)
        for n in spec.input_names():
            self.declared_by[n] = self.current_pass

    def add_input(self, gm: fx.GraphModule, spec: InputSpec) -> fx.Node:
        """Declare `spec` and return its placeholder (added after the last one, or the existing one)."""
        self.declare_input(spec)
        existing = _placeholder(gm, spec.name)
        if existing is not None:
            return existing
        sizes = tuple(_FAKE_DIMS.get(d, d) if not isinstance(d, int) else d for d in spec.shape)
        num_tokens = _placeholder(gm, "input_ids").meta["val"].shape[1]
        sizes = tuple(num_tokens if d == "tokens" else d for d in sizes)
        return _new_placeholder(gm, spec.name, sizes, spec.dtype)

    def add_cache(self, gm: fx.GraphModule, spec: CacheSpec) -> dict[str, fx.Node]:
        """Declare `spec` and add a placeholder for each of its tensors; returns them by name."""
        self.declare_cache(spec)
        nodes = {t.name: _new_placeholder(gm, t.name, (2, FAKE_BLOCK_SIZE, *t.shape), t.dtype)
                 for t in spec.tensors()}
        for name, value in spec.fixed_tensors().items():
            nodes[name] = _new_placeholder(gm, name, tuple(value.shape), value.dtype)
        return nodes

    def example_inputs(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """All graph inputs for running `input_ids` ([1, T]) as one sequence whose context is exactly these
        tokens (for verification and tests), built by the declared builders; caches are fresh and zeroed."""
        step = StepBatch.single_sequence(input_ids, position_ids, FAKE_BLOCK_SIZE)
        device = input_ids.device
        inputs = {name: spec.value(step).to(device) for name, spec in self.input_specs.items()}
        num_blocks = max(1, math.ceil(step.num_tokens / FAKE_BLOCK_SIZE))
        for spec in self.cache_specs:
            inputs.update(spec.allocate(num_blocks, FAKE_BLOCK_SIZE, device))
        return inputs


def _placeholder(gm: fx.GraphModule, name: str) -> fx.Node | None:
    return next((n for n in gm.graph.nodes if n.op == "placeholder" and n.name == name), None)


def _new_placeholder(gm: fx.GraphModule, name: str, sizes: tuple, dtype: torch.dtype) -> fx.Node:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    fake_mode = detect_fake_mode([p.meta["val"] for p in placeholders])
    device = placeholders[0].meta["val"].device  # the fakes' device (validation runs on CPU fakes)
    with gm.graph.inserting_after(placeholders[-1]):
        node = gm.graph.placeholder(name)
    if node.name != name:
        raise ValueError(f"graph input name {name!r} is taken by another node")
    with fake_mode:
        node.meta["val"] = torch.empty(sizes, dtype=dtype, device=device)
    return node


def replace_with_call(gm: fx.GraphModule, node: fx.Node, target, args: tuple) -> fx.Node:
    """Put `target(*args)` where `node` is and route `node`'s users to it (node is left for dead-code removal).
    The new node inherits `node`'s metadata (its fake value included), since it computes the same thing."""
    with gm.graph.inserting_before(node):
        new = gm.graph.call_function(target, tuple(args))
    new.meta.update(node.meta)
    node.replace_all_uses_with(new)
    return new


def erase_dead(gm: fx.GraphModule, owned: Callable[[fx.Node], bool], what: str) -> int:
    """Erase the nodes `owned` selects that no longer feed the graph's output, including in-place writes into dead
    tensors (e.g. HF's `index_put_` into a scratch buffer, `div_` of a dead top-k), which dead-code elimination keeps
    because they are impure. Such a write into a tensor that is still live is a ValueError naming the node and
    `what` was replaced: dropping it would change the result. Returns the number of nodes erased."""
    graph = gm.graph
    live: set[fx.Node] = set()
    stack = [graph.output_node()]
    while stack:
        node = stack.pop()
        if node not in live:
            live.add(node)
            stack.extend(node.all_input_nodes)
    erased = 0
    for node in reversed(list(graph.nodes)):
        if node in live or node.users or not owned(node):
            continue
        target = node.args[0] if node.args else None
        if node.is_impure() and isinstance(target, fx.Node) and target in live:
            raise ValueError(f"{node.name} ({node.target}) writes into the live tensor {target.name} in a replaced "
                             f"{what}; it cannot be dropped")
        graph.erase_node(node)
        erased += 1
    return erased


class GraphPass:
    """Base class of graph passes. Subclasses set `name`, `stage` (and `requires`) and implement `apply`.

    Arguments go to the subclass's `__init__`, which validates them (raise `self.invalid(...)`). The
    recommended pipeline builds each pass through `default_for(ctx)`: an instance configured from the context,
    or None when the pass has nothing to do for that model and options.
    """

    name: ClassVar[str] = ""
    stage: ClassVar[str] = "fusion"
    requires: ClassVar[tuple[str, ...]] = ()  # passes that must have run before this one
    quantization_modes: ClassVar[tuple[str, ...]] = ()  # values of `PassContext.quantization` it implements
    # error it may add to the logits by design, relative to their scale (quantization); verification against the
    # eager model allows the sum over the passes applied (`PassContext.info["approximation"]`); read after
    # `apply`, so a pass whose loss depends on the context (paged_attention with an fp8 cache) sets it there
    approximation: float = 0.0

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        raise NotImplementedError

    def check_context(self, ctx: PassContext) -> None:
        """Refuse, before capture, a model config or option this pass cannot serve (ValueError naming the field
        and its value), so that the user hears it before a capture that could fail on it less clearly.
        The default accepts everything; `apply` must still check what it relies on."""

    @classmethod
    def default_for(cls, ctx: PassContext) -> GraphPass | None:
        """The instance the recommended pipeline runs for `ctx` (None: leave this pass out)."""
        return cls()

    def invalid(self, argument: str, value: Any, why: str) -> PassConfigError:
        return PassConfigError(f"pass {self.name!r}: invalid {argument}={value!r}: {why}")

    def check_patterns(self, argument: str, value: Any) -> None:
        """PassConfigError unless `value` is a list (or tuple) of non-empty module-path pattern strings."""
        if isinstance(value, str) or not all(isinstance(p, str) and p for p in value):
            raise self.invalid(argument, value, "must be a list of non-empty module-path patterns")

    def arguments(self) -> dict[str, Any]:
        """The pass's settings (for its repr and the summary)."""
        return {k: v for k, v in vars(self).items() if not k.startswith("_")}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.arguments().items())
        return f"{type(self).__name__}({args})"
