"""Summary lines: non-zero statistics only, why an unchanged pass changed nothing, every skip reason; the JSON
keeps every counter."""
from effpass.report import CompileReport, GraphReport, PassRecord


def _report():
    g = GraphReport("graph_000")
    g.add(PassRecord("fuse_attention", "torch_ir", "torch_ir", changed=True,
                     stats={"fused": 3, "unfused": 0, "gqa": 3, "dropout": 0, "ratio": 0.0, "met": False},
                     skipped=[{"site": "a:softmax", "reason": "mask is data-dependent"},
                              {"site": "b:softmax", "reason": "mask is data-dependent"},
                              {"site": "c:softmax", "reason": "soft-capped scores"}]))
    g.add(PassRecord("checkpoint_activations", "joint", "inference", stats={"blocks": 0},
                     why_unchanged="inference graph: nothing is saved for a backward"))
    rep = CompileReport()
    rep.graphs.append(g)
    return rep


def test_summary_shows_nonzero_stats_reasons_and_why():
    lines = _report().summary().splitlines()
    fa = next(l for l in lines if "fuse_attention" in l)
    assert "fused=3" in fa and "gqa=3" in fa and "met=False" in fa  # booleans always shown
    assert "unfused" not in fa and "dropout" not in fa and "ratio" not in fa
    assert any("left alone (2 sites, e.g. a:softmax): mask is data-dependent" in l for l in lines)
    assert any("left alone (c:softmax): soft-capped scores" in l for l in lines)
    ca = next(l for l in lines if "checkpoint_activations" in l)
    assert "(all statistics 0)" in ca
    assert "      why unchanged: inference graph: nothing is saved for a backward" in lines


def test_zero_counters_stay_in_the_json_and_stats():
    rep = _report()
    rec = rep.records("fuse_attention")[0].to_json()
    assert rec["stats"]["unfused"] == 0 and rec["stats"]["dropout"] == 0
    assert rep.records("checkpoint_activations")[0].to_json()["why_unchanged"].startswith("inference graph")
    assert PassRecord.from_json(rec).stats == rec["stats"]
