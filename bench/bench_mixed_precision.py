"""Mixed precision benchmark: effpass apply_autocast (+ scale_loss) against the hand-written equivalents.

One full training step (forward, backward, AdamW) of a GPT-2-shaped model (Hugging Face GPT2LMHeadModel,
random init, SDPA attention, no dropout), arms run in one invocation, each in a fresh subprocess,
interleaved and repeated, same seed and batch:

    fp32_eager                      the model as written, eager
    eager_autocast_bf16             eager, torch.autocast(bf16)
    eager_autocast_fp16_gradscaler  eager, torch.autocast(fp16) + torch.amp.GradScaler
    compile_fp32                    plain torch.compile on the fp32 model
    compile_autocast_bf16           torch.compile on the hand-written autocast model (the fair bar)
    compile_autocast_fp16_gradscaler  same, fp16 + GradScaler
    effpass_bf16                    effpass on the fp32 model: ApplyAutocast(bf16)
    effpass_fp16                    effpass on the fp32 model: ApplyAutocast(fp16) + ScaleLoss

Reported per arm: median step time, tokens/s, MFU (GPU; FLOPs/token = 6N + 12*L*H*Q*T, N = matmul
parameters incl. the tied lm_head, position embedding excluded; peak 989 TFLOP/s bf16 dense), peak memory,
first-step (compile) time, graph breaks/recompiles, and loss drift against the fp32 eager arm.

    python bench/bench_mixed_precision.py                 # GPU if present (GPT-2-124M, T=1024), else CPU small
    python bench/bench_mixed_precision.py --arms fp32_eager,effpass_bf16 --reps 3
    python bench/bench_mixed_precision.py --quick            # smoke run: one layer, one step

Each arm runs in a fresh process under bench/driver.py (deadline, interleaving, results appended per arm to
bench/results/mixed_precision_<device>.{json,md}).

On CPU the shapes are small and the numbers say nothing about GPU speed; the result file says so.
"""
from __future__ import annotations

import os
import platform
import statistics
import sys
import time

ARMS = ("fp32_eager", "eager_autocast_bf16", "eager_autocast_fp16_gradscaler", "compile_fp32",
        "compile_autocast_bf16", "compile_autocast_fp16_gradscaler", "effpass_bf16", "effpass_fp16",
        "effpass_planned_bf16")
#: effpass_planned_bf16's memory budget (the planner adds what fits the step into it), per device
BUDGET = {"cuda": "5GiB", "cpu": "24MiB"}
GPU_SHAPE = dict(n_layer=12, n_embd=768, n_head=12, vocab=50257, seq=1024, batch=8)
CPU_SHAPE = dict(n_layer=2, n_embd=128, n_head=4, vocab=2048, seq=128, batch=4)
PEAK_FLOPS = 989e12  # H100/H200 bf16 dense spec
#: effpass's lowering in the worker (the quick smoke run: eager, no compile)
LOWERING = ["inductor"]
#: the run's ``budget`` (``--set budget=...``), else BUDGET of the device
BUDGET_NOW = [""]
QUICK = dict(n_layer=1, n_embd=64, n_head=2, vocab=256, seq=32, batch=1, steps=1, warmup=0, lowering="eager")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import driver  # noqa: E402


def build_model(shape, device):
    import torch
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.GPT2Config(vocab_size=shape["vocab"], n_embd=shape["n_embd"], n_layer=shape["n_layer"],
                        n_head=shape["n_head"], n_positions=shape["seq"], resid_pdrop=0.0, embd_pdrop=0.0,
                        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = tf.GPT2LMHeadModel(cfg)
    model.loss_type = "ForCausalLM"  # NOTE: avoids transformers' one-time loss_type warning (a graph break)
    model.config._attn_implementation = "sdpa"
    try:
        model.set_attn_implementation("sdpa")
    except Exception:
        pass
    return model.to(device).train()


def flops_per_token(model, shape) -> float:
    n = sum(p.numel() for p in model.parameters()) - model.transformer.wpe.weight.numel()
    L, H, T = shape["n_layer"], shape["n_head"], shape["seq"]
    Q = shape["n_embd"] // H
    return 6 * n + 12 * L * H * Q * T


def run_arm(arm: str, shape: dict, device: str, steps: int, warmup: int) -> dict:
    import resource

    import torch

    import effpass
    from effpass.testing import dynamo_counters

    dev = torch.device(device)
    model = build_model(shape, dev)
    fpt = flops_per_token(model, shape)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]), generator=g).to(dev)
    fused = dev.type == "cuda"
    dtype = torch.float16 if "fp16" in arm else torch.bfloat16
    use_gs = arm.endswith("gradscaler")
    scaler = torch.amp.GradScaler(dev.type, enabled=use_gs) if use_gs else None
    autocast = "autocast" in arm

    class Autocast(torch.nn.Module):  # the hand-written autocast model
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, **kw):
            with torch.autocast(dev.type, dtype):
                return self.m(**kw)

    if arm.startswith("effpass"):
        from effpass.passes import ApplyAutocast, ScaleLoss

        passes = [ApplyAutocast(dtype=dtype)] + ([ScaleLoss()] if dtype == torch.float16 else [])
        plan = {}
        if "planned" in arm:  # the planner's plan for a stated budget, made before compiling (example inputs)
            plan = dict(memory_budget=BUDGET_NOW[0] or BUDGET[dev.type],
                        example_inputs={"input_ids": tokens, "labels": tokens})
        fwd = effpass.compile(model, passes=passes, lowering=LOWERING[0], **plan)
        if dtype == torch.float16:
            from effpass.passes.scale_loss import loss_scaler

            scaler = loss_scaler(fwd)
    else:
        fwd = Autocast(model) if autocast else model
        if arm.startswith("compile"):
            fwd = torch.compile(fwd)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=fused)
    effpass_scaler = arm == "effpass_fp16"

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def step():
        loss = fwd(input_ids=tokens, labels=tokens).loss
        if scaler is not None and not effpass_scaler:
            scaler.scale(loss).backward()
        else:
            loss.backward()
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    with dynamo_counters() as counters:
        for i in range(warmup + steps):
            sync()
            t0 = time.perf_counter()
            losses.append(step())
            sync()
            times.append(time.perf_counter() - t0)
    timed = times[warmup:]
    med = statistics.median(timed)
    tok = shape["batch"] * shape["seq"] / med
    out = {"arm": arm, "median_step_s": med, "min_step_s": min(timed), "tokens_per_s": tok,
           "first_step_s": times[0], "losses": [float(x) for x in losses],
           "graph_breaks": counters["graph_breaks"], "recompiles": counters["recompiles"]}
    if dev.type == "cuda":
        out["mfu"] = tok * fpt / PEAK_FLOPS
        out["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2 ** 30
    else:
        out["mfu"] = None
        out["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20
    return out


SHAPE_KEYS = tuple(CPU_SHAPE)


def worker(arm: str, cfg: dict, device: str) -> dict:
    shape = {k: cfg[k] for k in SHAPE_KEYS}
    steps = cfg["steps"] or (20 if device == "cuda" else 8)
    LOWERING[0] = cfg.get("lowering", "inductor")
    BUDGET_NOW[0] = cfg.get("budget", "")
    return run_arm(arm=arm, shape=shape, device=device, steps=steps, warmup=cfg["warmup"])


def to_result(run: dict) -> dict:
    """A run of the driver in the form ``summarize`` and ``markdown`` read."""
    m, cfg = run["meta"], run["shape"]
    runs: dict[str, list[dict]] = {}
    for r in run["results"]:
        runs.setdefault(r["arm"], []).append(r if r.get("status") == "ok" else {"arm": r["arm"], "error": r.get("error")})
    shape = {k: cfg[k] for k in SHAPE_KEYS}
    cpu = m.get("device_tag", "cpu") == "cpu"
    env = {"device": m["device"], "date": m["date"], "torch": m.get("torch"), "transformers": m.get("transformers"),
           "triton": m.get("triton"), "cpu": platform.machine(), "cpu_count": m.get("cpu_count"),
           "load_average_1m": (m.get("load_average") or ["?"])[0]}
    if not cpu:
        env["gpu"] = m["device"]
    return {"benchmark": "mixed_precision", "environment": env, "shape": shape, "reps": m.get("repeats"),
            "steps": cfg["steps"] or (8 if cpu else 20), "warmup": cfg["warmup"], "summary": summarize(runs, shape),
            "note": ("CPU run at small shapes: the GPU target shape is GPT-2-124M at T=1024. CPU numbers do not "
                     "predict GPU speed (no bf16/fp16 tensor cores; fp16 matmuls on CPU are emulated).")
            if cpu else "GPU run at the GPT-2-124M shape."}


def main() -> None:
    driver.main(__file__, workload="mixed_precision", arms=ARMS, worker=worker,
                markdown=lambda run: markdown(to_result(run)),
                cpu_shape=dict(CPU_SHAPE, steps=0, warmup=3, budget=""),
                gpu_shape=dict(GPU_SHAPE, steps=0, warmup=3, budget=""),
                quick=QUICK, repeats=1, gpu_repeats=3, overrides=("steps", "warmup"),
                env={"TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR") or
                     os.path.join("/tmp", f"effpass-bench-inductor-{os.getpid()}")})


def summarize(runs: dict, shape: dict) -> dict:
    """Per-arm medians over repetitions, best (min) step, speedups and loss drift vs fp32 eager."""
    ref = next((r for r in runs.get("fp32_eager", []) if "losses" in r), None)
    summary = {}
    for arm, rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        if not ok:
            summary[arm] = {"error": rs[0].get("error", "")[-500:] if rs else "not run"}
            continue
        med = statistics.median(r["median_step_s"] for r in ok)
        best = min(r["min_step_s"] for r in ok)
        s = {"median_step_ms": med * 1e3, "tokens_per_s": shape["batch"] * shape["seq"] / med,
             "best_step_ms": best * 1e3, "tokens_per_s_best": shape["batch"] * shape["seq"] / best,
             "first_step_cold_s": ok[0]["first_step_s"],
             "first_step_warm_s": statistics.median([r["first_step_s"] for r in ok[1:]]) if len(ok) > 1 else None,
             "graph_breaks": max(r["graph_breaks"] for r in ok), "recompiles": max(r["recompiles"] for r in ok),
             "final_loss": ok[0]["losses"][-1]}
        for i, r in enumerate(ok):
            r.setdefault("cold", i == 0)
        if ok[0].get("mfu") is not None:
            s["mfu"] = statistics.median(r["mfu"] for r in ok)
            s["peak_mem_gib"] = max(r["peak_mem_gib"] for r in ok)
        else:
            s["peak_rss_gib"] = max(r["peak_rss_gib"] for r in ok)
        if ref is not None:
            s["max_loss_drift_vs_fp32_eager"] = max(abs(a - b) / abs(b) for a, b in zip(ok[0]["losses"], ref["losses"]))
        summary[arm] = s
    base = summary.get("fp32_eager", {}).get("tokens_per_s")
    bar = summary.get("compile_autocast_bf16", {}).get("tokens_per_s")
    for arm, s in summary.items():
        if "tokens_per_s" in s:
            if base:
                s["speedup_vs_fp32_eager"] = s["tokens_per_s"] / base
                s["speedup_vs_fp32_eager_best"] = s["tokens_per_s_best"] / summary["fp32_eager"]["tokens_per_s_best"]
            if bar:
                s["vs_compile_autocast_bf16"] = s["tokens_per_s"] / bar
                s["vs_compile_autocast_bf16_best"] = (s["tokens_per_s_best"]
                                                      / summary["compile_autocast_bf16"]["tokens_per_s_best"])
    return summary


def markdown(result: dict) -> str:
    env, shape = result["environment"], result["shape"]
    lines = [f"# mixed precision benchmark ({env['device']})", "",
             f"{result['note']}", "",
             f"- date {env['date']}; torch {env['torch']}; transformers {env['transformers']}; "
             f"triton {env.get('triton', '-')}; {env.get('gpu', env['cpu'])} ({env['cpu_count']} cores, "
             f"load average {env.get('load_average_1m', '?')} at the end: other jobs shared the machine)",
             f"- GPT-2 shape: {shape}; {result['steps']} timed steps after {result['warmup']} warm-up, "
             f"{result['reps']} repetition(s), arms interleaved, each in a fresh process", "",
             "Median and best (min) step over the timed steps, median over repetitions. On a shared CPU the best "
             "step is the steadier estimate.", "",
             "| arm | ms/step median | ms/step best | tokens/s median | x fp32 eager (median / best) | "
             "x compile+autocast bf16 (median / best) | MFU | peak mem GiB | first step cold s | "
             "breaks/recompiles | max loss drift vs fp32 |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for arm, s in result["summary"].items():
        if "error" in s:
            lines.append(f"| {arm} | failed | | | | | | | | | |")
            continue
        mem = s.get("peak_mem_gib", s.get("peak_rss_gib"))
        mfu = f"{s['mfu'] * 100:.1f}%" if s.get("mfu") is not None else "n/a (CPU)"
        lines.append(
            f"| {arm} | {s['median_step_ms']:.1f} | {s['best_step_ms']:.1f} | {s['tokens_per_s']:.0f} | "
            f"{s.get('speedup_vs_fp32_eager', 0):.2f} / {s.get('speedup_vs_fp32_eager_best', 0):.2f} | "
            f"{s.get('vs_compile_autocast_bf16', 0):.2f} / {s.get('vs_compile_autocast_bf16_best', 0):.2f} | {mfu} | {mem:.2f}{'' if 'peak_mem_gib' in s else ' (RSS)'} | "
            f"{s['first_step_cold_s']:.1f} | {s['graph_breaks']}/{s['recompiles']} | "
            f"{s.get('max_loss_drift_vs_fp32_eager', float('nan')):.2e} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
