"""`mini_infer::all_reduce_sum(x, group_name)`: the sum of `x` over the ranks of a process group, the all-reduce of
tensor parallelism (shard_tensor_parallel inserts it after row-parallel linears and MoE blocks).

The op is opaque to FX and to CUDA-graph capture like the other ops (fake impl: `empty_like`); its body picks how
to sum, by device and size (`pick_path`, a pure function):
  * CUDA, torch's symmetric memory usable, bf16 or fp32, a multiple of 4 bytes and at most `one_shot_max_bytes()`
    (the environment's MINI_INFER_ONE_SHOT_ALLREDUCE in bytes; unset: ONE_SHOT_MAX_BYTES = 262144, on by default
    since the twenty-ninth session's two-GPU checks; "0" = never): a one-shot
    all-reduce over peer memory (`torch.ops.symm_mem.one_shot_all_reduce_copy_out`: one kernel copies `x` into
    this rank's symmetric buffer, waits for the peers' copies, reads every peer's buffer over NVLink and sums in
    rank order, so every rank gets the same bits). The buffer is allocated once per (group, dtype, device) with
    `symm_mem.empty` + `rendezvous` at its first eligible call: a collective, reached by every rank together
    because they run the same graph, and eagerly (the CUDA-graph runner runs every shape twice before capturing
    it); under capture it is never allocated (that call takes NCCL). Later calls only slice it, so captured
    graphs replay with fixed pointers. NVLink multicast (multimem) is never used: the allocation sets
    TORCH_SYMM_MEM_DISABLE_MULTICAST=1 first.
  * CUDA, as above, a message above the one-shot limit, in whole 16-byte vectors and at most `two_shot_max_bytes()`
    (MINI_INFER_TWO_SHOT_ALLREDUCE; unset: TWO_SHOT_MAX_BYTES = 32 MiB, on by default; "0" = never): torch's
    two-shot kernel over the same buffer (`all_reduce_sum_two_shot`: each rank reduces 1/N of the elements, then
    gathers the rest; faster than NCCL from [256, 2048] bf16 up in `bench/tp.py --allreduce-probe` on two H200s, and
    1.043x NCCL's output tok/s inside a TP=2 + EP engine on the nano-vllm workload, twenty-eighth session). The
    buffer is sized for the larger of the two limits. Both paths agreed with NCCL bit for bit on two H200s, and
    every tiny preset's TP=2 greedy output (EP too) equalled TP=1's with both on (bench/RESULTS.md, twenty-ninth
    session).
  * otherwise (CPU / gloo, larger messages, fp16, symmetric memory missing or its set-up failed): torch's
    functional all-reduce (`_c10d_functional.all_reduce` + `wait_tensor`), what the graph ran before this op.
Why the symmetric-memory paths are not taken is logged once per reason.

`release_symmetric_buffers()` frees the buffers: the runtime calls it before destroying the process group (and
after freeing the CUDA graphs that captured them). Symmetric memory serves one process group per process: on two
H200s, with the two-shot path on, the second tensor-parallel engine in one process (a new group, which torch
names "0" again) never finished (bench/tp.py's check, twenty-eighth session; a fresh symmetric-memory name per
group, registered with torch, did not help either). The likely cause, in torch's source: its CUDA symmetric
memory numbers the store exchanges of a rendezvous with one counter per process (the keys are prefix/seq/rank), so
a newly started peer's first exchange (0) never meets the one rank 0 is at (N, after the earlier groups). So once
a group's buffers are released, later groups of rank 0's process take NCCL, said once. Groups whose ranks span
several hosts (CUDA IPC maps peers on one host only) or whose devices lack peer access take NCCL too. Every rank
gathers every rank's host, device and earlier groups over the group and decides alike (`symmetric_memory_agreed`,
`sharing_refused`), so that every rank takes the same path. Known gaps: the one-group rule, and
torch's one-shot and two-shot kernels wait for their peers without a timeout, so a rank that dies in the middle
of a step leaves the others' GPUs waiting (an NCCL abort does not end that kernel); a death between steps is
caught as before. This module never creates, joins or destroys a process group, and imports nothing from
mini_infer outside `mini_infer.ops`.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os

import torch

from mini_infer.ops._triton_support import cuda_index

logger = logging.getLogger("mini_infer")

ONE_SHOT_MAX_BYTES = 256 << 10  # the size to try: the largest message then taken (a [64, 2048] bf16 activation)
ONE_SHOT_DEFAULT_BYTES = ONE_SHOT_MAX_BYTES  # on (bench/RESULTS.md, fifteenth and twenty-ninth sessions)
ONE_SHOT_ENV = "MINI_INFER_ONE_SHOT_ALLREDUCE"
ONE_SHOT_DTYPES = (torch.bfloat16, torch.float32)  # what torch's one-shot kernel implements
_MIN_ALIGNMENT = 4  # bytes: the kernel's smallest vector
# Two-shot (torch's kernel over the same buffer: each rank reduces 1/N of the elements, then gathers the rest), for
# messages above the one-shot limit: faster than NCCL on two H200s from [256, 2048] to [8192, 2048] bf16 in the probe
# (bench/RESULTS.md, twenty-seventh session) and inside a TP=2 + EP engine (twenty-eighth); on by default.
TWO_SHOT_MAX_BYTES = 32 << 20  # the size to try: an [8192, 2048] bf16 prefill step's message
TWO_SHOT_DEFAULT_BYTES = TWO_SHOT_MAX_BYTES  # on
TWO_SHOT_ENV = "MINI_INFER_TWO_SHOT_ALLREDUCE"
_TWO_SHOT_ALIGNMENT = 16  # bytes: whole 16-byte vectors (each rank's share splits on them)

_buffers: dict[tuple[str, torch.dtype, int], torch.Tensor] = {}  # (group, dtype, device index) -> symmetric buffer
_abandoned: list[torch.Tensor] = []  # buffers of a failed group: never freed (release_symmetric_buffers)
_failed_groups: set[str] = set()  # groups whose symmetric memory could not be set up: NCCL from then on
_released_before = False  # a group of this process had symmetric buffers, since released: later groups take NCCL
_agreed: dict[str, str | None] = {}  # group -> why it may not set up symmetric memory, None: it may (agreed)
_said: set[str] = set()  # reasons already logged


def _env_bytes(name: str, default: int) -> int:
    """A size limit in bytes from the environment variable `name` ("0": never), else `default`."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        limit = int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r}: expected a number of bytes (0 = never)") from None
    if limit < 0:
        raise ValueError(f"{name}={value!r}: expected a number of bytes >= 0 (0 = never)")
    return limit


