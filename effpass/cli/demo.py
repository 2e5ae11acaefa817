"""``effpass demo``: train the embedded Llama-style model eagerly and with effpass, side by side.

Each arm runs in a fresh subprocess (so peak memory is its own), with the same seed and the same
synthetic token batches; the arms are interleaved and repeated (eager, effpass, effpass, eager, ...), and
the verdict compares the runs' median step times and says when their ranges overlap (within noise). The
machine's load average is noted before and after. CUDA is used when present, else the CPU. The first
effpass run leaves a dump in a fresh folder.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

__all__ = ["main", "run_arm", "render", "verdict"]


def _device(name: str | None):
    import torch

    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def run_arm(arm: str, args: argparse.Namespace) -> dict[str, Any]:
    """Train one arm and return its measurements (runs inside the arm's subprocess)."""
    import torch
    from tqdm import tqdm

    import effpass
    from effpass.testing.models import DemoConfig, DemoLM

    device = _device(args.device)
    torch.manual_seed(0)
    cfg = DemoConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                     n_kv_heads=args.kv_heads, ffn_dim=args.dim * 8 // 3 // 16 * 16 or args.dim * 2,
                     max_seq_len=args.seq)
    model = DemoLM(cfg).to(device)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device) for _ in range(4)]

    t0 = time.perf_counter()
    if arm == "effpass":
        passes = None if args.passes is None else [p for p in args.passes.split(",") if p]
        runner = effpass.compile(model, passes=passes, dump_dir=args.dump_dir or None, lowering=args.lowering)
    else:
        runner = model
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    times, losses = [], []
    compile_s = None
    bar = tqdm(range(args.steps), desc=f"{arm:>7} (compiling)" if arm == "effpass" else f"{arm:>7}",
               file=sys.stderr, disable=args.quiet, leave=True)
    ticking = threading.Event()
    if not args.quiet:
        def tick():  # the first step (capture, passes, lowering) takes minutes on a small CPU: show it moving
            while not ticking.wait(1.0):
                bar.set_postfix_str(f"first step: {time.perf_counter() - t0:.0f} s "
                                    f"({'capture, passes, lowering' if arm == 'effpass' else 'warm-up'})")
        threading.Thread(target=tick, daemon=True).start()
    for step in bar:
        tokens = batches[step % len(batches)]
        sync()
        s = time.perf_counter()
        loss, _ = runner(tokens, labels=tokens)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        dt = time.perf_counter() - s
        if step == 0:
            ticking.set()
            compile_s = time.perf_counter() - t0
            bar.set_description(f"{arm:>7} (training)")
        else:
            times.append(dt)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
    bar.close()
    step_s = statistics.median(times) if times else float("nan")
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated()
    else:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    out = {"arm": arm, "device": str(device), "step_s": step_s, "tokens_per_s": args.batch * args.seq / step_s,
           "peak_bytes": peak, "peak_kind": "cuda max_memory_allocated" if device.type == "cuda" else "process peak RSS",
           "step_times_s": times, "first_step_s": compile_s, "final_loss": losses[-1], "losses": losses}
    if arm == "effpass":
        rep = effpass.report(runner)
        out["passes"] = [p.name for p in effpass.backend_of(runner).manager.active]
        out["summary"] = rep.summary()
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="effpass demo", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=12, help="training steps per run (the first includes compile)")
    p.add_argument("--repeats", type=int, default=3, help="runs per arm, interleaved with the other arm's, each in a "
                                                          "fresh process")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--passes", default=None,
                   help="comma-separated pass names for the effpass arm (default: the default pipeline)")
    p.add_argument("--lowering", choices=["inductor", "eager"], default="inductor")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    p.add_argument("--dump-dir", default=None, help="a new (or empty) folder for the first effpass run's dump "
                                                   "(default: effpass-demo-DATE-TIME)")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--arm", choices=["eager", "effpass"], help=argparse.SUPPRESS)
    return p


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _ms(x: float) -> str:
    return f"{x * 1e3:.1f} ms"


