"""The pass interface (part of :mod:`effpass.pass_api`, which re-exports every public name and documents the
phases): :class:`Phase`, :class:`Note`, :class:`PassResult`, the :class:`Pass` base class and :class:`FunctionPass`
(a plain function as a pass).
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch

from .pass_options import _canonical, _coerce, check_option_names

__all__ = ["Phase", "PHASE_HOOKS", "Note", "PassResult", "Pass", "FunctionPass", "TILE_META"]

#: ``node.meta["custom"][TILE_META]``: the region id of a node a pass copied once per tile of the sequence (with
#: ``"tile": k`` inside tile ``k``, or ``"role"``: ``"split"``, ``"slice"``, ``"output"``); AOTAutograd copies it to the
#: forward node's backward nodes. The planner's extrapolation over the tile count reads it (planning/places.py).
TILE_META = "effpass_tile"


class Phase(str, enum.Enum):
    MODULE = "module"
    TORCH_IR = "torch_ir"
    JOINT = "joint"
    POST_GRAD = "post_grad"


PHASE_HOOKS: dict[Phase, str] = {
    Phase.MODULE: "prepare_module",
    Phase.TORCH_IR: "transform_torch_ir",
    Phase.JOINT: "transform_joint",
    Phase.POST_GRAD: "transform_post_grad",
}


class Note:
    """Base class of the typed facts one phase leaves for a later phase of the same Dynamo graph (a torch-IR
    pass for its joint or backward hook, say). Subclass it as a frozen dataclass; write with
    ``ctx.leave(note)`` and read with ``ctx.read(NoteClass)`` (None when no phase left one). The class is the
    key, so two passes never collide on a string and a reader names what it expects."""


@dataclass
class PassResult:
    """What a hook did: whether it changed the graph (or module) and named statistics."""

    changed: bool = False
    stats: dict[str, Any] = field(default_factory=dict)
    #: Sites the pass looked at and left alone, with the reason (shown in the dump).
    skipped: list[dict[str, Any]] = field(default_factory=list)
    #: When the hook changed nothing: why, in one sentence, and what to do if the user expected a change
    #: ("2 attention sites already call SDPA: nothing to fuse"); shown in summaries, dumps and reports.
    why_unchanged: str = ""
    #: statistics that keep changing after the hook ran (e.g. per-step counters a pass keeps on device):
    #: a callable returning a dict, called only when a report or dump is read (see PassRecord.current_stats)
    live_stats: Callable[[], dict[str, Any]] | None = None


@functools.lru_cache(maxsize=None)
def _file_digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@dataclass(frozen=True, kw_only=True)
class Pass:
    """Base class of every effpass pass. Subclass it as a frozen dataclass; fields are options.

    Class attributes a subclass sets:

    * ``name``: the snake_case verb phrase used everywhere (registry key, dumps, CLI, options).
    * ``run_after``: names of passes that must run before this one when both are in a pipeline.
    * ``conflicts_with``: names of passes this one cannot be combined with.
    * ``summary``: one line for ``effpass passes``.
    """

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    #: True for passes that only work when their module hook ran (the string backend rejects them)
    requires_module_phase: ClassVar[bool] = False
    #: True for passes with a module hook whose graph hooks still do the job without it (the string
    #: backend, which never sees the eager model, then runs them); False rejects them there
    module_phase_optional: ClassVar[bool] = False
    run_after: ClassVar[tuple[str, ...]] = ()
    conflicts_with: ClassVar[tuple[str, ...]] = ()

    targets: tuple[str, ...] = field(default=(), metadata={"doc": "module-name globs the pass acts on (empty: all)"})
    exclude: tuple[str, ...] = field(default=(), metadata={"doc": "module-name globs the pass leaves alone"})

    # ---- defaults and validation ------------------------------------------------------------------
    def __new__(cls, *args, **kwargs):
        # NOTE(options): runs before the dataclass __init__, so a misspelt option gets the same error as
        # parse_options (naming it, listing the valid ones, did-you-mean) instead of a bare TypeError.
        if args:
            raise TypeError(f"{cls.__name__} takes options by keyword only (got {len(args)} positional); "
                            f"valid options: {[f.name for f in dataclasses.fields(cls)]}")
        if kwargs and dataclasses.is_dataclass(cls):
            check_option_names(cls, kwargs)
        return super().__new__(cls)

    @classmethod
    def enabled_by_default(cls, device: torch.device | str | None = None) -> bool:
        """Whether the pass is in the default pipeline (``torch.compile(m, backend="effpass")``)."""
        return False

    @classmethod
    def default_note(cls) -> str:
        """One line for ``effpass passes`` saying when the pass is on by default."""
        return "off"

    @classmethod
    def memory_options(cls, model: torch.nn.Module | None = None, *, world_size: int = 1) -> tuple:
        """The memory options this pass offers the planner (``effpass.memory_options.MemoryOption``: its
        options, lossless or lossy, what they change, which phase needs them); ``model=None``: every option
        that could apply (for validating ``allow``). Default: none. See docs/memory_planner.md."""
        return ()

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            coerced = _coerce(type(self), f, value)
            if coerced is not value:
                object.__setattr__(self, f.name, coerced)
        self.validate()

    def validate(self) -> None:
        """Check option values beyond their types; raise ``ValueError`` naming the bad value."""

    def pin_length(self, seq: int, batch: int = 1) -> tuple["Pass", int]:
        """For the planner's extrapolation over the tile count (:mod:`effpass.planning.tiles`): ``(this pass with
        every choice it makes from the sequence length fixed to the one it makes at ``seq`` positions of ``batch``
        rows, the positions of one tile it unrolls into the graph per tile or 0)``. Replayed at ``seq - k * t`` the
        pinned pass gives the graph of ``seq`` with ``k`` tiles fewer. Default: ``(self, 0)`` (no choice depends
        on the length)."""
        return self, 0

    def facts(self) -> tuple:
        """The facts (:mod:`effpass.facts`: ``MixedPrecision(dtype=...)``, ``LossScaling()``, ...) this pass,
        with these options, establishes for the rest of its pipeline; other passes read them with
        ``ctx.fact(kind)``, never this pass's options by name. Default: none."""
        return ()

    # ---- hooks: override the ones the pass needs ---------------------------------------------------
    def prepare_module(self, model: torch.nn.Module, ctx) -> PassResult | None:  # pragma: no cover - default
        return None

    def verify_tolerance(self) -> float:
        """The relative error (``||compiled - eager|| / ||eager||`` per output, loss and gradient, fp32) within
        which this pass promises the compiled model matches the eager prepared one; ``effpass verify`` checks
        it. Lossless passes keep the default; a pass that changes arithmetic on purpose states its bound."""
        return 1e-5

    def transform_torch_ir(self, gm: torch.fx.GraphModule, ctx) -> PassResult | None:  # pragma: no cover
        return None

    def transform_joint(self, gm: torch.fx.GraphModule, ctx) -> PassResult | None:  # pragma: no cover
        return None

    def transform_post_grad(self, gm: torch.fx.GraphModule, ctx) -> PassResult | None:  # pragma: no cover
        return None

    def compile_config(self, ctx) -> dict[str, Any]:
        """Config patches applied around lowering, as ``{"inductor.<key>": v, "functorch.<key>": v}``."""
        return {}

    def lowering_context(self, ctx):
        """A context manager entered around lowering (AOTAutograd's trace, partition and compiles), or None.
        ``ctx`` is the dict ``compile_config`` receives (``device``, ``lowering``, ``model``). Used for state
        torch reads at compile time only, e.g. saved-tensor hooks that AOTAutograd inlines into the graphs."""
        return None

    # ---- introspection -----------------------------------------------------------------------------
    @classmethod
    def phases(cls) -> tuple[Phase, ...]:
        return tuple(p for p, hook in PHASE_HOOKS.items() if getattr(cls, hook) is not getattr(Pass, hook))

    def options(self) -> dict[str, Any]:
        """The options as a JSON-able dict (the inverse of ``make_pass(name, options)``)."""
        return {f.name: _canonical(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def uuid(self) -> str:
        """Changes with the pass's source file and its options (used for Inductor's caches)."""
        h = hashlib.sha256()
        h.update(self.name.encode())
        for klass in type(self).__mro__:
            if klass is object or klass.__module__ == "builtins":
                continue
            try:
                h.update(_file_digest(inspect.getfile(klass)).encode())
            except (TypeError, OSError):
                h.update(klass.__qualname__.encode())
        h.update(repr(sorted(self.options().items())).encode())
        return h.hexdigest()

    @classmethod
    def option_docs(cls) -> dict[str, str]:
        return {f.name: f.metadata.get("doc", "") for f in dataclasses.fields(cls)}

    def __repr__(self) -> str:
        non_default = []
        for f in dataclasses.fields(self):
            default = f.default if f.default is not dataclasses.MISSING else (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING)
            value = getattr(self, f.name)
            if default is dataclasses.MISSING or value != default:
                non_default.append(f"{f.name}={value!r}")
        return f"{type(self).__name__}({', '.join(non_default)})"


# ------------------------------------------------------------------------------------------------------
# function passes: a plain function becomes a graph-only pass
# ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class FunctionPass(Pass):
    """A pass made from a plain function ``fn(gm, ctx) -> PassResult | bool | None`` for one phase."""

    _fn: ClassVar[Callable]
    _phase: ClassVar[Phase]

    def _call(self, gm, ctx):
        out = type(self)._fn(gm, ctx)
        if isinstance(out, bool):
            return PassResult(changed=out)
        return out

    def uuid(self) -> str:
        h = hashlib.sha256(super().uuid().encode())
        fn = type(self)._fn
        try:
            h.update(inspect.getsource(fn).encode())
        except (OSError, TypeError):
            h.update(fn.__qualname__.encode())
        return h.hexdigest()
