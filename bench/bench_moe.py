"""Benchmark: LoRA on attention and MoE experts, HF+PEFT ``target_parameters`` eager vs torch.compile(PEFT)
vs effpass (inject_lora on the expert tensors).

Arms (each in a fresh subprocess, same seed and batch):

* ``peft_eager``:   Qwen3-MoE-shaped HF model + ``peft.get_peft_model(LoraConfig(target_modules=[q,k,v,o],
  target_parameters=[experts.gate_up_proj, experts.down_proj]))``, eager
* ``peft_compile``: the same PEFT model under ``torch.compile`` (Inductor)
* ``effpass``:      the plain HF model through ``effpass.compile(passes=[InjectLoRA(targets=[...])])`` (Inductor)
* ``effpass_qlora``: QLoRA on the same model: ``QuantizeLinear(scheme="nf4", experts=True)`` (NF4 with double
  quantization on every linear but the head and on the 3-D expert tensors) + the same ``InjectLoRA``; reports
  the expert weights' bytes before and after as storage holds them (``effpass.quantized.storage_bytes``)

Shape (CPU, fp32): 8 experts, top-2, hidden 512, 4 layers, expert intermediate 256, 8/4 heads of 64,
vocab 4096, batch 2 x 256 tokens, LoRA r=16 (alpha 32). A step is forward + backward + AdamW step.
Peak memory: the profiler method (effpass.testing.memory.peak_memory, bytes allocated during one step above
those live at its start). Also reported: the delta-weight bytes PEFT allocates per forward (one expert-stack
sized tensor per adapted parameter) that effpass never allocates.

    python bench/bench_moe.py            # all arms, appends to bench/results/moe_<device>.{json,md}
    python bench/bench_moe.py --quick    # smoke run: one step, no warm-up

Each arm runs in a fresh process under bench/driver.py (deadline, interleaving, results appended per arm).
"""
from __future__ import annotations

import os
import statistics
import sys
import time

ARMS = ("peft_eager", "peft_compile", "effpass", "effpass_qlora")
SHAPE = dict(vocab_size=4096, hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
             head_dim=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256, intermediate_size=1024,
             decoder_sparse_step=1, seq=256, batch=2)
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import driver  # noqa: E402


def build_model():
    import torch
    import transformers as tf

    cfg = tf.Qwen3MoeConfig(**{k: v for k, v in SHAPE.items() if k not in ("seq", "batch")},
                            max_position_embeddings=512, bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return tf.Qwen3MoeForCausalLM(cfg)


def worker(arm: str, steps: int, warmup: int, rank: int) -> dict:
    import torch

    import effpass
    from effpass.testing import dynamo_counters
    from effpass.testing.memory import peak_memory

    model = build_model()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, SHAPE["vocab_size"], (SHAPE["batch"], SHAPE["seq"]), generator=g)
    extra = {}
    if arm.startswith("peft"):
        import peft

        cfg = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=ATTN, target_parameters=EXPERTS)
        model = peft.get_peft_model(model, cfg)
        run = torch.compile(model) if arm == "peft_compile" else model
    else:
        from effpass.passes import InjectLoRA, QuantizeLinear
        from effpass.quantized import storage_bytes

        def expert_bytes():
            return sum(storage_bytes(p) for n, p in model.named_parameters()
                       if n.endswith(("experts.gate_up_proj", "experts.down_proj")))

        before = expert_bytes()
        quant = [QuantizeLinear(scheme="nf4", experts=True, exclude=["lm_head"])] if arm == "effpass_qlora" else []
        run = effpass.compile(model, passes=[*quant, InjectLoRA(rank=rank, alpha=2 * rank,
                                                                targets=[f"*.{t}" for t in ATTN + EXPERTS])])
        st = effpass.report(model).stats("inject_lora")
        extra = {k: st[k] for k in ("expert_adapters", "expert_adapter_params", "delta_weight_bytes_avoided")}
        extra.update(expert_bytes_before=before, expert_bytes_after=expert_bytes())
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)

    def step():
        loss = run(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    t0 = time.perf_counter()
    with dynamo_counters() as counters:
        for _ in range(warmup):
            step()
        first = time.perf_counter() - t0
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            loss = step()
            times.append(time.perf_counter() - t)
        _, peak = peak_memory(step)
    delta_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters()  # logical (delta) size
                      if n.endswith(("experts.gate_up_proj", "experts.down_proj")))
    return {"arm": arm, "median_step_s": statistics.median(times), "steps_s": times, "warmup_s": first,
            "peak_step_bytes": peak, "loss": float(loss), "trainable_params": sum(p.numel() for p in params),
            "expert_weight_bytes": delta_bytes, **counters, **extra}


