"""The HTML report: one self-contained page (no network resources, works opened from disk) of a dump.

    effpass inspect effpass-dump --html report.html      # from a dump folder
    effpass.report(model).to_html("report.html")         # from a live report (diffs need a dump_dir)

It reads the same data as :func:`effpass.inspect.load_dump` / ``effpass inspect DUMP --json`` (each
graph's ``index.json``) and shows: the pipeline and options; per graph and per pass op counts before and
after, saved-for-backward bytes before/after and recompute FLOPs (when a pass measured them), statistics,
sites left alone with reasons, failures, milliseconds; a unified diff of every pass that changed a graph;
graphs, graph breaks and recompiles; inline SVG charts (time per pass, saved bytes per graph, op counts);
and a memory plan when a graph's ``index.json`` has a ``memory_plan`` entry.

Hook for a memory planner: put a JSON-able dict in ``report.notes["memory_plan"]`` of a graph; the dump
writes it to ``index.json["memory_plan"]`` and this page renders it (numbers as a table; a list of dicts
as a table with one row per item; a ``{"rows": [...], "columns": [...]}`` dict as that table).

Every pass row carries its exact values as ``data-*`` attributes, and the page embeds the dump's JSON
(``<script type="application/json" id="effpass-data">``), so tests and scripts can compare the page
with ``effpass inspect DUMP --json``. Bad dumps (missing, empty, another effpass version, half-written
after a crash) give a page that says what is wrong and shows what it can.
"""
from __future__ import annotations

import datetime
import difflib
import html
import json
import os
from typing import Any, Iterable

from ..dump import INDEX, graph_index
from ..report import CompileReport, register_renderer

__all__ = ["load_dump_lenient", "render_html", "write_dump_html", "write_report_html"]

_SAVED = ("saved_bytes_before", "saved_bytes_after")
_FLOPS = ("recompute_flops_before", "recompute_flops_after", "recompute_flops_added")


# ------------------------------------------------------------------------------------------------------
# reading, leniently
# ------------------------------------------------------------------------------------------------------
def load_dump_lenient(path: str) -> tuple[list[dict[str, Any]], list[str]]:
    """The graphs of a dump folder (as :func:`effpass.inspect.load_dump` gives them) and a list of
    problems found on the way; never raises for a bad dump."""
    from .. import __version__

    problems: list[str] = []
    if not os.path.exists(path):
        return [], [f"{path!r} does not exist"]
    if not os.path.isdir(path):
        return [], [f"{path!r} is not a folder"]
    graphs = []
    entries = sorted(os.listdir(path))
    for name in entries:
        d = os.path.join(path, name)
        if not os.path.isdir(d):
            continue
        files = os.listdir(d)
        for f in files:
            if f.startswith(".tmp-"):
                problems.append(f"{name}/{f}: a half-written file (effpass crashed while writing it)")
        idx = os.path.join(d, INDEX)
        if not os.path.isfile(idx):
            if any(f.endswith(".py") for f in files):
                problems.append(f"{name}: graph files but no {INDEX} (the compile crashed before its first pass "
                                "finished); its files are listed below")
                graphs.append({"graph_id": name, "passes": [], "_dir": d, "_name": name, "_broken": True,
                               "_files": sorted(f for f in files if f.endswith(".py"))})
            continue
        try:
            with open(idx) as fh:
                g = json.load(fh)
            if not isinstance(g, dict) or not isinstance(g.get("passes", []), list):
                raise ValueError("not an effpass index (no 'passes' list)")
        except (OSError, ValueError) as e:
            problems.append(f"{name}/{INDEX} cannot be read ({type(e).__name__}: {e}); skipped")
            continue
        g.setdefault("passes", [])
        g["passes"] = [r for r in g["passes"] if isinstance(r, dict)]
        g["_dir"], g["_name"] = d, name
        version = g.get("effpass_version")
        if version is None:
            problems.append(f"{name}: the dump records no effpass version (written by an effpass older than "
                            f"{__version__}?); fields may be missing")
        elif version != __version__:
            problems.append(f"{name}: written by effpass {version}, this is effpass {__version__}; "
                            "fields may differ")
        if name != "module" and "timing" not in g and version is not None:
            problems.append(f"{name}: no compile timing recorded: the compile of this graph did not finish "
                            "(crash or interrupt); the passes that finished are shown")
        graphs.append(g)
    if not graphs and not problems:
        problems.append(f"no effpass dump in {path!r} (no */{INDEX}); "
                        f"{'it is empty' if not entries else 'entries: ' + ', '.join(entries[:10])}")
    return graphs, problems


