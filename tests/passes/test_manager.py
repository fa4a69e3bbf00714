"""PassManager: order checks, validation after every pass (a broken graph is a PassError naming the pass),
verification against eager (the first divergent pass is named), dumps and the summary table."""

import re

import pytest
import torch
import torch.fx as fx

from mini_infer.compiler import _make_verifier
from mini_infer.passes import PASSES, GraphPass, PassConfigError, PassResult, register_pass, resolve_passes
from mini_infer.passes.manager import (
    PassError,
    PassManager,
    PassStats,
    count_nodes,
    format_table,
    propagate_fake,
)
from tests.passes.helpers import (
    CPU,
    aten,
    copy_gm,
    loaded,
    mi,
    new_context,
    single_pass,
)
from tests.passes.helpers import _cleaned as cleaned

NAME = "tiny-llama"


def _fresh():
    return copy_gm(cleaned(NAME)), new_context(NAME, ("cleanup",))


def _lm_head(gm):
    return [n for n in gm.graph.nodes if n.target is aten.linear.default][-1]


class _EraseInUse(GraphPass):
    name = "erase_in_use"

    def apply(self, gm, ctx):
        gm.graph.erase_node(_lm_head(gm).args[0])  # still read by lm_head
        return PassResult(1)


class _UseBeforeDef(GraphPass):
    """Leaves a graph whose first multiply reads the lm_head output (defined later): a cycle."""

    name = "use_before_def"

    def apply(self, gm, ctx):
        first = next(n for n in gm.graph.nodes if n.target is aten.mul.Tensor)
        first.replace_input_with(first.args[0], _lm_head(gm))
        return PassResult(1)


class _WrongShape(GraphPass):
    """Feeds lm_head a narrowed hidden state: [1, T, 3] against a [vocab, 64] weight."""

    name = "wrong_shape"

    def apply(self, gm, ctx):
        head = _lm_head(gm)
        with gm.graph.inserting_before(head):
            bad = gm.graph.call_function(aten.narrow.default, (head.args[0], -1, 0, 3))
        head.replace_input_with(head.args[0], bad)
        return PassResult(1)


class _Raises(GraphPass):
    name = "raises"

    def apply(self, gm, ctx):
        raise KeyError("boom")


class _UntypedInput(GraphPass):
    """Adds a graph input without a fake value (so the graph cannot be validated)."""

    name = "untyped_input"

    def apply(self, gm, ctx):
        last = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
        with gm.graph.inserting_after(last):
            gm.graph.placeholder("mystery")
        return PassResult(1)


class _BreakEps(GraphPass):
    """Sets every rms_norm eps to 0.1: the graph stays valid, the logits change."""

    name = "break_eps"
    requires = ("fuse_rmsnorm",)

    def apply(self, gm, ctx):
        n = 0
        for node in gm.graph.nodes:
            if node.target in (mi.rms_norm.default, mi.fused_add_rms_norm.default):
                node.args = (*node.args[:-1], 0.1)
                n += 1
        return PassResult(n)


class _Nothing(GraphPass):
    name = "nothing"

    def apply(self, gm, ctx):
        return PassResult(0, "did nothing")


@pytest.mark.parametrize("bad", [_EraseInUse, _UseBeforeDef, _WrongShape, _Raises])
def test_broken_graph_is_a_pass_error_naming_the_pass(bad):
    gm, ctx = _fresh()
    with pytest.raises(PassError, match=f"pass '{bad.name}'") as info:
        PassManager([*resolve_passes(["fuse_rotary"]), bad()]).run(gm, ctx)
    assert info.value.__cause__ is not None
    assert ctx.applied == ["cleanup", "fuse_rotary"]  # the failing pass is not recorded as applied


def test_input_without_fake_value_names_the_pass():
    gm, ctx = _fresh()
    with pytest.raises(PassError, match="untyped_input"):
        PassManager([_UntypedInput()]).run(gm, ctx)


def test_invalid_graphs_are_pass_errors():
    """Whatever the message, a graph that cannot be validated is a PassError, and the pass is not recorded."""
    for bad, match in ((_UntypedInput, "mystery"), (_WrongShape, "linear")):
        gm, ctx = _fresh()
        with pytest.raises(PassError, match=match):
            PassManager([bad()]).run(gm, ctx)
        assert ctx.applied == ["cleanup"]


