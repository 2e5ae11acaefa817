"""step_in_backward: each parameter's optimizer update applied as soon as its gradient is complete.

Full fine-tuning holds every parameter's gradient from the end of backward until ``opt.step()``. This
pass registers a ``Tensor.register_post_accumulate_grad_hook`` on every trainable parameter; once the
user's optimizer is known, the hook runs that optimizer's own ``step`` on that one parameter (its
param_groups temporarily narrowed to ``[{**group, "params": [p]}]``, so the hyperparameters, the LR a
scheduler set, and ``opt.state[p]`` are the user's own) and then frees the gradient (``p.grad = None``).
``opt.step()`` afterwards finds no gradients and does nothing to those parameters (torch's and torchao's
optimizers skip parameters whose ``grad`` is ``None``); ``opt.zero_grad()`` is harmless.

The user's optimizer is found without any change to the training loop: a global
``torch.optim`` step pre-hook attaches every optimizer that holds one of the hooked parameters on its
first ``step()`` (the first step is therefore an ordinary one; from the second on, gradients are freed
during backward). ``attach(opt)`` attaches an optimizer at once, so that even the first step saves memory.

Exactness: the arithmetic is the optimizer's own per-parameter arithmetic, so parameters and state are
bit-identical to the usual ``step()`` for the single-tensor (``foreach=False``) implementations, torchao's
per-parameter 8-bit AdamW, and (as tested) ``foreach=True`` / ``fused=True`` of AdamW/Adam/SGD on CPU.
With an optimizer that takes gradients (``effpass.takes_gradients``: ``effpass.HostOffloadAdamW``, AdamW's states
and step on the host) each gradient is handed to it (``take_gradient``: copied to the host, the device gradient
freed) instead of a step, and ``opt.step()`` runs the host step.
Refused with an error: a second backward before ``opt.step()`` (gradient accumulation: the first
micro-batch's update has already been applied), a closure passed to ``step``, an optimizer class not in
:data:`SUPPORTED` (its step may couple parameters, e.g. LBFGS or a global-norm clipping optimizer).
Clipping by the global norm cannot be exact (it needs every gradient at once): with this pass the
gradients are gone when ``clip_grad_norm_`` runs; the Hugging Face integration raises when
``max_grad_norm > 0`` or ``gradient_accumulation_steps > 1``
(``effpass.integrations.huggingface.check_training_args``).
"""
from __future__ import annotations

import functools
import threading
import weakref
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.utils.weak import WeakTensorKeyDictionary

import effpass
from effpass.scope import glob_match_within

__all__ = ["StepInBackward", "attach", "detach", "SUPPORTED", "StepInBackwardError"]


class StepInBackwardError(RuntimeError):
    """A use of step_in_backward that cannot give the same parameters as the usual step."""


@functools.lru_cache(maxsize=None)
def _supported_classes() -> tuple[type, ...]:
    from effpass.host_optim import HostOffloadAdamW

    out: list[type] = [torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD, HostOffloadAdamW]
    try:  # optional: torchao's low-bit optimizers step one parameter at a time
        from effpass.quantized import quiet_torchao_import

        with quiet_torchao_import():
            from torchao.optim.adam import _AdamBase
        out.append(_AdamBase)
    except Exception:  # noqa: BLE001 - torchao absent or broken: its optimizers are simply not supported
        pass
    return tuple(out)


def __getattr__(name: str):
    """``SUPPORTED``: optimizer classes whose update of a parameter depends on that parameter's gradient and
    state only. Computed on first use (torchao is imported only when an optimizer is checked)."""
    if name == "SUPPORTED":
        return _supported_classes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

_LOCK = threading.RLock()
# keyed by tensor identity (a plain WeakKeyDictionary would compare tensors with ==)
_HOOKED = WeakTensorKeyDictionary()
_OPTS: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
_GLOBAL_HOOK = None
_INSIDE = threading.local()


class _ParamEntry:
    __slots__ = ("opt", "group", "stepped", "frames", "handle", "__weakref__")

    def __init__(self, handle):
        self.opt = None  # weakref to the optimizer, once attached
        self.group = None  # index into opt.param_groups
        self.stepped = False  # updated in backward since the last opt.step()
        self.frames = set()  # Dynamo frames whose compiled graphs take the parameter as an input
        self.handle = handle


