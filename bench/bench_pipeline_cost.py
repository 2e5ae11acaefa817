"""Cost of effpass's pipeline machinery (issue: at most +5% on a cold Inductor compile of the demo model
on CPU, growing linearly with graph size).

Arms, each in a fresh subprocess with a fresh Inductor cache (a cold compile), interleaved and repeated:
  plain      torch.compile(model)                                   (Inductor)
  effpass    effpass.compile(model, passes=[])                      (the machinery, no passes)
  noop4      effpass.compile(model, passes=[four no-op passes, one per phase])  (manager cost per hook)

Also measures the manager's own time per hook (snapshot for rollback, op histograms, provenance) for a
no-op pass on torch-IR graphs of growing size, to show it is linear in the number of nodes.

    python bench/bench_pipeline_cost.py [--repeats 3] [--layers 2]   # appends to bench/results/pipeline_cost_<device>.*
    python bench/bench_pipeline_cost.py --quick --repeats 1

Each arm (and the manager-scaling sweep, arm ``scaling``) runs in a fresh process under bench/driver.py, rounds
interleaved with the order reversed every other round.
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))

def cold_compile(arm: str, layers: int) -> dict:
    """One cold compile (a fresh Inductor cache) of the demo model, forward + backward, in this process."""
    import dataclasses

    import atexit
    import shutil

    cache = tempfile.mkdtemp(prefix="effpass-pipeline-cost-")
    atexit.register(shutil.rmtree, cache, True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # before torch is imported: this process's Inductor cache
    import torch

    import effpass
    from effpass.testing.models import DemoConfig, DemoLM

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
    return {"arm": arm, "compile_s": time.perf_counter() - t0, **timing}


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


ARMS = ("plain", "effpass", "noop4", "scaling")


def worker(arm: str, cfg: dict, device: str) -> dict:
    if arm == "scaling":
        scaling = manager_scaling(tuple(cfg["sizes"]))
        return {"arm": arm, "manager_scaling": scaling,
                "manager_us_per_node": [r["manager_ms"] * 1e3 / r["nodes"] for r in scaling]}
    return cold_compile(arm, cfg["layers"])


def summarize(run: dict) -> dict:
    ok = [r for r in run["results"] if r.get("status") == "ok"]
    times = {a: [r["compile_s"] for r in ok if r["arm"] == a] for a in ("plain", "effpass", "noop4")}
    med = {a: statistics.median(v) for a, v in times.items() if v}
    inside = {a: statistics.median((r["total_ms"] - r["lower_ms"]) / r["lower_ms"] for r in ok if r["arm"] == a)
              for a in ("effpass", "noop4") if times[a]}  # effpass's own share of the backend call
    scaling = next((r for r in reversed(ok) if r["arm"] == "scaling"), {})
    return {"cold_compile_s": times, "median_s": med,
            "overhead_empty_pipeline": med["effpass"] / med["plain"] - 1 if {"effpass", "plain"} <= set(med) else None,
            "overhead_four_noop_hooks": med["noop4"] / med["plain"] - 1 if {"noop4", "plain"} <= set(med) else None,
            "effpass_share_of_backend_call": inside, "manager_scaling": scaling.get("manager_scaling", []),
            "manager_us_per_node": scaling.get("manager_us_per_node", [])}


def markdown(run: dict) -> str:
    s, cfg = summarize(run), run["shape"]
    pct = lambda x: "-" if x is None else f"{x * 100:+.1f}%"  # noqa: E731
    lines = ["# Pipeline machinery cost on a cold Inductor compile (demo model, forward + backward)", "",
             f"Demo model, {cfg['layers']} layers; medians of interleaved fresh-process runs (a fresh Inductor cache "
             "each). CPU timings on a shared 2-core machine are noisy.", "",
             "| arm | cold compiles (s) | median (s) | effpass's share of the backend call |", "|---|---|---|---|"]
    for a, v in s["cold_compile_s"].items():
        if not v:  # the arm did not run (or not to the end) in this run
            continue
        share = s["effpass_share_of_backend_call"].get(a)
        lines.append(f"| {a} | {', '.join(f'{x:.1f}' for x in v)} | {s['median_s'].get(a, float('nan')):.1f} | "
                     f"{'-' if share is None else f'{share * 100:.1f}%'} |")
    lines += ["", f"Overhead of the empty pipeline: {pct(s['overhead_empty_pipeline'])}; of four no-op hooks: "
              f"{pct(s['overhead_four_noop_hooks'])}.", "",
              "Manager time around one no-op torch-IR hook: " + "; ".join(
                  f"{r['layers']} layers, {r['nodes']} nodes: {r['manager_ms']:.2f} ms" for r in s["manager_scaling"])]
    for r in run["results"]:
        if r.get("status") != "ok":
            lines.append(f"\n{r['arm']}: {r.get('status')}: {(str(r.get('error', '')).strip().splitlines() or ['?'])[-1][:200]}")
    return "\n".join(lines) + "\n"


def main():
    sys.path.insert(0, HERE)
    import driver

    driver.main(__file__, workload="pipeline_cost", arms=ARMS, worker=worker, markdown=markdown, repeats=3,
                cpu_shape=dict(layers=2, sizes=[1, 2, 4, 8, 16]), quick=dict(layers=1, sizes=[1, 2]),
                overrides=("layers", "sizes"), alternate=True,
                jobs=lambda chosen, cfg: [(a, {}) for a in chosen])


if __name__ == "__main__":
    main()
