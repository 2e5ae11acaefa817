"""Full fine-tuning at Llama-3-8B widths with a few layers: every weight trained (AdamW), the GPU proof's section d
(issue 37 (d)).

The model is built on the device in its dtype (bf16 on a GPU: weights, gradients and AdamW's states in bf16, no
fp32 master copy, as with Llama-3-8B's widths: hidden 4,096, FFN 14,336, GQA 32/8 heads, vocabulary 128,256,
untied head; ``layers`` of its 32). Arms, each in its own process (``bench/driver.py``), same seed, weights, batch:

* ``compile``: the plain model under ``torch.compile`` (Inductor), the reference of the loss;
* ``effpass``: ``effpass.compile(model)``, effpass's default pipeline;
* ``effpass_planned``: ``effpass.compile(model, memory_budget=BUDGET, example_inputs=...)``: the default pipeline
  plus what the planner adds to fit the step into the stated budget (``--set budget=...``; 20 GiB on a GPU,
  ``BUDGET``); the row names the plan chosen and its predicted peak.

Per arm: median step time (forward, backward, AdamW step), tokens/s, MFU of the layers measured and MFU
extrapolated to 32 layers (``mfu_32``: the convention in ``bench/_common.py``'s ``extrapolate_layers``: the
step's time split between layers and the rest by FLOPs, the layers' part scaled to 32; 989 TFLOP/s bf16 peak), peak memory (CUDA:
``max_memory_allocated`` over the timed steps; CPU: none), the first step's time (the cold compile), graph breaks
and recompiles, the first and last loss.

    python bench/bench_full_ft.py --device cuda                  # 4 layers at Llama-3-8B widths, 4,096 tokens, bf16
    python bench/bench_full_ft.py --quick                        # a smoke run on the CPU
    python bench/bench_full_ft.py --device cuda --set budget=20GiB --make-plans   # effpass_planned's CUDA plan,
                                                                 # made here (bench/plans.py), loaded on the GPU
"""
from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import driver  # noqa: E402
import plans  # noqa: E402

ARMS = ("compile", "effpass", "effpass_planned")
#: effpass_planned's stated memory budget per device (``--set budget=...`` overrides)
BUDGET = {"cuda": "20GiB", "cpu": "48MiB"}
GPU_SHAPE = dict(vocab=128256, hidden=4096, ffn=14336, layers=4, heads=32, kv_heads=8, seq=4096, batch=1,
                 dtype="bfloat16", steps=8, warmup=2, lowering="inductor", budget="")
CPU_SHAPE = dict(vocab=4096, hidden=256, ffn=688, layers=2, heads=8, kv_heads=4, seq=256, batch=1,
                 dtype="float32", steps=3, warmup=1, lowering="inductor", budget="")
QUICK = dict(vocab=512, hidden=64, ffn=128, layers=1, heads=4, kv_heads=2, seq=32, steps=1, warmup=0,
             lowering="eager")


def plan_key(cfg: dict, device: str) -> dict:
    """What effpass_planned's plan depends on (``bench/plans.py``): the model's shape, the batch, the budget."""
    keys = ("vocab", "hidden", "ffn", "layers", "heads", "kv_heads", "seq", "batch", "dtype", "lowering")
    return {"device": device, **{k: cfg[k] for k in keys}, "budget": cfg.get("budget") or BUDGET[device]}


def _model(cfg: dict, device: str):
    import torch

    from _common import llama

    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, cfg["dtype"]))
    try:
        with torch.device(device):  # built on the device in its dtype (no host copy of the weights, no fp32 copy)
            return llama(cfg, device, tie=False, train=True)
    finally:
        torch.set_default_dtype(default)


def make_plans(cfg: dict, device: str, folder: str | None = None) -> list[str]:
    """effpass_planned's plan for ``device`` made here, on a meta model (what ``effpass.compile(memory_budget=...,
    example_inputs=...)`` plans on the device: the default pipeline, AdamW, the plan for the budget)."""
    from _common import token_batches
    from effpass.planning import plan_memory

    key = plan_key(cfg, device)
    c0 = plans.cpu_seconds()
    ids = token_batches(cfg, "meta")[0]
    plan = plan_memory(_model(cfg, "meta"), {"input_ids": ids, "labels": ids}, key["budget"], device=device,
                       lowering=cfg["lowering"])
    return [plans.save("full_ft", key, plans.plan_record(plan), plans.cpu_seconds() - c0, folder)]


