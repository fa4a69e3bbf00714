"""RotaryTable: what the graph computes from `position_ids` alone (the rotary cos/sin) → a lookup in a table
computed once at compile time.

Every step, HF's rotary embedding recomputes its tables from the positions: `position_ids.float() * inv_freq`
(or a one-deep fp32 matmul), `cat((freqs, freqs), -1)`, `cos() * attention_scaling`, `sin() * ...`, a cast to
the model dtype (DeepSeek-V2: `polar` into complex freqs). This pass finds, structurally, the nodes whose only
non-constant input is the `position_ids` placeholder (parameters, buffers and input-free ops count as constants)
and takes the values other nodes read: walking back from each through pure re-views (view, unsqueeze, slice,
select, expand, view_as_real, same-dtype casts, ...) to the node that does the math (cos and sin, or the cast
after them; per-layer views of them stay in the graph, reading the lookup). Each such node is evaluated once on
positions 0 .. P-1 (P = `PassContext.max_positions`: the engine's `max_model_len`, else the config's
`max_position_embeddings`), on the target device with the graph's own ops, in one run, and replaced by
`aten.embedding(table [P, F], position_ids)` (plus a squeeze / unflatten where its shape needs it): one kernel
per table instead of the whole sub-graph, bit-equal to it. The tables are registered with
`PassContext.add_tensor`, so the graph owns them and `inv_freq` is dropped. Tables with equal contents (two
layers' copies) are shared, lookup included.

It must never give a different answer. A node is replaced only when (checked at compile time) its value is
per position: exactly one dimension is the token count, every dimension before it is 1, and the sub-graph run
on reversed positions, on a random draw with repeats and on the last position alone gives rows bit-equal to the
table's rows for those positions. A node that fails (HF's packed-sequence mask: `diff` / `cumsum` over the
positions, when the pass runs before `paged_attention`), a table above `max_table_bytes`, or an unknown P,
leaves that sub-graph alone and says why in the note. Views or casts of position_ids with no math are left.

It runs in the lowering stage, after the attention passes: `mla_latent_cache` reads HF's cos/sin producers to
tell cos from sin (and after `paged_attention` the mask's position math is gone); the rotary fusions read only
the cos/sin values, which are unchanged. It sets `PassContext.info[MAX_POSITIONS] = P`: a position at or past P
has no row (an IndexError on a CPU, a device-side assert on CUDA), so the engine refuses a `max_model_len` above
P (runtime/engine.py), and the runtime never feeds a position at or past `max_model_len`:
`sampling_params.check_context_length` rejects a prompt plus max_tokens longer than it, the engine ends a
sequence at it (`LLMEngine._reaches_length`), padded CUDA-graph rows hold 0 or an earlier step's positions,
and the activation profile's padding step uses position 0 (runtime/memory.py `padding_step`).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from mini_infer.contract.inputs import MAX_POSITIONS
from mini_infer.passes.base import GraphPass, PassContext, PassResult
from mini_infer.passes.pattern import CASTS, aten, is_op, val

# ops whose output is their one tensor input's values re-viewed (no arithmetic): walked through to the math
_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.unsqueeze.default,
          aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.expand.default, aten.slice.Tensor,
          aten.select.int, aten.transpose.int, aten.permute.default, aten.alias.default, aten.view_as_real.default,
          aten.view_as_complex.default, aten.unflatten.int, aten.flatten.using_ints)
_PROBE_DRAW = 61  # positions in the random probe (with repeats)
TABLE_PREFIX = "position_table_"  # the tables' names in the graph (buffers): what counts a token's one row of each
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass
class _Table:
    roots: list[fx.Node]  # the nodes it replaces (several when their values are equal)
    axis: int  # the token dimension of their shape
    after: tuple[int, ...]  # their dimensions after it
    rows: torch.Tensor  # [P, prod(after)]


def _is_cast(node: fx.Node) -> bool:
    return is_op(node, *CASTS)


def _re_views(node: fx.Node) -> bool:
    """`node` passes its input's values on unchanged: a view, a getitem, a cast to the same dtype."""
    if is_op(node, *_VIEWS) or (node.op == "call_function" and node.target is operator.getitem):
        return True
    src, out = val(node.args[0]) if node.args else None, val(node)
    return _is_cast(node) and isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor) \
        and src.dtype == out.dtype


def _deterministic(node: fx.Node) -> bool:
    tags = getattr(node.target, "tags", ())
    return not node.is_impure() and torch.Tag.nondeterministic_seeded not in tags


