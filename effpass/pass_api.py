"""The pass interface, the pass registry and option validation.

A pass is a frozen dataclass whose fields are its options. It has a snake_case verb-phrase ``name`` and
one optional hook per phase it acts in:

========================  =====================================================================
phase                     hook and what it receives
========================  =====================================================================
``module``                ``prepare_module(model, ctx)``: the eager ``nn.Module`` before compile
                          (state that must exist before the optimizer: LoRA weights, quantized
                          weights, FSDP sharding). Reached through ``effpass.compile``/``prepare``.
``torch_ir``              ``transform_torch_ir(gm, ctx)``: the torch-IR graph Dynamo hands over.
``joint``                 ``transform_joint(gm, ctx)``: the joint forward+backward aten graph, before
                          the partitioner (also inference graphs, which have no tangents).
``post_grad``             ``transform_post_grad(gm, ctx)``: the partitioned forward and backward
                          graphs (``ctx.graph_kind`` says which).
========================  =====================================================================

Every hook returns a :class:`PassResult` (or ``None`` for "unchanged"). Passes never print, time or dump
themselves: the :class:`~effpass.manager.PassManager` does that around every hook.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import inspect
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Iterable, Mapping

import torch

__all__ = [
    "Phase", "PassResult", "Pass", "FunctionPass", "register_pass", "get_pass_class", "registered_passes",
    "reserved_pass_names", "make_pass", "PassOptionError", "register_extension", "register_command",
    "registered_commands", "Command", "register_cacheable_function", "cacheable_functions",
    "UnknownPassOptionError", "check_option_names", "Note",
]

#: The package whose modules hold the built-in passes (their names are reserved).
BUILTIN_PACKAGE = "effpass.passes"


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

_NAME_RE = re.compile(r"^[a-z][a-z0-9]*(_[a-z0-9]+)*$")


class Note:
    """Base class of the typed facts one phase leaves for a later phase of the same Dynamo graph (a torch-IR
    pass for its joint or backward hook, say). Subclass it as a frozen dataclass; write with
    ``ctx.leave(note)`` and read with ``ctx.read(NoteClass)`` (None when no phase left one). The class is the
    key, so two passes never collide on a string and a reader names what it expects."""


class PassOptionError(ValueError):
    """A pass option has a bad name or value."""


class UnknownPassOptionError(PassOptionError, TypeError):
    """An option name a pass does not have (a ``ValueError``, and a ``TypeError`` as Python raises for an
    unexpected keyword argument, so either ``except`` catches it)."""


def check_option_names(klass: type, names: Iterable[str], pass_name: str | None = None) -> None:
    """Raise :class:`UnknownPassOptionError` for the first name that is not an option of ``klass``,
    listing the valid ones with a did-you-mean. Used by ``make_pass`` and by every pass constructor."""
    import difflib

    valid = [f.name for f in dataclasses.fields(klass)] if dataclasses.is_dataclass(klass) else []
    for key in names:
        if key not in valid:
            close = difflib.get_close_matches(str(key), valid, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise UnknownPassOptionError(f"unknown option {key!r} for pass {pass_name or klass.name or klass.__name__!r}"
                                         f"{hint}; valid options: {valid}")


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


def _canonical(value: Any) -> Any:
    """A JSON-able, deterministic form of an option value (for uuids, dumps and ``to_options``)."""
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _canonical(v) for k, v in sorted(value.items())}
    if isinstance(value, enum.Enum):
        return value.value
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


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
# option coercion: JSON-able values become the declared types; wrong types raise TypeError
# ------------------------------------------------------------------------------------------------------
_DTYPE_NAMES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def _type_hints(cls) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # pragma: no cover - unresolved forward refs: fall back to no checking
        return {}


def _coerce(cls, f: dataclasses.Field, value: Any) -> Any:
    hint = _type_hints(cls).get(f.name)
    if hint is None:
        return value
    where = f"{cls.name or cls.__name__}.{f.name}"
    return _coerce_to(hint, value, where)


def _coerce_to(hint: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        errors = []
        for arm in args:
            if arm is type(None):
                if value is None:
                    return None
                continue
            try:
                return _coerce_to(arm, value, where)
            except (TypeError, ValueError) as e:
                errors.append(str(e))
        raise TypeError(f"{where}: {value!r} is not one of {_hint_name(hint)}")
    if origin is typing.Literal:
        if value not in args:
            raise PassOptionError(f"{where}: {value!r} is not valid; choose one of {list(args)}")
        return value
    if origin is tuple:
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            if isinstance(value, str) and args and args[-1] is Ellipsis and args[0] is str:
                return (value,)  # a single glob is accepted where a list of globs is expected
            raise TypeError(f"{where}: expected a list, got {type(value).__name__} {value!r}")
        inner = args[0] if args else Any
        return tuple(_coerce_to(inner, v, where) for v in value)
    if origin is dict or hint is dict:
        if not isinstance(value, Mapping):
            raise TypeError(f"{where}: expected a dict, got {type(value).__name__} {value!r}")
        return dict(value)
    if hint is torch.dtype:
        if isinstance(value, torch.dtype):
            return value
        if isinstance(value, str) and value.removeprefix("torch.") in _DTYPE_NAMES:
            return _DTYPE_NAMES[value.removeprefix("torch.")]
        raise TypeError(f"{where}: {value!r} is not a dtype; use one of {sorted(_DTYPE_NAMES)}")
    if hint is bool:
        if not isinstance(value, bool):
            raise TypeError(f"{where}: expected a bool, got {type(value).__name__} {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{where}: expected an int, got {type(value).__name__} {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{where}: expected a number, got {type(value).__name__} {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise TypeError(f"{where}: expected a string, got {type(value).__name__} {value!r}")
        return value
    if isinstance(hint, type) and not isinstance(value, hint):
        raise TypeError(f"{where}: expected {hint.__name__}, got {type(value).__name__} {value!r}")
    return value


def _hint_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


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


# ------------------------------------------------------------------------------------------------------
# the registry
# ------------------------------------------------------------------------------------------------------
_REGISTRY: dict[str, type[Pass]] = {}
_PLUGINS_LOADED = False


def register_pass(name: str, *, run_after: Iterable[str] = (), conflicts_with: Iterable[str] = (),
                  phase: str | Phase = Phase.TORCH_IR, summary: str = "", replace: bool = False):
    """Register a pass class (or a plain graph function) under ``name``.

    >>> @effpass.register_pass("fold_scale", run_after=("fuse_attention",))
    ... class FoldScale(effpass.Pass):
    ...     def transform_torch_ir(self, gm, ctx): ...

    A plain function ``fn(gm, ctx)`` becomes a pass acting in ``phase`` (default ``"torch_ir"``).
    """
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(f"pass name {name!r} must be snake_case (a verb phrase such as 'fold_scale')")
    run_after, conflicts_with = tuple(run_after), tuple(conflicts_with)
    try:
        phase = Phase(phase)
    except ValueError:
        raise ValueError(f"phase {phase!r} is not valid; choose one of {[p.value for p in Phase]}") from None

    def wrap(obj):
        if not _is_builtin(obj):
            # NOTE(reserved names): a built-in pass's name is reserved, whichever is registered first.
            _load_builtins()
            if name in reserved_pass_names():
                raise ValueError(f"pass name {name!r} is reserved for a built-in pass; reserved: "
                                 f"{sorted(reserved_pass_names())}")
        if name in _REGISTRY and not replace and _REGISTRY[name].__qualname__ != getattr(obj, "__qualname__", None):
            raise ValueError(f"a pass named {name!r} is already registered ({_REGISTRY[name].__qualname__}); "
                             "pass replace=True to override it")
        if isinstance(obj, type):
            if not issubclass(obj, Pass):
                # A plain class with hook methods: make it a Pass subclass.
                obj = dataclass(frozen=True, kw_only=True)(type(obj.__name__, (obj, Pass), {"__module__": obj.__module__,
                                                                                           "__doc__": obj.__doc__}))
            elif "__dataclass_fields__" not in obj.__dict__:
                obj = dataclass(frozen=True, kw_only=True)(obj)
            obj.name = name
            obj.run_after = tuple(run_after) or obj.run_after
            obj.conflicts_with = tuple(conflicts_with) or obj.conflicts_with
            if summary:
                obj.summary = summary
            if not obj.summary:
                obj.summary = (inspect.getdoc(obj) or "").split("\n")[0]
            klass = obj
        elif callable(obj):
            fn = obj
            ns = {"_fn": staticmethod(fn), "_phase": phase, "__module__": fn.__module__, "__doc__": fn.__doc__,
                  "name": name, "run_after": run_after, "conflicts_with": conflicts_with,
                  "summary": summary or (inspect.getdoc(fn) or "").split("\n")[0],
                  PHASE_HOOKS[phase]: FunctionPass._call}
            klass = dataclass(frozen=True, kw_only=True)(type(_camel(name), (FunctionPass,), ns))
        else:
            raise TypeError(f"register_pass expects a class or a function, got {type(obj).__name__}")
        _REGISTRY[name] = klass
        return klass if isinstance(obj, type) else klass

    return wrap


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.split("_"))


def _is_builtin(obj: Any) -> bool:
    mod = getattr(obj, "__module__", "") or ""
    return mod == BUILTIN_PACKAGE or mod.startswith(BUILTIN_PACKAGE + ".")


def reserved_pass_names() -> frozenset[str]:
    """Names registered by the built-in passes: a plugin or user pass may not take them."""
    _load_builtins()
    return frozenset(n for n, k in _REGISTRY.items() if _is_builtin(k))


def _load_builtins() -> None:
    import importlib

    importlib.import_module(BUILTIN_PACKAGE)


def _load_plugins() -> None:
    """Import the modules named by the ``effpass.passes`` entry points (the built-ins are one of them)."""
    global _PLUGINS_LOADED
    if _PLUGINS_LOADED:
        return
    _PLUGINS_LOADED = True
    import importlib
    import importlib.metadata as md

    names = {BUILTIN_PACKAGE}
    try:
        for ep in md.entry_points(group="effpass.passes"):
            names.add(ep.value.split(":")[0])
    except Exception:  # pragma: no cover - broken metadata must not break effpass
        pass
    for mod in sorted(names):
        importlib.import_module(mod)


_EXTENSIONS: dict[str, Any] = {}


def register_extension(name: str, obj: Any = None):
    """Expose ``obj`` as ``effpass.<name>`` (a pass's user-facing helper such as ``effpass.loss_scaler``).

    The core never imports a concrete pass: ``effpass.<name>`` loads the pass plugins on first access
    and returns what they registered here. Usable as a decorator.
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"extension name {name!r} must be a Python identifier")

    def put(o):
        if name in _EXTENSIONS and _EXTENSIONS[name] is not o:
            raise ValueError(f"an effpass extension named {name!r} is already registered")
        _EXTENSIONS[name] = o
        return o

    return put if obj is None else put(obj)


