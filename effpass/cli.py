"""The ``effpass`` command line: ``passes``, ``inspect``, ``demo``, ``estimate``."""
from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
from typing import Any

__all__ = ["main"]


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for i, r in enumerate(rows):
        out.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if i == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


# ------------------------------------------------------------------------------------------------------
def cmd_passes(args) -> int:
    import torch

    from .config import default_pipeline
    from .manager import order_passes
    from .pass_api import registered_passes

    passes = registered_passes()
    device = torch.device(args.device) if args.device else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    defaults = [p.name for p in default_pipeline(device)]
    if args.name:
        from .pass_api import get_pass_class

        klass = get_pass_class(args.name)
        print(f"{klass.name}: {klass.summary}")
        print(f"  class: {klass.__module__}.{klass.__qualname__}")
        print(f"  phases: {', '.join(p.value for p in klass.phases())}")
        print(f"  run after: {', '.join(klass.run_after) or '-'};  conflicts with: {', '.join(klass.conflicts_with) or '-'}")
        print(f"  default: {klass.default_note()}")
        print("  options:")
        import dataclasses

        for f in dataclasses.fields(klass):
            default = f.default if f.default is not dataclasses.MISSING else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else "required")
            print(f"    {f.name} = {default!r}: {f.metadata.get('doc', '')}")
        return 0
    if args.json:
        print(json.dumps({n: {"phases": [p.value for p in k.phases()], "run_after": list(k.run_after),
                               "conflicts_with": list(k.conflicts_with), "default": k.default_note(),
                               "in_default_pipeline": n in defaults, "summary": k.summary}
                          for n, k in sorted(passes.items())}, indent=1))
        return 0
    ordered = order_passes([k() for k in passes.values()]) if passes else []
    rows = [("#", "pass", "phases", "runs after", "conflicts", f"on ({device.type})", "default")]
    for i, p in enumerate(ordered):
        k = type(p)
        rows.append((str(i), k.name, ",".join(ph.value for ph in k.phases()), ",".join(k.run_after) or "-",
                     ",".join(k.conflicts_with) or "-", "yes" if k.name in defaults else "no", k.default_note()[:80]))
    print(_table(rows) if len(rows) > 1 else "(no passes registered)")
    print(f"\ndefault pipeline on {device.type} (torch.compile(model, backend=\"effpass\")): "
          f"{', '.join(defaults) or '(empty)'}")
    print("order: passes run in the order above within each phase: module, torch_ir, joint, post_grad")
    print("summaries and options: effpass passes NAME")
    return 0


# ------------------------------------------------------------------------------------------------------
def _load_dump(path: str) -> list[dict[str, Any]]:
    from .dump import INDEX

    if not os.path.isdir(path):
        raise SystemExit(f"effpass inspect: {path!r} is not a folder")
    graphs = []
    for name in sorted(os.listdir(path)):
        idx = os.path.join(path, name, INDEX)
        if os.path.isfile(idx):
            with open(idx) as f:
                d = json.load(f)
            d["_dir"] = os.path.join(path, name)
            d["_name"] = name
            graphs.append(d)
    if not graphs:
        raise SystemExit(f"effpass inspect: no effpass dump in {path!r} (no */index.json)")
    return graphs


def _fmt_stats(stats: dict[str, Any], width: int = 100) -> str:
    parts = []
    for k, v in stats.items():
        if isinstance(v, dict):
            v = "{" + ", ".join(f"{kk}: {vv}" for kk, vv in list(v.items())[:6]) + (", ..." if len(v) > 6 else "") + "}"
        elif isinstance(v, list):
            v = f"[{len(v)} items]"
        elif isinstance(v, float):
            v = f"{v:.4g}"
        parts.append(f"{k}={v}")
    s = " ".join(parts)
    return s if len(s) <= width else s[: width - 3] + "..."


def _before_file(graph: dict[str, Any], index: int) -> str | None:
    rec = graph["passes"][index]
    for prev in reversed(graph["passes"][:index]):
        if prev.get("graph") == rec.get("graph") and prev.get("file"):
            return prev["file"]
    return graph.get("inputs", {}).get(rec.get("graph"))


