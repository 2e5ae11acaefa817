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
from effpass.planning import MemoryBudgetError, estimate_memory, plan_max_seq
from effpass.planning.measure import measure_step
from effpass.planning.planner import _candidates, _usable_options
from effpass.testing import model_case

TINY = {"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 96,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "max_position_embeddings": 4096, "dtype": "float32"}


def _names(model, allow=(), optimizer="adamw", device="cpu", base=()):
    notes = []
    groups = _usable_options(model, set(base), tuple(allow), optimizer, 1, notes, device=device)
    lossless, lossy = _candidates(groups, optimizer)
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
    assert [o.options for o in declared_memory_options(None) if o.technique == "tile_sequence"] == [{"tile_rows": 4096}]


def test_step_in_backward_predicted_as_measured():
    """The replay creates AdamW's states and steps each parameter inside the backward as the real step does
    (before: states never created, 36% of the start missing)."""
    case = model_case("llama", seq=64)
    passes = lambda: [CheckpointActivations(policy="full"), StepInBackward()]  # noqa: E731
    est = estimate_memory(case.model, case.inputs, passes=passes(), lowering="eager")
    model = case.make()
    compiled = effpass.compile(model, passes=passes(), lowering="eager")
    m = measure_step(compiled, model, case.inputs)
    trainable = sum(p.numel() * p.element_size() for p in model.parameters())
    assert est.optimizer_states >= 2 * trainable  # AdamW's two states per parameter exist in the replay
    assert est.start_bytes == m.start_bytes
    assert est.peak_bytes == pytest.approx(m.peak_bytes, rel=0.01)


def _tiny_llama(seq=16):
    return model_case("llama", seq=seq)


def _max_seq(budget, passes=None, optimizer="adamw", **kw):
    case = _tiny_llama()
    model = case.model

    def make_inputs(seq):
        ids = torch.zeros(1, seq, dtype=torch.long)
        return {"input_ids": ids, "labels": ids}

    passes = passes if passes is not None else [CheckpointActivations(policy="full"), FuseCrossEntropy(),
                                                TileSequence(tile_rows=64)]
    return model, make_inputs, plan_max_seq(model, make_inputs, budget, passes=passes, optimizer=optimizer,
                                            step=32, probes=(128, 256, 512), lowering="eager", **kw)


def test_max_seq_answer_fits_and_one_step_more_does_not():
    budget = 3 << 20
    model, make_inputs, res = _max_seq(budget)
    assert res.seq % 32 == 0 and res.seq >= 32
    assert res.plan.peak_bytes <= budget < res.next_peak
    names = [n for n, *_ in res.fits]
    assert set(names) == {"as given", "step in backward"}  # the only option the pipeline leaves to add
    # an independent replay of the plan at the answer + one step agrees
    nxt = estimate_memory(model, make_inputs(res.seq + 32), passes=res.plan.passes, lowering="eager")
    assert nxt.peak_bytes == res.next_peak and nxt.peak_bytes > budget
    assert "longest sequence that fits" in res.summary() and f"{res.seq:,} tokens" in res.summary()


def test_max_seq_nothing_fits():
    with pytest.raises(MemoryBudgetError, match="even at 32 tokens"):
        _max_seq(900_000, optimizer=None)


def test_cli_max_seq(tmp_path, capsys):
    from effpass.cli import main

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    passes = json.dumps({"checkpoint_activations": {"policy": "full"}, "fuse_cross_entropy": {}})
    rc = main(["plan", str(cfg), "--batch", "1", "--budget", "2MiB", "--max-seq", "--step", "64", "--probes", "128",
               "256", "512", "--optimizer", "none", "--passes", passes, "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc in (0, None)
    assert out["seq"] % 64 == 0 and out["seq"] >= 64
    assert out["plan"]["peak_bytes"] <= out["budget"] < out["next_peak"]
    with pytest.raises(SystemExit, match="--seq is required"):
        main(["plan", str(cfg), "--batch", "1", "--budget", "2MiB"])
