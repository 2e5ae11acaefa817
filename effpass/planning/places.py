"""The peak over the tile count, place by place: exact where the secant of the peak is only a lower bound.

A replay's peak is the largest of the live bytes right after each allocation (a *place*). Over the tile count
``T`` of a pinned pipeline (:mod:`effpass.planning.tiles`) each place's live bytes are affine in ``T`` and, inside
the ``k``-th tile of a region, in ``k``; the peak (their maximum) is convex in ``T``, and two places can cross
beyond the replayed counts, which the peak's own figures at three counts cannot see. So the short replays record
every place (:func:`recording_places`: the tracker's ``places``), named by where it is in the graphs that run:

* the phase, the graph (numbered in order of first run) and the graph's *segment*: the nodes before any tile
  (``("pre",)``), a tile (``(region, k)``: the nodes ``tile_sequence`` copied into tile ``k`` and everything
  up to the next tagged node, e.g. a weight gradient's accumulation) or a region's split and output
  (``(region, role)``); the tags are ``meta["custom"][TILE_META]`` (:data:`effpass.pass_base.TILE_META`),
  which AOTAutograd copies to a forward node's backward nodes;
* the place's ordinal among the segment's allocations.

Places outside the tiles, and in the first and the last tile (the last one is the rest: its own size), are the
same at every count: each is checked affine over the replayed counts and extrapolated. A middle tile's place
``j`` is ``A + B * T + C * k`` (checked on every middle tile of every count) and its largest value at ``n`` tiles
is at the second or the last-but-one tile. The peak at ``n`` tiles is the largest extrapolated place: exact,
not a bound, wherever every place is affine (:func:`exact_peak` says why not otherwise, and the caller falls back
to the bound). Over depth the places differ (the graphs grow); each depth's exact figures per phase are
combined over depth as :func:`effpass.planning.depth.combine_depths` combines every count (checked affine).
"""
from __future__ import annotations

import contextlib
import re
from array import array

__all__ = ["recording_places", "recording", "line_contexts", "exact_peak", "ExactPeak"]

_RECORD = [False]


@contextlib.contextmanager
def recording_places(on: bool = True):
    """While active, every replay's tracker records each allocation's place (``MemoryEstimate.places``; forked
    replay workers inherit the setting)."""
    old, _RECORD[0] = _RECORD[0], on
    try:
        yield
    finally:
        _RECORD[0] = old


def recording() -> bool:
    return _RECORD[0]


_ASSIGN = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*=")


def line_contexts(frame, tag: str) -> dict[int, tuple]:
    """``{line: (segment, node name)}`` of the FX graph whose generated ``forward`` runs in ``frame`` (the eager
    lowering's, :data:`effpass.lowering.GRAPH_OF_CODE`), each node's segment as the module docstring says; {} when
    it is not one (its allocations then share one segment, and the places do not line up: no exact peak)."""
    import linecache

    from effpass.lowering import GRAPH_OF_CODE

    gm = GRAPH_OF_CODE.get(frame.f_code)
    graph = getattr(gm, "graph", None)
    lines = linecache.getlines(frame.f_code.co_filename)
    if graph is None or not lines:
        return {}
    segment, state = {}, ("pre",)
    for node in graph.nodes:
        info = node.meta.get("custom") or {}
        if tag in info:
            state = (info[tag], info["tile"]) if isinstance(info.get("tile"), int) else (info[tag], str(info.get("role")))
        segment[node.name] = state
    out = {}
    for i, line in enumerate(lines, 1):
        m = _ASSIGN.match(line)
        if m and m[1] in segment:
            out[i] = (segment[m[1]], m[1])
    return out


def freeze(places: dict) -> dict:
    """The tracker's places, kept: ``{(phase, graph, segment): (array of live bytes, [node names])}``."""
    return {k: (array("q", v), n) for k, (v, n) in places.items()}


class ExactPeak:
    """The peak at ``n`` tiles place by place: ``step_peak`` (above the step's start), ``phase_peaks``, where
    (``phase``, ``node``), and the number of places."""

    def __init__(self, step_peak, phase_peaks, phase, node, places, graph="1"):
        self.step_peak, self.phase_peaks, self.phase, self.node, self.places = (step_peak, phase_peaks, phase, node,
                                                                                places)
        self.graph = graph  # the graph's number in its phase, in the order of the graphs' first allocation


def _split(profile: dict, c: int):
    """A count's places: fixed labels (outside the tiles, the first and the last tile) and the middle tiles."""
    fixed, mid = {}, {}
    for (phase, g, seg), (vals, names) in profile.items():
        if len(seg) == 2 and isinstance(seg[1], int):
            r, k = seg
            if k == 0 or k == c - 1:
                fixed[(phase, g, (r, "first" if k == 0 else "last"))] = (vals, names)
            else:
                mid.setdefault((phase, g, r), {})[k] = (vals, names)
        else:
            fixed[(phase, g, seg)] = (vals, names)
    return fixed, mid


