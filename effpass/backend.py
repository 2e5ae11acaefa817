"""The ``effpass`` torch.compile backend.

Per graph Dynamo hands over, the backend

1. runs the torch-IR passes on a copy of the graph (Dynamo shares its graph with the backend, and
   passes may add nodes; the copy keeps each placeholder's ``_dynamo_source``),
2. lowers it: ``lowering="inductor"`` calls ``compile_fx`` with the joint and post-grad phases installed
   as Inductor ``CustomGraphPass`` hooks (each with a ``uuid()`` that changes with effpass's source and
   the pass options, so the FX-graph and AOTAutograd caches stay correct and usable);
   ``lowering="eager"`` runs the same joint and post-grad phases inside an AOTAutograd pipeline without
   Inductor (for fast tests, and for telling effpass bugs from Inductor bugs),
3. records what every pass did in a :class:`~effpass.report.GraphReport` (and the dump). On a cache
   hit no joint or post-grad pass runs, so their records are replayed from the record store.
"""
from __future__ import annotations

import hashlib
import json
import sys
import time
import weakref
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass

from .config import Options, describe_options, parse_options
from .dump import DumpInstrument, RecordStore, claim_graph_dir
from .graph import has_tangents, lazy_graph_module, parameter_input_flags, snapshot_graph
from .manager import EffpassPassError, PassManager, WrongResultError
from .pass_api import Phase, cacheable_functions
from .report import CompileReport, GraphReport, PassRecord

__all__ = ["EffpassBackend", "effpass_backend"]


def _device_of(example_inputs: Sequence[Any]) -> torch.device:
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            return x.device
    return torch.device("cpu")


def _dtype_of(example_inputs: Sequence[Any]) -> torch.dtype | None:
    """The dtype of the graph's first floating-point input (its parameters', for a model's graph)."""
    for x in example_inputs:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.dtype
    return None


def _modules_on_stack() -> list[weakref.ref]:
    """The modules being called while Dynamo compiles a graph (weakly), found on the Python stack.

    Dynamo compiles a frame synchronously inside the call that runs it, so the callers' frames are on the
    stack: ``nn.Module._wrapped_call_impl`` / ``_call_impl`` frames name the module being called (for
    ``torch.compile(model)`` both the ``OptimizedModule`` and the model). This is how a report knows
    which model a graph of the shared string backend belongs to."""
    import sys

    codes = {torch.nn.Module._wrapped_call_impl.__code__, torch.nn.Module._call_impl.__code__}
    out, seen = [], set()
    frame = sys._getframe(1)
    while frame is not None:
        if any(frame.f_code is c for c in codes):  # identity: some frames' f_code objects do not hash
            mod = frame.f_locals.get("self")
            if isinstance(mod, torch.nn.Module) and id(mod) not in seen:
                seen.add(id(mod))
                try:
                    out.append(weakref.ref(mod))
                except TypeError:  # pragma: no cover - modules are weak-referenceable
                    pass
        frame = frame.f_back
    return out


class _NoteCallers:
    """A string backend's compiled graph, noting in its report every model whose call runs it.

    NOTE(shared graphs): ``torch.compile(b, backend="effpass")`` after ``torch.compile(a, backend="effpass")``
    with the same options (one shared backend object) and a model of the same class and shapes: Dynamo's
    guards do not depend on which module instance is called (parameters are graph inputs), so ``b``'s call
    runs the graph compiled for ``a`` without calling the backend. The graph's report then has to learn
    about ``b`` at run time: the graph's first parameter input identifies the model cheaply (a weak-set
    lookup per call); only the first call with a new parameter object walks the stack for the modules
    being called, as the compile did."""

    def __init__(self, fn, report: GraphReport, index: int, first_param: torch.Tensor):
        self.fn, self.report, self.index = fn, report, index
        # id -> weak reference (tensors compare elementwise, so no WeakSet; the identity check guards ids reused)
        self.seen: dict[int, weakref.ref] = {id(first_param): weakref.ref(first_param)}

    def __call__(self, *args):
        p = args[self.index] if len(args) > self.index else None
        if p is not None:
            r = self.seen.get(id(p))
            if r is None or r() is not p:
                self._note(p)
        return self.fn(*args)

    def _note(self, p) -> None:
        try:
            self.seen[id(p)] = weakref.ref(p)
        except TypeError:  # pragma: no cover - tensors are weak-referenceable
            return
        known = {id(r()) for r in self.report.modules if r() is not None}
        self.report.modules.extend(r for r in _modules_on_stack() if id(r()) not in known)

    def __getattr__(self, name):  # anything Dynamo or AOTAutograd reads from the compiled function
        return getattr(self.fn, name)


