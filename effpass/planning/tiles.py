"""Extrapolation over the tile count: a pass that unrolls a region once per tile of the sequence
(``tile_sequence``) makes a replay's cost grow with the length, but at a fixed tile its figures are affine in
the number of tiles. So a long length is replayed at a few short ones with the same tiles and extrapolated
(:func:`estimate_long`), checked affine as :mod:`effpass.planning.depth` checks depth.

How: every pass is pinned at the long length ``seq`` (:meth:`effpass.Pass.pin_length`: the tiles it cuts
there, ``t`` positions, the last one the rest, and any other choice it makes from the length, e.g. the loss's
chunk budget); the pinned pipeline is the same graph at ``seq`` and, at ``seq - k * t``, the same tiles ``k``
fewer: every tensor is either tile-sized (the same) or sequence-sized (``k * t`` positions shorter), so every
byte count at one place is affine in the tile count. Replayed at ``COUNTS`` tiles (three: affinity checked byte
for byte, every op's local peak too), the figures are extrapolated to the ``n`` tiles of ``seq``, the peak being
the largest extrapolated op peak; when they are not affine, ``seq`` itself is replayed and a note says so.
Screened (``screen=True``): the first two counts (and the first two depths), a provisional figure that
:func:`confirm_long` checks at the third count and depth.

The peak place by place: the short replays record every allocation's place (:mod:`effpass.planning.places`), each
affine in the tile count (and in the tile's index), and the peak at ``n`` tiles is the largest extrapolated place:
exact (``tile_exact``), where the peak's own extrapolation is only a lower bound. That bound: the step's live bytes
are a max over places, so the peak is convex in the count and its extension through the last two replayed counts
never exceeds it; two places can cross beyond the replayed counts and no check of the peak at three counts sees it
(a 2-block tiny Llama at 18 tiles: 4,544 B under the real replay; docs/memory_planner.md). Where the places do not
line up (a lowering other than eager: no tile tags in the code that runs; CUDA's modelled segments) the figure is
that bound, and ``plan_max_seq`` takes only "over the budget" from it and replays the length it answers.
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field

from .depth import AFFINE
from .places import recording_places
from .result import MemoryEstimate

__all__ = ["COUNTS", "MIN_TILES", "pin_pipeline", "combine_tiles", "estimate_long", "confirm_long", "batch_of"]

#: tile counts replayed for an extrapolation (three, so that affinity is checked, not assumed). NOTE(counts): not
#: 2, 3, 4: on Llama-3.1-8B QLoRA (2 blocks, tiles of 4,078 positions) the peak grows by 437,306,536 B from 2 to 3
#: tiles and 437,732,520 B per tile after, and the largest transient is a matmul's at 2 and 3 tiles, a cast's
#: (one per tile more) from 4 on: affine from 4 tiles
COUNTS = (4, 5, 6)

#: lengths of more tiles than this are extrapolated (fewer: the short replays would cost about as much)
MIN_TILES = 12


@dataclass
class TileReplays:
    """What a tile-extrapolated figure rests on: the pinned pipeline, its tile ``t`` (positions), the long
    length's ``n`` tiles, and the short replays (length -> estimate) at ``COUNTS`` tiles so far."""

    pipeline: list
    t: int
    n: int
    seq: int
    short: dict = field(default_factory=dict)

    def lengths(self, counts=COUNTS) -> list[int]:
        return [self.seq - (self.n - c) * self.t for c in counts]


def batch_of(inputs, seq: int) -> int | None:
    """Rows per position of a step's inputs at ``seq`` positions: the leading size of the first tensor whose last
    dimension is ``seq`` (``input_ids``), None when there is none."""
    import torch
    from torch.utils._pytree import tree_flatten

    for x in tree_flatten(inputs)[0]:
        if isinstance(x, torch.Tensor) and x.dim() >= 1 and x.shape[-1] == seq:
            return math.prod(x.shape[:-1]) or None
    return None


