"""`gumbel_argmax`: the sampler's one-pass draw. The kernel picks exactly the argmax of x * inv_t + its Philox Gumbel
noise (recomputed here by a helper kernel from the same `gumbel_noise`), greedy rows (inv_t <= 0) pick torch.argmax's
id, the draws follow softmax(x / T) (kernel and torch reference alike), the same seed repeats a draw, and bad input
is refused naming the field."""

import math

import pytest
import torch

import mini_infer.ops  # noqa: F401  (registers torch.ops.mini_infer.*)
from mini_infer.ops.gumbel_argmax import MAX_SEED, gumbel_argmax_reference, gumbel_argmax_triton
from tests.ops.helpers import DEVICE, requires_triton

try:
    import triton
    import triton.language as tl

    from mini_infer.ops.argmax import gumbel_noise

    @triton.jit
    def _noise_kernel(out_ptr, n_cols, seed, BLOCK: tl.constexpr):
        """The noise of every element, from `gumbel_noise` in tiles of its own size (the stream does not depend on
        the tiling)."""
        row = tl.program_id(0)
        start = tl.program_id(1) * BLOCK
        c = start + tl.arange(0, BLOCK)
        g = gumbel_noise(seed, row * ((n_cols + 3) // 4 * 4) + start, BLOCK)
        tl.store(out_ptr + row * n_cols + c, g, mask=c < n_cols)
except ImportError:  # no triton: the kernel tests are skipped
    pass


def expected_ids(x: torch.Tensor, inv_t: torch.Tensor, seed: int) -> torch.Tensor:
    """argmax of x * inv_t + the kernel's own noise (greedy rows: of x), from the noise the helper kernel writes."""
    rows, cols = x.shape
    g = torch.empty((rows, cols), dtype=torch.float32, device=x.device)
    _noise_kernel[(rows, triton.cdiv(cols, 1024))](g, cols, seed, BLOCK=1024)
    scores = torch.where(inv_t[:, None] > 0, x.float() * inv_t[:, None] + g, x.float())
    return scores.cpu().argmax(dim=-1)


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,cols", [(1, 7), (3, 1000), (5, 5000), (2, 151936)])
def test_kernel_draws_the_argmax_of_scaled_logits_plus_its_noise(dtype, rows, cols):
    """Exactly the argmax of x * inv_t + g (rows split over several programs at the longer vocabularies), and
    torch.argmax's id on the greedy rows (inv_t 0 or negative) in the same launch."""
    gen = torch.Generator().manual_seed(rows * cols)
    x = (torch.randn(rows, cols, generator=gen) * 3).to(dtype).to(DEVICE)
    inv_t = torch.tensor([1 / 0.7, 0.0, 2.0, -1.0, 1.0][:rows], dtype=torch.float32).repeat(2)[:rows].to(DEVICE)
    got = gumbel_argmax_triton(x, inv_t, seed=1234)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert torch.equal(got.cpu(), expected_ids(x, inv_t, 1234))
    greedy = (inv_t <= 0).cpu()
    assert torch.equal(got.cpu()[greedy], x.cpu().argmax(dim=-1)[greedy])


@requires_triton
def test_same_seed_same_draw_other_seed_other_draws():
    x = torch.zeros(64, 512, device=DEVICE)  # uniform rows: every id equally likely
    inv_t = torch.ones(64, device=DEVICE)
    a, b = gumbel_argmax_triton(x, inv_t, 7), gumbel_argmax_triton(x, inv_t, 7)
    c = gumbel_argmax_triton(x, inv_t, 8)
    assert torch.equal(a, b)
    assert (a != c).sum() > 32  # two independent draws over 512 ids: almost never equal
    assert len(set(a.tolist())) > 32  # the rows draw apart (their noise counters differ)


def _kernel_variants() -> int:
    """How many compiled variants of the argmax kernel this process holds (0 under the interpreter)."""
    from mini_infer.ops.argmax import _argmax_rows_kernel

    caches = getattr(_argmax_rows_kernel, "device_caches", {})
    return sum(len(c[0]) for c in caches.values())


@requires_triton
def test_a_new_seed_builds_no_new_kernel_variant():
    """The seed changes every sampling step: it must not be a specialization key, or the first seed divisible by 16
    (or equal to 1) compiles another variant mid-serving (a second's stall on a machine with a cold kernel cache)."""
    from mini_infer.ops.argmax import _argmax_rows_kernel

    declared = getattr(_argmax_rows_kernel, "kwargs", {}).get("do_not_specialize")  # the interpreter's copy
    if declared is None:
        declared = [p.name for p in _argmax_rows_kernel.params if p.do_not_specialize]
    assert "seed" in declared
    x, inv_t = torch.zeros(4, 512, device=DEVICE), torch.ones(4, device=DEVICE)
    gumbel_argmax_triton(x, inv_t, 17)
    before = _kernel_variants()
    for seed in (1, 16, 32, 33):  # Triton's specialization classes of an int: == 1, % 16 == 0, other
        gumbel_argmax_triton(x, inv_t, seed)
    assert _kernel_variants() == before


def _frequencies(ids: torch.Tensor, cols: int) -> torch.Tensor:
    return torch.bincount(ids.cpu(), minlength=cols).double() / ids.numel()


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_draws_follow_the_tempered_softmax(impl):
    """Rows of the same logits (4,000; 1,200 for the kernel, a program a row under the interpreter): each id's
    frequency within 5 standard deviations of softmax(x / T). At 1,200 rows 5 sigma is at most 0.072, below the 0.10
    by which the most likely id's probability moves between T = 0.7 and T = 1 (a kernel that ignored T fails)."""
    if impl == "triton":
        pytest.importorskip("triton")
    cols, rows, temp = 6, (1200 if impl == "triton" else 4000), 0.7
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 1.5])
    x = logits.repeat(rows, 1).to(DEVICE)
    inv_t = torch.full((rows,), 1 / temp, device=DEVICE)
    fn = gumbel_argmax_triton if impl == "triton" else gumbel_argmax_reference
    freq = _frequencies(fn(x, inv_t, 99), cols)
    p = torch.softmax(logits.double() / temp, dim=0)
    sigma = (p * (1 - p) / rows).sqrt()
    assert ((freq - p).abs() <= 5 * sigma + 1e-9).all(), (freq, p)


