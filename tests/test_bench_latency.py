"""bench/latency.py's `--switch` (a kernel switch set for one engine's build and restored after) and the order of
the engines `--rounds` alternates (the timings themselves run on a GPU only)."""

from pathlib import Path

import pytest


def test_switch_sets_and_restores(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    import latency

    from mini_infer.ops import fused_moe, paged_attention

    before = paged_attention.ATTN_PRELOAD, fused_moe.MOE_PRELOAD
    with latency.switched("paged_attention.ATTN_PRELOAD=0"):
        assert paged_attention.ATTN_PRELOAD is False
        with latency.switched(f"fused_moe.MOE_PRELOAD={int(not before[1])}"):
            assert fused_moe.MOE_PRELOAD is (not before[1])
    assert (paged_attention.ATTN_PRELOAD, fused_moe.MOE_PRELOAD) == before
    with pytest.raises(RuntimeError), latency.switched("paged_attention.ATTN_PRELOAD=0"):
        raise RuntimeError("an engine that failed to build")
    assert paged_attention.ATTN_PRELOAD == before[0]  # restored on the way out of a failure too
    with latency.switched("paged_attention.ATTN_PRELOAD=0,fused_moe.MOE_PRELOAD=0"):  # two for one engine
        assert (paged_attention.ATTN_PRELOAD, fused_moe.MOE_PRELOAD) == (False, False)
    assert (paged_attention.ATTN_PRELOAD, fused_moe.MOE_PRELOAD) == before
    with pytest.raises(SystemExit), latency.switched("paged_attention.ATTN_PRELOAD=0,MOE_PRELOAD=0"):
        pass
    assert paged_attention.ATTN_PRELOAD == before[0]  # the first one restored when the second is refused
    for bad in ("ATTN_PRELOAD=0", "paged_attention.ATTN_PRELOAD"):
        with pytest.raises(SystemExit), latency.switched(bad):
            pass


def test_every_switch_is_checked_before_the_first_engine(monkeypatch):
    """`check_switches` (latency.py and throughput.py call it right after parsing): a switch that does not parse, or
    names a module, attribute or table entry that does not exist, stops the run before any engine is built, naming
    the switch; good ones are set and restored, nothing left changed."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    import latency

    from mini_infer.ops import paged_attention

    before = paged_attention.ATTN_PRELOAD, dict(paged_attention._CONFIG["decode_split"])
    good = ["paged_attention.ATTN_PRELOAD=0", "paged_attention._CONFIG[decode_split][num_warps]=4", None]
    latency.check_switches(good)
    assert (paged_attention.ATTN_PRELOAD, paged_attention._CONFIG["decode_split"]) == before
    for bad in ("paged_attention.NO_SUCH_SWITCH=1", "no_such_module.X=1", "paged_attention._CONFIG[nope][x]=1",
                "paged_attention.ATTN_PRELOAD=0,linear.GEMV_CONFIG_LONG_K=4/x"):
        with pytest.raises(SystemExit, match="switch"):
            latency.check_switches([*good, bad])
        assert (paged_attention.ATTN_PRELOAD, paged_attention._CONFIG["decode_split"]) == before


def test_dotted_switch_reaches_a_runtime_module(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    import latency

    from mini_infer.runtime import cuda_graphs

    before = cuda_graphs.OWN_LOGITS_MAX_ROWS
    with latency.switched("runtime.cuda_graphs.OWN_LOGITS_MAX_ROWS=0"):
        assert cuda_graphs.OWN_LOGITS_MAX_ROWS == 0
    assert cuda_graphs.OWN_LOGITS_MAX_ROWS == before


def test_string_switch_takes_a_mode_by_name(monkeypatch):
    """A string attribute (a mode by name) takes the value as written; an int attribute still refuses a name."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    import latency

    from mini_infer.ops import int8_linear

    before = int8_linear.FP8_GEMV
    split = int8_linear.GEMV_DOT_SPLIT_PER_SM
    with latency.switched("int8_linear.FP8_GEMV=cuda-cores,int8_linear.GEMV_DOT_SPLIT_PER_SM=5"):
        assert (int8_linear.FP8_GEMV, int8_linear.GEMV_DOT_SPLIT_PER_SM) == ("cuda-cores", 5)
    assert (int8_linear.FP8_GEMV, int8_linear.GEMV_DOT_SPLIT_PER_SM) == (before, split)
    with pytest.raises(SystemExit), latency.switched("int8_linear.GEMV_DOT_SPLIT_PER_SM=two"):
        pass
    tile = int8_linear.SCALED_GEMV_CONFIG_FP8_DOT
    with latency.switched("int8_linear.SCALED_GEMV_CONFIG_FP8_DOT=64/256/4/4/2"):  # a tuple: ints joined by '/'
        assert int8_linear.SCALED_GEMV_CONFIG_FP8_DOT == (64, 256, 4, 4, 2)
    assert int8_linear.SCALED_GEMV_CONFIG_FP8_DOT == tile
    with pytest.raises(SystemExit), latency.switched("int8_linear.SCALED_GEMV_CONFIG_FP8_DOT=64/x"):
        pass


def test_table_entry_switch_takes_a_name_where_the_entry_is_a_string(monkeypatch):
    """A dict entry holding a string (paged_attention's fp8 dot way) takes a name, restored after; an int entry
    still refuses one."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    import latency

    from mini_infer.ops import paged_attention

    before = dict(paged_attention._CONFIG["decode_fp8"])
    with latency.switched("paged_attention._CONFIG[decode_fp8][fp8_dot]=fp16_vregs"):
        assert paged_attention._CONFIG["decode_fp8"] == {**before, "fp8_dot": "fp16_vregs"}
    assert paged_attention._CONFIG["decode_fp8"] == before
    with pytest.raises(SystemExit), latency.switched("paged_attention._CONFIG[decode_fp8][num_warps]=four"):
        pass
    assert paged_attention._CONFIG["decode_fp8"] == before


def test_rounds_alternate_every_variant(monkeypatch):
    """--rounds N: the first engine again from the second round on, then each variant (--without, --with, each
    --switch) in every round; no variant, no extra engine."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    import latency

    first = ["cleanup", "fuse_silu_mul", "paged_attention"]
    added = ["cleanup", "fuse_silu_mul", "fuse_gelu_mul", "paged_attention"]  # --with places a pass by its stage
    runs = latency.variant_runs(first, "fuse_silu_mul", "fuse_gelu_mul", ["linear.X=0"], 2)
    assert runs == [(",without=fuse_silu_mul", ["cleanup", "paged_attention"], None),
                    (",with=fuse_gelu_mul", added, None), (",linear.X=0", None, "linear.X=0"), (",round=2", None, None),
                    (",without=fuse_silu_mul,round=2", ["cleanup", "paged_attention"], None),
                    (",with=fuse_gelu_mul,round=2", added, None), (",linear.X=0,round=2", None, "linear.X=0")]
    assert latency.variant_runs(first, None, None, [], 3) == []
    assert latency.variant_runs(first, "cleanup,paged_attention", None, [], 1) == [
        (",without=cleanup+paged_attention", ["fuse_silu_mul"], None)]


def test_each_engine_is_reported_as_soon_as_it_is_timed(monkeypatch, capsys):
    """A run cut short by its time limit keeps what it measured: one stderr line an engine, with its tag."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    import latency

    latency.progress({"quantization": None, "kv_cache_dtype": "auto", "tag": ",linear.X=0", "decode_tok_s": 391.24,
                      "floor_tok_s": 681.4})
    latency.progress({"quantization": "w8a8", "kv_cache_dtype": "fp8", "decode_tok_s": 407.0, "floor_tok_s": 540.8})
    assert capsys.readouterr().err.splitlines() == [
        "[timed] q=none kv=auto,linear.X=0: 391.2 tok/s (floor 681.4)",
        "[timed] q=w8a8 kv=fp8: 407.0 tok/s (floor 540.8)"]


def test_table_switch_sets_one_field_and_clears_launch_shapes(monkeypatch):
    """`module.TABLE[key][field]=int`: one entry of a launch-shape table for the block (added if absent, removed
    after), the module's cached launch shapes dropped on the way in and out (else the next engine would launch the
    previous one's shape)."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    import latency

    from mini_infer.ops import paged_attention

    before = {k: dict(v) for k, v in paged_attention._CONFIG.items()}
    paged_attention._LAUNCH_OK["stale"] = (1, 2, 3, 4, 0)
    with latency.switched("paged_attention._CONFIG[decode_fp8][maxnreg]=96,"
                          "paged_attention._CONFIG[decode_split][num_warps]=4"):
        assert paged_attention._CONFIG["decode_fp8"]["maxnreg"] == 96
        assert paged_attention._CONFIG["decode_split"]["num_warps"] == 4
        assert "stale" not in paged_attention._LAUNCH_OK
        paged_attention._LAUNCH_OK["inside"] = (1, 2, 3, 4, 128)
    assert paged_attention._CONFIG == before and paged_attention._LAUNCH_OK == {}
    for bad in ("paged_attention._CONFIG[decode_fp8]maxnreg=1", "paged_attention._CONFIG[decode_fp8][maxnreg]=x"):
        with pytest.raises(SystemExit), latency.switched(bad):
            pass
    assert paged_attention._CONFIG == before


def test_profile_decode_keeps_its_switch_for_the_run(monkeypatch):
    """bench/profile_decode.py --switch: set while the engine is built and profiled, restored after (a first version
    entered it in an ExitStack it dropped at once, which restored the switch before anything ran)."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    import profile_decode

    from mini_infer.ops import paged_attention

    seen, before = [], dict(paged_attention._CONFIG["decode_fp8"])
    monkeypatch.setattr(profile_decode, "profile",
                        lambda args: seen.append(paged_attention._CONFIG["decode_fp8"].get("maxnreg")))
    monkeypatch.setattr("sys.argv", ["profile_decode.py", "--switch", "paged_attention._CONFIG[decode_fp8][maxnreg]=96"])
    profile_decode.main()
    assert seen == [96] != [before.get("maxnreg")] and paged_attention._CONFIG["decode_fp8"] == before


def test_env_switch_sets_and_restores(monkeypatch):
    """`env:NAME=value` (the switch that reaches a tensor-parallel engine's other ranks): set for the block, then
    restored, or removed when it was unset; with a module switch in the same assignment; malformed ones refused."""
    import os

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    import latency

    from mini_infer.ops import paged_attention

    monkeypatch.delenv("MINI_INFER_TWO_SHOT_ALLREDUCE", raising=False)
    monkeypatch.setenv("MINI_INFER_ONE_SHOT_ALLREDUCE", "4096")
    before = paged_attention.ATTN_PRELOAD
    with latency.switched("env:MINI_INFER_TWO_SHOT_ALLREDUCE=33554432,env:MINI_INFER_ONE_SHOT_ALLREDUCE=0,"
                          "paged_attention.ATTN_PRELOAD=0"):
        assert os.environ["MINI_INFER_TWO_SHOT_ALLREDUCE"] == "33554432"
        assert os.environ["MINI_INFER_ONE_SHOT_ALLREDUCE"] == "0"
        assert paged_attention.ATTN_PRELOAD is False
    assert "MINI_INFER_TWO_SHOT_ALLREDUCE" not in os.environ
    assert os.environ["MINI_INFER_ONE_SHOT_ALLREDUCE"] == "4096"
    assert paged_attention.ATTN_PRELOAD == before
    for bad in ("env:=1", "env:MINI_INFER_X=", "env:1BAD=2"):
        with pytest.raises(SystemExit, match="env:NAME=value"), latency.switched(bad):
            pass


def test_warm_up_decodes_as_long_as_the_timed_run(monkeypatch):
    """Every engine decodes once, as long as the timed decode, before it is timed (the first long decode after a
    machine starts runs slower once): the warm-up's generate asks for exactly the timed run's new tokens."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "bench"))
    import latency

    from mini_infer.llm import LLM

    llm = LLM("tiny-llama", num_kv_blocks=64, block_size=4)
    before = llm.engine.stats["generation_tokens"]
    latency.warm_up(llm, list(range(1, 30)), 20)
    assert llm.engine.stats["generation_tokens"] - before == 20
    assert not llm.engine.has_unfinished_requests()
