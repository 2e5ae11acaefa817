"""Extrapolation over the tile count (``effpass/planning/tiles.py``, issue 39.5): a long length's figures from
replays at 4, 5 and 6 tiles of the same size, checked affine byte for byte; where they are not, the length
itself is replayed and a note says so.

Oracles: numerical (the extrapolated figures equal a real replay at the long length byte for byte; the
max-seq answer with extrapolation, its peak and the peak one step more are real replays', place by place;
``combine_tiles`` on analytic figures equals the affine formula), structural (the lengths replayed and their
tile counts, the pinned passes' tiles, the fallback note when the figures are not affine, the pass statistics
left out, the short replays shared between lengths).
"""
import dataclasses
import importlib
import re

import pytest
import torch

from effpass.passes import CheckpointActivations, FuseAttention, FuseCrossEntropy, TileSequence
from effpass.planning import MemoryEstimate, estimate_many, plan_max_seq
from effpass.planning.depth import AFFINE
from effpass.planning.tiles import COUNTS, batch_of, combine_tiles, estimate_long, pin_pipeline
from effpass.testing import model_case

_tile_bounds = importlib.import_module(TileSequence.__module__)._tile_bounds


def _inputs(seq):
    ids = torch.zeros(1, seq, dtype=torch.long)
    return {"input_ids": ids, "labels": ids}


def _est(n, **over):
    """Figures affine in the tile count ``n`` (``over``: a field made otherwise)."""
    e = MemoryEstimate(peak_bytes=1000 + 70 * n, start_bytes=500 + 2 * n, step_peak_bytes=500 + 68 * n, parameters=400,
                       trainable_parameters=100, buffers=0, inputs=2 * n, gradients=100, optimizer_states=200,
                       activations=30 * n, largest_transient=9 * n, largest_transient_op="mm", peak_phase="backward",
                       peak_graph="backward graph 1", peak_node=f"mul_{40 + 11 * n} (aten.mul.Tensor)",
                       phase_peaks={"forward": 10 * n, "backward": 68 * n}, flops=1_000 * n,
                       pass_stats={"tile_sequence": {"tiles": 2 * n, "regions": 2}, "loss": {"chunks": n * n}},
                       op_peaks={"backward aten.mul.Tensor": 68 * n, "backward aten.mm.default": 60 * n + 5,
                                 "forward aten.mm.default": 10 * n})
    return dataclasses.replace(e, **over)


def _ops(ests, op, f):
    """``ests`` with ``op``'s local peak ``f(n)`` at 4, 5, 6 tiles."""
    return [dataclasses.replace(e, op_peaks={**e.op_peaks, op: f(n)}) for n, e in zip(COUNTS, ests)]


def test_combine_tiles_extrapolates_affine_figures_and_refuses_the_rest():
    ests = [_est(n) for n in COUNTS]
    out, why = combine_tiles(ests, COUNTS, 54)
    assert why == "" and not out.provisional
    want = _est(54)
    assert all(getattr(out, f) == getattr(want, f) for f in AFFINE)
    assert out.phase_peaks == want.phase_peaks and out.peak_bytes == 1000 + 70 * 54
    assert out.pass_stats == {"tile_sequence": {"tiles": 108, "regions": 2}, "loss": {}}
    assert "left out: loss.chunks" in out.notes[-1] and "checked" in out.notes[-1]
    # two counts: the affine prediction, provisional
    two, _ = combine_tiles(ests[:2], COUNTS, 54)
    assert two.provisional and two.peak_bytes == want.peak_bytes
    # a count with a second difference (one byte), the peak elsewhere, another phase: refused, with the reason
    bent = ests[:2] + [dataclasses.replace(ests[2], activations=ests[2].activations + 1)]
    assert combine_tiles(bent, COUNTS, 54) == (None, "activations is not affine in the tile count "
                                                     "(120 / 150 / 181 at 4/5/6 tiles)")
    moved = ests[:2] + [dataclasses.replace(ests[2], peak_phase="forward")]
    assert combine_tiles(moved, COUNTS, 54)[0] is None
    assert "another place" in combine_tiles(moved, COUNTS, 54)[1]
    cuda = [dataclasses.replace(e, reserved_peak_bytes=2 << 20 if n < 6 else 4 << 20) for n, e in zip(COUNTS, ests)]
    assert "reserved_peak_bytes is not affine" in combine_tiles(cuda, COUNTS, 54)[1]


