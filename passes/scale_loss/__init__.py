"""``scale_loss``: dynamic loss scaling inside the compiled step, for fp16 mixed precision.

fp16 has a narrow exponent range: small gradients underflow to zero. Dynamic loss scaling multiplies the
backward's seed gradient by a scale S (large, e.g. 2**16), divides the gradients by S before the optimizer
step, skips steps whose gradients overflowed (inf/NaN) and then lowers S, and raises S again after
``growth_interval`` clean steps. ``torch.amp.GradScaler`` does this around the model; here the scaling is
part of the compiled graph and the scale is a tensor the graph reads, so a changing scale never recompiles.

Phases:

* module: registers the scale (and its growth tracker) as non-persistent buffers on the model, so Dynamo
  sees the scale as a graph input that changes in place, and wraps ``model.forward`` so the model's scalar
  loss (``ModelOutput.loss``, ``(loss, ...)[0]``, or a scalar output) goes through ``effpass::scale_grad``:
  identity in the forward (the loss you see is the true loss), multiplies its gradient by the scale in the
  backward. Attaches the :class:`LossScaler` returned by :func:`loss_scaler` (``ScaleLoss.scaler(model)``).
* torch IR: records how many losses the graph scales, or why none (no scalar loss: the forward ran
  without labels), in the pass statistics.

The unscale, the inf/NaN check and the skip happen in ``scaler.step(optimizer)``, where all gradients
are, with the same kernels as GradScaler (``_amp_foreach_non_finite_check_and_unscale_``,
``_amp_update_scale_``); fused Adam/AdamW/SGD receive ``grad_scale``/``found_inf`` and skip on device, with
no host sync per step.

Runs after ``apply_autocast`` (NOTE(ordering): it reads that pass's dtype; with bf16 scaling is pointless,
bf16 has fp32's exponent range, and the pass turns itself off and says so).

Invariants: the prepared eager model computes the same forward as before (identity op) and, during
backward, gradients scaled by the current scale, exactly as the compiled model; nothing here depends on
a pass having run on a cache hit (the scale lives on the model, not in the graph).
"""
from __future__ import annotations

import types
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch
import torch.fx as fx

import effpass
from effpass.facts import LossScaling, MixedPrecision

__all__ = ["ScaleLoss", "LossScaler", "loss_scaler", "LossScaleCollapsedError", "scale_grad"]

_SCALE_BUFFER = "effpass_loss_scale"
_TRACKER_BUFFER = "effpass_loss_scale_growth_tracker"
_SCALER_ATTR = "_effpass_loss_scaler"
_INNER_FORWARD = "_effpass_unscaled_forward"
_BOUND_TO_SELF = "_effpass_unscaled_forward_takes_self"


