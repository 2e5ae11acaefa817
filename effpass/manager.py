"""The pass manager: orders passes from their declarations and runs their hooks.

It owns every cross-cutting concern, so passes stay small: ordering (networkx), conflicts, the disable
list, bisection, scoping contexts, timing, provenance (``node.meta["effpass_pass"]`` names the pass that
made a node), rollback on failure (or ``strict`` re-raise), and instruments (dumps) around each hook.
"""
from __future__ import annotations

import dataclasses
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence, TypeVar

import networkx as nx
import torch
import torch.fx as fx

from .facts import Fact
from .graph import GraphCheckpoint, op_histogram
from .pass_api import Note, Pass, PassResult, Phase, PHASE_HOOKS
from .report import GraphReport, PassRecord
from .scope import Scope

__all__ = ["PassManager", "PassContext", "order_passes", "PipelineError", "EffpassPassError",
           "WrongResultError", "collect_facts"]


N = TypeVar("N", bound=Note)
F = TypeVar("F", bound=Fact)


class PipelineError(ValueError):
    """The pipeline cannot be ordered: a cycle or a conflict between two passes."""


class EffpassPassError(RuntimeError):
    """A pass failed in strict mode."""


class WrongResultError(RuntimeError):
    """A pass found a site where going on would compute a silently wrong result (e.g. packed examples that
    would attend to each other). Never rolled back, never skipped, never caught by a lowering fallback:
    the message names the site and how to avoid it."""


def order_passes(passes: Sequence[Pass], *, check_conflicts: bool = True) -> list[Pass]:
    """Order ``passes`` so every ``run_after`` edge holds, keeping the user's order where free.

    Raises :class:`PipelineError` naming both passes for a conflict (unless ``check_conflicts=False``, for
    listing a whole registry), and the passes of a cycle.
    """
    by_name = {p.name: p for p in passes}
    for p in passes:
        for other in (p.conflicts_with if check_conflicts else ()):
            if other in by_name:
                raise PipelineError(f"pass {p.name!r} conflicts with pass {other!r}: remove one of them")
    g = nx.DiGraph()
    index = {p.name: i for i, p in enumerate(passes)}
    g.add_nodes_from(index)
    for p in passes:
        for before in p.run_after:
            if before in by_name:
                g.add_edge(before, p.name)
    try:
        order = list(nx.lexicographical_topological_sort(g, key=index.__getitem__))
    except nx.NetworkXUnfeasible:
        cycle = nx.find_cycle(g)
        names = " -> ".join([a for a, _ in cycle] + [cycle[0][0]])
        raise PipelineError(f"passes form an ordering cycle through run_after: {names}") from None
    return [by_name[n] for n in order]


def collect_facts(passes: Iterable[Pass]) -> dict[type[Fact], Fact]:
    """The facts (:mod:`effpass.facts`) the passes declare, by class. Raises :class:`PipelineError` naming both
    passes when two declare different values of one fact, and ``TypeError`` for a declaration that is not a
    :class:`~effpass.facts.Fact`."""
    facts: dict[type[Fact], Fact] = {}
    owners: dict[type[Fact], str] = {}
    for p in passes:
        for fact in p.facts():
            if not isinstance(fact, Fact):
                raise TypeError(f"pass {p.name!r}: facts() must return effpass.facts.Fact instances, got "
                                f"{type(fact).__name__} {fact!r}")
            kind = type(fact)
            if kind in facts and facts[kind] != fact:
                raise PipelineError(f"passes {owners[kind]!r} and {p.name!r} declare different {kind.__name__} "
                                    f"facts ({facts[kind]!r} and {fact!r}): remove one of them or make them agree")
            facts.setdefault(kind, fact)
            owners.setdefault(kind, p.name)
    return facts