def test_combine_tiles_follows_an_op_that_overtakes_the_peak():
    """Every op's local peak is extrapolated: one that grows faster overtakes the peak beyond the replayed counts
    (below it at 4-6 tiles); an op's local peak not affine is refused in the peak's phase, named in another."""
    ests = _ops([_est(n) for n in COUNTS], "backward sdpa_backward", lambda n: 80 * n - 100)
    out, why = combine_tiles(ests, COUNTS, 54)
    assert why == "" and out.step_peak_bytes == 80 * 54 - 100 and out.peak_bytes == (500 + 2 * 54) + 80 * 54 - 100
    assert out.peak_node.startswith("sdpa_backward") and out.peak_phase == "backward"
    assert any(n.startswith("the peak moves past 6 tiles: at 54 tiles it is after sdpa_backward") for n in out.notes)
    assert out.phase_peaks["backward"] == 80 * 54 - 100
    below = combine_tiles(_ops([_est(n) for n in COUNTS], "backward sdpa_backward", lambda n: 60 * n), COUNTS, 54)[0]
    assert below.step_peak_bytes == 500 + 68 * 54 and below.peak_node.startswith("mul_")
    bent = _ops([_est(n) for n in COUNTS], "backward aten.add.Tensor", lambda n: n * n)
    assert "the local peak after backward aten.add.Tensor is not affine" in combine_tiles(bent, COUNTS, 54)[1]
    other = _ops([_est(n) for n in COUNTS], "forward aten.mean.dim", lambda n: n * n)
    out, why = combine_tiles(other, COUNTS, 54)
    assert why == "" and out.peak_bytes == _est(54).peak_bytes
    assert "left unchecked (below the peak, in another phase): forward aten.mean.dim" in out.notes[-1]
    assert combine_tiles(_ops([_est(n) for n in COUNTS[:2]] + [dataclasses.replace(_est(6), op_peaks={})],
                              "x", lambda n: n), COUNTS, 54)[0] is None


def test_pinned_passes_cut_the_tiles_of_the_long_length():
    """``pin_length``: the exact cut of the even cut's tile is the same tiles at that length; the loss's chunk
    budget is pinned to the length's rows; a pipeline without tiles is not extrapolated."""
    pinned, t = TileSequence(tile_rows=4096).pin_length(220_160)
    assert (t, pinned.tile_rows, pinned.cut) == (4078, 4078, "exact")
    assert _tile_bounds(220_160, 4096) == _tile_bounds(220_160, 4078, "exact")
    assert len(_tile_bounds(220_160, 4096)) == 54 and _tile_bounds(220_160, 4096)[-1] == (216_134, 220_160)
    # k tiles fewer: the same tiles
    assert _tile_bounds(220_160 - 50 * 4078, 4078, "exact") == _tile_bounds(220_160, 4096)[:3] + [(12_234, 16_260)]
    assert TileSequence(tile_rows=4096).pin_length(8191) == (TileSequence(tile_rows=4096), 0)  # not tiled
    assert TileSequence(tile_rows=4096).pin_length(8192, batch=2)[1] == 2048
    assert FuseCrossEntropy().pin_length(1000)[0].budget_rows == 1000
    assert FuseCrossEntropy(chunk_bytes=4096).pin_length(1000)[0].budget_rows == 0
    got = pin_pipeline([CheckpointActivations(policy="full"), FuseCrossEntropy(), TileSequence(tile_rows=16)], 250, 1)
    assert got[1:] == (16, 16) and got[0][1].budget_rows == 250 and got[0][2].cut == "exact"
    assert pin_pipeline([CheckpointActivations(policy="full"), FuseCrossEntropy()], 250, 1) is None
    assert batch_of({"input_ids": torch.zeros(3, 250, dtype=torch.long), "use_cache": False}, 250) == 3


@pytest.fixture(scope="module")
def llama():
    case = model_case("llama", seq=16, layers=2, attn="sdpa")
    case.model.train()
    return case.model


