"""The longest sequence that fits a memory budget, and the plan that fits it (:func:`plan_max_seq`): candidates
in a neighbourhood of the leanest plan, probe replays fitted and solved for the budget to choose where to
look, then a search (secant steps, then bisection) replaying the candidates still in the running at each
length (a later tier only where no earlier one fits), the answering pair confirmed at full depth when the
figures were screened from two depths."""
from __future__ import annotations

from typing import Any, Iterable

import torch

from effpass.memory_options import replayed_optimizer

from .bounds import LowerBound, bound_note, gradient_only_bound, is_gradient_only_extension, probe_skip
from .candidates import Candidate, MemoryBudgetError, MemoryPlan, pipeline_with, search_candidates, tiers
from .estimate import confirm_many, estimate_many, with_optimizer
from .maxseq_result import MaxSeqResult
from .result import format_bytes
from .setup import PlanSetup, prepare
from .tiles import MIN_TILES, check_grid_early, confirm_long, estimate_long

__all__ = ["plan_max_seq", "MaxSeqResult", "PROBES"]

#: default probe lengths. NOTE(two short probes): the fits only choose where the search starts; with fused attention,
#: tiles and checkpointing every plan's peak is affine in the length (Llama-3.1-8B QLoRA, tiles of 4,096: 353,100 B
#: per token from 8,192 to 12,288 tokens, from 12,288 to 16,384 and from 16,384 to 32,768), so two short
#: probes give the same first length as three longer ones (221,184 tokens at 80 GiB) at 25 of their 70 block-tiles
#: per plan; where a peak grows faster (attention scores materialised) the search's secant steps correct the linear
#: guess, and a third probe (``probes=(a, b, c)``) fits a quadratic
PROBES = (8192, 12288)


def _fit(points: list[tuple[int, int]]):
    """peak(seq) through the probe points: quadratic through three (attention scores grow with seq^2), linear
    through two; returns a function."""
    (x1, y1), (x2, y2) = points[-2], points[-1]
    b_lin = (y2 - y1) / (x2 - x1)
    if len(points) >= 3:
        (x0, y0) = points[-3]
        d1 = (y1 - y0) / (x1 - x0)
        c = (b_lin - d1) / (x2 - x0)
        if c > 0:
            return lambda s: y2 + b_lin * (s - x2) + c * (s - x2) * (s - x1)
    return lambda s: y2 + b_lin * (s - x2)


def _solve(f, budget: int, step: int, lo: int, hi: int) -> int:
    """The largest multiple of ``step`` in [lo, hi] with f(s) <= budget (f increasing; bisection on f); 0 when
    even ``lo`` does not fit."""
    if f(lo) > budget:
        return 0
    a, b = lo // step, hi // step
    if f(b * step) <= budget:
        return b * step
    while b - a > 1:
        m = (a + b) // 2
        a, b = (m, b) if f(m * step) <= budget else (a, m)
    return a * step


