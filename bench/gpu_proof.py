"""The GPU proof: every headline workload measured side by side on one H100/H200 within ~9 minutes (issue 37).

Run it through ``bash scripts/gpu_proof.sh OUTDIR [--dry-run] [--only a,b] [--budget S]`` (which installs the
carried wheels first). Sections, in the order of their value to a user; each is one ``bench/`` script run by
``bench/driver.py`` (every arm in its own process group with a deadline, rows appended after every arm), under a
section deadline of its own (SIGTERM, then SIGKILL to the section's process group):

====  =======================================================================================================
a     the loss head alone at Llama-3-8B widths (hidden 4,096, vocabulary 128,256, 8,192 tokens, bf16):
      plain compiled unfused, effpass, Liger, Cut Cross-Entropy, torch's ``F.linear_cross_entropy``
b     one LoRA step (r=16, every projection) at Llama-3-8B widths, 4 layers, 4,096 tokens, bf16: PEFT +
      ``torch.compile``, PEFT + Liger's kernels, and effpass on the unmodified model
c     the same for QLoRA (NF4 base): PEFT + bitsandbytes, PEFT + torchao, effpass
d     full fine-tuning (AdamW, bf16 weights): plain compile, effpass, and effpass with its planner's plan for
      a stated budget (``--set budget=...``: 20 GiB on a GPU; the plan made ahead, ``bench/plans/``)
e     attention at 4k/8k/16k tokens, GQA 32/8, head dim 128: naive attention under effpass vs SDPA
f     packed rows (the varlen path; its statistic) vs padded batches: useful tokens/s
g     the planner against the device: predicted vs measured device and host peak at 4k/8k tokens (a plan that
      holds host memory among them), the CPU replay, the longest length under a cap (plans made ahead, ``bench/plans/``)
h     ``pytest -m gpu``
====  =======================================================================================================

Results: ``OUTDIR/proof.jsonl`` (one line per arm of every section, appended as each section ends, killed arms
with their partial figures) and ``OUTDIR/proof.md`` (re-rendered after every section); each section's full
results file (``OUTDIR/<section>_<workload>.json/.md``, the bench driver's format). Every line carries the device,
the versions, the commit and the date. Loss agreement: within a section, an arm whose loss differs from the
reference arm's by more than the tolerance of its dtype is marked ``loss_drift`` and not reported as a speed.

``--dry-run``: the same sections and code paths on the CPU at the scripts' ``--quick`` shapes with one or two
cheap arms each (what the suite's test runs, so that a GPU window is never spent on a driver bug).
``--plant-slow SECTION``: that section's arms sleep past their deadline (the test of deadlines and partial rows).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import driver  # noqa: E402

#: relative loss difference allowed against the reference arm, by dtype of the step
LOSS_TOL = {"bfloat16": 3e-2, "float16": 3e-2, "float32": 1e-4}


@dataclasses.dataclass(frozen=True)
class Section:
    key: str
    title: str
    script: str                       # under bench/, or "pytest"
    gpu_args: tuple                   # the real run's options
    dry_args: tuple                   # the CPU dry run's options
    budget_s: float                   # the section's deadline on the GPU (cold compiles included)
    arm_deadline_s: float             # each arm's deadline inside it (bench driver) on the GPU
    ref_arm: str | None = None        # the loss reference of the section
    dtype: str = "bfloat16"
    plan: str = ""                    # what the budget pays for (the time plan, docs/gpu_proof.md)
    #: options that make the section's run one step (the prewarm: its cold compiles, started in parallel)
    prewarm_args: tuple = ()


SECTIONS = (
    Section("a", "loss head alone (hidden 4,096, vocabulary 128,256, 8,192 tokens, bf16)", "bench_loss_head.py",
            ("--arms", "compile,effpass,effpass_chunked,liger,cce,torch_lce"), ("--quick", "--arms", "eager,effpass"),
            budget_s=80, arm_deadline_s=25, ref_arm="compile", prewarm_args=("--set", "steps=1", "warmup=0"),
            plan="6 arms x (process start + import ~6 s, warm compile 2-5 s (prewarmed), 12 steps of ~3-40 ms) ~ 70 s"),
    Section("b", "LoRA r=16 step, Llama-3-8B widths, 4 layers, 4,096 tokens, bf16", "bench_lora.py",
            ("--arms", "peft_compile,peft_liger,effpass", "--set", "hidden_size=4096", "intermediate_size=14336",
             "num_hidden_layers=4", "num_attention_heads=32", "num_key_value_heads=8", "tie_word_embeddings=false",
             "seq=4096", "steps=8", "warmup=2"), ("--quick", "--arms", "effpass"),
            budget_s=70, arm_deadline_s=30, ref_arm="peft_compile", prewarm_args=("--set", "steps=1", "warmup=1"),
            plan="3 arms x (start 6 s, build on the device 2 s, warm compile 5-8 s (prewarmed), 10 steps of ~0.1 s) ~ 50 s"),
    Section("c", "QLoRA (NF4 base) step, same widths", "bench_qlora_peers.py",
            ("--arms", "peft_bnb_nf4,peft_torchao_nf4,effpass_nf4", "--set", "hidden=4096", "ffn=14336", "layers=4",
             "seq=4096", "steps=8", "warmup=2"), ("--quick", "--arms", "effpass_nf4"),
            budget_s=75, arm_deadline_s=30, ref_arm="peft_bnb_nf4", prewarm_args=("--set", "steps=1", "warmup=0"),
            plan="3 arms x (start 6 s, build + quantize 4 s (bnb: save + reload 8 s), warm compile 5-8 s, 11 steps + "
                 "peak step of ~0.15 s) ~ 65 s"),
    Section("d", "full fine-tuning (AdamW, bf16), Llama-3-8B widths, 4 layers, 4,096 tokens", "bench_full_ft.py",
            ("--arms", "compile,effpass,effpass_planned", "--set", "budget=20GiB"),
            ("--quick", "--arms", "effpass,effpass_planned"), budget_s=65, arm_deadline_s=28,
            ref_arm="compile", prewarm_args=("--set", "steps=1", "warmup=0"),
            plan="3 arms x (start 6 s, build 2 s, warm compile 5-8 s, 11 steps of ~0.1 s; the planned arm loads its "
                 "plan made ahead, bench/plans/) ~ 45 s"),
    Section("e", "attention at 4k/8k/16k tokens, GQA 32/8, head dim 128", "bench_attention.py",
            ("--arms", "sdpa,effpass,naive"), ("--quick", "--arms", "effpass"), budget_s=40, arm_deadline_s=15,
            plan="3 arms x (start 6 s, 3 lengths x (compile 2 s + 20 reps of < 10 ms)) ~ 36 s"),
    Section("f", "packed rows vs padded batches (the varlen path)", "bench_packing.py",
            ("--arms", "padded_sorted,packed_effpass"), ("--quick", "--arms", "packed_effpass", "--set", "examples=6"), budget_s=35,
            arm_deadline_s=17, plan="2 arms x (start 6 s, compile 8 s, ~40 steps of ~20 ms) ~ 30 s"),
    Section("g", "planner vs the device: a planned QLoRA step (NF4 + LoRA, the plan for 12 GiB; host_plan: one that "
                 "holds host memory), 2 layers at 8B widths, device and host peaks", "bench_plan_check.py",
            ("--arms", "predict_measure,cpu_replay,maxseq,host_plan", "--seq", "4096", "8192", "--cap_gib", "12"),
            ("--quick", "--arms", "predict_measure,host_plan"), budget_s=115, arm_deadline_s=45, dtype="bfloat16",
            plan="plans made ahead (bench/plans/): predict_measure 2 x (start 6 s, build 3 s, compile + 2 steps 5 s) + "
                 "cpu_replay 2 x 6 s (the saved figures) + maxseq (6 + 3 + 5 s at its answer) + host_plan 2 x (6 + 3 + "
                 "5 s; its ~20 MB of host copies a step are ms over PCIe) ~ 82 s"),
    Section("h", "pytest -m gpu", "pytest", ("-m", "gpu"), ("-m", "gpu", "--collect-only", "tests/passes/offload_activations"), budget_s=40,
            arm_deadline_s=40, plan="the GPU-marked tests (~16, one a compiled tiny step for the planner), one process"),
)
#: the parallel prewarm on a GPU (its time comes out of the budget; the sections' cold compiles then hit the cache)
PREWARM_S = 100.0
SETUP_S = 20  # wheel install, effpass import check, device query (measured by the shell script's own clock)
#: the whole run's default budget on a GPU: 9 minutes less the set-up (the sections' budgets add up to it)
TOTAL_S = 540 - SETUP_S
#: a dry-run section's deadline on the CPU (smoke shapes; generous: the suite runs it on a loaded 2-core machine)
DRY_SECTION_S = 150.0


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _run_group(cmd: list[str], deadline_s: float, log_path: str, env: dict,
               poll=None) -> tuple[int | None, bool, float]:
    """Run ``cmd`` in its own process group under ``deadline_s``; (returncode, killed, wall seconds). ``poll()`` is
    called every 2 s while it runs (proof.md re-rendered as each arm ends)."""
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=True)
        killed = False
        try:
            while True:
                try:
                    p.wait(timeout=max(0.0, min(2.0, deadline_s - (time.perf_counter() - t0))))
                    break
                except subprocess.TimeoutExpired:
                    if time.perf_counter() - t0 >= deadline_s:
                        raise
                    if poll is not None:
                        poll()
        except subprocess.TimeoutExpired:
            killed = True
            driver._signal_group(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout=driver.KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                driver._signal_group(p.pid, signal.SIGKILL)
                p.wait()
        except BaseException:
            driver._signal_group(p.pid, signal.SIGTERM)
            time.sleep(1)
            driver._signal_group(p.pid, signal.SIGKILL)
            raise
        driver._signal_group(p.pid, signal.SIGKILL)
    return p.returncode, killed, time.perf_counter() - t0


def _pytest_rows(junit: str) -> list[dict]:
    """One row per test of a JUnit XML file (``pytest --junitxml``)."""
    import xml.etree.ElementTree as ET

    if not os.path.exists(junit):
        return []
    rows = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        status = "ok"
        why = ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                status = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                why = (el.get("message") or "")[:300]
        rows.append({"arm": f"{case.get('classname')}::{case.get('name')}", "status": status,
                     "seconds": float(case.get("time") or 0), **({"error": why} if why else {})})
    return rows


def _loss_checks(rows: list[dict], ref_arm: str | None, dtype: str) -> None:
    """Mark rows whose loss drifts from the reference arm's (in place)."""
    def loss(r):
        v = r.get("loss", r.get("loss_first"))
        return v if r.get("status") == "ok" and isinstance(v, (int, float)) else None

    ref = next((r for r in rows if r.get("arm") == ref_arm and loss(r) is not None), None)
    if ref is None:
        ref = next((r for r in rows if loss(r) is not None), None)
    if ref is None:
        return
    tol = LOSS_TOL.get(dtype, 3e-2)
    for r in rows:
        if loss(r) is not None:
            rel = abs(loss(r) - loss(ref)) / max(abs(loss(ref)), 1e-12)
            r["loss_vs_ref"] = {"ref_arm": ref["arm"], "rel_diff": rel, "tol": tol}
            if rel > tol:
                r["loss_drift"] = True


