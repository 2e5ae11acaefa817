"""The shared driver of every bench/ script: one arm per process, arms interleaved over repeats, a deadline per
arm, and a results file appended after every arm.

Contract (what a script gets by calling :func:`main`, and what a caller such as a GPU proof script can rely on):

* **One arm per process.** Each arm runs as ``python <script> --worker <arm> --cfg <json>`` in a fresh
  interpreter, in its own process group (so an arm that spawns ranks, ``torchrun`` or compilers is ended
  whole). The worker prints JSON objects, one per line; the last line that starts with ``{`` is the arm's
  result. A worker may print partial results as it goes (:func:`partial`).
* **Interleaved.** ``--repeats N`` runs every (arm, sweep value) once per round, N rounds, in the same order.
* **A deadline per arm** (``--deadline`` seconds, default the script's): at the deadline the arm's process
  group gets SIGTERM, then SIGKILL 10 s later; the row says ``"status": "killed"`` and keeps the last partial
  result the arm printed (``"partial"``). A crash is ``"status": "error"`` with the end of stderr in
  ``"error"``; an arm whose peer package does not import is ``"status": "not installed"`` and is not started.
  SIGTERM or Ctrl-C to the driver ends the running arm's process group before the driver exits.
* **Appended after every arm**, atomically (write to a temporary file, then rename), so a killed or
  interrupted run keeps what it measured: ``bench/results/<workload>_<device>.json`` and its ``.md``, with
  ``device`` = ``cpu`` or ``cuda-<model>`` (``cuda-h100``, ``cuda-h200``) from the device name. A file holds
  every run of that workload on that device, newest last: ``{"workload", "device", "runs": [run, ...]}``,
  ``run = {"label", "meta", "shape", "results": [row, ...]}``. ``meta`` holds the date, device name, load
  average, versions (python, torch, transformers, triton and the script's peers: ``"not installed: ..."``
  where a package does not import), the commit (``git rev-parse HEAD``) and whether the tree was dirty, and
  the command line. A variant of a workload (a vocabulary, a length) is a field of the rows (a sweep) or the
  run's ``label``, never a file name suffix. Runs from before the driver are kept as they were written, with
  ``"historical"`` naming the file they came from (their ``.md`` text kept in ``"markdown"``).

Common options of every script: ``--arms a,b``, ``--repeats N``, ``--deadline S``, ``--quick`` (the smallest
setting: a smoke run), ``--label TEXT``, ``--device cpu|cuda``, ``--out STEM`` (default
``bench/results/<workload>_<device>``), ``--set KEY=VALUE ...`` (any shape key), plus ``--<key>`` for the shape
keys the script exposes.
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from typing import Callable

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
KILL_GRACE_S = 10


# ---------------------------------------------------------------------------------------------------- the worker


def partial(result: dict) -> None:
    """Print a partial result of the running arm (kept in the row if the arm is killed at its deadline)."""
    print(json.dumps(result), flush=True)


# ------------------------------------------------------------------------------------------------- device, meta


def device_tag(device: str) -> str:
    """``cpu``, or ``cuda-<model>`` from the CUDA device's name (``NVIDIA H100 80GB HBM3`` -> ``cuda-h100``)."""
    if device != "cuda":
        return "cpu"
    import torch

    return cuda_tag(torch.cuda.get_device_name())


def cuda_tag(name: str) -> str:
    words = [w for w in re.split(r"[\s_-]+", name) if w.upper() not in ("NVIDIA", "GEFORCE", "TESLA", "RTX")]
    model = next((w for w in words if re.search(r"\d", w)), words[0] if words else "gpu")
    return "cuda-" + re.sub(r"[^a-z0-9]", "", model.lower())


def git_state() -> dict:
    """The commit of the tree the bench ran from and whether it had uncommitted changes."""
    def git(*args):
        try:
            return subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True, timeout=30).stdout.strip()
        except Exception:  # noqa: BLE001 - no git: recorded as unknown
            return None

    head = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": head or "unknown", "dirty": None if status is None else bool(status)}


def versions(packages: tuple[str, ...] = ()) -> dict:
    """python, torch, transformers, triton and ``packages``; ``"not installed: <why>"`` where one does not import."""
    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "triton") + tuple(p for p in packages if p not in ("torch",)):
        try:
            out[name] = str(getattr(importlib.import_module(name), "__version__", "?"))
        except Exception as e:  # noqa: BLE001 - recorded, not raised: the arm that needs it says so
            out[name] = f"not installed: {type(e).__name__}: {str(e)[:120]}"
    return out