def _note_callers(compiled, report: GraphReport, example_inputs: Sequence[Any]):
    for i, x in enumerate(example_inputs):
        if isinstance(x, torch.nn.Parameter):
            return _NoteCallers(compiled, report, i, x)
    return compiled  # no parameter input: nothing identifies the model (its compile-time modules stay)


def copy_dynamo_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of Dynamo's GraphModule that passes may edit freely (Dynamo keeps the original)."""
    graph = snapshot_graph(gm.graph)
    for old, new in zip(gm.graph.find_nodes(op="placeholder"), graph.find_nodes(op="placeholder")):
        if hasattr(old, "_dynamo_source"):
            new._dynamo_source = old._dynamo_source
    new_gm = lazy_graph_module(gm, graph, class_name=type(gm).__name__)  # its code: once the passes are done
    new_gm.meta = dict(getattr(gm, "meta", {}))
    for attr in ("_param_name_to_source", "_buffer_name_to_source"):
        if hasattr(gm, attr):
            setattr(new_gm, attr, getattr(gm, attr))
    return new_gm


def _dynamo_context() -> dict[str, Any]:
    """Dynamo's compile id of the graph being compiled ("frame/recompile") and the graph-break reasons
    it has counted in this process so far (for reports: graph breaks and recompiles)."""
    out: dict[str, Any] = {}
    try:
        from torch._guards import CompileContext

        cid = CompileContext.current_compile_id()
        if cid is not None:
            out["compile_id"] = str(cid)
            out["frame_id"], out["frame_compile_id"] = cid.frame_id, cid.frame_compile_id
        from torch._dynamo.utils import counters

        out["graph_breaks"] = {str(k): int(v) for k, v in counters["graph_break"].items()}
    except Exception:  # pragma: no cover - reporting must never break a compile
        pass
    return out


class _PhaseHook(CustomGraphPass):
    """An Inductor hook running one effpass phase on one Dynamo graph's joint or post-grad graphs."""

    def __init__(self, backend: "EffpassBackend", phase: Phase, report: GraphReport, common: dict[str, Any]):
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


