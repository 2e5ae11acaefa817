"""Choose the passes that fit a training step into a memory budget with the least extra compute.

Tiers, tried in order:

1. lossless (always): activation checkpointing (``checkpoint_activations``, policies ``"ops"`` then
   ``"full"``), fused cross-entropy (``fuse_cross_entropy``, when that pass is registered) and, with
   ``world_size > 1``, FSDP sharding (``wrap_fsdp``; per-rank accounting, see ``fold_fsdp``). Gradients are
   those of the plain step.
2. lossy, only the techniques named in ``allow``: ``"nf4"`` / ``"int8"`` frozen base weights under LoRA
   (``quantize_linear``; needs ``inject_lora`` in the pipeline) and ``"adamw8bit"`` (torchao's 8-bit
   optimizer states).

Every candidate of a tier is replayed (:func:`~effpass.planning.estimate_memory`); among those whose
predicted peak fits the budget, the one with the least extra compute (FLOPs counted during the replay:
matmul/attention FLOPs from torch's flop counter plus one per element written by every other op, minus the
base plan's) wins, ties going to the smaller peak. The next tier is tried only when nothing in the
previous one fits. If nothing fits, :class:`MemoryBudgetError` names the smallest achievable peak and the
plan that reaches it.
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch

from .estimate import with_adamw8bit, MemoryEstimate, _storage_bytes, _target_device, estimate_memory, fold_fsdp, format_bytes, \
    parse_size, _largest_unit_bytes

__all__ = ["MemoryPlan", "Candidate", "MemoryBudgetError", "plan_memory", "LOSSY_TECHNIQUES", "plan_for_compile"]

#: what ``allow`` may name (lossy techniques), with what each does
LOSSY_TECHNIQUES = {
    "nf4": "NF4 (4-bit, double-quantized) frozen base weights under LoRA (quantize_linear scheme='nf4')",
    "int8": "int8 frozen base weights under LoRA (quantize_linear scheme='int8')",
    "adamw8bit": "8-bit AdamW states (torchao.optim.AdamW8bit): build the optimizer as torchao's AdamW8bit",
}
#: lossless techniques, tried without being allowed (named in ``allow`` they are accepted and ignored)
LOSSLESS_TECHNIQUES = ("checkpoint", "fuse_cross_entropy", "fsdp")


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
    checkpoint: str | None = None          # None, "ops", "full"
    fuse_cross_entropy: bool = False
    quantize: str | None = None            # None, "nf4", "int8"
    optimizer: str | None = "adamw"
    fsdp: bool = False
    estimate: MemoryEstimate | None = None
    extra_flops: int = 0
    fits: bool = False
    error: str | None = None

    @property
    def lossy(self) -> bool:
        return self.quantize is not None or self.optimizer == "adamw8bit"

    @property
    def name(self) -> str:
        parts = []
        if self.checkpoint:
            parts.append(f"checkpoint({self.checkpoint})")
        if self.fuse_cross_entropy:
            parts.append("fuse_cross_entropy")
        if self.fsdp:
            parts.append("fsdp")
        if self.quantize:
            parts.append(f"{self.quantize} base")
        if self.optimizer == "adamw8bit":
            parts.append("adamw8bit")
        return " + ".join(parts) or "as given"

    @property
    def peak_bytes(self) -> int | None:
        return self.estimate.peak_bytes if self.estimate else None

    def replay_key(self):
        return (self.checkpoint, self.fuse_cross_entropy, self.quantize, self.optimizer)


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
            if c.estimate is None:
                rows.append((c.name, "yes" if c.lossy else "no", c.error or "not evaluated", "-", "-", "-"))
                continue
            pct = f" ({100 * c.extra_flops / base_flops:+.1f}%)" if base_flops else ""
            rows.append((("* " if c is self.chosen else "  ") + c.name, "yes" if c.lossy else "no",
                         format_bytes(c.peak_bytes), "yes" if c.fits else "no",
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

    def to_dict(self) -> dict[str, Any]:
        return {"budget": self.budget, "chosen": self.chosen.name, "peak_bytes": self.peak_bytes,
                "reason": self.reason, "optimizer": self.optimizer, "world_size": self.world_size,
                "passes": [{"name": p.name, "options": p.options()} for p in self.passes],
                "candidates": [{"plan": c.name, "lossy": c.lossy, "peak_bytes": c.peak_bytes, "fits": c.fits,
                                "extra_flops": c.extra_flops, "error": c.error,
                                "peak_at": f"{c.estimate.peak_phase}: {c.estimate.peak_node}" if c.estimate else None}
                               for c in self.candidates],
                "notes": self.notes}


# ------------------------------------------------------------------------------------------------------
def _flops(n: float) -> str:
    for unit, size in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} FLOP"


def _registered(name: str) -> bool:
    from effpass.pass_api import registered_passes

    return name in registered_passes()


def _check_allow(allow) -> tuple[str, ...]:
    if allow is None:
        return ()
    if isinstance(allow, str):
        allow = [allow]
    out = []
    valid = sorted(LOSSY_TECHNIQUES) + list(LOSSLESS_TECHNIQUES)
    for a in allow:
        if not isinstance(a, str) or a.lower() not in valid:
            import difflib

            close = difflib.get_close_matches(str(a), valid, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"allow: {a!r} names no technique{hint}; lossy techniques: "
                             f"{sorted(LOSSY_TECHNIQUES)} (lossless ones {list(LOSSLESS_TECHNIQUES)} are always tried)")
        if a.lower() in LOSSY_TECHNIQUES:
            out.append(a.lower())
    return tuple(dict.fromkeys(out))


def _pipeline(base: list, cand: Candidate, lora_targets_quant_exclude: Sequence[str]) -> list:
    """The user's pipeline plus the candidate's passes (the user's own settings of a pass win)."""
    from effpass.pass_api import make_pass

    names = {p.name for p in base}
    out = list(base)
    if cand.checkpoint and "checkpoint_activations" not in names:
        out.append(make_pass("checkpoint_activations", {"policy": cand.checkpoint}))
    if cand.fuse_cross_entropy and "fuse_cross_entropy" not in names:
        out.append(make_pass("fuse_cross_entropy", {}))
    if cand.quantize and "quantize_linear" not in names:
        out.append(make_pass("quantize_linear", {"scheme": cand.quantize,
                                                  "exclude": list(lora_targets_quant_exclude)}))
    if cand.fsdp and "wrap_fsdp" not in names:
        out.append(make_pass("wrap_fsdp", {}))
    return out


def _output_heads(model) -> list[str]:
    """Module names of the output head (left in full precision under a quantized base, as QLoRA does)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return [n for n, m in model.named_modules() if head is not None and m is head and n]


def _candidates(base_names: set, allow: tuple, optimizer, world_size: int, has_lora: bool, notes: list):
    ckpts = [None] if "checkpoint_activations" in base_names else [None, "ops", "full"]
    ces = [False]
    if "fuse_cross_entropy" not in base_names:
        if _registered("fuse_cross_entropy"):
            ces = [False, True]
        else:
            notes.append("fuse_cross_entropy is not registered: plans without it")
    fsdps = [False, True] if world_size > 1 and "wrap_fsdp" not in base_names else [world_size > 1 and "wrap_fsdp" in base_names]
    quants = [None]
    for q in ("int8", "nf4"):
        if q in allow:
            if "quantize_linear" in base_names:
                notes.append(f"{q!r} allowed but the pipeline already has quantize_linear: left as given")
            elif not has_lora:
                notes.append(f"{q!r} allowed but the pipeline has no inject_lora (a quantized base must be "
                             f"frozen under adapters): not tried")
            else:
                quants.append(q)
    opts = [optimizer]
    if "adamw8bit" in allow:
        if optimizer == "adamw":
            opts.append("adamw8bit")
        else:
            notes.append(f"'adamw8bit' allowed but the optimizer is {optimizer!r}: not tried")
    lossless, lossy = [], []
    for q, o in itertools.product(quants, opts):
        for ck, ce, fs in itertools.product(ckpts, ces, fsdps):
            c = Candidate(checkpoint=ck, fuse_cross_entropy=ce, quantize=q, optimizer=o, fsdp=fs)
            (lossy if c.lossy else lossless).append(c)
    return lossless, lossy


def plan_memory(model: torch.nn.Module, example_inputs, memory_budget, allow: Iterable[str] = (), passes=None,
                optimizer: str | None = "adamw", world_size: int = 1, *, device=None, loss_fn=None,
                _cache: dict | None = None, **compile_options) -> MemoryPlan:
    """Choose a pipeline for ``model`` whose predicted training-step peak fits ``memory_budget``
    (``"24GiB"``, bytes; per rank when ``world_size > 1``). See the module docstring for the order.

    Raises :class:`MemoryBudgetError` (a ``ValueError``) naming the smallest achievable peak and its plan
    when nothing fits, ``ValueError`` for an unreadable budget, one below the parameters' own bytes, or an
    ``allow`` entry that names no technique.
    """
    from effpass.config import _build_passes, default_pipeline

    budget = parse_size(memory_budget, "memory_budget")
    allow_t = _check_allow(allow)
    dev = _target_device(model, device)
    base = _build_passes(passes) if passes is not None else default_pipeline(dev)
    base_names = {p.name for p in base}
    has_lora = "inject_lora" in base_names
    params = list(model.parameters())
    p_bytes = _storage_bytes(params)
    floor = p_bytes / (world_size if world_size > 1 else 1)
    if has_lora and ("nf4" in allow_t or "int8" in allow_t):
        floor = floor / (8 if "nf4" in allow_t else 4)
    if budget < floor:
        raise ValueError(f"memory_budget {memory_budget!r} ({format_bytes(budget)}) is below the parameters' own "
                         f"bytes ({format_bytes(p_bytes)}"
                         + (f" / {world_size} ranks" if world_size > 1 else "")
                         + (", quantized as allowed" if floor < p_bytes / max(world_size, 1) else "")
                         + "); no plan can fit it")
    notes: list[str] = []
    lossless, lossy = _candidates(base_names, allow_t, optimizer, world_size, has_lora, notes)
    lora_exclude = _output_heads(model)
    replays: dict = {} if _cache is None else _cache  # a caller planning several budgets shares the replays
    unit_bytes = _largest_unit_bytes(model) if world_size > 1 else 0

    def evaluate(c: Candidate):
        key = c.replay_key()
        if c.optimizer == "adamw8bit":  # the AdamW replay's forward/backward, torchao's states (analytic)
            same = Candidate(checkpoint=c.checkpoint, fuse_cross_entropy=c.fuse_cross_entropy, quantize=c.quantize,
                             optimizer="adamw")
            evaluate(same)
            if same.error:
                c.error = same.error
                return
            if key not in replays:
                est = replays[same.replay_key()]
                replays[key] = with_adamw8bit(est, est.trainable_numels)
        if key not in replays:
            try:
                pipeline = [p for p in _pipeline(base, c, lora_exclude) if p.name != "wrap_fsdp"]
                replays[key] = estimate_memory(model, example_inputs, passes=pipeline, optimizer=c.optimizer,
                                               device=dev, loss_fn=loss_fn, **compile_options)
            except Exception as e:  # a candidate that cannot be replayed is reported, not fatal
                replays[key] = e
        r = replays[key]
        if isinstance(r, Exception):
            c.error = f"{type(r).__name__}: {str(r).splitlines()[0][:120] if str(r) else ''}"
            return
        est = r
        if world_size > 1:
            est = fold_fsdp(est, world_size, unit_bytes) if c.fsdp else dataclasses.replace(est, world_size=world_size)
        c.estimate = est
        c.fits = est.peak_bytes <= budget

    considered: list[Candidate] = []
    chosen = None
    for tier_name, tier in (("lossless", lossless), ("lossy", lossy)):
        if not tier:
            continue
        for c in tier:
            evaluate(c)
        considered += tier
        done = [c for c in considered if c.estimate is not None]
        if not done:
            continue
        base_flops = done[0].estimate.flops if considered[0].estimate is not None else min(c.estimate.flops for c in done)
        for c in done:
            c.extra_flops = c.estimate.flops - base_flops
        fitting = [c for c in tier if c.fits]
        if fitting:
            chosen = min(fitting, key=lambda c: (c.extra_flops, c.fsdp, c.peak_bytes))
            break
    done = [c for c in considered if c.estimate is not None]
    if chosen is None:
        if not done:
            errors = "; ".join(f"{c.name}: {c.error}" for c in considered[:3])
            raise RuntimeError(f"plan_memory: no plan could be replayed ({errors})")
        best = min(done, key=lambda c: c.peak_bytes)
        hint = ""
        missing = sorted(set(LOSSY_TECHNIQUES) - set(allow_t))
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
                  f"{sum(c.fits for c in considered)} fitting {'lossy' if chosen.lossy else 'lossless'} plans")
        if chosen.lossy:
            reason += "; no lossless plan fits"
    if chosen.optimizer == "adamw8bit":
        notes.append("build the optimizer as torchao.optim.AdamW8bit(trainable parameters) for this plan")
    pipeline = _pipeline(base, chosen, lora_exclude)
    return MemoryPlan(budget=budget, chosen=chosen, candidates=considered, passes=pipeline,
                      optimizer=chosen.optimizer, world_size=world_size, reason=reason, notes=notes)


def plan_for_compile(model, passes, memory_budget, allow, example_inputs, *, optimizer="adamw", world_size=1,
                     **compile_options):
    """For ``effpass.compile(model, memory_budget=...)``: (the pipeline to compile with, the plan)."""
    if example_inputs is None:
        raise ValueError("memory_budget needs example_inputs= (a tuple of arguments or a dict of keyword "
                         "arguments for one training step, e.g. {'input_ids': ..., 'labels': ...}): the plan is "
                         "chosen by replaying that step")
    plan = plan_memory(model, example_inputs, memory_budget, allow=allow, passes=passes, optimizer=optimizer,
                       world_size=world_size, **compile_options)
    import logging

    logging.getLogger("effpass.planning").info("%s", plan.summary())
    return plan.passes, plan
