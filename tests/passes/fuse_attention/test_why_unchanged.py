"""fuse_attention says why it changed nothing (PassResult.why_unchanged), in the summary and the dump."""
import json

import effpass
from effpass.testing import model_case


def _compile(case, tmp_path):
    model = effpass.compile(case.model, passes=["fuse_attention"], lowering="eager", dump_dir=str(tmp_path))
    model(**case.inputs)
    return effpass.report(model)


def test_fuse_attention_on_an_sdpa_model_says_the_sites_already_call_sdpa(tmp_path):
    case = model_case("llama", attn="sdpa", layers=2)
    rep = _compile(case, tmp_path)
    (rec,) = rep.records("fuse_attention")
    assert not rec.changed
    assert rec.why_unchanged.startswith("2 attention sites already call F.scaled_dot_product_attention"), rec
    assert "why unchanged: 2 attention sites already call" in rep.summary()
    assert "fused=" not in rep.summary()  # zero counters are not on the summary line ...
    index = json.loads((tmp_path / "graph_000" / "index.json").read_text())
    (dumped,) = [p for p in index["passes"] if p["name"] == "fuse_attention"]
    assert dumped["stats"]["fused"] == 0 and dumped["why_unchanged"] == rec.why_unchanged  # ... but in the JSON


def test_fuse_attention_that_fuses_gives_no_why(tmp_path):
    rep = _compile(model_case("llama", layers=2), tmp_path)
    (rec,) = rep.records("fuse_attention")
    assert rec.changed and rec.why_unchanged == ""
    assert "fused=2" in rep.summary() and "why unchanged: 2" not in rep.summary()
