"""The pass manager: ordering, conflicts, cycles, bisect, disable, fallback, strict, provenance."""
import dataclasses

import pytest
import torch

import effpass
from effpass.manager import PipelineError, order_passes
from effpass.testing import compile_and_compare, model_case
from _helpers import register_test_passes


@pytest.fixture(autouse=True)
def test_passes():
    restore = register_test_passes()
    yield
    restore()


def _mk(name, run_after=(), conflicts=()):
    klass = dataclasses.make_dataclass(name.title().replace("_", ""), [], bases=(effpass.Pass,), frozen=True, kw_only=True,
                                       namespace={"transform_torch_ir": lambda self, gm, ctx: None})
    klass.name, klass.run_after, klass.conflicts_with = name, tuple(run_after), tuple(conflicts)
    return klass()


def test_order_follows_run_after_and_keeps_user_order_otherwise():
    a, b, c, d = _mk("a_pass"), _mk("b_pass", run_after=("d_pass",)), _mk("c_pass"), _mk("d_pass")
    assert [p.name for p in order_passes([a, b, c, d])] == ["a_pass", "c_pass", "d_pass", "b_pass"]
    # run_after on a pass that is not in the pipeline is ignored
    assert [p.name for p in order_passes([b, a])] == ["b_pass", "a_pass"]


def test_cycle_is_rejected_naming_the_passes():
    a, b = _mk("a_pass", run_after=("b_pass",)), _mk("b_pass", run_after=("a_pass",))
    with pytest.raises(PipelineError, match=r"cycle.*a_pass.*b_pass|cycle.*b_pass.*a_pass"):
        order_passes([a, b])


def test_conflict_is_rejected_naming_both():
    a, b = _mk("a_pass", conflicts=("b_pass",)), _mk("b_pass")
    with pytest.raises(PipelineError, match=r"'a_pass' conflicts with pass 'b_pass'"):
        effpass.compile(torch.nn.Linear(2, 2), passes=[a, b], lowering="eager")


def test_user_pass_runs_in_declared_order_and_appears_in_dump(tmp_path):
    @effpass.register_pass("after_scaling", run_after=("scale_linears_by_one",))
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class AfterScaling(effpass.Pass):
        def transform_torch_ir(self, gm, ctx):
            muls = sum(1 for n in gm.graph.nodes if n.meta.get("effpass_pass") == "scale_linears_by_one")
            return effpass.PassResult(False, {"muls_seen": muls})

    case = model_case("demo")
    # listed first, but declared to run after scale_linears_by_one
    res = compile_and_compare(case, [AfterScaling(), effpass.make_pass("scale_linears_by_one")],
                              dump_dir=str(tmp_path))
    names = [r.name for r in res.report.records() if r.phase == "torch_ir"]
    assert names == ["scale_linears_by_one", "after_scaling"]
    n_linears = 7 * case.num_layers + 1
    assert res.report.stats("scale_linears_by_one")["wrapped"] == n_linears
    # provenance: the later pass saw every node the earlier one made
    assert res.report.stats("after_scaling")["muls_seen"] == n_linears
    import json

    index = json.loads((tmp_path / "graph_000" / "index.json").read_text())
    assert [p["name"] for p in index["passes"]] == ["scale_linears_by_one", "after_scaling"]
    assert index["passes"][0]["file"].endswith("torch_ir_scale_linears_by_one.py")
    assert index["passes"][1]["file"] is None  # unchanged: no file
    assert index["passes"][0]["ops_after"]["torch.mul"] - index["passes"][0]["ops_before"].get("torch.mul", 0) == n_linears


def test_failing_pass_falls_back_with_a_warning_and_the_result_is_right(tmp_path):
    case = model_case("llama")
    with pytest.warns(RuntimeWarning, match=r"pass 'break_graph' failed on graph_000 \(joint graph\).*deliberate failure"):
        res = compile_and_compare(case, [effpass.make_pass("break_graph"), effpass.make_pass("count_joint_matmuls")],
                                  dump_dir=str(tmp_path))
    rec = res.report.records("break_graph")[0]
    assert rec.fell_back and "deliberate failure" in rec.error
    # The next pass saw the rolled-back graph: as many matmuls as before the failing pass.
    assert res.report.stats("count_joint_matmuls")["mm"] == rec.ops_before.get("aten.mm", 0) + rec.ops_before.get("aten.bmm", 0)
    import json

    index = json.loads((tmp_path / "graph_000" / "index.json").read_text())
    assert index["passes"][0]["error"].startswith("RuntimeError: deliberate failure")


def test_strict_mode_raises_listing_passes_that_ran_before():
    case = model_case("demo")
    compiled = effpass.compile(case.model, passes=[effpass.make_pass("count_joint_matmuls"),
                                                   effpass.make_pass("break_graph")],
                               lowering="eager", strict=True)
    with pytest.raises(Exception, match=r"pass 'break_graph' failed.*passes that ran before on this graph: \['count_joint_matmuls'\]"):
        compiled(**case.inputs)


@pytest.mark.parametrize("how", ["option", "env"])
def test_bisect_runs_only_the_first_n_passes(how, monkeypatch):
    case = model_case("demo")
    passes = [effpass.make_pass("count_linears"), effpass.make_pass("scale_linears_by_one")]
    if how == "env":
        monkeypatch.setenv("EFFPASS_BISECT", "1")
        kwargs = {}
    else:
        kwargs = {"bisect": 1}
    res = compile_and_compare(case, passes, **kwargs)
    assert [r.name for r in res.report.records()] == ["count_linears"]