def summarize(results: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per arm the median and range over runs of each run's median step time, the median peak, and the loss
    agreement of the paired runs."""
    out: dict[str, Any] = {}
    for arm, runs in results.items():
        steps = [r["step_s"] for r in runs]
        out[arm] = {"step_s": statistics.median(steps), "min_s": min(steps), "max_s": max(steps),
                    "peak_bytes": statistics.median(r["peak_bytes"] for r in runs),
                    "first_step_s": runs[0]["first_step_s"], "final_loss": runs[0]["final_loss"]}
    e, f = results["eager"], results["effpass"]
    out["loss_diff"] = max(max(abs(a - b) for a, b in zip(x["losses"], y["losses"])) for x, y in zip(e, f))
    return out


def verdict(s: dict[str, Any]) -> str:
    """One line: speed-up and whether it is within noise (the arms' step-time ranges overlap), memory ratio,
    loss agreement."""
    e, f = s["eager"], s["effpass"]
    speed = e["step_s"] / f["step_s"]
    overlap = f["min_s"] <= e["max_s"] and e["min_s"] <= f["max_s"]
    if overlap:
        time_part = (f"step time within noise ({speed:.2f}x; the runs' ranges overlap: more --repeats or an idle "
                     "machine to tell)")
    else:
        time_part = (f"effpass steps {speed:.2f}x faster than eager" if speed > 1 else
                     f"effpass steps {1 / speed:.2f}x slower than eager") + " (the runs' ranges are apart)"
    mem = f["peak_bytes"] / e["peak_bytes"]
    agree = s["loss_diff"] <= 1e-4 * max(1.0, abs(e["final_loss"]))
    loss_part = (f"losses agree (max difference {s['loss_diff']:.1e})" if agree else
                 f"LOSSES DIFFER (max difference {s['loss_diff']:.1e})")
    return f"verdict: {time_part}; peak memory {mem:.2f}x eager's; {loss_part}"


def render(res: dict[str, Any]) -> str:
    """The demo's report (without the pass summary) from its JSON results (what ``--json`` writes)."""
    cfg, s = res["config"], summarize(res["runs"])
    e0 = res["runs"]["eager"][0]
    head = [f"effpass demo: Llama-style model (GQA, RoPE, SwiGLU, RMSNorm, hand-written attention), {cfg['layers']} "
            f"layer(s), dim {cfg['dim']}, batch {cfg['batch']} x seq {cfg['seq']}, {cfg['steps']} steps x "
            f"{cfg['repeats']} runs per arm (interleaved, fresh processes) on {e0['device']}",
            f"effpass pipeline: {', '.join(res['passes']) or '(none)'}; lowering: {cfg['lowering']}",
            f"machine: {res['machine']['cpus']} CPUs, load average {res['machine']['load_before']:.1f} before, "
            f"{res['machine']['load_after']:.1f} after (load inflates and spreads step times)"]
    lines = [textwrap.fill(h, 100, subsequent_indent="  ") for h in head] + [""]
    rows = [("arm", f"step time: median (range of {cfg['repeats']})", "tokens/s", f"peak ({e0['peak_kind']})",
             "first step", "final loss")]
    for arm in ("eager", "effpass"):
        a = s[arm]
        rows.append((arm, f"{_ms(a['step_s'])} ({_ms(a['min_s'])[:-3]}-{_ms(a['max_s'])})",
                     f"{cfg['batch'] * cfg['seq'] / a['step_s']:,.0f}", _fmt_bytes(a["peak_bytes"]),
                     f"{a['first_step_s']:.2f} s", f"{a['final_loss']:.5f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for i, row in enumerate(rows):
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines += ["", textwrap.fill(verdict(s), 100, subsequent_indent="  ")]
    return "\n".join(lines)


def _fresh_dump_dir(given: str | None) -> str:
    if given is None:
        return os.path.abspath(time.strftime("effpass-demo-%Y%m%d-%H%M%S"))
    if os.path.exists(given) and (not os.path.isdir(given) or os.listdir(given)):
        raise SystemExit(f"effpass demo: --dump-dir {given!r} exists and is not an empty folder; a dump mixes "
                         "runs otherwise: give a new folder (or leave --dump-dir out for a dated one)")
    return os.path.abspath(given)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.arm:  # inside an arm's subprocess
        print("EFFPASS_RESULT " + json.dumps(run_arm(args.arm, args)), flush=True)
        return 0
    if args.repeats < 1 or args.steps < 2:
        raise SystemExit(f"effpass demo: need --repeats >= 1 and --steps >= 2 (got {args.repeats}, {args.steps})")
    dump_dir = _fresh_dump_dir(args.dump_dir)
    child_args = list(argv) if argv is not None else sys.argv[1:]
    runs: dict[str, list] = {"eager": [], "effpass": []}
    load_before = os.getloadavg()[0]
    for r in range(args.repeats):
        for arm in (("eager", "effpass") if r % 2 == 0 else ("effpass", "eager")):
            dump = dump_dir if (arm == "effpass" and not runs["effpass"]) else ""
            if not args.quiet:
                print(f"run {r + 1}/{args.repeats}: {arm}", file=sys.stderr, flush=True)
            proc = subprocess.run([sys.executable, "-m", "effpass.cli.demo", *child_args, "--dump-dir", dump,
                                   "--arm", arm], stdout=subprocess.PIPE, text=True,
                                  env={**os.environ, "PYTHONWARNINGS": "ignore"})
            line = next((l for l in proc.stdout.splitlines() if l.startswith("EFFPASS_RESULT ")), None)
            if proc.returncode != 0 or line is None:
                print(proc.stdout, file=sys.stderr)
                print(f"effpass demo: the {arm} arm failed (exit code {proc.returncode})", file=sys.stderr)
                return 1
            runs[arm].append(json.loads(line[len("EFFPASS_RESULT "):]))
    res = {"config": {k: getattr(args, k) for k in ("layers", "dim", "heads", "kv_heads", "vocab", "seq", "batch",
                                                    "steps", "repeats", "lowering")},
           "machine": {"cpus": os.cpu_count(), "load_before": load_before, "load_after": os.getloadavg()[0]},
           "passes": runs["effpass"][0]["passes"], "runs": runs}
    print()
    print(render(res))
    print(f"dump: {dump_dir}  (effpass inspect {os.path.relpath(dump_dir)})")
    print()
    print(runs["effpass"][0]["summary"])
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