def pin_pipeline(pipeline, seq: int, batch: int):
    """``(pinned pipeline, t, n)`` of ``pipeline`` at ``seq`` positions: every pass pinned there, ``t`` the
    positions of the one tile unrolled per copy, ``n`` the tiles of ``seq``; None when no pass unrolls tiles
    there, or two passes unroll different tiles."""
    pinned, ts = [], set()
    for p in pipeline:
        q, t = p.pin_length(seq, batch)
        pinned.append(q)
        if t:
            ts.add(t)
    if len(ts) != 1:
        return None
    (t,) = ts
    return pinned, t, math.ceil(seq / t)


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


def _estimate(model, make_inputs, seq, pipelines, optimizer, *, screen, estimate=None, **kw) -> list:
    from .estimate import estimate_many

    return (estimate or estimate_many)(model, make_inputs(seq), pipelines, optimizer, screen=screen, **kw)


def _key(L, tr, optimizer):
    return (L, optimizer, tuple(repr(p) for p in tr.pipeline))  # passes are dataclasses: repr names every option


def _shared(shared, L, tr, optimizer, screen) -> bool:
    """``tr.short[L]`` from ``shared`` (short replays kept across long lengths: two lengths whose pinned
    pipelines are the same share their replays at the same short length); False when not there (or only
    screened, ``screen`` False)."""
    r = None if shared is None else shared.get(_key(L, tr, optimizer))
    if r is None or (not screen and getattr(r, "provisional", False)):
        return False
    tr.short[L] = r
    return True


def _share(shared, L, tr, optimizer, r) -> None:
    if shared is not None and not isinstance(r, BaseException):
        shared[_key(L, tr, optimizer)] = r


def estimate_long(model, make_inputs, seq: int, pipelines, optimizer, *, screen: bool, min_tiles: int | None = MIN_TILES,
                  log: list | None = None, estimate=None, shared: dict | None = None, **kw) -> list:
    """:func:`~effpass.planning.estimate.estimate_many` of ``pipelines`` at ``seq`` positions (inputs
    ``make_inputs(seq)``), those that unroll more than ``min_tiles`` tiles there extrapolated over the tile count
    (pipelines with the same tiles share each short replay; ``shared``: a dict that keeps them across calls).
    ``screen``: two depths and two tile counts (provisional; :func:`confirm_long` checks them). ``log``: gets one
    line per extrapolation or fallback."""
    out: list = [None] * len(pipelines)
    direct = list(range(len(pipelines)))
    batch = batch_of(make_inputs(seq), seq) if min_tiles is not None else None
    groups: dict = {}
    if batch:
        direct = []
        for i, p in enumerate(pipelines):
            pin = pin_pipeline(p, seq, batch)
            if pin is None or pin[2] <= max(min_tiles, COUNTS[-1]):
                direct.append(i)
            else:
                groups.setdefault(pin[1:], []).append((i, TileReplays(pin[0], pin[1], pin[2], seq)))
    for (t, n), members in groups.items():
        counts = COUNTS[:2] if screen else COUNTS
        for L in members[0][1].lengths(counts):
            todo = [tr for _, tr in members if not _shared(shared, L, tr, optimizer, screen)]
            with recording_places():
                res = _estimate(model, make_inputs, L, [tr.pipeline for tr in todo], optimizer, screen=screen,
                                estimate=estimate, **kw) if todo else []
            for tr, r in zip(todo, res):
                tr.short[L] = r
                _share(shared, L, tr, optimizer, r)
        for i, tr in members:
            out[i] = _combine(tr, counts, log)
            if out[i] is None:
                direct.append(i)
    if direct:
        tried = {i: tr for members in groups.values() for i, tr in members}
        res = _estimate(model, make_inputs, seq, [pipelines[i] for i in sorted(direct)], optimizer, screen=screen,
                        estimate=estimate, **kw)
        for i, r in zip(sorted(direct), res):
            out[i] = _fallback(r, tried[i]) if i in tried else r
    return out


