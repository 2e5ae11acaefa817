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
class LossScaler:
    """Unscales, checks and steps; updates the scale. Same contract and state_dict as GradScaler.

    >>> scaler = effpass.passes.scale_loss.loss_scaler(model)     # or ScaleLoss.scaler(model)
    >>> loss = model(**batch).loss; loss.backward()                 # the model scaled the gradients
    >>> scaler.step(optimizer); scaler.update(); optimizer.zero_grad()
    """

    #: with the fused optimizers (no host sync per step), the scale is checked against min_scale this often
    check_every: int = 16

    def __init__(self, model: torch.nn.Module, *, init_scale: float, growth_factor: float, backoff_factor: float,
                 growth_interval: int, min_scale: float, enabled: bool, disabled_reason: str = ""):
        self._model_ref = weakref.ref(model)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.min_scale, self.init_scale = growth_interval, min_scale, init_scale
        self._enabled = enabled
        self.disabled_reason = disabled_reason
        self._found_inf: dict[int, torch.Tensor] = {}   # per optimizer stepped since the last update()
        self._unscaled: set[int] = set()
        self._updates = 0
        self._consecutive_skips = 0                       # known exactly only where we synced anyway
        self._skipped = None                              # device tensor: skipped steps so far
        self._manual_scaling = False

    # -- state on the model ---------------------------------------------------------------------------
    @property
    def _model(self) -> torch.nn.Module:
        m = self._model_ref()
        if m is None:
            raise RuntimeError("scale_loss: the model this scaler belongs to no longer exists")
        return m

    @property
    def scale_tensor(self) -> torch.Tensor:
        """The scale the graph reads (a 1-element fp32 buffer on the model; changed in place)."""
        return getattr(self._model, _SCALE_BUFFER)

    @property
    def _tracker(self) -> torch.Tensor:
        return getattr(self._model, _TRACKER_BUFFER)

    def is_enabled(self) -> bool:
        return self._enabled

    def get_scale(self) -> float:
        """The current scale as a Python float (a host sync); 1.0 when disabled."""
        return float(self.scale_tensor.item()) if self._enabled else 1.0

    @property
    def skipped_steps(self) -> int:
        """How many steps were skipped for inf/NaN gradients (a host sync)."""
        return 0 if self._skipped is None else int(self._skipped.item())

    # -- the training-loop API ------------------------------------------------------------------------
    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """Scale a loss computed outside the model (the model's own loss is scaled already).

        Returns ``loss`` unchanged in value; its backward is scaled."""
        if not self._enabled:
            return loss
        self._manual_scaling = True
        return scale_grad(loss, self.scale_tensor.to(loss.device))

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by the scale in place (e.g. before gradient clipping)."""
        if not self._enabled:
            return
        key = id(optimizer)
        if key in self._unscaled:
            raise RuntimeError("unscale_() was already called on this optimizer since the last update()")
        if key in self._found_inf:
            raise RuntimeError("unscale_() is being called after step(); call update() first")
        inv = self.scale_tensor.double().reciprocal().float()
        self._found_inf[key] = self._check_and_unscale(optimizer, inv)
        self._unscaled.add(key)

    def step(self, optimizer: torch.optim.Optimizer, *args, **kwargs):
        """Unscale the gradients and step, unless some gradient is inf/NaN: then skip the step entirely
        (parameters and optimizer state untouched). Returns what ``optimizer.step`` returned, or None."""
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        key = id(optimizer)
        if key in self._found_inf and key not in self._unscaled:
            raise RuntimeError("step() was already called on this optimizer since the last update()")
        self._check_loss_was_scaled()
        if getattr(optimizer, "_step_supports_amp_scaling", False) and key not in self._unscaled:
            # Fused optimizers unscale and skip on device: no host sync (as GradScaler does it).
            found_inf = self._check_and_unscale(optimizer, torch.ones((), device=self.scale_tensor.device))
            self._found_inf[key] = found_inf
            optimizer.grad_scale = self.scale_tensor
            optimizer.found_inf = found_inf
            try:
                return optimizer.step(*args, **kwargs)
            finally:
                del optimizer.grad_scale
                del optimizer.found_inf
        if key not in self._unscaled:
            self.unscale_(optimizer)
        self._unscaled.discard(key)
        if self._found_inf[key].item() == 0:   # the host sync GradScaler also does for unfused optimizers
            self._consecutive_skips = 0
            return optimizer.step(*args, **kwargs)
        self._consecutive_skips += 1
        return None

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Lower the scale after a skipped step, raise it after ``growth_interval`` clean steps.

        Raises :class:`LossScaleCollapsedError` when the scale has fallen below ``min_scale``."""
        if not self._enabled:
            return
        scale = self.scale_tensor
        if new_scale is not None:
            if isinstance(new_scale, torch.Tensor):
                scale.copy_(new_scale.reshape(scale.shape))
            else:
                scale.fill_(float(new_scale))
            self._found_inf.clear()
            self._unscaled.clear()
            return
        if not self._found_inf:
            raise RuntimeError("update() was called without a step(): no inf/NaN check was recorded")
        found = list(self._found_inf.values())
        combined = found[0].to(scale.device)
        for f in found[1:]:
            combined = combined + f.to(scale.device)
        torch._amp_update_scale_(scale, self._tracker, combined, self.growth_factor, self.backoff_factor,
                                 self.growth_interval)
        skipped = (combined > 0).to(torch.int64)
        self._skipped = skipped if self._skipped is None else self._skipped + skipped
        self._found_inf.clear()
        self._unscaled.clear()
        self._updates += 1
        if self.min_scale > 0 and (self._consecutive_skips > 0 or self._updates % self.check_every == 0):
            value = float(scale.item())
            if value < self.min_scale:
                raise LossScaleCollapsedError(
                    f"scale_loss: the loss scale fell to {value:g}, below min_scale={self.min_scale:g} "
                    f"({self.skipped_steps} of {self._updates} steps skipped for inf/NaN gradients). Every "
                    "step overflows, so training makes no progress. Check the loss for NaN/inf from the "
                    "forward, use bf16 (ApplyAutocast(dtype=torch.bfloat16)), keep the overflowing module "
                    "in fp32 (ApplyAutocast(exclude=[...])), or lower the learning rate; ScaleLoss(min_scale=0) "
                    "turns this check off.")

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state; the same keys as ``torch.amp.GradScaler.state_dict()`` (empty when disabled)."""
        if not self._enabled:
            return {}
        return {"scale": self.get_scale(), "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "_growth_tracker": int(self._tracker.item())}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from :meth:`state_dict` (or from a ``GradScaler`` state dict)."""
        if not self._enabled:
            return
        if not state:
            raise RuntimeError("the state dict is empty: it was saved from a disabled scaler")
        missing = [k for k in ("scale", "_growth_tracker") if k not in state]
        if missing:
            raise ValueError(f"scale_loss state dict lacks {missing}; it has {sorted(state)}")
        self.scale_tensor.fill_(float(state["scale"]))
        self._tracker.fill_(int(state["_growth_tracker"]))
        self.growth_factor = float(state.get("growth_factor", self.growth_factor))
        self.backoff_factor = float(state.get("backoff_factor", self.backoff_factor))
        self.growth_interval = int(state.get("growth_interval", self.growth_interval))

    # -- helpers --------------------------------------------------------------------------------------
    def _check_and_unscale(self, optimizer, inv_scale: torch.Tensor) -> torch.Tensor:
        found_inf = torch.zeros((), dtype=torch.float32, device=self.scale_tensor.device)
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
        per_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        with torch.no_grad():
            for (device, _), grads in groups.items():
                if device not in per_device:
                    per_device[device] = (torch.zeros((), dtype=torch.float32, device=device), inv_scale.to(device))
                f, inv = per_device[device]
                torch._amp_foreach_non_finite_check_and_unscale_(grads, f, inv)
            for f, _ in per_device.values():
                found_inf = found_inf + f.to(found_inf.device)
        if sharded and torch.distributed.is_available() and torch.distributed.is_initialized():
            # NOTE: every rank must make the same skip decision, so an overflow in any shard counts.
            torch.distributed.all_reduce(found_inf, op=torch.distributed.ReduceOp.MAX)
        return found_inf

    def _check_loss_was_scaled(self) -> None:
        if self._manual_scaling:
            return
        model = self._model
        if getattr(model, "_effpass_eager_scaled", False):
            return
        try:
            scaled = effpass.report(model).stats("scale_loss").get("scaled_losses", 0)
        except ValueError:
            scaled = 0
        if not scaled:
            raise RuntimeError(
                "scale_loss: no loss was scaled: the model's output held no scalar loss that requires grad "
                "(did the forward get labels?). Return the loss from the model, or scale a loss computed "
                "outside it with `loss = scaler.scale(loss)` before backward()")
        self._manual_scaling = True  # checked once


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

    def _disabled_reason(self, ctx) -> str:
        ac = ctx.find_pass("apply_autocast")
        if ac is not None and getattr(ac, "dtype", None) == torch.bfloat16:
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
        if n == 0:
            why = ("the graph returns no scalar loss that requires grad (inference, or a forward without labels); "
                   "scale a loss computed outside the model with scaler.scale(loss)")
            if scaler is None:
                why = "the model was not prepared by ScaleLoss (use effpass.compile, not the string backend)"
            return effpass.PassResult(stats={"scaled_losses": 0}, skipped=[{"site": "output", "reason": why}])
        return effpass.PassResult(stats={"scaled_losses": n})
