"""Host memory as a resource of a CUDA plan: activations offloaded to pinned host memory
(``offload_activations``), optimizer states kept on the host (torchao's ``CPUOffloadOptimizer``), the host
bytes each holds, the bytes each moves over the host link, and what the transfers do to the step's time.

Offloaded activations, predicted on a CPU replay (no CUDA needed). The pass runs as ``cpu="emulate"`` (torch's
synchronous rewrite: ``prims.device_put`` to the CPU after a saved tensor's last forward use, back before its
first backward use; :func:`emulated`), and the replay's tracker counts the copies as CUDA would hold them
(:func:`on_device_put`):

* a forward copy to the host is host memory: not a device byte; its bytes are pinned host bytes, each storage
  rounded up to a power of two (torch's ``CachingHostAllocator`` rounds every pinned block with
  ``PowerOf2Ceil``; ``ao.offload`` and a non-blocking ``device_put`` to the CPU allocate pinned memory);
* a backward copy of such a host tensor is a device allocation (the reload), counted as any other;
* the stream variant (``separate_stream=True``, the pass's default) sinks each copy's wait to the end of the
  forward graph with the device tensor as its keep-alive (``activation_offload_sink_wait``): each offloaded
  device tensor is held until the forward ends (exact for a forward that is one graph; an upper bound when
  the forward is several graphs);
* its prefetch (``prefetch=True``) issues each reload ahead of its use, by torch's bandwidth estimate and the
  benchmarked runtimes of the nodes in between (not predictable here): modelled as one reload buffer held
  ahead of every reload through the backward (from the backward's start to the last reload), the size of the
  largest offloaded tensor not yet reloaded. Exact when one block's backward covers one tensor's transfer;
  when the transfers are slower than the compute (transfer-bound) more reloads are in flight and the device
  figure is a lower bound (the plan says so).

Optimizer states on the host (:func:`with_host_optimizer`): derived from the AdamW replay's forward and
backward as torchao's ``CPUOffloadOptimizer(params, torch.optim.AdamW)`` (``offload_gradients=False``) holds
them: no states on the device (parameters under ``minimal_size`` = 4,096 elements keep an on-device AdamW:
two states and a step each), gradients on the device until ``zero_grad`` (as AdamW's), no optimizer step on the
device (parameters are copied back in place). Host: per offloaded parameter a pinned copy and a pinned gradient
(each a power of two, as above) in the parameter's dtype (no fp32 master copy: torchao copies the parameter as
it is), and AdamW's two states (plain host memory, the parameter's dtype) and its step (4 bytes). Moved per step:
every offloaded gradient to the host (during the backward, on a side stream), every offloaded parameter back
(after the host optimizer step, not overlapped). The CPU's AdamW step itself is not timed (a lower bound).

AdamW on the host replayed (:func:`replayed_host_optimizer`; ``adamw_host``: :class:`effpass.HostOffloadAdamW`, the
optimizer of ``step_in_backward`` + host): the replay builds the real optimizer on the fake parameters and runs
it in the replayed step, so the device bytes are what it leaves on the device (parameters, the on-device AdamW
of parameters under ``minimal_size`` elements, each gradient freed when ``step_in_backward``'s in-graph op hands
it over, no step transient on the device). Its host tensors are not device memory: the replay leaves them out of
the states and counts them here, as CUDA would hold them (the parameters' host copies and gradient buffers
pinned, each a power of two; AdamW's states and step plain host memory). Moved: the optimizer's own counts over
the tracked step (every offloaded gradient to the host inside the backward, overlapping it; every offloaded
parameter back after the host step, not overlapped). The CPU's AdamW step is not timed.

Step time (:func:`step_time`): the plan's FLOPs at the GPU's rate split at the forward's end; host-to-device and
device-to-host are separate directions of the link (full duplex), each at ``GPU.host_bytes_per_s``
(:mod:`effpass.devices`). Overlapped transfers (the stream variant, gradients to the host) cost
``max(compute, transfer)`` within their phase; synchronous ones add to it. A plan is transfer-bound when a
phase's transfers take longer than its compute.
"""
from __future__ import annotations

import dataclasses
import weakref

import torch

__all__ = ["HOST_OPTIMIZERS", "REPLAYED_HOST_OPTIMIZERS", "replayed_host_optimizer", "HostBudgetError",
           "is_host_option", "emulated", "offload_mode", "on_device_put", "on_phase", "add_host",
           "pinned_bytes", "host_optimizer_figures", "with_host_optimizer", "step_time"]

#: optimizers whose states live on the host (registered by effpass/planning/optimizers.py): name -> their
#: CPUOffloadOptimizer keyword arguments
HOST_OPTIMIZERS: dict[str, dict] = {}
#: optimizers with host memory that the replay runs itself (registered by effpass/planning/optimizers.py)
REPLAYED_HOST_OPTIMIZERS: set[str] = set()
#: torchao CPUOffloadOptimizer's default: smaller parameters keep an on-device optimizer
MINIMAL_SIZE = 4096


