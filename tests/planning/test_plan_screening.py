"""The planner's two-depth screen (issue 23.4, planning speed): a model of identical blocks is replayed at 2
and 3 blocks for every candidate; the figures of a candidate are the affine prediction through them
(``provisional``), and a third depth (4 blocks) is replayed only for the plans the answer rests on (every
fitting plan, the smallest when nothing fits, the plan as given).

Oracles: numerical - every provisional figure equals, count for count, the figure of the same candidate
checked at three depths (``prune=False``), and the answer (chosen plan, or smallest peak and plan) is the
same; structural - the plans the answer rests on are not provisional, the others are marked in the table
and notes, and fewer depth replays run.

The three plans share their replays (``cache=``, as the planner's users share them across budgets): the screened
run replays every candidate at two depths; the whole table (``prune=False``) reuses those and completes each
figure at the third depth (the planner checks every figure it reads from a shared cache); the budget run starts
from the screened run's replays. Each replay is deterministic, so sharing changes no figure; what the oracle
compares is the two-depth prediction against the third depth's replay.
"""
import pytest
import torch

import effpass
from effpass.planning import MemoryBudgetError, plan_memory
from effpass.planning import estimate as est_mod
from effpass.planning.cli import model_from_config
from effpass.planning.depth import AFFINE

CFG = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=12, num_attention_heads=4,
           num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, tie_word_embeddings=False)
#: at least the parameters' own bytes, below every plan's peak: nothing fits, every candidate is replayed
LOW = sum(p.numel() * 4 for p in model_from_config(CFG, "float32").parameters())


def _plan(budget, prune, depths, cache):
    model = model_from_config(CFG, "float32")
    tok = torch.zeros(1, 16, dtype=torch.long, device="meta")
    inputs = {"input_ids": tok, "labels": tok, "use_cache": False}
    passes = [effpass.make_pass("inject_lora", {"rank": 4, "targets": ["*.q_proj", "*.v_proj"]}),
              effpass.make_pass("fuse_cross_entropy", {})]
    real = est_mod._depth_units

    def counting(model, pipelines, units, *a, **k):  # every depth replay goes through here: (inputs, indices, depth)
        depths.extend(d for _, idx, d in units for _ in idx)
        return real(model, pipelines, units, *a, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(est_mod, "_depth_units", counting)
        try:
            return plan_memory(model, inputs, budget, passes=passes, lowering="eager", prune=prune, cache=cache)
        except MemoryBudgetError as e:
            return e


def _same_figures(screened, full):
    by_name = {c.name: c for c in full}
    n = 0
    for c in screened:
        if c.estimate is None:
            continue
        f = by_name[c.name].estimate
        assert f is not None and not f.provisional
        for k in AFFINE:
            assert getattr(c.estimate, k) == getattr(f, k), (c.name, k)
        n += c.estimate.provisional
    return n


@pytest.fixture(scope="module")
def plans():
    """The screened plan below every peak, then the whole table on its replays; and a copy of the screened
    replays for a budget run."""
    cache: dict = {}
    depths: list = []
    screened = _plan(LOW, True, depths, cache)  # nothing fits: every candidate replayed at two depths
    after_screen = dict(cache)
    full_depths: list = []
    full = _plan(LOW, False, full_depths, cache)  # below every plan: the whole table, checked at three depths
    return screened, depths, full, full_depths, after_screen


def test_nothing_fits_names_the_same_smallest_plan_checked(plans):
    got, depths, full, full_depths, _ = plans
    assert isinstance(full, MemoryBudgetError) and isinstance(got, MemoryBudgetError)
    assert (got.smallest, got.plan.name) == (full.smallest, full.plan.name)
    assert not got.plan.estimate.provisional and not got.candidates[0].estimate.provisional
    n_prov = _same_figures(got.candidates, full.candidates)
    assert n_prov >= 1
    # the whole table replays the third depth of every figure the screen left provisional, and only those
    replayed = [c for c in full.candidates if c.estimate is not None]
    assert full_depths.count(4) == n_prov and set(full_depths) == {4}, (full_depths, n_prov)
    assert depths.count(4) + full_depths.count(4) >= len({c.replay_key() for c in replayed}) > depths.count(4)


def test_a_budget_one_plan_fits_chooses_the_same_plan(plans):
    _, _, full, _, after_screen = plans
    free = [c for c in full.candidates if c.estimate is not None and not c.restricted]
    budget = min(c.peak_bytes for c in free)  # only the leanest unrestricted plan(s) fit
    want = min((c for c in free if c.peak_bytes <= budget), key=lambda c: c.extra_flops)
    depths: list = []
    got = _plan(budget, True, depths, dict(after_screen))
    assert got.chosen.name == want.name and got.peak_bytes == want.peak_bytes
    assert all(not c.estimate.provisional for c in got.candidates if c.fits)
    assert not got.candidates[0].estimate.provisional  # the base of extra compute
    assert _same_figures(got.candidates, full.candidates) >= 1
    assert "~" in got.table() and any("marked ~" in n for n in got.notes)
    assert all(c.estimate is None or c.estimate.provisional is False for c in full.candidates)
