"""Dumps: one folder per compiled graph with its input graphs, one runnable file per changing pass, and
``index.json`` (per pass: name, phase, graph, changed, statistics, milliseconds, node counts, op
histograms before and after). Every file is written to a temporary name and renamed, and the index is
rewritten after each pass, so a crash mid-compile leaves a readable folder.

Also the record store: on an Inductor/AOTAutograd cache hit no joint or post-grad pass runs, so their
records and dump files are kept in ``<inductor cache dir>/effpass-records/<key>.json`` and replayed.
"""
from __future__ import annotations

import json
import os
import re
import tempfile
from typing import Any

import torch.fx as fx

from .graph import runnable_source
from .manager import Instrument
from .report import GraphReport, PassRecord

__all__ = ["DumpInstrument", "write_atomic", "claim_graph_dir", "RecordStore", "INDEX", "graph_index"]

INDEX = "index.json"


def write_atomic(path: str, text: str) -> None:
    d = os.path.dirname(path) or "."
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def claim_graph_dir(dump_dir: str, stem: str) -> str:
    """Create and return a fresh ``dump_dir/<stem>_NNN`` folder (safe with concurrent compiles)."""
    os.makedirs(dump_dir, exist_ok=True)
    i = 0
    while True:
        path = os.path.join(dump_dir, f"{stem}_{i:03d}")
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            i += 1


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


class DumpInstrument(Instrument):
    """Writes the dump of every graph whose report has a ``dump_path``."""

    def __init__(self, options_summary: dict[str, Any] | None = None):
        self.options_summary = options_summary or {}
        self._counters: dict[str, int] = {}
        #: files written per graph and phase group, so the record store can replay them on a cache hit
        self.written: dict[str, dict[str, str]] = {}

    def _next(self, report: GraphReport, label: str) -> str:
        n = self._counters.get(report.graph_id, 0)
        self._counters[report.graph_id] = n + 1
        return f"{n:02d}_{_safe(label)}.py"

    def _write_graph(self, report: GraphReport, label: str, gm: fx.GraphModule, title: str) -> str:
        name = self._next(report, label)
        try:
            text = runnable_source(gm, title=title)
        except Exception as e:  # a dump must never break a compile
            text = f"# could not render this graph as Python: {type(e).__name__}: {e}\n'''\n{gm.graph}\n'''\n"
        write_atomic(os.path.join(report.dump_path, name), text)
        self.written.setdefault(report.graph_id, {})[name] = text
        return name

    def graph_input(self, report: GraphReport, graph_kind: str, gm) -> None:
        if not report.dump_path:
            return
        name = self._write_graph(report, f"input_{graph_kind}", gm, f"effpass dump: {report.graph_id}, {graph_kind} graph as received")
        report.notes.setdefault("_dump_inputs", {})[graph_kind] = name
        self.write_index(report)

    def after_pass(self, report: GraphReport, record: PassRecord, gm) -> None:
        if not report.dump_path:
            return
        if record.changed and gm is not None:
            record.file = self._write_graph(report, f"{record.graph}_{record.name}", gm,
                                            f"effpass dump: {report.graph_id}, {record.graph} graph after pass {record.name}")
        self.write_index(report)

    def write_index(self, report: GraphReport) -> None:
        if not report.dump_path:
            return
        index = graph_index(report, self.options_summary)
        write_atomic(os.path.join(report.dump_path, INDEX), json.dumps(index, indent=1, default=str))


def graph_index(report: GraphReport, options_summary: dict[str, Any] | None = None) -> dict[str, Any]:
    """What ``index.json`` holds for one graph (also what ``effpass.report(model).to_html()`` renders).

    ``timing`` is written when the backend call finished (its absence marks a compile that did not
    finish); ``dynamo`` names Dynamo's compile id (frame/recompile) and the graph-break reasons Dynamo
    had counted in this process so far. ``memory_plan`` (a JSON-able dict a memory planner leaves in
    ``report.notes["memory_plan"]``) is copied when present: the HTML report renders it. ``figures`` holds, per
    lowered graph kind (forward, backward, inference), what ``effpass.graph_figures`` reads from its metadata.
    """
    from . import __version__

    index: dict[str, Any] = {
        "effpass_version": __version__,
        "graph_id": report.graph_id,
        "cache": report.cache,
        "options": options_summary or {},
        "inputs": report.notes.get("_dump_inputs", {}),
        "passes": [r.to_json() for r in report.records],
    }
    if report.timing:
        index["timing"] = dict(report.timing)
    if report.notes.get("dynamo"):
        index["dynamo"] = report.notes["dynamo"]
    if report.notes.get("memory_plan") is not None:
        index["memory_plan"] = report.notes["memory_plan"]
    if report.notes.get("figures"):
        index["figures"] = report.notes["figures"]
    return index


class RecordStore:
    """Records and dump files of the phases that a compile-cache hit skips, keyed by graph + pipeline."""

    def __init__(self, root: str | None = None):
        if root is None:
            try:
                from torch._inductor.runtime.cache_dir_utils import cache_dir

                root = cache_dir()
            except Exception:  # pragma: no cover
                root = os.path.join(tempfile.gettempdir(), "effpass")
        self.root = os.path.join(root, "effpass-records")

    def _path(self, key: str) -> str:
        return os.path.join(self.root, f"{key}.json")

    def save(self, key: str, records: list[PassRecord], files: dict[str, str], inputs: dict[str, str],
             figures: dict[str, Any] | None = None) -> None:
        try:
            os.makedirs(self.root, exist_ok=True)
            write_atomic(self._path(key), json.dumps({"records": [r.to_json() for r in records], "files": files,
                                                      "inputs": inputs, "figures": figures or {}}, default=str))
        except OSError:  # pragma: no cover - a read-only cache dir costs only the replay
            pass

    def load(self, key: str) -> dict[str, Any] | None:
        try:
            with open(self._path(key)) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None
