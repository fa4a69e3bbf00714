"""paged_attention's long-query-run route (ops/_prefill_sdpa.py): runs of MIN_QUERY_ROWS rows or more go through
torch's fused attention kernels over their gathered context + new k/v, the rest of the step through the Triton
kernel / torch reference with those runs left out.

On CPU the route is forced (`_prefill_sdpa.ROUTE = "on"`, threshold lowered to 8 rows) and compared with the
independent float64 oracle and the reference; spies check which rows each path computed. Cases come from
test_paged_attention's builder (shuffled block tables, NaN in every slot the op must not read).
"""

import pytest
import torch

from mini_infer.ops import HAS_TRITON, _prefill_sdpa
from mini_infer.ops import paged_attention as pa
from tests.ops.helpers import DEVICE, assert_close, requires_triton
from tests.ops.test_paged_attention import check_cache, fp8_args, fp8_case, make_case, oracle

MIN_ROWS = 8
# on CUDA the fused kernels take 16-bit inputs only (fp32 runs stay on the Triton kernel)
ON_DEVICE = dict(dtype=torch.bfloat16, d=64) if DEVICE == "cuda" else {}


@pytest.fixture(autouse=True)
def forced_route(monkeypatch):
    monkeypatch.setattr(_prefill_sdpa, "ROUTE", "on")
    monkeypatch.setattr(_prefill_sdpa, "MIN_QUERY_ROWS", MIN_ROWS)


@pytest.fixture
def spies(monkeypatch):
    """Records the query rows each path computed: "sdpa" (one entry per run it returned), "rest" (the row count
    of each batch given to the reference / Triton attention)."""
    seen = {"sdpa": [], "rest": []}
    attend_run = _prefill_sdpa.attend_run

    def sdpa_spy(q, *args):
        out = attend_run(q, *args)
        if out is not None:
            seen["sdpa"].append(q.shape[0])
        return out

    def rest_spy(impl):
        def spy(q, *args, **kw):
            seen["rest"].append(q.shape[0])
            return impl(q, *args, **kw)

        return spy

    monkeypatch.setattr(_prefill_sdpa, "attend_run", sdpa_spy)
    monkeypatch.setattr(pa, "_reference_attention", rest_spy(pa._reference_attention))
    monkeypatch.setattr(pa, "_triton_attention", rest_spy(pa._triton_attention))
    return seen


def routed(case, impl="reference", scales=()):
    """(output, args) of the routed op body on `case` (fresh caches in args)."""
    args = (*case.args(), *scales)
    return pa._paged_attention_routed(*args, use_triton_kernel=impl == "triton"), args


# (seqs, make_case kwargs, query rows the route must take, rows left to the other path)
ROUTED = {
    "all_new": ([(0, 20)], {}, [20], []),
    "chunked_unaligned_context": ([(13, 20)], {}, [20], []),
    "prefix_hit_aligned_context": ([(16, 12)], {}, [12], []),
    "gqa_4": ([(9, 16)], dict(hq=8, hkv=2), [16], []),
    "mqa_bs16": ([(21, 30)], dict(hq=4, hkv=1, block_size=16), [30], []),
    "run_of_exactly_min_rows": ([(3, MIN_ROWS), (0, MIN_ROWS - 1)], {}, [MIN_ROWS], [MIN_ROWS - 1]),
    "mixed_decode_and_run": ([(5, 1), (13, 20), (0, 3), (7, 1)], dict(pad_tokens=2), [20], [5]),
    "two_runs_and_decode": ([(0, 12), (6, 1), (30, 9)], {}, [12, 9], [1]),
    "padding_sequences": ([(4, 10), (0, 0), (6, 1), (0, 0)], dict(pad_tokens=3), [10], [1]),
}


@pytest.mark.parametrize("name", list(ROUTED))
def test_route_matches_oracle_and_reference(name, spies):
    seqs, kw, sdpa_rows, rest_rows = ROUTED[name]
    case = make_case(seqs, device="cpu", **kw)
    out, args = routed(case)
    assert spies["sdpa"] == sdpa_rows  # the long runs went through the fused kernel ...
    assert spies["rest"] == ([sum(rest_rows)] if rest_rows else [])  # ... and only the other rows elsewhere
    assert not out.isnan().any()
    assert_close(out, oracle(case))
    assert_close(out, pa.paged_attention_reference(*case.args()))
    check_cache(case, args[3], args[4])  # the cache write is the one the op always does


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_route_half_precision(dtype, spies):
    case = make_case([(2, 1), (19, 25)], hq=8, hkv=2, d=32, dtype=dtype, device="cpu")
    out, args = routed(case)
    assert spies["sdpa"] == [25] and out.dtype == dtype
    assert_close(out, oracle(case))
    check_cache(case, args[3], args[4])