_PASSES = [FuseAttention(), CheckpointActivations(policy="full"), FuseCrossEntropy(), TileSequence(tile_rows=16)]


@pytest.fixture
def replayed_once(monkeypatch):
    """``estimate_many`` (the one the tile extrapolation's fallback calls) that replays each distinct request once:
    keyed by the length, every pipeline's passes (``repr`` names every option), the optimizer and every option; a
    request made again (the test's own oracle, after the fallback made it) gets a deep copy of the first replay's
    figures, which a replay of the same request gives byte for byte (deterministic). A fallback that replayed
    anything else (another length, the pinned pipeline, another device) misses the key and the oracle is replayed;
    one that changed the figures after the replay differs from the untouched copy. ``.keys``: the requests
    replayed, in order."""
    import copy

    from effpass.planning import estimate as est_mod

    real, memo, keys = est_mod.estimate_many, {}, []

    def once(model, inputs, pipelines, optimizer="adamw", **kw):
        key = (id(model), inputs["input_ids"].shape[-1], tuple(repr(list(p)) for p in pipelines), optimizer,
               tuple(sorted((k, repr(v)) for k, v in dict({"screen": False}, **kw).items())))
        if key not in memo:
            keys.append(key)
            memo[key] = real(model, inputs, pipelines, optimizer, **kw)
        return copy.deepcopy(memo[key])

    monkeypatch.setattr(est_mod, "estimate_many", once)
    once.keys = keys
    return once


def _same(a, b) -> list:
    return [f for f in list(AFFINE) + ["reserved_peak_bytes", "reserved_expandable_bytes", "phase_peaks", "peak_phase",
                                       "peak_graph"] if getattr(a, f) != getattr(b, f)]


@pytest.mark.slow  # ~45 CPU-s: 6 short replays of a 5-block tiny Llama, one at full depth and length
def test_a_deep_model_is_checked_on_the_grid_with_six_replays_and_falls_back_to_the_whole_grid(monkeypatch):
    """A 5-block tiny Llama (depth extrapolated) at 106 tokens (7 tiles of 16): the figure from the first two
    depths at the first two counts, checked by two replays (2 blocks at 6 tiles, 4 blocks at 4 tiles), equals the
    real 5-block replay at 106 tokens byte for byte (every count, each phase's peak, FLOPs), exact. One place of the
    2-block 6-tile replay moved by 8 bytes: the grid check fails, says why, and the whole grid follows (its first
    step, the third depth of the first two counts, stopped here: the whole grid's figures are tested above)."""
    from effpass.planning import estimate as est_mod
    from effpass.planning.depth import block_list

    monkeypatch.setenv("EFFPASS_PLAN_WORKERS", "1")  # the spy sees every replay (forked workers' would not report)
    seen, orig = [], est_mod.replay_many

    def spy(model, inputs, pipelines, *a, **k):
        seen.append((len(block_list(model)), inputs["input_ids"].shape[-1]))
        return orig(model, inputs, pipelines, *a, **k)

    monkeypatch.setattr(est_mod, "replay_many", spy)
    model = model_case("llama", seq=16, layers=5, attn="sdpa").model.train()
    log, shared = [], {}
    kw = dict(min_tiles=4, lowering="eager", extrapolate=True)
    (ext,) = estimate_long(model, _inputs, 106, [_PASSES], "adamw", screen=False, log=log, shared=shared, **kw)
    assert sorted(seen) == [(2, 58), (2, 74), (2, 90), (3, 58), (3, 74), (4, 58)]
    seen.clear()
    (real,) = estimate_many(model, _inputs(106), [_PASSES], "adamw", lowering="eager", extrapolate=False)
    assert seen == [(5, 106)]
    assert _same(ext, real) == [], [(f, getattr(ext, f), getattr(real, f)) for f in _same(ext, real)]
    assert ext.tile_exact and not ext.provisional and ext.depths == [2, 3]
    assert log == ["106 tokens (7 tiles of 16): checked at 90 tokens (6 tiles, 2 blocks) and 58 tokens (4 tiles, "
                   "4 blocks)"]
    assert any(n.startswith("checked on the grid of depths and tile counts") for n in ext.notes)
    # the check can fail: one place of the 2-block 6-tile replay 8 bytes off
    (key,) = [k for k in shared if k[-1] == ("depth", 2)]
    places = shared[key].places
    seg = next(k for k in places if k[0] == "forward" and k[2] == ("pre",))
    places[seg][0][-1] += 8
    seen.clear()
    log.clear()

    class WholeGrid(Exception):
        pass

    def whole_grid(model, inputs, pipelines, optimizer, ests, **k):  # the whole grid's first step (confirm_many)
        raise WholeGrid(inputs["input_ids"].shape[-1])

    with pytest.raises(WholeGrid, match="58"):
        estimate_long(model, _inputs, 106, [_PASSES], "adamw", screen=False, log=log, shared=shared,
                      confirm=whole_grid, **kw)
    assert seen == []  # the screened replays and the checks' came from ``shared``
    assert log == ["106 tokens: the screened figure's grid check failed (at the first depth the places do not line "
                   "up over the three counts); every count replayed at every depth"], log