def position_only(graph: fx.Graph, pos: fx.Node) -> tuple[set[fx.Node], set[fx.Node]]:
    """(nodes computed from `pos` and constants only, constant nodes: parameters, buffers and what is computed
    from them and literals alone)."""
    derived: set[fx.Node] = set()
    const: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "get_attr":
            const.add(node)
        if node.op != "call_function" or not _deterministic(node):
            continue
        inputs = node.all_input_nodes
        if all(i in const for i in inputs):
            const.add(node)
        elif all(i is pos or i in derived or i in const for i in inputs) and \
                isinstance(val(node), (torch.Tensor, tuple, list)):
            derived.add(node)
    return derived, const


def _root(node: fx.Node, derived: set[fx.Node]) -> fx.Node | None:
    """The node doing the math under `node`'s re-views (None: it re-views position_ids itself)."""
    while node in derived and _re_views(node):
        inputs = [i for i in node.all_input_nodes if i in derived]
        if len(inputs) != 1:
            return node
        node = inputs[0]
    return node if node in derived else None


def _trivial(root: fx.Node, derived: set[fx.Node]) -> bool:
    """Only re-views and casts of position_ids above `root`: nothing to save."""
    stack, seen = [root], set()
    while stack:
        n = stack.pop()
        if n in seen or n not in derived:
            continue
        seen.add(n)
        if not (_re_views(n) or _is_cast(n)):
            return False
        stack.extend(n.all_input_nodes)
    return True


def _layout(node: fx.Node, tokens) -> tuple[int, tuple[int, ...]] | str:
    """(the token axis, the sizes after it) of a per-position shape, or why it is not one."""
    v = val(node)
    if not isinstance(v, torch.Tensor):
        return "not a tensor"
    sizes = tuple(v.shape)
    axes = [i for i, s in enumerate(sizes) if str(s) == str(tokens)]
    if len(axes) != 1:
        return f"shape {sizes} has {len(axes)} token dimensions"
    axis = axes[0]
    others = sizes[:axis] + sizes[axis + 1:]
    if not all(isinstance(s, int) for s in others) or any(s != 1 for s in sizes[:axis]):
        return f"shape {sizes}: not [1, .., T, static sizes]"
    return axis, tuple(sizes[axis + 1:])


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.is_complex():
        t = torch.view_as_real(t)
    t = t.contiguous()
    return t if t.dtype == torch.bool else t.view(_INT_OF_SIZE[t.element_size()])


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


class _Evaluator:
    """Runs the sub-graph under some nodes on given positions, with the graph's own ops and tensors."""

    def __init__(self, gm: fx.GraphModule, pos: fx.Node, derived: set[fx.Node], const: set[fx.Node],
                 targets: list[fx.Node]) -> None:
        needed, stack = set(), list(targets)
        while stack:
            n = stack.pop()
            if n not in needed and (n in derived or n in const):
                needed.add(n)
                stack.extend(n.all_input_nodes)
        self.gm, self.pos, self.targets = gm, pos, targets
        self.order = [n for n in gm.graph.nodes if n in needed]
        self.const = const
        self._consts: dict[fx.Node, object] = {}

    def run(self, positions: torch.Tensor) -> list[torch.Tensor]:
        env: dict[fx.Node, object] = {self.pos: positions, **self._consts}
        with torch.no_grad():
            for n in self.order:
                if n in env:
                    continue
                if n.op == "get_attr":
                    env[n] = PassContext.tensor_of(self.gm, n)
                else:
                    args, kwargs = fx.node.map_arg((n.args, n.kwargs), env.__getitem__)
                    env[n] = n.target(*args, **kwargs)
                if n in self.const:
                    self._consts[n] = env[n]
        return [env[t] for t in self.targets]


def _rows(value: torch.Tensor, axis: int) -> torch.Tensor:
    """[k, F]: row i the value at token i (every dimension before `axis` is 1)."""
    return value.reshape(value.shape[axis], -1)


def _fmt_bytes(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.1f} KB"