def _graphs_of_report(report: CompileReport) -> list[dict[str, Any]]:
    out = []
    for g in [report.module, *report.graphs]:
        if g is report.module and not g.records:
            continue
        d = graph_index(g, report.options)
        d["_dir"], d["_name"] = g.dump_path, (os.path.basename(g.dump_path) if g.dump_path else g.graph_id)
        out.append(d)
    plan = getattr(report, "memory_plan", None)
    if plan is not None and out and out[0].get("memory_plan") is None:
        # effpass.compile(memory_budget=...): the planner's choice, with its timelines, under the first graph
        out[0]["memory_plan"] = plan.to_dict() if hasattr(plan, "to_dict") else plan
    return out


# ------------------------------------------------------------------------------------------------------
# formatting helpers
# ------------------------------------------------------------------------------------------------------
def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _num(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:,.1f}" if abs(v) >= 100 else f"{v:.4g}"
    return str(v)


def _bytes(n: Any) -> str:
    if not isinstance(n, (int, float)):
        return str(n)
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= k:
            return f"{n / k:.2f} {unit} ({int(n):,} B)"
    return f"{int(n):,} B"


def _data_attr(v: Any) -> str:
    return _e(json.dumps(v, default=str))


def _result(r: dict[str, Any]) -> tuple[str, str]:
    if r.get("error"):
        return "failed", "FAILED (fell back)" if r.get("fell_back") else "FAILED"
    res = ("changed", "changed") if r.get("changed") else ("unchanged", "unchanged")
    if r.get("from_cache"):
        return res[0], res[1] + " (cached)"
    return res


def _op_delta(r: dict[str, Any]) -> dict[str, tuple[int, int]]:
    before, after = r.get("ops_before") or {}, r.get("ops_after") or {}
    return {k: (before.get(k, 0), after.get(k, 0)) for k in sorted(set(before) | set(after))
            if before.get(k, 0) != after.get(k, 0)}


def _before_file(g: dict[str, Any], i: int) -> str | None:
    rec = g["passes"][i]
    for prev in reversed(g["passes"][:i]):
        if prev.get("graph") == rec.get("graph") and prev.get("file"):
            return prev["file"]
    return (g.get("inputs") or {}).get(rec.get("graph"))


def _read(g: dict[str, Any], name: str | None) -> list[str] | None:
    if not name or not g.get("_dir"):
        return None
    try:
        with open(os.path.join(g["_dir"], name)) as f:
            return f.read().splitlines()
    except OSError:
        return None


def _diff_html(g: dict[str, Any], i: int) -> str:
    r = g["passes"][i]
    if not r.get("file"):
        return ""
    after = _read(g, r["file"])
    if after is None:
        why = "no dump folder (compile with dump_dir=... to see diffs)" if not g.get("_dir") else \
            f"file {r['file']} is missing from the dump"
        return f'<p class="warn">diff unavailable: {_e(why)}</p>'
    bname = _before_file(g, i)
    before = _read(g, bname) or []
    lines = list(difflib.unified_diff(before, after, bname or "(none)", r["file"], lineterm="", n=2))
    out = []
    for line in lines[:4000]:
        cls = "add" if line.startswith("+") and not line.startswith("+++") else \
            "del" if line.startswith("-") and not line.startswith("---") else "hunk" if line.startswith("@@") else ""
        out.append(f'<span class="{cls}">{_e(line)}</span>' if cls else _e(line))
    more = f"\n... {len(lines) - 4000} more lines" if len(lines) > 4000 else ""
    adds = sum(1 for l in lines if l.startswith("+") and not l.startswith("+++"))
    dels = sum(1 for l in lines if l.startswith("-") and not l.startswith("---"))
    return (f'<details class="diff"><summary>diff of {_e(r["name"])} on the {_e(r.get("graph"))} graph: '
            f'+{adds} / -{dels} lines ({_e(bname or "(none)")} &rarr; {_e(r["file"])})</summary>'
            f'<pre>{chr(10).join(out)}{_e(more)}</pre></details>')


