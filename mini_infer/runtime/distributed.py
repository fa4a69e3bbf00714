"""Tensor parallelism at run time: one process per rank; rank 0 schedules, every rank runs the same graph.

`start(config)` (called by `LLMEngine` when `tensor_parallel_size > 1`) joins or builds the process group:
  * under torchrun (RANK / WORLD_SIZE / LOCAL_RANK in the environment; several machines through torchrun's
    rendezvous) each process is one rank, already started;
  * otherwise the calling process becomes rank 0 and starts ranks 1 … N-1 itself (torch.multiprocessing, spawn),
    with the rendezvous store bound to 127.0.0.1.
Data collectives (the graph's all-reduces and all-gathers, the step inputs) use NCCL on CUDA and gloo on a CPU
(the graph's CUDA all-reduces up to 32 MiB: one-shot or two-shot over symmetric memory, mini_infer/ops/all_reduce.py);
a gloo group carries the small per-step headers and start-up agreements. Every rank builds the same engine
(load, compile for its rank, measure, allocate the same number of KV blocks, capture the same CUDA graphs), so
the collectives inside those steps pair up. Then rank 0 runs the scheduler, the sampler and the clients, and
before each step it broadcasts a header (step sizes) and the step's declared inputs (`InputSpec`s, packed in
one byte buffer: tensors only, never pickle); ranks > 0 (`serve`) receive them and run the same step through
their own runner and CUDA graphs, discarding the logits. On ranks > 0 `LLMEngine(...)` never returns: it serves
rank 0's steps until rank 0 stops the group, then exits the process.

Teardown frees, in order, the CUDA graphs, the all-reduce's symmetric buffers (`mini_infer.ops.all_reduce`) and
then the process group.

Failures: rank 0 watches the processes it started; when one dies it says which, stops the others, aborts the
NCCL communicators (so a step waiting on the dead rank returns) and marks the group failed, after which every
step raises `WorkerDiedError` (fatal for the engine: the server answers 503). A started rank whose parent
(rank 0) disappears exits within a second, so nothing is left behind. Under torchrun, torchrun itself stops
every rank when one fails. This module moves step inputs and processes; it never schedules or samples.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import threading
import time
import traceback
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mini_infer.ops.all_reduce import release_symmetric_buffers

logger = logging.getLogger("mini_infer")

CMD_STEP, CMD_STOP = 1, 2
_HEADER = 8  # cmd, tokens, seqs, logits, blocks, decode, padded, max_query_len
_LONG = datetime.timedelta(days=365)  # ranks > 0 wait for rank 0's next step for as long as the server idles
_START_TIMEOUT = 600.0  # seconds the started ranks get to import and join
_STARTED_RANK = "MINI_INFER_TP_RANK"  # set in the ranks rank 0 started


class WorkerDiedError(RuntimeError):
    """A tensor-parallel rank died: the engine cannot run another step (fatal; the server answers 503)."""


def under_torchrun() -> bool:
    """True when this process was started by torchrun (or anything that sets RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def torchrun_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _backend(device_type: str) -> str:
    return "nccl" if device_type == "cuda" else "gloo"


@dataclass
class ParallelState:
    """This process's place in the tensor-parallel group."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    control: object  # the gloo ProcessGroup for headers and agreements
    workers: list = field(default_factory=list)  # rank 0 when it started the others: their processes
    failure: WorkerDiedError | None = None
    _closed: bool = False
    _monitor: threading.Thread | None = None
    _graphs: object = None  # the runner's CUDAGraphRunner (attach): freed before the group is destroyed

    # ------------------------------------------------------------------ agreements (every rank calls them)
    def agree_min(self, value: int) -> int:
        """The smallest `value` over ranks (e.g. the KV budget: every rank must allocate the same blocks)."""
        t = torch.tensor([int(value)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())

    def attach(self, runner):
        """After the runner's CUDA graphs are captured: keep only the shapes every rank captured, and on rank 0
        return a runner that broadcasts each step before running it (ranks > 0 keep their own)."""
        graphs = getattr(runner, "cuda_graphs", None)
        self._graphs = graphs
        if graphs is not None and graphs.use_graphs:  # a shape one rank failed to capture: all run eagerly
            shapes = sorted(graphs.graphs)
            mine = torch.tensor([len(shapes), sum(t * 7919 + s for t, s in shapes)], dtype=torch.int64)
            low, high = mine.clone(), mine.clone()
            dist.all_reduce(low, op=dist.ReduceOp.MIN, group=self.control)
            dist.all_reduce(high, op=dist.ReduceOp.MAX, group=self.control)
            if not torch.equal(low, high):
                logger.warning("the ranks captured different CUDA graphs (this one: %d shapes); every step runs "
                               "uncaptured", len(shapes))
                graphs.graphs, graphs.decode_sizes, graphs.token_sizes = {}, [], []
        return BroadcastingRunner(runner, self) if self.rank == 0 else runner

    # ------------------------------------------------------------------ rank 0
    def check_alive(self) -> None:
        if self.failure is not None:
            raise self.failure

    def send_step(self, inputs: dict[str, torch.Tensor], specs, plan, decode: bool, padded: bool) -> None:
        """Broadcast one step's header and inputs to ranks > 0 (rank 0)."""
        self.check_alive()
        blocks = 0
        for spec in specs:
            if "blocks" in spec.shape:
                blocks = int(inputs[spec.name].shape[spec.shape.index("blocks")])
        header = torch.tensor([CMD_STEP, plan.num_tokens, plan.num_seqs, plan.num_logits, blocks, int(decode),
                               int(padded), plan.max_query_len], dtype=torch.int64)
        try:
            dist.broadcast(header, src=0, group=self.control)
            dist.broadcast(_pack([inputs[s.name] for s in _by_itemsize(specs)]), src=0)
        except Exception as exc:  # a rank went away mid-broadcast
            raise self._fail(f"broadcasting a step to the other ranks failed: {type(exc).__name__}: {exc}") from exc

    def close(self, abort: bool = False) -> None:
        """Stop the group (rank 0: tell the other ranks to exit and wait for the processes it started).

        A clean stop destroys the process group on every rank at once: rank 0 right after the stop message, the
        other ranks when they receive it (`serve`). NCCL's teardown waits for its peers, so rank 0 must not wait
        for the processes to exit first (they would be waiting in their own teardown for rank 0's): it joins them
        after its own. A failed or aborted group (its peers may be gone) is ended without waiting for them."""
        if self._closed:
            return
        self._closed = True
        stopped = False
        if self.rank == 0 and not abort and self.failure is None:
            try:
                header = torch.zeros(_HEADER, dtype=torch.int64)
                header[0] = CMD_STOP
                dist.broadcast(header, src=0, group=self.control)
                stopped = True
            except Exception:  # noqa: BLE001 - already broken: the processes are stopped below
                pass
        if stopped:
            self._release_graphs()
            _end_group(wait_for_peers=True)
        deadline = time.monotonic() + (10.0 if not abort else 0.0)
        for p in self.workers:
            p.join(max(0.0, deadline - time.monotonic()))
        _stop_processes([p for p in self.workers if p.is_alive()])
        if not stopped:
            _end_group(wait_for_peers=False)
        # nothing of the engine may outlive the close: the exit hook (rank 0) held this object, and through the
        # CUDA-graph runner the compiled model (on an H200, 33 GB of qwen3-30b-a3b's rank 0 stayed allocated per
        # closed engine until the process ended)
        self._graphs = None
        atexit.unregister(self.close)

    def _release_graphs(self) -> None:
        """Free the CUDA graphs that captured this group's collectives (NCCL's teardown waits for them)."""
        if self._graphs is not None and self._graphs.graphs:
            self._graphs.release()

    def _fail(self, why: str) -> WorkerDiedError:
        if self.failure is None:
            self.failure = WorkerDiedError(f"tensor parallelism stopped: {why}")
            logger.error("%s", self.failure)
        return self.failure

    def _watch(self) -> None:
        """Rank 0's monitor: a started rank that exits unasked stops the group."""
        while not self._closed:
            dead = [(r, p) for r, p in enumerate(self.workers, start=1) if p.exitcode is not None]
            if dead:
                rank, proc = dead[0]
                others = [r for r, p in enumerate(self.workers, start=1) if p.exitcode is None]
                self._fail(f"rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}; stopping ranks "
                           f"{others} and refusing new steps")
                _stop_processes([p for p in self.workers if p.is_alive()])
                if self.device.type == "cuda":  # a step blocked in NCCL on the dead rank returns with an error
                    try:
                        dist.distributed_c10d._abort_process_group()
                    except Exception:  # noqa: BLE001 - best effort: the group is failed either way
                        pass
                return
            time.sleep(0.2)

    # ------------------------------------------------------------------ ranks > 0
    def serve(self, engine) -> None:
        """Run rank 0's steps on this rank until it stops the group; then exit the process (ranks > 0)."""
        from mini_infer.runtime.model_runner import StepPlan

        runner = engine.runner
        specs = _by_itemsize(runner.input_specs)
        caches = runner.kv_cache.tensors
        header = torch.zeros(_HEADER, dtype=torch.int64)
        while True:
            dist.broadcast(header, src=0, group=self.control)
            cmd, tokens, seqs, logits, blocks, decode, padded, max_query_len = header.tolist()[:8]
            if cmd == CMD_STOP:
                break
            shapes = [s.sizes(tokens, seqs, logits, blocks) for s in specs]
            buf = torch.empty(sum(_nbytes(sh, s.dtype) for sh, s in zip(shapes, specs)), dtype=torch.uint8,
                              device=self.device)
            dist.broadcast(buf, src=0)
            inputs = _unpack(buf, shapes, specs)
            inputs.update(caches)
            runner.execute(inputs, StepPlan(num_tokens=tokens, num_seqs=seqs, num_logits=logits,
                                            max_query_len=max_query_len),
                           decode=bool(decode), padded=bool(padded))
        self._closed = True
        self._release_graphs()
        _end_group(wait_for_peers=True)  # paired with rank 0's (close)
        raise SystemExit(0)


class BroadcastingRunner:
    """Rank 0's model runner: every step's inputs go to the other ranks before it runs here."""

    def __init__(self, runner, state: ParallelState) -> None:
        self._runner = runner
        self._state = state

    def __getattr__(self, name: str):
        return getattr(self._runner, name)

    def execute(self, inputs, plan, decode: bool = False, padded: bool = True) -> torch.Tensor:
        if not isinstance(inputs, dict):  # host values from prepare(): the other ranks receive device tensors
            inputs = self._runner.device_inputs(inputs)
        self._state.send_step(inputs, self._runner.input_specs, plan, decode, padded)
        return self._runner.execute(inputs, plan, decode=decode, padded=padded)


# ---------------------------------------------------------------------- packing step inputs
def _by_itemsize(specs) -> list:
    """Specs ordered by element size, largest first: packed back to back, every tensor stays aligned."""
    return sorted(specs, key=lambda s: -torch.empty((), dtype=s.dtype).element_size())


def _nbytes(shape, dtype: torch.dtype) -> int:
    n = torch.empty((), dtype=dtype).element_size()
    for d in shape:
        n *= d
    return n


def _pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def _unpack(buf: torch.Tensor, shapes, specs) -> dict[str, torch.Tensor]:
    out, offset = {}, 0
    for shape, spec in zip(shapes, specs):
        n = _nbytes(shape, spec.dtype)
        out[spec.name] = buf[offset:offset + n].view(spec.dtype).reshape(shape)
        offset += n
    return out


# ---------------------------------------------------------------------- start-up
def start(config) -> ParallelState | None:
    """Join (torchrun, or a process this module started) or build (rank 0) the tensor-parallel group for
    `config.tensor_parallel_size`; None when it is 1."""
    size = config.tensor_parallel_size
    if size == 1:
        return None
    device_type = torch.device(config.device).type if config.device else \
        ("cuda" if torch.cuda.is_available() else "cpu")
    if _STARTED_RANK in os.environ:  # a rank this module started (its group was built in _worker_main)
        rank, world = dist.get_rank(), dist.get_world_size()
        local_rank = rank
        workers = []
    elif under_torchrun():
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if world != size:
            raise ValueError(f"tensor_parallel_size={size}, but torchrun started WORLD_SIZE={world} processes: "
                             "start one process per rank (torchrun --nproc-per-node x --nnodes = the size)")
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        _set_device(device_type, local_rank)
        if not dist.is_initialized():  # (a script may have built the group itself)
            dist.init_process_group(_backend(device_type), rank=rank, world_size=world)
        workers = []
    else:
        if dist.is_initialized():
            raise ValueError(f"tensor_parallel_size={size}: this process already has a process group (an engine "
                             "that was not closed? call engine.close()); start the ranks with torchrun to use "
                             "your own group")
        rank, world, local_rank = 0, size, 0
        _set_device(device_type, 0)
        workers = _start_workers(config, device_type)
    if dist.get_world_size() != size:
        raise ValueError(f"tensor_parallel_size={size}, but the process group has {dist.get_world_size()} ranks")
    control = dist.new_group(backend="gloo", timeout=_LONG)
    device = torch.device("cuda", local_rank) if device_type == "cuda" else torch.device("cpu")
    state = ParallelState(rank, world, local_rank, device, control, workers)
    if workers:
        state._monitor = threading.Thread(target=state._watch, name="mini-infer-tp-monitor", daemon=True)
        state._monitor.start()
    if rank == 0:
        atexit.register(state.close)
    return state


def _set_device(device_type: str, local_rank: int) -> None:
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)


