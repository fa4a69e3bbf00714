"""The pass manager: the one place that orders passes, cleans and validates the graph after each one,
records what each did, writes graph dumps, and (with verify) finds the first pass that changes the output.

It runs passes; it must not contain pass logic of its own beyond generic cleanup (dead code).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode

from mini_infer.passes.base import STAGES, GraphPass, PassContext


class PassError(RuntimeError):
    """A pass failed, broke the graph, or changed the model's output; the message names the pass."""


@dataclass
class PassStats:
    """One row of the summary table."""

    name: str
    num_matches: int
    nodes_before: int
    nodes_after: int
    seconds: float
    note: str = ""
    max_abs_err: float | None = None


def _describe(v) -> str:
    if isinstance(v, torch.Tensor):
        return f"T({v.dtype},{v.device},{tuple(v.shape)},{v.stride()})"
    if isinstance(v, (tuple, list)):
        return "(" + ",".join(_describe(x) for x in v) + ")"
    return repr(v)


def _signature(node: fx.Node) -> tuple:
    """What determines a node's metadata: its op and its inputs' metadata (not their identity), so a pass
    that swaps in an input with the same metadata leaves the node's value valid."""
    args = fx.node.map_arg((node.args, node.kwargs), lambda n: _describe(n.meta.get("val")))
    return (node.op, node.target, repr(args))


def _fake_on(mode: FakeTensorMode, v, device: torch.device):
    """A fake tensor with v's shape (symbols kept), strides and dtype on `device`."""
    if not isinstance(v, torch.Tensor) or v.device == device:
        return v
    with mode:
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=device)


def _linear_meta(x, w, b=None):
    out = torch.matmul(x, w.t())
    return out + b if b is not None else out


def _sdpa_meta(q, k, v, *args, **kwargs):
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


def _in_place_meta(x, *args, **kwargs):
    return x


# Shape rules for composite ops whose fake kernels, in some torch versions, call numel() on symbolic sizes, and for
# in-place ops whose decomposition copies on the device, which a CPU-only torch cannot fake for CUDA (transformers
# 5.17's MoE routing clamps its expert ids in place).
_SHAPE_RULES = {
    torch.ops.aten.linear.default: _linear_meta,
    torch.ops.aten.scaled_dot_product_attention.default: _sdpa_meta,
    torch.ops.aten.clamp_.default: _in_place_meta,
}


def _run_fake(node: fx.Node, mode: FakeTensorMode, args, kwargs):
    from torch._dispatch.python import enable_python_dispatcher

    with enable_python_dispatcher(), mode:  # as export traces: composite ops see symbolic sizes
        try:
            return node.target(*args, **kwargs)
        except RuntimeError:
            rule = _SHAPE_RULES.get(node.target)
            if rule is None:
                raise
            return rule(*args, **kwargs)


