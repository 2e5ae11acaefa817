"""The command line starts fast and fails early: ``effpass --help`` and ``effpass passes`` import no torch
(they read the generated index of the built-in registry, which must equal the live registry), tables fit 100
columns, unknown names fail at once with a did-you-mean and one line on stderr."""
import os
import subprocess
import sys

import pytest

from _paths import ROOT
from effpass.cli.index import build_index, load_index, render_index

ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}


def _cli(*args, importtime=False):
    cmd = [sys.executable, *(["-X", "importtime"] if importtime else []), "-m", "effpass.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV, cwd=ROOT)


def test_index_is_current():
    """effpass/cli/_builtin_index.py is what the registry says now (regenerate: python -m effpass.cli.index)."""
    assert load_index() == build_index(), "stale: run `python -m effpass.cli.index`"
    with open(os.path.join(ROOT, "effpass", "cli", "_builtin_index.py")) as fh:
        assert fh.read() == render_index(build_index())


@pytest.mark.parametrize("args", [("--help",), ("passes",), ("passes", "inject_lora"), ("passes", "--json")],
                         ids=["help", "passes", "passes-name", "passes-json"])
def test_listing_imports_no_torch(args):
    out = _cli(*args, importtime=True)
    assert out.returncode == 0, out.stderr[-2000:]
    imported = {line.split("|")[-1].strip() for line in out.stderr.splitlines() if line.startswith("import time:")}
    assert "effpass.cli" in imported
    assert "torch" not in imported, "effpass " + " ".join(args) + " imported torch"
    for line in out.stdout.splitlines() if "--json" not in args else []:
        assert len(line) <= 100, line


@pytest.mark.parametrize("args,name", [(("passes", "fuse_atention"), "fuse_atention"),
                                       (("demo", "--passes", "fuse_atention,checkpoint_activations"), "fuse_atention"),
                                       (("verify", "llama", "--passes", "fuse_atention"), "fuse_atention")],
                         ids=["passes", "demo", "verify"])
def test_unknown_pass_fails_at_once_in_one_line(args, name):
    out = _cli(*args, importtime=True)
    assert out.returncode != 0
    lines = [l for l in out.stderr.splitlines() if not l.startswith("import time:")]
    assert lines == [l for l in lines if l.startswith("effpass ")] and len(lines) == 1, lines
    assert f"unknown pass {name!r} (did you mean 'fuse_attention'?)" in lines[0]
    assert "Traceback" not in out.stderr
    imported = {l.split("|")[-1].strip() for l in out.stderr.splitlines() if l.startswith("import time:")}
    assert "torch" not in imported  # checked before any work


def test_errors_are_one_line_unless_debug(tmp_path):
    out = _cli("inspect", str(tmp_path / "missing"))
    assert out.returncode != 0 and "Traceback" not in out.stderr and out.stderr.startswith("effpass inspect:")
