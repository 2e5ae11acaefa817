"""Per-file test times: one pytest process per test file (no xdist), wall and CPU (user+sys, the file's
subprocesses included: spawned ranks, torchrun, Inductor's g++), the load average around it and the slowest
tests (pytest --durations). CPU is the figure to compare on a shared machine: wall grows with the load.

    python bench/suite_times.py [tests/core/test_a.py ...] [--top 10] [--deadline 1800] [--label TEXT] [--out STEM]

Each file is an arm of bench/driver.py: timed in a fresh process (its pytest a child of it) under a deadline, its row
appended to OUT.json and OUT.md (default bench/results/suite_times_<device>; device, versions, commit, date, load)
as soon as it ends. Run it on a quiet machine for figures to quote.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import re
import resource
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import driver  # noqa: E402

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


def markdown(run: dict) -> str:
    meta = run["meta"]
    lines = [f"# Test times per file ({meta['date']}, {meta['device']}, torch {meta['torch']})", "",
             "| file | wall s | CPU s | load | result | slowest |", "|---|---:|---:|---|---|---|"]
    for r in run["results"]:
        if r.get("status") != "ok":
            lines.append(f"| {r['arm']} | {r.get('wall_s')} | {r.get('process_cpu_s')} | - | {r.get('status')}: "
                         f"{(str(r.get('error', '')).strip().splitlines() or ['?'])[-1][:120]} | |")
            continue
        slow = "; ".join(f"{s['test'].split('::', 1)[-1]} {s['seconds']:.0f}s" for s in r["slowest"][:3])
        lines.append(f"| {r['file']} | {r['wall_s']} | {r['cpu_s']} | {r['load_start']}..{r['load_end']} | "
                     f"{r['summary']} | {slow} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", help="test files (default: every tests/**/test_*.py)")
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--deadline", type=float, default=1800, help="seconds per file before its process group is killed")
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default=driver.result_stem("suite_times", "cpu"))
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cfg", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:  # one file, in the driver's fresh process
        print(json.dumps({"arm": args.worker, **time_file(args.worker, json.loads(args.cfg)["top"])}), flush=True)
        return 0
    files = args.files or sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py"))
    driver.stop_on_sigterm()
    run_id = f"{datetime.datetime.now(datetime.timezone.utc):%Y%m%dT%H%M%S}-{os.getpid()}"
    header = {"label": args.label, "meta": driver.meta("suite_times", "cpu"), "shape": {"top": args.top}}
    header["meta"]["deadline_s"] = args.deadline
    rows = []
    for f in files:
        r = driver.run_arm(os.path.abspath(__file__), f, {"top": args.top}, deadline_s=args.deadline)
        rows.append(r)
        driver.append_row(args.out, run_id, header, r, markdown, "Test times per file")
        print(f"{f}: {r.get('wall_s')} s wall, {r.get('cpu_s', r.get('process_cpu_s'))} s CPU, "
              f"load {r.get('load_start')}..{r.get('load_end')}, {r.get('summary', r.get('status'))}", flush=True)
    return 0 if all(r.get("status") == "ok" and r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
