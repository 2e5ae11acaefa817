"""What the planner predicts: one training step (:func:`training_step`, which the tests and benchmarks measure
too) and its predicted memory (:class:`MemoryEstimate`)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from effpass.config import parse_size  # noqa: F401  (re-exported)

__all__ = ["MemoryEstimate", "training_step", "format_bytes", "parse_size", "reserved_after", "both_reserved_after"]


def format_bytes(n: float) -> str:
    n = float(n)
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


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
    #: per "phase op" (e.g. "backward aten.mm.default"): the most live bytes above the start right after that op
    #: allocated; where the peak could move to at other lengths (planning/tiles.py: a crossing beyond the replays)
    op_peaks: dict = field(default_factory=dict)
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
    #: CUDA target: bytes the caching allocator reserves from the driver over the step (its segments:
    #: ``torch.cuda.max_memory_reserved``), :mod:`effpass.planning.cuda_allocator`; None for other devices
    reserved_peak_bytes: int | None = None
    #: the same with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (each pool's live bytes in 2 MiB pages)
    reserved_expandable_bytes: int | None = None
    #: the allocator the plan is for: "default" or "expandable" (expandable segments); picks the reserved figure
    allocator: str = "default"
    #: host memory (CUDA plans, :mod:`effpass.planning.host_memory`): the most pinned/host bytes the step holds
    #: (offloaded activations, optimizer states on the host), and the bytes moved over the host link per step
    host_bytes: int = 0
    offload_d2h_bytes: int = 0        # offloaded activations to the host (forward)
    offload_h2d_bytes: int = 0        # and back (backward)
    offload_overlapped: bool = False  # the copies overlap compute (offload_activations' stream variant)
    prefetch_window: int = 0          # the reload buffer held ahead of its use (device bytes, modelled)
    optimizer_d2h_bytes: int = 0      # gradients to the host (optimizer on the host)
    optimizer_h2d_bytes: int = 0      # parameters back
    forward_flops: int = 0            # of ``flops``, those of the forward (the window offload copies overlap)

    @property
    def reserved_bytes(self) -> int | None:
        """The reserved bytes of the allocator the plan is for (:attr:`allocator`), None where not modelled."""
        if self.allocator == "expandable":
            return self.reserved_expandable_bytes
        return self.reserved_peak_bytes

    @property
    def device_peak_bytes(self) -> int:
        """What the device must hold for the step: the allocator's reserved segments where modelled (CUDA; the
        default allocator's, or with expandable segments when :attr:`allocator` says so), else the peak of live
        storage bytes. The planner fits this to the budget."""
        return max(self.peak_bytes, self.reserved_bytes or 0)

    def breakdown(self) -> dict[str, int]:
        return {"parameters": self.parameters, "buffers": self.buffers, "inputs": self.inputs,
                "optimizer_states": self.optimizer_states, "gradients": self.gradients,
                "activations": self.activations, "largest_transient": self.largest_transient}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def summary(self) -> str:
        lines = [f"predicted peak of one training step: {format_bytes(self.peak_bytes)} ({self.peak_bytes} bytes)"
                 + (f" per rank, {self.world_size} ranks ({self.sharding})" if self.world_size > 1 else "")
                 + (f"; reserved by CUDA's caching allocator {format_bytes(self.reserved_bytes)} "
                    f"({self.reserved_bytes} bytes"
                    + (", expandable segments" if self.allocator == "expandable" else "") + ")"
                    if self.reserved_bytes is not None else ""),
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


def reserved_after(est: MemoryEstimate, peak_bytes: int, expandable: bool = False) -> int | None:
    """``est``'s reserved bytes (``expandable``: with expandable segments) moved by a change of its live peak to
    ``peak_bytes`` made after the replay (a sharding fold, another optimizer's states): the allocator's overhead
    above the live peak is kept."""
    reserved = est.reserved_expandable_bytes if expandable else est.reserved_peak_bytes
    if reserved is None:
        return None
    return max(peak_bytes, reserved + peak_bytes - est.peak_bytes)


def both_reserved_after(est: MemoryEstimate, peak_bytes: int) -> dict:
    """:func:`reserved_after` of both allocator modes, as ``dataclasses.replace`` keywords."""
    return {"reserved_peak_bytes": reserved_after(est, peak_bytes),
            "reserved_expandable_bytes": reserved_after(est, peak_bytes, expandable=True)}


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


def training_step(model, inputs, optimizer=None, loss_fn: Callable | None = None,
                  on_phase: Callable[[str | None], None] | None = None):
    """One training step as the planner predicts it: ``loss = loss_fn(model(*inputs))`` (inputs a tuple
    or a dict of keyword arguments), ``loss.backward()``, ``optimizer.step()``,
    ``optimizer.zero_grad(set_to_none=True)``. Returns the loss (detached). ``on_phase`` is called with
    ``"forward"``, ``"backward"``, ``"optimizer"`` as the step enters each, and ``None`` at its end (the
    replay's tracker attributes allocations to phases with it)."""
    set_phase = on_phase or (lambda p: None)
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
