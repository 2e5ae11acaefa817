"""The replay service: one training step replayed on fake tensors, its allocations tracked.

How: the model is copied with every parameter, buffer and tensor attribute replaced by a *fake* tensor
(``torch._subclasses.FakeTensor``: shape, dtype and device, no storage) on the target device
(:func:`fake_copy`), the module-level passes run on the copy (quantization and adapters make fake buffers and
parameters), then the copy is compiled by an effpass backend built directly (no loop back through
``effpass.compile``; ``lowering="eager"``: the AOTAutograd joint graph, passes and min-cut partition run op by
op; ``lowering="inductor"``: Inductor compiles, and its generated wrapper runs with fake allocations and no
kernels, :mod:`effpass.planning.fake_inductor`) and one training step (forward, backward, optimizer step,
``zero_grad``) runs twice on fake inputs: the first compiles and creates the optimizer states, the second is
tracked (:class:`effpass.planning.tracker.Tracker`). Every patch of torch this needs is installed by one
context manager, :func:`effpass.planning.patches.replay_patches`.

Why fake CPU/CUDA tensors, not the meta device: on ``meta`` tensors ``scaled_dot_product_attention``
picks the math path (it materialises the scores) and ``nll_loss`` loses its backward (Python Meta kernels
registered for composite ops), so the replayed program is not the one that runs. Fake tensors claim the
real device, so every kernel choice is the device's own. Traps avoided (see the shared torch-facts notes):
a dispatch mode makes Dynamo skip compiling unless ``ignore_compile_internals()`` is True; ``model.to``
unties tied weights (the copy maps each parameter object once); ``torch.tensor(...)`` inside traced
model code needs fake-tensor "non-fake inputs" allowed.

Several pipelines with the same module phase share one fake copy and one Dynamo capture
(:func:`replay_many`). The GPU path (fake CUDA tensors, the allocator rounding) is untested: no GPU was
available when this was written.
"""
from __future__ import annotations

import copy
import sys
import time
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from ..devices import targeting
from .patches import replay_patches, sharing_joint_traces
from .cuda_allocator import simulate
from .result import MemoryEstimate, format_bytes, training_step
from .tracker import Tracker, gradient_split, step_timeline, storage_sizes, tracked_bytes

__all__ = ["replay_many", "module_groups", "fake_copy", "replay_options", "module_phase_key", "prepare_replay_model",
           "without_fsdp", "target_device", "check_optimizer", "largest_unit_bytes", "split_compile_options",
           "COMPILE_ONLY_OPTIONS"]


