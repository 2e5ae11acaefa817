"""One TRL ``DPOTrainer`` / ``KTOTrainer`` / ``GRPOTrainer`` / ``RLOOTrainer`` step (issue 40): peak memory and time
per arm.

TRL 1.16's trainers score tokens through the fused LM head they add to the policy and the reference
(``add_fused_lm_head``, TRL's chunked kernel: tiles of 4,096 tokens x 32,768 vocabulary entries); for an
effpass-compiled model effpass routes that head to its own fused ops (``effpass/integrations/_trl_fused_head.py``).
Arms (each in a fresh process, same seed and batch; ``bench/_common.py``'s driver):

* ``eager``: policy and reference as built, TRL's kernel;
* ``compile``: ``model.compile()`` on both (Inductor), TRL's kernel (its ``torch.mm(out=)`` tiles run eagerly);
* ``liger``: TRL's ``use_liger_kernel=True`` (Liger's layer kernels; TRL 1.16 keeps its own fused head and refuses
  Liger's fused linear cross-entropy for these trainers), where Liger is installed;
* ``effpass``: ``effpass.compile`` on both (default pipeline), the routed head.

Shape: a Llama-shaped policy and a separate frozen reference (fp32, hidden 64, 1 layer, vocabulary 128,256), 4 rows
of 512 tokens (a 64-token prompt and a 448-token answer): DPO 2 pairs (chosen + rejected), KTO 4 examples (and TRL's 4
mismatched KL rows), GRPO and RLOO 4 sampled completions. The step: ``trainer.training_step`` (DPO, KTO); for GRPO
and RLOO the reference's per-token log-probs (computed by TRL at generation time; RLOO also scores the policy's own,
without gradients) and ``compute_loss`` + backward on a fixed batch of completions (generation itself is left out: it is the same for every arm and not a loss).
``--dtype bfloat16``: the models' weights in bf16 (as ``from_pretrained(..., dtype=torch.bfloat16)`` loads them). Peak: tensors allocated
during the step above those live at its start (``effpass.testing.memory.peak_memory``), after warm-up steps.

    python bench/bench_trl_trainers.py --trainer dpo    # -> bench/results/dpo_trainer_cpu.{json,md}
    python bench/bench_trl_trainers.py --trainer grpo   # kto, rloo likewise
    python bench/bench_trl_trainers.py --trainer dpo --dtype bfloat16   # -> dpo_trainer_bf16_cpu.{json,md}
"""
from __future__ import annotations

import argparse
import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import llama, time_steps  # noqa: E402

ARMS = ("eager", "compile", "liger", "effpass")
TRAINERS = ("dpo", "kto", "grpo", "rloo")
CPU = dict(trainer="dpo", hidden=64, layers=1, heads=4, kv_heads=2, ffn=128, vocab=128256, prompt=64, answer=448,
           rows=4, dtype="float32", warmup=1, steps=2)
#: --quick: a smoke run
QUICK = dict(vocab=1024, prompt=8, answer=24)


def _tokenizer(vocab):
    import transformers as tf
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<eos>", "<unk>"] + [f"w{i}" for i in range(vocab - 2)]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return tf.PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", pad_token="<eos>", unk_token="<unk>")


def _models(cfg):
    """The policy (``_common.llama``: seed 0) and a reference that differs from it."""
    import torch
    import transformers as tf

    tf.logging.set_verbosity_error()
    shape = {**cfg, "seq": 4096}
    policy = llama(shape, "cpu", tie=False)
    policy.config.pad_token_id = 0
    ref = copy.deepcopy(policy).eval()
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for p in ref.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    return policy, ref


