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
Each arm runs in a fresh process under bench/driver.py (deadline, results appended per arm to
bench/results/saved_activations_<device>.{json,md}); the gradients cross processes through a temporary folder.

    .venv/bin/python bench/bench_saved_activations.py --quick   # smoke run: 128 tokens
"""
from __future__ import annotations

import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import effpass  # noqa: E402
from effpass.testing.memory import peak_memory  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import driver  # noqa: E402

#: AOTAutograd's graphs run with this lowering (``--lowering``)
LOWERING = "eager"
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
    effpass.compile(model, passes=passes_of(arm), lowering=LOWERING)
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


def worker(arm: str, cfg: dict, device: str) -> dict:
    global LOWERING
    LOWERING = cfg["lowering"]
    row, grads = run_arm(arm, cfg["seq"])
    if cfg.get("_grads_dir"):
        torch.save(grads, os.path.join(cfg["_grads_dir"], f"{arm}.pt"))
    return row


def compare(grads_dir: str, row: dict, rows: list) -> None:
    """Gradient error (global norm) and loss equality of an arm against its base arm (BASE), if that ran."""
    base = BASE.get(row["arm"])
    path = os.path.join(grads_dir, f"{base}.pt")
    if base is None or not os.path.exists(path):
        return
    g0, g = torch.load(path), torch.load(os.path.join(grads_dir, f"{row['arm']}.pt"))
    num = sum(float(((g[k] - g0[k]) ** 2).sum()) for k in g0) ** 0.5
    den = sum(float((g0[k] ** 2).sum()) for k in g0) ** 0.5
    row["grad_rel_err_vs_" + base] = num / den
    ref = next((r for r in reversed(rows) if r["arm"] == base and "loss" in r), None)
    if ref is not None:
        row["loss_equal_to_" + base] = row["loss"] == ref["loss"]


def markdown(run: dict) -> str:
    meta, cfg = run["meta"], run["shape"]
    lines = [f"# Saved activations compressed / offloaded ({meta['device']}, {cfg['seq']} tokens)", "",
             f"{meta['date']}, torch {meta['torch']}, lowering {cfg['lowering']}, load {meta['load_average']} at the "
             f"start on {meta['cpu_count']} CPUs", "",
             "| arm | saved for backward (pass stats) | compressed / offloaded | fwd+bwd peak | loss | grad rel. err |",
             "|---|---|---|---|---|---|"]
    for r in run["results"]:
        if r.get("status") != "ok":
            lines.append(f"| {r['arm']} | did not run ({r.get('status')}): "
                         f"{(str(r.get('error', '')).strip().splitlines() or ['?'])[-1][:160]} |||||")
            continue
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
    return "\n".join(lines) + "\n"


def main():
    import tempfile

    with tempfile.TemporaryDirectory() as grads_dir:
        done: list = []

        def after(row):
            compare(grads_dir, row, done)
            done.append(row)

        driver.main(__file__, workload="saved_activations", arms=ARMS, worker=worker, markdown=markdown,
                    cpu_shape=dict(seq=2048, lowering="eager"), quick=dict(seq=128), overrides=("seq", "lowering"),
                    configure=lambda args, cfg: cfg.update(_grads_dir=grads_dir), after_arm=after)


if __name__ == "__main__":
    main()
