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

Here: the backend object and its entry point (``effpass_backend``, the string backend). Lowering is in
:mod:`effpass.lowering` (a base class of :class:`EffpassBackend`), the cache-hit records in
:mod:`effpass.cache_records`, compiling a model in place in :mod:`effpass.compiled_call` (re-exported here).
"""
from __future__ import annotations

import json
import time
import weakref
from typing import Any, Sequence

import torch
import torch.fx as fx

from .cache_records import record_key, save_or_replay, unrecorded_hit
from .compiled_call import MODEL_BACKENDS, _CompiledCall, _none, compile_in_place, compiled_backend, pipeline_names
from .config import Options, describe_options, parse_options
from .dump import DumpInstrument, RecordStore, claim_graph_dir
from .graph import lazy_graph_module, parameter_input_flags, snapshot_graph
from .lowering import Lowering
from .manager import PassManager
from .pass_api import Phase
from .report import CompileReport, GraphReport

__all__ = ["EffpassBackend", "effpass_backend", "last_string_backend", "string_backends", "copy_dynamo_graph_module",
           # compiling a model in place (effpass/compiled_call.py), imported from here by the API and integrations;
           # _none: pickles of compiled models made before the split name effpass.backend._none
           "MODEL_BACKENDS", "_CompiledCall", "_none", "compile_in_place", "compiled_backend", "pipeline_names"]


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

class EffpassBackend(Lowering):
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
        #: the name Dynamo's errors give this backend (BackendCompilerFailed reads ``__name__``)
        self.__name__ = "effpass"

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
        key = record_key(self.manager, self.options.lowering, gm, example_inputs) if late else ""
        n_records = len(report.records)
        files_before = set(self.dump.written.get(report.graph_id, {})) if self.dump else set()

        t_lower = time.perf_counter()
        hits = _cache_hits()
        compiled = self._lower(gm, example_inputs, report, common)
        if (late and self.options.lowering == "inductor" and _cache_hits() > hits
                and unrecorded_hit(self.store, report, key, late)):
            compiled = self._lower_uncached(gm, example_inputs, report, common)
        t_lowered = time.perf_counter()

        if late:
            save_or_replay(self.store, self.dump, report, key, late, n_records, files_before)
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


def _cache_hits() -> int:
    """Inductor's FX-graph and AOTAutograd cache hits so far in this process (torch's counters)."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"]