#: the figures proof.md shows, in this order, where a row has them (bytes shown in MiB)
_HEADLINE = ("S", "mode", "median_step_ms", "median_ms", "median_step_s", "step_s", "tokens_per_s", "useful_tokens_per_s",
             "varlen", "tflops", "mfu", "peak_above_start_mib", "peak_mem_gib", "peak_mem_mib", "peak_bytes",
             "padding_fraction", "per_example_rel_error", "seq", "predicted_gib", "measured_gib", "rel_error", "device_ratio",
             "predicted_host_bytes", "measured_host_bytes", "host_ratio", "rss_growth_bytes", "max_seq",
             "measured_gib_at_max_seq", "fits", "plan", "plan_source", "plan_stale", "tokens_per_s_32", "mfu_32", "compile_cold_s",
             "compile_warm_s", "first_step_s", "first_call_s", "graph_breaks", "recompiles", "fused", "fused_sites", "loss",
             "loss_first", "seconds")


def _headline(row: dict) -> dict:
    def mib(k, v):  # bytes in MiB; a host figure that was not measured keeps its reason ("n/a on CPU ...")
        return v / 2**20 if k.endswith("_bytes") and isinstance(v, (int, float)) and not isinstance(v, bool) else v
    return {(k.replace("_bytes", "_mib") if k.endswith("_bytes") else k): mib(k, v) for k in _HEADLINE
            if isinstance(v := row.get(k), (int, float, bool, str))}


