"""Per-file test times: one pytest process per test file (no xdist), wall and CPU (user+sys, the file's
subprocesses included: spawned ranks, torchrun, Inductor's g++), the load average around it and the slowest
tests (pytest --durations). CPU is the figure to compare on a shared machine: wall grows with the load.

    python bench/suite_times.py [tests/test_a.py ...] [--top 10] [--out bench/results/suite_times]

Writes OUT.json and OUT.md (device, versions, date, load). Run it on a quiet machine for figures to quote.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import re
import resource
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
_DUR = re.compile(r"^([\d.]+)s (call|setup|teardown)\s+(\S+)")


def _load() -> float:
    return float(pathlib.Path("/proc/loadavg").read_text().split()[0])


def time_file(path: str, top: int) -> dict:
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", PYTHONWARNINGS="ignore::DeprecationWarning")
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ROOT / ".cache" / "inductor"))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load0, t0 = _load(), time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--durations={top}", path],
                          cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    slow = [{"seconds": float(m.group(1)), "phase": m.group(2), "test": m.group(3)}
            for m in map(_DUR.match, proc.stdout.splitlines()) if m]
    return {"file": path, "rc": proc.returncode, "wall_s": round(wall, 1),
            "cpu_s": round((after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), 1),
            "load_start": load0, "load_end": _load(), "summary": (proc.stdout.strip().splitlines() or [""])[-1],
            "slowest": slow}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", help="test files (default: every tests/test_*.py)")
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "suite_times"))
    args = ap.parse_args(argv)
    files = args.files or sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*.py"))
    import torch

    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "device": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs", "python": platform.python_version(),
            "torch": torch.__version__}
    rows = []
    for f in files:
        rows.append(time_file(f, args.top))
        r = rows[-1]
        print(f"{r['file']}: {r['wall_s']} s wall, {r['cpu_s']} s CPU, load {r['load_start']}..{r['load_end']}, "
              f"{r['summary']}", flush=True)
        pathlib.Path(args.out + ".json").write_text(json.dumps({"meta": meta, "files": rows}, indent=1))
    lines = [f"# Test times per file ({meta['date']}, {meta['device']}, torch {meta['torch']})", "",
             "| file | wall s | CPU s | load | result | slowest |", "|---|---:|---:|---|---|---|"]
    for r in rows:
        slow = "; ".join(f"{s['test'].split('::', 1)[-1]} {s['seconds']:.0f}s" for s in r["slowest"][:3])
        lines.append(f"| {r['file']} | {r['wall_s']} | {r['cpu_s']} | {r['load_start']}..{r['load_end']} | "
                     f"{r['summary']} | {slow} |")
    pathlib.Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
