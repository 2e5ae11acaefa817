"""The planner's candidates: every combination of declared memory options (at most one per group) it may add
to the pipeline as given (:func:`usable_options`, :func:`candidates`), what a plan is (:class:`Candidate`,
:class:`MemoryPlan`) and the error when none fits (:class:`MemoryBudgetError`).

The planner knows techniques only through the registry (:mod:`effpass.memory_options`): every registered
pass declares the memory options it offers (``Pass.memory_options``: its options, lossless or lossy, what
they change, the phase that needs them, the passes they require, a group), and non-pass options (an
optimizer with smaller states) are declared with ``register_memory_option``.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from effpass.quantized import storage_bytes

from .result import MemoryEstimate, format_bytes

__all__ = ["techniques", "MemoryBudgetError", "Candidate", "MemoryPlan", "usable_options", "candidate_tiers",
           "neighbourhood", "optimizers_agree", "pipeline_with", "batch_rows", "check_allow", "parameter_floor",
           "is_sharding", "format_flops", "search_candidates", "tiers", "agrees_with_replay"]


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
    #: CUDA plans: a compute-bound estimate of the step's time on the planned GPU (``PlanSetup.step_seconds``)
    est_step_s: float | None = None
    #: CUDA plans that use host memory: a phase's transfers over the host link outlast its compute
    transfer_bound: bool = False

    @property
    def host_bytes(self) -> int:
        """Host memory the plan holds (offloaded activations, optimizer states on the host); 0 when none."""
        return self.estimate.host_bytes if self.estimate else 0

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
        """What the device must hold (``MemoryEstimate.device_peak_bytes``: CUDA's reserved segments where
        modelled, else the live peak)."""
        return self.estimate.device_peak_bytes if self.estimate else None

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
        timed = any(c.est_step_s is not None for c in self.candidates)
        host = any(c.host_bytes for c in self.candidates)
        rows = [("plan", "lossy", "predicted peak", "fits", "extra compute") + (("est. step",) if timed else ())
                + (("host",) if host else ()) + ("peak at",)]
        base_flops = self._base_flops()
        for c in self.candidates:
            if c.pruned and c.estimate is None:
                if c.floor is not None and c.floor > self.budget:
                    rows.append(("  " + c.name, "yes" if c.lossy else "no",
                                 f"not replayed: >= {format_bytes(c.floor)}", "no", "-") + (("-",) if timed else ())
                                + (("-",) if host else ()) + ("start of step alone exceeds the budget",))
                else:
                    rows.append(("  " + c.name, "yes" if c.lossy else "no", "not replayed", "-", "-")
                                + (("-",) if timed else ()) + (("-",) if host else ())
                                + ("restricted; an unrestricted plan fits",))
                continue
            if c.estimate is None:
                rows.append((c.name, "yes" if c.lossy else "no", c.error or "not evaluated", "-", "-")
                            + (("-",) if timed else ()) + (("-",) if host else ()) + ("-",))
                continue
            pct = f" ({100 * c.extra_flops / base_flops:+.1f}%)" if base_flops else ""
            step = ((f"{c.est_step_s * 1e3:.3g} ms" + (" transfer-bound" if c.transfer_bound else "")
                     if c.est_step_s is not None else "-",) if timed else ())
            step += ((format_bytes(c.host_bytes) if c.host_bytes else "-",) if host else ())
            rows.append((("* " if c is self.chosen else "  ") + c.name, "yes" if c.lossy else "no",
                         ("~" if c.estimate.provisional else "") + format_bytes(c.peak_bytes),
                         "yes" if c.fits else "no",
                         f"{format_flops(c.extra_flops)}{pct}"
                         # device FLOPs: an optimizer stepped on the host leaves its step's FLOPs out
                         + (" (device; host step not counted)" if c.estimate.optimizer_d2h_bytes else "")) + step
                        + (f"{c.estimate.peak_phase}: {c.estimate.peak_node}"[:60],))
        widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
        return "\n".join("  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows)

    def _base_flops(self) -> int:
        base = next((c for c in self.candidates if c.estimate is not None), None)
        return base.estimate.flops if base else 0

    def summary(self) -> str:
        lines = [f"memory plan for a budget of {format_bytes(self.budget)}"
                 + (f" per rank ({self.world_size} ranks)" if self.world_size > 1 else "") + f": {self.chosen.name}",
                 f"  predicted peak {format_bytes(self.peak_bytes)}; why: {self.reason}",
                 *([f"  host memory {format_bytes(self.chosen.host_bytes)} ({self.chosen.host_bytes} bytes: pinned "
                    f"offload buffers and optimizer states on the host)"
                    + (f"; est. step {self.chosen.est_step_s * 1e3:.3g} ms" if self.chosen.est_step_s else "")
                    + (", transfer-bound (the host link's transfers outlast the compute they overlap)"
                       if self.chosen.transfer_bound else "")] if self.chosen.host_bytes else []),
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
                                "extra_flops": c.extra_flops, "est_step_s": c.est_step_s, "error": c.error,
                                "host_bytes": c.host_bytes, "transfer_bound": c.transfer_bound,
                                "pruned": c.pruned,
                                "floor_bytes": c.floor,
                                "provisional": bool(c.estimate and c.estimate.provisional),
                                "peak_at": f"{c.estimate.peak_phase}: {c.estimate.peak_node}" if c.estimate else None}
                               for c in self.candidates],
                "notes": self.notes}


def format_flops(n: float) -> str:
    for unit, size in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} FLOP"


def check_allow(allow, world_size: int = 2) -> tuple[str, ...]:
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


def pipeline_with(base: list, cand: Candidate) -> list:
    """The user's pipeline plus the candidate's passes (the user's own settings of a pass win)."""
    from effpass.pass_api import make_pass

    names = {p.name for p in base}
    return list(base) + [make_pass(o.pass_name, dict(o.options)) for o in cand.options
                         if o.pass_name and o.pass_name not in names]


def batch_rows(example_inputs) -> int | None:
    """Tokens in the step's batch: the element count of the largest integer input (token ids); None if none."""
    from torch.utils._pytree import tree_flatten

    n = [x.numel() for x in tree_flatten(example_inputs)[0]
         if isinstance(x, torch.Tensor) and not x.is_floating_point() and not x.is_complex() and x.dim() >= 1]
    return max(n) if n else None


def usable_options(model, base_names: set, allow: tuple, optimizer, world_size: int, notes: list,
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


def candidate_tiers(groups: dict, optimizer):
    """(lossless, lossy) candidates: every combination of at most one option per group of ``groups`` whose passes
    do not conflict and whose optimizers agree."""
    keys = sorted(groups)
    lossless, lossy = [], []
    for combo in itertools.product(*[[None] + groups[k] for k in keys]):
        opts = tuple(o for o in combo if o is not None)
        if _conflict(opts):
            continue
        if not optimizers_agree(opts, optimizer):
            continue
        opt_o = next((o for o in opts if o.optimizer), None)
        c = Candidate(options=opts, optimizer=opt_o.optimizer if opt_o else optimizer)
        (lossy if c.lossy else lossless).append(c)
    # lossy plans: those with fewer lossy options first (a stable order for reports)
    lossy.sort(key=lambda c: sum(not o.lossless for o in c.options))
    return lossless, lossy


def optimizers_agree(opts, optimizer) -> bool:
    """The options ``opts`` of one plan agree on its optimizer (``optimizer``: the one asked for): at most one
    option builds another optimizer, every option that names the optimizers it works with gets one of them, and an
    optimizer built alone on the AdamW replay (not replayed itself) is not combined with such an option."""
    from effpass.memory_options import replayed_optimizer

    opt_os = [o for o in opts if o.optimizer]
    if len(opt_os) > 1:
        return False
    opt_o = opt_os[0] if opt_os else None
    if any(o.optimizers and (opt_o.optimizer if opt_o else optimizer) not in o.optimizers for o in opts):
        return False
    # NOTE(replay): an optimizer that is not replayed is built alone on the AdamW twin's forward and backward,
    # which cannot model an option that runs the optimizer inside the backward
    return not (opt_o is not None and any(o.optimizers for o in opts) and not replayed_optimizer(opt_o.optimizer))


def neighbourhood(groups: dict, allowed_lossy: bool) -> list[tuple]:
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


def parameter_floor(model, groups, world_size) -> tuple[int, int]:
    """(the parameters' own bytes, the smallest they can become under the usable options) - an early bound."""
    p_bytes = storage_bytes(list(model.parameters()))
    floor = p_bytes / max(world_size, 1)
    if any(o.group for g in groups.values() for o in g if "parameters" in o.changes):
        floor = floor / 8  # no declared parameter format holds less than 4 bits per 32-bit value
    return p_bytes, floor


def is_sharding(pass_name: str, model, world_size: int) -> bool:
    """A pass whose declared option is folded (sharding): not replayed (one rank is replayed)."""
    from effpass.pass_api import registered_passes

    klass = registered_passes().get(pass_name)
    return klass is not None and any(o.sharding for o in klass.memory_options(None, world_size=max(world_size, 2)))


def search_candidates(setup, replay_opt) -> list[Candidate]:
    """``plan_max_seq``'s candidates: the neighbourhood of the leanest lossless plan (and of the leanest plan with the
    lossy options allowed) of ``setup`` (a ``PlanSetup``); ``replay_opt``: the optimizer the replays run."""
    groups = setup.groups
    lossless_groups = {k: [o for o in v if o.lossless] for k, v in groups.items()}
    lossless_groups = {k: v for k, v in lossless_groups.items() if v}
    combos = neighbourhood(lossless_groups, False)
    if setup.allow:
        combos += [c for c in neighbourhood(groups, True) if any(not o.lossless for o in c)]
    cands, seen = [], set()
    for opts in combos:
        if not agrees_with_replay(opts, setup.optimizer, replay_opt):
            # NOTE(repair): an optimizer-only option that disagrees with the plan's others (another option that
            # builds an optimizer, e.g. step_in_backward + AdamW on the host, or one that steps in the backward
            # with the replayed optimizer) is left out of that plan, not the plan dropped: the neighbourhood of
            # {adamw on host, step in backward + adamw on host} is then {step in backward + adamw on host}
            opts = tuple(o for o in opts if not (o.optimizer and not o.pass_name))
            if not agrees_with_replay(opts, setup.optimizer, replay_opt):
                continue
        key = tuple(id(o) for o in opts)
        if key in seen:
            continue
        seen.add(key)
        opt_o = next((o for o in opts if o.optimizer), None)
        cands.append(Candidate(options=opts, optimizer=opt_o.optimizer if opt_o else setup.optimizer))
    return cands


def agrees_with_replay(opts, optimizer, replay_opt) -> bool:
    """The options of one plan agree on its optimizer (``optimizers_agree``), and an option that names the
    optimizers it works with gets the replayed one (another is built alone on the AdamW replay)."""
    if not optimizers_agree(opts, optimizer):
        return False
    opt_o = next((o for o in opts if o.optimizer), None)
    opt = opt_o.optimizer if opt_o else optimizer
    return not any(o.optimizers and opt != replay_opt for o in opts)


def tiers(cands: list) -> list[list]:
    """``cands`` grouped in the order plans are chosen: lossless unrestricted, lossless restricted, lossy
    unrestricted, lossy restricted (empty tiers left out; the order within a tier kept)."""
    keys = sorted({(c.lossy, c.restricted) for c in cands})
    return [[c for c in cands if (c.lossy, c.restricted) == k] for k in keys]
