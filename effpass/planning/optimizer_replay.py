"""Optimizers other than the replayed AdamW: the real optimizer (``effpass.register_optimizer``) built on fake
parameters of the trainable shapes, its states and step transient measured (:func:`optimizer_replay`), and a
replay's estimate with it instead (:func:`with_optimizer`)."""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from .patches import replay_patches
from .replay import check_optimizer
from .result import MemoryEstimate, both_reserved_after
from .tracker import Tracker, tracked_bytes

__all__ = ["optimizer_replay", "with_optimizer"]


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

    from .host_memory import HOST_OPTIMIZERS, host_optimizer_figures

    if optimizer in HOST_OPTIMIZERS:  # states on the host (CUDA only: not built here); the device keeps small ones'
        return host_optimizer_figures(shapes, device)["device_states"], 0
    dev = torch.device(device)
    total, transient = 0, 0
    for (shape, dtype), n in Counter((tuple(s), str(d)) for s, d in shapes).items():
        key = (optimizer, str(dev), shape, dtype, lr)
        if key not in _OPTIMIZER_REPLAYS:
            fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
            tracker = Tracker(device=dev)
            try:
                with replay_patches(dev, inductor=True), fake_mode, tracker:
                    p = torch.nn.Parameter(torch.empty(shape, dtype=getattr(torch, dtype), device=dev))
                    p.grad = torch.empty_like(p)
                    opt = build_optimizer(optimizer, [p], lr=lr, device=dev)
                    opt.step()
                    from .host_memory import replayed_host_optimizer

                    on_host, _ = replayed_host_optimizer(opt, dev)  # host tensors are not device states
                    states = [v for s in opt.state.values() for v in s.values()
                              if isinstance(v, torch.Tensor) and id(v) not in on_host]
                    s_bytes = tracked_bytes(states, dev)
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
    check_optimizer(optimizer)
    from .host_memory import HOST_OPTIMIZERS, with_host_optimizer

    if optimizer in HOST_OPTIMIZERS:
        return with_host_optimizer(est, optimizer)
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
                               **both_reserved_after(est, start + step_peak),
                               peak_graph=where[1], peak_node=where[2],
                               notes=list(est.notes) + [f"{optimizer}: states and step transient from the real "
                                                        f"optimizer built on fake parameters; forward/backward "
                                                        f"from the replay with {est.optimizer}"])
