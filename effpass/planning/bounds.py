"""Lower bounds of a plan's peak known without replaying it (:func:`gradient_only_bound`), for the length search
(:mod:`effpass.planning.maxseq`): a plan that adds only gradient-only options (``MemoryOption.changes ==
("gradients",)``, e.g. ``step_in_backward``) to a replayed plan peaks at least where the replayed plan's forward and
backward peak without their gradients. Over the budget, that plan is over without a replay of its own."""
from __future__ import annotations

from dataclasses import dataclass

from .result import format_bytes

__all__ = ["LowerBound", "gradient_only_bound", "is_gradient_only_extension", "probe_skip", "bound_note"]


@dataclass(frozen=True)
class LowerBound:
    """Not a replay: a lower bound of a plan's peak at a length (``device_peak_bytes``), from the replay of
    ``base`` (the plan without its gradient-only options) there."""

    device_peak_bytes: int
    base: str


def _gradient_only(extra) -> bool:
    return bool(extra) and all(tuple(o.changes) == ("gradients",) and not o.optimizer and not o.sharding
                               for o in extra)


def gradient_only_bound(cand, replayed) -> LowerBound | None:
    """The largest lower bound of ``cand``'s peak from ``replayed`` (pairs of a candidate and its estimate at one
    length, one device): each replayed plan whose options are ``cand``'s less only gradient-only options, with the
    same optimizer, bounds it by its start bytes plus its non-gradient peak (the most its forward and backward
    hold above the start besides the gradients made so far, :func:`~effpass.planning.tracker.gradient_split`), or
    its peak less all its gradients where that is more (:func:`_peak_less_gradients`).

    NOTE(why a bound): such options only make gradients live shorter (``step_in_backward`` hands each one to the
    optimizer inside the backward); every other allocation of the forward and backward stays (the optimizer's
    per-parameter work inside the backward adds). Where the figures are extrapolated (depth, tile count) the
    non-gradient peak is a max over places each affine in the count, extended through the last two counts: no
    more than the replay's (the premise of every extrapolated "over" verdict). None when no replayed plan
    bounds ``cand``."""
    best = None
    for base, est in replayed:
        if isinstance(est, (BaseException, LowerBound)) or not is_gradient_only_extension(cand, base):
            continue
        n = est.start_bytes + max(est.non_gradient_peak, _peak_less_gradients(est))
        if n > est.start_bytes and (best is None or n > best.device_peak_bytes):
            best = LowerBound(n, base.name)
    return best


def is_gradient_only_extension(cand, base) -> bool:
    """``cand`` is ``base`` plus gradient-only options (``MemoryOption.changes == ("gradients",)``, no optimizer
    of their own), with the same optimizer."""
    mine, theirs = {id(o) for o in cand.options}, {id(o) for o in base.options}
    return (base is not cand and base.optimizer == cand.optimizer and theirs < mine
            and _gradient_only([o for o in cand.options if id(o) not in theirs]))


def probe_skip(cand, probed, step: int) -> str | None:
    """Why ``cand`` need not be probed (None: it must be): ``probed`` pairs each probed candidate with its
    estimates at the probe lengths (a dict length -> estimate). A plan of gradient-only options over a probed
    ``base`` peaks at least at ``base``'s peak less its gradients (:func:`gradient_only_bound`); where those
    gradients are less than what one ``step`` of length adds to ``base``'s peak (the slope through the two
    longest probes), it fits at most one step beyond the longest length ``base`` fits, so its probes would move
    where the search starts by a step at most (Llama-3.1-8B QLoRA: step_in_backward saves 160 MiB of LoRA gradients, a step of
    1,024 tokens adds 345 MiB). Its figures are replayed where the search needs them."""
    for base, ests in probed:
        if not is_gradient_only_extension(cand, base):
            continue
        (s1, e1), (s2, e2) = sorted(ests.items())[-2:]
        if any(isinstance(e, BaseException) for e in (e1, e2)) or e2.peak_phase not in ("forward", "backward"):
            continue
        grow = (e2.device_peak_bytes - e1.device_peak_bytes) * step // (s2 - s1)
        if 0 <= e2.gradients < grow:
            return (f"not probed: it saves at most {base.name}'s gradients ({format_bytes(e2.gradients)}), less than "
                    f"a step of {step:,} tokens adds ({format_bytes(grow)})")
    return None


def _peak_less_gradients(est) -> int:
    """The step's peak above the start less every gradient byte (no more than those live there), where the peak is
    in the forward or backward: the non-gradient bytes at the peak's own moment. NOTE(crossing): the peak
    extrapolated place by place can be at a place that overtakes the short replays' (Llama-3.1-8B QLoRA at 221,184
    tokens: the attention backward's, 468 MB above the non-gradient peak extended through the replayed counts)."""
    if est.peak_phase not in ("forward", "backward"):
        return 0
    return est.step_peak_bytes - est.gradients


def bound_note(cand, seq: int, b: LowerBound, budget: int) -> str:
    return (f"{cand.name} not replayed at {seq:,} tokens: it adds only gradient-only options to {b.base}, so it peaks "
            f"at least at {format_bytes(b.device_peak_bytes)} there ({b.base}'s figures less its gradients), over the "
            f"budget {format_bytes(budget)}")