def meta(workload: str, device: str, packages: tuple[str, ...] = ()) -> dict:
    """Everything a result needs to be read later: workload, device, date, load, versions, commit, command."""
    if device == "cuda":
        import torch

        name = torch.cuda.get_device_name()
    else:
        name = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    return {"workload": workload, "device": name, "device_tag": device_tag(device),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "load_average": [round(x, 2) for x in os.getloadavg()], "cpu_count": os.cpu_count(),
            **versions(packages), **git_state(),
            "argv": [os.path.relpath(sys.argv[0], ROOT) if os.path.isabs(sys.argv[0]) else sys.argv[0]] + sys.argv[1:]}


# ------------------------------------------------------------------------------------------------- results files


def result_stem(workload: str, device: str) -> str:
    """``bench/results/<workload>_<device tag>`` (no extension)."""
    return os.path.join(RESULTS, f"{workload}_{device_tag(device) if device in ('cpu', 'cuda') else device}")


def load(path: str) -> dict | None:
    """A results file (``.json``; the extension may be left out), or None when it does not exist."""
    path = path if path.endswith(".json") else path + ".json"
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def runs(path: str) -> list[dict]:
    """The runs of a results file, oldest first ([] when there is none). A file written before the driver
    (one document, no ``runs``) reads as one run."""
    doc = load(path)
    if doc is None:
        return []
    return doc["runs"] if "runs" in doc else [doc]


def latest(path: str, label: str | None = None, *, historical: str | None = None) -> dict | None:
    """The newest run of a results file whose ``label`` is ``label`` (None: any label but ``quick``), or the
    historical run taken from the file named ``historical``."""
    for run in reversed(runs(path)):
        if historical is not None:
            if run.get("historical") == historical:
                return run
            continue
        if label is None and run.get("label") in (None, "") or label is not None and run.get("label") == label:
            return run
    return None


def _write_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` atomically (effpass's own writer: a temporary file, then a rename)."""
    from effpass.dump import write_atomic

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_atomic(os.path.abspath(path), text)


def write(stem: str, doc: dict, markdown: Callable[[dict], str] | None = None, title: str | None = None) -> None:
    """Write ``doc`` to ``stem.json`` and its rendering to ``stem.md``, each atomically."""
    _write_atomic(stem + ".json", json.dumps(doc, indent=1, default=str) + "\n")
    _write_atomic(stem + ".md", render(doc, markdown, title))


def append_row(stem: str, run_id: str, run: dict, row: dict, markdown=None, title=None) -> dict:
    """Append ``row`` to the run ``run_id`` of ``stem.json`` (adding the run if the file lacks it), re-reading
    the file first so that rows another process appended meanwhile are kept; rewrite ``.json`` and ``.md``."""
    import fcntl
    import hashlib

    os.makedirs(os.path.dirname(os.path.abspath(stem)), exist_ok=True)
    key = hashlib.sha1(os.path.abspath(stem).encode()).hexdigest()[:16]  # the lock lives outside results/
    with open(os.path.join(tempfile.gettempdir(), f"effpass-bench-{key}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        doc = load(stem) or {"workload": run["meta"]["workload"], "device": run["meta"]["device_tag"], "runs": []}
        if "runs" not in doc:  # a file from before the driver: keep it as the first (historical) run
            doc = {"workload": run["meta"]["workload"], "device": run["meta"]["device_tag"],
                   "runs": [{**doc, "historical": os.path.basename(stem) + ".json"}]}
        mine = next((r for r in doc["runs"] if r.get("run_id") == run_id), None)
        if mine is None:
            mine = {**run, "run_id": run_id, "results": []}
            doc["runs"].append(mine)
        else:  # the caller's header may have grown (a finished flag, the load at the end)
            mine.update({k: v for k, v in run.items() if k != "results"})
        if row is not None:
            mine["results"].append(row)
        write(stem, doc, markdown, title)
    return mine


def render(doc: dict, markdown: Callable[[dict], str] | None = None, title: str | None = None) -> str:
    """The ``.md`` of a results file: every run, newest first, each under a heading with its date, label and
    commit; a run rendered by the script's ``markdown(run)`` or, without one, as a generic table."""
    out = [f"# {title or doc.get('workload')} on {doc.get('device')}", "",
           f"Written by `bench/driver.py` from `{doc.get('workload')}_{doc.get('device')}.json` (every run of this "
           "workload on this device, newest first). See `bench/README.md` for how to rerun it.", ""]
    for run in reversed(doc.get("runs", [])):
        m = run.get("meta") or run.get("header") or run.get("versions") or run.get("environment") or {}
        date = str(m.get("date") or run.get("date") or "?")
        head = f"## {date[:16].replace('T', ' ')}" + (f" · {run['label']}" if run.get("label") else "")
        if run.get("historical"):
            out += [head + f" · historical (`{run['historical']}`)", ""]
            body = run.get("markdown")
            if not body:  # a run that wrote JSON only: its figures, as written
                data = json.dumps({k: v for k, v in run.items() if k not in ("historical", "label")}, indent=1)
                body = ("No table was written for this run; its JSON as written"
                        + (" (first 6,000 characters)" if len(data) > 6000 else "") + ":\n\n```json\n"
                        + data[:6000] + "\n```")
            out += [_demote(body).rstrip(), ""]
            continue
        dirty = " (dirty tree)" if m.get("dirty") else ""
        out += [head + f" · commit {str(m.get('commit', '?'))[:10]}{dirty}", "",
                f"{m.get('device')}; load average {m.get('load_average')}; " +
                ", ".join(f"{k} {m[k]}" for k in ("torch", "transformers", "triton") if k in m) +
                f"; `{' '.join(m.get('argv', []))}`.", ""]
        body = None
        if markdown is not None:
            try:
                body = markdown(run)
            except Exception as e:  # noqa: BLE001 - a partial run the renderer cannot read: the generic table
                body = f"(the script's table failed on this run: {type(e).__name__}: {e})\n\n" + table(run)
        out += [_demote(body if body is not None else table(run)).rstrip(), ""]
    return "\n".join(out) + "\n"


