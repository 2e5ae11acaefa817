"""Tests of the ``checkpoint_activations`` pass.

Oracles: numerical (gradients with every policy equal the gradients of the same compiled model without
checkpointing, within 1e-6 relative in fp32; with dropout the recomputed forward draws the same random
numbers) and structural (the pass's byte/FLOP statistics, what the partitioner saves and recomputes).
"""
from __future__ import annotations

import copy

import pytest
import torch

import effpass
from effpass.testing import compile_and_compare, grads_of, model_case
from effpass.passes import CheckpointActivations
from effpass.passes.checkpoint_activations import (MUST_SAVE, RECOMPUTE, find_blocks, forward_nodes,
                                                    num_forward_outputs, parse_bytes, partition_stats,
                                                    plan_budget, plan_policy)

NAME = "checkpoint_activations"

# One worker, in file order (--dist loadgroup): the compiles that several tests read (the reference gradients, the
# unmarked joint graph, the "ops" and "full" policies' graphs and statistics) are made once per run, not once per
# worker; each test still compiles what it checks (or reads the compile its own checks were written for).
pytestmark = pytest.mark.xdist_group("checkpoint_activations")

# ------------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------------
_CAPTURED: dict = {}


@effpass.register_pass("capture_joint_for_ca_tests", phase="joint", run_after=(NAME,))
def _capture(gm, ctx):
    """Keeps the joint graph (after checkpoint_activations marked it) for structural checks."""
    if ctx.graph_kind == "joint":
        _CAPTURED["gm"], _CAPTURED["model"] = gm, ctx.model
    return None


def _train_step(case, passes, *, seed=0, lowering="eager", **kw):
    """One compiled forward+backward on a fresh copy of the case's model: (grads, report, loss)."""
    model, compiled = _compile(case, passes, lowering=lowering, **kw)
    return _step(case, model, compiled, seed)


def _compile(case, passes, *, lowering="eager", **kw):
    """(a fresh copy of the case's model, that copy compiled with ``passes``)."""
    torch._dynamo.reset()
    model = copy.deepcopy(case.model)
    kw.setdefault("detailed_stats", True)
    return model, effpass.compile(model, passes=passes, lowering=lowering, dump_dir=None, strict=True, **kw)


