"""Choose the passes that fit a training step into a memory budget with the least extra compute.

The planner knows techniques only through the registry (:mod:`effpass.memory_options`): every registered
pass declares the memory options it offers (``Pass.memory_options``: its options, lossless or lossy, what
they change, the phase that needs them, the passes they require, a group), and non-pass options (an
optimizer with smaller states) are declared with ``register_memory_option``. Candidates are the
combinations of at most one option per group. Tiers, tried in order:

1. lossless options (always tried);
2. lossy options, only the techniques named in ``allow``.

Every candidate of a tier is replayed (:func:`~effpass.planning.estimate_memory`; candidates that differ
only in what is folded - sharding - or in the optimizer share one replay of the forward and backward);
among those whose predicted peak fits the budget, the one with the least extra compute (FLOPs counted
during the replay, minus the base plan's) wins, ties going to unsharded plans and then to the smaller peak.
The next tier is tried only when nothing in the previous one fits. If nothing fits,
:class:`MemoryBudgetError` names the smallest achievable peak and the plan that reaches it.
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from effpass.quantized import storage_bytes

from .estimate import MemoryEstimate, _largest_unit_bytes, _target_device, confirm_many, estimate_many, estimate_memory, format_bytes, \
    parse_size, start_bytes_many, with_optimizer
from .sharding import fold_sequence_parallel, fold_sharding

__all__ = ["MemoryPlan", "Candidate", "MemoryBudgetError", "plan_memory", "plan_for_compile", "techniques", "plan_max_seq",
           "MaxSeqResult"]


def techniques(world_size: int = 2) -> dict[str, tuple[bool, str]]:
    """technique -> (lossless, what it does) of every option the registry declares (what ``allow`` may name)."""
    from effpass.memory_options import declared_memory_options

    out: dict[str, tuple[bool, str]] = {}
    for o in declared_memory_options(None, world_size=world_size):
        out.setdefault(o.technique, (o.lossless, o.cost or o.name))
    return out


class MemoryBudgetError(ValueError):
    """No plan fits the budget; ``.smallest`` is the smallest achievable predicted peak, ``.plan`` its plan."""

    def __init__(self, message: str, smallest: int | None = None, plan: "Candidate | None" = None,
                 candidates: list | None = None):
        super().__init__(message)
        self.smallest = smallest
        self.plan = plan
        self.candidates = candidates or []


@dataclass
class Candidate:
    """One combination of declared memory options (at most one per group) and the optimizer it builds."""

    options: tuple = ()                    # MemoryOption, one per group, in group order
    optimizer: str | None = "adamw"
    estimate: MemoryEstimate | None = None
    extra_flops: int = 0
    fits: bool = False
    error: str | None = None
    #: bytes live at the start of its step (parameters, buffers, optimizer states, inputs): a lower bound of
    #: its peak, known without a replay (:func:`~effpass.planning.estimate.start_bytes_many`); None if unknown
    floor: int | None = None
    #: why it was not replayed (it cannot fit, or cannot be the answer); None when replayed
    pruned: str | None = None

    @property
    def lossy(self) -> bool:
        return any(not o.lossless for o in self.options)

    @property
    def name(self) -> str:
        return " + ".join(o.name for o in self.options) or "as given"

    def option(self, group: str):
        """The option of ``group`` in this plan (None when the plan has none)."""
        return next((o for o in self.options if o.group == group), None)

    def techniques(self) -> tuple[str, ...]:
        return tuple(o.technique for o in self.options)

    @property
    def restricted(self) -> bool:
        """The plan restricts the training loop (an option with ``restricts``, e.g. no gradient accumulation)."""
        return any(o.restricts for o in self.options)

    @property
    def sharded(self) -> bool:
        return any(o.sharding for o in self.options)

    @property
    def peak_bytes(self) -> int | None:
        return self.estimate.peak_bytes if self.estimate else None

    def replay_key(self):
        """What the replay depends on: the added passes and their options (sharding is folded, not replayed)."""
        return (tuple((o.pass_name, repr(sorted(o.options.items()))) for o in self.options
                      if o.pass_name and not o.sharding), self.optimizer)

    def without_optimizer_option(self, base_optimizer) -> "Candidate":
        return Candidate(options=tuple(o for o in self.options if not o.optimizer), optimizer=base_optimizer)


@dataclass
class MemoryPlan:
    """The chosen plan, the alternatives considered and why."""

    budget: int
    chosen: Candidate
    candidates: list[Candidate]
    passes: list                      # the full pipeline to compile with (user's passes + the plan's)
    optimizer: str | None
    world_size: int
    reason: str
    notes: list = field(default_factory=list)

    @property
    def peak_bytes(self) -> int:
        return self.chosen.peak_bytes

    def table(self) -> str:
        rows = [("plan", "lossy", "predicted peak", "fits", "extra compute", "peak at")]
        base_flops = self._base_flops()
        for c in self.candidates:
            if c.pruned and c.estimate is None:
                if c.floor is not None and c.floor > self.budget:
                    rows.append(("  " + c.name, "yes" if c.lossy else "no",
                                 f"not replayed: >= {format_bytes(c.floor)}", "no", "-",
                                 "start of step alone exceeds the budget"))
                else:
                    rows.append(("  " + c.name, "yes" if c.lossy else "no", "not replayed", "-", "-",
                                 "restricted; an unrestricted plan fits"))
                continue
            if c.estimate is None:
                rows.append((c.name, "yes" if c.lossy else "no", c.error or "not evaluated", "-", "-", "-"))
                continue
            pct = f" ({100 * c.extra_flops / base_flops:+.1f}%)" if base_flops else ""
            rows.append((("* " if c is self.chosen else "  ") + c.name, "yes" if c.lossy else "no",
                         ("~" if c.estimate.provisional else "") + format_bytes(c.peak_bytes),
                         "yes" if c.fits else "no",
                         f"{_flops(c.extra_flops)}{pct}", f"{c.estimate.peak_phase}: {c.estimate.peak_node}"[:60]))
        widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
        return "\n".join("  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows)

    def _base_flops(self) -> int:
        base = next((c for c in self.candidates if c.estimate is not None), None)
        return base.estimate.flops if base else 0

    def summary(self) -> str:
        lines = [f"memory plan for a budget of {format_bytes(self.budget)}"
                 + (f" per rank ({self.world_size} ranks)" if self.world_size > 1 else "") + f": {self.chosen.name}",
                 f"  predicted peak {format_bytes(self.peak_bytes)}; why: {self.reason}",
                 f"  pipeline: {', '.join(p.name for p in self.passes) or '(none)'}; optimizer: {self.optimizer}"]
        lines += [f"  note: {n}" for n in self.notes]
        lines += ["", self.table()]
        return "\n".join(lines)

    def timelines(self) -> list[tuple[str, dict]]:
        """(plan name, live-byte timeline) of the chosen plan first, then of every other evaluated candidate."""
        order = [self.chosen] + [c for c in self.candidates if c is not self.chosen]
        return [(c.name, c.estimate.timeline) for c in order
                if c.estimate is not None and getattr(c.estimate, "timeline", None)]

    def to_dict(self) -> dict[str, Any]:
        return {"budget": self.budget, "timelines": dict(self.timelines()), "chosen": self.chosen.name, "peak_bytes": self.peak_bytes,
                "reason": self.reason, "optimizer": self.optimizer, "world_size": self.world_size,
                "passes": [{"name": p.name, "options": p.options()} for p in self.passes],
                "candidates": [{"plan": c.name, "techniques": list(c.techniques()), "lossy": c.lossy, "peak_bytes": c.peak_bytes, "fits": c.fits,
                                "extra_flops": c.extra_flops, "error": c.error, "pruned": c.pruned,
                                "floor_bytes": c.floor,
                                "provisional": bool(c.estimate and c.estimate.provisional),
                                "peak_at": f"{c.estimate.peak_phase}: {c.estimate.peak_node}" if c.estimate else None}
                               for c in self.candidates],
                "notes": self.notes}


# ------------------------------------------------------------------------------------------------------
def _flops(n: float) -> str:
    for unit, size in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} FLOP"



def _check_allow(allow, world_size: int = 2) -> tuple[str, ...]:
    """The lossy techniques ``allow`` names (lossless ones are accepted and ignored: always tried)."""
    if allow is None:
        return ()
    if isinstance(allow, str):
        allow = [allow]
    known = techniques(max(world_size, 2))
    lossy = sorted(t for t, (lossless, _) in known.items() if not lossless)
    lossless = sorted(t for t, (ll, _) in known.items() if ll)
    out = []
    for a in allow:
        if not isinstance(a, str) or a.lower() not in known:
            import difflib

            close = difflib.get_close_matches(str(a), list(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"allow: {a!r} names no technique{hint}; lossy techniques: {lossy} (lossless ones "
                             f"{lossless} are always tried)")
        if not known[a.lower()][0]:
            out.append(a.lower())
    return tuple(dict.fromkeys(out))


def _pipeline(base: list, cand: Candidate) -> list:
    """The user's pipeline plus the candidate's passes (the user's own settings of a pass win)."""
    from effpass.pass_api import make_pass

    names = {p.name for p in base}
    return list(base) + [make_pass(o.pass_name, dict(o.options)) for o in cand.options
                         if o.pass_name and o.pass_name not in names]


def _rows(example_inputs) -> int | None:
    """Tokens in the step's batch: the element count of the largest integer input (token ids); None if none."""
    from torch.utils._pytree import tree_flatten

    n = [x.numel() for x in tree_flatten(example_inputs)[0]
         if isinstance(x, torch.Tensor) and not x.is_floating_point() and not x.is_complex() and x.dim() >= 1]
    return max(n) if n else None


def _usable_options(model, base_names: set, allow: tuple, optimizer, world_size: int, notes: list,
                    graph_only: bool = False, device=None, rows: int | None = None) -> dict[str, list]:
    """group -> the declared options the planner may add, in preference order."""
    from effpass.memory_options import declared_memory_options

    groups: dict[str, list] = {}
    for o in declared_memory_options(model, world_size=world_size, device=device):
        if o.min_rows and rows is not None and rows < o.min_rows:
            continue  # it changes nothing on a batch this small: a replay would repeat another's
        if o.max_rows and (rows is None or rows > o.max_rows):
            continue  # meant for shorter batches (unknown here, or a length search: plan_max_seq)
        if o.sharding and world_size <= 1:
            continue
        if not o.lossless and o.technique not in allow:
            continue
        if o.pass_name and o.pass_name in base_names:
            if not o.lossless:
                notes.append(f"{o.technique!r} allowed but the pipeline already has {o.pass_name}: left as given")
            continue
        missing = [r for r in o.requires if r not in base_names]
        if missing:
            notes.append(f"{o.technique!r} needs {', '.join(missing)} in the pipeline: not tried")
            continue
        if o.optimizer and o.replaces_optimizer and optimizer != o.replaces_optimizer:
            notes.append(f"{o.technique!r} replaces the optimizer {o.replaces_optimizer!r} but the optimizer is "
                         f"{optimizer!r}: not tried")
            continue
        if o.optimizers and optimizer not in o.optimizers and not (o.optimizer and o.optimizer in o.optimizers):
            notes.append(f"{o.technique!r} works with the optimizers {list(o.optimizers)}, not {optimizer!r}: not tried")
            continue
        if graph_only and o.phase == "module":
            if o.lossless:
                notes.append(f"{o.technique!r} changes the eager model before the optimizer exists: not tried on "
                             f"the first call (pass example_inputs= to plan it)")
            continue
        groups.setdefault(o.group, []).append(o)
    for g in groups.values():
        g.sort(key=lambda o: o.order)
    return groups


def _conflict(opts) -> bool:
    """Two options whose passes the registry declares conflicting (``conflicts_with``)."""
    from effpass.pass_api import registered_passes

    names = {o.pass_name for o in opts if o.pass_name}
    reg = registered_passes()
    return any(set(getattr(reg.get(n), "conflicts_with", ())) & names for n in names)


def _candidates(groups: dict, optimizer):
    keys = sorted(groups)
    lossless, lossy = [], []
    for combo in itertools.product(*[[None] + groups[k] for k in keys]):
        opts = tuple(o for o in combo if o is not None)
        if _conflict(opts):
            continue
        opt_o = next((o for o in opts if o.optimizer), None)
        if any(o.optimizers and (opt_o.optimizer if opt_o else optimizer) not in o.optimizers for o in opts):
            continue
        if opt_o is not None and any(o.optimizers for o in opts):
            # NOTE(replay): a replaced optimizer is replayed alone on the AdamW twin's forward and backward,
            # which cannot model an option that runs the optimizer inside the backward
            continue
        c = Candidate(options=opts, optimizer=opt_o.optimizer if opt_o else optimizer)
        (lossy if c.lossy else lossless).append(c)
    # lossy plans: those with fewer lossy options first (a stable order for reports)
    lossy.sort(key=lambda c: sum(not o.lossless for o in c.options))
    return lossless, lossy


def _parameter_floor(model, groups, world_size) -> tuple[int, int]:
    """(the parameters' own bytes, the smallest they can become under the usable options) - an early bound."""
    p_bytes = storage_bytes(list(model.parameters()))
    floor = p_bytes / max(world_size, 1)
    if any(o.group for g in groups.values() for o in g if "parameters" in o.changes):
        floor = floor / 8  # no declared parameter format holds less than 4 bits per 32-bit value
    return p_bytes, floor


def plan_memory(model: torch.nn.Module, example_inputs, memory_budget, allow: Iterable[str] = (), passes=None,
                optimizer: str | None = "adamw", world_size: int = 1, *, device=None, loss_fn=None,
                sequence_parallel: int = 1, prune: bool = True, _cache: dict | None = None,
                _graph_only: bool = False, _sp_terms=None, **compile_options) -> MemoryPlan:
    """Choose a pipeline for ``model`` whose predicted training-step peak fits ``memory_budget``
    (``"24GiB"``, bytes; per rank when ``world_size > 1``). See the module docstring for the order.

    ``prune`` (default True; one rank, no sequence parallelism): a candidate whose bytes live at the start of
    its step (parameters, buffers, optimizer states and inputs after its module phase, computed without a
    replay) already exceed the budget cannot fit, so it is not replayed; it is listed with that floor and
    ``pruned`` set. If nothing fits, every pruned candidate whose floor is below the smallest replayed peak
    is replayed after all, so the smallest achievable peak is the same as without pruning. In a tier that mixes
    plans that restrict the training loop with plans that do not, the unrestricted ones are replayed first;
    if one of them fits, the restricted ones cannot be chosen and are not replayed. The plan as given
    (the first candidate, the base of every "extra compute" figure) is always replayed. ``prune=False``
    replays every candidate of every tier tried (the whole table). Every replayed candidate's figures are
    the same either way.

    Raises :class:`MemoryBudgetError` (a ``ValueError``) naming the smallest achievable peak and its plan
    when nothing fits, ``ValueError`` for an unreadable budget, one below the parameters' own bytes, or an
    ``allow`` entry that names no technique.
    """
    from effpass.config import _build_passes, default_pipeline

    if sequence_parallel != 1:  # one rank of a shard_sequence group: seq/sp tokens replayed (planning.sharding)
        from .sharding import sequence_parallel_replay

        if world_size % sequence_parallel:
            raise ValueError(f"sequence_parallel={sequence_parallel} must divide world_size={world_size}")
        local, restore_sp, terms = sequence_parallel_replay(model, example_inputs, sequence_parallel)
        try:
            return plan_memory(model, local, memory_budget, allow, passes, optimizer, world_size, device=device,
                               loss_fn=loss_fn, prune=prune, _cache=_cache, _graph_only=_graph_only,
                               _sp_terms=(sequence_parallel, terms), **compile_options)
        finally:
            restore_sp()
    budget = parse_size(memory_budget, "memory_budget")
    allow_t = _check_allow(allow, world_size)
    dev = _target_device(model, device)
    base = _build_passes(passes) if passes is not None else default_pipeline(dev)
    base_names = {p.name for p in base}
    notes: list[str] = []
    groups = _usable_options(model, base_names, allow_t, optimizer, world_size, notes, graph_only=_graph_only,
                             device=dev, rows=_rows(example_inputs))
    p_bytes, floor = _parameter_floor(model, groups, world_size)
    if budget < floor:
        raise ValueError(f"memory_budget {memory_budget!r} ({format_bytes(budget)}) is below the parameters' own "
                         f"bytes ({format_bytes(p_bytes)}"
                         + (f" / {world_size} ranks" if world_size > 1 else "")
                         + (", quantized as allowed" if floor < p_bytes / max(world_size, 1) else "")
                         + "); no plan can fit it")
    lossless, lossy = _candidates(groups, optimizer)
    # a sharding pass the user put in the pipeline is folded on every candidate
    from effpass.memory_options import declared_memory_options

    base_sharding = next((o for o in declared_memory_options(model, world_size=world_size)
                          if o.sharding and o.pass_name in base_names), None) if world_size > 1 else None
    replays: dict = {} if _cache is None else _cache  # a caller planning several budgets shares the replays
    unit_bytes = _largest_unit_bytes(model) if world_size > 1 else 0

    def pipeline_of(c: Candidate) -> list:
        pipeline = _pipeline([p for p in base if not _is_sharding(p.name, model, world_size)], c)
        return [p for p in pipeline if not _is_sharding(p.name, model, world_size)]

    def replay_all(cands):
        """Replay every candidate of ``cands`` not replayed yet in one :func:`estimate_many` call: candidates
        with the same module phase share one fake copy and one Dynamo capture (and, extrapolated, each depth
        is replayed once for all of them); those that change only the optimizer reuse their AdamW twin."""
        todo, seen = [], set()
        for c in cands:
            opt_o = next((o for o in c.options if o.optimizer), None)
            if opt_o is not None and opt_o.optimizer != optimizer:
                c = c.without_optimizer_option(optimizer)
            key = c.replay_key()
            if key in replays or key in seen or c.optimizer not in ("adamw", None):
                continue
            seen.add(key)
            todo.append(c)
        if len(todo) < 2:
            return
        try:
            pipelines = [pipeline_of(c) for c in todo]
        except Exception:
            return  # replayed one by one below (each error reported on its candidate)
        # the plan as given is the base of every extra-compute figure: always checked at three depths
        first = considered[0].replay_key() if considered else None
        results = estimate_many(model, example_inputs, pipelines, todo[0].optimizer, device=dev, loss_fn=loss_fn,
                                screen=prunable, check=[i for i, c in enumerate(todo) if c.replay_key() == first],
                                **compile_options)
        for c, r in zip(todo, results):
            replays[c.replay_key()] = r

    def confirm(cands):
        """Every provisional figure among ``cands`` (predicted from two depths, ``estimate_many(screen=True)``)
        checked at the third depth in one :func:`confirm_many` call; the candidates evaluated again (those that
        derive from a confirmed replay too: another optimizer on the same replay)."""
        def base_of(c):
            opt_o = next((o for o in c.options if o.optimizer), None)
            return c.without_optimizer_option(optimizer) if opt_o is not None and opt_o.optimizer != optimizer else c

        todo, seen = [], set()
        for c in cands:
            if c.estimate is None or not c.estimate.provisional:
                continue
            base_c = base_of(c)
            key = base_c.replay_key()
            r = replays.get(key)
            if key in seen or not isinstance(r, MemoryEstimate) or not r.provisional:
                continue
            seen.add(key)
            todo.append((base_c, r))
        if todo:
            got = confirm_many(model, example_inputs, [pipeline_of(b) for b, _ in todo], [r for _, r in todo],
                               todo[0][0].optimizer, device=dev, loss_fn=loss_fn, **compile_options)
            for (b, _), r in zip(todo, got):
                replays[b.replay_key()] = r
        for c in considered + [c for c in cands if c not in considered]:
            if c.estimate is None or not c.estimate.provisional:
                continue
            base_key = base_of(c).replay_key()
            r = replays.get(base_key)
            if base_key != c.replay_key() and not (isinstance(r, MemoryEstimate) and r.provisional):
                replays.pop(c.replay_key(), None)  # derived from a replay now confirmed: derived again
            evaluate(c)

    def replay(c: Candidate):
        key = c.replay_key()
        if key in replays:
            return replays[key]
        opt_o = next((o for o in c.options if o.optimizer), None)
        if opt_o is not None and opt_o.optimizer != optimizer:
            # the same forward and backward as the base optimizer's replay; the optimizer built on fake
            # parameters of the same shapes (its states and step transient measured, not derived)
            r = replay(c.without_optimizer_option(optimizer))
            if not isinstance(r, Exception):
                try:
                    r = with_optimizer(r, opt_o.optimizer, device=dev)
                except Exception as e:  # pragma: no cover - an optimizer that cannot run on fake tensors
                    r = e
        else:
            try:
                pipeline = pipeline_of(c)
                r = estimate_memory(model, example_inputs, passes=pipeline, optimizer=c.optimizer, device=dev,
                                    loss_fn=loss_fn, **compile_options)
            except Exception as e:  # a candidate that cannot be replayed is reported, not fatal
                r = e
        replays[key] = r
        return r

    def evaluate(c: Candidate):
        r = replay(c)
        if isinstance(r, Exception):
            c.error = f"{type(r).__name__}: {str(r).splitlines()[0][:120] if str(r) else ''}"
            c.estimate, c.fits = None, False
            return
        est = r
        sharding = next((o.sharding for o in c.options if o.sharding), None) or (
            base_sharding.sharding if base_sharding else None)
        if world_size > 1:
            est = fold_sharding(est, world_size, unit_bytes, sharding) if sharding else dataclasses.replace(
                est, world_size=world_size)
        if _sp_terms:
            est = fold_sequence_parallel(est, *_sp_terms)
        c.estimate = est
        c.fits = est.peak_bytes <= budget

    prunable = prune and world_size == 1 and not _sp_terms

    def set_floors(cands):
        """Each candidate's floor (bytes live at its step's start), from its module phase alone; cached with the
        replays. A candidate whose floor cannot be computed has none (it is replayed, which reports why)."""
        todo = [c for c in cands if ("floor", c.replay_key()) not in replays]
        if todo:
            pipes = []
            for c in todo:
                try:
                    pipes.append((pipeline_of(c), c.optimizer))
                except Exception as e:
                    pipes.append((None, e))
            ok = [i for i, (p, o) in enumerate(pipes) if not isinstance(o, Exception)]
            got = start_bytes_many(model, example_inputs, [pipes[i] for i in ok], device=dev, **compile_options)
            for i, f in zip(ok, got):
                replays[("floor", todo[i].replay_key())] = f
            for i in set(range(len(todo))) - set(ok):
                replays[("floor", todo[i].replay_key())] = pipes[i][1]
        for c in cands:
            f = replays[("floor", c.replay_key())]
            c.floor = f if isinstance(f, int) else None

    deferred: list = []  # the plan as given when it cannot fit: replayed with the next batch

    def run(cands):
        cands = list(cands)
        if deferred and cands:
            cands = deferred + cands
            deferred.clear()
        from ..progress import progress

        if optimizer in ("adamw", None):
            replay_all(cands)
        bar = progress(len(cands), "effpass plan")  # each candidate: a replay unless shared with another
        try:
            for c in cands:
                bar.set_postfix_str(c.name[:40])
                evaluate(c)
                bar.update()
        finally:
            bar.close()
        if not prunable:  # every figure checked (replays cached by a screening plan, _cache, included)
            confirm(cands)

    def set_extra_flops() -> bool:
        done = [c for c in considered if c.estimate is not None]
        if not done:
            return False
        base_flops = considered[0].estimate.flops if considered[0].estimate is not None else min(
            c.estimate.flops for c in done)
        for c in done:
            c.extra_flops = c.estimate.flops - base_flops
        return True

    considered: list[Candidate] = []
    chosen = None
    # plans that restrict the training loop (step_in_backward) form their own tier after the free lossless ones
    free = [c for c in lossless if not c.restricted]
    for tier in (free, [c for c in lossless if c.restricted], lossy):
        if not tier:
            continue
        first = tier[0] if not considered else None  # the plan as given: the base of extra compute
        if prunable:
            set_floors(tier)
            for c in tier:
                if c is not first and c.floor is not None and c.floor > budget:
                    c.pruned = (f"not replayed: the bytes live at the start of its step (parameters, buffers, "
                                f"optimizer states, inputs) are {format_bytes(c.floor)} ({c.floor} bytes), above "
                                f"the budget")
            if first is not None and first.floor is not None and first.floor > budget:
                # it cannot fit but is the base of every extra-compute figure: replayed with the next batch
                # (one estimate_many call spreads more work over the workers)
                deferred.append(first)
        considered += tier
        free_part = [c for c in tier if not c.pruned and not c.restricted and c not in deferred]
        restricted = [c for c in tier if not c.pruned and c.restricted]
        if prunable and free_part and restricted:
            # plans without a restriction on the training loop are chosen first: if one of them fits, a
            # restricted plan of the tier cannot be the answer
            run(free_part)
            confirm([considered[0]] + [c for c in free_part if c.fits])
            if any(c.fits for c in free_part):
                for c in restricted:
                    c.pruned = ("not replayed: it restricts the training loop and a plan of the same tier without "
                                "a restriction fits (preferred)")
            else:
                run(restricted)
        else:
            run(c for c in tier if not c.pruned and c not in deferred)
        if not set_extra_flops():
            continue
        if any(c.fits for c in tier):
            # a provisional figure decides nothing alone: every fitting plan, and the base of extra compute,
            # checked at the third depth before one is chosen
            confirm([considered[0]] + [c for c in tier if c.fits])
            set_extra_flops()
        fitting = [c for c in tier if c.fits]
        if fitting:
            chosen = min(fitting, key=lambda c: (c.restricted, c.extra_flops, c.sharded, c.peak_bytes))
            break
    if deferred:
        run(list(deferred))
        deferred.clear()
    set_extra_flops()
    done = [c for c in considered if c.estimate is not None]
    while chosen is None and done:
        # nothing fits: the smallest achievable peak must be among the replayed; a pruned candidate whose
        # floor is below the smallest replayed peak could be smaller, so it is replayed after all (those with
        # the lowest floor first: their peaks may rule out the others). The smallest is named only once its
        # figure is checked at the third depth (with the plan as given, the base of extra compute).
        best = min(done, key=lambda c: c.peak_bytes)
        unchecked = [c for c in (considered[0], best) if c.estimate is not None and c.estimate.provisional]
        if unchecked:
            confirm(unchecked)
            if any(c.estimate is not None and c.estimate.provisional for c in unchecked):  # pragma: no cover
                raise RuntimeError(f"plan_memory: the figures of {[c.name for c in unchecked]} could not be checked")
            set_extra_flops()
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
        run(late)
        set_extra_flops()
        done = [c for c in considered if c.estimate is not None]
    if chosen is None:
        if not done:
            errors = "; ".join(f"{c.name}: {c.error}" for c in considered[:3])
            raise RuntimeError(f"plan_memory: no plan could be replayed ({errors})")
        best = min(done, key=lambda c: c.peak_bytes)
        hint = ""
        missing = sorted(t for t, (ll, _) in techniques(max(world_size, 2)).items() if not ll and t not in allow_t)
        if missing:
            hint = f"; allow=[...] may add lossy techniques: {missing}"
        raise MemoryBudgetError(
            f"no plan fits memory_budget {format_bytes(budget)}: the smallest achievable predicted peak is "
            f"{format_bytes(best.peak_bytes)} ({best.peak_bytes} bytes) with plan {best.name!r}{hint}",
            smallest=best.peak_bytes, plan=best, candidates=considered)
    plain = considered[0]
    if chosen is plain:
        reason = (f"the pipeline as given fits ({format_bytes(chosen.peak_bytes)} <= {format_bytes(budget)}); "
                  f"nothing added")
    else:
        reason = (f"the pipeline as given needs {format_bytes(plain.peak_bytes) if plain.estimate else '?'}; "
                  f"{chosen.name} fits ({format_bytes(chosen.peak_bytes)} <= {format_bytes(budget)}) with the least "
                  f"extra compute ({_flops(chosen.extra_flops)}) among the "
                  f"{sum(c.fits for c in considered)} fitting {'lossy' if chosen.lossy else 'lossless'} plans"
                  + (" replayed" if any(c.pruned for c in considered) else ""))
        if chosen.lossy:
            reason += "; no lossless plan fits"
    if chosen.restricted:  # plans without restrictions are preferred: none of them fits
        reason += "; no plan without a restriction on the training loop fits"
    for o in chosen.options:
        if o.optimizer:
            notes.append(f"build the optimizer as {o.optimizer!r} for this plan ({o.cost})")
        if o.restricts:
            notes.append(f"{o.name}: {o.restricts}")
    n_prov = sum(1 for c in considered if c.estimate is not None and c.estimate.provisional)
    if n_prov:
        notes.append(f"{n_prov} candidate(s) marked ~ were predicted from replays of the first 2 and 3 blocks (the "
                     f"peak at the same node in both) and not replayed at a third depth: the chosen plan"
                     f"{', every fitting plan' if chosen is not None else ' (the smallest)'} and the plan as given "
                     f"were (prune=False or `effpass plan --all` checks every one)")
    n_floor = sum(1 for c in considered if c.pruned and c.floor is not None and c.floor > budget)
    if n_floor:
        notes.append(f"{n_floor} candidate(s) not replayed: the bytes live at the start of their step already "
                     f"exceed the budget (prune=False or `effpass plan --all` replays them)")
    if sum(1 for c in considered if c.pruned) > n_floor:
        notes.append(f"{sum(1 for c in considered if c.pruned) - n_floor} restricted candidate(s) not replayed: a plan "
                     f"of the same tier without a restriction on the training loop fits (prune=False replays them)")
    pipeline = _pipeline(base, chosen)
    return MemoryPlan(budget=budget, chosen=chosen, candidates=considered, passes=pipeline,
                      optimizer=chosen.optimizer, world_size=world_size, reason=reason, notes=notes)


def _is_sharding(pass_name: str, model, world_size: int) -> bool:
    """A pass whose declared option is folded (sharding): not replayed (one rank is replayed)."""
    from effpass.pass_api import registered_passes

    klass = registered_passes().get(pass_name)
    return klass is not None and any(o.sharding for o in klass.memory_options(None, world_size=max(world_size, 2)))


def plan_for_compile(model, passes, memory_budget, allow, example_inputs, *, optimizer="adamw", world_size=1,
                     **compile_options):
    """For ``effpass.compile(model, memory_budget=...)``: (the pipeline to compile with, the plan)."""
    plan = plan_memory(model, example_inputs, memory_budget, allow=allow, passes=passes, optimizer=optimizer,
                       world_size=world_size, **compile_options)
    import logging

    logging.getLogger("effpass.planning").info("%s", plan.summary())
    return plan.passes, plan


def module_phase_techniques(model, passes, allow, optimizer="adamw", world_size=1) -> list[str]:
    """The techniques the planner could add for ``model`` that must change the eager model before the
    optimizer exists (``phase="module"``): planning them needs ``example_inputs`` before compiling."""
    from effpass.config import _build_passes, default_pipeline

    base = _build_passes(passes) if passes is not None else default_pipeline(_target_device(model, None))
    groups = _usable_options(model, {p.name for p in base}, _check_allow(allow, world_size), optimizer, world_size,
                             [], device=_target_device(model, None))
    # lossless module-phase options (step_in_backward) are simply not tried on the first call (noted); only
    # those the user asked for (lossy ones named in allow, sharding over world_size ranks) need example_inputs
    return sorted({o.technique for g in groups.values() for o in g if o.phase == "module"
                   and (not o.lossless or o.sharding)})


def check_plan_without_inputs(model, passes, allow, optimizer="adamw", world_size=1) -> None:
    """``effpass.compile(memory_budget=...)`` without ``example_inputs``: the plan is made on the first call,
    after the optimizer exists, so it may only add options that act on graphs. Raise naming the options that
    must change the eager model first (a quantized base, sharding, another optimizer)."""
    module = module_phase_techniques(model, passes, allow, optimizer, world_size)
    if module:
        raise ValueError(
            f"memory_budget without example_inputs: the plan may use {module}, which change the eager model (or "
            f"the optimizer) before the optimizer exists, so they cannot be chosen on the first call; pass "
            f"example_inputs= (a tuple of arguments or a dict of keyword arguments for one training step, e.g. "
            f"{{'input_ids': ..., 'labels': ...}}) to plan before compiling, or leave them out of allow="
            + (" / use world_size=1" if world_size > 1 else ""))


class _PlanOnFirstCall:
    """``model._compiled_call_impl`` until the first call: plans with that call's inputs (graph options
    only), compiles the model again in place with the plan's passes, then runs the call."""

    def __init__(self, model, inner, base_passes, memory_budget, allow, optimizer, world_size, compile_options,
                 on_backend):
        self.model, self.inner, self.on_backend = model, inner, on_backend
        self.args = (base_passes, memory_budget, allow, optimizer, world_size, compile_options)
        self.backend = inner.backend
        self.first_call_checks = inner.first_call_checks
        self.first_input_checks = getattr(inner, "first_input_checks", [])

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            return self.inner(*args, **kwargs)
        return self._plan_and_call(args, kwargs)

    @torch._dynamo.disable
    def _plan_and_call(self, args, kwargs):
        import logging

        from effpass.backend import EffpassBackend, compile_in_place

        base_passes, budget, allow, optimizer, world_size, opts = self.args
        if args and kwargs:
            import inspect

            bound = inspect.signature(self.model.forward).bind(*args, **kwargs)
            inputs = dict(bound.arguments)
        else:
            inputs = dict(kwargs) if kwargs else tuple(args)
        old = self.backend
        plan = plan_memory(self.model, inputs, budget, allow=allow, passes=base_passes, optimizer=optimizer,
                           world_size=world_size, _graph_only=True, **opts)
        plan.notes.append("planned on the first call (no example_inputs): graph options only")
        logging.getLogger("effpass.planning").info("%s", plan.summary())
        names = {p.name for p in old.options.passes}
        new = EffpassBackend(old.options, model=self.model, report=old.report)
        new.extra_passes = tuple(p for p in plan.passes if p.name not in names)
        new._count = old._count
        new.manager = new._make_manager(old.options.passes)
        new.report.memory_plan = plan
        compile_in_place(self.model, new, **getattr(self.model, "_effpass_compile_kwargs", {}))
        self.on_backend(new)
        call = self.model._compiled_call_impl
        call.first_call_checks = list(self.first_call_checks)
        if hasattr(call, "first_input_checks"):
            call.first_input_checks = list(self.first_input_checks)
        return call(*args, **kwargs)

    def __deepcopy__(self, memo):
        return None

    def __reduce__(self):
        return (type(None), ())


def plan_on_first_call(model, base_passes, memory_budget, allow, optimizer, world_size, *, on_backend,
                       **compile_options) -> None:
    """Install :class:`_PlanOnFirstCall` on a model ``effpass.compile`` compiled in place; ``on_backend(b)``
    is told the backend compiled with the plan."""
    model._compiled_call_impl = _PlanOnFirstCall(model, model._compiled_call_impl, base_passes, memory_budget, allow,
                                                 optimizer, world_size, compile_options, on_backend)


# ------------------------------------------------------------------------------------------------------
# the longest sequence that fits
# ------------------------------------------------------------------------------------------------------
@dataclass
class MaxSeqResult:
    """``plan_max_seq``'s answer: the longest sequence ``seq`` (a multiple of ``step``) whose predicted peak
    fits the budget, the plan that fits it, and how it was found."""

    seq: int
    step: int
    budget: int
    plan: MemoryPlan
    next_peak: int | None                 #: predicted peak at seq + step with the same plan (> budget), None at max_len
    fits: list = field(default_factory=list)      #: per candidate: (name, lossy, restricted, fitted seq, probe peaks)
    probes: tuple = ()
    replays: list = field(default_factory=list)   #: (seq, predicted peak, fits) of the search at the answer
    notes: list = field(default_factory=list)

    def table(self) -> str:
        rows = [("plan", "lossy", "fitted longest seq", "peaks at probes " + "/".join(str(s) for s in self.probes))]
        for name, lossy, _r, fitted, peaks in self.fits:
            mark = "* " if name == self.plan.chosen.name else "  "
            rows.append((mark + name, "yes" if lossy else "no", "-" if fitted is None else f"{fitted:,}",
                         " / ".join(format_bytes(p) if isinstance(p, int) else str(p) for p in peaks)))
        widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
        return "\n".join("  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows)

    def summary(self) -> str:
        nxt = (f"; at {self.seq + self.step:,} tokens it needs {format_bytes(self.next_peak)}"
               if self.next_peak is not None else "")
        lines = [f"longest sequence that fits {format_bytes(self.budget)}"
                 + (f" per rank ({self.plan.world_size} ranks)" if self.plan.world_size > 1 else "")
                 + f": {self.seq:,} tokens (in steps of {self.step}) with {self.plan.chosen.name}",
                 f"  predicted peak {format_bytes(self.plan.peak_bytes)}{nxt}",
                 f"  pipeline: {', '.join(p.name for p in self.plan.passes) or '(none)'}; optimizer: {self.plan.optimizer}"]
        lines += [f"  note: {n}" for n in self.notes + self.plan.notes]
        lines += ["", "candidates (longest sequence fitted from the probe replays; the answer replayed):", self.table()]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"seq": self.seq, "step": self.step, "budget": self.budget, "next_peak": self.next_peak,
                "plan": self.plan.to_dict(), "probes": list(self.probes), "replays": self.replays,
                "candidates": [{"plan": n, "lossy": l, "restricted": r, "fitted_seq": f,
                                "probe_peaks": [p if isinstance(p, int) else None for p in peaks]}
                               for n, l, r, f, peaks in self.fits], "notes": self.notes}


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


def _neighbourhood(groups: dict, allowed_lossy: bool) -> list[tuple]:
    """The plan with every group's last option (the leanest each group offers), the same without each group,
    and with each other option of a group: 1 + groups + alternatives plans (of the full product's)."""
    keys = sorted(groups)
    full = {k: groups[k][-1] for k in keys}
    out = [tuple(full[k] for k in keys)]
    for k in keys:
        out.append(tuple(full[j] for j in keys if j != k))
        for o in groups[k][:-1]:
            out.append(tuple(o if j == k else full[j] for j in keys))
    seen, uniq = set(), []
    for opts in out:
        key = tuple(id(o) for o in opts)
        if key not in seen and not _conflict(opts):
            seen.add(key)
            uniq.append(opts)
    return uniq


def plan_max_seq(model: torch.nn.Module, make_inputs, memory_budget, allow: Iterable[str] = (), passes=None,
                 optimizer: str | None = "adamw", world_size: int = 1, *, step: int = 1024,
                 probes: tuple = (8192, 16384, 32768), max_len: int = 1 << 24, min_len: int | None = None,
                 device=None, loss_fn=None, max_replays: int = 12, screen: bool = True,
                 _cache: dict | None = None, **compile_options) -> MaxSeqResult:
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
       lengths): at each length every candidate still in the running is replayed (one shared replay); a
       candidate over the budget at a length no longer than one some candidate fits is out of the running.
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
    ``_cache``: a dict shared by calls for several budgets of the same model, inputs and options (the probe
    replays do not depend on the budget).
    """
    from effpass.config import _build_passes, default_pipeline
    from effpass.memory_options import declared_memory_options

    budget = parse_size(memory_budget, "memory_budget")
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step must be a positive number of tokens, got {step!r}")
    probes = tuple(sorted(set(int(p) for p in probes)))
    if len(probes) < 2 or probes[0] < 1:
        raise ValueError(f"probes must be at least two positive lengths, got {probes!r}")
    min_len = step if min_len is None else int(min_len)
    allow_t = _check_allow(allow, world_size)
    dev = _target_device(model, device)
    base = _build_passes(passes) if passes is not None else default_pipeline(dev)
    base_names = {p.name for p in base}
    notes: list[str] = []
    groups = _usable_options(model, base_names, allow_t, optimizer, world_size, notes, device=dev)
    p_bytes, floor = _parameter_floor(model, groups, world_size)
    if budget < floor:
        raise ValueError(f"memory_budget {memory_budget!r} ({format_bytes(budget)}) is below the parameters' own "
                         f"bytes ({format_bytes(p_bytes)}); no sequence can fit it")
    lossless_groups = {k: [o for o in v if o.lossless] for k, v in groups.items()}
    lossless_groups = {k: v for k, v in lossless_groups.items() if v}
    combos = _neighbourhood(lossless_groups, False)
    if allow_t:
        combos += [c for c in _neighbourhood(groups, True) if any(not o.lossless for o in c)]
    # the forward and backward are replayed with AdamW (or none); another optimizer is built alone on fake
    # parameters of the trainable shapes (with_optimizer), which cannot model a step inside the backward
    replay_opt = optimizer if optimizer in ("adamw", None) else "adamw"
    cands = []
    for opts in combos:
        opt_o = next((o for o in opts if o.optimizer), None)
        opt = opt_o.optimizer if opt_o else optimizer
        if any(o.optimizers and (opt not in o.optimizers or opt != replay_opt) for o in opts):
            continue
        cands.append(Candidate(options=opts, optimizer=opt))
    base_sharding = next((o for o in declared_memory_options(model, world_size=world_size)
                          if o.sharding and o.pass_name in base_names), None) if world_size > 1 else None
    unit_bytes = _largest_unit_bytes(model) if world_size > 1 else 0

    def pipeline_of(c):
        pipeline = _pipeline([p for p in base if not _is_sharding(p.name, model, world_size)], c)
        return [p for p in pipeline if not _is_sharding(p.name, model, world_size)]

    def finish(c, est):
        if c.optimizer is not None and c.optimizer != replay_opt:
            est = with_optimizer(est, c.optimizer, device=dev)
        sharding = next((o.sharding for o in c.options if o.sharding), None) or (
            base_sharding.sharding if base_sharding else None)
        if world_size > 1:
            est = fold_sharding(est, world_size, unit_bytes, sharding) if sharding else dataclasses.replace(
                est, world_size=world_size)
        return est

    cache: dict = {} if _cache is None else _cache

    def replay_many(cs, seq, full=not screen):
        """Estimates (or exceptions) of the candidates ``cs`` at ``seq``: one shared replay (``full``: every
        provisional figure among them confirmed at the third depth)."""
        twins = [c.without_optimizer_option(replay_opt) if c.optimizer != replay_opt else c for c in cs]
        keys = list(dict.fromkeys(t.replay_key() for t in twins))
        by_key = {t.replay_key(): t for t in twins}
        todo = [k for k in keys if (seq, k) not in cache]
        if todo:
            res = estimate_many(model, make_inputs(seq), [pipeline_of(by_key[k]) for k in todo], replay_opt,
                                device=dev, loss_fn=loss_fn, screen=not full, **compile_options)
            cache.update({(seq, k): r for k, r in zip(todo, res)})
        unsure = [k for k in keys if full and getattr(cache[(seq, k)], "provisional", False)]
        if unsure:
            opts = {k: v for k, v in compile_options.items() if k != "extrapolate"}
            res = confirm_many(model, make_inputs(seq), [pipeline_of(by_key[k]) for k in unsure],
                               [cache[(seq, k)] for k in unsure], replay_opt, device=dev, loss_fn=loss_fn, **opts)
            cache.update({(seq, k): r for k, r in zip(unsure, res)})
        got = {k: cache[(seq, k)] for k in keys}
        out = []
        for c, t in zip(cs, twins):
            r = got[t.replay_key()]
            if not isinstance(r, BaseException):
                try:
                    r = finish(c, r)
                except Exception as e:  # pragma: no cover
                    r = e
            out.append(r)
        return out

    # 1-2: probe, fit, solve
    peaks: dict[int, list] = {}
    for s in probes:
        peaks[s] = replay_many(cands, s)
    fits = []
    fit_fn: dict = {}
    for i, c in enumerate(cands):
        pts = [(s, peaks[s][i].peak_bytes) for s in probes if not isinstance(peaks[s][i], BaseException)]
        errs = [peaks[s][i] for s in probes if isinstance(peaks[s][i], BaseException)]
        if len(pts) < 2:
            c.error = f"{type(errs[0]).__name__}: {str(errs[0]).splitlines()[0][:120] if str(errs[0]) else ''}"
            fits.append((c, None, [c.error]))
            continue
        f = _fit(pts)
        fit_fn[id(c)] = f
        fits.append((c, _solve(f, budget, step, min_len, max_len), [p for _, p in pts]))
    ok = [(c, L, pk) for c, L, pk in fits if L is not None]
    if not ok:
        errors = "; ".join(f"{c.name}: {c.error}" for c, _, _ in fits[:3])
        raise RuntimeError(f"plan_max_seq: no plan could be replayed ({errors})")
    # 3: search for the longest length that some candidate fits, replaying every candidate still in the running
    # at each length (one shared replay per length). NOTE(every candidate): the probe fits only choose where
    # to look; a fit can be far off beyond the probes (Llama-3.1-8B at 80 GiB: the plan as given was fitted at
    # 126,976 tokens and fits 71,680), so comparing the others by their fits missed longer answers. A
    # candidate whose peak is over the budget at a length <= one that fits is out of the running (peaks
    # grow with the length), so after the first fitting length only the plans that still fit are replayed.
    live = [c for c, _, _ in ok]
    fitted = {id(c): L for c, L, _ in ok}
    known: dict[int, dict[int, Any]] = {   # seq -> id(candidate) -> estimate (the probes' replays to start)
        p: {id(c): peaks[p][i] for i, c in enumerate(cands) if id(c) in fitted
            and not isinstance(peaks[p][i], BaseException)} for p in probes}
    over_at = {id(c): min(p for p in probes if id(c) in known[p] and known[p][id(c)].peak_bytes > budget)
               for c in live if any(id(c) in known[p] and known[p][id(c)].peak_bytes > budget for p in probes)}
    replays: list = []
    lo = hi = None  # lo: some candidate fits; hi: none in the running fits (multiples of step)

    def at(s):
        """The smallest predicted peak among the candidates in the running at ``s`` (replaying those not yet
        replayed there), and that candidate."""
        got = known.setdefault(s, {})
        todo = [c for c in live if id(c) not in got]
        if todo:
            for c, r in zip(todo, replay_many(todo, s)):
                if isinstance(r, BaseException):
                    c.error = f"{type(r).__name__}: {str(r).splitlines()[0][:120] if str(r) else ''} (at {s:,} tokens)"
                    live.remove(c)
                    continue
                got[id(c)] = r
                if r.peak_bytes > budget:
                    over_at[id(c)] = min(over_at.get(id(c), s), s)
        here = [(got[id(c)].peak_bytes, i, c) for i, c in enumerate(live) if id(c) in got]
        if not here:
            raise RuntimeError(f"plan_max_seq: no plan could be replayed at {s:,} tokens "
                               f"({'; '.join(f'{c.name}: {c.error}' for c, _, _ in fits if c.error)[:400]})")
        peak, _, c = min(here, key=lambda t: (t[0], t[1]))
        replays.append((s, peak, peak <= budget))
        return peak, c

    s = max(min_len, max(fitted.values()))
    for _ in range(max_replays):
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
        # next: a secant step through the two nearest lengths' smallest peaks, kept inside the bracket
        pts = sorted((k, min(v[id(c)].peak_bytes for c in live if id(c) in v)) for k, v in known.items()
                     if any(id(c) in v for c in live))
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
        nxt = min(max(nxt, min_len), max_len)
        if any(r[0] == nxt for r in replays):  # searched there already
            break
        s = nxt
    def unscreened():
        """The same search without screening: every figure it uses confirmed at the third depth (the cached
        two-depth replays completed, not replayed again)."""
        return plan_max_seq(model, make_inputs, memory_budget, allow, passes, optimizer, world_size, step=step,
                            probes=probes, max_len=max_len, min_len=min_len, device=device, loss_fn=loss_fn,
                            max_replays=max_replays, screen=False, _cache=cache, **compile_options)

    if lo is None:
        peak, best_c = at(min_len)
        if peak > budget and screen:
            return unscreened()  # the error names a confirmed figure
        if peak > budget:
            # NOTE(budget-independent): every candidate is replayed at min_len (none is out of the running
            # before some length fits), so the smallest peak named is the smallest any plan reaches there
            raise MemoryBudgetError(
                f"nothing fits memory_budget {format_bytes(budget)} even at {min_len:,} tokens: the leanest plan "
                f"({best_c.name}) needs {format_bytes(peak)} ({peak} bytes) there",
                smallest=peak, plan=best_c, candidates=[c for c, _, _ in fits])
        lo = min_len
    if hi != lo + step and lo + step <= max_len:
        notes.append(f"search not converged in {max_replays} replays: {lo:,} fits; {lo + step:,} not replayed")
    if screen:
        # NOTE(screen): the pair that answers is confirmed at full depth (the third depth checks that every
        # count is affine in the number of blocks, else the whole model is replayed): each plan fitting L and
        # each plan replayed at L + step. If a confirmed figure changes the verdict, the search runs again
        # without screening.
        pair = [(lo, [c for c in live if id(c) in known[lo] and known[lo][id(c)].peak_bytes <= budget])]
        if lo + step <= max_len:
            pair.append((lo + step, [c for c in live if id(c) in known.get(lo + step, {})]))
        for s_, cs_ in pair:
            if not cs_:
                continue
            for c, r in zip(cs_, replay_many(cs_, s_, full=True)):
                if isinstance(r, BaseException):
                    return unscreened()
                known[s_][id(c)] = r
            peak_ = min(known[s_][id(c)].peak_bytes for c in cs_)
            replays[:] = [(x, peak_, peak_ <= budget) if x == s_ else (x, p, f) for x, p, f in replays]
        if not any(known[lo][id(c)].peak_bytes <= budget for c in pair[0][1]) or (
                len(pair) > 1 and any(known[lo + step][id(c)].peak_bytes <= budget for c in pair[1][1])):
            return unscreened()
    # the plan: among those fitting the longest length, lossless before lossy, unrestricted before restricted,
    # then the fewest FLOPs and options
    at_lo = [c for c in live if id(c) in known[lo] and known[lo][id(c)].peak_bytes <= budget]
    chosen = min(at_lo, key=lambda c: (c.lossy, c.restricted, known[lo][id(c)].flops, len(c.options)))
    if chosen.lossy and any(not c.lossy for c, _, _ in ok):
        notes.append(f"a lossy plan fits a longer sequence than every lossless one ({lo:,} tokens)")
    est = known[lo][id(chosen)]
    chosen.estimate, chosen.fits = est, True
    nxt_est = known.get(lo + step, {}).get(id(chosen))
    others = known.get(lo + step, {})
    reason = (f"the longest sequence any of {len(cands)} plans fits ({len(probes)} probe replays each to guess "
              f"it; every plan still in the running replayed at each length searched: "
              f"{len({s for s, *_ in replays})} lengths)")
    if others and lo + step <= max_len:
        notes.append(f"at {lo + step:,} tokens none of the {len(others)} plans replayed there fits (smallest "
                     f"{format_bytes(min(e.peak_bytes for e in others.values()))})")
    if chosen.restricted:
        notes.append("; ".join(f"{o.name}: {o.restricts}" for o in chosen.options if o.restricts))
    for o in chosen.options:
        if o.optimizer:
            notes.append(f"build the optimizer as {o.optimizer!r} for this plan ({o.cost})")
    plan = MemoryPlan(budget=budget, chosen=chosen, candidates=[chosen], passes=_pipeline(base, chosen),
                      optimizer=chosen.optimizer, world_size=world_size, reason=reason, notes=[])
    fit_rows = [(c.name, c.lossy, c.restricted, L, pk) for c, L, pk in fits]
    return MaxSeqResult(seq=lo, step=step, budget=budget, plan=plan,
                        next_peak=nxt_est.peak_bytes if nxt_est is not None else None, fits=fit_rows,
                        probes=probes, replays=replays, notes=notes)
