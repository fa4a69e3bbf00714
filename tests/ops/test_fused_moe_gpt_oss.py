"""fused_moe's GPT-OSS arguments: per-expert biases (w13_bias [E, 2I] = gate | up, w2_bias [E, H], added per
(token, slot) before the routing weight) and activation="swigluoai" (gate clamped to <= limit, up to [-limit, limit],
(up + 1) * gate * sigmoid(alpha * gate)).

The reference against HF's `GptOssExperts` (its own module, eager and grouped-mm implementations, on its own
transposed, gate/up-interleaved weights re-laid as route_moe re-lays them) and against a float64 loop of HF's
math; the Triton paths (decode GEMVs, grouped GEMMs sorted and pair per block, prefill tiles, the shape-picked
default) against the reference in fp32 and bf16, with and without each of the two additions, with dropped slots
and an expert map; the kernels' switches left at their defaults without them; argument checks, fake and opcheck.
"""

import pytest
import torch

import mini_infer.ops  # noqa: F401  (registers torch.ops.mini_infer.*)
from mini_infer.ops import fused_moe as fused_moe_mod
from mini_infer.ops._moe_gemv import GemvTile, MoeGemvConfig
from mini_infer.ops.fused_moe import GemmTile, MoeTileConfig, fused_moe_reference, fused_moe_triton
from tests.ops.helpers import DEVICE, assert_close, record_kernel_launches, requires_triton

ALPHA, LIMIT = 1.702, 7.0  # every GPT-OSS config's swiglu_alpha / swiglu_limit
E, H, INTER = 8, 32, 48  # the test experts (I 48: K loops with a tail at the test tiles)
DECODE = MoeTileConfig("decode", 16, GemmTile(32, 32, 1, 4, 2), GemmTile(32, 32, 1, 4, 2))
PREFILL = MoeTileConfig("prefill", 64, GemmTile(32, 32, 4, 4, 2), GemmTile(64, 16, 4, 4, 2))
GEMV = MoeGemvConfig(GemvTile(64, 16, 4, 1), GemvTile(32, 16, 4, 1))  # gate/up tiles past I, a down K tail


def _hf_experts(num_experts=E, hidden=H, inter=INTER, seed=0, implementation="eager"):
    """HF's GptOssExperts with random weights, and biases large enough that both clamps bite."""
    from transformers.models.gpt_oss.configuration_gpt_oss import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = GptOssConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=num_experts)
    config._experts_implementation = implementation
    experts = GptOssExperts(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=g) / hidden**0.5)
        experts.gate_up_proj_bias.copy_(torch.randn(experts.gate_up_proj_bias.shape, generator=g) * 4)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=g) / inter**0.5)
        experts.down_proj_bias.copy_(torch.randn(experts.down_proj_bias.shape, generator=g))
    return experts.eval()


def _relaid(experts, dtype=torch.float32):
    """(w13 [E, 2I, H], w2 [E, H, I], w13_bias [E, 2I], w2_bias [E, H]) from HF's GPT-OSS layout, written out
    here (not by the code under test): gate = gate_up[..., ::2], up = gate_up[..., 1::2], weights transposed."""
    gup, gub = experts.gate_up_proj.detach(), experts.gate_up_proj_bias.detach()
    w13 = torch.cat([gup[..., ::2], gup[..., 1::2]], dim=2).transpose(1, 2).contiguous()
    b13 = torch.cat([gub[:, ::2], gub[:, 1::2]], dim=1)
    w2 = experts.down_proj.detach().transpose(1, 2).contiguous()
    return tuple(t.to(dtype).to(DEVICE) for t in (w13, w2, b13, experts.down_proj_bias.detach()))


def _routing(tokens, top_k, num_experts=E, seed=0):
    """GPT-OSS routing of random logits (top-k, then softmax over the k values), with a dropped slot (HF's id E,
    and -1) when there are enough tokens: fp32 weights, int32 ids."""
    g = torch.Generator().manual_seed(seed)
    values, ids = torch.randn(tokens, num_experts, generator=g).topk(top_k)
    ids = ids.to(torch.int32)
    if tokens > 1:
        ids[0, -1] = num_experts
        ids[-1, 0] = -1
    return torch.softmax(values, -1).to(DEVICE), ids.to(DEVICE)


