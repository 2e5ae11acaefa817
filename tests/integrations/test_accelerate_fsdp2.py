"""Trainer sharding an effpass-compiled model through accelerate's FSDP2 plugin (2 CPU ranks, gloo): the same
losses as one process, effpass recompiles per FSDP unit, checkpoints save and resume (examples/accelerate_fsdp2.py).

One ``accelerate launch`` (the documented command); the one-process run and the resumed relaunch run the script on
processes forked from the preloaded fork server (tests/_ranks.py), the relaunch's ranks with the environment
accelerate's launcher computes for the same command (each fresh interpreter costs ~8 CPU-s of imports)."""
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


def _run_script(rank, argv, env, world):
    """``python examples/accelerate_fsdp2.py ARGV`` (the script as ``__main__``) as rank ``rank`` of ``world``, in a
    process forked from the preloaded fork server (tests/_ranks.py): the script's code in a fresh interpreter
    state, without a fresh interpreter's imports of torch, transformers and effpass (~8 CPU-s a process)."""
    import runpy

    import torch

    os.environ.update(env)
    if world > 1:   # what torchrun gives each of its workers
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank),
                          WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), ROLE_WORLD_SIZE=str(world))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    sys.argv = [SCRIPT, *argv]
    runpy.run_path(SCRIPT, run_name="__main__")


def _launch_env(procs):
    """The environment ``accelerate launch --config_file CONFIG --num_processes N`` gives the torchrun that starts
    its ranks: accelerate's own launch-command validation and ``prepare_multi_gpu_env``, as its
    ``multi_gpu_launcher`` calls them (with a free port), over _env(); and the rendezvous address."""
    from unittest import mock

    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    with mock.patch.dict(os.environ, _env(), clear=True):
        args = launch_command_parser().parse_args(["--config_file", CONFIG, "--num_processes", str(procs),
                                                   "--main_process_port", "0", SCRIPT])
        args = _validate_launch_command(args)[0]
        assert args.use_fsdp and not args.cpu, args   # launch_command's branch: multi_gpu_launcher
        env = prepare_multi_gpu_env(args)
    return {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(args.main_process_port)}


def _forked_launch(out, *extra, procs=2):
    """What _launch runs, on ranks forked from the preloaded fork server with the launch's environment (the
    launcher's own start and the ranks' imports cost more than the ranks' 2 steps)."""
    from _ranks import spawn_ranks

    spawn_ranks(_run_script, lambda: (["--out", str(out), *extra], _launch_env(procs), procs), procs)
    with open(os.path.join(out, "losses.json")) as f:
        return json.load(f)


def _single(out, *extra):
    """The one-process run (``python examples/accelerate_fsdp2.py``), forked from the preloaded fork server."""
    from _ranks import spawn_ranks

    spawn_ranks(_run_script, (["--out", str(out), *extra], _env(), 1), 1)
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
    # the relaunch: the same launch's ranks, forked (the documented `accelerate launch` ran above)
    again = _forked_launch(resumed, "--resume")
    for step in ("3", "4"):
        assert abs(again["losses"][step] - sharded["losses"][step]) <= 1e-5 * abs(sharded["losses"][step])
    assert again["steps_run"] == [3, 4] and sharded["steps_run"] == [1, 2, 3, 4]  # resumed, not started over
    assert again["world_size"] == 2 and again["sharded_params"] == sharded["sharded_params"]  # FSDP2 again