def _trainer(cfg, arm, policy, ref):
    import datasets
    import torch
    import trl

    g = torch.Generator().manual_seed(0)

    def text(n):
        return " ".join(f"w{i}" for i in torch.randint(0, cfg["vocab"] - 2, (n,), generator=g).tolist())

    kind, rows = cfg["trainer"], cfg["rows"]
    common = dict(output_dir=f"/tmp/bench_trl_{kind}", max_steps=3, learning_rate=1e-4, optim="sgd", report_to=[],
                  save_strategy="no", use_cpu=True, disable_tqdm=True, bf16=False, gradient_checkpointing=False,
                  use_liger_kernel=arm == "liger")
    length = cfg["prompt"] + cfg["answer"] + 8
    if kind == "dpo":
        data = datasets.Dataset.from_dict({"prompt": [text(cfg["prompt"]) for _ in range(rows // 2)],
                                           "chosen": [text(cfg["answer"]) for _ in range(rows // 2)],
                                           "rejected": [text(cfg["answer"]) for _ in range(rows // 2)]})
        args = trl.DPOConfig(**common, per_device_train_batch_size=rows // 2, beta=0.1, max_length=length)
        return trl.DPOTrainer(model=policy, ref_model=ref, args=args, train_dataset=data,
                              processing_class=_tokenizer(cfg["vocab"]))
    if kind == "kto":
        data = datasets.Dataset.from_dict({"prompt": [text(cfg["prompt"]) for _ in range(rows)],
                                           "completion": [text(cfg["answer"]) for _ in range(rows)],
                                           "label": [bool(i % 2) for i in range(rows)]})
        args = trl.KTOConfig(**common, per_device_train_batch_size=rows, beta=0.1, max_length=length)
        return trl.KTOTrainer(model=policy, ref_model=ref, args=args, train_dataset=data,
                              processing_class=_tokenizer(cfg["vocab"]))
    # GRPO and RLOO load their reference from the policy's path: the reference's weights are saved there
    path = f"/tmp/bench_trl_{kind}_ref_{os.getpid()}"
    ref.save_pretrained(path)
    policy.config._name_or_path = path
    data = datasets.Dataset.from_dict({"prompt": [text(cfg["prompt"]) for _ in range(rows)]})
    config_cls, trainer_cls = (trl.GRPOConfig, trl.GRPOTrainer) if kind == "grpo" else (trl.RLOOConfig, trl.RLOOTrainer)
    args = config_cls(**common, per_device_train_batch_size=rows, beta=0.04, num_generations=rows,
                      generation_batch_size=rows, max_completion_length=cfg["answer"])
    return trainer_cls(model=policy, reward_funcs=lambda completions, **k: [0.0] * len(completions), args=args,
                           train_dataset=data, processing_class=_tokenizer(cfg["vocab"]))


def _grpo_batch(cfg, tr):
    """A fixed batch of completions as TRL's generation step hands it to the loss (lengths 448 down to 400)."""
    import torch

    g = torch.Generator().manual_seed(2)
    rows, p, a = cfg["rows"], cfg["prompt"], cfg["answer"]
    comp_mask = torch.ones(rows, a, dtype=torch.long)
    for i in range(rows):
        comp_mask[i, a - 16 * i:] = 0  # padded completions
    return {"prompt_ids": torch.randint(2, cfg["vocab"], (rows, p), generator=g),
            "prompt_mask": torch.ones(rows, p, dtype=torch.long),
            "completion_ids": torch.randint(2, cfg["vocab"], (rows, a), generator=g),
            "completion_mask": comp_mask, "advantages": torch.randn(rows, generator=g),
            "num_items_in_batch": comp_mask.sum()}


def worker(arm: str, cfg: dict, device: str) -> dict:
    import importlib

    import torch

    import effpass
    from effpass.testing.memory import peak_memory

    if arm == "liger":
        try:
            importlib.import_module("liger_kernel")
        except ImportError as e:
            return {"arm": arm, "error": f"not installed ({e})"}
    importlib.import_module("trl")  # before effpass.compile, as a user's script does

    policy, ref = _models(cfg)
    grpo = cfg["trainer"] in ("grpo", "rloo")  # the reference TRL loads, the loss on a fixed batch
    compile_ = {"compile": lambda m: m.compile(), "effpass": effpass.compile}.get(arm, lambda m: None)
    compile_(policy)
    if not grpo:
        compile_(ref)
    tr = _trainer(cfg, arm, policy, ref)
    if grpo:  # TRL built the reference (and added its fused head): compiled now
        compile_(tr.ref_model)
    tr.current_gradient_accumulation_steps = 1  # set by train(); the step is called alone here
    losses = []
    if grpo:
        inputs = _grpo_batch(cfg, tr)
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
        mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)

        def step():
            with torch.no_grad():
                inputs["ref_per_token_logps"] = tr._get_per_token_logps_and_entropies(
                    tr.ref_model, ids, mask, cfg["answer"])[0]
                if cfg["trainer"] == "rloo":  # RLOO's scoring: the policy's own sequence log-probs (no grad)
                    old = tr._get_per_token_logps_and_entropies(policy, ids, mask, cfg["answer"])[0]
                    inputs["old_logps"] = (old * inputs["completion_mask"]).sum(1)
            loss = tr.compute_loss(policy, inputs)
            loss.backward()
            losses.append(float(loss))
            policy.zero_grad(set_to_none=True)
    else:
        batch = tr._prepare_inputs(next(iter(tr.get_train_dataloader())))

        def step():
            losses.append(float(tr.training_step(policy, batch)))
            policy.zero_grad(set_to_none=True)

    times = time_steps(step, cfg, cuda=False)
    _, peak = peak_memory(step, "cpu")
    out = {"arm": arm, "peak_bytes": peak, **times, "loss": losses[0], "load_at_step": os.getloadavg()[0]}
    if arm == "effpass":
        for name, m in (("policy", policy), ("reference", tr.ref_model)):
            rep = effpass.report(m)
            st = rep.stats("fuse_cross_entropy")
            out[name] = {"trl_fused_head": rep.module.notes.get("trl_fused_head"),
                         **{k: st.get(k, 0) for k in ("logprob_sites", "rowwise_sites", "trl_logprob_sites",
                                                      "skipped")}}
    return out


def markdown(doc: dict) -> str:
    meta, cfg, results = doc["meta"], doc["shape"], doc["results"]
    kind = {"dpo": "DPOTrainer", "kto": "KTOTrainer", "grpo": "GRPOTrainer", "rloo": "RLOOTrainer"}[cfg["trainer"]]
    lines = [f"# TRL {kind}, one training step (issue 40), CPU, {meta['date'][:16]}", "",
             f"torch {meta['torch']}, transformers {meta['transformers']}, trl {meta.get('trl')}, {meta['device']}, "
             f"load {', '.join(f'{x:.1f}' for x in meta['load_average'] or [])}; shape {cfg}", "",
             "peak: tensors allocated during the step above those live at its start (after the warm-up); step s / "
             "CPU s: median of the timed steps' wall and process CPU seconds", "",
             "| arm | peak MiB | x eager | step s | x compile | step CPU s | x compile | first call s | load | loss | "
             "fused (policy / reference) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    e = next((r for r in results if r["arm"] == "eager" and "peak_bytes" in r), None)
    c = next((r for r in results if r["arm"] == "compile" and "step_s" in r), None)
    for r in results:
        if "error" in r:
            lines.append(f"| {r['arm']} | {r['error'].strip().splitlines()[-1][:160] if r['error'] else '?'} |"
                         + " |" * 9)
            continue

        def fused(x):
            return "" if not x else (f"{x['logprob_sites']} log-prob + {x['rowwise_sites']} row-wise, "
                                     f"{x['trl_logprob_sites']} TRL kernel, routed "
                                     f"{(x['trl_fused_head'] or {}).get('routed_models', 0)}")

        lines.append(f"| {r['arm']} | {r['peak_bytes'] / 2**20:.0f} | "
                     f"{r['peak_bytes'] / e['peak_bytes'] if e else float('nan'):.3f} | {r['step_s']:.2f} | "
                     f"{r['step_s'] / c['step_s'] if c else float('nan'):.2f} | {r['cpu_s']:.2f} | "
                     f"{r['cpu_s'] / c['cpu_s'] if c else float('nan'):.2f} | {r['first_call_s']:.1f} | "
                     f"{r['load_at_step']:.1f} | {r['loss']:.6f} | "
                     f"{fused(r.get('policy'))}{' / ' + fused(r.get('reference')) if r.get('reference') else ''} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import driver

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--trainer", choices=TRAINERS, default="dpo")
    pre.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    known, _ = pre.parse_known_args()
    shape = {**CPU, "trainer": known.trainer, "dtype": known.dtype}
    workload = f"{known.trainer}_trainer" + ("_bf16" if known.dtype == "bfloat16" else "")
    driver.main(__file__, workload=workload, arms=ARMS, worker=worker, markdown=markdown,
                cpu_shape=shape, quick=QUICK, packages=("trl", "liger_kernel"), requires={"liger": ("liger_kernel",)},
                overrides=("trainer", "steps", "warmup", "dtype"))


if __name__ == "__main__":
    main()
