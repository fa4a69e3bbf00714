"""rotary_paged_attention: qk_rotary then paged_attention, the rotary inside a decode step's attention launch.

Decode-shaped launches (one query row per tile; paged_attention's cases with runs of up to three new tokens, GQA,
splits with the fused merge and with the reduce kernel, a sliding window, rows no sequence owns, one with a slot)
launch `_paged_attn_kernel` alone, no `_qk_rotary_kernel`, and leave the output and the cache bytes of
`qk_rotary_triton` then `paged_attention_triton` bit for bit (interpreter; on a GPU within the dtype's tolerance,
whose compiler contracts fp32 arithmetic its own way; fp32 and bf16, with and without Qwen3's
head norms, an fp8 cache), close to the two references (but for the fp8 cache: the interpreter's bf16 truncation of
the rotated k moves some keys a whole e4m3 step); a prefill-shaped launch, and a head dim that is no power of two,
run the unfused kernels, as does a query group above the launch's limit (ROTARY_MAX_GROUP for one-split launches,
ROTARY_MAX_GROUP_SPLIT for split ones; the decode cases lift the limit to test the kernel's math at every group). The registered op's fake and opcheck; the reference entry equals the references in
sequence.
"""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from mini_infer.ops import paged_attention as pa
from mini_infer.ops import qk_rotary as qr
from mini_infer.ops import rotary_paged_attention as rpa
from mini_infer.ops.qk_rotary import qk_rotary_reference, qk_rotary_triton
from mini_infer.ops.rotary_paged_attention import (
    rotary_paged_attention_reference,
    rotary_paged_attention_reference_entry,
    rotary_paged_attention_triton,
)
from tests.ops.helpers import TOL, assert_close, record_kernel_launches, requires_triton
from tests.ops.test_paged_attention import (  # small_key_tiles: a fixture (16-key tiles, several splits)
    CASES,
    Case,
    fused_write_case,
    make_case,
    same_bytes,
    small_key_tiles,  # noqa: F401
)

EPS = 1e-6


def rotary_args(case: Case, norms: bool, seed: int = 0) -> tuple:
    """(q, k, v as [1, H, T, D] views of the case's packed rows; cos, sin [1, 1, T, D] at each token's position;
    q_weight, k_weight or None; eps)."""
    t, _, d = case.q.shape
    gen = torch.Generator().manual_seed(seed)
    pos = torch.zeros(t)
    qsl, lens = case.query_start_loc.tolist(), case.seq_lens.tolist()
    for s, ln in enumerate(lens):
        pos[qsl[s] : qsl[s + 1]] = torch.arange(ln - (qsl[s + 1] - qsl[s]), ln, dtype=torch.float32)
    emb = pos[:, None] / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    emb = torch.cat((emb, emb), -1)[None, None]
    dtype, dev = case.q.dtype, case.q.device
    weights = [(torch.rand(d, generator=gen) + 0.5).to(dtype).to(dev) if norms else None for _ in range(2)]
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (case.q, case.k, case.v))
    return (q, k, v, emb.cos().to(dtype).to(dev), emb.sin().to(dtype).to(dev), *weights, EPS)


def unfused_triton(rot: tuple, attn_args: tuple, **knobs) -> torch.Tensor:
    """qk_rotary_triton, then paged_attention_triton of its packed outputs (the pair the op replaces)."""
    q2, k2 = qk_rotary_triton(*rot[:2], *rot[3:])
    packed = (x.select(0, 0).transpose(0, 1) for x in (q2, k2, rot[2]))
    return pa.paged_attention_triton(*packed, *attn_args, **knobs)


@pytest.fixture
def launches(monkeypatch):
    """Launches of qk_rotary's kernel and paged_attention's write and attention kernels, in order."""
    record = record_kernel_launches(monkeypatch, qr, "_qk_rotary_kernel")
    return record_kernel_launches(monkeypatch, pa, "_write_kv_kernel", "_paged_attn_kernel", launches=record)


# (FUSED_WRITE case, dtype, fp8 cache, head norms)
DECODE = [
    ("qlen2_splits", torch.float32, False, True),
    ("qlen2_splits_reduce", torch.bfloat16, False, False),
    ("qlen2_one_split_g4", torch.bfloat16, False, True),
    ("window_qlen3", torch.float32, False, False),
    ("padding", torch.bfloat16, True, True),
]


def _assert_gpu_close(out, want, caches, want_caches, dtype) -> None:
    """On a GPU: the output within the dtype's tolerance, each 16-bit cache too, and an fp8 cache's bytes equal but
    for at most 2% of them (an ulp of the rotated k can move a key one e4m3 step)."""
    assert_close(out, want, dtype)
    for got, ref in zip(caches, want_caches):
        if got.dtype == torch.float8_e4m3fn:
            differ = (got.view(torch.uint8) != ref.view(torch.uint8)).float().mean().item()
            assert differ <= 0.02, differ
        else:  # unwritten slots hold NaN in both
            atol, rtol = TOL[dtype]
            torch.testing.assert_close(got.float().cpu(), ref.float().cpu(), atol=atol, rtol=rtol, equal_nan=True)