def cmd_inspect(args) -> int:
    graphs = _load_dump(args.dump_dir)
    if args.diff:
        gname, pname = args.diff
        g = next((g for g in graphs if g["_name"] == gname), None)
        if g is None:
            raise SystemExit(f"effpass inspect: no graph {gname!r}; graphs: {[g['_name'] for g in graphs]}")
        hits = [i for i, r in enumerate(g["passes"]) if r["name"] == pname]
        if not hits:
            raise SystemExit(f"effpass inspect: pass {pname!r} did not run on {gname}; passes: "
                             f"{sorted({r['name'] for r in g['passes']})}")
        shown = 0
        for i in hits:
            rec = g["passes"][i]
            if not rec.get("file"):
                print(f"# {pname} on the {rec['graph']} graph: unchanged" + (f" (error: {rec['error']})" if rec.get("error") else ""))
                continue
            before = _before_file(g, i)
            a = open(os.path.join(g["_dir"], before)).read().splitlines() if before else []
            b = open(os.path.join(g["_dir"], rec["file"])).read().splitlines()
            sys.stdout.writelines(l + "\n" for l in difflib.unified_diff(a, b, before or "(none)", rec["file"], lineterm="", n=2))
            shown += 1
        return 0
    if args.json:
        print(json.dumps([{k: v for k, v in g.items() if not k.startswith("_")} for g in graphs], indent=1, default=str))
        return 0
    for g in graphs:
        cache = f"  [compile cache: {g['cache']}]" if g.get("cache") else ""
        print(f"{g['_name']}{cache}")
        if not g["passes"]:
            print("  (no passes ran)")
        rows = [("phase", "graph", "pass", "result", "ms", "nodes", "statistics")]
        for r in g["passes"]:
            result = "FAILED" if r.get("error") else ("changed" if r.get("changed") else "unchanged")
            if r.get("from_cache"):
                result += " (cached)"
            rows.append((r["phase"], r["graph"], r["name"], result, f"{r.get('ms', 0):.1f}",
                         f"{r.get('nodes_before', 0)}->{r.get('nodes_after', 0)}", _fmt_stats(r.get("stats", {}))))
        if len(rows) > 1:
            print("  " + _table(rows).replace("\n", "\n  "))
        for r in g["passes"]:
            if r.get("error"):
                print(f"  ! {r['name']} ({r['graph']}): {r['error']} -> fell back to the graph before the pass")
            for s in r.get("skipped", [])[:10]:
                print(f"  - {r['name']} left alone: {s}")
            if args.ops and r.get("changed"):
                before, after = r.get("ops_before", {}), r.get("ops_after", {})
                delta = {k: after.get(k, 0) - before.get(k, 0) for k in set(before) | set(after)}
                delta = {k: v for k, v in sorted(delta.items()) if v}
                print(f"    {r['name']} op changes: {delta}")
        print()
    return 0


# ------------------------------------------------------------------------------------------------------
def cmd_estimate(args) -> int:
    import importlib

    from .pass_api import get_pass_class

    module = importlib.import_module(get_pass_class("wrap_fsdp").__module__)
    fn = getattr(module, "estimate_table", None)
    if fn is None:
        raise SystemExit("effpass estimate: the wrap_fsdp pass provides no estimate_table()")
    print(fn(**{k: v for k, v in vars(args).items() if k not in ("func", "cmd") and v is not None}))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="effpass", description="effpass: graph passes for faster, leaner training")
    sub = p.add_subparsers(dest="cmd", required=True)

    sp = sub.add_parser("passes", help="list registered passes: phases, ordering, defaults")
    sp.add_argument("name", nargs="?", help="show one pass with its options")
    sp.add_argument("--device", help="say what the default pipeline is on this device (cpu, cuda)")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(func=cmd_passes)

    sp = sub.add_parser("inspect", help="show the graphs and passes of a dump, with statistics")
    sp.add_argument("dump_dir")
    sp.add_argument("--diff", nargs=2, metavar=("GRAPH", "PASS"), help="what PASS changed in GRAPH (unified diff)")
    sp.add_argument("--ops", action="store_true", help="also show each pass's op-count changes")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(func=cmd_inspect)

    sub.add_parser("demo", help="train the embedded Llama-style model eagerly and with effpass", add_help=False)

    sp = sub.add_parser("estimate", help="per-rank memory for a model under each sharding mode (wrap_fsdp)")
    sp.add_argument("--params", type=float, help="parameter count, e.g. 8e9")
    sp.add_argument("--world-size", dest="world_size", type=int)
    sp.add_argument("--batch", type=int)
    sp.add_argument("--seq", type=int)
    sp.set_defaults(func=cmd_estimate)

    if argv and argv[0] == "demo":
        from .demo import main as demo_main

        return demo_main(argv[1:])
    args = p.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