class RotaryTable(GraphPass):
    """Values computed from position_ids alone (rotary cos/sin) → embedding lookups in compile-time tables."""

    name = "rotary_table"
    stage = "lowering"
    requires = ("cleanup",)

    def __init__(self, max_table_bytes: int = 1 << 28) -> None:
        if not isinstance(max_table_bytes, int) or max_table_bytes < 0:
            raise self.invalid("max_table_bytes", max_table_bytes, "must be an int >= 0")
        self.max_table_bytes = max_table_bytes

    def apply(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        graph = gm.graph
        pos = next((n for n in graph.nodes if n.op == "placeholder" and n.name == "position_ids"), None)
        if pos is None or not isinstance(val(pos), torch.Tensor) or val(pos).dim() != 2:
            return PassResult(0, "no [1, T] position_ids input")
        derived, const = position_only(graph, pos)
        roots: list[fx.Node] = []
        for node in graph.nodes:  # the values read outside the position-only sub-graph, down to their math
            if node in derived and any(u not in derived for u in node.users):
                root = _root(node, derived)
                if root is not None and root not in roots and not _trivial(root, derived):
                    roots.append(root)
        if not roots:
            return PassResult(0)
        max_positions = ctx.max_positions
        if not max_positions or max_positions < 1:
            return PassResult(0, f"left {len(roots)}: table length unknown (PassContext.max_positions is None and "
                                 "the config has no max_position_embeddings)")
        left: list[str] = []
        layouts = {}
        for root in roots:
            layout = _layout(root, val(pos).shape[1])
            if isinstance(layout, str):
                left.append(f"{root.name} ({layout})")
            else:
                layouts[root] = layout
        tables = self._tables(gm, ctx, pos, derived, const, layouts, max_positions, left)
        for table in tables:
            self._replace(gm, ctx, pos, table)
        if tables:
            ctx.info[MAX_POSITIONS] = max_positions
        return PassResult(sum(len(t.roots) for t in tables), self._note(tables, left))

    def _tables(self, gm, ctx, pos, derived, const, layouts, p, left) -> list[_Table]:
        """Evaluate every candidate on positions 0 .. p-1 and on the probes; the per-position ones, by
        contents."""
        candidates = list(layouts)
        if not candidates:
            return []
        device = ctx.device
        evaluator = _Evaluator(gm, pos, derived, const, candidates)
        gen = torch.Generator().manual_seed(0)
        draw = torch.cat([torch.tensor([p - 1, 0]), torch.randint(0, p, (_PROBE_DRAW - 2,), generator=gen)])
        probes = [torch.arange(p - 1, -1, -1), draw, torch.tensor([p - 1])]
        try:
            full = evaluator.run(torch.arange(p, device=device)[None])
            outs = [evaluator.run(q.to(device)[None]) for q in probes]
        except Exception as exc:  # an op that cannot run on these positions: leave everything
            left.append(f"{len(candidates)} not evaluated ({type(exc).__name__}: {str(exc).splitlines()[0]})")
            return []
        tables: list[_Table] = []
        for i, root in enumerate(candidates):
            axis, after = layouts[root]
            value = full[i]
            if value.shape[axis] != p:
                left.append(f"{root.name} (gave {value.shape[axis]} rows for {p} positions)")
                continue
            rows = _rows(value, axis)
            if not all(_same_bits(_rows(out[i], axis), rows[q.to(rows.device)]) for q, out in zip(probes, outs)):
                left.append(f"{root.name} (not per position)")
                continue
            if rows.numel() * rows.element_size() > self.max_table_bytes:
                left.append(f"{root.name} ({_fmt_bytes(rows.numel() * rows.element_size())} > max_table_bytes)")
                continue
            same = next((t for t in tables if (t.axis, t.after) == (axis, after) and _same_bits(t.rows, rows)),
                        None)
            if same is not None:
                same.roots.append(root)
            else:
                tables.append(_Table([root], axis, after, rows.contiguous().clone()))
        return tables

    def _replace(self, gm: fx.GraphModule, ctx: PassContext, pos: fx.Node, table: _Table) -> None:
        """One embedding of the table by position_ids ([1, T, F]), reshaped to the roots' shape, for each root."""
        graph = gm.graph
        first = table.roots[0]
        weight = ctx.add_tensor(gm, f"{TABLE_PREFIX}{first.name}", table.rows, before=first)
        with graph.inserting_before(first):
            out = graph.call_function(aten.embedding.default, (weight, pos))  # [1, T, F]
            if not table.after:
                out = graph.call_function(aten.squeeze.dim, (out, -1))
            elif len(table.after) > 1:
                out = graph.call_function(aten.unflatten.int, (out, -1, list(table.after)))
            if table.axis == 0:
                out = graph.call_function(aten.squeeze.dim, (out, 0))
            for _ in range(table.axis - 1):
                out = graph.call_function(aten.unsqueeze.default, (out, 0))
        for root in table.roots:
            root.replace_all_uses_with(out)

    @staticmethod
    def _note(tables: list[_Table], left: list[str]) -> str:
        parts = []
        if tables:
            kinds: dict[str, int] = {}
            for t in tables:
                key = f"[{t.rows.shape[0]}, {t.rows.shape[1]}] {str(t.rows.dtype).removeprefix('torch.')}"
                kinds[key] = kinds.get(key, 0) + 1
            total = sum(t.rows.numel() * t.rows.element_size() for t in tables)
            if len(kinds) == 1:
                shapes = f"{len(tables)} table{'s' if len(tables) > 1 else ''} {next(iter(kinds))}"
            else:
                shapes = f"{len(tables)} tables: " + ", ".join(f"{c} x {k}" for k, c in kinds.items())
            parts.append(f"{shapes}, {_fmt_bytes(total)}")
        if left:
            parts.append("left " + "; ".join(left))
        return "; ".join(parts)