class EffpassBackend:
    """A torch.compile backend running an effpass pipeline. ``effpass.compile`` makes one per model."""

    def __init__(self, options: Options | dict | None = None, *, model: torch.nn.Module | None = None,
                 report: CompileReport | None = None):
        self.options = options if isinstance(options, Options) else parse_options(options)
        self.dump = DumpInstrument(describe_options(self.options)) if self.options.dump_dir else None
        #: the pipeline of the graph being compiled (of the last one compiled, between compiles)
        self.manager = self._make_manager(self.options.passes)
        # NOTE(default pipeline): when the user gave no pipeline, it is chosen per graph from the graph's
        # inputs (device, dtype), not once when the backend is made: a model compiled on CPU and moved to
        # CUDA gets the CUDA pipeline. One manager per (device type, dtype).
        self._default_managers: dict[tuple[str, Any], PassManager] = {}
        self.report = report or CompileReport()
        self.report.options = describe_options(self.options)
        self._model_ref = weakref.ref(model) if model is not None else None
        self.store = RecordStore()
        self._count = 0

    @property
    def model(self) -> torch.nn.Module | None:
        return self._model_ref() if self._model_ref is not None else None

    #: whether models other than the one being compiled may run this backend's graphs (the string backend,
    #: shared by every model compiled with the same options): see NOTE(shared graphs)
    shared: bool = False

    #: passes added to the pipeline after the backend was made (e.g. ``checkpoint_activations`` when Hugging
    #: Face gradient checkpointing is turned on); each is used unless the pipeline has one of that name.
    extra_passes: tuple = ()

    def _make_manager(self, passes) -> PassManager:
        names = {p.name for p in passes}
        passes = [*passes, *(p for p in self.extra_passes if p.name not in names)]
        return PassManager(passes, strict=self.options.strict, bisect=self.options.bisect,
                           disable=self.options.disable, instruments=[self.dump] if self.dump else [])

    def manager_for(self, example_inputs: Sequence[Any]) -> PassManager:
        """The pipeline for a graph with these inputs: the user's, or the default one for their device
        and dtype (decided here, when the graph is compiled)."""
        if not self.options.default_pipeline:
            return self.manager
        from .config import default_pipeline

        device, dtype = _device_of(example_inputs), _dtype_of(example_inputs)
        key = (device.type, dtype)
        mgr = self._default_managers.get(key)
        if mgr is None:
            mgr = self._default_managers[key] = self._make_manager(default_pipeline(device, dtype))
        return mgr

    # -- the backend entry point ----------------------------------------------------------------------
    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs):
        t_start = time.perf_counter()
        report = GraphReport(f"graph_{self._count:03d}")
        report.modules = _modules_on_stack()
        self._count += 1
        self.manager = self.manager_for(example_inputs)
        if self.options.dump_dir:
            report.dump_path = claim_graph_dir(self.options.dump_dir, "graph")
            report.graph_id = report.dump_path.rsplit("/", 1)[-1]
        self.report.graphs.append(report)
        report.notes["dynamo"] = _dynamo_context()
        common = dict(model=self.model, device=_device_of(example_inputs), lowering=self.options.lowering,
                      detailed_stats=self.options.detailed_stats)
        try:
            common["parameter_inputs"] = parameter_input_flags(example_inputs)
        except Exception:  # noqa: BLE001 - an input we cannot flatten: passes see None (unknown)
            common["parameter_inputs"] = None

        if self.manager.passes_for(Phase.TORCH_IR):
            gm = copy_dynamo_graph_module(gm)
            self.manager.run_graph_phase(Phase.TORCH_IR, gm, report, "torch_ir", example_inputs=example_inputs,
                                         **common)
        late = [p for p in (Phase.JOINT, Phase.POST_GRAD) if self.manager.passes_for(p)
                and self.options.lowering != "tensorrt"]  # TensorRT lowers without AOTAutograd's phases
        key = self._record_key(gm, example_inputs) if late else ""
        n_records = len(report.records)
        files_before = set(self.dump.written.get(report.graph_id, {})) if self.dump else set()

        t_lower = time.perf_counter()
        compiled = self._lower(gm, example_inputs, report, common)
        t_lowered = time.perf_counter()

        if late:
            self._save_or_replay(report, key, late, n_records, files_before)
        # Where compile time went: lowering (Inductor or AOTAutograd, with the late phases' hooks inside)
        # and everything else effpass did around it (bench/bench_pipeline_cost.py reads these).
        late_ms = sum(r.ms for r in report.records if r.phase in ("joint", "post_grad") and not r.from_cache)
        report.timing = {"total_ms": (time.perf_counter() - t_start) * 1e3,
                         "lower_ms": (t_lowered - t_lower) * 1e3 - late_ms, "late_pass_ms": late_ms}
        if self.dump:
            self.dump.write_index(report)  # last: with timing (its presence marks a finished compile)
        if self.shared:
            compiled = _note_callers(compiled, report, example_inputs)
        return compiled

    # -- lowering -------------------------------------------------------------------------------------
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
        if changed and phase is Phase.JOINT:
            # NOTE(ordering): Inductor sorts only at the end of its own joint passes; constant folding
            # in between fails on an unsorted graph, so re-sort after ours.
            from torch._inductor.pattern_matcher import stable_topological_sort

            stable_topological_sort(gm.graph)
            gm.graph.lint()
            gm.recompile()

    # -- cache-hit bookkeeping ------------------------------------------------------------------------
    def _record_key(self, gm: fx.GraphModule, example_inputs) -> str:
        h = hashlib.sha256()
        h.update(self.manager.uuid([Phase.TORCH_IR, Phase.JOINT, Phase.POST_GRAD]).encode())
        h.update(self.options.lowering.encode())
        h.update(gm.code.encode())
        h.update(str(torch.is_grad_enabled()).encode())
        for x in example_inputs:
            if isinstance(x, torch.Tensor):
                h.update(f"{tuple(x.shape)}{x.stride()}{x.dtype}{x.device}{x.requires_grad}".encode())
            else:
                h.update(repr(x).encode())
        return h.hexdigest()

    def _save_or_replay(self, report: GraphReport, key: str, late: list[Phase], n_records: int,
                        files_before: set[str]) -> None:
        ran = report.notes.get("_ran_phases", set())
        new_records = report.records[n_records:]
        written = self.dump.written.get(report.graph_id, {}) if self.dump else {}
        for phase in late:
            phase_key = f"{key}-{phase.value}"
            if phase.value in ran:
                records = [r for r in new_records if r.phase == phase.value]
                files = {r.file: written[r.file] for r in records if r.file and r.file in written}
                inputs = {k: v for k, v in report.notes.get("_dump_inputs", {}).items()
                          if v in written and v not in files_before}
                files.update({v: written[v] for v in inputs.values()})
                self.store.save(phase_key, records, files, inputs)
                report.cache = report.cache or "miss"
                continue
            entry = self.store.load(phase_key)
            if entry is None:
                report.cache = "hit-unrecorded"
                report.add(PassRecord(name="(cache)", phase=phase.value, graph=phase.value, from_cache=True,
                                      error=None, stats={"note": "compile cache hit; no record of this phase's passes"}))
                continue
            report.cache = "hit"
            for d in entry["records"]:
                rec = PassRecord.from_json(d)
                rec.from_cache = True
                report.add(rec)
            if self.dump and report.dump_path:
                import os

                from .dump import write_atomic

                for name, text in entry.get("files", {}).items():
                    write_atomic(os.path.join(report.dump_path, name), text)
                report.notes.setdefault("_dump_inputs", {}).update(entry.get("inputs", {}))


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