def propagate_fake(gm: fx.GraphModule, device: torch.device | str | None = None, incremental: bool = True) -> int:
    """Shape-propagate `gm` on fake tensors of `device` (symbolic token count kept); returns the nodes run.

    Validation runs on the device the graph will run on (default: the device of its input values): an op's
    rules can differ by device (transformers' MoE path feeds `histc` int32 on CUDA, which has no CPU kernel).
    Composite ops whose fake kernels reject symbolic sizes on some devices, and in-place ops that a CPU-only torch
    cannot fake for CUDA, fall back to `_SHAPE_RULES`.
    With `incremental`, a node is re-run only if it is new or its signature (op and the metadata of its
    inputs, updated in topological order) changed since it last ran; every node still ends up with a `val`
    derived from its current inputs, so the whole graph is validated at the cost of what a pass touched.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    vals = [n.meta.get("val") for n in placeholders]
    missing = [n.name for n, v in zip(placeholders, vals) if v is None]
    if missing:
        raise PassError(f"graph inputs without fake values: {missing}")
    mode = detect_fake_mode(vals) or FakeTensorMode()
    target = torch.device(device) if device is not None else next(
        (v.device for v in vals if isinstance(v, torch.Tensor)), torch.device("cpu"))
    if target.type == "cuda" and target.index is None:
        target = torch.device("cuda", 0)
    if any(isinstance(v, torch.Tensor) and v.device != target for v in vals):
        incremental = False  # values of another device: move every one
    for n, v in zip(placeholders, vals):
        n.meta["val"] = _fake_on(mode, v, target)

    def on_target(a):
        return target if isinstance(a, torch.device) else a

    attr_cache = gm.meta.setdefault("_fake_attrs", {})
    ran = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        sig = _signature(node)
        if incremental and node.meta.get("_sig") == sig and "val" in node.meta:
            continue
        ran += 1
        if node.op == "get_attr":
            real = PassContext.tensor_of(gm, node)
            key = (node.target, id(real), target)
            if key not in attr_cache:
                attr_cache[key] = _fake_on(mode, mode.from_tensor(real, static_shapes=True), target)
            new_val = attr_cache[key]
        elif node.op == "call_function":
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
            args, kwargs = torch.utils._pytree.tree_map(on_target, (args, kwargs))
            try:
                new_val = _run_fake(node, mode, args, kwargs)
            except Exception as exc:
                raise PassError(f"shape propagation failed at node {node.name} ({node.target}): "
                                f"{type(exc).__name__}: {str(exc).splitlines()[0]}") from exc
        else:
            raise PassError(f"node {node.name}: unsupported op kind {node.op!r} in a flat graph")
        node.meta["val"] = new_val
        node.meta["_sig"] = sig
    return ran


def drop_unused_tensors(gm: fx.GraphModule) -> int:
    """Delete parameters and buffers no `get_attr` node refers to (weights a pass replaced); returns how many.

    The graph then holds the only reference the compiled model keeps to each weight it uses: with the HF
    model released (the engine does that after compiling), replaced weights are freed."""
    used = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    names = [name for name, _ in gm.named_parameters(remove_duplicate=False)] + \
        [name for name, _ in gm.named_buffers(remove_duplicate=False)]
    dropped = 0
    for name in names:
        if name in used:
            continue
        owner_path, _, attr = name.rpartition(".")
        owner = gm.get_submodule(owner_path) if owner_path else gm
        if attr in owner._parameters:
            del owner._parameters[attr]
        elif attr in owner._buffers:
            del owner._buffers[attr]
        else:
            continue
        dropped += 1
    if dropped:
        gm.meta.pop("_fake_attrs", None)
    return dropped


def count_nodes(gm: fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr"))


def clean_and_validate(gm: fx.GraphModule, device: torch.device | None = None) -> None:
    """Drop dead code and unused weights, lint, recompile, re-propagate fake tensors on `device`. Raises on a
    broken graph."""
    gm.graph.eliminate_dead_code()
    gm.delete_all_unused_submodules()
    drop_unused_tensors(gm)
    gm.graph.lint()
    gm.recompile()
    propagate_fake(gm, device)


def write_graph(gm: fx.GraphModule, path: Path) -> None:
    path.write_text(gm.print_readable(print_output=False, include_stride=False, include_device=False))


def format_table(stats: Sequence[PassStats]) -> str:
    """The per-pass summary table as aligned text."""
    has_err = any(s.max_abs_err is not None for s in stats)
    head = ["pass", "matches", "nodes before", "nodes after", "ms"] + (["max |err|"] if has_err else []) + ["note"]
    rows = [head]
    for s in stats:
        row = [s.name, str(s.num_matches), str(s.nodes_before), str(s.nodes_after), f"{s.seconds * 1e3:.1f}"]
        if has_err:
            row.append("" if s.max_abs_err is None else f"{s.max_abs_err:.2e}")
        rows.append(row + [s.note])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def check_pass_order(passes: Sequence[GraphPass], already_applied: Sequence[str] = ()) -> None:
    """The one ordering rule: stages in `STAGES` order, each pass once, every `requires` met earlier."""
    seen: list[str] = list(already_applied)
    stage_of = {name: i for i, name in enumerate(STAGES)}
    order = [q.name for q in passes]
    last = None
    for p in passes:
        if p.stage not in stage_of:
            raise ValueError(f"pass {p.name!r} has unknown stage {p.stage!r}; stages: {' -> '.join(STAGES)}")
        if last is not None and stage_of[p.stage] < stage_of[last.stage]:
            raise ValueError(f"pass {p.name!r} (stage {p.stage!r}) is listed after {last.name!r} (stage "
                             f"{last.stage!r}); stages run in the order {' -> '.join(STAGES)}; order given: {order}")
        if p.name in seen:
            raise ValueError(f"pass {p.name!r} is listed twice (or already ran); order given: {order}")
        missing = [r for r in p.requires if r not in seen]
        if missing:
            raise ValueError(f"pass {p.name!r} requires {missing} to run before it; order given: {order}")
        seen.append(p.name)
        last = p


# verify(gm, ctx) -> max abs error of the logits against eager, and the tolerance
Verifier = Callable[[fx.GraphModule, PassContext], tuple[float, float]]


class PassManager:
    """Runs an ordered list of passes over a GraphModule."""

    def __init__(self, passes: Sequence[GraphPass], dump_dir: str | Path | None = None,
                 verifier: Verifier | None = None) -> None:
        self.passes = list(passes)
        self.dump_dir = Path(dump_dir) if dump_dir is not None else None
        self.verifier = verifier

    def check_order(self, already_applied: list[str]) -> None:
        """Raise ValueError naming the pass if the list is out of stage order, repeats a pass, or runs a pass
        before one it requires."""
        check_pass_order(self.passes, already_applied)

    def run(self, gm: fx.GraphModule, ctx: PassContext) -> list[PassStats]:
        """Apply every pass in order, in place. Returns one PassStats per pass."""
        self.check_order(ctx.applied)
        stats: list[PassStats] = []
        if self.dump_dir is not None:
            self.dump_dir.mkdir(parents=True, exist_ok=True)
            write_graph(gm, self.dump_dir / "00_captured.txt")
        for i, p in enumerate(self.passes, start=1):
            before = count_nodes(gm)
            if self.dump_dir is not None:
                write_graph(gm, self.dump_dir / f"{i:02d}_{p.name}.before.txt")
            start = time.perf_counter()
            ctx.current_pass = p.name
            try:
                result = p.apply(gm, ctx)
            except Exception as exc:
                raise PassError(f"pass {p.name!r} failed: {type(exc).__name__}: {exc}") from exc
            ctx.current_pass = ""
            try:
                clean_and_validate(gm, ctx.device)
            except Exception as exc:
                raise PassError(f"pass {p.name!r} left an invalid graph: {type(exc).__name__}: {exc}") from exc
            seconds = time.perf_counter() - start
            ctx.applied.append(p.name)
            if p.approximation:
                ctx.info["approximation"] = ctx.info.get("approximation", 0.0) + p.approximation
            row = PassStats(p.name, result.num_matches, before, count_nodes(gm), seconds, result.note)
            if self.verifier is not None:
                err, tol = self.verifier(gm, ctx)
                row.max_abs_err = err
                if not err <= tol:
                    stats.append(row)
                    raise PassError(f"pass {p.name!r} changed the model's output: max |logits - eager| = {err:.3e} "
                                    f"> tolerance {tol:.1e} (the passes before it, {ctx.applied[:-1]}, agreed)")
            stats.append(row)
            if self.dump_dir is not None:
                write_graph(gm, self.dump_dir / f"{i:02d}_{p.name}.after.txt")
        if self.dump_dir is not None:
            (self.dump_dir / "summary.txt").write_text(format_table(stats) + "\n")
        return stats
