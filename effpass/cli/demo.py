"""``effpass demo``: train the embedded Llama-style model eagerly and with effpass, side by side.

Each arm runs in a fresh subprocess (so peak memory is its own), with the same seed and the same
synthetic token batches. CUDA is used when present, else the CPU. The effpass arm leaves a dump.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

__all__ = ["main", "run_arm"]


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
        runner = effpass.compile(model, passes=passes, dump_dir=args.dump_dir, lowering=args.lowering)
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
           "first_step_s": compile_s, "final_loss": losses[-1], "losses": losses}
    if arm == "effpass":
        rep = effpass.report(runner)
        out["passes"] = [p.name for p in effpass.backend_of(runner).manager.active]
        out["summary"] = rep.summary()
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="effpass demo", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=12, help="training steps per arm (the first includes compile)")
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
    p.add_argument("--dump-dir", default="effpass-dump", help="where the effpass arm leaves its dump")
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


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.arm:  # inside an arm's subprocess
        print("EFFPASS_RESULT " + json.dumps(run_arm(args.arm, args)), flush=True)
        return 0
    child_args = list(argv) if argv is not None else sys.argv[1:]
    results = {}
    for arm in ("eager", "effpass"):
        proc = subprocess.run([sys.executable, "-m", "effpass.cli.demo", *child_args, "--arm", arm],
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
        line = next((l for l in proc.stdout.splitlines() if l.startswith("EFFPASS_RESULT ")), None)
        if proc.returncode != 0 or line is None:
            print(proc.stdout, file=sys.stderr)
            print(f"effpass demo: the {arm} arm failed (exit code {proc.returncode})", file=sys.stderr)
            return 1
        results[arm] = json.loads(line[len("EFFPASS_RESULT "):])
    e, f = results["eager"], results["effpass"]
    print()
    print(f"effpass demo: Llama-style model (GQA, RoPE, SwiGLU, RMSNorm, hand-written attention), "
          f"{args.layers} layers, dim {args.dim}, batch {args.batch} x seq {args.seq}, {args.steps} steps on {e['device']}")
    print(f"effpass pipeline: {', '.join(f['passes']) or '(none)'}; lowering: {args.lowering}")
    print()
    rows = [("arm", "step time", "tokens/s", f"peak memory ({e['peak_kind']})", "first step (compile)", "final loss")]
    for r in (e, f):
        rows.append((r["arm"], f"{r['step_s'] * 1e3:.1f} ms", f"{r['tokens_per_s']:,.0f}", _fmt_bytes(r["peak_bytes"]),
                     f"{r['first_step_s']:.2f} s", f"{r['final_loss']:.5f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for i, row in enumerate(rows):
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    print()
    print(f"speed-up: {e['step_s'] / f['step_s']:.2f}x   final-loss difference: {abs(e['final_loss'] - f['final_loss']):.2e}")
    print(f"dump: {os.path.abspath(args.dump_dir)}  (effpass inspect {args.dump_dir})")
    print()
    print(f["summary"])
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