@dataclass
class PassContext:
    """What a hook may know about where it runs. Built by the manager, one per hook call."""

    pass_name: str
    phase: Phase
    #: "module", "torch_ir", "joint", "inference", "forward" or "backward"
    graph_kind: str
    scope: Scope
    pipeline: tuple[Pass, ...] = ()
    model: torch.nn.Module | None = None
    example_inputs: Sequence[Any] | None = None
    device: torch.device | None = None
    #: per Dynamo graph, shared by all phases and passes. Passes leave typed notes (:class:`Note`) with
    #: :meth:`leave` / :meth:`read`; string keys belong to the backend and the dumps
    notes: dict[Any, Any] = field(default_factory=dict)
    #: module phase only: set False by a pass that compiled submodules itself (FSDP units)
    compile_root: bool = True
    #: module phase only: ``backend_factory()`` returns an effpass backend for this pipeline
    backend_factory: Any = None
    lowering: str = "inductor"
    #: module phase only: the caller's torch.compile arguments (fullgraph, dynamic), for passes that
    #: compile submodules themselves
    compile_kwargs: dict[str, Any] = field(default_factory=dict)

    #: compute statistics that cost extra work (a dump is written or the user asked: ``detailed_stats``)
    detailed_stats: bool = False
    #: joint phase: for each ``primals_*`` input, whether it holds (part of) a model parameter
    #: (:func:`effpass.graph.parameter_input_flags`; None where unknown)
    parameter_inputs: tuple[bool, ...] | None = None
    #: the facts the pipeline's passes declare (:func:`collect_facts`, filled by the manager); None: collected
    #: from ``pipeline`` when first asked
    facts: dict[type[Fact], Fact] | None = None

    def allows(self, node: fx.Node) -> bool:
        """Whether this pass may act on ``node`` (targets/exclude globs and skip/only decorators)."""
        return self.scope.allows(node)

    def leave(self, note: Note) -> None:
        """Leave a typed note for a later phase on this graph (replaces an earlier note of its class)."""
        if not isinstance(note, Note):
            raise TypeError(f"ctx.leave takes an effpass.Note, got {type(note).__name__}")
        self.notes[type(note)] = note

    def read(self, kind: type[N]) -> N | None:
        """The note of class ``kind`` an earlier phase left on this graph, or None."""
        if not (isinstance(kind, type) and issubclass(kind, Note)):
            raise TypeError(f"ctx.read takes a subclass of effpass.Note, got {kind!r}")
        return self.notes.get(kind)

    def fact(self, kind: type[F]) -> F | None:
        """The fact of class ``kind`` (:mod:`effpass.facts`) a pass of this pipeline declares, or None. How a
        pass reads another pass's choice (the autocast dtype, whether the loss is scaled)."""
        if not (isinstance(kind, type) and issubclass(kind, Fact)):
            raise TypeError(f"ctx.fact takes a subclass of effpass.facts.Fact, got {kind!r}")
        if self.facts is None:
            self.facts = collect_facts(self.pipeline)
        return self.facts.get(kind)

    def find_pass(self, name: str) -> Pass | None:
        """The pipeline's pass called ``name``, or None. For the core's own use: a pass reads another pass's
        choice through a fact (:meth:`fact`), never by its name."""
        return next((p for p in self.pipeline if p.name == name), None)


class Instrument:
    """Called around every hook the manager runs. Subclass and pass to the manager (dumps, tracing)."""

    def before_pass(self, session: "GraphReport", record: PassRecord, gm) -> None:
        pass

    def after_pass(self, session: "GraphReport", record: PassRecord, gm) -> None:
        pass

    def graph_input(self, session: "GraphReport", graph_kind: str, gm) -> None:
        pass


