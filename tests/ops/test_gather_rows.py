"""`gather_rows`: several `aten.embedding` lookups in one launch, bit-equal to them, under the Triton interpreter
here: every table dtype, row widths below, at and past one copy step, strided and transposed tables, index tensors
of other shapes, dtypes and lengths (programs past a shorter index write nothing), one to four tables in one launch;
the registered op, its fake shapes, and the arguments it refuses."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import mini_infer.ops  # noqa: F401  (registers torch.ops.mini_infer.*)
from mini_infer.ops import gather_rows as gather_mod
from mini_infer.ops.gather_rows import MAX_BLOCK, MAX_TABLES, gather_rows_reference, gather_rows_triton
from tests.ops.helpers import DEVICE, record_kernel_launches, requires_triton

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64]


def _table(rows: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.randn(rows, width, generator=gen) * 3).to(dtype)
    return torch.randint(-1000, 1000, (rows, width), generator=gen, dtype=dtype)


def _ids(rows: int, shape: tuple, seed: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.randint(0, rows, shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def assert_gathers(tables: list[torch.Tensor], indices: list[torch.Tensor]) -> list[torch.Tensor]:
    """The kernel's outputs equal aten.embedding's (computed on the CPU) bit for bit, in shape, dtype and values."""
    got = gather_rows_triton([t.to(DEVICE) for t in tables], [i.to(DEVICE) for i in indices])
    assert len(got) == len(tables)
    for out, t, i in zip(got, tables, indices):
        want = torch.ops.aten.embedding.default(t, i)
        assert out.dtype == t.dtype and out.shape == want.shape
        assert torch.equal(out.cpu(), want), (out.cpu(), want)
    return got


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1, 7, 128, MAX_BLOCK, MAX_BLOCK + 5])
def test_one_table_matches_embedding(dtype, width):
    rows = 3 if width > MAX_BLOCK else 20
    assert_gathers([_table(rows, width, dtype, width)], [_ids(rows, (1, 9), width)])


@requires_triton
def test_three_tables_of_a_decode_step_in_one_launch(monkeypatch):
    """The lookups a step starts with (token embedding by input_ids, cos and sin by position_ids): one launch."""
    launches = record_kernel_launches(monkeypatch, gather_mod, "_gather_rows_kernel")
    embed, cos, sin = _table(512, 64, torch.bfloat16, 0), _table(1024, 32, torch.float32, 1), \
        _table(1024, 32, torch.float32, 2)
    for tokens in (1, 5):
        ids, pos = _ids(512, (1, tokens), tokens), 100 + torch.arange(tokens)[None]
        assert_gathers([embed, cos, sin], [ids, pos, pos])
    assert launches == ["_gather_rows_kernel"] * 2


@requires_triton
@pytest.mark.parametrize("num_tables", range(1, MAX_TABLES + 1))
def test_indices_of_other_lengths_shapes_and_dtypes(num_tables):
    """Table j's index has its own length: programs past it write nothing, every output row is its own table's."""
    shapes = [(1, 7), (3,), (2, 2), (1,)][:num_tables]
    tables = [_table(30 + j, 4 + 3 * j, DTYPES[j], j) for j in range(num_tables)]
    indices = [_ids(30 + j, s, 10 + j, torch.int32 if j % 2 else torch.int64) for j, s in enumerate(shapes)]
    assert_gathers(tables, indices)


@requires_triton
def test_strided_tables():
    """A table whose rows are a slice of wider rows (row stride > width) is read in place; one whose columns are
    strided (a transposed view) is copied first: both give embedding's rows."""
    wide = _table(40, 24, torch.float32, 3)
    ids = _ids(40, (1, 6), 4)
    assert_gathers([wide[:, 8:16], wide.t()[:, :40].t()[:, 2:5], _table(24, 40, torch.bfloat16, 5).t()],
                   [ids, ids, ids])


@requires_triton
def test_empty_index():
    """An index without elements gives an empty output (and no launch if every index is empty)."""
    table = _table(10, 8, torch.float32, 6)
    got = assert_gathers([table, table], [torch.empty(1, 0, dtype=torch.int64), _ids(10, (1, 2), 7)])
    assert got[0].shape == (1, 0, 8)
    assert assert_gathers([table], [torch.empty(0, dtype=torch.int64)])[0].shape == (0, 8)


def test_registered_op_and_fake_shapes():
    """The op on CPU tensors runs the reference; its fake impl gives each output the index's shape + the width,
    the table's dtype."""
    embed, cos = _table(50, 16, torch.bfloat16, 8), _table(60, 8, torch.float32, 9)
    ids, pos = _ids(50, (1, 4), 1), _ids(60, (1, 4), 2)
    out = torch.ops.mini_infer.gather_rows([embed, cos], [ids, pos])
    assert [torch.equal(o, t[i]) for o, t, i in zip(out, (embed, cos), (ids, pos))] == [True, True]
    with FakeTensorMode() as mode:
        fakes = [mode.from_tensor(x) for x in (embed, cos, ids, pos)]
        shapes = torch.ops.mini_infer.gather_rows(fakes[:2], fakes[2:])
    assert [(tuple(s.shape), s.dtype) for s in shapes] == [((1, 4, 16), torch.bfloat16), ((1, 4, 8), torch.float32)]


@pytest.mark.parametrize("impl", [gather_rows_reference, torch.ops.mini_infer.gather_rows])
def test_refuses_what_it_cannot_serve(impl):
    table, ids = _table(10, 4, torch.float32, 0), _ids(10, (1, 3), 0)
    bad = {
        "1 to 4 tables": ([table] * (MAX_TABLES + 1), [ids] * (MAX_TABLES + 1)),
        "one index tensor per table": ([table, table], [ids]),
        "tables\\[1\\] must be 2-D": ([table, table[0]], [ids, ids]),
        "tables\\[0\\] is torch.complex64": ([torch.zeros(10, 4, dtype=torch.complex64)], [ids]),
        "indices\\[0\\] must be an integer tensor": ([table], [ids.float()]),
    }
    for message, (tables, indices) in bad.items():
        with pytest.raises(ValueError, match=message):
            impl(tables, indices)
    with pytest.raises(IndexError):  # the reference, as aten.embedding on a CPU: an index past the table
        gather_rows_reference([table], [torch.tensor([10])])
