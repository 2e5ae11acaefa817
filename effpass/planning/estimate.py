"""Predict the peak memory of one training step by replaying it on fake tensors.

How: the model is copied with every parameter, buffer and tensor attribute replaced by a *fake* tensor
(``torch._subclasses.FakeTensor``: shape, dtype and device, no storage) on the target device, the
module-level passes run on the copy (quantization and adapters make fake buffers and parameters), then
the copy is compiled by an effpass backend built directly (no loop back through ``effpass.compile``;
``lowering="eager"``: the AOTAutograd joint graph, passes and min-cut
partition run op by op; ``lowering="inductor"``: Inductor compiles, and its generated wrapper runs with
fake allocations and no kernels, see :func:`_fake_wrapper`) and one training step (forward, backward,
optimizer step, ``zero_grad``) runs twice on fake inputs: the first compiles and creates the optimizer states, the second
is tracked. A :class:`TorchDispatchMode` adds a storage's bytes when an op creates it (a storage none of
the op's inputs hold) and subtracts them when the storage dies (``weakref.finalize``); the running maximum
is the step's peak above the bytes live at its start (parameters, buffers, optimizer states, inputs).
Models with many identical blocks are replayed at 2, 3 and 4 blocks and extrapolated (checked affine,
see :func:`_extrapolate_depth`).

Why fake CPU/CUDA tensors, not the meta device: on ``meta`` tensors ``scaled_dot_product_attention``
picks the math path (it materialises the scores) and ``nll_loss`` loses its backward (Python Meta kernels
registered for composite ops), so the replayed program is not the one that runs. Fake tensors claim the
real device, so every kernel choice is the device's own. Traps avoided (see the shared torch-facts notes):
a dispatch mode makes Dynamo skip compiling unless ``ignore_compile_internals()`` is True; ``model.to``
unties tied weights (the copy maps each parameter object once); ``torch.tensor(...)`` inside traced
model code needs fake-tensor "non-fake inputs" allowed.

Every byte is counted as storage holds it (``effpass.quantized.storage_bytes``: tensor subclasses such as
torchao's NF4 and int8 weights by their inner tensors, each storage once). For ``device="cuda"`` every
storage is rounded up to the CUDA caching allocator's 512-byte block, as torch's ``MemTracker`` does.

All process-wide patching the replay needs (Inductor's compiled graphs run their generated wrapper with fake
allocations; Dynamo's fake modes accept real constants) happens inside one context manager,
:func:`replay_patches`, and is undone when it exits.

The GPU path (fake CUDA tensors, the allocator rounding) is untested: no GPU was available when this was
written.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import linecache
import re
import sys
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["MemoryEstimate", "estimate_memory", "estimate_many", "confirm_many", "start_bytes_many", "training_step", "format_bytes", "parse_size", "with_optimizer",
           "optimizer_replay", "replay_patches", "fold_fsdp"]

_GIB = 1024 ** 3
#: the CUDA caching allocator's smallest block (torch.distributed._tools.mem_tracker._PYTORCH_MIN_ALLOCATE)
CUDA_MIN_ALLOCATE = 512


def _alloc_bytes(n: int, device) -> int:
    """Bytes the device's allocator holds for a storage of ``n`` bytes (CUDA: rounded up to 512)."""
    if torch.device(device).type == "cuda" and n:
        return -(-n // CUDA_MIN_ALLOCATE) * CUDA_MIN_ALLOCATE
    return n


def _bytes(tensors, device="cpu") -> int:
    """Storage-true bytes of ``tensors`` (each storage once), as the device's allocator holds them."""
    from effpass.quantized import inner_tensors, _storage_key_and_bytes

    seen, total = set(), 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        for inner in inner_tensors(t):
            key, n = _storage_key_and_bytes(inner)
            if key not in seen:
                seen.add(key)
                total += _alloc_bytes(n, device)
    return total

from effpass.config import parse_size  # noqa: E402  (re-exported)


def format_bytes(n: float) -> str:
    n = float(n)
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


# ------------------------------------------------------------------------------------------------------
# the result
# ------------------------------------------------------------------------------------------------------
@dataclass
class MemoryEstimate:
    """The predicted memory of one steady-state training step (bytes; per rank when ``world_size > 1``).

    ``peak_bytes = start_bytes + step_peak_bytes``: what is live at the step's start (parameters,
    buffers, optimizer states, inputs) plus the peak of what the forward, backward and optimizer step
    allocate above it.
    """

    peak_bytes: int
    start_bytes: int
    step_peak_bytes: int
    parameters: int                 # every parameter (trainable and frozen), each storage once
    trainable_parameters: int
    buffers: int                    # buffers (quantized weights live here)
    inputs: int
    gradients: int                  # all gradients (what exists when backward ends)
    optimizer_states: int
    activations: int                # live when the forward returns: saved for backward (+ the loss)
    largest_transient: int          # the largest single allocation of the step
    largest_transient_op: str
    peak_phase: str                 # "forward", "backward" or "optimizer"
    peak_graph: str                 # e.g. "backward graph 1 of 1" or "eager code"
    peak_node: str                  # the FX node (or aten op) that allocated at the peak
    gradients_at_peak: int = 0      # gradient bytes live at the peak (inside compiled backward graphs too)
    #: max over the forward and backward of (live - live gradients) above the start, and the gradient bytes live
    #: then: with the peak's split, what folding sharded gradients needs (``planning.sharding.fold_sharding``)
    non_gradient_peak: int = 0
    gradients_at_non_gradient_peak: int = 0
    phase_peaks: dict = field(default_factory=dict)  # peak above the start within each phase
    trainable_numels: list = field(default_factory=list)
    trainable_shapes: list = field(default_factory=list)  # (shape, dtype name) of each trainable parameter
    flops: int = 0                  # of the step: matmul/attention FLOPs (torch's flop counter) + 1 per element
                                    # written by any other op
    optimizer: str | None = "adamw"
    world_size: int = 1
    sharding: str = "none"          # "none" or the folded sharding mode, e.g. "zero3" (see fold_fsdp)
    device: str = "cpu"
    replay_lowering: str = "eager"
    requested_lowering: str = "eager"
    passes: list = field(default_factory=list)
    pass_stats: dict = field(default_factory=dict)
    seconds: float = 0.0
    notes: list = field(default_factory=list)
    largest_unit_bytes: int = 0     # parameters of the largest block (FSDP unit), after module passes
    depths: list = field(default_factory=list)  # block counts replayed when extrapolated (else empty)
    #: live bytes over the step by category (:func:`step_timeline`); None when not recorded (extrapolated)
    timeline: dict | None = None
    #: predicted from two depths, affinity not yet checked at a third (``estimate_many(screen=True)``)
    provisional: bool = False

    def breakdown(self) -> dict[str, int]:
        return {"parameters": self.parameters, "buffers": self.buffers, "inputs": self.inputs,
                "optimizer_states": self.optimizer_states, "gradients": self.gradients,
                "activations": self.activations, "largest_transient": self.largest_transient}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def summary(self) -> str:
        lines = [f"predicted peak of one training step: {format_bytes(self.peak_bytes)} ({self.peak_bytes} bytes)"
                 + (f" per rank, {self.world_size} ranks ({self.sharding})" if self.world_size > 1 else ""),
                 f"  live at the step's start: {format_bytes(self.start_bytes)} = parameters "
                 f"{format_bytes(self.parameters)} ({format_bytes(self.trainable_parameters)} trainable) + buffers "
                 f"{format_bytes(self.buffers)} + optimizer states {format_bytes(self.optimizer_states)} "
                 f"({self.optimizer}) + inputs {format_bytes(self.inputs)}",
                 f"  during the step: peak +{format_bytes(self.step_peak_bytes)}; gradients "
                 f"{format_bytes(self.gradients)}, activations saved for backward {format_bytes(self.activations)}, "
                 f"largest transient {format_bytes(self.largest_transient)} ({self.largest_transient_op})",
                 f"  the peak occurs in the {self.peak_phase} ({self.peak_graph}) at {self.peak_node}",
                 f"  replayed with lowering={self.replay_lowering!r} on fake {self.device} tensors in "
                 f"{self.seconds:.1f} s; passes: {', '.join(self.passes) or '(none)'}"]
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------
# the step that is predicted (tests and benchmarks measure this same function)
# ------------------------------------------------------------------------------------------------------
def _loss_of(out) -> torch.Tensor:
    if hasattr(out, "loss") and getattr(out, "loss") is not None:
        return out.loss
    if isinstance(out, torch.Tensor):
        return out if out.dim() == 0 else out.float().mean()
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0] if out[0].dim() == 0 else out[0].float().mean()
    if isinstance(out, Mapping) and "loss" in out:
        return out["loss"]
    raise TypeError(f"cannot find a loss in the model's output ({type(out).__name__}); return a scalar, a "
                    f"(loss, ...) tuple or an object with .loss, or pass loss_fn=")


