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
from dataclasses import dataclass, field

from .places import recording_places
from .result import MemoryEstimate
from .tile_combine import combine_tiles

__all__ = ["COUNTS", "MIN_TILES", "pin_pipeline", "combine_tiles", "estimate_long", "confirm_long", "check_grid_early",
           "batch_of"]

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


def _estimate(model, make_inputs, seq, pipelines, optimizer, *, screen, estimate=None, **kw) -> list:
    from .estimate import estimate_many

    return (estimate or estimate_many)(model, make_inputs(seq), pipelines, optimizer, screen=screen, **kw)


def _estimate_lengths(model, make_inputs, todo, optimizer, *, estimate=None, **kw) -> list[list]:
    """Screened estimates of several short lengths, ``todo`` = [(length, pipelines)]: every length's depths replayed
    over the workers together (:func:`~effpass.planning.estimate.estimate_units`; the two lengths of a screen, 2
    and 3 blocks each: four replays at once, not two and two); one call per length with another ``estimate``."""
    from .estimate import estimate_many, estimate_units

    if estimate is not None and estimate is not estimate_many:
        return [_estimate(model, make_inputs, L, pipes, optimizer, screen=True, estimate=estimate, **kw)
                for L, pipes in todo]
    if not todo:
        return []
    return estimate_units(model, [(make_inputs(L), pipes) for L, pipes in todo], optimizer, screen=True, **kw)


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
                  log: list | None = None, estimate=None, confirm=None, shared: dict | None = None, **kw) -> list:
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
    unsure = []
    for (t, n), members in groups.items():
        # NOTE(screen first): without ``screen`` too, the first two counts at the first two depths, then the checks
        # (confirm_long's): the same figures as every count at every depth where those checks pass, at half the cost
        counts = COUNTS[:2]
        todo = [(L, [tr for _, tr in members if not _shared(shared, L, tr, optimizer, True)])
                for L in members[0][1].lengths(counts)]
        todo = [(L, trs) for L, trs in todo if trs]
        with recording_places():
            res = _estimate_lengths(model, make_inputs, [(L, [tr.pipeline for tr in trs]) for L, trs in todo],
                                    optimizer, estimate=estimate, **kw)
        for (L, trs), rs in zip(todo, res):
            for tr, r in zip(trs, rs):
                tr.short[L] = r
                _share(shared, L, tr, optimizer, r)
        for i, tr in members:
            said: list = []  # unscreened: only a refusal is said here (the confirmed figure says how it was had)
            out[i] = _combine(tr, counts, log if screen else said)
            if out[i] is None:
                direct.append(i)
                if log is not None:
                    log += said
            elif not screen and getattr(out[i], "provisional", False):
                unsure.append((i, tr, out[i]))
    if unsure:
        from .estimate import confirm_many

        for i, r in _confirm_members(model, make_inputs, seq, pipelines, unsure, optimizer, log=log, estimate=estimate,
                                     confirm=confirm or confirm_many, shared=shared, **kw).items():
            out[i] = r
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
    the third depth (:func:`~effpass.planning.estimate.confirm_many`), tile-extrapolated ones by two more replays
    (:func:`_check_grid`: the first depth at a third tile count, the third depth at the first; not affine: the
    whole grid of counts and depths, then ``seq`` itself). Returns the figures :func:`estimate_long` gives without
    ``screen``."""
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
    members = [(i, estimates[i].tile_replays, estimates[i]) for i in tiled]
    out_t = _confirm_members(model, make_inputs, seq, pipelines, members, optimizer, log=log, estimate=estimate,
                             confirm=confirm_many, shared=shared, **kw)
    for i, r in out_t.items():
        out[i] = r
    return out


def _confirm_members(model, make_inputs, seq, pipelines, members, optimizer, *, log, estimate, confirm, shared,
                     **kw) -> dict:
    """``{i: confirmed figure}`` for ``members`` ``(i, TileReplays, screened figure)``: the grid check where it
    applies (:func:`_check_grid`), else (or where it fails) every count at every depth, then ``seq`` itself."""
    ckw = {k: v for k, v in kw.items() if k != "extrapolate"}
    out: dict = {}
    ready = [m for m in members if _grid_ready(m[2], m[1])]
    if ready:
        got = _check_grid(model, make_inputs, [(tr, e) for _, tr, e in ready], optimizer, log=log, shared=shared,
                          **ckw)
        for (i, _, _), r in zip(ready, got):
            if r is not None:
                out[i] = r
    groups: dict = {}
    for i, tr, _ in members:
        if i not in out:
            groups.setdefault((tr.t, tr.n), []).append((i, tr))
    direct = []
    for members_ in groups.values():
        trs = [tr for _, tr in members_]
        for L in trs[0].lengths(COUNTS):
            for tr in trs:
                _shared(shared, L, tr, optimizer, False)  # confirmed for another long length already
            have = [tr for tr in trs if L in tr.short and getattr(tr.short[L], "provisional", False)]
            if have:  # screened short replays: their third depth
                with recording_places():
                    got = confirm(model, make_inputs(L), [tr.pipeline for tr in have], [tr.short[L] for tr in have],
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
        for i, tr in members_:
            out[i] = _combine(tr, COUNTS, log)
            if out[i] is None:
                direct.append((i, tr))
    if direct:
        res = _estimate(model, make_inputs, seq, [pipelines[i] for i, _ in direct], optimizer, screen=False,
                        estimate=estimate, **kw)
        for (i, tr), r in zip(direct, res):
            out[i] = _fallback(r, tr)
    return out


def _grid_ready(est, tr: TileReplays) -> bool:
    """The screened figure ``est`` can be checked on the grid: exact place by place, from short replays at the first
    two counts each predicted from the first two depths (with those depths' replays and places kept)."""
    if not getattr(est, "tile_exact", False):
        return False
    L4, L5 = tr.lengths(COUNTS[:2])
    for L in (L4, L5):
        e = tr.short.get(L)
        reps = getattr(e, "depth_replays", None)
        if e is None or not getattr(e, "provisional", False) or not reps or len(reps) != 2:
            return False
        if any(getattr(r, "places", None) is None for r in reps) or getattr(e, "depth_target", None) is None:
            return False
    return True


def _checks(tr: TileReplays) -> list:
    """The grid check's replays of ``tr``: (short length, depth)."""
    from .depth import DEPTHS

    L4, _L5, L6 = tr.lengths(COUNTS)
    return [(L4, DEPTHS[2]), (L6, DEPTHS[0])]


def _run_checks(model, make_inputs, trs, optimizer, *, shared, **kw) -> None:
    """The grid checks' replays of ``trs`` not yet in ``shared`` (exceptions too), all at once over the replay
    workers (:func:`~effpass.planning.estimate.replay_at_depths`), kept in ``shared``."""
    from .estimate import replay_at_depths

    units: dict = {}  # (L, depth) -> {pipeline key: TileReplays}
    for tr in trs:
        for L, d in _checks(tr):
            if _key(L, tr, optimizer) + (("depth", d),) not in shared:
                units.setdefault((L, d), {}).setdefault(_key(L, tr, optimizer), tr)
    if not units:
        return
    keys = list(units)
    with recording_places():
        got = replay_at_depths(model, [(make_inputs(L), [tr.pipeline for tr in units[(L, d)].values()], d)
                                       for L, d in keys], optimizer, **kw)
    for (L, d), res in zip(keys, got):
        for k, r in zip(units[(L, d)], res):
            shared[k + (("depth", d),)] = r


def check_grid_early(model, make_inputs, estimates, optimizer, *, shared: dict, **kw) -> None:
    """The grid checks (:func:`_check_grid`) that ``estimates`` (screened tile figures, possibly of several long
    lengths) will need, replayed now, all at once over the workers, into ``shared`` (where :func:`confirm_long`
    finds them): ``plan_max_seq`` confirms the answering pair's two lengths together this way."""
    trs = [e.tile_replays for e in estimates if getattr(e, "provisional", False)
           and getattr(e, "tile_replays", None) is not None and _grid_ready(e, e.tile_replays)]
    if trs:
        kw = {k: v for k, v in kw.items() if k != "extrapolate"}
        _run_checks(model, make_inputs, trs, optimizer, shared=shared, **kw)


def _check_grid(model, make_inputs, items, optimizer, *, log, shared, **kw) -> list:
    """Screened tile figures (each from the first two depths at the first two counts: four replays) checked by two
    more: the first depth at the third count and the third depth at the first count, all at once over the replay
    workers. Returns per item the checked figure (the screened one, no longer provisional) or None where a check
    fails (the caller then replays the whole grid of counts and depths).

    NOTE(grid): each figure of a stack of ``d`` blocks at ``c`` tiles is bilinear in ``(d, c)`` (each block adds its
    share of every tile), so the four screened replays determine it; the checks: at the first depth every place and
    every count affine over the three counts (place by place, as :func:`combine_tiles` checks them), and at the first
    count every count and each phase's peak affine over the three depths (as :func:`~effpass.planning.depth.
    combine_depths` checks them). A term that is not bilinear shows on one of the two lines unless it vanishes on
    both. Cost: the whole grid replays every count at every depth (Llama-3.1-8B QLoRA, 9 replays of 135 block-tiles
    for a length); this 6 of 73 block-tiles, the two checks at once."""
    from .depth import DEPTHS, combine_depths

    shared = {} if shared is None else shared
    _run_checks(model, make_inputs, [tr for tr, _ in items], optimizer, shared=shared, **kw)
    need = [{(L, d): shared.get(_key(L, tr, optimizer) + (("depth", d),)) for L, d in _checks(tr)} for tr, _ in items]
    out = []
    for (tr, est), want in zip(items, need):
        L4, L5, L6 = tr.lengths(COUNTS)
        r44, r26 = want[(L4, DEPTHS[2])], want[(L6, DEPTHS[0])]
        p4, p5 = tr.short[L4], tr.short[L5]
        (r24, r34), r25 = p4.depth_replays, p5.depth_replays[0]
        why = ""
        if isinstance(r44, BaseException) or isinstance(r26, BaseException):
            why = f"a check replay failed ({type(r44 if isinstance(r44, BaseException) else r26).__name__})"
        elif combine_depths([r24, r34, r44], p4.depth_target) is None:
            why = f"at {COUNTS[0]} tiles the counts are not affine in depth"
        else:
            same = set(r24.phase_peaks) == set(r34.phase_peaks) == set(r44.phase_peaks)
            bent = [ph for ph in r44.phase_peaks if not same
                    or r34.phase_peaks[ph] - r24.phase_peaks[ph] != r44.phase_peaks[ph] - r34.phase_peaks[ph]]
            if bent:
                why = f"at {COUNTS[0]} tiles the {bent[0]} peak is not affine in depth"
            else:
                chk, why = combine_tiles([r24, r25, r26], COUNTS, tr.n)
                if chk is not None and not chk.tile_exact:
                    why = "at the first depth the places do not line up over the three counts"
        if why:
            if log is not None:
                log.append(f"{tr.seq:,} tokens: the screened figure's grid check failed ({why}); every count "
                           f"replayed at every depth")
            out.append(None)
            continue
        r = dataclasses.replace(est, provisional=False, notes=[
            x.replace("not yet checked at a third count", "checked on the grid: below")
            for x in est.notes if not x.startswith("provisional:")])
        r.tile_replays, r.tile_exact = tr, True
        r.notes.append(f"checked on the grid of depths and tile counts: every place and count affine over {COUNTS} "
                       f"tiles at {DEPTHS[0]} blocks, every count and phase peak affine over {DEPTHS} blocks at "
                       f"{COUNTS[0]} tiles (the figure is bilinear in blocks and tiles: predicted from "
                       f"{DEPTHS[0]}-{DEPTHS[1]} blocks at {COUNTS[0]}-{COUNTS[1]} tiles)")
        if log is not None:
            log.append(f"{tr.seq:,} tokens ({tr.n} tiles of {tr.t}): checked at {L6:,} tokens ({COUNTS[2]} tiles, "
                       f"{DEPTHS[0]} blocks) and {L4:,} tokens ({COUNTS[0]} tiles, {DEPTHS[2]} blocks)")
        out.append(r)
    return out
