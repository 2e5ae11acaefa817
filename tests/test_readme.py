"""The README's Python examples run (each block in its own process)."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCKS = re.findall(r"```python\n(.*?)```", open(os.path.join(ROOT, "README.md")).read(), re.S)
RUNNABLE = [b for b in BLOCKS if "(sketch" not in b]


def test_readme_has_examples():
    assert len(RUNNABLE) >= 4


@pytest.mark.parametrize("block", RUNNABLE, ids=[f"block{i}" for i in range(len(RUNNABLE))])
def test_readme_example_runs(block, tmp_path):
    out = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stderr[-3000:]