def _step(case, model, compiled, seed=0):
    """One forward+backward of ``compiled`` (gradients of ``model`` reset first): (grads, report, loss)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = case.loss(compiled(**case.inputs))
    loss.backward()
    return grads_of(model), effpass.report(compiled), loss.detach()


def _assert_grads_equal(actual, expected, rtol=1e-6):
    assert set(actual) == set(expected)
    for k in expected:
        scale = expected[k].abs().max().clamp_min(1e-12)
        err = ((actual[k] - expected[k]).abs().max() / scale).item()
        assert err <= rtol, f"grad {k}: relative error {err:.2e} > {rtol}"


def _joint(name="llama"):
    """The joint graph of one training step of the model (unmarked), its model and num_fwd_outputs: captured by
    the reference compile (:func:`_reference`)."""
    _reference(name)
    gm, model = _JOINTS[name]
    return gm, model, num_forward_outputs(gm)


# ------------------------------------------------------------------------------------------------------
# every policy: same gradients, fewer saved bytes, as promised
# ------------------------------------------------------------------------------------------------------
_REFS: dict = {}
_JOINTS: dict = {}  # model -> (its unmarked joint graph, the model), captured by the reference compile


def _reference(name):
    """Gradients of the compiled model without checkpointing (computed once per model; the pass that captures
    the joint graph changes nothing in it)."""
    if name not in _REFS:
        case = model_case(name)
        _REFS[name] = (case, _train_step(case, ["capture_joint_for_ca_tests"])[0])
        _JOINTS[name] = (_CAPTURED["gm"], _CAPTURED["model"])
    return _REFS[name]


_POLICIES = {"ops": {}, "full": {"policy": "full"}, "budget": {"budget": 0.5}}
#: model -> the "ops" policy's statistics, when its case ran in this process
_OPS_STATS: dict = {}
#: policy -> (joint graph marked by the pass, model, the pass's statistics) of the llama case: the policy test's
#: own compile, read again by the structural tests of that policy below (compiled there when it did not run)
_LLAMA_GRAPHS: dict = {}
#: the report of 1-layer llama (train=True) compiled with the default policy and fuse_cross_entropy, detailed_stats:
#: made by test_statistics_that_cost_partitions_only_when_asked (counting its partitions), read by the fused-loss test
_FUSED_OPS: dict = {}


def _llama_policy(label):
    """(marked joint graph, model, statistics) of llama compiled with ``_POLICIES[label]``."""
    if label not in _LLAMA_GRAPHS:
        case, _ = _reference("llama")
        _, rep, _ = _train_step(case, [CheckpointActivations(**_POLICIES[label]), "capture_joint_for_ca_tests"])
        _LLAMA_GRAPHS[label] = (_CAPTURED["gm"], _CAPTURED["model"], rep.stats(NAME))
    return _LLAMA_GRAPHS[label]


@pytest.mark.parametrize("policy", [
    # every policy on llama and the default on all models in the quick run; the rest is marked slow
    pytest.param((m, p), marks=[pytest.mark.slow] if (p != "ops" and m != "llama") else [], id=f"{m}-{p}")
    for m in ("llama", "gpt2", "bert", "demo") for p in _POLICIES])
@pytest.mark.sweep
def test_policies_keep_gradients_and_cut_saved_bytes(policy):
    name, label = policy
    case, ref = _reference(name)
    grads, rep, _ = _train_step(case, [CheckpointActivations(**_POLICIES[label]), "capture_joint_for_ca_tests"])
    _assert_grads_equal(grads, ref)
    st = rep.stats(NAME)
    if name == "llama":  # the marked graph, for the structural tests of this policy below
        _LLAMA_GRAPHS[label] = (_CAPTURED["gm"], _CAPTURED["model"], st)
    if label == "ops":
        _OPS_STATS[name] = st  # the "full" case compares with these: one compile fewer where both run here
    assert st["blocks"] == case.num_layers, st
    assert st["saved_bytes_measured"] == st["saved_bytes_after"], st  # plan == real partition
    assert st["recompute_flops_measured"] == st["recompute_flops_after"], st
    assert st["saved_bytes_after"] < st["saved_bytes_before"], st
    if label != "ops":  # "ops" may even recompute less than the unmarked partitioner (it saves softmax outputs)
        assert st["recompute_flops_added"] > 0, st
    # the promises, from tensor metadata: "budget" at most half the no-checkpointing bytes; "full" keeps
    # only block inputs, so at most what the op-level policy keeps; "ops" at least a quarter less
    if label == "budget":
        assert st["budget_met"] and st["saved_bytes_after"] <= 0.5 * st["saved_bytes_before"], st
    elif label == "ops":
        assert st["saved_bytes_after"] <= 0.75 * st["saved_bytes_before"], st
    else:
        ops = _OPS_STATS.get(name) or partition_stats_of(case, CheckpointActivations())
        assert st["saved_bytes_after"] <= ops["saved_bytes_after"], (st, ops)
        assert st["recompute_flops_added"] > ops["recompute_flops_added"]
    # per graph and in total: the graphs' numbers add up to the total (GPT-2 has a second graph for the loss)
    per_graph = [g.stats(NAME) for g in rep.graphs if g.stats(NAME)]
    assert sum(g["saved_bytes_after"] for g in per_graph) == st["saved_bytes_after"]


def partition_stats_of(case, p):
    """The pass's statistics without training: compile and run forward+backward once."""
    return _train_step(case, [p])[1].stats(NAME)


