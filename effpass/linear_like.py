"""The linear-like module contract: how a wrapped linear (a LoRA adapter, a quantized linear) says what it
computes, so that a pass can rewrite the computation without knowing the wrapper's class or the graph its
``forward`` traces to.

A module class registers a function that describes an instance::

    from effpass.linear_like import LinearParts, Adapter, register_linear_like

    register_linear_like(MyLoRALinear, lambda m: LinearParts(
        weight=m.base.weight, bias=m.base.bias,
        adapters=(Adapter(a=m.lora_A.weight, b=m.lora_B.weight, scale=m.scaling, dropout=m.dropout),)))

The description promises ``module(x) == F.linear(x, weight, bias) + sum(scale * F.linear(F.linear(dropout(x),
a), b))`` (adapters computed in their own dtype and cast to the base output's, as PEFT). ``weight`` may be a
quantized tensor (see :mod:`effpass.quantized`). A module whose adapters are merged into ``weight``
describes itself without adapters. Plain ``nn.Linear`` is described without registration.

Passes use :func:`linear_parts` (None for modules that are not linear-like) and, to find the graph nodes a
module's tensors became, :func:`effpass.graph.source_path` on the placeholders.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn

__all__ = ["Adapter", "LinearParts", "register_linear_like", "linear_parts", "linear_like_classes"]


@dataclass(frozen=True)
class Adapter:
    """A low-rank update ``scale * F.linear(F.linear(dropout(x), a), b)``: ``a`` is ``[rank, in]``, ``b``
    ``[out, rank]``; ``dropout`` is the module applied to ``x`` first (None: identity)."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float = 1.0
    dropout: Optional[nn.Module] = None


@dataclass(frozen=True)
class LinearParts:
    """What a linear-like module computes: ``F.linear(x, weight, bias)`` plus its adapters' updates."""

    weight: torch.Tensor
    bias: Optional[torch.Tensor] = None
    adapters: tuple[Adapter, ...] = ()


_CLASSES: dict[type, Callable[[nn.Module], Optional[LinearParts]]] = {}


def register_linear_like(cls: type, describe: Callable[[nn.Module], Optional[LinearParts]]) -> type:
    """Declare ``cls`` linear-like: ``describe(module)`` returns its :class:`LinearParts` (or None when
    this instance is not a linear now). Registering a class again replaces its function."""
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f"register_linear_like: {cls!r} is not an nn.Module subclass")
    if not callable(describe):
        raise TypeError(f"register_linear_like: describe must be callable, got {describe!r}")
    _CLASSES[cls] = describe
    return cls


def linear_like_classes() -> tuple[type, ...]:
    """The registered classes (for reports and tests)."""
    return tuple(_CLASSES)


def linear_parts(module: nn.Module) -> Optional[LinearParts]:
    """The parts of a registered linear-like module or an ``nn.Linear``; None for anything else."""
    for klass in type(module).__mro__:
        fn = _CLASSES.get(klass)
        if fn is not None:
            return fn(module)
    if isinstance(module, nn.Linear):
        return LinearParts(weight=module.weight, bias=module.bias)
    return None
