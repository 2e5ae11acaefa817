"""effpass's Axolotl plugin inside the real Axolotl (``axolotl.cli.train.do_cli``, what ``axolotl train cfg.yml``
runs): a tiny Llama built from a local directory (random weights, a tokenizer trained here on a few strings), a local
alpaca JSONL, LoRA on every linear layer, 2 steps on CPU. Trained once without the plugin and once with it, each in
its own process (Axolotl's PluginManager is a process-wide singleton and Axolotl patches transformers in place).

Runs only where Axolotl is importable: scripts/axolotl_check.sh builds a virtual environment with Axolotl 0.19.0
(the last release that allows Python 3.11) and runs this file there. The project's own environment has no Axolotl,
so CI skips it as an optional extra.

This file is also the driver the tests start: ``python tests/integrations/test_axolotl_real.py CONFIG OUT.json``.
"""
import json
import math
import os
import subprocess
import sys

import pytest

EFFPASS_SECTION = {"passes": {"fuse_attention": {}, "fuse_cross_entropy": {}}, "lowering": "eager"}

TEMPLATE = ("Below is an instruction that describes a task. Write a response that appropriately completes the request."
            "\n\n### Instruction:\n{instruction}\n\n### Response:\n{output}")


def make_assets(root):
    """A tiny random Llama and a byte-level BPE tokenizer trained on the data (no downloads), and the alpaca JSONL."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    rows = [{"instruction": f"Add {a} and {b}.", "input": "", "output": f"The sum of {a} and {b} is {a + b}."}
            for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (2, 9), (4, 4), (6, 1), (8, 3)]]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEMPLATE.format(**r) for r in rows],
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>")
    model_dir = os.path.join(root, "model")
    fast.save_pretrained(model_dir)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id, pad_token_id=fast.pad_token_id)
    LlamaForCausalLM(cfg).save_pretrained(model_dir)
    with open(os.path.join(root, "data.jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return model_dir


def write_config(root, name, effpass=None, **extra):
    """An Axolotl YAML for the tiny model; ``effpass``: the plugin and this ``effpass:`` section."""
    import yaml

    cfg = {
        "base_model": os.path.join(root, "model"), "model_type": "LlamaForCausalLM", "tokenizer_type": "AutoTokenizer",
        "datasets": [{"path": os.path.join(root, "data.jsonl"), "ds_type": "json", "type": "alpaca"}],
        "dataset_prepared_path": os.path.join(root, "prepared"), "val_set_size": 0,
        "output_dir": os.path.join(root, "out-" + name),
        "sequence_len": 256, "sample_packing": False,
        "attn_implementation": "eager",  # transformers' eager attention: fuse_attention has sites to fuse
        "adapter": "lora", "lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "lora_target_linear": True,
        "micro_batch_size": 2, "gradient_accumulation_steps": 1, "max_steps": 2, "num_epochs": 1,
        "optimizer": "adamw_torch", "lr_scheduler": "constant", "learning_rate": 1e-3, "seed": 42,
        "logging_steps": 1, "save_strategy": "no", "bf16": False, "fp16": False, "tf32": False,
    }
    if effpass is None:
        # Axolotl auto-enables its fused LoRA kernels when none is set; their SwiGLU kernel is Triton (CUDA only).
        # With the plugin they stay unset: the plugin turns them off (Dynamo cannot trace the QKV and O kernels)
        cfg.update(lora_mlp_kernel=False, lora_qkv_kernel=False, lora_o_kernel=False, lora_embedding_kernel=False)
    else:
        cfg["plugins"] = ["effpass.integrations.axolotl.EffpassPlugin"]
        cfg["effpass"] = effpass
    cfg.update(extra)
    path = os.path.join(root, name + ".yml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


def run_axolotl(config, out, cwd, timeout=1200, expect_failure=False):
    """``axolotl train CONFIG`` in a fresh process (this file as the driver); returns what the driver recorded
    (``expect_failure``: the failed process's stderr)."""
    env = dict(os.environ, AXOLOTL_DO_NOT_TRACK="1", WANDB_MODE="disabled", HF_HUB_OFFLINE="1",
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), config, out], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)
    if expect_failure:
        assert proc.returncode != 0 and not os.path.exists(out), proc.stdout[-4000:]
        return proc.stderr
    if proc.returncode != 0 or not os.path.exists(out):
        raise AssertionError(f"axolotl train {config} failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[-8000:]}")
    with open(out) as f:
        return json.load(f)