# ------------------------------------------------------------------------------------------------------
# charts (inline SVG)
# ------------------------------------------------------------------------------------------------------
def _svg_bars(title: str, rows: list[tuple[str, list[tuple[float, str, str]]]], fmt=_num, cid: str = "") -> str:
    """A horizontal bar chart: rows of (label, [(value, css class, legend)]) drawn as grouped bars."""
    rows = [r for r in rows if r[1]]
    if not rows:
        return ""
    vmax = max((v for _, bars in rows for v, _, _ in bars), default=0) or 1
    label_w, bar_w, bar_h, gap = 300, 420, 14, 8
    y, parts = 24, []
    for label, bars in rows:
        parts.append(f'<text x="{label_w - 6}" y="{y + bar_h * len(bars) / 2 + 4:.0f}" text-anchor="end" '
                     f'class="lbl">{_e(label[:48])}</text>')
        for v, cls, legend in bars:
            w = max(1.0, bar_w * (v / vmax)) if v > 0 else 0
            parts.append(f'<rect x="{label_w}" y="{y}" width="{w:.1f}" height="{bar_h - 2}" class="{cls}">'
                         f'<title>{_e(label)} {_e(legend)}: {_e(fmt(v))}</title></rect>')
            parts.append(f'<text x="{label_w + w + 4:.1f}" y="{y + bar_h - 4}" class="val">{_e(fmt(v))}</text>')
            y += bar_h
        y += gap
    legends = sorted({(cls, legend) for _, bars in rows for _, cls, legend in bars if legend})
    lx, leg = label_w, []
    for cls, legend in legends:
        leg.append(f'<rect x="{lx}" y="6" width="10" height="10" class="{cls}"/>'
                   f'<text x="{lx + 14}" y="15" class="val">{_e(legend)}</text>')
        lx += 24 + 7 * len(legend)
    height = y + 4
    return (f'<figure class="chart" id="{_e(cid)}"><figcaption>{_e(title)}</figcaption>'
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{label_w + bar_w + 160}" height="{height}" '
            f'role="img" aria-label="{_e(title)}">{"".join(leg)}{"".join(parts)}</svg></figure>')


def _charts(graphs: list[dict[str, Any]]) -> str:
    time_rows, saved_rows, ops_rows = [], [], []
    for g in graphs:
        for r in g["passes"]:
            label = f"{g['_name']} {r.get('graph', '')} {r.get('name', '')}"
            if r.get("ms"):
                time_rows.append((label, [(float(r.get("ms", 0)), "b-time", "")]))
            st = r.get("stats") or {}
            if all(isinstance(st.get(k), (int, float)) for k in _SAVED):
                saved_rows.append((label, [(st[_SAVED[0]], "b-before", "before"), (st[_SAVED[1]], "b-after", "after")]))
            if r.get("changed"):
                ops_rows.append((label, [(r.get("nodes_before", 0), "b-before", "before"),
                                         (r.get("nodes_after", 0), "b-after", "after")]))
    out = [_svg_bars("Time per pass (ms; lowering times are in the graph table)", time_rows, cid="chart-time"),
           _svg_bars("Saved-for-backward bytes per graph, before and after", saved_rows, fmt=_bytes_short,
                     cid="chart-saved"),
           _svg_bars("Graph nodes before and after each changing pass", ops_rows, cid="chart-nodes")]
    return "".join(out)


def _bytes_short(n: float) -> str:
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= k:
            return f"{n / k:.2f} {unit}"
    return f"{int(n)} B"


