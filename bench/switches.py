"""Kernel switches for benchmark A/Bs (shared by bench/latency.py and bench/throughput.py): a module attribute of
mini_infer, or one field of a dict attribute (a launch-shape table such as paged_attention's `_CONFIG`), set for
the block in which an engine is built (its CUDA graphs captured), then restored. Benchmarks only: nothing in
mini_infer imports this."""

from __future__ import annotations

import contextlib
import importlib
import os
import re

# module.ATTR, or module.ATTR[key][field]... (dict entries; keys are strings, or ints where they read as ints)
_TARGET = re.compile(r"^(?P<mod>[A-Za-z_][\w.]*)\.(?P<attr>[A-Za-z_]\w*)(?P<keys>(\[[^\[\]]+\])*)$")


_MISSING = object()  # a dict entry the switch added (removed again on the way out)


def _restore(table: dict, key, old) -> None:
    if old is _MISSING:
        table.pop(key, None)
    else:
        table[key] = old


def _restore_env(name: str, old: str | None) -> None:
    if old is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = old


@contextlib.contextmanager
def environment(values: dict[str, str]):
    """Within the block the environment variables `values` are set; after it each is restored, or removed where it
    was unset (what an `env:NAME=value` switch does; bench/tp.py's per-engine variables too)."""
    with contextlib.ExitStack() as stack:
        for name, value in values.items():
            stack.callback(_restore_env, name, os.environ.get(name))
            os.environ[name] = value
        yield


def _key(text: str):
    return int(text) if text.lstrip("-").isdigit() else text


def _clear_launch_cache(module) -> None:
    """A module that caches the launch shape it found per key (`_LAUNCH_OK`) must look again under a new table."""
    cache = getattr(module, "_LAUNCH_OK", None)
    if isinstance(cache, dict):
        cache.clear()


def _set_one(stack: contextlib.ExitStack, one: str, assignment: str) -> None:
    """Set the one switch `one` (of `assignment`, for messages) and push its restoration onto `stack`."""
    name, _, value = one.partition("=")
    if name.strip().startswith("env:"):
        var = name.strip()[4:]
        if not re.fullmatch(r"[A-Za-z_]\w*", var) or not value.strip():
            raise SystemExit(f"--switch env:NAME=value needs a variable name and a value; got {one!r}")
        stack.enter_context(environment({var: value.strip()}))
        return
    m = _TARGET.match(name.strip())
    if not m or not value.strip():
        raise SystemExit(f"--switch takes module.ATTR=int or module.ATTR[key]...=int, joined by commas; "
                         f"got {assignment!r}")
    mod_name, attr = m["mod"], m["attr"]
    # `module` names mini_infer.ops.<module>; a dotted one (runtime.cuda_graphs) a module under mini_infer
    module = importlib.import_module(f"mini_infer.{mod_name}" if "." in mod_name else f"mini_infer.ops.{mod_name}")
    keys = [_key(k) for k in re.findall(r"\[([^\[\]]+)\]", m["keys"])]
    if not keys and isinstance(getattr(module, attr), str):  # a mode by name: `int8_linear.FP8_GEMV=cuda-cores`
        stack.callback(setattr, module, attr, getattr(module, attr))
        setattr(module, attr, value.strip())
        return
    if not keys and isinstance(getattr(module, attr), tuple):  # a tile: `int8_linear.SCALED_GEMV_CONFIG=4/512/4/1`
        if not re.fullmatch(r"-?\d+(/-?\d+)*", value.strip()):
            raise SystemExit(f"--switch of a tuple attribute takes ints joined by '/'; got {one!r}")
        stack.callback(setattr, module, attr, getattr(module, attr))
        setattr(module, attr, tuple(int(v) for v in value.strip().split("/")))
        return
    table, last, old = None, None, None
    if keys:
        table = getattr(module, attr)
        for k in keys[:-1]:
            table = table[k]
        last = keys[-1]
        old = table.get(last, _MISSING)
    by_name = bool(keys) and isinstance(old, str)  # a mode by name in a table: `..._CONFIG[decode_fp8][fp8_dot]=fp16`
    if not by_name and not value.strip().lstrip("-").isdigit():
        raise SystemExit(f"--switch takes module.ATTR=int or module.ATTR[key]...=int (or a name for a string "
                         f"attribute or entry), joined by commas; got {assignment!r}")
    if not keys:
        old = getattr(module, attr)
        setattr(module, attr, type(old)(int(value)))
        stack.callback(setattr, module, attr, old)
        return
    if by_name:
        table[last] = value.strip()
    else:
        table[last] = int(value) if old is _MISSING else type(old)(int(value))
    stack.callback(_restore, table, last, old)
    _clear_launch_cache(module)
    stack.callback(_clear_launch_cache, module)


@contextlib.contextmanager
def switched(assignment: str):
    """`module.ATTR=int` set on mini_infer.ops.<module> (or mini_infer.<package.module> for a dotted name: a runtime
    switch such as `runtime.cuda_graphs.OWN_LOGITS_MAX_ROWS=0`), cast to the attribute's type (a string attribute
    takes the value as written: `int8_linear.FP8_GEMV=cuda-cores`; a tuple of ints takes them joined by '/':
    `int8_linear.SCALED_GEMV_CONFIG_FP8_DOT=64/256/4/4`), for the block, then restored: a kernel switch read at launch, for an engine built (and its graphs captured) inside the block.
    `module.TABLE[key][field]=int` sets one entry of a dict attribute instead (added if absent, removed again after),
    e.g. `paged_attention._CONFIG[decode_fp8][maxnreg]=128`, or by name where the entry holds a string
    (`paged_attention._CONFIG[decode_fp8][fp8_dot]=fp16_vregs`); the module's cached launch shapes (`_LAUNCH_OK`) are
    cleared on the way in and out. `env:NAME=value` sets an environment variable for the block instead (restored, or
    removed, after): the one kind of switch that also reaches the other ranks of a tensor-parallel engine, which
    its start-up spawns with this process's environment (a module attribute set here stays in this process: rank
    0), e.g. `env:MINI_INFER_TWO_SHOT_ALLREDUCE=33554432`. Several switches for one engine are joined by commas:
    `linear.PRELOAD_MAX_K=4096,paged_attention.ATTN_PRELOAD=0`. A switch that does not parse, or names a module,
    attribute or table entry that does not exist, is a SystemExit naming it before the block runs (the ones set
    before it restored)."""
    with contextlib.ExitStack() as stack:
        for one in assignment.split(","):
            try:  # before the block: an error inside it (the engine's) is not a switch's
                _set_one(stack, one, assignment)
            except (AttributeError, ImportError, KeyError, TypeError, ValueError) as err:
                raise SystemExit(f"--switch {one!r}: {type(err).__name__}: {err}") from None
        yield


def check_switches(switches: list[str | None]) -> None:
    """Every `--switch` of a run set and restored once, before any engine is built: a switch that does not parse or
    names no attribute stops the run at once (`switched`'s SystemExit naming it) instead of after the engines before
    it were built and timed (minutes of device time)."""
    for one in switches:
        if one:
            with switched(one):
                pass
