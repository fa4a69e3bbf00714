import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

import mini_infer.ops  # noqa: F401  (registers torch.ops.mini_infer.*)
from mini_infer.ops.moe_topk import moe_topk_reference, moe_topk_triton, portable_sigmoid
from tests.ops.helpers import DEVICE, requires_triton

# ---------------------------------------------------------------------------------------------------------------
# kernel == reference, on logits full of exact ties and 1-ulp near-ties


def _tie_heavy(shape, dtype, scale, n_distinct, near_ties, rng) -> torch.Tensor:
    """Random values of `dtype`; with n_distinct, drawn from that many values only (exact duplicates); with
    near_ties, a third of them replaced by a 1-ulp neighbour of another entry of the same row."""
    if n_distinct:
        pool = rng.standard_normal(n_distinct) * scale
        x = torch.from_numpy(pool[rng.integers(0, n_distinct, size=shape)]).to(dtype)
    else:
        x = torch.from_numpy(rng.standard_normal(shape) * scale).to(dtype)
    if near_ties and shape[-1] > 1:
        int_t = torch.int16 if dtype.itemsize == 2 else torch.int32
        bits = x.view(int_t)
        rows, cols = shape[:-1], shape[-1]
        for idx in np.ndindex(*rows):
            for j in rng.choice(cols, size=cols // 3, replace=False):
                src = int(rng.integers(0, cols))
                bits[idx + (j,)] = bits[idx + (src,)] + int(rng.choice([-1, 1]))
    return x


@st.composite
def routing_cases(draw):
    scoring = draw(st.sampled_from(["softmax", "sigmoid"]))
    n_group = draw(st.sampled_from([1, 1, 2, 4, 8]))
    if n_group == 1:
        num_experts = draw(st.sampled_from([2, 4, 8, 60, 64, 128, 256]))
    else:
        num_experts = n_group * draw(st.sampled_from([2, 3, 5, 8, 20, 32]))
    group_size = num_experts // n_group
    topk_group = draw(st.integers(1, n_group))
    top_k = draw(st.integers(1, min(8, topk_group * group_size)))
    case = dict(top_k=top_k, scoring=scoring, renormalize=draw(st.booleans()),
                routed_scaling_factor=draw(st.sampled_from([1.0, 2.5, 16.0])), n_group=n_group,
                topk_group=topk_group)
    tokens = draw(st.integers(1, 4))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    scale = draw(st.sampled_from([0.01, 1.0, 10.0, 100.0]))
    n_distinct = draw(st.sampled_from([None, 1, 2, 3]))
    near_ties = draw(st.booleans())
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    logits = _tie_heavy((tokens, num_experts), dtype, scale, n_distinct, near_ties, rng)
    bias = None
    if scoring == "sigmoid":
        bias = _tie_heavy((num_experts,), torch.float32, 0.1, draw(st.sampled_from([None, 1, 2])), near_ties, rng)
    return logits, bias, case


@requires_triton
@settings(derandomize=True, deadline=None, max_examples=40)
@given(routing_cases())
def test_kernel_matches_reference_on_ties(args):
    logits, bias, case = args
    w_ref, ids_ref = moe_topk_reference(logits, correction_bias=bias, **case)
    w, ids = moe_topk_triton(logits.to(DEVICE), correction_bias=None if bias is None else bias.to(DEVICE), **case)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32 and ids.shape == (logits.shape[0], case["top_k"])
    assert torch.equal(ids.cpu(), ids_ref), (logits, ids, ids_ref)
    torch.testing.assert_close(w.cpu(), w_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_ties_go_to_the_lower_index(impl):
    if impl == "triton" and not mini_infer.ops.HAS_TRITON:
        pytest.skip("triton is not installed")
    fn = moe_topk_reference if impl == "reference" else moe_topk_triton
    # all equal; -0.0 equals 0.0
    flat = torch.tensor([[0.0, -0.0, 0.0, -0.0, 0.0, -0.0, 0.0, -0.0]], device=DEVICE)
    _, ids = fn(flat, 3, "softmax", False)
    assert ids.tolist() == [[0, 1, 2]]
    # top score 5 twice, then 4 twice: larger first, lower index among equals
    x = torch.tensor([[4.0, 5.0, 1.0, 5.0, 4.0, 0.0]], device=DEVICE)
    _, ids = fn(x, 4, "softmax", True)
    assert ids.tolist() == [[1, 3, 0, 4]]
    # grouped: groups 1 and 2 tie for second place (max 3.0): group 1 is kept, so expert 3 (not 5) is picked
    g = torch.tensor([[9.0, 0.0, 3.0, 1.0, 3.0, 2.0, 0.0, 0.0]], device=DEVICE)
    _, ids = fn(g, 3, "softmax", False, 1.0, 4, 2)
    assert ids.tolist() == [[0, 2, 3]]
    # sigmoid: equal logits and equal bias tie exactly
    bias = torch.tensor([0.5, 0.0, 0.5, 0.0], device=DEVICE)
    _, ids = fn(torch.zeros(1, 4, device=DEVICE), 2, "sigmoid", True, 1.0, 1, 1, bias)
    assert ids.tolist() == [[0, 2]]


@requires_triton
def test_portable_sigmoid_is_bitwise_the_kernels_and_accurate():
    x = torch.cat([torch.linspace(-90, 90, 4097), torch.randn(4094) * 5, torch.tensor([0.0])])
    expected = torch.sigmoid(x.double())
    got = portable_sigmoid(x)
    normal = x > -87
    rel = ((got.double() - expected).abs() / expected)[normal]
    assert rel.max() < 2 * torch.finfo(torch.float32).eps
    # the kernel's sigmoid, read through un-normalized, unscaled sigmoid routing with top_k = E
    rows = x.view(-1, 256)
    w, _ = moe_topk_triton(rows, 256, "sigmoid", False, 1.0, 1, 1, torch.zeros(256))
    assert torch.equal(w.sort(dim=1).values, got.view(-1, 256).sort(dim=1).values)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_replays_new_logits():
    logits = torch.randn(33, 256, device="cuda")
    bias = torch.randn(256, device="cuda") * 0.1
    args = (8, "sigmoid", True, 2.5, 8, 4)
    moe_topk_triton(logits, *args, bias)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        w, ids = moe_topk_triton(logits, *args, bias)
    logits.copy_(torch.randn(33, 256, device="cuda"))
    graph.replay()
    w_ref, ids_ref = moe_topk_reference(logits, *args, bias)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# reference == transformers' own routers


def _hf_router(family: str, num_experts: int, top_k: int, **cfg):
    from transformers.models.deepseek_v2.configuration_deepseek_v2 import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.gpt_oss.configuration_gpt_oss import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
    from transformers.models.mixtral.configuration_mixtral import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen2_moe.configuration_qwen2_moe import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    classes = {"mixtral": (MixtralConfig, MixtralTopKRouter, "num_local_experts"),
               "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeTopKRouter, "num_experts"),
               "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeTopKRouter, "num_experts"),
               "deepseek_v2": (DeepseekV2Config, DeepseekV2TopkRouter, "n_routed_experts"),
               "deepseek_v3": (DeepseekV3Config, DeepseekV3TopkRouter, "n_routed_experts"),
               "gpt_oss": (GptOssConfig, GptOssTopKRouter, "num_local_experts")}
    config_cls, router_cls, experts_key = classes[family]
    config = config_cls(hidden_size=32, num_experts_per_tok=top_k, **{experts_key: num_experts}, **cfg)
    router = router_cls(config)
    with torch.no_grad():
        router.weight.normal_()
        if family == "deepseek_v3":
            router.e_score_correction_bias.normal_(0.0, 0.2)
        if family == "gpt_oss":  # the router linear's own bias: part of the logits moe_topk is given
            router.bias.normal_()
    return router


def _hf_choice_scores(family, router, logits):
    """The scores HF's router ranks experts by (to tell its arbitrary tie-breaking from a real difference)."""
    if family == "deepseek_v3":
        return logits.float().sigmoid() + router.e_score_correction_bias
    return torch.softmax(logits.float(), dim=-1)


def _assert_same_routing(w, ids, hf_w, hf_ids, hf_choice):
    """Same experts with the same weights; or, where the chosen experts differ, the swapped ones are ones HF's
    own scores rate equal up to a few ulp (HF's torch.topk breaks such ties arbitrarily). Returns the number of
    rows that differed."""
    differing = 0
    for t in range(ids.shape[0]):
        ours = dict(zip(ids[t].tolist(), w[t].tolist()))
        theirs = dict(zip(hf_ids[t].tolist(), hf_w[t].float().tolist()))
        if set(ours) == set(theirs):
            for e, v in ours.items():
                assert v == pytest.approx(theirs[e], rel=1e-5, abs=1e-7), (t, e)
            continue
        differing += 1
        kth = min(hf_choice[t, e].item() for e in theirs)
        for e in set(ours) - set(theirs):
            assert hf_choice[t, e].item() == pytest.approx(kth, rel=1e-6, abs=1e-9), (t, e, ours, theirs)
    return differing


HF_CASES = [
    # (family, experts, top_k, HF config, our arguments after top_k)
    ("mixtral", 8, 2, {}, ("softmax", True, 1.0, 1, 1)),
    ("qwen2_moe", 60, 4, {"norm_topk_prob": False}, ("softmax", False, 1.0, 1, 1)),
    ("qwen3_moe", 128, 8, {"norm_topk_prob": True}, ("softmax", True, 1.0, 1, 1)),
    ("deepseek_v2", 64, 6, {"topk_method": "greedy", "routed_scaling_factor": 1.5},
     ("softmax", False, 1.5, 1, 1)),
    ("deepseek_v2", 160, 6, {"topk_method": "group_limited_greedy", "n_group": 8, "topk_group": 3,
                             "routed_scaling_factor": 16.0}, ("softmax", False, 16.0, 8, 3)),
    ("deepseek_v3", 256, 8, {"n_group": 8, "topk_group": 4, "norm_topk_prob": True, "routed_scaling_factor": 2.5},
     ("sigmoid", True, 2.5, 8, 4)),
    ("deepseek_v3", 64, 6, {"n_group": 4, "topk_group": 2, "norm_topk_prob": False, "routed_scaling_factor": 1.0},
     ("sigmoid", False, 1.0, 4, 2)),
    # GPT-OSS ranks the logits and softmaxes the k top values: Mixtral's rule (softmax over all, renormalized)
    ("gpt_oss", 32, 4, {}, ("softmax", True, 1.0, 1, 1)),
    ("gpt_oss", 128, 4, {}, ("softmax", True, 1.0, 1, 1)),
]


@pytest.mark.parametrize(("family", "num_experts", "top_k", "hf_cfg", "ours"), HF_CASES,
                         ids=[f"{c[0]}-E{c[1]}-{c[3].get('topk_method', '')}" for c in HF_CASES])
def test_reference_matches_hf_router(family, num_experts, top_k, hf_cfg, ours):
    torch.manual_seed(num_experts + top_k)
    router = _hf_router(family, num_experts, top_k, **hf_cfg)
    hidden = torch.randn(64, 32)
    with torch.no_grad():
        logits, hf_w, hf_ids = router(hidden)
    bias = router.e_score_correction_bias if family == "deepseek_v3" else None
    w, ids = moe_topk_reference(logits, top_k, *ours, correction_bias=bias)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32
    differing = _assert_same_routing(w, ids, hf_w, hf_ids, _hf_choice_scores(family, router, logits))
    assert differing <= 1  # fp32 logits: exact ties are rare


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt_oss_rule_is_mixtrals_up_to_rounding(dtype):
    """GPT-OSS's router (top-k of the logits, then a softmax of the k values, in the logits' dtype) is moe_topk's
    softmax rule renormalized (softmax over all E, the top k renormalized), as route_moe routes it: the same
    experts, and weights equal up to fp32 rounding (a few ulp: exp(l - max) / Z / sum instead of exp(l - max) /
    sum), in bf16 up to the one bf16 rounding both end with (weights_dtype, as route_moe passes it)."""
    torch.manual_seed(7)
    router = _hf_router("gpt_oss", 32, 4).to(dtype)
    with torch.no_grad():
        logits, hf_w, hf_ids = router(torch.randn(256, 32, dtype=dtype))
    assert hf_w.dtype == dtype
    w, ids = moe_topk_reference(logits, 4, "softmax", True, weights_dtype=None if dtype == torch.float32 else dtype)
    assert w.dtype == dtype
    same = (ids.long() == hf_ids).all(1)  # HF's order is ours (larger first) but where bf16 logits tie
    assert same.all() if dtype == torch.float32 else same.float().mean() > 0.9
    # fp32: a few ulp apart; bf16: the fp32 values' roundings agree or are one bf16 ulp apart
    rtol = 4 * torch.finfo(torch.float32).eps if dtype == torch.float32 else 2**-8
    torch.testing.assert_close(w[same].float(), hf_w[same].float(), rtol=rtol, atol=0.0)
    _assert_same_routing(w.float(), ids, hf_w.float(), hf_ids, logits.float())  # other rows: swapped ties only


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matches_hf_router_on_ties(dtype):
    """A Mixtral router whose experts 3 and 5 (and 1 and 6) have the same weights, so their logits tie on every
    token; HF's torch.topk then keeps either one, ours the lower index."""
    torch.manual_seed(0)
    router = _hf_router("mixtral", 8, 2).to(dtype)
    with torch.no_grad():
        router.weight[5] = router.weight[3]
        router.weight[6] = router.weight[1]
        logits, hf_w, hf_ids = router(torch.randn(128, 32, dtype=dtype))
    w, ids = moe_topk_reference(logits, 2, "softmax", True)
    for twin, lower in ((5, 3), (6, 1)):  # a twin is picked only together with its lower-index copy
        assert ((ids == twin).any(1) <= (ids == lower).any(1)).all()
    _assert_same_routing(w, ids, hf_w, hf_ids, _hf_choice_scores("mixtral", router, logits))


# ---------------------------------------------------------------------------------------------------------------
# arguments, the registered op, fake impl, opcheck


@pytest.mark.parametrize(("kwargs", "names"), [
    ({"top_k": 0}, "top_k"),
    ({"top_k": 9}, "top_k"),
    ({"scoring": "sparsemax"}, "scoring"),
    ({"n_group": 3}, "n_group"),
    ({"n_group": 0}, "n_group"),
    ({"n_group": 2, "topk_group": 3}, "topk_group"),
    ({"n_group": 4, "topk_group": 1, "top_k": 3}, "top_k=3"),
    ({"scoring": "sigmoid"}, "correction_bias"),
    ({"correction_bias": torch.zeros(8)}, "correction_bias"),
    ({"scoring": "sigmoid", "correction_bias": torch.zeros(7)}, "correction_bias"),
    ({"scoring": "sigmoid", "correction_bias": torch.zeros(8), "n_group": 8, "topk_group": 8}, "top 2"),
])
def test_invalid_arguments_name_the_argument(kwargs, names):
    args = {"top_k": 2, "scoring": "softmax", "renormalize": True, "routed_scaling_factor": 1.0, "n_group": 1,
            "topk_group": 1, "correction_bias": None, **kwargs}
    for fn in (moe_topk_reference, moe_topk_triton, torch.ops.mini_infer.moe_topk):
        with pytest.raises(ValueError, match=names):
            fn(torch.randn(3, 8), **args)
    with pytest.raises(ValueError, match="router_logits"):
        moe_topk_reference(torch.randn(2, 3, 8), 2, "softmax", True)


def test_registered_op_fake_and_opcheck():
    torch.manual_seed(4)
    logits, bias = torch.randn(5, 16), torch.randn(16) * 0.1
    args = (logits, 4, "sigmoid", True, 2.5, 4, 2, bias)
    w, ids = torch.ops.mini_infer.moe_topk(*args)
    w_ref, ids_ref = moe_topk_reference(*args)
    assert torch.equal(ids, ids_ref) and torch.equal(w, w_ref)
    with FakeTensorMode():
        fw, fids = torch.ops.mini_infer.moe_topk(torch.empty(7, 64, dtype=torch.bfloat16), 6, "softmax", False)
    assert fw.shape == (7, 6) and fw.dtype == torch.float32 and fids.shape == (7, 6) and fids.dtype == torch.int32
    torch.library.opcheck(torch.ops.mini_infer.moe_topk.default, args)
    torch.library.opcheck(torch.ops.mini_infer.moe_topk.default, (logits.bfloat16(), 2, "softmax", True))
    torch.library.opcheck(torch.ops.mini_infer.moe_topk.default,
                          (logits.bfloat16(), 2, "softmax", True, 1.0, 1, 1, None, torch.bfloat16))
    with FakeTensorMode():
        fw, _ = torch.ops.mini_infer.moe_topk(torch.empty(7, 64), 6, "softmax", False, weights_dtype=torch.float16)
    assert fw.dtype == torch.float16
    with pytest.raises(ValueError, match="weights_dtype"):
        moe_topk_reference(logits, 2, "softmax", True, weights_dtype=torch.int8)


@requires_triton
@pytest.mark.parametrize("weights_dtype", [torch.bfloat16, torch.float16])
def test_weights_rounded_by_the_kernel_as_the_reference_casts(weights_dtype):
    """Qwen's routers round the weights to the logits' dtype: the reference gives the bits of the fp32 weights cast
    by torch (round to nearest), the kernel's store too on a GPU; the CPU interpreter truncates fp32 -> bf16, so
    there the kernel is held to one ulp below (and fp16, which it rounds, to the bits)."""
    torch.manual_seed(6)
    logits = torch.randn(9, 64).bfloat16()
    w32, ids32 = moe_topk_reference(logits, 4, "softmax", True)
    w_ref, ids_ref = moe_topk_reference(logits, 4, "softmax", True, weights_dtype=weights_dtype)
    w, ids = moe_topk_triton(logits.to(DEVICE), 4, "softmax", True, weights_dtype=weights_dtype)
    assert w.dtype == weights_dtype and torch.equal(ids.cpu(), ids_ref) and torch.equal(ids_ref, ids32)
    assert torch.equal(w_ref, w32.to(weights_dtype))
    w = w.cpu()
    if DEVICE == "cuda" or weights_dtype == torch.float16:
        assert torch.equal(w, w_ref)
    else:  # truncated: the same bf16 value or the next one toward zero (all weights here are positive)
        below = torch.nextafter(w_ref, torch.zeros_like(w_ref))
        assert bool(((w == w_ref) | (w == below)).all())