# ------------------------------------------------------------------------------------------------------
# sections
# ------------------------------------------------------------------------------------------------------
def _pipeline(graphs: list[dict[str, Any]]) -> str:
    opts = next((g.get("options") for g in graphs if g.get("options")), None)
    if not opts:
        return "<p>The dump records no options.</p>"
    rows = []
    for i, p in enumerate(opts.get("passes") or []):
        rows.append(f'<tr class="pipeline-pass" data-pass="{_e(p.get("name"))}"><td>{i}</td><td>{_e(p.get("name"))}</td>'
                    f'<td><code>{_e(json.dumps(p.get("options", {}), default=str))}</code></td></tr>')
    other = {k: v for k, v in opts.items() if k != "passes"}
    orow = "".join(f"<tr><th>{_e(k)}</th><td><code>{_e(json.dumps(v, default=str))}</code></td></tr>"
                   for k, v in other.items())
    return (f'<table class="pipeline"><tr><th>#</th><th>pass</th><th>options</th></tr>{"".join(rows)}</table>'
            f'<table class="options">{orow}</table>')


def _graph_table(graphs: list[dict[str, Any]]) -> str:
    rows = []
    frames: dict[Any, list[str]] = {}
    breaks: dict[str, int] = {}
    for g in graphs:
        if g["_name"] == "module":
            continue
        dyn = g.get("dynamo") or {}
        t = g.get("timing") or {}
        fails = sum(1 for r in g["passes"] if r.get("error"))
        recompile = dyn.get("frame_compile_id", 0) or 0
        if "frame_id" in dyn:
            frames.setdefault(dyn["frame_id"], []).append(g["_name"])
        for k, v in (dyn.get("graph_breaks") or {}).items():
            breaks[k] = max(breaks.get(k, 0), v)
        rows.append(f'<tr class="graph-row" data-graph="{_e(g["_name"])}"><td>{_e(g["_name"])}</td>'
                    f'<td>{_e(dyn.get("compile_id", "?"))}</td><td>{"yes" if recompile else "no"}</td>'
                    f'<td>{_e(g.get("cache") or "-")}</td><td>{len(g["passes"])}</td><td>{fails}</td>'
                    f'<td class="num">{_num(t.get("total_ms")) if t else "(unfinished)"}</td>'
                    f'<td class="num">{_num(t.get("lower_ms")) if t else "-"}</td></tr>')
    if not rows:
        return "<p>No compiled graphs in this dump (module-level passes only).</p>"
    n_graphs = len(rows)
    n_recompiles = sum(1 for g in graphs if ((g.get("dynamo") or {}).get("frame_compile_id") or 0) > 0)
    n_breaks = sum(breaks.values())
    brk = "".join(f"<li><code>{_e(k)}</code> &times; {v}</li>" for k, v in sorted(breaks.items())) or "<li>none</li>"
    return (f'<p><span id="n-graphs">{n_graphs}</span> graph(s) compiled; '
            f'<span id="n-recompiles">{n_recompiles}</span> recompile(s) (a Dynamo frame compiled again, compile id '
            f'<code>frame/n</code> with n &gt; 0); <span id="n-breaks">{n_breaks}</span> graph break(s) counted by Dynamo '
            f'in the compiling process.</p>'
            f'<table class="graphs"><tr><th>graph</th><th>Dynamo compile id</th><th>recompile</th><th>compile cache</th>'
            f'<th>pass runs</th><th>failures</th><th>backend ms</th><th>lowering ms</th></tr>{"".join(rows)}</table>'
            f'<details><summary>graph-break reasons</summary><ul>{brk}</ul></details>')


def _stats_cell(st: dict[str, Any]) -> str:
    plain, lists = [], []
    for k, v in st.items():
        if k in _SAVED or k in _FLOPS:
            continue
        if isinstance(v, list):
            items = "".join(f"<li>{_e(json.dumps(x, default=str) if not isinstance(x, str) else x)}</li>" for x in v[:500])
            lists.append(f'<details><summary>{_e(k)} ({len(v)})</summary><ul>{items}</ul></details>')
        elif isinstance(v, dict):
            items = "".join(f"<li>{_e(kk)}: {_e(vv)}</li>" for kk, vv in list(v.items())[:500])
            lists.append(f'<details><summary>{_e(k)} ({len(v)})</summary><ul>{items}</ul></details>')
        else:
            plain.append(f'<span class="stat" data-stat="{_e(k)}">{_e(k)}={_e(_num(v))}</span>')
    return " ".join(plain) + "".join(lists)