def _drive(config, out):
    """Axolotl's CLI entry point (``do_cli``: config loading and validation, plugin registration, dataset
    preparation, ``axolotl.train.train``, ``post_train_unload``), recording the Trainer's exact log history."""
    import torch

    import axolotl.cli.train as cli
    from axolotl.train import train as axolotl_train

    record = {}

    def train(cfg, dataset_meta):
        model, tokenizer, trainer = axolotl_train(cfg=cfg, dataset_meta=dataset_meta)
        logs = [h for h in trainer.state.log_history if "loss" in h]
        record["losses"] = [h["loss"] for h in logs]
        record["grad_norms"] = [h.get("grad_norm") for h in logs]
        import effpass
        from effpass.integrations.huggingface import is_effpass_compiled

        record["lora_kernels"] = {k: cfg.get(k) for k in ("lora_mlp_kernel", "lora_qkv_kernel", "lora_o_kernel",
                                                          "lora_embedding_kernel")}
        record["compiled"] = bool(is_effpass_compiled(trainer.model))
        if record["compiled"]:
            rep = effpass.report(trainer.model)
            record["stats"] = {p: rep.stats(p) for p in ("fuse_attention", "fuse_cross_entropy")}
        return model, tokenizer, trainer

    cli.train = train  # do_train looks its train function up in the module
    sys.argv = [sys.argv[0]]  # do_cli parses the remaining command line as TrainerCliArgs
    # Axolotl 0.19 seeds only in Trainer(), after it has initialised the LoRA adapters: seed here so both runs
    # start from the same adapters
    torch.manual_seed(0)
    cli.do_cli(config=config)
    with open(out, "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    _drive(sys.argv[1], sys.argv[2])
    sys.exit(0)

pytest.importorskip("axolotl.cli.train", reason="optional extra: Axolotl (scripts/axolotl_check.sh builds a "
                                                "virtual environment with it and runs this file)")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("axolotl"))
    make_assets(root)
    base = run_axolotl(write_config(root, "base"), os.path.join(root, "base.json"), root)
    section = dict(EFFPASS_SECTION, dump_dir=os.path.join(root, "dump"))
    eff = run_axolotl(write_config(root, "effpass", effpass=section), os.path.join(root, "effpass.json"), root)
    return root, base, eff


def test_axolotl_trains_with_the_plugin_and_the_losses_match(runs):
    root, base, eff = runs
    # structural: without the plugin nothing is compiled; with it effpass compiled the model Axolotl built (PEFT LoRA
    # included) and its passes rewrote the attention of both layers and the loss
    assert base["compiled"] is False
    assert eff["compiled"] is True
    # the config left Axolotl's LoRA kernels unset: the plugin turned them off before Axolotl could switch them on
    assert eff["lora_kernels"] == dict.fromkeys(eff["lora_kernels"], False) and len(eff["lora_kernels"]) == 4
    assert eff["stats"]["fuse_attention"]["fused"] == 2
    assert eff["stats"]["fuse_cross_entropy"]["fused"] == 1
    dump = os.path.join(root, "dump")
    assert os.path.exists(os.path.join(dump, "report.html"))
    assert any(d.startswith("graph_") and os.path.exists(os.path.join(dump, d, "index.json")) for d in os.listdir(dump))
    # numerical: the same 2 steps (same data order, same adapters) give the same losses and gradient norms; the fused
    # attention and chunked loss reorder float32 sums (measured: 1.7e-7 relative on the second step)
    assert len(base["losses"]) == len(eff["losses"]) == 2
    assert all(math.isfinite(x) for x in eff["losses"])
    assert eff["losses"] == pytest.approx(base["losses"], rel=1e-5)
    assert eff["grad_norms"] == pytest.approx(base["grad_norms"], rel=1e-4)


def test_axolotl_lora_qkv_kernel_is_refused_by_name(runs):
    root = runs[0]
    config = write_config(root, "qkv", effpass=dict(EFFPASS_SECTION), lora_qkv_kernel=True)
    err = run_axolotl(config, os.path.join(root, "qkv.json"), root, expect_failure=True)
    assert "lora_qkv_kernel: true" in err and "set lora_qkv_kernel: false" in err
