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
is recorded over ``--steps`` steps. Each (arm, length) and each budget probe runs in a fresh process under
bench/driver.py (deadline per process, rows appended as each ends) into bench/results/long_sequence_cpu.{json,md};
``--label`` names the run inside the file (e.g. ``planned8k``).

    python bench/bench_long_sequence.py --quick      # smoke run: 256 tokens, one step, eager lowering
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import effpass  # noqa: E402
from effpass.testing.memory import live_tensor_bytes, peak_memory  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import driver  # noqa: E402

#: effpass's lowering in the worker (``--lowering``; the hand-built compiled arm always uses Inductor)
LOWERING = "inductor"
ARMS = ("hf_eager", "hand_built", "hand_built_compiled", "effpass_planned", "effpass_ckpt", "effpass_tiled",
        "effpass_step")
#: hf_eager keeps every layer's attention probabilities (heads x seq^2 fp32): past this length one layer's
#: alone is 2 GiB and more, beyond what this shared machine can lend (23 GiB for ~8 agents)
HF_EAGER_MAX_SEQ = 8192


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


def _planned_passes(m, seq: int):
    """The planner's smallest-peak lossless plan for this model and length (its candidates as declared by the
    passes on this branch), as a pass list, and its name; the planner is asked for a budget nothing meets,
    so its MemoryBudgetError carries the smallest plan (``plan_memory`` otherwise picks the cheapest fitting
    one)."""
    from effpass.planning import MemoryBudgetError, plan_memory
    from effpass.planning.candidates import pipeline_with

    ids = torch.zeros(1, seq, dtype=torch.long)
    floor = sum(p.numel() * p.element_size() for p in m.parameters())
    try:
        plan = plan_memory(m, {"input_ids": ids, "labels": ids}, floor + 1, lowering=LOWERING)
        return plan.passes, plan.chosen.name, plan.chosen.peak_bytes
    except MemoryBudgetError as e:
        base = list(effpass.default_pipeline("cpu", torch.float32))
        return pipeline_with(base, e.plan), e.plan.name, e.plan.peak_bytes


def make_arm(name: str, seq: int):
    """(module to call, the model whose parameters train, loss_of(out), notes)."""
    if name == "hf_eager":
        m = build("eager", seq=seq)
        return m, m, lambda out: out.loss, {}
    if name in ("hand_built", "hand_built_compiled"):
        m = build("sdpa", seq=seq)
        hb = HandBuilt(m)
        if name == "hand_built_compiled":
            hb = torch.compile(hb)
        return hb, m, lambda out: out, {}
    m = build("sdpa", seq=seq)
    from effpass.passes import CheckpointActivations

    notes = {}
    passes = list(effpass.default_pipeline("cpu", torch.float32))
    if name == "effpass_planned":
        t = time.perf_counter()
        passes, plan_name, predicted = _planned_passes(m, seq)
        notes = {"plan": plan_name, "predicted_peak": predicted, "plan_s": time.perf_counter() - t,
                 "passes": [p.name for p in passes]}
        extra = []
    else:
        extra = [CheckpointActivations(policy="full")]
    if name in ("effpass_tiled", "effpass_step"):
        from effpass.passes import TileSequence

        extra.append(TileSequence())
    if name == "effpass_step" or (name == "effpass_planned" and any(p.name == "step_in_backward" for p in passes)):
        from effpass.passes import StepInBackward

        if name == "effpass_step":
            extra.append(StepInBackward())
        notes["step_in_backward"] = True
    effpass.compile(m, passes=passes + extra, lowering=LOWERING)
    return m, m, lambda out: out.loss, notes


def run_arm(name: str, seq: int, steps: int, prefill: bool = True):
    torch._dynamo.reset()  # NOTE: else a new length recompiles with a symbolic one (automatic dynamic shapes)
    load = os.getloadavg()
    model_in, model, loss_of, notes = make_arm(name, seq)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 32000, (1, seq), generator=g) for _ in range(steps)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if notes.get("step_in_backward"):
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
        print(f"  {name} @ {seq} step {i}: loss {loss:.6f} {times[-1]:.1f}s", flush=True)
    row = dict(arm=name, seq=seq, peak=start + peak, start=start, step_peak=peak, losses=losses,
               step_s=min(times[1:]) if len(times) > 1 else None, first_step_s=times[0],
               load=[round(x, 1) for x in load], **notes)
    del model_in, model, opt
    gc.collect()
    return row