@requires_triton
@pytest.mark.parametrize("name", ["mixed_decode_and_run", "two_runs_and_decode", "chunked_unaligned_context"])
def test_route_with_triton_for_the_rest(name, spies):
    """The Triton kernel (CPU interpreter here) computes the rows the route leaves, on the sub-batch."""
    seqs, kw, sdpa_rows, rest_rows = ROUTED[name]
    case = make_case(seqs, device=DEVICE, **kw, **ON_DEVICE)
    out, args = routed(case, "triton")
    assert spies["sdpa"] == sdpa_rows
    assert spies["rest"] == ([sum(rest_rows)] if rest_rows else [])
    assert_close(out, oracle(case))
    check_cache(case, args[3], args[4])


def test_registered_op_takes_the_route(spies):
    case = make_case([(6, 1), (11, 17)], hq=4, hkv=2, **ON_DEVICE)
    args = case.args()
    out = torch.ops.mini_infer.paged_attention(*args)
    assert spies["sdpa"] == [17]
    assert_close(out, oracle(case))
    check_cache(case, args[3], args[4])


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_bound_kernel_takes_the_route(backend, spies):
    """Compiled graphs call ops.kernel_impls' function instead of the op (bind_kernels): it must be the op's
    routed body, not the bare kernel (which never routes), or the engine never takes the route."""
    from mini_infer.ops import kernel_impls

    case = make_case([(6, 1), (11, 17)], hq=4, hkv=2, **ON_DEVICE)
    args = case.args()
    out = kernel_impls(backend)[torch.ops.mini_infer.paged_attention.default](*args)
    assert spies["sdpa"] == [17] and spies["rest"] == [1]
    assert_close(out, oracle(case))
    check_cache(case, args[3], args[4])


@pytest.mark.parametrize(
    "name,kw",
    [
        ("sliding_window", dict(sliding_window=5)),
        ("softcap", dict(softcap=2.0, scale=1.0)),
    ],
)
def test_fallbacks_stay_on_the_kernel(name, kw, spies):
    case = make_case([(13, 20), (4, 1)], device="cpu", **kw)
    out, args = routed(case)
    assert spies["sdpa"] == [] and spies["rest"] == [21]
    assert_close(out, oracle(case))
    check_cache(case, args[3], args[4])


def test_fp8_cache_stays_on_the_kernel(spies):
    case, ks, vs = fp8_case(make_case([(13, 20), (4, 1)], dtype=torch.bfloat16, device="cpu"))
    out, args = routed(case, scales=(ks, vs))
    assert spies["sdpa"] == [] and spies["rest"] == [21]
    ref_args = fp8_args(case, ks, vs)
    assert torch.equal(out, pa.paged_attention_reference(*ref_args))
    assert torch.equal(args[3].view(torch.uint8), ref_args[3].view(torch.uint8))


def test_value_head_dim_differs(spies):
    """Dv != D: whichever backend takes it (or none: the rows then stay on the reference), the result holds."""
    case = make_case([(9, 12), (3, 1)], hq=4, hkv=4, d=32, dv=16, device="cpu")
    out, _ = routed(case)
    assert sorted(spies["sdpa"] + spies["rest"]) in ([1, 12], [13])
    assert_close(out, oracle(case))


def test_short_steps_never_read_lengths(monkeypatch, spies):
    """A step of fewer than MIN_QUERY_ROWS tokens is decided from its shape: no host read of its lengths."""
    def no_sync(*_):
        raise AssertionError("lengths read on the host")

    monkeypatch.setattr(pa, "_host_lengths", no_sync)
    case = make_case([(5, MIN_ROWS - 2), (3, 1)], device="cpu")
    out, _ = routed(case)
    assert spies["sdpa"] == [] and spies["rest"] == [MIN_ROWS - 1]
    assert_close(out, oracle(case))


