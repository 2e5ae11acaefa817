"""Per-rank peak memory and step time of ``shard_sequence`` (Ulysses) at sp = 1, 2, 4 (CPU) or 1..8 (GPU).

Each sp runs as its own ``torchrun``-style job (``python -m torch.distributed.run --nproc-per-node sp``), one
after the other, in one invocation, so the ratios are measured under one load.

* CPU (gloo, no GPU here): a small Llama (2 layers, hidden 64, 8 heads / 2 key-value heads, vocabulary
  8192), SDPA attention, fp32, ``lowering="eager"``, one sequence of ``--seq`` tokens (default 8192), every
  rank single-threaded (``OMP_NUM_THREADS=1``). Peak = bytes allocated during one warm forward + backward
  (``effpass.testing.memory.peak_memory``: torch.profiler's allocator events), plus the bytes of the
  tensors live at its start (parameters); the largest over ranks. Step time: median over ``--steps``.
* GPU (NCCL; written, not run here: no GPU in this session): the Llama-3.2-1B shape, bf16 autocast,
  fused cross-entropy, Inductor, ``--seq`` tokens per sequence (default 32768), arms sp = 1n, 1, 2, 4, 8 (those
  with at most as many ranks as GPUs), each its own ``torchrun`` job; per-GPU ``torch.cuda.max_memory_allocated``
  during a warm forward + backward, tokens/s (one sequence per step, shared by the group) and MFU per GPU
  (6 x params x tokens + attention 12 x layers x hidden x seq^2 (causal: halved) per step, over the world and
  the GPU's peak bf16 FLOP/s, ``--peak-tflops``, H100 SXM 989 by default). ``--fsdp`` adds FSDP2 over all
  ranks, ``--attn flash_attention_2`` the flash kernels.

    python bench/bench_sequence_parallel.py                     # CPU: writes bench/results/sequence_parallel_cpu.{json,md}
    python bench/bench_sequence_parallel.py --device cuda       # GPU arm: launches torchrun per arm itself
    python bench/bench_sequence_parallel.py --device cuda --seq 131072 --fsdp --sp 1,2,4,8
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


def _model(device: str, vocab: int | None = None, attn: str = "sdpa"):
    import transformers as tf

    if device == "cuda":   # the Llama-3.2-1B shape
        cfg = tf.LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                             num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=262144,
                             tie_word_embeddings=True)
    else:
        cfg = tf.LlamaConfig(vocab_size=vocab or 8192, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=65536)
    cfg.use_cache = False
    cfg._attn_implementation = attn
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
    model, cfg = _model(args.device, args.vocab, args.attn)
    model.to(dev).train()
    # NOTE: arm "1" runs the pass as a group of one: the same mask handling as the split runs (the pass skips
    # the plain causal S x S mask that Hugging Face materialises under Dynamo), so its ratio is the split's;
    # arm "1n" is the model without the pass (Hugging Face's own masks, compiled the same way)
    passes = [ShardSequence(size=world)] if (world > 1 or not args.no_pass_at_1) else []
    if cuda:
        from effpass.passes import ApplyAutocast, FuseCrossEntropy

        passes += [ApplyAutocast(dtype=torch.bfloat16), FuseCrossEntropy()]
    if args.fsdp:
        from effpass.passes import WrapFSDP

        passes.append(WrapFSDP())
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


#: Llama-3 shapes for the per-rank predictions (random weights on the meta device: nothing is downloaded)
PREDICT_SHAPES = {
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8),
    "70b": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                num_attention_heads=64, num_key_value_heads=8),
}
#: (shape, tokens per sequence, ranks, sequence-parallel size)
PREDICT_ROWS = [("8b", 131072, 8, 8), ("8b", 524288, 8, 8), ("70b", 131072, 16, 8), ("70b", 65536, 8, 8)]


def predict(args) -> None:
    """Per-rank peak predictions (not measurements) for Llama-3-8B/70B shapes at long sequences under
    ``shard_sequence`` + FSDP2 (ZeRO-3 over all ranks), bf16 parameters, AdamW, full activation checkpointing
    and the fused cross-entropy: the planner's own sequence-parallel path
    (``effpass.planning.sharding.sequence_parallel_replay`` / ``fold_sequence_parallel``, what ``effpass plan
    --sequence-parallel N`` runs): one rank's step replayed on ``tokens / sp`` tokens with mask-less causal SDPA
    (what the pass gives plain causal calls), the zero3 fold over all ranks, plus what a rank holds for the whole
    sequence (embedding output and its gradient, rotary tables, labels) and one attention's all-to-all buffers."""
    import torch
    import transformers as tf

    from effpass.passes import CheckpointActivations, FuseCrossEntropy
    from effpass.planning import estimate_memory
    from effpass.planning.sharding import fold_sequence_parallel, sequence_parallel_replay

    rows = []
    for shape, tokens, ranks, sp in PREDICT_ROWS:
        cfg = tf.LlamaConfig(**PREDICT_SHAPES[shape], max_position_embeddings=max(tokens, 8192), use_cache=False,
                             tie_word_embeddings=False)
        cfg._attn_implementation = "sdpa"
        with torch.device("meta"):
            model = tf.LlamaForCausalLM(cfg).to(torch.bfloat16)
        ids = torch.empty((1, tokens), dtype=torch.long, device="meta")
        t0 = time.perf_counter()
        local, restore, terms = sequence_parallel_replay(model, {"input_ids": ids, "labels": ids}, sp)
        try:
            one = estimate_memory(model, local, passes=[CheckpointActivations(policy="full"), FuseCrossEntropy()],
                                  lowering="eager", extrapolate=True)
        finally:
            restore()
        from effpass.planning.estimate import fold_fsdp

        est = fold_sequence_parallel(fold_fsdp(one, ranks, one.largest_unit_bytes), sp, terms)
        per_rank = est.peak_bytes
        row = {"shape": shape, "tokens": tokens, "ranks": ranks, "sp": sp, "data_parallel": ranks // sp,
               "per_rank_bytes": per_rank, "per_rank_gib": per_rank / 2**30, "fits_80gb": per_rank <= 80e9,
               "start_bytes": est.start_bytes, "peak_phase": one.peak_phase,
               "parameters_per_rank": est.parameters, "optimizer_per_rank": est.optimizer_states,
               "gradients_per_rank": est.gradients, "activations": one.activations,
               "one_rank_step_peak": one.step_peak_bytes, "one_rank_gradients_at_peak": one.gradients_at_peak,
               "one_rank_non_gradient_peak": one.non_gradient_peak, "one_rank_phase_peaks": one.phase_peaks,
               "largest_unit_bytes": one.largest_unit_bytes, "sp_terms": terms,
               "seconds": time.perf_counter() - t0}
        print(json.dumps(row), flush=True)
        rows.append(row)
        del model
    import transformers

    try:
        load = os.getloadavg()
    except OSError:  # pragma: no cover
        load = None
    result = {"kind": "prediction (not measured)", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), "torch": torch.__version__, "transformers": transformers.__version__, "load_before": load,
        "method": predict.__doc__, "rows": rows}
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "sequence_parallel_predict.json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = ["# shard_sequence: per-rank peak PREDICTIONS (planner replay, not measured)", "",
             f"{result['date']}, torch {torch.__version__}, transformers {transformers.__version__}; bf16, AdamW, "
             "FSDP2 over all ranks, full checkpointing, fused cross-entropy, one sequence per data group", "",
             "| model | tokens | GPUs | sp | data | predicted peak / GPU | params + AdamW / GPU | gradients / GPU | "
             "saved activations | fits 80 GB | replay s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| Llama-3-{r['shape'].upper()} shape | {r['tokens']:,} | {r['ranks']} | {r['sp']} | "
                     f"{r['data_parallel']} | {r['per_rank_gib']:.1f} GiB | "
                     f"{(r['parameters_per_rank'] + r['optimizer_per_rank']) / 2**30:.1f} GiB | "
                     f"{r['gradients_per_rank'] / 2**30:.1f} GiB | {r['activations'] / 2**30:.1f} GiB | "
                     f"{'yes' if r['fits_80gb'] else 'no'} | {r['seconds']:.0f} |")
    with open(os.path.join(HERE, "results", "sequence_parallel_predict.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--sp", default=None, help="comma-separated arms: sizes, '1n' = one process without the pass "
                    "(default: 1n,1,2,4 on CPU; 1n,1,2,4,8 on GPU)")
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="GPU bf16 dense peak (H100 SXM: 989)")
    ap.add_argument("--tag", default="")
    ap.add_argument("--no-pass-at-1", action="store_true", help="sp=1 without the pass (Hugging Face's own masks)")
    ap.add_argument("--vocab", type=int, default=None, help="CPU model's vocabulary (default 8192)")
    ap.add_argument("--fsdp", action="store_true", help="also shard parameters with FSDP2 (wrap_fsdp) over all ranks")
    ap.add_argument("--attn", default="sdpa", help="attn_implementation (sdpa, flash_attention_2, eager)")
    ap.add_argument("--predict", action="store_true", help="per-rank predictions for 8B/70B shapes (planner replay)")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.seq is None:
        args.seq = 32768 if args.device == "cuda" else 8192
    if args.worker:
        return worker(args)
    if args.predict:
        return predict(args)
    arms = (args.sp or ("1n,1,2,4,8" if args.device == "cuda" else "1n,1,2,4")).split(",")
    if args.device == "cuda":
        import torch

        arms = [a for a in arms if int(a.rstrip("n")) <= torch.cuda.device_count()]
    sizes = arms
    try:
        load = os.getloadavg()
    except OSError:  # pragma: no cover
        load = None
    rows = {}
    for sp in sizes:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            out = f.name
        nopass = str(sp).endswith("n") or args.no_pass_at_1
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(sp).rstrip("n"),
               os.path.abspath(__file__), "--worker", "--device", args.device, "--seq", str(args.seq),
               "--steps", str(args.steps), *(["--vocab", str(args.vocab)] if args.vocab else []),
               *(["--fsdp"] if args.fsdp else []), "--attn", args.attn,
               *(["--no-pass-at-1"] if nopass else []), "--peak-tflops", str(args.peak_tflops), "--out", out]
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

    base = rows["1"] if "1" in rows else rows[sizes[0]]
    b_peak = max(x["peak_bytes"] for x in base)
    b_during = max(x["allocated_during_step"] for x in base)
    b_t = max(x["step_s"] for x in base)
    summary = []
    for sp in sizes:
        peak = max(x["peak_bytes"] for x in rows[sp])
        during = max(x["allocated_during_step"] for x in rows[sp])
        t = max(x["step_s"] for x in rows[sp])
        s = {"sp": sp, "pass": not sp.endswith("n"), "peak_mib": peak / 2**20, "during_step_mib": during / 2**20, "step_s": t,
             "peak_ratio": peak / b_peak, "during_step_ratio": during / b_during, "time_ratio": t / b_t,
             "tokens_per_s": args.seq / t}
        if args.device == "cuda":
            s["mfu"] = statistics.mean(x["mfu"] for x in rows[sp])
        summary.append(s)
    nop = rows.get("1n")
    for s_ in summary:
        if nop:
            s_["peak_ratio_vs_no_pass"] = s_["peak_mib"] * 2**20 / max(x["peak_bytes"] for x in nop)
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
             "Arms: `1n` = one process without the pass (Hugging Face's own masks); `1`, `2`, `4` = the pass with "
             "groups of 1, 2, 4 ranks. Ratios against arm `1` (and against `1n`).", "",
             "| arm | peak / rank (MiB) | allocated during step (MiB) | step (s) | peak ratio | vs 1n | during-step ratio | time ratio |"
             + (" MFU |" if args.device == "cuda" else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|" if args.device == "cuda" else "")]
    for s in summary:
        lines.append(f"| {s['sp']} | {s['peak_mib']:.1f} | {s['during_step_mib']:.1f} | {s['step_s']:.2f} | "
                     f"{s['peak_ratio']:.3f} | {s.get('peak_ratio_vs_no_pass', float('nan')):.3f} | "
                     f"{s['during_step_ratio']:.3f} | {s['time_ratio']:.2f} |"
                     + (f" {s['mfu']:.3f} |" if args.device == "cuda" else ""))
    with open(os.path.join(HERE, "results", name + ".md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
