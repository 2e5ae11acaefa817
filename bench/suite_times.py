"""Per-file test times: one pytest process per test file (no xdist), wall and CPU (user+sys, the file's
subprocesses included: spawned ranks, torchrun, Inductor's g++), the load average around it and the slowest
tests (pytest --durations). CPU is the figure to compare on a shared machine: wall grows with the load.

    python bench/suite_times.py [tests/core/test_a.py ...] [--top 10] [--deadline 1800] [--label TEXT] [--out STEM]
    python bench/suite_times.py --suite-cpu DIR [--top 40] [--label TEXT] [--commit SHA] [--out STEM]

Each file is an arm of bench/driver.py: timed in a fresh process (its pytest a child of it) under a deadline, its row
appended to OUT.json and OUT.md (default bench/results/suite_times_<device>; device, versions, commit, date, load)
as soon as it ends. Run it on a quiet machine for figures to quote.

``--suite-cpu DIR`` reads instead what ``bench/_suite_cpu.py`` wrote during one whole run of the suite (CI's two
workers, as ``bash .ci/run`` runs it) and adds it as one run: CPU per file, by cost band, the costliest tests, and
every test's CPU in the .json (the commit is the one the run recorded, or ``--commit`` for older files).
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


def suite_cpu(folder: str, top: int, commit: str | None = None) -> dict:
    """One suite run's per-test CPU (the jsonl files of bench/_suite_cpu.py in ``folder``) as a results row."""
    tests, sessions = [], {}
    for path in sorted(pathlib.Path(folder).glob("*.jsonl")):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("session"):
                sessions[path.stem] = rec
            else:
                tests.append(rec)
    if not tests:
        raise SystemExit(f"suite_times: no per-test records in {folder} (bench/_suite_cpu.py writes them)")
    recorded = {s.get("commit") for s in sessions.values()} - {None}
    dirty = {s.get("dirty") for s in sessions.values() if s.get("commit")}
    # the workers' whole CPU (imports and collection included); without workers, the one process's. The xdist
    # controller's own line ("main") counts the workers again (they are its children), so it is left out then.
    workers = {k: v for k, v in sessions.items() if k != "main"} or sessions
    tree_dirty = None  # unknown unless the run recorded it (or --commit names a commit: taken as clean)
    if commit is None and len(recorded) == 1:
        commit = recorded.pop()
        tree_dirty = dirty.pop() if len(dirty) == 1 else None
    elif commit is not None:
        tree_dirty = False
    per_file: dict[str, list] = {}
    for t in tests:
        f = per_file.setdefault(t["test"].split("::", 1)[0], [0, 0.0])
        f[0] += 1
        f[1] += t["cpu_s"]
    bands = [(0, 0.5), (0.5, 2), (2, 5), (5, 10), (10, 20), (20, float("inf"))]
    by_band = [{"from_s": lo, "to_s": None if hi == float("inf") else hi,
                "tests": sum(lo <= t["cpu_s"] < hi for t in tests),
                "cpu_s": round(sum(t["cpu_s"] for t in tests if lo <= t["cpu_s"] < hi), 1)} for lo, hi in bands]
    ranked = sorted(tests, key=lambda t: -t["cpu_s"])
    return {"suite_cpu": True, "tested_commit": commit, "tested_tree_dirty": tree_dirty, "tests": len(tests),
            "cpu_s": round(sum(t["cpu_s"] for t in tests), 1),
            "process_cpu_s": round(sum(s["cpu_s"] for s in workers.values()), 1), "by_band": by_band,
            "per_file": sorted(({"file": k, "tests": v[0], "cpu_s": round(v[1], 1)} for k, v in per_file.items()),
                               key=lambda r: -r["cpu_s"]),
            "top": [{"test": t["test"], "cpu_s": t["cpu_s"]} for t in ranked[:top]],
            "every_test": [{"test": t["test"], "cpu_s": t["cpu_s"], "wall_s": t.get("wall_s")} for t in ranked]}


def _suite_markdown(r: dict) -> list[str]:
    lines = [f"One whole run of the suite: {r['tests']} tests, **{r['cpu_s']:,.0f} CPU-s in tests** "
             f"({r['process_cpu_s']:,.0f} in the test processes, imports and collection included); tested commit "
             f"{(r['tested_commit'] or 'not recorded')[:12]}.", "",
             "| CPU-s per test | tests | CPU-s |", "|---|---:|---:|"]
    for b in r["by_band"]:
        lines.append(f"| {b['from_s']}-{b['to_s'] if b['to_s'] is not None else ''} | {b['tests']} | {b['cpu_s']:,.1f} |")
    lines += ["", "| file | tests | CPU-s |", "|---|---:|---:|"]
    lines += [f"| {f['file']} | {f['tests']} | {f['cpu_s']:,.1f} |" for f in r["per_file"]]
    lines += ["", "| costliest tests | CPU-s |", "|---|---:|"]
    lines += [f"| {t['test']} | {t['cpu_s']:,.1f} |" for t in r["top"]]
    return lines


def markdown(run: dict) -> str:
    meta = run["meta"]
    if run.get("shape", {}).get("suite_cpu"):
        return "\n".join([f"# Test CPU per test, one whole run ({meta['date']}, {meta['device']}, torch {meta['torch']})",
                          ""] + [line for r in run["results"] for line in _suite_markdown(r)]) + "\n"
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
    ap.add_argument("--top", type=int, default=None, help="slowest tests listed (10 per file; 40 with --suite-cpu)")
    ap.add_argument("--deadline", type=float, default=1800, help="seconds per file before its process group is killed")
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default=driver.result_stem("suite_times", "cpu"))
    ap.add_argument("--suite-cpu", metavar="DIR", default=None,
                    help="summarise one whole suite run recorded by bench/_suite_cpu.py in DIR (no test is run)")
    ap.add_argument("--commit", default=None, help="with --suite-cpu: the commit tested, when DIR did not record it")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cfg", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:  # one file, in the driver's fresh process
        print(json.dumps({"arm": args.worker, **time_file(args.worker, json.loads(args.cfg)["top"])}), flush=True)
        return 0
    if args.suite_cpu:
        top = args.top or 40
        header = {"label": args.label, "meta": driver.meta("suite_times", "cpu"), "shape": {"suite_cpu": True, "top": top}}
        run_id = f"{datetime.datetime.now(datetime.timezone.utc):%Y%m%dT%H%M%S}-{os.getpid()}"
        row = suite_cpu(args.suite_cpu, top, args.commit)
        if row["tested_commit"]:  # the figures are the tested commit's, not this checkout's
            header["meta"].update(commit=row["tested_commit"], dirty=row["tested_tree_dirty"])
        driver.append_row(args.out, run_id, header, row, markdown, "Test times per file")
        print(f"{row['tests']} tests, {row['cpu_s']} CPU-s in tests, commit {row['tested_commit']}: {args.out}.md")
        return 0
    files = args.files or sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py"))
    args.top = args.top or 10
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
