"""Where memory goes: the planner's live-byte timeline of one step drawn as an SVG, and exported for PyTorch's
memory visualizer.

    svg = timeline_svg([("checkpoint full", est.timeline), ("no technique", other.timeline)])
    write_timeline_html("plan.html", curves, title="effpass plan")
    snapshot = memory_viz_snapshot(est.timeline)      # pickle it; open at https://pytorch.org/memory_viz

The first curve is drawn stacked by category (parameters, optimizer states, inputs, saved activations,
gradients, transients) with its peak marked by the op and graph that reach it; every other curve (another
candidate plan) is drawn as its total, for comparison. Self-contained: no script, no external file.
"""
from __future__ import annotations

import html
from typing import Sequence

__all__ = ["timeline_svg", "write_timeline_html", "memory_viz_snapshot", "COLORS"]

COLORS = {"parameters": "#8da0cb", "optimizer states": "#a6d854", "inputs": "#b3b3b3",
          "saved activations": "#fc8d62", "gradients": "#66c2a5", "transients": "#ffd92f"}
_LINES = ("#1f77b4", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf")


def _mib(b: float) -> str:
    return f"{b / 2**20:,.1f} MiB"


def _stack(tl: dict) -> tuple[list[int], list[list[float]]]:
    """x positions and, per category in order, the cumulative top of its band at each point."""
    st = tl["static"]
    base = [st.get("parameters", 0), st.get("optimizer states", 0), st.get("inputs", 0)]
    xs, tops = [], [[] for _ in tl["categories"]]
    for i, _phase, saved, grads, trans in tl["points"]:
        acc = 0.0
        for k, v in enumerate(base + [saved, grads, trans]):
            acc += v
            tops[k].append(acc)
        xs.append(i)
    return xs, tops


def timeline_svg(curves: Sequence[tuple[str, dict]], width: int = 900, height: int = 320) -> str:
    curves = [(label, tl) for label, tl in curves if tl and tl.get("points")]
    if not curves:
        return '<p class="timeline-empty">no timeline recorded</p>'
    pad_l, pad_r, pad_t, pad_b = 70, 170, 20, 30
    w, h = width - pad_l - pad_r, height - pad_t - pad_b
    stacks = [(label, tl, *_stack(tl)) for label, tl in curves]
    ymax = max(max(top[-1] for top in zip(*tops)) if tops[0] else 1 for _, _, _, tops in stacks) or 1
    ymax = max(ymax, max(tl["peak"]["bytes"] for _, tl in curves)) * 1.05

    def X(i, n):
        return pad_l + (w * i / max(n - 1, 1))

    def Y(b):
        return pad_t + h - h * b / ymax

    out = [f'<svg class="memory-timeline" xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" role="img" aria-label="live bytes over one training step">']
    label0, tl0, xs0, tops0 = stacks[0]
    n0 = max(tl0["events"], 1)
    prev = [0.0] * len(xs0)
    for cat, top in zip(tl0["categories"], tops0):
        pts_top = " ".join(f"{X(x, n0):.1f},{Y(t):.1f}" for x, t in zip(xs0, top))
        pts_bot = " ".join(f"{X(x, n0):.1f},{Y(b):.1f}" for x, b in reversed(list(zip(xs0, prev))))
        out.append(f'<polygon class="band" data-category="{html.escape(cat)}" fill="{COLORS.get(cat, "#ccc")}" '
                   f'points="{pts_top} {pts_bot}"><title>{html.escape(cat)}</title></polygon>')
        prev = top
    for k, (label, tl, xs, tops) in enumerate(stacks[1:]):
        n = max(tl["events"], 1)
        pts = " ".join(f"{X(x, n):.1f},{Y(t):.1f}" for x, t in zip(xs, tops[-1]))
        out.append(f'<polyline class="candidate" data-plan="{html.escape(label)}" fill="none" stroke="{_LINES[k % len(_LINES)]}" '
                   f'stroke-width="1.5" points="{pts}"><title>{html.escape(label)}</title></polyline>')
    # the peak of the first curve, with the op that reaches it
    pk = tl0["peak"]
    px = X(pk["event"], n0)
    out.append(f'<line class="peak" x1="{px:.1f}" x2="{px:.1f}" y1="{pad_t}" y2="{pad_t + h}" stroke="#000" '
               f'stroke-dasharray="4 3"/>')
    where = f'peak {_mib(pk["bytes"])}: {pk.get("phase")} {pk.get("graph", "")} {pk.get("node", "")}'.strip()
    out.append(f'<text class="peak-label" x="{min(px + 4, pad_l + w - 200):.1f}" y="{pad_t + 12}" font-size="11">'
               f'{html.escape(where[:90])}</text>')
    # axes and legend
    for frac in (0, 0.25, 0.5, 0.75, 1.0):
        b = ymax * frac
        out.append(f'<text x="{pad_l - 6}" y="{Y(b) + 4:.1f}" font-size="10" text-anchor="end">{_mib(b)}</text>'
                   f'<line x1="{pad_l}" x2="{pad_l + w}" y1="{Y(b):.1f}" y2="{Y(b):.1f}" stroke="#eee"/>')
    out.append(f'<text x="{pad_l + w / 2:.0f}" y="{height - 6}" font-size="11" text-anchor="middle">allocations and '
               f'frees of one step (forward, backward, optimizer), in order</text>')
    ly = pad_t
    out.append(f'<text x="{pad_l + w + 10}" y="{ly + 10}" font-size="11" font-weight="bold">{html.escape(label0[:24])}</text>')
    for cat in reversed(tl0["categories"]):
        ly += 16
        out.append(f'<rect x="{pad_l + w + 10}" y="{ly}" width="10" height="10" fill="{COLORS.get(cat, "#ccc")}"/>'
                   f'<text x="{pad_l + w + 24}" y="{ly + 9}" font-size="11">{html.escape(cat)}</text>')
    for k, (label, tl, _, _) in enumerate(stacks[1:]):
        ly += 16
        out.append(f'<line x1="{pad_l + w + 10}" x2="{pad_l + w + 20}" y1="{ly + 5}" y2="{ly + 5}" '
                   f'stroke="{_LINES[k % len(_LINES)]}" stroke-width="2"/><text x="{pad_l + w + 24}" y="{ly + 9}" '
                   f'font-size="11">{html.escape(label[:22])} ({_mib(tl["peak"]["bytes"])})</text>')
    out.append("</svg>")
    return "\n".join(out)


def write_timeline_html(path: str, curves: Sequence[tuple[str, dict]], title: str = "effpass memory timeline",
                        text: str = "") -> str:
    body = timeline_svg(curves)
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head>"
            f"<body style='font-family: sans-serif'><h2>{html.escape(title)}</h2>{body}"
            + (f"<pre>{html.escape(text)}</pre>" if text else "") + "</body></html>")
    with open(path, "w") as f:
        f.write(page)
    return path