def _check_optimizer(opt: torch.optim.Optimizer) -> None:
    from effpass.host_optim import takes_gradients

    supported = _supported_classes()
    if not isinstance(opt, supported) and not takes_gradients(opt):
        raise StepInBackwardError(
            f"step_in_backward: optimizer {type(opt).__name__} is not supported; supported: "
            f"{[c.__name__ for c in supported]} (their update of one parameter depends on its own gradient "
            f"and state only), or any optimizer that takes gradients (effpass.takes_gradients: "
            f"takes_gradients = True and take_gradient(param, grad)). Remove the step_in_backward pass to use "
            f"{type(opt).__name__}.")
    for g in opt.param_groups:
        if g.get("differentiable"):
            raise StepInBackwardError("step_in_backward: differentiable=True optimizers are not supported")


def attach(opt: torch.optim.Optimizer) -> int:
    """Make ``opt`` step the hooked parameters it holds inside backward; returns how many it holds.

    Called automatically on ``opt``'s first ``step()``; call it right after building the optimizer to save
    the gradients' memory from the first step on. Idempotent."""
    with _LOCK:
        held = [(gi, p) for gi, g in enumerate(opt.param_groups) for p in g["params"] if p in _HOOKED]
        if not held:
            return 0
        _check_optimizer(opt)
        for gi, p in held:
            e = _HOOKED[p]
            other = e.opt() if e.opt is not None else None
            if other is not None and other is not opt:
                raise StepInBackwardError(
                    f"step_in_backward: a parameter of shape {tuple(p.shape)} is held by two optimizers "
                    f"({type(other).__name__} and {type(opt).__name__}); each parameter must have one: when an "
                    f"optimizer replaces another (a resume), call effpass.passes.step_in_backward.detach(old) first")
            e.opt, e.group = weakref.ref(opt), gi
        if opt not in _OPTS:
            _OPTS.add(opt)
            opt.register_step_pre_hook(_on_user_step)
        return len(held)


def detach(opt: torch.optim.Optimizer) -> None:
    """Stop stepping ``opt``'s parameters in backward (gradients are kept for ``opt.step()`` again)."""
    with _LOCK:
        for e in list(_HOOKED.values()):
            if e.opt is not None and e.opt() is opt:
                e.opt, e.group, e.stepped = None, None, False


def _on_any_step(opt, args, kwargs):
    """Global step pre-hook: attach optimizers holding hooked parameters on their first step."""
    if getattr(_INSIDE, "on", False) or opt in _OPTS:
        return None
    attach(opt)
    return None


def _on_user_step(opt, args, kwargs):
    """The user's ``opt.step()``: a new cycle; refuse what cannot be exact."""
    if getattr(_INSIDE, "on", False):
        return None
    closure = args[1] if len(args) > 1 else kwargs.get("closure")
    if closure is not None:
        raise StepInBackwardError("step_in_backward: opt.step(closure) is not supported (the closure would "
                                  "run backward, which already stepped the parameters)")
    for e in _HOOKED.values():
        if e.opt is not None and e.opt() is opt:
            e.stepped = False
    return None


_ACCUMULATION = ("step_in_backward: a second backward before opt.step() (gradient accumulation over several "
                 "micro-batches) cannot be exact: the first micro-batch's update was already applied in backward. "
                 "Call opt.step() after every backward (gradient_accumulation_steps=1), or remove the pass.")
_OUTSIDE = (" Under effpass.compile this also happens when a parameter gets gradient from more than one place "
            "(used in two compiled graphs across a graph break, or also by eager code): its compiled graph's "
            "gradient was not the whole gradient. Exclude that parameter (StepInBackward(exclude=...)).")


def _grad_hook(p: torch.Tensor) -> None:
    e = _HOOKED.get(p)
    if e is None or e.opt is None or p.grad is None:
        return
    opt = e.opt()
    if opt is None:
        e.opt = None
        return
    if e.frames:
        # NOTE(compiled graphs): a graph taking p as input hands its gradient to its step op (autograd still
        # calls this hook, with p.grad as the op left it); a gradient arriving after that step is refused
        if e.stepped:
            raise StepInBackwardError(_ACCUMULATION + _OUTSIDE)
        return
    if e.stepped:
        raise StepInBackwardError(_ACCUMULATION)
    _step_one(p, e, opt)


