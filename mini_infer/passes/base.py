"""What every graph pass shares: the `GraphPass` base class, its result, and the `PassContext`.

A pass is a small object with a `name` and `apply(gm, ctx) -> PassResult`; it rewrites the GraphModule in
place and reports how many places it matched. The context is the pass's window on everything beyond the
graph: the model config, target device and dtype, parameters by node, the KV-cache layout the runtime must
allocate, and the extra graph inputs a pass adds (with a builder of example values for verification).
Passes never import the runtime.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.fx as fx


@dataclass
class PassResult:
    """What a pass did: the number of matches, and a free-form note for the summary table."""

    num_matches: int
    note: str = ""


@dataclass(frozen=True)
class KVCacheSpec:
    """One attention layer's paged cache, as the pass that inserted it declares it.

    The runtime allocates `[num_blocks, block_size, num_kv_heads, head_size]` for K and
    `[..., head_size_v]` for V, and passes them as the graph inputs named `k_input` / `v_input`.
    `sliding_window` (tokens) lets the runtime free blocks that fall out of the window.
    """

    layer_idx: int
    k_input: str
    v_input: str
    num_kv_heads: int
    head_size: int
    head_size_v: int
    dtype: torch.dtype
    sliding_window: int | None = None

    def bytes_per_token(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.num_kv_heads * (self.head_size + self.head_size_v) * itemsize


# Builds an example value for an extra graph input from the verification inputs
# (input_ids [1, T], position_ids [1, T], treated as one sequence starting at position 0).
InputBuilder = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class PassContext:
    """Everything a pass may read or declare beyond the graph itself."""

    config: Any
    device: torch.device
    dtype: torch.dtype
    kv_cache_specs: list[KVCacheSpec] = field(default_factory=list)
    extra_inputs: dict[str, InputBuilder] = field(default_factory=dict)
    applied: list[str] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)

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
        """Register `value` as a new buffer of `gm` (unique name) and return a get_attr node for it."""
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
    def declare_kv_cache(self, spec: KVCacheSpec) -> None:
        self.kv_cache_specs.append(spec)

    def declare_input(self, name: str, builder: InputBuilder) -> None:
        """Declare an extra graph input the runtime must feed, with an example builder for verify."""
        self.extra_inputs[name] = builder

    def example_inputs(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """All graph inputs for running `input_ids` as a single sequence (for verification and tests)."""
        inputs = {"input_ids": input_ids, "position_ids": position_ids}
        for name, build in self.extra_inputs.items():
            inputs[name] = build(input_ids, position_ids)
        return inputs


def replace_with_call(gm: fx.GraphModule, node: fx.Node, target, args: tuple) -> fx.Node:
    """Put `target(*args)` where `node` is and route `node`'s users to it (node is left for dead-code removal).
    The new node inherits `node`'s metadata (its fake value included), since it computes the same thing."""
    with gm.graph.inserting_before(node):
        new = gm.graph.call_function(target, tuple(args))
    new.meta.update(node.meta)
    node.replace_all_uses_with(new)
    return new


class GraphPass:
    """Base class of graph passes. Subclasses set `name` (and `requires`) and implement `apply`."""

    name: ClassVar[str] = ""
    requires: ClassVar[tuple[str, ...]] = ()  # passes that must have run before this one

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        raise NotImplementedError

    def uuid(self) -> str:
        """A stable hash of the pass's source and settings (for compiled-graph cache keys)."""
        src = inspect.getsource(type(self))
        state = repr(sorted(vars(self).items()))
        return hashlib.sha256((src + state).encode()).hexdigest()[:16]

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
