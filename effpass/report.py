"""What effpass did: per-graph pass records, readable from Python (``effpass.report(model)``) and dumps."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from numbers import Number
from typing import Any

__all__ = ["PassRecord", "GraphReport", "CompileReport", "register_renderer", "nonzero_stats", "explain"]


@dataclass
class PassRecord:
    name: str
    phase: str
    graph: str  # module, torch_ir, joint, inference, forward, backward
    changed: bool = False
    stats: dict[str, Any] = field(default_factory=dict)
    skipped: list[dict[str, Any]] = field(default_factory=list)
    ms: float = 0.0
    nodes_before: int = 0
    nodes_after: int = 0
    ops_before: dict[str, int] = field(default_factory=dict)
    ops_after: dict[str, int] = field(default_factory=dict)
    file: str | None = None
    error: str | None = None
    traceback: str | None = None
    fell_back: bool = False
    #: why an unchanged pass changed nothing (``PassResult.why_unchanged``)
    why_unchanged: str = ""
    #: True when this record was replayed from effpass's record store on a compile-cache hit
    from_cache: bool = False
    #: a callable returning statistics that change after the hook ran (``PassResult.live_stats``)
    live_stats: Any = field(default=None, repr=False, compare=False)

    def current_stats(self) -> dict[str, Any]:
        """``stats`` updated with the live statistics, read now."""
        return {**self.stats, **self.live_stats()} if self.live_stats is not None else self.stats

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(dataclasses.replace(self, live_stats=None, stats=dict(self.current_stats())))
        d.pop("live_stats")
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "PassRecord":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass
class GraphReport:
    """Everything that happened to one graph Dynamo handed over (or to the eager model: ``module``)."""

    graph_id: str
    records: list[PassRecord] = field(default_factory=list)
    #: "miss" (passes ran), "hit" (records replayed from the store), "hit-unrecorded", or "" (not lowered)
    cache: str = ""
    dump_path: str | None = None
    notes: dict[str, Any] = field(default_factory=dict)
    #: total_ms (the backend call), lower_ms (Inductor/AOTAutograd without effpass hooks), late_pass_ms
    timing: dict[str, float] = field(default_factory=dict)
    #: weak references to the modules being called when Dynamo compiled this graph (which model it is of),
    #: and, for a string backend's graph, to those of every model whose call has run it since (Dynamo
    #: reuses a graph for another model of the same class and shapes without calling the backend)
    modules: list[Any] = field(default_factory=list, repr=False, compare=False)

    def belongs_to(self, model: Any) -> bool:
        """Whether this graph was compiled while ``model`` (or the module it wraps) was being called."""
        targets = {id(model), id(getattr(model, "_orig_mod", model))}
        return any(r() is not None and id(r()) in targets for r in self.modules)

    def add(self, record: PassRecord) -> None:
        self.records.append(record)

    def stats(self, pass_name: str, graph: str | None = None) -> dict[str, Any]:
        """Statistics of ``pass_name`` on this graph, numbers summed over its hooks."""
        _check_pass_name(pass_name, self.records)
        return _merge([r.current_stats() for r in self.records if r.name == pass_name and (graph is None or r.graph == graph)])


@dataclass
class CompileReport:
    """All graphs compiled through one effpass backend (one ``effpass.compile`` call)."""

    module: GraphReport = field(default_factory=lambda: GraphReport("module"))
    graphs: list[GraphReport] = field(default_factory=list)
    #: the validated options, JSON-able (``effpass.config.describe_options``)
    options: dict[str, Any] = field(default_factory=dict)

    def to_html(self, path: str) -> str:
        """Write a self-contained HTML page of this report to ``path`` (returns the path). The renderer
        lives in the tool package ``effpass.inspect.html``, registered under ``"html"`` (see
        :func:`register_renderer`; ``import effpass`` registers it)."""
        return _renderer("html")(self, path)

    def for_model(self, model: Any) -> "CompileReport":
        """The part of this report about ``model``: its module phase and the graphs compiled while it was
        being called (a string backend is shared by every model compiled with the same options)."""
        return CompileReport(module=self.module, graphs=[g for g in self.graphs if g.belongs_to(model)])
    #: the memory planner's choice (``effpass.compile(model, memory_budget=...)``), else None
    memory_plan: Any = None
    #: ``effpass.compile(model, verify=True)``: the first-call verifier (its ``.report`` after the first call)
    verifier: Any = None

    @property
    def verification(self):
        """The :class:`effpass.verification.VerifyReport` of ``verify=True`` (None before the first call / without)."""
        return getattr(self.verifier, "report", None)

    def records(self, pass_name: str | None = None) -> list[PassRecord]:
        out = list(self.module.records)
        for g in self.graphs:
            out += g.records
        return [r for r in out if pass_name is None or r.name == pass_name]

    def stats(self, pass_name: str, graph: str | None = None) -> dict[str, Any]:
        """Statistics of ``pass_name`` over every graph (numbers summed; other values listed).

        An unknown name (neither registered nor in this report) raises ``ValueError`` naming the valid ones;
        a registered pass that has not run yet gives ``{}``."""
        _check_pass_name(pass_name, self.records())
        return _merge([r.current_stats() for r in self.records(pass_name) if graph is None or r.graph == graph])

    def failures(self) -> list[PassRecord]:
        return [r for r in self.records() if r.error]

    def summary(self) -> str:
        """One line per pass and graph with its non-zero statistics (zero counters are in ``stats()`` and the
        dump's JSON), then why an unchanged pass changed nothing and every reason a site was left alone."""
        lines = []
        for g in [self.module, *self.graphs]:
            if not g.records:
                continue
            lines.append(f"{g.graph_id}{' (cache ' + g.cache + ')' if g.cache else ''}")
            for r in g.records:
                flag = "ERROR " + r.error if r.error else ("changed" if r.changed else "unchanged")
                lines.append(f"  {r.graph:<9} {r.name:<24} {flag:<10} {r.ms:8.1f} ms  {_fmt_stats(r.current_stats())}")
                lines += [f"      {line}" for line in explain(r.why_unchanged if not r.changed else "", r.skipped)]
            fb = g.notes.get("lowering_fallback")
            if fb:
                lines.append(f"  lowering fell back to {fb['to']!r}: {'; '.join(fb['errors'])}")
            if g.notes.get("recompiled"):
                lines.append(f"  {g.notes['recompiled']}")
        return "\n".join(lines) or "(no passes ran)"


# Renderers: the core must not import a tool, so tools register how to render a report in a format.
_RENDERERS: dict[str, Any] = {}


def register_renderer(fmt: str, fn) -> None:
    """Register ``fn(report, path) -> path`` as the renderer of format ``fmt`` (e.g. ``"html"``)."""
    _RENDERERS[fmt] = fn


def _renderer(fmt: str):
    if fmt not in _RENDERERS:
        raise RuntimeError(f"no {fmt!r} renderer is registered (registered: {sorted(_RENDERERS)}); "
                           f"`import effpass` registers the built-in ones (effpass.inspect.html)")
    return _RENDERERS[fmt]


def _check_pass_name(name: str, records: list[PassRecord]) -> None:
    from .pass_api import registered_passes

    here = sorted({r.name for r in records})
    if name in here:
        return
    registered = registered_passes()
    if name in registered:
        return
    import difflib

    close = difflib.get_close_matches(str(name), [*here, *registered], n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(f"unknown pass {name!r}{hint}; passes in this report: {here}; registered passes: "
                     f"{sorted(registered)}")


def _merge(dicts: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for d in dicts:
        for k, v in d.items():
            if k not in out:
                out[k] = v if not isinstance(v, list) else list(v)
            elif isinstance(v, bool) or not isinstance(v, Number) or not isinstance(out[k], Number):
                if isinstance(out[k], list) and isinstance(v, list):
                    out[k] = out[k] + v
                elif isinstance(out[k], dict) and isinstance(v, dict):
                    merged = dict(out[k])
                    for kk, vv in v.items():
                        merged[kk] = merged.get(kk, 0) + vv if isinstance(vv, Number) else vv
                    out[k] = merged
                else:
                    out[k] = v
            else:
                out[k] = out[k] + v
    return out


def nonzero_stats(stats: dict[str, Any]) -> dict[str, Any]:
    """The statistics a summary line shows: numbers other than 0 (booleans and text always; lists and
    dicts when not empty). Zero counters stay in ``stats()`` and the JSON."""
    return {k: v for k, v in stats.items()
            if isinstance(v, bool) or not (isinstance(v, Number) and v == 0 or isinstance(v, (list, dict)) and not v)}


def explain(why_unchanged: str, skipped: list[Any]) -> list[str]:
    """Lines saying why a pass changed nothing and every distinct reason a site was left alone (with how
    many sites and the first of them)."""
    lines = [f"why unchanged: {why_unchanged}"] if why_unchanged else []
    reasons: dict[str, list[str]] = {}
    for item in skipped:
        reason = str(item.get("reason", item)) if isinstance(item, dict) else str(item)
        site = str(item.get("site", "")) if isinstance(item, dict) else ""
        reasons.setdefault(reason, []).append(site)
    for reason, sites in reasons.items():
        where = f"{len(sites)} sites, e.g. {sites[0]}" if len(sites) > 1 else (sites[0] or "1 site")
        lines.append(f"left alone ({where}): {reason}")
    return lines


def _fmt_stats(stats: dict[str, Any]) -> str:
    parts = []
    for k, v in nonzero_stats(stats).items():
        if isinstance(v, (dict, list)):
            continue
        parts.append(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}")
    return " ".join(parts) or "(all statistics 0)"
