"""8-bit optimizer states against the peers: full fine-tuning of a Llama-shaped model, all arms in one run,
each in a fresh process.

Arms (same seed, weights and batches; lr 1e-3, weight decay 0.01; every parameter trainable):

* ``adamw``: ``torch.optim.AdamW``, fp32 states (the reference: the lossless loss curve)
* ``torchao_adamw8bit``: ``torchao.optim.AdamW8bit`` (uint8 states in blocks of 256 with fp32 scales;
  its per-parameter step is compiled with Inductor once per parameter shape: the model here has few
  shapes, see below)
* ``bnb_adamw8bit``: ``bitsandbytes.optim.AdamW8bit`` (block-wise dynamic 8-bit states; bitsandbytes
  >= 0.48 has a CPU backend, so the arm runs on the CPU too)
* ``effpass_adamw8bit``: effpass's 8-bit option as the planner builds it, ``effpass.memory_options.
  build_optimizer("adamw8bit", ...)`` (which is torchao's AdamW8bit: effpass has no 8-bit optimizer of its
  own), on the model through ``effpass.compile`` with ``StepInBackward()``: each parameter's 8-bit update runs as
  soon as its gradient is complete and the gradient is freed, so the gradients never all exist at once

Per arm: optimizer-state bytes as storage holds them (``effpass.quantized.storage_bytes`` over every
tensor in ``opt.state``; torchao's states are tensor subclasses, counted by their inner tensors), bytes
live at the step's start, the step's peak above them (CPU: ``effpass.testing.memory.peak_memory``;
CUDA: ``max_memory_allocated``), median time of the optimizer step alone (not for the step-in-backward
arm, whose update runs inside backward) and of the whole step, the loss after ``steps`` updates and
its difference from ``adamw``'s.

Shapes: hidden = ffn = 512, 8 heads / 8 KV heads, vocabulary 4,096 (embedding and head untied), so the
2-D parameters have two shapes ([512, 512] and [4096, 512]) and torchao compiles few step graphs.

    python bench/bench_optim8bit.py            # writes bench/results/optim8bit_<device>.{json,md}
"""
from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import driver  # noqa: E402
from _common import llama, time_steps, timed, token_batches  # noqa: E402

ARMS = ("adamw", "torchao_adamw8bit", "bnb_adamw8bit", "effpass_adamw8bit")
CPU_SHAPE = dict(vocab=4096, hidden=512, ffn=512, layers=4, heads=8, kv_heads=8, seq=256, batch=1,
                 dtype="float32", steps=6, warmup=2)
GPU_SHAPE = dict(vocab=32768, hidden=2048, ffn=2048, layers=16, heads=16, kv_heads=16, seq=2048, batch=1,
                 dtype="float32", steps=20, warmup=3)


def build(cfg: dict, device: str):
    """The model and one batch per call: the first, the warm-up, the timed steps and the peak's (4 distinct)."""
    batches = token_batches(cfg, device, 4)
    return llama(cfg, device, tie=False), [batches[i % 4] for i in range(1 + cfg["warmup"] + cfg["steps"] + 1)]


def worker(arm: str, cfg: dict, device: str) -> dict:
    import torch

    import effpass
    from effpass.quantized import storage_bytes
    from effpass.testing.memory import peak_memory

    model, batches = build(cfg, device)
    run = model
    kw = dict(lr=1e-3, weight_decay=0.01)
    if arm == "adamw":
        opt = torch.optim.AdamW(model.parameters(), **kw)
    elif arm == "torchao_adamw8bit":
        from torchao.optim import AdamW8bit

        opt = AdamW8bit(model.parameters(), **kw)
    elif arm == "bnb_adamw8bit":
        import bitsandbytes as bnb

        opt = bnb.optim.AdamW8bit(model.parameters(), **kw)
    else:
        from effpass.passes import StepInBackward
        from effpass.passes.step_in_backward import attach

        from effpass.memory_options import build_optimizer

        run = effpass.compile(model, passes=[StepInBackward()], lowering="eager" if device == "cpu" else "inductor")
        opt = build_optimizer("adamw8bit", model.parameters(), lr=kw["lr"], device=torch.device(device))
        for g in opt.param_groups:
            g["weight_decay"] = kw["weight_decay"]
        attach(opt)
    it = iter(batches)
    losses, opt_times = [], []
    cuda = device == "cuda"

    def step():
        ids = next(it)
        loss = run(input_ids=ids, labels=ids).loss
        loss.backward()
        opt_times.append(timed(opt.step, cuda))
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))

    timing = time_steps(step, cfg, cuda)
    del opt_times[:1 + cfg["warmup"]]  # the optimizer steps of the timed steps only
    states = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    state_bytes = storage_bytes(states)
    live = storage_bytes(list(model.parameters()) + list(model.buffers()) + states)
    loss_end = losses[-1]
    _, peak = peak_memory(step, device)
    n_params = sum(p.numel() for p in model.parameters())
    out = {"arm": arm, "optimizer": f"{type(opt).__module__}.{type(opt).__name__}", "state_bytes": state_bytes,
           "state_bytes_per_param": state_bytes / n_params, "params": n_params, "live_bytes": live,
           "peak_bytes": peak, **timing,
           "opt_step_s": statistics.median(opt_times) if arm != "effpass_adamw8bit" else None,
           "losses": losses[:-1], "loss_end": loss_end, "load": os.getloadavg()[0]}
    if arm == "effpass_adamw8bit":
        out["effpass_stats"] = {k: v for k, v in effpass.report(run).stats("step_in_backward").items()
                                if isinstance(v, (int, float))}
    return out


