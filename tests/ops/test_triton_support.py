"""ops/_triton_support.py: the programmatic-dependent-launch (PDL) contract every decode-path kernel keeps.

A kernel launched with `pdl_args` may start before the kernel ahead of it has finished; only `await_producers` at
its very start makes that safe (and keeps the chain transitive: a kernel that could finish before its producer
would release the next one too early). These tests read the ops' source: every @triton.jit kernel with a USE_GDC
parameter must wait first (directly, or through a jit body such as `gemv_program` that waits first), and every
launch that passes `pdl_args` must target such a kernel. On the CPU the arguments switch PDL off.
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


def _first_call(fn: ast.FunctionDef) -> str | None:
    """The name called by the first statement after the docstring, if that statement is a bare call."""
    body = fn.body[1:] if isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant) else fn.body
    stmt = body[0]
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) and isinstance(stmt.value.func, ast.Name):
        return stmt.value.func.id
    return None


def _waits_first(name: str, jit: dict[str, ast.FunctionDef]) -> bool:
    called = _first_call(jit[name])
    return called == "await_producers" or (called in jit and _waits_first(called, jit))


def test_every_kernel_with_use_gdc_waits_first():
    jit = _jit_functions()
    with_flag = [n for n, f in jit.items() if any(a.arg == "USE_GDC" for a in f.args.args) and n != "await_producers"]
    assert len(with_flag) >= 20  # the decode path's kernels (GEMVs, attention, norms, MoE, MLA, quantization)
    late = [n for n in with_flag if not _waits_first(n, jit)]
    assert not late, f"kernels that take USE_GDC but do not start with await_producers: {late}"


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