def _pass_rows(g: dict[str, Any]) -> str:
    rows, extras = [], []
    for i, r in enumerate(g["passes"]):
        cls, text = _result(r)
        st = r.get("stats") or {}
        saved = (f'{_e(_bytes_short(st[_SAVED[0]]))} &rarr; {_e(_bytes_short(st[_SAVED[1]]))}'
                 if all(isinstance(st.get(k), (int, float)) for k in _SAVED)
                 else (_e(_bytes_short(st["saved_bytes_measured"])) + " (measured)"
                       if isinstance(st.get("saved_bytes_measured"), (int, float)) else ""))
        flops = (f'{_num(st.get(_FLOPS[0]))} &rarr; {_num(st.get(_FLOPS[1]))}'
                 + (f' (+{_num(st[_FLOPS[2]])})' if isinstance(st.get(_FLOPS[2]), (int, float)) else "")
                 if isinstance(st.get(_FLOPS[0]), (int, float)) else "")
        delta = _op_delta(r)
        ops = (f'<details><summary>{len(delta)} op(s) changed</summary><table class="ops"><tr><th>op</th><th>before</th>'
               f'<th>after</th></tr>' + "".join(f"<tr><td><code>{_e(k)}</code></td><td>{b}</td><td>{a}</td></tr>"
                                                for k, (b, a) in delta.items()) + "</table></details>") if delta else ""
        skipped = r.get("skipped") or []
        sk = ""
        if skipped:
            items = "".join(f"<li><b>{_e(s.get('site', '?') if isinstance(s, dict) else s)}</b>: "
                            f"{_e(s.get('reason', '') if isinstance(s, dict) else '')}</li>" for s in skipped[:500])
            sk = f'<details class="skipped"><summary>{len(skipped)} site(s) left alone</summary><ul>{items}</ul></details>'
        err = ""
        if r.get("error"):
            err = (f'<details class="error" open><summary>{_e(r["error"])}</summary>'
                   f'<pre>{_e(r.get("traceback") or "")}</pre></details>')
        attrs = {"graph": g["_name"], "index": i, "pass": r.get("name"), "phase": r.get("phase"),
                 "kind": r.get("graph"), "changed": bool(r.get("changed")), "ms": r.get("ms", 0),
                 "nodes-before": r.get("nodes_before", 0), "nodes-after": r.get("nodes_after", 0),
                 "skipped": len(skipped), "stats": st, "error": r.get("error")}
        data = " ".join(f'data-{k}="{_data_attr(v)}"' for k, v in attrs.items())
        rows.append(f'<tr class="pass-row {cls}" {data}><td>{_e(r.get("phase"))}</td><td>{_e(r.get("graph"))}</td>'
                    f'<td><b>{_e(r.get("name"))}</b></td><td class="res">{_e(text)}</td>'
                    f'<td class="num ms">{_e(_num(float(r.get("ms", 0) or 0)))}</td>'
                    f'<td class="num nodes">{r.get("nodes_before", 0)} &rarr; {r.get("nodes_after", 0)}</td>'
                    f'<td>{ops}</td><td class="num">{saved}</td><td class="num">{flops}</td>'
                    f'<td>{_stats_cell(st)}{sk}{err}</td></tr>')
        d = _diff_html(g, i)
        if d:
            extras.append(d)
    head = ("<tr><th>phase</th><th>graph</th><th>pass</th><th>result</th><th>ms</th><th>nodes</th><th>ops</th>"
            "<th>saved for backward</th><th>recompute FLOPs</th><th>statistics, sites</th></tr>")
    body = f'<table class="passes">{head}{"".join(rows)}</table>' if rows else "<p>(no passes ran)</p>"
    return body + "".join(extras)


