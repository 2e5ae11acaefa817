"""The candidate search of :func:`~effpass.planning.plan_memory` (:func:`search`): tiers tried in order, every
candidate of a tier replayed (shared replays, :func:`~effpass.planning.estimate_many`), pruned by the bytes live
at its step's start, screened from two depths and confirmed at the third where the answer rests on it.

Tiers: lossless plans without a restriction on the training loop, lossless plans with one, lossy plans (only
the techniques named in ``allow``). Among the plans of a tier whose predicted peak fits the budget, the one
with the least extra compute (FLOPs counted during the replay, minus the plan as given's) wins, ties going to
unsharded plans and then to the smaller peak. The next tier is tried only when nothing in the previous one
fits. If nothing fits, the smallest achievable peak is found among every candidate (pruned ones replayed
after all where they could be smaller).
"""
from __future__ import annotations

from effpass.memory_options import replayed_optimizer

from .candidates import Candidate
from .host_memory import HostBudgetError
from .estimate import confirm_many, estimate_many, estimate_memory, start_bytes_many, with_optimizer
from .result import MemoryEstimate, format_bytes
from .setup import PlanSetup
from .sharding import fold_sequence_parallel

__all__ = ["search", "CandidateSearch"]


def search(setup: PlanSetup, example_inputs, lossless: list, lossy: list, *, loss_fn=None, replays: dict | None = None,
           prune: bool = True, sp_terms=None, compile_options=None) -> "CandidateSearch":
    """Search ``lossless`` then ``lossy`` candidates (:func:`~effpass.planning.candidates.candidate_tiers`) for the
    plan to choose; the finished search (``.chosen``: None when nothing fits; ``.considered``: every candidate of
    the tiers tried, the plan as given first). ``replays``: a cache shared by searches of several budgets of the
    same model, inputs and options; ``sp_terms``: ``(sequence_parallel, terms)`` folded onto every replay."""
    s = CandidateSearch(setup, example_inputs, loss_fn=loss_fn, replays=replays, prune=prune, sp_terms=sp_terms,
                        compile_options=compile_options or {})
    s.choose(lossless, lossy)
    return s