class HostBudgetError(ValueError):
    """A plan whose host bytes exceed the host budget (not a candidate)."""


def pinned_bytes(n: int) -> int:
    """Bytes torch's CachingHostAllocator holds for a pinned block of ``n`` bytes (the next power of two)."""
    return 1 << (int(n) - 1).bit_length() if n > 0 else 0


# -- offloaded activations: the pipeline a CPU replay runs, and the tracker's accounting ---------------------
def emulated(p, device):
    """``p`` as a CPU replay for a CUDA target runs it: ``offload_activations`` with ``cpu="emulate"`` (torch's
    synchronous rewrite on CPU graphs), so that the tracker sees which tensors move; every other pass as is."""
    dev = torch.device(device) if device is not None else None
    # a CUDA target without CUDA here is replayed on CPU fake tensors (replay.replay_device)
    if (getattr(type(p), "host_offload", False) and dev is not None and dev.type == "cuda"
            and not torch.cuda.is_available() and getattr(p, "cpu", "emulate") != "emulate"):
        return dataclasses.replace(p, cpu="emulate")
    return p


def offload_mode(passes, dev, rdev) -> dict | None:
    """What the tracker models of ``offload_activations`` in ``passes`` on a CPU replay for a CUDA target."""
    if dev.type != "cuda" or rdev is None or rdev == dev:
        return None
    p = next((p for p in passes if getattr(type(p), "host_offload", False)), None)
    if p is None:
        return None
    return {"stream": bool(p.separate_stream), "prefetch": bool(p.separate_stream and p.prefetch)}


def is_host_option(o) -> bool:
    """A declared memory option that holds host memory: an optimizer of :data:`HOST_OPTIMIZERS`, or a pass whose
    class says ``host_offload = True`` (it copies saved activations to the host; the replay emulates it)."""
    if o.optimizer in HOST_OPTIMIZERS or o.optimizer in REPLAYED_HOST_OPTIMIZERS:
        return True
    if not o.pass_name:
        return False
    from effpass.pass_api import registered_passes

    return bool(getattr(registered_passes().get(o.pass_name), "host_offload", False))


def add_host(tracker, st, n: int) -> None:
    """Storage ``st`` of ``n`` bytes made in host memory by an offload: pinned host bytes, moved to the host."""
    key = st._cdata
    if key in tracker._host_alloc:
        return
    r = pinned_bytes(n)
    tracker._host_alloc[key] = r
    tracker.host_sizes[key] = n
    tracker.host_live += r
    tracker.host_peak = max(tracker.host_peak, tracker.host_live)
    tracker.d2h_bytes += n
    weakref.finalize(st, tracker._free_host, key)


