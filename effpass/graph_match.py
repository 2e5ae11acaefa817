"""Matching torch-IR nodes (part of :mod:`effpass.graph`, which re-exports every name): predicates and argument
readers, :class:`Skip`, symbolic sizes (compared and hinted without guards) and the one reader of autocast regions.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.fx as fx

from .graph_nodes import tensor_meta

__all__ = ["MASK_FILL_THRESHOLD", "Skip", "is_fn", "is_method", "is_softmax", "arg", "val", "shape_of", "size_hint",
           "is_static", "same_size", "same_shape", "is_number", "ENTER_AUTOCAST", "EXIT_AUTOCAST", "is_autocast_enter",
           "is_autocast_exit", "AutocastRegions", "autocast_dtype_at"]


# ------------------------------------------------------------------------------------------------------
# matching torch-IR nodes (after effpass.canonicalize: one spelling per function, method and operator)
# ------------------------------------------------------------------------------------------------------
#: an additive mask value at or below this counts as "masked out" (HF uses finfo(dtype).min; fp16's is -65504)
MASK_FILL_THRESHOLD = -1e4


class Skip(Exception):
    """A site a pass looked at and left alone; the message is the reason (it goes to the report)."""


def is_fn(n: Any, fns) -> bool:
    """``n`` is a ``call_function`` node whose target is in ``fns``."""
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target in fns


def is_method(n: Any, names) -> bool:
    """``n`` is a ``call_method`` node whose method name is in ``names``."""
    return isinstance(n, fx.Node) and n.op == "call_method" and n.target in names


_SOFTMAX_FNS = frozenset({torch.softmax, torch.nn.functional.softmax, torch.special.softmax})


def is_softmax(n: Any) -> bool:
    """A softmax in any of its torch-IR spellings (``torch.softmax``, ``F.softmax``, ``.softmax``)."""
    return is_fn(n, _SOFTMAX_FNS) or is_method(n, {"softmax"})


def arg(n: fx.Node, i: int, name: str, default: Any = None) -> Any:
    """Argument ``i`` of a call, positional or by keyword ``name`` (``default`` when absent)."""
    if len(n.args) > i:
        return n.args[i]
    return n.kwargs.get(name, default)


def val(n: Any) -> Any:
    """The example value of a node (None for a non-node argument)."""
    return tensor_meta(n) if isinstance(n, fx.Node) else None


def shape_of(n: Any) -> tuple | None:
    """The shape of a node's tensor value, or None."""
    v = val(n)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def size_hint(a: Any) -> int:
    """A size as a Python int without adding a guard: an int as is, a ``SymInt`` (a dynamic dim, e.g. the packed
    length ``pack_sequences`` marks dynamic) its hint, the value of the example the graph was traced with.

    NOTE(recompiles): ``int(symint)`` specialises the graph to that value (a guard), so every new packed length would
    recompile; use this for statistics and budgets, never for a size the graph computes with."""
    if isinstance(a, int):
        return int(a)
    from torch.fx.experimental import symbolic_shapes as ss

    hint = getattr(ss, "optimization_hint", None)
    if hint is not None:
        return int(hint(a))
    return int(a.node.hint)  # older torch (2.11): the SymNode carries the hint


def is_static(shape: Iterable[Any]) -> bool:
    """Every dim a Python int (no symbolic size)."""
    return all(isinstance(d, int) for d in shape)


def same_size(a: Any, b: Any, *, guard: bool = False) -> bool:
    """``a == b`` for sizes that may be symbolic, true only when provably equal (no guard added).

    ``guard=True``: sizes that are not provably equal but were equal in the traced example (two inputs whose relation
    Dynamo cannot see, e.g. the hidden states an FSDP boundary returns, with a size of their own, and the labels)
    are made equal by a guard ``a == b`` on the graph: it then only runs on inputs where they are (others
    recompile), never on sizes it was not traced for."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    if statically_known_true(a == b):
        return True
    if guard and size_hint(a) == size_hint(b):
        return bool(a == b)  # installs the guard (a symbolic relation; against an int, that int)
    return False


def same_shape(a: Iterable[Any], b: Iterable[Any], *, guard: bool = False) -> bool:
    """Shapes equal dim by dim (:func:`same_size`)."""
    a, b = tuple(a), tuple(b)
    return len(a) == len(b) and all(same_size(x, y, guard=guard) for x, y in zip(a, b))


def is_number(x: Any) -> bool:
    """A Python int or float constant (not a bool)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


# ------------------------------------------------------------------------------------------------------
# autocast: the one reader of autocast regions
# ------------------------------------------------------------------------------------------------------
ENTER_AUTOCAST = torch.amp.autocast_mode._enter_autocast
EXIT_AUTOCAST = torch.amp.autocast_mode._exit_autocast


def is_autocast_enter(node: Any) -> bool:
    return is_fn(node, {ENTER_AUTOCAST})


def is_autocast_exit(node: Any) -> bool:
    return is_fn(node, {EXIT_AUTOCAST})


class AutocastRegions:
    """Which autocast state each node of a torch-IR graph runs under: the regions Dynamo recorded
    (``_enter_autocast``/``_exit_autocast`` nodes: a model's own ``with torch.autocast``, apply_autocast's
    module wrappers) on top of the state around the compiled call (accelerate/TRL/Trainer enter autocast
    around the model call; passes run while the call is traced, so that state is the ambient one).

    Build once per graph and pass (the nodes are indexed once); rebuild after inserting autocast nodes."""

    def __init__(self, graph: fx.Graph):
        self.stack_at: dict[fx.Node, tuple] = {}
        stack: list[fx.Node] = []
        #: every exit closes an open region and every region is closed by the end of the graph
        self.balanced = True
        for n in graph.nodes:
            self.stack_at[n] = tuple(stack)
            if is_autocast_enter(n):
                stack.append(n)
            elif is_autocast_exit(n):
                if stack:
                    stack.pop()
                else:
                    self.balanced = False
        self.balanced = self.balanced and not stack

    def inside(self, node: fx.Node) -> bool:
        """Whether ``node`` runs inside a region recorded in the graph (not counting the outer autocast)."""
        return bool(self.stack_at.get(node))

    def dtype_at(self, node: fx.Node, device_type: str) -> torch.dtype | None:
        """The autocast dtype ``node`` runs under on ``device_type``, or None when autocast is off there."""
        for enter in reversed(self.stack_at.get(node, ())):
            args = list(enter.args)
            dev = args[0] if args else enter.kwargs.get("device_type")
            if dev != device_type:
                continue
            dtype = args[1] if len(args) > 1 else enter.kwargs.get("dtype")
            enabled = args[2] if len(args) > 2 else enter.kwargs.get("enabled", True)
            if not enabled:
                return None
            return dtype if isinstance(dtype, torch.dtype) else torch.get_autocast_dtype(device_type)
        return self.outer_dtype(device_type)

    @staticmethod
    def outer_dtype(device_type: str) -> torch.dtype | None:
        """The autocast dtype entered around the compiled call (accelerate, TRL), or None."""
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
        return None


def autocast_dtype_at(graph: fx.Graph, node: fx.Node, device_type: str) -> torch.dtype | None:
    """:meth:`AutocastRegions.dtype_at` for one node (build :class:`AutocastRegions` for many)."""
    return AutocastRegions(graph).dtype_at(node, device_type)
