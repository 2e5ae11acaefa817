"""Planning time of Llama-3-8B LoRA (r=16, q/k/v/o, batch 1 x 2048 tokens, bf16) over every candidate the
registry offers with allow=['nf4', 'int8', 'adamw8bit'] (a budget nothing fits, so every tier is replayed).

    .venv/bin/python bench/bench_plan_speed.py [--no-prune] [--no-share] [--tiny] [--workers N]

``--no-prune``: every candidate of every tier replayed (``plan_memory(prune=False)``: the planner before
candidates whose start-of-step bytes exceed the budget were skipped; the same figures for every candidate
replayed both ways);

``--no-share``: every candidate replayed alone (the planner before work was shared between candidates);
``--tiny``: the same architecture and depth at hidden size 64 (fake tensors: the replay's work is the same
op for op, so its CPU time is a proxy of the full-size plan's); ``--workers N``: processes replaying the
extrapolation's depths (``EFFPASS_PLAN_WORKERS``; default up to 2). Reports wall and CPU seconds of this
process and its worker processes (the machine is shared: CPU seconds are the comparable figure; the target is
wall time on an idle 2-core machine).

Runs as one arm (``plan``) in a fresh process under bench/driver.py (deadline; repeats interleaved) and appends to
bench/results/plan_speed_<device>.json and .md; the options are fields of the run (``shape``), not file names.

    .venv/bin/python bench/bench_plan_speed.py --quick      # smoke run: --tiny, budget 6GiB
"""
from __future__ import annotations

import datetime
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import effpass  # noqa: E402
from effpass.planning import MemoryBudgetError, format_bytes, plan_memory  # noqa: E402
from effpass.planning.cli import model_from_config  # noqa: E402

LLAMA_3_8B = dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                  max_position_embeddings=8192, tie_word_embeddings=False, torch_dtype="bfloat16")


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import driver  # noqa: E402


def extra_args(ap) -> None:
    ap.add_argument("--no-share", action="store_true")
    ap.add_argument("--no-prune", action="store_true")
    ap.add_argument("--budget", default="6GiB", help="the memory budget (default 6GiB: nothing fits, so every "
                    "tier is tried and the smallest achievable peak is searched; 8GiB: an NF4 plan fits)")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--workers", type=int, default=None)


def configure(args, cfg: dict) -> None:
    cfg.update(no_share=args.no_share, no_prune=args.no_prune, budget=args.budget, tiny=args.tiny or cfg["tiny"],
               workers=args.workers)


def worker(arm: str, cfg: dict, device: str) -> dict:
    import argparse

    return {"arm": arm, **measure(argparse.Namespace(**cfg))}


def markdown(run: dict) -> str:
    out = next((r for r in reversed(run["results"]) if r.get("status") == "ok"), None)
    if out is None:
        return driver.table(run)
    return out["markdown"]


def main():
    driver.main(__file__, workload="plan_speed", arms=("plan",), worker=worker, markdown=markdown,
                cpu_shape=dict(tiny=False), quick=dict(tiny=True), overrides=(), extra_args=extra_args,
                configure=configure, deadline_s=2 * 3600)


def measure(args) -> dict:
    if args.workers is not None:
        os.environ["EFFPASS_PLAN_WORKERS"] = str(args.workers)
    import resource

    def children_cpu():
        r = resource.getrusage(resource.RUSAGE_CHILDREN)
        return r.ru_utime + r.ru_stime
    if args.no_share:  # every candidate replayed alone
        import effpass.planning.search as search_mod  # the candidate search's estimate_many

        real = search_mod.estimate_many
        search_mod.estimate_many = lambda *a, **k: real(*a, **{**k, "share": False})
    load0 = os.getloadavg()
    cfg = dict(LLAMA_3_8B)
    if args.tiny:
        cfg.update(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                   vocab_size=256)
    model = model_from_config(cfg)
    tok = torch.zeros(1, 2048, dtype=torch.long, device="meta")
    inputs = {"input_ids": tok, "labels": tok, "use_cache": False}
    lora = effpass.make_pass("inject_lora", {"rank": 16, "targets": ["*.q_proj", "*.k_proj", "*.v_proj", "*.o_proj"]})
    t0, c0, k0 = time.perf_counter(), time.process_time(), children_cpu()
    try:
        plan = plan_memory(model, inputs, args.budget, allow=["nf4", "int8", "adamw8bit"], passes=[lora], lowering="eager",
                           prune=not args.no_prune)
        cands, answer = plan.candidates, f"chosen: {plan.chosen.name} ({format_bytes(plan.peak_bytes)})"
    except MemoryBudgetError as e:
        cands, answer = e.candidates, f"nothing fits; smallest: {e.plan.name} ({format_bytes(e.smallest)})"
    seconds, cpu, child_cpu = time.perf_counter() - t0, time.process_time() - c0, children_cpu() - k0
    load1 = os.getloadavg()
    rows = [{"plan": c.name, "peak": c.peak_bytes, "parameters": c.estimate.parameters if c.estimate else None,
             "start": c.estimate.start_bytes if c.estimate else None, "floor": c.floor,
             "extra_flops": c.extra_flops if c.estimate else None, "error": c.error, "pruned": c.pruned,
             "provisional": bool(c.estimate and c.estimate.provisional)}
            for c in cands]
    import transformers

    head = {"device": f"CPU ({platform.machine()}, {os.cpu_count()} cores, shared)", "torch": torch.__version__,
            "transformers": transformers.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "load_before": load0, "load_after": load1, "shared": not args.no_share,
            "pruned": not args.no_prune, "budget": args.budget,
            "model": "Llama-3-8B shapes at hidden 64 (--tiny)" if args.tiny else "Llama-3-8B"}
    from effpass.planning.pool import plan_workers

    head["workers"] = plan_workers()
    out = {"header": head, "seconds": round(seconds, 1), "cpu_seconds": round(cpu + child_cpu, 1),
           "cpu_seconds_workers": round(child_cpu, 1), "candidates": len(cands),
           "replayed": sum(1 for c in cands if c.estimate is not None), "answer": answer,
           "rows": rows}
    md = [f"# Planning time: Llama-3-8B LoRA r=16, 1 x 2048 tokens, allow nf4/int8/adamw8bit, budget {args.budget}\n", f"{head}\n",
          f"{len(cands)} candidates in {seconds:.1f} s wall, {cpu + child_cpu:.1f} s CPU ({child_cpu:.1f} s of it in "
          f"{head['workers'] - 1} worker process(es)) (load average before {load0[0]:.1f}, after {load1[0]:.1f}; "
          f"shared replays: {not args.no_share}; pruning: {not args.no_prune}); "
          f"{out['replayed']} candidates replayed; {answer}\n",
          "~: predicted from replays of 2 and 3 blocks, not checked at 4 (the chosen or smallest plan and the plan "
          "as given are; `--no-prune` checks every one)\n",
          "| plan | predicted peak | parameters | start of step (floor) | error or why not replayed |",
          "|---|---|---|---|---|"]
    md += [f"| {r['plan']} | {('~' if r['provisional'] else '') + format_bytes(r['peak']) if r['peak'] else '-'} | "
           f"{format_bytes(r['parameters']) if r['parameters'] else '-'} | "
           f"{format_bytes(r['floor']) if r['floor'] is not None else '-'} | {r['error'] or r['pruned'] or ''} |"
           for r in rows]
    out["markdown"] = "\n".join(md) + "\n"
    return out


if __name__ == "__main__":
    main()