def test_ops_policy_saves_matmul_outputs_and_recomputes_pointwise():
    gm, model, st = _llama_policy("ops")
    fwd = [n for n in forward_nodes(gm.graph) if n.op == "call_function"]
    marks = {n: n.meta.get("recompute") for n in fwd}
    mms = [n for n in marks if n.target is torch.ops.aten.mm.default]
    assert mms and all(marks[n] is MUST_SAVE for n in mms)
    pointwise = [n for n in marks if n.target in (torch.ops.aten.mul.Tensor, torch.ops.aten.rsqrt.default,
                                                  torch.ops.aten.silu.default, torch.ops.aten.add.Tensor)]
    recomputed = [n for n in pointwise if marks[n] is RECOMPUTE]
    assert len(recomputed) > len(pointwise) / 2, (len(recomputed), len(pointwise))
    # block ids follow the layers: layer 0 -> 1, layer 1 -> 2
    ids = {n.meta["ac_graph_id"] for n in mms if "layers.1." in str(n.meta.get("nn_module_stack"))}
    assert ids == {2}
    # the values saved on top of the matmul outputs cost no bytes and no recompute: the plain rule
    # (save only matmul/attention outputs) saves at least as much and recomputes at least as much
    plain = partition_stats(gm, plan=plan_policy(fwd, find_blocks(fwd, (), model), "ops"))
    assert st["saved_bytes_after"] <= plain["saved_bytes"]
    assert st["recompute_flops_after"] < plain["recompute_flops"]
    # "before" is the partition of the same graph without marks: what the partitioner recomputes on its own
    unmarked = partition_stats(gm, clear_marks=True)
    assert (st["saved_bytes_before"], st["recompute_flops_before"]) == (unmarked["saved_bytes"],
                                                                         unmarked["recompute_flops"]), st


def test_full_policy_saves_only_values_crossing_blocks():
    gm, model, _ = _llama_policy("full")
    st = partition_stats(gm)
    by_name = {n.name: n for n in gm.graph.nodes}
    fwd = [n for n in forward_nodes(gm.graph) if n.op == "call_function"]
    block_of = find_blocks(fwd, (), model)
    inside = [by_name[s] for s in st["saved"] if block_of.get(by_name[s])]
    assert inside, "the block outputs must be saved"
    for n in inside:  # every saved value made inside a block is used outside it (a block output)
        assert any(block_of.get(u, "") != block_of[n] for u in n.users if u in block_of), n


# ------------------------------------------------------------------------------------------------------
# dropout: the recomputed forward uses the same random numbers
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["gpt2", pytest.param("demo", marks=pytest.mark.slow)])
def test_dropout_is_recomputed_with_the_same_random_numbers(name):
    case = model_case(name, dropout=0.1, train=True)
    plain = _compile(case, [])
    ref, _, ref_loss = _step(case, *plain, seed=3)
    # the test can fail: another seed draws other masks and gives another loss (the same compiled plain step, run
    # before the next compile resets Dynamo)
    _, _, other_loss = _step(case, *plain, seed=4)
    assert not torch.equal(other_loss, ref_loss)
    grads, rep, loss = _train_step(case, [CheckpointActivations(policy="full")], seed=3)
    st = rep.stats(NAME)
    assert st["recomputed_rng_ops"] > 0, st  # dropout really is replayed in the backward
    assert torch.equal(loss, ref_loss)
    _assert_grads_equal(grads, ref)


# ------------------------------------------------------------------------------------------------------
# budget: effpass against torch's own activation_memory_budget on the same joint graph
# ------------------------------------------------------------------------------------------------------
def test_budget_recomputes_no_more_flops_than_torch_memory_budget():
    """At the bytes torch's knapsack reaches for a given ``activation_memory_budget``, effpass's budget mode
    (given those bytes) saves no more and recomputes no more FLOPs (measured on llama: fewer at 0.3 and 0.7;
    FLOPs of recomputed attention counted by its q/k/v shapes). A tight and a loose budget: 0.5 (between them,
    also fewer) cost another ~6.5 CPU-s of budget search for the same check."""
    gm, model, nf = _joint()
    fwd = [n for n in forward_nodes(gm.graph) if n.op == "call_function"]
    block_of = find_blocks(fwd, (), model)
    before = partition_stats(gm, nf)["saved_bytes"]
    results = []
    for frac in (0.3, 0.7):
        ts = partition_stats(gm, nf, memory_budget=frac)
        _plan, met, es = plan_budget(gm, fwd, block_of, ts["saved_bytes"], nf, before_bytes=before)
        assert met and es["saved_bytes"] <= ts["saved_bytes"]
        assert es["recompute_flops"] <= ts["recompute_flops"], (frac, es["recompute_flops"], ts["recompute_flops"])
        results.append((frac, ts["recompute_flops"], es["recompute_flops"]))
    assert all(e < t for _, t, e in results), results


