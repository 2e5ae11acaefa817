"""The README's Python examples run (each block in its own process).

A block runs in a process forked from one that has imported torch, transformers and effpass already (the
imports cost more than most blocks on 2 cores): each block still gets a fresh process, with its own working
directory, and sees only the names it imports itself."""
import json
import os
import re
import subprocess
import sys

import pytest

from _fork_server import run_block as _run_block  # the session fixture fork_server: tests/conftest.py
from _paths import ROOT  # noqa: E402  (the repository's root)
BLOCKS = re.findall(r"```python\n(.*?)```", open(os.path.join(ROOT, "README.md")).read(), re.S)
FIRST_HOUR = re.search(r"## The first hour\n(.*?)\n## ", open(os.path.join(ROOT, "README.md")).read(), re.S).group(1)
# the first hour's Python block runs in test_first_hour_runs_every_command (with its commands after it), not twice
RUNNABLE = [b for b in BLOCKS if "(sketch" not in b and b not in FIRST_HOUR]


def test_readme_has_examples():
    assert len(RUNNABLE) >= 4


@pytest.mark.xdist_group("readme")
@pytest.mark.parametrize("block", RUNNABLE, ids=[f"block{i}" for i in range(len(RUNNABLE))])
def test_readme_example_runs(block, tmp_path, fork_server):
    _run_block(fork_server, block, tmp_path)


def test_readme_lists_every_option_and_environment_variable():
    """The Options section's tables name every key of the options dict (read from the fields of
    effpass.config.Options) and every environment variable in effpass.config.ENV_VARS, and nothing else."""
    from effpass.config import ENV_VARS, OPTION_DOCS

    text = open(os.path.join(ROOT, "README.md")).read()
    section = text[text.index("\n## Options\n"):]
    section = section[:section.index("\n## ", 1)]
    rows = set(re.findall(r"^\| `([A-Za-z_]+)=?` \|", section, re.M))
    options = {r for r in rows if not r.isupper()}   # environment variables are upper case (EFFPASS_*, TRITON_*)
    assert options - {"mode"} == set(OPTION_DOCS), f"README options table vs effpass.config.Options: {options ^ set(OPTION_DOCS)}"
    env = {r for r in rows if r.isupper()}
    assert env == set(ENV_VARS), f"README environment table vs effpass.config.ENV_VARS: {env ^ set(ENV_VARS)}"


@pytest.mark.xdist_group("readme")
def test_first_hour_runs_every_command(tmp_path, fork_server):
    """The "first hour" walk-through: its Python block (forked from the fork server, as the other README blocks:
    it is one of them), then each `effpass` command of its bash block, in one folder; the adapter, the report
    and the dump exist, and fuse_attention says why it changed nothing."""
    (code,) = re.findall(r"```python\n(.*?)```", FIRST_HOUR, re.S)
    (shell,) = re.findall(r"```bash\n(.*?)```", FIRST_HOUR, re.S)
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    stdout = _run_block(fork_server, code, tmp_path)
    assert "step 4: loss" in stdout and "already call F.scaled_dot_product_attention" in stdout
    assert (tmp_path / "adapter" / "adapter_config.json").exists() and (tmp_path / "report.html").exists()
    commands = [line.split("#")[0].split() for line in shell.splitlines() if line.strip()]
    assert commands and all(c[0] == "effpass" for c in commands)
    for c in commands:
        run = subprocess.run([sys.executable, "-m", "effpass.cli", *c[1:]], cwd=tmp_path, capture_output=True,
                             text=True, timeout=300, env=env)
        assert run.returncode == 0, (c, run.stderr[-2000:])


def test_demo_sample_is_what_the_demo_prints_for_its_results():
    """The README's demo block equals effpass.cli.demo.render of bench/results/demo_cpu.json (a real run's
    --json): it goes stale when the demo's format or fields change (rerun: scripts/demo_readme.py)."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    try:
        import demo_readme
    finally:
        sys.path.pop(0)
    text = open(os.path.join(ROOT, "README.md")).read()
    m = demo_readme.BLOCK.search(text)
    assert m, "README.md lost its <!-- demo:begin --> block"
    assert m.group(2) == demo_readme.block(), "stale: run `python scripts/demo_readme.py`"
    res = json.load(open(demo_readme.RESULTS))
    runs = res["runs"]
    assert len(runs["eager"]) == len(runs["effpass"]) == res["config"]["repeats"] >= 2
    assert all(len(r["step_times_s"]) == res["config"]["steps"] - 1 for rs in runs.values() for r in rs)
    assert "verdict: " in m.group(2)
