"""Long sequences on one device (issue 25): the whole-step peak of full fine-tuning with AdamW, CPU.

    .venv/bin/python bench/bench_long_sequence.py --seq 8192 [--arms hf_eager,hand_built,...] [--steps 3]

A Llama-shaped model (hidden 512, intermediate 1408, 4 layers, 8 heads / 2 KV heads, vocabulary 32,000,
fp32), batch 1, random tokens, AdamW(lr=1e-4). Arms (all in one run, same weights, same batches):

* ``hf_eager``: Hugging Face eager (its attention "eager", its own loss).
* ``hand_built``: Hugging Face gradient checkpointing (non-reentrant) + SDPA + torch's chunked
  ``F.linear_cross_entropy(..., options=LinearCrossEntropyOptions())`` wired by hand on the base model's
  hidden states: the leanest stack a user builds without effpass.
* ``hand_built_compiled``: the same under plain ``torch.compile`` (Inductor).
* ``effpass_ckpt``: ``effpass.compile`` with its default pipeline + ``CheckpointActivations(policy="full")``
  (the best lossless plan before ``tile_sequence``).
* ``effpass_tiled``: ... + ``TileSequence()`` (MLP regions in sequence tiles, recomputed tile by tile).
* ``effpass_step``: ... + ``StepInBackward()`` (each parameter's AdamW update inside the compiled backward,
  its gradient freed at once). The training loop is unchanged; ``attach(opt)`` is called so that the
  measured (first, ``--prefill``) step is already the steady state that the unchanged loop reaches from its
  second step on (its first ``opt.step()`` attaches the optimizer).

Peak = bytes live at the step's start (weights, AdamW states, inputs) + the profiler's peak during one
steady-state step (forward, backward, ``opt.step()``, ``opt.zero_grad()``). The loss history of every arm
is recorded over ``--steps`` steps. Results: bench/results/long_sequence_cpu*.json and .md.
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
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import effpass  # noqa: E402
from effpass.testing.memory import live_tensor_bytes, peak_memory  # noqa: E402

RESULTS = os.environ.get("EFFPASS_BENCH_RESULTS") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
ARMS = ("hf_eager", "hand_built", "hand_built_compiled", "effpass_ckpt", "effpass_tiled", "effpass_step")


def build(attn: str, hidden=512, inter=1408, layers=4, vocab=32000, seq=8192):
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256),
                         max_position_embeddings=max(seq, 4096))
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg)
    model.train()
    return model


class HandBuilt(torch.nn.Module):
    """Hugging Face base model (gradient checkpointing, SDPA) + torch's chunked linear cross-entropy."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False

    def forward(self, input_ids, labels):
        h = self.model.model(input_ids=input_ids, use_cache=False).last_hidden_state
        h = h[:, :-1].reshape(-1, h.shape[-1])
        t = labels[:, 1:].reshape(-1)
        return F.linear_cross_entropy(h, self.model.lm_head.weight, t, ignore_index=-100,
                                      options=torch.nn.LinearCrossEntropyOptions())


def make_arm(name: str, seq: int):
    """(module to call, the model whose parameters train, loss_of(out))."""
    if name == "hf_eager":
        m = build("eager", seq=seq)
        return m, m, lambda out: out.loss
    if name in ("hand_built", "hand_built_compiled"):
        m = build("sdpa", seq=seq)
        hb = HandBuilt(m)
        if name == "hand_built_compiled":
            hb = torch.compile(hb)
        return hb, m, lambda out: out
    m = build("sdpa", seq=seq)
    from effpass.passes import CheckpointActivations

    passes = list(effpass.default_pipeline("cpu", torch.float32))
    extra = [CheckpointActivations(policy="full")]
    if name in ("effpass_tiled", "effpass_step"):
        from effpass.passes import TileSequence

        extra.append(TileSequence())
    if name == "effpass_step":
        from effpass.passes import StepInBackward

        extra.append(StepInBackward())
    effpass.compile(m, passes=passes + extra, lowering=os.environ.get("LOWERING", "inductor"))
    return m, m, lambda out: out.loss