def _memory_plan(plan: Any) -> str:
    if isinstance(plan, dict) and plan.get("timelines"):
        from .timeline import timeline_svg

        rest = {k: v for k, v in plan.items() if k != "timelines"}
        return (f'<div class="timeline"><h5>Where memory goes (predicted, one step)</h5>'
                f'{timeline_svg(list(plan["timelines"].items()))}</div>' + _memory_plan(rest))
    if isinstance(plan, dict) and isinstance(plan.get("rows"), list):
        cols = plan.get("columns") or sorted({k for row in plan["rows"] if isinstance(row, dict) for k in row})
        head = "".join(f"<th>{_e(c)}</th>" for c in cols)
        body = "".join("<tr>" + "".join(f'<td class="num">{_e(_num(row.get(c, "")))}</td>' for c in cols) + "</tr>"
                       for row in plan["rows"] if isinstance(row, dict))
        rest = {k: v for k, v in plan.items() if k not in ("rows", "columns")}
        return (_memory_plan(rest) if rest else "") + f'<table class="plan"><tr>{head}</tr>{body}</table>'
    if isinstance(plan, dict):
        rows = []
        for k, v in plan.items():
            if isinstance(v, (dict, list)):
                rows.append(f"<tr><th>{_e(k)}</th><td>{_memory_plan(v)}</td></tr>")
            else:
                shown = _bytes(v) if "bytes" in str(k) and isinstance(v, (int, float)) else _num(v)
                rows.append(f'<tr><th>{_e(k)}</th><td class="num" data-key="{_e(k)}">{_e(shown)}</td></tr>')
        return f'<table class="plan">{"".join(rows)}</table>'
    if isinstance(plan, list) and plan and all(isinstance(x, dict) for x in plan):
        return _memory_plan({"rows": plan})
    return f"<code>{_e(json.dumps(plan, default=str))}</code>"


_CSS = """
body{font:14px/1.4 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#1d1d1f;background:#fff}
h1{font-size:22px;margin:0 0 4px} h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #ddd}
h3{font-size:15px;margin:20px 0 6px} .meta{color:#666}
table{border-collapse:collapse;margin:6px 0} th,td{border:1px solid #ddd;padding:3px 7px;vertical-align:top;text-align:left}
th{background:#f5f5f7} td.num{text-align:right;white-space:nowrap} code{font-size:12px}
tr.changed td.res{color:#0a7a2f;font-weight:600} tr.failed td.res{color:#b00020;font-weight:600}
tr.unchanged td.res{color:#777} .problems{border:2px solid #b00020;background:#fff4f4;padding:8px 14px}
.problems li{margin:2px 0} .warn{color:#b05a00} .stat{display:inline-block;margin-right:8px;white-space:nowrap}
pre{background:#fafafa;border:1px solid #eee;padding:8px;overflow:auto;max-height:600px;font-size:12px}
pre .add{color:#0a7a2f;background:#eaffea} pre .del{color:#b00020;background:#ffecec} pre .hunk{color:#555}
details{margin:2px 0} summary{cursor:pointer} figure.chart{margin:10px 0} figcaption{font-weight:600}
svg .lbl,svg .val{font:11px system-ui,sans-serif;fill:#333} .b-time{fill:#4f7cd9} .b-lower{fill:#aab4c8}
.b-before{fill:#d98b4f} .b-after{fill:#4fa36b} button{margin-right:6px}
table.passes td:last-child{max-width:420px;overflow-wrap:anywhere}
"""

_JS = """
(function () {
  var data = JSON.parse(document.getElementById('effpass-data').textContent);
  var rows = document.querySelectorAll('tr.pass-row');
  var expected = data.graphs.reduce(function (n, g) { return n + g.passes.length; }, 0);
  if (rows.length !== expected) { throw new Error('effpass report: ' + rows.length + ' pass rows, data has ' + expected); }
  function all(open) { document.querySelectorAll('details').forEach(function (d) { d.open = open; }); }
  document.getElementById('expand').addEventListener('click', function () { all(true); });
  document.getElementById('collapse').addEventListener('click', function () { all(false); });
  document.documentElement.setAttribute('data-effpass-ready', String(rows.length));
})();
"""


