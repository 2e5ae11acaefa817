"""What :func:`effpass.planning.plan_max_seq` answers (:class:`MaxSeqResult`): the longest sequence, its plan and how
it was found, as a summary, a table and a dict for JSON."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .candidates import MemoryPlan
from .result import format_bytes

__all__ = ["MaxSeqResult"]


@dataclass
class MaxSeqResult:
    """``plan_max_seq``'s answer: the longest sequence ``seq`` (a multiple of ``step``) whose predicted peak
    fits the budget, the plan that fits it, and how it was found."""

    seq: int
    step: int
    budget: int
    plan: MemoryPlan
    next_peak: int | None                 #: predicted peak at seq + step with the same plan (> budget), None at max_len
    next_peak_bound: bool = False         #: next_peak extrapolated over the tile count: a lower bound of the replay's
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
        bound = " (extrapolated over the tile count: a lower bound)" if self.next_peak_bound else ""
        nxt = (f"; at {self.seq + self.step:,} tokens it needs {'at least ' * self.next_peak_bound}"
               f"{format_bytes(self.next_peak)}{bound}" if self.next_peak is not None else "")
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
                "next_peak_is_lower_bound": self.next_peak_bound,
                "plan": self.plan.to_dict(), "probes": list(self.probes), "replays": self.replays,
                "candidates": [{"plan": n, "lossy": l, "restricted": r, "fitted_seq": f,
                                "probe_peaks": [p if isinstance(p, int) else None for p in peaks],
                                # why it has no fit (not probed, or its replay's error), else None
                                "unfitted": next((p for p in peaks if isinstance(p, str)), None) if f is None else None}
                               for n, l, r, f, peaks in self.fits], "notes": self.notes}
