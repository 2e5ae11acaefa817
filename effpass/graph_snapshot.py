"""Rollback and dumps (part of :mod:`effpass.graph`, which re-exports every name): structural copies of a graph
and their restoration in place (:class:`GraphCheckpoint` copies no node), lazily generated graph modules, and
:func:`runnable_source` (a graph as a Python file that runs on its own).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from .graph_nodes import placeholder_values

__all__ = ["snapshot_graph", "copy_graph_into", "restore_graph", "GraphCheckpoint", "lazy_graph_module",
           "runnable_source"]


def snapshot_graph(graph: fx.Graph, val_map: dict[fx.Node, fx.Node] | None = None) -> fx.Graph:
    """A structural copy of ``graph`` (node meta dicts are shallow-copied) for rollback; ``val_map``, when given,
    is filled with each node's copy."""
    g = fx.Graph(tracer_cls=graph._tracer_cls)
    copy_graph_into(g, graph, {} if val_map is None else val_map)
    g._codegen = graph._codegen
    return g


def copy_graph_into(dst: fx.Graph, src: fx.Graph, val_map: dict[fx.Node, fx.Node]) -> None:
    """Append ``src``'s nodes and its output (with the output's meta) to ``dst``; ``val_map`` maps ``src``'s
    nodes to ``dst``'s (pre-filled entries are used for those nodes, e.g. placeholders kept)."""
    out = dst.graph_copy(src, val_map, return_output_node=True)
    out_val, out_node = out if isinstance(out, tuple) else (out, None)
    new_out = dst.output(out_val)
    if out_node is not None:
        new_out.meta = dict(out_node.meta)


def restore_graph(graph: fx.Graph, snapshot: fx.Graph) -> None:
    """Make ``graph`` equal to ``snapshot`` in place, keeping ``graph``'s own placeholder nodes (callers
    such as the partitioner know them by identity). Placeholders a failed pass added are removed."""
    snap_ph = [n for n in snapshot.nodes if n.op == "placeholder"]
    by_name = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    missing = [p.name for p in snap_ph if p.name not in by_name]
    if missing:  # checked before anything is erased: the graph is left as the pass left it
        raise RuntimeError(f"cannot roll back a pass that removed graph inputs {missing}")
    keep = {by_name[p.name] for p in snap_ph}
    _erase_all_but(graph, keep)
    copy_graph_into(graph, snapshot, {p: by_name[p.name] for p in snap_ph})


def _erase_all_but(graph: fx.Graph, keep: set) -> None:
    """Erase every node of ``graph`` but the placeholders in ``keep``, whatever order a failed pass left them in
    (a node used before it is defined: erasing in reverse order would meet a node that still has users)."""
    gone = [n for n in graph.nodes if n not in keep]
    for n in gone:
        n.args, n.kwargs = (), {}
    for n in reversed(gone):
        graph.erase_node(n)


class GraphCheckpoint:
    """A rollback point of ``graph`` that copies no node: each node's op, target, arguments, name, type and a
    shallow copy of its meta, in order (fx keeps arguments in immutable containers, so a pass that rewires a
    node replaces them and never edits the recorded ones). :meth:`restore` makes the graph equal to the
    recorded one in place, as :func:`restore_graph` does with a :func:`snapshot_graph` copy: the graph's own
    placeholder nodes are kept (callers such as the partitioner know them by identity), the nodes after them
    are built again, and placeholders a failed pass added are removed. Taking one costs a tuple per node
    (a snapshot builds a second graph), so every pass hook can afford one."""

    __slots__ = ("graph", "records", "codegen")

    def __init__(self, graph: fx.Graph):
        self.graph = graph
        self.records = [(n, n.op, n.target, n.args, n.kwargs, n.name, n.type, dict(n.meta)) for n in graph.nodes]
        self.codegen = graph._codegen

    def restore(self) -> None:
        graph = self.graph
        placeholders = [r for r in self.records if r[1] == "placeholder"]
        missing = [r[5] for r in placeholders if getattr(r[0], "_erased", False) or r[0].graph is not graph]
        if missing:  # checked before anything is erased: the graph is left as the pass left it
            raise RuntimeError(f"cannot roll back a pass that removed graph inputs {missing}")
        _erase_all_but(graph, {r[0] for r in placeholders})
        env: dict[fx.Node, fx.Node] = {}
        for node, op, target, args, kwargs, name, type_, meta in self.records:
            if op == "placeholder":
                node.meta = dict(meta)
                env[node] = node
                continue
            new = graph.create_node(op, target, fx.map_arg(args, env.__getitem__), fx.map_arg(kwargs, env.__getitem__),
                                    name=name, type_expr=type_)
            new.meta = dict(meta)
            env[node] = new
        graph._codegen = self.codegen


