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

    python bench/bench_sequence_parallel.py                     # appends to bench/results/sequence_parallel_<device>.*
    python bench/bench_sequence_parallel.py --device cpu --quick  # smoke run: 512 tokens, vocabulary 1,024
    python bench/bench_sequence_parallel.py --seq 131072 --fsdp --arms 1,2,4,8   # on GPUs
    python bench/bench_sequence_parallel.py --predict           # 8B/70B per-rank predictions (planner replay)

Each arm (an sp size) runs in a fresh process under bench/driver.py (deadline for the arm's whole process group,
torchrun and its ranks included; results appended per arm). The vocabulary, length and options are fields of the
run, not file names.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import driver  # noqa: E402


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


def predict_row(shape: str, tokens: int, ranks: int, sp: int) -> dict:
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
    return {"shape": shape, "tokens": tokens, "ranks": ranks, "sp": sp, "data_parallel": ranks // sp,
            "per_rank_bytes": per_rank, "per_rank_gib": per_rank / 2**30, "fits_80gb": per_rank <= 80e9,
            "start_bytes": est.start_bytes, "peak_phase": one.peak_phase,
            "parameters_per_rank": est.parameters, "optimizer_per_rank": est.optimizer_states,
            "gradients_per_rank": est.gradients, "activations": one.activations,
            "one_rank_step_peak": one.step_peak_bytes, "one_rank_gradients_at_peak": one.gradients_at_peak,
            "one_rank_non_gradient_peak": one.non_gradient_peak, "one_rank_phase_peaks": one.phase_peaks,
            "largest_unit_bytes": one.largest_unit_bytes, "sp_terms": terms,
            "seconds": time.perf_counter() - t0}


PREDICT_ARMS = {f"{shape}_{tokens}_{ranks}gpu_sp{sp}": (shape, tokens, ranks, sp)
                for shape, tokens, ranks, sp in PREDICT_ROWS}


def predict_markdown(run: dict) -> str:
    m = run["meta"]
    rows = [r for r in run["results"] if r.get("status") == "ok"]
    lines = ["# shard_sequence: per-rank peak PREDICTIONS (planner replay, not measured)", "",
             f"{m['date']}, torch {m['torch']}, transformers {m['transformers']}; bf16, AdamW, "
             "FSDP2 over all ranks, full checkpointing, fused cross-entropy, one sequence per data group. "
             "Method: " + " ".join((predict_row.__doc__ or "").split()), "",
             "| model | tokens | GPUs | sp | data | predicted peak / GPU | params + AdamW / GPU | gradients / GPU | "
             "saved activations | fits 80 GB | replay s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| Llama-3-{r['shape'].upper()} shape | {r['tokens']:,} | {r['ranks']} | {r['sp']} | "
                     f"{r['data_parallel']} | {r['per_rank_gib']:.1f} GiB | "
                     f"{(r['parameters_per_rank'] + r['optimizer_per_rank']) / 2**30:.1f} GiB | "
                     f"{r['gradients_per_rank'] / 2**30:.1f} GiB | {r['activations'] / 2**30:.1f} GiB | "
                     f"{'yes' if r['fits_80gb'] else 'no'} | {r['seconds']:.0f} |")
    for r in run["results"]:
        if r.get("status") != "ok":
            lines.append(f"\n{r['arm']}: {r.get('status')}: "
                         f"{(str(r.get('error', '')).strip().splitlines() or ['?'])[-1][:200]}")
    return "\n".join(lines) + "\n"


ARMS = ("1n", "1", "2", "4", "8")


