"""The arithmetic of the extrapolation over the tile count (:mod:`effpass.planning.tiles`): a long length's
figures from the estimates at a few tile counts of the same pinned pipeline (:func:`combine_tiles`), the peak place by
place where the places were recorded (:mod:`effpass.planning.places`: exact), else the peak's own extrapolation (a
lower bound, said in the notes)."""
from __future__ import annotations

import dataclasses
import re

from .depth import AFFINE
from .result import MemoryEstimate

__all__ = ["combine_tiles", "AT_PEAK"]


def _place(e: MemoryEstimate) -> tuple:
    return (e.peak_phase, e.peak_graph, re.sub(r"_\d+$", "", e.peak_node.split(" ")[0]), e.peak_node.partition(" ")[2])


def combine_tiles(ests: list, counts, n: int) -> tuple[MemoryEstimate | None, str]:
    """The estimate at ``n`` tiles from the estimates at ``counts`` tiles (the same pinned pipeline), and why
    not (None, reason) when they are not affine in the tile count: the peak at another place, a count whose
    second difference is not zero (byte for byte: ``AFFINE``, each phase's peak, the CUDA allocator's reserved
    bytes), or the trainable parameters not the same. Two estimates: the affine prediction, ``provisional``."""
    counts = tuple(counts)[:len(ests)]
    exact, exact_why = (None, "the places were not recorded")
    if any(getattr(e, "places", None) is not None or getattr(e, "depth_places", None) is not None for e in ests):
        from .places import exact_peak

        exact, exact_why = exact_peak(ests, counts, n)
    if exact is None and len({_place(e) for e in ests}) != 1:
        return None, "the peak is at another place: " + " / ".join(e.peak_node for e in ests)
    if len({repr((e.trainable_numels, e.trainable_shapes)) for e in ests}) != 1:
        return None, "the trainable parameters differ between the short replays"
    if len({tuple(sorted(e.phase_peaks)) for e in ests}) != 1:
        return None, "the phases differ between the short replays"
    b, c = ests[-2], ests[-1]
    reserved = [f for f in ("reserved_peak_bytes", "reserved_expandable_bytes")
                if all(getattr(e, f) is not None for e in ests)]
    get = {f: (lambda e, f=f: getattr(e, f)) for f in list(AFFINE) + reserved}
    get.update({("phase", p): (lambda e, p=p: e.phase_peaks[p]) for p in c.phase_peaks})
    if len(ests) == 3:
        a = ests[0]
        if counts[1] - counts[0] != counts[2] - counts[1]:
            raise ValueError(f"combine_tiles: counts {counts} are not evenly spaced")
        bad = [f for f, g in get.items() if g(b) - g(a) != g(c) - g(b)
               and (exact is None or not (f in AT_PEAK or isinstance(f, tuple)))]  # exact: the peak's own below
        if bad:
            f = bad[0]
            return None, (f"{f if isinstance(f, str) else 'the ' + f[1] + ' peak'} is not affine in the tile count "
                          f"({' / '.join(str(get[f](e)) for e in ests)} at {'/'.join(map(str, counts))} tiles)")
    if exact is not None:
        if (n - counts[-1]) % (counts[-1] - counts[-2]):
            raise ValueError(f"combine_tiles: {n} tiles is not reached from {counts}")
        return _exact(ests, counts, n, exact, get)
    # NOTE(crossing): the step's peak is the largest of every op's local peak (``op_peaks``), each affine in the
    # tile count, but another op's may grow faster and overtake the peak beyond the replayed counts (Llama-3.1-8B
    # QLoRA, 2 blocks, tiles of 4,078: at 4-6 tiles the peak is the MLP recompute's mul, at 54 tiles the attention
    # backward's, 464,252,360 B above the mul's extrapolation): every op's local peak is checked affine and
    # extrapolated, and the largest is the peak at ``n`` tiles
    ops = set(c.op_peaks)
    if not ops or any(set(e.op_peaks) != ops for e in ests):
        return None, "the ops that allocate differ between the short replays (or were not recorded)"
    bent = sorted(o for o in ops if len(ests) == 3
                  and b.op_peaks[o] - ests[0].op_peaks[o] != c.op_peaks[o] - b.op_peaks[o])
    k, d = n - counts[-1], counts[-1] - counts[-2]
    if k % d:
        raise ValueError(f"combine_tiles: {n} tiles is not reached from {counts} in steps of {d}")
    step = lambda g: g(c) + (k // d) * (g(c) - g(b))  # noqa: E731
    op_peaks = {o: step(lambda e, o=o: e.op_peaks[o]) for o in ops if o not in bent}
    top = max(op_peaks or {"-": 0}, key=lambda o: (op_peaks.get(o, 0), o))
    peak_phase = top.split(" ", 1)[0] if op_peaks.get(top, 0) > step(get["step_peak_bytes"]) else c.peak_phase
    if any(o.split(" ", 1)[0] == peak_phase for o in bent):
        o = next(o for o in bent if o.split(" ", 1)[0] == peak_phase)
        return None, (f"the local peak after {o} is not affine in the tile count "
                      f"({' / '.join(str(e.op_peaks[o]) for e in ests)} at {'/'.join(map(str, counts))} tiles)")
    # pass statistics (counts of tiles, rows, chunks): extrapolated where affine; one that is not (the loss's
    # chunk count) cannot be known from the short replays and is left out, named in the note
    stats, dropped = _stats(ests, counts, k // d)
    checked = len(ests) == 3 and not any(getattr(e, "provisional", False) for e in ests)
    note = (f"extrapolated over the tile count from replays at {', '.join(map(str, counts[:len(ests)]))} of {n} "
            f"tiles (every byte count affine in the tile count, "
            f"{'checked' if len(ests) == 3 else 'not yet checked at ' + str(counts[-1] + d) + ' tiles'}; the "
            f"peak node is named in the {counts[-1]}-tile replay; pass statistics extrapolated"
            + (f", those not affine left out: {', '.join(dropped)}" if dropped else "") + ")")
    if bent:
        # NOTE(other phases): every op of the peak's phase is affine (checked); in another phase an op's local peak
        # that is not (a max over places that cross: Llama-3.1-8B's forward norms at 4-6 tiles) is left out, and
        # that phase's own peak is extrapolated unchecked: said here, never silently
        note += (f"; not affine in the tile count, left unchecked (below the peak, in another phase): "
                 f"{', '.join(bent)}")
    out = dataclasses.replace(c, **{f: step(g) for f, g in get.items() if isinstance(f, str)},
                              phase_peaks={p: step(get[("phase", p)]) for p in c.phase_peaks}, pass_stats=stats,
                              op_peaks=op_peaks, provisional=not checked, notes=list(c.notes) + [note])
    if op_peaks.get(top, 0) > out.step_peak_bytes:
        # the peak moves to another op beyond the replayed counts: its local peak (affine, checked) is the step's
        # peak; the gradients live there are not known from these replays (the split that folding sharded
        # gradients reads): plan_max_seq extrapolates over tiles for one device only
        phase = top.split(" ", 1)[0]
        out.notes.append(f"the peak moves past {counts[-1]} tiles: at {n} tiles it is after {top.split(' ', 1)[1]} in "
                         f"the {phase} ({op_peaks[top]:,} B above the start, where {out.peak_node} reaches "
                         f"{out.step_peak_bytes:,} B); the gradients at the peak are those at {out.peak_node}")
        out.peak_bytes += op_peaks[top] - out.step_peak_bytes
        out.step_peak_bytes = op_peaks[top]
        out.peak_phase, out.peak_graph = phase, f"{phase} graph (extrapolated)"
        out.peak_node = f"{top.split(' ', 1)[1]} (extrapolated over the tile count)"
        out.phase_peaks[phase] = max(out.phase_peaks.get(phase, 0), op_peaks[top])
    out.tile_exact = False
    out.notes.insert(len(c.notes), f"the peak at {n} tiles is a lower bound (not place by place: {exact_why})")
    return out, ""


#: figures of the peak itself (and of what is live there): a max over places, exact from the places, not affine
AT_PEAK = ("peak_bytes", "step_peak_bytes", "gradients_at_peak", "non_gradient_peak", "gradients_at_non_gradient_peak",
           "largest_transient")


def _exact(ests, counts, n, exact, get) -> tuple[MemoryEstimate, str]:
    """The estimate at ``n`` tiles with the peak from the places (:mod:`effpass.planning.places`): every other
    count extrapolated (checked affine), the peak's figures exact; ``tile_exact`` set when the device's figure is
    the peak of live bytes (no modelled allocator segments, which are not extrapolated place by place)."""
    b, c = ests[-2], ests[-1]
    k = (n - counts[-1]) // (counts[-1] - counts[-2])
    step = lambda g: g(c) + k * (g(c) - g(b))  # noqa: E731
    checked = len(ests) == 3 and not any(getattr(e, "provisional", False) for e in ests)
    bent_peak = [f for f in AT_PEAK[2:] if len(ests) == 3 and get[f](b) - get[f](ests[0]) != get[f](c) - get[f](b)]
    out = dataclasses.replace(c, **{f: step(g) for f, g in get.items() if isinstance(f, str)},
                              phase_peaks=dict(exact.phase_peaks), op_peaks={}, provisional=not checked,
                              notes=list(c.notes))
    out.peak_bytes = out.start_bytes + exact.step_peak
    out.step_peak_bytes = exact.step_peak
    out.peak_phase = exact.phase
    out.peak_graph = "eager code" if exact.graph == "eager" else f"{exact.phase} graph {exact.graph}"
    out.peak_node = f"{exact.node} (place by place over the tile count)"
    out.pass_stats, dropped = _stats(ests, counts, k)
    out.tile_exact = out.reserved_peak_bytes is None and out.reserved_expandable_bytes is None
    if not out.tile_exact:
        out.notes.append("the CUDA allocator's reserved bytes (what the device must hold) extrapolated through the "
                         "counts, not place by place: not an exact figure (plan_max_seq replays the length it answers)")
    out.notes.append(
        f"the peak at {n} tiles place by place: the live bytes after each of the step's allocations (before, in and "
        f"after the tiles; {exact.places:,} places at {n} tiles) from replays at "
        f"{', '.join(map(str, counts))} tiles, each affine in the tile count and a middle tile's in its index "
        f"({'checked' if checked else 'not yet checked at a third count'}): exact, not a bound"
        + (f"; at the peak, extrapolated through the last two counts (not affine): {', '.join(bent_peak)}"
           if bent_peak else "")
        + (f"; pass statistics not affine, left out: {', '.join(dropped)}" if dropped else ""))
    return out, ""


def _stats(ests, counts, k) -> tuple[dict, list]:
    """Pass statistics at ``k`` count steps past the last: extrapolated where affine, the rest left out (named)."""
    c = ests[-1]
    stats, dropped = {}, []
    for name, st in c.pass_stats.items():
        stats[name] = {}
        for key, v in st.items():
            if not isinstance(v, int) or isinstance(v, bool):
                stats[name][key] = v
                continue
            vals = [e.pass_stats.get(name, {}).get(key) for e in ests]
            if any(not isinstance(x, int) for x in vals) or (len(vals) == 3 and vals[1] - vals[0] != vals[2] - vals[1]):
                dropped.append(f"{name}.{key}")
                continue
            stats[name][key] = v + k * (v - vals[-2])
    return stats, dropped