def _hf_loop(hidden, weights, ids, experts, round_to):
    """HF's GptOssExperts math token by token, slot by slot, in float64 on HF's own layout (the activation rounded
    to `round_to`, as the op states)."""
    gup, gub = experts.gate_up_proj.double(), experts.gate_up_proj_bias.double()
    down, db = experts.down_proj.double(), experts.down_proj_bias.double()
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for t in range(hidden.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if not 0 <= e < gup.shape[0]:
                continue
            gate_up = hidden[t].cpu().double() @ gup[e] + gub[e]
            gate, up = gate_up[::2].clamp(max=LIMIT), gate_up[1::2].clamp(-LIMIT, LIMIT)
            act = ((up + 1) * gate * torch.sigmoid(gate * ALPHA)).to(round_to).double()
            out[t] += float(weights[t, j]) * (act @ down[e] + db[e])
    return out.to(round_to)


def _assert_close(actual, expected):
    """assert_close, in bf16 against the outputs' scale: the activation reaches (limit + 1) * limit = 56, whose bf16
    rounding (1 ulp: 0.25 there; the interpreter truncates) moves outputs of a few units by a few hundredths."""
    if expected.dtype != torch.bfloat16:
        return assert_close(actual, expected)
    scale = max(1.0, expected.abs().max().item())
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=2e-2 * scale, rtol=2e-2)


def _gpt_oss(x, weights, ids, w13, w2, b13, b2, fn=fused_moe_reference, **kwargs):
    return fn(x, weights, ids, w13, w2, "swigluoai", kwargs.pop("expert_map", None), b13, b2, ALPHA, LIMIT, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_hf_math(dtype):
    experts = _hf_experts()
    x = (torch.randn(11, H, generator=torch.Generator().manual_seed(1)) * 2).to(dtype).to(DEVICE)
    weights, ids = _routing(11, 3, seed=1)
    gate_up = torch.einsum("th,ehn->ten", x.float().cpu(), experts.gate_up_proj.detach())
    gate_up = gate_up + experts.gate_up_proj_bias.detach()
    assert (gate_up[..., ::2] > LIMIT).any() and (gate_up[..., 1::2].abs() > LIMIT).any()  # both clamps bite
    got = _gpt_oss(x, weights, ids, *_relaid(experts, dtype))
    _assert_close(got, _hf_loop(x, weights, ids, experts, dtype).to(DEVICE))


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
def test_reference_matches_hf_module(implementation):
    """HF's module itself (its eager loop, and the grouped-mm path capture sees) on the same routing."""
    experts = _hf_experts(seed=2, implementation=implementation)
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(2)) * 2
    weights, ids = _routing(9, 2, seed=2)
    ids[0, -1] = 1  # no dropped slots: HF's modules do not all skip id E / -1
    ids[-1, 0] = 0 if int(ids[-1, 1]) != 0 else 2
    with torch.no_grad():
        expected = experts(x, ids.cpu().long(), weights.cpu())
    assert_close(_gpt_oss(x.to(DEVICE), weights, ids, *_relaid(experts)), expected.to(DEVICE))


# (decode GEMVs / grouped GEMMs after align / pair per block / prefill tiles / by shape, tokens, top_k, dtype,
#  with the biases, activation)
VARIANTS = {"gpt_oss": (True, "swigluoai"), "bias_silu": (True, "silu"), "swiglu_only": (False, "swigluoai")}
PATHS = {"gemv": (GEMV, None), "sorted": (DECODE, False), "pairs": (DECODE, True), "prefill": (PREFILL, None),
         "auto": (None, None)}
CASES = [
    ("gemv", 2, 2, torch.float32, "gpt_oss"), ("gemv", 3, 3, torch.bfloat16, "gpt_oss"),
    ("gemv", 2, 2, torch.float32, "bias_silu"), ("gemv", 2, 2, torch.bfloat16, "swiglu_only"),
    ("sorted", 9, 2, torch.float32, "gpt_oss"), ("sorted", 9, 2, torch.bfloat16, "gpt_oss"),
    ("sorted", 7, 1, torch.float32, "gpt_oss"),  # one slot: the down GEMM writes the output rows itself
    ("sorted", 9, 2, torch.bfloat16, "bias_silu"), ("sorted", 9, 2, torch.float32, "swiglu_only"),
    ("pairs", 1, 4, torch.bfloat16, "gpt_oss"), ("pairs", 2, 2, torch.float32, "gpt_oss"),  # slot sum in the launch
    ("prefill", 19, 2, torch.float32, "gpt_oss"), ("prefill", 19, 2, torch.bfloat16, "gpt_oss"),
    ("auto", 1, 2, torch.bfloat16, "gpt_oss"),  # 2 pairs: the decode GEMVs, their own tiles
    ("auto", 1, 4, torch.bfloat16, "gpt_oss"),  # 4 pairs (gpt-oss's batch 1): the grouped GEMMs, one block a pair
]


