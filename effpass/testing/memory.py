"""Measuring the peak memory of a step, on CPU and on CUDA, in a way that sees every allocation.

CPU: ``torch.profiler`` with ``profile_memory=True`` records each alloc/free of c10's CPU allocator below
the dispatcher, so it also sees the buffers that Inductor's generated code allocates
(``empty_strided_cpu``). The peak is the running maximum of the signed sizes in time order. It counts
bytes allocated during the call only: tensors live at its start (parameters, optimizer states) are
added by the caller (:func:`live_tensor_bytes`). RSS-based figures read 4-10% low and miss buffers never
written (see the shared torch-facts notes).

CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, minus the bytes allocated
at the start, so both devices report the same quantity.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

__all__ = ["peak_memory", "live_tensor_bytes", "HostMeter", "pinned_host_stats", "NA_ON_CPU"]


def _allocation_events(prof) -> list[tuple[int, int]]:
    """(time ns, signed bytes) of every CPU allocator event the profiler saw."""
    from torch._C._profiler import _EventType

    out: list[tuple[int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        ev = stack.pop()
        stack.extend(ev.children)
        if ev.tag == _EventType.Allocation:
            alloc = ev.extra_fields
            if alloc.device.type == "cpu":
                out.append((ev.start_time_ns, int(alloc.alloc_size)))
    out.sort(key=lambda t: t[0])
    return out


def peak_memory(fn: Callable[[], Any], device: torch.device | str = "cpu") -> tuple[Any, int]:
    """Run ``fn()`` and return ``(its result, peak bytes allocated above the bytes live at its start)``.

    >>> _, peak = peak_memory(lambda: torch.empty(1 << 20))   # 4 MiB, freed at once
    >>> peak == 4 << 20
    True
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = fn()
        torch.cuda.synchronize(device)
        return out, torch.cuda.max_memory_allocated(device) - start
    if device.type != "cpu":
        raise ValueError(f"peak_memory measures 'cpu' or 'cuda' devices, not {device.type!r}")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False) as prof:
        out = fn()
    live = peak = 0
    for _, size in _allocation_events(prof):
        live += size
        peak = max(peak, live)
    return out, peak


def live_tensor_bytes(tensors: Iterable[torch.Tensor | Any]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (e.g. a model's parameters and buffers plus the
    optimizer's states): what is live at a step's start. Each storage is counted once."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # tensor subclasses without one storage
            total += t.numel() * t.element_size()
            continue
        key = st.data_ptr() or id(st)
        if key not in seen:
            seen.add(key)
            total += st.nbytes()
    return total


# -- host memory of a CUDA step: the pinned allocator's stats and the process's RSS ----------------------------
#: what a host figure says where the device is the host (a CPU step holds no separate host memory)
NA_ON_CPU = "n/a on CPU"


def _proc_status_bytes(field: str) -> int | None:
    """``VmRSS`` / ``VmHWM`` of this process in bytes (``/proc/self/status``); None where unreadable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _reset_rss_peak() -> bool:
    """Reset this process's peak RSS (``VmHWM``; Linux: ``5`` to ``/proc/self/clear_refs``); False if refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def pinned_host_stats() -> dict | str:
    """torch's pinned ``CachingHostAllocator`` statistics (``torch.cuda.host_memory_stats()``, flat keys such as
    ``allocated_bytes.peak``), or why they cannot be read: feature-tested, never a made-up figure."""
    fn = getattr(torch.cuda, "host_memory_stats", None)
    if fn is None:
        return f"not measurable with this torch ({torch.__version__}: no torch.cuda.host_memory_stats)"
    try:
        stats = fn()
    except Exception as e:  # noqa: BLE001 - an allocator without stats: said, not guessed
        return f"not measurable with this torch ({torch.__version__}: host_memory_stats raised {type(e).__name__})"
    if "allocated_bytes.peak" not in stats:
        return f"not measurable with this torch ({torch.__version__}: host_memory_stats has no allocated_bytes.peak)"
    return stats


class HostMeter:
    """Host memory over a CUDA training step: :meth:`start` before the optimizer is built and the warm-up steps
    run, :meth:`before_step` just before the measured step, :meth:`result` after it (synchronised).

    ``result()``: ``pinned_peak_bytes`` (``allocated_bytes.peak`` of the pinned allocator over the measured step:
    the pinned blocks it owns, in use and cached, each a power of two; its peak was reset before the step, so it is
    at least what the warm-up left in the pool), ``pinned_active_peak_bytes`` (``active_bytes.peak``: blocks
    handed out), ``pinned_before_bytes`` (owned before the optimizer and the warm-up); ``rss_growth_bytes`` (coarse:
    the process's peak RSS during the measured step, ``VmHWM`` reset before it, less its RSS before the optimizer
    and the warm-up; it includes the first call's compile work and plain host memory such as host optimizer states);
    ``host_measure`` says what was read. On a CPU device every figure is :data:`NA_ON_CPU`."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.rss0 = self.before = None
        self.hwm_reset = False

    def start(self) -> None:
        if not self.cuda:
            return
        torch.cuda.synchronize(self.device)
        self.rss0 = _proc_status_bytes("VmRSS")
        st = pinned_host_stats()
        self.before = st.get("allocated_bytes.current") if isinstance(st, dict) else None

    def before_step(self) -> None:
        if not self.cuda:
            return
        torch.cuda.synchronize(self.device)
        if isinstance(pinned_host_stats(), dict) and hasattr(torch.cuda, "reset_peak_host_memory_stats"):
            torch.cuda.reset_peak_host_memory_stats()
        self.hwm_reset = _reset_rss_peak()

    def result(self) -> dict:
        if not self.cuda:
            return {"pinned_peak_bytes": NA_ON_CPU, "pinned_active_peak_bytes": NA_ON_CPU, "rss_growth_bytes": NA_ON_CPU,
                    "host_measure": NA_ON_CPU + " (the device is the host: no separate host memory)"}
        torch.cuda.synchronize(self.device)
        st = pinned_host_stats()
        out: dict = {}
        if isinstance(st, dict):
            out.update(pinned_peak_bytes=int(st["allocated_bytes.peak"]),
                       pinned_active_peak_bytes=(int(st["active_bytes.peak"]) if "active_bytes.peak" in st
                                                 else "not measurable with this torch (no active_bytes.peak)"),
                       pinned_before_bytes=self.before)
            how = "pinned: torch.cuda.host_memory_stats() allocated_bytes.peak over the measured step"
        else:
            out.update(pinned_peak_bytes=st, pinned_active_peak_bytes=st)
            how = "pinned: " + st
        rss = _proc_status_bytes("VmHWM" if self.hwm_reset else "VmRSS")
        if rss is None or self.rss0 is None:
            out["rss_growth_bytes"] = "not measurable here (no /proc/self/status)"
        else:
            out["rss_growth_bytes"] = rss - self.rss0
            how += ("; RSS: VmHWM (reset before the measured step)" if self.hwm_reset else
                    "; RSS: VmRSS after the measured step (VmHWM could not be reset)") + \
                " less VmRSS before the optimizer and the warm-up"
        out["host_measure"] = how
        return out
