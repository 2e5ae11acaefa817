"""Supervised fine-tuning with TRL's ``SFTTrainer`` (default ``SFTConfig``: bf16, gradient checkpointing)
on an effpass-compiled (tiny, random) Llama with LoRA adapters.

    python examples/trl_sft.py       # CPU: 35 s (2 shared cores, load 7.5); EFFPASS_LOWERING=inductor: 129 s cold, 33 s warm

Hugging Face gradient checkpointing is taken over by effpass's checkpoint_activations pass, so attention
and the LoRA adapters stay visible to the graph passes; the tokenizer is built in memory (no download).
"""
import os
import tempfile

import torch
import transformers
import trl

import effpass
from effpass.passes import FuseAttention, InjectLoRA
from effpass.testing import dynamo_counters
from effpass.testing.hf import text_dataset, tiny_tokenizer

transformers.logging.set_verbosity_error()


def make_model():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, bos_token_id=0, eos_token_id=0,
                                      pad_token_id=0)
    config._attn_implementation = "eager"
    return transformers.LlamaForCausalLM(config)


def sft(model, out):
    config = trl.SFTConfig(out, max_steps=3, per_device_train_batch_size=4, logging_steps=1, learning_rate=1e-3,
                           report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True)
    trainer = trl.SFTTrainer(model=model, args=config, train_dataset=text_dataset(12),
                             processing_class=tiny_tokenizer())
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


passes = [InjectLoRA(rank=8, alpha=16, targets=["*.q_proj", "*.k_proj", "*.v_proj", "*.o_proj"]), FuseAttention()]
# On CPU the example lowers without Inductor (the same passes, graphs run by AOTAutograd): a cold Inductor compile
# of this step takes 1-2 minutes on a 2-core CPU. EFFPASS_LOWERING=inductor overrides it (and =eager on a GPU).
LOWERING = "inductor" if torch.cuda.is_available() else "eager"
with tempfile.TemporaryDirectory() as tmp:
    torch.manual_seed(1)
    eager_losses = sft(effpass.prepare(make_model(), passes=passes, lowering=LOWERING), os.path.join(tmp, "eager"))
    torch.manual_seed(1)
    model = effpass.compile(make_model(), passes=passes, lowering=LOWERING)
    with dynamo_counters() as counters:
        losses = sft(model, os.path.join(tmp, "effpass"))
    report = effpass.report(model)
    print("losses (effpass):", [round(x, 5) for x in losses])
    print("losses (eager):  ", [round(x, 5) for x in eager_losses])
    diff = max(abs(a - b) for a, b in zip(losses, eager_losses))
    assert diff < 1e-3, diff  # bf16 autocast (SFTConfig's default) in both runs
    assert len(report.graphs) >= 1 and counters["graph_breaks"] == 0
    print(f"loss matches eager (max difference {diff:.2e}, bf16); {len(report.graphs)} effpass graph(s), "
          f"{counters['graph_breaks']} graph breaks")
    print(report.summary())