def test_reference_greedy_rows_are_torch_argmax():
    x = torch.randn(4, 300)
    inv_t = torch.tensor([0.0, 1.0, 0.0, 2.0])
    got = gumbel_argmax_reference(x, inv_t, 5)
    assert got[0] == x[0].argmax() and got[2] == x[2].argmax()


def test_op_dispatch_on_cpu_runs_the_reference():
    x, inv_t = torch.randn(3, 50), torch.ones(3)
    assert torch.equal(torch.ops.mini_infer.gumbel_argmax(x, inv_t, 3), gumbel_argmax_reference(x, inv_t, 3))


@requires_triton
def test_nan_logit_wins_a_noisy_row():
    x = torch.zeros(2, 3000, device=DEVICE)
    x[0, 1234] = math.nan
    got = gumbel_argmax_triton(x, torch.ones(2, device=DEVICE), 11)
    assert got[0].item() == 1234


@pytest.mark.parametrize("impl", [gumbel_argmax_reference, gumbel_argmax_triton])
def test_bad_input_is_refused_naming_the_field(impl):
    if impl is gumbel_argmax_triton:
        pytest.importorskip("triton")
    x = torch.randn(2, 10)
    with pytest.raises(ValueError, match="x must be"):
        impl(x[0], torch.ones(2), 1)
    with pytest.raises(ValueError, match="inv_temperature"):
        impl(x, torch.ones(3), 1)
    with pytest.raises(ValueError, match="inv_temperature"):
        impl(x, torch.ones(2, dtype=torch.float64), 1)
    with pytest.raises(ValueError, match="seed"):
        impl(x, torch.ones(2), MAX_SEED)
    with pytest.raises(ValueError, match="seed"):
        impl(x, torch.ones(2), -1)
