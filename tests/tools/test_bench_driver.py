"""bench/driver.py, the plumbing every bench script shares: one process per arm, a deadline that ends the arm's
whole process group and keeps what it printed, a row appended after every arm, "not installed" without starting,
results files named by workload and device. A fake script stands in for a bench (no torch in the arms)."""
import importlib.util
import json
import os
import textwrap

import pytest

from _paths import ROOT  # noqa: E402  (the repository's root)


@pytest.fixture(scope="module")
def driver():
    spec = importlib.util.spec_from_file_location("bench_driver_under_test", os.path.join(ROOT, "bench", "driver.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


FAKE = textwrap.dedent('''
    import os, subprocess, sys, time
    sys.path.insert(0, {bench!r})
    import driver

    def worker(arm, cfg, device):
        if arm == "crash":
            raise RuntimeError("the arm broke")
        if arm == "slow":
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
            open(cfg["pidfile"], "w").write(str(child.pid))
            driver.partial({{"arm": arm, "step": 1}})
            time.sleep(120)
        return {{"arm": arm, "value": cfg["x"] * 2}}

    if __name__ == "__main__":
        driver.main(__file__, workload="fake", arms=("ok", "crash", "needs", "slow"), worker=worker, cpu_shape={{"x": 1}})
''')


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "State:\tZ" not in f.read()
    except FileNotFoundError:
        return False


def test_arms_in_processes_deadline_not_installed_and_append_per_arm(driver, tmp_path, monkeypatch):
    script = tmp_path / "bench_fake.py"
    script.write_text(FAKE.format(bench=os.path.join(ROOT, "bench")))
    monkeypatch.setattr(driver, "meta", lambda workload, device, packages=(): {
        "workload": workload, "device": "test", "device_tag": "cpu", "date": "2026-01-01T00:00:00", "commit": "c",
        "dirty": False, "load_average": [0.0], "argv": []})
    stem = str(tmp_path / "fake_cpu")
    seen = []  # rows in the file when each arm's row is about to be appended

    def log(row):
        seen.append(len(driver.latest(stem)["results"]) if driver.load(stem) else None)
        return row

    jobs = [("ok", {}), ("crash", {}), ("needs", {}), ("slow", {}), ("ok", {})]
    cfg = {"x": 21, "pidfile": str(tmp_path / "pid")}
    run = driver.run(str(script), workload="fake", jobs=jobs, cfg=cfg, device="cpu", stem=stem, deadline_s=8,
                     requires={"needs": ("effpass_no_such_package",)}, log=log)
    st = {r["arm"] + str(i): r for i, r in enumerate(run["results"])}
    assert [r["status"] for r in run["results"]] == ["ok", "error", "not installed", "killed", "ok"]
    assert st["ok0"]["value"] == 42 and st["ok0"]["wall_s"] > 0
    assert "the arm broke" in st["crash1"]["error"]
    assert "effpass_no_such_package" in st["needs2"]["error"] and "wall_s" not in st["needs2"]  # never started
    assert st["slow3"]["partial"] == {"arm": "slow", "step": 1} and "deadline of 8 s" in st["slow3"]["error"]
    assert not _alive(int((tmp_path / "pid").read_text())), "the killed arm's child outlived its deadline"
    assert seen == [0, 1, 2, 3, 4], "a row is written after every arm, not at the end"
    doc = json.loads((tmp_path / "fake_cpu.json").read_text())
    assert doc["workload"] == "fake" and doc["device"] == "cpu" and len(doc["runs"]) == 1
    assert "cpu" in (tmp_path / "fake_cpu.md").read_text() and "killed" in (tmp_path / "fake_cpu.md").read_text()
    # a second run appends to the same file; the newest run of a label wins
    driver.run(str(script), workload="fake", jobs=[("ok", {})], cfg=cfg, device="cpu", stem=stem, label="again")
    assert [r["label"] for r in driver.runs(stem)] == ["", "again"]
    assert driver.latest(stem)["results"][0]["value"] == 42 and driver.latest(stem, "again") is not None


def test_device_tags_and_result_names(driver):
    assert driver.cuda_tag("NVIDIA H100 80GB HBM3") == "cuda-h100"
    assert driver.cuda_tag("NVIDIA H200") == "cuda-h200"
    assert driver.cuda_tag("NVIDIA A100-SXM4-80GB") == "cuda-a100"
    assert driver.result_stem("fake", "cpu").endswith(os.path.join("bench", "results", "fake_cpu"))


def test_results_files_follow_the_scheme(driver):
    """Every committed results file is <workload>_<device>.json with its .md, holds runs, and no script or
    machine path lives under bench/results/."""
    import re

    results = os.path.join(ROOT, "bench", "results")
    names = [n for n in os.listdir(results) if os.path.isfile(os.path.join(results, n))]
    for n in names:
        assert re.fullmatch(r"[a-z0-9_]+_(cpu|cuda-[a-z0-9]+)\.(json|md)", n), f"results file {n!r} breaks the scheme"
        if n.endswith(".json"):
            assert n[:-5] + ".md" in names, f"{n} has no .md"
            assert "runs" in driver.load(os.path.join(results, n)), f"{n} has no runs"
    for dirpath, _, files in os.walk(results):
        for n in files:
            assert not n.endswith((".py", ".sh")), f"a script under bench/results/: {os.path.join(dirpath, n)}"
            with open(os.path.join(dirpath, n), errors="replace") as f:
                assert "/work/" not in f.read(), f"a machine path in {os.path.join(dirpath, n)}"


def test_every_bench_script_is_on_the_driver():
    """No bench script spawns and records its own arms: each one goes through bench/driver.py."""
    import re

    bench = os.path.join(ROOT, "bench")
    scripts = sorted(n for n in os.listdir(bench) if n.startswith("bench_") and n.endswith(".py")) + ["suite_times.py"]
    assert len(scripts) > 20
    for n in scripts:
        with open(os.path.join(bench, n)) as f:
            src = f.read()
        assert "import driver" in src and "driver." in src, f"bench/{n} is not on bench/driver.py"
        assert not re.search(r"RESULTS|os\.path\.join\([^)]*\"results\"", src), f"bench/{n} writes its own results file"


def test_a_stopped_driver_ends_its_running_arm(tmp_path):
    """SIGTERM to the driver (as `timeout` sends it) ends the arm's process group too: a GPU is never left busy."""
    import signal
    import subprocess
    import time

    script = tmp_path / "bench_fake.py"
    script.write_text(FAKE.format(bench=os.path.join(ROOT, "bench")))
    parent = tmp_path / "parent.py"
    parent.write_text(textwrap.dedent(f'''
        import sys
        sys.path.insert(0, {os.path.join(ROOT, "bench")!r})
        import driver
        driver.meta = lambda workload, device, packages=(): {{"workload": workload, "device_tag": "cpu", "date": "x"}}
        driver.run({str(script)!r}, workload="fake", jobs=[("slow", {{}})], device="cpu", deadline_s=600,
                   stem={str(tmp_path / "fake_cpu")!r}, cfg={{"x": 1, "pidfile": {str(tmp_path / "pid")!r}}})
    '''))
    import sys

    p = subprocess.Popen([sys.executable, str(parent)])
    pidfile = tmp_path / "pid"
    for _ in range(600):
        if pidfile.exists() and pidfile.read_text():
            break
        time.sleep(0.1)
    grandchild = int(pidfile.read_text())
    assert _alive(grandchild)
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=60) != 0
    for _ in range(100):
        if not _alive(grandchild):
            break
        time.sleep(0.1)
    assert not _alive(grandchild), "the arm's process group outlived the stopped driver"


def test_suite_cpu_summary_adds_up_and_leaves_out_the_controllers_double_count(tmp_path):
    """`suite_times.py --suite-cpu DIR`: per-file and per-band sums equal the records, the xdist controller's own
    line (which counts its workers again) is left out of the processes' CPU, and the recorded commit is kept."""
    import json
    import sys

    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import suite_times

    recs = {"gw0": [("tests/a/test_x.py::test_one", 0.3), ("tests/a/test_x.py::test_two[p]", 12.0)],
            "gw1": [("tests/b/test_y.py::test_three", 3.5), ("tests/a/test_x.py::test_four", 25.0)]}
    for worker, rows in recs.items():
        lines = [json.dumps({"test": t, "cpu_s": c, "wall_s": c, "load": 1.0}) for t, c in rows]
        lines.append(json.dumps({"session": True, "cpu_s": 50.0, "commit": "abc123", "dirty": worker == "gw1"}))
        (tmp_path / f"{worker}.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "main.jsonl").write_text(json.dumps({"session": True, "cpu_s": 101.0, "commit": "abc123", "dirty": False}) + "\n")
    row = suite_times.suite_cpu(str(tmp_path), top=2)
    assert row["tests"] == 4 and row["cpu_s"] == 40.8 and row["process_cpu_s"] == 100.0
    assert row["tested_commit"] == "abc123"
    assert row["tested_tree_dirty"] is None  # the workers disagree: not claimed clean
    gw1 = (tmp_path / "gw1.jsonl").read_text().replace('"dirty": true', '"dirty": false')
    (tmp_path / "gw1.jsonl").write_text(gw1)
    assert suite_times.suite_cpu(str(tmp_path), top=2)["tested_tree_dirty"] is False
    assert row["per_file"] == [{"file": "tests/a/test_x.py", "tests": 3, "cpu_s": 37.3},
                               {"file": "tests/b/test_y.py", "tests": 1, "cpu_s": 3.5}]
    assert {b["from_s"]: (b["tests"], b["cpu_s"]) for b in row["by_band"] if b["tests"]} == {
        0: (1, 0.3), 2: (1, 3.5), 10: (1, 12.0), 20: (1, 25.0)}
    assert [t["test"] for t in row["top"]] == ["tests/a/test_x.py::test_four", "tests/a/test_x.py::test_two[p]"]
    assert len(row["every_test"]) == 4
    md = suite_times.markdown({"meta": {"date": "d", "device": "cpu", "torch": "t"}, "shape": {"suite_cpu": True},
                               "results": [row]})
    assert "| tests/a/test_x.py | 3 | 37.3 |" in md and "tested commit abc123" in md