def _step_one(p: torch.Tensor, e: "_ParamEntry", opt: torch.optim.Optimizer) -> None:
    """Run ``opt``'s own step on ``p`` alone (its gradient in ``p.grad``), then free the gradient. An optimizer
    that takes gradients (``effpass.takes_gradients``: ``effpass.HostOffloadAdamW``) is handed the gradient
    instead (``take_gradient``: copied to the host, the update in ``opt.step()``); ``p`` keeps no ``.grad``."""
    from effpass.host_optim import takes_gradients

    if takes_gradients(opt):
        grad, p.grad = p.grad, None
        with torch.no_grad():
            opt.take_gradient(p, grad)
        e.stepped = True
        return
    groups = opt.param_groups
    group = groups[e.group]
    if not any(q is p for q in group["params"]):
        raise StepInBackwardError("step_in_backward: the optimizer's param_groups changed after attach(); "
                                  "call attach(opt) again")
    with torch.no_grad():
        opt.param_groups = [{**group, "params": [p]}]
        _INSIDE.on = True
        try:
            step = type(opt).step
            if getattr(step, "hooked", False):  # torch's hook wrapper: user hooks run once, on opt.step()
                step = step.__wrapped__
            step(opt)
        finally:
            _INSIDE.on = False
            opt.param_groups = groups
    p.grad = None
    e.stepped = True


# ------------------------------------------------------------------------------------------------------
# inside a compiled backward graph: one op per parameter gradient
# ------------------------------------------------------------------------------------------------------
@torch.library.custom_op("effpass::step_parameter", mutates_args=())
def step_parameter(param: torch.Tensor, grad: torch.Tensor, after: list[torch.Tensor]) -> None:
    """Hand ``grad`` (``param``'s whole gradient from this graph) to ``param``'s optimizer at once: its step
    runs on ``param`` alone and the gradient is dropped. Before the optimizer is attached the gradient is
    accumulated into ``param.grad`` as autograd would.

    NOTE(ordering): the op updates ``param`` in place behind the compiler's back (declared side-effectful so
    it is kept, not declared mutating: a declared mutation bumps the parameter's version counter even when
    nothing is stepped, which breaks another graph's saved copy of it). Every value the backward computes
    from ``param`` is passed in ``after`` (unused here), so a compiler computes them all, reading the old
    ``param``, before this op (Inductor would otherwise compute a pointwise read lazily in a later kernel),
    and the pass places the op after every read of ``param`` in the graph."""
    _step_parameter_impl(param, grad, after)


def _step_parameter_impl(param: torch.Tensor, grad: torch.Tensor, after) -> None:
    e = _HOOKED.get(param)
    if e is None:
        raise StepInBackwardError(f"step_in_backward: a compiled graph steps a parameter of shape {tuple(param.shape)} "
                                  "that the pass did not hook (was the model's parameter replaced after compile?)")
    opt = e.opt() if e.opt is not None else None
    with torch.no_grad():
        if opt is None or len(e.frames) > 1:
            # not attached yet, or the parameter is an input of graphs of several frames (a graph break):
            # this graph's gradient may be a part of it; opt.step() steps it as usual.
            # NOTE(accumulate): autograd's AccumulateGrad keeps a gradient laid out like its parameter
            g = grad if grad.stride() == param.stride() else grad.contiguous()
            param.grad = g if param.grad is None else param.grad + g
            return
        if e.stepped:
            raise StepInBackwardError(_ACCUMULATION + _OUTSIDE)
        if param.grad is not None:
            raise StepInBackwardError(
                f"step_in_backward: a parameter of shape {tuple(param.shape)} already holds a gradient when its "
                "compiled graph's gradient is complete (gradient from eager code or another graph, or a gradient "
                "left from before: call opt.zero_grad()): stepping now would not use the whole gradient."
                + _OUTSIDE)
        param.grad = grad
        with _autograd_keys_restored():
            _step_one(param, e, opt)