def _boxed(g: fx.GraphModule):
    """``g`` run with the boxed calling convention, its code clearing the argument list once it has read it
    (what ``aot_eager``'s ``boxed_nop`` does): each input, e.g. a tensor saved for backward, is then freed
    after its last use in the graph, as in Inductor's code, not held until the graph returns."""
    from torch.fx.graph import _BoxedCodeGen

    g.graph.set_codegen(_BoxedCodeGen())
    g.recompile()
    forward = g.forward

    def run(args):
        return forward(args)

    run._boxed_call = True
    return run


def _run_graph_as_is(gm: fx.GraphModule):
    """The last fallback: the torch-IR graph run by Python (autograd differentiates it as eager code)."""
    def run(*args):
        return gm(*args)

    return run


# ------------------------------------------------------------------------------------------------------
# the string backend: torch.compile(model, backend="effpass", options={...})
# ------------------------------------------------------------------------------------------------------
_STRING_BACKENDS: dict[str, EffpassBackend] = {}


def effpass_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], options: dict | None = None,
                    mode: str | None = None, **kwargs):
    """Entry point of ``torch.compile(..., backend="effpass")`` (registered as a ``torch_dynamo_backends``
    entry point). One backend object is kept per distinct options dict, so reports accumulate."""
    try:
        key = json.dumps(options, sort_keys=True, default=repr) + f"|{mode}"
    except TypeError:
        key = repr(options) + f"|{mode}"
    backend = _STRING_BACKENDS.pop(key, None)
    if backend is not None:
        _STRING_BACKENDS[key] = backend  # most recently used last (last_string_backend)
    else:
        opts = parse_options(options, mode=mode, device=_device_of(example_inputs))
        # NOTE(string backend): it never sees the eager model, so no module hook runs. A pass with a module
        # hook runs here only if it declares module_phase_optional (its graph hooks do the job alone, with
        # any difference documented and warned, as apply_autocast does); every other one is an error, never
        # a silent no-op.
        if opts.memory_budget is not None:
            raise ValueError("memory_budget needs the eager model and one step's inputs, which the string backend "
                             "never sees; use effpass.compile(model, memory_budget=..., example_inputs=...)")
        module_only = [p.name for p in opts.passes
                       if type(p).requires_module_phase
                       or (Phase.MODULE in type(p).phases() and not type(p).module_phase_optional)]
        if module_only:
            raise ValueError(
                f"pass(es) {module_only} must act on the eager model before compile (module phase), which "
                "torch.compile(model, backend='effpass') never sees; use model = effpass.compile(model, passes=[...]) "
                "(it runs the module phase in place, then torch.compile with the same pipeline), or "
                "effpass.prepare(model, passes=[...]) then torch.compile(model, backend=effpass.backend_of(model))")
        backend = EffpassBackend(opts)
        backend.shared = True
        _STRING_BACKENDS[key] = backend
    return backend(gm, example_inputs)


def last_string_backend() -> EffpassBackend | None:
    """The string backend that compiled a graph most recently (for ``effpass.report()`` with no argument)."""
    return next(reversed(_STRING_BACKENDS.values()), None)


def string_backends() -> list[EffpassBackend]:
    """Every string backend made in this process (one per distinct options), least recently used first."""
    return list(_STRING_BACKENDS.values())


# ------------------------------------------------------------------------------------------------------
# compiling a module in place: effpass.compile(model)
# ------------------------------------------------------------------------------------------------------
#: model -> the backend effpass.compile / effpass.prepare made for it (weak: effpass keeps no model alive)
MODEL_BACKENDS: "weakref.WeakKeyDictionary[torch.nn.Module, EffpassBackend]" = weakref.WeakKeyDictionary()


