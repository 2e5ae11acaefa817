"""The planner's long-sequence candidates and ``effpass plan --max-seq`` (issue 25.5).

Oracles: the registry's declarations reaching the candidate list (structural: which plans are formed, with
and without ``allow``, per optimizer and device); the planner's own replays bracketing its answer (the
answer fits, the answer plus one step does not, checked by an independent ``estimate_memory``); a measured
training step for step_in_backward's start bytes and peak (numerical).
"""
import json

import pytest
import torch

import effpass
from effpass.memory_options import declared_memory_options
from effpass.passes import CheckpointActivations, FuseCrossEntropy, StepInBackward, TileSequence
from effpass.planning import MemoryBudgetError, estimate_many, estimate_memory, plan_max_seq
from effpass.planning.measure import measure_step
from effpass.planning.candidates import candidate_tiers, usable_options
from effpass.testing import model_case

TINY = {"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 96,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "max_position_embeddings": 4096, "dtype": "float32"}


def _names(model, allow=(), optimizer="adamw", device="cpu", base=()):
    notes = []
    groups = usable_options(model, set(base), tuple(allow), optimizer, 1, notes, device=device)
    lossless, lossy = candidate_tiers(groups, optimizer)
    return {c.name for c in lossless}, {c.name for c in lossy}, notes


def test_long_sequence_techniques_are_candidates():
    model = model_case("llama", seq=16).model
    lossless, lossy, _ = _names(model)
    assert "checkpoint(full) + fuse_cross_entropy + step in backward + tiles(4096)" in lossless
    assert any("tiles(4096)" in n for n in lossless) and any("step in backward" in n for n in lossless)
    assert not lossy  # lossy ones only when allowed
    assert not any("compress" in n or "offload" in n for n in lossless)  # offload: CUDA plans only
    _, lossy, _ = _names(model, allow=["compress_activations"])
    assert lossy and all("compress(int8)" in n for n in lossy)
    cuda, _, _ = _names(model, device="cuda")
    assert any("offload" in n for n in cuda)
    # step_in_backward needs an optimizer it can step; never combined with a replaced optimizer
    none, _, notes = _names(model, optimizer=None)
    assert not any("step in backward" in n for n in none)
    assert any("step_in_backward" in n and "not tried" in n for n in notes)
    _, lossy8, _ = _names(model, allow=["adamw8bit"])
    assert lossy8 and not any("step in backward" in n for n in lossy8)


def test_step_in_backward_declares_its_restriction():
    (o,) = [o for o in declared_memory_options(None) if o.technique == "step_in_backward"]
    assert o.lossless and o.restricts and "adamw" in o.optimizers and o.phase == "module"
    assert [o.options for o in declared_memory_options(None) if o.technique == "tile_sequence"] == [
        {"tile_rows": 4096}, {"tile_rows": 1024}]


@pytest.mark.parametrize("rows,labels", [(None, ["tiles(4096)"]), (1024, []), (4096, ["tiles(1024)"]),
                                         (8192, ["tiles(4096)", "tiles(1024)"]),
                                         (16384, ["tiles(4096)", "tiles(1024)"]), (16385, ["tiles(4096)"])])
def test_tile_options_by_batch_rows(rows, labels):
    """Small tiles only on short batches (min_rows / max_rows), never in a length search (rows unknown)."""
    model = model_case("llama", seq=16).model
    groups = usable_options(model, set(), (), "adamw", 1, [], device="cpu", rows=rows)
    assert [o.label for o in groups.get("sequence_tiling", [])] == labels


@pytest.mark.parametrize("tiles", [False, True], ids=["ckpt", "ckpt_tiles"])
def test_step_in_backward_predicted_as_measured(tiles):
    """The replay creates AdamW's states and steps each parameter inside the backward as the real step does
    (before: states never created, 36% of the start missing); also with tiles, the planner's long-sequence plan."""
    case = model_case("llama", seq=64)
    passes = lambda: [CheckpointActivations(policy="full"), *([TileSequence(tile_rows=32)] if tiles else []),  # noqa: E731
                      StepInBackward()]
    est = estimate_memory(case.model, case.inputs, passes=passes(), lowering="eager")
    model = case.make()
    compiled = effpass.compile(model, passes=passes(), lowering="eager")
    m = measure_step(compiled, model, case.inputs)
    trainable = sum(p.numel() * p.element_size() for p in model.parameters())
    assert est.optimizer_states >= 2 * trainable  # AdamW's two states per parameter exist in the replay
    assert est.start_bytes == m.start_bytes
    assert est.peak_bytes == pytest.approx(m.peak_bytes, rel=0.01)
    assert effpass.report(compiled).stats("step_in_backward"), "no step inside the backward"
    if tiles:
        assert effpass.report(compiled).stats("tile_sequence")["tiles"] >= 4


def _est(peak, flops=0):
    """An analytic estimate. NOTE(bounds): every byte of its peak counted as gradients, so no plan is bounded by
    another's gradient-free peak (planning/bounds.py); the fakes below make plans differ in other ways."""
    from effpass.planning import MemoryEstimate

    return MemoryEstimate(peak_bytes=int(peak), start_bytes=0, step_peak_bytes=int(peak), parameters=0,
                          trainable_parameters=0, buffers=0, inputs=0, gradients=int(peak), optimizer_states=0,
                          activations=0, largest_transient=0, largest_transient_op="-", peak_phase="backward",
                          peak_graph="-", peak_node="-", flops=flops)


@pytest.fixture
def analytic(monkeypatch):
    """The planner's replays replaced by an analytic peak per plan, a function of (plan's passes, seq): the
    search logic (fit, bracket, choice, errors) tested without replay time. Records every replayed seq."""
    import effpass.planning.maxseq as maxseq

    calls = []

    def fake_many(model, inputs, pipelines, optimizer, **kw):
        seq = next(v for v in inputs.values() if isinstance(v, torch.Tensor)).shape[-1]
        out = []
        for pipe in pipelines:
            names = {p.name for p in pipe}
            calls.append((seq, tuple(sorted(names))))
            per_token = 1000 - 300 * ("tile_sequence" in names) - 200 * ("checkpoint_activations" in names)
            quad = 0.0 if "fuse_attention" in names else 0.01  # "eager attention": scores grow with seq^2
            start = 1_000_000 - 100_000 * ("step_in_backward" in names)
            out.append(_est(start + per_token * seq + quad * seq * seq, flops=seq * (1 + len(names))))
        return out

    monkeypatch.setattr(maxseq, "estimate_many", fake_many)
    return calls


def _inputs(seq):
    ids = torch.zeros(1, seq, dtype=torch.long)
    return {"input_ids": ids, "labels": ids}


def _peak(seq, per_token, quad=0.01, start=900_000):
    return start + per_token * seq + quad * seq * seq


def test_max_seq_search_brackets_the_answer(analytic):
    model = model_case("llama", seq=16).model
    budget = 5_000_000
    res = plan_max_seq(model, _inputs, budget, passes=[], step=64, probes=(512, 1024, 2048))
    # the leanest neighbourhood plan: every lossless option (per token 500, start 900,000), quadratic term kept
    assert {"tile_sequence", "checkpoint_activations", "step_in_backward"} <= {p.name for p in res.plan.passes}
    want = max(s for s in range(64, 1 << 16, 64) if _peak(s, 500) <= budget)
    assert res.seq == want  # the quadratic fit through three probes is exact here
    assert res.plan.peak_bytes <= budget < res.next_peak
    answer_replays = [s for s, *_ in res.replays]
    assert res.seq in answer_replays and res.seq + 64 in answer_replays and len(answer_replays) <= 4
    # every candidate was probed at the three lengths, the answer then replayed for the chosen plan only
    assert {s for s, _ in analytic[:len(res.fits) * 3]} == {512, 1024, 2048}
    assert "step in backward" in res.plan.chosen.name and any("no gradient accumulation" in n for n in
                                                              res.plan.notes + res.notes)


def test_max_seq_prefers_unrestricted_on_a_tie(analytic, monkeypatch):
    """A plan restricting the training loop is chosen only when it fits a longer sequence."""
    import effpass.planning.maxseq as maxseq

    real = maxseq.estimate_many

    def no_gain(model, inputs, pipelines, optimizer, **kw):  # step_in_backward saves nothing here
        return [_est(e.peak_bytes + 100_000 * ("step_in_backward" in {p.name for p in pipe}), e.flops)
                for e, pipe in zip(real(model, inputs, pipelines, optimizer, **kw), pipelines)]

    monkeypatch.setattr(maxseq, "estimate_many", no_gain)
    res = plan_max_seq(model_case("llama", seq=16).model, _inputs, 5_000_000, passes=[], step=64,
                       probes=(512, 1024, 2048))
    assert "step in backward" not in res.plan.chosen.name and not res.plan.chosen.restricted


def test_max_seq_nothing_fits_analytic(analytic):
    with pytest.raises(MemoryBudgetError, match="even at 64 tokens") as e:
        plan_max_seq(model_case("llama", seq=16).model, _inputs, 900_000, passes=[], step=64, probes=(512, 1024))
    assert e.value.smallest > 900_000 and e.value.plan is not None


def test_max_seq_lossy_only_when_allowed(analytic):
    model = model_case("llama", seq=16).model
    res = plan_max_seq(model, _inputs, 5_000_000, passes=[], step=64, probes=(512, 1024, 2048))
    assert not any("compress" in n for n, *_ in res.fits)
    res = plan_max_seq(model, _inputs, 5_000_000, passes=[], step=64, probes=(512, 1024, 2048),
                       allow=["compress_activations"])
    assert any("compress" in n for n, *_ in res.fits)
    assert not res.plan.chosen.lossy  # the analytic peak gains nothing from it: lossless kept


def test_cli_max_seq(tmp_path, capsys, analytic):
    from effpass.cli import main

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    rc = main(["plan", str(cfg), "--batch", "1", "--budget", "5000000", "--max-seq", "--step", "64", "--probes",
               "512", "1024", "2048"])
    out = capsys.readouterr().out
    assert rc in (0, None)
    assert "longest sequence that fits" in out and "predictions, not measurements" in out
    assert f"{max(s for s in range(64, 1 << 16, 64) if _peak(s, 500) <= 5_000_000):,} tokens" in out
    rc = main(["plan", str(cfg), "--batch", "1", "--budget", "5000000", "--max-seq", "--step", "64", "--probes",
               "512", "1024", "--json"])
    d = json.loads(capsys.readouterr().out)
    assert d["plan"]["peak_bytes"] <= d["budget"] < d["next_peak"]
    assert main(["plan", str(cfg), "--batch", "1", "--budget", "800000", "--max-seq", "--step", "64"]) == 2
    assert "even at 64 tokens" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--seq is required"):
        main(["plan", str(cfg), "--batch", "1", "--budget", "2MiB"])


def test_max_seq_answer_fits_by_real_replays():
    """Real replays (tiny Llama, one plan: the pipeline leaves nothing to add without an optimizer): the
    answer's peak fits, one step more does not, and an independent replay at the answer + step agrees."""
    case = model_case("llama", seq=16, layers=1)
    passes = [CheckpointActivations(policy="full"), FuseCrossEntropy(), TileSequence()]  # tiles: none below 8k
    budget = 1_400_000
    res = plan_max_seq(case.model, _inputs, budget, passes=passes, optimizer=None, step=64, probes=(256, 512),
                       max_len=4096, lowering="eager")
    assert [n for n, *_ in res.fits] == ["as given"]
    assert res.seq >= 64 and res.plan.peak_bytes <= budget < res.next_peak
    nxt = estimate_memory(case.model, _inputs(res.seq + 64), passes=passes, optimizer=None, lowering="eager")
    assert nxt.peak_bytes == res.next_peak


def _two_plans(monkeypatch, est_of):
    """The replays of two plans (as given; + step_in_backward) replaced by ``est_of(seq, sib)``; records every
    (seq, sib) replayed."""
    import effpass.planning.maxseq as maxseq

    calls = []

    def fake_many(model, inputs, pipelines, optimizer, **kw):
        seq = next(v for v in inputs.values() if isinstance(v, torch.Tensor)).shape[-1]
        sibs = ["step_in_backward" in {p.name for p in pipe} for pipe in pipelines]
        calls.extend((seq, sib) for sib in sibs)
        return [est_of(seq, sib) for sib in sibs]

    monkeypatch.setattr(maxseq, "estimate_many", fake_many)
    return calls


def _kinked(monkeypatch, kink=4096):
    """Two plans (as given; + step_in_backward) whose peaks the probes misjudge: the plan as given is linear up to
    ``kink`` tokens and steeper after it (its fit, through probes below the kink, promises more); the other is
    linear and steeper at the probes but wins past the kink. Records every (seq, plan) replayed."""
    return _two_plans(monkeypatch, lambda seq, sib: _est(int(
        900_000 + 600 * seq if sib else 1_000_000 + 500 * seq + 2000 * max(0, seq - kink)), flops=seq))


_KINK_PASSES = [CheckpointActivations(policy="full"), FuseCrossEntropy(), TileSequence()]


def test_max_seq_searches_every_candidate_at_each_length(monkeypatch):
    """The fits choose only where to look: the plan as given is fitted longer (linear through the probes) but
    fits less past a kink; the answer is the longest length some plan fits, by replays of every plan still in
    the running (the search once replayed only the best-fitted plan, and answered its length). Oracles: the
    answer equals the analytic maximum over both plans; both plans were replayed at a searched length; the
    bracket holds (the chosen fits at the answer, nothing replayed fits one step more)."""
    calls = _kinked(monkeypatch)
    budget = 5_000_000
    res = plan_max_seq(model_case("llama", seq=16).model, _inputs, budget, passes=_KINK_PASSES, step=64,
                       probes=(1024, 2048))
    fitted = {n: L for n, _, _, L, _ in res.fits}
    assert fitted["as given"] > fitted["step in backward"]  # the fits misjudge (the oracle can fail)

    def true_max(sib):
        return max(s for s in range(64, 1 << 16, 64) if (900_000 + 600 * s if sib else
                                                          1_000_000 + 500 * s + 2000 * max(0, s - 4096)) <= budget)

    assert true_max(True) > true_max(False)
    assert res.seq == true_max(True) and "step in backward" in res.plan.chosen.name
    assert res.plan.peak_bytes <= budget < res.next_peak
    searched = {s for s, _ in calls if s not in (1024, 2048)}
    assert any((s, False) in calls and (s, True) in calls for s in searched)


def _peak_kinked(seq, kink=4096):
    return 1_000_000 + 500 * seq + 2000 * max(0, seq - kink)


def _gradient_split(monkeypatch, grads=200_000, extra=1_000):
    """Two plans (as given; + step_in_backward) whose replays carry the split of the peak into gradients and the
    rest: step_in_backward's peak is the plan as given's less its ``grads`` gradient bytes plus ``extra`` (the
    optimizer's work inside the backward; negative: a plan that breaks the bound's premise); both steeper past a
    kink beyond the probes, so the search starts where both are over. Records every (seq, plan) replayed."""
    import dataclasses

    def est_of(seq, sib):
        peak = _peak_kinked(seq)
        e = _est(peak - grads + extra if sib else peak, flops=seq)
        return dataclasses.replace(e, start_bytes=400_000, step_peak_bytes=e.peak_bytes - 400_000, gradients=grads,
                                   non_gradient_peak=peak - grads - 400_000)

    return _two_plans(monkeypatch, est_of)


def _unbounded(monkeypatch):
    import effpass.planning.maxseq as maxseq

    monkeypatch.setattr(maxseq, "gradient_only_bound", lambda c, replayed: None)
    monkeypatch.setattr(maxseq, "probe_skip", lambda c, probed, step: None)


def _same_answer(res, ref):
    """The same length and plan; the next peak the replay's, or a lower bound of it said so."""
    assert (res.seq, res.plan.chosen.name) == (ref.seq, ref.plan.chosen.name)
    assert res.next_peak == ref.next_peak or (res.next_peak_bound and ref.plan.budget < res.next_peak < ref.next_peak)


def _sib_at(calls):
    return {s for s, sib in calls if sib}


@pytest.mark.parametrize("budget,grads", [(5_000_000, 200_000), (5_000_000, 20_000)],
                         ids=["step_in_backward_answers", "as_given_answers"])
def test_a_plan_over_the_budget_by_its_gradient_free_bound_is_not_replayed(monkeypatch, budget, grads):
    """step_in_backward changes only gradients (``MemoryOption.changes``): where the plan as given's peak less
    its gradients is over the budget, step_in_backward's is too, and it is not replayed there (Llama-3.1-8B QLoRA:
    its 6 replays at the answer's next length). Either plan answering (with 20,000 B of gradients both fit the
    same length and the plan as given is chosen: step_in_backward's next length is bounded again from the plan as
    given's confirmed figure). Oracles: the answer equals the search's without bounds (the next peak a replay's,
    or a lower bound of it said so); step_in_backward replayed at fewer lengths, never where its bound is over
    the budget; the note names the bound."""
    kw = dict(passes=_KINK_PASSES, step=64, probes=(1024, 2048))
    calls = _gradient_split(monkeypatch, grads=grads)
    res = plan_max_seq(model_case("llama", seq=16).model, _inputs, budget, **kw)
    with_bound = list(calls)
    if grads == 200_000:  # nothing fits: the smallest peak is named, step_in_backward's, not one skipped by its bound
        with pytest.raises(MemoryBudgetError, match="even at 64 tokens") as e:
            plan_max_seq(model_case("llama", seq=16).model, _inputs, 800_000, **kw)
        assert (e.value.smallest, e.value.plan.name) == (_peak_kinked(64) - grads + 1_000, "step in backward")
    calls.clear()
    _unbounded(monkeypatch)
    ref = plan_max_seq(model_case("llama", seq=16).model, _inputs, budget, **kw)
    _same_answer(res, ref)
    sib_answers = max(s for s in range(64, 1 << 16, 64) if _peak_kinked(s) - grads + 1_000 <= budget)
    as_given = max(s for s in range(64, 1 << 16, 64) if _peak_kinked(s) <= budget)
    assert res.seq == max(sib_answers, as_given)
    assert ("step in backward" in res.plan.chosen.name) == (sib_answers > as_given) == (grads == 200_000)
    assert _sib_at(with_bound) < _sib_at(calls)  # the oracle can fail: without the bound they are replayed
    assert all(_peak_kinked(s) - grads <= budget or (s, False) not in with_bound  # replayed: no bound there
               for s in _sib_at(with_bound) if s not in (1024, 2048))
    assert any("not replayed" in n and "peaks at least" in n for n in res.notes)


def test_a_bound_above_a_replayed_peak_turns_the_bounds_off(monkeypatch):
    """A plan that breaks the premise (step_in_backward saving more than the gradients): the self-check meets its
    replayed peak below its bound where both plans are replayed, and the search runs again without bounds.
    Oracles: the answer equals the search's without bounds; the note says why."""
    kw = dict(passes=_KINK_PASSES, step=64, probes=(1024, 2048))
    _gradient_split(monkeypatch, grads=200_000, extra=-50_000)
    res = plan_max_seq(model_case("llama", seq=16).model, _inputs, 5_000_000, **kw)
    _unbounded(monkeypatch)
    ref = plan_max_seq(model_case("llama", seq=16).model, _inputs, 5_000_000, **kw)
    _same_answer(res, ref)
    assert res.next_peak == ref.next_peak and any("searched again without bounds" in n for n in res.notes)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_step_in_backward_peaks_at_least_at_the_gradient_free_peak(lora):
    """The premise of the bound (planning/bounds.py), on real replays: step_in_backward's peak is at least the
    plan without it's start plus non-gradient peak; full fine-tuning (gradients as large as the weights) and LoRA
    with tiles (the Llama-3.1-8B QLoRA pipeline's shape). Oracles: the inequality (numerical), the bound the
    search reads from the candidates (structural), the bound within the gradients of the peak (usable)."""
    from effpass.memory_options import declared_memory_options
    from effpass.passes import InjectLoRA
    from effpass.planning.bounds import gradient_only_bound
    from effpass.planning.candidates import Candidate

    case = model_case("llama", seq=64)
    base = lambda: [CheckpointActivations(policy="full"), FuseCrossEntropy(),  # noqa: E731
                    *([TileSequence(tile_rows=32), InjectLoRA(rank=4, targets=["*.q_proj", "*.down_proj"])]
                      if lora else [])]
    est = estimate_memory(case.model, case.inputs, passes=base(), lowering="eager")
    sib = estimate_memory(case.model, case.inputs, passes=[*base(), StepInBackward()], lowering="eager")
    free_peak = est.start_bytes + est.non_gradient_peak  # the most the forward and backward hold besides gradients
    less_grads = est.peak_bytes - est.gradients if est.peak_phase in ("forward", "backward") else 0
    assert free_peak <= sib.peak_bytes and less_grads <= sib.peak_bytes <= est.peak_bytes  # the bound holds
    bound = max(free_peak, less_grads)
    assert est.start_bytes < bound and est.peak_bytes - bound <= est.gradients  # within the gradients: usable
    assert sib.peak_bytes < est.peak_bytes or lora  # LoRA's gradients are not live at its peak: nothing saved
    (o,) = [o for o in declared_memory_options(None) if o.technique == "step_in_backward"]
    got = gradient_only_bound(Candidate(options=(o,)), [(Candidate(), est)])
    assert got is not None and got.device_peak_bytes == bound and got.base == "as given"


def test_a_plan_that_saves_less_than_a_step_of_gradients_is_not_probed(monkeypatch):
    """Where step_in_backward saves fewer gradient bytes than one step of length adds (LoRA), its probes could
    move the search's start by a step at most: it is not probed, and replayed where the search needs it; here it
    fits one step more than the plan as given (30,000 B of gradients past the kink). Oracles: the answer, plan
    and next peak equal the search's without bounds or skips; no probe replay of it (with 200,000 B it is probed:
    the test above); replayed in the search; its row says why."""
    kw = dict(passes=_KINK_PASSES, step=64, probes=(1024, 2048))
    budget = _peak_kinked(4928) - 29_000  # step_in_backward fits 4,928 tokens, the plan as given 4,864
    calls = _gradient_split(monkeypatch, grads=30_000)
    res = plan_max_seq(model_case("llama", seq=16).model, _inputs, budget, **kw)
    assert not any(sib for s, sib in calls if s in (1024, 2048)) and 4928 in _sib_at(calls)
    (row,) = [r for r in res.fits if r[0] == "step in backward"]
    assert row[3] is None and "not probed" in row[4][0]
    assert [c["unfitted"] for c in res.to_dict()["candidates"] if c["plan"] == "step in backward"] == [row[4][0]]
    _unbounded(monkeypatch)
    ref = plan_max_seq(model_case("llama", seq=16).model, _inputs, budget, **kw)
    _same_answer(res, ref)
    assert (res.seq, res.plan.chosen.name, res.next_peak) == (4928, "step in backward", ref.next_peak)


def test_max_seq_nothing_fits_names_the_same_smallest_for_every_budget(monkeypatch):
    """When nothing fits even at one step, the error names the smallest peak any plan reaches there, whatever
    the budget (the search once named the best-fitted plan's peak, which depended on the budget: 61.79 GiB at 24
    GiB against 48.07 GiB at 48 GiB for Llama-3.1-8B)."""
    _kinked(monkeypatch)
    smallest = []
    for budget in (800_000, 900_000, 938_000):  # below both plans' peaks at 64 tokens (938,400 and 1,032,000)
        with pytest.raises(MemoryBudgetError, match="even at 64 tokens") as e:
            plan_max_seq(model_case("llama", seq=16).model, _inputs, budget, passes=_KINK_PASSES, step=64,
                         probes=(1024, 2048))
        smallest.append((e.value.smallest, e.value.plan.name))
    assert smallest == [(900_000 + 600 * 64, "step in backward")] * 3


@pytest.mark.slow  # ~60-70 CPU-s: two searches with 12 replays of 2-4 blocks, two for the budget
def test_max_seq_screened_answer_equals_the_unscreened_one(monkeypatch):
    """Depth extrapolation (a 5-block Llama, ``extrapolate=True``): with ``screen`` (the default) the probes and
    the search use two-depth figures and only the answering pair is confirmed at the third depth; the answer,
    its peak and the peak one step more equal the unscreened search's (every figure from three depths), and
    both figures are confirmed ones. The unscreened search reuses the screened replays, completing each figure it
    reads at the third depth (as the screened search does when a confirmed figure changes its verdict).
    The probes (512 and 1280 tokens) bracket the answer: the search reads a screened figure on each side of it
    (512 fits, 1280 does not) and replays only 896 and 1024 between (probes 256 and 512 cost two replays more:
    a screened one at 1408 and a third confirmation, for screened figures on each side as well)."""
    import effpass.planning.maxseq as maxseq

    case = model_case("llama", seq=16, layers=5)
    passes = [CheckpointActivations(policy="full"), FuseCrossEntropy(), TileSequence()]
    kw = dict(passes=passes, optimizer=None, step=128, probes=(512, 1280), max_len=2048, lowering="eager",
              extrapolate=True)
    # the budget: between the peaks at 896 and 1024 tokens; a screened figure (two depths) places it as well
    (at_1000,) = estimate_many(case.model, _inputs(1000), [passes], None, lowering="eager", extrapolate=True,
                               screen=True)
    budget = at_1000.peak_bytes
    screens, confirmed = [], []
    real_many, real_confirm = maxseq.estimate_many, maxseq.confirm_many

    def spy_many(model, inputs, pipelines, optimizer, **k):
        screens.append(k.get("screen"))
        return real_many(model, inputs, pipelines, optimizer, **k)

    def spy_confirm(model, inputs, *a, **k):
        confirmed.append(inputs["input_ids"].shape[-1])
        return real_confirm(model, inputs, *a, **k)

    monkeypatch.setattr(maxseq, "estimate_many", spy_many)
    monkeypatch.setattr(maxseq, "confirm_many", spy_confirm)
    cache: dict = {}
    res = plan_max_seq(case.model, _inputs, budget, cache=cache, **kw)
    assert set(screens) == {True} and sorted(confirmed) == [res.seq, res.seq + kw["step"]], (screens, confirmed)
    assert not res.plan.chosen.estimate.provisional and res.plan.chosen.estimate.depths == [2, 3, 4]
    provisional = sorted(s for (s, _), e in cache.items() if e.provisional)
    assert provisional and res.seq not in provisional and res.seq + kw["step"] not in provisional, provisional
    screens.clear(), confirmed.clear()
    # unscreened, on the same replays: every figure the search reads is completed at the third depth first
    full = plan_max_seq(case.model, _inputs, budget, screen=False, cache=cache, **kw)
    assert set(screens) <= {False} and sorted(confirmed) == provisional, (screens, confirmed, provisional)
    assert not any(e.provisional for e in cache.values())
    assert (res.seq, res.plan.peak_bytes, res.next_peak) == (full.seq, full.plan.peak_bytes, full.next_peak)
    assert res.seq == 896 and res.plan.peak_bytes <= budget < res.next_peak
    peaks = {s: e.peak_bytes for (s, _), e in cache.items()}
    assert provisional == [512, 1280] and peaks[512] <= budget < peaks[1280], (provisional, peaks)