def one_shot_max_bytes() -> int:
    """The largest message (bytes) the one-shot path takes: MINI_INFER_ONE_SHOT_ALLREDUCE when set ("0": never;
    ONE_SHOT_MAX_BYTES is the size to try), else ONE_SHOT_DEFAULT_BYTES (= ONE_SHOT_MAX_BYTES: on by default)."""
    return _env_bytes(ONE_SHOT_ENV, ONE_SHOT_DEFAULT_BYTES)


def two_shot_max_bytes() -> int:
    """The largest message (bytes) the two-shot path takes (above the one-shot limit): MINI_INFER_TWO_SHOT_ALLREDUCE
    when set ("0": never), else TWO_SHOT_DEFAULT_BYTES (= TWO_SHOT_MAX_BYTES: on by default)."""
    return _env_bytes(TWO_SHOT_ENV, TWO_SHOT_DEFAULT_BYTES)


def _fits_symmetric(device_type: str, nbytes: int, dtype: torch.dtype, available: bool, max_bytes: int,
                    alignment: int) -> bool:
    """Whether torch's symmetric-memory kernels take a message: CUDA, `available`, bf16 / fp32, at most `max_bytes`
    (0: never) and a whole number of `alignment`-byte vectors."""
    return (device_type == "cuda" and available and dtype in ONE_SHOT_DTYPES and 0 < nbytes <= max_bytes
            and nbytes % alignment == 0)


