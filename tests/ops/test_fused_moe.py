import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import mini_infer.ops  # noqa: F401  (registers torch.ops.mini_infer.*)
from mini_infer.ops import HAS_TRITON
from mini_infer.ops import fused_moe as fused_moe_mod
from mini_infer.ops._moe_gemv import (
    MOE_GEMV_MAX_PAIRS,
    GemvTile,
    MoeGemvConfig,
    moe_gemv_config,
    moe_gemv_tiles,
)
from mini_infer.ops.fused_moe import (
    GemmTile,
    MoeTileConfig,
    fused_moe_reference,
    fused_moe_triton,
    local_expert_ids,
    moe_align_triton,
    moe_tile_config,
    padded_rows,
)
from tests.ops.helpers import DEVICE, assert_close, record_kernel_launches, requires_triton

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# tiles small enough for the test shapes: one per regime (BLOCK_M 16 and 64), short K steps so that the K loop
# and its tail (K not a multiple of BLOCK_K) both run
DECODE = MoeTileConfig("decode", 16, GemmTile(32, 32, 1, 4, 2), GemmTile(32, 32, 1, 4, 2))
PREFILL = MoeTileConfig("prefill", 64, GemmTile(32, 32, 4, 4, 2), GemmTile(64, 16, 4, 4, 2))
# the decode path (grouped GEMVs), forced whatever the number of pairs: with the tests' H 32 and I 48, gate/up
# tiles past I (rows that do not exist), two K steps each, the down one with a tail. Wide tiles: the interpreter
# runs one program at a time.
GEMV = MoeGemvConfig(GemvTile(64, 16, 4, 1), GemvTile(32, 16, 4, 1))


def _experts(num_experts, hidden, inter, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5
    return w13.to(dtype).to(DEVICE), w2.to(dtype).to(DEVICE)


def _routing(tokens, num_experts, top_k, seed=0):
    """Softmax top-k routing of random logits: distinct experts per token, fp32 weights, int32 ids."""
    g = torch.Generator().manual_seed(seed)
    w, ids = torch.softmax(torch.randn(tokens, num_experts, generator=g), -1).topk(top_k)
    return w.to(DEVICE), ids.to(torch.int32).to(DEVICE)


def _loop_definition(hidden, weights, ids, w13, w2):
    """The op's formula token by token, slot by slot, in float64 (silu * up rounded to hidden's dtype, as stated)."""
    inter = w2.shape[2]
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for t in range(hidden.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if not 0 <= e < w13.shape[0]:
                continue
            x = hidden[t].cpu().double()
            gate, up = w13[e, :inter].cpu().double() @ x, w13[e, inter:].cpu().double() @ x
            act = (torch.nn.functional.silu(gate) * up).to(hidden.dtype).double()
            out[t] += float(weights[t, j]) * (w2[e].cpu().double() @ act)
    return out.to(hidden.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_matches_definition(dtype):
    torch.manual_seed(0)
    hidden = torch.randn(5, 24).to(dtype)
    w13, w2 = _experts(4, 24, 16, dtype)
    weights, ids = _routing(5, 4, 2)
    ids[2, 1] = 4  # == E: HF's "no expert" id contributes nothing
    assert_close(fused_moe_reference(hidden.cpu(), weights.cpu(), ids.cpu(), w13.cpu(), w2.cpu()),
                 _loop_definition(hidden, weights, ids, w13, w2))


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_reference_matches_hf_experts(family):
    """w13 / w2 are HF's gate_up_proj / down_proj as they are (the layout the pass will hand over)."""
    from transformers.models.mixtral.configuration_mixtral import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    torch.manual_seed(1)
    if family == "mixtral":
        experts = MixtralExperts(MixtralConfig(hidden_size=32, intermediate_size=48, num_local_experts=6))
    else:
        experts = Qwen3MoeExperts(Qwen3MoeConfig(hidden_size=32, moe_intermediate_size=48, num_experts=6))
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.2)
        experts.down_proj.normal_(0, 0.2)
        hidden = torch.randn(9, 32)
        weights, ids = _routing(9, 6, 2, seed=1)
        expected = experts(hidden, ids.cpu().long(), weights.cpu())
    got = fused_moe_reference(hidden, weights.cpu(), ids.cpu(), experts.gate_up_proj.data, experts.down_proj.data)
    assert_close(got, expected)


@requires_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "num_experts", "top_k", "hidden", "inter"),
                         [(9, 8, 2, 32, 64), (17, 8, 2, 64, 40), (17, 4, 1, 48, 32)])
