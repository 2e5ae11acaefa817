"""Shared by the bench/ scripts: timing one step the same way on every device."""
from __future__ import annotations

import time
from typing import Callable

import torch


def timed(step: Callable[[], object], cuda: bool) -> float:
    """Seconds one call of ``step`` takes: CUDA events on a GPU, ``perf_counter`` on the CPU."""
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3
    t = time.perf_counter()
    step()
    return time.perf_counter() - t


def meta(device: str, packages: tuple[str, ...] = ()) -> dict:
    """Device, date, load average and versions (torch, transformers, triton and ``packages``) of a run;
    a package that does not import is recorded as ``"not installed: <why>"``."""
    import datetime
    import importlib
    import os
    import platform

    dev = torch.cuda.get_device_name() if device == "cuda" else \
        f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, shared)"
    info = {"device": dev, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "python": platform.python_version(), "torch": torch.__version__,
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}
    for name in ("transformers", "triton") + tuple(packages):
        try:
            info[name] = getattr(importlib.import_module(name), "__version__", "?")
        except Exception as e:  # noqa: BLE001 - recorded, not raised: the arm that needs it says so
            info[name] = f"not installed: {type(e).__name__}: {str(e)[:120]}"
    return info


def run_arm_subprocess(script: str, arm: str, args: list[str], env: dict | None = None) -> dict:
    """Runs ``script --worker arm *args`` in a fresh process; its last stdout line starting with ``{`` is the
    arm's result. A crash becomes ``{"arm": arm, "error": <the last lines of stderr>}``."""
    import json
    import os
    import subprocess
    import sys

    p = subprocess.run([sys.executable, script, "--worker", arm, *args], capture_output=True, text=True,
                       env={**os.environ, **(env or {})})
    line = next((ln for ln in reversed(p.stdout.splitlines()) if ln.startswith("{")), None)
    if line:
        return json.loads(line)
    err = [ln for ln in p.stderr.splitlines() if ln.strip() and "_pytree" not in ln and "Failed to load" not in ln]
    return {"arm": arm, "error": "\n".join(err[-15:])}
