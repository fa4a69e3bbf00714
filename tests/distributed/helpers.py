"""Shared launching code of the tensor-parallel tests: run a function on N gloo ranks (spawned processes), run
the CLI as a process, list a process's descendants, wait for a condition; and the greedy run (`greedy_tokens`:
three prompts, the longest prefilled in chunks) whose tokens the end-to-end tests compare between TP=1 and TP=N.

`run_ranks(fn, world_size, *args)` spawns one process per rank, joins them in a gloo group through a file
store, calls `fn(rank, world_size, *args)` (a module-level function, importable by the children) and returns
each rank's result (small picklable values, passed back through files in a temporary directory). A rank that
fails or hangs fails the caller with its exit code and error.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 47)), [7] * 3]
LLM_OPTIONS = dict(device="cpu", max_num_batched_tokens=16, max_num_seqs=4)  # the 37-token prompt takes 3 steps


def greedy_tokens(llm, max_tokens: int = 6) -> list[list[int]]:
    """`llm`'s greedy tokens (EOS ignored) for PROMPTS, one list per prompt."""
    from mini_infer.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _rank_main(rank: int, world_size: int, store_path: str, out_dir: str, fn: Callable, args: tuple) -> None:
    import pickle

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size)
    try:
        result = ("ok", fn(rank, world_size, *args))
    except BaseException as exc:  # noqa: BLE001 - handed to the test, which fails with it
        result = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))


def run_ranks(fn: Callable, world_size: int, *args, timeout: float = 300.0) -> list:
    """`fn(rank, world_size, *args)` on `world_size` gloo ranks; the list of their return values."""
    import pickle

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="mini-infer-ranks-") as tmp:
        store = os.path.join(tmp, "store")
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_rank_main, args=(r, world_size, store, tmp, fn, args), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
        assert not hung, f"ranks {hung} did not finish within {timeout:.0f}s"
        results = []
        for r, p in enumerate(procs):
            path = Path(tmp, f"rank{r}.pkl")
            assert path.exists(), f"rank {r} exited with code {p.exitcode} and no result"
            status, value = pickle.loads(path.read_bytes())
            assert status == "ok", f"rank {r} failed: {value}"
            results.append(value)
        return results


def cli_env(threads: int = 1) -> dict[str, str]:
    """The environment of a CLI child process: this checkout importable, one torch thread."""
    return dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(threads),
                TOKENIZERS_PARALLELISM="false")


def run_cli(args: list[str], timeout: float = 300.0, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m mini_infer.cli *args`, output captured."""
    return subprocess.run([sys.executable, "-m", "mini_infer.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env or cli_env(), stdin=subprocess.DEVNULL, cwd=ROOT)


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":  # zombies are dead
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def spawned_ranks(pid: int) -> list[int]:
    """The processes below `pid` that torch.multiprocessing spawned (the tensor-parallel ranks; not its
    resource tracker)."""
    found = []
    for child in descendants(pid):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmdline:
            found.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_until(cond: Callable[[], bool], timeout: float, what: str, step: float = 0.1) -> float:
    """Poll `cond` until true; returns the seconds it took, fails naming `what` after `timeout`."""
    start = time.monotonic()
    while not cond():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what}: not within {timeout:.0f}s")
        time.sleep(step)
    return time.monotonic() - start
