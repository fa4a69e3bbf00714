"""ops/_triton_support.py: the programmatic-dependent-launch (PDL) contract every decode-path kernel keeps.

A kernel launched with `pdl_args` may start before the kernel ahead of it has finished; only `await_producers` at
its very start makes that safe (and keeps the chain transitive: a kernel that could finish before its producer
would release the next one too early). These tests read the ops' source: every @triton.jit kernel with a USE_GDC
parameter must wait first (directly, or through a jit body such as `gemv_program` that waits first; before the
wait only index arithmetic and loads of the weights, `w_ptr`, which no kernel writes: linear_add's preload), and
every launch that passes `pdl_args` must target such a kernel. On the CPU the arguments switch PDL off.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import mini_infer.ops as ops_pkg
from mini_infer.ops._triton_support import pdl_args

OPS_DIR = Path(ops_pkg.__file__).parent


def _jit_functions() -> dict[str, ast.FunctionDef]:
    """Every function decorated with `triton.jit` in mini_infer/ops, by name (names are unique there)."""
    found: dict[str, ast.FunctionDef] = {}
    for path in sorted(OPS_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(
                isinstance(d, ast.Attribute) and d.attr == "jit" for d in node.decorator_list
            ):
                assert node.name not in found, f"two jit functions named {node.name}"
                found[node.name] = node
    return found


# what may run before the wait: index arithmetic, and loads of the weights (`w_ptr`), which no kernel writes
_PRE_WAIT_TL = {"arange", "program_id", "load", "zeros", "full", "cdiv", "maximum", "minimum"}


def _body(fn: ast.FunctionDef) -> list[ast.stmt]:
    """The function's statements after its docstring."""
    return fn.body[1:] if isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant) else fn.body


def _weights_only(call: ast.Call) -> bool:
    """A call that may run before the wait: tl.<index op>, tl.load from an address built on w_ptr alone (the
    pointers it names), or a method such as `.to(...)` on such values."""
    func = call.func
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "tl":
        if func.attr not in _PRE_WAIT_TL:
            return False
        if func.attr == "load":
            ptrs = {n.id for n in ast.walk(call.args[0]) if isinstance(n, ast.Name) and n.id.endswith("_ptr")}
            return ptrs == {"w_ptr"}
        return True
    return isinstance(func, ast.Attribute)  # x.to(...), a[:, None] ... on values computed here


def _reaches_wait(stmts: list[ast.stmt], jit: dict[str, ast.FunctionDef]) -> bool:
    """Whether these statements call `await_producers` (directly or in a jit function they call first) before
    anything but weight loads and index arithmetic; an `if` must reach it on both branches."""
    for stmt in stmts:
        if isinstance(stmt, ast.If):
            return _reaches_wait(stmt.body, jit) and _reaches_wait(stmt.orelse, jit)
        if not isinstance(stmt, (ast.Expr, ast.Assign, ast.AnnAssign)) or stmt.value is None:
            return False
        calls = [n for n in ast.walk(stmt.value) if isinstance(n, ast.Call)]
        named = [c.func.id for c in calls if isinstance(c.func, ast.Name)]
        if "await_producers" in named:
            return True
        for name in named:
            if name not in jit:
                return False
            if _reaches_wait(_body(jit[name]), jit):
                return True  # a jit body that waits (after weight loads at most) before anything else
            return False
        if not all(_weights_only(c) for c in calls):
            return False
    return False


def _waits_first(name: str, jit: dict[str, ast.FunctionDef]) -> bool:
    return _reaches_wait(_body(jit[name]), jit)


def test_every_kernel_with_use_gdc_waits_first():
    jit = _jit_functions()
    with_flag = [n for n, f in jit.items() if any(a.arg == "USE_GDC" for a in f.args.args) and n != "await_producers"]
    assert len(with_flag) >= 20  # the decode path's kernels (GEMVs, attention, norms, MoE, MLA, quantization)
    late = [n for n in with_flag if not _waits_first(n, jit)]
    assert not late, f"kernels that take USE_GDC but do not start with await_producers: {late}"


def test_only_weight_loads_may_come_before_the_wait():
    """The rule above, checked on two small kernels: loading the weights before the wait is allowed (a preload:
    no kernel writes them), loading an activation is not."""
    src = """
@triton.jit
def ok(x_ptr, w_ptr, K, PRELOAD: tl.constexpr, USE_GDC: tl.constexpr):
    if PRELOAD:
        cols = tl.arange(0, 16)
        w = tl.load(w_ptr + cols, mask=cols < K, other=0.0)
        await_producers(USE_GDC)
    else:
        await_producers(USE_GDC)

@triton.jit
def early(x_ptr, w_ptr, USE_GDC: tl.constexpr):
    x = tl.load(x_ptr + tl.arange(0, 16))
    await_producers(USE_GDC)
"""
    jit = {f.name: f for f in ast.parse(src).body}
    assert _waits_first("ok", jit) and not _waits_first("early", jit)


def test_every_pdl_launch_targets_a_waiting_kernel():
    """Launch sites `kernel[grid](..., **pdl_args(x))`, and every `launch_gemv(kernel, ...)` /
    `launch_scaled_gemv(kernel, ...)` (launch_gemv adds pdl_args itself): the kernel (through aliases such as
    `_gemv_kernel = gemv_program`) takes USE_GDC. A kernel passed in a variable is checked where it is named."""
    jit = _jit_functions()
    takes_flag = {n for n, f in jit.items() if any(a.arg == "USE_GDC" for a in f.args.args)}
    trees = {path.name: ast.parse(path.read_text()) for path in sorted(OPS_DIR.glob("*.py"))}
    aliases = {t.id: v.value.id for tree in trees.values() for v in ast.walk(tree) if isinstance(v, ast.Assign)
               and isinstance(v.value, ast.Name) and v.value.id in jit for t in v.targets if isinstance(t, ast.Name)}
    launches = 0
    for name, tree in trees.items():
        for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
            pdl = any(k.arg is None and isinstance(k.value, ast.Call) and getattr(k.value.func, "id", "") == "pdl_args"
                      for k in call.keywords)
            launcher = getattr(call.func, "id", "")
            if isinstance(call.func, ast.Subscript) and pdl:  # kernel[grid](...)
                kernel = call.func.value.id
            elif launcher in ("launch_gemv", "launch_scaled_gemv") and call.args:
                kernel = call.args[0].id
            else:
                continue
            if kernel not in jit and kernel not in aliases:
                continue  # a launcher's kernel parameter
            launches += 1
            assert aliases.get(kernel, kernel) in takes_flag, f"{name}: {kernel} launched with PDL"
    assert launches >= 20


@pytest.mark.parametrize("env", [None, "0"])
def test_pdl_is_off_on_the_cpu(monkeypatch, env):
    if env is not None:
        monkeypatch.setenv("MINI_INFER_PDL", env)
    assert pdl_args(torch.zeros(1)) == {"USE_GDC": False}