def memory_viz_snapshot(timeline: dict) -> dict:
    """The timeline as a snapshot in the format of ``torch.cuda.memory._snapshot()`` (one device trace of
    alloc / free_completed actions, one per category change), which https://pytorch.org/memory_viz reads
    from a pickle file. Sizes are the category totals' changes between points (the planner's events are
    bucketed), frames name the phase."""
    trace, addr, live = [], 0, {}
    st = timeline["static"]
    for cat in ("parameters", "optimizer states", "inputs"):
        if st.get(cat):
            addr += 1
            trace.append({"action": "alloc", "addr": addr, "size": int(st[cat]), "stream": 0,
                          "frames": [{"filename": "step start", "line": 0, "name": cat}]})
    prev = {"saved activations": 0, "gradients": 0, "transients": 0}
    for i, phase, saved, grads, trans in timeline["points"]:
        changes = [(cat, int(v - prev[cat])) for cat, v in
                   (("saved activations", saved), ("gradients", grads), ("transients", trans))]
        frames = lambda cat: [{"filename": str(phase), "line": int(i), "name": cat}]  # noqa: E731
        for cat, d in sorted(changes, key=lambda c: c[1]):  # frees first: the trace never overshoots a point
            while d < 0 and live.get(cat):
                a, n = live[cat].pop()
                take = min(n, -d)
                trace.append({"action": "free_completed", "addr": a, "size": n, "stream": 0, "frames": frames(cat)})
                if take < n:  # part of a block stays live: the rest as a new block
                    addr += 1
                    live[cat].append((addr, n - take))
                    trace.append({"action": "alloc", "addr": addr, "size": n - take, "stream": 0,
                                  "frames": frames(cat)})
                d += take
            if d > 0:
                addr += 1
                live.setdefault(cat, []).append((addr, d))
                trace.append({"action": "alloc", "addr": addr, "size": d, "stream": 0, "frames": frames(cat)})
        prev = {"saved activations": saved, "gradients": grads, "transients": trans}
    return {"segments": [], "device_traces": [trace]}