def test_verify_names_the_first_divergent_pass():
    gm, ctx = _fresh()
    lm = loaded(NAME)
    verifier = _make_verifier(lm.model, CPU, torch.float32)
    passes = [*resolve_passes(["fuse_rmsnorm", "fuse_rotary"]), _BreakEps(), *resolve_passes(["fuse_silu_mul"])]
    with pytest.raises(PassError, match=r"pass 'break_eps' changed the model's output") as info:
        PassManager(passes, verifier=verifier).run(gm, ctx)
    assert "['cleanup', 'fuse_rmsnorm', 'fuse_rotary']" in str(info.value)  # the ones that agreed
    assert "fuse_silu_mul" not in ctx.applied  # nothing ran after the divergent pass


def test_verify_records_error_per_pass():
    gm, ctx = _fresh()
    verifier = _make_verifier(loaded(NAME).model, CPU, torch.float32)
    stats = PassManager(resolve_passes(["select_logits", "fuse_rmsnorm", "paged_attention"]),
                        verifier=verifier).run(gm, ctx)
    assert [s.name for s in stats] == ["select_logits", "fuse_rmsnorm", "paged_attention"]
    assert all(s.max_abs_err is not None and s.max_abs_err < 1e-4 for s in stats)


def test_requires_order():
    gm, ctx = _fresh()
    ctx.applied = []  # as if cleanup had not run
    with pytest.raises(ValueError, match=re.escape("pass 'fuse_rmsnorm' requires ['cleanup']")):
        PassManager(resolve_passes(["fuse_rmsnorm"])).run(gm, ctx)
    with pytest.raises(ValueError, match="'break_eps' requires \\['fuse_rmsnorm'\\]"):
        PassManager([*resolve_passes(["cleanup"]), _BreakEps(), *resolve_passes(["fuse_rmsnorm"])]).run(gm, ctx)
    assert ctx.applied == []  # checked before anything ran
    # requirements already met by earlier runs on the same context count
    ctx.applied = ["cleanup"]
    PassManager(resolve_passes(["fuse_rmsnorm"])).run(gm, ctx)
    PassManager([_BreakEps()]).run(gm, ctx)
    assert ctx.applied == ["cleanup", "fuse_rmsnorm", "break_eps"]


def test_unknown_pass_name_lists_valid_ones():
    with pytest.raises(ValueError, match="unknown pass 'fuse_everything'") as info:
        resolve_passes(["cleanup", "fuse_everything"])
    for name in PASSES:
        assert name in str(info.value)
    with pytest.raises(ValueError, match="unknown pass"):
        resolve_passes([object()])


def test_register_pass_makes_it_resolvable():
    try:
        assert register_pass(_Nothing) is _Nothing
        (p,) = resolve_passes(["nothing"])
        assert isinstance(p, _Nothing)
    finally:
        PASSES.pop("nothing", None)
    instance = _Nothing()
    assert resolve_passes([instance]) == [instance]


def test_dumps_and_summary(tmp_path):
    gm, ctx = _fresh()
    names = ["fuse_rmsnorm", "fuse_rotary", "nothing"]
    stats = PassManager([*resolve_passes(names[:2]), _Nothing()], dump_dir=tmp_path / "d").run(gm, ctx)
    d = tmp_path / "d"
    expected = {"00_captured.txt", "summary.txt"}
    for i, n in enumerate(names, start=1):
        expected |= {f"{i:02d}_{n}.before.txt", f"{i:02d}_{n}.after.txt"}
    assert {p.name for p in d.iterdir()} == expected
    before, after = (d / "01_fuse_rmsnorm.before.txt").read_text(), (d / "01_fuse_rmsnorm.after.txt").read_text()
    assert "mini_infer.rms_norm" not in before and "mini_infer.rms_norm" in after
    assert "mini_infer.apply_rotary" in (d / "02_fuse_rotary.after.txt").read_text()
    assert (d / "02_fuse_rotary.before.txt").read_text() == after
    lines = (d / "summary.txt").read_text().splitlines()
    assert lines[0].split()[:2] == ["pass", "matches"] and set(lines[1]) <= {"-", " "}
    assert [line.split()[0] for line in lines[2:]] == names
    assert lines[4].endswith("did nothing")
    # the row numbers chain: each pass starts from the node count the previous one left
    assert [s.name for s in stats] == names
    assert stats[0].nodes_after == stats[1].nodes_before and stats[-1].nodes_after == count_nodes(gm)
    assert stats[0].num_matches == 5 and stats[1].num_matches == 4 and stats[2].num_matches == 0


def test_format_table():
    rows = [PassStats("a", 1, 10, 9, 0.001), PassStats("long_pass_name", 12, 9, 9, 0.5, "note here")]
    text = format_table(rows)
    lines = text.splitlines()
    assert len(lines) == 4 and "max |err|" not in lines[0]
    assert lines[3].startswith("long_pass_name  12") and lines[3].endswith("note here")
    assert "500.0" in lines[3]
    rows[1].max_abs_err = 3e-7
    assert "max |err|" in format_table(rows) and "3.00e-07" in format_table(rows)