def test_route_off_and_auto_on_cpu(monkeypatch, spies):
    case = make_case([(13, 20)], device="cpu")
    for route in ("off", "auto"):  # "auto" is CUDA only
        monkeypatch.setattr(_prefill_sdpa, "ROUTE", route)
        assert_close(routed(case)[0], oracle(case))
    assert spies["sdpa"] == [] and spies["rest"] == [20, 20]


def test_host_lengths_read_once_per_step(monkeypatch):
    """Every layer of a step gets the same metadata tensors: their lengths are read on the host once."""
    reads = []
    real = pa._per_step

    def counting(slot, tensors, args, compute):
        def counted():
            reads.append(slot is pa._HOST_LENGTHS)
            return compute()

        return real(slot, tensors, args, counted)

    monkeypatch.setattr(pa, "_per_step", counting)
    case = make_case([(13, 20), (2, 1)], device="cpu")
    args = case.args()
    for _ in range(3):  # three layers
        pa._paged_attention_routed(*args, use_triton_kernel=False)
    assert reads.count(True) == 1
    case.seq_lens.add_(0)  # a new step writes the metadata in place (version bump): read again
    pa._paged_attention_routed(*args, use_triton_kernel=False)
    assert reads.count(True) == 2


def test_bucket_ladder():
    """BUCKET_STEPS lengths per octave: never shorter, padding under 1/8 of the rows, exact on the ladder."""
    b = _prefill_sdpa.bucket_length
    assert [b(n) for n in (4096, 4097, 4608, 4609, 7424, 8192, 8193, 32000)] == [
        4096, 4608, 4608, 5120, 7680, 8192, 9216, 32768]
    assert sorted({b(n) for n in range(4096, 8193)}) == list(range(4096, 8193, 512))
    assert len({b(n) for n in range(4096, 32769)}) == 25
    assert all(n <= b(n) < n * 9 / 8 for n in range(1, 20000))
    assert [b(n) for n in (0, 1, 9, 23, 37)] == [0, 1, 9, 24, 40]


def test_bucket_ladder_off(monkeypatch):
    monkeypatch.setattr(_prefill_sdpa, "BUCKET_STEPS", 0)
    assert [_prefill_sdpa.bucket_length(n) for n in (23, 4097, 7424)] == [23, 4097, 7424]


@pytest.fixture
def kernel_shapes(monkeypatch):
    """The (query rows, key rows, causal) of every kernel call attend_run makes."""
    seen = []
    run = _prefill_sdpa.Backend.run

    def spy(self, q, k, v, causal, scale, lse):
        seen.append((q.shape[2], k.shape[2], causal))
        return run(self, q, k, v, causal, scale, lse)

    monkeypatch.setattr(_prefill_sdpa.Backend, "run", spy)
    return seen


def _run_inputs(n, c, hq, hkv, d, dtype, seed=3):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, hq, d, generator=gen).to(dtype)
    k = torch.randn(c + n, hkv, d, generator=gen).to(dtype)
    v = torch.randn(c + n, hkv, d, generator=gen).to(dtype)
    return q, k, v


def _want(q, k, v, c, scale):
    """Float64 bottom-right causal attention of q (positions c..) over k, v: the exact result."""
    n, hq, _ = q.shape
    g = hq // k.shape[1]
    k, v = (x.double().repeat_interleave(g, dim=1).transpose(0, 1) for x in (k, v))
    s = q.double().transpose(0, 1) @ k.transpose(1, 2) * scale
    s = s.masked_fill(torch.arange(c + n)[None, :] > torch.arange(c, c + n)[:, None], float("-inf"))
    return (torch.softmax(s, -1) @ v).transpose(0, 1)