def test_disable_list_and_env(monkeypatch):
    case = model_case("demo")
    passes = [effpass.make_pass("count_linears"), effpass.make_pass("scale_linears_by_one")]
    res = compile_and_compare(case, passes, disable=["scale_linears_by_one"])
    assert [r.name for r in res.report.records()] == ["count_linears"]
    monkeypatch.setenv("EFFPASS_DISABLE", "count_linears")
    res = compile_and_compare(model_case("demo"), passes)
    assert [r.name for r in res.report.records()] == ["scale_linears_by_one"]


def test_rollback_removes_placeholders_a_failed_pass_added():
    import torch.fx as fx

    from effpass.graph import restore_graph, snapshot_graph

    g = fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(torch.relu, (x,)))
    snap = snapshot_graph(g)
    extra = g.placeholder("extra")  # a pass adds an input and rewires, then fails
    out = next(n for n in g.nodes if n.op == "output")
    with g.inserting_before(out):
        add = g.call_function(torch.add, (out.args[0], extra))
    out.args = (add,)
    restore_graph(g, snap)
    assert [n.op for n in g.nodes] == ["placeholder", "call_function", "output"]
    assert next(iter(g.nodes)) is x  # the original input node survives (callers know it by identity)
    gm = fx.GraphModule(torch.nn.Module(), g)
    assert torch.equal(gm(torch.tensor([-1.0, 2.0])), torch.tensor([0.0, 2.0]))


CRASH_SCRIPT = """
import os, sys, dataclasses, torch, effpass
from effpass.testing import model_case

@effpass.register_pass("crash_process", phase="joint")
def crash_process(gm, ctx):
    os._exit(3)   # the process dies mid-compile, after the torch-IR passes

@effpass.register_pass("count_nodes_first")
def count_nodes_first(gm, ctx):
    return effpass.PassResult(False, {"nodes": len(gm.graph.nodes)})

case = model_case("demo")
m = effpass.compile(case.model, passes=["count_nodes_first", "crash_process"], lowering="eager", dump_dir=sys.argv[1])
m(**case.inputs)
"""


def test_a_crash_mid_compile_leaves_a_readable_dump(tmp_path):
    import json
    import subprocess
    import sys

    script = tmp_path / "crash.py"
    script.write_text(CRASH_SCRIPT)
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "dump")], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 3
    index = json.loads((tmp_path / "dump" / "graph_000" / "index.json").read_text())
    assert [p["name"] for p in index["passes"]] == ["count_nodes_first"] and index["passes"][0]["stats"]["nodes"] > 0
    assert (tmp_path / "dump" / "graph_000" / index["inputs"]["joint"]).exists()  # the joint input was written
    assert not [f for f in (tmp_path / "dump" / "graph_000").iterdir() if f.name.startswith(".tmp-")]


def test_strict_failure_is_recorded_in_the_dump(tmp_path):
    import json

    case = model_case("demo")
    compiled = effpass.compile(case.model, passes=[effpass.make_pass("break_graph")], lowering="eager", strict=True,
                               dump_dir=str(tmp_path))
    with pytest.raises(Exception, match="break_graph"):
        compiled(**case.inputs)
    index = json.loads((tmp_path / "graph_000" / "index.json").read_text())
    assert index["passes"][0]["name"] == "break_graph" and "deliberate failure" in index["passes"][0]["error"]


def test_facts_are_collected_before_any_hook_and_read_by_class():
    """Passes read each other's choices through declared facts (effpass.facts), never by name: the manager
    collects the active passes' facts, a hook asks by class (None when no pass declares it), two passes that
    declare different values of one fact are a PipelineError naming both, and a declaration that is not a Fact
    is a TypeError."""
    import effpass.passes as P
    from effpass.facts import FusesLossHead, LossScaling, MixedPrecision, ShardsParameters
    from effpass.manager import PassContext, PassManager, collect_facts
    from effpass.scope import Scope

    mgr = PassManager([P.ApplyAutocast(dtype=torch.float16), P.ScaleLoss(), P.FuseCrossEntropy()])
    assert mgr.fact(MixedPrecision) == MixedPrecision(dtype=torch.float16)
    assert mgr.fact(LossScaling) == LossScaling() and mgr.fact(FusesLossHead) == FusesLossHead()
    assert mgr.fact(ShardsParameters) is None
    assert PassManager([P.ApplyAutocast(), P.ScaleLoss()], disable=["scale_loss"]).fact(LossScaling) is None
    assert collect_facts([P.WrapFSDP(), P.ShardSequence()]) == {ShardsParameters: ShardsParameters()}
    ctx = PassContext(pass_name="x", phase=effpass.Phase.MODULE, graph_kind="module", scope=Scope("x"),
                      pipeline=(P.ApplyAutocast(),))
    assert ctx.fact(MixedPrecision) == MixedPrecision(dtype=torch.bfloat16) and ctx.fact(LossScaling) is None
    with pytest.raises(TypeError, match="ctx.fact takes a subclass of effpass.facts.Fact"):
        ctx.fact(effpass.Note)

    def declaring(name, facts):
        klass = dataclasses.make_dataclass(name.title().replace("_", ""), [], bases=(effpass.Pass,), frozen=True,
                                           kw_only=True, namespace={"transform_torch_ir": lambda self, gm, ctx: None,
                                                                    "facts": lambda self: facts})
        klass.name = name
        return klass()

    with pytest.raises(PipelineError, match="'apply_autocast' and 'declares_fp32' declare different MixedPrecision"):
        PassManager([P.ApplyAutocast(), declaring("declares_fp32", (MixedPrecision(dtype=torch.float32),))])
    assert PassManager([P.ApplyAutocast(), declaring("agrees", (MixedPrecision(dtype=torch.bfloat16),))]).facts
    with pytest.raises(TypeError, match="'bad_facts': facts\\(\\) must return effpass.facts.Fact instances"):
        PassManager([declaring("bad_facts", ("fp16",))])
