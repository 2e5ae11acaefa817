"""What the memory planner may choose from: memory options declared by passes (and optimizers), the optimizer
registry, and FLOP formulas of custom ops (core; the planner knows techniques only through this module).

A pass declares the memory options it offers with a classmethod; the planner (``effpass.planning``) searches
what the registry offers and never names a pass::

    @effpass.register_pass("tile_sequence")
    @dataclass(frozen=True, kw_only=True)
    class TileSequence(effpass.Pass):
        @classmethod
        def memory_options(cls, model, *, world_size=1):
            return [effpass.MemoryOption(
                technique="tile_sequence", options={"tiles": 4}, lossless=True, group="sequence_tiling",
                changes="activations", cost="recomputes nothing; smaller kernels", label="tiled(4)")]

Each :class:`MemoryOption` says: what ``allow=[...]`` calls it (``technique``), the pass options it stands
for, whether its gradients are those of the plain step (``lossless``), what it changes, which phase needs it
(``Phase.MODULE``: it changes the eager model before the optimizer exists, so planning it needs
``example_inputs``), the passes it needs in the pipeline (``requires``) and its ``group`` (one option per
group per plan; options of different groups combine). The planner replays every combination it tries
(extra compute and peak are measured, not declared); ``cost`` is a line for people.

Options that are not passes (an optimizer with smaller states) are declared with
:func:`register_memory_option` and their optimizer with :func:`register_optimizer` (a factory the replay
calls on fake parameters: the states are sized by building the real optimizer, never by a copied rule).
Options whose effect is per-rank accounting rather than a different program (``sharding="zero3"``) are
folded onto the one-rank replay (:func:`effpass.planning.sharding.fold_sharding`).

FLOPs of custom ops: the replay counts matmul/attention FLOPs with torch's flop counter and one per element
written by any other op; an opaque custom op registers its formula with :func:`register_flop_formula`
(torch's ``register_flop_formula``, so torch's own ``FlopCounterMode`` sees it too).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

__all__ = ["MemoryOption", "register_memory_option", "declared_memory_options", "register_optimizer",
           "register_device_kernel", "is_device_kernel",
           "build_optimizer", "registered_optimizers", "replayed_optimizer", "register_flop_formula", "CHANGES"]

#: what an option may change (for reports and the planner's checks)
CHANGES = ("activations", "parameters", "gradients", "optimizer_states", "sharding", "logits", "compute")


@dataclass(frozen=True)
class MemoryOption:
    """One way to trade compute or precision for memory, as a pass (or optimizer) declares it."""

    technique: str                       #: the name ``allow=[...]`` uses (lossy ones must be allowed)
    lossless: bool                       #: True: the gradients are those of the plain step
    group: str                           #: one option per group in a plan (e.g. "checkpoint", "base_weights")
    changes: str | tuple = "activations"  #: what it shrinks, among CHANGES. ``"gradients"`` alone is a promise
    #: the planner relies on: with the option, the forward and backward allocate what they did without it (more
    #: is allowed) except gradients, which live shorter, and the optimizer is the same; so the plan's peak is at
    #: least the other plan's non-gradient peak (``plan_max_seq`` then skips its replay where that is over)
    pass_name: str | None = None         #: the pass it adds (None: an optimizer or a fold); set by the registry
    options: Mapping[str, Any] = field(default_factory=dict)  #: the pass's options
    phase: str = "graph"                 #: "module": must change the eager model before the optimizer exists
    requires: tuple = ()                 #: pass names that must be in the pipeline (e.g. ("inject_lora",))
    optimizer: str | None = None         #: an optimizer name (register_optimizer) this option builds instead
    replaces_optimizer: str | None = None  #: ... which it replaces (e.g. "adamw"); else it applies to any
    sharding: str | None = None          #: "zero3": per-rank accounting folded on the replay (not replayed)
    cost: str = ""                       #: a line for people (extra compute and peak are measured)
    label: str = ""                      #: how plans name it (default: technique)
    order: int = 0                       #: preference among the options of a group (lower first)
    optimizers: tuple = ()               #: the optimizers (register_optimizer names) it works with; () any
    min_rows: int = 0                    #: it changes nothing on a batch of fewer tokens (not tried there)
    max_rows: int = 0                    #: tried only on a batch of at most this many tokens (0: any); an
    #: option meant for short batches (e.g. small tiles, whose replay grows with the length): not tried where
    #: the batch is unknown or the length searched (plan_max_seq)
    restricts: str = ""                  #: what the training loop must not do with it (e.g. "no clipping by the
    #: global norm"); the planner prefers plans without such options and states the restriction in the plan

    def __post_init__(self):
        changes = (self.changes,) if isinstance(self.changes, str) else tuple(self.changes)
        bad = [c for c in changes if c not in CHANGES]
        if bad:
            raise ValueError(f"MemoryOption {self.technique!r}: changes {bad[0]!r} is not one of {list(CHANGES)}")
        if self.phase not in ("module", "graph"):
            raise ValueError(f"MemoryOption {self.technique!r}: phase {self.phase!r} is not 'module' or 'graph'")
        object.__setattr__(self, "changes", changes)
        object.__setattr__(self, "requires", tuple(self.requires))
        object.__setattr__(self, "optimizers", tuple(self.optimizers))
        object.__setattr__(self, "options", dict(self.options))

    @property
    def name(self) -> str:
        return self.label or self.technique


#: options declared outside a pass class: callables (model, world_size) -> options
_EXTRA: list[Callable[..., Sequence[MemoryOption]]] = []


def register_memory_option(fn_or_option: MemoryOption | Callable[..., Sequence[MemoryOption]]):
    """Declare options that no pass class offers (e.g. an 8-bit optimizer): a :class:`MemoryOption`, or a
    callable ``(model, *, world_size) -> [MemoryOption, ...]`` (model may be None: list what could apply).
    Returns its argument (usable as a decorator)."""
    if isinstance(fn_or_option, MemoryOption):
        opt = fn_or_option
        _EXTRA.append(lambda model, world_size=1: [opt])
    elif callable(fn_or_option):
        _EXTRA.append(fn_or_option)
    else:
        raise TypeError(f"register_memory_option expects a MemoryOption or a callable, got {fn_or_option!r}")
    return fn_or_option


def _accepts_device(fn) -> bool:
    import inspect

    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # pragma: no cover
        return False
    return "device" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def declared_memory_options(model: torch.nn.Module | None = None, *, world_size: int = 1,
                            device=None) -> list[MemoryOption]:
    """Every option the registered passes (``Pass.memory_options``) and :func:`register_memory_option`
    declare for ``model`` (``None``: every technique that could apply, for validation of ``allow``).
    ``device``: the device the plan is for (a declaration that takes a ``device`` keyword gets it, e.g. to
    offer a CUDA-only technique only for CUDA; ``None``: unknown, list what could apply)."""
    from effpass.pass_api import registered_passes

    out: list[MemoryOption] = []
    for name, klass in sorted(registered_passes().items()):
        kw = {"device": device} if device is not None and _accepts_device(klass.memory_options) else {}
        for opt in klass.memory_options(model, world_size=world_size, **kw) or ():
            if not isinstance(opt, MemoryOption):
                raise TypeError(f"pass {name!r}: memory_options returned {opt!r}, not a MemoryOption")
            out.append(dataclasses.replace(opt, pass_name=name))
    for fn in _EXTRA:
        kw = {"device": device} if device is not None and _accepts_device(fn) else {}
        out.extend(fn(model, world_size=world_size, **kw) or ())
    return out


# ------------------------------------------------------------------------------------------------------
# optimizers: built on fake parameters by the replay (their states are sized by the real optimizer)
# ------------------------------------------------------------------------------------------------------
_OPTIMIZERS: dict[str, tuple[Callable, str]] = {}
#: optimizers the replay builds and runs in the replayed step itself (not derived from the AdamW replay)
_REPLAYED: set[str] = {"adamw"}


def register_optimizer(name: str, factory: Callable[..., torch.optim.Optimizer], doc: str = "", *,
                       replayed: bool = False) -> None:
    """``factory(params, lr=..., device=...)`` builds the optimizer ``name`` (e.g. ``"adamw8bit"``).

    ``replayed``: the planner's replay builds it on the fake parameters and runs it inside the replayed training
    step (its states, its step and any work it does inside the backward, e.g. taking gradients from
    ``step_in_backward``, are seen as they happen). Otherwise a plan with it reuses the AdamW replay's forward and
    backward and builds the optimizer alone on fake parameters (``effpass.planning.with_optimizer``)."""
    if not callable(factory):
        raise TypeError(f"register_optimizer({name!r}): factory must be callable")
    _OPTIMIZERS[name] = (factory, doc)
    if replayed:
        _REPLAYED.add(name)
    elif name != "adamw":
        _REPLAYED.discard(name)


def replayed_optimizer(name: str | None) -> bool:
    """Whether the replay runs the optimizer ``name`` in the replayed step itself (``None``: no optimizer, yes)."""
    return name is None or name in _REPLAYED


def registered_optimizers() -> dict[str, str]:
    """name -> one line, of every registered optimizer (plus ``None``: no optimizer)."""
    return {n: d for n, (_, d) in _OPTIMIZERS.items()}


def build_optimizer(name: str, params: Iterable[torch.Tensor], *, lr: float = 1e-3,
                    device: torch.device | None = None) -> torch.optim.Optimizer:
    if name not in _OPTIMIZERS:
        raise ValueError(f"optimizer {name!r} is not valid; choose one of {sorted(_OPTIMIZERS) + [None]}")
    return _OPTIMIZERS[name][0](list(params), lr=lr, device=device)


register_optimizer("adamw", lambda params, lr=1e-3, device=None: torch.optim.AdamW(
    params, lr=lr, foreach=(device is not None and torch.device(device).type == "cuda")),
    "torch.optim.AdamW (fp32 exp_avg, exp_avg_sq, step per parameter)")


# ------------------------------------------------------------------------------------------------------
# FLOP formulas of custom ops
# ------------------------------------------------------------------------------------------------------
def register_flop_formula(op, formula: Callable[..., int]) -> None:
    """Register ``formula(*args, out_val=..., **kwargs) -> int`` as the FLOPs of the custom op ``op``
    (an ``OpOverloadPacket`` such as ``torch.ops.effpass.linear_cross_entropy``) with torch's flop counter
    (``torch.utils.flop_counter.register_flop_formula``): the planner's replay and ``FlopCounterMode`` both
    use it. Without one an opaque op counts one FLOP per element it writes."""
    from torch.utils.flop_counter import flop_registry, register_flop_formula as torch_register

    packet = getattr(op, "_overloadpacket", op)
    if packet in flop_registry:
        return
    torch_register(packet, get_raw=True)(formula)


#: custom ops that are one device kernel each (schema names): the cost model records them whole
_DEVICE_KERNELS: set[str] = set()


def register_device_kernel(op) -> None:
    """Declare the custom op ``op`` one device kernel (a Triton launch): ``effpass.cost`` then records it as one
    kernel reading its operands and writing its outputs and mutated arguments once, with the FLOPs of its
    :func:`register_flop_formula`, instead of expanding its Python implementation op by op (which on a CPU is a
    reference computation, not what the device runs)."""
    packet = getattr(op, "_overloadpacket", op)
    _DEVICE_KERNELS.add(str(packet._qualified_op_name))


def is_device_kernel(schema_name: str) -> bool:
    """Whether the op named ``schema_name`` (``"effpass::lce_lse"``) was declared by :func:`register_device_kernel`."""
    return schema_name in _DEVICE_KERNELS