@pytest.mark.slow  # ~25-45 CPU-s: 5 replays of a tiny Llama (three at 4-6 tiles, two at 10)
def test_extrapolated_figures_equal_a_real_replay(llama):
    """A 2-block tiny Llama (fused attention, full checkpointing, fused loss, tiles of 16 rows) at 154 tokens: 10
    tiles of 16 positions, the last 10 (four tiles past the replayed counts; 250 tokens, 16 tiles, gave the same
    verdicts for a dearer real replay). Extrapolated from 58, 74 and 90 tokens (4, 5, 6 tiles): every byte count,
    each phase's peak and the FLOPs equal the replay at 154 tokens; the pinned pipeline at 154 tokens is the same
    graph as the plan's (the same figures)."""
    log = []
    (ext,) = estimate_long(llama, _inputs, 154, [_PASSES], "adamw", screen=False, min_tiles=4, log=log, lowering="eager")
    (real,) = estimate_many(llama, _inputs(154), [_PASSES], "adamw", lowering="eager")
    assert _same(ext, real) == [], [(f, getattr(ext, f), getattr(real, f)) for f in _same(ext, real)]
    assert ext.peak_bytes == real.peak_bytes and not ext.provisional
    assert sorted(ext.tile_replays.short) == [58, 74, 90] and (ext.tile_replays.t, ext.tile_replays.n) == (16, 10)
    # place by place: exact (the forward's local peaks after a mul cross between 4 and 6 tiles, which the op-level
    # extrapolation could only name as unchecked)
    assert log == ["154 tokens (10 tiles of 16): extrapolated from replays at 58, 74, 90 tokens (4, 5, 6 tiles)"]
    node = lambda e: re.sub(r"_\d+$", "", e.peak_node.split(" ")[0])  # noqa: E731  (FX numbers copies per tile)
    assert ext.tile_exact and "exact, not a bound" in ext.notes[-1] and node(ext) == node(real) == "add"
    assert ext.pass_stats["tile_sequence"]["tiles"] == real.pass_stats["tile_sequence"]["tiles"] == 20
    (pinned,) = estimate_many(llama, _inputs(154), [ext.tile_replays.pipeline], "adamw", lowering="eager")
    assert _same(pinned, real) == [] and pinned.pass_stats == real.pass_stats


@pytest.mark.slow  # ~20 CPU-s: the 4-6-tile replays, one real replay at 7 tiles (the fallback's, the oracle's)
def test_not_affine_falls_back_to_the_real_replay(llama, replayed_once):
    """A CUDA plan (replayed on CPU fake tensors): the caching allocator rounds the tiny model's small blocks, so
    the peak is not affine in the tile count (1,890,816 / 1,934,848 / 1,977,856 B at 4/5/6 tiles); the length
    itself (106 tokens, 7 tiles: past the replayed counts) is replayed and the figure says so. The oracle (a real
    replay of the pipeline at 106 tokens) is the request the fallback made, replayed once (``replayed_once``)."""
    log = []
    (got,) = estimate_long(llama, _inputs, 106, [_PASSES], "adamw", screen=False, min_tiles=4, log=log,
                           lowering="eager", device="cuda")
    assert [k[1] for k in replayed_once.keys].count(106) == 1  # the length itself, replayed by the fallback
    (real,) = replayed_once(llama, _inputs(106), [_PASSES], "adamw", lowering="eager", device="cuda")
    assert _same(got, real) == [] and got.device_peak_bytes == real.device_peak_bytes
    assert len(log) == 1 and "not extrapolated over the tile count" in log[0] and "not affine" in log[0]
    assert "replayed at full length: not affine in the tile count" in got.notes[-1]
    assert not hasattr(got, "tile_replays")