class _CompiledCall:
    """``model._compiled_call_impl`` for a model effpass compiled in place (what ``nn.Module.compile()``
    installs, in a wrapper that a copy or a pickle of the model leaves behind).

    NOTE(copies): ``copy.deepcopy`` copies a plain function by reference, so a deep copy of a model
    compiled with ``nn.Module.compile()`` would still run the *original* model's compiled code. A copy of
    an effpass-compiled model is the eager, prepared model instead (it computes the same function).
    """

    def __init__(self, fn, backend: EffpassBackend):
        self.fn, self.backend = fn, backend
        #: callables run (once, eagerly) before the first call: integrations' checks of the caller
        self.first_call_checks: list = []
        #: callables ``check(args, kwargs)`` run (once, eagerly) on the first call's inputs (``verify=True``);
        #: one may return a new compiled call to run instead (the model compiled again without a pass)
        self.first_input_checks: list = []

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            self._compiled_again()
        if self.first_call_checks:
            self._run_checks()
        if "torch.distributed.fsdp" in sys.modules and self._sharded_since_compile():
            model = self.backend.model
            return model._call_impl(*args, **kwargs)  # FSDP2's hooks, then the forwards compiled per unit
        if self.first_input_checks:
            replacement = self._run_input_checks(args, kwargs)
            if replacement is not None:
                return replacement(*args, **kwargs)
        return self.fn(*args, **kwargs)

    @torch._dynamo.disable
    def _sharded_since_compile(self) -> bool:
        """NOTE(FSDP2 after compile): accelerate's FSDP2 plugin shards a model that effpass.compile already
        compiled in place. Compiled as a whole, FSDP2's hooks (which Dynamo skips) would split the graph at
        every unit and no pass would see an attention or the head. The first call that finds the model
        sharded recompiles it the way wrap_fsdp does (inside each unit, the root around them: the
        ``adopt_fsdp`` extension wrap_fsdp registers) and hands the model back its hooked ``_call_impl``."""
        from torch.distributed.fsdp import FSDPModule

        model = self.backend.model
        if model is None or not isinstance(model, FSDPModule):
            return False
        from .pass_api import get_extension

        stats = get_extension("adopt_fsdp")(model, self.backend, getattr(model, "_effpass_compile_kwargs", {}))
        self.backend.report.module.notes["adopted_fsdp"] = stats
        model._compiled_call_impl = None
        return True

    @torch._dynamo.disable
    def _run_input_checks(self, args, kwargs):
        checks, self.first_input_checks = self.first_input_checks, []
        replacement = None
        for check in checks:
            replacement = check(args, kwargs) or replacement
        return replacement

    @torch._dynamo.disable
    def _run_checks(self):
        # NOTE(dynamo): disabled, so an outer torch.compile tracing this call runs the checks eagerly
        # (they walk the Python stack) instead of tracing them.
        for check in self.first_call_checks:
            check()
        self.first_call_checks = []

    @torch._dynamo.disable
    def _compiled_again(self):
        # An outer torch.compile (e.g. accelerate for TrainingArguments(torch_compile=True)) traces into
        # the effpass-compiled call: Dynamo would inline it and compile the plain model, effpass's passes
        # silently not running. Run the caller's checks (they name the option), else say it plainly.
        self._run_checks()
        raise RuntimeError("this model was compiled in place by effpass.compile and is being compiled again by "
                           "an outer torch.compile, which would bypass effpass; call the model directly (do not "
                           "wrap it in torch.compile again)")

    def __deepcopy__(self, memo):
        return None

    def __reduce__(self):
        return (_none, ())


def _none():
    return None


def compiled_backend(model: torch.nn.Module) -> EffpassBackend | None:
    """The backend of a model ``effpass.compile`` compiled in place (None for any other model, and for a copy of
    one, which keeps the compiled call but not the registration)."""
    if not isinstance(getattr(model, "_compiled_call_impl", None), _CompiledCall):
        return None
    return MODEL_BACKENDS.get(model)


def pipeline_names(backend: EffpassBackend) -> list[str]:
    """The names of the passes ``backend`` runs: its pipeline and the passes added to it (e.g. by Hugging Face
    gradient checkpointing)."""
    return [p.name for p in backend.manager.active] + [p.name for p in backend.extra_passes]


def compile_in_place(model: torch.nn.Module, backend: EffpassBackend, *, fullgraph: bool = False,
                     dynamic: bool | None = None) -> None:
    """Compile ``model`` in place with ``backend`` (``nn.Module.compile``'s mechanism), replacing an
    earlier effpass compile. Used again when the pipeline changes (e.g. gradient checkpointing is turned
    on through Hugging Face's API after compiling)."""
    fn = torch.compile(model._call_impl, backend=backend, fullgraph=fullgraph, dynamic=dynamic)
    model._compiled_call_impl = _CompiledCall(fn, backend)
    model._effpass_compile_kwargs = {"fullgraph": fullgraph, "dynamic": dynamic}
    MODEL_BACKENDS[model] = backend


