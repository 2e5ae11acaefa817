"""Lowering one Dynamo graph after its torch-IR passes: ``lowering="inductor"`` (``compile_fx`` with the joint and
post-grad phases installed as Inductor ``CustomGraphPass`` hooks), ``"eager"`` (the same phases inside an AOTAutograd
pipeline without Inductor) or ``"tensorrt"``; if the lowering fails on a graph, the other one, then the graph run
as captured (warned; ``strict=True`` raises).

:class:`Lowering` is the part of :class:`effpass.backend.EffpassBackend` that does this (the backend inherits it;
it reads the backend's ``options``, ``manager`` and ``report``).
"""
from __future__ import annotations

import weakref

from typing import Any

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from .graph import has_tangents
from .manager import EffpassPassError, PassManager, WrongResultError
from .pass_api import Phase, cacheable_functions
from .report import GraphReport

__all__ = ["Lowering"]


class _PhaseHook(CustomGraphPass):
    """An Inductor hook running one effpass phase on one Dynamo graph's joint or post-grad graphs."""

    def __init__(self, backend: "Lowering", phase: Phase, report: GraphReport, common: dict[str, Any]):
        self.backend, self.phase, self.report, self.common = backend, phase, report, common
        self.manager = backend.manager  # the pipeline of this graph (the default one depends on its inputs)

    def __call__(self, graph: fx.Graph) -> None:
        gm = graph.owning_module
        self.backend._run_late_phase(self.phase, gm, self.report, self.common, manager=self.manager)

    def uuid(self) -> str:
        return self.manager.uuid([self.phase])


def _kind_of(phase: Phase, gm: fx.GraphModule, report: GraphReport) -> str:
    training = has_tangents(gm.graph)
    if phase is Phase.JOINT:
        report.notes["_training"] = training
        return "joint" if training else "inference"
    if training:
        return "backward"
    return "forward" if report.notes.get("_training") else "inference"