@requires_triton
@pytest.mark.usefixtures("small_key_tiles")
@pytest.mark.parametrize("name,dtype,fp8,norms", DECODE)
def test_decode_launch_is_the_unfused_pair_bitwise(launches, monkeypatch, name, dtype, fp8, norms):
    monkeypatch.setattr(rpa, "ROTARY_MAX_GROUP", 64)  # the kernel's math at every group size (g4 included)
    monkeypatch.setattr(rpa, "ROTARY_MAX_GROUP_SPLIT", 64)
    case, scales, knobs = fused_write_case(name, dtype, fp8)
    rot = rotary_args(case, norms)
    args = case.args()
    out = rotary_paged_attention_triton(*rot, *args[3:], *scales, **knobs)
    assert launches == ["_paged_attn_kernel"]
    launches.clear()
    want_args = case.args()
    want = unfused_triton(rot, (*want_args[3:], *scales), **knobs)
    assert launches[0] == "_qk_rotary_kernel"
    if out.is_cuda:  # the GPU compiler contracts the norm's and rotary's fp32 arithmetic its own way: an ulp apart
        _assert_gpu_close(out, want, args[3:5], want_args[3:5], dtype)
    else:
        assert torch.equal(out, want)
        assert same_bytes(args[3], want_args[3]) and same_bytes(args[4], want_args[4])
    if name == "padding":  # the padding row's slot holds its rotated k (the unfused kernels' bytes, checked above)
        slot = int(case.slot_mapping[-1])
        assert not args[3].float()[slot // 4, slot % 4].isnan().any()
    if fp8:  # the interpreter truncates the rotated bf16 k where torch rounds: another e4m3 step now and then
        return
    ref_args = [x.cpu() if torch.is_tensor(x) else x for x in case.args()]
    ref = rotary_paged_attention_reference(*(x.cpu() if torch.is_tensor(x) else x for x in rot), *ref_args[3:])
    assert_close(out, ref.to(out.device))
    assert_close(args[3].nan_to_num(0.0), ref_args[3].to(args[3].device).nan_to_num(0.0))


@requires_triton
def test_prefill_launch_runs_the_unfused_kernels(launches):
    case = make_case(**CASES["chunked_prefill"], d=32, dtype=torch.bfloat16)
    rot = rotary_args(case, norms=True)
    args = case.args()
    out = rotary_paged_attention_triton(*rot, *args[3:])
    assert launches == ["_qk_rotary_kernel", "_write_kv_kernel", "_paged_attn_kernel"]
    want_args = case.args()
    assert torch.equal(out, unfused_triton(rot, want_args[3:]))
    assert same_bytes(args[3], want_args[3]) and same_bytes(args[4], want_args[4])


@requires_triton
@pytest.mark.usefixtures("small_key_tiles")
def test_group_above_the_limit_runs_the_unfused_kernels(launches):
    """A decode step whose query group (4 heads a kv head) exceeds ROTARY_MAX_GROUP: the two kernels, same values."""
    assert rpa.ROTARY_MAX_GROUP < 4
    case, scales, knobs = fused_write_case("qlen2_one_split_g4", torch.bfloat16, False)
    rot = rotary_args(case, norms=True)
    args = case.args()
    out = rotary_paged_attention_triton(*rot, *args[3:], *scales, **knobs)
    assert launches == ["_qk_rotary_kernel", "_paged_attn_kernel"]
    want_args = case.args()
    assert torch.equal(out, unfused_triton(rot, (*want_args[3:], *scales), **knobs))


@requires_triton
@pytest.mark.usefixtures("small_key_tiles")
@pytest.mark.parametrize("split_limit,want", [(8, ["_paged_attn_kernel"]), (2, ["_qk_rotary_kernel", "_paged_attn_kernel"])])
def test_split_launch_takes_groups_up_to_the_split_limit(launches, monkeypatch, split_limit, want):
    """The same group of 4 in a split launch (num_splits=2): one kernel up to ROTARY_MAX_GROUP_SPLIT, two above it;
    the same values either way."""
    monkeypatch.setattr(rpa, "ROTARY_MAX_GROUP_SPLIT", split_limit)
    case, scales, _ = fused_write_case("qlen2_one_split_g4", torch.bfloat16, False)
    rot = rotary_args(case, norms=True)
    args = case.args()
    out = rotary_paged_attention_triton(*rot, *args[3:], num_splits=2)
    assert launches == want
    launches.clear()
    want_args = case.args()
    expected = unfused_triton(rot, want_args[3:], num_splits=2)
    if out.is_cuda:
        _assert_gpu_close(out, expected, args[3:5], want_args[3:5], torch.bfloat16)
    else:
        assert torch.equal(out, expected)


def test_max_group_by_launch():
    """Split launches (forced, or a small batch on a GPU) take ROTARY_MAX_GROUP_SPLIT, one-split ones ROTARY_MAX_GROUP;
    off a GPU the default launch never splits."""
    q, k, lens = torch.zeros(1, 8, 1, 16), torch.zeros(1, 2, 1, 16), torch.ones(1, dtype=torch.int32)
    assert rpa.max_group(q, k, lens, 2) == rpa.ROTARY_MAX_GROUP_SPLIT
    assert rpa.max_group(q, k, lens, 1) == rpa.ROTARY_MAX_GROUP
    assert rpa.max_group(q, k, lens, None) == rpa.ROTARY_MAX_GROUP  # CPU tensors: default_num_splits is 1
    if torch.cuda.is_available():
        assert rpa.max_group(q.cuda(), k.cuda(), lens.cuda(), None) == rpa.ROTARY_MAX_GROUP_SPLIT  # 2 programs


@requires_triton
def test_head_dim_not_a_power_of_two_runs_the_unfused_kernels(launches):
    """D = 24: the kernel's head tile (32) is not the head dim, so the rotated halves cannot sit side by side."""
    case = make_case(**CASES["decode_gqa"], d=24)
    rot = rotary_args(case, norms=False)
    args = case.args()
    out = rotary_paged_attention_triton(*rot, *args[3:])
    assert launches == ["_qk_rotary_kernel", "_paged_attn_kernel"]
    want_args = case.args()
    assert torch.equal(out, unfused_triton(rot, want_args[3:]))
    assert same_bytes(args[3], want_args[3])


def test_reference_entry_is_the_two_references():
    case = make_case(**CASES["sliding_window"], device="cpu")
    rot = rotary_args(case, norms=True)
    args, want_args = case.args(), case.args()
    out = rotary_paged_attention_reference_entry(*rot, *args[3:])
    q2, k2 = qk_rotary_reference(*rot[:2], *rot[3:])
    packed = [x.select(0, 0).transpose(0, 1) for x in (q2, k2, rot[2])]
    want = pa.paged_attention_reference_entry(*packed, *want_args[3:])
    assert torch.equal(out, want) and torch.equal(args[3].nan_to_num(7.0), want_args[3].nan_to_num(7.0))


def test_registered_op_fake_and_opcheck():
    case = make_case(**CASES["decode_gqa"], dtype=torch.bfloat16, cache_fill=0.0, device="cpu")
    rot = rotary_args(case, norms=True)
    args = (*rot, *case.args()[3:])
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        out = torch.ops.mini_infer.rotary_paged_attention(*fake)
    assert out.shape == case.q.shape and out.dtype == torch.bfloat16
    torch.library.opcheck(torch.ops.mini_infer.rotary_paged_attention.default, args)


@requires_triton
@pytest.mark.usefixtures("small_key_tiles")
@pytest.mark.parametrize("name,dtype", [("qlen2_splits", torch.float32), ("qlen2_splits_reduce", torch.bfloat16),
                                        ("window_qlen3", torch.float32)])
def test_sinks_in_the_decode_launch_are_the_unfused_pair_bitwise(launches, monkeypatch, name, dtype):
    """Attention sinks (GPT-OSS), the op's last argument: the one launch applying the rotary takes them as
    paged_attention_triton does (same bits), and the reference entry as the references do."""
    monkeypatch.setattr(rpa, "ROTARY_MAX_GROUP", 64)
    monkeypatch.setattr(rpa, "ROTARY_MAX_GROUP_SPLIT", 64)
    case, _, knobs = fused_write_case(name, dtype, False)
    sinks = (torch.randn(case.q.shape[1], generator=torch.Generator().manual_seed(9)) * 2).to(case.q.device)
    rot = rotary_args(case, norms=True)
    args = case.args()
    out = rotary_paged_attention_triton(*rot, *args[3:], None, None, sinks, **knobs)
    assert launches == ["_paged_attn_kernel"]
    want_args = case.args()
    want = unfused_triton(rot, (*want_args[3:], None, None, sinks), **knobs)
    if out.is_cuda:
        _assert_gpu_close(out, want, args[3:5], want_args[3:5], dtype)
    else:
        assert torch.equal(out, want)
    cpu = lambda xs: [x.cpu() if torch.is_tensor(x) else x for x in xs]  # noqa: E731
    ref = rotary_paged_attention_reference_entry(*cpu(rot), *cpu(case.args()[3:]), None, None, sinks.cpu())
    assert_close(out, ref.to(out.device))
    without = rotary_paged_attention_reference_entry(*cpu(rot), *cpu(case.args()[3:]))
    assert not torch.allclose(ref.float(), without.float(), atol=1e-2)  # the sinks matter
    q2, k2 = qk_rotary_reference(*cpu(rot[:2]), *cpu(rot[3:]))
    packed = [x.select(0, 0).transpose(0, 1) for x in (q2, k2, rot[2].cpu())]
    assert torch.equal(ref, pa.paged_attention_reference_entry(*packed, *cpu(case.args()[3:]), None, None,
                                                                sinks.cpu()))