def _demote(md: str) -> str:
    """Headings of a run's own text one level down (the file's run headings are level 2)."""
    return "\n".join("##" + ln if re.match(r"#+ ", ln) else ln for ln in md.splitlines())


def result_rows(run: dict) -> list[dict]:
    """The rows every arm of ``run`` returned (``{"rows": [...]}``), a partial arm's rows included."""
    rows: list[dict] = []
    for r in run["results"]:
        rows += r.get("rows") or (r.get("partial") or {}).get("rows") or []
    return rows


def table(run: dict) -> str:
    """A generic table of a run's rows: every scalar field."""
    rows = run.get("results") or []
    keys: list[str] = []
    for r in rows:
        for k, v in r.items():
            if k not in keys and isinstance(v, (int, float, str, bool, type(None))) and k not in ("error",):
                keys.append(k)
    if not rows:
        return "(no rows yet)"

    def cell(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v).replace("|", "/").replace("\n", " ")[:120]

    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        lines.append("| " + " | ".join(cell(r.get(k, "")) for k in keys) + " |")
    errs = [(r.get("arm"), r["error"]) for r in rows if r.get("error")]
    if errs:
        lines += [""] + [f"- {a}: {str(e).strip().splitlines()[-1][:200] if str(e).strip() else 'crashed'}"
                         for a, e in errs]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------- one arm


