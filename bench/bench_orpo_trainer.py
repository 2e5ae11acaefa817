"""One TRL ``ORPOTrainer`` training step (issue 27): peak memory and time, eager vs an effpass-compiled policy.

TRL's ``ORPOTrainer`` (``trl.experimental.orpo``) computes its loss in trainer code from the full logits the
model returns; effpass routes that method through TRL's own fused LM head for an effpass-compiled model
(``effpass/integrations/_trl_orpo.py``), so the logits are never built. Arms (each in a fresh subprocess, same
seed and batch, all in one run):

* ``eager``: the model as built, TRL's method;
* ``compile``: ``torch.compile(model)`` (Inductor), TRL's method (the logits are the compiled graph's output);
* ``effpass``: ``effpass.compile(model)`` (default pipeline), the routed method.

Shape: a Llama-shaped policy (fp32, hidden 64, 1 layer, vocabulary 128,256) so the vocabulary-sized work dominates
(as in bench_preference.py); 2 pairs (chosen + rejected: 4 rows) of a 64-token prompt and a 448-token answer.
Peak: ``effpass.testing.memory.peak_memory`` of ``trainer.training_step`` (tensors allocated above those live at the
step's start), after one warm-up step.

    python bench/bench_orpo_trainer.py        # -> bench/results/orpo_trainer_cpu.{json,md}
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time

ARMS = ("eager", "compile", "effpass")
SHAPE = dict(hidden=64, layers=1, heads=4, kv_heads=2, ffn=128, vocab=128256, prompt=64, answer=448, pairs=2,
             dtype="float32")
if os.environ.get("BENCH_ORPO_SMOKE"):
    SHAPE.update(vocab=1024, prompt=8, answer=24)


def run_arm(arm: str) -> dict:
    import datasets
    import torch
    import transformers as tf
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    import effpass
    from effpass.testing.memory import peak_memory

    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=SHAPE["vocab"], hidden_size=SHAPE["hidden"], intermediate_size=SHAPE["ffn"],
                         num_hidden_layers=SHAPE["layers"], num_attention_heads=SHAPE["heads"],
                         num_key_value_heads=SHAPE["kv_heads"], max_position_embeddings=4096,
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = tf.LlamaForCausalLM(cfg).train()
    if arm == "compile":
        model.compile()
    elif arm == "effpass":
        effpass.compile(model)
    # a word-level tokenizer over the whole vocabulary: one token per word
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<eos>", "<unk>"] + [f"w{i}" for i in range(SHAPE["vocab"] - 2)]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = tf.PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", pad_token="<eos>", unk_token="<unk>")
    g = torch.Generator().manual_seed(0)

    def text(n):
        return " ".join(f"w{i}" for i in torch.randint(0, SHAPE["vocab"] - 2, (n,), generator=g).tolist())

    n = SHAPE["pairs"]
    data = datasets.Dataset.from_dict({"prompt": [text(SHAPE["prompt"]) for _ in range(n)],
                                       "chosen": [text(SHAPE["answer"]) for _ in range(n)],
                                       "rejected": [text(SHAPE["answer"]) for _ in range(n)]})
    length = SHAPE["prompt"] + SHAPE["answer"] + 8
    args = ORPOConfig(output_dir="/tmp/bench_orpo", max_steps=3, per_device_train_batch_size=n, learning_rate=1e-4,
                      optim="sgd", report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, bf16=False,
                      beta=0.1, max_length=length,
                      max_completion_length=SHAPE["answer"] + 4)
    tr = ORPOTrainer(model=model, args=args, train_dataset=data, processing_class=tok)
    tr.current_gradient_accumulation_steps = 1  # set by train(); the step is called alone here
    batch = tr._prepare_inputs(next(iter(tr.get_train_dataloader())))
    losses = []

    def step():
        losses.append(float(tr.training_step(model, batch)))
        model.zero_grad(set_to_none=True)

    t0 = time.perf_counter()
    step()
    first = time.perf_counter() - t0
    load = os.getloadavg()[0]
    c0, t0 = os.times(), time.perf_counter()
    step()
    wall, c1 = time.perf_counter() - t0, os.times()
    _, peak = peak_memory(step, "cpu")
    out = {"arm": arm, "peak_bytes": peak, "step_s": wall, "step_cpu_s": c1.user + c1.system - c0.user - c0.system,
           "first_call_s": first, "load_at_step": load, "loss": losses[0], "rows": 2 * int(batch["chosen_input_ids"].shape[0]),
           "tokens_per_row": int(max(batch["chosen_input_ids"].shape[1], batch["rejected_input_ids"].shape[1]))}
    if arm == "effpass":
        rep = effpass.report(model)
        out["trl_orpo"] = rep.module.notes.get("trl_orpo")
        out["trl_logprob_sites"] = rep.stats("fuse_cross_entropy").get("trl_logprob_sites", 0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arm", choices=ARMS)
    ap.add_argument("--arms", nargs="*", default=list(ARMS), choices=ARMS)
    args = ap.parse_args()
    if args.arm:
        print(json.dumps(run_arm(args.arm)))
        return
    results = []
    for arm in args.arms:
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--arm", arm], capture_output=True, text=True)
        line = next((l for l in reversed(p.stdout.splitlines()) if l.startswith("{")), None)
        res = json.loads(line) if line else {"arm": arm, "error": p.stderr[-1500:]}
        print(json.dumps(res), flush=True)
        results.append(res)
    print(write(results))


def write(results) -> str:
    import importlib.metadata

    import torch
    import transformers

    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    out = os.path.join(root, "orpo_trainer_cpu" + ("_smoke" if os.environ.get("BENCH_ORPO_SMOKE") else ""))
    meta = {"device": "cpu", "cpus": os.cpu_count(), "torch": torch.__version__, "transformers": transformers.__version__,
            "trl": importlib.metadata.version("trl"), "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "shape": SHAPE}
    with open(out + ".json", "w") as fh:
        json.dump({"meta": meta, "results": results}, fh, indent=1)
    lines = [f"# TRL ORPOTrainer, one training step (issue 27), CPU, {meta['date'][:16]}", "",
             f"torch {meta['torch']}, transformers {meta['transformers']}, trl {meta['trl']}, {meta['cpus']} CPUs, "
             f"shape {SHAPE}", "",
             "peak: tensors allocated during `trainer.training_step` above those live at its start (after a warm-up "
             "step); step s / CPU s: the second step's wall time and the arm's process CPU time; load: 1-minute load "
             "average then", "",
             "| arm | peak MiB | x eager | step s | x compile | step CPU s | first call s | load | loss | routed |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    e = next((r for r in results if r["arm"] == "eager" and "peak_bytes" in r), None)
    c = next((r for r in results if r["arm"] == "compile" and "step_s" in r), None)
    for r in results:
        if "error" in r:
            lines.append(f"| {r['arm']} | error: {r['error'].strip().splitlines()[-1][:150] if r['error'] else '?'} |")
            continue
        lines.append(f"| {r['arm']} | {r['peak_bytes'] / 2**20:.0f} | "
                     f"{r['peak_bytes'] / e['peak_bytes'] if e else float('nan'):.3f} | {r['step_s']:.2f} | "
                     f"{r['step_s'] / c['step_s'] if c else float('nan'):.2f} | {r['step_cpu_s']:.2f} | "
                     f"{r['first_call_s']:.1f} | {r['load_at_step']:.1f} | {r['loss']:.6f} | "
                     f"{r.get('trl_orpo') or ''} |")
    with open(out + ".md", "w") as fh:
        fh.write("\n".join(lines) + "\n")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
