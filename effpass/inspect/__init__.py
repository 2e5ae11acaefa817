"""Reading effpass dumps: the graphs and passes of a dump folder as data, text tables and diffs.

``effpass inspect DUMP`` is a thin command over these functions; they are usable from Python too::

    from effpass.inspect import load_dump, format_dump
    print(format_dump(load_dump("effpass-dump")))
"""
from __future__ import annotations

import difflib
import io
import json
import os
from typing import Any

from ..dump import INDEX
from ..report import explain

__all__ = ["DumpError", "load_dump", "format_dump", "diff_pass", "to_json", "table"]

# ------------------------------------------------------------------------------------------------------
class DumpError(ValueError):
    """A dump folder that cannot be read (missing, empty, not an effpass dump)."""


def table(rows: list[tuple[str, ...]]) -> str:
    """A plain-text table; the first row is the header."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for i, r in enumerate(rows):
        out.append("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if i == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def load_dump(path: str) -> list[dict[str, Any]]:
    """The graphs of a dump folder, each its ``index.json`` plus ``_dir`` and ``_name``."""
    if not os.path.isdir(path):
        raise DumpError(f"{path!r} is not a folder")
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
        raise DumpError(f"no effpass dump in {path!r} (no */index.json)")
    return graphs


def _fmt_stats(stats: dict[str, Any], width: int = 100) -> str:
    """Non-zero statistics (``effpass.report.nonzero_stats``; ``--json`` has them all)."""
    from ..report import nonzero_stats

    parts = []
    for k, v in nonzero_stats(stats).items():
        if isinstance(v, dict):
            v = "{" + ", ".join(f"{kk}: {vv}" for kk, vv in list(v.items())[:6]) + (", ..." if len(v) > 6 else "") + "}"
        elif isinstance(v, list):
            v = f"[{len(v)} items]"
        elif isinstance(v, float):
            v = f"{v:.4g}"
        parts.append(f"{k}={v}")
    s = " ".join(parts) or "(all statistics 0)"
    return s if len(s) <= width else s[: width - 3] + "..."


def _before_file(graph: dict[str, Any], index: int) -> str | None:
    rec = graph["passes"][index]
    for prev in reversed(graph["passes"][:index]):
        if prev.get("graph") == rec.get("graph") and prev.get("file"):
            return prev["file"]
    return graph.get("inputs", {}).get(rec.get("graph"))


def diff_pass(graphs: list[dict[str, Any]], graph_name: str, pass_name: str) -> str:
    """What ``pass_name`` changed in ``graph_name``, as unified diffs of the dumped graph files."""
    g = next((g for g in graphs if g["_name"] == graph_name), None)
    if g is None:
        raise DumpError(f"no graph {graph_name!r}; graphs: {[g['_name'] for g in graphs]}")
    hits = [i for i, r in enumerate(g["passes"]) if r["name"] == pass_name]
    if not hits:
        raise DumpError(f"pass {pass_name!r} did not run on {graph_name}; passes: "
                        f"{sorted({r['name'] for r in g['passes']})}")
    out = io.StringIO()
    for i in hits:
        rec = g["passes"][i]
        if not rec.get("file"):
            out.write(f"# {pass_name} on the {rec['graph']} graph: unchanged"
                      + (f" (error: {rec['error']})" if rec.get("error") else "") + "\n")
            continue
        before = _before_file(g, i)
        with open(os.path.join(g["_dir"], rec["file"])) as f:
            b = f.read().splitlines()
        a: list[str] = []
        if before:
            with open(os.path.join(g["_dir"], before)) as f:
                a = f.read().splitlines()
        out.writelines(l + "\n" for l in difflib.unified_diff(a, b, before or "(none)", rec["file"], lineterm="", n=2))
    return out.getvalue()


def to_json(graphs: list[dict[str, Any]]) -> str:
    """The dump as JSON (what ``effpass inspect DUMP --json`` prints)."""
    return json.dumps([{k: v for k, v in g.items() if not k.startswith("_")} for g in graphs], indent=1, default=str)


def format_dump(graphs: list[dict[str, Any]], ops: bool = False) -> str:
    """The dump as text: per graph a table of passes with their results and statistics."""
    lines: list[str] = []
    for g in graphs:
        cache = f"  [compile cache: {g['cache']}]" if g.get("cache") else ""
        lines.append(f"{g['_name']}{cache}")
        if not g["passes"]:
            lines.append("  (no passes ran)")
        rows = [("phase", "graph", "pass", "result", "ms", "nodes", "statistics")]
        for r in g["passes"]:
            result = "FAILED" if r.get("error") else ("changed" if r.get("changed") else "unchanged")
            if r.get("from_cache"):
                result += " (cached)"
            rows.append((r["phase"], r["graph"], r["name"], result, f"{r.get('ms', 0):.1f}",
                         f"{r.get('nodes_before', 0)}->{r.get('nodes_after', 0)}", _fmt_stats(r.get("stats", {}))))
        if len(rows) > 1:
            lines.append("  " + table(rows).replace("\n", "\n  "))
        for r in g["passes"]:
            if r.get("error"):
                lines.append(f"  ! {r['name']} ({r['graph']}): {r['error']} -> fell back to the graph before the pass")
            for line in explain("" if r.get("changed") else r.get("why_unchanged", ""), r.get("skipped", [])):
                lines.append(f"  - {r['name']} ({r['graph']}) {line}")
            if ops and r.get("changed"):
                before, after = r.get("ops_before", {}), r.get("ops_after", {})
                delta = {k: after.get(k, 0) - before.get(k, 0) for k in set(before) | set(after)}
                delta = {k: v for k, v in sorted(delta.items()) if v}
                lines.append(f"    {r['name']} op changes: {delta}")
        lines.append("")
    return "\n".join(lines)