def run_arm(script: str, arm: str, cfg: dict, *, deadline_s: float | None, env: dict | None = None,
            python: str = sys.executable) -> dict:
    """Run one arm in a fresh process (its own process group) with a deadline; return its row (without
    ``arm``/``repeat`` bookkeeping beyond ``arm``): the result, or ``status`` error / killed with what it printed."""
    t0 = time.perf_counter()
    c0 = os.times()
    with tempfile.TemporaryFile("w+") as err:
        p = subprocess.Popen([python, script, "--worker", arm, "--cfg", json.dumps(cfg)], stdout=subprocess.PIPE,
                             stderr=err, text=True, env={**os.environ, **(env or {})}, start_new_session=True)
        killed = False
        try:
            out, _ = p.communicate(timeout=deadline_s)
        except subprocess.TimeoutExpired:
            killed = True
            _signal_group(p.pid, signal.SIGTERM)
            try:
                out, _ = p.communicate(timeout=KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                _signal_group(p.pid, signal.SIGKILL)
                out, _ = p.communicate()
        except BaseException:  # the driver itself is stopped (Ctrl-C, SIGTERM from `timeout`): end the arm too
            _signal_group(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout=KILL_GRACE_S)
            finally:
                _signal_group(p.pid, signal.SIGKILL)
            raise
        _signal_group(p.pid, signal.SIGKILL)  # anything the arm left behind in its group
        err.seek(0)
        stderr = err.read()
    c1 = os.times()
    wall = time.perf_counter() - t0
    cpu = (c1.children_user - c0.children_user) + (c1.children_system - c0.children_system)
    objs = []
    for ln in (out or "").splitlines():
        if ln.startswith("{"):
            try:
                objs.append(json.loads(ln))
            except json.JSONDecodeError:
                pass
    book = {"wall_s": round(wall, 3), "process_cpu_s": round(cpu, 3), "returncode": p.returncode,
            "load_average": [round(x, 2) for x in os.getloadavg()]}
    if killed:
        return {"arm": arm, "status": "killed", "error": f"killed at the deadline of {deadline_s:g} s",
                "partial": objs[-1] if objs else None, **book}
    if p.returncode == 0 and objs:
        res = dict(objs[-1])
        res.setdefault("arm", arm)
        res.setdefault("status", "error" if "error" in res else "ok")
        if isinstance(res.get("error"), str):
            res["error"] = _scrub_paths(res["error"])
        return {**book, **res}  # the arm's own figures (a wall_s of its own) win over the driver's
    lines = [ln for ln in stderr.splitlines() if ln.strip() and "_pytree" not in ln and "Failed to load" not in ln]
    return {"arm": arm, "status": "error",
            "error": _scrub_paths("\n".join(lines[-15:])) or f"exit code {p.returncode}",
            "partial": objs[-1] if objs else None, **book}


def _scrub_paths(text: str) -> str:
    """An error's text without this machine's paths (results files carry no machine paths): the repository's root
    and the Python installation's package folders become relative / ``<site-packages>``."""
    import site
    import sysconfig

    roots = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site.getsitepackages()},
                   key=len, reverse=True)
    for r in roots:
        text = text.replace(r.rstrip("/") + "/", "<site-packages>/")
    return text.replace(ROOT.rstrip("/") + "/", "")


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_on_sigterm() -> None:
    """SIGTERM to the driver (``timeout``, a job scheduler) raises SystemExit, so that the running arm's process
    group, which lives in a session of its own, is ended with it rather than left running (main thread only)."""
    import threading

    def _stop(signum, frame):
        raise SystemExit(128 + signum)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _stop)


def _load_mega_caches(folder: str) -> None:
    """Load every compile-cache archive in ``folder`` (``torch.compiler.load_cache_artifacts``; feature-tested):
    an arm compiled in an earlier process, or on an earlier machine whose archives were carried, starts warm."""
    import torch

    load = getattr(torch.compiler, "load_cache_artifacts", None)
    if load is None or not os.path.isdir(folder):
        return
    for name in sorted(os.listdir(folder)):
        if name.endswith(".bin"):
            try:
                with open(os.path.join(folder, name), "rb") as f:
                    load(f.read())
            except Exception as e:  # noqa: BLE001 - a stale or foreign archive: said, not fatal
                print(f"bench: could not load compile cache {name}: {type(e).__name__}: {e}", file=sys.stderr)


def _save_mega_cache(folder: str, name: str) -> None:
    """Save this process's compile artifacts (``torch.compiler.save_cache_artifacts``) as ``folder/name.bin``."""
    import torch

    save = getattr(torch.compiler, "save_cache_artifacts", None)
    got = save() if save is not None else None
    if got:
        os.makedirs(folder, exist_ok=True)
        _write_bytes_atomic(os.path.join(folder, re.sub(r"[^A-Za-z0-9_.-]", "_", name) + ".bin"), got[0])


