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

    python bench/bench_orpo_trainer.py          # appends to bench/results/orpo_trainer_<device>.{json,md}
    python bench/bench_orpo_trainer.py --quick  # smoke run: vocabulary 1,024, 8 + 24 tokens

Each arm runs in a fresh process under bench/driver.py (deadline, interleaving, results appended per arm).
"""
from __future__ import annotations

import os
import sys
import time

ARMS = ("eager", "compile", "effpass")
SHAPE = dict(hidden=64, layers=1, heads=4, kv_heads=2, ffn=128, vocab=128256, prompt=64, answer=448, pairs=2,
             dtype="float32")
QUICK = dict(vocab=1024, prompt=8, answer=24)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import driver  # noqa: E402


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


def worker(arm: str, cfg: dict, device: str) -> dict:
    SHAPE.update({k: v for k, v in cfg.items() if k in SHAPE})
    return run_arm(arm)


def markdown(run: dict) -> str:
    meta, shape = run["meta"], {k: v for k, v in run["shape"].items() if k in SHAPE}
    results = [r if r.get("status") == "ok" else {"arm": r["arm"], "error": r.get("error")} for r in run["results"]]
    lines = [f"# TRL ORPOTrainer, one training step (issue 27), {meta['device']}, {meta['date'][:16]}", "",
             f"torch {meta['torch']}, transformers {meta['transformers']}, trl {meta.get('trl')}, "
             f"{meta['cpu_count']} CPUs, shape {shape}", "",
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
    return "\n".join(lines) + "\n"


def main() -> None:
    driver.main(__file__, workload="orpo_trainer", arms=ARMS, worker=worker, markdown=markdown, cpu_shape=dict(SHAPE),
                quick=QUICK, overrides=("vocab",), packages=("trl", "datasets"),
                requires={a: ("trl", "datasets") for a in ARMS})


if __name__ == "__main__":
    main()