def render_html(graphs: list[dict[str, Any]], problems: Iterable[str] = (), *, source: str = "") -> str:
    """The page for ``graphs`` (as :func:`load_dump` returns them) and a list of problems to show."""
    from .. import __version__

    problems = list(problems)
    prob = ""
    if problems:
        prob = ('<div class="problems" id="problems"><b>Problems with this dump</b><ul>'
                + "".join(f"<li>{_e(p)}</li>" for p in problems) + "</ul></div>")
    versions = sorted({str(g.get("effpass_version", "?")) for g in graphs}) or ["?"]
    sections = []
    for g in graphs:
        if g["_name"] == "module" and not g["passes"]:
            continue  # no module-level pass ran
        if g.get("_broken"):
            files = "".join(f"<li>{_e(f)}</li>" for f in g.get("_files", []))
            sections.append(f'<section class="graph" id="g-{_e(g["_name"])}"><h3>{_e(g["_name"])} (no index)</h3>'
                            f'<ul>{files}</ul></section>')
            continue
        t = g.get("timing") or {}
        timing = (f' &middot; backend {_num(t.get("total_ms"))} ms, lowering {_num(t.get("lower_ms"))} ms'
                  if t else "")
        cache = f' &middot; compile cache: {_e(g["cache"])}' if g.get("cache") else ""
        plan = ""
        if g.get("memory_plan") is not None:
            plan = f'<div class="memory-plan"><h4>Memory plan</h4>{_memory_plan(g["memory_plan"])}</div>'
        sections.append(f'<section class="graph" id="g-{_e(g["_name"])}"><h3>{_e(g["_name"])}'
                        f'<span class="meta">{cache}{timing}</span></h3>{_pass_rows(g)}{plan}</section>')
    plans = [g for g in graphs if g.get("memory_plan") is not None]
    plan_note = (f"<p>{len(plans)} graph(s) carry a memory plan (shown under each graph).</p>" if plans else
                 "<p>No memory plan in this dump (a memory planner writes one into <code>index.json</code> "
                 "as <code>memory_plan</code>).</p>")
    payload = {"source": source, "problems": problems,
               "graphs": [{k: v for k, v in g.items() if not k.startswith("_")} for g in graphs]}
    data = json.dumps(payload, default=str).replace("</", "<\\/").replace("<!--", "<\\!--")
    n_pass = sum(len(g["passes"]) for g in graphs)
    names = sorted({r.get("name") for g in graphs for r in g["passes"]})
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>effpass report{(' - ' + _e(source)) if source else ''}</title><style>{_CSS}</style></head>
<body>
<h1>effpass report</h1>
<div class="meta">{_e(source)} &middot; dump written by effpass {_e(', '.join(versions))} &middot; page by effpass
{_e(__version__)} &middot; {len(graphs)} graph(s), {n_pass} pass run(s) of {len(names)} pass(es): {_e(', '.join(map(str, names)))}
&middot; generated {_e(datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC'))}</div>
{prob}
<p><button id="expand" type="button">expand all</button><button id="collapse" type="button">collapse all</button></p>
<h2>Pipeline and options</h2>{_pipeline(graphs)}
<h2>Charts</h2>{_charts(graphs) or '<p>(nothing to chart)</p>'}
<h2>Graphs, graph breaks and recompiles</h2>{_graph_table(graphs)}
<h2>Memory plan</h2>{plan_note}
<h2>Passes per graph</h2>{''.join(sections) or '<p>(nothing to show)</p>'}
<script type="application/json" id="effpass-data">{data}</script>
<script>{_JS}</script>
</body></html>
"""


def write_dump_html(dump_dir: str, out_path: str) -> list[str]:
    """Write the page of a dump folder to ``out_path``; returns the problems found (also on the page)."""
    graphs, problems = load_dump_lenient(dump_dir)
    _write(out_path, render_html(graphs, problems, source=os.path.abspath(dump_dir)))
    return problems


def write_report_html(report: CompileReport, path: str) -> str:
    """``effpass.report(model).to_html(path)``: the page of a live report (diffs where it had a dump)."""
    graphs = _graphs_of_report(report)
    problems = [] if graphs else ["this report is empty: nothing was compiled or prepared yet"]
    _write(path, render_html(graphs, problems, source="effpass.report(model)"))
    return path


def _write(path: str, text: str) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


register_renderer("html", write_report_html)
