"""ops/_triton_support.py: the programmatic-dependent-launch (PDL) contract every decode-path kernel keeps.

A kernel launched with `pdl_args` may start before the kernel ahead of it has finished; only `await_producers` at
its very start makes that safe (and keeps the chain transitive: a kernel that could finish before its producer
would release the next one too early). These tests read the ops' source: every @triton.jit kernel with a USE_GDC
parameter must wait first (directly, or through a jit body such as `gemv_program` that waits first; before the
wait only index arithmetic and loads of the weights, `w_ptr`, which no kernel writes: linear_add's preload, or of
what a kernel declares in PRE_WAIT_POINTERS below), and every launch that passes `pdl_args` must target such a
kernel. On the CPU the arguments switch PDL off.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import mini_infer.ops as ops_pkg
from mini_infer.ops._triton_support import pdl_args
from tests.ops.helpers import run_uninterpreted

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


# what may run before the wait: index arithmetic (loops of it too), and loads of the weights (addresses built on
# `w_ptr` and what is derived from it, also through jit helpers), which no kernel writes
_PRE_WAIT_TL = {"arange", "program_id", "load", "zeros", "full", "cdiv", "maximum", "minimum", "where", "sum"}
# pointers besides w_ptr that a kernel loads before its wait, and why no kernel of the step writes what it loads:
PRE_WAIT_POINTERS = {
    # the step's lengths and block tables are inputs copied before the step's graph; of the caches, only key
    # positions older than the step's keys (kpos < new0: an earlier step's writes) are loaded there, which the op
    # tests check by value (a preloaded new key would be stale), not this source check
    "_paged_attn_kernel": {"qsl_ptr", "seq_lens_ptr", "bt_ptr", "kc_ptr", "vc_ptr"},
    # (MOE_PRELOAD, launched so only for the down GEMM and the slot sum) the routing's outputs, the align
    # step's pair rows / block experts / padded count and the expert map: two or more kernels back (the kernel just
    # before a down GEMM is its call's gate/up GEMM, which writes only the A operand; before a slot sum, the down
    # GEMM, which writes only its src); b_ptr is the expert weights
    "_moe_gemm_kernel": {"b_ptr", "sorted_ptr", "block_expert_ptr", "num_padded_ptr", "weight_ptr", "map_ptr"},
    "_moe_sum_kernel": {"ids_ptr", "map_ptr"},
}
WAITS, PURE, UNSAFE = "waits", "pure", "unsafe"


def _body(fn: ast.FunctionDef) -> list[ast.stmt]:
    """The function's statements after its docstring."""
    return fn.body[1:] if isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant) else fn.body


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _weight_address(expr: ast.AST, weights: set[str]) -> bool:
    """An address built on the weights: it names one of them and no other pointer (`*_ptr`)."""
    names = _names(expr)
    return bool(names & weights) and not {n for n in names if n.endswith("_ptr")} - weights


def _before_wait(stmts: list[ast.stmt], jit: dict[str, ast.FunctionDef], weights: set[str]) -> str:
    """WAITS if these statements call `await_producers` (directly or inside a jit function they call) before
    anything but index arithmetic and weight loads; PURE if they end (or return) having done only those; else
    UNSAFE. An `if` (a constexpr branch) must be WAITS on both sides, or PURE on both."""
    for stmt in stmts:
        if isinstance(stmt, ast.If):
            sides = {_before_wait(stmt.body, jit, weights), _before_wait(stmt.orelse, jit, weights)}
            if sides == {WAITS}:
                return WAITS
            if sides != {PURE}:
                return UNSAFE
            continue
        if isinstance(stmt, ast.For):  # a loop of index arithmetic and allowed loads (no wait inside a loop)
            bounds = [c for c in _calls(stmt.iter) if getattr(c.func, "id", "") != "range"]
            if _before_wait(stmt.body, jit, weights) != PURE or any(_call_ok(c, jit, weights) != PURE for c in bounds):
                return UNSAFE
            continue
        if isinstance(stmt, ast.Return):
            return PURE if stmt.value is None or all(_call_ok(c, jit, weights) == PURE for c in _calls(stmt.value)) \
                else UNSAFE
        if not isinstance(stmt, (ast.Expr, ast.Assign, ast.AnnAssign)) or stmt.value is None:
            return UNSAFE
        results = {_call_ok(c, jit, weights) for c in _calls(stmt.value)}
        if UNSAFE in results:
            return UNSAFE
        if WAITS in results:
            return WAITS
        if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and _names(stmt.value) & weights:
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            weights = weights | {n for t in targets for n in _names(t)}
    return PURE


def _calls(node: ast.AST) -> list[ast.Call]:
    return [n for n in ast.walk(node) if isinstance(n, ast.Call)]


def _call_ok(call: ast.Call, jit: dict[str, ast.FunctionDef], weights: set[str]) -> str:
    func = call.func
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "tl":
        if func.attr not in _PRE_WAIT_TL:
            return UNSAFE
        return PURE if func.attr != "load" or _weight_address(call.args[0], weights) else UNSAFE
    if isinstance(func, ast.Name):
        name = func.id
    elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.attr in jit:
        name = func.attr  # a helper of another ops module (`_split_k.key_tile(...)`)
    else:
        return PURE if isinstance(func, ast.Attribute) else UNSAFE  # x.to(...) on values computed here
    if name == "await_producers":
        return WAITS
    if name not in jit:
        return UNSAFE
    fn = jit[name]
    params = [a.arg for a in fn.args.args]
    inner = {p for p, arg in zip(params, call.args) if _weight_address(arg, weights)}
    return _before_wait(_body(fn), jit, inner)


