"""The parts of the HTML report's page (:mod:`effpass.inspect.html` assembles them): formatting helpers, the
per-pass unified diffs, the inline SVG charts and the sections (pipeline and options, graphs, pass rows, memory
plan). Each returns an HTML fragment from the graphs as :func:`effpass.inspect.load_dump` gives them.
"""
from __future__ import annotations

import difflib
import html
import json
import os
from typing import Any

_SAVED = ("saved_bytes_before", "saved_bytes_after")
_FLOPS = ("recompute_flops_before", "recompute_flops_after", "recompute_flops_added")


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


# ------------------------------------------------------------------------------------------------------
# memory and time first: what a user asks before anything else
# ------------------------------------------------------------------------------------------------------
def _short_bytes(n: Any) -> str:
    if not isinstance(n, (int, float)):
        return "-"
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= k:
            return f"{n / k:.2f} {unit}"
    return f"{int(n)} B"


def _short_num(n: Any) -> str:
    if not isinstance(n, (int, float)):
        return "-"
    for unit, k in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= k:
            return f"{n / k:.2f} {unit}"
    return f"{n:.0f}"


def _plan_peak(graphs: list[dict[str, Any]]) -> Any:
    for g in graphs:
        plan = g.get("memory_plan")
        if isinstance(plan, dict):
            for key in ("predicted_peak_bytes", "peak_bytes"):
                if isinstance(plan.get(key), (int, float)):
                    return plan[key]
            chosen = plan.get("chosen")
            if isinstance(chosen, dict) and isinstance(chosen.get("peak_bytes"), (int, float)):
                return chosen["peak_bytes"]
    return None


def memory_and_time(graphs: list[dict[str, Any]], device: str = "h100") -> str:
    """Per graph and for the step: saved activations and the transient peak (predicted from the graphs'
    metadata), FLOPs, a roofline time estimate on ``device`` and the compile time (measured); the step row sums
    them. Says which figures are predicted and which measured."""
    rows, tot = [], {"flops": 0, "est": 0.0, "saved": 0, "peak": 0, "compile": 0.0}
    missing = []
    for g in graphs:
        if g["_name"] == "module":
            continue
        figs = g.get("figures") or {}
        t = g.get("timing") or {}
        fw = figs.get("forward") or figs.get("inference") or {}
        bw = figs.get("backward") or {}
        why = fw.get("skipped") or bw.get("skipped")
        if why:
            fw, bw = {}, {}
        if not fw and not bw:
            missing.append(f'{g["_name"]} ({why})' if why else g["_name"])
        flops = (fw.get("flops") or 0) + (bw.get("flops") or 0)
        est = ((fw.get("est_ms") or {}).get(device) or 0.0) + ((bw.get("est_ms") or {}).get(device) or 0.0)
        saved = bw.get("saved_bytes")
        peak = max(fw.get("peak_bytes") or 0, (bw.get("peak_bytes") or 0) + (saved or 0))
        tot["flops"] += flops
        tot["est"] += est
        tot["saved"] += saved or 0
        tot["peak"] = max(tot["peak"], peak)
        tot["compile"] += t.get("total_ms") or 0.0
        kinds = "+".join(k for k in ("forward", "backward", "inference") if k in figs) or "-"
        rows.append(f'<tr class="fig-row" data-graph="{_e(g["_name"])}" data-flops="{flops}" data-saved="{saved or 0}">'
                    f'<td>{_e(g["_name"])}</td><td>{_e(kinds)}</td>'
                    f'<td class="num">{_short_bytes(saved) if saved is not None else "-"}</td>'
                    f'<td class="num">{_short_bytes(fw.get("peak_bytes"))}</td>'
                    f'<td class="num">{_short_bytes(bw.get("peak_bytes")) if bw else "-"}</td>'
                    f'<td class="num">{_short_num(flops)}</td><td class="num">{est:.3f}</td>'
                    f'<td class="num">{_num(t.get("total_ms")) if t else "(unfinished)"}</td></tr>')
    if not rows:
        return "<p>No compiled graphs in this dump: nothing to estimate.</p>"
    plan_peak = _plan_peak(graphs)
    plan = (f'<p class="plan-peak">Memory planner: predicted peak of the step <b>{_short_bytes(plan_peak)}</b> '
            f'(predicted by replaying the step; see "Memory plan").</p>' if plan_peak is not None else "")
    gap = (f'<p class="warn">No figures for {_e(", ".join(missing))} (without a reason: compiled without a dump '
           f'and without <code>detailed_stats=True</code>, which record them, or a compile-cache hit recorded without '
           f'them).</p>' if missing else "")
    step = (f'<tr class="fig-step"><th>step</th><th>all graphs</th><th class="num">{_short_bytes(tot["saved"])}</th>'
            f'<th class="num" colspan="2">largest: {_short_bytes(tot["peak"])}</th>'
            f'<th class="num">{_short_num(tot["flops"])}</th><th class="num">{tot["est"]:.3f}</th>'
            f'<th class="num">{_num(tot["compile"])}</th></tr>')
    return (f'<div id="memory-time">{plan}'
            f'<table class="figures"><tr><th>graph</th><th>lowered</th><th>saved for backward</th>'
            f'<th>forward peak</th><th>backward peak</th><th>FLOPs</th><th>est. {_e(device.upper())} ms</th>'
            f'<th>compile ms</th></tr>{"".join(rows)}{step}</table>{gap}'
            f'<p class="meta">Memory and FLOPs are <b>predicted</b> from each graph\'s tensor metadata, nothing run: '
            f'"saved for backward" is what the forward leaves for the backward (activations, each storage once), a '
            f'peak is the most intermediate bytes alive at once above the graph\'s inputs with the ops unfused '
            f'(Inductor\'s fusions hold less); the step\'s "largest" is the biggest of the graphs\' backward peak plus '
            f'its saved bytes (or forward peak). The time is a <b>roofline estimate</b> on {_e(device.upper())} '
            f'(each op the larger of its FLOPs at the matmul ceiling and its bytes at HBM bandwidth, plus a launch; '
            f'<code>effpass cost</code> has the fused model), not a measurement. Compile time is <b>measured</b> '
            f'(the backend call).</p></div>')