def configure(args, cfg: dict) -> None:
    cfg["_plans"] = args.plans
    if args.make_plans:
        import torch

        device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        for p in make_plans(cfg, device, args.plans):
            print(f"wrote {p}", flush=True)
        raise SystemExit(0)


def worker(arm: str, cfg: dict, device: str) -> dict:
    import torch

    import effpass
    from _common import PEAK_BF16_FLOPS, extrapolate_layers, llama_flops, token_batches
    from effpass.testing import dynamo_counters

    dev = torch.device(device)
    model = _model(cfg, device)
    ids = token_batches(cfg, device)[0]
    plan_info = {}
    if arm == "compile":
        run = torch.compile(model)
    elif arm == "effpass":
        run = effpass.compile(model, lowering=cfg["lowering"])
    elif arm == "effpass_planned":
        budget = cfg.get("budget") or BUDGET[dev.type]
        t0 = time.perf_counter()
        saved, pipeline = plans.load("full_ft", plan_key(cfg, dev.type), cfg.get("_plans")), None
        if saved is not None:  # made ahead (bench/plans.py): compiled with the saved pipeline, not replanned
            try:
                pipeline = plans.passes_of(saved[0])
            except Exception as e:  # noqa: BLE001 - a pass renamed since: planned on the spot, said on the row
                plan_info["plan_load_error"] = f"{type(e).__name__}: {e}"[:300]
        if pipeline is not None:
            rec, prov = saved
            run = effpass.compile(model, passes=pipeline, lowering=cfg["lowering"])
            plan_info.update(prov, plan=rec["plan"], predicted_peak_bytes=rec["predicted_device_bytes"])
        else:
            run = effpass.compile(model, lowering=cfg["lowering"], memory_budget=budget,
                                  example_inputs={"input_ids": ids, "labels": ids})
            plan = effpass.report(run).memory_plan
            plan_info.update(plan_source="on the device", plan=getattr(getattr(plan, "chosen", None), "name", None),
                             predicted_peak_bytes=getattr(plan, "peak_bytes", None))
        plan_info.update(budget=budget, plan_s=round(time.perf_counter() - t0, 2))
        driver.partial({"arm": arm, "status": "partial", **plan_info})
    else:
        raise ValueError(f"bench_full_ft: unknown arm {arm!r}; choose from {ARMS}")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=dev.type == "cuda")

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def step():
        loss = run(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    losses, times = [], []
    with dynamo_counters() as counters:
        sync()
        t0 = time.perf_counter()
        losses.append(step())
        sync()
        first = time.perf_counter() - t0
        driver.partial({"arm": arm, "status": "partial", "first_step_s": round(first, 3), **plan_info})
        for _ in range(cfg["warmup"]):
            losses.append(step())
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        for _ in range(cfg["steps"]):
            sync()
            t0 = time.perf_counter()
            losses.append(step())
            sync()
            times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    tokens = cfg["batch"] * cfg["seq"]
    out = {"arm": arm, "median_step_s": med, "min_step_s": min(times), "tokens_per_s": tokens / med,
           "first_step_s": first, "graph_breaks": counters["graph_breaks"], "recompiles": counters["recompiles"],
           "loss_first": float(losses[0]), "loss_last": float(losses[-1]), "layers": cfg["layers"],
           "params": sum(p.numel() for p in model.parameters()), **plan_info}
    rest, layer = llama_flops(cfg)
    out["mfu"] = tokens / med * (rest + cfg["layers"] * layer) / PEAK_BF16_FLOPS
    out.update(extrapolate_layers(med, tokens, rest, layer, cfg["layers"]))
    if dev.type == "cuda":
        out["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    else:  # a GPU's peak FLOP/s says nothing of a CPU: the figures' arithmetic runs, MFU is not claimed
        out["mfu"] = out["mfu_32"] = None
    return out


if __name__ == "__main__":
    driver.main(__file__, workload="full_ft", arms=ARMS, worker=worker, cpu_shape=CPU_SHAPE, gpu_shape=GPU_SHAPE,
                quick=QUICK, overrides=("steps", "warmup", "budget"), deadline_s=600,
                extra_args=plans.add_options, configure=configure)