def _device_bytes(n: int, device) -> int:
    """As ``tracker.alloc_bytes``: CUDA's caching allocator rounds every block up to 512 bytes."""
    return -(-int(n) // 512) * 512 if torch.device(device).type == "cuda" and n else int(n)


def _ghost_free(tracker) -> None:
    if tracker._ghost is not None:
        key, n = tracker._ghost
        tracker._ghost = None
        tracker.live -= n
        tracker.events.append((-n, key, tracker.phase, ""))


def _ghost_next(tracker) -> None:
    """Hold the next reload's buffer ahead of its use (the prefetch window)."""
    if not (tracker.offload or {}).get("prefetch") or not tracker.host_sizes:
        return
    n = _device_bytes(max(tracker.host_sizes.values()), tracker.alloc_device)
    tracker._scratch -= 1
    tracker._ghost = (tracker._scratch, n)
    tracker.prefetch_window = max(tracker.prefetch_window, n)
    tracker._grow(n, tracker._scratch, "prefetch of the next reload")


def on_device_put(tracker, func, args, out) -> bool:
    """A ``prims.device_put`` during a tracked step: True when it is an offload (its output is host memory and
    must not be counted on the device); a reload is counted by the caller as a device allocation."""
    if not tracker.offload or tracker.device.type != "cpu" or not isinstance(out, torch.Tensor):
        return False
    src = args[0] if args else None
    if not isinstance(src, torch.Tensor):
        return False
    key_in = src.untyped_storage()._cdata
    if key_in in tracker.host_sizes:  # a reload: its buffer replaces the prefetched one; the next is prefetched
        _ghost_free(tracker)
        tracker.h2d_bytes += tracker.host_sizes.pop(key_in)
        _ghost_next(tracker)
        return False
    if tracker.phase != "forward":
        return False
    add_host(tracker, out.untyped_storage(), out.untyped_storage().nbytes())
    if tracker.offload.get("stream"):
        tracker.keepalive.append(src)  # the sunk wait keeps the device tensor until the forward ends
    return True


def on_phase(tracker, old, new) -> None:
    """The step moves from phase ``old`` to ``new``: kept device tensors freed at the forward's end, the first
    reload prefetched at the backward's start, the prefetch buffer freed at its end."""
    if old == "forward":
        tracker.keepalive.clear()
        if new == "backward":
            _ghost_next(tracker)
    if old == "backward":
        _ghost_free(tracker)


# -- optimizer states on the host ---------------------------------------------------------------------------
def host_optimizer_figures(shapes, device="cuda") -> dict:
    """Bytes of torchao's CPUOffloadOptimizer(AdamW) over trainable parameters of ``shapes`` ((shape, dtype) each):
    device states (small parameters' on-device AdamW), host bytes, largest offloaded gradient, bytes moved."""
    dev_states = host = moved = 0
    for shape, dtype in shapes:
        numel = 1
        for s in shape:
            numel *= int(s)
        b = numel * torch.empty((), dtype=getattr(torch, str(dtype).removeprefix("torch."))).element_size()
        if numel < MINIMAL_SIZE:
            dev_states += 2 * _device_bytes(b, device) + _device_bytes(4, device)  # exp_avg, exp_avg_sq, step (fused)
            continue
        host += 2 * pinned_bytes(b) + 2 * b + 4  # pinned copy and gradient; exp_avg, exp_avg_sq; step
        moved += b
    return {"device_states": dev_states, "host_bytes": host, "d2h": moved, "h2d": moved}


def with_host_optimizer(est, optimizer: str):
    """``est`` (a replay with AdamW on the device) with the optimizer's states on the host (module docstring)."""
    from .result import both_reserved_after

    shapes = est.trainable_shapes or [((n,), "float32") for n in est.trainable_numels]
    f = host_optimizer_figures(shapes, est.device)
    fwd, bwd = est.phase_peaks.get("forward", 0), est.phase_peaks.get("backward", 0)
    step_peak = max(fwd, bwd, est.gradients)  # no optimizer step on the device: gradients held until zero_grad
    start = est.start_bytes - est.optimizer_states + f["device_states"]
    if est.peak_phase == "optimizer":
        where = ("backward" if bwd >= fwd else "forward", "-", "the replay's peak of that phase (AdamW's step "
                 "left out: it runs on the host)")
    else:
        where = (est.peak_phase, est.peak_graph, est.peak_node)
    return dataclasses.replace(
        est, optimizer=optimizer, optimizer_states=f["device_states"], start_bytes=start, step_peak_bytes=step_peak,
        peak_bytes=start + step_peak, **both_reserved_after(est, start + step_peak),
        peak_phase=where[0], peak_graph=where[1], peak_node=where[2],
        host_bytes=est.host_bytes + f["host_bytes"], optimizer_d2h_bytes=f["d2h"], optimizer_h2d_bytes=f["h2d"],
        notes=list(est.notes) + [
            f"{optimizer}: AdamW's states on the host (torchao CPUOffloadOptimizer): device states "
            f"{f['device_states']} B (parameters under {MINIMAL_SIZE} elements), host {f['host_bytes']} B (pinned "
            f"parameter and gradient copies rounded to powers of two, AdamW's states); the CPU AdamW step is not "
            f"timed"])


def replayed_host_optimizer(opt, device) -> tuple[set, int]:
    """(ids of the host tensors of ``opt``, their host bytes as ``device`` holds them) for an optimizer the replay
    runs that keeps tensors on the host (``host_buffers()``: ``effpass.HostOffloadAdamW``); (empty, 0) for any
    other. On a CUDA target the buffers pinned there are rounded to powers of two (:func:`pinned_bytes`)."""
    buffers = getattr(opt, "host_buffers", None)
    if opt is None or not callable(buffers):
        return set(), 0
    cuda = torch.device(device).type == "cuda"
    ids, total = set(), 0
    for t, pinned in buffers():
        ids.add(id(t))
        n = t.numel() * t.element_size()
        total += pinned_bytes(n) if pinned and cuda else n
    return ids, total


# -- the step's time --------------------------------------------------------------------------------------------
def step_time(est, gpu, low_precision: bool) -> tuple[float, bool, dict]:
    """(estimated seconds, transfer-bound, the terms) of ``est``'s step on ``gpu`` (module docstring)."""
    rate = gpu.matmul_flops if low_precision else gpu.fp32_flops
    compute = est.flops / rate
    bw = gpu.host_bytes_per_s
    act_d2h, act_h2d = est.offload_d2h_bytes / bw, est.offload_h2d_bytes / bw
    grad_d2h, param_h2d = est.optimizer_d2h_bytes / bw, est.optimizer_h2d_bytes / bw
    terms = {"compute_s": compute, "offload_d2h_s": act_d2h, "offload_h2d_s": act_h2d, "grads_d2h_s": grad_d2h,
             "params_h2d_s": param_h2d}
    if not (act_d2h or act_h2d or grad_d2h or param_h2d):
        return compute, False, terms
    fwd = min(est.forward_flops / rate, compute)
    rest = compute - fwd
    if est.offload_overlapped:
        t_fwd = max(fwd, act_d2h)
        t_rest = max(rest, act_h2d, grad_d2h)
    else:
        t_fwd = fwd + act_d2h
        t_rest = max(rest + act_h2d, grad_d2h)
    bound = act_d2h > fwd or act_h2d > rest or grad_d2h > rest
    return t_fwd + t_rest + param_h2d, bound, terms
