"""README's "effpass vs peers" table is what bench/peer_table.py makes of the committed results."""
import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
