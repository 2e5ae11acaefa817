"""Saved activations compressed (int8 / fp8) or offloaded (issue 25.3-4), CPU: bytes saved for backward and
the forward+backward peak on the long-sequence bench model.

    .venv/bin/python bench/bench_saved_activations.py [--seq 2048] [--arms none,none_int8,...]

The model of bench/bench_long_sequence.py (Llama-shaped: hidden 512, intermediate 1408, 4 layers, 8 heads /
2 KV heads, vocabulary 32,000, fp32), batch 1, random tokens, ``lowering="eager"`` (AOTAutograd's graphs
run with eager kernels). Arms, each ``effpass.compile`` with the default CPU pipeline plus:

* ``none``: nothing; ``none_int8`` / ``none_fp8``: ``CompressActivations(format=...)``;
* ``ckpt``: ``CheckpointActivations(policy="full")``; ``ckpt_int8``: + ``CompressActivations()``;
* ``ckpt_offload``: + ``OffloadActivations(cpu="emulate")``: torch's synchronous rewrite CPU->CPU; only its
  statistics mean something here (which bytes would go to the host); its peak does not (a CPU copy).

Per arm: the pass statistics (saved bytes before/after, storage-true), the peak of one forward+backward
above the bytes live at its start (``effpass.testing.memory.peak_memory``, after a first step that compiles),
the loss, and the relative gradient error (global norm) against the arm without compression/offload.
Results: bench/results/saved_activations_cpu.json and .md (device, versions, date, load).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import effpass  # noqa: E402
from effpass.testing.memory import peak_memory  # noqa: E402

RESULTS = os.environ.get("EFFPASS_BENCH_RESULTS") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
ARMS = ("none", "none_int8", "none_fp8", "ckpt", "ckpt_int8", "ckpt_offload")
BASE = {"none_int8": "none", "none_fp8": "none", "ckpt_int8": "ckpt", "ckpt_offload": "ckpt"}


def build(seq: int, hidden=512, inter=1408, layers=4, vocab=32000):
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256),
                         max_position_embeddings=max(seq, 4096))
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg)
    model.train()
    return model


def passes_of(arm: str):
    from effpass.passes import CheckpointActivations, CompressActivations, OffloadActivations

    out = list(effpass.default_pipeline("cpu", torch.float32))
    if arm.startswith("ckpt"):
        out.append(CheckpointActivations(policy="full"))
    if arm.endswith("_int8"):
        out.append(CompressActivations(format="int8"))
    if arm.endswith("_fp8"):
        out.append(CompressActivations(format="fp8"))
    if arm.endswith("_offload"):
        out.append(OffloadActivations(cpu="emulate"))
    return out


def run_arm(arm: str, seq: int):
    model = build(seq)
    effpass.compile(model, passes=passes_of(arm), lowering=os.environ.get("LOWERING", "eager"))
    ids = torch.randint(0, 32000, (1, seq), generator=torch.Generator().manual_seed(1))

    def step():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return float(loss.detach())

    t = time.perf_counter()
    step()  # compiles
    first = time.perf_counter() - t
    model.zero_grad(set_to_none=True)
    gc.collect()
    t = time.perf_counter()
    loss, peak = peak_memory(step)
    dt = time.perf_counter() - t
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    rep = effpass.report(model)
    stats = {k: rep.stats(k) for k in ("checkpoint_activations", "compress_activations", "offload_activations")
             if rep.stats(k)}
    row = dict(arm=arm, seq=seq, loss=loss, step_peak=peak, step_s=dt, first_step_s=first, stats=stats)
    print(f"  {arm}: loss {loss:.6f} peak {peak / 2**20:.1f} MiB {dt:.1f}s stats {stats}", flush=True)
    del model
    gc.collect()
    return row, grads


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    arms = args.arms.split(",")
    for a in arms:
        if a not in ARMS:
            raise SystemExit(f"unknown arm {a!r}; choose among {list(ARMS)}")
    load_before = os.getloadavg()
    rows, grads = [], {}
    for arm in arms:
        row, g = run_arm(arm, args.seq)
        base = BASE.get(arm)
        if base in grads:
            g0 = grads[base]
            num = sum(float(((g[k] - g0[k]) ** 2).sum()) for k in g0) ** 0.5
            den = sum(float((g0[k] ** 2).sum()) for k in g0) ** 0.5
            row["grad_rel_err_vs_" + base] = num / den
            row["loss_equal_to_" + base] = row["loss"] == next(r["loss"] for r in rows if r["arm"] == base)
        if arm in BASE.values():
            grads[arm] = g
        rows.append(row)
    meta = dict(device=platform.processor() or platform.machine(), torch=torch.__version__, python=platform.python_version(),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                load_before=load_before, load_after=os.getloadavg(), lowering=os.environ.get("LOWERING", "eager"),
                cpus=os.cpu_count())
    os.makedirs(RESULTS, exist_ok=True)
    stem = os.path.join(RESULTS, f"saved_activations_cpu{args.tag}")
    with open(stem + ".json", "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    lines = [f"# Saved activations compressed / offloaded (CPU, {args.seq} tokens)", "",
             f"{meta['date']}, torch {meta['torch']}, lowering {meta['lowering']}, load {load_before} -> "
             f"{meta['load_after']} on {meta['cpus']} CPUs", "",
             "| arm | saved for backward (pass stats) | compressed / offloaded | fwd+bwd peak | loss | grad rel. err |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        st = r["stats"]
        c = st.get("compress_activations", {})
        o = st.get("offload_activations", {})
        ck = st.get("checkpoint_activations", {})
        saved = (f"{c['saved_bytes_before']:,} -> {c['saved_bytes_after']:,} B" if c else
                 f"{ck.get('saved_bytes_measured', 0):,} B" if ck else "")
        what = (f"{c['compressed']} tensors, {c['compressed_bytes_before']:,} -> {c['compressed_bytes_after']:,} B" if c
                else f"{o.get('offloaded', 0)} tensors, {o.get('offloaded_bytes', 0):,} B to host" if o else "")
        err = next((v for k, v in r.items() if k.startswith("grad_rel_err")), None)
        lines.append(f"| {r['arm']} | {saved} | {what} | {r['step_peak'] / 2**20:,.1f} MiB | {r['loss']:.6f} | "
                     f"{'' if err is None else f'{err:.2e}'} |")
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