def render(lines: list[dict], meta: dict) -> str:
    """``proof.md``: the run's facts, then one table per section (its arms' headline figures)."""
    out = ["# effpass GPU proof", "",
           f"{meta.get('device')}; torch {meta.get('torch')}, triton {meta.get('triton')}, transformers "
           f"{meta.get('transformers')}; CUDA {meta.get('cuda')}, driver {meta.get('gpu_driver')}; effpass commit {str(meta.get('commit'))[:10]}"
           f"{' (dirty tree)' if meta.get('dirty') else ''}; started {meta.get('date')}"
           f"{'; DRY RUN on the CPU at smoke shapes (not a measurement)' if meta.get('dry_run') else ''}.", "",
           "Peers: " + ", ".join(f"{k} {v}" for k, v in (meta.get("peers") or {}).items()) + ".", ""]
    for s in SECTIONS:
        rows = [ln for ln in lines if ln.get("section") == s.key]
        out += [f"## ({s.key}) {s.title}", ""]
        if not rows:
            chosen = meta.get("sections")
            out += ["(not chosen for this run: --only)" if chosen and s.key not in chosen else "(not run yet)", ""]
            continue
        keys: list[str] = []
        for r in rows:
            for k in _headline(r):
                if k not in keys:
                    keys.append(k)
        out += ["| arm | status | " + " | ".join(keys) + " |", "|---|---|" + "---:|" * len(keys)]
        for r in rows:
            status = r.get("status", "?") + (" (loss drifts: not a speed)" if r.get("loss_drift") else "")
            cells = []
            for k in keys:
                v = _headline(r).get(k, "")
                cells.append(f"{v:.4g}" if isinstance(v, float) else str(v))
            out.append(f"| {r.get('arm')} | {status} | " + " | ".join(cells) + " |")
        errs = [r for r in rows if r.get("status") not in ("ok", "skipped") and r.get("error")]
        out += [""] + [f"- {r.get('arm')}: {str(r['error']).strip().splitlines()[-1][:240]}" for r in errs if
                       str(r["error"]).strip()]
        sec = next((r for r in rows if r.get("section_wall_s") is not None), None)
        if sec:
            out += [f"Section wall time {sec['section_wall_s']:.0f} s of its {sec['section_budget_s']:.0f} s budget"
                    f"{' (killed at the section deadline)' if sec.get('section_killed') else ''}.", ""]
    return "\n".join(out) + "\n"