class CandidateSearch:
    """The state of one search: the replays (cached by replay key, shared between budgets), the candidates
    considered so far (the plan as given first: the base of every extra-compute figure) and the plan as given
    when its replay is deferred to the next batch."""

    def __init__(self, setup: PlanSetup, example_inputs, *, loss_fn, replays, prune, sp_terms, compile_options):
        self.setup = setup
        self.inputs = example_inputs
        self.loss_fn = loss_fn
        self.compile_options = compile_options
        self.replays: dict = {} if replays is None else replays  # a caller planning several budgets shares them
        self.sp_terms = sp_terms
        self.prunable = prune and setup.world_size == 1 and not sp_terms
        self.considered: list[Candidate] = []
        self.deferred: list = []  # the plan as given when it cannot fit: replayed with the next batch
        self.chosen: Candidate | None = None

    # ---------------------------------------------------------------------------------------------- replays
    def _twin(self, c: Candidate) -> Candidate:
        """``c`` with the optimizer asked for when it replaces it (its replay is the AdamW twin's), unless the replay
        runs that optimizer itself (``replayed_optimizer``)."""
        opt_o = next((o for o in c.options if o.optimizer), None)
        if opt_o is not None and opt_o.optimizer != self.setup.optimizer and not replayed_optimizer(opt_o.optimizer):
            return c.without_optimizer_option(self.setup.optimizer)
        return c

    def replay_all(self, cands) -> None:
        """Replay every candidate of ``cands`` not replayed yet in one :func:`estimate_many` call: candidates
        with the same module phase share one fake copy and one Dynamo capture (and, extrapolated, each depth
        is replayed once for all of them); those that change only the optimizer reuse their AdamW twin."""
        todo, seen = [], set()
        for c in cands:
            c = self._twin(c)
            key = c.replay_key()
            if key in self.replays or key in seen or not replayed_optimizer(c.optimizer):
                continue
            seen.add(key)
            todo.append(c)
        if len(todo) < 2:
            return
        try:
            pipelines = [self.setup.pipeline_of(c) for c in todo]
        except Exception:
            return  # replayed one by one below (each error reported on its candidate)
        # the plan as given is the base of every extra-compute figure: always checked at three depths
        first = self.considered[0].replay_key() if self.considered else None
        for opt in dict.fromkeys(c.optimizer for c in todo):  # one shared replay per optimizer the replay runs
            idx = [i for i, c in enumerate(todo) if c.optimizer == opt]
            results = estimate_many(self.setup.model, self.inputs, [pipelines[i] for i in idx], opt,
                                    device=self.setup.device, loss_fn=self.loss_fn, screen=self.prunable,
                                    check=[j for j, i in enumerate(idx) if todo[i].replay_key() == first],
                                    **self.compile_options)
            for i, r in zip(idx, results):
                self.replays[todo[i].replay_key()] = r

    def confirm(self, cands) -> None:
        """Every provisional figure among ``cands`` (predicted from two depths, ``estimate_many(screen=True)``)
        checked at the third depth in one :func:`confirm_many` call; the candidates evaluated again (those that
        derive from a confirmed replay too: another optimizer on the same replay)."""
        todo, seen = [], set()
        for c in cands:
            if c.estimate is None or not c.estimate.provisional:
                continue
            base_c = self._twin(c)
            key = base_c.replay_key()
            r = self.replays.get(key)
            if key in seen or not isinstance(r, MemoryEstimate) or not r.provisional:
                continue
            seen.add(key)
            todo.append((base_c, r))
        for opt in dict.fromkeys(b.optimizer for b, _ in todo):  # one call per optimizer the replay runs
            part = [(b, r) for b, r in todo if b.optimizer == opt]
            got = confirm_many(self.setup.model, self.inputs, [self.setup.pipeline_of(b) for b, _ in part],
                               [r for _, r in part], opt, device=self.setup.device,
                               loss_fn=self.loss_fn, **self.compile_options)
            for (b, _), r in zip(part, got):
                self.replays[b.replay_key()] = r
        for c in self.considered + [c for c in cands if c not in self.considered]:
            if c.estimate is None or not c.estimate.provisional:
                continue
            base_key = self._twin(c).replay_key()
            r = self.replays.get(base_key)
            if base_key != c.replay_key() and not (isinstance(r, MemoryEstimate) and r.provisional):
                self.replays.pop(c.replay_key(), None)  # derived from a replay now confirmed: derived again
            self.evaluate(c)

    def replay(self, c: Candidate):
        """``c``'s one-rank estimate (or the exception its replay raised), cached by its replay key."""
        key = c.replay_key()
        if key in self.replays:
            return self.replays[key]
        opt_o = next((o for o in c.options if o.optimizer), None)
        if opt_o is not None and opt_o.optimizer != self.setup.optimizer and not replayed_optimizer(opt_o.optimizer):
            # the same forward and backward as the base optimizer's replay; the optimizer built on fake
            # parameters of the same shapes (its states and step transient measured, not derived)
            r = self.replay(c.without_optimizer_option(self.setup.optimizer))
            if not isinstance(r, Exception):
                try:
                    r = with_optimizer(r, opt_o.optimizer, device=self.setup.device)
                except Exception as e:  # pragma: no cover - an optimizer that cannot run on fake tensors
                    r = e
        else:
            try:
                pipeline = self.setup.pipeline_of(c)
                r = estimate_memory(self.setup.model, self.inputs, passes=pipeline, optimizer=c.optimizer,
                                    device=self.setup.device, loss_fn=self.loss_fn, **self.compile_options)
            except Exception as e:  # a candidate that cannot be replayed is reported, not fatal
                r = e
        self.replays[key] = r
        return r

    def evaluate(self, c: Candidate) -> None:
        """``c``'s per-rank estimate and whether it fits."""
        r = self.replay(c)
        if isinstance(r, Exception):
            c.error = f"{type(r).__name__}: {str(r).splitlines()[0][:120] if str(r) else ''}"
            c.estimate, c.fits = None, False
            return
        try:
            est = self.setup.fold(c, r)
        except HostBudgetError as e:  # over host_budget: not a candidate (the table says why)
            c.error, c.estimate, c.fits = str(e), None, False
            return
        if self.sp_terms:
            est = fold_sequence_parallel(est, *self.sp_terms)
        c.estimate = est
        c.fits = est.device_peak_bytes <= self.setup.budget
        c.est_step_s, c.transfer_bound = self.setup.step_time(est)

    def set_floors(self, cands) -> None:
        """Each candidate's floor (bytes live at its step's start), from its module phase alone; cached with the
        replays. A candidate whose floor cannot be computed has none (it is replayed, which reports why)."""
        replays = self.replays
        todo = [c for c in cands if ("floor", c.replay_key()) not in replays]
        if todo:
            pipes = []
            for c in todo:
                try:
                    pipes.append((self.setup.pipeline_of(c), c.optimizer))
                except Exception as e:
                    pipes.append((None, e))
            ok = [i for i, (p, o) in enumerate(pipes) if not isinstance(o, Exception)]
            got = start_bytes_many(self.setup.model, self.inputs, [pipes[i] for i in ok], device=self.setup.device,
                                   **self.compile_options)
            for i, f in zip(ok, got):
                replays[("floor", todo[i].replay_key())] = f
            for i in set(range(len(todo))) - set(ok):
                replays[("floor", todo[i].replay_key())] = pipes[i][1]
        for c in cands:
            f = replays[("floor", c.replay_key())]
            c.floor = f if isinstance(f, int) else None

    def run(self, cands) -> None:
        """Replay and evaluate ``cands`` (with the deferred plan as given, if any)."""
        from ..progress import progress

        cands = list(cands)
        if self.deferred and cands:
            cands = self.deferred + cands
            self.deferred.clear()
        if self.setup.optimizer in ("adamw", None):
            self.replay_all(cands)
        bar = progress(len(cands), "effpass plan")  # each candidate: a replay unless shared with another
        try:
            for c in cands:
                bar.set_postfix_str(c.name[:40])
                self.evaluate(c)
                bar.update()
        finally:
            bar.close()
        if not self.prunable:  # every figure checked (replays cached by a screening plan, a shared cache, included)
            self.confirm(cands)

    def set_extra_flops(self) -> bool:
        considered = self.considered
        done = [c for c in considered if c.estimate is not None]
        if not done:
            return False
        base_flops = considered[0].estimate.flops if considered[0].estimate is not None else min(
            c.estimate.flops for c in done)
        for c in done:
            c.extra_flops = c.estimate.flops - base_flops
        return True

    # ----------------------------------------------------------------------------------------------- search
    def choose(self, lossless: list, lossy: list) -> Candidate | None:
        """The tiers in order; sets and returns ``chosen`` (None when nothing fits: then every candidate that
        could have the smallest peak has been replayed and the smallest is checked at three depths)."""
        # plans that restrict the training loop (step_in_backward) form their own tier after the free lossless ones
        free = [c for c in lossless if not c.restricted]
        for tier in (free, [c for c in lossless if c.restricted], lossy):
            if tier and self._tier(tier):
                break
        if self.deferred:
            self.run(list(self.deferred))
            self.deferred.clear()
        self.set_extra_flops()
        if self.chosen is None:
            self._smallest()
        return self.chosen

    def _tier(self, tier: list) -> bool:
        """Replay the tier (pruned, restricted plans after the others); True when a plan of it is chosen."""
        budget = self.setup.budget
        first = tier[0] if not self.considered else None  # the plan as given: the base of extra compute
        if self.prunable:
            self.set_floors(tier)
            for c in tier:
                if c is not first and c.floor is not None and c.floor > budget:
                    c.pruned = (f"not replayed: the bytes live at the start of its step (parameters, buffers, "
                                f"optimizer states, inputs) are {format_bytes(c.floor)} ({c.floor} bytes), above "
                                f"the budget")
            if first is not None and first.floor is not None and first.floor > budget:
                # it cannot fit but is the base of every extra-compute figure: replayed with the next batch
                # (one estimate_many call spreads more work over the workers)
                self.deferred.append(first)
        self.considered += tier
        free_part = [c for c in tier if not c.pruned and not c.restricted and c not in self.deferred]
        restricted = [c for c in tier if not c.pruned and c.restricted]
        if self.prunable and free_part and restricted:
            # plans without a restriction on the training loop are chosen first: if one of them fits, a
            # restricted plan of the tier cannot be the answer
            self.run(free_part)
            self.confirm([self.considered[0]] + [c for c in free_part if c.fits])
            if any(c.fits for c in free_part):
                for c in restricted:
                    c.pruned = ("not replayed: it restricts the training loop and a plan of the same tier without "
                                "a restriction fits (preferred)")
            else:
                self.run(restricted)
        else:
            self.run(c for c in tier if not c.pruned and c not in self.deferred)
        if not self.set_extra_flops():
            return False
        if any(c.fits for c in tier):
            # a provisional figure decides nothing alone: every fitting plan, and the base of extra compute,
            # checked at the third depth before one is chosen
            self.confirm([self.considered[0]] + [c for c in tier if c.fits])
            self.set_extra_flops()
        fitting = [c for c in tier if c.fits]
        if fitting:
            # plans that hold host memory (offloads) come after those that do not (host_memory.py)
            self.chosen = min(fitting, key=lambda c: (c.restricted, bool(c.host_bytes), c.extra_flops, c.sharded,
                                                      c.peak_bytes))
            return True
        return False

    def _smallest(self) -> None:
        """Nothing fits: the smallest achievable peak must be among the replayed; a pruned candidate whose floor
        is below the smallest replayed peak could be smaller, so it is replayed after all (those with the lowest
        floor first: their peaks may rule out the others). The smallest is named only once its figure is
        checked at the third depth (with the plan as given, the base of extra compute)."""
        considered = self.considered
        done = [c for c in considered if c.estimate is not None]
        while done:
            best = min(done, key=lambda c: c.peak_bytes)
            unchecked = [c for c in (considered[0], best) if c.estimate is not None and c.estimate.provisional]
            if unchecked:
                self.confirm(unchecked)
                if any(c.estimate is not None and c.estimate.provisional for c in unchecked):  # pragma: no cover
                    raise RuntimeError(f"plan_memory: the figures of {[c.name for c in unchecked]} could not be "
                                       f"checked")
                self.set_extra_flops()
                done = [c for c in considered if c.estimate is not None]
                continue
            smallest = best.peak_bytes
            late = [c for c in considered if c.pruned and c.estimate is None and c.error is None
                    and c.floor is not None and c.floor < smallest]
            late = [c for c in late if c.floor == min(x.floor for x in late)]
            if not late:
                for c in considered:
                    if c.pruned and c.estimate is None:
                        c.pruned += f" and at least the smallest replayed peak, {format_bytes(smallest)}"
                break
            for c in late:
                c.pruned = None
            self.run(late)
            self.set_extra_flops()
            done = [c for c in considered if c.estimate is not None]
