"""The planner's two-depth screen (issue 23.4, planning speed): a model of identical blocks is replayed at 2
and 3 blocks for every candidate; the figures of a candidate are the affine prediction through them
(``provisional``), and a third depth (4 blocks) is replayed only for the plans the answer rests on (every
fitting plan, the smallest when nothing fits, the plan as given).

Oracles: numerical - every provisional figure equals, count for count, the figure of the same candidate
checked at three depths (``prune=False``), and the answer (chosen plan, or smallest peak and plan) is the
same; structural - the plans the answer rests on are not provisional, the others are marked in the table
and notes, and fewer depth replays run.
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


def _plan(budget, prune, depths):
    model = model_from_config(CFG, "float32")
    tok = torch.zeros(1, 16, dtype=torch.long, device="meta")
    inputs = {"input_ids": tok, "labels": tok, "use_cache": False}
    passes = [effpass.make_pass("inject_lora", {"rank": 4, "targets": ["*.q_proj", "*.v_proj"]}),
              effpass.make_pass("fuse_cross_entropy", {})]
    real = est_mod._replay_depths

    def counting(model, inputs, pipelines, ds, *a, only=None, **k):
        depths.extend(d for d in ds for _ in (only[d] if only and d in only else pipelines))
        return real(model, inputs, pipelines, ds, *a, only=only, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(est_mod, "_replay_depths", counting)
        try:
            return plan_memory(model, inputs, budget, passes=passes, lowering="eager", prune=prune)
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
def full_plans():
    depths: list = []
    return _plan(LOW, False, depths), depths  # below every plan: the whole table, checked at three depths


def test_nothing_fits_names_the_same_smallest_plan_checked(full_plans):
    full, full_depths = full_plans
    assert isinstance(full, MemoryBudgetError)
    depths: list = []
    got = _plan(LOW, True, depths)
    assert isinstance(got, MemoryBudgetError)
    assert (got.smallest, got.plan.name) == (full.smallest, full.plan.name)
    assert not got.plan.estimate.provisional and not got.candidates[0].estimate.provisional
    n_prov = _same_figures(got.candidates, full.candidates)
    assert n_prov >= 1
    assert depths.count(4) < full_depths.count(4)


def test_a_budget_one_plan_fits_chooses_the_same_plan(full_plans):
    full, _ = full_plans
    free = [c for c in full.candidates if c.estimate is not None and not c.restricted]
    budget = min(c.peak_bytes for c in free)  # only the leanest unrestricted plan(s) fit
    want = min((c for c in free if c.peak_bytes <= budget), key=lambda c: c.extra_flops)
    depths: list = []
    got = _plan(budget, True, depths)
    assert got.chosen.name == want.name and got.peak_bytes == want.peak_bytes
    assert all(not c.estimate.provisional for c in got.candidates if c.fits)
    assert not got.candidates[0].estimate.provisional  # the base of extra compute
    assert _same_figures(got.candidates, full.candidates) >= 1
    assert "~" in got.table() and any("marked ~" in n for n in got.notes)
    assert all(c.estimate is None or c.estimate.provisional is False for c in full.candidates)