def test_torch_budget_plan_reproduces_torch_exactly():
    """When torch's own knapsack is the best plan, the pass hands it to the partitioner as a per-graph
    ``memory_budget`` and the real partition is torch's: same saved bytes as torch at that fraction."""
    from effpass.passes.checkpoint_activations import TorchBudget

    gm, _model, nf = _joint()
    ts = partition_stats(gm, nf, memory_budget=0.5)
    next(iter(gm.graph.nodes)).meta["memory_budget"] = TorchBudget(0.5).fraction
    try:
        mine = partition_stats(gm, nf)  # no config patch: only the node's override says 0.5
    finally:
        next(iter(gm.graph.nodes)).meta.pop("memory_budget")
    plain = partition_stats(gm, nf)
    assert mine["saved_bytes"] == ts["saved_bytes"] < plain["saved_bytes"]
    assert mine["recompute_flops"] == ts["recompute_flops"] > plain["recompute_flops"]


def test_absolute_budget_string():
    # one block: 24 KiB is ~14% of what it saves unchecked (175 KiB), as tight as 40 KiB of two blocks' 303 KiB;
    # the budget search partitions the joint graph a dozen times, half the graph half the cost (~11 -> ~5 CPU-s)
    case = model_case("demo", layers=1)
    _, rep, _ = _train_step(case, [CheckpointActivations(budget="24KiB"), "capture_joint_for_ca_tests"])
    st = rep.stats(NAME)
    assert st["budget_bytes"] == 24 * 1024
    assert st["budget_met"] and st["saved_bytes_measured"] <= 24 * 1024 < st["saved_bytes_before"], st
    # torch_solver: the graph carries torch's per-graph budget override exactly when torch's knapsack won, and
    # then torch's partition at torch_budget_fraction is what the real partition saved
    gm = _CAPTURED["gm"]
    override = next(iter(gm.graph.nodes)).meta.get("memory_budget")
    assert bool(st["torch_solver"]) == (override is not None), (st, override)
    if st["torch_solver"]:
        assert st["torch_budget_fraction"] == override and 0 < override <= 1
        assert partition_stats(gm, clear_marks=True, memory_budget=override)["saved_bytes"] == st["saved_bytes_measured"]
    else:
        assert "torch_budget_fraction" not in st


# ------------------------------------------------------------------------------------------------------
# scope, inference, options
# ------------------------------------------------------------------------------------------------------
def test_targets_limit_checkpointing_to_one_layer():
    case, ref = _reference("llama")
    grads, rep, _ = _train_step(case, [CheckpointActivations(policy="full", targets=["model.layers.0"]),
                                       "capture_joint_for_ca_tests"])
    _assert_grads_equal(grads, ref)
    assert rep.stats(NAME)["blocks"] == 1
    marked = {str(n.meta.get("nn_module_stack")) for n in _CAPTURED["gm"].graph.nodes if "recompute" in n.meta}
    assert marked and not any("layers.1" in s for s in marked)


def test_targets_matching_nothing_is_an_error():
    case = model_case("llama")
    with pytest.raises(Exception, match="targets pattern 'model.blocks.\\*' matches no module"):
        _train_step(case, [CheckpointActivations(targets=["model.blocks.*"])])


