"""Trainer sharding an effpass-compiled model through accelerate's FSDP2 plugin (2 CPU ranks, gloo): the same
losses as one process, effpass recompiles per FSDP unit, checkpoints save and resume (examples/accelerate_fsdp2.py)."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from _paths import ROOT  # noqa: E402  (the repository's root)
SCRIPT = os.path.join(ROOT, "examples", "accelerate_fsdp2.py")
CONFIG = os.path.join(ROOT, "examples", "accelerate_fsdp2.yaml")
pytest.importorskip("accelerate")


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", PYTHONWARNINGS="default")
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    return env


def _launch(out, *extra, procs=2):
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", CONFIG, "--num_processes", str(procs),
           "--main_process_port", "0", SCRIPT, "--out", str(out), *extra]
    r = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"rc {r.returncode}\nstdout: {r.stdout[-2000:]}\nstderr: {r.stderr[-6000:]}"
    with open(os.path.join(out, "losses.json")) as f:
        return json.load(f), r.stderr


def _single(out, *extra):
    r = subprocess.run([sys.executable, SCRIPT, "--out", str(out), *extra], env=_env(), capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    with open(os.path.join(out, "losses.json")) as f:
        return json.load(f)


def test_trainer_with_accelerate_fsdp2_matches_one_process_and_resumes(tmp_path):
    sharded, log = _launch(tmp_path / "fsdp2")
    single = _single(tmp_path / "single", "--batch", "4")  # 2 ranks x 2 examples = the same 4 examples
    assert sharded["world_size"] == 2 and single["world_size"] == 1
    assert sharded["sharded_params"] > 0  # parameters are DTensor shards: FSDP2 really ran, not DDP
    assert sharded["adopted_fsdp"]["compiled_units"] >= 2  # effpass recompiled inside each FSDP unit
    for step, loss in single["losses"].items():
        assert abs(sharded["losses"][step] - loss) <= 1e-5 * abs(loss), (step, sharded["losses"], single["losses"])
    # accelerate shards the final norm and the head as a unit of their own: the head cannot be fused; said loudly
    assert sharded["fused_cross_entropy"] == 0 and "runs unfused" in log

    # kill after the checkpoint at step 2 (here: drop what came after it) and resume to step 4
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "fsdp2", resumed)
    shutil.rmtree(resumed / "checkpoint-4")
    os.remove(resumed / "losses.json")
    again, _ = _launch(resumed, "--resume")
    for step in ("3", "4"):
        assert abs(again["losses"][step] - sharded["losses"][step]) <= 1e-5 * abs(sharded["losses"][step])
    assert again["steps_run"] == [3, 4] and sharded["steps_run"] == [1, 2, 3, 4]  # resumed, not started over
