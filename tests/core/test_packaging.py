"""Packaging: the top-level passes/ folder installs as effpass.passes, in a wheel and editable."""
import importlib
import os
import subprocess
import sys
import zipfile

import pytest

from _paths import ROOT  # noqa: E402  (the repository's root)

PASS_PACKAGES = sorted(d for d in os.listdir(os.path.join(ROOT, "passes"))
                       if os.path.isfile(os.path.join(ROOT, "passes", d, "__init__.py")))


def test_editable_install_maps_passes_to_effpass_passes():
    mod = importlib.import_module("effpass.passes")
    assert os.path.realpath(os.path.dirname(mod.__file__)) == os.path.realpath(os.path.join(ROOT, "passes"))
    assert "passes" not in sys.modules or sys.modules["passes"] is not mod  # no top-level 'passes' package
    for name in PASS_PACKAGES:  # one package per pass, each from its folder
        sub = importlib.import_module(f"effpass.passes.{name}")
        assert os.path.realpath(sub.__file__) == os.path.realpath(os.path.join(ROOT, "passes", name, "__init__.py"))
    # the import paths users had before the passes became packages
    from effpass.passes import lora
    from effpass.passes.fsdp_estimate import estimate
    import effpass.passes.lora as lora2

    assert lora is lora2 and callable(lora.save) and callable(estimate)


@pytest.mark.slow
def test_built_wheel_contains_effpass_passes_and_entry_points(tmp_path):
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp_path), ROOT], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    wheel = next(p for p in tmp_path.iterdir() if p.suffix == ".whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "effpass/passes/__init__.py" in names and "effpass/backend.py" in names
    for name in PASS_PACKAGES:  # every pass package and its private modules ship
        for f in os.listdir(os.path.join(ROOT, "passes", name)):
            if f.endswith(".py"):
                assert f"effpass/passes/{name}/{f}" in names, (name, f)
    for sub in ("cli", "inspect", "testing"):  # the tool subpackages ship too
        assert f"effpass/{sub}/__init__.py" in names, sub
    assert not any(n.startswith("passes/") for n in names)
    ep = next(n for n in names if n.endswith("entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(ep).decode()
    assert "[torch_dynamo_backends]" in text and "effpass = effpass.backend:effpass_backend" in text
    assert "[console_scripts]" in text and "[effpass.passes]" in text


def test_cache_key_hashes_every_source_file_at_any_depth():
    """The source digest in every cache key covers each pass package's private modules (a change in
    passes/fuse_cross_entropy/rowwise.py must not reuse a stale compiled graph), and only source files."""
    import effpass

    files = {os.path.relpath(f, ROOT) for f in effpass._source_files()}
    expected = {os.path.relpath(os.path.join(d, f), ROOT) for top in ("effpass", "passes")
                for d, _, names in os.walk(os.path.join(ROOT, top)) if "__pycache__" not in d
                for f in names if f.endswith(".py")}
    assert files == expected
    assert {"passes/fuse_cross_entropy/rowwise.py", "passes/inject_lora/lora.py", "effpass/backend.py"} <= files