def test_inference_graph_is_left_alone():
    case = model_case("llama")
    torch._dynamo.reset()
    compiled = effpass.compile(copy.deepcopy(case.model), passes=[CheckpointActivations()], lowering="eager",
                               dump_dir=None, strict=True)
    with torch.no_grad():
        compiled(**case.inputs)
    recs = effpass.report(compiled).records(NAME)
    assert recs and not any(r.changed for r in recs)
    assert any("inference" in s["reason"] for r in recs for s in r.skipped)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"budget": 1.5}, ValueError, "fraction in"),
    ({"budget": 0.0}, ValueError, "fraction in"),
    ({"budget": "6 parsecs"}, ValueError, "cannot read"),
    ({"budget": 0.5, "policy": "full"}, ValueError, "cannot be combined"),
    ({"policy": "most"}, ValueError, "choose one of"),
    ({"save_ops": ["aten.no_such_op"]}, ValueError, "not an aten op"),
    ({"budget": [1]}, TypeError, "not one of"),
])
def test_bad_options_name_the_bad_value(kwargs, error, match):
    with pytest.raises(error, match=match):
        CheckpointActivations(**kwargs)


def test_parse_bytes():
    assert parse_bytes("6GiB") == 6 * 2**30
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes("2g") == 2_000_000_000
    assert parse_bytes("1000") == 1000


def test_options_round_trip_through_the_string_backend_form():
    p = effpass.make_pass(NAME, {"budget": "1GiB", "targets": ["model.layers.*"]})
    assert p == CheckpointActivations(budget="1GiB", targets=("model.layers.*",))
    assert effpass.make_pass(NAME, p.options()) == p


# ------------------------------------------------------------------------------------------------------
# composition with apply_autocast: low-precision bytes are counted as such
# ------------------------------------------------------------------------------------------------------
def test_composes_with_apply_autocast():
    from effpass.passes import ApplyAutocast

    case = model_case("llama")
    ac = ApplyAutocast(dtype=torch.bfloat16)
    ref, _, _ = _train_step(case, [ac])
    grads, rep, _ = _train_step(case, [ac, CheckpointActivations()])
    _assert_grads_equal(grads, ref, rtol=1e-6)  # the recompute runs in the same dtypes as the forward
    st, st32 = rep.stats(NAME), _llama_policy("ops")[2]  # fp32: the "ops" policy's compile of the same model
    assert st["saved_bytes_after"] < st32["saved_bytes_after"], (st, st32)  # bf16 matmul outputs: 2 bytes
    assert st["saved_bytes_measured"] == st["saved_bytes_after"]


# ------------------------------------------------------------------------------------------------------
# Inductor
# ------------------------------------------------------------------------------------------------------
@pytest.mark.inductor
def test_inductor_lowering_matches_eager():
    # the reference: the same model without checkpointing, compiled with eager lowering (one Inductor compile
    # fewer; the policies above compare the eager-lowered graphs with each other)
    case, ref = _reference("llama")
    grads, rep, _ = _train_step(case, [CheckpointActivations()], lowering="inductor")
    _assert_grads_equal(grads, ref, rtol=1e-5)  # Inductor fuses the recompute differently
    st = rep.stats(NAME)
    assert st["saved_bytes_after"] < st["saved_bytes_before"]
    assert 0 < st["saved_bytes_measured"] <= st["saved_bytes_before"]


def test_recompute_modules_trades_projection_matmuls_for_a_40_percent_cut():
    """The default 'ops' policy saves every matmul output (~30% cut on Llama blocks at most); recomputing
    the q/k/v projections from the saved layer input goes past 40% for a little more matmul work."""
    from effpass.passes import FuseAttention

    qkv = ("*.q_proj", "*.k_proj", "*.v_proj")
    cuts = {}
    for rm in ((), qkv):
        case = model_case("llama", seq=64)
        res = compile_and_compare(case, [FuseAttention(), CheckpointActivations(recompute_modules=rm)],
                                  atol=1e-6, rtol=1e-6, detailed_stats=True)   # gradients still equal the eager reference
        st = res.report.stats("checkpoint_activations")
        cuts[rm] = (1 - st["saved_bytes_after"] / st["saved_bytes_before"], st["recompute_flops_added"])
    assert cuts[()][0] < 0.40 <= cuts[qkv][0], cuts
    # the extra recompute is the three projections' matmuls: far more FLOPs than pointwise-only recompute
    assert cuts[qkv][1] > 10 * cuts[()][1], cuts


