"""Cost of effpass's pipeline: (1) its machinery on a cold Inductor compile (issue: at most +5% on the demo
model on CPU, growing linearly with graph size); (2) with ``--step-cost``, the cost model of one training step
(``effpass.cost``, issue 36.3): a Llama-3-8B-width model (2 layers, bf16, fake tensors), plain compile vs
effpass's default pipeline vs each pass alone: FLOPs, bytes, host syncs, kernels and the estimated time on a GPU;
(3) with ``--head``, the loss head alone at hidden 2,048, vocabulary 128,256, 2,048 tokens, bf16 (one decoder
layer; the baseline issue 36.2 must beat), unfused vs fused.

    python bench/bench_pipeline_cost.py --step-cost [--device h100] [--seq 8192]
    python bench/bench_pipeline_cost.py --head [--device h100]

Each arm of (2) and (3) runs in a fresh process (bench/_common.py); results are written after every arm to
bench/results/step_cost_llama3_8b_width_<device>.json / .md and step_cost_head_h2048_v128k_<device>.json / .md.

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


# ------------------------------------------------------------------------------------------------------
# (2), (3): the cost model of one step (effpass.cost)
# ------------------------------------------------------------------------------------------------------
LLAMA3_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "rope_theta": 500000.0,
             "max_position_embeddings": 8192, "tie_word_embeddings": False, "rms_norm_eps": 1e-5}
#: the head shape of the one H100 run (issue 36): hidden 2,048 (Llama-3.2-1B's width), vocabulary 128,256
HEAD_2048 = {**LLAMA3_8B, "hidden_size": 2048, "intermediate_size": 8192, "num_key_value_heads": 8}
#: passes that need torch.distributed (not replayed by the one-process cost model)
DISTRIBUTED = ("shard_sequence", "wrap_fsdp")


def _cost_worker(arm: str, workload: str, device: str, seq: int) -> None:
    from effpass.cost import config_step_cost

    cfg = LLAMA3_8B if workload == "pipeline" else HEAD_2048
    layers = 2 if workload == "pipeline" else 1
    passes = [] if arm == "plain" else None if arm == "default" else [arm]
    t0 = time.process_time()
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(cfg, f)
    try:
        cost = config_step_cost(f.name, 1, seq, dtype="bfloat16", passes=passes, device=device, layers=layers,
                                tensors="fake", per_pass=arm == "default")
    finally:
        os.unlink(f.name)
    out = {"arm": arm, "pipeline": cost.pipeline, "totals": cost.totals, "head": cost.head, "graphs": cost.graphs,
           "passes": cost.passes, "notes": cost.notes, "cpu_s": round(time.process_time() - t0, 1),
           "top_ops": dict(sorted(cost.ops.items(), key=lambda kv: -kv[1]["est_time_s"])[:15])}
    print(json.dumps(out, default=str))


def _cost_table(results: list[dict], part: str = "totals", base: str = "plain") -> str:
    """A markdown table of ``part`` ("totals" or "head") per arm, with the difference from ``base``."""
    ref = next((r for r in results if r.get("arm") == base and part in r), None)
    rows = ["| arm | passes | FLOPs | bytes | host syncs | kernels | est. time (ms) | vs plain: FLOPs, bytes, syncs, "
            "kernels |", "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in results:
        if part not in r:
            rows.append(f"| {r['arm']} | error: {r.get('error', '?').splitlines()[-1][:120]} | | | | | | |")
            continue
        t = r[part]
        delta = "" if ref is None or r is ref else ", ".join(
            f"{t[k] - ref[part][k]:+,}" for k in ("flops", "bytes", "host_syncs", "kernels"))
        rows.append(f"| {r['arm']} | {', '.join(r['pipeline']) or '-'} | {t['flops']:.4g} | {t['bytes']:.4g} | "
                    f"{t['host_syncs']} | {t['kernels']} | {t['est_time_s'] * 1e3:.3f} | {delta} |")
    return "\n".join(rows)


def _write_md(path: str, what: str, result: dict) -> None:
    import torch

    text = (f"# {what}\n\ncommit {result['commit']}, torch {torch.__version__}; estimates, not measurements "
            f"(docs/cost_model.md)\n\n## The whole step\n\n{_cost_table(result['arms'])}\n\n"
            f"## The loss head\n\n{_cost_table(result['arms'], 'head')}\n")
    if result.get("head_gemms"):
        g = result["head_gemms"]
        text += (f"\nThe head's 3 GEMMs (logits, input gradient, weight gradient): {g['flops']:.4g} FLOPs; their "
                 f"operands and results at least once: {g['min_bytes']:.4g} bytes; at the matmul ceiling and HBM "
                 f"bandwidth: {g['est_time_s'] * 1e3:.3f} ms.\n")
    for r in result["arms"]:
        if r.get("notes"):
            text += f"\n{r['arm']}: " + "; ".join(r["notes"]) + "\n"
    with open(path, "w") as f:
        f.write(text)


def step_cost_main(args) -> None:
    import torch

    import effpass
    from _common import meta, run_arm_subprocess

    workload = "head" if args.head else "pipeline"
    if workload == "pipeline":
        alone = [n for n in sorted(effpass.registered_passes()) if n not in DISTRIBUTED]
        arms = ["plain", "default"] + alone
        seq = args.seq or 8192
        name = f"step_cost_llama3_8b_width_{args.device}"
        what = (f"one training step (forward + backward) of a Llama-3-8B-width model, 2 layers, bf16, batch 1 x "
                f"{seq} tokens, fake tensors, cost model (effpass.cost) on {args.device}: plain compile vs the default "
                f"pipeline vs each pass alone (passes needing torch.distributed left out: {', '.join(DISTRIBUTED)})")
    else:
        arms = ["plain", "fuse_cross_entropy"]
        seq = args.seq or 2048
        name = f"step_cost_head_h2048_v128k_{args.device}"
        what = (f"one training step of one Llama decoder layer at hidden 2,048, vocabulary 128,256, batch 1 x {seq} "
                f"tokens, bf16, fake tensors, cost model (effpass.cost) on {args.device}: unfused head vs "
                f"fuse_cross_entropy")
    out = os.path.join(HERE, "results", name)
    import subprocess as _sp

    commit = _sp.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout.strip()
    result = {"benchmark": what, **meta("cpu"), "commit": commit, "estimates_for": args.device, "seq": seq,
              "note": "estimates of the cost model (docs/cost_model.md), not measurements; FLOPs as FlopCounterMode "
                      "counts them", "arms": []}
    if workload == "head":  # the floor: 3 GEMMs of 2*N*H*V, operands (x, W, dlogits-free) read and results written once
        from effpass.cost import get_device, kernel_seconds

        n, h, v = seq, HEAD_2048["hidden_size"], HEAD_2048["vocab_size"]
        flops = 3 * 2 * n * h * v
        min_bytes = 2 * (n * h + v * h) + 2 * (n * h + v * h)  # read x and W; write dx and dW (bf16)
        gpu = get_device(args.device)
        result["head_gemms"] = {"flops": flops, "min_bytes": min_bytes,
                                "est_time_s": kernel_seconds(gpu, flops, min_bytes, torch.bfloat16)}
    for arm in arms:
        res = run_arm_subprocess(os.path.abspath(__file__), arm, ["--workload", workload, "--device", args.device,
                                                                  "--seq", str(seq)])
        print(f"{arm}: {json.dumps(res.get('totals', res.get('error')), default=str)[:300]}", file=sys.stderr)
        result["arms"].append(res)
        with open(out + ".json", "w") as f:
            json.dump(result, f, indent=1, default=str)
        _write_md(out + ".md", what, result)
    print(f"wrote {out}.json and .md")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "pipeline_cost.json"))
    ap.add_argument("--step-cost", action="store_true", help="the cost model: plain vs default vs each pass alone")
    ap.add_argument("--head", action="store_true", help="the cost model: the loss head at hidden 2,048, 128K vocab")
    ap.add_argument("--device", default="h100")
    ap.add_argument("--seq", type=int, default=0)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--workload", default="pipeline", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return _cost_worker(args.worker, args.workload, args.device, args.seq)
    if args.step_cost or args.head:
        sys.path.insert(0, HERE)
        return step_cost_main(args)
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