def fake_copy(model: torch.nn.Module, example_inputs, dev):
    """(the fake mode, a fake copy of ``model``, fake copies of ``example_inputs``) on device ``dev``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake = _fake_factory(fake_mode, dev)
    return fake_mode, _fake_model(model, fake, dev), _fake_inputs(example_inputs, fake)


def _fake_factory(fake_mode, device):
    def fake(t: torch.Tensor) -> torch.Tensor:
        with fake_mode:
            return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=device)
    return fake


def _fake_model(model: torch.nn.Module, fake, device) -> torch.nn.Module:
    """A deep copy of ``model`` whose tensors are fake (no storage); tied parameters stay tied."""
    memo: dict[int, Any] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in memo:
            continue
        ft = fake(t)
        memo[id(t)] = torch.nn.Parameter(ft, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else ft
    # tensors held as plain attributes (e.g. rotary embeddings' original_inv_freq)
    for m in model.modules():
        for v in m.__dict__.values():
            if isinstance(v, torch.Tensor) and id(v) not in memo:
                memo[id(v)] = fake(v)
    out = copy.deepcopy(model, memo)
    return out


def _fake_inputs(inputs, fake):
    memo: dict[int, torch.Tensor] = {}  # the same tensor twice (input_ids and labels) stays one tensor

    def one(x):
        if not isinstance(x, torch.Tensor):
            return x
        if id(x) not in memo:
            memo[id(x)] = fake(x)
        return memo[id(x)]

    return tree_map(one, inputs)


def replay_device(dev: torch.device) -> torch.device:
    """The device whose fake tensors replay a step for target ``dev``: ``dev`` itself, or the CPU for a CUDA
    target on a machine without CUDA (autograd on fake CUDA tensors needs CUDA's device guard). The bytes are
    still counted as CUDA's caching allocator holds them (:mod:`effpass.planning.cuda_allocator`)."""
    if dev.type == "cuda" and not torch.cuda.is_available():
        return torch.device("cpu")
    return dev


def target_device(model: torch.nn.Module, device) -> torch.device:
    if device is not None:
        return torch.device(device)
    for t in list(model.parameters()) + list(model.buffers()):
        if t.device.type != "meta":
            return t.device
    return torch.device("cpu")


def check_optimizer(optimizer):
    from effpass.memory_options import registered_optimizers
    from effpass.pass_api import registered_passes

    registered_passes()  # loads the built-in passes and plugins (some register optimizers)

    valid = list(registered_optimizers())
    if optimizer is not None and optimizer not in valid:
        raise ValueError(f"optimizer {optimizer!r} is not valid; choose one of {valid + [None]}")


#: compile options of effpass.compile that a replay does not use (the planner's own, or output)
COMPILE_ONLY_OPTIONS = ("dump_dir", "memory_budget", "allow", "example_inputs", "optimizer", "world_size")


def split_compile_options(compile_options) -> tuple[str, str, dict]:
    """(the lowering asked for, the lowering replayed, the remaining options) of a replay's compile options.
    Inductor is replayed from its generated code (its fusions, buffer reuse and frees); every other lowering
    (eager, TensorRT) by the eager lowering's op-by-op run of the same partitioned graphs."""
    opts = dict(compile_options)
    requested = opts.pop("lowering", "inductor")
    for k in COMPILE_ONLY_OPTIONS:
        opts.pop(k, None)
    return requested, "inductor" if requested == "inductor" else "eager", opts


def replay_options(pass_list, lowering, opts, dev):
    """(effpass ``Options``, torch.compile kwargs) of a replay; ``opts`` are the remaining compile options
    (consumed; unknown ones raise ``TypeError``)."""
    from effpass.config import parse_options

    opts = dict(opts)
    raw = {"lowering": lowering, "strict": opts.pop("strict", False),
           "detailed_stats": opts.pop("detailed_stats", False)}
    if pass_list is not None:
        raw["passes"] = pass_list
    if opts.get("disable"):
        raw["disable"] = list(opts["disable"])
    opts.pop("disable", None)
    if opts.get("inductor_config"):
        raw["inductor_config"] = opts["inductor_config"]
    opts.pop("inductor_config", None)
    options = parse_options(raw, mode=opts.pop("mode", None), device=dev)
    kwargs = {"fullgraph": opts.pop("fullgraph", False), "dynamic": opts.pop("dynamic", None)}
    opts.pop("bisect", None)
    if opts:
        raise TypeError(f"estimate_memory: unknown compile option(s) {sorted(opts)}")
    return options, kwargs


def module_phase_key(options, kwargs) -> tuple:
    """What the module phase of a replay depends on: its module-level passes (names and options, in order)
    and the compile arguments. Replays with the same key can share one prepared fake copy and one Dynamo
    capture (:func:`_replay_group`)."""
    from effpass.backend import EffpassBackend
    from effpass.pass_api import Phase

    mgr = EffpassBackend(options).manager
    return (tuple((p.name, repr(sorted(p.options().items()))) for p in mgr.passes_for(Phase.MODULE)),
            repr(sorted(kwargs.items())), options.lowering)


def prepare_replay_model(work, options, kwargs, dev):
    """The effpass backend of ``options`` for the fake copy ``work``, after running its module phase on it."""
    from effpass.backend import EffpassBackend

    backend = EffpassBackend(options, model=work)
    backend.manager.run_module_phase(work, backend.report.module, device=dev, lowering=options.lowering,
                                     backend_factory=lambda: backend, compile_kwargs=kwargs)
    if "transformers" in sys.modules:  # as effpass.compile does for a Hugging Face model: the same graphs
        from effpass.integrations.huggingface import set_hf_loss_type

        set_hf_loss_type(work)
    return backend


class _SharedCapture:
    """A torch.compile backend that hands every graph Dynamo captures to several effpass backends (one per
    replayed plan; they differ only in graph-level passes) and runs the compiled graph of the plan that is
    ``current``: one Dynamo trace serves every plan of a group (:func:`_replay_group`). Each backend compiles
    its own copy of the graph, inside Dynamo's compile (its tracing context and fake mode), as it would
    alone."""

    def __init__(self, backends):
        self.backends = list(backends)
        self.current = 0

    def __call__(self, gm, example_inputs, **kwargs):
        from effpass.backend import copy_dynamo_graph_module

        with sharing_joint_traces(id(gm)):
            fns = [be(copy_dynamo_graph_module(gm), example_inputs, **kwargs) for be in self.backends]

        def run(*args):  # as Dynamo calls a backend's result (unboxed)
            return fns[self.current](*args)

        return run


def _replay_errors(model, e):
    """The exception a failed replay raises (as :func:`estimate_memory` always has)."""
    import effpass

    if isinstance(e, (effpass.PipelineError, effpass.PassOptionError, effpass.TargetMatchError)):
        return e
    if isinstance(e, TypeError) and "unknown compile option" in str(e):
        return e
    err = RuntimeError(f"estimate_memory: could not replay a training step of {type(model).__name__} on fake "
                       f"tensors ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
                       + ("" if isinstance(e, TypeError) else
                          "; the model must run under torch.compile (fake tensors, no data-dependent Python "
                          "control flow on tensor values outside graph breaks)"))
    err.__cause__ = e
    return err


def _replay_group(model, example_inputs, items, optimizer, dev, loss_fn, lr, requested_lowering):
    """Replay the training step of every ``(pass_list, options, kwargs)`` in ``items`` (they share the module
    phase, :func:`module_phase_key`) on one fake copy of ``model``: the module phase runs once, Dynamo
    captures once, and each plan compiles the captured graphs with its own backend (graph-level passes,
    AOTAutograd, partition) and runs its two steps (the first creates its optimizer's states, the second is
    tracked with a fresh tracker). Returns one :class:`MemoryEstimate` per item (the bytes of each are those
    of a replay of that plan alone). Raises on any failure (the caller replays the items alone then)."""
    t0 = time.perf_counter()
    rdev = replay_device(dev)
    fake_mode, work, inputs = fake_copy(model, example_inputs, rdev)
    was_training = work.training
    work.train(True if was_training is None else was_training)
    # Inductor is replayed from its generated code (its fusions, buffer reuse and frees); every other
    # lowering (eager, TensorRT) by the eager lowering's op-by-op run of the same partitioned graphs
    replay_lowering = "inductor" if requested_lowering == "inductor" else "eager"
    results = []
    try:
        torch._dynamo.reset()
        # kernels that choose by device (the fused head's Triton tiles on CUDA) take the target's path: the replay
        # predicts the program the target device runs, on CPU fake tensors too
        with replay_patches(rdev, inductor=replay_lowering == "inductor"), fake_mode, targeting(dev.type):
            with Tracker(device=rdev, allocator=dev):  # as during each step: .item() on a fake tensor reads 1
                first = prepare_replay_model(work, items[0][1], items[0][2], rdev)
            backends = [first]
            for _, options, _kw in items[1:]:
                from effpass.backend import EffpassBackend
                from effpass.report import CompileReport

                be = EffpassBackend(options, model=work, report=CompileReport(module=first.report.module))
                backends.append(be)
            switch = _SharedCapture(backends) if len(items) > 1 else None
            compiled = torch.compile(work, backend=switch or first, **items[0][2])
            for i, (pass_list, options, _kw) in enumerate(items):
                if switch is not None:
                    switch.current = i
                tracker = Tracker(device=rdev, allocator=dev)
                with tracker:
                    est = _run_tracked(work, compiled, inputs, tracker, backends[i], optimizer, dev, loss_fn, lr,
                                       replay_lowering, requested_lowering, compiled_already=i > 0, rdev=rdev)
                est.seconds = time.perf_counter() - t0
                results.append(est)
    finally:
        torch._dynamo.reset()
    return results


def _run_tracked(work, compiled, inputs, tracker, be, optimizer, dev, loss_fn, lr, replay_lowering,
                 requested_lowering, compiled_already=False, rdev=None):
    """Two training steps of the compiled fake copy (the first compiles and creates the optimizer states, the
    second is tracked); the estimate of the second.

    ``compiled_already`` (a later plan of a shared capture, whose graphs were all compiled by the first plan's
    first call): with the eager lowering (forward and backward compiled at once) and no gradient hooks on the
    parameters, the first step's only lasting effect is the optimizer's states, so they are made by one
    optimizer step on empty gradients instead of running the step (what is live at the tracked step's start
    is the same: parameters, buffers, states, inputs; gradients are None)."""
    notes: list[str] = []
    trainable = [p for p in work.parameters() if p.requires_grad]
    tracker.params = trainable
    opt = None
    if optimizer is not None and trainable:
        from effpass.memory_options import build_optimizer

        opt = build_optimizer(optimizer, trainable, lr=lr, device=rdev or dev)
    if (compiled_already and replay_lowering == "eager"
            and not any(getattr(p, "_post_accumulate_grad_hooks", None) for p in trainable)):
        if opt is not None:
            for p in trainable:
                p.grad = torch.empty_like(p)
            opt.step()
            opt.zero_grad(set_to_none=True)
    else:
        training_step(compiled, inputs, opt, loss_fn)      # compiles; creates optimizer states
    params = list(work.parameters())
    buffers = list(work.buffers())
    from .host_memory import replayed_host_optimizer

    on_host, host_opt_bytes = replayed_host_optimizer(opt, dev)  # an optimizer's host tensors are not device memory
    states = [v for s in (opt.state.values() if opt else ()) for v in s.values()
              if isinstance(v, torch.Tensor) and id(v) not in on_host]
    flat_inputs = [x for x in tree_flatten(inputs)[0] if isinstance(x, torch.Tensor)]
    start_sizes = storage_sizes(params + buffers + states + flat_inputs, dev)
    start = sum(start_sizes)
    p_bytes = tracked_bytes(params, dev)
    b_bytes = tracked_bytes(buffers, dev)
    s_bytes = tracked_bytes(states, dev)
    i_bytes = tracked_bytes(flat_inputs, dev)
    tracker.reset()
    from .host_memory import offload_mode

    tracker.offload = offload_mode(be.options.passes, dev, rdev)
    tracker.enabled = True
    phases = {}

    def set_phase(p):
        if tracker.phase == "forward" and p == "backward":
            phases["activations"] = tracker.live
        tracker.phase = p

    moved0 = dict(getattr(opt, "counters", None) or {})
    training_step(compiled, inputs, opt, loss_fn, on_phase=set_phase)
    tracker.enabled = False
    moved = {k: v - moved0.get(k, 0) for k, v in (getattr(opt, "counters", None) or {}).items()}
    tracker.keepalive.clear()
    del opt, states
    grads = sum(tracked_bytes([p], dev) for p in trainable)  # a gradient is laid out as its parameter (empty_like)
    step_peak = tracker.peak
    stats = {}
    for name in {p.name for p in be.options.passes}:
        try:
            s = be.report.stats(name)
        except Exception:
            continue
        if s:
            stats[name] = {k: v for k, v in s.items() if isinstance(v, (int, float, bool, str))}
    est = MemoryEstimate(
        peak_bytes=start + step_peak, start_bytes=start, step_peak_bytes=step_peak, parameters=p_bytes,
        trainable_parameters=tracked_bytes(trainable, dev), buffers=b_bytes, inputs=i_bytes, gradients=grads,
        optimizer_states=s_bytes, activations=phases.get("activations", 0),
        largest_transient=tracker.largest[0], largest_transient_op=tracker.largest[1],
        peak_phase=tracker.peak_where[0], peak_graph=tracker.peak_where[1], peak_node=tracker.peak_where[2],
        gradients_at_peak=tracker.grads_at_peak, phase_peaks=dict(tracker.phase_peaks), flops=tracker.flops,
        op_peaks=dict(tracker.op_peaks),
        optimizer=optimizer, device=str(dev), replay_lowering=replay_lowering,
        requested_lowering=requested_lowering, passes=[p.name for p in be.options.passes],
        pass_stats=stats, notes=notes, trainable_numels=[p.numel() for p in trainable],
        trainable_shapes=[(tuple(p.shape), str(p.dtype).removeprefix("torch.")) for p in trainable],
        host_bytes=tracker.host_peak + host_opt_bytes, offload_d2h_bytes=tracker.d2h_bytes,
        offload_h2d_bytes=tracker.h2d_bytes, optimizer_d2h_bytes=moved.get("d2h_bytes", 0),
        optimizer_h2d_bytes=moved.get("h2d_bytes", 0),
        offload_overlapped=bool(tracker.offload and tracker.offload["stream"]),
        prefetch_window=tracker.prefetch_window, forward_flops=tracker.forward_flops)
    est.gradients_at_peak, est.non_gradient_peak, est.gradients_at_non_gradient_peak = gradient_split(
        tracker.events, tracker.grads_at_peak)
    est.timeline = step_timeline(tracker.events, est)
    est.notes.extend(tracker.hints.notes())
    if requested_lowering not in ("inductor", "eager"):
        est.notes.append(f"lowering={requested_lowering!r} is predicted by the eager lowering's replay of the same "
                         f"partitioned graphs (its own buffer plan is not replayed)")
    if host_opt_bytes:
        est.notes.append(f"{optimizer}: its host tensors (parameter copies and gradient buffers, pinned on CUDA; "
                         f"AdamW's states) counted as host memory (host_bytes), the gradients it took and the "
                         f"parameters it copied back as the bytes moved; the CPU's AdamW step is not timed")
    if dev.type == "cuda":
        est.reserved_peak_bytes = cuda_reserved_peak(start_sizes, tracker.events)
        est.reserved_expandable_bytes = cuda_reserved_peak(start_sizes, tracker.events, expandable_segments=True)
        est.notes.append(
            "CUDA: every storage rounded up to the caching allocator's 512-byte blocks (peak_bytes: what "
            "torch.cuda.max_memory_allocated would read); the device must hold the allocator's segments "
            f"({format_bytes(est.reserved_peak_bytes)} reserved: the start's storages, then the step twice through "
            "a model of the caching allocator, effpass.planning.cuda_allocator), which the plan fits to the budget"
            + ("; replayed on CPU fake tensors (no CUDA here): CPU kernels' outputs and workspaces" if rdev is not None
               and rdev != dev else ""))
    est.largest_unit_bytes = largest_unit_bytes(work)
    if tracker.places is not None:  # each allocation's place, for the extrapolation over the tile count
        from .places import freeze

        est.places = freeze(tracker.places)
        tracker.places = None
    return est


def cuda_reserved_peak(start_sizes, events, expandable_segments: bool = False) -> int:
    """Bytes CUDA's caching allocator reserves for a step: the storages live at its start allocated first (in
    order), then the tracked step's allocations and frees twice (the first as the warm-up step that fills the
    allocator's cache, the second as the steady-state step). ``expandable_segments``: the allocator with
    ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (:mod:`effpass.planning.cuda_allocator`)."""
    step = [(n, key) for n, key, *_ in events]
    return simulate([(n, ("start", i)) for i, n in enumerate(start_sizes)] + step + step,
                    expandable_segments=expandable_segments).reserved


def replay_many(model, example_inputs, pipelines, optimizer, dev, loss_fn, lr, compile_options, share=True):
    """One estimate (or the exception its replay raised) per pipeline in ``pipelines``, replayed on fake
    tensors at the model's own depth. Pipelines with the same module phase share one fake copy and one
    Dynamo capture (``share``); if a shared replay fails, its pipelines are replayed alone."""
    requested_lowering, replay_lowering, opts = split_compile_options(compile_options)
    out: list = [None] * len(pipelines)
    groups: dict = {}
    for i, passes in enumerate(pipelines):
        try:
            pass_list = without_fsdp(passes, dev)
        except Exception as e:  # a bad pipeline: raised as given
            out[i] = e
            continue
        try:
            options, kwargs = replay_options(pass_list, replay_lowering, opts, dev)
            key = module_phase_key(options, kwargs) if share else i
        except Exception as e:
            out[i] = _replay_errors(model, e)
            continue
        groups.setdefault(key, []).append((i, (pass_list, options, kwargs)))
    for members in groups.values():
        idx = [i for i, _ in members]
        items = [it for _, it in members]
        try:
            for i, est in zip(idx, _replay_group(model, example_inputs, items, optimizer, dev, loss_fn, lr,
                                                 requested_lowering)):
                out[i] = est
            continue
        except Exception as e:
            if len(items) == 1:
                out[idx[0]] = _replay_errors(model, e)
                continue
        for i, it in members:  # a shared replay failed: each alone, so that errors name their plan
            try:
                out[i] = _replay_group(model, example_inputs, [it], optimizer, dev, loss_fn, lr,
                                       requested_lowering)[0]
            except Exception as e:
                out[i] = _replay_errors(model, e)
    return out


def module_groups(pipelines, dev, compile_options) -> list[list[int]]:
    """Indices of ``pipelines`` grouped as :func:`replay_many` shares them (the same module phase); a
    pipeline that cannot be read is a group of its own (its replay reports the error)."""
    _, lowering, opts = split_compile_options(compile_options)
    groups: dict = {}
    for i, passes in enumerate(pipelines):
        try:
            options, kwargs = replay_options(without_fsdp(passes, dev), lowering, opts, dev)
            key = module_phase_key(options, kwargs)
        except Exception:
            key = ("unreadable", i)
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def without_fsdp(passes, device):
    """The pipeline without sharding passes (sharding is folded onto the one-rank replay, not replayed)."""
    from effpass.config import _build_passes

    if passes is None:
        return None
    from .host_memory import emulated

    built = _build_passes(passes)
    return [emulated(p, device) for p in built
            if not any(o.sharding for o in type(p).memory_options(None, world_size=2))]


def largest_unit_bytes(model: torch.nn.Module) -> int:
    from effpass.graph import transformer_blocks
    from effpass.quantized import storage_bytes

    units = transformer_blocks(model)
    return max((storage_bytes(list(u.parameters())) for _, u in units), default=0)