def _call(model, inputs):
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, torch.Tensor):
        return model(inputs)
    return model(*inputs)


def training_step(model, inputs, optimizer=None, loss_fn: Callable | None = None, _phase=None):
    """One training step as the planner predicts it: ``loss = loss_fn(model(*inputs))`` (inputs a tuple
    or a dict of keyword arguments), ``loss.backward()``, ``optimizer.step()``,
    ``optimizer.zero_grad(set_to_none=True)``. Returns the loss (detached)."""
    set_phase = _phase or (lambda p: None)
    set_phase("forward")
    out = _call(model, inputs)
    loss = (loss_fn or _loss_of)(out)
    del out
    set_phase("backward")
    loss.backward()
    value = loss.detach()
    del loss
    set_phase("optimizer")
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    else:
        for p in model.parameters():
            p.grad = None
    set_phase(None)
    return value


# ------------------------------------------------------------------------------------------------------
# the allocation tracker
# ------------------------------------------------------------------------------------------------------
class _Tracker(TorchDispatchMode):
    """Adds a storage's bytes when an op creates it, frees them when it dies; keeps the running peak."""

    #: higher-order ops (e.g. run_and_save_rng_state when a recomputed region has random ops) come here too:
    #: they run below this mode, their outputs are tracked like any op's
    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls):  # NOTE: else Dynamo skips compiling under this mode
        return True

    def __init__(self, params: Sequence[torch.Tensor] = (), device="cpu"):
        super().__init__()
        self.device = torch.device(device)
        self.live = 0
        self.peak = 0
        self.sizes: dict[int, int] = {}
        self.enabled = False
        self.phase: str | None = None
        self.peak_where = ("-", "-", "-")
        self.largest = (0, "-")
        self.params = list(params)
        self.grads_at_peak = 0
        self.events = []
        self.phase_peaks: dict[str | None, int] = {}
        self.graphs: dict[tuple[str, str], str] = {}
        self._scratch = 0  # keys of in-kernel scratch buffers (negative: never a storage's key)
        self.flops = 0
        self._flop_registry = None
        try:
            from torch.utils.flop_counter import flop_registry

            self._flop_registry = flop_registry
        except Exception:  # pragma: no cover
            pass

    def reset(self):
        #: (+bytes or -bytes, storage key, phase, op) per allocation and free of the measured step: the timeline
        self.events: list[tuple[int, int, str | None, str]] = []
        self.live = self.peak = 0
        self.peak_where = ("-", "-", "-")
        self.largest = (0, "-")
        self.grads_at_peak = 0
        self.flops = 0
        self.phase_peaks = {}

    def _free(self, key):
        n = self.sizes.pop(key, 0)
        self.live -= n
        if n and self.enabled:
            self.events.append((-n, key, self.phase, ""))

    def _where(self, func) -> tuple[str, str]:
        f = sys._getframe(2)
        while f is not None:
            fn = f.f_code.co_filename
            inductor = f.f_code in _FAKE_WRAPPER_CODE
            if fn.startswith("<eval_with_key>") or inductor:
                line = linecache.getline(fn, f.f_lineno).strip()
                key = (self.phase or "-", fn)
                if key not in self.graphs:
                    self.graphs[key] = str(1 + sum(1 for k in self.graphs if k[0] == key[0]))
                node = line.split("=", 1)[0].strip() if "=" in line else line
                kind = "Inductor " if inductor else ""
                return f"{self.phase} {kind}graph {self.graphs[key]}", f"{node} ({func})"
            f = f.f_back
        return "eager code", str(func)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default and isinstance(args[0], torch.Tensor):
            a = args[0]  # .item() on a fake tensor (the optimizer's step count)
            if isinstance(a, torch._subclasses.FakeTensor) or a.device.type == "meta":
                return 1.0 if a.is_floating_point() else (True if a.dtype == torch.bool else 1)
        _DISPATCHING.append(self)
        try:
            out = func(*args, **kwargs)
        finally:
            _DISPATCHING.pop()
        if not self.enabled:
            return out
        packet = getattr(func, "_overloadpacket", None)
        if packet is None:  # a higher-order op: no flop formula
            pass
        elif self._flop_registry is not None and packet in self._flop_registry:
            try:
                self.flops += int(self._flop_registry[packet](*args, **kwargs, out_val=out))
            except Exception:  # pragma: no cover - a flop formula that does not fit these args
                pass
        elif not func.is_view:  # every other op: one per element it writes
            self.flops += sum(t.numel() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        from effpass.quantized import inner_tensors

        flat_in = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        ins = set()
        for a in flat_in:
            for i in inner_tensors(a):
                try:
                    ins.add(i.untyped_storage()._cdata)
                except Exception:
                    pass
        # NOTE(subclasses): a wrapper subclass (NF4, int8, 8-bit optimizer states) holds its inner tensors'
        # storages; its own ops run below this mode, so its outputs are sized by their inner tensors here
        for t in (i for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor) for i in inner_tensors(o)):
            try:
                st = t.untyped_storage()
            except Exception:  # pragma: no cover - a tensor without a storage
                continue
            key = st._cdata
            if key in ins or key in self.sizes:
                continue
            if t.device.type != self.device.type and t.device.type != "meta":
                continue  # NOTE(offload): host memory (offloaded activations, CPU step counters) is not device memory
            n = _alloc_bytes(st.nbytes(), self.device)
            self.sizes[key] = n
            weakref.finalize(st, self._free, key)
            self._grow(n, key, func)
        # buffers the real kernel allocates and frees inside the op (not its outputs): live beside its outputs
        work = _alloc_bytes(_kernel_workspace(func, args), self.device)
        if work:
            self._scratch -= 1
            self._grow(work, self._scratch, func)
            self.live -= work
            self.events.append((-work, self._scratch, self.phase, ""))
        return out

    def _grow(self, n: int, key: int, func) -> None:
        """``n`` bytes allocated (storage ``key``) by ``func``: the live bytes, the events and the peaks."""
        self.live += n
        self.events.append((n, key, self.phase, str(getattr(func, "__name__", func))))
        if n > self.largest[0]:
            self.largest = (n, f"{func} in the {self.phase}")
        if self.live > self.phase_peaks.get(self.phase, 0):
            self.phase_peaks[self.phase] = self.live
        if self.live > self.peak:
            self.peak = self.live
            graph, node = self._where(func)
            self.peak_where = (self.phase or "-", graph, node)
            if self.phase in ("backward", "optimizer"):
                self.grads_at_peak = _bytes([p.grad for p in self.params if p.grad is not None],
                                            self.device)


#: ops whose CPU and CUDA kernels make their tensor inputs contiguous first (``input.contiguous()`` inside the
#: kernel: a copy of each non-contiguous input, live beside the output until the op returns). A fake or meta
#: kernel allocates only the outputs. Measured: a DPO step's ``log_softmax(logits[:, :-1])`` copies the sliced
#: logits (one head's logits, 4 MiB in tests/passes/fuse_cross_entropy/test_fused_logprobs.py's planner test), which the replay missed.
_CONTIGUOUS_INPUT_OPS = {
    "aten::_log_softmax": (0,), "aten::_softmax": (0,),
    "aten::_log_softmax_backward_data": (0, 1), "aten::_softmax_backward_data": (0, 1),
}


def _kernel_workspace(func, args) -> int:
    """Bytes of the contiguous copies ``func``'s real kernel makes of its non-contiguous inputs."""
    which = _CONTIGUOUS_INPUT_OPS.get(getattr(getattr(func, "_schema", None), "name", ""))
    if not which:
        return 0
    total = 0
    for i in which:
        a = args[i] if i < len(args) else None
        if isinstance(a, torch.Tensor) and not a.is_contiguous():
            total += a.numel() * a.element_size()
    return total


#: the trackers whose ``__torch_dispatch__`` is running an op (innermost last), for :func:`replay_kernel`
_DISPATCHING: list = []


