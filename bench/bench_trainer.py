"""Benchmark: Hugging Face ``Trainer`` LoRA fine-tuning steps/s and peak memory, three arms in one run.

Arms (each in a fresh subprocess, same seed, data and TrainingArguments):

* ``eager``:          PEFT LoRA model (``peft.get_peft_model``), eager
* ``torch_compile``:  the same PEFT model with ``TrainingArguments(torch_compile=True)`` (accelerate, Inductor)
* ``effpass``:        the plain model through ``effpass.compile(model, passes=[InjectLoRA(...), FuseAttention()])``
                      (Inductor), handed to the same Trainer

Attention is Hugging Face's default (``sdpa``) in every arm. LoRA r=16 on q/k/v/o.
Shapes: a small Llama on CPU (fp32; hidden 256, 2 layers, vocab 4096, T=256, batch 2); on a GPU a ~0.5B Llama
shape in bf16 (``TrainingArguments(bf16=True)``), T=1024, batch 4 (GPU arms written, not run here).

Steps/s: Trainer steps after the warm-up steps (the compile happens in the first ones), timed by a callback
(``on_step_begin``/``on_step_end``; CUDA synchronised). Peak memory: one ``trainer.training_step``
(forward + backward) after training, measured with ``effpass.testing.memory.peak_memory``: bytes allocated
above those live at its start (parameters, optimizer state), on CPU from the profiler's allocator events.

    python bench/bench_trainer.py                  # all arms; writes bench/results/trainer_<device>.json and .md
    python bench/bench_trainer.py --steps 4 --warmup 2
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys

ARMS = ("eager", "torch_compile", "effpass")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
CPU_SHAPE = dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=4, seq=256, batch=2, bf16=False)
GPU_SHAPE = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
                 num_attention_heads=16, num_key_value_heads=4, seq=1024, batch=4, bf16=True)


def run_arm(arm: str, device: str, steps: int, warmup: int) -> dict:
    import time
    import tempfile

    import torch
    import transformers as tf

    import effpass
    from effpass.passes import FuseAttention, InjectLoRA
    from effpass.testing.memory import peak_memory

    tf.logging.set_verbosity_error()
    shape = GPU_SHAPE if device == "cuda" else CPU_SHAPE
    cfg = tf.LlamaConfig(**{k: v for k, v in shape.items() if k not in ("seq", "batch", "bf16")},
                         max_position_embeddings=shape["seq"], bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg).to(device)
    torch.manual_seed(1)
    if arm == "effpass":
        effpass.compile(model, passes=[InjectLoRA(rank=16, alpha=32, targets=[f"*.{t}" for t in TARGETS]), FuseAttention()])
    else:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS))

    import datasets

    g = torch.Generator().manual_seed(0)
    n = shape["batch"] * (steps + warmup + 1)
    ids = torch.randint(0, shape["vocab_size"], (n, shape["seq"]), generator=g)
    data = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})

    times: list[float] = []

    class Timer(tf.TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if device == "cuda":
                torch.cuda.synchronize()
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t)

    with tempfile.TemporaryDirectory() as out:
        args = tf.TrainingArguments(out, max_steps=steps + warmup, per_device_train_batch_size=shape["batch"],
                                    logging_steps=1, report_to=[], save_strategy="no", seed=0, disable_tqdm=True,
                                    use_cpu=device == "cpu", bf16=shape["bf16"], torch_compile=arm == "torch_compile")
        trainer = tf.Trainer(model=model, args=args, train_dataset=data, callbacks=[Timer()])
        t0 = time.perf_counter()
        trainer.train()
        total = time.perf_counter() - t0
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        batch = next(iter(trainer.get_train_dataloader()))
        batch = {k: v.to(device) for k, v in batch.items()}
        _, peak = peak_memory(lambda: trainer.training_step(trainer.model_wrapped, batch), device)
    measured = times[warmup:]
    out = {"arm": arm, "steps_per_s": len(measured) / sum(measured), "step_ms": 1e3 * sum(measured) / len(measured),
           "first_steps_s": sum(times[:warmup]), "train_s": total, "peak_step_bytes": peak,
           "losses": losses, "graphs": None}
    if arm == "effpass":
        out["graphs"] = len(effpass.report(model).graphs)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--steps", type=int, default=8, help="timed steps per arm (after the warm-up)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed first steps (compile)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--arm", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import torch

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if a.arm:  # child process: one arm
        print(json.dumps(run_arm(a.arm, device, a.steps, a.warmup)))
        return
    results = []
    for arm in a.arms.split(","):
        cmd = [sys.executable, __file__, "--arm", arm, "--device", device, "--steps", str(a.steps),
               "--warmup", str(a.warmup)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"arm {arm} failed")
        res = json.loads(proc.stdout.strip().splitlines()[-1])
        results.append(res)
        print(f"{arm:<14} {res['steps_per_s']:.3f} steps/s  {res['step_ms']:.1f} ms/step  "
              f"peak {res['peak_step_bytes'] / 2**20:.1f} MiB  first {a.warmup} steps {res['first_steps_s']:.1f} s")
    import transformers

    base = next(r for r in results if r["arm"] == "eager") if any(r["arm"] == "eager" for r in results) else None
    meta = {"device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "torch": torch.__version__, "transformers": transformers.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "shape": GPU_SHAPE if device == "cuda" else CPU_SHAPE, "steps": a.steps, "warmup": a.warmup,
            "lora": {"r": 16, "alpha": 32, "targets": TARGETS},
            "load_average_1m_at_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}
    os.makedirs(os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"), exist_ok=True)
    path = a.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", f"trainer_{device}.json")
    with open(path, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=2)
    lines = [f"# Trainer LoRA fine-tuning: eager vs torch.compile vs effpass ({device})", "",
             f"{meta['date']}, {meta['device']} ({meta['cpu_count']} cores), torch {meta['torch']}, "
             f"transformers {meta['transformers']}; {a.steps} timed steps after {a.warmup} warm-up steps; "
             f"1-minute load average at the end: {meta['load_average_1m_at_end']}.", "",
             "| arm | steps/s | ms/step | vs eager | peak step memory (MiB) | vs eager | first steps (s) |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        sp = f"{r['steps_per_s'] / base['steps_per_s']:.2f}x" if base else ""
        mem = f"{r['peak_step_bytes'] / base['peak_step_bytes']:.2f}x" if base else ""
        lines.append(f"| {r['arm']} | {r['steps_per_s']:.3f} | {r['step_ms']:.1f} | {sp} | "
                     f"{r['peak_step_bytes'] / 2**20:.1f} | {mem} | {r['first_steps_s']:.1f} |")
    with open(path[:-5] + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