# ------------------------------------------------------------------------------------------------------
# the op: identity forward, gradient times scale backward
# ------------------------------------------------------------------------------------------------------
@torch.library.custom_op("effpass::scale_grad", mutates_args=())
def scale_grad(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` unchanged in the forward; in the backward the gradient of ``x`` is multiplied by ``scale``."""
    return x.clone()


@scale_grad.register_fake
def _scale_grad_fake(x, scale):
    return torch.empty_like(x)


def _scale_grad_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])


def _scale_grad_backward(ctx, grad):
    (scale,) = ctx.saved_tensors
    # NOTE(parity): GradScaler computes (loss * scale[1]).backward(): the loss's gradient is 1.0 * scale
    # in fp32. Same value here.
    return (grad * scale).to(grad.dtype).reshape(grad.shape), None


scale_grad.register_autograd(_scale_grad_backward, setup_context=_scale_grad_setup)

_SCALE_GRAD_TARGETS = (torch.ops.effpass.scale_grad.default, torch.ops.effpass.scale_grad, scale_grad)


class LossScaleCollapsedError(RuntimeError):
    """The loss scale kept falling: every step overflowed, so training would silently do nothing."""


# ------------------------------------------------------------------------------------------------------
# the scaler the user steps with
# ------------------------------------------------------------------------------------------------------
class LossScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose scale lives on the model, where the compiled graph reads it.

    The unscale, the inf/NaN check, the skip, the scale update, ``state_dict`` and ``load_state_dict`` are
    GradScaler's own code (so a state dict moves freely between the two, and the semantics are the same);
    what differs:

    * the scale and growth tracker are the model's buffers (``scale_tensor``), so ``model.to(device)``
      moves them and the graph reads the current value without recompiling;
    * the model's own loss is scaled inside the graph by ``effpass::scale_grad``; :meth:`scale` is only for
      a loss computed outside the model, and returns the loss *unchanged in value* (its backward is
      scaled), so what you log is the true loss;
    * gradients of FSDP2 (DTensor) parameters are checked per shard and the found-inf flag is all-reduced,
      so every rank makes the same skip decision;
    * :class:`LossScaleCollapsedError` when the scale falls below ``min_scale`` (training would make no
      progress), checked without an extra host sync on the fused-optimizer path.

    >>> scaler = effpass.loss_scaler(model)                          # or ScaleLoss.scaler(model)
    >>> loss = model(**batch).loss; loss.backward()                 # the model scaled the gradients
    >>> scaler.step(optimizer); scaler.update(); optimizer.zero_grad()
    """

    #: with the fused optimizers (no host sync per step), the scale is checked against min_scale this often
    check_every: int = 16

    def __init__(self, model: torch.nn.Module, *, init_scale: float, growth_factor: float, backoff_factor: float,
                 growth_interval: int, min_scale: float, enabled: bool, disabled_reason: str = ""):
        self._model_ref = weakref.ref(model)
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        super().__init__(device=device.type, init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval, enabled=enabled)
        self.min_scale = min_scale
        self.disabled_reason = disabled_reason
        self._updates = 0
        self._consecutive_skips = 0                       # known exactly only where GradScaler syncs anyway
        self._skipped = None                              # device tensor: skipped steps so far
        self._manual_scaling = False
        #: set by the torch-IR hook when a compiled graph routes the model's loss through scale_grad
        self._loss_scaled_in_graph = False

    # -- the scale and tracker are the model's buffers (GradScaler reads and writes them in place) -----
    @property
    def _model(self) -> torch.nn.Module:
        m = self._model_ref()
        if m is None:
            raise RuntimeError("scale_loss: the model this scaler belongs to no longer exists")
        return m

    @property
    def _scale(self) -> torch.Tensor | None:
        return getattr(self._model, _SCALE_BUFFER) if self._enabled else None

    @_scale.setter
    def _scale(self, value) -> None:  # GradScaler's constructor sets None; the buffer is the scale
        if value is not None:
            self.scale_tensor.copy_(value)

    @property
    def _growth_tracker(self) -> torch.Tensor | None:
        return getattr(self._model, _TRACKER_BUFFER) if self._enabled else None

    @_growth_tracker.setter
    def _growth_tracker(self, value) -> None:
        if value is not None:
            getattr(self._model, _TRACKER_BUFFER).copy_(value)

    @property
    def scale_tensor(self) -> torch.Tensor:
        """The scale the graph reads (a 1-element fp32 buffer on the model; changed in place)."""
        return getattr(self._model, _SCALE_BUFFER)

    @property
    def skipped_steps(self) -> int:
        """How many steps were skipped for inf/NaN gradients (a host sync)."""
        return 0 if self._skipped is None else int(self._skipped.item())

    # -- what differs from GradScaler ----------------------------------------------------------------------
    def scale(self, outputs):
        """Scale the backward of a loss computed outside the model (the model's own loss is scaled
        already). Returns ``outputs`` unchanged in value."""
        if not self._enabled:
            return outputs
        if not isinstance(outputs, torch.Tensor):
            raise TypeError(f"scale_loss: scale() takes one loss tensor, got {type(outputs).__name__}")
        self._manual_scaling = True
        return scale_grad(outputs, self.scale_tensor.to(outputs.device))

    def step(self, optimizer: torch.optim.Optimizer, *args, **kwargs):
        """GradScaler's ``step`` (unscale, skip on inf/NaN; fused optimizers skip on device), after
        checking that some loss was scaled at all."""
        if self._enabled:
            self._check_loss_was_scaled()
        return super().step(optimizer, *args, **kwargs)

    def _maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs):
        # The same host sync as GradScaler's, also counting consecutive skips for the collapse check.
        if sum(v.item() for v in optimizer_state["found_inf_per_device"].values()):
            self._consecutive_skips += 1
            return None
        self._consecutive_skips = 0
        return optimizer.step(*args, **kwargs)

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        """GradScaler's check-and-unscale, per shard for FSDP2 (DTensor) gradients, with the found-inf
        flag all-reduced across ranks."""
        groups: dict[tuple, list[torch.Tensor]] = {}
        sharded = False
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise TypeError("scale_loss does not support sparse gradients")
                grad = p.grad
                if hasattr(grad, "to_local"):  # an FSDP2 DTensor: each rank checks and unscales its shard
                    grad, sharded = grad.to_local(), True
                groups.setdefault((grad.device, grad.dtype), []).append(grad)
        per_device: dict[torch.device, torch.Tensor] = {}
        with torch.no_grad():
            for (device, _), grads in groups.items():
                if device not in per_device:
                    per_device[device] = found_inf.to(device, copy=True)
                torch._amp_foreach_non_finite_check_and_unscale_(grads, per_device[device], inv_scale.to(device))
            if sharded and torch.distributed.is_available() and torch.distributed.is_initialized():
                # NOTE: every rank must make the same skip decision, so an overflow in any shard counts.
                for f in per_device.values():
                    torch.distributed.all_reduce(f, op=torch.distributed.ReduceOp.MAX)
        return per_device or {found_inf.device: found_inf}

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """GradScaler's ``update``; raises :class:`LossScaleCollapsedError` when the scale has fallen
        below ``min_scale``."""
        if not self._enabled:
            return
        if new_scale is None:
            found = [f for st in self._per_optimizer_states.values() for f in st["found_inf_per_device"].values()]
            if not found:  # GradScaler asserts here; a user error deserves a RuntimeError that says what to do
                raise RuntimeError("update() was called without a step(): no inf/NaN check was recorded; call "
                                   "scaler.step(optimizer) (or scaler.unscale_(optimizer)) first")
            if found:
                skipped = (sum(f.to(self.scale_tensor.device) for f in found) > 0).to(torch.int64)
                self._skipped = skipped if self._skipped is None else self._skipped + skipped
                self._updates += 1
        elif isinstance(new_scale, (int, float)):
            new_scale = float(new_scale)
        super().update(new_scale)
        if new_scale is None and self.min_scale > 0 and (
                self._consecutive_skips > 0 or self._updates % self.check_every == 0):
            value = float(self.scale_tensor.item())
            if value < self.min_scale:
                raise LossScaleCollapsedError(
                    f"scale_loss: the loss scale fell to {value:g}, below min_scale={self.min_scale:g} "
                    f"({self.skipped_steps} of {self._updates} steps skipped for inf/NaN gradients). Every "
                    "step overflows, so training makes no progress. Check the loss for NaN/inf from the "
                    "forward, use bf16 (ApplyAutocast(dtype=torch.bfloat16)), keep the overflowing module "
                    "in fp32 (ApplyAutocast(exclude=[...])), or lower the learning rate; ScaleLoss(min_scale=0) "
                    "turns this check off.")

    # -- helpers --------------------------------------------------------------------------------------
    def _check_loss_was_scaled(self) -> None:
        if self._manual_scaling or self._loss_scaled_in_graph:
            return
        if getattr(self._model, "_effpass_eager_scaled", False):
            return
        raise RuntimeError(
            "scale_loss: no loss was scaled: the model's output held no scalar loss that requires grad "
            "(did the forward get labels?). Return the loss from the model, or scale a loss computed "
            "outside it with `loss = scaler.scale(loss)` before backward()")


@effpass.register_extension("loss_scaler")
def loss_scaler(model: torch.nn.Module) -> LossScaler:
    """The :class:`LossScaler` of a model prepared or compiled with ``ScaleLoss`` (compiled or not)."""
    inner = getattr(model, "_orig_mod", model)
    scaler = getattr(inner, _SCALER_ATTR, None)
    if scaler is None:
        raise ValueError("this model has no loss scaler: compile it with ScaleLoss in the pipeline, e.g. "
                         "effpass.compile(model, passes=[ApplyAutocast(dtype=torch.float16), ScaleLoss()])")
    return scaler


# ------------------------------------------------------------------------------------------------------
# the model's forward, with its loss routed through scale_grad
# ------------------------------------------------------------------------------------------------------
def _is_loss(t: Any) -> bool:
    return (isinstance(t, torch.Tensor) and t.dim() == 0 and t.is_floating_point() and t.requires_grad
            and torch.is_grad_enabled())


def _route_loss(out: Any, scale: torch.Tensor, on_scaled) -> Any:
    if _is_loss(out):
        on_scaled()
        return scale_grad(out, scale)
    if isinstance(out, Mapping) or hasattr(out, "to_tuple"):  # dicts and Hugging Face ModelOutput
        if "loss" in out and _is_loss(out["loss"]):
            on_scaled()
            out["loss"] = scale_grad(out["loss"], scale)
        return out
    if isinstance(out, tuple) and out and _is_loss(out[0]):
        on_scaled()
        return (scale_grad(out[0], scale), *out[1:])
    return out


def _scaled_forward(self, *args, **kwargs):
    inner = getattr(self, _INNER_FORWARD)
    # NOTE(scoping): calling the plain function with `self` keeps Dynamo's module paths as
    # L['self'].lm_head (a bound method would name them L['self']._effpass_unscaled_forward.__self__...).
    out = inner(self, *args, **kwargs) if getattr(self, _BOUND_TO_SELF, False) else inner(*args, **kwargs)

    def mark():
        if not torch.compiler.is_compiling():
            object.__setattr__(self, "_effpass_eager_scaled", True)

    return _route_loss(out, getattr(self, _SCALE_BUFFER), mark)


@effpass.register_pass("scale_loss", run_after=("apply_autocast",))
@dataclass(frozen=True, kw_only=True)
class ScaleLoss(effpass.Pass):
    """Dynamic loss scaling for fp16 inside the compiled step (a no-op with bf16).

    Before (module)::  ``out = model(input_ids, labels=labels)``; ``out.loss.backward()``

    After::

        out = model(input_ids, labels=labels)   # out.loss = effpass::scale_grad(loss, model.effpass_loss_scale)
        out.loss.backward()                     # gradients are scaled by the current scale
        scaler = ScaleLoss.scaler(model)
        scaler.step(optimizer); scaler.update() # unscale, skip on inf/NaN, adapt the scale
    """

    # NOTE: the loss is routed through the scale only by the module hook (a wrapper on forward).
    requires_module_phase = True

    init_scale: float = field(default=2.0 ** 16, metadata={"doc": "initial loss scale"})
    growth_factor: float = field(default=2.0, metadata={"doc": "scale multiplier after growth_interval clean steps"})
    backoff_factor: float = field(default=0.5, metadata={"doc": "scale multiplier after a step with inf/NaN gradients"})
    growth_interval: int = field(default=2000, metadata={"doc": "clean steps before the scale grows"})
    min_scale: float = field(default=1.0, metadata={
        "doc": "raise LossScaleCollapsedError when the scale falls below this (0: never)"})

    def validate(self) -> None:
        if not self.init_scale > 0:
            raise ValueError(f"scale_loss: init_scale must be > 0, got {self.init_scale}")
        if not self.growth_factor > 1:
            raise ValueError(f"scale_loss: growth_factor must be > 1, got {self.growth_factor}")
        if not 0 < self.backoff_factor < 1:
            raise ValueError(f"scale_loss: backoff_factor must be in (0, 1), got {self.backoff_factor}")
        if self.growth_interval < 1:
            raise ValueError(f"scale_loss: growth_interval must be >= 1, got {self.growth_interval}")
        if self.min_scale < 0:
            raise ValueError(f"scale_loss: min_scale must be >= 0, got {self.min_scale}")

    @classmethod
    def default_note(cls) -> str:
        return "off (add it with ApplyAutocast(dtype=torch.float16); a no-op with bf16)"

    #: ``ScaleLoss.scaler(model)``: the model's :class:`LossScaler`.
    scaler = staticmethod(loss_scaler)

    def facts(self) -> tuple:
        """The loss is scaled for float16 gradients (read by apply_autocast)."""
        return (LossScaling(),)

    def _disabled_reason(self, ctx) -> str:
        mp = ctx.fact(MixedPrecision)
        if mp is not None and mp.dtype == torch.bfloat16:
            return ("apply_autocast uses bfloat16, which has float32's exponent range: gradients do not "
                    "underflow, so scale_loss does nothing")
        return ""

    def prepare_module(self, model: torch.nn.Module, ctx) -> effpass.PassResult:
        ctx.scope.check_graph()   # targets/exclude name modules of the model (the loss is scaled as a whole)
        reason = self._disabled_reason(ctx)
        existing = getattr(model, _SCALER_ATTR, None)
        if reason:
            warnings.warn(f"effpass: {reason}", UserWarning, stacklevel=2)
            if existing is None:
                setattr(model, _SCALER_ATTR, self._make_scaler(model, enabled=False, reason=reason))
            return effpass.PassResult(stats={"enabled": False}, skipped=[{"site": "model", "reason": reason}])
        if existing is not None and existing.is_enabled():
            return effpass.PassResult(stats={"enabled": True, "reused": 1})  # prepared before: keep its state
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        model.register_buffer(_SCALE_BUFFER, torch.full((1,), self.init_scale, dtype=torch.float32, device=device),
                              persistent=False)
        model.register_buffer(_TRACKER_BUFFER, torch.zeros((1,), dtype=torch.int32, device=device), persistent=False)
        # NOTE(design): an instance forward that Dynamo traces, so the scale is a graph input and the
        # scale_grad op sits in the compiled graph. A bound method (not a closure) survives deepcopy;
        # the inner forward is stored as a plain function, which deepcopy shares.
        fwd = model.forward
        if getattr(fwd, "__self__", None) is model:   # store the function, not a bound method
            object.__setattr__(model, _INNER_FORWARD, fwd.__func__)
            object.__setattr__(model, _BOUND_TO_SELF, True)
        else:
            object.__setattr__(model, _INNER_FORWARD, fwd)
        model.forward = types.MethodType(_scaled_forward, model)
        setattr(model, _SCALER_ATTR, self._make_scaler(model, enabled=True))
        return effpass.PassResult(changed=True, stats={"enabled": True, "init_scale": self.init_scale})

    def _make_scaler(self, model, *, enabled: bool, reason: str = "") -> LossScaler:
        return LossScaler(model, init_scale=self.init_scale, growth_factor=self.growth_factor,
                          backoff_factor=self.backoff_factor, growth_interval=self.growth_interval,
                          min_scale=self.min_scale, enabled=enabled, disabled_reason=reason)

    def transform_torch_ir(self, gm: fx.GraphModule, ctx) -> effpass.PassResult:
        model = ctx.model
        scaler = getattr(model, _SCALER_ATTR, None) if model is not None else None
        if scaler is not None and not scaler.is_enabled():
            return effpass.PassResult(stats={"scaled_losses": 0}, skipped=[{"site": "graph",
                                                                           "reason": scaler.disabled_reason}])
        n = sum(1 for node in gm.graph.nodes if node.op == "call_function" and node.target in _SCALE_GRAD_TARGETS)
        if n and scaler is not None:
            # NOTE(state): the scaler checks at step() that a loss was scaled; the torch-IR phase runs on
            # every compile (cache hits included), so this is where a compiled graph tells it.
            scaler._loss_scaled_in_graph = True
        if n == 0:
            why = ("the graph returns no scalar loss that requires grad (inference, or a forward without labels); "
                   "scale a loss computed outside the model with scaler.scale(loss)")
            if scaler is None:
                why = "the model was not prepared by ScaleLoss (use effpass.compile, not the string backend)"
            return effpass.PassResult(stats={"scaled_losses": 0}, skipped=[{"site": "output", "reason": why}])
        return effpass.PassResult(stats={"scaled_losses": n})