def _gpu_driver(out: str) -> str | None:
    """The NVIDIA driver version (``nvidia-smi``'s line that scripts/gpu_proof.sh wrote to OUTDIR/device.txt)."""
    try:
        with open(os.path.join(out, "device.txt")) as f:
            return f.readline().strip().split(",")[-1].strip() or None
    except OSError:
        return None


def _peer_versions() -> dict:
    return {k: v for k, v in driver.versions(("peft", "liger_kernel", "cut_cross_entropy", "torchao", "bitsandbytes",
                                               "trl", "accelerate")).items()
            if k not in ("python", "torch", "transformers", "triton")}


def _first_step(r: dict):
    v = r.get("first_step_s", r.get("first_call_s"))
    return v if isinstance(v, (int, float)) else None


def compile_times(rows: list[dict], cold: dict) -> None:
    """Each row's cold and warm compile time (in place): its first step's seconds (compile included) is the warm
    one when the prewarm compiled the same arm first (``cold``: (section, arm) -> the prewarm's first step),
    else the cold one."""
    for r in rows:
        first = _first_step(r)
        key = (r.get("section"), r.get("arm"))
        if key in cold:
            r["compile_cold_s"] = cold[key]
            if first is not None:
                r["compile_warm_s"] = first
        elif first is not None:
            r["compile_cold_s"] = first


