"""Cost of effpass's pipeline machinery (issue: at most +5% on a cold Inductor compile of the demo model
on CPU, growing linearly with graph size).

Arms, each in a fresh subprocess with a fresh Inductor cache (a cold compile), interleaved and repeated:
  plain      torch.compile(model)                                   (Inductor)
  effpass    effpass.compile(model, passes=[])                      (the machinery, no passes)
  noop4      effpass.compile(model, passes=[four no-op passes, one per phase])  (manager cost per hook)

Also measures the manager's own time per hook (snapshot for rollback, op histograms, provenance) for a
no-op pass on torch-IR graphs of growing size, to show it is linear in the number of nodes.

    python bench/bench_pipeline_cost.py [--repeats 3] [--layers 2]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))

CHILD = r'''
import os, sys, time, json, dataclasses
import torch, effpass
from effpass.testing.models import DemoConfig, DemoLM
arm, layers = sys.argv[1], int(sys.argv[2])
torch.manual_seed(0)
model = DemoLM(DemoConfig(n_layers=layers))
tokens = torch.randint(0, 512, (2, 64))
if arm == "plain":
    runner = torch.compile(model)
elif arm == "effpass":
    runner = effpass.compile(model, passes=[])
else:
    hooks = {}
    for phase in ("prepare_module", "transform_torch_ir", "transform_joint", "transform_post_grad"):
        name = "noop_" + phase.split("_", 1)[1]
        klass = dataclasses.make_dataclass(name.title().replace("_", ""), [], bases=(effpass.Pass,), frozen=True,
                                           kw_only=True, namespace={phase: lambda self, g, ctx: None})
        effpass.register_pass(name)(klass)
        hooks[name] = klass()
    runner = effpass.compile(model, passes=list(hooks.values()))
t0 = time.perf_counter()
loss, _ = runner(tokens, labels=tokens)
loss.backward()
timing = {}
if arm != "plain":
    g = effpass.report(runner).graphs[0].timing
    timing = {"total_ms": g["total_ms"], "lower_ms": g["lower_ms"], "late_pass_ms": g["late_pass_ms"]}
print("RESULT " + json.dumps({"arm": arm, "compile_s": time.perf_counter() - t0, **timing}))
'''


def cold_compile(arm: str, layers: int) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONWARNINGS": "ignore"}
        out = subprocess.run([sys.executable, "-c", CHILD, arm, str(layers)], env=env, capture_output=True, text=True)
        line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT ")), None)
        if line is None:
            raise RuntimeError(out.stderr[-3000:])
        return json.loads(line[7:])


def manager_scaling(sizes=(1, 2, 4, 8, 16)) -> list[dict]:
    """Manager time around one no-op torch-IR hook, on demo-model graphs with more and more layers."""
    import dataclasses

    import torch

    import effpass
    from effpass.manager import PassManager
    from effpass.testing.models import DemoConfig, DemoLM
    from effpass.pass_api import Phase
    from effpass.report import GraphReport

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Noop(effpass.Pass):
        def transform_torch_ir(self, gm, ctx):
            return None

    Noop.name = "noop_for_scaling"
    rows = []
    for layers in sizes:
        graphs = []

        def grab(gm, example_inputs):
            graphs.append(gm)
            return gm

        torch._dynamo.reset()
        m = DemoLM(DemoConfig(n_layers=layers))
        torch.compile(m, backend=grab)(torch.randint(0, 512, (2, 16)))
        gm = graphs[0]
        mgr = PassManager([Noop()])
        times = []
        for _ in range(7):
            t0 = time.perf_counter()
            mgr.run_graph_phase(Phase.TORCH_IR, gm, GraphReport("g"), "torch_ir", model=m)
            times.append(time.perf_counter() - t0)
        rows.append({"layers": layers, "nodes": len(gm.graph.nodes), "manager_ms": statistics.median(times) * 1e3})
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "pipeline_cost.json"))
    args = ap.parse_args()
    import torch

    arms = ["plain", "effpass", "noop4"]
    times = {a: [] for a in arms}
    inside = {a: [] for a in arms[1:]}
    for r in range(args.repeats):
        for a in (arms if r % 2 == 0 else arms[::-1]):  # interleaved, alternating order
            res = cold_compile(a, args.layers)
            times[a].append(res["compile_s"])
            if a != "plain":
                # effpass's own share of the backend call: everything but lowering itself
                inside[a].append((res["total_ms"] - res["lower_ms"]) / res["lower_ms"])
            print(f"repeat {r} {a}: {res}", file=sys.stderr)
    med = {a: statistics.median(v) for a, v in times.items()}
    scaling = manager_scaling()
    per_node_us = [r["manager_ms"] * 1e3 / r["nodes"] for r in scaling]
    result = {
        "benchmark": "pipeline machinery cost on a cold Inductor compile (demo model, forward+backward)",
        "date": datetime.date.today().isoformat(), "device": "cpu", "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
        "layers": args.layers, "repeats": args.repeats, "cold_compile_s": times, "median_s": med,
        "overhead_empty_pipeline": med["effpass"] / med["plain"] - 1,
        "effpass_share_of_backend_call": {a: statistics.median(v) for a, v in inside.items()},
        "overhead_four_noop_hooks": med["noop4"] / med["plain"] - 1,
        "manager_scaling": scaling, "manager_us_per_node": per_node_us,
        "note": "CPU timings on a shared 2-core machine are noisy; medians of interleaved fresh-process runs.",
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: result[k] for k in ("median_s", "overhead_empty_pipeline", "overhead_four_noop_hooks",
                                             "effpass_share_of_backend_call",
                                             "manager_scaling")}, indent=1))


if __name__ == "__main__":
    main()