@contextlib.contextmanager
def replay_kernel():
    """For a fake kernel that does the real op's work on fake tensors during a replay (step_in_backward's
    optimizer step inside backward): re-enters the replay's tracker, which a dispatch mode leaves while it
    runs an op, so that the kernel's own allocations and frees are counted. Outside a replay: nothing."""
    tracker = _DISPATCHING[-1] if _DISPATCHING else None
    if tracker is None:
        yield
        return
    with tracker:
        yield


TIMELINE_CATEGORIES = ("parameters", "optimizer states", "inputs", "saved activations", "gradients", "transients")


def _gradient_split(events, grads_at_peak: int) -> tuple[int, int, int]:
    """(gradient bytes live at the step's peak, max over the forward and backward of live bytes minus live
    gradient bytes, the gradient bytes live at that moment).

    Gradients are what the backward makes and keeps past its end (as :func:`step_timeline` classifies them).
    A compiled backward graph holds the gradients it computes as its own tensors until it returns (``p.grad``
    is set after), so counting ``p.grad`` at the peak (``grads_at_peak``, the tracker's) misses them: the
    events see them."""
    open_alloc: dict[int, int] = {}          # storage key -> index of its live allocation event
    freed_in: dict[int, str | None] = {}     # allocation event index -> phase of its free
    for i, (delta, key, phase, _) in enumerate(events):
        if delta > 0:
            open_alloc[key] = i
        elif key in open_alloc:
            freed_in[open_alloc.pop(key)] = phase
    live = grads = peak = g_peak = other = g_other = 0
    sizes: dict[int, tuple[bool, int]] = {}
    for i, (delta, key, phase, _) in enumerate(events):
        if delta > 0:
            is_grad = phase == "backward" and freed_in.get(i, "end") != "backward"
            sizes[key] = (is_grad, delta)
            live += delta
            grads += delta if is_grad else 0
        else:
            is_grad, n = sizes.pop(key, (False, 0))
            live -= n
            grads -= n if is_grad else 0
        if live > peak:
            peak, g_peak = live, grads
        if phase in ("forward", "backward") and live - grads > other:
            other, g_other = live - grads, grads
    return max(g_peak, grads_at_peak), other, g_other