def get_extension(name: str) -> Any:
    _load_plugins()
    if name not in _EXTENSIONS:
        raise AttributeError(f"module 'effpass' has no attribute {name!r}")
    return _EXTENSIONS[name]


# ------------------------------------------------------------------------------------------------------
# what passes contribute to the core besides hooks: CLI commands and cacheable functions
# ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Command:
    """A subcommand of the ``effpass`` command line, contributed by a pass or plugin."""

    name: str
    help: str
    add_arguments: Callable[[Any], None]  # argparse.ArgumentParser -> None
    run: Callable[[Any], int]  # argparse.Namespace -> exit code


_COMMANDS: dict[str, Command] = {}
_CORE_COMMANDS = ("passes", "inspect", "demo")


def register_command(name: str, *, help: str, add_arguments: Callable[[Any], None],
                     run: Callable[[Any], int]) -> Command:
    """Add ``effpass NAME`` to the command line (wrap_fsdp registers ``effpass estimate`` this way)."""
    if not isinstance(name, str) or not re.match(r"^[a-z][a-z0-9-]*$", name):
        raise ValueError(f"command name {name!r} must be lower-case letters, digits and dashes")
    if name in _CORE_COMMANDS:
        raise ValueError(f"command name {name!r} is taken by effpass itself; taken: {list(_CORE_COMMANDS)}")
    if name in _COMMANDS and _COMMANDS[name].run is not run:
        raise ValueError(f"an effpass command named {name!r} is already registered")
    _COMMANDS[name] = cmd = Command(name, help, add_arguments, run)
    return cmd


