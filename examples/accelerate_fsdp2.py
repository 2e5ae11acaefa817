"""Hugging Face Trainer sharding an effpass-compiled model with accelerate's FSDP2 plugin.

    accelerate launch --config_file examples/accelerate_fsdp2.yaml examples/accelerate_fsdp2.py --out runs/fsdp2
    python examples/accelerate_fsdp2.py --out runs/single --batch 4        # the same steps in one process

Each of the N ranks gets ``--batch`` examples per step (the global batch is N x batch); one process with
``--batch N x batch`` sees the same examples, so both runs log the same losses. ``--resume`` continues from
the last checkpoint in ``--out``. The final losses are written to ``OUT/losses.json`` (rank 0).
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import transformers

import effpass


def dataset(n: int, seq: int, vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (n, seq), generator=g)
    return [{"input_ids": r, "labels": r.clone()} for r in ids]


def fsdp_on_cpu_ranks() -> None:
    """NOTE(accelerate on CPU): accelerate 1.x applies its FSDP plugin only on GPU-like devices; on CPU ranks
    it silently trains with DDP instead (``DistributedType.MULTI_CPU``). To test the FSDP2 path on CPU ranks
    (gloo), keep the plugin accelerate built from the launch config. Not needed (and not used) on GPUs."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    orig = AcceleratorState.__init__

    def init(self, *a, fsdp_plugin=None, **k):
        orig(self, *a, fsdp_plugin=fsdp_plugin, **k)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin

    AcceleratorState.__init__ = init


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=2, help="examples per rank per step")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--save-steps", type=int, default=2)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--no-effpass", action="store_true")
    args = ap.parse_args(argv)

    transformers.logging.set_verbosity_error()
    if not torch.cuda.is_available() and os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        fsdp_on_cpu_ranks()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   use_cache=False, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg)
    if not args.no_effpass:
        model = effpass.compile(model, lowering="eager")  # the default pipeline: fused attention and loss
    targs = transformers.TrainingArguments(
        args.out, max_steps=args.steps, per_device_train_batch_size=args.batch, learning_rate=1e-3,
        lr_scheduler_type="constant", logging_steps=1, report_to=[], seed=0, save_strategy="steps",
        save_steps=args.save_steps, use_cpu=not torch.cuda.is_available(), disable_tqdm=True, dataloader_drop_last=True,
        max_grad_norm=0.0)
    steps_run: list[int] = []

    class _Steps(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            steps_run.append(state.global_step)

    trainer = transformers.Trainer(model=model, args=targs, train_dataset=dataset(64, 16, cfg.vocab_size),
                                   callbacks=[_Steps()])
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    if trainer.is_world_process_zero():
        losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
        from torch.distributed.tensor import DTensor

        info = {"losses": losses, "world_size": trainer.args.world_size, "steps_run": steps_run,
                "distributed_type": str(trainer.accelerator.state.distributed_type),
                "sharded_params": sum(isinstance(p, DTensor) for p in model.parameters())}
        if not args.no_effpass:
            rep = effpass.report(model)
            info["graphs"] = len(rep.graphs)
            info["fused_cross_entropy"] = rep.stats("fuse_cross_entropy").get("fused", 0)
            info["fused_attention"] = rep.stats("fuse_attention").get("fused", 0)
            info["adopted_fsdp"] = rep.module.notes.get("adopted_fsdp")


        with open(os.path.join(args.out, "losses.json"), "w") as f:
            json.dump(info, f)
    # every rank leaves together and closes its process group: a rank that exits while another still holds the
    # gloo group open can abort at interpreter exit ("terminate called without an active exception")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