@pytest.mark.parametrize("steps", [8, 2])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)])
@pytest.mark.parametrize("c", [0, 13])
@pytest.mark.parametrize("n", [17, 23, 37, 45])
def test_padded_runs_match_exact_lengths(n, c, hq, hkv, d, steps, monkeypatch, kernel_shapes):
    """attend_run at odd lengths: the kernels see the padded run (causal square over the padded new keys, the
    context's exact C keys) and the result equals the unpadded path and float64 attention."""
    monkeypatch.setattr(_prefill_sdpa, "BUCKET_STEPS", steps)
    q, k, v = _run_inputs(n, c, hq, hkv, d, torch.float32)
    scale = d**-0.5
    _prefill_sdpa.usable_backends(q, k, v)  # the first use probes the backends (calls of their own)
    kernel_shapes.clear()
    out = _prefill_sdpa.attend_run(q, k[c:], v[c:], k[:c], v[:c], scale)
    rows = _prefill_sdpa.bucket_length(n)
    assert rows > n
    assert kernel_shapes == [(rows, rows, True)] + ([(rows, c, False)] if c else [])
    assert out.shape == (n, hq, d) and out.isfinite().all()
    monkeypatch.setattr(_prefill_sdpa, "BUCKET_STEPS", 0)
    exact = _prefill_sdpa.attend_run(q, k[c:], v[c:], k[:c], v[:c], scale)
    assert kernel_shapes[-1][0] == n  # that call was not padded
    torch.testing.assert_close(out, exact, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(out.double(), _want(q, k, v, c, scale), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_padded_runs_half_precision(dtype, monkeypatch):
    monkeypatch.setattr(_prefill_sdpa, "BUCKET_STEPS", 2)
    q, k, v = _run_inputs(45, 13, 8, 2, 64, dtype)
    out = _prefill_sdpa.attend_run(q, k[13:], v[13:], k[:13], v[:13], 0.125)
    assert out.dtype == dtype and out.isfinite().all()
    torch.testing.assert_close(out.double(), _want(q, k, v, 13, 0.125), atol=2e-2, rtol=2e-2)


def test_padding_rows_are_zeros():
    x = torch.randn(5, 2, 3)
    p = _prefill_sdpa._padded(x, 8)
    assert p.is_contiguous() and torch.equal(p[:5], x) and torch.equal(p[5:], torch.zeros(3, 2, 3))
    assert _prefill_sdpa._padded(x, 5) is x  # already contiguous at its length: no copy


def test_merge_is_bottom_right_aligned():
    """attend_run directly: context keys all visible, new keys causal from the run's first row; the same run
    attended with the mask aligned top-left (as if the context were new rows) must differ."""
    gen = torch.Generator().manual_seed(5)
    c, n, hq, hkv, d = 11, 9, 4, 2, 16
    q = torch.randn(n, hq, d, generator=gen)
    k = torch.randn(c + n, hkv, d, generator=gen)
    v = torch.randn(c + n, hkv, d, generator=gen)
    out = _prefill_sdpa.attend_run(q, k[c:], v[c:], k[:c], v[:c], d**-0.5)
    qpos, kpos = torch.arange(c, c + n)[:, None], torch.arange(c + n)[None, :]
    for aligned, mask in (("bottom-right", kpos <= qpos), ("top-left", kpos <= qpos - c)):
        want = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=d**-0.5, enable_gqa=True
        ).transpose(0, 1)
        assert torch.allclose(out, want, atol=1e-5) == (aligned == "bottom-right")


CUDA = pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and triton")


@CUDA
@pytest.mark.parametrize("hq,hkv", [(16, 8), (28, 4)])
@pytest.mark.parametrize("seqs", [[(0, 640)], [(700, 600), (30, 1), (0, 5)], [(1024, 512), (0, 520)]])
def test_cuda_fused_backend_matches_triton(hq, hkv, seqs, spies):
    """Real head dims, bf16: a fused backend takes the runs (cuDNN first) and agrees with the Triton kernel."""
    torch.manual_seed(0)
    case = make_case(seqs, hq=hq, hkv=hkv, d=128, block_size=16, dtype=torch.bfloat16, device="cuda")
    out, args = routed(case, "triton")
    names = [b.name for b in _prefill_sdpa.usable_backends(case.q, case.k, case.v)]
    assert names, "no fused attention backend on this GPU"
    print("fused backends:", names)
    assert spies["sdpa"] == [n for _, n in seqs if n >= MIN_ROWS]
    assert not out.isnan().any()
    assert_close(out, pa.paged_attention_triton(*case.args()))
    check_cache(case, args[3], args[4])


@CUDA
def test_cuda_graph_capture_skips_the_route(spies):
    """While a graph is captured the route is off (no host read): the captured step is the Triton kernel's."""
    case = make_case([(7, 12), (3, 1)], seed=1, cache_fill=0.0, **ON_DEVICE)
    static = list(case.args())
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.ops.mini_infer.paged_attention(*static)  # warm-up, eager: takes the route
        pa.paged_attention_triton(*static)  # compiles the kernel shape the capture will launch
    torch.cuda.current_stream().wait_stream(stream)
    assert spies["sdpa"] == [12]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.mini_infer.paged_attention(*static)
    assert spies["sdpa"] == [12]
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, oracle(case))
