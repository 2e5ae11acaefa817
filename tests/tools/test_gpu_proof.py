"""The GPU proof kit (scripts/gpu_proof.sh, bench/gpu_proof.py) rehearsed on the CPU: the sections the commit samples (tests/_sweep.py; all eight with EFFPASS_TEST_SWEEP=full) run
through the same code paths as on a GPU (the wheel install with a stand-in wheel, one process group per section
and per arm, deadlines, rows appended per section, loss agreement, rendering), and a planted slow arm is killed
at its deadline with its partial figures kept."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile

import pytest

from _paths import ROOT
from _sweep import sample

#: the sections the dry run rehearses: (a), the most valuable, always; a third of the others by the commit
#: (tests/_sweep.py: successive commits cover the rest; EFFPASS_TEST_SWEEP=full runs all eight)
SECTIONS = sample(list("abcdefgh"))

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("gpu_proof")]


def _standin_wheel(folder) -> str:
    """A minimal wheel (one module), as the peers' wheels travel to a machine without a network."""
    name = "effpass_proof_standin"
    path = os.path.join(folder, f"{name}-0.1-py3-none-any.whl")
    files = {f"{name}/__init__.py": "VALUE = 42\n",
             f"{name}-0.1.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n",
             f"{name}-0.1.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{k},,\n" for k in files) + f"{name}-0.1.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for k, v in files.items():
            z.writestr(k, v)
        z.writestr(f"{name}-0.1.dist-info/RECORD", record)
    return path


def _lines(out) -> list[dict]:
    with open(os.path.join(out, "proof.jsonl")) as f:
        return [json.loads(ln) for ln in f if ln.strip()]


def _env(**extra):
    env = {**os.environ, "EFFPASS_PROOF_PYTHON": sys.executable, "OMP_NUM_THREADS": "1", **extra}
    env.pop("PYTEST_XDIST_WORKER", None)
    return env


def _proof(out: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    """``python bench/gpu_proof.py OUT ARGS...`` (the driver itself, without the shell script's install step)."""
    return subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu_proof.py"), out, *args], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=timeout)


#: the planned sections' dry-run arms and the script that makes their plans ahead (bench/plans.py)
PLANNED = {"d": ("bench_full_ft.py", "effpass,effpass_planned"), "g": ("bench_plan_check.py", "predict_measure,host_plan")}


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    wheels = tmp_path_factory.mktemp("wheels")
    _standin_wheel(str(wheels))
    out = str(tmp_path_factory.mktemp("proof"))
    plans = os.path.join(out, "plans")  # the plans made first (section g's test reads them back)
    for key in set(PLANNED) & set(SECTIONS):  # the planned arms' plans made first, as for a GPU window
        script, arms = PLANNED[key]
        p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", script), "--quick", "--device", "cpu",
                            "--arms", arms, "--make-plans", "--plans", plans], cwd=ROOT, env=_env(),
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0 and "wrote " in p.stdout, p.stdout[-2000:] + p.stderr[-2000:]
    p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "gpu_proof.sh"), out, "--dry-run", "--only",
                        ",".join(SECTIONS), "--plans", plans], cwd=ROOT,
                       env=_env(EFFPASS_PROOF_WHEELS=str(wheels)), capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return out