def _start_workers(config, device_type: str) -> list:
    """Rank 0: start ranks 1 … N-1 (spawn), wait until each has joined the rendezvous on 127.0.0.1, then join
    the group. A rank that dies while starting is reported with its exit code."""
    import torch.multiprocessing as mp

    size = config.tensor_parallel_size
    store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=_START_TIMEOUT))
    ctx = mp.get_context("spawn")
    workers = []
    for rank in range(1, size):
        p = ctx.Process(target=_worker_main, name=f"mini-infer-tp-rank{rank}", daemon=True,
                        args=(rank, size, store.port, config, os.getpid(), logging.getLogger().level))
        p.start()
        workers.append(p)
    deadline = time.monotonic() + _START_TIMEOUT
    try:
        while not store.check([f"joining/{r}" for r in range(1, size)]):
            dead = [(r, p.exitcode) for r, p in enumerate(workers, start=1) if p.exitcode is not None]
            if dead:
                raise WorkerDiedError(f"tensor-parallel rank {dead[0][0]} exited with code {dead[0][1]} while "
                                      "starting (its error is printed above)")
            if time.monotonic() > deadline:
                raise WorkerDiedError(f"tensor-parallel ranks did not start within {_START_TIMEOUT:.0f}s")
            time.sleep(0.05)
        dist.init_process_group(_backend(device_type), store=store, rank=0, world_size=size)
    except BaseException:
        _stop_processes(workers)
        raise
    return workers