def test_triton_matches_reference(dtype, tokens, num_experts, top_k, hidden, inter):
    torch.manual_seed(tokens)
    x = torch.randn(tokens, hidden, device=DEVICE).to(dtype)
    w13, w2 = _experts(num_experts, hidden, inter, dtype, seed=tokens)
    weights, ids = _routing(tokens, num_experts, top_k, seed=tokens)
    assert_close(fused_moe_triton(x, weights, ids, w13, w2), fused_moe_reference(x, weights, ids, w13, w2))


def _patterns(tokens, num_experts):
    """Routing patterns (ids [T, 2]): every expert used, some unused, all tokens to the same pair of experts,
    int64 ids, an id E ("no expert")."""
    t = torch.arange(tokens)
    every = torch.stack([t % num_experts, (t + 1) % num_experts], 1)
    some = torch.stack([t % 2, 2 + t % 2], 1)  # experts >= 4 never used
    one = torch.stack([torch.full_like(t, 3), torch.full_like(t, 5)], 1)
    dropped = every.clone()
    dropped[::3, 1] = num_experts
    return {"every_expert": every.int(), "some_unused": some.int(), "all_to_one": one.int(),
            "int64": every.long(), "dropped_slot": dropped.int()}


@requires_triton
@pytest.mark.parametrize(("pattern", "config"), [
    *[(p, DECODE) for p in ["every_expert", "some_unused", "all_to_one", "int64", "dropped_slot"]],
    ("every_expert", PREFILL),  # BLOCK_M 64: the other patterns only change the align step, as with DECODE
    *[(p, GEMV) for p in ["all_to_one", "int64", "dropped_slot"]],  # no align step: which experts are used is moot
], ids=lambda v: v if isinstance(v, str) else type(v).__name__ if isinstance(v, MoeGemvConfig) else v.kind)
def test_triton_routing_patterns(pattern, config):
    tokens, num_experts, hidden, inter = 19, 8, 32, 48
    torch.manual_seed(2)
    x = torch.randn(tokens, hidden, device=DEVICE).to(torch.float16)
    w13, w2 = _experts(num_experts, hidden, inter, torch.float16, seed=2)
    ids = _patterns(tokens, num_experts)[pattern].to(DEVICE)
    weights = torch.rand(tokens, 2, device=DEVICE)
    expected = fused_moe_reference(x, weights, ids, w13, w2)
    assert_close(fused_moe_triton(x, weights, ids, w13, w2, config=config), expected)
    if pattern == "all_to_one":  # single slot: the down GEMM writes the output directly
        assert_close(fused_moe_triton(x, weights[:, :1], ids[:, :1], w13, w2, config=config),
                     fused_moe_reference(x, weights[:, :1], ids[:, :1], w13, w2))


# -- the decode path: grouped GEMVs for few (token, slot) pairs -------------------------------------------------


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "num_experts", "top_k"), [(1, 16, 8), (2, 8, 2), (3, 64, 5)])
def test_gemv_path_matches_reference(dtype, tokens, num_experts, top_k):
    """The decode path (its own tiles, `moe_gemv_tiles`, at one token; else the wide test tiles: the interpreter
    runs one program at a time) matches the reference, also with ids outside [0, E) in some slots (HF's "no
    expert" E, -1, far out of range: they contribute nothing)."""
    hidden, inter = 24, 16
    torch.manual_seed(11)
    x = torch.randn(tokens, hidden, device=DEVICE).to(dtype)
    w13, w2 = _experts(num_experts, hidden, inter, dtype, seed=11)
    weights, ids = _routing(tokens, num_experts, top_k, seed=11)
    ids[0, -1] = num_experts
    ids[-1, 0] = -1 if tokens > 1 else ids[-1, 0]
    if tokens > 2:
        ids[1, -1] = 1 << 20
    config = moe_gemv_tiles(hidden, inter) if tokens == 1 else GEMV
    assert_close(fused_moe_triton(x, weights, ids, w13, w2, config=config), fused_moe_reference(x, weights, ids, w13, w2))


