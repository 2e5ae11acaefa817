"""Packaging: the top-level passes/ folder installs as effpass.passes, in a wheel and editable."""
import importlib
import os
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_editable_install_maps_passes_to_effpass_passes():
    mod = importlib.import_module("effpass.passes")
    assert os.path.realpath(os.path.dirname(mod.__file__)) == os.path.realpath(os.path.join(ROOT, "passes"))
    assert "passes" not in sys.modules or sys.modules["passes"] is not mod  # no top-level 'passes' package


@pytest.mark.slow
def test_built_wheel_contains_effpass_passes_and_entry_points(tmp_path):
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp_path), ROOT], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    wheel = next(p for p in tmp_path.iterdir() if p.suffix == ".whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "effpass/passes/__init__.py" in names and "effpass/backend.py" in names
    for sub in ("cli", "inspect", "testing"):  # the tool subpackages ship too
        assert f"effpass/{sub}/__init__.py" in names, sub
    assert not any(n.startswith("passes/") for n in names)
    ep = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(ep).decode()
    assert "[torch_dynamo_backends]" in text and "effpass = effpass.backend:effpass_backend" in text
    assert "[console_scripts]" in text and "[effpass.passes]" in text
