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
import json
import os
from typing import Any, Iterable

from ..dump import INDEX, graph_index
from ..report import CompileReport, register_renderer
from .html_sections import _charts, _e, _graph_table, _memory_plan, _num, _pass_rows, _pipeline, memory_and_time

__all__ = ["load_dump_lenient", "render_html", "write_dump_html", "write_report_html"]


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


_CSS = """
body{font:14px/1.4 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#1d1d1f;background:#fff}
h1{font-size:22px;margin:0 0 4px} h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #ddd}
h3{font-size:15px;margin:20px 0 6px} .meta{color:#666}
table{border-collapse:collapse;margin:6px 0} th,td{border:1px solid #ddd;padding:3px 7px;vertical-align:top;text-align:left}
th{background:#f5f5f7} td.num{text-align:right;white-space:nowrap} code{font-size:12px}
tr.changed td.res{color:#0a7a2f;font-weight:600} tr.failed td.res{color:#b00020;font-weight:600}
tr.unchanged td.res{color:#777} .problems{border:2px solid #b00020;background:#fff4f4;padding:8px 14px}
.problems li{margin:2px 0} .warn{color:#b05a00} .stat{display:inline-block;margin-right:8px;max-width:100%;overflow-wrap:anywhere}
pre{background:#fafafa;border:1px solid #eee;padding:8px;overflow:auto;max-height:600px;font-size:12px}
pre .add{color:#0a7a2f;background:#eaffea} pre .del{color:#b00020;background:#ffecec} pre .hunk{color:#555}
details{margin:2px 0} summary{cursor:pointer} figure.chart{margin:10px 0} figcaption{font-weight:600}
svg .lbl,svg .val{font:11px system-ui,sans-serif;fill:#333} .b-time{fill:#4f7cd9} .b-lower{fill:#aab4c8}
.b-before{fill:#d98b4f} .b-after{fill:#4fa36b} button{margin-right:6px}
table.passes td:last-child{max-width:420px;overflow-wrap:anywhere}
table{max-width:100%} td,th{overflow-wrap:anywhere} pre{max-width:100%;white-space:pre-wrap}
table.passes{table-layout:fixed;width:100%}
#memory-time table.figures th,#memory-time table.figures td.num{white-space:nowrap}
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
  // nothing wider than the window (a clipped column hides numbers): the page's width is checked, not assumed
  var wide = document.documentElement.scrollWidth > window.innerWidth + 1;
  document.documentElement.setAttribute('data-effpass-fits', wide ? 'no:' + document.documentElement.scrollWidth : 'yes');
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
    # the header counts what the body shows: compiled graphs (the module phase is not a graph)
    n_graphs = sum(1 for g in graphs if g["_name"] != "module")
    module = " and the module phase" if any(g["_name"] == "module" and g["passes"] for g in graphs) else ""
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>effpass report{(' - ' + _e(source)) if source else ''}</title><style>{_CSS}</style></head>
<body>
<h1>effpass report</h1>
<div class="meta">{_e(source)} &middot; dump written by effpass {_e(', '.join(versions))} &middot; page by effpass
{_e(__version__)} &middot; <span id="n-graphs-head">{n_graphs}</span> graph(s){module}, {n_pass} pass run(s) of {len(names)} pass(es): {_e(', '.join(map(str, names)))}
&middot; generated {_e(datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC'))}</div>
{prob}
<p><button id="expand" type="button">expand all</button><button id="collapse" type="button">collapse all</button></p>
<h2>Memory and time</h2>{memory_and_time(graphs)}
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
