"""Every process-wide patch of private torch functions a replay needs, installed by one context manager,
:func:`replay_patches`, and undone when it exits:

- Dynamo's fake modes accept real constants made while tracing (``FakeTensorMode.__init__``);
- AOTAutograd skips printing graphs to strings no log reads (``_log_joint_graph``, ``_log_fw_bw_graphs``);
- with ``inductor``, compiled graphs run their generated wrapper with fake allocations
  (``CompiledFxGraph.__call__``, :mod:`effpass.planning.fake_inductor`);
- plans of one shared capture share AOTAutograd's joint trace (``aot_module_simplified``,
  ``aot_dispatch_autograd_graph``, ``run_functionalized_fw_and_collect_metadata``): active only inside
  :func:`sharing_joint_traces` (one Dynamo graph compiled by several plans); elsewhere these call through.
"""
from __future__ import annotations

import contextlib
import copy

import torch

from .fake_inductor import fake_wrapper

__all__ = ["replay_patches", "sharing_joint_traces"]


@contextlib.contextmanager
def _replay_inductor_wrappers(device):
    """While active, every Inductor-compiled graph runs its generated wrapper with fake allocations
    (:func:`fake_wrapper`) instead of its kernels."""
    from torch._inductor.output_code import CompiledFxGraph

    orig = CompiledFxGraph.__call__
    cache: dict = {}

    def call(self, inputs):
        if not isinstance(self, CompiledFxGraph) or getattr(self, "cache_key", None) is None:
            return orig(self, inputs)
        return fake_wrapper(self, device, cache)(inputs)

    CompiledFxGraph.__call__ = call
    try:
        yield
    finally:
        CompiledFxGraph.__call__ = orig


@contextlib.contextmanager
def _allow_non_fake_inputs():
    """NOTE(torch.tensor in traced code): Dynamo's fake mode refuses real constants made while tracing a
    fake model (e.g. ``torch.tensor([])`` in Hugging Face's cache); let it accept them, as export does."""
    from torch._subclasses import fake_tensor as ft

    orig = ft.FakeTensorMode.__init__

    def init(self, *a, **k):
        k["allow_non_fake_inputs"] = True
        orig(self, *a, **k)

    ft.FakeTensorMode.__init__ = init
    try:
        yield
    finally:
        ft.FakeTensorMode.__init__ = orig


@contextlib.contextmanager
def _no_graph_strings():
    """AOTAutograd prints every joint, forward and backward graph to a string for its logs and cache entries
    (``print_readable``), logging on or off: 4% of a replay. Skipped while replaying unless AOTAutograd's graph
    logs or the structured trace are on (the strings only ever reach a log or an AOTAutogradCache entry's
    debug fields)."""
    import logging

    from torch._functorch._aot_autograd import graph_compile as gc

    logs_on = any(getattr(gc, n, None) is None or getattr(gc, n).isEnabledFor(logging.INFO)
                  for n in ("aot_joint_log", "aot_graphs_log"))
    try:
        from torch._logging._internal import trace_log

        logs_on = logs_on or bool(trace_log.handlers)
    except Exception:  # pragma: no cover - a torch without the structured trace log
        pass
    if logs_on or not hasattr(gc, "_log_joint_graph") or not hasattr(gc, "_log_fw_bw_graphs"):
        yield
        return
    orig = gc._log_joint_graph, gc._log_fw_bw_graphs
    gc._log_joint_graph = lambda *a, **k: None
    gc._log_fw_bw_graphs = lambda *a, **k: (None, None)
    try:
        yield
    finally:
        gc._log_joint_graph, gc._log_fw_bw_graphs = orig