def registered_commands() -> dict[str, Command]:
    _load_plugins()
    return dict(_COMMANDS)


_CACHEABLE: dict[str, str] = {}


def register_cacheable_function(qualified_name: str, version: str | None = None) -> None:
    """Declare a Python function that graphs may call as safe for Inductor's caches (its behaviour is
    fixed by its arguments), e.g. ``torch.amp.autocast_mode._enter_autocast``. Without this, every graph
    holding a call to it bypasses the FX-graph and AOTAutograd caches."""
    if not isinstance(qualified_name, str) or "." not in qualified_name:
        raise ValueError(f"expected a dotted function name, got {qualified_name!r}")
    _CACHEABLE[qualified_name] = version or torch.__version__


def cacheable_functions() -> dict[str, str]:
    """``{qualified name: version}`` of the functions passes declared cacheable."""
    _load_plugins()
    return dict(_CACHEABLE)


def registered_passes() -> dict[str, type[Pass]]:
    """All registered pass classes by name (built-ins and plugins are loaded on first use)."""
    _load_plugins()
    return dict(_REGISTRY)


def get_pass_class(name: str) -> type[Pass]:
    passes = registered_passes()
    if name not in passes:
        import difflib

        close = difflib.get_close_matches(name, passes, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown pass {name!r}{hint}; registered passes: {sorted(passes)}")
    return passes[name]


def make_pass(name: str, options: Mapping[str, Any] | None = None) -> Pass:
    """Build a pass from its name and a JSON-able options dict, validating both."""
    klass = get_pass_class(name)
    options = dict(options or {})
    if not isinstance(options, dict):
        raise TypeError(f"options of pass {name!r} must be a dict, got {type(options).__name__}")
    check_option_names(klass, options, name)
    return klass(**options)
