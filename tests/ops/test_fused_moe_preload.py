"""fused_moe's loads before the PDL wait (fused_moe.MOE_PRELOAD; fused_moe.py's module docstring, "Before the wait").

With the switch on, the down GEMM of a call at decode tiles (and the slot sum after it, a launch of its own unless
fused_moe.MOE_MERGE_SLOTS puts it in the down GEMM's: pair-per-block mode, both ways run here) is launched with PRELOAD,
and its output equals the output without it bit for bit, and the reference within tolerance. That holds at 1 to 4
tokens, top-2 and top-8, with and without an expert map, in pair-per-block mode and after align, and with K a
multiple of the K step or not. The switch is read at each call: the tests set the module attribute. The launches
are recorded, so a test that passed without the preload would fail. Also the sm_90 build
(tests/ops/compile_fused_moe_sm90.py): no spills, and no store before the wait.
"""

import pytest
import torch

from mini_infer.ops import fused_moe as fm
from mini_infer.ops._moe_gemv import MOE_GEMV_MAX_PAIRS
from tests.ops.helpers import DEVICE, assert_close, requires_triton, run_uninterpreted

# the test tiles of test_fused_moe.py: BLOCK_M 16, K steps of 32 (I = 48: a full step and a tail of 16)
DECODE = fm.MoeTileConfig("decode", 16, fm.GemmTile(32, 32, 1, 4, 2), fm.GemmTile(32, 32, 1, 4, 2))
HIDDEN = 32


def record_preload(monkeypatch: pytest.MonkeyPatch) -> list:
    """(kernel, PRELOAD) of each grouped-GEMM and slot-sum launch from now on (each still runs), in order."""
    launches = []

    class Recorded:
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            run = self.kernel[grid]

            def launch(*args, **kwargs):
                launches.append((self.name, kwargs["PRELOAD"]))
                return run(*args, **kwargs)

            return launch

    for name in ("_moe_gemm_kernel", "_moe_sum_kernel"):
        monkeypatch.setattr(fm, name, Recorded(name, getattr(fm, name)))
    return launches