def plan_max_seq(model: torch.nn.Module, make_inputs, memory_budget, allow: Iterable[str] = (), passes=None,
                 optimizer: str | None = "adamw", world_size: int = 1, *, step: int = 1024,
                 probes: tuple = PROBES, max_len: int = 1 << 24, min_len: int | None = None,
                 device=None, loss_fn=None, max_replays: int = 12, screen: bool = True,
                 cache: dict | None = None, host_budget=None, allocator: str = "default",
                 min_tiles: int | None = MIN_TILES, **compile_options) -> MaxSeqResult:
    """The longest sequence (a multiple of ``step``) whose predicted training-step peak fits ``memory_budget``,
    and the plan that fits it. ``make_inputs(seq)`` builds the step's inputs at a sequence length.

    1. Candidates: the registry's usable options (lossless always; lossy ones named in ``allow``), in a
       neighbourhood of the plan with every group's leanest option (that plan, the same without each group,
       and with each other option of a group; conflicting passes never combined).
    2. Every candidate is replayed at the ``probes`` lengths (one shared replay per length); its peak is fitted
       as a function of the length (quadratic through three probes when the peak grows faster than linearly,
       as with attention scores materialised; else linear: fused attention, tiles, checkpointing) and solved
       for the budget. The fits only say where to search: the longest fitted length is the first one tried.
    3. Search (secant steps on the smallest peak among the candidates, then bisection, at most ``max_replays``
       lengths): at each length the candidates still in the running are replayed tier by tier (lossless
       unrestricted, lossless restricted, lossy; one shared replay per tier), the later tiers only when no
       plan of an earlier tier fits there (none of theirs could be chosen there); a candidate over the budget
       at a length no longer than one some candidate fits is out of the running. A candidate adding only
       gradient-only options (``MemoryOption.changes == ("gradients",)``: step_in_backward) to a plan replayed
       there is not replayed where that plan's figures less its gradients, a lower bound of its own peak, are over
       the budget (:mod:`effpass.planning.bounds`; at ``L + step`` taken again from the confirmed figures).
       It ends when a length ``L`` that some candidate fits and ``L + step`` that none in the running fits
       are both replayed. The plan: among those fitting ``L``, lossless before lossy, unrestricted before
       restricted, then the fewest FLOPs and options. Guarantee: that pair, by the planner's own replays;
       the peak is not proved monotonic in the length (candidates out of the running are not replayed at
       ``L + step``).

    ``screen`` (models replayed by depth extrapolation): the probes and the search use figures predicted from
    two depths (``estimate_many(screen=True)``, provisional); the answer's pair is then confirmed at the third
    depth (every candidate fitting ``L`` and every one replayed at ``L + step``, :func:`confirm_many`). When a
    confirmed figure changes the verdict, the search is run again without screening (the cached replays
    confirmed as they are used), so the answer is always guaranteed by full-depth figures.

    Raises :class:`MemoryBudgetError` when even ``min_len`` (default ``step``) fits no candidate; it names the
    smallest peak among all of them there (every candidate is replayed at ``min_len``: the same for any budget).
    ``cache``: a dict shared by calls for several budgets of the same model, inputs and options (the probe
    replays do not depend on the budget). ``host_budget``: as :func:`~effpass.planning.plan_memory`'s (a plan over
    it at a length is out of the running there: host bytes grow with the length); ``allocator``: as
    ``plan_memory``'s (``"expandable"``: the reserved bytes with expandable segments).

    ``min_tiles`` (default ``tiles.MIN_TILES``, 12; None: off, and never with ``world_size > 1``): at a length where a
    plan's pipeline unrolls more tiles than this (``tile_sequence``), the search uses figures extrapolated over the
    tile count from replays at 4, 5 and 6 tiles of the same size (:mod:`effpass.planning.tiles`; short replays
    shared between lengths whose pinned pipelines are the same). The short replays record every allocation's
    place, and the peak is extrapolated place by place (:mod:`effpass.planning.places`): exact (``tile_exact``),
    used as a replay's figure. Where the places do not line up (a lowering other than eager, the CUDA allocator's
    segments) the figure is the peak's own extrapolation, a lower bound of the replay's (each place's live bytes
    affine in the tile count: the peak, a max over places, is convex in it; a 2-block tiny Llama at 18 tiles: 4,544
    B under), so only a verdict "over the budget" is taken from it: each plan fitting ``L`` by such a figure is
    replayed at full length (``L`` itself, every depth), and its figures are the answer's. When that replay is
    over the budget the search runs again without extrapolation (a note says so). ``next_peak`` may stay an
    extrapolated lower bound (``next_peak_bound``, said in the summary).
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step must be a positive number of tokens, got {step!r}")
    probes = tuple(sorted(set(int(p) for p in probes)))
    if len(probes) < 2 or probes[0] < 1:
        raise ValueError(f"probes must be at least two positive lengths, got {probes!r}")
    setup = prepare(model, memory_budget, allow, passes, optimizer, world_size, device=device, answer="sequence",
                    host_budget=host_budget, allocator=allocator)
    search = _MaxSeqSearch(setup, make_inputs, step=step, probes=probes, max_len=max_len,
                           min_len=step if min_len is None else int(min_len), loss_fn=loss_fn,
                           max_replays=max_replays, cache={} if cache is None else cache,
                           compile_options=compile_options,
                           # NOTE(one device): a peak that moves beyond the short replays is known by its bytes,
                           # not by the gradients live there (what folding sharded gradients reads)
                           min_tiles=min_tiles if setup.world_size == 1 else None)
    if min_tiles is not None and setup.world_size > 1:
        search.tile_log.append(f"min_tiles={min_tiles} not used: extrapolation over the tile count is for one rank "
                               f"(world_size={setup.world_size}); every length replayed")
    return search.run(screen)


def _error_text(e) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"


class _MaxSeqSearch:
    """The state of :func:`plan_max_seq`'s search; :meth:`run` answers (again without screening when a confirmed
    figure changes the screened verdict, on the same cache)."""

    def __init__(self, setup: PlanSetup, make_inputs, *, step, probes, max_len, min_len, loss_fn, max_replays, cache,
                 compile_options, min_tiles=None):
        self.setup, self.make_inputs = setup, make_inputs
        self.step, self.probes, self.max_len, self.min_len = step, probes, max_len, min_len
        self.loss_fn, self.max_replays, self.cache = loss_fn, max_replays, cache
        self.compile_options = compile_options
        self.min_tiles, self.tile_log = min_tiles, []  # extrapolation over the tile count (planning/tiles.py)
        self.shared: dict = {}  # short replays of the tile extrapolation, kept across long lengths
        self.bound_log: dict = {}  # (plan, length) -> why it was not replayed there: over the budget by a bound
        self.allow_bounds = self.bounds_on = True  # (one device: a sharding fold moves the gradients)
        # the forward and backward are replayed with AdamW (or none); another optimizer is built alone on fake
        # parameters of the trainable shapes (with_optimizer), which cannot model a step inside the backward
        self.replay_opt = setup.optimizer if setup.optimizer in ("adamw", None) else "adamw"

    def twin(self, c: Candidate) -> Candidate:
        """The candidate whose replay ``c``'s figures come from: ``c`` itself when the replay runs its optimizer,
        else ``c`` with the replayed optimizer (``c``'s built alone on fake parameters, :meth:`finish`)."""
        if c.optimizer == self.replay_opt or replayed_optimizer(c.optimizer):
            return c
        return c.without_optimizer_option(self.replay_opt)

    def finish(self, c: Candidate, est):
        """A replay's estimate as ``c``'s: its optimizer, then sharding folded."""
        if self.twin(c) is not c:
            est = with_optimizer(est, c.optimizer, device=self.setup.device)
        return self.setup.fold(c, est)

    def replay_many(self, cs, seq, full: bool):
        """Estimates (or exceptions) of the candidates ``cs`` at ``seq``: one shared replay (``full``: every
        provisional figure among them confirmed at the third depth)."""
        setup, cache = self.setup, self.cache
        twins = [self.twin(c) for c in cs]
        keys = list(dict.fromkeys(t.replay_key() for t in twins))
        by_key = {t.replay_key(): t for t in twins}
        todo = [k for k in keys if (seq, k) not in cache or (  # an extrapolated figure, the extrapolation now off
            self.min_tiles is None and getattr(cache[(seq, k)], "tile_replays", None) is not None)]
        for opt in dict.fromkeys(by_key[k].optimizer for k in todo):  # one shared replay per replayed optimizer
            part = [k for k in todo if by_key[k].optimizer == opt]
            res = estimate_long(setup.model, self.make_inputs, seq, [setup.pipeline_of(by_key[k]) for k in part],
                                opt, screen=not full, min_tiles=self.min_tiles, log=self.tile_log,
                                shared=self.shared, estimate=estimate_many, device=setup.device, loss_fn=self.loss_fn,
                                **self.compile_options)
            cache.update({(seq, k): r for k, r in zip(part, res)})
        unsure = [k for k in keys if full and getattr(cache[(seq, k)], "provisional", False)]
        for opt in dict.fromkeys(by_key[k].optimizer for k in unsure):
            part = [k for k in unsure if by_key[k].optimizer == opt]
            res = confirm_long(setup.model, self.make_inputs, seq, [setup.pipeline_of(by_key[k]) for k in part],
                               [cache[(seq, k)] for k in part], opt, log=self.tile_log, shared=self.shared,
                               device=setup.device,
                               loss_fn=self.loss_fn, estimate=estimate_many, confirm=confirm_many,
                               **self.compile_options)
            cache.update({(seq, k): r for k, r in zip(part, res)})
        got = {k: cache[(seq, k)] for k in keys}
        out = []
        for c, t in zip(cs, twins):
            r = got[t.replay_key()]
            if not isinstance(r, BaseException):
                try:
                    r = self.finish(c, r)
                except Exception as e:  # pragma: no cover
                    r = e
            out.append(r)
        return out

    def run(self, screen: bool) -> MaxSeqResult:
        try:
            return self._run(screen)
        except _BoundBroken as e:  # NOTE(self-check): a bound above a replayed peak: every verdict again, replayed
            self.allow_bounds = False
            self.tile_log.append(str(e))
            return self._run(screen)

    def _run(self, screen: bool) -> MaxSeqResult:
        setup, budget, step, probes = self.setup, self.setup.budget, self.step, self.probes
        max_len, min_len = self.max_len, self.min_len
        notes = list(setup.notes)
        cands = self.cands = search_candidates(setup, self.replay_opt)
        self.bounds_on, self.bound_log = self.allow_bounds and setup.world_size == 1, {}

        # 1-2: probe (a plan over a probed one by gradient-only options when its probes matter, planning/bounds.py),
        # fit, solve
        later = [c for c in cands if setup.world_size == 1 and any(is_gradient_only_extension(c, b) for b in cands)]
        peaks: dict[int, dict] = {s: {} for s in probes}
        first = [c for c in cands if c not in later]
        for s in probes:
            peaks[s].update(zip(map(id, first), self.replay_many(first, s, full=not screen)))
        probed = [(b, {s: peaks[s][id(b)] for s in probes}) for b in first]
        skip = {id(c): why for c in later if (why := probe_skip(c, probed, step))}
        rest = [c for c in later if id(c) not in skip]
        for s in probes if rest else ():
            peaks[s].update(zip(map(id, rest), self.replay_many(rest, s, full=not screen)))
            self._check_bounds(s, peaks[s])
        fits = []
        fit_fn: dict = {}
        for c in cands:
            if id(c) in skip:
                fits.append((c, None, [skip[id(c)]]))
                continue
            pts = [(s, peaks[s][id(c)].device_peak_bytes) for s in probes
                   if not isinstance(peaks[s][id(c)], BaseException)]
            errs = [peaks[s][id(c)] for s in probes if isinstance(peaks[s][id(c)], BaseException)]
            if len(pts) < 2:
                c.error = _error_text(errs[0])
                fits.append((c, None, [c.error]))
                continue
            f = _fit(pts)
            fit_fn[id(c)] = f
            fits.append((c, _solve(f, budget, step, min_len, max_len), [p for _, p in pts]))
        ok = [(c, L, pk) for c, L, pk in fits if L is not None]
        if not ok:
            errors = "; ".join(f"{c.name}: {c.error}" for c, _, _ in fits[:3])
            raise RuntimeError(f"plan_max_seq: no plan could be replayed ({errors})")
        # 3: search, replaying every candidate still in the running at each length (one shared replay per tier, or
        # over by a bound). NOTE(every candidate): a fit can be far off beyond the probes (Llama-3.1-8B, 80 GiB: as
        # given fitted 126,976 tokens, fits 71,680). Over the budget at a length <= one that fits: out of the running.
        live = [c for c, _, _ in ok] + [c for c in cands if id(c) in skip]
        fitted = {id(c): L for c, L, _ in ok}
        known: dict[int, dict[int, Any]] = {   # seq -> id(candidate) -> estimate (the probes' replays to start)
            p: {id(c): peaks[p][id(c)] for c in cands if id(c) in fitted
                and not isinstance(peaks[p][id(c)], BaseException)} for p in probes}
        over_at = {id(c): min(p for p in probes if id(c) in known[p] and known[p][id(c)].device_peak_bytes > budget)
                   for c in live if any(id(c) in known[p] and known[p][id(c)].device_peak_bytes > budget for p in probes)}
        replays: list = []
        lo = hi = None  # lo: some candidate fits; hi: none in the running fits (multiples of step)

        def at(s):
            """The smallest predicted peak among the candidates in the running replayed at ``s`` (replaying
            those not yet replayed there, tier by tier), and that candidate.

            NOTE(tiers): the plan is chosen lossless before lossy, unrestricted before restricted, so once a
            plan of a tier fits ``s`` no plan of a later tier can be chosen at ``s``: the later tiers are not
            replayed there (they stay in the running and are replayed at every longer length searched, ``L +
            step`` included, so the bracket is unchanged). Llama-3.1-8B QLoRA: step_in_backward (restricted, its
            own capture) is no longer replayed at the answer, one long replay in four."""
            got = known.setdefault(s, {})
            for tier in tiers(live):
                todo = [c for c in tier if id(c) not in got and not self._bounded(c, s, got, live, over_at)]
                if todo:
                    for c, r in zip(todo, self.replay_many(todo, s, full=not screen)):
                        if isinstance(r, BaseException):
                            c.error = f"{_error_text(r)} (at {s:,} tokens)"
                            live.remove(c)
                            continue
                        got[id(c)] = r
                        if r.device_peak_bytes > budget:
                            over_at[id(c)] = min(over_at.get(id(c), s), s)
                self._check_bounds(s, got)
                if any(id(c) in got and got[id(c)].device_peak_bytes <= budget for c in tier):
                    break
            here = [(got[id(c)].device_peak_bytes, i, c) for i, c in enumerate(live)
                    if id(c) in got and not isinstance(got[id(c)], LowerBound)]
            if not here:
                raise RuntimeError(f"plan_max_seq: no plan could be replayed at {s:,} tokens "
                                   f"({'; '.join(f'{c.name}: {c.error}' for c, _, _ in fits if c.error)[:400]})")
            peak, _, c = min(here, key=lambda t: (t[0], t[1]))
            replays.append((s, peak, peak <= budget))
            return peak, c

        s = max(min_len, max(fitted.values()))
        for _ in range(self.max_replays):
            peak, best_c = at(s)
            if peak <= budget:
                lo = s if lo is None else max(lo, s)
                live[:] = [c for c in live if over_at.get(id(c), lo + 1) > lo]
            else:
                hi = s if hi is None else min(hi, s)
            if lo is not None and (hi == lo + step or lo + step > max_len):
                break
            if hi is not None and hi <= min_len:
                break
            nxt = self._next_length(s, peak, best_c, lo, hi, known, live, fit_fn)
            if any(r[0] == nxt for r in replays):  # searched there already
                break
            s = nxt

        if lo is None:  # NOTE(smallest): the error names the smallest peak of all: no plan skipped by a bound
            self.bounds_on = False
            known[min_len] = {k: v for k, v in known.get(min_len, {}).items() if not isinstance(v, LowerBound)}
            peak, best_c = at(min_len)
            if peak > budget and screen:
                return self.run(screen=False)  # the error names a confirmed figure
            if peak > budget:
                # NOTE(budget-independent): every candidate is replayed at min_len (none is out of the running
                # before some length fits), so the smallest peak named is the smallest any plan reaches there
                raise MemoryBudgetError(
                    f"nothing fits memory_budget {format_bytes(budget)} even at {min_len:,} tokens: the leanest plan "
                    f"({best_c.name}) needs {format_bytes(peak)} ({peak} bytes) there",
                    smallest=peak, plan=best_c, candidates=[c for c, _, _ in fits])
            lo = min_len
        if hi != lo + step and lo + step <= max_len:
            notes.append(f"search not converged in {self.max_replays} replays: {lo:,} fits; {lo + step:,} not "
                         f"replayed")
        if (screen or self.min_tiles is not None) and not self._confirm_pair(lo, live, known, replays):
            # a confirmed figure changed the verdict: the search again without screening (or, the replay at full
            # length over the budget, without extrapolating over the tile count), on the same replays
            if not screen and not self._tiles_off:
                # NOTE(termination): unscreened figures whose verdict still cannot be confirmed: every length
                # replayed (that run confirms nothing, so the search ends)
                self.min_tiles = None
                self.tile_log.append("the answering pair not confirmed: searched again with every length replayed")
            return self.run(screen=screen and self._tiles_off)
        return self._answer(lo, live, known, replays, cands, ok, fits, notes)

    def _next_length(self, s, peak, best_c, lo, hi, known, live, fit_fn) -> int:
        """The next length to replay: a secant step through the two nearest lengths' smallest peaks, kept inside
        the bracket (else bisection)."""
        budget, step, min_len, max_len = self.setup.budget, self.step, self.min_len, self.max_len
        real = {k: [v[id(c)] for c in live if id(c) in v and not isinstance(v[id(c)], LowerBound)]
                for k, v in known.items()}
        pts = sorted((k, min(e.device_peak_bytes for e in v)) for k, v in real.items() if v)
        slope = None
        if len(pts) >= 2:
            near = sorted(pts, key=lambda p: abs(p[0] - s))[:2]
            slope = (near[0][1] - near[1][1]) / (near[0][0] - near[1][0])
        if slope is None or slope <= 0:  # the fit's slope at s, of the plan with the smallest peak there
            f = fit_fn.get(id(best_c))
            slope = max((f(s + step) - f(s)) / step, 1e-9) if f else 1e-9
        nxt = int((s + (budget - peak) / slope) // step * step)
        nxt = max(nxt, s + step) if peak <= budget else min(nxt, s - step)
        a = lo if lo is not None else min_len - step
        b = hi if hi is not None else max_len + step
        if not (a < nxt < b):
            nxt = ((a + b) // 2) // step * step
            if not (a < nxt < b):
                nxt = a + step if peak <= budget else b - step
        return min(max(nxt, min_len), max_len)

    def _bounded(self, c, s, got, bases, over_at) -> bool:
        """``c`` over the budget at ``s`` by a bound from one of ``bases`` replayed there (planning/bounds.py), put
        in ``got`` in place of a replay."""
        b = gradient_only_bound(c, [(x, got[id(x)]) for x in bases if id(x) in got]) if self.bounds_on else None
        if b is None or b.device_peak_bytes <= self.setup.budget:
            return False
        got[id(c)], over_at[id(c)] = b, min(over_at.get(id(c), s), s)
        self.bound_log[(c.name, s)] = bound_note(c, s, b, self.setup.budget)
        return True

    def _check_bounds(self, s, got) -> None:
        """Raise :class:`_BoundBroken` where a plan replayed at ``s`` peaks below its bound from another replayed
        there (the premise of planning/bounds.py broken: the search is run again without bounds)."""
        real = [(x, got[id(x)]) for x in self.cands if id(x) in got]
        for c, e in real if self.bounds_on else ():
            b = None if isinstance(e, (BaseException, LowerBound)) else gradient_only_bound(c, real)
            if b is not None and b.device_peak_bytes > e.device_peak_bytes:
                raise _BoundBroken(f"{c.name} replayed at {s:,} tokens peaks at {e.device_peak_bytes:,} B, below its "
                                   f"bound {b.device_peak_bytes:,} B from {b.base}: searched again without bounds")

    def _confirm_pair(self, lo, live, known, replays) -> bool:
        """NOTE(screen): the pair that answers is confirmed at full depth (the third depth checks that every count
        is affine in the number of blocks, else the whole model is replayed): each plan fitting ``lo`` and each
        plan replayed at ``lo + step``. False when a confirmed figure changes the verdict (or cannot be had)."""
        budget, step = self.setup.budget, self.step
        pair = [(lo, [c for c in live if id(c) in known[lo] and known[lo][id(c)].device_peak_bytes <= budget])]
        if lo + step <= self.max_len:
            pair.append((lo + step, [c for c in live if id(c) in known.get(lo + step, {})]))
        self._tiles_off = False
        self._check_early(pair)
        for s_, cs_ in pair:
            held = [c for c in cs_ if isinstance(known[s_][id(c)], LowerBound)]  # over by a bound: not replayed
            cs_ = [c for c in cs_ if c not in held]
            if not cs_ and not held:
                continue
            # NOTE(lower bound): a figure extrapolated over the tile count is a lower bound (convex peak): "over" at
            # lo + step stands; "fits" at lo is replayed at full length (this length, every depth)
            real = s_ == lo and any(_bound(known[s_][id(c)]) for c in cs_)
            min_tiles, self.min_tiles = self.min_tiles, None if real else self.min_tiles
            try:
                got = self.replay_many(cs_, s_, full=True) if cs_ else []
            finally:
                self.min_tiles = min_tiles
            if real and (any(isinstance(r, BaseException) for r in got)
                         or all(r.device_peak_bytes > budget for r in got)):
                self.min_tiles, self._tiles_off = None, True
                self.tile_log.append(f"{s_:,} tokens fit by the extrapolation over the tile count but not replayed at "
                                     f"full length: searched again without the extrapolation")
                return False
            if real:
                self.tile_log.append(f"{s_:,} tokens (the answer): replayed at full length, not extrapolated")
            for c, r in zip(cs_, got):
                if isinstance(r, BaseException):
                    return False
                known[s_][id(c)] = r
            self._check_bounds(s_, known[s_])
            for c in held:  # bounded again by the plans just confirmed here (held too: their bases), else replayed
                del known[s_][id(c)]
                if not self._bounded(c, s_, known[s_], cs_, {}):
                    r = self.replay_many([c], s_, full=True)[0]
                    if isinstance(r, BaseException):
                        return False
                    known[s_][id(c)] = r
                    cs_.append(c)
            peak_ = min((known[s_][id(c)].device_peak_bytes for c in cs_), default=None)
            replays[:] = [(x, peak_, peak_ <= budget) if x == s_ and cs_ else (x, p, f) for x, p, f in replays]
        return not (not any(known[lo][id(c)].device_peak_bytes <= budget for c in pair[0][1]) or (
            len(pair) > 1 and any(known[lo + step][id(c)].device_peak_bytes <= budget for c in pair[1][1])))

    def _check_early(self, pair) -> None:
        """The grid checks of the pair's screened tile figures (:func:`~effpass.planning.tiles.check_grid_early`),
        both lengths at once over the replay workers (confirmed one length after the other, the second length's
        checks would wait for the first's: Llama-3.1-8B QLoRA, 2 then 4 replays on 2 workers)."""
        if self.min_tiles is None:
            return
        by_opt: dict = {}
        for s_, cs_ in pair:
            for c in cs_:
                t = self.twin(c)
                est = self.cache.get((s_, t.replay_key()))
                if est is not None and not isinstance(est, BaseException):
                    by_opt.setdefault(t.optimizer, []).append(est)
        for opt, ests in by_opt.items():
            check_grid_early(self.setup.model, self.make_inputs, ests, opt, shared=self.shared,
                             device=self.setup.device, loss_fn=self.loss_fn, **self.compile_options)

    def _answer(self, lo, live, known, replays, cands, ok, fits, notes) -> MaxSeqResult:
        """The plan: among those fitting the longest length, lossless before lossy, unrestricted before
        restricted, then the fewest FLOPs and options."""
        setup, budget, step, probes = self.setup, self.setup.budget, self.step, self.probes
        at_lo = [c for c in live if id(c) in known[lo] and known[lo][id(c)].device_peak_bytes <= budget]
        chosen = min(at_lo, key=lambda c: (c.lossy, c.restricted, bool(known[lo][id(c)].host_bytes),
                                           known[lo][id(c)].flops, len(c.options)))
        if chosen.lossy and any(not c.lossy for c, _, _ in ok):
            notes.append(f"a lossy plan fits a longer sequence than every lossless one ({lo:,} tokens)")
        est = known[lo][id(chosen)]
        chosen.estimate, chosen.fits = est, True
        nxt_est = known.get(lo + step, {}).get(id(chosen))
        others = known.get(lo + step, {})
        reason = (f"the longest sequence any of {len(cands)} plans fits ({len(probes)} probe replays each to guess "
                  f"it; the plans still in the running replayed at each length searched, a later tier only where no "
                  f"earlier one fits: {len({s for s, *_ in replays})} lengths)")
        done = [e for e in others.values() if not isinstance(e, LowerBound)]  # the rest: over by a bound
        if done and lo + step <= self.max_len:
            notes.append(f"at {lo + step:,} tokens none of the {len(others)} plans there fits ({len(done)} replayed, "
                         f"smallest {format_bytes(min(e.device_peak_bytes for e in done))})")
        if chosen.restricted:
            notes.append("; ".join(f"{o.name}: {o.restricts}" for o in chosen.options if o.restricts))
        for o in chosen.options:
            if o.optimizer:
                notes.append(f"build the optimizer as {o.optimizer!r} for this plan ({o.cost})")
        notes += list(dict.fromkeys(self.tile_log)) + list(self.bound_log.values())
        plan = MemoryPlan(budget=budget, chosen=chosen, candidates=[chosen], passes=pipeline_with(setup.base, chosen),
                          optimizer=chosen.optimizer, world_size=setup.world_size, reason=reason, notes=[])
        fit_rows = [(c.name, c.lossy, c.restricted, L, pk) for c, L, pk in fits]
        return MaxSeqResult(seq=lo, step=step, budget=budget, plan=plan,
                            next_peak=nxt_est.device_peak_bytes if nxt_est is not None else None,
                            next_peak_bound=isinstance(nxt_est, LowerBound) or _bound(nxt_est), fits=fit_rows,
                            probes=probes, replays=replays, notes=notes)


class _BoundBroken(Exception):
    """A plan's replayed peak below its bound (planning/bounds.py): the search runs again without bounds."""


def _bound(est) -> bool:
    """A figure extrapolated over the tile count that is only a lower bound (not place by place: planning/places.py)."""
    return getattr(est, "tile_replays", None) is not None and not getattr(est, "tile_exact", False)