class Lowering:
    """How :class:`~effpass.backend.EffpassBackend` lowers a graph (a base class of the backend: tests patch
    ``EffpassBackend._lower_eager`` / ``_lower_inductor`` to make a lowering fail)."""

    def _config_patches(self, common) -> tuple[dict[str, Any], dict[str, Any]]:
        """(inductor patches, functorch patches) asked for by the passes and options."""
        import torch._inductor.config as ic

        inductor: dict[str, Any] = {}
        functorch: dict[str, Any] = {"force_non_lazy_backward_lowering": True}
        # NOTE(caching): functions that passes declared cacheable (e.g. apply_autocast's enter/exit
        # calls, fixed by their arguments); without this the caches bypass every graph calling them.
        marked = dict(ic.unsafe_marked_cacheable_functions)
        for name, version in cacheable_functions().items():
            marked.setdefault(name, version)
        inductor["unsafe_marked_cacheable_functions"] = marked
        for p in self.manager.active:
            for k, v in (p.compile_config(common) or {}).items():
                group, _, name = k.partition(".")
                if group == "inductor":
                    inductor[name] = v
                elif group == "functorch":
                    functorch[name] = v
                else:
                    raise ValueError(f"pass {p.name!r}: compile_config key {k!r} must start with 'inductor.' or 'functorch.'")
        inductor.update(self.options.inductor_config)
        return inductor, functorch

    def _lower(self, gm, example_inputs, report, common):
        """Lower with the chosen lowering; if the lowering itself fails on this graph, fall back (with a
        warning naming the graph and the reason) to the other lowering, then to running the torch-IR graph
        as it is (the torch-IR passes applied, no joint/post-grad passes). ``strict=True`` raises instead.
        Errors that mean a wrong result (``WrongResultError``) or a failing pass in strict mode propagate."""
        order = [self.options.lowering] + [x for x in ("eager", "inductor") if x != self.options.lowering
                                             and self.options.lowering != "tensorrt"]
        errors: list[str] = []
        for i, lowering in enumerate(order):
            try:
                compiled = self._lower_with(lowering, gm, example_inputs, report, common)
            except (WrongResultError, EffpassPassError, ValueError, TypeError):
                raise  # a wrong result, a failing pass in strict mode, a user error (bad targets, options)
            except Exception as e:
                if self.options.strict:
                    raise
                errors.append(f"{lowering}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
                continue
            if errors:
                self._fell_back(report, lowering, errors)
            return compiled
        late = [p.name for ph in (Phase.JOINT, Phase.POST_GRAD) for p in self.manager.passes_for(ph)]
        if late and getattr(self.report, "memory_plan", None) is not None:
            # NOTE: without a lowering the joint/post-grad passes (checkpointing, recompute marks) do not run:
            # the values stay right, but the memory plan's promise would not hold
            raise RuntimeError(f"effpass: lowering failed on {report.graph_id} ({'; '.join(errors)}) and the graph "
                               f"cannot run as captured: it would skip {late}, which the memory plan relies on")
        if late and not self.options.allow_fallback:
            # NOTE(failures): running as captured would silently turn these passes off: an error unless allowed
            raise RuntimeError(
                f"effpass: every lowering failed on {report.graph_id} ({'; '.join(errors)}); running the graph as "
                f"captured would skip the passes {late} (values unchanged, their memory or speed gains lost). "
                "Pass allow_fallback=True (effpass.compile / options={'allow_fallback': True}) to run it that way "
                "with a warning, or strict=True for the full traceback")
        errors.append(f"not run without a lowering (memory only, values unchanged): {late}" if late else "")
        self._fell_back(report, "none", [e for e in errors if e])
        return _run_graph_as_is(gm)

    @staticmethod
    def _fell_back(report: GraphReport, to: str, errors: list[str]) -> None:
        import warnings

        report.notes["lowering_fallback"] = {"to": to, "errors": errors}
        what = f"lowered with {to!r} instead" if to != "none" else "runs as captured (torch-IR passes applied, no lowering)"
        warnings.warn(f"effpass: lowering failed on {report.graph_id}; it {what}. Reason(s): {'; '.join(errors)} "
                      "(strict=True raises instead)", RuntimeWarning, stacklevel=3)

    def _lower_with(self, lowering, gm, example_inputs, report, common):
        import contextlib

        inductor_patches, functorch_patches = self._config_patches(common)
        with torch._functorch.config.patch(functorch_patches), contextlib.ExitStack() as stack:
            for p in self.manager.active:  # e.g. compress_activations' saved-tensor hooks (compile time only)
                cm = p.lowering_context(common)
                if cm is not None:
                    stack.enter_context(cm)
            if lowering == "eager":
                with torch._inductor.config.patch(inductor_patches):
                    return self._lower_eager(gm, example_inputs, report, common)
            if lowering == "tensorrt":
                return self._lower_tensorrt(gm, example_inputs)
            return self._lower_inductor(gm, example_inputs, report, common, inductor_patches)

    def _lower_uncached(self, gm, example_inputs, report, common):
        """Lowered again with Inductor's FX-graph and AOTAutograd caches off (a cache hit whose pass records were
        lost: :func:`effpass.cache_records.unrecorded_hit`); the report says so."""
        import torch._functorch.config as fc
        import torch._inductor.config as ic

        off = {k: False for k in ("fx_graph_cache", "fx_graph_remote_cache") if hasattr(ic, k)}
        aot = {k: False for k in ("enable_autograd_cache", "enable_remote_autograd_cache") if hasattr(fc, k)}
        report.notes["_ran_phases"] = set()
        with ic.patch(off), fc.patch(aot):
            compiled = self._lower(gm, example_inputs, report, common)
        report.notes["recompiled"] = ("a compile-cache hit without effpass's records of its late passes: compiled "
                                      "again without the caches (the records saved now)")
        return compiled

    def _lower_inductor(self, gm, example_inputs, report, common, patches):
        from torch._inductor.compile_fx import compile_fx
        import torch._inductor.config as ic

        patches = dict(patches)
        if self.options.mode and self.options.mode != "default":
            patches.update(torch._inductor.list_mode_options(self.options.mode))
        for phase, key in ((Phase.JOINT, "joint_custom_pre_pass"), (Phase.POST_GRAD, "post_grad_custom_pre_pass")):
            if self.manager.passes_for(phase):
                hook = _PhaseHook(self, phase, report, common)
                existing = getattr(ic, key)
                patches[key] = hook if existing is None else [hook, *(existing if isinstance(existing, list) else [existing])]
        return compile_fx(gm, example_inputs, config_patches=patches)

    def _lower_tensorrt(self, gm, example_inputs):
        """Hand the transformed torch-IR graph to torch_tensorrt's Dynamo backend (inference).

        UNTESTED: written without a GPU or torch_tensorrt (tests/tools/test_export_onnx.py has the GPU test).
        Joint and post-grad passes do not run: TensorRT does its own lowering without AOTAutograd's phases.
        """
        import warnings

        import importlib

        from torch._dynamo.backends.registry import lookup_backend

        importlib.import_module("torch_tensorrt")  # importing it registers the "torch_tensorrt" Dynamo backend

        late = [p.name for p in self.manager.passes_for(Phase.JOINT) + self.manager.passes_for(Phase.POST_GRAD)]
        if late:
            warnings.warn(f"effpass: lowering='tensorrt' runs no joint/post-grad passes; skipped: {late}",
                          RuntimeWarning, stacklevel=2)
        return lookup_backend("torch_tensorrt")(gm, example_inputs)

    def _lower_eager(self, gm, example_inputs, report, common):
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        manager = self.manager

        def partition(joint, joint_inputs, **kw):
            self._run_late_phase(Phase.JOINT, joint, report, common, manager=manager)
            return min_cut_rematerialization_partition(joint, joint_inputs, **kw)

        def compiler(g, _inputs):
            self._run_late_phase(Phase.POST_GRAD, g, report, common, manager=manager)
            n = _views_as_reshapes(g)
            if n:
                report.notes["eager_views_as_reshape"] = report.notes.get("eager_views_as_reshape", 0) + n
            return _boxed(g)

        def inference_compiler(g, inputs):
            self._run_late_phase(Phase.JOINT, g, report, common, manager=manager)
            return compiler(g, inputs)

        lower = aot_autograd(fw_compiler=compiler, bw_compiler=compiler, inference_compiler=inference_compiler,
                             partition_fn=partition, keep_inference_input_mutations=True)
        return lower(gm, example_inputs)

    def _run_late_phase(self, phase: Phase, gm: fx.GraphModule, report: GraphReport, common, *,
                        manager: PassManager | None = None) -> None:
        report.notes.setdefault("_ran_phases", set()).add(phase.value)
        kind = _kind_of(phase, gm, report)
        changed = (manager or self.manager).run_graph_phase(phase, gm, report, kind,
                                                            regenerate=phase is not Phase.JOINT, **common)
        if phase is Phase.POST_GRAD and common.get("detailed_stats"):
            _record_figures(gm, report, kind)  # a dump is written or the user asked (detailed_stats): costs a walk
        if changed and phase is Phase.JOINT:
            # NOTE(ordering): Inductor sorts only at the end of its own joint passes; constant folding
            # in between fails on an unsorted graph, so re-sort after ours.
            from torch._inductor.pattern_matcher import stable_topological_sort

            stable_topological_sort(gm.graph)
            gm.graph.lint()
            gm.recompile()


def _record_figures(gm: fx.GraphModule, report: GraphReport, kind: str) -> None:
    """The graph's figures read from its metadata (``effpass.graph_figures``: FLOPs, transient peak, bytes saved
    for backward, a roofline estimate) under ``report.notes["figures"][kind]``, for the dump and the HTML report.
    Figures never fail a compile: an error is recorded in their place."""
    from .graph_figures import graph_figures

    try:
        fig = graph_figures(gm)
    except Exception as e:  # noqa: BLE001 - a statistic must not break the compile
        fig = {"error": f"{type(e).__name__}: {e}"[:300]}
    report.notes.setdefault("figures", {})[kind] = fig


def _views_as_reshapes(g: fx.GraphModule) -> int:
    """NOTE(eager strides): the eager lowering runs AOTAutograd's aten graphs with eager kernels, whose output
    strides may differ from the traced ones (e.g. ``aten.cat`` keeps an input's memory format), so an
    ``aten.view`` traced on a contiguous value can fail at run time (Qwen3-Next's gated DeltaNet backward).
    Inductor plans its own layouts and never meets this. ``aten.reshape`` is a view wherever ``view`` would
    succeed (same aliasing, same values) and copies only where ``view`` would raise, so rewriting every view
    keeps every graph that ran before and runs the ones that crashed. Returns how many were rewritten."""
    n = 0
    for node in g.graph.find_nodes(op="call_function", target=torch.ops.aten.view.default):
        node.target = torch.ops.aten.reshape.default
        n += 1
    if n:
        g.recompile()
    return n


#: the eager lowering's graph modules by the code object of their generated ``forward`` (weakly): the planner's
#: tracker reads a running graph's node metadata by it (planning/places.py), never through the frame's locals
#: (a snapshot of them would keep every input alive until the graph returns)
GRAPH_OF_CODE: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()


def _boxed(g: fx.GraphModule):
    """``g`` run with the boxed calling convention, its code clearing the argument list once it has read it
    (what ``aot_eager``'s ``boxed_nop`` does): each input, e.g. a tensor saved for backward, is then freed
    after its last use in the graph, as in Inductor's code, not held until the graph returns."""
    from torch.fx.graph import _BoxedCodeGen

    g.graph.set_codegen(_BoxedCodeGen())
    g.recompile()
    if hasattr(g, "real_recompile"):  # a lazy graph module: its code now (else the first call generates it)
        g.real_recompile()
    forward = g.forward
    GRAPH_OF_CODE[forward.__code__] = g

    def run(args):
        return forward(args)

    run._boxed_call = True
    return run


def _run_graph_as_is(gm: fx.GraphModule):
    """The last fallback: the torch-IR graph run by Python (autograd differentiates it as eager code)."""
    def run(*args):
        return gm(*args)

    return run