def test_dry_run_has_every_section_with_its_status(dry_run):
    lines = _lines(dry_run)
    by = {}
    for ln in lines:
        by.setdefault(ln["section"], []).append(ln)
    assert sorted(by) == SECTIONS
    for key, rows in by.items():
        assert all(r["status"] == "ok" for r in rows), (key, [(r.get("arm"), r.get("status"), str(r.get("error"))[-300:])
                                                              for r in rows])
        assert all(r["commit"] and r["torch"] and r["device"] and r["proof_date"] for r in rows)
        assert all(r["section_wall_s"] <= r["section_budget_s"] + 15 for r in rows)
    # every measured arm records its graph breaks and recompiles (a section's figures are read with them)
    for key in set("abcdefg") & set(SECTIONS):
        assert all(isinstance(r.get("graph_breaks"), int) and isinstance(r.get("recompiles"), int)
                   for r in by[key]), key
    # the figures each section exists for
    head = {r["arm"]: r for r in by["a"]}
    assert head["effpass"]["fused_sites"] == 1 and head["effpass"]["peak_above_start_bytes"] > 0
    assert head["effpass"]["loss_vs_ref"]["rel_diff"] <= 1e-4 and not head["effpass"].get("loss_drift")
    # each arm's compile time: cold (no prewarm in this run: its own first step), and the run's facts on every line
    assert all(r["compile_cold_s"] > 0 and "compile_warm_s" not in r for k in set("abcdf") & set(SECTIONS)
               for r in by[k]), [(r["arm"], r.get("compile_cold_s")) for k in by for r in by[k]]
    assert all("gpu_driver" in r and "cuda" in r and isinstance(r["peers"], dict) for r in lines)
    # b, c, d: tokens/s, and the 32-layer extrapolation's arithmetic (MFU itself only on a GPU: None here)
    for key in set("bcd") & set(SECTIONS):
        for r in by[key]:
            assert r["tokens_per_s"] > 0 and 0 < r["tokens_per_s_32"] < r["tokens_per_s"], (key, r)
            assert r["rest_share_32"] < r["rest_share"] and r["mfu_32"] is None, (key, r)
    if "d" in by:  # full fine-tuning: effpass default and the planner's plan for the stated budget, same loss
        d = {r["arm"]: r for r in by["d"]}
        assert set(d) == {"effpass", "effpass_planned"} and d["effpass_planned"]["budget"] == "48MiB"
        assert d["effpass_planned"]["plan"] and d["effpass_planned"]["predicted_peak_bytes"] > 0
        assert d["effpass_planned"]["loss_vs_ref"]["rel_diff"] <= 1e-4
        # the plan made ahead was loaded (same tree: not stale), not replanned in the arm
        assert d["effpass_planned"]["plan_source"] == "precomputed" and d["effpass_planned"]["plan_stale"] is False
    if "c" in by:
        assert by["c"][0]["peak_bytes"] > 0
    if "e" in by:
        assert {r["S"] for r in by["e"]} and all(r["fused"] >= 1 for r in by["e"] if r["mode"] != "-")
    if "f" in by:
        packed = by["f"][0]
        assert packed["pack_sequences_stats"]["packed_rows"] >= 1 and packed["padding_fraction"] == 0.0
        assert packed["per_example_rel_error"] < 1e-4 and "varlen" in packed  # the varlen statistic (> 0 on a GPU)
    if "g" in by:  # planned QLoRA steps: the plan's prediction against the measured peak, device and host
        _check_section_g(by["g"], dry_run)


