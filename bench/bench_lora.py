"""Benchmark: LoRA fine-tuning step, HF+PEFT eager vs torch.compile(PEFT) vs effpass (inject_lora).

Arms (each in a fresh subprocess, interleaved and repeated, same seed and batch):

* ``peft_eager``:   HF model (SDPA attention) + ``peft.get_peft_model``, eager
* ``peft_compile``: the same PEFT model under ``torch.compile`` (Inductor)
* ``effpass``:      the plain HF model through ``effpass.compile(passes=[InjectLoRA(...)])`` (Inductor)

Shapes: on a GPU the issue's Llama-3.2-1B shape (GQA 32/8 heads, hidden 2048, 16 layers, vocab 128256),
bf16, T=2048, batch 1, LoRA r=16 on all attention and MLP projections. On a CPU a small Llama shape
(fp32) so the script runs on the 2-core machines; CPU numbers are noisy and say nothing about GPU speed.

MFU convention (anchors.md): FLOPs/token = 4N + 12*L*H*Q*T + 6*N_adapter (N: matmul parameters of the
frozen base, embedding lookup excluded); peak 989 TFLOP/s bf16 dense (H100/H200 spec). ``mfu_32``: extrapolated
to 32 layers (``bench/_common.py`` ``extrapolate_layers``: the step's time split between the layers and the rest
by FLOPs, the layers' part scaled to 32), with ``tokens_per_s_32`` and ``step_s_32``.

    python bench/bench_lora.py                 # all arms, appends to bench/results/lora_<device>.{json,md}
    python bench/bench_lora.py --arms effpass --steps 5
    python bench/bench_lora.py --quick         # smoke run: one layer, short sequence, one step

Each arm runs in a fresh process under bench/driver.py (deadline, interleaving, results appended per arm).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import driver  # noqa: E402

ARMS = ("peft_eager", "peft_compile", "peft_liger", "effpass")
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
    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, shape["dtype"]))
    try:  # built on the device in its dtype: no host copy, no fp32 copy (Llama-3-8B widths: seconds, not a minute)
        with torch.device(device):
            model = tf.LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    model = model.to(device=device, dtype=getattr(torch, shape["dtype"]))
    try:
        model.set_attn_implementation("sdpa")
    except Exception:
        pass
    return model


def worker(arm: str, shape: dict, steps: int, warmup: int, rank: int, dropout: float,
           lowering: str = "inductor") -> dict:
    import torch

    import effpass
    from effpass.testing import dynamo_counters

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = build_model(shape, device)
    base_linear_params = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, shape["vocab_size"], (shape["batch"], shape["seq"]), generator=g).to(device)
    if arm in ("peft_eager", "peft_compile", "peft_liger"):
        import peft

        if arm == "peft_liger":  # Liger's kernels patched into this model (RMSNorm, RoPE, SwiGLU, fused linear CE)
            from liger_kernel.transformers import apply_liger_kernel_to_llama

            apply_liger_kernel_to_llama(model=model)

        cfg = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=dropout, target_modules=TARGETS)
        model = peft.get_peft_model(model, cfg)
        run = torch.compile(model) if arm == "peft_compile" else model
    else:
        from effpass.passes import InjectLoRA

        run = effpass.compile(model, passes=[InjectLoRA(rank=rank, alpha=2 * rank, dropout=dropout,
                                                        targets=[f"*.{t}" for t in TARGETS])],
                              lowering=lowering)
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
                loss = step()
                b.record()
                sync()
                losses.append(loss.item())  # read after the timed window: no host sync inside the step
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
    from _common import extrapolate_layers, llama_flops

    L = shape["num_hidden_layers"]
    rest, layer = llama_flops(dict(hidden=shape["hidden_size"], ffn=shape["intermediate_size"], vocab=shape["vocab_size"],
                                   heads=shape["num_attention_heads"], kv_heads=shape["num_key_value_heads"],
                                   seq=shape["seq"]), trained="adapters", adapter_params_per_layer=n_adapter // L)
    out.update(extrapolate_layers(med, tokens_per_step, rest, layer, L))  # MFU at 32 layers (convention: _common)
    if device == "cuda":
        out["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        out["mfu"] = out["tokens_per_s"] * fpt / PEAK_FLOPS
    else:
        out["mfu_32"] = None  # a GPU's peak says nothing of a CPU: the arithmetic runs, MFU is not claimed
        import resource

        out["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    if arm == "effpass":
        st = effpass.report(run).stats("inject_lora")
        out["effpass_stats"] = {k: st.get(k) for k in ("adapters", "merged_groups", "merged_adapters")}
    return out


QUICK = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1, seq=32, steps=1, warmup=0,
             lowering="eager")


def driver_worker(arm: str, cfg: dict, device: str) -> dict:
    shape = {k: v for k, v in cfg.items() if k in CPU_SHAPE}
    return worker(arm, shape, cfg["steps"] or (20 if device == "cuda" else 5), cfg["warmup"], cfg["rank"],
                  cfg["dropout"], cfg.get("lowering", "inductor"))


def summarize(run: dict) -> dict:
    """The best round of each arm (lowest median step), in the form the tables read."""
    cfg = run["shape"]
    summary = {}
    for arm in dict.fromkeys(r["arm"] for r in run["results"]):
        rs = [r for r in run["results"] if r["arm"] == arm]
        ok = [r for r in rs if r.get("status") == "ok"]
        if not ok:
            summary[arm] = {"error": rs[-1].get("error")}
            continue
        best = min(ok, key=lambda r: r["median_step_s"])
        summary[arm] = dict(best, runs=[r["median_step_s"] for r in ok])
    base = summary.get("peft_eager", {}).get("tokens_per_s")
    for s in summary.values():
        if base and "tokens_per_s" in s:
            s["speedup_vs_peft_eager"] = s["tokens_per_s"] / base
    gpu = run["meta"].get("device_tag", "cpu") != "cpu"
    return {"versions": run["meta"], "shape": {k: v for k, v in cfg.items() if k in CPU_SHAPE}, "rank": cfg["rank"],
            "dropout": cfg["dropout"], "steps": cfg["steps"], "repeats": run["meta"].get("repeats"),
            "gpu": gpu, "note": ("GPU run at the issue's shape" if gpu else
                                 "CPU run at a small Llama shape: noisy, says nothing about GPU speed"),
            "arms": summary}


def markdown(run: dict) -> str:
    result = summarize(run)
    gpu, shape, summary, steps, repeats = (result["gpu"], result["shape"], result["arms"], result["steps"],
                                           result["repeats"])
    tag = run["meta"].get("device_tag")
    lines = [f"# inject_lora benchmark ({tag})", "", f"{result['note']}. Device: {result['versions']['device']}; "
             f"torch {result['versions']['torch']}, transformers {result['versions']['transformers']}, "
             f"peft {result['versions']['peft']}; {result['versions']['date'][:10]}.", "",
             f"Shape: {json.dumps(shape)}; LoRA r={result['rank']}, alpha={2 * result['rank']}, "
             f"dropout={result['dropout']} on {', '.join(TARGETS)}; {steps} timed steps, best median of {repeats} "
             "round(s).", "",
             "| arm | median step (ms) | tokens/s | vs PEFT eager | first step (s) | graph breaks | recompiles |"
             + (" MFU | peak mem (GiB) |" if gpu else " peak RSS (GiB) |"),
             "|---|---|---|---|---|---|---|" + ("---|---|" if gpu else "---|")]
    for arm, s in summary.items():
        if "error" in s:
            why = (str(s["error"] or "").strip().splitlines() or ["crashed"])[-1][:160]
            lines.append(f"| {arm} | failed: {why} | | | | | |")
            continue
        extra = (f" {s['mfu'] * 100:.1f}% | {s['peak_mem_gib']:.2f} |" if gpu else f" {s['peak_rss_gib']:.2f} |")
        lines.append(f"| {arm} | {s['median_step_s'] * 1e3:.1f} | {s['tokens_per_s']:.0f} | "
                     f"{s.get('speedup_vs_peft_eager', 1.0):.2f}x | {s['first_step_s']:.1f} | {s['graph_breaks']} | "
                     f"{s['recompiles']} |" + extra)
    return "\n".join(lines) + "\n"


def main():
    driver.main(__file__, workload="lora", arms=ARMS, worker=driver_worker, markdown=markdown,
                cpu_shape=dict(CPU_SHAPE, steps=0, warmup=3, rank=16, dropout=0.0, lowering="inductor"),
                gpu_shape=dict(GPU_SHAPE, steps=0, warmup=3, rank=16, dropout=0.0, lowering="inductor"), quick=QUICK, repeats=1,
                gpu_repeats=2, overrides=("steps", "warmup", "rank", "dropout", "seq"), packages=("peft",),
                requires={"peft_eager": ("peft",), "peft_compile": ("peft",), "peft_liger": ("peft", "liger_kernel")},
                default_arms=("peft_eager", "peft_compile", "effpass"))


if __name__ == "__main__":
    main()
