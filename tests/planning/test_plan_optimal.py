"""The planner finds its own best plan (issue 39.4): on a long-sequence shape of the bench model (scaled down),
every pipeline the declared options can form is replayed on its own (``estimate_memory``: no shared capture,
no pruning, no screening), and the planner's answers equal the best of them: the smallest achievable peak and
its plan when nothing fits, and, at a budget only the leanest plans meet, the fitting plan with the least extra
compute.

Oracles: numerical - the planner's peaks equal the lone replays' to the byte; structural - the candidates the
planner lists are exactly the pipelines the options form (none missing, none extra)."""
import itertools

import pytest
import torch

import effpass
from effpass.planning import MemoryBudgetError, estimate_memory, plan_memory
from effpass.planning.candidates import Candidate, _conflict, pipeline_with, usable_options
from effpass.planning.cli import model_from_config

#: the bench model of docs/long_sequence.md (hidden 512, 4 layers, vocabulary 32,000, 8,192 tokens), scaled down;
#: one block: the options form the same 12 pipelines at 1 and 2 blocks (a replay's cost is its trace, ~0.6x at 1), and
#: the shared capture's byte equality with lone replays on 2 blocks is test_memory_planner.py's
#: test_shared_replays_equal_separate_replays
CFG = dict(model_type="llama", hidden_size=128, intermediate_size=352, num_hidden_layers=1, num_attention_heads=4,
           num_key_value_heads=1, vocab_size=4096, max_position_embeddings=4096, tie_word_embeddings=False)
SEQ = 2048


def _setup():
    model = model_from_config(CFG, "float32")
    tok = torch.zeros(1, SEQ, dtype=torch.long, device="meta")
    return model, {"input_ids": tok, "labels": tok, "use_cache": False}


def _every_pipeline(model):
    """Every combination of at most one declared option per group (no conflicts), formed here, not by the
    planner's own candidate generator."""
    groups = usable_options(model, {p.name for p in effpass.default_pipeline("cpu", torch.float32)}, (), "adamw",
                            1, [], device="cpu", rows=SEQ)
    keys = sorted(groups)
    out = []
    for combo in itertools.product(*[[None] + groups[k] for k in keys]):
        opts = tuple(o for o in combo if o is not None)
        if not _conflict(opts) and all(o.lossless for o in opts):
            out.append(Candidate(options=opts, optimizer="adamw"))
    return out


@pytest.fixture(scope="module")
def lone_replays():
    model, inputs = _setup()
    base = list(effpass.default_pipeline("cpu", torch.float32))
    out = {}
    for c in _every_pipeline(model):
        est = estimate_memory(model, inputs, pipeline_with(base, c), "adamw", lowering="eager", extrapolate=False)
        out[c.name] = (est.peak_bytes, est.flops, c.restricted)
    return out


def test_the_planner_answers_with_the_best_pipeline_the_options_form(lone_replays):
    model, inputs = _setup()
    assert len(lone_replays) >= 6, lone_replays  # checkpoint x tiles at least: a search worth the name
    cache: dict = {}
    floor = sum(p.numel() * 4 for p in model.parameters())
    # nothing fits: the smallest achievable peak and its plan, as the lone replays say
    with pytest.raises(MemoryBudgetError) as e:
        plan_memory(model, inputs, floor + 1, lowering="eager", cache=cache, prune=False)
    err = e.value
    assert {c.name for c in err.candidates} == set(lone_replays)  # the same pipelines, none missing or extra
    for c in err.candidates:
        assert c.peak_bytes == lone_replays[c.name][0], c.name
    best = min(lone_replays, key=lambda n: lone_replays[n][0])
    assert err.smallest == lone_replays[best][0] == lone_replays[err.plan.name][0]
    # a budget only the leanest plans meet: the planner (pruned, as users run it) picks the fitting plan with the
    # least compute
    budget = sorted(p for p, *_ in lone_replays.values())[1]
    plan = plan_memory(model, inputs, budget, lowering="eager", cache=cache)
    fitting = [n for n, (p, *_) in lone_replays.items() if p <= budget]
    # unrestricted plans first (a plan that restricts the training loop only when nothing else fits), then compute
    want = min(fitting, key=lambda n: (lone_replays[n][2], lone_replays[n][1]))
    assert plan.chosen.name == want and plan.peak_bytes == lone_replays[want][0], (plan.table(), lone_replays)
    # the leanest plan is well below the pipeline as given (the long-sequence techniques earn their place)
    assert lone_replays[best][0] < 0.8 * lone_replays["as given"][0], lone_replays
