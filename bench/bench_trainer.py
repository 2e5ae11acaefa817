"""Benchmark: Hugging Face ``Trainer`` LoRA fine-tuning steps/s and peak memory, three arms in one run.

Arms (each in a fresh subprocess, same seed, data and TrainingArguments):

* ``eager``:          PEFT LoRA model (``peft.get_peft_model``), eager
* ``torch_compile``:  the same PEFT model with ``TrainingArguments(torch_compile=True)`` (accelerate, Inductor)
* ``effpass``:        the plain model through ``effpass.compile(model, passes=[InjectLoRA(...), FuseAttention()])``
                      (Inductor), handed to the same Trainer
* ``effpass_default``: ``InjectLoRA`` plus the device's default pipeline (``effpass.config.default_pipeline``: on
                      CPU fuse_attention and fuse_cross_entropy, which never materialises the logits)

Attention is Hugging Face's default (``sdpa``) in every arm. LoRA r=16 on q/k/v/o.
Shapes: a small Llama on CPU (fp32; hidden 256, 2 layers, vocab 4096, T=256, batch 2); on a GPU a ~0.5B Llama
shape in bf16 (``TrainingArguments(bf16=True)``), T=1024, batch 4 (GPU arms written, not run here).

Steps/s: Trainer steps after the warm-up steps (the compile happens in the first ones), timed by a callback
(``on_step_begin``/``on_step_end``; CUDA synchronised); also the process CPU time per step, which on a shared
CPU is steadier than wall time. Peak memory: one ``trainer.training_step`` (forward + backward, called as
Trainer calls it, with ``num_items_in_batch``, so no recompile) after training, measured with
``effpass.testing.memory.peak_memory``: bytes allocated above those live at its start (parameters,
optimizer state), on CPU from the profiler's allocator events.

CPU threads (NOTE(threads)): Inductor's C++ kernels each open an OpenMP parallel region, and libgomp's
default wait policy spins at every barrier. On a CPU shared with other processes (load above the core
count) a thread spins while its partner is descheduled, and compiled steps become several times slower than
eager (measured: 5-15x more CPU time per step with 2 threads at a load of 8 on 2 cores). The children
therefore run with ``OMP_WAIT_POLICY=PASSIVE`` unless the environment sets it (``--omp-wait-policy ""``
keeps libgomp's default); ``--threads N`` sets ``torch.set_num_threads``. Both are recorded.

    python bench/bench_trainer.py                  # all arms; appends to bench/results/trainer_<device>.{json,md}
    python bench/bench_trainer.py --steps 4 --warmup 2 --repeats 2
    python bench/bench_trainer.py --quick          # smoke run: 1 step after 1

Each arm runs in a fresh process under bench/driver.py (deadline, interleaved rounds, results appended per arm);
the table reports each arm's best round (lowest CPU ms/step).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import driver  # noqa: E402

ARMS = ("eager", "torch_compile", "effpass", "effpass_default")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
CPU_SHAPE = dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=4, seq=256, batch=2, bf16=False)
GPU_SHAPE = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
                 num_attention_heads=16, num_key_value_heads=4, seq=1024, batch=4, bf16=True)


def run_arm(arm: str, device: str, steps: int, warmup: int, threads: int | None = None) -> dict:
    import time
    import tempfile

    import torch

    if threads:
        torch.set_num_threads(threads)
    import transformers as tf

    import effpass
    from effpass.passes import FuseAttention, InjectLoRA
    from effpass.testing import dynamo_counters
    from effpass.testing.memory import peak_memory

    tf.logging.set_verbosity_error()
    shape = GPU_SHAPE if device == "cuda" else CPU_SHAPE
    cfg = tf.LlamaConfig(**{k: v for k, v in shape.items() if k not in ("seq", "batch", "bf16")},
                         max_position_embeddings=shape["seq"], bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg).to(device)
    torch.manual_seed(1)
    lora = InjectLoRA(rank=16, alpha=32, targets=[f"*.{t}" for t in TARGETS])
    if arm == "effpass":
        effpass.compile(model, passes=[lora, FuseAttention()])
    elif arm == "effpass_default":
        from effpass.config import default_pipeline

        effpass.compile(model, passes=[lora, *default_pipeline(torch.device(device), torch.bfloat16 if shape["bf16"] else torch.float32)])
    else:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS))

    import datasets

    g = torch.Generator().manual_seed(0)
    n = shape["batch"] * (steps + warmup + 1)
    ids = torch.randint(0, shape["vocab_size"], (n, shape["seq"]), generator=g)
    data = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})

    times: list[float] = []
    cpu_times: list[float] = []

    class Timer(tf.TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if device == "cuda":
                torch.cuda.synchronize()
            self.t, self.c = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kw):
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t)
            cpu_times.append(time.process_time() - self.c)

    with tempfile.TemporaryDirectory() as out:
        args = tf.TrainingArguments(out, max_steps=steps + warmup, per_device_train_batch_size=shape["batch"],
                                    logging_steps=1, report_to=[], save_strategy="no", seed=0, disable_tqdm=True,
                                    use_cpu=device == "cpu", bf16=shape["bf16"], torch_compile=arm == "torch_compile")
        trainer = tf.Trainer(model=model, args=args, train_dataset=data, callbacks=[Timer()])
        t0 = time.perf_counter()
        with dynamo_counters() as dyn:  # graph breaks / recompiles in training and in the memory step
            trainer.train()
            total = time.perf_counter() - t0
            losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
            batch = next(iter(trainer.get_train_dataloader()))
            batch = {k: v.to(device) for k, v in batch.items()}
            n_items = trainer._get_num_items_in_batch([batch], torch.device(device))  # as Trainer passes it
            step = lambda: trainer.training_step(trainer.model_wrapped, batch, n_items)  # noqa: E731
            step()  # the same call signature as in training: no recompile inside the measurement
            _, peak = peak_memory(step, device)
    measured = times[warmup:]
    cpu = cpu_times[warmup:]
    out = {"arm": arm, "steps_per_s": len(measured) / sum(measured), "step_ms": 1e3 * sum(measured) / len(measured),
           "step_ms_min": 1e3 * min(measured), "cpu_ms_per_step": 1e3 * sum(cpu) / len(cpu),
           "threads": torch.get_num_threads(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
           "first_steps_s": sum(times[:warmup]), "train_s": total, "peak_step_bytes": peak,
           "losses": losses, "graphs": None}
    if arm.startswith("effpass"):
        rep = effpass.report(model)
        out["graphs"] = len(rep.graphs)
    out["dynamo"] = dict(dyn)
    return out


def worker(arm: str, cfg: dict, device: str) -> dict:
    res = run_arm(arm, device, cfg["steps"], cfg["warmup"], cfg["threads"] or None)
    res["omp_wait_policy"] = os.environ.get("OMP_WAIT_POLICY")
    res["load_average_1m"] = os.getloadavg()[0]
    return res


def markdown(run: dict) -> str:
    meta, cfg = run["meta"], run["shape"]
    best: dict[str, dict] = {}
    for r in run["results"]:
        if r.get("status") == "ok" and (r["arm"] not in best or r["cpu_ms_per_step"] < best[r["arm"]]["cpu_ms_per_step"]):
            best[r["arm"]] = r
    results = list(best.values())
    loads = [r.get("load_average_1m") for r in run["results"] if r.get("status") == "ok"]
    base = best.get("eager")
    omp = results[0].get("omp_wait_policy") if results else None
    lines = [f"# Trainer LoRA fine-tuning: eager vs torch.compile vs effpass ({meta.get('device_tag')})", "",
             f"{meta['date']}, {meta['device']} ({meta['cpu_count']} cores), torch {meta['torch']}, "
             f"transformers {meta['transformers']}; {cfg['steps']} timed steps after {cfg['warmup']} warm-up steps; "
             f"{results[0].get('threads') if results else '?'} torch threads, OMP_WAIT_POLICY={omp}; best of "
             f"{meta.get('repeats')} interleaved round(s) per arm (by CPU time); 1-minute load average after each arm: "
             f"{', '.join(f'{x:.1f}' for x in loads if x is not None)}. The CPU is shared: compare ratios only.", "",
             "| arm | CPU ms/step | vs eager | wall ms/step (min) | steps/s | vs eager | peak step memory (MiB) | vs eager "
             "| first steps (s) | graph breaks | recompiles | max abs loss diff vs eager |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        cpu = f"{base['cpu_ms_per_step'] / r['cpu_ms_per_step']:.2f}x" if base else ""
        sp = f"{r['steps_per_s'] / base['steps_per_s']:.2f}x" if base else ""
        mem = f"{r['peak_step_bytes'] / base['peak_step_bytes']:.2f}x" if base else ""
        dyn = r.get("dynamo") or {}
        dl = f"{max(abs(x - y) for x, y in zip(r['losses'], base['losses'])):.1e}" if base else ""
        lines.append(f"| {r['arm']} | {r['cpu_ms_per_step']:.1f} | {cpu} | {r['step_ms']:.1f} ({r['step_ms_min']:.1f}) | "
                     f"{r['steps_per_s']:.3f} | {sp} | {r['peak_step_bytes'] / 2**20:.1f} | {mem} | "
                     f"{r['first_steps_s']:.1f} | {dyn.get('graph_breaks', '')} | {dyn.get('recompiles', '')} | {dl} |")
    for r in run["results"]:
        if r.get("status") != "ok":
            lines.append(f"\n{r['arm']}: {r.get('status')}: "
                         f"{(str(r.get('error', '')).strip().splitlines() or ['?'])[-1][:200]}")
    return "\n".join(lines) + "\n"


def main() -> None:
    def extra_args(ap):
        ap.add_argument("--omp-wait-policy", default="PASSIVE",
                        help="OMP_WAIT_POLICY for the arms unless already set ('' keeps libgomp's default); "
                             "see NOTE(threads)")

    env = {"PYTHONWARNINGS": "ignore"}
    if "OMP_WAIT_POLICY" not in os.environ:
        wait = next((sys.argv[i + 1] for i, x in enumerate(sys.argv[:-1]) if x == "--omp-wait-policy"), "PASSIVE")
        if wait:
            env["OMP_WAIT_POLICY"] = wait
    shape = dict(steps=8, warmup=3, threads=0)
    driver.main(__file__, workload="trainer", arms=ARMS, worker=worker, markdown=markdown, cpu_shape=shape,
                quick=dict(steps=1, warmup=1), overrides=("steps", "warmup", "threads"), extra_args=extra_args,
                env=env, packages=("peft", "accelerate"),
                requires={a: ("peft",) for a in ("eager", "torch_compile")})


if __name__ == "__main__":
    main()