def _check_section_g(rows: list[dict], out: str) -> None:
    """Section g's rows: per arm and length the device figures (predicted, measured, their ratio) and the host ones
    (predicted: the saved plan's host bytes; measured on a CPU: "n/a on CPU", never a number), in proof.md and in
    the section's own table."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import plans as bench_plans

    assert {r["arm"] for r in rows} == {"predict_measure", "host_plan"}, [r["arm"] for r in rows]
    saved = [json.load(open(os.path.join(out, "plans", f))) for f in os.listdir(os.path.join(out, "plans"))]
    for g in rows:
        assert g["predicted_bytes"] > 0 and g["measured_bytes"] > 0 and g["plan"] and g["fits_cap"]
        assert abs(g["rel_error"]) < 0.25 and g["device_ratio"] == g["measured_bytes"] / g["predicted_bytes"]
        assert g["plan_source"] == "precomputed" and g["plan_stale"] is False and g["plan_cpu_s"] > 0
        # the host plan's own pipeline (the user's passes with checkpointing, the fused loss, tiles), its own plan file
        host = g["arm"] == "host_plan"
        (doc,) = [d for d in saved if d["key"]["seq"] == g["seq"] and ("user_passes" in d["key"]) == host]
        assert ("checkpoint_activations" in [p["name"] for p in doc["record"]["passes"]]) == host
        # numerical: the predicted host bytes are the planner's figure for the saved plan (a CPU plan holds none)
        assert g["predicted_host_bytes"] == doc["record"]["host_bytes"] == bench_plans.host_bytes_of(doc["record"]) == 0
        # structural: on the CPU every measured host figure says why it is not one
        for k in ("measured_host_bytes", "measured_host_active_bytes", "rss_growth_bytes", "host_ratio", "host_measure"):
            assert isinstance(g[k], str) and g[k].startswith("n/a on CPU"), (k, g[k])
    md = open(os.path.join(out, "proof.md")).read()
    sec = md[md.index("## (g) "):].split("\n## ")[0]
    assert "predicted_host_mib" in sec and "measured_host_mib" in sec and "host_ratio" in sec and "n/a on CPU" in sec
    table = open(os.path.join(out, "g_plan_check.md")).read()
    assert "| predicted host (MiB) | measured host: pinned peak (MiB) | host measured/predicted |" in table
    assert table.count("| host_plan |") == 1 and table.count("| predict_measure |") == 1 and "| n/a on CPU" in table


def test_dry_run_installs_the_carried_wheels_and_renders(dry_run):
    site = os.path.join(dry_run, "site")
    assert os.path.isfile(os.path.join(site, "effpass_proof_standin", "__init__.py"))
    meta = json.load(open(os.path.join(dry_run, "proof_meta.json")))
    assert any(w.startswith("effpass_proof_standin") for w in meta["wheels"]) and meta["dry_run"]
    md = open(os.path.join(dry_run, "proof.md")).read()
    assert "DRY RUN" in md and "(not run yet)" not in md
    assert md.count("(not chosen for this run: --only)") == 8 - len(SECTIONS)
    for key in SECTIONS:
        assert f"## ({key}) " in md
    # each section's own results file, in the bench driver's format
    assert json.load(open(os.path.join(dry_run, "a_loss_head.json")))["runs"][-1]["label"] == "proof"


def test_planted_slow_arm_is_killed_and_its_partial_kept(tmp_path):
    """Deadlines: the arms of a planted slow section sleep past their deadline; the bench driver kills each arm's
    process group, the row keeps the partial figures the arm printed, and proof.md says killed."""
    out = str(tmp_path)
    p = _proof(out, "--dry-run", "--only", "a", "--plant-slow", "a", "--budget", "40", timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rows = _lines(out)
    assert {r["arm"] for r in rows} == {"eager", "effpass"}
    for r in rows:
        assert r["status"] == "killed" and r["planted_slow"] is True and "deadline" in r["error"]
        assert r["wall_s"] < 30 and r["section_wall_s"] <= 45
    assert "| eager | killed |" in open(os.path.join(out, "proof.md")).read()


def test_unknown_section_is_refused_before_anything_runs(tmp_path):
    p = _proof(str(tmp_path), "--dry-run", "--only", "a,z", timeout=120)
    assert p.returncode != 0 and "unknown section(s) ['z']" in p.stderr and "'a'" in p.stderr
    assert not os.path.exists(os.path.join(tmp_path, "proof.jsonl"))


def test_peer_table_takes_gpu_rows_from_proof_lines_and_marks_stale_ones():
    """bench/peer_table.py: effpass's arm against each peer of the same section and run (memory, time), a drifting
    loss not compared, a run measured before a change to effpass/ or passes/ marked stale."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import peer_table

    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    first = subprocess.run(["git", "-C", ROOT, "rev-list", "--max-parents=0", "HEAD"], capture_output=True,
                           text=True).stdout.split()[0]

    def line(arm, commit, date, **kw):
        return {"section": "a", "section_title": "loss head", "arm": arm, "status": "ok", "device_tag": "cuda-h200",
                "device": "NVIDIA H200", "commit": commit, "date": date, **kw}

    fresh = [line("compile", head, "2026-12-01", median_step_ms=10.0, peak_above_start_bytes=4 << 30),
             line("effpass", head, "2026-12-01", median_step_ms=8.0, peak_above_start_bytes=1 << 30),
             line("liger", head, "2026-12-01", median_step_ms=7.0, peak_above_start_bytes=1 << 30, loss_drift=True)]
    rows: list = []
    peer_table.gpu_proof(rows, fresh)
    by = {r[1]: r for r in rows}
    assert by["compile"][2].startswith("0.25x (1,024 vs 4,096 MiB)") and by["compile"][3] == "0.80x step time"
    assert "stale" not in by["compile"][4] and "commit " + head[:10] in by["compile"][4]
    assert "loss drifts" in by["liger"][2] and by["liger"][3] == ""
    old = [dict(x, commit=first, date="2026-11-01", device_tag="cuda-h100") for x in fresh[:2]]
    rows = []
    peer_table.gpu_proof(rows, old)
    assert len(rows) == 1 and f"stale: effpass/passes changed since {first[:10]}" in rows[0][4]
    rows = []
    peer_table.gpu_proof(rows, [])
    assert rows[0][2] == "not run on a GPU yet"


def test_prewarm_runs_one_step_of_each_section_first(tmp_path):
    """--prewarm: the sections with a one-step form start together before the timed sections (their cold
    compiles in parallel, filling the caches the timed runs read); each arm's prewarm line says so and carries
    its first step's time, and the timed lines follow."""
    out = str(tmp_path)
    p = _proof(out, "--dry-run", "--only", "a", "--prewarm", "90", "--budget", "300", timeout=400)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rows = _lines(out)
    warm = [r for r in rows if r.get("phase") == "prewarm"]
    timed = [r for r in rows if r.get("phase") != "prewarm"]
    assert {r["arm"] for r in warm} == {"eager (prewarm)", "effpass (prewarm)"}
    assert all(r["status"] == "ok" and r["first_step_s"] > 0 and r["steps"] == 1 for r in warm)
    assert rows.index(warm[-1]) < rows.index(timed[0]) and {r["arm"] for r in timed} == {"eager", "effpass"}
    assert all(r["status"] == "ok" for r in timed)
    # cold compile from the prewarm's first step, warm from the timed run's own
    first = {r["arm"].removesuffix(" (prewarm)"): r["first_step_s"] for r in warm}
    assert all(r["compile_cold_s"] == first[r["arm"]] and r["compile_warm_s"] == r["first_step_s"] for r in timed)
    assert "effpass (prewarm)" in open(os.path.join(out, "proof.md")).read()
