"""Every pass record that changed nothing says why (issue 38.3): in the record, the summary and the dump; where a
user would expect the pass to act, the reason says what to do."""
from __future__ import annotations

import json

import effpass
from effpass.passes import InjectLoRA, TileSequence
from effpass.testing import model_case


def test_every_unchanged_record_of_a_broad_pipeline_says_why(tmp_path):
    case = model_case("llama", train=True)
    # a short sequence (16 tokens) under the default 1,024-row tiles; unpacked inputs; fp32 (no loss scaling)
    passes = ["inject_lora", "tile_sequence", effpass.make_pass("pack_sequences", {"require_boundaries": False}),
              "scale_loss", "compress_activations", "checkpoint_activations", "fuse_cross_entropy", "step_in_backward"]
    model = effpass.compile(case.model, passes=passes, lowering="eager", dump_dir=str(tmp_path))
    case.loss(model(**case.inputs)).backward()
    records = effpass.report(model).records()
    unchanged = [r for r in records if not r.changed and not r.error]
    assert unchanged, [(r.name, r.changed) for r in records]
    assert all(r.why_unchanged for r in unchanged), [(r.name, r.graph) for r in unchanged if not r.why_unchanged]
    assert all(not r.why_unchanged for r in records if r.changed)
    tile = [r for r in unchanged if r.name == "tile_sequence" and r.graph == "torch_ir"]
    assert tile and "tile_rows=1024" in tile[0].why_unchanged and "lower tile_rows" in tile[0].why_unchanged
    summary = effpass.report(model).summary()
    assert "why unchanged: " in summary and "tile_rows=1024" in summary
    dumped = [r for f in tmp_path.glob("*/index.json") for r in json.loads(f.read_text())["passes"]]
    assert {r["why_unchanged"] for r in dumped if not r["changed"] and not r.get("error")} == {
        r.why_unchanged for r in unchanged}


def test_lora_on_an_already_adapted_model_says_nothing_new_was_injected():
    case = model_case("llama", layers=1, train=True)
    effpass.prepare(case.model, passes=[InjectLoRA()])
    effpass.prepare(case.model, passes=[InjectLoRA()])
    rec = [r for r in effpass.report(case.model).records() if r.name == "inject_lora"][-1]
    assert not rec.changed and rec.why_unchanged.startswith("every selected module already has a LoRA adapter")


def test_tiles_that_act_give_no_reason():
    case = model_case("llama", layers=1, seq=64, train=True)
    model = effpass.compile(case.model, passes=[TileSequence(tile_rows=32)], lowering="eager")
    case.loss(model(**case.inputs)).backward()
    rec = next(r for r in effpass.report(model).records() if r.name == "tile_sequence" and r.graph == "torch_ir")
    assert rec.changed and rec.why_unchanged == ""
