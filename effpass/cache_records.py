"""What the joint and post-grad passes did to a graph, kept for compile-cache hits.

On an FX-graph or AOTAutograd cache hit Inductor runs no joint or post-grad hook, so those passes' records (and
their dump files) would be missing from the report. On a miss they are saved under a key of the pipeline, the
lowering, the graph's code and its inputs (:func:`record_key`); on a hit they are replayed from that record store
(:func:`save_or_replay`).
"""
from __future__ import annotations

import hashlib
import os
from typing import Sequence

import torch
import torch.fx as fx

from .dump import DumpInstrument, RecordStore, write_atomic
from .manager import PassManager
from .pass_api import Phase
from .report import GraphReport, PassRecord

__all__ = ["record_key", "save_or_replay", "unrecorded_hit"]


def record_key(manager: PassManager, lowering: str, gm: fx.GraphModule, example_inputs: Sequence) -> str:
    """The key of a graph's late-phase records: the pipeline's uuid, the lowering, the graph's code, grad mode and
    the inputs' shapes, strides, dtypes, devices and requires_grad."""
    h = hashlib.sha256()
    h.update(manager.uuid([Phase.TORCH_IR, Phase.JOINT, Phase.POST_GRAD]).encode())
    h.update(lowering.encode())
    h.update(gm.code.encode())
    h.update(str(torch.is_grad_enabled()).encode())
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            h.update(f"{tuple(x.shape)}{x.stride()}{x.dtype}{x.device}{x.requires_grad}".encode())
        else:
            h.update(repr(x).encode())
    return h.hexdigest()


def unrecorded_hit(store: RecordStore, report: GraphReport, key: str, late: list[Phase]) -> bool:
    """A compile-cache hit (a late phase did not run) of which the record store holds no record: a compile stopped
    between the cache's write and the records', or a store cleared. The graph is then compiled again without the
    caches (by the backend), so that the report has every pass's record, never a hit that lost them."""
    ran = report.notes.get("_ran_phases", set())
    return any(p.value not in ran and store.load(f"{key}-{p.value}") is None for p in late)


def save_or_replay(store: RecordStore, dump: DumpInstrument | None, report: GraphReport, key: str,
                   late: list[Phase], n_records: int, files_before: set[str]) -> None:
    """Per late phase: if it ran (a cache miss), save its records (``report.records[n_records:]``) and the dump
    files they wrote; if it did not (a cache hit), add the saved records to ``report`` marked ``from_cache`` and
    write their dump files again (or one ``(cache)`` record saying nothing was saved). Sets ``report.cache``."""
    ran = report.notes.get("_ran_phases", set())
    new_records = report.records[n_records:]
    written = dump.written.get(report.graph_id, {}) if dump else {}
    for phase in late:
        phase_key = f"{key}-{phase.value}"
        if phase.value in ran:
            records = [r for r in new_records if r.phase == phase.value]
            files = {r.file: written[r.file] for r in records if r.file and r.file in written}
            inputs = {k: v for k, v in report.notes.get("_dump_inputs", {}).items()
                      if v in written and v not in files_before}
            files.update({v: written[v] for v in inputs.values()})
            figures = report.notes.get("figures", {}) if phase is Phase.POST_GRAD else None
            store.save(phase_key, records, files, inputs, figures)
            report.cache = report.cache or "miss"
            continue
        entry = store.load(phase_key)
        if entry is None:
            report.cache = "hit-unrecorded"
            report.add(PassRecord(name="(cache)", phase=phase.value, graph=phase.value, from_cache=True,
                                  error=None, stats={"note": "compile cache hit; no record of this phase's passes"}))
            continue
        report.cache = "hit"
        if entry.get("figures"):  # the graphs' figures as the compile that missed the cache read them
            report.notes.setdefault("figures", {}).update(entry["figures"])
        for d in entry["records"]:
            rec = PassRecord.from_json(d)
            rec.from_cache = True
            report.add(rec)
        if dump and report.dump_path:
            for name, text in entry.get("files", {}).items():
                write_atomic(os.path.join(report.dump_path, name), text)
            report.notes.setdefault("_dump_inputs", {}).update(entry.get("inputs", {}))