def test_statistics_that_cost_partitions_only_when_asked(monkeypatch):
    """Without a dump or ``detailed_stats`` the pass partitions no copy of the graph (the real partition
    is the only one); the measured saved bytes from the real backward graph are still reported."""
    import effpass.passes.checkpoint_activations as ca

    calls = []
    real = ca.partition_stats
    monkeypatch.setattr(ca, "partition_stats", lambda *a, **k: calls.append(1) or real(*a, **k))
    case = model_case("llama", layers=1)  # the partitions counted are per graph: one block shows them
    _, rep, _ = _train_step(case, [CheckpointActivations()], detailed_stats=False)
    st = rep.stats(NAME)
    assert calls == [] and "saved_bytes_before" not in st and st["saved_bytes_measured"] > 0, st
    _, rep, _ = _train_step(case, [CheckpointActivations()], detailed_stats=True)
    # one copy (the unmarked graph, "before"); "after" is the real partition of the marked graph (issue 36.4)
    st = rep.stats(NAME)
    assert len(calls) == 1 and st["saved_bytes_after"] == st["saved_bytes_measured"] < st["saved_bytes_before"], st
    assert st["recompute_flops_added"] == st["recompute_flops_after"] - st["recompute_flops_before"], st
    # a later joint hook (fuse_cross_entropy marks its op) could change the graph first: a marked copy is
    # partitioned, and its prediction is what the real partition then saves
    from effpass.passes import FuseCrossEntropy

    calls.clear()
    _, rep, _ = _train_step(model_case("llama", layers=1, train=True),
                            [CheckpointActivations(), FuseCrossEntropy()], detailed_stats=True)
    _FUSED_OPS["report"] = rep  # the same compile test_fused_loss_is_not_counted_as_recompute[ops] checks
    st = rep.stats(NAME)
    assert len(calls) == 2 and st["saved_bytes_after"] == st["saved_bytes_measured"], st


# ------------------------------------------------------------------------------------------------------
# recompute statistics count only what the backward graph recomputes
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("options", [{}, {"budget": 0.5}], ids=["ops", "budget"])
def test_fused_loss_is_not_counted_as_recompute(options):
    """``fuse_cross_entropy``'s op computes the head's gradients in its forward and is never recomputed (it
    marks the op MUST_SAVE in its own joint hook, after this pass): the predicted recompute equals the FLOPs
    of the forward ops the real backward graph runs, and the fused head adds no recompute of its own (the
    unfused head's backward recomputes its elementwise log-softmax; the fused one nothing)."""
    from effpass.passes import FuseCrossEntropy

    case = model_case("llama", layers=1, train=True)  # one block: the head and a block's recompute
    if not options and "report" in _FUSED_OPS:  # the statistics test's compile of this step (detailed_stats too)
        fused = _FUSED_OPS["report"]
    else:
        _, fused, _ = _train_step(case, [CheckpointActivations(**options), FuseCrossEntropy()])
    assert fused.stats("fuse_cross_entropy")["fused"] == 1
    st = fused.stats(NAME)
    assert st["recompute_flops_measured"] == st["recompute_flops_after"], st
    if options:
        # a budget is a fraction of bytes that differ with the fused head (other choices): the unfused step is no
        # comparison of flops here; its own check (predicted recompute == measured, budget policy, no fused head)
        # reads the policy tests' compile of llama with the budget policy (shared: its budget search partitions the
        # joint graph up to nine times), compiled here when the sweep's sample left that case out
        ref = _llama_policy("budget")[2]
        assert ref["recompute_flops_measured"] == ref["recompute_flops_after"], ref
        return
    _, plain, _ = _train_step(case, [CheckpointActivations(**options)])
    ref = plain.stats(NAME)
    assert ref["recompute_flops_measured"] == ref["recompute_flops_after"], ref
    assert st["recompute_flops_after"] <= ref["recompute_flops_after"], (st, ref)
    assert st["recompute_flops_added"] <= ref["recompute_flops_added"], (st, ref)