def _autograd_keys_restored():
    """The dispatch keys of a plain eager call, for the optimizer's step inside this op's kernel.

    NOTE(subclass states): a custom op's kernel runs with the autograd keys excluded, where composite ops such
    as ``Tensor.to`` are not decomposed before a tensor subclass's ``__torch_dispatch__`` sees them;
    torchao's 8-bit optimizer states (``OptimState8bit``) implement ``_to_copy`` only, so AdamW8bit's first
    step (``out.to(p.device)``) failed inside the compiled backward. Grad mode stays off (``_step_one``)."""
    k = torch._C.DispatchKey
    excluded = torch._C._dispatch_tls_local_exclude_set()
    for key in (k.AutogradFunctionality, k.AutogradOther, k.AutogradNestedTensor):
        excluded = excluded.remove(key)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), excluded)


@step_parameter.register_fake
def _step_parameter_fake(param, grad, after) -> None:
    # NOTE(planner): the memory planner's replay runs the compiled graphs on fake tensors, so this kernel
    # runs where the real one would. On the replay's own (hooked) fake parameters, outside any tracing, it
    # does what the real op does (the optimizer's step on fake tensors: its states are created, its
    # transients and the freed gradient are seen by the replay). While a compiler traces, or on parameters
    # the pass did not hook (a compiler's own fake copies), it does nothing.
    if _HOOKED.get(param) is None or _tracing():
        return None
    from effpass.planning.estimate import replay_kernel

    with replay_kernel():
        _step_parameter_impl(param, grad, after)
    return None


def _tracing() -> bool:
    """A compiler is tracing (a proxy or functionalization mode, or a tracing context, is active)."""
    from torch._C import _get_dispatch_mode, _TorchDispatchModeKey

    if _get_dispatch_mode(_TorchDispatchModeKey.PROXY) is not None:
        return True
    if _get_dispatch_mode(_TorchDispatchModeKey.FUNCTIONAL) is not None:
        return True
    return torch._guards.TracingContext.try_get() is not None


@torch.library.custom_op("effpass::step_after", mutates_args=())
def step_after(value: torch.Tensor) -> torch.Tensor:
    """An empty token computed from ``value``: a :func:`step_parameter` call waits for it instead of for
    ``value`` itself.

    NOTE(lifetimes): passing a backward value read from the parameter directly in ``after`` keeps it alive
    until the step, i.e. until the parameter's whole gradient is complete: every tile of a tiled region (its
    intermediate-width input gradients, say) then lives to the end of the region's backward, which undid
    tile_sequence's saving (measured 844 MiB with both passes against 826 with tiles alone at 8,192 tokens).
    The token is computed right after ``value`` (its input: a compiler must realise ``value``, reading the
    old parameter, before it) and holds no memory, so ``value`` dies at its last real use."""
    return value.new_empty(0)


@step_after.register_fake
def _step_after_fake(value):
    return value.new_empty(0)


_STEP_OP = torch.ops.effpass.step_parameter.default
_AFTER_OP = torch.ops.effpass.step_after.default
fx.node.has_side_effect(_STEP_OP)  # kept by dead-code elimination (partitioner, Inductor) without users


@dataclass(frozen=True)
class _HookedInputs(effpass.Note):
    """Positions (in the Dynamo graph's inputs) of the parameters this pass hooked."""

    positions: frozenset


from .graph import insert_steps  # noqa: E402  (the joint graph rewrite)


def _install_global_hook() -> None:
    global _GLOBAL_HOOK
    with _LOCK:
        if _GLOBAL_HOOK is None:
            from torch.optim.optimizer import register_optimizer_step_pre_hook
            _GLOBAL_HOOK = register_optimizer_step_pre_hook(_on_any_step)


def hooked_parameters(model: torch.nn.Module) -> int:
    """How many of ``model``'s parameters step in backward (hooked by the pass)."""
    return sum(1 for p in model.parameters() if p in _HOOKED)


@effpass.register_pass("step_in_backward",
                       run_after=("inject_lora", "quantize_linear", "checkpoint_activations", "tile_sequence",
                                  "fuse_cross_entropy"), conflicts_with=("wrap_fsdp",),
                       summary="optimizer step per parameter inside backward; gradients freed at once (lossless)")
