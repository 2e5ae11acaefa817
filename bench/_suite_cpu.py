"""pytest plugin: CPU seconds per test, the test's subprocesses included (spawned ranks, torchrun, Inductor's g++
and compile workers). Load it with ``-p _suite_cpu`` and ``bench/`` on PYTHONPATH; each process (an xdist worker
or the single process) appends one JSON line per test to ``$SUITE_CPU_OUT/<worker>.jsonl`` and a last line with
its whole CPU (collection and imports included) and the commit tested. ``python bench/suite_times.py --suite-cpu
DIR`` turns a whole run's files into a results table (per file, the costliest tests, every test in the .json):

    SUITE_CPU_OUT=/tmp/scpu PYTHONPATH=bench PYTEST_ADDOPTS="-p _suite_cpu" bash .ci/run
    python bench/suite_times.py --suite-cpu /tmp/scpu --label "fresh clone, quiet"

CPU of a test = the change, over setup + call + teardown, of: this process's user+sys, its waited-for children's
(RUSAGE_CHILDREN: every finished descendant), and the live descendants' user+sys (psutil; a persistent pool
worker's time counts in the test during which it ran).
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import time

import pytest

try:
    import psutil
except ImportError:  # pragma: no cover - psutil ships with the dev extra's dependencies
    psutil = None


def _cpu() -> float:
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime
    if psutil is not None:
        try:
            children = psutil.Process().children(recursive=True)
        except psutil.Error:
            children = []
        for c in children:
            try:
                t = c.cpu_times()
            except psutil.Error:
                continue
            total += t.user + t.system + t.children_user + t.children_system
    return total


def _out_path() -> str | None:
    out = os.environ.get("SUITE_CPU_OUT")
    if not out:
        return None
    os.makedirs(out, exist_ok=True)
    return os.path.join(out, f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.jsonl")


def _write(record: dict) -> None:
    path = _out_path()
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    c0, t0 = _cpu(), time.perf_counter()
    yield
    _write({"test": item.nodeid, "cpu_s": round(_cpu() - c0, 2), "wall_s": round(time.perf_counter() - t0, 2),
            "load": float(open("/proc/loadavg").read().split()[0])})


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def _tree() -> dict:
    """The commit tested and whether tracked files differed from it (None: unknown)."""
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"commit": _git("rev-parse", "HEAD") or None, "dirty": None if status is None else bool(status)}


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("PYTEST_XDIST_WORKER") or not hasattr(session.config, "workerinput"):
        _write({"session": True, "cpu_s": round(_cpu(), 2), **_tree()})