def sp_worker(arm: str, cfg: dict, device: str) -> dict:
    """One sp arm: a ``torchrun`` job of ``sp`` ranks (``--rank-worker``); the per-rank rows."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    nopass = arm.endswith("n") or cfg["no_pass_at_1"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", arm.rstrip("n"),
           os.path.abspath(__file__), "--rank-worker", "--device", device, "--seq", str(cfg["seq"]),
           "--steps", str(cfg["steps"]), *(["--vocab", str(cfg["vocab"])] if cfg["vocab"] else []),
           *(["--fsdp"] if cfg["fsdp"] else []), "--attn", cfg["attn"],
           *(["--no-pass-at-1"] if nopass else []), "--peak-tflops", str(cfg["peak_tflops"]), "--out", out]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": ROOT}
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    if proc.returncode:
        sys.stderr.write(proc.stdout[-2000:] + proc.stderr[-4000:])
        raise SystemExit(f"sp={arm} failed (torchrun exit code {proc.returncode})")
    with open(out) as f:
        rows = json.load(f)
    os.unlink(out)
    return {"arm": arm, "per_rank": rows}


def sp_markdown(run: dict) -> str:
    m, cfg = run["meta"], run["shape"]
    cuda = m.get("device_tag", "cpu") != "cpu"
    rows = {r["arm"]: r["per_rank"] for r in run["results"] if r.get("status") == "ok"}
    if not rows:
        return driver.table(run)
    sizes = list(rows)
    base = rows["1"] if "1" in rows else rows[sizes[0]]
    b_peak = max(x["peak_bytes"] for x in base)
    b_during = max(x["allocated_during_step"] for x in base)
    b_t = max(x["step_s"] for x in base)
    summary = []
    for sp in sizes:
        peak = max(x["peak_bytes"] for x in rows[sp])
        during = max(x["allocated_during_step"] for x in rows[sp])
        t = max(x["step_s"] for x in rows[sp])
        s = {"sp": sp, "pass": not sp.endswith("n"), "peak_mib": peak / 2**20, "during_step_mib": during / 2**20,
             "step_s": t, "peak_ratio": peak / b_peak, "during_step_ratio": during / b_during, "time_ratio": t / b_t,
             "tokens_per_s": cfg["seq"] / t}
        if cuda:
            s["mfu"] = statistics.mean(x["mfu"] for x in rows[sp])
        summary.append(s)
    nop = rows.get("1n")
    for s_ in summary:
        if nop:
            s_["peak_ratio_vs_no_pass"] = s_["peak_mib"] * 2**20 / max(x["peak_bytes"] for x in nop)
    lines = [f"# shard_sequence: per-rank peak and step time ({m.get('device_tag')}, {cfg['seq']} tokens, one sequence, "
             f"vocabulary {cfg['vocab'] or 'default'})", "",
             f"{m['date']}, torch {m['torch']}, transformers {m['transformers']}, "
             f"{m['cpu_count']} CPUs, load average before {m['load_average']}", "",
             "Arms: `1n` = one process without the pass (Hugging Face's own masks); `1`, `2`, `4` = the pass with "
             "groups of 1, 2, 4 ranks. Ratios against arm `1` (and against `1n`).", "",
             "| arm | peak / rank (MiB) | allocated during step (MiB) | step (s) | peak ratio | vs 1n | during-step ratio | time ratio |"
             + (" MFU |" if cuda else ""),
             "|---|---|---|---|---|---|---|---|" + ("---|" if cuda else "")]
    for s in summary:
        lines.append(f"| {s['sp']} | {s['peak_mib']:.1f} | {s['during_step_mib']:.1f} | {s['step_s']:.2f} | "
                     f"{s['peak_ratio']:.3f} | {s.get('peak_ratio_vs_no_pass', float('nan')):.3f} | "
                     f"{s['during_step_ratio']:.3f} | {s['time_ratio']:.2f} |"
                     + (f" {s['mfu']:.3f} |" if cuda else ""))
    for r in run["results"]:
        if r.get("status") != "ok":
            lines.append(f"\n{r['arm']}: {r.get('status')}: "
                         f"{(str(r.get('error', '')).strip().splitlines() or ['?'])[-1][:200]}")
    return "\n".join(lines) + "\n"


def main():
    if "--rank-worker" in sys.argv:  # one rank of an arm's torchrun job
        ap = argparse.ArgumentParser()
        ap.add_argument("--rank-worker", action="store_true")
        ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
        ap.add_argument("--seq", type=int)
        ap.add_argument("--steps", type=int, default=1)
        ap.add_argument("--peak-tflops", type=float, default=989.0)
        ap.add_argument("--no-pass-at-1", action="store_true")
        ap.add_argument("--vocab", type=int, default=None)
        ap.add_argument("--fsdp", action="store_true")
        ap.add_argument("--attn", default="sdpa")
        ap.add_argument("--out", default=None)
        return worker(ap.parse_args())
    if "--predict" in sys.argv or any(a in PREDICT_ARMS for a in sys.argv):  # (an arm's worker: its name says)
        if "--predict" in sys.argv:
            sys.argv.remove("--predict")
        return driver.main(__file__, workload="sequence_parallel_predict", arms=tuple(PREDICT_ARMS),
                           worker=lambda arm, cfg, device: {"arm": arm, **predict_row(*PREDICT_ARMS[arm])},
                           markdown=predict_markdown, cpu_shape={}, overrides=(), deadline_s=3 * 3600,
                           meta_extra=lambda cfg: {"argv": ["bench/bench_sequence_parallel.py", "--predict"]
                                                   + sys.argv[1:]})

    def jobs(chosen, cfg):
        if chosen == list(ARMS):  # no --arms: 1n,1,2,4 on CPU; on GPUs those with at most as many ranks as GPUs
            if cfg["_device"] == "cuda":
                import torch

                chosen = [a for a in ARMS if int(a.rstrip("n")) <= torch.cuda.device_count()]
            else:
                chosen = ["1n", "1", "2", "4"]
        return [(a, {}) for a in chosen]

    opts = dict(steps=1, vocab=0, fsdp=False, attn="sdpa", no_pass_at_1=False, peak_tflops=989.0)
    driver.main(__file__, workload="sequence_parallel", arms=ARMS, worker=sp_worker, markdown=sp_markdown,
                cpu_shape=dict(seq=8192, **opts), gpu_shape=dict(seq=32768, **opts), quick=dict(seq=512, vocab=1024),
                overrides=("seq", "steps", "vocab", "fsdp", "attn", "no_pass_at_1", "peak_tflops"), jobs=jobs)


if __name__ == "__main__":
    main()
