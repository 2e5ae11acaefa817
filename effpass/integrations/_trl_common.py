"""What effpass's routes of TRL's trainers share: finding the effpass backend of a model under TRL's, accelerate's
and PEFT's wrappers, deciding whether its pipeline fuses the loss, and counting routed and unrouted work (with the
reasons) in the model's report (``effpass.report(model).module.notes[key]``)."""
from __future__ import annotations

from typing import Any

from ..backend import MODEL_BACKENDS, compiled_backend, pipeline_names

__all__ = ["unwrap", "backend_of", "fused_backend", "note"]


def unwrap(trainer, model):
    """The Hugging Face model under accelerate's and PEFT's wrappers."""
    acc = getattr(trainer, "accelerator", None)
    inner = acc.unwrap_model(model) if acc is not None else model
    get_base = getattr(inner, "get_base_model", None)
    return get_base() if callable(get_base) and hasattr(inner, "peft_config") else inner


def backend_of(*models, containing: bool = False):
    """The effpass backend of the first of ``models`` effpass compiled in place; with ``containing``, also of an
    effpass-compiled model that holds one of them (a PEFT model around the Hugging Face model TRL patched)."""
    for m in models:
        be = compiled_backend(m) if m is not None else None
        if be is not None:
            return be
    if containing:
        for outer, be in list(MODEL_BACKENDS.items()):
            if compiled_backend(outer) is be and any(any(x is m for x in outer.modules()) for m in models if m is not None):
                return be
    return None


def fused_backend(*models, containing: bool = False) -> tuple[str | None, Any]:
    """``(why not, backend)``: why the loss of these models cannot be fused by effpass (None when it can)."""
    be = backend_of(*models, containing=containing)
    if be is None:
        return "the model is not compiled by effpass", None
    if "fuse_cross_entropy" not in pipeline_names(be):
        return "the model's effpass pipeline has no fuse_cross_entropy (the logits are kept on request)", be
    return None, be


def note(be, key: str, counter: str, why: str | None = None, counters: tuple[str, ...] = ()) -> None:
    """Add one to ``counter`` in ``be``'s report under ``notes[key]`` (created with ``counters`` at 0 and an empty
    list of reasons), and record ``why`` among the reasons once. Nothing for ``be`` None (a model effpass did not
    compile is left to TRL with no note)."""
    if be is None:
        return
    notes = be.report.module.notes.setdefault(key, {**{c: 0 for c in counters}, "reasons": []})
    notes[counter] = notes.get(counter, 0) + 1
    if why and why not in notes["reasons"]:
        notes["reasons"].append(why)
