"""The planner's pruning (issue 23.4, planning speed): a candidate whose bytes at the start of its step
already exceed the budget is not replayed, and every replayed candidate's figures are byte-identical to
those of a plan that replays every candidate (``prune=False``).

Oracles: numerical - each replayed candidate's estimate, extra compute and table row equal the unpruned
plan's field by field, and the pruned candidate's real (unpruned) peak is above its floor and the budget;
structural - the floor equals the replay's own start-of-step bytes, and the number of replays is smaller.
A Llama built from its config on the meta device (LoRA, full checkpointing, fused loss in the pipeline),
fp32 weights large against the activations, so that an NF4 base changes what fits.
"""
import re

import pytest
import torch

import effpass
from effpass.planning import MemoryBudgetError, plan_memory
from effpass.planning import search as search_mod
from effpass.planning.cli import model_from_config
from effpass.planning.estimate import start_bytes_many

CFG = dict(model_type="llama", hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, vocab_size=512, max_position_embeddings=128, tie_word_embeddings=False)


def _setup():
    model = model_from_config(CFG, "float32")
    tok = torch.zeros(1, 16, dtype=torch.long, device="meta")
    inputs = {"input_ids": tok, "labels": tok, "use_cache": False}
    passes = [effpass.make_pass("inject_lora", {"rank": 4, "targets": ["*.q_proj", "*.v_proj"]}),
              effpass.make_pass("checkpoint_activations", {"policy": "full"}),
              effpass.make_pass("fuse_cross_entropy", {})]
    return model, inputs, passes


@pytest.fixture(scope="module")
def replays():
    """Replay caches of this module's plans, all of the same model, inputs, pipeline and options: ``pruned`` for the
    pruned plans, ``full`` for the unpruned reference plans (two independent sets of replays: the comparison's
    sides). A module fixture: its users run on one xdist worker, so the command-line test reads the replays the
    first test made (the same plans at the same budget) instead of replaying them again."""
    return {"pruned": {}, "full": {}}


