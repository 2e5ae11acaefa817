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
module's tensors became, :func:`effpass.graph.source_path` on the placeholders. :func:`direct_weight_read` says
where model code reads a linear's weight outside its forward (Mamba's ``self.dt_proj.weight @ x``): a pass that
changes the weight's type (``quantize_linear``) or adds to what the linear computes (``inject_lora``) leaves such a
linear alone, with that as the reason.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn

__all__ = ["Adapter", "LinearParts", "register_linear_like", "linear_parts", "linear_like_classes", "direct_weight_read"]


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


#: attributes of a weight that read its metadata only (a quantized weight keeps the original's)
_METADATA = frozenset({"dtype", "device", "shape", "size", "ndim", "dim", "is_cuda", "is_meta", "requires_grad",
                       "numel"})
#: calls that read no values of their argument
_TYPE_CHECKS = frozenset({"isinstance", "hasattr", "getattr", "type"})
#: methods that do not run in a step (besides every method with "init" in its name: construction, initialisation)
_NOT_IN_A_STEP = frozenset({"reset_parameters", "_reset_parameters", "extra_repr"})
_UNKNOWN = object()
#: a method -> (its parsed source, its first line): the class's code, the same for every instance
_PARSED: dict = {}


def _value(node, module):
    """The value of a branch condition built from constants and ``self``'s attributes (``self.pretraining_tp > 1
    and self.slow_but_exact``), else ``_UNKNOWN`` (locals, calls: decided only when the step runs)."""
    import ast
    import operator

    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return getattr(module, node.attr, _UNKNOWN)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        v = _value(node.operand, module)
        return _UNKNOWN if v is _UNKNOWN else not v
    if isinstance(node, ast.BoolOp):
        vals = [_value(v, module) for v in node.values]
        decided = [bool(v) for v in vals if v is not _UNKNOWN]
        if isinstance(node.op, ast.And):
            return False if False in decided else (True if len(decided) == len(vals) else _UNKNOWN)
        return True if True in decided else (False if len(decided) == len(vals) else _UNKNOWN)
    if isinstance(node, ast.Compare) and len(node.ops) == 1:
        ops = {ast.Gt: operator.gt, ast.Lt: operator.lt, ast.GtE: operator.ge, ast.LtE: operator.le,
               ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Is: operator.is_, ast.IsNot: operator.is_not}
        a, b = _value(node.left, module), _value(node.comparators[0], module)
        op = ops.get(type(node.ops[0]))
        if op is None or a is _UNKNOWN or b is _UNKNOWN:
            return _UNKNOWN
        try:
            return op(a, b)
        except TypeError:
            return _UNKNOWN
    return _UNKNOWN


def _direct_read(fn, module, child: str) -> int | None:
    """The first line of ``fn`` (a method of ``module``'s class) that reads ``self.<child>.weight`` for its values
    (not its metadata, not a type check) in a branch that can run for ``module`` (branches whose condition
    ``_value`` decides false are skipped); None when there is none."""
    import ast
    import inspect
    import textwrap

    parsed = _PARSED.get(fn)
    if parsed is None:  # NOTE(cost): parsed once per method, not once per linear of a 32-layer model
        try:
            src, first = inspect.getsourcelines(fn)
            parsed = (ast.parse(textwrap.dedent("".join(src))), first)
        except (OSError, TypeError, SyntaxError):
            parsed = (None, 0)
        _PARSED[fn] = parsed
    tree, first = parsed
    if tree is None:
        return None

    def is_read(node, parent) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "weight" and isinstance(node.value, ast.Attribute)
                and node.value.attr == child and isinstance(node.value.value, ast.Name) and node.value.value.id == "self"
                and not (isinstance(parent, ast.Attribute) and parent.attr in _METADATA)
                and not (isinstance(parent, ast.Call) and isinstance(parent.func, ast.Name)
                         and parent.func.id in _TYPE_CHECKS))

    def walk(node, parent):
        if isinstance(node, (ast.If, ast.IfExp)):
            v = _value(node.test, module)
            branches = [node.body] if v is True else [node.orelse] if v is False else [node.body, node.orelse]
            found = walk(node.test, node)
            for b in branches:
                for child_node in (b if isinstance(b, list) else [b]):
                    found = found or walk(child_node, node)
            return found
        if is_read(node, parent):
            return node.lineno
        for c in ast.iter_child_nodes(node):
            line = walk(c, node)
            if line:
                return line
        return None

    line = walk(tree, None)
    return None if line is None else first + line - 1


def direct_weight_read(model: nn.Module, name: str) -> str | None:
    """Where a method of the parent module of the linear at ``name`` reads ``self.<child>.weight`` for its values,
    outside the linear's own forward (Mamba's training path computes ``self.dt_proj.weight @ x``; its fused CUDA
    kernels' path passes ``x_proj.weight`` and ``out_proj.weight`` to the kernel): ``"Class.method (line N) reads
    self.<child>.weight directly"``, else None. A pass that changes what the linear computes without changing its
    weight (an adapter) or changes the weight's type (quantization) does not reach that path. Read from the parent
    class's source (the methods that run in a step); a read of metadata (``weight.dtype``, ``.device``, ``.shape``),
    a type check, or a branch whose condition the module's own attributes decide false here does not count (Bloom's
    ``if self.pretraining_tp > 1 and self.slow_but_exact``: its ``dense`` slices); a branch decided only at run time
    (locals, calls) does: it may run."""
    import inspect

    parent_name, _, child = name.rpartition(".")
    if not child.isidentifier():
        return None  # an element of a ModuleList/Sequential: no attribute to read it by
    parent = model.get_submodule(parent_name) if parent_name else model
    for cls in type(parent).__mro__:
        if cls.__module__.startswith("torch.") or cls is object:
            break
        for attr, fn in vars(cls).items():
            if attr in _NOT_IN_A_STEP or "init" in attr or not inspect.isfunction(fn):
                continue
            line = _direct_read(fn, parent, child)
            if line is not None:
                return f"{cls.__name__}.{attr} (line {line}) reads self.{child}.weight directly"
    return None
