"""`mini_infer::gather_rows`: several table lookups (`aten.embedding`) in one launch.

    gather_rows([t_0, .., t_n-1], [i_0, .., i_n-1]) == [embedding(t_0, i_0), .., embedding(t_n-1, i_n-1)]

Each table t_j is 2-D [rows_j, width_j] (any row stride, unit column stride; other layouts are copied first), each
index tensor i_j integer of any shape; output j is t_j's rows at i_j, shaped i_j.shape + [width_j], with t_j's dtype
and device: exactly what `aten.embedding` returns (a copy of the rows, bit for bit). At most `MAX_TABLES` tables
a call; the tables' dtypes and widths may differ (float16 / bfloat16 / float32, or any integer type; complex tables
are refused: the Triton kernel has no complex type).

Inserted by the FuseLookups pass (passes/fuse_lookups.py) for the lookups a decode step starts with: the token
embedding and rotary_table's cos / sin tables. Each is a kernel of its own in torch (2.0-2.2 us at qwen3-0.6b batch 1
on an H200, one after the other before the first layer can start); here they are the programs of one launch: a
grid of (index elements of the longest index, tables), program (r, j) copying row i_j[r] of t_j when r is below
i_j's element count. Launched with programmatic dependent launch (`pdl_args`): each program waits for the kernel
before it (`await_producers`) before it reads its index.

Indices must lie in [0, rows_j): the reference raises as `aten.embedding` does on a CPU; the kernel does not check
them (torch's CUDA embedding asserts on the device). The runtime never feeds one out of range: token ids are
checked against the vocabulary when a request is added, positions stay below `max_model_len`, which the engine
keeps within rotary_table's tables (passes/rotary_table.py).

Imports nothing from mini_infer outside `mini_infer.ops`.
"""

from __future__ import annotations

import torch

from mini_infer.ops._triton_support import (
    HAS_TRITON,
    await_producers,
    next_pow2,
    pdl_args,
    tl,
    triton,
    use_triton,
)

__all__ = ["MAX_TABLES", "gather_rows", "gather_rows_reference", "gather_rows_triton"]

MAX_TABLES = 4  # tables one call (and one launch) takes
MAX_BLOCK = 4096  # row elements a program copies per step (wider rows take several steps)


def _check(tables: list[torch.Tensor], indices: list[torch.Tensor]) -> None:
    """ValueError naming the argument for what neither implementation serves."""
    if not 1 <= len(tables) <= MAX_TABLES or len(indices) != len(tables):
        raise ValueError(f"gather_rows: 1 to {MAX_TABLES} tables and one index tensor per table, got "
                         f"{len(tables)} tables and {len(indices)} index tensors")
    for j, (t, i) in enumerate(zip(tables, indices)):
        if t.dim() != 2:
            raise ValueError(f"gather_rows: tables[{j}] must be 2-D [rows, width], got shape {tuple(t.shape)}")
        if t.is_complex():
            raise ValueError(f"gather_rows: tables[{j}] is {t.dtype}; complex tables are not supported")
        if i.is_floating_point() or i.is_complex() or i.dtype == torch.bool:
            raise ValueError(f"gather_rows: indices[{j}] must be an integer tensor, got {i.dtype}")
        if i.device != t.device:
            raise ValueError(f"gather_rows: indices[{j}] is on {i.device}, tables[{j}] on {t.device}")


def _empty_outputs(tables: list[torch.Tensor], indices: list[torch.Tensor]) -> list[torch.Tensor]:
    """Output j: index j's shape + table j's width, table j's dtype and device (the op's shape rule)."""
    return [t.new_empty((*i.shape, t.shape[1])) for t, i in zip(tables, indices)]


def gather_rows_reference(tables: list[torch.Tensor], indices: list[torch.Tensor]) -> list[torch.Tensor]:
    """Plain torch: one `aten.embedding` per table."""
    _check(tables, indices)
    return [torch.ops.aten.embedding.default(t, i) for t, i in zip(tables, indices)]


if HAS_TRITON:

    @triton.jit
    def _copy_row(t_ptr, i_ptr, o_ptr, r, n_idx, width, stride_t, BLOCK: tl.constexpr):
        """out row r = table row idx[r], in BLOCK-element steps; nothing when r >= n_idx (a shorter index)."""
        if r < n_idx:
            row = tl.load(i_ptr + r).to(tl.int64)
            src = t_ptr + row * stride_t
            dst = o_ptr + r.to(tl.int64) * width
            for c in range(0, width, BLOCK):
                cols = c + tl.arange(0, BLOCK)
                ok = cols < width
                tl.store(dst + cols, tl.load(src + cols, mask=ok), mask=ok)

    @triton.jit
    def _gather_rows_kernel(
        t0, i0, o0, n0, w0, s0, t1, i1, o1, n1, w1, s1, t2, i2, o2, n2, w2, s2, t3, i3, o3, n3, w3, s3,
        B0: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr, B3: tl.constexpr, USE_GDC: tl.constexpr,
    ):  # fmt: skip
        await_producers(USE_GDC)
        r = tl.program_id(0)
        j = tl.program_id(1)
        if j == 0:
            _copy_row(t0, i0, o0, r, n0, w0, s0, B0)
        elif j == 1:
            _copy_row(t1, i1, o1, r, n1, w1, s1, B1)
        elif j == 2:
            _copy_row(t2, i2, o2, r, n2, w2, s2, B2)
        else:
            _copy_row(t3, i3, o3, r, n3, w3, s3, B3)


def _row_major(t: torch.Tensor) -> torch.Tensor:
    """t, or a copy of it, with a unit column stride (rows may keep any stride)."""
    return t if t.stride(1) == 1 or t.shape[1] <= 1 else t.contiguous()


def gather_rows_triton(tables: list[torch.Tensor], indices: list[torch.Tensor]) -> list[torch.Tensor]:
    """One Triton launch for every lookup (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1)."""
    if not HAS_TRITON:
        raise RuntimeError("gather_rows_triton needs triton")
    _check(tables, indices)
    outs = _empty_outputs(tables, indices)
    n_max = max(i.numel() for i in indices)
    if n_max == 0 or all(o.numel() == 0 for o in outs):
        return outs
    args, blocks = [], []
    for t, i, o in zip(tables, indices, outs):
        t2 = _row_major(t)
        args += [t2, i.reshape(-1), o, i.numel(), t2.shape[1], t2.stride(0)]
        blocks.append(min(MAX_BLOCK, next_pow2(max(t2.shape[1], 1))))
    n = len(tables)
    for _ in range(MAX_TABLES - n):  # unused slots: the first table's operands, no program reads them
        args += args[:6]
        blocks.append(blocks[0])
    _gather_rows_kernel[(n_max, n)](
        *args, B0=blocks[0], B1=blocks[1], B2=blocks[2], B3=blocks[3], num_warps=4, **pdl_args(outs[0]),
    )  # fmt: skip
    return outs


@torch.library.custom_op("mini_infer::gather_rows", mutates_args=())
def gather_rows(tables: list[torch.Tensor], indices: list[torch.Tensor]) -> list[torch.Tensor]:
    """`aten.embedding(tables[j], indices[j])` for every j, in one launch on CUDA (the torch reference elsewhere)."""
    if use_triton(tables[0]):
        return gather_rows_triton(tables, indices)
    return gather_rows_reference(tables, indices)


@gather_rows.register_fake
def _(tables: list[torch.Tensor], indices: list[torch.Tensor]) -> list[torch.Tensor]:
    _check(tables, indices)
    return _empty_outputs(tables, indices)
