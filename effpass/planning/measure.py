"""Measure what :func:`~effpass.planning.estimate_memory` predicts: the peak of one steady-state training
step, on real tensors (tests and ``bench/bench_memory_plan.py`` use it).

Measured = bytes live at the step's start (parameters, buffers, optimizer states, inputs; each storage
once) + the peak allocated during the step: on CPU with :func:`effpass.testing.memory.peak_memory`
(profiler allocator events, sees Inductor's buffers too), on CUDA with ``torch.cuda.max_memory_allocated``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils._pytree import tree_flatten

from effpass.quantized import storage_bytes as _storage_bytes

from .result import training_step

__all__ = ["MeasuredStep", "measure_step", "make_optimizer"]


@dataclass
class MeasuredStep:
    peak_bytes: int
    start_bytes: int
    step_peak_bytes: int
    grads: dict
    loss: float
    #: ``measure_step(..., host=True)``: the step's host memory (:class:`effpass.testing.memory.HostMeter`)
    host: dict | None = None


def make_optimizer(model: torch.nn.Module, optimizer: str | None, lr: float = 1e-3):
    """The optimizer the planner assumes: AdamW over the trainable parameters (foreach on CUDA only, as
    torch's default), torchao's AdamW8bit, or None."""
    from effpass.memory_options import build_optimizer

    from .replay import check_optimizer

    check_optimizer(optimizer)
    params = [p for p in model.parameters() if p.requires_grad]
    if optimizer is None or not params:
        return None
    return build_optimizer(optimizer, params, lr=lr, device=params[0].device)


def _state_tensors(opt) -> list:
    """The optimizer's state tensors. torchao's ``CPUOffloadOptimizer`` (``adamw_offload``) has no ``state`` of
    its own: its on-device optimizer's (``d_opt``) and its per-parameter host optimizers' (``optim_dict``)."""
    if opt is None:
        return []
    if hasattr(opt, "state"):
        subs = [opt]
    else:
        subs = [o for o in [getattr(opt, "d_opt", None), *getattr(opt, "optim_dict", {}).values()] if o is not None]
    return [v for o in subs for s in o.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def measure_step(compiled: torch.nn.Module, model: torch.nn.Module, inputs, optimizer: str | None = "adamw", *,
                 warmup: int = 2, loss_fn: Callable | None = None, keep_grads: bool = False,
                 lr: float = 1e-3, host: bool = False) -> MeasuredStep:
    """Run ``warmup`` training steps of ``compiled`` (whose parameters are ``model``'s), then measure one.

    ``keep_grads``: after the measured step, run one more forward and backward (no update) and return
    its gradients, for comparing plans (outside the measured window).

    ``host``: also the step's host memory (``MeasuredStep.host``, :class:`effpass.testing.memory.HostMeter`: on
    CUDA the pinned allocator's peak over the measured step and the process's RSS growth; on CPU "n/a on CPU")."""
    from effpass.testing.memory import HostMeter, peak_memory

    first = next(iter(model.parameters()), None)
    meter = HostMeter(first.device if first is not None else "cpu") if host else None
    if meter:
        meter.start()
    opt = make_optimizer(model, optimizer, lr)
    for _ in range(warmup):
        training_step(compiled, inputs, opt, loss_fn)
    params = list(model.parameters())
    dev = params[0].device if params else torch.device("cpu")
    # on CUDA the states a host optimizer keeps on the host are host memory, not the device's
    states = [v for v in _state_tensors(opt) if dev.type != "cuda" or v.device == dev]
    flat_inputs = [x for x in tree_flatten(inputs)[0] if isinstance(x, torch.Tensor)]
    start = _storage_bytes(params + list(model.buffers()) + states + flat_inputs)
    if meter:
        meter.before_step()
    loss, peak = peak_memory(lambda: training_step(compiled, inputs, opt, loss_fn), dev)
    host_figures = meter.result() if meter else None
    grads = {}
    if keep_grads:  # one more step without the optimizer update: the gradients at the same weights
        from .result import _call, _loss_of

        out = _call(compiled, inputs)
        (loss_fn or _loss_of)(out).backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        for p in params:
            p.grad = None
    return MeasuredStep(peak_bytes=start + peak, start_bytes=start, step_peak_bytes=peak, grads=grads,
                        loss=float(loss), host=host_figures)
