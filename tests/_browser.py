"""Headless Chromium for the HTML pages effpass writes (report, memory timeline)."""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time

import pytest

#: scripts/dev.sh installs Chromium in the background while the tests already run; this file exists until it ends
_PENDING = os.environ.get("EFFPASS_CHROMIUM_PENDING")


def find_chromium(wait_s: float = 900.0) -> str | None:
    """The headless Chromium's path, or None; first waits (at most ``wait_s``) for an install that
    ``scripts/dev.sh test`` started in the background and has not finished yet."""
    deadline = time.monotonic() + wait_s
    while _PENDING and os.path.exists(_PENDING) and time.monotonic() < deadline:
        time.sleep(1.0)
    return next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")) if p), None)


@pytest.fixture
def chromium() -> str:
    path = find_chromium()
    if path is None:
        pytest.skip("optional extra: headless Chromium is not installed (scripts/dev.sh test installs Debian's chromium)")
    return path


#: a test that opens pages in Chromium (skipped, with the reason, where none is installed)
needs_chromium = pytest.mark.usefixtures("chromium")


def load_in_chromium(path: str, window: tuple[int, int] = (1280, 900), screenshot: str | None = None
                     ) -> tuple[str, list[str]]:
    """(DOM after scripts ran, console messages) of ``path`` opened from disk in headless Chromium with a
    ``window`` of (width, height) CSS pixels; ``screenshot``: also write a PNG of the first screen there."""
    with tempfile.TemporaryDirectory() as profile:
        common = [find_chromium(), "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}",
                  "--hide-scrollbars", f"--window-size={window[0]},{window[1]}"]
        proc = subprocess.run(
            [*common, "--enable-logging=stderr", "--v=0", "--virtual-time-budget=2000", "--dump-dom",
             "file://" + os.path.abspath(path)], capture_output=True, text=True, timeout=120)
        if screenshot is not None:
            shot = subprocess.run([*common, "--virtual-time-budget=2000", f"--screenshot={os.path.abspath(screenshot)}",
                                   "file://" + os.path.abspath(path)], capture_output=True, text=True, timeout=120)
            assert shot.returncode == 0 and os.path.exists(screenshot), shot.stderr[-2000:]
    assert proc.returncode == 0, proc.stderr[-2000:]
    console = [line for line in proc.stderr.splitlines() if ":CONSOLE" in line]
    return proc.stdout, console