def _case(tokens, top_k, num_experts, inter, held, seed):
    """bf16 activations and experts, softmax top-k routing with one slot on no expert (HF's id E), and with `held`
    (the experts this rank holds) an expert map and those experts' weights alone."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g).to(torch.bfloat16).to(DEVICE)
    w13 = (torch.randn(num_experts, 2 * inter, HIDDEN, generator=g) / HIDDEN**0.5).to(torch.bfloat16)
    w2 = (torch.randn(num_experts, HIDDEN, inter, generator=g) / inter**0.5).to(torch.bfloat16)
    weights, ids = torch.softmax(torch.randn(tokens, num_experts, generator=g), -1).topk(top_k)
    ids = ids.to(torch.int32)
    ids[0, -1] = num_experts
    emap = None
    if held is not None:
        emap = torch.full((num_experts,), -1, dtype=torch.int32)
        emap[list(held)] = torch.arange(len(held), dtype=torch.int32)
        w13, w2, emap = w13[list(held)], w2[list(held)], emap.to(DEVICE)
    return x, weights.to(DEVICE), ids.to(DEVICE), w13.contiguous().to(DEVICE), w2.contiguous().to(DEVICE), emap


# (name, tile config (None: moe_tile_config's), I, pair_blocks (None: by shape), routing weights' dtype)
VARIANTS = [("decode_tail", DECODE, 48, None, torch.float32),  # two K steps, the last 16 wide; pairs only at T = 1
            ("decode_even_pairs", DECODE, 64, True, torch.bfloat16),  # two full K steps; one block per pair
            ("default_tiles", None, 48, None, torch.float32)]  # K step 128: the preloaded step is the only one


@requires_triton
@pytest.mark.parametrize("variant", VARIANTS, ids=[v[0] for v in VARIANTS])
@pytest.mark.parametrize("held", [None, "upper_half"])
@pytest.mark.parametrize(("top_k", "num_experts"), [(2, 8), (8, 16)])
@pytest.mark.parametrize("tokens", [1, 2, 3, 4])
def test_preload_is_bit_equal_to_loading_after_the_wait(tokens, top_k, num_experts, held, variant, monkeypatch):
    _, config, inter, pair_blocks, weights_dtype = variant
    rank = range(num_experts // 2, num_experts) if held else None
    x, weights, ids, w13, w2, emap = _case(tokens, top_k, num_experts, inter, rank, seed=tokens * 10 + top_k)
    weights = weights.to(weights_dtype)
    launches = record_preload(monkeypatch)
    # the slot sum in the down GEMM's launch (pair-per-block mode) on odd token counts, its own kernel on even ones
    merge = tokens % 2 == 1
    monkeypatch.setattr(fm, "MOE_MERGE_SLOTS", merge)
    pairs = pair_blocks if pair_blocks is not None else fm.PAIR_BLOCKS_BY_DEFAULT and fm.uses_pair_blocks(
        tokens, top_k, num_experts)
    sums = top_k > 1 and not (merge and pairs)

    def run(preload: bool) -> torch.Tensor:
        monkeypatch.setattr(fm, "MOE_PRELOAD", preload)
        launches.clear()
        return fm.fused_moe_triton(x, weights, ids, w13, w2, "silu", emap, config=config, pair_blocks=pair_blocks)

    on = run(True)
    if not launches:  # few enough pairs for the grouped-GEMV path (default tiles at 2 pairs): nothing to preload
        assert config is None and tokens * top_k <= MOE_GEMV_MAX_PAIRS
        return
    expected_on = [("_moe_gemm_kernel", False), ("_moe_gemm_kernel", True)] + [("_moe_sum_kernel", True)] * sums
    assert launches == expected_on
    off = run(False)
    assert launches == [(name, False) for name, _ in expected_on]
    assert torch.equal(on, off)
    assert_close(on, fm.fused_moe_reference(x, weights, ids, w13, w2, "silu", emap))


@requires_triton
def test_preload_only_at_decode_tiles_within_the_size_limit_and_when_switched_on(monkeypatch):
    """The down GEMM preloads only with the switch on, at "decode" tiles whose B tile has at most _PRELOAD_MAX_TILE
    elements (the slot sum whenever the switch is on at decode tiles); the gate/up GEMM never does."""
    x, weights, ids, w13, w2, _ = _case(3, 2, 8, 48, None, seed=5)
    launches = record_preload(monkeypatch)
    wide = fm.MoeTileConfig("decode", 16, DECODE.gate_up, fm.GemmTile(128, 128, 1, 4, 2))  # 128 x 128 > limit
    prefill = fm.MoeTileConfig("prefill", 64, fm.GemmTile(32, 32, 4, 4, 2), fm.GemmTile(32, 32, 4, 4, 2))
    expected = {(True, "decode"): [False, True, True], (True, "wide"): [False, False, True],
                (True, "prefill"): [False, False, False], (False, "decode"): [False, False, False]}
    configs = {"decode": DECODE, "wide": wide, "prefill": prefill}
    for (switch, name), flags in expected.items():
        monkeypatch.setattr(fm, "MOE_PRELOAD", switch)
        launches.clear()
        out = fm.fused_moe_triton(x, weights, ids, w13, w2, config=configs[name])
        assert [flag for _, flag in launches] == flags, (switch, name)
        assert_close(out, fm.fused_moe_reference(x, weights, ids, w13, w2))


@requires_triton
@pytest.mark.parametrize("pair_blocks", [False, True], ids=["sorted", "pair_per_block"])
def test_gated_preload_is_bit_equal(pair_blocks):
    """The kernel's GATED preload (the last K step's gate and up tiles), which fused_moe never launches (the kernel
    just before the gate/up GEMM writes its experts), launched directly: the same bits as without it."""
    tokens, top_k, num_experts, inter = 3, 2, 8, 48
    x, _, ids, w13, _, _ = _case(tokens, top_k, num_experts, inter, None, seed=6)
    num_pairs, flat = tokens * top_k, ids.reshape(-1).contiguous()
    if pair_blocks:
        sorted_pairs, num_padded = fm.pair_block_rows(num_pairs, DECODE.block_m, flat.device)
        block_expert, raw = flat, fm._RawIds(num_experts, flat, 0, False)
    else:
        sorted_pairs, block_expert, num_padded = fm.moe_align_triton(flat, num_experts, DECODE.block_m)
        raw = None
    outs = []
    for preload in (True, False):
        # on a GPU the zero-fill is the kernel just before the GEMM: align's outputs are two kernels back
        act = torch.zeros(num_pairs, inter, dtype=x.dtype, device=DEVICE)
        fm._grouped_gemm(x, w13, act, sorted_pairs, block_expert, num_padded, None, num_pairs, top_k, True,
                         DECODE.block_m, DECODE.gate_up, raw, preload)
        outs.append(act)
    assert torch.equal(*outs)
    used = flat < num_experts
    assert outs[0][used].abs().amax(1).gt(0).all()  # every used slot's row was written


@requires_triton
def test_down_gemm_and_slot_sum_compile_sm90_without_spills():
    """Built for sm_90 as qwen3-30b-a3b's decode launches build them (no GPU needed): no register spills with the
    preload or without it, no store before the wait, and with the preload the B tile's vector loads (the slot sum:
    its ids) before the wait, without it no load there. Batch 1's tile is within the preload's size limit, batch 4's
    128 x 128 is not. The same holds for the down GEMM with the slot sum in its launch (MOE_MERGE_SLOTS: its counts and
    sums come after the wait)."""
    report = run_uninterpreted(["-m", "tests.ops.compile_fused_moe_sm90"])
    for case in report["cases"]:
        assert "STACK:0 " in case["resources"] and "LOCAL:0 " in case["resources"], case
        assert case["stores_before_wait"] == 0, case
        if not case["preload"]:
            assert case["loads_before_wait"] == 0, case
        elif case["kernel"] == "down_gemm":
            assert case["vector_loads_before_wait"] > 0, case
        else:
            assert case["loads_before_wait"] > 0, case
    limits = {case["name"]: case["within_preload_limit"] for case in report["cases"] if case["kernel"] == "down_gemm"}
    assert limits["qwen3_t1"] and limits["qwen3_t2"] and not limits["qwen3_t4"]
    assert sorted(case["name"] for case in report["cases"] if case.get("merge")) == ["qwen3_t1", "qwen3_t1_ep2",
                                                                                     "qwen3_t2"]
