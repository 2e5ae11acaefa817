"""Headless Chromium for the HTML pages effpass writes (report, memory timeline)."""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

import pytest

CHROMIUM = next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")) if p), None)
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="optional extra: headless Chromium is not installed "
                                    "(scripts/dev.sh test installs Debian's chromium)")


def load_in_chromium(path: str) -> tuple[str, list[str]]:
    """(DOM after scripts ran, console messages) of ``path`` opened from disk in headless Chromium."""
    with tempfile.TemporaryDirectory() as profile:
        proc = subprocess.run(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}",
             "--enable-logging=stderr", "--v=0", "--virtual-time-budget=2000", "--dump-dom",
             "file://" + os.path.abspath(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    console = [line for line in proc.stderr.splitlines() if ":CONSOLE" in line]
    return proc.stdout, console