def _waits_first(name: str, jit: dict[str, ast.FunctionDef]) -> bool:
    return _before_wait(_body(jit[name]), jit, {"w_ptr", *PRE_WAIT_POINTERS.get(name, ())}) == WAITS


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


def test_declared_inputs_and_helpers_before_the_wait():
    """A pointer a kernel declares in PRE_WAIT_POINTERS may be loaded before the wait, also in a loop and through a
    jit helper named through its module; an undeclared one may not, even through such a helper; a store may not."""
    src = """
@triton.jit
def find(lens_ptr, n):
    lo = n * 0
    for _ in range(4):
        lo = tl.where(tl.load(lens_ptr + lo) < n, lo + 1, lo)
    return lo

@triton.jit
def _paged_attn_kernel(lens_ptr, x_ptr, n, USE_GDC: tl.constexpr):
    lo = _split_k.find(lens_ptr, n)
    await_producers(USE_GDC)

@triton.jit
def undeclared(lens_ptr, x_ptr, n, USE_GDC: tl.constexpr):
    lo = _split_k.find(x_ptr, n)
    await_producers(USE_GDC)

@triton.jit
def stores(lens_ptr, x_ptr, n, USE_GDC: tl.constexpr):
    tl.store(lens_ptr, n)
    await_producers(USE_GDC)
"""
    jit = {f.name: f for f in ast.parse(src).body}
    declared = dict(PRE_WAIT_POINTERS)
    try:
        PRE_WAIT_POINTERS.update(_paged_attn_kernel={"lens_ptr"}, undeclared={"lens_ptr"}, stores={"lens_ptr"})
        assert _waits_first("_paged_attn_kernel", jit)
        assert not _waits_first("undeclared", jit) and not _waits_first("stores", jit)
    finally:
        PRE_WAIT_POINTERS.clear()
        PRE_WAIT_POINTERS.update(declared)


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


# Files whose launches never let the next kernel launch before their wait (PDL_TRIGGER_FIRST): the MoE ones. After
# them a kernel may load, before its wait, what a kernel two or more back wrote (PRE_WAIT_POINTERS: the down GEMM
# and the slot sum load the routing's outputs), which is safe only while the kernel just before it lets it launch
# after its own wait (_triton_support's docstring); the kernels just before those loaders are MoE kernels.
NO_TRIGGER_FIRST = {"fused_moe.py", "fused_moe_mxfp4.py", "_moe_gemv.py", "moe_topk.py"}
STEP_WRITTEN_PRE_WAIT = {"_moe_gemm_kernel", "_moe_sum_kernel"}  # of PRE_WAIT_POINTERS: loads the step writes


def test_moe_launches_never_trigger_first():
    """Every `pdl_args` call in the MoE files passes trigger_first=False, and the kernels that load step-written
    tensors before their wait are launched only there."""
    assert STEP_WRITTEN_PRE_WAIT <= set(PRE_WAIT_POINTERS)
    calls, launched_elsewhere = 0, set()
    for path in sorted(OPS_DIR.glob("*.py")):
        for call in (n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call)):
            if getattr(call.func, "id", "") == "pdl_args" and path.name in NO_TRIGGER_FIRST:
                calls += 1
                assert any(k.arg == "trigger_first" and isinstance(k.value, ast.Constant) and k.value.value is False
                           for k in call.keywords), f"{path.name}:{call.lineno}: pdl_args without trigger_first=False"
            elif isinstance(call.func, ast.Subscript) and getattr(call.func.value, "id", "") in STEP_WRITTEN_PRE_WAIT:
                if path.name not in NO_TRIGGER_FIRST:
                    launched_elsewhere.add(f"{path.name}:{call.func.value.id}")
    assert calls >= 9 and not launched_elsewhere, launched_elsewhere


def test_trigger_first_only_where_allowed(monkeypatch):
    """On a PDL-capable GPU, pdl_args asks for the wait first unless PDL_TRIGGER_FIRST is on and the launch allows
    the other order."""
    from types import SimpleNamespace

    from mini_infer.ops import _triton_support as ts

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("MINI_INFER_PDL", raising=False)
    monkeypatch.setattr(ts, "_pdl_capable", lambda index: True)
    gpu = SimpleNamespace(is_cuda=True, device=SimpleNamespace(index=0))
    monkeypatch.setattr(ts, "PDL_TRIGGER_FIRST", False)
    assert ts.pdl_args(gpu) == {"USE_GDC": True, "launch_pdl": True}
    monkeypatch.setattr(ts, "PDL_TRIGGER_FIRST", True)
    assert ts.pdl_args(gpu) == {"USE_GDC": ts.TRIGGER_FIRST, "launch_pdl": True}
    assert ts.pdl_args(gpu, trigger_first=False) == {"USE_GDC": True, "launch_pdl": True}


def test_trigger_first_orders_the_ptx():
    """The sm_90 build of a kernel launched with each USE_GDC order (tests/ops/compile_pdl_sm90.py): the wait, then
    the next kernel's launch allowed; or, with TRIGGER_FIRST, the other way round."""
    report = run_uninterpreted(["-m", "tests.ops.compile_pdl_sm90"])
    assert {case["name"]: case["order"] for case in report["cases"]} == {
        "wait_first": ["wait", "launch_dependents"], "trigger_first": ["launch_dependents", "wait"]}


def test_cuda_index_is_the_device_s_own_or_the_current_one(monkeypatch):
    """`cuda_index` (what pdl_args, the split counts and the all-reduce's buffers key on) takes a device's own index,
    and for a bare `cuda` the current device's."""
    from mini_infer.ops import _triton_support

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 5)
    assert _triton_support.cuda_index(torch.device("cuda", 3)) == 3
    assert _triton_support.cuda_index(torch.device("cuda", 0)) == 0
    assert _triton_support.cuda_index(torch.device("cuda")) == 5