def _end_group(wait_for_peers: bool) -> None:
    """Leave the process group: destroyed (NCCL pairs the teardown with the peers', so all must be doing it), or,
    when the peers may be gone, aborted on CUDA (NCCL's abort waits for nobody; gloo's destroy never waits)."""
    if not dist.is_initialized():
        return
    release_symmetric_buffers(wait=wait_for_peers)  # the all-reduce's peer memory is this group's (graphs freed)
    try:
        if wait_for_peers or dist.get_backend() != "nccl":
            dist.destroy_process_group()
        else:
            dist.distributed_c10d._abort_process_group()
    except Exception:  # noqa: BLE001 - best effort: the process is leaving the group either way
        pass


def _stop_processes(procs: list, grace: float = 3.0) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(1.0)


def _watch_parent(parent_pid: int, rank: int) -> None:
    """Exit this rank within a second of rank 0's process going away (no orphans)."""
    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                print(f"mini-infer tensor-parallel rank {rank}: rank 0 (pid {parent_pid}) is gone; exiting",
                      flush=True)
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, name="mini-infer-tp-parent", daemon=True).start()


def _worker_main(rank: int, size: int, port: int, config, parent_pid: int, log_level: int) -> None:
    """A rank started by rank 0: join the group, build the same engine, serve rank 0's steps."""
    _watch_parent(parent_pid, rank)
    logging.basicConfig(level=log_level, format=f"%(asctime)s rank{rank} %(name)s %(levelname)s %(message)s")
    device_type = torch.device(config.device).type if config.device else \
        ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type == "cpu":  # ranks share the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    os.environ[_STARTED_RANK] = str(rank)
    try:
        _set_device(device_type, rank)
        store = dist.TCPStore("127.0.0.1", port, size, is_master=False,
                              timeout=datetime.timedelta(seconds=_START_TIMEOUT))
        store.set(f"joining/{rank}", "1")
        dist.init_process_group(_backend(device_type), store=store, rank=rank, world_size=size)
        from mini_infer.runtime.engine import LLMEngine

        LLMEngine(config)  # serves rank 0's steps; leaves through SystemExit when rank 0 stops the group
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - said once, clearly, then the process ends
        traceback.print_exc()
        print(f"mini-infer tensor-parallel rank {rank}: {type(exc).__name__}: {exc}", flush=True)
        os._exit(1)


__all__ = ["BroadcastingRunner", "ParallelState", "WorkerDiedError", "start", "torchrun_rank", "under_torchrun"]