def lazy_graph_module(root, graph: fx.Graph, class_name: str = "GraphModule") -> fx.GraphModule:
    """``fx.GraphModule(root, graph, class_name)`` whose Python code is generated when it is first read or
    called, not at construction and not at each ``recompile()`` (torch's ``_LazyGraphModule``, which Dynamo
    and Inductor use; a plain ``GraphModule`` where the installed torch lacks it). For copies that passes
    edit before anything runs them."""
    try:
        from torch.fx._lazy_graph_module import _LazyGraphModule
    except ImportError:  # pragma: no cover - feature-tested
        return fx.GraphModule(root, graph, class_name=class_name)
    return _LazyGraphModule(root, graph, class_name=class_name)


def _import_line(name: str, obj: Any) -> str | None:
    mod = getattr(obj, "__module__", None)
    qual = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    if isinstance(obj, type(torch)):
        return f"import {obj.__name__} as {name}" if obj.__name__ != name else f"import {name}"
    if mod and qual and "<" not in qual:
        if "." in qual:
            return f"import {mod}\n{name} = {mod}.{qual}"
        return f"from {mod} import {qual} as {name}" if qual != name else f"from {mod} import {name}"
    return None


def _example_input(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        shape = tuple(int(s) if not isinstance(s, torch.SymInt) else 8 for s in v.shape)
        dt = str(v.dtype)
        if v.dtype.is_floating_point:
            return f"torch.randn({shape}, dtype={dt})"
        if v.dtype == torch.bool:
            return f"torch.ones({shape}, dtype=torch.bool)"
        return f"torch.zeros({shape}, dtype={dt})"
    if isinstance(v, (int, float, bool)):
        return repr(v)
    if isinstance(v, torch.SymInt):
        return "8"
    return "None"


def runnable_source(gm: fx.GraphModule, title: str = "") -> str:
    """Python source for a graph that imports and runs on its own with random inputs of the right shape."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():  # hooks run under a fake mode; constants are real tensors
        return _runnable_source(gm, title)


def _runnable_source(gm: fx.GraphModule, title: str) -> str:
    graph = snapshot_graph(gm.graph)
    graph._codegen = fx.graph.CodeGen()  # plain positional inputs (joint graphs use a pytree signature)
    code = graph.python_code(root_module="self", verbose=True)
    lines = ["# " + l for l in title.splitlines()] if title else []
    lines += ["import torch", "import operator", "import math", "from math import inf, nan",
              "from torch import device", "import torch.fx._symbolic_trace",
              "try:\n    import torch._inductor.inductor_prims  # Inductor's prims (fma, ...) in joint graphs\nexcept Exception:\n    pass",
              "try:\n    import effpass.passes  # registers the passes' custom ops (torch.ops.effpass.*)\nexcept Exception:\n    pass", ""]
    for name, obj in sorted(code.globals.items()):
        if name in ("torch", "operator", "math", "inf", "nan", "device", "builtins"):
            continue
        line = _import_line(name, obj)
        if line is None:
            lines.append(f"{name} = None  # not importable: {obj!r}"[:200])
        else:
            lines.append(f"try:\n    {line.replace(chr(10), chr(10) + '    ')}\nexcept Exception:\n    {name} = None")
    body = code.src.replace("\n", "\n    ")
    lines += ["", "", "class Graph(torch.nn.Module):", "    def __init__(self):", "        super().__init__()"]
    for n in graph.nodes:  # constants the graph reads with get_attr
        if n.op != "get_attr":
            continue
        try:
            value = _getattr_path(gm, n.target)
        except AttributeError:
            continue
        if isinstance(value, torch.Tensor):
            if value.numel() <= 64:
                init = f"torch.tensor({value.detach().cpu().tolist()!r}, dtype={value.dtype})"
            else:
                init = _example_input(value)
            lines.append(f"        setattr(self, {n.target!r}, {init})")
    lines += [f"    {body}", ""]
    inputs = [_example_input(v) for v in placeholder_values(graph)]
    lines += ["", "def example_inputs():", f"    return [{', '.join(inputs)}]", "",
              "", "if __name__ == '__main__':",
              "    with torch.no_grad():",
              "        out = Graph()(*example_inputs())",
              "    print(type(out).__name__)", ""]
    return "\n".join(lines)


def _getattr_path(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj
