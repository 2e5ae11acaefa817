"""Benchmark: LoRA fine-tuning step, HF+PEFT eager vs torch.compile(PEFT) vs effpass (inject_lora).

Arms (each in a fresh subprocess, interleaved and repeated, same seed and batch):

* ``peft_eager``:   HF model (SDPA attention) + ``peft.get_peft_model``, eager
* ``peft_compile``: the same PEFT model under ``torch.compile`` (Inductor)
* ``effpass``:      the plain HF model through ``effpass.compile(passes=[InjectLoRA(...)])`` (Inductor)

Shapes: on a GPU the issue's Llama-3.2-1B shape (GQA 32/8 heads, hidden 2048, 16 layers, vocab 128256),
bf16, T=2048, batch 1, LoRA r=16 on all attention and MLP projections. On a CPU a small Llama shape
(fp32) so the script runs on the 2-core machines; CPU numbers are noisy and say nothing about GPU speed.

MFU convention (anchors.md): FLOPs/token = 4N + 12*L*H*Q*T + 6*N_adapter (N: matmul parameters of the
frozen base, embedding lookup excluded); peak 989 TFLOP/s bf16 dense (H100/H200 spec).

    python bench/bench_lora.py                 # all arms, writes bench/results/lora_<device>.json and .md
    python bench/bench_lora.py --arms effpass --steps 5
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
import time

ARMS = ("peft_eager", "peft_compile", "effpass")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PEAK_FLOPS = 989e12

GPU_SHAPE = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                 num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True, seq=2048, batch=1,
                 dtype="bfloat16")
CPU_SHAPE = dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                 num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=True, seq=256, batch=2,
                 dtype="float32")


def build_model(shape, device):
    import torch
    import transformers as tf

    cfg = tf.LlamaConfig(**{k: v for k, v in shape.items() if k not in ("seq", "batch", "dtype")},
                         max_position_embeddings=max(shape["seq"], 128), bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg).to(device=device, dtype=getattr(torch, shape["dtype"]))
    try:
        model.set_attn_implementation("sdpa")
    except Exception:
        pass
    return model


def worker(arm: str, shape: dict, steps: int, warmup: int, rank: int, dropout: float) -> dict:
    import torch

    import effpass
    from effpass.testing import dynamo_counters

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_model(shape, device)
    base_linear_params = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, shape["vocab_size"], (shape["batch"], shape["seq"]), generator=g).to(device)
    if arm in ("peft_eager", "peft_compile"):
        import peft

        cfg = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=dropout, target_modules=TARGETS)
        model = peft.get_peft_model(model, cfg)
        run = torch.compile(model) if arm == "peft_compile" else model
    else:
        from effpass.passes import InjectLoRA

        run = effpass.compile(model, passes=[InjectLoRA(rank=rank, alpha=2 * rank, dropout=dropout,
                                                        targets=[f"*.{t}" for t in TARGETS])])
    params = [p for p in model.parameters() if p.requires_grad]
    n_adapter = sum(p.numel() for p in params)
    opt = torch.optim.AdamW(params, lr=1e-4)
    model.train()

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def step():
        loss = run(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    times, losses = [], []
    torch._dynamo.reset()
    with dynamo_counters() as counters:
        t0 = time.perf_counter()
        losses.append(step().item())
        sync()
        first = time.perf_counter() - t0
        for _ in range(warmup - 1):
            step()
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        for _ in range(steps):
            if device == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                losses.append(step().item())
                b.record()
                sync()
                times.append(a.elapsed_time(b) / 1e3)
            else:
                t0 = time.perf_counter()
                losses.append(step().item())
                times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    tokens_per_step = shape["batch"] * shape["seq"]
    fpt = 4 * base_linear_params + 12 * shape["num_hidden_layers"] * shape["hidden_size"] * shape["seq"] \
        + 6 * n_adapter
    out = {"arm": arm, "median_step_s": med, "min_step_s": min(times), "tokens_per_s": tokens_per_step / med,
           "first_step_s": first, "graph_breaks": counters["graph_breaks"], "recompiles": counters["recompiles"],
           "trainable_params": n_adapter, "loss_first": losses[0], "loss_last": losses[-1]}
    if device == "cuda":
        out["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        out["mfu"] = out["tokens_per_s"] * fpt / PEAK_FLOPS
    else:
        import resource

        out["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    if arm == "effpass":
        st = effpass.report(run).stats("inject_lora")
        out["effpass_stats"] = {k: st.get(k) for k in ("adapters", "merged_groups", "merged_adapters")}
    return out


def versions() -> dict:
    import peft
    import torch
    import transformers

    d = {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
         "python": platform.python_version(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat()}
    try:
        import triton

        d["triton"] = triton.__version__
    except Exception:
        pass
    if torch.cuda.is_available():
        d["device"] = torch.cuda.get_device_name()
        d["driver"] = torch.version.cuda
    else:
        d["device"] = f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} logical cores (shared)"
    return d


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default: 20 GPU, 5 CPU)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=None, help="rounds over the arms (default: 2 GPU, 1 CPU)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--shape", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.worker:
        res = worker(args.worker, json.loads(args.shape), args.steps, args.warmup, args.rank, args.dropout)
        print("RESULT " + json.dumps(res))
        return

    import torch

    gpu = torch.cuda.is_available()
    shape = GPU_SHAPE if gpu else CPU_SHAPE
    steps = args.steps or (20 if gpu else 5)
    repeats = args.repeats or (2 if gpu else 1)
    arms = [a for a in args.arms.split(",") if a]
    bad = [a for a in arms if a not in ARMS]
    if bad:
        raise SystemExit(f"unknown arm(s) {bad}; choose from {list(ARMS)}")
    runs: dict[str, list[dict]] = {a: [] for a in arms}
    for _ in range(repeats):
        for arm in arms:
            cmd = [sys.executable, __file__, "--worker", arm, "--shape", json.dumps(shape), "--steps", str(steps),
                   "--warmup", str(args.warmup), "--rank", str(args.rank), "--dropout", str(args.dropout)]
            p = subprocess.run(cmd, capture_output=True, text=True)
            line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if line is None:
                print(f"arm {arm} failed:\n{p.stderr[-3000:]}", file=sys.stderr)
                runs[arm].append({"arm": arm, "error": p.stderr[-500:]})
                continue
            r = json.loads(line[7:])
            runs[arm].append(r)
            print(f"{arm:13s} {r['median_step_s'] * 1e3:9.1f} ms/step  {r['tokens_per_s']:10.0f} tok/s  "
                  f"breaks={r['graph_breaks']}  first step {r['first_step_s']:.1f} s", file=sys.stderr)
    summary = {}
    for arm, rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        if not ok:
            summary[arm] = {"error": rs[-1].get("error")}
            continue
        best = min(ok, key=lambda r: r["median_step_s"])
        summary[arm] = dict(best, runs=[r["median_step_s"] for r in ok])
    base = summary.get("peft_eager", {}).get("tokens_per_s")
    for s in summary.values():
        if base and "tokens_per_s" in s:
            s["speedup_vs_peft_eager"] = s["tokens_per_s"] / base
    result = {"versions": versions(), "shape": shape, "rank": args.rank, "dropout": args.dropout, "steps": steps,
              "repeats": repeats, "note": ("GPU run at the issue's shape" if gpu else
                                           "CPU run at a small Llama shape: noisy, says nothing about GPU speed"),
              "arms": summary}
    tag = "gpu" if gpu else "cpu"
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", f"lora_{tag}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    lines = [f"# inject_lora benchmark ({tag})", "", f"{result['note']}. Device: {result['versions']['device']}; "
             f"torch {result['versions']['torch']}, transformers {result['versions']['transformers']}, "
             f"peft {result['versions']['peft']}; {result['versions']['date'][:10]}.", "",
             f"Shape: {json.dumps(shape)}; LoRA r={args.rank}, alpha={2 * args.rank}, dropout={args.dropout} on "
             f"{', '.join(TARGETS)}; {steps} timed steps, best median of {repeats} round(s).", "",
             "| arm | median step (ms) | tokens/s | vs PEFT eager | first step (s) | graph breaks | recompiles |"
             + (" MFU | peak mem (GiB) |" if gpu else " peak RSS (GiB) |"),
             "|---|---|---|---|---|---|---|" + ("---|---|" if gpu else "---|")]
    for arm, s in summary.items():
        if "error" in s:
            lines.append(f"| {arm} | failed | | | | | |")
            continue
        extra = (f" {s['mfu'] * 100:.1f}% | {s['peak_mem_gib']:.2f} |" if gpu else f" {s['peak_rss_gib']:.2f} |")
        lines.append(f"| {arm} | {s['median_step_s'] * 1e3:.1f} | {s['tokens_per_s']:.0f} | "
                     f"{s.get('speedup_vs_peft_eager', 1.0):.2f}x | {s['first_step_s']:.1f} | {s['graph_breaks']} | "
                     f"{s['recompiles']} |" + extra)
    with open(out.replace(".json", ".md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