def _write_bytes_atomic(path: str, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def missing(packages: tuple[str, ...]) -> list[str]:
    """Those of ``packages`` that are not installed (not importable by name)."""
    import importlib.util

    out = []
    for name in packages:
        try:
            if importlib.util.find_spec(name) is None:
                out.append(name)
        except (ImportError, ValueError):
            out.append(name)
    return out


# --------------------------------------------------------------------------------------------------- the run


def run(script: str, *, workload: str, jobs: list[tuple[str, dict]], cfg: dict, device: str, stem: str,
        repeats: int = 1, deadline_s: float | None = None, label: str = "", packages: tuple[str, ...] = (),
        requires: dict[str, tuple[str, ...]] | None = None, env: dict | None = None,
        markdown: Callable[[dict], str] | None = None, title: str | None = None,
        after_arm: Callable[[dict], None] | None = None, log: Callable[[dict], dict] | None = None,
        meta_extra: Callable[[dict], dict] | None = None, alternate: bool = False,
        once: tuple[str, ...] = ()) -> dict:
    """Run ``jobs`` (``(arm, extra cfg)`` pairs) ``repeats`` times interleaved, each in a fresh process under
    ``deadline_s``, appending each row to ``stem.json``/``.md`` as it ends. Returns the run."""
    stop_on_sigterm()
    run_id = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S") + f"-{os.getpid()}"
    header = {"label": label, "meta": meta(workload, device, packages),
              "shape": {k: v for k, v in cfg.items() if not k.startswith("_")}}  # _keys: the process's own
    header["meta"]["deadline_s"] = deadline_s
    header["meta"]["repeats"] = repeats
    if meta_extra is not None:
        header["meta"].update(meta_extra({**cfg, "_device": device}))
    current = append_row(stem, run_id, header, None, markdown, title)
    for rep in range(repeats):
        for arm, extra in (jobs[::-1] if alternate and rep % 2 else jobs):  # alternate: odd rounds reversed
            if rep and arm in once:  # a deterministic arm (an accuracy check): the first round only
                continue
            need = missing(tuple((requires or {}).get(arm, ())))
            if need:
                row = {"arm": arm, **extra, "status": "not installed",
                       "error": f"not installed: {', '.join(need)} (pip install .[bench])"}
            else:
                row = run_arm(os.path.abspath(script), arm, {**cfg, **extra}, deadline_s=deadline_s, env=env)
                for k, v in extra.items():
                    row.setdefault(k, v)
            row["repeat"] = rep
            if after_arm is not None and row.get("status") == "ok":
                after_arm(row)
            print(json.dumps((log or (lambda r: r))(row), default=str)[:2000], flush=True)
            current = append_row(stem, run_id, header, row, markdown, title)
    print(f"wrote {os.path.relpath(stem, os.getcwd())}.json and .md", flush=True)
    return current


def main(script: str, *, workload: str, arms: tuple[str, ...], worker: Callable[[str, dict, str], dict],
         cpu_shape: dict, gpu_shape: dict | None = None, quick: dict | None = None,
         markdown: Callable[[dict], str] | None = None, title: str | None = None,
         packages: tuple[str, ...] = (), requires: dict[str, tuple[str, ...]] | None = None,
         overrides: tuple[str, ...] | None = None, sweep: str | None = None, default_arms: tuple[str, ...] | None = None,
         env: dict | None = None, after_arm: Callable[[dict], None] | None = None,
         log: Callable[[dict], dict] | None = None, deadline_s: float = 1800, repeats: int = 1,
         gpu_repeats: int | None = None, extra_args: Callable[[argparse.ArgumentParser], None] | None = None,
         configure: Callable[[argparse.Namespace, dict], None] | None = None,
         jobs: Callable[[list[str], dict], list[tuple[str, dict]]] | None = None, name: str | None = None,
         meta_extra: Callable[[dict], dict] | None = None, alternate: bool = False,
         once: tuple[str, ...] = ()) -> None:
    """The command line of every bench script (see the module docstring for the contract).

    ``worker(arm, cfg, device) -> dict`` measures one arm in the worker process. ``cpu_shape`` / ``gpu_shape``:
    the configuration on each device (``gpu_shape`` defaults to ``cpu_shape``); ``quick``: the keys ``--quick``
    overrides. ``overrides``: shape keys exposed as ``--<key>`` options (a list-valued key takes several
    values). ``sweep``: a list-valued shape key whose values each arm runs over (a row field, e.g. ``vocab``).
    ``requires``: arm -> the packages it needs (absent ones: the row says "not installed", nothing starts).
    ``jobs(chosen_arms, cfg)``: the (arm, extra cfg) pairs of one round, when arms x sweep is not enough.
    ``extra_args`` / ``configure(args, cfg)``: script options beyond the shape keys. ``meta_extra(cfg)``:
    fields added to the run's meta once, in the driver's process (a method check, a model name). ``alternate``:
    odd rounds run the arms in reverse order. ``once``: arms run in the first round only (deterministic checks)."""
    workload = workload or name
    if overrides is None:  # the common knob, where the script has it
        overrides = ("steps",) if "steps" in cpu_shape else ()
    doc = (sys.modules["__main__"].__doc__ or "").strip().split("\n")[0]
    ap = argparse.ArgumentParser(description=doc)
    ap.add_argument("--arms", default=",".join(default_arms or arms), help=f"comma-separated, from {','.join(arms)}")
    ap.add_argument("--repeats", type=int, default=None, help=f"interleaved rounds over the arms (default {repeats})")
    ap.add_argument("--deadline", type=float, default=deadline_s, help="seconds per arm before it is killed")
    ap.add_argument("--quick", action="store_true", help="the smallest setting (a smoke run)")
    ap.add_argument("--label", default=None, help="a label for this run inside the results file")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--out", default=None, help="results stem (default bench/results/<workload>_<device>)")
    for k in overrides:
        v = cpu_shape[k]
        if isinstance(v, (list, tuple)):
            ap.add_argument(f"--{k}", type=type(v[0]), nargs="+", default=None)
        elif isinstance(v, bool):
            ap.add_argument(f"--{k}", type=lambda s: s.lower() in ("1", "true", "yes"), default=None)
        else:
            ap.add_argument(f"--{k}", type=type(v) if v is not None else str, default=None)
    ap.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                    help="override any shape key (VALUE read as JSON, else as a string), e.g. --set hidden=4096")
    if extra_args is not None:
        extra_args(ap)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cfg", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        cfg = json.loads(args.cfg)
        if os.environ.get("EFFPASS_PROOF_PLANT_SLOW"):  # bench/gpu_proof.py's test: an arm that outlives its deadline
            partial({"arm": args.worker, "status": "partial", "planted_slow": True})
            time.sleep(3600)
        mega = os.environ.get("EFFPASS_MEGA_CACHE_DIR")  # bench/gpu_proof.py: portable compile caches per arm
        if mega:
            _load_mega_caches(mega)
        res = worker(args.worker, cfg, cfg.get("_device", "cpu"))
        if mega:
            _save_mega_cache(mega, f"{os.path.splitext(os.path.basename(script))[0]}_{args.worker}")
        print(json.dumps(res, default=str), flush=True)
        return
    if args.device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    else:
        device = args.device
    cfg = dict(gpu_shape if device == "cuda" and gpu_shape is not None else cpu_shape)
    if args.quick:
        cfg.update(quick or {})
    for k in overrides:
        if getattr(args, k) is not None:
            cfg[k] = getattr(args, k)
    for kv in args.set:
        key, sep, value = kv.partition("=")
        if not sep or key not in cfg:
            raise SystemExit(f"bench: --set {kv!r}: expected KEY=VALUE with KEY one of {sorted(cfg)}")
        try:
            cfg[key] = json.loads(value)
        except json.JSONDecodeError:
            cfg[key] = value
    if configure is not None:
        configure(args, cfg)
    cfg["_device"] = device
    chosen = [a for a in args.arms.split(",") if a]
    bad = [a for a in chosen if a not in arms]
    if bad:
        raise SystemExit(f"bench: unknown arm(s) {bad}; choose from {list(arms)}")
    if jobs is not None:
        plan = jobs(chosen, cfg)
    elif sweep is not None:
        values = cfg[sweep] if isinstance(cfg[sweep], (list, tuple)) else [cfg[sweep]]
        plan = [(a, {sweep: v}) for v in values for a in chosen]
    else:
        plan = [(a, {}) for a in chosen]
    reps = args.repeats if args.repeats is not None else (gpu_repeats if device == "cuda" and gpu_repeats else repeats)
    label = args.label if args.label is not None else ("quick" if args.quick else "")
    stem = args.out or result_stem(workload, device)
    r = run(script, workload=workload, jobs=plan, cfg=cfg, device=device, stem=stem, repeats=reps,
            deadline_s=args.deadline, label=label, packages=packages, requires=requires, env=env, markdown=markdown,
            title=title, after_arm=after_arm, log=log, meta_extra=meta_extra, alternate=alternate, once=once)
    if markdown is not None:
        try:
            print(markdown(r))
        except Exception:  # noqa: BLE001 - the file's .md says why
            pass