class PassManager:
    def __init__(self, passes: Sequence[Pass], *, strict: bool = False, bisect: int | None = None,
                 disable: Iterable[str] = (), instruments: Sequence[Instrument] = ()):
        self.ordered: list[Pass] = order_passes(list(passes))
        disable = set(disable)
        active = [p for p in self.ordered if p.name not in disable]
        if bisect is not None:
            active = active[:bisect]
        self.active: list[Pass] = active
        #: what the active passes declare for each other (:mod:`effpass.facts`), collected before any hook runs
        self.facts: dict[type[Fact], Fact] = collect_facts(active)
        self.strict = strict
        self.instruments = list(instruments)
        self._stale = False  # the graph being run has changed since its code was generated (run_graph_phase)

    # -- queries ------------------------------------------------------------------------------------
    def fact(self, kind: type[F]) -> F | None:
        """The fact of class ``kind`` an active pass declares, or None (as :meth:`PassContext.fact`)."""
        return self.facts.get(kind)

    def passes_for(self, phase: Phase) -> list[Pass]:
        return [p for p in self.active if phase in type(p).phases()]

    def uuid(self, phases: Iterable[Phase]) -> str:
        import hashlib

        from . import _source_digest

        h = hashlib.sha256(_source_digest().encode())
        for phase in phases:
            for p in self.passes_for(phase):
                h.update(f"{phase.value}:{p.uuid()}".encode())
        return h.hexdigest()

    # -- running ------------------------------------------------------------------------------------
    def run_module_phase(self, model: torch.nn.Module, report: GraphReport, **ctx_kwargs) -> PassContext:
        """Run every module-level hook in order on the eager model. Failures raise (the model may be
        half-prepared, which cannot be rolled back safely)."""
        last_ctx = PassContext(pass_name="", phase=Phase.MODULE, graph_kind="module", scope=Scope(""),
                               pipeline=tuple(self.active), facts=self.facts, model=model, **ctx_kwargs)
        done: list[str] = []
        for p in self.passes_for(Phase.MODULE):
            ctx = dataclasses.replace(last_ctx, pass_name=p.name,
                                      scope=Scope(p.name, p.targets, p.exclude, root=model))
            record = PassRecord(name=p.name, phase=Phase.MODULE.value, graph="module")
            t0 = time.perf_counter()
            try:
                result = p.prepare_module(model, ctx)
            except Exception as e:
                record.error = f"{type(e).__name__}: {e}"
                report.add(record)
                if isinstance(e, (ValueError, TypeError, WrongResultError)):
                    raise
                raise EffpassPassError(
                    f"pass {p.name!r} failed at module level: {type(e).__name__}: {e}; passes that ran before: {done}"
                ) from e
            record.ms = (time.perf_counter() - t0) * 1e3
            result = result or PassResult()
            record.changed, record.stats, record.skipped = bool(result.changed), dict(result.stats), list(result.skipped)
            record.why_unchanged = "" if record.changed else (result.why_unchanged or _default_why(record))
            record.live_stats = result.live_stats
            report.add(record)
            for inst in self.instruments:
                inst.after_pass(report, record, None)
            done.append(p.name)
            last_ctx = dataclasses.replace(ctx, pass_name="")
        return last_ctx

    def run_graph_phase(self, phase: Phase, gm: fx.GraphModule, report: GraphReport, graph_kind: str,
                        regenerate: bool = True, **ctx_kwargs) -> bool:
        """Run every hook of ``phase`` on ``gm`` in order. Returns whether any pass changed it. ``regenerate``
        False: the caller regenerates ``gm``'s code itself if it changed (not done here)."""
        passes = self.passes_for(phase)
        if not passes:
            return False
        changed_any = False
        if phase is Phase.TORCH_IR:
            # NOTE(dumps): canonicalised first, so the dump's input graph is what the passes see and each
            # pass's diff shows only what that pass changed
            changed_any = self._canonicalize(gm, report)
        for inst in self.instruments:
            inst.graph_input(report, graph_kind, gm)
        done: list[str] = []
        # NOTE(recompile): a GraphModule's Python code is generated once, after the phase, not after every pass
        # that changed the graph (passes read and rewrite ``gm.graph``; none runs ``gm``). An instrument (a dump)
        # reads the code after each pass, so with one the code is regenerated after each.
        outer, self._stale = self._stale, False  # (a pass may compile a graph of its own)
        for p in passes:
            model = ctx_kwargs.get("model")
            ctx = PassContext(pass_name=p.name, phase=phase, graph_kind=graph_kind,
                              scope=Scope(p.name, p.targets, p.exclude, root=model),
                              pipeline=tuple(self.active), facts=self.facts, notes=report.notes, **ctx_kwargs)
            changed_any |= self._run_hook(p, phase, gm, ctx, report, done)
            done.append(p.name)
        if self._stale and regenerate:
            gm.recompile()
        self._stale = outer
        return changed_any

    def _regenerate(self, gm: fx.GraphModule) -> None:
        """``gm``'s code is out of date: regenerated now if an instrument reads it after each pass, else once
        at the end of the phase (:meth:`run_graph_phase`)."""
        if self.instruments:
            gm.recompile()
        else:
            self._stale = True

    def _canonicalize(self, gm: fx.GraphModule, report: GraphReport) -> bool:
        """One spelling per op before the torch-IR passes match (:mod:`effpass.canonicalize`); on any error the
        graph is restored and the passes see it as Dynamo made it (strict: raise)."""
        from .canonicalize import canonicalize

        snapshot = GraphCheckpoint(gm.graph)
        try:
            stats = canonicalize(gm)
        except Exception as e:
            if self.strict:
                raise EffpassPassError(f"canonicalizing {report.graph_id} failed: {type(e).__name__}: {e}") from e
            snapshot.restore()
            gm.recompile()
            warnings.warn(f"effpass: canonicalizing {report.graph_id} failed, the torch-IR passes see the graph as "
                          f"Dynamo made it. Reason: {type(e).__name__}: {e}", RuntimeWarning, stacklevel=3)
            return False
        report.notes["canonicalized"] = stats
        return any(v for k, v in stats.items() if k != "inplace_kept")

    def _run_hook(self, p: Pass, phase: Phase, gm: fx.GraphModule, ctx: PassContext, report: GraphReport,
                  done: list[str]) -> bool:
        graph = gm.graph
        record = PassRecord(name=p.name, phase=phase.value, graph=ctx.graph_kind)
        record.nodes_before = len(graph.nodes)
        record.ops_before = op_histogram(graph)
        before_nodes = set(graph.nodes)
        snapshot = GraphCheckpoint(graph)
        for inst in self.instruments:
            inst.before_pass(report, record, gm)
        t0 = time.perf_counter()
        try:
            result = getattr(p, PHASE_HOOKS[phase])(gm, ctx) or PassResult()
            if not isinstance(result, PassResult):
                raise TypeError(f"hook returned {type(result).__name__}, expected PassResult or None")
            if result.changed:
                graph.lint()
                self._regenerate(gm)
        except Exception as e:
            record.ms = (time.perf_counter() - t0) * 1e3
            record.error = f"{type(e).__name__}: {e}"
            record.traceback = traceback.format_exc(limit=8)
            if isinstance(e, WrongResultError):  # NOTE: rolling back would leave the wrong result in place
                report.add(record)
                raise
            if self.strict:
                report.add(record)
                for inst in self.instruments:
                    inst.after_pass(report, record, None)
                raise EffpassPassError(
                    f"pass {p.name!r} failed on {report.graph_id} ({ctx.graph_kind} graph): {type(e).__name__}: {e}; "
                    f"passes that ran before on this graph: {done or 'none'}") from e
            snapshot.restore()
            self._regenerate(gm)
            record.changed = False
            record.fell_back = True
            record.nodes_after = len(graph.nodes)
            record.ops_after = record.ops_before
            report.add(record)
            warnings.warn(f"effpass: pass {p.name!r} failed on {report.graph_id} ({ctx.graph_kind} graph) and was "
                          f"skipped; the graph is as it was before the pass. Reason: {type(e).__name__}: {e}",
                          RuntimeWarning, stacklevel=2)
            for inst in self.instruments:
                inst.after_pass(report, record, gm)
            return False
        record.ms = (time.perf_counter() - t0) * 1e3
        record.changed = bool(result.changed)
        record.stats = dict(result.stats)
        record.live_stats = result.live_stats
        record.skipped = list(result.skipped)
        record.why_unchanged = "" if record.changed else (result.why_unchanged or _default_why(record))
        if record.changed:
            for n in graph.nodes:
                if n not in before_nodes:
                    n.meta.setdefault("effpass_pass", p.name)
        record.nodes_after = len(graph.nodes)
        record.ops_after = op_histogram(graph) if record.changed else record.ops_before
        report.add(record)
        for inst in self.instruments:
            inst.after_pass(report, record, gm)
        return record.changed


def _default_why(record: PassRecord) -> str:
    """Why an unchanged pass changed nothing, when its hook did not say."""
    if record.skipped:
        return f"{len(record.skipped)} site(s) left alone (reasons below)"
    where = "model" if record.graph == "module" else f"{record.graph} graph"
    return f"its {record.phase} hook found nothing to act on in this {where}"