def use_one_shot(device_type: str, nbytes: int, dtype: torch.dtype, available: bool, max_bytes: int) -> bool:
    """Whether a message of `nbytes` bytes of `dtype` on `device_type` takes the one-shot path, given whether
    symmetric memory is `available` and the size limit `max_bytes` (0: never)."""
    return _fits_symmetric(device_type, nbytes, dtype, available, max_bytes, _MIN_ALIGNMENT)


def pick_path(device_type: str, nbytes: int, dtype: torch.dtype, available: bool, one_shot_max: int,
              two_shot_max: int, two_shot_available: bool = True) -> str:
    """How a message of `nbytes` bytes of `dtype` is summed: "one_shot" (`use_one_shot`), else "two_shot" (CUDA,
    symmetric memory and torch's two-shot kernel available, bf16 / fp32, whole 16-byte vectors, at most
    `two_shot_max` bytes: 0 never), else "collective" (NCCL / gloo)."""
    if use_one_shot(device_type, nbytes, dtype, available, one_shot_max):
        return "one_shot"
    if _fits_symmetric(device_type, nbytes, dtype, available and two_shot_available, two_shot_max,
                       _TWO_SHOT_ALIGNMENT):
        return "two_shot"
    return "collective"


@functools.cache
def symmetric_memory_missing() -> str | None:
    """Why torch's symmetric-memory one-shot all-reduce cannot run in this process, or None when it can (asked
    once per process)."""
    if not torch.distributed.is_available():
        return "torch.distributed is not available"
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        importlib.import_module("torch.distributed._symmetric_memory")
    except ImportError as exc:
        return f"torch.distributed._symmetric_memory does not import ({exc})"
    if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_out"):
        return f"torch {torch.__version__} has no torch.ops.symm_mem.one_shot_all_reduce_out"
    return None


@functools.cache
def has_two_shot() -> bool:
    """Whether this torch has the two-shot kernel (`torch.ops.symm_mem.two_shot_all_reduce_`; asked once per
    process, as `symmetric_memory_missing` asks for the one-shot one)."""
    return symmetric_memory_missing() is None and hasattr(torch.ops.symm_mem, "two_shot_all_reduce_")


def _say_once(reason: str) -> None:
    if reason not in _said:
        _said.add(reason)
        logger.warning("all_reduce_sum: NCCL instead of the symmetric-memory all-reduce: %s", reason)


def _alignment(nbytes: int) -> int:
    """The largest vector (16, 8, 4, 2 or 1 bytes) dividing `nbytes`, as torch's symm_mem kernels reckon it."""
    return next(a for a in (16, 8, 4, 2, 1) if nbytes % a == 0)


def _rendezvous(buf: torch.Tensor, group_name: str) -> None:
    import torch.distributed._symmetric_memory as symm_mem

    try:
        symm_mem.rendezvous(buf, group_name)
    except RuntimeError as exc:  # torch before lazy group lookup: the group must be registered first
        if "group info" not in str(exc) or not hasattr(symm_mem, "enable_symm_mem_for_group"):
            raise
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(group_name)
        symm_mem.rendezvous(buf, group_name)


def sharing_refused(ranks: list[tuple[str, int | None, bool]], peer_access=None) -> str | None:
    """Why a group whose ranks are `ranks` (in group order: each one's host name, CUDA device index or None, and
    whether its process already released an earlier group's symmetric buffers) may not set up symmetric memory, or
    None when it may. Refused: when rank 0's process had an earlier group (the one-group rule, module docstring);
    when the ranks are on several hosts (torch's CUDA symmetric memory maps peers' memory through CUDA IPC: one
    host); when two of the ranks' devices cannot access each other's memory (`peer_access(a, b)`, default
    torch.cuda.can_device_access_peer). A pure function of what every rank gathered, so every rank decides alike."""
    if ranks[0][2]:
        return ("rank 0's process already used symmetric memory for a process group that has ended (a later "
                "group's set-up never finished on two H200s, twenty-eighth session): start a new process for "
                "another engine with the symmetric-memory paths")
    hosts = sorted({host for host, _, _ in ranks})
    if len(hosts) > 1:
        return f"the ranks are on {len(hosts)} hosts ({', '.join(hosts)}): symmetric memory maps peers on one host"
    devices = sorted({d for _, d, _ in ranks if d is not None})
    peer_access = peer_access or torch.cuda.can_device_access_peer
    for a in devices:
        for b in devices:
            if a != b and not peer_access(a, b):
                return f"CUDA device {a} cannot access device {b}'s memory (no peer access)"
    return None