def test_gemv_path_is_picked_by_shape(monkeypatch):
    """Up to MOE_GEMV_MAX_PAIRS (token, slot) pairs (mixtral-8x7b's batch 1) fused_moe_triton takes the decode path
    by itself, with the tiles `moe_gemv_config` gives; more pairs (qwen3-30b-a3b's batch 1), or an I that no K step
    of 16+ divides: the grouped GEMMs (None)."""
    assert moe_gemv_config(1, 2, 4096, 14336) == MoeGemvConfig(GemvTile(1, 1024, 4, 3), GemvTile(4, 1024, 4, 3))
    assert moe_gemv_config(1, 8, 2048, 768) is None
    assert moe_gemv_config(1, 2, 64, 40) is None and moe_gemv_tiles(64, 40) is None  # 40 = 8 x 5
    if not HAS_TRITON:
        return
    launch, calls = fused_moe_mod.moe_gemv_triton, []

    def spy(*args, **kwargs):  # records the config the launcher ran with, and runs it
        calls.append(args[-1])
        return launch(*args, **kwargs)

    monkeypatch.setattr(fused_moe_mod, "moe_gemv_triton", spy)
    torch.manual_seed(12)
    x = torch.randn(1, 32, device=DEVICE)
    w13, w2 = _experts(4, 32, 16, torch.float32, seed=12)
    weights, ids = _routing(1, 4, MOE_GEMV_MAX_PAIRS, seed=12)
    assert_close(fused_moe_triton(x, weights, ids, w13, w2), fused_moe_reference(x, weights, ids, w13, w2))
    assert calls == [moe_gemv_config(1, MOE_GEMV_MAX_PAIRS, 32, 16)]
    x, weights, ids = x.expand(3, 32).contiguous(), weights.expand(3, -1), ids.expand(3, -1)  # 3x the pairs
    fused_moe_triton(x, weights, ids, w13, w2)
    assert len(calls) == 1


