"""Per-rank peak memory and step time of ``shard_sequence`` (Ulysses) at sp = 1, 2, 4 (CPU) or 1..8 (GPU).

Each sp runs as its own ``torchrun``-style job (``python -m torch.distributed.run --nproc-per-node sp``), one
after the other, in one invocation, so the ratios are measured under one load.

* CPU (gloo, no GPU here): a small Llama (2 layers, hidden 64, 8 heads / 2 key-value heads, vocabulary
  8192), SDPA attention, fp32, ``lowering="eager"``, one sequence of ``--seq`` tokens (default 8192), every
  rank single-threaded (``OMP_NUM_THREADS=1``). Peak = bytes allocated during one warm forward + backward
  (``effpass.testing.memory.peak_memory``: torch.profiler's allocator events), plus the bytes of the
  tensors live at its start (parameters); the largest over ranks. Step time: median over ``--steps``.
* GPU (NCCL; written, not run here: no GPU in this session): the Llama-3.2-1B shape, bf16 autocast,
  Inductor, ``--seq`` tokens per sequence (default 32768), sp = 1, 2, 4, 8 (as many as there are GPUs);
  per-GPU ``torch.cuda.max_memory_allocated``, tokens/s and MFU (6 x params x tokens + attention
  12 x layers x hidden x seq^2 (causal: halved) per step, over the GPU's peak bf16 FLOP/s, ``--peak-tflops``).

    python bench/bench_sequence_parallel.py                     # CPU: writes bench/results/sequence_parallel_cpu.{json,md}
    python bench/bench_sequence_parallel.py --device cuda       # GPU arm
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _model(device: str, vocab: int | None = None):
    import transformers as tf

    if device == "cuda":   # the Llama-3.2-1B shape
        cfg = tf.LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                             num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=262144,
                             tie_word_embeddings=True)
    else:
        cfg = tf.LlamaConfig(vocab_size=vocab or 8192, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=65536)
    cfg.use_cache = False
    cfg._attn_implementation = "sdpa"
    return tf.LlamaForCausalLM(cfg), cfg


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    import effpass
    from effpass.passes import ShardSequence

    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    torch.manual_seed(0)
    model, cfg = _model(args.device, args.vocab)
    model.to(dev).train()
    # NOTE: sp=1 runs the pass too (a group of one): the same mask handling as the split runs (the pass skips
    # the plain causal S x S mask that Hugging Face materialises under Dynamo), so the ratio is the split's
    passes = [ShardSequence(size=world)] if (world > 1 or not args.no_pass_at_1) else []
    if cuda:
        from effpass.passes import ApplyAutocast, FuseCrossEntropy

        passes += [ApplyAutocast(dtype=torch.bfloat16), FuseCrossEntropy()]
    effpass.compile(model, passes=passes, lowering="inductor" if cuda else "eager")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (1, args.seq), generator=g).to(dev)

    def step():
        model(input_ids=ids, labels=ids).loss.backward()

    step()                                   # warm-up (compiles)
    model.zero_grad(set_to_none=False)       # gradients stay allocated: counted as live below
    times = []
    for _ in range(args.steps):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        dist.barrier()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        during = peak - base
    else:
        from effpass.testing.memory import peak_memory

        during = peak_memory(step)[1]
        base = params + grads
        peak = base + during
    n_params = sum(p.numel() for p in model.parameters())
    tokens = args.seq                                # one sequence per step, shared by the group
    flops = 6 * n_params * tokens + 6 * cfg.num_hidden_layers * cfg.hidden_size * tokens ** 2  # causal: half of 12
    t = statistics.median(times)
    row = {"rank": rank, "world": world, "seq": args.seq, "step_s": t, "peak_bytes": peak,
           "allocated_during_step": during, "live_at_start": base, "tokens_per_s": tokens / t,
           "flops_per_step": flops}
    if cuda:
        row["mfu"] = flops / t / world / (args.peak_tflops * 1e12)
    out = [None] * world
    dist.all_gather_object(out, row)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--sp", default=None, help="comma-separated sizes (default: 1,2,4 on CPU; 1,2,4,8 on GPU)")
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="GPU bf16 dense peak (H100 SXM: 989)")
    ap.add_argument("--tag", default="")
    ap.add_argument("--no-pass-at-1", action="store_true", help="sp=1 without the pass (Hugging Face's own masks)")
    ap.add_argument("--vocab", type=int, default=None, help="CPU model's vocabulary (default 8192)")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.seq is None:
        args.seq = 32768 if args.device == "cuda" else 8192
    if args.worker:
        return worker(args)
    sizes = [int(s) for s in (args.sp or ("1,2,4,8" if args.device == "cuda" else "1,2,4")).split(",")]
    if args.device == "cuda":
        import torch

        sizes = [s for s in sizes if s <= torch.cuda.device_count()]
    try:
        load = os.getloadavg()
    except OSError:  # pragma: no cover
        load = None
    rows = {}
    for sp in sizes:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            out = f.name
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(sp),
               os.path.abspath(__file__), "--worker", "--device", args.device, "--seq", str(args.seq),
               "--steps", str(args.steps), *(["--vocab", str(args.vocab)] if args.vocab else []),
               *(["--no-pass-at-1"] if args.no_pass_at_1 else []), "--peak-tflops", str(args.peak_tflops), "--out", out]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": ROOT}
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
        if proc.returncode:
            print(proc.stdout[-2000:], proc.stderr[-4000:], file=sys.stderr)
            raise SystemExit(f"sp={sp} failed")
        rows[sp] = json.load(open(out))
        r = max(rows[sp], key=lambda x: x["peak_bytes"])
        print(f"sp={sp}: peak/rank {r['peak_bytes'] / 2**20:.1f} MiB (during step {r['allocated_during_step'] / 2**20:.1f}"
              f" MiB), step {max(x['step_s'] for x in rows[sp]):.2f} s", flush=True)
    import torch
    import transformers

    base = rows[sizes[0]]
    b_peak = max(x["peak_bytes"] for x in base)
    b_during = max(x["allocated_during_step"] for x in base)
    b_t = max(x["step_s"] for x in base)
    summary = []
    for sp in sizes:
        peak = max(x["peak_bytes"] for x in rows[sp])
        during = max(x["allocated_during_step"] for x in rows[sp])
        t = max(x["step_s"] for x in rows[sp])
        s = {"sp": sp, "peak_mib": peak / 2**20, "during_step_mib": during / 2**20, "step_s": t,
             "peak_ratio": peak / b_peak, "during_step_ratio": during / b_during, "time_ratio": t / b_t,
             "tokens_per_s": args.seq / t}
        if args.device == "cuda":
            s["mfu"] = statistics.mean(x["mfu"] for x in rows[sp])
        summary.append(s)
    result = {"device": args.device, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
              "cpu_count": os.cpu_count(), "load_before": load, "seq": args.seq, "steps": args.steps,
              "vocab": args.vocab, "summary": summary, "per_rank": {str(k): v for k, v in rows.items()}}
    name = f"sequence_parallel_{args.device}{args.tag}"
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", name + ".json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = [f"# shard_sequence: per-rank peak and step time ({args.device}, {args.seq} tokens, one sequence, vocabulary {args.vocab or 'default'})", "",
             f"{result['date']}, torch {torch.__version__}, transformers {transformers.__version__}, "
             f"{os.cpu_count()} CPUs, load average before {load}", "",
             "| sp | peak / rank (MiB) | allocated during step (MiB) | step (s) | peak ratio | during-step ratio | time ratio |"
             + (" MFU |" if args.device == "cuda" else ""),
             "|---|---|---|---|---|---|---|" + ("---|" if args.device == "cuda" else "")]
    for s in summary:
        lines.append(f"| {s['sp']} | {s['peak_mib']:.1f} | {s['during_step_mib']:.1f} | {s['step_s']:.2f} | "
                     f"{s['peak_ratio']:.3f} | {s['during_step_ratio']:.3f} | {s['time_ratio']:.2f} |"
                     + (f" {s['mfu']:.3f} |" if args.device == "cuda" else ""))
    with open(os.path.join(HERE, "results", name + ".md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