def step_timeline(events, est: "MemoryEstimate", max_points: int = 600) -> dict:
    """Live bytes over one step, stacked by category, from the tracker's allocation events.

    What is live at the step's start is constant (parameters and buffers, optimizer states, inputs). What the
    step allocates is classified by when it was made and freed: made in the forward and alive past it = saved
    activations (the loss included); made in the backward and alive into the optimizer step or past it =
    gradients; everything else = transients. Downsampled to ``max_points`` points, keeping each bucket's
    highest point (so the peak is drawn at its height)."""
    made: dict[int, str | None] = {}
    freed: dict[int, str | None] = {}
    for delta, key, phase, _ in events:
        if delta > 0:
            made[key] = phase
            freed.pop(key, None)
        else:
            freed[key] = phase

    def category(key) -> str:
        a, f = made.get(key), freed.get(key, "end")
        if a == "forward" and f != "forward":
            return "saved activations"
        if a == "backward" and f != "backward":
            return "gradients"
        return "transients"

    static = {"parameters": est.parameters + est.buffers, "optimizer states": est.optimizer_states,
              "inputs": est.inputs}
    live = {"saved activations": 0, "gradients": 0, "transients": 0}
    sizes: dict[int, tuple[str, int]] = {}
    points, peak_i, peak_total = [], 0, -1
    for i, (delta, key, phase, op) in enumerate(events):
        if delta > 0:
            c = category(key)
            sizes[key] = (c, delta)
            live[c] += delta
        else:
            c, n = sizes.pop(key, ("transients", 0))
            live[c] -= n
        total = sum(live.values())
        points.append((i, phase or "-", live["saved activations"], live["gradients"], live["transients"], op))
        if total > peak_total:
            peak_total, peak_i = total, i
    if len(points) > max_points:  # keep each bucket's highest point
        step = -(-len(points) // max_points)
        kept = []
        for b in range(0, len(points), step):
            chunk = points[b:b + step]
            kept.append(max(chunk, key=lambda p: p[2] + p[3] + p[4]))
        if all(p[0] != peak_i for p in kept):
            kept.append(points[peak_i])
            kept.sort()
        points = kept
    return {"categories": list(TIMELINE_CATEGORIES), "static": static, "events": len(events),
            "points": [list(p[:5]) for p in points],
            "peak": {"event": peak_i, "bytes": est.start_bytes + max(peak_total, 0), "phase": est.peak_phase,
                     "graph": est.peak_graph, "node": est.peak_node}}


# ------------------------------------------------------------------------------------------------------
# replaying Inductor's generated code on fake tensors
# ------------------------------------------------------------------------------------------------------
class _NoKernel:
    """Stands in for a generated kernel (C++ or Triton): kernels write into buffers the wrapper allocated,
    so skipping them changes no allocation."""

    def __call__(self, *args, **kwargs):
        return None

    def run(self, *args, **kwargs):
        return None


def _noop(*args, **kwargs):
    return None


#: the code objects of the fake wrappers made so far -> their generated file (for "where is the peak")
_FAKE_WRAPPER_CODE: dict[Any, str] = {}


def _fake_wrapper(compiled_graph, device, cache: dict):
    """The ``call`` of Inductor's generated Python wrapper for ``compiled_graph`` with fake allocations.

    The wrapper allocates every buffer (``empty_strided_cpu/cuda``), runs kernels into them, reuses them
    (``buf5 = buf2; del buf2  # reuse``) and frees them (``del buf3``, ``args.clear()``) in exactly the
    order of the real run. Run with its globals swapped (allocators make fake tensors, kernels do nothing,
    ``reinterpret_tensor`` is ``as_strided``), under the fake mode and the tracker, it replays the real
    allocation sequence; extern kernels (``extern_kernels.mm(..., out=buf)``) and ATen fallbacks
    (``aten._scaled_dot_product_flash_attention_for_cpu``) run as fake ops. The module itself is not
    changed (a real run of the same code in this process still works): a copy of ``call`` gets new globals.
    """
    import types

    from torch._inductor.codecache import PyCodeCache

    key = compiled_graph.cache_key
    if key in cache:
        return cache[key]
    mod = PyCodeCache.load_by_key_path(key, compiled_graph.write_to_disk())
    g = dict(mod.__dict__)

    def empty(size, stride, dtype, *_a, _dev=device, **_k):
        return torch.empty_strided(size, stride, dtype=dtype, device=_dev)

    for name, value in list(g.items()):
        if name.startswith("empty_strided"):
            g[name] = empty
        elif name.startswith(("cpp_", "triton_")) and not isinstance(value, type(torch)):
            g[name] = _NoKernel()
    g["reinterpret_tensor"] = lambda t, size, stride, offset: t.as_strided(size, stride, t.storage_offset() + offset)
    g["assert_size_stride"] = _noop
    g["assert_alignment"] = _noop
    call = mod.call
    if isinstance(call, types.MethodType):  # torch >= 2.11: a Runner object's bound method
        f = call.__func__
        fn = types.MethodType(types.FunctionType(f.__code__, g, f.__name__, f.__defaults__, f.__closure__),
                              call.__self__)
        code = f.__code__
    else:
        fn = types.FunctionType(call.__code__, g, call.__name__, call.__defaults__, call.__closure__)
        code = call.__code__
    _FAKE_WRAPPER_CODE[code] = getattr(mod, "__file__", key)
    cache[key] = fn
    return fn


@contextlib.contextmanager
def _replay_inductor_wrappers(device):
    """While active, every Inductor-compiled graph runs its generated wrapper with fake allocations
    (:func:`_fake_wrapper`) instead of its kernels."""
    from torch._inductor.output_code import CompiledFxGraph

    orig = CompiledFxGraph.__call__
    cache: dict = {}

    def call(self, inputs):
        if not isinstance(self, CompiledFxGraph) or getattr(self, "cache_key", None) is None:
            return orig(self, inputs)
        return _fake_wrapper(self, device, cache)(inputs)

    CompiledFxGraph.__call__ = call
    try:
        yield
    finally:
        CompiledFxGraph.__call__ = orig


# ------------------------------------------------------------------------------------------------------
# fake copies of the model and the inputs
# ------------------------------------------------------------------------------------------------------
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


def _storage_bytes(tensors) -> int:
    """Storage-true bytes (``effpass.quantized.storage_bytes``), as kept for callers of the old name."""
    from effpass.quantized import storage_bytes

    return storage_bytes(list(tensors))


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


@contextlib.contextmanager
def replay_patches(device, inductor: bool):
    """Every process-wide patch a replay needs, undone on exit: Dynamo's fake modes accept real constants
    (:func:`_allow_non_fake_inputs`) and, with ``inductor``, compiled graphs run their generated wrapper with
    fake allocations (:func:`_replay_inductor_wrappers`; also what lets a compiled optimizer step, e.g.
    torchao's, run on fake parameters)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(_allow_non_fake_inputs())
        stack.enter_context(_no_graph_strings())
        if inductor:
            stack.enter_context(_replay_inductor_wrappers(device))
        yield


# ------------------------------------------------------------------------------------------------------
def _target_device(model: torch.nn.Module, device) -> torch.device:
    if device is not None:
        return torch.device(device)
    for t in list(model.parameters()) + list(model.buffers()):
        if t.device.type != "meta":
            return t.device
    return torch.device("cpu")


def _check_optimizer(optimizer):
    from effpass.memory_options import registered_optimizers
    from effpass.pass_api import registered_passes

    registered_passes()  # loads the built-in passes and plugins (some register optimizers)

    valid = list(registered_optimizers())
    if optimizer is not None and optimizer not in valid:
        raise ValueError(f"optimizer {optimizer!r} is not valid; choose one of {valid + [None]}")


def _replay_options(pass_list, lowering, opts, dev):
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


def _module_phase_key(options, kwargs) -> tuple:
    """What the module phase of a replay depends on: its module-level passes (names and options, in order)
    and the compile arguments. Replays with the same key can share one prepared fake copy and one Dynamo
    capture (:func:`_replay_group`)."""
    from effpass.backend import EffpassBackend
    from effpass.pass_api import Phase

    mgr = EffpassBackend(options).manager
    return (tuple((p.name, repr(sorted(p.options().items()))) for p in mgr.passes_for(Phase.MODULE)),
            repr(sorted(kwargs.items())), options.lowering)


def _build_replay_backend(work, pass_list, lowering, opts, dev):
    """An effpass backend for the fake copy, built directly (its module phase run on the copy): the replay
    never goes back through ``effpass.compile`` (whose ``memory_budget`` would plan again)."""
    options, kwargs = _replay_options(pass_list, lowering, opts, dev)
    backend = _prepare_replay_model(work, options, kwargs, dev)
    return backend, torch.compile(work, backend=backend, **kwargs)


def _prepare_replay_model(work, options, kwargs, dev):
    """The effpass backend of ``options`` for the fake copy ``work``, after running its module phase on it."""
    from effpass.backend import EffpassBackend

    backend = EffpassBackend(options, model=work)
    backend.manager.run_module_phase(work, backend.report.module, device=dev, lowering=options.lowering,
                                     backend_factory=lambda: backend, compile_kwargs=kwargs)
    if "transformers" in sys.modules:  # as effpass.compile does for a Hugging Face model: the same graphs
        from effpass.integrations.huggingface import set_hf_loss_type

        set_hf_loss_type(work)
    return backend


#: the Dynamo graph being compiled by :class:`_SharedCapture` (the key of shared joint traces)
_JOINT_KEY: list = []
#: share AOTAutograd's joint trace between plans with the same torch-IR graph (:func:`_shared_joint_traces`).
#: (It once asserted "traced_tangent_metas should be None before calling make_runtime_safe": AOTAutograd makes
#: the trace's subclass metadata runtime-safe in place; each plan now gets its own copy, :func:`_fresh_aot_meta`.)
_SHARE_JOINT = True


def _joint_key(gm, args) -> tuple:
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
    return (_JOINT_KEY[-1], h.hexdigest(), tuple(id(a) for a in args), repr(sorted(cfg.items(), key=str)),
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


@contextlib.contextmanager
def _shared_joint_traces():
    """While active (inside :class:`_SharedCapture`), plans whose torch-IR graphs are the same (they differ
    only in joint-graph passes or partitioning, e.g. checkpoint policies) share AOTAutograd's joint trace:
    the first plan's trace is kept and every plan gets its own copy of it (node meta copied, so the joint
    passes' marks stay per plan), with the per-call bookkeeping AOTAutograd does after tracing
    (``fw_metadata``'s stream indices and tangent stack traces) redone on the plan's own metadata. The
    metadata pass before the trace (a functionalized run of the forward) is shared the same way. Every
    shared object is handed out as a fresh copy (:func:`_fresh_aot_meta`). Partitioning, compiling and the
    runtime wrappers stay per plan."""
    from torch._dynamo.backends import common
    from torch._functorch import aot_autograd
    from torch._functorch._aot_autograd import graph_capture, graph_compile

    from effpass.graph import lazy_graph_module, snapshot_graph

    orig_simplified = common.aot_module_simplified
    orig_trace = graph_compile.aot_dispatch_autograd_graph
    orig_collect = aot_autograd.run_functionalized_fw_and_collect_metadata
    cache: dict = {}
    keys: list = []

    def simplified(gm, args, *a, **kw):
        keys.append(_joint_key(gm, args) if _JOINT_KEY and isinstance(gm, torch.fx.GraphModule) else None)
        try:
            return orig_simplified(gm, args, *a, **kw)
        finally:
            keys.pop()

    def copy_joint(fx_g):
        # lazy: a joint graph is partitioned, never run, so its code need not be generated
        new = lazy_graph_module(fx_g, snapshot_graph(fx_g.graph), class_name=type(fx_g).__name__)
        new.meta = dict(getattr(fx_g, "meta", {}))
        return new

    def trace(flat_fn, flat_args, flat_args_descs, aot_config, *, fw_metadata):
        key = keys[-1] if keys else None
        if key is None:
            return orig_trace(flat_fn, flat_args, flat_args_descs, aot_config, fw_metadata=fw_metadata)
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

    metas: dict = {}

    def collect_metadata(*a, **kw):  # AOTAutograd's metadata pass (one functionalized run of the forward)
        inner = orig_collect(*a, **kw)
        key = keys[-1] if keys else None
        if key is None:
            return inner

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

        _JOINT_KEY.append(id(gm))
        try:
            with _shared_joint_traces() if _SHARE_JOINT else contextlib.nullcontext():
                fns = [be(copy_dynamo_graph_module(gm), example_inputs, **kwargs) for be in self.backends]
        finally:
            _JOINT_KEY.pop()

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
    phase, :func:`_module_phase_key`) on one fake copy of ``model``: the module phase runs once, Dynamo
    captures once, and each plan compiles the captured graphs with its own backend (graph-level passes,
    AOTAutograd, partition) and runs its two steps (the first creates its optimizer's states, the second is
    tracked with a fresh tracker). Returns one :class:`MemoryEstimate` per item (the bytes of each are those
    of a replay of that plan alone). Raises on any failure (the caller replays the items alone then)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    t0 = time.perf_counter()
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake = _fake_factory(fake_mode, dev)
    work = _fake_model(model, fake, dev)
    inputs = _fake_inputs(example_inputs, fake)
    was_training = work.training
    work.train(True if was_training is None else was_training)
    # Inductor is replayed from its generated code (its fusions, buffer reuse and frees); every other
    # lowering (eager, TensorRT) by the eager lowering's op-by-op run of the same partitioned graphs
    replay_lowering = "inductor" if requested_lowering == "inductor" else "eager"
    results = []
    try:
        torch._dynamo.reset()
        with replay_patches(dev, inductor=replay_lowering == "inductor"), fake_mode:
            with _Tracker(device=dev):  # as during each step: .item() on a fake tensor reads 1
                first = _prepare_replay_model(work, items[0][1], items[0][2], dev)
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
                tracker = _Tracker(device=dev)
                with tracker:
                    est = _run_tracked(work, compiled, inputs, tracker, backends[i], optimizer, dev, loss_fn, lr,
                                       replay_lowering, requested_lowering, compiled_already=i > 0)
                est.seconds = time.perf_counter() - t0
                results.append(est)
    finally:
        torch._dynamo.reset()
    return results


#: later plans of a shared capture create their optimizer states without running a first step (:func:`_run_tracked`)
_SKIP_WARM_STEP = True


def _run_tracked(work, compiled, inputs, tracker, be, optimizer, dev, loss_fn, lr, replay_lowering,
                 requested_lowering, compiled_already=False):
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

        opt = build_optimizer(optimizer, trainable, lr=lr, device=dev)
    if (_SKIP_WARM_STEP and compiled_already and replay_lowering == "eager"
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
    states = [v for s in (opt.state.values() if opt else ()) for v in s.values() if isinstance(v, torch.Tensor)]
    flat_inputs = [x for x in tree_flatten(inputs)[0] if isinstance(x, torch.Tensor)]
    start = _bytes(params + buffers + states + flat_inputs, dev)
    p_bytes = _bytes(params, dev)
    b_bytes = _bytes(buffers, dev)
    s_bytes = _bytes(states, dev)
    i_bytes = _bytes(flat_inputs, dev)
    tracker.reset()
    tracker.enabled = True
    phases = {}

    def set_phase(p):
        if tracker.phase == "forward" and p == "backward":
            phases["activations"] = tracker.live
        tracker.phase = p

    training_step(compiled, inputs, opt, loss_fn, _phase=set_phase)
    tracker.enabled = False
    del opt, states
    grads = sum(_bytes([p], dev) for p in trainable)  # a gradient is laid out as its parameter (empty_like)
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
        trainable_parameters=_bytes(trainable, dev), buffers=b_bytes, inputs=i_bytes, gradients=grads,
        optimizer_states=s_bytes, activations=phases.get("activations", 0),
        largest_transient=tracker.largest[0], largest_transient_op=tracker.largest[1],
        peak_phase=tracker.peak_where[0], peak_graph=tracker.peak_where[1], peak_node=tracker.peak_where[2],
        gradients_at_peak=tracker.grads_at_peak, phase_peaks=dict(tracker.phase_peaks), flops=tracker.flops,
        optimizer=optimizer, device=str(dev), replay_lowering=replay_lowering,
        requested_lowering=requested_lowering, passes=[p.name for p in be.options.passes],
        pass_stats=stats, notes=notes, trainable_numels=[p.numel() for p in trainable],
        trainable_shapes=[(tuple(p.shape), str(p.dtype).removeprefix("torch.")) for p in trainable])
    est.gradients_at_peak, est.non_gradient_peak, est.gradients_at_non_gradient_peak = _gradient_split(
        tracker.events, tracker.grads_at_peak)
    est.timeline = step_timeline(tracker.events, est)
    if requested_lowering not in ("inductor", "eager"):
        est.notes.append(f"lowering={requested_lowering!r} is predicted by the eager lowering's replay of the same "
                         f"partitioned graphs (its own buffer plan is not replayed)")
    if dev.type == "cuda":
        est.notes.append("CUDA: every storage rounded up to the caching allocator's 512-byte blocks (as torch's "
                         "MemTracker); untested on a GPU")
    est.largest_unit_bytes = _largest_unit_bytes(work)
    return est


def _replay_many(model, example_inputs, pipelines, optimizer, dev, loss_fn, lr, compile_options, share=True):
    """One estimate (or the exception its replay raised) per pipeline in ``pipelines``, replayed on fake
    tensors at the model's own depth. Pipelines with the same module phase share one fake copy and one
    Dynamo capture (``share``); if a shared replay fails, its pipelines are replayed alone."""
    opts = dict(compile_options)
    requested_lowering = opts.pop("lowering", "inductor")
    for k in ("dump_dir", "memory_budget", "allow", "example_inputs", "optimizer", "world_size"):
        opts.pop(k, None)
    replay_lowering = "inductor" if requested_lowering == "inductor" else "eager"
    out: list = [None] * len(pipelines)
    groups: dict = {}
    for i, passes in enumerate(pipelines):
        try:
            pass_list = _without_fsdp(passes, dev)
        except Exception as e:  # a bad pipeline: raised as given
            out[i] = e
            continue
        try:
            options, kwargs = _replay_options(pass_list, replay_lowering, opts, dev)
            key = _module_phase_key(options, kwargs) if share else i
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


def _module_groups(pipelines, dev, compile_options) -> list[list[int]]:
    """Indices of ``pipelines`` grouped as :func:`_replay_many` shares them (the same module phase); a
    pipeline that cannot be read is a group of its own (its replay reports the error)."""
    opts = dict(compile_options)
    lowering = "inductor" if opts.pop("lowering", "inductor") == "inductor" else "eager"
    for k in ("dump_dir", "memory_budget", "allow", "example_inputs", "optimizer", "world_size"):
        opts.pop(k, None)
    groups: dict = {}
    for i, passes in enumerate(pipelines):
        try:
            options, kwargs = _replay_options(_without_fsdp(passes, dev), lowering, opts, dev)
            key = _module_phase_key(options, kwargs)
        except Exception:
            key = ("unreadable", i)
        groups.setdefault(key, []).append(i)
    return list(groups.values())


def _plan_workers() -> int:
    """Processes for a replay's independent parts: ``EFFPASS_PLAN_WORKERS`` if set, else min(2, the cores this
    process may use); 1 where ``os.fork`` is not available (not Linux)."""
    import os

    if not sys.platform.startswith("linux") or not hasattr(os, "fork"):
        return 1
    env = os.environ.get("EFFPASS_PLAN_WORKERS")
    if env:
        try:
            return max(1, int(env))
        except ValueError:
            raise ValueError(f"EFFPASS_PLAN_WORKERS={env!r}: expected a whole number of processes >= 1") from None
    try:
        cores = len(os.sched_getaffinity(0))
    except Exception:  # pragma: no cover
        cores = os.cpu_count() or 1
    return max(1, min(2, cores))


def _picklable(r):
    """``r`` (a result or a list of results) with every element that cannot be pickled, an exception with
    its own constructor, replaced by a RuntimeError that says what it was."""
    import pickle

    if isinstance(r, list):
        return [_picklable(x) for x in r]
    try:
        pickle.loads(pickle.dumps(r))
        return r
    except Exception:
        return RuntimeError(f"{type(r).__name__}: {r}")


#: seconds a forked replay worker may take beyond twice this process's own share before it is given up
_CHILD_GRACE_S = 120.0


def _read_until(fd: int, deadline: float) -> bytes | None:
    """Everything written to pipe ``fd`` until its writer closes it, or None if that has not happened by
    ``deadline`` (``time.monotonic()``)."""
    import os
    import select

    chunks = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def _in_workers(fn, jobs: list, costs: list, workers: int) -> list:
    """``[fn(j) for j in jobs]``, the jobs spread over ``workers`` processes: this one and ``workers - 1``
    children forked from it (each job's result, or the exception it raised, pickled back). Jobs go to the
    least loaded process by ``costs`` (longest first). A child that dies or sends nothing readable leaves its
    jobs to this process, so the result is the same as run here. Fake-tensor replays only: a child runs no
    kernel and touches nothing the parent keeps."""
    import os
    import pickle

    workers = max(1, min(workers, len(jobs)))
    if workers == 1:
        return [fn(j) for j in jobs]
    loads = [0.0] * workers
    mine: list[list[int]] = [[] for _ in range(workers)]
    for i in sorted(range(len(jobs)), key=lambda i: -costs[i]):
        w = min(range(workers), key=lambda w: loads[w])
        mine[w].append(i)
        loads[w] += costs[i]
    children = []
    for w in range(1, workers):
        r, wfd = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: its jobs, pickled to the pipe, then exit without the parent's exit handlers
            code = 0
            try:
                os.close(r)
                res = {}
                for i in mine[w]:
                    try:
                        res[i] = fn(jobs[i])
                    except Exception as e:
                        res[i] = e
                data = pickle.dumps({i: _picklable(v) for i, v in res.items()})
                with os.fdopen(wfd, "wb") as f:
                    f.write(data)
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        os.close(wfd)
        children.append((pid, r, w))
    out: dict[int, Any] = {}
    t0 = time.monotonic()
    for i in mine[0]:
        out[i] = fn(jobs[i])
    # NOTE(hang): a child forked from a process with other threads (a test runner's, a compile pool's) could
    # block on a lock one of them held at the fork; one that has not answered by the deadline is killed and
    # its jobs are run here, so the result stays the same and the planner never waits forever.
    deadline = time.monotonic() + max(_CHILD_GRACE_S, 2.0 * (time.monotonic() - t0))
    for pid, r, w in children:
        data = _read_until(r, deadline)
        if data is None:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
            data = b""
        os.close(r)
        os.waitpid(pid, 0)
        try:
            got = pickle.loads(data) if data else {}
        except Exception:
            got = {}
        for i in mine[w]:
            out[i] = got[i] if i in got else fn(jobs[i])
    return [out[i] for i in range(len(jobs))]


def estimate_many(model: torch.nn.Module, example_inputs, pipelines: Sequence, optimizer: str | None = "adamw", *,
                  device=None, loss_fn: Callable | None = None, lr: float = 1e-3, extrapolate: bool | None = None,
                  share: bool = True, workers: int | None = None, screen: bool = False, check: Sequence[int] = (),
                  **compile_options) -> list:
    """:func:`estimate_memory` of ``model`` under each pipeline of ``pipelines`` (one rank; ``optimizer``
    ``"adamw"`` or ``None``), sharing work between them: pipelines whose module phase is the same (the same
    module-level passes, e.g. the same quantized base and adapters) are replayed on one fake copy with one
    Dynamo capture, each compiling the captured graphs with its own graph-level passes; with depth
    extrapolation each depth is replayed once for all of them. Returns, per pipeline, its
    :class:`MemoryEstimate` (the same bytes as ``estimate_memory`` alone) or the exception its replay
    raised (not raised here).

    ``workers``: processes that replay the extrapolation's depths at once (forked from this one, Linux only;
    default ``EFFPASS_PLAN_WORKERS`` or up to 2 where this process may use 2 cores; 1: all in this process).
    A worker that fails hands its depths back to this process.

    ``screen`` (extrapolated models only): each pipeline is replayed at the first two depths (2 and 3 blocks),
    not three; where the peak is at the same node at both, its estimate is the affine prediction through them,
    marked ``provisional`` (:func:`confirm_many` replays the third depth and checks it; the planner confirms
    every plan it chooses or names as the smallest). Where the peak moved, the pipeline is confirmed here.
    ``check``: indices of pipelines replayed at all three depths all the same (known to need a checked
    figure; their third depth is replayed beside the others' first two, over the same workers)."""
    if optimizer not in ("adamw", None):
        raise ValueError(f"estimate_many: optimizer {optimizer!r}: only 'adamw' or None are replayed (other "
                         f"optimizers: with_optimizer on the AdamW replay)")
    t0 = time.perf_counter()
    dev = _target_device(model, device)
    pipelines = list(pipelines)
    out: list = [None] * len(pipelines)
    todo = list(range(len(pipelines)))
    blocks = _block_list(model) if extrapolate is not False else None
    if blocks is not None and len(blocks) > max(_DEPTHS) and (extrapolate or len(blocks) >= _AUTO_MIN_BLOCKS):
        checked = set(range(len(pipelines))) if not screen else set(check)
        per_depth = _replay_depths(model, example_inputs, pipelines, _DEPTHS, optimizer, dev, loss_fn, lr,
                                   compile_options, share, workers, blocks,
                                   only={_DEPTHS[2]: checked} if screen else None)
        todo, unsure = [], []
        for i in range(len(pipelines)):
            ests = [d[i] for d in per_depth if i in checked or d is not per_depth[2]]
            bad = next((e for e in ests if isinstance(e, BaseException)), None)
            if bad is not None and not isinstance(bad, RuntimeError):
                out[i] = bad  # a user error (bad targets, options): as the replay alone raises it
                continue
            est = None if bad is not None else _combine_depths(ests, len(blocks))
            if est is None and screen and bad is None:
                unsure.append(i)  # the peak moved between the two depths: the third depth decides
            elif est is None:
                todo.append(i)  # not affine (or a depth failed): the full model is replayed
            else:
                est.seconds = time.perf_counter() - t0
                out[i] = est
        if unsure:
            for i, r in zip(unsure, confirm_many(model, example_inputs, [pipelines[i] for i in unsure],
                                                 [_Unconfirmed([d[i] for d in per_depth[:2]]) for i in unsure],
                                                 optimizer, device=device, loss_fn=loss_fn, lr=lr, share=share,
                                                 workers=workers, **compile_options)):
                out[i] = r
    _replay_whole(model, example_inputs, pipelines, todo, out, optimizer, dev, loss_fn, lr, compile_options, share, t0)
    return out


def _replay_whole(model, example_inputs, pipelines, todo, out, optimizer, dev, loss_fn, lr, compile_options, share,
                  t0) -> None:
    """``out[i]`` for each ``i`` in ``todo``: pipeline ``i`` replayed at the model's full depth (counts not
    affine in depth, or a depth failed), or the exception raised."""
    if not todo:
        return
    full = _replay_many(model, example_inputs, [pipelines[i] for i in todo], optimizer, dev, loss_fn, lr,
                        compile_options, share)
    for i, r in zip(todo, full):
        if not isinstance(r, BaseException):
            r.seconds = time.perf_counter() - t0
        out[i] = r


class _Unconfirmed:
    """The replays at the first two depths of a pipeline whose peak moved between them (no prediction)."""

    def __init__(self, replays):
        self.depth_replays = replays


def confirm_many(model: torch.nn.Module, example_inputs, pipelines: Sequence, estimates: Sequence,
                 optimizer: str | None = "adamw", *, device=None, loss_fn: Callable | None = None, lr: float = 1e-3,
                 share: bool = True, workers: int | None = None, **compile_options) -> list:
    """The estimates of ``pipelines`` checked at the third depth: ``estimates`` are :func:`estimate_many`'s
    ``screen`` results for them (``provisional``, with the replays of the first two depths). Each pipeline
    is replayed at the third depth (pipelines with one module phase share the capture, depths over the
    workers as in :func:`estimate_many`) and extrapolated from all three when every count is affine in
    depth; if not, the full model is replayed. Returns per pipeline the confirmed :class:`MemoryEstimate`
    (the figures :func:`estimate_many` gives without ``screen``) or the exception its replay raised. An
    estimate that is not provisional is returned as it is."""
    t0 = time.perf_counter()
    dev = _target_device(model, device)
    pipelines = list(pipelines)
    out: list = list(estimates)
    idx = [i for i, e in enumerate(estimates) if getattr(e, "depth_replays", None)]
    if not idx:
        return out
    blocks = _block_list(model)
    (third,) = _replay_depths(model, example_inputs, [pipelines[i] for i in idx], _DEPTHS[2:], optimizer, dev,
                              loss_fn, lr, compile_options, share, workers, blocks)
    todo = []
    for i, r in zip(idx, third):
        if isinstance(r, BaseException):
            todo.append(i)
            continue
        est = _combine_depths(list(estimates[i].depth_replays) + [r], len(blocks))
        if est is None:
            todo.append(i)
        else:
            est.seconds = time.perf_counter() - t0
            out[i] = est
    _replay_whole(model, example_inputs, pipelines, todo, out, optimizer, dev, loss_fn, lr, compile_options, share, t0)
    return out


def _replay_depths(model, example_inputs, pipelines, depths, optimizer, dev, loss_fn, lr, compile_options, share,
                   workers, blocks, only: dict | None = None) -> list[list]:
    """Per depth of ``depths``, per pipeline: its replay with only the first ``depth`` blocks (or the
    exception raised; None where ``only[depth]``, a set of pipeline indices, leaves it out). The work units,
    spread over the workers: one depth of one module phase (its plans share a capture)."""
    groups = _module_groups(pipelines, dev, compile_options) if share else [[i] for i in range(len(pipelines))]
    only = only or {}
    jobs = [(k, [i for i in g if k not in only or i in only[k]]) for k in depths for g in groups]
    jobs = [(k, g) for k, g in jobs if g]

    def replay_job(job):
        k, g = job
        with _first_blocks(blocks, k):
            return _replay_many(model, example_inputs, [pipelines[i] for i in g], optimizer, dev, loss_fn, lr,
                                compile_options, share)

    results = _in_workers(replay_job, jobs, [(k + 2) * (len(g) + 1) for k, g in jobs],
                          _plan_workers() if workers is None else workers)
    per_depth = [[None] * len(pipelines) for _ in depths]
    for (k, g), res in zip(jobs, results):
        for i, r in zip(g, res):
            per_depth[depths.index(k)][i] = r
    return per_depth


def start_bytes_many(model: torch.nn.Module, example_inputs, plans: Sequence, *, device=None,
                     lr: float = 1e-3, **compile_options) -> list:
    """The bytes live at the start of each plan's training step, without replaying the step: parameters,
    buffers, optimizer states and inputs after the plan's module phase, counted as the replay counts them
    (:func:`_run_tracked`'s ``start``: storage-true, each storage once). ``plans``: ``(pipeline, optimizer)``
    pairs (``optimizer`` a registered name or None). Every predicted peak is these bytes plus the step's own
    peak above them (>= 0), so this is a lower bound of the peak the replay would predict: the planner prunes
    with it (a plan whose start alone exceeds the budget cannot fit). Plans with the same module phase share
    one fake copy. A model of identical blocks that :func:`estimate_many` extrapolates is counted as it is
    replayed: at the first 2, 3 and 4 blocks, extrapolated when the three counts are affine in depth (else at
    full depth). Returns per plan an int, or the exception raised (the caller replays that plan, which
    reports it)."""
    _check_optimizer(None)  # loads the registered passes and optimizers
    dev = _target_device(model, device)
    blocks = _block_list(model)
    if blocks is None or len(blocks) <= max(_DEPTHS) or len(blocks) < _AUTO_MIN_BLOCKS:
        return _start_bytes(model, example_inputs, plans, dev, lr, compile_options)
    def at_depth(k):
        with _first_blocks(blocks, k):
            return _start_bytes(model, example_inputs, plans, dev, lr, compile_options)

    per_depth = _in_workers(at_depth, list(_DEPTHS), [k + 2 for k in _DEPTHS], _plan_workers())
    out: list = []
    todo = []
    for i, (a, b, c) in enumerate(zip(*per_depth)):
        if not all(isinstance(x, int) for x in (a, b, c)):
            out.append(next(x for x in (a, b, c) if not isinstance(x, int)))
        elif b - a == c - b:
            out.append(c + (len(blocks) - _DEPTHS[-1]) * (c - b))
        else:  # not affine: counted at full depth
            out.append(None)
            todo.append(i)
    if todo:
        for i, r in zip(todo, _start_bytes(model, example_inputs, [plans[i] for i in todo], dev, lr, compile_options)):
            out[i] = r
    return out


def _start_bytes(model, example_inputs, plans, dev, lr, compile_options) -> list:
    """:func:`start_bytes_many` of ``model`` as it is (no extrapolation)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from effpass.memory_options import build_optimizer

    opts = dict(compile_options)
    lowering = "inductor" if opts.pop("lowering", "inductor") == "inductor" else "eager"
    for k in ("dump_dir", "memory_budget", "allow", "example_inputs", "optimizer", "world_size"):
        opts.pop(k, None)
    out: list = [None] * len(plans)
    groups: dict = {}
    for i, (passes, _opt) in enumerate(plans):
        try:
            options, kwargs = _replay_options(_without_fsdp(passes, dev), lowering, opts, dev)
            groups.setdefault(_module_phase_key(options, kwargs), []).append((i, options, kwargs))
        except Exception as e:
            out[i] = e
    for members in groups.values():
        _, options, kwargs = members[0]
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        fake = _fake_factory(fake_mode, dev)
        try:
            work = _fake_model(model, fake, dev)
            inputs = _fake_inputs(example_inputs, fake)
            with replay_patches(dev, inductor=lowering == "inductor"), fake_mode, _Tracker(device=dev):
                _prepare_replay_model(work, options, kwargs, dev)
                params, buffers = list(work.parameters()), list(work.buffers())
                trainable = [p for p in params if p.requires_grad]
                flat_inputs = [x for x in tree_flatten(inputs)[0] if isinstance(x, torch.Tensor)]
                shapes = [(tuple(p.shape), str(p.dtype).removeprefix("torch.")) for p in trainable]
                by_optimizer: dict = {None: _bytes(params + buffers + flat_inputs, dev)}
                if trainable and any(plans[i][1] is not None for i, _o, _k in members):
                    # AdamW's states as the replay's first step leaves them (one step on empty gradients)
                    opt = build_optimizer("adamw", trainable, lr=lr, device=dev)
                    for p in trainable:
                        p.grad = torch.empty_like(p)
                    opt.step()
                    states = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
                    for p in trainable:
                        p.grad = None
                    by_optimizer["adamw"] = _bytes(params + buffers + states + flat_inputs, dev)
                    del opt, states
            for i, _o, _k in members:
                name = plans[i][1]
                if name not in by_optimizer:  # as with_optimizer sizes them on the AdamW replay
                    by_optimizer[name] = by_optimizer[None] + (optimizer_replay(name, shapes, dev, lr)[0]
                                                               if trainable else 0)
                out[i] = by_optimizer[name]
        except Exception as e:
            for i, _o, _k in members:
                if out[i] is None:
                    out[i] = e
        finally:
            torch._dynamo.reset()
    return out


def estimate_memory(model: torch.nn.Module, example_inputs, passes=None, optimizer: str | None = "adamw",
                    world_size: int = 1, *, device=None, loss_fn: Callable | None = None,
                    lr: float = 1e-3, extrapolate: bool | None = None, **compile_options) -> MemoryEstimate:
    """Predict the peak memory of one steady-state training step of ``model`` compiled with effpass.

    ``example_inputs``: a tuple of positional arguments or a dict of keyword arguments (as Hugging Face
    models take them); real, fake or meta tensors (only shapes and dtypes are read). ``passes`` and
    ``compile_options`` (``lowering``, ``strict``, ``disable``, ...) are those of :func:`effpass.compile`.
    ``optimizer``: ``"adamw"`` (``torch.optim.AdamW`` over the trainable parameters), any name registered
    with ``effpass.register_optimizer`` (``"adamw8bit"``: torchao's 8-bit states; built on fake parameters,
    see :func:`with_optimizer`) or ``None`` (no optimizer: gradients are dropped after backward).
    ``world_size > 1``: per-rank figures under FSDP (ZeRO-3) sharding, see :func:`fold_fsdp`.
    ``device``: the device to predict for (default: the model's; a meta model is predicted for the CPU).

    The model is not changed: the replay works on a fake copy (no weights are allocated), so a model
    built on the meta device at full size (``with torch.device("meta"): AutoModelForCausalLM.from_config(cfg)``)
    works. Several pipelines of one model: :func:`estimate_many` (shares the capture between them).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"estimate_memory expects an nn.Module, got {type(model).__name__}")
    _check_optimizer(optimizer)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if not isinstance(example_inputs, (tuple, list, Mapping, torch.Tensor)):
        raise TypeError(f"example_inputs must be a tuple of arguments or a dict of keyword arguments, got "
                        f"{type(example_inputs).__name__}")
    t0 = time.perf_counter()
    if optimizer not in ("adamw", None):  # the AdamW replay's forward/backward, the optimizer built on fakes
        est = estimate_memory(model, example_inputs, passes, "adamw", 1, device=device, loss_fn=loss_fn, lr=lr,
                              extrapolate=extrapolate, **compile_options)
        est = with_optimizer(est, optimizer, device=est.device, lr=lr)
    else:
        (est,) = estimate_many(model, example_inputs, [passes], optimizer, device=device, loss_fn=loss_fn, lr=lr,
                               extrapolate=extrapolate, **compile_options)
        if isinstance(est, BaseException):
            raise est
    if world_size > 1:
        est = fold_fsdp(est, world_size, est.largest_unit_bytes)
    est.seconds = time.perf_counter() - t0
    return est


#: (optimizer, device, shape, dtype, lr) -> (state bytes of one parameter, step peak above the gradient)
_OPTIMIZER_REPLAYS: dict = {}


def optimizer_replay(optimizer: str, shapes: Sequence[tuple], device="cpu", lr: float = 1e-3) -> tuple[int, int]:
    """(state bytes, the largest step transient) of ``optimizer`` over trainable parameters of ``shapes``
    (``(shape, dtype name)`` each), measured by building the real optimizer (``effpass.register_optimizer``)
    on fake parameters and running two steps on fake tensors (the first creates the states, the second is
    tracked). Parameters of the same shape and dtype are replayed once (their states are the same): the
    transient is the largest one parameter's step allocates (optimizers that step several parameters at
    once, ``foreach``, hold more)."""
    from collections import Counter

    from torch._subclasses.fake_tensor import FakeTensorMode

    from effpass.memory_options import build_optimizer

    dev = torch.device(device)
    total, transient = 0, 0
    for (shape, dtype), n in Counter((tuple(s), str(d)) for s, d in shapes).items():
        key = (optimizer, str(dev), shape, dtype, lr)
        if key not in _OPTIMIZER_REPLAYS:
            fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
            tracker = _Tracker(device=dev)
            try:
                with replay_patches(dev, inductor=True), fake_mode, tracker:
                    p = torch.nn.Parameter(torch.empty(shape, dtype=getattr(torch, dtype), device=dev))
                    p.grad = torch.empty_like(p)
                    opt = build_optimizer(optimizer, [p], lr=lr, device=dev)
                    opt.step()
                    states = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
                    s_bytes = _bytes(states, dev)
                    tracker.reset()
                    tracker.enabled = True
                    opt.step()
                    tracker.enabled = False
            finally:
                torch._dynamo.reset()
            _OPTIMIZER_REPLAYS[key] = (s_bytes, tracker.peak)
        s_bytes, peak = _OPTIMIZER_REPLAYS[key]
        total += n * s_bytes
        transient = max(transient, peak)
    return total, transient


def with_optimizer(est: MemoryEstimate, optimizer: str, *, device=None, lr: float = 1e-3) -> MemoryEstimate:
    """The estimate of the same step with ``optimizer`` instead of the replayed one: the forward and
    backward are the same; the states and the optimizer step's transient are measured by building the
    real optimizer on fake parameters (:func:`optimizer_replay`)."""
    _check_optimizer(optimizer)
    shapes = est.trainable_shapes or [((n,), "float32") for n in est.trainable_numels]
    states, transient = optimizer_replay(optimizer, shapes, device or est.device, lr)
    fwd_bwd = max(est.phase_peaks.get("forward", 0), est.phase_peaks.get("backward", 0))
    opt_peak = est.gradients + transient
    start = est.start_bytes - est.optimizer_states + states
    step_peak = max(fwd_bwd, opt_peak)
    where = (est.peak_phase, est.peak_graph, est.peak_node) if fwd_bwd >= opt_peak else (
        "optimizer", "eager code", f"{optimizer} step (replayed on fake parameters)")
    return dataclasses.replace(est, optimizer=optimizer, optimizer_states=states, start_bytes=start,
                               step_peak_bytes=step_peak, peak_bytes=start + step_peak, peak_phase=where[0],
                               peak_graph=where[1], peak_node=where[2],
                               notes=list(est.notes) + [f"{optimizer}: states and step transient from the real "
                                                        f"optimizer built on fake parameters; forward/backward "
                                                        f"from the replay with {est.optimizer}"])


def _without_fsdp(passes, device):
    """The pipeline without sharding passes (sharding is folded onto the one-rank replay, not replayed)."""
    from effpass.config import _build_passes

    if passes is None:
        return None
    built = _build_passes(passes)
    return [p for p in built if not any(o.sharding for o in type(p).memory_options(None, world_size=2))]


def _largest_unit_bytes(model: torch.nn.Module) -> int:
    from effpass.graph import transformer_blocks
    from effpass.quantized import storage_bytes

    units = transformer_blocks(model)
    return max((storage_bytes(list(u.parameters())) for _, u in units), default=0)


def fold_fsdp(est: MemoryEstimate, world_size: int, unit_bytes: int) -> MemoryEstimate:
    """Per-rank figures under FSDP2 / ZeRO-3 (``wrap_fsdp``), from a one-rank replay: the one sharding
    arithmetic, :func:`effpass.planning.sharding.fold_sharding` (also behind ``effpass estimate``)."""
    from .sharding import fold_sharding

    return fold_sharding(est, world_size, unit_bytes, "zero3")


# ------------------------------------------------------------------------------------------------------
# depth extrapolation: identical blocks make every byte count affine in the number of blocks
# ------------------------------------------------------------------------------------------------------
#: block counts replayed for an extrapolation (three, so that affinity is checked, not assumed)
_DEPTHS = (2, 3, 4)
#: with extrapolate=None (auto), models with at least this many identical blocks are extrapolated
_AUTO_MIN_BLOCKS = 12
#: MemoryEstimate fields that are byte or FLOP counts (extrapolated, and checked to be affine)
_AFFINE = ("peak_bytes", "start_bytes", "step_peak_bytes", "parameters", "trainable_parameters", "buffers",
           "inputs", "gradients", "optimizer_states", "activations", "largest_transient", "gradients_at_peak",
           "non_gradient_peak", "gradients_at_non_gradient_peak",
           "flops", "largest_unit_bytes")


def _block_list(model: torch.nn.Module):
    """The one ``ModuleList`` of identical blocks (same classes, parameter and buffer names, shapes, dtypes
    and requires_grad in every entry), or None."""
    lists = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) > 1 and len({type(m) for m in mod}) == 1:
            if not any(name.startswith(n + ".") for n in lists):
                lists[name] = mod
    if len(lists) != 1:
        return None
    (blocks,) = lists.values()

    def sig(m):
        return (tuple((n, type(x)) for n, x in m.named_modules()),
                tuple((n, tuple(t.shape), t.dtype, t.requires_grad) for n, t in m.named_parameters()),
                tuple((n, tuple(t.shape), t.dtype) for n, t in m.named_buffers()))

    first = sig(blocks[0])
    return blocks if all(sig(b) == first for b in blocks) else None


@contextlib.contextmanager
def _first_blocks(blocks: torch.nn.ModuleList, k: int):
    """``blocks`` holds only its first ``k`` entries while active (the replay deep-copies the model)."""
    saved = blocks._modules
    blocks._modules = type(saved)(list(saved.items())[:k])
    try:
        yield
    finally:
        blocks._modules = saved


def _combine_depths(ests, L: int) -> MemoryEstimate | None:
    """The estimate of ``L`` identical blocks from the replays of the first 2, 3 and 4 (``_DEPTHS``), or None
    when they are not affine in depth.

    Every byte count of a stack of identical blocks is affine in the number of blocks (each block adds
    its parameters, gradients, states and saved activations; the peak stays at the same place, e.g. the
    loss's backward or the first block's recompute). The three replays check it: when a count's second
    difference is not zero (the peak moves with depth) this returns None and the full model is replayed.
    Cost: 9 blocks replayed instead of all (Llama-3-8B: 32).

    Given the first two replays only (a screen, :func:`estimate_many`), the estimate is the affine prediction
    through them, marked ``provisional`` (with the two replays, for :func:`confirm_many`), if the peak is at
    the same place in both; else None.
    """
    b, c = ests[-2], ests[-1]
    depths = _DEPTHS[:len(ests)]
    # the same place in each: phase, graph and node (FX numbers repeated nodes: _softmax_backward_data_3)
    where = {(e.peak_phase, e.peak_graph, re.sub(r"_\d+$", "", e.peak_node.split(" ")[0]),
              e.peak_node.partition(" ")[2]) for e in ests}
    if len(where) != 1:
        return None
    if len(ests) == 3 and any(getattr(b, f) - getattr(ests[0], f) != getattr(c, f) - getattr(b, f) for f in _AFFINE):
        return None
    n = L - depths[-1]
    step = lambda f: getattr(c, f) + n * (getattr(c, f) - getattr(b, f))  # noqa: E731
    phase_peaks = {p: c.phase_peaks[p] + n * (c.phase_peaks[p] - b.phase_peaks.get(p, 0)) for p in c.phase_peaks}
    from collections import Counter

    per_block = Counter(c.trainable_numels) - Counter(b.trainable_numels)
    numels = list(c.trainable_numels) + [x for x, m in per_block.items() for _ in range(m * n)]
    per_block_s = Counter(map(tuple, c.trainable_shapes)) - Counter(map(tuple, b.trainable_shapes))
    shapes = [tuple(x) for x in c.trainable_shapes] + [x for x, m in per_block_s.items() for _ in range(m * n)]
    stats = {}
    for name, st in c.pass_stats.items():
        stats[name] = {k: (v + n * (v - b.pass_stats.get(name, {}).get(k, v))
                           if isinstance(v, int) and not isinstance(v, bool) else v) for k, v in st.items()}
    if len(ests) == 3:
        note = (f"extrapolated from replays of the first {', '.join(map(str, depths))} of {L} identical blocks "
                f"(every count affine in depth, checked); the peak node is named in the {depths[-1]}-block replay")
    else:
        note = (f"provisional: predicted from replays of the first {depths[0]} and {depths[1]} of {L} identical "
                f"blocks (the peak at the same node in both); affinity in depth not yet checked at {_DEPTHS[2]} "
                f"blocks")
    out = dataclasses.replace(c, **{f: step(f) for f in _AFFINE}, phase_peaks=phase_peaks, trainable_numels=numels,
                              trainable_shapes=shapes, pass_stats=stats, depths=list(depths),
                              provisional=len(ests) < 3, notes=list(c.notes) + [note])
    if out.provisional:
        out.depth_replays = list(ests)
    return out
