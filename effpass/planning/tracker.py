"""The allocation tracker of a replay: a :class:`TorchDispatchMode` that adds a storage's bytes when an op
creates it (a storage none of the op's inputs hold) and subtracts them when the storage dies
(``weakref.finalize``); the running maximum is the step's peak above the bytes live at its start.

Every byte is counted as storage holds it (``effpass.quantized.storage_bytes``: tensor subclasses such as
torchao's NF4 and int8 weights by their inner tensors, each storage once). For ``device="cuda"`` every
storage is rounded up to the CUDA caching allocator's 512-byte block, as torch's ``MemTracker`` does.
Also here: what the tracker's events say afterwards (:func:`step_timeline`, the gradient split of the peak)."""
from __future__ import annotations

import contextlib
import linecache
import sys
import weakref
from typing import Any, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .data_dependent import RoutingHints
from .fake_inductor import FAKE_WRAPPER_CODE
from .result import MemoryEstimate

__all__ = ["Tracker", "replay_kernel", "step_timeline", "gradient_split", "tracked_bytes", "storage_sizes",
           "alloc_bytes", "TIMELINE_CATEGORIES",
           "CUDA_MIN_ALLOCATE"]


#: the CUDA caching allocator's smallest block (torch.distributed._tools.mem_tracker._PYTORCH_MIN_ALLOCATE)
CUDA_MIN_ALLOCATE = 512


