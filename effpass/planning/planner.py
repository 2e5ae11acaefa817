"""Choose the passes that fit a training step into a memory budget with the least extra compute
(:func:`plan_memory`), and the planner's entry points for ``effpass.compile(model, memory_budget=...)``.

``plan_memory`` is a short list of steps: the set-up shared with ``plan_max_seq``
(:func:`effpass.planning.setup.prepare`), the candidates (:mod:`effpass.planning.candidates`: every combination
of at most one declared option per group; tiers: lossless options, always tried, then lossy options, only the
techniques named in ``allow``), the search (:mod:`effpass.planning.search`: every candidate of a tier replayed,
:func:`~effpass.planning.estimate_memory`; candidates that differ only in what is folded - sharding - or in the
optimizer share one replay of the forward and backward; among those whose predicted peak fits the budget, the
one with the least extra compute wins), then the answer and why. If nothing fits, :class:`MemoryBudgetError`
names the smallest achievable peak and the plan that reaches it. The longest sequence that fits:
:mod:`effpass.planning.maxseq`.
"""
from __future__ import annotations

from typing import Iterable

import torch

from .candidates import (Candidate, MemoryBudgetError, MemoryPlan, batch_rows, candidate_tiers, check_allow,
                         format_flops, pipeline_with, techniques, usable_options)
from .maxseq import MaxSeqResult, plan_max_seq
from .replay import target_device
from .result import format_bytes
from .search import search
from .setup import prepare

__all__ = ["MemoryPlan", "Candidate", "MemoryBudgetError", "plan_memory", "plan_for_compile", "techniques",
           "plan_max_seq", "MaxSeqResult"]


def plan_memory(model: torch.nn.Module, example_inputs, memory_budget, allow: Iterable[str] = (), passes=None,
                optimizer: str | None = "adamw", world_size: int = 1, *, device=None, loss_fn=None,
                sequence_parallel: int = 1, prune: bool = True, cache: dict | None = None, gpu: str | None = None,
                host_budget=None, allocator: str = "default", **compile_options) -> MemoryPlan:
    """Choose a pipeline for ``model`` whose predicted training-step peak fits ``memory_budget``
    (``"24GiB"``, bytes; per rank when ``world_size > 1``). See the module docstring for the order.

    ``sequence_parallel`` (> 1: one rank of a ``shard_sequence`` group of that many ranks, which must divide
    ``world_size``): the step is replayed on the rank's ``seq / sequence_parallel`` tokens and what the sharded
    attention adds is folded on (:mod:`effpass.planning.sharding`).

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

    ``cache``: a dict shared by calls for several budgets of the same model, inputs, pipeline and options
    (replays do not depend on the budget; a later call reuses them).

    ``device="cuda"``: the plan fits the caching allocator's reserved segments (made on any machine); each
    candidate gets a compute-bound estimate of its step time on ``gpu`` (``"h100"``, the default, or ``"h200"``:
    :mod:`effpass.devices`), ``Candidate.est_step_s``, shown in the table. Offloaded activations
    (``offload_activations``) and AdamW's states on the host (``adamw_offload``) are candidates there, predicted
    on any machine (:mod:`effpass.planning.host_memory`): each with its host bytes and its transfers over the
    GPU's host link in the step time (``transfer_bound`` when they outlast the compute they overlap).
    ``host_budget`` (``"512GiB"``, bytes; default None: unbounded): a plan holding more host memory is not a
    candidate (listed with why). ``allocator="expandable"`` (CUDA plans): the reserved bytes fitted to the budget are
    those of the caching allocator with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (default: its default
    mode); step_in_backward with AdamW on the host (``effpass.HostOffloadAdamW``) is a candidate too.

    Raises :class:`MemoryBudgetError` (a ``ValueError``) naming the smallest achievable peak and its plan
    when nothing fits, ``ValueError`` for an unreadable budget, one below the parameters' own bytes, or an
    ``allow`` entry that names no technique.
    """
    return _plan(model, example_inputs, memory_budget, allow, passes, optimizer, world_size, device=device,
                 loss_fn=loss_fn, sequence_parallel=sequence_parallel, prune=prune, cache=cache, gpu=gpu,
                 host_budget=host_budget, allocator=allocator, compile_options=compile_options)


def _plan(model, example_inputs, memory_budget, allow, passes, optimizer, world_size, *, device=None, loss_fn=None,
          sequence_parallel: int = 1, prune: bool = True, cache: dict | None = None, graph_only: bool = False,
          gpu: str | None = None, host_budget=None, allocator: str = "default", compile_options) -> MemoryPlan:
    """:func:`plan_memory`; ``graph_only``: only options that act on graphs (planning on the first call)."""
    if sequence_parallel == 1:
        return _plan_one_rank(model, example_inputs, memory_budget, allow, passes, optimizer, world_size,
                              device=device, loss_fn=loss_fn, prune=prune, cache=cache, graph_only=graph_only,
                              sp_terms=None, gpu=gpu, host_budget=host_budget, allocator=allocator,
                              compile_options=compile_options)
    # one rank of a shard_sequence group: seq/sp tokens replayed, the sharded attention's terms folded on
    from .sharding import sequence_parallel_replay

    if world_size % sequence_parallel:
        raise ValueError(f"sequence_parallel={sequence_parallel} must divide world_size={world_size}")
    local, restore_sp, terms = sequence_parallel_replay(model, example_inputs, sequence_parallel)
    try:
        return _plan_one_rank(model, local, memory_budget, allow, passes, optimizer, world_size, device=device,
                              loss_fn=loss_fn, prune=prune, cache=cache, graph_only=graph_only,
                              sp_terms=(sequence_parallel, terms), gpu=gpu, host_budget=host_budget,
                              allocator=allocator,
                              compile_options=compile_options)
    finally:
        restore_sp()