def _combine(tr: TileReplays, counts, log) -> MemoryEstimate | BaseException | None:
    """The extrapolation of ``tr``'s short replays at ``counts`` tiles (an exception one of them raised is the
    long length's); None when not affine (``tr.why`` says why: the long length is then replayed)."""
    ests = [tr.short[L] for L in tr.lengths(counts)]
    bad = next((e for e in ests if isinstance(e, BaseException)), None)
    if bad is not None:
        tr.why = f"a short replay failed ({type(bad).__name__})"
        return None
    est, why = combine_tiles(ests, counts, tr.n)
    if est is None:
        tr.why = why
        if log is not None:
            log.append(f"{tr.seq:,} tokens: not extrapolated over the tile count ({why}); replayed at full length")
        return None
    est.tile_replays = tr
    if log is not None:
        tag = "left unchecked (below the peak, in another phase): "
        unchecked = next((x.partition(tag)[2] for x in est.notes if tag in x), "")
        moved = next((x for x in est.notes if x.startswith("the peak moves past")), "")
        log.append(f"{tr.seq:,} tokens ({tr.n} tiles of {tr.t}): extrapolated from replays at "
                   f"{', '.join(f'{L:,}' for L in tr.lengths(counts))} tokens ({', '.join(map(str, counts))} tiles)"
                   + (f"; {moved.split(';')[0]}" if moved else "")
                   + (f"; unchecked (not affine, another phase than the peak's): {unchecked}" if unchecked else ""))
    return est


def _fallback(r, tr: TileReplays):
    if isinstance(r, MemoryEstimate):
        r.notes = list(r.notes) + [f"replayed at full length: not affine in the tile count ({tr.why})"]
    return r


def confirm_long(model, make_inputs, seq: int, pipelines, estimates, optimizer, *, log: list | None = None,
                 estimate=None, confirm=None, shared: dict | None = None, **kw) -> list:
    """The provisional figures among ``estimates`` (of ``pipelines`` at ``seq``) checked: depth-screened ones at
    the third depth (:func:`~effpass.planning.estimate.confirm_many`), tile-extrapolated ones from their short
    replays confirmed at the third depth and a third tile count (not affine: ``seq`` replayed). Returns the
    figures :func:`estimate_long` gives without ``screen``."""
    from .estimate import confirm_many

    confirm_many = confirm or confirm_many
    out = list(estimates)
    ckw = {k: v for k, v in kw.items() if k != "extrapolate"}
    tiled = [i for i, e in enumerate(estimates) if getattr(e, "provisional", False) and getattr(e, "tile_replays", None)]
    depth = [i for i, e in enumerate(estimates) if getattr(e, "provisional", False) and i not in tiled]
    if depth:
        for i, r in zip(depth, confirm_many(model, make_inputs(seq), [pipelines[i] for i in depth],
                                            [estimates[i] for i in depth], optimizer, **ckw)):
            out[i] = r
    groups: dict = {}
    for i in tiled:
        tr = estimates[i].tile_replays
        groups.setdefault((tr.t, tr.n), []).append((i, tr))
    direct = []
    for members in groups.values():
        trs = [tr for _, tr in members]
        for L in trs[0].lengths(COUNTS):
            for tr in trs:
                _shared(shared, L, tr, optimizer, False)  # confirmed for another long length already
            have = [tr for tr in trs if L in tr.short and getattr(tr.short[L], "provisional", False)]
            if have:  # screened short replays: their third depth
                with recording_places():
                    got = confirm_many(model, make_inputs(L), [tr.pipeline for tr in have], [tr.short[L] for tr in have],
                                       optimizer, **ckw)
                for tr, r in zip(have, got):
                    tr.short[L] = r
                    _share(shared, L, tr, optimizer, r)
            new = [tr for tr in trs if L not in tr.short]
            if new:
                with recording_places():
                    got = _estimate(model, make_inputs, L, [tr.pipeline for tr in new], optimizer, screen=False,
                                    estimate=estimate, **kw)
                for tr, r in zip(new, got):
                    tr.short[L] = r
                    _share(shared, L, tr, optimizer, r)
        for i, tr in members:
            out[i] = _combine(tr, COUNTS, log)
            if out[i] is None:
                direct.append((i, tr))
    if direct:
        res = _estimate(model, make_inputs, seq, [pipelines[i] for i, _ in direct], optimizer, screen=False,
                        estimate=estimate, **kw)
        for (i, tr), r in zip(direct, res):
            out[i] = _fallback(r, tr)
    return out