def _bench_rows(s: Section, stem: str, dry: bool) -> list[dict]:
    """The rows of a bench section's results file so far (one per arm, or per shape), with loss agreement."""
    run = (driver.runs(stem) or [{}])[-1]
    rows = []
    for r in run.get("results", []):
        subs = r.get("rows") if isinstance(r.get("rows"), list) else None
        if subs:  # an arm that measures several shapes (attention): one line per shape
            rows += [{**{k: v for k, v in r.items() if k != "rows"}, **sub, "arm": r.get("arm"),
                      "status": "error" if sub.get("error") else r.get("status")} for sub in subs]
        else:
            rows.append(dict(r))
    for r in rows:  # the packing arm's varlen statistic (the GPU path) on the line itself
        if isinstance(r.get("pack_sequences_stats"), dict):
            r["varlen"] = r["pack_sequences_stats"].get("varlen", 0)
    for r in rows:  # a killed arm: its last partial figures, flattened
        if r.get("status") == "killed" and isinstance(r.get("partial"), dict):
            for k, v in r["partial"].items():
                r.setdefault(k, v)
    _loss_checks(rows, s.ref_arm, "float32" if dry else s.dtype)
    return rows


def run_section(s: Section, out: str, *, dry: bool, deadline_s: float, plant_slow: bool, env: dict,
                progress=None) -> list[dict]:
    """Run one section under ``deadline_s``; its rows (one per arm). ``progress(rows)``: called as arms end."""
    device = "cpu" if dry else "cuda"
    scale = deadline_s / s.budget_s
    arm_deadline = max(5.0, s.arm_deadline_s * scale) if not dry else max(5.0, deadline_s - 5)
    stem = os.path.join(out, f"{s.key}_{os.path.splitext(s.script)[0].removeprefix('bench_')}")
    env = dict(env)
    if plant_slow:
        env["EFFPASS_PROOF_PLANT_SLOW"] = "1"
        arm_deadline = min(arm_deadline, max(3.0, deadline_s / 4))
    if s.script == "pytest":
        junit = stem + ".xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", f"--junitxml={junit}",
               *(s.dry_args if dry else (*s.gpu_args, "tests"))]
    else:
        cmd = [sys.executable, os.path.join(HERE, s.script), "--device", device, "--out", stem, "--label", "proof",
               "--repeats", "1", "--deadline", f"{arm_deadline:.0f}", *(s.dry_args if dry else s.gpu_args)]
    seen = [None]

    def poll():  # an arm ended (the section's results file changed): its rows into proof.md, provisionally
        try:
            m = os.path.getmtime(stem + ".json")
        except OSError:
            return
        if m != seen[0] and progress is not None:
            seen[0] = m
            try:  # a provisional rendering never stops the run
                progress([{**r, "section": s.key, "section_title": s.title} for r in _bench_rows(s, stem, dry)])
            except Exception as e:  # noqa: BLE001
                print(f"gpu_proof: proof.md not re-rendered: {type(e).__name__}: {e}", file=sys.stderr)

    rc, killed, wall = _run_group(cmd, deadline_s, stem + ".log", env, poll=None if s.script == "pytest" else poll)
    if s.script == "pytest":
        rows = _pytest_rows(stem + ".xml")
        if dry:  # --collect-only: the GPU tests exist and collect; none ran
            rows = rows or [{"arm": "collect -m gpu", "status": "ok" if rc in (0, 5) else "error"}]
    else:
        rows = _bench_rows(s, stem, dry)
    if not rows:
        with open(stem + ".log") as f:
            tail = f.read()[-1500:]
        rows = [{"arm": "(section)", "status": "killed" if killed else "error",
                 "error": tail.strip() or f"exit code {rc}"}]
    for r in rows:
        r.update(section=s.key, section_title=s.title, section_wall_s=round(wall, 1), section_budget_s=deadline_s,
                 section_killed=killed, section_rc=rc)
    return rows