def run_arm(name: str, seq: int, steps: int, prefill: bool = False):
    model_in, model, loss_of = make_arm(name, seq)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 32000, (1, seq), generator=g) for _ in range(steps)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if name == "effpass_step":
        from effpass.passes.step_in_backward import attach

        attach(opt)  # what the unchanged loop's first opt.step() does (see the module docstring)
    if prefill:  # AdamW's states as after a first step, so the first step is already the steady state
        for p in model.parameters():
            opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}

    def step(ids):
        out = model_in(input_ids=ids, labels=ids)
        loss = loss_of(out)
        del out
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    losses, times = [], []
    peak = start = None
    for i, ids in enumerate(batches):
        if i == (0 if prefill else 1):  # steady state (AdamW states exist): measure this one
            gc.collect()
            start = live_tensor_bytes(list(model.parameters()) + list(model.buffers()) + [ids] +
                                      [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)])
            t = time.perf_counter()
            loss, peak = peak_memory(lambda: step(ids))
            times.append(time.perf_counter() - t)
        else:
            t = time.perf_counter()
            loss = step(ids)
            times.append(time.perf_counter() - t)
        losses.append(loss)
        print(f"  {name} step {i}: loss {loss:.6f} {times[-1]:.1f}s", flush=True)
    row = dict(arm=name, seq=seq, peak=start + peak, start=start, step_peak=peak, losses=losses,
               step_s=min(times[1:]) if len(times) > 1 else times[0], compiled_in_timed_step=len(times) == 1, first_step_s=times[0])
    del model_in, model, opt
    gc.collect()
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, nargs="+", default=[8192])
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tag", default="")
    ap.add_argument("--prefill", action="store_true", help="create AdamW's states before the first step and "
                    "measure that step (one step per arm is then enough; the first step includes compiling)")
    args = ap.parse_args()
    torch.set_num_threads(2)
    rows = []
    load = os.getloadavg()
    for seq in args.seq:
        for arm in args.arms.split(","):
            print(f"{arm} @ {seq}", flush=True)
            rows.append(run_arm(arm, seq, args.steps, args.prefill))
            print(f"  peak {rows[-1]['peak'] / 2**20:.0f} MiB (start {rows[-1]['start'] / 2**20:.0f})", flush=True)
    import transformers

    head = {"device": f"CPU ({platform.machine()}, {os.cpu_count()} cores, shared with other jobs)",
            "torch": torch.__version__, "transformers": transformers.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "load_before": load, "load_after": os.getloadavg(), "lowering": os.environ.get("LOWERING", "inductor")}
    os.makedirs(RESULTS, exist_ok=True)
    base = os.path.join(RESULTS, f"long_sequence_cpu{args.tag}")
    with open(base + ".json", "w") as f:
        json.dump({"header": head, "rows": rows}, f, indent=1)
    md = ["# Long sequences: whole-step peak of full fine-tuning with AdamW (CPU)\n", f"{head}\n",
          "Llama-shaped (hidden 512, intermediate 1408, 4 layers, vocabulary 32,000), fp32, batch 1, AdamW. "
          "Peak = live at the step's start + profiler peak of one steady-state step.\n",
          "| seq | arm | peak | x hand-built | start | step time (s) | losses |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        ref = next((x for x in rows if x["seq"] == r["seq"] and x["arm"] == "hand_built"), None)
        ratio = f"{r['peak'] / ref['peak']:.2f}x" if ref else "-"
        md.append(f"| {r['seq']} | {r['arm']} | {r['peak'] / 2**20:.0f} MiB | {ratio} | {r['start'] / 2**20:.0f} MiB | "
                  f"{r['step_s']:.1f} | {', '.join(f'{x:.6f}' for x in r['losses'])} |")
    with open(base + ".md", "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
