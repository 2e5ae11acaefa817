"""Benchmark of ``fuse_cross_entropy``: peak memory and time of one training step of a Llama-shaped model.

Arms (each in a fresh subprocess, same seed and batch, all in one run):

* ``eager``: Hugging Face eager, ``model(input_ids, labels=labels).loss.backward()``
* ``compile``: ``torch.compile(model)`` (Inductor), unmodified model
* ``torch_lce``: torch's ``F.linear_cross_entropy`` with ``LinearCrossEntropyOptions()`` (chunked),
  hand-wired as a user would (``model.model(...)`` hidden states, shifted labels), eager
* ``effpass_off``: effpass's default pipeline without the pass (``disable=["fuse_cross_entropy"]``), Inductor
* ``effpass``: effpass's default pipeline (includes ``fuse_cross_entropy``, default chunk budget), Inductor
* ``effpass_64m``: as ``effpass`` with ``chunk_bytes=64 MiB``
* ``effpass_2m``: as ``effpass`` with the budget of the first version's default (the hidden states: 2 MiB
  here, 2-D tiles and two passes over the vocabulary)
* peers, installed from the package index as a user installs them (``pip install -e ".[bench]"``), each wired
  by hand as its README shows, eager: ``cce`` (Apple's Cut Cross-Entropy, ``impl="torch_compile"`` on CPU,
  its Triton ``"cce"`` kernel on CUDA), ``liger`` (Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss``:
  Triton kernels, CUDA only; on CPU the arm records the error it raises), ``trl_chunked`` (TRL's
  ``ChunkedLogProbFunction``, the op behind its chunked losses, torch tiles on CPU)

Default arms: eager, compile, effpass, torch_lce (``--arms`` picks others).

Per arm: peak memory of one step (forward + backward) above the bytes live before it (CPU:
``effpass.testing.memory.peak_memory``: torch.profiler allocator events, which see Inductor's own buffers;
checked against a known allocation at start-up; CUDA: ``max_memory_allocated``), median step time
after warm-up, first-call (compile) time, and the loss (checked against the eager arm's). On the CPU also
the process CPU time of each timed step (``cpu_s``: all threads; less sensitive than wall time to other jobs
on a shared machine) and the 1-minute load average when the arm ended (``load``).

CPU: fp32, hidden 256, 2 layers, heads 4/2, ffn 688, batch 1 x 2048 tokens, vocab 32,000 and 128,256.
GPU (when present; not run yet): bf16 weights with the same shapes scaled to hidden 2048, 4 layers.

    python bench/bench_cross_entropy.py --vocab 32000             # all arms, one vocabulary
    python bench/bench_cross_entropy.py --vocab 32000 128256      # appends to bench/results/cross_entropy_<device>.{json,md}
    python bench/bench_cross_entropy.py --quick                   # smoke run: small vocabulary, one step

Each (arm, vocabulary) runs in a fresh process under bench/driver.py (deadline, interleaving, results appended per
arm); the vocabulary is a field of each row.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import driver  # noqa: E402
from _common import time_steps  # noqa: E402

ARMS = ("eager", "effpass", "compile", "effpass_off", "effpass_64m", "effpass_2m", "torch_lce", "cce", "liger",
        "trl_chunked")
DEFAULT_ARMS = ("eager", "compile", "effpass", "torch_lce", "cce", "liger", "trl_chunked")
#: peers and the package each needs (the ``bench`` extra)
PEER_PACKAGES = {"cce": "cut-cross-entropy", "liger": "liger-kernel", "trl_chunked": "trl"}


def shape(device: str, vocab: int) -> dict:
    if device == "cuda":
        return dict(hidden=2048, layers=4, heads=16, kv_heads=4, ffn=5504, vocab=vocab, seq=2048, batch=1,
                    dtype="bfloat16", steps=10, warmup=3)
    return dict(hidden=256, layers=2, heads=4, kv_heads=2, ffn=688, vocab=vocab, seq=2048, batch=1,
                dtype="float32", steps=2, warmup=0)  # CPU steps take 15-60 s on the shared machine


def build(cfg: dict, device: str):
    import torch
    import transformers as tf

    torch.manual_seed(0)
    conf = tf.LlamaConfig(vocab_size=cfg["vocab"], hidden_size=cfg["hidden"], intermediate_size=cfg["ffn"],
                          num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"],
                          num_key_value_heads=cfg["kv_heads"], max_position_embeddings=cfg["seq"],
                          bos_token_id=0, eos_token_id=0)
    model = tf.LlamaForCausalLM(conf).to(device=device, dtype=getattr(torch, cfg["dtype"]))
    model.train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g).to(device)
    return model, ids


def run_arm(arm: str, vocab: int, device: str, steps: int | None = None, seq: int | None = None) -> dict:
    import torch
    import torch.nn.functional as F

    import effpass
    from effpass.testing.memory import live_tensor_bytes, peak_memory

    cfg = shape(device, vocab)
    if steps:
        cfg["steps"] = steps
    if seq:  # --quick: a short sequence, no warm-up
        cfg.update(seq=seq, warmup=0)
    model, ids = build(cfg, device)
    stats = {}
    if arm == "eager":
        fwd = lambda: model(input_ids=ids, labels=ids).loss  # noqa: E731
    elif arm == "compile":
        c = torch.compile(model)
        fwd = lambda: c(input_ids=ids, labels=ids).loss  # noqa: E731
    elif arm == "torch_lce":
        if not hasattr(F, "linear_cross_entropy"):
            return {"arm": arm, "vocab": vocab, "error": "torch has no F.linear_cross_entropy"}
        labels = torch.nn.functional.pad(ids, (0, 1), value=-100)[:, 1:].reshape(-1)

        def fwd():
            h = model.model(input_ids=ids).last_hidden_state
            return F.linear_cross_entropy(h.reshape(-1, h.shape[-1]), model.lm_head.weight, labels,
                                          ignore_index=-100, options=torch.nn.LinearCrossEntropyOptions())
    elif arm in PEER_PACKAGES:
        labels = torch.nn.functional.pad(ids, (0, 1), value=-100)[:, 1:].reshape(-1)
        try:
            fwd = _peer_loss(arm, model, ids, labels, device)
        except ImportError as e:
            return {"arm": arm, "vocab": vocab, "error": f"not installed ({PEER_PACKAGES[arm]}): {e}"}
    else:
        passes = None
        opts = {}
        if arm == "effpass_off":
            opts["disable"] = ["fuse_cross_entropy"]
        if arm in ("effpass_64m", "effpass_2m"):
            from effpass.passes import FuseCrossEntropy

            budget = 64 << 20 if arm == "effpass_64m" else cfg["seq"] * cfg["batch"] * cfg["hidden"] * 4
            names = [p for p, k in effpass.registered_passes().items()
                     if k.enabled_by_default(device) and p != "fuse_cross_entropy"]
            passes = [effpass.make_pass(p) for p in names] + [FuseCrossEntropy(chunk_bytes=budget)]
        c = effpass.compile(model, passes=passes, **opts)
        fwd = lambda: c(input_ids=ids, labels=ids).loss  # noqa: E731

    losses = []

    def step():
        loss = fwd()
        loss.backward()
        model.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))

    timing = time_steps(step, cfg, device == "cuda")
    live = live_tensor_bytes(model.parameters())
    _, peak = peak_memory(step, device)
    if arm.startswith("effpass") and arm != "effpass_off":
        stats = effpass.report(c).stats("fuse_cross_entropy")
    return {"arm": arm, "vocab": vocab, "peak_bytes": peak, "live_bytes": live, **timing,
            "load": os.getloadavg()[0] if hasattr(os, "getloadavg") else None, "loss": losses[0], "logits_bytes": cfg["seq"] * vocab * 4,
            "stats": {k: v for k, v in stats.items() if isinstance(v, (int, float))}, "shape": cfg}


def _peer_loss(arm: str, model, ids, labels, device: str):
    """The peer's fused loss over the model's hidden states, wired as its documentation shows."""

    W = model.lm_head.weight

    def hidden():
        h = model.model(input_ids=ids).last_hidden_state
        return h.reshape(-1, h.shape[-1])

    if arm == "cce":
        from cut_cross_entropy import linear_cross_entropy

        impl = "cce" if device == "cuda" else "torch_compile"
        return lambda: linear_cross_entropy(hidden(), W, labels, impl=impl)
    if arm == "liger":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        loss = LigerFusedLinearCrossEntropyLoss()
        return lambda: loss(W, hidden(), labels)
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    valid = labels != -100
    targets = labels.clamp(min=0)

    def trl_loss():
        logp = ChunkedLogProbFunction.apply(hidden(), W, None, targets, 1.0, 4096, None, 1.0, ())[0]
        return -(logp * valid).sum() / valid.sum()

    return trl_loss


def check_method(device: str) -> int:
    """The peak-memory method against a known allocation: 64 MiB written then freed."""
    import torch

    from effpass.testing.memory import peak_memory

    _, peak = peak_memory(lambda: torch.ones(16 << 20, device=device).sum(), device)
    return peak


def worker(arm: str, cfg: dict, device: str) -> dict:
    return run_arm(arm, cfg["vocab"], device, cfg["steps"] or None, cfg.get("seq"))


def main() -> None:
    driver.main(__file__, workload="cross_entropy", arms=ARMS, default_arms=DEFAULT_ARMS, worker=worker,
                cpu_shape=dict(vocab=[32000], steps=0, seq=None), quick=dict(vocab=[4096], steps=1, seq=256),
                overrides=("vocab", "steps"), sweep="vocab", packages=("cut_cross_entropy", "liger_kernel", "trl"),
                requires={"cce": ("cut_cross_entropy",), "liger": ("liger_kernel",), "trl_chunked": ("trl",)},
                meta_extra=lambda cfg: {"method_check_64MiB": check_method(cfg["_device"])},
                markdown=lambda run: markdown(run["meta"], run["results"]),
                log=lambda r: {k: v for k, v in r.items() if k not in ("shape", "steps_s", "steps_cpu_s")})


def markdown(meta: dict, results: list[dict]) -> str:
    mib = lambda b: f"{b / 2**20:,.1f} MiB"  # noqa: E731
    lines = [f"# fuse_cross_entropy benchmark ({meta['device']})", "",
             f"{meta['date']}; torch {meta['torch']}, transformers {meta['transformers']}; load average at the end "
             f"{meta.get('load_average')}. Peak-memory method check: a 64 MiB allocation read "
             f"{meta.get('method_check_64MiB', 0):,} bytes.", ""]
    for vocab in sorted({r["vocab"] for r in results}):
        rows = [r for r in results if r["vocab"] == vocab]
        base = {r["arm"]: r for r in rows if "error" not in r}
        cfg = next((r["shape"] for r in rows if "shape" in r), {})
        lines += [f"## vocabulary {vocab:,}", "",
                  f"Llama-shaped: hidden {cfg.get('hidden')}, {cfg.get('layers')} layers, heads "
                  f"{cfg.get('heads')}/{cfg.get('kv_heads')}, ffn {cfg.get('ffn')}, batch {cfg.get('batch')} x "
                  f"{cfg.get('seq')} tokens, {cfg.get('dtype')}; fp32 logits of the batch: "
                  f"{mib(cfg.get('seq', 0) * vocab * 4)}.", "",
                  "| arm | step peak | vs eager | vs compile | step (median) | vs compile | step CPU time | "
                  "vs compile | load | first call | loss | chunks |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            if "error" in r:
                lines.append(f"| {r['arm']} | error: {r['error'][-120:].strip()!r} |||||||||||")
                continue

            def ratio(key, other):
                o = base.get(other)
                return f"{r[key] / o[key]:.2f}" if o and o.get(key) else "-"

            lines.append(f"| {r['arm']} | {mib(r['peak_bytes'])} | {ratio('peak_bytes', 'eager')} | "
                         f"{ratio('peak_bytes', 'compile')} | {r['step_s'] * 1e3:,.0f} ms | "
                         f"{ratio('step_s', 'compile')} | {r.get('cpu_s', 0) * 1e3:,.0f} ms | "
                         f"{ratio('cpu_s', 'compile')} | {r.get('load') or 0:.1f} | {r['first_call_s']:.1f} s | {r['loss']:.5f} | {r['stats'].get('chunks', '-')} |")
        lines.append("")
    lines += ["Step peak: bytes allocated during one step above those live before it (parameters: "
              "`live_bytes` in the JSON). Step CPU time: the process's CPU time (all threads) of a timed step. "
              "Load: the 1-minute load average when the arm ended. CPU step times are noisy on the shared 2-core "
              "machine (other jobs ran beside it): compare ratios within one run only.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