def longest_fitting(name: str, budget: int, known: dict[int, int], probe, grain: int = 1024, max_probes: int = 6):
    """The longest sequence (a multiple of ``grain``) whose measured peak fits ``budget``: a bracketing search
    (regula falsi on the measured peaks, doubling/halving until a bracket exists, then bisection's guarantee:
    each probe lies strictly inside the bracket) over ``probe(seq) -> peak bytes``; ``known`` holds peaks
    measured already. Returns (longest fitting, shortest not fitting or None, probes run, points)."""
    pts = dict(known)
    probes = 0

    def bracket():
        fit = [s for s, p in pts.items() if p <= budget]
        over = [s for s, p in pts.items() if p > budget]
        lo = max(fit) if fit else None
        hi = min([s for s in over if lo is None or s > lo], default=None)
        return lo, hi

    while probes < max_probes:
        lo, hi = bracket()
        if lo is not None and hi is not None and hi - lo <= grain:
            break
        if lo is None:  # nothing fits yet: halve below the shortest tried
            if min(pts) <= grain:
                break  # not even the granularity fits
            nxt = max(grain, (min(pts) // 2) // grain * grain)
            if nxt in pts:
                break
        elif hi is None:  # everything fits: extrapolate from the two longest points, at least double
            a, b = sorted(pts)[-2:] if len(pts) > 1 else (None, lo)
            guess = 2 * lo
            if a is not None and pts[b] > pts[a]:
                guess = int(b + (budget - pts[b]) * (b - a) / (pts[b] - pts[a]))
            nxt = max(lo + grain, min(guess // grain * grain + grain, 2 * lo))
        else:  # interpolate inside the bracket
            guess = lo + (budget - pts[lo]) * (hi - lo) / (pts[hi] - pts[lo])
            nxt = int(guess) // grain * grain
            nxt = min(max(nxt, lo + grain), hi - grain)
        print(f"  fit {name}: probe {nxt} (bracket {lo}..{hi})", flush=True)
        pts[nxt] = probe(nxt)
        probes += 1
    lo, hi = bracket()
    return lo, hi, probes, {str(k): v for k, v in sorted(pts.items())}


def _run_worker(arm: str, seq: int, steps: int, deadline: float | None, lowering: str) -> dict:
    """One (arm, length) in its own process (bench/driver.py); its row, or ``{"failed": reason, "row": ...}``."""
    r = driver.run_arm(os.path.abspath(__file__), arm, {"seq": seq, "steps": steps, "lowering": lowering},
                       deadline_s=deadline)
    if r.get("status") != "ok":
        tail = str(r.get("error", "")).strip().splitlines()[-3:]
        return {"failed": f"{r.get('status')}, rc {r.get('returncode')}: " + " | ".join(tail), "row": r}
    return r


def markdown(run: dict) -> str:
    res = run["results"]
    rows = [dict(r) for r in res if r.get("status") == "ok" and r.get("kind") != "fit"]
    skipped = [r for r in res if r.get("status") != "ok"]
    fits = [r for r in res if r.get("kind") == "fit"]
    return _markdown(run["meta"], run["shape"], rows, skipped, fits)


def _markdown(head: dict, args: dict, rows: list, skipped: list, fits: list) -> str:
    """The tables of one run (per-length rows against the hand-built stack, what did not run, the budget fits)."""
    done = head.get("finished", False)
    rows = sorted(rows, key=lambda r: (r["seq"], ARMS.index(r["arm"])))
    for r in rows:  # the same loss history: every arm against the hand-built stack's, per length
        ref = next((x for x in rows if x["seq"] == r["seq"] and x["arm"] == "hand_built"), None)
        if ref is not None:
            n = min(len(ref["losses"]), len(r["losses"]))
            r["loss_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(r["losses"][:n], ref["losses"][:n]))
            r["x_hand_built"] = r["peak"] / ref["peak"]
    md = ["# Long sequences: whole-step peak of full fine-tuning with AdamW (CPU)\n",
          f"Run: `python {' '.join(head.get('argv', []))}` (effpass lowering {args.get('lowering')})"
          + ("" if done else " (**partial: the run had not finished when this was written**)") + "\n",
          "Llama-shaped (hidden 512, intermediate 1408, 4 layers, 8 heads / 2 KV heads, vocabulary 32,000), fp32, "
          "batch 1, AdamW(lr=1e-4). Peak = bytes live at the step's start (weights, AdamW states, batch) + the "
          "profiler's peak of one steady-state step (forward, backward, opt.step(), zero_grad). Step time: the "
          "second step (no compile, no profiler) where one ran, else the first (incl. compile and profiler); the "
          "machine is shared, see the load per arm.\n",
          "| seq | arm | peak | x hand-built | start | step time (s) | load (1 min) | losses | max rel. diff to hand-built |",
          "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['x_hand_built']:.3f}x" if "x_hand_built" in r else "-"
        st = f"{r['step_s']:.1f}" if r["step_s"] is not None else f"{r['first_step_s']:.1f} (first step: incl. compile)"
        name = r["arm"] + (f" ({r['plan']})" if r.get("plan") else "")
        md.append(f"| {r['seq']} | {name} | {r['peak'] / 2**20:.0f} MiB | {ratio} | {r['start'] / 2**20:.0f} MiB | "
                  f"{st} | {r['load'][0]} | {', '.join(f'{x:.6f}' for x in r['losses'])} | {r.get('loss_rel_diff', 0):.1e} |")
    for s_ in skipped:
        md.append(f"| {s_['seq']} | {s_['arm']} | - | - | - | - | - | {s_.get('reason') or s_.get('error')} | - |")
    if fits:
        md += ["", f"Longest sequence fitting {args.get('budget')} (measured peaks; multiples of 1,024):", "",
               "| arm | fits | does not fit | probes | measured points (seq: MiB) |", "|---|---|---|---|---|"]
        for f_ in fits:
            pts = ", ".join(f"{k}: {v / 2**20:.0f}" for k, v in f_["points"].items())
            md.append(f"| {f_['arm']} | {f_['longest_fitting']} | {f_['shortest_over']} | {f_['probes']} | {pts} |")
    return "\n".join(md) + "\n"


def main():
    global LOWERING
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[8192, 16384])
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--steps", type=int, default=2, help="steps per arm; the first (AdamW states created before "
                    "it, so already the steady state) is measured for memory, the later ones for time")
    ap.add_argument("--budget", default=None, help="e.g. 1GiB: also search the longest sequence each arm fits")
    ap.add_argument("--fit-arms", default=None, help="arms for the budget search (default: --arms)")
    ap.add_argument("--max-probes", type=int, default=4)
    ap.add_argument("--label", default=None, help="names this run inside the results file (e.g. planned8k)")
    ap.add_argument("--lowering", default="inductor", help="effpass's lowering (eager: no Inductor compiles)")
    ap.add_argument("--deadline", type=float, default=3600, help="seconds per (arm, length) process")
    ap.add_argument("--quick", action="store_true", help="smoke run: 256 tokens, one step, eager lowering")
    ap.add_argument("--out", default=None, help="results stem (default bench/results/long_sequence_cpu)")
    ap.add_argument("--steps-at", default="", help="per-length steps, e.g. 16384:1 (else --steps)")
    ap.add_argument("--arms-at", default="", help="per-length arms, e.g. 16384:hand_built+effpass_tiled (else --arms)")
    ap.add_argument("--parallel", type=int, default=1, help="at most this many (arm, length) processes at once "
                    "(every (arm, length) and every budget probe runs in its own process: same code, weights and "
                    "batches); memory peaks are allocator bytes, independent of this; times are not")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cfg", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.seq, args.steps, args.lowering = [256], 1, "eager"
    torch.set_num_threads(2)
    steps_at = {int(k): int(v) for k, v in (x.split(":") for x in args.steps_at.split(",") if x)}
    arms_at = {int(k): v.replace("+", ",") for k, v in (x.split(":") for x in args.arms_at.split(";") if x)}
    if args.worker:
        cfg = json.loads(args.cfg)
        LOWERING = cfg["lowering"]
        print(json.dumps(run_arm(args.worker, cfg["seq"], cfg["steps"])), flush=True)
        return
    import threading
    from concurrent.futures import ThreadPoolExecutor

    label = args.label if args.label is not None else ("quick" if args.quick else "")
    stem = args.out or driver.result_stem("long_sequence", "cpu")
    driver.stop_on_sigterm()
    run_id = f"{datetime.datetime.now(datetime.timezone.utc):%Y%m%dT%H%M%S}-{os.getpid()}"
    head = driver.meta("long_sequence", "cpu")
    head.update(lowering_effpass=args.lowering, lowering_hand_built_compiled="inductor", deadline_s=args.deadline)
    header = {"label": label, "meta": head, "shape": {k: v for k, v in vars(args).items() if k not in ("worker", "cfg")}}
    rows, jobs = [], []
    lock = threading.Lock()

    def save(row):
        with lock:
            driver.append_row(stem, run_id, header, row, markdown, "Long sequences (bench_long_sequence.py)")

    save(None)
    for seq in args.seq:
        for arm in arms_at.get(seq, args.arms).split(","):
            if arm == "hf_eager" and seq > HF_EAGER_MAX_SEQ:
                save({"arm": arm, "seq": seq, "status": "not run", "reason": f"not run: its saved attention probabilities alone "
                      f"are {4 * 8 * seq * seq * 4 / 2**30:.0f} GiB (4 layers x 8 heads x seq^2 x 4 B), "
                      "more than this shared machine holds"})
                continue
            jobs.append((arm, seq, steps_at.get(seq, args.steps)))

    def job(a, s_, n):
        r = _run_worker(a, s_, n, args.deadline, args.lowering)
        if "failed" in r:
            print(f"{a} @ {s_} failed: {r['failed']}", flush=True)
            save({**r["row"], "seq": s_, "reason": "failed: " + r["failed"]})
        else:
            with lock:
                rows.append(r)
            print(f"{a} @ {s_}: peak {r['peak'] / 2**20:.0f} MiB (start {r['start'] / 2**20:.0f}) "
                  f"losses {r['losses']}", flush=True)
            save(r)

    pool = ThreadPoolExecutor(max(1, args.parallel))
    jobs.sort(key=lambda j: (j[1], j[0] == "hf_eager"))  # shortest first; per length hf_eager (the most memory) last
    for f in [pool.submit(job, *j) for j in jobs]:
        f.result()
    if args.budget:
        from effpass.config import parse_size

        budget = parse_size(args.budget)

        def probe(arm, s_):
            r = _run_worker(arm, s_, 1, args.deadline, args.lowering)
            if "failed" in r:
                raise RuntimeError(f"{arm} @ {s_}: {r['failed']}")
            return r["peak"]

        def fit(arm):
            known = {r["seq"]: r["peak"] for r in rows if r["arm"] == arm}
            try:
                lo, hi, n, pts = longest_fitting(arm, budget, known, lambda s_: probe(arm, s_),
                                                 max_probes=args.max_probes)
            except RuntimeError as e:
                print(f"  fit {arm} failed: {e}", flush=True)
                return
            fit_row = dict(arm=arm, kind="fit", status="ok", budget=budget, longest_fitting=lo, shortest_over=hi,
                           probes=n, points=pts)
            print(f"  {arm}: fits {lo}, not {hi} ({n} probes)", flush=True)
            save(fit_row)

        for f in [pool.submit(fit, a) for a in (args.fit_arms or args.arms).split(",")]:
            f.result()
    head.update(load_after=[round(x, 1) for x in os.getloadavg()], finished=True)
    save(None)
    print(f"wrote {stem}.json and .md")


if __name__ == "__main__":
    main()
