"""README's "effpass vs peers" table is what bench/peer_table.py makes of the committed results."""
import importlib.util
import os

from _paths import ROOT  # noqa: E402  (the repository's root)


def _module():
    spec = importlib.util.spec_from_file_location("peer_table", os.path.join(ROOT, "bench", "peer_table.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_readme_peer_table_is_regenerated_from_results():
    mod = _module()
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    block = readme.split(mod.BEGIN, 1)[1].split(mod.END, 1)[0].strip()
    assert block == mod.table().strip(), "README's peer table is stale: run python bench/peer_table.py"
    # every row names its script, and no row claims a measurement for a peer that did not run
    rows = [l for l in block.splitlines() if l.startswith("| ") and not l.startswith("| workload")]
    assert rows and all(r.rstrip().endswith("|") for r in rows)
    assert any("PEFT" in r for r in rows) and any("Cut Cross-Entropy" in r or "not measured" in r for r in rows)


def test_new_workloads_render_ratios_and_failed_peers(tmp_path, monkeypatch):
    """QLoRA, 8-bit optimizer and tiled-MLP rows: effpass/peer ratios from the result files, a peer that
    failed shown as 'did not run' with its reason (never as a measurement), an absent file as 'not measured'."""
    import json

    mod = _module()
    monkeypatch.setattr(mod, "RESULTS", str(tmp_path))
    meta = {"device": "CPU (test)", "date": "2026-01-01T00:00:00", "load_average": [3.0]}
    q = {"meta": meta, "results": [
        {"arm": "peft_torchao_nf4", "peak_bytes": 200, "live_bytes": 100, "base_weight_bytes": 40, "cpu_s": 2.0, "load": 3.0},
        {"arm": "peft_bnb_nf4", "error": "Traceback\nRuntimeError: no backend"},
        {"arm": "effpass_nf4", "peak_bytes": 100, "live_bytes": 50, "base_weight_bytes": 40, "cpu_s": 1.0, "load": 3.0}]}
    (tmp_path / "qlora_peers_cpu.json").write_text(json.dumps(q))
    text = mod.table()
    rows = {l.split(" | ")[1]: l for l in text.splitlines() if l.startswith("| QLoRA")}
    assert "0.50x high-water" in rows["PEFT + torchao NF4 (to_nf4)"] and "1.00x base weight bytes" in rows["PEFT + torchao NF4 (to_nf4)"]
    assert "did not run: RuntimeError: no backend" in rows["PEFT + bitsandbytes 4-bit NF4 (BitsAndBytesConfig)"]
    assert "| 8-bit optimizer states | torchao AdamW8bit, bitsandbytes AdamW8bit | not measured yet |" in text
    assert "| tiled MLP (long sequence) | ALST TiledMLP (DeepSpeed) | not measured yet |" in text


def test_rows_come_from_the_newest_default_run_of_a_results_file(tmp_path, monkeypatch):
    """A results file holds many runs (bench/driver.py appends): the table reads the newest run with the default
    label, not a smoke run (label "quick") appended after it, and reads rows in the driver's format."""
    import json

    mod = _module()
    monkeypatch.setattr(mod, "RESULTS", str(tmp_path))
    meta = {"device": "CPU (test)", "date": "2026-01-02T00:00:00", "load_average": [1.0]}

    def run(label, ours_cpu):
        return {"label": label, "meta": meta, "shape": {"seq": 4096}, "results": [
            {"arm": "alst_tiled_mlp", "status": "ok", "peak_bytes": 200, "cpu_s": 1.0, "loss": 7.5, "load": 1.0},
            {"arm": "effpass_tiled", "status": "ok", "peak_bytes": 100, "cpu_s": ours_cpu, "loss": 7.5, "load": 1.0}]}

    doc = {"workload": "tiled_mlp", "device": "cpu",
           "runs": [run("", 4.0), run("", 2.0), run("quick", 8.0)]}
    (tmp_path / "tiled_mlp_cpu.json").write_text(json.dumps(doc))
    row = next(l for l in mod.table().splitlines() if "effpass at its default tile" in l)
    assert "0.50x step peak" in row and "2.00x CPU time" in row, row
