"""Train a Llama-style model with effpass + FSDP2 under torchrun, with sharded checkpoints and resume.

One node, N processes (CPU with gloo, or GPUs with NCCL: picked from ``torch.cuda.is_available()``)::

    torchrun --standalone --nproc-per-node 2 examples/train_fsdp.py --steps 20 --ckpt-dir /tmp/ckpt

Several nodes (run the same command on every node; ``host:port`` is reachable from all of them)::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint host0:29500 \\
        examples/train_fsdp.py --model 1b --autocast bf16 --replicate 2 --ckpt-dir /shared/ckpt

The job resumes from the newest complete checkpoint in ``--ckpt-dir``, so a relaunch (or torchrun's own
restart, ``--max-restarts 3``) after a crash continues where it left off. ``--fail-at-step K`` kills
rank 1 once at step K (a marker file in the checkpoint directory remembers that it did) to test this.
The data of step ``k`` depends only on ``--seed`` and ``k``, so a resumed run repeats the uninterrupted one.
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

import effpass
from effpass.passes import WrapFSDP
from effpass.passes.wrap_fsdp import load_checkpoint, save_checkpoint


def build_model(name: str):
    import transformers as tf

    if name == "tiny":
        cfg = tf.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    elif name == "1b":  # the Llama-3.2-1B shape
        cfg = tf.LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                             num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
                             tie_word_embeddings=True)
    else:
        raise ValueError(f"--model {name!r}: choose 'tiny' or '1b'")
    cfg.use_cache = False
    return tf.LlamaForCausalLM(cfg), cfg.vocab_size


def batch_of(step: int, seed: int, batch: int, seq: int, vocab: int, rank: int, world: int, device):
    """The global batch of ``step`` (a function of seed and step only), this rank's slice."""
    if batch % world:
        raise ValueError(f"--batch {batch} must be divisible by the world size {world}")
    g = torch.Generator().manual_seed(seed * 100003 + step)
    tokens = torch.randint(0, vocab, (batch, seq), generator=g)
    per = batch // world
    return tokens[rank * per:(rank + 1) * per].to(device)


def latest_checkpoint(ckpt_dir: str | None) -> tuple[str | None, int]:
    """The newest complete checkpoint (DCP writes ``.metadata`` last) and its step."""
    if not ckpt_dir or not os.path.isdir(ckpt_dir):
        return None, 0
    steps = [int(d.split("_")[1]) for d in os.listdir(ckpt_dir)
             if d.startswith("step_") and os.path.exists(os.path.join(ckpt_dir, d, ".metadata"))]
    if not steps:
        return None, 0
    return os.path.join(ckpt_dir, f"step_{max(steps)}"), max(steps)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny", help="tiny | 1b")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=4, help="global batch (split over ranks)")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lowering", default="eager", choices=["eager", "inductor"])
    ap.add_argument("--autocast", default="none", choices=["none", "bf16", "fp16"])
    ap.add_argument("--lora", type=int, default=0, help="LoRA rank (0: full fine-tuning)")
    ap.add_argument("--no-reshard", action="store_true", help="reshard_after_forward=False (ZeRO-2-like)")
    ap.add_argument("--replicate", type=int, default=1, help="HSDP replica groups (e.g. the number of nodes)")
    ap.add_argument("--ckpt-dir", default=None)
    ap.add_argument("--ckpt-every", type=int, default=5)
    ap.add_argument("--out", default=None, help="save the final full state dict here (rank 0)")
    ap.add_argument("--fail-at-step", type=int, default=-1, help="rank 1 dies once at this step (fault test)")
    args = ap.parse_args(argv)

    use_cuda = torch.cuda.is_available()
    owns_group = not dist.is_initialized()      # main() may run inside an already initialised job (tests)
    if owns_group:
        dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(args.seed)  # identical initial weights on every rank
    model, vocab = build_model(args.model)
    model.to(device).train()
    passes: list = []
    if args.autocast != "none":
        from effpass.passes import ApplyAutocast

        passes.append(ApplyAutocast(dtype=torch.bfloat16 if args.autocast == "bf16" else torch.float16))
    if args.lora:
        from effpass.passes import InjectLoRA

        passes.append(InjectLoRA(rank=args.lora, targets=["model.layers.*.self_attn.*_proj"]))
    passes.append(WrapFSDP(reshard_after_forward=not args.no_reshard, replicate=args.replicate))
    model = effpass.compile(model, passes=passes, lowering=args.lowering, dump_dir=None)

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    state = {"step": 0}
    path, _ = latest_checkpoint(args.ckpt_dir)
    if path:
        state = load_checkpoint(path, model, opt, extra=state)
        if rank == 0:
            print(f"resumed from {path} at step {state['step']}", flush=True)

    t0 = time.perf_counter()
    for step in range(state["step"], args.steps):
        if step == args.fail_at_step and rank == 1 and args.ckpt_dir:
            marker = os.path.join(args.ckpt_dir, "failed_once")
            if not os.path.exists(marker):
                open(marker, "w").close()
                print(f"rank 1: simulated crash at step {step}", flush=True)
                os._exit(17)
        tokens = batch_of(step, args.seed, args.batch, args.seq, vocab, rank, world, device)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            print(f"step {step} loss {loss.item():.6f}", flush=True)
        if args.ckpt_dir and (step + 1) % args.ckpt_every == 0:
            save_checkpoint(os.path.join(args.ckpt_dir, f"step_{step + 1}"), model, opt, extra={"step": step + 1})
    if rank == 0:
        print(f"{args.steps - state['step']} steps in {time.perf_counter() - t0:.2f} s", flush=True)

    if args.out:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            torch.save(full, args.out)
    dist.barrier()
    if owns_group:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