def _plan(model, inputs, passes, budget, prune, cache, calls):
    real = search_mod.estimate_many

    def counting(m, i, pipelines, *a, **k):
        calls.append(len(pipelines))
        return real(m, i, pipelines, *a, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(search_mod, "estimate_many", counting)
        mp.setattr(search_mod, "estimate_memory", lambda *a, **k: calls.append(1) or _estimate_memory(*a, **k))
        try:
            return plan_memory(model, inputs, budget, allow=["nf4"], passes=passes, lowering="eager", prune=prune,
                               cache=cache)
        except MemoryBudgetError as e:
            return e


def _estimate_memory(*a, **k):
    from effpass.planning.estimate import estimate_memory

    return estimate_memory(*a, **k)


def _counts(est):  # the timeline's categories follow storage addresses, which malloc may reuse differently
    return {k: v for k, v in est.to_dict().items() if k not in ("seconds", "timeline")}


def _compare(pruned, full, budget):
    """Every replayed candidate of ``pruned`` equals its twin in ``full``; every pruned one is above the budget
    in ``full`` too, its floor the replay's own start bytes."""
    by_name = {c.name: c for c in full}
    assert [c.name for c in pruned] == [c.name for c in full]
    n = 0
    for c in pruned:
        f = by_name[c.name]
        assert f.estimate is not None and f.pruned is None
        if c.pruned and not c.restricted or c.pruned and c.floor > budget:
            n += 1
            assert c.estimate is None and c.floor > budget and "not replayed" in c.pruned
            assert c.floor == f.estimate.start_bytes  # the floor is the replay's own start of step
            assert f.peak_bytes >= c.floor and not f.fits
        elif c.pruned:  # restricted, and an unrestricted plan of its tier fits: it cannot be chosen
            n += 1
            assert c.estimate is None and "restricts the training loop" in c.pruned
            assert any(x.fits and not x.restricted and x.lossy == c.lossy for x in pruned)
        else:
            assert _counts(c.estimate) == _counts(f.estimate)
            assert (c.extra_flops, c.fits) == (f.extra_flops, f.fits)
            if c.floor is not None:
                assert c.floor == c.estimate.start_bytes
    return n


def test_pruned_plan_equals_the_whole_table(replays):
    model, inputs, passes = _setup()
    # the floors alone: the fp32 base's start is above the NF4 base's, both above the parameters' eighth
    plans = [(passes, "adamw"), ([passes[0], effpass.make_pass("quantize_linear", {"scheme": "nf4",
                                                                                   "exclude": ["lm_head"]})]
                                 + passes[1:], "adamw")]
    fp32_floor, nf4_floor = start_bytes_many(model, inputs, plans, lowering="eager")
    assert fp32_floor > 2 * nf4_floor > 0

    # a budget just below the fp32 start: the fp32 plans cannot fit (their start alone is above it), NF4 ones do
    budget = fp32_floor - 1
    cache, full_cache, pcalls, fcalls = replays["pruned"], replays["full"], [], []
    plan = _plan(model, inputs, passes, budget, True, cache, pcalls)
    full = _plan(model, inputs, passes, budget, False, full_cache, fcalls)
    assert not isinstance(plan, Exception) and not isinstance(full, Exception)
    assert plan.chosen.name == full.chosen.name and plan.chosen.option("base_weights") is not None
    assert plan.peak_bytes == full.peak_bytes
    # the reason counts the fitting plans replayed (a pruned restricted plan may fit too: it is not counted)
    assert plan.reason.split(" among the ")[0] == full.reason.split(" among the ")[0]
    assert "fitting lossy plans replayed" in plan.reason
    assert _compare(plan.candidates, full.candidates, budget) >= 1
    assert sum(pcalls) < sum(fcalls)  # fewer replays
    assert "not replayed" in plan.table() and any("prune=False" in n for n in plan.notes)
    # the lossy tier: "nf4 base" fits, so "nf4 base + step in backward" (restricted) is not replayed
    assert "restricts the training loop" in next(c.pruned for c in plan.candidates
                                                 if c.name == "nf4 base + step in backward")
    def cells(table):  # the columns are padded to the widest cell, which a pruned row may change
        return {c[0].lstrip("* "): c for c in (re.split(r"\s{2,}", ln.strip()) for ln in table.splitlines()[1:])}

    rows = cells(full.table())
    for name, row in cells(plan.table()).items():  # a replayed candidate's row is the same text
        if not row[2].startswith("not replayed"):
            assert row == rows[name]
    d = plan.to_dict()
    assert any(c["pruned"] and c["peak_bytes"] is None and c["floor_bytes"] > budget for c in d["candidates"])

    # nothing fits (a budget below the NF4 start): the pruned NF4 plans' floors are below the only replayed
    # peak (the plan as given), so they are replayed after all; the smallest peak is the unpruned plan's
    budget = nf4_floor - 1
    err = _plan(model, inputs, passes, budget, True, cache, pcalls)
    ref = _plan(model, inputs, passes, budget, False, full_cache, fcalls)
    assert isinstance(err, MemoryBudgetError) and isinstance(ref, MemoryBudgetError)
    assert (err.smallest, err.plan.name, str(err)) == (ref.smallest, ref.plan.name, str(ref))
    assert _compare(err.candidates, ref.candidates, budget) >= 1
    for c in err.candidates:
        if c.pruned:
            assert c.floor >= err.smallest and "smallest replayed peak" in c.pruned


def test_floor_of_a_bad_pipeline_is_its_error():
    """A pipeline that cannot be built gives its error as its floor, not a number (the planner then replays
    it, and the replay reports the error on its candidate)."""
    model, inputs, _ = _setup()
    bad = [effpass.make_pass("inject_lora", {"rank": 4, "targets": ["*.no_such_module"]})]
    (got,) = start_bytes_many(model, inputs, [(bad, "adamw")], lowering="eager")
    assert isinstance(got, Exception) and "no_such_module" in str(got)


def test_cli_lists_pruned_plans_and_all_replays_them(tmp_path, capsys, monkeypatch, replays):
    """`effpass plan` shows a pruned candidate as not replayed, with its floor; `--all` replays it. The commands
    plan the model, inputs, pipeline and options of ``test_pruned_plan_equals_the_whole_table`` at its first budget
    (the CLI builds the same meta-device Llama and zero tokens) and read its replay caches (``plan_memory(cache=)``):
    the pruned command the pruned plans', `--all` the unpruned plans'. What is checked here is the command line
    (the rows, the floors, what `--all` adds); the figures' equality pruned vs unpruned is that test's oracle."""
    import json

    from effpass.cli import main
    from effpass.planning import planner as planner_mod

    real_plan = planner_mod.plan_memory
    monkeypatch.setattr(planner_mod, "plan_memory", lambda *a, **k: real_plan(
        *a, **k, cache=replays["pruned" if k.get("prune", True) else "full"]))

    model, inputs, passes = _setup()
    (floor,) = start_bytes_many(model, inputs, [(passes, "adamw")], lowering="eager")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CFG))
    args = ["plan", str(path), "--batch", "1", "--seq", "16", "--budget", str(floor - 1), "--allow", "nf4",
            "--passes", json.dumps({"inject_lora": {"rank": 4, "targets": ["*.q_proj", "*.v_proj"]},
                                    "checkpoint_activations": {"policy": "full"}, "fuse_cross_entropy": {}})]
    assert main(args + ["--json"]) == 0
    pruned = json.loads(capsys.readouterr().out)
    assert main(args + ["--json", "--all"]) == 0
    full = json.loads(capsys.readouterr().out)
    assert pruned["chosen"] == full["chosen"] and pruned["peak_bytes"] == full["peak_bytes"]
    by_name = {c["plan"]: c for c in full["candidates"]}
    cut = [c for c in pruned["candidates"] if c["pruned"]]
    assert cut and not any(c["pruned"] for c in full["candidates"])
    for c in cut:  # listed with its floor, no figure; replayed with --all, above the budget
        assert c["peak_bytes"] is None and c["fits"] is False
        assert by_name[c["plan"]]["peak_bytes"] is not None
        if c["floor_bytes"] > floor - 1:
            assert by_name[c["plan"]]["peak_bytes"] >= c["floor_bytes"] and not by_name[c["plan"]]["fits"]