def alloc_bytes(n: int, device) -> int:
    """Bytes the device's allocator holds for a storage of ``n`` bytes (CUDA: rounded up to 512)."""
    if torch.device(device).type == "cuda" and n:
        return -(-n // CUDA_MIN_ALLOCATE) * CUDA_MIN_ALLOCATE
    return n


def tracked_bytes(tensors, device="cpu") -> int:
    """Storage-true bytes of ``tensors`` (each storage once), as the device's allocator holds them."""
    return sum(storage_sizes(tensors, device))


def storage_sizes(tensors, device="cpu") -> list[int]:
    """The bytes of each storage of ``tensors`` (each once, in order), as the device's allocator holds them."""
    from effpass.quantized import inner_tensors, _storage_key_and_bytes

    seen, sizes = set(), []
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        for inner in inner_tensors(t):
            key, n = _storage_key_and_bytes(inner)
            if key not in seen:
                seen.add(key)
                sizes.append(alloc_bytes(n, device))
    return sizes


class Tracker(TorchDispatchMode):
    """Adds a storage's bytes when an op creates it, frees them when it dies; keeps the running peak."""

    #: higher-order ops (e.g. run_and_save_rng_state when a recomputed region has random ops) come here too:
    #: they run below this mode, their outputs are tracked like any op's
    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls):  # NOTE: else Dynamo skips compiling under this mode
        return True

    def __init__(self, params: Sequence[torch.Tensor] = (), device="cpu", allocator=None):
        super().__init__()
        self.device = torch.device(device)
        #: the device whose allocator the bytes are counted for (a CUDA target replayed on CPU tensors)
        self.alloc_device = torch.device(allocator) if allocator is not None else self.device
        self.live = 0
        self.peak = 0
        self.sizes: dict[int, int] = {}
        self.enabled = False
        self.phase: str | None = None
        self.peak_where = ("-", "-", "-")
        self.largest = (0, "-")
        self.params = list(params)
        self.hints = RoutingHints()  # sizes of data-dependent ops (planning/data_dependent.py)
        self.grads_at_peak = 0
        self.events = []
        self.phase_peaks: dict[str | None, int] = {}
        self.op_peaks: dict[str, int] = {}  # "phase op" -> the most live bytes right after that op allocated
        self.graphs: dict[tuple[str, str], str] = {}
        self.places = None
        self._lines: dict = {}
        self._scratch = 0  # keys of in-kernel scratch buffers (negative: never a storage's key)
        self.flops = 0
        #: offload_activations emulated on a CPU replay for a CUDA target (:mod:`effpass.planning.host_memory`):
        #: None, or {"stream": bool, "prefetch": bool} (set by the replay from the pipeline)
        self.offload = None
        self._reset_host()
        self.forward_flops = 0
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
        self.op_peaks = {}
        self.forward_flops = 0
        self._reset_host()
        self.hints.reset()
        from .places import recording

        #: each allocation's place (planning/places.py), recorded for the extrapolation over the tile count
        self.places = {} if recording() else None
        self._lines: dict = {}
        self._place_graphs: dict = {}  # numbered in the order of their first allocation (not of their first peak)

    # -- host memory (offloaded activations): counted apart from the device's bytes -------------------------
    def _reset_host(self):
        self.host_live = self.host_peak = 0          # pinned host bytes (each storage rounded to a power of two)
        self.d2h_bytes = self.h2d_bytes = 0          # bytes copied to the host / back over the step
        self.host_sizes: dict[int, int] = {}         # host storage key -> its bytes (unrounded), until reloaded
        self._host_alloc: dict[int, int] = {}        # host storage key -> its pinned bytes, while alive
        self.keepalive: list = []                    # device tensors kept until the forward ends (stream variant)
        self.prefetch_window = 0                     # the largest prefetch buffer held ahead of a reload
        self._ghost = None                           # (key, bytes) of the prefetch buffer live now

    @property
    def phase(self):
        return getattr(self, "_phase", None)

    @phase.setter
    def phase(self, p):
        old = getattr(self, "_phase", None)
        self._phase = p
        if self.enabled and self.offload and old != p:
            from .host_memory import on_phase

            on_phase(self, old, p)

    def _free_host(self, key):
        n = self._host_alloc.pop(key, 0)
        self.host_live -= n

    def _free(self, key):
        n = self.sizes.pop(key, 0)
        self.live -= n
        if n and self.enabled:
            self.events.append((-n, key, self.phase, ""))

    def _graph_no(self, fn: str, graphs: dict | None = None) -> str:
        """The graph's number in its phase (in the order ``graphs``, default ``self.graphs``, first sees it)."""
        graphs = self.graphs if graphs is None else graphs
        key = (self.phase or "-", fn)
        if key not in graphs:
            graphs[key] = str(1 + sum(1 for k in graphs if k[0] == key[0]))
        return graphs[key]

    @staticmethod
    def _graph_frame(depth: int):
        """The innermost frame running a graph's code (an FX graph's generated ``forward``, or an Inductor
        wrapper replayed with fake allocations) above the caller ``depth`` frames up, or None (eager code)."""
        f = sys._getframe(depth + 1)
        while f is not None and not (f.f_code.co_filename.startswith("<eval_with_key>")
                                     or f.f_code in FAKE_WRAPPER_CODE):
            f = f.f_back
        return f

    def _place(self) -> None:
        """Records the live bytes after this allocation at its place (planning/places.py)."""
        f = self._graph_frame(3)
        key, name = (self.phase, "eager", ("pre",)), "eager code"
        if f is not None:
            co = f.f_code
            lines = self._lines.get(co)
            if lines is None:
                from effpass.pass_base import TILE_META
                from .places import line_contexts

                lines = self._lines[co] = line_contexts(f, TILE_META)
            seg, name = lines.get(f.f_lineno, (("?",), "?"))
            key = (self.phase, self._graph_no(co.co_filename, self._place_graphs), seg)
        got = self.places.get(key)
        if got is None:
            got = self.places[key] = ([], [])
        got[0].append(self.live)
        got[1].append(name)

    def _where(self, func) -> tuple[str, str]:
        f = self._graph_frame(2)
        if f is None:
            return "eager code", str(func)
        fn = f.f_code.co_filename
        line = linecache.getline(fn, f.f_lineno).strip()
        node = line.split("=", 1)[0].strip() if "=" in line else line
        kind = "Inductor " if f.f_code in FAKE_WRAPPER_CODE else ""
        return f"{self.phase} {kind}graph {self._graph_no(fn)}", f"{node} ({func})"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        hinted = self.hints.handles(func, args)
        if hinted:  # a data-dependent op on fake tensors (nonzero, .item() of its rows): a stated hint
            out = self.hints.run(func, args)
            if not isinstance(out, torch.Tensor):
                return out
        elif func is torch.ops.aten._local_scalar_dense.default and isinstance(args[0], torch.Tensor):
            a = args[0]  # .item() on a fake tensor (the optimizer's step count)
            if isinstance(a, torch._subclasses.FakeTensor) or a.device.type == "meta":
                return 1.0 if a.is_floating_point() else (True if a.dtype == torch.bool else 1)
        if not hinted:
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
        if self.phase == "forward":
            self.forward_flops = self.flops
        from effpass.quantized import inner_tensors

        flat_in = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        if func is torch.ops.prims.device_put.default and (self.offload or self.alloc_device.type != self.device.type):
            from .host_memory import on_device_put

            if on_device_put(self, func, args, out):
                return out  # an offload: the copy is host memory
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
                # NOTE(offload): host memory (offloaded activations, CPU step counters) is not device memory; a
                # CUDA replay's copies to the host (ao.offload) are counted as pinned host bytes
                if t.device.type == "cpu" and self.alloc_device.type == "cuda" and self.phase == "forward":
                    from .host_memory import add_host

                    add_host(self, st, st.nbytes())
                continue
            n = alloc_bytes(st.nbytes(), self.alloc_device)
            self.sizes[key] = n
            weakref.finalize(st, self._free, key)
            self._grow(n, key, func)
        # buffers the real kernel allocates and frees inside the op (not its outputs): live beside its outputs
        work = alloc_bytes(_kernel_workspace(func, args), self.alloc_device)
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
        if self.places is not None:
            self._place()
        if n > self.largest[0]:
            self.largest = (n, f"{func} in the {self.phase}")
        if self.live > self.phase_peaks.get(self.phase, 0):
            self.phase_peaks[self.phase] = self.live
        op = f"{self.phase} {func}"
        if self.live > self.op_peaks.get(op, 0):
            self.op_peaks[op] = self.live
        if self.live > self.peak:
            self.peak = self.live
            graph, node = self._where(func)
            self.peak_where = (self.phase or "-", graph, node)
            if self.phase in ("backward", "optimizer"):
                self.grads_at_peak = tracked_bytes([p.grad for p in self.params if p.grad is not None],
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


def gradient_split(events, grads_at_peak: int) -> tuple[int, int, int]:
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


def step_timeline(events, est: MemoryEstimate, max_points: int = 600) -> dict:
    """Live bytes over one step, stacked by category, from the tracker's allocation events.

    What is live at the step's start is constant (parameters and buffers, optimizer states, inputs). What the
    step allocates is classified by when it was made and freed: made in the forward and alive past it = saved
    activations (the loss included); made in the backward and alive into the optimizer step or past it =
    gradients; everything else = transients. Downsampled to ``max_points`` points, keeping each bucket's
    highest point (so the peak is drawn at its height)."""
    # NOTE(key reuse): a key (a storage's identity) is reused once its storage is freed, so what an allocation
    # is follows from its own lifetime (the event that made it to the event that freed it), never from the key's
    # last use: classifying by key made a forward activation whose key a backward gradient reused a "gradient"
    # (and the figures depended on what the process had allocated before).
    made: dict[int, str | None] = {}      # event index of an allocation -> the phase it was made in
    freed: dict[int, str | None] = {}     # event index of an allocation -> the phase it was freed in
    current: dict[Any, int] = {}
    for i, (delta, key, phase, _) in enumerate(events):
        if delta > 0:
            current[key] = i
            made[i] = phase
        elif key in current:
            freed[current.pop(key)] = phase

    def category(i: int) -> str:
        a, f = made.get(i), freed.get(i, "end")
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
            c = category(i)
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
