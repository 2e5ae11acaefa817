"""The planner finds its own best plan (issue 39.4): on a long-sequence shape of the bench model (scaled down),
every pipeline the declared options can form is replayed on its own (``estimate_memory``: no shared capture,
no pruning, no screening), and the planner's answers equal the best of them: the smallest achievable peak and
its plan when nothing fits, and, at a budget only the leanest plans meet, the fitting plan with the least extra
compute.

Oracles: numerical - the planner's peaks equal the lone replays' to the byte; structural - the candidates the
planner lists are exactly the pipelines the options form (none missing, none extra). The same lone replays are the
"alone" side of the shared-capture test (every count of a shared replay equals the replay alone)."""
import itertools

import pytest
import torch

import effpass
from effpass.planning import MemoryBudgetError, estimate_memory, plan_memory
from effpass.planning.candidates import Candidate, _conflict, pipeline_with, usable_options
from effpass.planning.cli import model_from_config

#: the bench model of docs/long_sequence.md (hidden 512, 4 layers, vocabulary 32,000, 8,192 tokens), scaled down;
#: one block: the options form the same 12 pipelines at 1 and 2 blocks (a replay's cost is its trace, ~0.6x at 1); the
#: shared capture's byte equality with lone replays (every count, not only the peak) is this module's
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


def _counting(mp, copies, traces):
    """Count the replay's fake copies of the model and its joint (AOTAutograd) traces into ``copies`` and ``traces``."""
    from torch._functorch._aot_autograd import graph_compile

    from effpass.planning import replay

    real_fake_model, real_trace = replay._fake_model, graph_compile.aot_dispatch_autograd_graph
    mp.setattr(replay, "_fake_model", lambda *a: copies.append(1) or real_fake_model(*a))
    mp.setattr(graph_compile, "aot_dispatch_autograd_graph", lambda *a, **k: traces.append(1) or real_trace(*a, **k))


@pytest.fixture(scope="module")
def lone():
    """Each pipeline the options form, replayed alone: name -> (its estimate, its fake copies, its joint traces).
    Shared by this module's two tests (they run on one xdist worker, tests/conftest.py)."""
    model, inputs = _setup()
    base = list(effpass.default_pipeline("cpu", torch.float32))
    out = {}
    for c in _every_pipeline(model):
        copies, traces = [], []
        with pytest.MonkeyPatch.context() as mp:
            _counting(mp, copies, traces)
            est = estimate_memory(model, inputs, pipeline_with(base, c), "adamw", lowering="eager", extrapolate=False)
        out[c.name] = (est, len(copies), len(traces))
    return out


@pytest.fixture(scope="module")
def lone_replays(lone):
    """name -> (peak bytes, FLOPs, restricted) of each lone replay."""
    restricted = {c.name: c.restricted for c in _every_pipeline(_setup()[0])}
    return {n: (est.peak_bytes, est.flops, restricted[n]) for n, (est, _, _) in lone.items()}


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


def test_shared_replays_equal_separate_replays(lone):
    """estimate_many replays pipelines that share their module phase on one fake copy with one Dynamo capture
    (each compiles the captured graphs with its own graph passes); every count equals the pipeline's replay
    alone, byte for byte (issue 23.4: planning speed). The "alone" side is this module's lone replays (one fake
    copy each, its own joint trace), four of them: the plan as given, checkpoint ops, checkpoint full (one
    torch-IR graph: checkpointing acts on the joint graph) and tiles (another: tiling rewrites the graph before
    the joint trace). (Was tests/planning/test_memory_planner.py's, on a model_case Llama with its own four lone
    replays.)"""
    from effpass.planning import estimate_many

    model, inputs = _setup()
    base = list(effpass.default_pipeline("cpu", torch.float32))
    cands = {c.name: c for c in _every_pipeline(model)}
    names = ["as given", "checkpoint(ops)", "checkpoint(full)", "tiles(1024)"]
    copies, traces = [], []
    with pytest.MonkeyPatch.context() as mp:
        _counting(mp, copies, traces)
        shared = estimate_many(model, inputs, [pipeline_with(base, cands[n]) for n in names], lowering="eager")
    assert len(copies) == 1 and [lone[n][1] for n in names] == [1, 1, 1, 1]  # one fake copy for the four plans
    # joint traces: the plan as given and the two checkpoint plans have one torch-IR graph, tiles another: 2
    # traces per Dynamo graph shared, 4 alone
    assert 2 * len(traces) == sum(lone[n][2] for n in names) > 0

    def counts(e):  # the timeline's categories follow storage addresses, which malloc may reuse differently
        return {k: v for k, v in e.to_dict().items() if k not in ("seconds", "timeline")}

    for n, a in zip(names, shared):
        assert counts(a) == counts(lone[n][0]), n
        assert a.pass_stats["fuse_cross_entropy"]["fused"] == 1  # the default pipeline's fused loss in each
    assert len({e.flops for e in shared}) == 4  # four different programs
    assert shared[3].pass_stats["tile_sequence"]["tiles"] == 2 and "tile_sequence" not in shared[2].pass_stats
