"""_triton_support.WEIGHT_EVICTION (MINI_INFER_WEIGHT_EVICTION, read at import; evict_first unless set): the L2
eviction policy of the batch-1 kernels' weight loads. Built for sm_90, the GEMVs' weight loads carry it and their
input row's loads do not; `none` leaves every load plain; the MoE GEMMs take it for decode-shaped launches only; an
unknown value stops the import, naming the variable."""

import os
import subprocess
import sys

import pytest
import torch

from mini_infer.ops import fused_moe as fused_moe_mod
from mini_infer.ops.fused_moe import GemmTile, MoeTileConfig, fused_moe_reference, fused_moe_triton
from tests.ops.helpers import (
    DEVICE,
    ROOT,
    assert_close,
    record_kernel_launches,
    requires_triton,
    run_uninterpreted,
)


@pytest.mark.parametrize(("variable", "want"), [(None, "evict_first"), ("evict_first", "evict_first"), ("none", ""),
                                                ("", "")])
def test_gemv_weight_loads_carry_the_policy(monkeypatch, variable, want):
    """tests/ops/compile_weight_eviction_sm90.py, built in a process with the variable set (or unset: the default):
    with evict_first every kernel creates an L2::evict_first policy and hints exactly its weight loads (two vector
    loads of the weight rows; the input row, scales and bias plain); with `none` (or empty) no load is hinted."""
    if variable is None:
        monkeypatch.delenv("MINI_INFER_WEIGHT_EVICTION", raising=False)
    else:
        monkeypatch.setenv("MINI_INFER_WEIGHT_EVICTION", variable)
    report = run_uninterpreted(["-m", "tests.ops.compile_weight_eviction_sm90"])
    assert [case["kernel"] for case in report["cases"]] == ["linear._gemv_kernel", "int8_linear._scaled_gemv_kernel"]
    for case in report["cases"]:
        assert case["eviction"] == want
        assert case["plain_loads"] >= 1, case  # the input row at least
        if want:
            assert case["policies"] == ["L2::evict_first"] and case["hinted_loads"] == 2, case
        else:
            assert case["policies"] == [] and case["hinted_loads"] == 0, case


def test_unknown_policy_is_refused():
    env = dict(os.environ, MINI_INFER_WEIGHT_EVICTION="evict_sometimes")
    run = subprocess.run([sys.executable, "-c", "import mini_infer.ops._triton_support"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "MINI_INFER_WEIGHT_EVICTION" in run.stderr and "evict_sometimes" in run.stderr


@requires_triton
@pytest.mark.parametrize(("kind", "block_m", "policy"), [("decode", 16, "evict_first"), ("prefill", 64, "")])
def test_moe_gemms_take_the_policy_at_decode_shapes(monkeypatch, kind, block_m, policy):
    """fused_moe's grouped GEMMs pass WEIGHT_EVICTION as B_EVICT in decode-shaped launches (the experts' weights
    stream once a step) and the default policy in prefill-shaped ones (weights reused across row blocks); the
    result is the reference's either way."""
    monkeypatch.setattr(fused_moe_mod, "WEIGHT_EVICTION", "evict_first")
    g = torch.Generator().manual_seed(3)
    w13 = (torch.randn(4, 2 * 16, 32, generator=g) / 32**0.5).to(DEVICE)
    w2 = (torch.randn(4, 32, 16, generator=g) / 16**0.5).to(DEVICE)
    x = torch.randn(2, 32, generator=g).to(DEVICE)
    weights, ids = torch.softmax(torch.randn(2, 4, generator=g), -1).topk(2)
    weights, ids = weights.to(DEVICE), ids.to(torch.int32).to(DEVICE)
    tile = GemmTile(32, 16, 1, 4, 2)
    launches = record_kernel_launches(monkeypatch, fused_moe_mod, "_moe_gemm_kernel", arguments=True)
    out = fused_moe_triton(x, weights, ids, w13, w2, config=MoeTileConfig(kind, block_m, tile, tile))
    assert [kwargs["B_EVICT"] for _, kwargs in launches] == [policy, policy]  # gate/up, then down
    assert_close(out, fused_moe_reference(x, weights, ids, w13, w2))
