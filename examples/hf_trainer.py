"""Fine-tune a (tiny, random) Hugging Face Llama with LoRA through ``transformers.Trainer`` and effpass.

    python examples/hf_trainer.py    # CPU: 29 s (2 shared cores, load 7.5); EFFPASS_LOWERING=inductor: 79 s cold, 24 s warm

effpass.compile compiles the model in place, so Trainer gets the model itself: default TrainingArguments
work (columns are kept, the loss is scaled over accumulated microbatches), and ``trainer.save_model``
writes a PEFT adapter that ``peft.PeftModel.from_pretrained`` loads. The same run without effpass is the
reference: the losses match.
"""
import os
import tempfile

import torch
import transformers

import effpass
from effpass.passes import FuseAttention, InjectLoRA
from effpass.testing.hf import lm_dataset

transformers.logging.set_verbosity_error()


def make_model():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, bos_token_id=0, eos_token_id=0)
    config._attn_implementation = "eager"  # hand-written attention: fuse_attention turns it into SDPA
    return transformers.LlamaForCausalLM(config)


def train(model, out):
    args = transformers.TrainingArguments(out, max_steps=4, per_device_train_batch_size=2,
                                          gradient_accumulation_steps=2, logging_steps=1, learning_rate=1e-3,
                                          report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=lm_dataset(16))
    trainer.train()
    return trainer, [h["loss"] for h in trainer.state.log_history if "loss" in h]


passes = [InjectLoRA(rank=8, alpha=16, targets=["*.q_proj", "*.k_proj", "*.v_proj", "*.o_proj"]), FuseAttention()]
# On CPU the example lowers without Inductor (the same passes, graphs run by AOTAutograd): a cold Inductor compile
# of this step takes 1-2 minutes on a 2-core CPU. EFFPASS_LOWERING=inductor overrides it (and =eager on a GPU).
LOWERING = "inductor" if torch.cuda.is_available() else "eager"
with tempfile.TemporaryDirectory() as tmp:
    torch.manual_seed(1)
    reference = effpass.prepare(make_model(), passes=passes, lowering=LOWERING)   # eager: the same adapters, no compile
    _, eager_losses = train(reference, os.path.join(tmp, "eager"))

    torch.manual_seed(1)
    model = effpass.compile(make_model(), passes=passes, lowering=LOWERING)       # in place: `model` is still a LlamaForCausalLM
    trainer, losses = train(model, os.path.join(tmp, "effpass"))
    for step, (a, b) in enumerate(zip(losses, eager_losses)):
        print(f"step {step}: effpass {a:.5f}  eager {b:.5f}")
    diff = max(abs(a - b) for a, b in zip(losses, eager_losses))
    assert diff < 1e-4, diff
    print(f"loss matches eager (max difference {diff:.2e})")

    trainer.save_model(os.path.join(tmp, "adapter"))           # adapter_config.json + adapter_model.safetensors
    print("saved:", sorted(os.listdir(os.path.join(tmp, "adapter"))))
    print(effpass.report(model).summary())