@pytest.mark.slow  # ~60 CPU-s: two real replays (the oracle), the search (short replays, one real replay)
def test_max_seq_with_tile_extrapolation_answers_with_real_replays(llama):
    """plan_max_seq with the tile extrapolation (the default: past 12 tiles), the budget between the real peaks
    at 256 and 288 tokens: the answer (256, what the exhaustive scan of real replays gave: every multiple of 32 up
    to 384, the peak increasing), its peak and the peak one step more are the real replays' byte for byte, from
    the short replays place by place (planning/places.py; the peak's own extrapolation gave 1,640,712 B at 288
    tokens, a lower bound under the real 1,645,256 B: a crossing beyond the replayed counts). Structural: no
    length past the probes replayed at full length; both lengths exact (``tile_exact``), not labelled bounds; the
    short replays (not shared here: the loss's chunk rows, pinned, differ between 256 and 288)."""
    step = 32
    real = {s: estimate_many(llama, _inputs(s), [_PASSES], None, lowering="eager")[0].peak_bytes for s in (256, 288)}
    budget = (real[256] + real[288]) // 2
    import effpass.planning.maxseq as maxseq

    calls, replays, orig, orig_many = [], [], maxseq.estimate_long, maxseq.estimate_many
    spy = lambda m, mk, seq, pipes, opt, **kw: (  # noqa: E731
        calls.append((seq, kw["min_tiles"])) or orig(m, mk, seq, pipes, opt, **kw))
    count = lambda m, inputs, *a, **kw: replays.append(inputs["input_ids"].shape[-1]) or orig_many(m, inputs, *a, **kw)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(maxseq, "estimate_long", spy)
        mp.setattr(maxseq, "estimate_many", count)
        res = plan_max_seq(llama, _inputs, budget, passes=_PASSES, optimizer=None, step=step, probes=(64, 128),
                           max_len=384, lowering="eager")  # the default: min_tiles=12
    assert (res.seq, res.plan.peak_bytes, res.next_peak) == (256, real[256], real[288])
    assert real[256] <= budget < real[288] and not res.next_peak_bound and "lower bound" not in res.summary()
    assert res.plan.chosen.estimate.tile_exact and res.plan.chosen.estimate.peak_node.endswith(
        "(place by place over the tile count)")
    assert all(m is not None for s, m in calls if s > 128), calls  # nothing past the probes replayed at full length
    assert not any("replayed at full length" in n for n in res.notes), res.notes
    ext = [re.match(r"([\d,]+) tokens \((\d+) tiles of (\d+)\): extrapolated", n) for n in res.notes]
    ext = {int(m[1].replace(",", "")): (int(m[2]), int(m[3])) for m in ext if m}
    assert ext == {256: (16, 16), 288: (18, 16)}, res.notes
    assert sorted(replays) == [64, 64, 64, 80, 80, 96, 96, 128], replays  # probes; 4-6 tiles x 2 (none at 256)