@requires_triton
@pytest.mark.parametrize(("path", "tokens", "top_k", "dtype", "variant"), CASES,
                         ids=[f"{c[0]}-T{c[1]}k{c[2]}-{str(c[3])[6:]}-{c[4]}" for c in CASES])
def test_triton_matches_reference(path, tokens, top_k, dtype, variant):
    with_bias, activation = VARIANTS[variant]
    config, pair_blocks = PATHS[path]
    w13, w2, b13, b2 = _relaid(_hf_experts(seed=tokens + top_k), dtype)
    if not with_bias:
        b13 = b2 = None
    x = (torch.randn(tokens, H, generator=torch.Generator().manual_seed(3)) * 2).to(dtype).to(DEVICE)
    weights, ids = _routing(tokens, top_k, seed=tokens)
    args = (x, weights, ids, w13, w2, activation, None, b13, b2, ALPHA, LIMIT)
    expected = fused_moe_reference(*args)
    _assert_close(fused_moe_triton(*args, config=config, pair_blocks=pair_blocks), expected)


@requires_triton
@pytest.mark.parametrize("config", [GEMV, DECODE], ids=["gemv", "grouped"])
def test_expert_map_with_biases(config):
    """Expert parallelism: a rank holds some experts and their biases (indexed by local expert); its output is the
    formula over its slots, bias included once per slot, and the two halves' shares add up to the whole."""
    experts = _hf_experts(seed=4)
    w13, w2, b13, b2 = _relaid(experts)
    x = (torch.randn(6, H, generator=torch.Generator().manual_seed(4)) * 2).to(DEVICE)
    weights, ids = _routing(6, 2, seed=4)
    shares = []
    for held in (range(0, 4), range(4, 8)):
        emap = torch.full((E,), -1, dtype=torch.int32)
        emap[list(held)] = torch.arange(len(held), dtype=torch.int32)
        local = [t[list(held)].contiguous() for t in (w13, w2, b13, b2)]
        share = _gpt_oss(x, weights, ids, *local, expert_map=emap.to(DEVICE))
        theirs = torch.where(torch.isin(ids.cpu(), torch.tensor(list(held))), ids.cpu(), E)
        assert_close(share, _hf_loop(x, weights, theirs, experts, torch.float32).to(DEVICE))
        assert_close(_gpt_oss(x, weights, ids, *local, fn=fused_moe_triton, expert_map=emap.to(DEVICE),
                              config=config), share)
        shares.append(share)
    assert_close(shares[0] + shares[1], _gpt_oss(x, weights, ids, w13, w2, b13, b2))


@requires_triton
def test_kernel_switches_stay_at_their_defaults_without_bias_or_swiglu(monkeypatch):
    """A silu call without biases passes none of the new switches (each kernel keeps its defaults and gets None for
    its bias pointer: the same compiled kernels as before they existed); a GPT-OSS call sets them per kernel."""
    launches = record_kernel_launches(monkeypatch, fused_moe_mod, "_moe_gemm_kernel", arguments=True)
    gemv = record_kernel_launches(monkeypatch, mini_infer.ops._moe_gemv, "_moe_gemv_gate_up_kernel",
                                  "_moe_gemv_down_kernel", arguments=True)
    w13, w2, b13, b2 = _relaid(_hf_experts(seed=5))
    x = torch.randn(3, H, device=DEVICE)
    weights, ids = _routing(3, 2, seed=5)
    new = {"HAS_BIAS", "ACTIVATION", "ALPHA", "LIMIT"}
    for config in (DECODE, GEMV):
        fused_moe_triton(x, weights, ids, w13, w2, config=config)
    assert len(launches) == len(gemv) == 2
    assert not [kw for _, kw in launches + gemv if new & set(kw)]
    launches.clear()
    gemv.clear()
    for config in (DECODE, GEMV):
        _gpt_oss(x, weights, ids, w13, w2, b13, b2, fn=fused_moe_triton, config=config)
    for record in (launches, gemv):
        (_, gate_up), (_, down) = record
        assert {k: gate_up[k] for k in new} == {"HAS_BIAS": True, "ACTIVATION": 1, "ALPHA": ALPHA, "LIMIT": LIMIT}
        assert {k: down[k] for k in new & set(down)} == {"HAS_BIAS": True}


