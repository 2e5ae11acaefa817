"""The registries (part of :mod:`effpass.pass_api`, which re-exports the public names): passes (built-ins and
plugins, loaded on first use), extensions (``effpass.<name>``), CLI commands and cacheable functions.
"""
from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

import torch

from .pass_base import PHASE_HOOKS, FunctionPass, Pass, Phase
from .pass_options import check_option_names

__all__ = ["register_pass", "get_pass_class", "registered_passes", "reserved_pass_names", "make_pass",
           "register_extension", "get_extension", "register_command", "registered_commands", "Command",
           "register_cacheable_function", "cacheable_functions", "BUILTIN_PACKAGE"]

BUILTIN_PACKAGE = "effpass.passes"

_NAME_RE = re.compile(r"^[a-z][a-z0-9]*(_[a-z0-9]+)*$")


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