def _check_alignment(ids, num_experts, block_m, sorted_pairs, block_expert, num_padded):
    """Every expert's pairs form one run starting at a multiple of block_m, padded with the sentinel to the
    next multiple; block_expert names each block's expert; num_padded is the sum of the padded runs."""
    flat = ids.reshape(-1).cpu().long()
    num_pairs = flat.numel()
    rows = sorted_pairs.cpu().tolist()
    owners = block_expert.cpu().tolist()
    pos = 0
    for e in range(num_experts):
        pairs = torch.nonzero(flat == e).squeeze(1).tolist()
        if not pairs:
            continue
        run = -(-len(pairs) // block_m) * block_m
        assert pos % block_m == 0
        assert sorted(rows[pos:pos + len(pairs)]) == pairs, e
        assert rows[pos + len(pairs):pos + run] == [num_pairs] * (run - len(pairs)), e
        assert owners[pos // block_m:(pos + run) // block_m] == [e] * (run // block_m), e
        pos += run
    assert int(num_padded) == pos
    assert sorted_pairs.numel() == padded_rows(num_pairs, num_experts, block_m)


@requires_triton
@pytest.mark.parametrize("multi_kernel", [False, True], ids=["one_program", "three_kernels"])
@pytest.mark.parametrize("block_m", [16, 64])
def test_align(multi_kernel, block_m, monkeypatch):
    if multi_kernel:  # the three-kernel path, with several programs, at a test-sized batch
        monkeypatch.setattr(fused_moe_mod, "_ALIGN_SINGLE_MAX", 16)
        monkeypatch.setattr(fused_moe_mod, "_ALIGN_BLOCK", 64)
    torch.manual_seed(3)
    for ids in [torch.randint(0, 12, (150, 2)), torch.full((150, 2), 7), torch.randint(0, 3, (1, 2))]:
        ids = ids.int().to(DEVICE)
        _check_alignment(ids, 12, block_m, *moe_align_triton(ids, 12, block_m))


@requires_triton
@pytest.mark.parametrize(("config", "pair_blocks"), [(GEMV, None), (DECODE, False), (DECODE, True)],
                         ids=["gemv", "grouped", "pair_per_block"])
def test_triton_never_syncs_with_the_host(config, pair_blocks, monkeypatch):
    """No .item() / .tolist() / bool() / int() on a tensor: the launcher can run inside a CUDA graph (the decode
    path and the grouped GEMMs, after align or pair per block)."""
    def refuse(*_args, **_kwargs):
        raise AssertionError("host sync in the Triton path")

    torch.manual_seed(4)
    x = torch.randn(3, 32, device=DEVICE)
    w13, w2 = _experts(4, 32, 32, torch.float32)
    weights, ids = _routing(3, 4, 2)
    expected = fused_moe_reference(x, weights, ids, w13, w2)
    with monkeypatch.context() as m:
        for name in ("item", "tolist", "__bool__", "__int__", "__index__", "__float__"):
            m.setattr(torch.Tensor, name, refuse)
        got = fused_moe_triton(x, weights, ids, w13, w2, config=config, pair_blocks=pair_blocks)
        with pytest.raises(AssertionError, match="host sync"):  # the patch does catch the reference's .tolist()
            fused_moe_reference(x, weights, ids, w13, w2)
    assert_close(got, expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("placement", [None, "linear rank 1"])
@pytest.mark.parametrize("tokens", [1, 40])
def test_cuda_graph_replays_new_routing(tokens, placement):
    """Captured once, the graph recomputes the alignment on the device: replaying it after writing another routing
    (other experts, other counts per expert) into its input buffers gives that routing's result (also with an
    expert map: the rank's share changes with the routing)."""
    num_experts, hidden, inter = 8, 64, 96
    x = torch.randn(tokens, hidden, device="cuda").to(torch.bfloat16)
    w13, w2 = _experts(num_experts, hidden, inter, torch.bfloat16, seed=6)
    emap = None
    if placement is not None:
        held = PLACEMENTS[placement]
        emap = _expert_map(num_experts, held).to("cuda")
        w13, w2 = w13[list(held)].contiguous(), w2[list(held)].contiguous()
    weights, ids = _routing(tokens, num_experts, 2, seed=6)
    fused_moe_triton(x, weights, ids, w13, w2, "silu", emap)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe_triton(x, weights, ids, w13, w2, "silu", emap)
    for seed in (7, 8):
        new_w, new_ids = _routing(tokens, num_experts, 2, seed=seed)
        new_ids[: tokens // 2, 0] = 3  # skew: many rows on one expert
        new_ids[: tokens // 2, 1] = 5
        weights.copy_(new_w)
        ids.copy_(new_ids)
        graph.replay()
        assert_close(out, fused_moe_reference(x, weights, ids, w13, w2, "silu", emap))


def test_tile_config_by_regime():
    """Decode: BLOCK_M 16, or 32 once experts average more than 8 rows; prefill: 64, then 128."""
    qwen3 = {"num_experts": 128, "top_k": 8, "hidden": 2048, "inter": 768}
    mixtral = {"num_experts": 8, "top_k": 2, "hidden": 4096, "inter": 14336}
    expected = {"qwen3": {1: 16, 8: 16, 64: 16, 256: 32, 2048: 128, 8192: 128},
                "mixtral": {1: 16, 8: 16, 64: 32, 256: 64, 2048: 128, 8192: 128}}
    for name, shapes in (("qwen3", qwen3), ("mixtral", mixtral)):
        for tokens, block_m in expected[name].items():
            cfg = moe_tile_config(tokens, **shapes)
            assert cfg.block_m == block_m, (name, tokens, cfg)
            assert cfg.kind == ("decode" if block_m <= 32 else "prefill")
    # one token: narrower output tiles, so that the few used experts' weights still spread over ~180+ programs
    one = moe_tile_config(1, **qwen3)
    assert (one.gate_up.block_n, one.down.block_n) == (32, 64)  # 192 and 256 programs
    assert (one.gate_up.num_stages, one.down.num_stages) == (4, 3)  # one token: four gate/up K steps in flight
    assert moe_tile_config(1, **mixtral).down.block_n == 32
    gpt_oss = moe_tile_config(1, num_experts=32, top_k=4, hidden=2880, inter=2880)
    assert (gpt_oss.gate_up.block_n, gpt_oss.down.block_n) == (64, 64)  # 4 x 45 = 180 programs each, not 360
    two = moe_tile_config(2, **qwen3)
    assert (two.gate_up.block_n, two.down.block_n) == (32, 64)  # 384 and 512 programs: more tokens aim at ~264
    assert (two.gate_up.num_stages, two.down.num_stages) == (3, 3)


@pytest.mark.parametrize(("change", "name"), [
    ({"activation": "gelu"}, "activation"),
    ({"hidden": torch.randn(3, 16, dtype=torch.float64)}, "hidden"),
    ({"w13": torch.randn(4, 31, 16)}, "w13"),
    ({"w2": torch.randn(4, 16, 8)}, "w2"),
    ({"w2": torch.randn(4, 16, 12, dtype=torch.float16)}, "w2"),
    ({"topk_ids": torch.zeros(3, 2)}, "topk_ids"),
    ({"topk_ids": torch.zeros(4, 2, dtype=torch.int32)}, "topk_ids"),
    ({"topk_weights": torch.ones(3, 1)}, "topk_weights"),
])
def test_invalid_arguments_name_the_argument(change, name):
    args = {"hidden": torch.randn(3, 16), "topk_weights": torch.ones(3, 2), "topk_ids": torch.zeros(3, 2, dtype=torch.int32),
            "w13": torch.randn(4, 24, 16), "w2": torch.randn(4, 16, 12), "activation": "silu", **change}
    for fn in (fused_moe_reference, fused_moe_triton, torch.ops.mini_infer.fused_moe):
        with pytest.raises(ValueError, match=name):
            fn(**args)


# -- expert parallelism: an expert map (global id -> local index, -1 on another rank) ---------------------------

# the experts one rank holds, of 8: two ranks' contiguous halves (vLLM's "linear" placement), and every other
# expert (its "round_robin", which the op serves as well though the sharding pass uses the linear one)
PLACEMENTS = {"linear rank 0": range(0, 4), "linear rank 1": range(4, 8), "round robin": range(1, 8, 2)}


def _expert_map(num_experts: int, held: range) -> torch.Tensor:
    """Written out here, not by the code under test: held[i] -> i, every other expert -> -1."""
    emap = [-1] * num_experts
    for local, expert in enumerate(held):
        emap[expert] = local
    return torch.tensor(emap, dtype=torch.int32)


def _rank_case(num_experts=8, tokens=19, hidden=32, inter=48, top_k=2, dtype=torch.float32, seed=9):
    torch.manual_seed(seed)
    x = torch.randn(tokens, hidden).to(dtype).to(DEVICE)
    w13, w2 = _experts(num_experts, hidden, inter, dtype, seed=seed)
    weights, ids = _routing(tokens, num_experts, top_k, seed=seed)
    ids[::5, -1] = num_experts  # HF's "no expert" id: on no rank
    return x, weights, ids, w13, w2


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_with_expert_map_is_the_ranks_share(dtype):
    """A rank's output is the op's formula over the slots whose expert it holds (the other slots given HF's "no
    expert" id), computed with the whole expert stack; the shares of the ranks add up to the whole op."""
    x, weights, ids, w13, w2 = _rank_case(dtype=dtype)
    shares = []
    for name, held in PLACEMENTS.items():
        emap = _expert_map(8, held).to(DEVICE)
        got = fused_moe_reference(x, weights, ids, w13[list(held)], w2[list(held)], "silu", emap)
        theirs = torch.where(torch.isin(ids, torch.tensor(list(held), device=ids.device)), ids, 8)
        assert_close(got, _loop_definition(x, weights, theirs, w13, w2).to(DEVICE))
        if name.startswith("linear"):
            shares.append(got.float())
    whole = fused_moe_reference(x, weights, ids, w13, w2)
    assert_close((shares[0] + shares[1]).to(dtype), whole)


@requires_triton
@pytest.mark.parametrize(("placement", "config"), [*[(p, DECODE) for p in PLACEMENTS], ("round robin", GEMV)],
                         ids=[*[f"grouped-{p}" for p in PLACEMENTS], "gemv-round robin"])  # map: in align / per slot
def test_triton_with_expert_map_matches_reference(placement, config):
    x, weights, ids, w13, w2 = _rank_case(dtype=torch.float16)
    held = list(PLACEMENTS[placement])
    emap = _expert_map(8, PLACEMENTS[placement]).to(DEVICE)
    w13, w2 = w13[held].contiguous(), w2[held].contiguous()
    expected = fused_moe_reference(x, weights, ids, w13, w2, "silu", emap)
    assert expected.abs().amax(1).gt(0).sum() >= len(ids) // 2  # some tokens have a slot on this rank
    assert_close(fused_moe_triton(x, weights, ids, w13, w2, "silu", emap, config=config), expected)
    # one slot per token (the down GEMM writes the output rows; other ranks' rows stay zero), int64 ids
    expected = fused_moe_reference(x, weights[:, :1], ids[:, :1].long(), w13, w2, "silu", emap)
    assert_close(fused_moe_triton(x, weights[:, :1], ids[:, :1].long(), w13, w2, "silu", emap, config=config),
                 expected)


@requires_triton
@pytest.mark.parametrize("multi_kernel", [False, True], ids=["one_program", "three_kernels"])
def test_align_with_expert_map_places_only_the_ranks_pairs(multi_kernel, monkeypatch):
    """The rank's work is its pairs: only the slots whose expert it holds are placed (by local index), so the
    padded rows, and with them the GEMM blocks that run, count those alone; with none, nothing runs."""
    if multi_kernel:
        monkeypatch.setattr(fused_moe_mod, "_ALIGN_SINGLE_MAX", 16)
        monkeypatch.setattr(fused_moe_mod, "_ALIGN_BLOCK", 64)
    torch.manual_seed(10)
    block_m = 16
    for held in PLACEMENTS.values():
        emap = _expert_map(8, held).to(DEVICE)
        for ids in [torch.randint(0, 8, (150, 2)), torch.full((150, 2), held[1]), torch.randint(0, 9, (3, 2))]:
            ids = ids.int().to(DEVICE)
            local = torch.tensor([[emap[e] if e < 8 else -1 for e in row] for row in ids.cpu().tolist()])
            aligned = moe_align_triton(ids, len(held), block_m, emap)
            _check_alignment(local, len(held), block_m, *aligned)
            mine = int((local >= 0).sum())
            assert int(aligned[2]) <= mine + len(held) * (block_m - 1)
    others = torch.full((40, 2), 0, dtype=torch.int32, device=DEVICE)  # every slot on rank 0's expert 0
    emap = _expert_map(8, PLACEMENTS["linear rank 1"]).to(DEVICE)
    assert int(moe_align_triton(others, 4, block_m, emap)[2]) == 0
    x, weights, _, w13, w2 = _rank_case(tokens=40)
    out = fused_moe_triton(x, weights, others, w13[4:].contiguous(), w2[4:].contiguous(), "silu", emap)
    assert torch.equal(out, torch.zeros_like(out))


def test_local_expert_ids():
    emap = _expert_map(8, PLACEMENTS["round robin"])
    ids = torch.tensor([[1, 2], [7, 8], [-1, 3]], dtype=torch.int32)
    assert local_expert_ids(ids, emap).tolist() == [[0, -1], [3, -1], [-1, 1]]
    assert local_expert_ids(ids, None) is ids


@pytest.mark.parametrize("emap", [torch.zeros(8), torch.zeros(2, 4, dtype=torch.int32), torch.zeros(3, dtype=torch.int32)],
                         ids=["float", "2-d", "shorter than the local experts"])
def test_invalid_expert_map_is_named(emap):
    args = (torch.randn(3, 16), torch.ones(3, 2), torch.zeros(3, 2, dtype=torch.int32), torch.randn(4, 24, 16),
            torch.randn(4, 16, 12), "silu", emap)
    for fn in (fused_moe_reference, fused_moe_triton, torch.ops.mini_infer.fused_moe):
        with pytest.raises(ValueError, match="expert_map"):
            fn(*args)


def test_tile_config_counts_the_ranks_pairs():
    """Under expert parallelism the regime follows the rows per expert (the router's count), and the decode
    tiles narrow for the fewer blocks a rank's experts get."""
    qwen3 = dict(num_experts=128, top_k=8, hidden=2048, inter=768)
    whole, half = moe_tile_config(8, **qwen3), moe_tile_config(8, **qwen3, local_experts=64)
    assert (whole.block_m, whole.gate_up.block_n) == (16, 128)  # ~64 experts used: 64 x 6 blocks of 128 columns
    assert (half.block_m, half.gate_up.block_n) == (16, 64)  # ~32 on this rank: 32 x 12 blocks of 64
    assert moe_tile_config(2048, **qwen3, local_experts=64).block_m == moe_tile_config(2048, **qwen3).block_m


def test_registered_op_fake_and_opcheck():
    torch.manual_seed(5)
    x = torch.randn(6, 16)
    w13, w2 = _experts(4, 16, 8, torch.float32)
    weights, ids = _routing(6, 4, 2)
    args = (x, weights.cpu(), ids.cpu(), w13.cpu(), w2.cpu())
    assert torch.equal(torch.ops.mini_infer.fused_moe(*args), fused_moe_reference(*args))
    with FakeTensorMode():
        out = torch.ops.mini_infer.fused_moe(
            torch.empty(7, 64, dtype=torch.bfloat16), torch.empty(7, 2), torch.empty(7, 2, dtype=torch.int32),
            torch.empty(8, 96, 64, dtype=torch.bfloat16), torch.empty(8, 64, 48, dtype=torch.bfloat16))
    assert out.shape == (7, 64) and out.dtype == torch.bfloat16
    torch.library.opcheck(torch.ops.mini_infer.fused_moe.default, args)
    emap = _expert_map(8, PLACEMENTS["linear rank 1"])
    ids8 = _routing(6, 8, 2)[1].cpu()
    map_args = (x, weights.cpu(), ids8, w13.cpu(), w2.cpu(), "silu", emap)
    assert torch.equal(torch.ops.mini_infer.fused_moe(*map_args), fused_moe_reference(*map_args))
    torch.library.opcheck(torch.ops.mini_infer.fused_moe.default, map_args)


# -- pair-per-block mode: no align step at a handful of pairs --------------------------------------------------


def test_pair_blocks_are_picked_by_shape():
    """One token (distinct experts) up to 16 pairs; a few tokens only among many experts (rare repeats)."""
    assert fused_moe_mod.uses_pair_blocks(1, 8, 128) and fused_moe_mod.uses_pair_blocks(2, 8, 128)  # qwen3-30b-a3b
    assert not fused_moe_mod.uses_pair_blocks(3, 8, 128)  # 24 pairs
    assert fused_moe_mod.uses_pair_blocks(1, 6, 64) and not fused_moe_mod.uses_pair_blocks(2, 6, 64)  # dsv2-lite
    assert fused_moe_mod.uses_pair_blocks(1, 2, 8) and not fused_moe_mod.uses_pair_blocks(2, 2, 8)  # mixtral
    assert not fused_moe_mod.uses_pair_blocks(1, 32, 256)


@requires_triton
def test_pair_block_rows_are_one_pair_per_block_and_cached():
    sorted_pairs, num_padded = fused_moe_mod.pair_block_rows(5, 16, torch.device(DEVICE))
    assert sorted_pairs.dtype == num_padded.dtype == torch.int32
    assert sorted_pairs.view(5, 16)[:, 0].tolist() == list(range(5))
    assert torch.equal(sorted_pairs.view(5, 16)[:, 1:], torch.full((5, 15), 5, dtype=torch.int32, device=DEVICE))
    assert num_padded.tolist() == [5 * 16]
    again = fused_moe_mod.pair_block_rows(5, 16, torch.device(DEVICE))
    assert again[0].data_ptr() == sorted_pairs.data_ptr() and again[1].data_ptr() == num_padded.data_ptr()


@requires_triton
@pytest.mark.parametrize(("placement", "top_k"), [(None, 3), (None, 1), ("round robin", 2)])
def test_pair_blocks_equal_the_align_path_bit_for_bit(placement, top_k):
    """Same per-pair products as the expert-sorted path, bit for bit, with ids outside [0, E) (HF's E, -1, far
    out) and, with an expert map, slots on other ranks (-1): both contribute nothing."""
    num_experts, tokens = 8, 4
    x, weights, ids, w13, w2 = _rank_case(num_experts, tokens, top_k=top_k, dtype=torch.float16, seed=13)
    ids[1, 0], ids[2, -1], ids[3, 0] = -1, num_experts, 1 << 20
    emap = None
    if placement is not None:
        held = list(PLACEMENTS[placement])
        emap = _expert_map(num_experts, PLACEMENTS[placement]).to(DEVICE)
        w13, w2 = w13[held].contiguous(), w2[held].contiguous()
    sorted_out = fused_moe_triton(x, weights, ids, w13, w2, "silu", emap, config=DECODE, pair_blocks=False)
    paired = fused_moe_triton(x, weights, ids, w13, w2, "silu", emap, config=DECODE, pair_blocks=True)
    assert torch.equal(paired, sorted_out)
    assert_close(paired, fused_moe_reference(x, weights, ids, w13, w2, "silu", emap))


@requires_triton
def test_pair_blocks_launch_no_align_and_reuse_their_rows(monkeypatch):
    """At one token the launcher takes pair-per-block mode by itself (once it is on by default): no align launch,
    the same cached rows on a repeated call with another routing (still right)."""
    monkeypatch.setattr(fused_moe_mod, "PAIR_BLOCKS_BY_DEFAULT", True)
    align, aligned, rows = fused_moe_mod.moe_align_triton, [], []
    cached = fused_moe_mod.pair_block_rows

    def spy_align(*args, **kwargs):
        aligned.append(args)
        return align(*args, **kwargs)

    def spy_rows(*args):
        rows.append(cached(*args))  # kept alive: a rebuilt buffer could not reuse the first one's memory
        return rows[-1]

    monkeypatch.setattr(fused_moe_mod, "moe_align_triton", spy_align)
    monkeypatch.setattr(fused_moe_mod, "pair_block_rows", spy_rows)
    w13, w2 = _experts(16, 32, 16, torch.float32, seed=14)
    x = torch.randn(1, 32, device=DEVICE)
    for seed in (14, 15):
        weights, ids = _routing(1, 16, 4, seed=seed)
        assert_close(fused_moe_triton(x, weights, ids, w13, w2, config=DECODE),
                     fused_moe_reference(x, weights, ids, w13, w2))
    assert aligned == [] and len(rows) == 2 and rows[0][0].data_ptr() == rows[1][0].data_ptr()
    fused_moe_triton(x, weights, ids, w13, w2, config=DECODE, pair_blocks=False)
    assert len(aligned) == 1


@requires_triton
@pytest.mark.parametrize(("placement", "tokens", "top_k"), [(None, 1, 8), (None, 4, 3), ("round robin", 2, 4)])
def test_slot_sum_in_the_down_launch_is_the_sum_kernels_bits(placement, tokens, top_k, monkeypatch):
    """MOE_MERGE_SLOTS (pair-per-block mode): the down GEMM's last block of each (token, column tile) sums the slot
    rows itself; the output equals the slot-sum kernel's bit for bit, with ids outside [0, E) and, with an expert
    map, slots on other ranks (they still count), and no `_moe_sum_kernel` launch. The counters are left zero: a
    second call (another routing) is right too."""
    num_experts = 16
    x, weights, ids, w13, w2 = _rank_case(num_experts, tokens, top_k=top_k, dtype=torch.float16, seed=21)
    ids[0, 0] = -1
    if tokens > 1:
        ids[-1, -1] = num_experts
    emap = None
    if placement is not None:
        held = list(PLACEMENTS[placement])
        emap = _expert_map(num_experts, PLACEMENTS[placement]).to(DEVICE)
        w13, w2 = w13[held].contiguous(), w2[held].contiguous()
    monkeypatch.setattr(fused_moe_mod, "MOE_MERGE_SLOTS", False)
    summed = fused_moe_triton(x, weights, ids, w13, w2, "silu", emap, config=DECODE, pair_blocks=True)
    monkeypatch.setattr(fused_moe_mod, "MOE_MERGE_SLOTS", True)
    sums = record_kernel_launches(monkeypatch, fused_moe_mod, "_moe_sum_kernel")
    for _ in range(2):
        merged = fused_moe_triton(x, weights, ids, w13, w2, "silu", emap, config=DECODE, pair_blocks=True)
        assert torch.equal(merged, summed)
    assert sums == []
    assert_close(merged, fused_moe_reference(x, weights, ids, w13, w2, "silu", emap))