@pytest.mark.parametrize(("change", "name"), [
    ({"w13_bias": torch.zeros(4, 23)}, "w13_bias"),
    ({"w13_bias": torch.zeros(4, 24, dtype=torch.bfloat16)}, "w13_bias"),
    ({"w2_bias": torch.zeros(3, 16)}, "w2_bias"),
    ({"swiglu_limit": 0.0}, "swiglu_limit"),
    ({"swiglu_alpha": float("nan")}, "swiglu_alpha"),
])
def test_invalid_arguments_name_the_argument(change, name):
    args = {"hidden": torch.randn(3, 16), "topk_weights": torch.ones(3, 2), "topk_ids": torch.zeros(3, 2, dtype=torch.int32),
            "w13": torch.randn(4, 24, 16), "w2": torch.randn(4, 16, 12), "activation": "swigluoai",
            "w13_bias": torch.zeros(4, 24), "w2_bias": torch.zeros(4, 16), **change}
    for fn in (fused_moe_reference, fused_moe_triton, torch.ops.mini_infer.fused_moe):
        with pytest.raises(ValueError, match=name):
            fn(**args)


def test_registered_op_fake_and_opcheck():
    w13, w2, b13, b2 = (t.cpu() for t in _relaid(_hf_experts(seed=6)))
    x = torch.randn(5, H) * 2
    weights, ids = (t.cpu() for t in _routing(5, 2, seed=6))
    args = (x, weights, ids, w13, w2, "swigluoai", None, b13, b2, ALPHA, LIMIT)
    assert torch.equal(torch.ops.mini_infer.fused_moe(*args), fused_moe_reference(*args))
    torch.library.opcheck(torch.ops.mini_infer.fused_moe.default, args)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        out = torch.ops.mini_infer.fused_moe(
            torch.empty(7, 64, dtype=torch.bfloat16), torch.empty(7, 4), torch.empty(7, 4, dtype=torch.int32),
            torch.empty(8, 96, 64, dtype=torch.bfloat16), torch.empty(8, 64, 48, dtype=torch.bfloat16), "swigluoai",
            None, torch.empty(8, 96, dtype=torch.bfloat16), torch.empty(8, 64, dtype=torch.bfloat16), ALPHA, LIMIT)
    assert out.shape == (7, 64) and out.dtype == torch.bfloat16


@requires_triton
def test_gpt_oss_launches_compile_sm90_without_spills():
    """Every kernel fused_moe_triton launches for gpt-oss-20b's experts at 1, 8 and 512 tokens, built for sm_90 (no
    GPU needed; `python -m tests.ops.compile_fused_moe_sm90 gpt_oss`): the grouped GEMMs with both biases and the
    swigluoai epilogue on the gate/up one, and no build spills. (The interpreter shows no compile error.)"""
    from tests.ops.helpers import run_uninterpreted

    report = run_uninterpreted(["-m", "tests.ops.compile_fused_moe_sm90", "gpt_oss"])
    for case in report["cases"]:
        assert "STACK:0 " in case["resources"] and "LOCAL:0 " in case["resources"], (report["triton"], case)
    gemms = [c for c in report["cases"] if c["kernel"] in ("_moe_gemm_kernel", "_moe_gemv_gate_up_kernel",
                                                           "_moe_gemv_down_kernel")]
    assert {c["tokens"] for c in gemms} == {1, 8, 512}
    for c in gemms:
        gate_up = c["gated"] or c["kernel"] == "_moe_gemv_gate_up_kernel"
        assert c["has_bias"] and c["activation"] == (1 if gate_up else 0), c
    for tokens in (1, 8, 512):  # a gate/up and a down launch at each size
        assert sorted(c["gated"] or "gate_up" in c["kernel"] for c in gemms if c["tokens"] == tokens) == [False, True]