def markdown(doc: dict) -> str:
    m, s, rows = doc["meta"], doc["shape"], doc["results"]
    ok = {r["arm"]: r for r in rows if "error" not in r}
    ref = ok.get("adamw", {})
    mib = lambda b: f"{b / 2**20:,.2f} MiB"  # noqa: E731
    lines = [f"# 8-bit optimizer states vs peers ({m['device']})", "",
             f"{m['date']}; torch {m['torch']}, transformers {m['transformers']}, torchao {m.get('torchao')}, "
             f"bitsandbytes {m.get('bitsandbytes')}; load average {m.get('load_average')}.",
             f"Llama-shaped full fine-tuning: hidden {s['hidden']}, ffn {s['ffn']}, {s['layers']} layers, heads "
             f"{s['heads']}/{s['kv_heads']}, vocab {s['vocab']} (untied), batch {s['batch']} x {s['seq']}, "
             f"{s['dtype']}; lr 1e-3, weight decay 0.01; {s['steps']} timed steps after {1 + s['warmup']} "
             f"warm-up.", "",
             "| arm | optimizer | state bytes | bytes/param | vs AdamW | live at step start | step peak | high-water | "
             "vs AdamW | optimizer step (median) | whole step (CPU time) | loss after steps | vs AdamW's loss | load |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            why = r["error"].strip().splitlines()[-1][:160] if r["error"].strip() else "crashed"
            lines.append(f"| {r['arm']} | did not run: {why} |||||||||||| ")
            continue

        def rat(k):
            return f"{r[k] / ref[k]:.2f}" if ref.get(k) else "-"

        hw = f"{(r['live_bytes'] + r['peak_bytes']) / (ref['live_bytes'] + ref['peak_bytes']):.2f}" if ref else "-"
        ost = f"{r['opt_step_s'] * 1e3:,.1f} ms" if r.get("opt_step_s") is not None else "inside backward"
        dl = f"{(r['loss_end'] - ref['loss_end']) / ref['loss_end']:+.1e}" if ref else "-"
        lines.append(f"| {r['arm']} | {r['optimizer']} | {mib(r['state_bytes'])} | {r['state_bytes_per_param']:.2f} | "
                     f"{rat('state_bytes')} | {mib(r['live_bytes'])} | {mib(r['peak_bytes'])} | "
                     f"{mib(r['live_bytes'] + r['peak_bytes'])} | {hw} | "
                     f"{ost} | {r['step_s'] * 1e3:,.0f} ms ({r['cpu_s'] * 1e3:,.0f} ms) | {r['loss_end']:.4f} | {dl} | "
                     f"{r['load']:.1f} |")
    lines += ["", "State bytes: every tensor in `opt.state`, each storage once (8-bit states: uint8 codes plus "
              "fp32 block scales; 1-D parameters under 4,096 elements keep fp32 states in both 8-bit peers). Step "
              "peak: allocated during one step (forward, backward, optimizer step) above what is live at its "
              "start; high-water: the two added (8-bit optimizers dequantize a parameter's states to fp32 inside "
              "their step, so their step peak can exceed AdamW's while their high-water is lower). effpass_adamw8bit is torchao's AdamW8bit (built by effpass.memory_options.build_optimizer) "
              "stepping inside backward (StepInBackward), which frees each gradient as soon as its update ran; "
              "the update's fp32 transients then coincide with the activations still live in backward. "
              "CPU "
              "times are noisy on the shared 2-core machine: compare within this run only.", ""]
    return "\n".join(lines)


def main() -> None:
    driver.main(__file__, arms=ARMS,
                quick=dict(vocab=512, hidden=64, ffn=64, layers=1, heads=2, kv_heads=2, seq=32, steps=1, warmup=0),
                requires={"torchao_adamw8bit": ("torchao",), "bnb_adamw8bit": ("bitsandbytes",)},
                cpu_shape=CPU_SHAPE, gpu_shape=GPU_SHAPE, worker=worker, markdown=markdown,
                workload="optim8bit", packages=("torchao", "bitsandbytes"),
                log=lambda r: {k: v for k, v in r.items() if k != "losses"})


if __name__ == "__main__":
    main()
