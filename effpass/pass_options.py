"""Pass options (part of :mod:`effpass.pass_api`, which re-exports the public names): the errors for a bad option
name or value, the check of option names with a did-you-mean, the coercion of JSON-able values to the declared
field types, and the canonical JSON-able form of a value (for uuids, dumps and ``to_options``).
"""
from __future__ import annotations

import dataclasses
import enum
import types
import typing
from typing import Any, Iterable, Mapping

import torch

__all__ = ["PassOptionError", "UnknownPassOptionError", "check_option_names"]


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