def _joint_key(graph_id, gm, args) -> tuple:
    """What AOTAutograd's joint trace of ``gm`` depends on, within one shared capture: the Dynamo graph it
    came from, the torch-IR graph (code and the node annotations tracing carries into the joint), the
    example inputs (the same objects for every plan of a capture) and the global state tracing reads."""
    import hashlib

    h = hashlib.sha256(gm.code.encode())
    for n in gm.graph.nodes:
        m = n.meta
        h.update(repr((n.name, m.get("custom"), m.get("recompute"), m.get("ac_graph_id"),
                       tuple(m.get("nn_module_stack", {}) or {}), m.get("stack_trace"))).encode())
    cfg = torch._functorch.config.get_config_copy()
    return (graph_id, h.hexdigest(), tuple(id(a) for a in args), repr(sorted(cfg.items(), key=str)),
            torch.is_grad_enabled(), torch.is_autocast_enabled())


def _fresh_aot_meta(x, memo=None):
    """A copy of AOTAutograd's tracing metadata (``SubclassMeta``, ``ViewAndMutationMeta``,
    ``SubclassCreationMeta``, with the lists, tuples and dicts that hold them) whose objects are new, so
    that mutating one copy (``make_runtime_safe``) leaves the others as traced; tensors, SymInts, types and
    every other value are shared (read-only)."""
    from torch._functorch._aot_autograd import schemas

    memo = {} if memo is None else memo
    if id(x) in memo:
        return memo[id(x)]
    if isinstance(x, list):
        out = memo[id(x)] = []
        out.extend(_fresh_aot_meta(v, memo) for v in x)
        return out
    if isinstance(x, tuple) and type(x) is tuple:
        return tuple(_fresh_aot_meta(v, memo) for v in x)
    if isinstance(x, dict) and type(x) is dict:
        out = memo[id(x)] = {}
        out.update((k, _fresh_aot_meta(v, memo)) for k, v in x.items())
        return out
    if type(x).__module__ == schemas.__name__ and hasattr(x, "__dict__") and not isinstance(x, type):
        out = memo[id(x)] = copy.copy(x)
        for k, v in vars(x).items():
            object.__setattr__(out, k, _fresh_aot_meta(v, memo))
        return out
    return x


#: the Dynamo graphs being compiled by several plans at once (innermost last), see :func:`sharing_joint_traces`
_SESSIONS: list = []


class _JointSession:
    """One Dynamo graph compiled by several plans: the joint traces and metadata passes shared between them."""

    def __init__(self, graph_id):
        self.graph_id = graph_id
        self.keys: list = []    # the joint key of each aot_module_simplified call in progress (None: not shared)
        self.traces: dict = {}
        self.metas: dict = {}


@contextlib.contextmanager
def sharing_joint_traces(graph_id):
    """While active (a shared capture compiling Dynamo graph ``graph_id`` with each plan's backend, inside
    :func:`replay_patches`), plans whose torch-IR graphs are the same (they differ only in joint-graph passes
    or partitioning, e.g. checkpoint policies) share AOTAutograd's joint trace: the first plan's trace is kept
    and every plan gets its own copy of it (node meta copied, so the joint passes' marks stay per plan), with
    the per-call bookkeeping AOTAutograd does after tracing (``fw_metadata``'s stream indices and tangent
    stack traces) redone on the plan's own metadata. The metadata pass before the trace (a functionalized run
    of the forward) is shared the same way. Every shared object is handed out as a fresh copy
    (:func:`_fresh_aot_meta`). Partitioning, compiling and the runtime wrappers stay per plan."""
    _SESSIONS.append(_JointSession(graph_id))
    try:
        yield
    finally:
        _SESSIONS.pop()


