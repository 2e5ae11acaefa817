"""Canonicalize a torch-IR graph before the torch-IR passes match it (core; run by the manager).

Dynamo records an op as the model wrote it: ``q @ k`` (``operator.matmul``), ``q.matmul(k)``,
``torch.matmul(q, k)``; ``F.softmax``, ``torch.softmax``, ``x.softmax``; ``s / d``, ``s.div(d)``,
``torch.true_divide(s, d)``; and in-place forms (``s /= d``, ``s.masked_fill_(m, v)``). Inductor normalises
its graphs before it matches patterns; effpass does the same here so that a pass matches one spelling:

* one function per op: the aliases below become the ``torch.*`` function (``torch.matmul``,
  ``torch.softmax`` as ``torch.softmax(x, dim)`` with ``dtype`` the only keyword, ``torch.mul``, ``torch.div``, ``torch.add``, ``torch.masked_fill``, ``torch.transpose``);
  Python operators only where an operand is a tensor (``operator.add`` on sizes stays);
* in-place arithmetic and ``masked_fill_`` become out of place where that is safe: the mutated tensor is
  made by the graph (not an input), is not a view, and nothing made before the mutation aliases it. Later
  readers of the mutated tensor then read the new node (functionalization by hand, for these few ops).
  An in-place op where that is not provable stays as it was (a pass that meets it skips the site).

Nodes are changed in place (name, provenance and example value kept), so node counts do not change.
Statistics: ``functions``, ``methods``, ``operators`` (spellings rewritten) and ``inplace`` (made out of
place), and ``inplace_kept`` (left in place: not provably safe).
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef

from .graph import infer_fake_values, val

__all__ = ["canonicalize", "CANONICAL_FUNCTIONS", "INPLACE_FORMS"]

#: function aliases -> the canonical torch function (same signature after argument mapping)
_FN_ALIASES = {
    operator.matmul: torch.matmul,
    torch.multiply: torch.mul,
    torch.true_divide: torch.div,
    torch.divide: torch.div,
    torch.special.softmax: torch.softmax,
}
#: Python operators, rewritten where an operand is a tensor
_OPERATORS = {operator.mul: torch.mul, operator.truediv: torch.div, operator.add: torch.add}
#: tensor methods -> the canonical torch function (``x.f(*a, **k)`` == ``f(x, *a, **k)``)
_METHODS = {
    "matmul": torch.matmul, "__matmul__": torch.matmul, "bmm": torch.bmm,
    "mul": torch.mul, "__mul__": torch.mul, "div": torch.div, "__truediv__": torch.div,
    "add": torch.add, "__add__": torch.add, "masked_fill": torch.masked_fill, "transpose": torch.transpose,
}
#: in-place forms -> their out-of-place function
_INPLACE = {
    operator.imul: torch.mul, operator.itruediv: torch.div, operator.iadd: torch.add,
    "mul_": torch.mul, "__imul__": torch.mul, "div_": torch.div, "__itruediv__": torch.div,
    "add_": torch.add, "__iadd__": torch.add, "masked_fill_": torch.masked_fill,
}
#: in-place spellings a canonical graph may still hold (where making them out of place was not provably safe)
INPLACE_FORMS = frozenset(_INPLACE)
#: every function a canonical graph spells these ops with
CANONICAL_FUNCTIONS = frozenset(_FN_ALIASES.values()) | frozenset(_METHODS.values()) | {torch.softmax}


def _is_tensor(a: Any) -> bool:
    return isinstance(val(a), torch.Tensor)


def _storage(a: Any):
    v = val(a)
    try:
        return StorageWeakRef(v.untyped_storage()) if isinstance(v, torch.Tensor) else None
    except Exception:  # noqa: BLE001 - a tensor without storage (a subclass): alias unknown
        return "unknown"


def _softmax_call(node: fx.Node) -> tuple | None:
    """(args, kwargs) of ``torch.softmax`` for a softmax in another spelling, or None to leave it."""
    if node.op == "call_method":
        x, *rest = node.args
        dim = rest[0] if rest else node.kwargs.get("dim")
        dtype = rest[1] if len(rest) > 1 else node.kwargs.get("dtype")
    else:  # F.softmax(input, dim=None, _stacklevel=3, dtype=None) / torch[.special].softmax(input, dim, dtype=None)
        names = ("input", "dim", "_stacklevel", "dtype") if node.target is F.softmax else ("input", "dim", "dtype")
        bound = dict(zip(names, node.args)) | dict(node.kwargs)
        x, dim, dtype = bound.get("input"), bound.get("dim"), bound.get("dtype")
    if not isinstance(dim, int) or isinstance(dim, bool):
        return None  # an implicit dim (F.softmax's legacy choice): left as written
    return (x, dim), ({"dtype": dtype} if dtype is not None else {})


def _inplace_safe(node: fx.Node, order: dict) -> bool:
    x = node.args[0] if node.args else None
    if not isinstance(x, fx.Node) or x.op not in ("call_function", "call_method") or not _is_tensor(x):
        return False
    if val(x)._base is not None:  # a view: the mutation reaches its base
        return False
    mine = _storage(x)
    if not isinstance(mine, StorageWeakRef):
        return False
    for u in x.users:  # anything made from x before the mutation that shares its storage sees it too
        if u is not node and order[u] < order[node]:
            theirs = _storage(u)
            if isinstance(theirs, str) or (isinstance(theirs, StorageWeakRef) and theirs == mine):
                return False
    return True


def canonicalize(gm: fx.GraphModule) -> dict[str, int]:
    """Rewrite ``gm``'s graph to the canonical spellings (in place). Returns the statistics."""
    graph = gm.graph
    stats = {"functions": 0, "methods": 0, "operators": 0, "inplace": 0, "inplace_kept": 0}
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        if node.op == "call_function":
            t = node.target
            if t is F.softmax or t is torch.special.softmax or t is torch.softmax:
                call = _softmax_call(node)
                # torch.softmax already is the canonical function: only its arguments are put in one form
                if call is not None and (t is not torch.softmax or call != (node.args, dict(node.kwargs))):
                    node.target, (node.args, node.kwargs) = torch.softmax, call
                    stats["functions"] += 1
            elif t in _FN_ALIASES:
                node.target = _FN_ALIASES[t]
                stats["functions"] += 1
            elif t in _OPERATORS and any(_is_tensor(a) for a in node.args):
                # NOTE(numerics): a Python number first (``0.5 * x``) runs as ``x.__rmul__(0.5)``, a scalar op;
                # ``torch.mul(0.5, x)`` wraps the number in an fp32 tensor and rounds differently in bf16
                # (GPT-2's gelu under autocast). Swap the operands where the op commutes, else leave it.
                if not _is_tensor(node.args[0]):
                    if t is operator.truediv or len(node.args) != 2:
                        stats["operators_kept"] = stats.get("operators_kept", 0) + 1
                        continue
                    node.args = (node.args[1], node.args[0])
                node.target = _OPERATORS[t]
                stats["operators"] += 1
            elif t in _INPLACE and node.args and _is_tensor(node.args[0]):
                _out_of_place(graph, node, order, stats)
        elif node.op == "call_method" and node.args and _is_tensor(node.args[0]):
            t = node.target
            if t == "softmax":
                call = _softmax_call(node)
                if call is not None:
                    node.op, node.target, (node.args, node.kwargs) = "call_function", torch.softmax, call
                    stats["methods"] += 1
            elif t in _METHODS:
                node.op, node.target = "call_function", _METHODS[t]
                stats["methods"] += 1
            elif t in _INPLACE:
                _out_of_place(graph, node, order, stats)
    if any(stats[k] for k in ("functions", "methods", "operators", "inplace")):
        graph.lint()
        gm.recompile()
    return stats


def _out_of_place(graph: fx.Graph, node: fx.Node, order: dict, stats: dict) -> None:
    if not _inplace_safe(node, order):
        stats["inplace_kept"] += 1
        return
    x = node.args[0]
    old = node.meta.get("example_value")
    node.op, node.target = "call_function", _INPLACE[node.target]
    # readers of x after the mutation read the new value
    for u in list(x.users):
        if u is not node and order[u] > order[node]:
            u.replace_input_with(x, node)
    node.meta.pop("example_value", None)
    if not infer_fake_values([node]) and old is not None:
        node.meta["example_value"] = old
    stats["inplace"] += 1