@dataclass(frozen=True, kw_only=True)
class StepInBackward(effpass.Pass):
    """Each trainable parameter's optimizer update applied as soon as its gradient is complete, then the
    gradient freed: the gradients of all parameters never exist at once. Lossless (the optimizer's own
    arithmetic). Works with the optimizer the user builds after ``effpass.compile``."""

    requires_module_phase = True

    @classmethod
    def memory_options(cls, model=None, *, world_size=1, device=None):
        """For the memory planner: lossless; each gradient freed once its parameter is stepped (full
        fine-tuning: the gradients of all parameters never exist at once). For CUDA plans (and when the device is
        not known) also with AdamW on the host (``adamw_host``: ``effpass.HostOffloadAdamW``, each gradient handed
        to it inside the backward and copied to the host)."""
        restricts = "one backward per opt.step() (no gradient accumulation) and no clipping by the global norm"
        out = [effpass.MemoryOption(
            technique="step_in_backward", lossless=True, group="optimizer_step", changes="gradients",
            phase="module", optimizers=("adamw", "adamw8bit"), label="step in backward", restricts=restricts,
            cost="the optimizer steps each parameter inside backward; no extra compute")]
        if device is None or torch.device(device).type == "cuda":
            out.append(effpass.MemoryOption(
                technique="step_in_backward_host", lossless=True, group="optimizer_step",
                changes=("gradients", "optimizer_states"), phase="module", optimizer="adamw_host",
                replaces_optimizer="adamw", label="step in backward + adamw on host", order=1, restricts=restricts,
                cost="AdamW's states and step on the host (effpass.HostOffloadAdamW): each gradient copied to the "
                     "host inside the backward and freed, parameters copied back after the host step; build the "
                     "optimizer as effpass.HostOffloadAdamW(params)"))
        return out

    def prepare_module(self, model: torch.nn.Module, ctx) -> effpass.PassResult:
        _install_global_hook()
        stats = {"parameters": 0, "elements": 0, "gradient_bytes": 0}
        skipped = []
        with _LOCK:
            for name, p in model.named_parameters():
                if not p.requires_grad:
                    continue
                mod = name.rpartition(".")[0]  # targets/exclude are module-name globs
                if (self.targets and not glob_match_within(mod, self.targets)) or glob_match_within(mod, self.exclude):
                    skipped.append({"site": name, "reason": "outside targets"})
                    continue
                if p not in _HOOKED:
                    _HOOKED[p] = _ParamEntry(p.register_post_accumulate_grad_hook(_grad_hook))
                stats["parameters"] += 1
                stats["elements"] += p.numel()
                stats["gradient_bytes"] += p.numel() * p.element_size()
        return effpass.PassResult(changed=bool(stats["parameters"]), stats=stats, skipped=skipped)

    def transform_torch_ir(self, gm: fx.GraphModule, ctx) -> effpass.PassResult | None:
        # which of this graph's inputs are hooked parameters (the joint graph knows inputs by position only)
        ex = list(ctx.example_inputs or ())
        pos = frozenset(i for i, x in enumerate(ex)
                        if isinstance(x, torch.Tensor) and x.requires_grad and x in _HOOKED)
        frame = (ctx.notes.get("dynamo") or {}).get("frame_id")
        shared = 0
        for i in pos:
            e = _HOOKED[ex[i]]
            e.frames.add(frame)
            shared += len(e.frames) > 1
        if pos:
            ctx.leave(_HookedInputs(pos))
        skipped = [{"site": f"{shared} parameter(s)", "reason": "also inputs of another frame's compiled graph (a graph "
                    "break): their gradients are accumulated and opt.step() steps them as usual"}] if shared else []
        return effpass.PassResult(changed=False, stats={"graph_parameters": len(pos), "shared_parameters": shared},
                                  skipped=skipped)

    def transform_joint(self, gm: fx.GraphModule, ctx) -> effpass.PassResult | None:
        note = ctx.read(_HookedInputs)
        if ctx.graph_kind != "joint" or note is None:
            return None
        steps, skipped = insert_steps(gm, note.positions)
        return effpass.PassResult(changed=bool(steps), stats={"steps_in_graph": steps}, skipped=skipped)