@contextlib.contextmanager
def _joint_trace_sharing():
    """The patches behind :func:`sharing_joint_traces`; outside a sharing session they call through."""
    from torch._dynamo.backends import common
    from torch._functorch import aot_autograd
    from torch._functorch._aot_autograd import graph_capture, graph_compile

    from effpass.graph import lazy_graph_module, snapshot_graph

    orig_simplified = common.aot_module_simplified
    orig_trace = graph_compile.aot_dispatch_autograd_graph
    orig_collect = aot_autograd.run_functionalized_fw_and_collect_metadata

    def current_key():
        session = _SESSIONS[-1] if _SESSIONS else None
        return session, (session.keys[-1] if session is not None and session.keys else None)

    def simplified(gm, args, *a, **kw):
        if not _SESSIONS:
            return orig_simplified(gm, args, *a, **kw)
        session = _SESSIONS[-1]
        session.keys.append(_joint_key(session.graph_id, gm, args) if isinstance(gm, torch.fx.GraphModule)
                            else None)
        try:
            return orig_simplified(gm, args, *a, **kw)
        finally:
            session.keys.pop()

    def copy_joint(fx_g):
        # lazy: a joint graph is partitioned, never run, so its code need not be generated
        new = lazy_graph_module(fx_g, snapshot_graph(fx_g.graph), class_name=type(fx_g).__name__)
        new.meta = dict(getattr(fx_g, "meta", {}))
        return new

    def trace(flat_fn, flat_args, flat_args_descs, aot_config, *, fw_metadata):
        session, key = current_key()
        if key is None:
            return orig_trace(flat_fn, flat_args, flat_args_descs, aot_config, fw_metadata=fw_metadata)
        cache = session.traces
        if key not in cache:
            fx_g, inputs, descs, sub_meta = orig_trace(flat_fn, flat_args, flat_args_descs, aot_config,
                                                       fw_metadata=fw_metadata)
            # kept pristine: AOTAutograd later makes the returned metadata "runtime safe" in place (it clears
            # traced tangents and subclass references), which a second plan's compile must not see
            cache[key] = (copy_joint(fx_g), inputs, descs, _fresh_aot_meta(sub_meta))
            return fx_g, inputs, descs, sub_meta
        fx_g, inputs, descs, sub_meta = cache[key]
        fx_g = copy_joint(fx_g)
        inputs = tuple(list(x) for x in inputs)
        descs = tuple(list(x) for x in descs)
        sub_meta = _fresh_aot_meta(sub_meta)
        graph_capture.populate_fw_metadata_with_stream_indices(fx_g, fw_metadata)
        graph_capture._extract_tangent_source_stack_traces(fx_g, fw_metadata)
        return fx_g, inputs, descs, sub_meta

    def collect_metadata(*a, **kw):  # AOTAutograd's metadata pass (one functionalized run of the forward)
        inner = orig_collect(*a, **kw)
        session, key = current_key()
        if key is None:
            return inner
        metas = session.metas

        def run(*args):
            if key not in metas:
                meta = inner(*args)
                metas[key] = _fresh_aot_meta(meta)
                return meta
            return _fresh_aot_meta(metas[key])

        return run

    common.aot_module_simplified = simplified
    graph_compile.aot_dispatch_autograd_graph = trace
    aot_autograd.run_functionalized_fw_and_collect_metadata = collect_metadata
    try:
        yield
    finally:
        common.aot_module_simplified = orig_simplified
        graph_compile.aot_dispatch_autograd_graph = orig_trace
        aot_autograd.run_functionalized_fw_and_collect_metadata = orig_collect


@contextlib.contextmanager
def replay_patches(device, inductor: bool):
    """Every process-wide patch a replay needs, undone on exit: Dynamo's fake modes accept real constants
    (:func:`_allow_non_fake_inputs`), AOTAutograd prints no graph strings no log reads
    (:func:`_no_graph_strings`), plans of a shared capture can share joint traces (:func:`sharing_joint_traces`)
    and, with ``inductor``, compiled graphs run their generated wrapper with fake allocations
    (:func:`_replay_inductor_wrappers`; also what lets a compiled optimizer step, e.g. torchao's, run on fake
    parameters)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(_allow_non_fake_inputs())
        stack.enter_context(_no_graph_strings())
        stack.enter_context(_joint_trace_sharing())
        if inductor:
            stack.enter_context(_replay_inductor_wrappers(device))
        yield