def _plan_one_rank(model, example_inputs, memory_budget, allow, passes, optimizer, world_size, *, device, loss_fn,
                   prune, cache, graph_only, sp_terms, compile_options, gpu=None, host_budget=None,
                   allocator: str = "default") -> MemoryPlan:
    """The plan of one rank's replayed step: set-up, candidates, search, answer."""
    setup = prepare(model, memory_budget, allow, passes, optimizer, world_size, device=device, graph_only=graph_only,
                    rows=batch_rows(example_inputs), gpu_name=gpu, host_budget=host_budget, allocator=allocator)
    lossless, lossy = candidate_tiers(setup.groups, optimizer)
    found = search(setup, example_inputs, lossless, lossy, loss_fn=loss_fn, replays=cache, prune=prune,
                   sp_terms=sp_terms, compile_options=compile_options)
    if found.chosen is None:
        raise _nothing_fits(setup, found.considered)
    chosen, considered = found.chosen, found.considered
    notes = setup.notes
    notes += _plan_notes(chosen, considered, setup.budget)
    return MemoryPlan(budget=setup.budget, chosen=chosen, candidates=considered,
                      passes=pipeline_with(setup.base, chosen), optimizer=chosen.optimizer,
                      world_size=world_size, reason=_reason(chosen, considered, setup.budget), notes=notes)


def _nothing_fits(setup, considered) -> Exception:
    """The error when no candidate fits: the smallest achievable peak and its plan (or why none was replayed)."""
    done = [c for c in considered if c.estimate is not None]
    over_host = [c for c in considered if c.error and c.error.startswith("over the host budget")]
    if not done and over_host and len(over_host) == sum(1 for c in considered if c.error):
        return MemoryBudgetError(f"no plan fits: every plan replayed is over the host budget "
                                 f"({over_host[0].name}: {over_host[0].error})", candidates=considered)
    if not done:
        errors = "; ".join(f"{c.name}: {c.error}" for c in considered[:3])
        return RuntimeError(f"plan_memory: no plan could be replayed ({errors})")
    best = min(done, key=lambda c: c.peak_bytes)
    hint = ""
    missing = sorted(t for t, (ll, _) in techniques(max(setup.world_size, 2)).items()
                     if not ll and t not in setup.allow)
    if missing:
        hint = f"; allow=[...] may add lossy techniques: {missing}"
    if over_host:
        hint += (f"; {len(over_host)} plan(s) left out as over host_budget {format_bytes(setup.host_budget)} (e.g. "
                 f"{over_host[0].name!r}: {over_host[0].error})")
    return MemoryBudgetError(
        f"no plan fits memory_budget {format_bytes(setup.budget)}: the smallest achievable predicted peak is "
        f"{format_bytes(best.peak_bytes)} ({best.peak_bytes} bytes) with plan {best.name!r}{hint}",
        smallest=best.peak_bytes, plan=best, candidates=considered)


def _reason(chosen, considered, budget) -> str:
    """Why ``chosen`` (the plan's ``reason``)."""
    plain = considered[0]
    if chosen is plain:
        reason = (f"the pipeline as given fits ({format_bytes(chosen.peak_bytes)} <= {format_bytes(budget)}); "
                  f"nothing added")
    else:
        reason = (f"the pipeline as given needs {format_bytes(plain.peak_bytes) if plain.estimate else '?'}; "
                  f"{chosen.name} fits ({format_bytes(chosen.peak_bytes)} <= {format_bytes(budget)}) with the least "
                  f"extra compute ({format_flops(chosen.extra_flops)}) among the "
                  f"{sum(c.fits for c in considered)} fitting {'lossy' if chosen.lossy else 'lossless'} plans"
                  + (" replayed" if any(c.pruned for c in considered) else ""))
        if chosen.lossy:
            reason += "; no lossless plan fits"
    if chosen.host_bytes:  # plans without host memory are preferred: none of them fits
        reason += (f"; it holds {format_bytes(chosen.host_bytes)} of host memory (no plan without host memory "
                   f"fits)")
    if chosen.restricted:  # plans without restrictions are preferred: none of them fits
        reason += "; no plan without a restriction on the training loop fits"
    return reason


def _plan_notes(chosen, considered, budget) -> list[str]:
    """What the user must do for the plan (optimizer, restrictions) and which figures were screened or pruned."""
    notes = []
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
    return notes


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

    base = _build_passes(passes) if passes is not None else default_pipeline(target_device(model, None))
    groups = usable_options(model, {p.name for p in base}, check_allow(allow, world_size), optimizer, world_size,
                             [], device=target_device(model, None))
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
        plan = _plan(self.model, inputs, budget, allow, base_passes, optimizer, world_size, graph_only=True,
                     compile_options=opts)
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