def markdown(run: dict) -> str:
    m, cfg = run["meta"], run["shape"]
    results = [r if r.get("status") == "ok" else {"arm": r["arm"], "error": r.get("error")} for r in run["results"]]
    base = next((r for r in results if r["arm"] == "peft_eager" and "error" not in r), None)
    lines = [f"# LoRA on attention + MoE experts (Qwen3-MoE shape), {m['device']} fp32, {m['date']}",
             f"torch {m['torch']}, transformers {m['transformers']}, peft {m.get('peft')}; load average "
             f"{m['load_average'][0]:.2f} at start ({m['cpu_count']} cores, shared); rank {cfg['rank']}, "
             f"{cfg['steps']} steps after {cfg['warmup']}", "",
             "| arm | median step | vs PEFT eager | step peak (MiB) | vs PEFT eager | graph breaks | recompiles |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            why = (str(r["error"] or "").strip().splitlines() or ["crashed"])[-1][:160]
            lines.append(f"| {r['arm']} | failed: {why} | | | | | |")
            continue
        if not base:
            base = r  # a run without peft_eager: ratios against the first arm
        sp = base["median_step_s"] / r["median_step_s"] if base else float("nan")
        mp = r["peak_step_bytes"] / base["peak_step_bytes"] if base else float("nan")
        lines.append(f"| {r['arm']} | {r['median_step_s'] * 1e3:.0f} ms | {sp:.2f}x speed | "
                     f"{r['peak_step_bytes'] / 2**20:.1f} | {mp:.2f}x | {r.get('graph_breaks')} | {r.get('recompiles')} |")
    eff = next((r for r in results if r["arm"] == "effpass" and "error" not in r), None)
    if eff:
        lines += ["", f"Expert delta weights effpass never allocates: {eff['delta_weight_bytes_avoided'] / 2**20:.1f} MiB "
                  f"per forward ({eff['expert_adapters']} adapted expert tensors; PEFT's ParamWrapper forms one "
                  "expert-stack-sized W + scaling*B@A per adapted tensor on every forward)."]
    q = next((r for r in results if r["arm"] == "effpass_qlora" and "error" not in r), None)
    if q:
        lines += ["", f"QLoRA (effpass_qlora): expert weights {q['expert_bytes_before'] / 2**20:.2f} MiB fp32 before, "
                  f"{q['expert_bytes_after'] / 2**20:.2f} MiB NF4 after, as storage holds them "
                  f"({q['expert_bytes_after'] / q['expert_bytes_before']:.3f}x; loss {q['loss']:.5f})."]
    return "\n".join(lines) + "\n"


def main() -> None:
    driver.main(__file__, workload="moe", arms=ARMS, markdown=markdown, packages=("peft",),
                worker=lambda arm, cfg, device: worker(arm, cfg["steps"], cfg["warmup"], cfg["rank"]),
                cpu_shape=dict(steps=5, warmup=2, rank=16), quick=dict(steps=1, warmup=0),
                overrides=("steps", "warmup", "rank"),
                requires={"peft_eager": ("peft",), "peft_compile": ("peft",)},
                log=lambda r: {k: v for k, v in r.items() if k != "steps_s"})


if __name__ == "__main__":
    main()