def test_every_node_has_fake_values_after_a_pass():
    gm, _, _ = single_pass(NAME, "paged_attention")
    for node in gm.graph.nodes:
        if node.op != "output":
            assert "val" in node.meta, node.format_node()


def test_stage_order_is_validated_before_anything_runs():
    gm, ctx = _fresh()
    with pytest.raises(ValueError, match=r"pass 'select_logits' \(stage 'cleanup'\) is listed after "
                                         r"'paged_attention' \(stage 'attention'\)"):
        PassManager(resolve_passes(["paged_attention", "select_logits"])).run(gm, ctx)
    with pytest.raises(ValueError, match="pass 'fuse_rotary' is listed twice"):
        PassManager(resolve_passes(["fuse_rotary", "fuse_rotary"])).run(gm, ctx)
    with pytest.raises(ValueError, match="pass 'cleanup' is listed twice \\(or already ran\\)"):
        PassManager(resolve_passes(["cleanup"])).run(gm, ctx)  # cleanup already ran on this context
    assert ctx.applied == ["cleanup"]

    class _NoStage(GraphPass):
        name = "no_stage"
        stage = "whenever"

    with pytest.raises(ValueError, match="pass 'no_stage' has unknown stage 'whenever'"):
        PassManager([_NoStage()]).run(gm, ctx)
    with pytest.raises(ValueError, match="unknown stage 'whenever'"):
        register_pass(_NoStage)


def test_pass_arguments_are_validated_and_shown():
    class _Scaled(GraphPass):
        name = "scaled"

        def __init__(self, factor: float = 1.0) -> None:
            if not factor > 0:
                raise self.invalid("factor", factor, "must be > 0")
            self.factor = factor

        def apply(self, gm, ctx):
            return PassResult(0)

    with pytest.raises(PassConfigError, match=r"pass 'scaled': invalid factor=-1: must be > 0"):
        _Scaled(-1)
    assert repr(_Scaled(2.0)) == "_Scaled(factor=2.0)"
    assert repr(resolve_passes(["fuse_rotary"])[0]) == "FuseRotary()"


def test_pass_without_apply_is_an_error():
    class _Abstract(GraphPass):
        name = "abstract"

    gm, ctx = _fresh()
    with pytest.raises(PassError, match="pass 'abstract'"):
        PassManager([_Abstract()]).run(gm, ctx)
    assert isinstance(gm, fx.GraphModule)


def test_validation_runs_on_the_target_device():
    """transformers' MoE path feeds `histc` int32 on CUDA, which has no CPU kernel: validating a CUDA graph on
    CPU fakes failed every MoE preset on the GPU. Fakes of the graph's own device validate it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    graph = fx.Graph()
    x = graph.placeholder("expert_ids")
    graph.output(graph.call_function(aten.histc.default, (x, 4, 0, 3)))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    with FakeTensorMode():
        x.meta["val"] = torch.empty(6, dtype=torch.int32, device="cuda")
    propagate_fake(gm, "cuda")
    out = next(n for n in gm.graph.nodes if n.op == "call_function").meta["val"]
    assert out.device.type == "cuda" and out.dtype == torch.int32
    with pytest.raises(PassError, match="histc"):
        propagate_fake(gm, "cpu")


def test_in_place_ops_validate_on_cuda_fakes():
    """transformers 5.17's MoE routing clamps its expert ids in place; with a symbolic size the in-place op's
    decomposition copies on the device, which a CPU-only torch cannot fake for CUDA: its shape rule returns the
    tensor it changes."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    graph = fx.Graph()
    x = graph.placeholder("expert_ids")
    graph.output(graph.call_function(aten.clamp_.default, (x, 0, 7)))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    mode = FakeTensorMode(shape_env=ShapeEnv())
    x.meta["val"] = mode.from_tensor(torch.empty(6, dtype=torch.int64),
                                     symbolic_context=StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC]))
    propagate_fake(gm, "cuda")
    out = next(n for n in gm.graph.nodes if n.op == "call_function").meta["val"]
    assert out.device.type == "cuda" and out.dtype == torch.int64 and out.shape == x.meta["val"].shape


def test_every_tiny_graph_validates_on_cuda_fakes():
    """CUDA fake kernels with a symbolic token count, on a machine without a GPU: what the GPU runs."""
    gm, _, _ = single_pass("tiny-qwen3-moe", "paged_attention")
    propagate_fake(copy_gm(gm), "cuda")