@pytest.mark.sweep
@pytest.mark.parametrize("family", ["cohere", "qwen3", "phi3", "gpt_neox", "opt", "mistral"])
def test_the_peak_place_by_place_equals_a_real_replay_on_every_family(family, replayed_once):
    """Each family (2 blocks, SDPA, the same pipeline as above) at 154 tokens (10 tiles of 16) from replays at 4-6
    tiles, place by place: the peak and each phase's equal a real replay's byte for byte. Cohere: a parallel block
    (one norm read by the attention and the MLP); Mistral: a sliding-window mask of the whole sequence squared,
    not affine in the tile count: refused (a lower bound is not needed: the length itself replayed, said so; the
    oracle is that replay, made once: ``replayed_once``)."""
    import transformers as tf
    from _families import _specs

    cfg_name, model_name, kwargs, *_ = _specs()[family]
    cfg = getattr(tf, cfg_name)(**dict(kwargs, num_hidden_layers=2, max_position_embeddings=256))
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = getattr(tf, model_name)(cfg).train()
    log = []
    (ext,) = estimate_long(model, _inputs, 154, [_PASSES], None, screen=False, min_tiles=4, log=log, lowering="eager")
    assert [k[1] for k in replayed_once.keys].count(154) == (family == "mistral")  # the fallback's replay only
    (real,) = replayed_once(model, _inputs(154), [_PASSES], None, lowering="eager")
    assert (ext.peak_bytes, ext.phase_peaks) == (real.peak_bytes, real.phase_peaks)
    if family == "mistral":
        assert not hasattr(ext, "tile_replays") and "not extrapolated over the tile count" in log[0], log
    else:
        assert ext.tile_exact and log == ["154 tokens (10 tiles of 16): extrapolated from replays at 58, 74, 90 "
                                          "tokens (4, 5, 6 tiles)"], log


def test_cli_min_tiles_reaches_the_search_on_by_default(monkeypatch, tmp_path):
    """``effpass plan --max-seq --min-tiles N`` reaches ``plan_max_seq(min_tiles=N)``; without it, 12; 0: None."""
    import json

    import effpass.planning.maxseq as maxseq
    from effpass.cli import main

    seen = []

    def fake(*args, **kwargs):  # the CLI turns other exceptions into its own errors: stop with SystemExit
        seen.append(kwargs.get("min_tiles", "absent"))
        raise SystemExit("stopped before the search")

    monkeypatch.setattr(maxseq, "plan_max_seq", fake)
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(dict(model_type="llama", vocab_size=64, hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)))
    for extra in (["--min-tiles", "8"], [], ["--min-tiles", "0"]):
        with pytest.raises(SystemExit, match="stopped before the search"):
            main(["plan", str(cfg), "--batch", "1", "--budget", "1GiB", "--max-seq", *extra])
    assert seen == [8, 12, None]


def test_short_replays_are_shared_between_lengths_with_the_same_pinned_pipeline():
    """Two long lengths whose pinned pipelines are the same (tiles of 16, no loss pass): the second reuses the
    first's short replays (``shared``); a full (unscreened) request takes a screened one and confirms it. Numerical:
    the figures are the affine extrapolation of the fake replays at each length's tile count."""
    seen = []

    def fake(model, inputs, pipelines, optimizer, *, screen, **kw):
        n = inputs["input_ids"].shape[-1] // 16
        seen.append((n, screen))
        return [_est(n) for _ in pipelines]

    shared, passes = {}, [TileSequence(tile_rows=16)]
    a = estimate_long(None, _inputs, 256, [passes], None, screen=True, min_tiles=8, estimate=fake, shared=shared)
    b = estimate_long(None, _inputs, 288, [passes], None, screen=True, min_tiles=8, estimate=fake, shared=shared)
    assert seen == [(4, True), (5, True)]  # 288's short replays: 256's
    assert (a[0].peak_bytes, b[0].peak_bytes) == (_est(16).peak_bytes, _est(18).peak_bytes)
    for e in shared.values():
        e.provisional = True  # as a depth-screened replay is

    def confirm(model, inputs, pipelines, ests, optimizer, **kw):
        seen.append(("confirm", inputs["input_ids"].shape[-1] // 16))
        return [_est(inputs["input_ids"].shape[-1] // 16) for _ in pipelines]

    (c,) = estimate_long(None, _inputs, 320, [passes], None, screen=False, min_tiles=8, estimate=fake, confirm=confirm,
                         shared=shared)
    # a full request takes the screened short replays and confirms them (the third count replayed unscreened)
    assert seen[2:] == [("confirm", 4), ("confirm", 5), (6, False)]
    assert c.peak_bytes == _est(20).peak_bytes and not c.provisional