def symmetric_memory_agreed(group_name: str, device_index: int | None = None) -> bool:
    """Whether the group may set up symmetric memory (`sharing_refused` says None): every rank's host, device and
    earlier groups gathered over the group itself, so that every rank takes the same path (a newly started rank
    knows no earlier group: rank 0's history decides). Collective at the first call of a group (eager: `_buffer`
    never asks under capture); remembered, with the reason of a refusal, until the group's buffers are released."""
    if group_name not in _agreed:
        import socket

        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        group = c10d._resolve_process_group(group_name)
        ranks: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(ranks, (socket.gethostname(), device_index, _released_before), group=group)
        _agreed[group_name] = sharing_refused([tuple(r) for r in ranks])
    return _agreed[group_name] is None


def _buffer(group_name: str, dtype: torch.dtype, device: torch.device, nbytes: int) -> torch.Tensor | None:
    """This rank's symmetric buffer for (group, dtype, device), allocated and rendezvoused with the peers at the
    first call (collective); None when it cannot be (under CUDA-graph capture, the set-up failed, or an earlier
    group of rank 0's process had symmetric memory: `symmetric_memory_agreed`, module docstring)."""
    key = (group_name, dtype, cuda_index(device))
    buf = _buffers.get(key)
    if buf is not None:
        return buf if buf.nbytes >= nbytes else None
    if group_name in _failed_groups:
        return None
    if torch.cuda.is_current_stream_capturing():
        _say_once(f"the symmetric buffer of group {group_name} ({dtype}) would be allocated under CUDA-graph "
                  "capture (no eager call ran first)")
        return None
    if not symmetric_memory_agreed(group_name, key[2]):
        _say_once(f"group {group_name} takes NCCL: {_agreed[group_name]}")
        return None
    import torch.distributed._symmetric_memory as symm_mem

    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"  # both paths read peers' memory; never NVLink multicast
    size = max(one_shot_max_bytes(), two_shot_max_bytes(), nbytes)
    try:
        with torch.cuda.device(key[2]):
            buf = symm_mem.empty(size // dtype.itemsize, dtype=dtype, device=torch.device("cuda", key[2]))
            _rendezvous(buf, group_name)
    except Exception as exc:  # noqa: BLE001 - said once; this group runs NCCL from now on
        _failed_groups.add(group_name)
        _say_once(f"symmetric memory for group {group_name} could not be set up ({type(exc).__name__}: {exc})")
        return None
    _buffers[key] = buf
    logger.info("all_reduce_sum: symmetric memory for group %s, %s, %d bytes (one-shot up to %d, two-shot up to %d)",
                group_name, dtype, size, one_shot_max_bytes(), two_shot_max_bytes())
    return buf


def symmetric_buffers() -> dict[tuple[str, torch.dtype, int], int]:
    """The symmetric buffers set up so far, (group, dtype, device index) -> bytes: empty until a one-shot or
    two-shot all-reduce ran (and after `release_symmetric_buffers`)."""
    return {key: buf.nbytes for key, buf in _buffers.items()}


def release_symmetric_buffers(wait: bool = True) -> None:
    """Forget every symmetric buffer (after the graphs that captured them; before their process group goes) and
    remember that this process had some: a later group takes NCCL (`symmetric_memory_agreed`). `wait`: finish this
    device's work, then free them; otherwise (a peer may be gone, and a one-shot kernel waiting for it never returns)
    keep them allocated until the process exits, unused, rather than free memory such a kernel may still touch."""
    global _released_before
    if wait:
        if _buffers and torch.cuda.is_available():
            torch.cuda.synchronize()
    else:
        _abandoned.extend(_buffers.values())
    _released_before = _released_before or bool(_buffers)
    _buffers.clear()
    _failed_groups.clear()
    _agreed.clear()


def all_reduce_sum_collective(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """sum over the group's ranks through torch.distributed (NCCL on CUDA, gloo on CPU)."""
    c10d = torch.ops._c10d_functional
    return c10d.wait_tensor.default(c10d.all_reduce.default(x, "sum", group_name))


def all_reduce_sum_one_shot(x: torch.Tensor, buf: torch.Tensor, group_name: str) -> torch.Tensor:
    """sum over the group's ranks by torch's one-shot kernel, staging `x` in the symmetric buffer `buf`."""
    x = x.contiguous()
    flat, out = x.view(-1), torch.empty_like(x)
    staged = buf[:flat.numel()]
    copy_out = getattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out", None)
    # the copying variant needs the same vector width for x and the buffer (the buffer's slice starts at 0)
    if copy_out is not None and _alignment(x.storage_offset() * x.element_size()) >= _alignment(x.nbytes):
        copy_out(staged, flat, "sum", group_name, out.view(-1))
    else:
        staged.copy_(flat)
        torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", group_name, out.view(-1))
    return out


def all_reduce_sum_two_shot(x: torch.Tensor, buf: torch.Tensor, group_name: str) -> torch.Tensor:
    """sum over the group's ranks by torch's two-shot kernel (each rank reduces its 1/N of the elements from every
    peer's buffer, then gathers the others' reduced parts), staging `x` in the symmetric buffer `buf`: the scheme
    vLLM runs through symmetric memory for larger messages. At two ranks every rank gets the same bits (a sum of
    two)."""
    x = x.contiguous()
    flat = x.view(-1)
    staged = buf[:flat.numel()]
    staged.copy_(flat)
    torch.ops.symm_mem.two_shot_all_reduce_(staged, "sum", group_name)
    return staged.view_as(x).clone()


def symmetric_buffer(x: torch.Tensor, group_name: str) -> torch.Tensor | None:
    """The group's symmetric buffer for x's dtype and device, set up (collectively) at the first call; None where
    it cannot be (see `all_reduce_sum_impl`)."""
    return _buffer(group_name, x.dtype, x.device, x.nbytes)


def all_reduce_sum_impl(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """The op's body: the one-shot or two-shot path where `pick_path` says so and the buffer is there, else the
    collective."""
    if x.device.type == "cuda":
        missing = symmetric_memory_missing()
        if missing is not None:
            _say_once(missing)
        path = pick_path("cuda", x.nbytes, x.dtype, missing is None, one_shot_max_bytes(), two_shot_max_bytes(),
                         has_two_shot())
        if path != "collective":
            buf = symmetric_buffer(x, group_name)
            if buf is not None:
                return (all_reduce_sum_one_shot if path == "one_shot" else all_reduce_sum_two_shot)(x, buf, group_name)
    return all_reduce_sum_collective(x, group_name)


# compiled graphs call these directly (ops.kernel_impls, bind_kernels): the body picks by device itself
all_reduce_sum_reference_entry = all_reduce_sum_impl
all_reduce_sum_triton_entry = all_reduce_sum_impl


@torch.library.custom_op("mini_infer::all_reduce_sum", mutates_args=())
def all_reduce_sum(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return all_reduce_sum_impl(x, group_name)


@all_reduce_sum.register_fake
def _(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(x)


__all__ = ["ONE_SHOT_DEFAULT_BYTES", "ONE_SHOT_ENV", "ONE_SHOT_MAX_BYTES", "TWO_SHOT_ENV", "TWO_SHOT_MAX_BYTES",
           "all_reduce_sum", "all_reduce_sum_collective", "all_reduce_sum_impl", "all_reduce_sum_one_shot",
           "all_reduce_sum_two_shot", "has_two_shot", "one_shot_max_bytes", "pick_path", "release_symmetric_buffers",
           "sharing_refused", "symmetric_buffer", "symmetric_buffers", "symmetric_memory_agreed",
           "symmetric_memory_missing", "two_shot_max_bytes", "use_one_shot"]