def _at_depth(profiles, counts, n):
    """(ExactPeak at ``n`` tiles, "") from one depth's place profiles at ``counts`` tiles, or (None, why)."""
    counts = list(counts)
    if len(profiles) < 2 or any(p is None for p in profiles):
        return None, "the places were not recorded"
    parts = [_split(p, c) for p, c in zip(profiles, counts)]
    d = counts[-1] - counts[-2]
    m = (n - counts[-1]) // d
    best = (-1, None, None, None)
    phase_peaks: dict = {}
    count = 0

    def take(v, phase, name, graph):
        nonlocal best
        if v > phase_peaks.get(phase, -1):
            phase_peaks[phase] = v
        if v > best[0]:
            best = (v, phase, name, graph)

    fixed = [f for f, _ in parts]
    if any(set(f) != set(fixed[-1]) for f in fixed):
        diff = sorted(set(fixed[0]) ^ set(fixed[-1]), key=repr)[:3]
        return None, f"the graphs' segments differ between the counts ({diff})"
    for label, (vals, names) in fixed[-1].items():
        series = [f[label][0] for f in fixed]
        if len({len(s) for s in series}) != 1:
            return None, f"{label[0]} {label[2]}: {' / '.join(str(len(s)) for s in series)} allocations at {counts}"
        for j in range(len(vals)):
            a = [s[j] for s in series]
            if len(a) == 3 and a[1] - a[0] != a[2] - a[1]:
                return None, f"a place in the {label[0]} ({names[j]}) is not affine: {a[0]} / {a[1]} / {a[2]}"
            take(a[-1] + m * (a[-1] - a[-2]), label[0], names[j], label[1])
        count += len(vals)
    mids = [md for _, md in parts]
    keys = set().union(*mids)
    for key in keys:
        per = [md.get(key, {}) for md in mids]
        if any(sorted(p) != list(range(1, c - 1)) for p, c in zip(per, counts)):
            return None, f"region {key[2]}'s middle tiles are not all there in the {key[0]}"
        c1 = counts[0]
        if c1 < 4:
            return None, "fewer than two middle tiles at the first count"
        lens = {len(p[k][0]) for p in per for k in p}
        if len(lens) != 1:
            return None, f"region {key[2]}'s middle tiles allocate {sorted(lens)} times in the {key[0]}"
        (length,) = lens
        names = per[-1][1][1]
        for j in range(length):
            v11, v12, v21 = per[0][1][0][j], per[0][2][0][j], per[1][1][0][j]
            C = v12 - v11
            if (v21 - v11) % (counts[1] - c1):
                return None, f"a place in region {key[2]}'s tiles ({names[j]}) is not affine in the tile count"
            B = (v21 - v11) // (counts[1] - c1)
            A = v11 - B * c1 - C
            for p, c in zip(per, counts):
                for k, (vals, _) in p.items():
                    if vals[j] != A + B * c + C * k:
                        return None, (f"a place in region {key[2]}'s tiles ({names[j]}) is not affine in the tile "
                                      f"count and index ({vals[j]} at tile {k} of {c})")
            take(A + B * n + C * max(1, n - 2) if C > 0 else A + B * n + C, key[0], names[j], key[1])
        count += length * (n - 2)
    if best[1] is None and best[0] < 0:
        return None, "no allocation recorded"
    return ExactPeak(best[0], phase_peaks, best[1], best[2], count, best[3]), ""


def exact_peak(ests, counts, n: int):
    """(ExactPeak of the step at ``n`` tiles, "") from the estimates at ``counts`` tiles (each with its place
    profiles: ``depth_places``, one per replayed depth, or ``places``), or (None, why not)."""
    per_depth = []
    for e in ests:
        prof = getattr(e, "depth_places", None)
        per_depth.append(prof if prof is not None else [getattr(e, "places", None)])
    if len({len(p) for p in per_depth}) != 1:
        return None, "the counts were replayed at different depths"
    depths = getattr(ests[-1], "depths", None) if len(per_depth[-1]) > 1 else None
    target = getattr(ests[-1], "depth_target", None)
    if len(per_depth[-1]) > 1 and (not depths or target is None or len(depths) != len(per_depth[-1])):
        return None, "the depths of the replays are not known"
    got = []
    for i in range(len(per_depth[-1])):
        r, why = _at_depth([p[i] for p in per_depth], counts, n)
        if r is None:
            return None, why
        got.append(r)
    if len(got) == 1:
        return got[0], ""
    # over depth: each phase's peak affine in the number of blocks (checked at three depths), as combine_depths
    phases = set(got[-1].phase_peaks)
    if any(set(g.phase_peaks) != phases for g in got):
        return None, "the phases differ between the depths"
    k = target - depths[-1]
    ext = {}
    for ph in phases:
        v = [g.phase_peaks[ph] for g in got]
        if len(v) == 3 and v[1] - v[0] != v[2] - v[1]:
            return None, f"the {ph} peak at {n} tiles is not affine in depth ({' / '.join(map(str, v))})"
        ext[ph] = v[-1] + k * (v[-1] - v[-2])
    top = max(ext, key=lambda p: (ext[p], str(p)))
    at = next((g for g in reversed(got) if g.phase == top), got[-1])
    return ExactPeak(ext[top], ext, top, at.node if at.phase == top else "-", got[-1].places, at.graph), ""
