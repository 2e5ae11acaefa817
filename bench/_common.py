"""Shared by the bench/ scripts: models, batches, timing one step the same way on every device, and the
command line of the peer benches (each arm in a fresh process, results written after every arm)."""
from __future__ import annotations

import time
from typing import Callable

import torch


def timed(step: Callable[[], object], cuda: bool) -> float:
    """Seconds one call of ``step`` takes: CUDA events on a GPU, ``perf_counter`` on the CPU."""
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3
    t = time.perf_counter()
    step()
    return time.perf_counter() - t


def meta(device: str, packages: tuple[str, ...] = ()) -> dict:
    """Device, date, load average and versions (torch, transformers, triton and ``packages``) of a run;
    a package that does not import is recorded as ``"not installed: <why>"``."""
    import datetime
    import importlib
    import os
    import platform

    dev = torch.cuda.get_device_name() if device == "cuda" else \
        f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, shared)"
    info = {"device": dev, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "python": platform.python_version(), "torch": torch.__version__,
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}
    for name in ("transformers", "triton") + tuple(packages):
        try:
            info[name] = getattr(importlib.import_module(name), "__version__", "?")
        except Exception as e:  # noqa: BLE001 - recorded, not raised: the arm that needs it says so
            info[name] = f"not installed: {type(e).__name__}: {str(e)[:120]}"
    return info


def run_arm_subprocess(script: str, arm: str, args: list[str], env: dict | None = None) -> dict:
    """Runs ``script --worker arm *args`` in a fresh process; its last stdout line starting with ``{`` is the
    arm's result. A crash becomes ``{"arm": arm, "error": <the last lines of stderr>}``."""
    import json
    import os
    import subprocess
    import sys

    p = subprocess.run([sys.executable, script, "--worker", arm, *args], capture_output=True, text=True,
                       env={**os.environ, **(env or {})})
    line = next((ln for ln in reversed(p.stdout.splitlines()) if ln.startswith("{")), None)
    if line:
        return json.loads(line)
    err = [ln for ln in p.stderr.splitlines() if ln.strip() and "_pytree" not in ln and "Failed to load" not in ln]
    return {"arm": arm, "error": "\n".join(err[-15:])}


def llama(cfg: dict, device: str, *, tie: bool | None = None, train: bool = True):
    """A Llama-shaped Hugging Face model with random weights (seed 0, SDPA attention) from a bench shape
    (``vocab``, ``hidden``, ``ffn``, ``layers``, ``heads``, ``kv_heads``, ``seq``, ``dtype``)."""
    import transformers as tf

    torch.manual_seed(0)
    extra = {} if tie is None else {"tie_word_embeddings": tie}
    conf = tf.LlamaConfig(vocab_size=cfg["vocab"], hidden_size=cfg["hidden"], intermediate_size=cfg["ffn"],
                          num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"],
                          num_key_value_heads=cfg["kv_heads"], max_position_embeddings=cfg["seq"],
                          bos_token_id=0, eos_token_id=0, use_cache=False, **extra)
    conf._attn_implementation = "sdpa"
    model = tf.LlamaForCausalLM(conf).to(device=device, dtype=getattr(torch, cfg["dtype"]))
    return model.train(train)


def token_batches(cfg: dict, device: str, n: int = 1) -> list:
    """``n`` random ``[batch, seq]`` token batches (generator seed 1)."""
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g).to(device) for _ in range(n)]


def time_steps(step: Callable[[], object], cfg: dict, cuda: bool) -> dict:
    """The first call's seconds, then ``cfg["warmup"]`` calls, then the median wall and CPU seconds of
    ``cfg["steps"]`` calls (and each call's, ``steps_s`` / ``steps_cpu_s``)."""
    import statistics

    t0 = time.perf_counter()
    step()
    if cuda:
        torch.cuda.synchronize()
    first = time.perf_counter() - t0
    for _ in range(cfg["warmup"]):
        step()
    times, cpu = [], []
    for _ in range(cfg["steps"]):
        c0 = time.process_time()
        times.append(timed(step, cuda))
        cpu.append(time.process_time() - c0)
    return {"first_call_s": first, "step_s": statistics.median(times), "cpu_s": statistics.median(cpu),
            "steps_s": times, "steps_cpu_s": cpu}


def arm_main(script: str, *, arms: tuple[str, ...], cpu_shape: dict, gpu_shape: dict, worker: Callable,
             markdown: Callable[[dict], str], name: str, packages: tuple[str, ...] = (),
             overrides: tuple[str, ...] = ("steps",), env: dict | None = None,
             after_arm: Callable[[dict], None] | None = None, log: Callable[[dict], dict] = lambda r: r) -> None:
    """The command line every peer bench shares: ``--arms a,b`` (each arm in a fresh process: ``--worker``),
    ``--out`` (default ``bench/results/<name>_<device>``) and ``--<key>`` for each shape key in
    ``overrides``. Writes ``.json`` and ``.md`` after every arm, so a crash keeps the arms before it."""
    import argparse
    import json
    import os

    ap = argparse.ArgumentParser(description=(__import__("sys").modules["__main__"].__doc__ or "").split("\n")[0])
    ap.add_argument("--arms", default=",".join(arms))
    for k in overrides:
        ap.add_argument(f"--{k}", type=type(cpu_shape[k]), default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cfg", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.worker:
        print(json.dumps(worker(args.worker, json.loads(args.cfg), device)))
        return
    cfg = dict(gpu_shape if device == "cuda" else cpu_shape)
    for k in overrides:
        if getattr(args, k) is not None:
            cfg[k] = getattr(args, k)
    chosen = [a for a in args.arms.split(",") if a]
    bad = [a for a in chosen if a not in arms]
    if bad:
        raise SystemExit(f"unknown arm(s) {bad}; choose from {list(arms)}")
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(script)), "results", f"{name}_{device}")
    results, doc = [], None
    for arm in chosen:
        r = run_arm_subprocess(os.path.abspath(script), arm, ["--cfg", json.dumps(cfg)], env=env)
        if after_arm is not None and "error" not in r:
            after_arm(r)
        print(json.dumps(log(r)), flush=True)
        results.append(r)
        doc = {"meta": meta(device, packages), "shape": cfg, "results": results}
        with open(out + ".json", "w") as f:
            json.dump(doc, f, indent=1)
        with open(out + ".md", "w") as f:
            f.write(markdown(doc))
    if doc is not None:
        print(markdown(doc))