def prewarm(sections, out: str, *, dry: bool, seconds: float, env: dict) -> list[dict]:
    """Start the sections that have ``prewarm_args`` at once, each a one-step run of all its arms (in their own
    process groups), so that their cold compiles run in parallel on the machine's cores and fill the compile
    caches the timed sections then read; stop them all at ``seconds``. One line per arm (``phase: prewarm``): its
    first step's time is the cold compile's."""
    device = "cpu" if dry else "cuda"
    procs = []
    for s in sections:
        if not s.prewarm_args or s.script == "pytest":
            continue
        stem = os.path.join(out, "prewarm", f"{s.key}_{os.path.splitext(s.script)[0].removeprefix('bench_')}")
        os.makedirs(os.path.dirname(stem), exist_ok=True)
        cmd = [sys.executable, os.path.join(HERE, s.script), "--device", device, "--out", stem, "--label", "prewarm",
               "--repeats", "1", "--deadline", f"{max(5.0, seconds - 5):.0f}", *(s.dry_args if dry else s.gpu_args),
               *s.prewarm_args]
        log = open(stem + ".log", "w")
        procs.append((s, stem, log, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                                     start_new_session=True)))
    t0 = time.perf_counter()
    for s, stem, log, p in procs:
        try:
            p.wait(timeout=max(0.0, seconds - (time.perf_counter() - t0)))
        except subprocess.TimeoutExpired:
            driver._signal_group(p.pid, signal.SIGTERM)
    for s, stem, log, p in procs:
        try:
            p.wait(timeout=driver.KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            driver._signal_group(p.pid, signal.SIGKILL)
            p.wait()
        driver._signal_group(p.pid, signal.SIGKILL)
        log.close()
    wall = time.perf_counter() - t0
    rows = []
    for s, stem, log, p in procs:
        run = (driver.runs(stem) or [{}])[-1]
        got = [dict(r) for r in run.get("results", [])] or [{"arm": "(section)", "status": "killed",
                                                                "error": f"no arm finished within {seconds:.0f} s"}]
        for r in got:
            rows.append({**{k: v for k, v in r.items() if k != "rows"}, "arm": f"{r.get('arm')} (prewarm)",
                         "phase": "prewarm", "section": s.key, "section_title": s.title,
                         "prewarm_wall_s": round(wall, 1), "prewarm_budget_s": seconds})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("outdir")
    ap.add_argument("--dry-run", action="store_true", help="the CPU rehearsal at smoke shapes")
    ap.add_argument("--only", default="", help="comma-separated sections (default all, a-h)")
    ap.add_argument("--budget", type=float, default=None, help="seconds for all sections (default: their sum)")
    ap.add_argument("--plant-slow", default="", help="a section whose arms sleep past their deadline (a test)")
    ap.add_argument("--prewarm", type=float, default=None,
                    help="seconds for the parallel one-step runs that fill the compile caches first (default: 100 on "
                         "a GPU, 0 in a dry run; counted in the budget)")
    ap.add_argument("--plans", default=None, help="the planned arms' precomputed plans (default bench/plans)")
    args = ap.parse_args(argv)
    keys = [k for k in args.only.split(",") if k] or [s.key for s in SECTIONS]
    bad = [k for k in keys if k not in {s.key for s in SECTIONS}]
    if bad:
        raise SystemExit(f"gpu_proof: unknown section(s) {bad}; choose from {[s.key for s in SECTIONS]}")
    if args.plant_slow and args.plant_slow not in keys:
        raise SystemExit(f"gpu_proof: --plant-slow {args.plant_slow!r} is not among the sections run ({keys})")
    out = os.path.abspath(args.outdir)
    os.makedirs(out, exist_ok=True)
    driver.stop_on_sigterm()
    dry = args.dry_run
    if not dry:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("gpu_proof: no CUDA device here; use --dry-run for the CPU rehearsal")
    chosen = [s for s in SECTIONS if s.key in keys]
    budget = args.budget if args.budget is not None else (
        min(TOTAL_S, sum(s.budget_s for s in chosen)) if not dry else DRY_SECTION_S * len(chosen))
    import torch

    meta = {**driver.meta("gpu_proof", "cpu" if dry else "cuda"), "dry_run": dry, "peers": _peer_versions(),
            "cuda": torch.version.cuda,
            "wheels": sorted(os.listdir(os.path.join(out, "site"))) if os.path.isdir(os.path.join(out, "site")) else [],
            "budget_s": budget, "sections": [s.key for s in chosen]}
    jsonl = os.path.join(out, "proof.jsonl")
    lines: list[dict] = []
    if os.path.exists(jsonl):  # a second command in the same window: keep the first one's lines
        with open(jsonl) as f:
            lines = [json.loads(ln) for ln in f if ln.strip()]
    meta["gpu_driver"] = _gpu_driver(out)
    common = {k: meta[k] for k in ("device", "device_tag", "date", "commit", "dirty", "torch", "triton", "transformers",
                                   "python", "cuda", "gpu_driver", "peers")}
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **({"EFFPASS_BENCH_PLANS": os.path.abspath(args.plans)} if args.plans else {})}
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(out, "inductor-cache"))
    env.setdefault("TRITON_CACHE_DIR", os.path.join(out, "triton-cache"))
    env.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    env.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "1")
    # portable archives too (torch.compiler.save_cache_artifacts after each arm, loaded before each): carried to a
    # later window's fresh machine, they make its first compiles warm
    env.setdefault("EFFPASS_MEGA_CACHE_DIR", os.path.join(out, "mega-cache"))
    def record(rows: list[dict]) -> None:
        """Append ``rows`` to proof.jsonl (with the run's facts) and re-render proof.md."""
        with open(jsonl, "a") as f:
            for r in rows:
                line = {**common, **r, "proof_date": _now()}
                f.write(json.dumps(line, default=str) + "\n")
                lines.append(line)
        driver._write_atomic(os.path.join(out, "proof.md"), render(lines, meta))

    t_start = time.perf_counter()
    driver._write_atomic(os.path.join(out, "proof.md"), render(lines, meta))
    cold: dict = {}
    warm_s = args.prewarm if args.prewarm is not None else (0.0 if dry else PREWARM_S)
    if warm_s > 0 and any(s.prewarm_args for s in chosen):
        rows = prewarm(chosen, out, dry=dry, seconds=min(warm_s, 0.5 * budget), env=env)
        record(rows)
        cold.update({(r["section"], r["arm"].removesuffix(" (prewarm)")): _first_step(r) for r in rows
                     if r.get("status") == "ok" and _first_step(r) is not None})
        print(f"gpu_proof: prewarm {len(rows)} arms [{time.perf_counter() - t_start:.0f} s]", flush=True)
    weights = {s.key: (DRY_SECTION_S if dry else s.budget_s) for s in chosen}
    factor = (budget - (time.perf_counter() - t_start)) / sum(weights.values())
    for i, s in enumerate(chosen):
        left = budget - (time.perf_counter() - t_start)
        # each section's share of the budget, plus what earlier sections left unused (never past the end)
        later = sum(weights[x.key] for x in chosen[i + 1:]) * factor
        deadline = min(max(weights[s.key] * factor, left - later), left)
        if deadline < 5:
            rows = [{"arm": "(section)", "status": "skipped", "error": f"out of time ({left:.0f} s left of {budget:.0f})",
                     "section": s.key, "section_title": s.title}]
        else:
            rows = run_section(s, out, dry=dry, deadline_s=deadline, plant_slow=args.plant_slow == s.key, env=env,
                               progress=lambda rows: driver._write_atomic(os.path.join(out, "proof.md"),
                                                                          render(lines + rows, meta)))
            compile_times(rows, cold)
        record(rows)
        print(f"gpu_proof: ({s.key}) {len(rows)} rows, {sum(r.get('status') == 'ok' for r in rows)} ok "
              f"[{time.perf_counter() - t_start:.0f} s]", flush=True)
    with open(os.path.join(out, "proof_meta.json"), "w") as f:
        json.dump({**meta, "wall_s": round(time.perf_counter() - t_start, 1)}, f, indent=1, default=str)
    print(f"gpu_proof: wrote {os.path.join(out, 'proof.jsonl')} and proof.md", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
