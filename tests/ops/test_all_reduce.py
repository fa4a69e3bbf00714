"""mini_infer::all_reduce_sum: the size policy (pure functions of device, bytes, dtype, availability and the
limits), the limits' environment overrides, the fake impl, and on two gloo ranks the op's value: bit-equal to
torch.distributed's all_reduce for the shapes a decode and a prefill step reduce, through the dispatcher and
through the function compiled graphs call (ops.kernel_impls), with the size limits set to 0 and to the sizes to try
too, never touching its input. The one-shot and two-shot paths themselves need CUDA and peer memory: bench/tp.py
--allreduce-probe checks and times them on GPUs.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from mini_infer.ops import kernel_impls
from mini_infer.ops.all_reduce import (
    ONE_SHOT_ENV,
    ONE_SHOT_MAX_BYTES,
    TWO_SHOT_ENV,
    TWO_SHOT_MAX_BYTES,
    one_shot_max_bytes,
    pick_path,
    release_symmetric_buffers,
    sharing_refused,
    two_shot_max_bytes,
    use_one_shot,
)
from tests.distributed.helpers import run_ranks

BF16 = torch.bfloat16


@pytest.mark.parametrize(("device", "nbytes", "dtype", "available", "limit", "expected"), [
    ("cuda", 4096, BF16, True, ONE_SHOT_MAX_BYTES, True),  # a batch-1 decode step's [1, 2048]
    ("cuda", ONE_SHOT_MAX_BYTES, BF16, True, ONE_SHOT_MAX_BYTES, True),  # the limit itself
    ("cuda", ONE_SHOT_MAX_BYTES + 4, BF16, True, ONE_SHOT_MAX_BYTES, False),  # one past it
    ("cuda", 4096, torch.float32, True, ONE_SHOT_MAX_BYTES, True),
    ("cuda", 4096, torch.float16, True, ONE_SHOT_MAX_BYTES, False),  # torch's kernel: bf16 and fp32 only
    ("cuda", 4098, BF16, True, 1 << 20, False),  # not a multiple of 4 bytes
    ("cuda", 0, BF16, True, ONE_SHOT_MAX_BYTES, False),
    ("cuda", 4096, BF16, False, ONE_SHOT_MAX_BYTES, False),  # no symmetric memory
    ("cuda", 4096, BF16, True, 0, False),  # MINI_INFER_ONE_SHOT_ALLREDUCE=0
    ("cpu", 4096, BF16, True, ONE_SHOT_MAX_BYTES, False),  # gloo
])
def test_use_one_shot(device, nbytes, dtype, available, limit, expected):
    assert use_one_shot(device, nbytes, dtype, available, limit) is expected


ONE, TWO = ONE_SHOT_MAX_BYTES, TWO_SHOT_MAX_BYTES


@pytest.mark.parametrize(("device", "nbytes", "dtype", "available", "one", "two", "two_available", "expected"), [
    ("cuda", 4096, BF16, True, ONE, TWO, True, "one_shot"),  # under the one-shot limit: one-shot first
    ("cuda", 256 * 2048 * 2, BF16, True, ONE, TWO, True, "two_shot"),  # a [256, 2048] decode batch
    ("cuda", TWO, BF16, True, ONE, TWO, True, "two_shot"),  # the two-shot limit itself
    ("cuda", TWO + 16, BF16, True, ONE, TWO, True, "collective"),  # past it
    ("cuda", 4096, BF16, True, 0, TWO, True, "two_shot"),  # one-shot off: two-shot takes the small ones too
    ("cuda", ONE + 8, BF16, True, ONE, TWO, True, "collective"),  # not whole 16-byte vectors
    ("cuda", 1 << 20, torch.float32, True, ONE, TWO, True, "two_shot"),
    ("cuda", 1 << 20, torch.float16, True, ONE, TWO, True, "collective"),  # bf16 and fp32 only
    ("cuda", 1 << 20, BF16, False, ONE, TWO, True, "collective"),  # no symmetric memory
    ("cuda", 1 << 20, BF16, True, ONE, TWO, False, "collective"),  # torch without the two-shot kernel
    ("cuda", 1 << 20, BF16, True, ONE, 0, True, "collective"),  # MINI_INFER_TWO_SHOT_ALLREDUCE unset / "0"
    ("cpu", 1 << 20, BF16, True, ONE, TWO, True, "collective"),  # gloo
])
def test_pick_path(device, nbytes, dtype, available, one, two, two_available, expected):
    assert pick_path(device, nbytes, dtype, available, one, two, two_available) == expected


def test_two_shot_limit_from_the_environment(monkeypatch):
    monkeypatch.delenv(TWO_SHOT_ENV, raising=False)
    assert two_shot_max_bytes() == TWO_SHOT_MAX_BYTES == 32 << 20  # on by default (checked on two H200s)
    monkeypatch.setenv(TWO_SHOT_ENV, "0")
    assert two_shot_max_bytes() == 0
    assert pick_path("cuda", 1 << 20, BF16, True, ONE_SHOT_MAX_BYTES, two_shot_max_bytes(), True) == "collective"
    monkeypatch.setenv(TWO_SHOT_ENV, str(1 << 20))
    assert two_shot_max_bytes() == 1 << 20
    for bad in ("lots", "-16"):
        monkeypatch.setenv(TWO_SHOT_ENV, bad)
        with pytest.raises(ValueError, match=TWO_SHOT_ENV):
            two_shot_max_bytes()


def test_limit_from_the_environment(monkeypatch):
    monkeypatch.delenv(ONE_SHOT_ENV, raising=False)
    assert one_shot_max_bytes() == ONE_SHOT_MAX_BYTES == 256 << 10  # on by default (checked on two H200s)
    assert use_one_shot("cuda", 4096, BF16, True, one_shot_max_bytes())
    monkeypatch.setenv(ONE_SHOT_ENV, "0")
    assert one_shot_max_bytes() == 0
    assert not use_one_shot("cuda", 4096, BF16, True, one_shot_max_bytes())  # "0": always NCCL
    monkeypatch.setenv(ONE_SHOT_ENV, " 1048576 ")
    assert one_shot_max_bytes() == 1 << 20
    assert use_one_shot("cuda", 512 << 10, BF16, True, one_shot_max_bytes())
    for bad in ("lots", "-4"):
        monkeypatch.setenv(ONE_SHOT_ENV, bad)
        with pytest.raises(ValueError, match=ONE_SHOT_ENV):
            one_shot_max_bytes()


def test_fake_impl_keeps_shape_and_dtype():
    with FakeTensorMode():
        x = torch.empty(3, 64, dtype=BF16)
        out = torch.ops.mini_infer.all_reduce_sum(x, "0")
    assert out.shape == (3, 64) and out.dtype == BF16


SHAPES = ((1, 2048), (8, 2048), (64, 96), (5, 7))


def _sums(rank: int, world_size: int, env: str | None) -> list[str]:
    """On each rank: the op (dispatcher, and the function bound into compiled graphs) against dist.all_reduce of
    the same tensors; the mismatches found."""
    import os

    import torch.distributed as dist

    if env is not None:  # both limits: on CPU ranks (gloo) every size still takes the collective
        os.environ[ONE_SHOT_ENV] = os.environ[TWO_SHOT_ENV] = env
    group = dist.group.WORLD.group_name
    bound = kernel_impls("reference")[torch.ops.mini_infer.all_reduce_sum.default]
    gen = torch.Generator().manual_seed(rank)
    errors = []
    for dtype in (torch.float32, BF16):
        for shape in SHAPES:
            x = torch.randn(shape, generator=gen).to(dtype) * (rank + 1)
            kept = x.clone()
            expected = x.clone()
            dist.all_reduce(expected)
            for how, out in (("op", torch.ops.mini_infer.all_reduce_sum(x, group)), ("bound", bound(x, group)),
                             ("view", torch.ops.mini_infer.all_reduce_sum(x.t(), group).t())):
                if not torch.equal(out, expected):
                    errors.append(f"{how} {dtype} {shape}: off by {(out.float() - expected.float()).abs().max()}")
            if not torch.equal(x, kept):
                errors.append(f"{dtype} {shape}: the input changed")
    release_symmetric_buffers()  # nothing was allocated on CPU; must not fail
    return errors


@pytest.mark.parametrize("env", [None, "0", str(TWO_SHOT_MAX_BYTES)])
def test_two_ranks_equal_dist_all_reduce(env):
    assert run_ranks(_sums, 2, env) == [[], []]


@pytest.mark.parametrize(("ranks", "peers", "refused"), [
    ([("a", 0, False), ("a", 1, False)], True, None),  # one host, peer access: agreed
    ([("a", None, False), ("a", None, False)], False, None),  # no CUDA devices named (gloo): nothing to ask
    ([("a", 0, False), ("a", 1, True)], True, None),  # a rank other than 0 with history: rank 0's decides
    ([("a", 0, True), ("a", 1, False)], True, "already used symmetric memory"),  # rank 0's process had a group
    ([("a", 0, False), ("b", 0, False)], True, "on 2 hosts (a, b)"),  # CUDA IPC maps peers on one host only
    ([("a", 0, False), ("a", 1, False)], False, "device 0 cannot access device 1"),  # no peer access
])
def test_sharing_refused(ranks, peers, refused):
    reason = sharing_refused(ranks, peer_access=lambda a, b: peers)
    assert reason is None if refused is None else refused in reason


def _agreement(rank: int, world_size: int) -> list:
    """On each rank: whether the group may set up symmetric memory, before and after rank 0 alone has an ended
    group (as a process that ran an earlier engine has; its peers are newly started and have none), and whether
    the buffer set-up is then refused with its reason said."""
    import torch.distributed as dist

    from mini_infer.ops import all_reduce

    group = dist.group.WORLD.group_name
    first = all_reduce.symmetric_memory_agreed(group)
    release_symmetric_buffers()  # forgets the answer with the group's buffers
    if rank == 0:
        all_reduce._released_before = True  # an earlier group's buffers, released
    later = all_reduce.symmetric_memory_agreed(group)
    torch.cuda.is_current_stream_capturing = lambda: False  # an eager call (this CPU build has no CUDA to ask)
    refused = all_reduce._buffer(group, BF16, torch.device("cuda", 0), 4096) is None  # (no other CUDA call first)
    said = any("already used symmetric memory" in reason for reason in all_reduce._said)
    return [first, later, refused, said]


def test_symmetric_memory_agreed_by_every_rank_from_rank_0():
    """Symmetric memory serves one process group per process (a second tensor-parallel engine's group set it up
    again and never finished on two H200s): once rank 0 has released an earlier group's buffers, a later group is
    refused on every rank, its newly started peers included (every rank gathers every rank's history over the group
    and decides alike), and the reason is said."""
    assert run_ranks(_agreement, 2) == [[True, False, True, True], [True, False, True, True]]
