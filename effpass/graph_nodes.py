"""Reading graphs (part of :mod:`effpass.graph`, which re-exports every name): what a node does and where it
came from. Op names and histograms, example values, the joint graph's inputs (tangents, primals, parameters) and
forward part, a model's repeated blocks, and module paths (where a node or a graph input came from).
"""
from __future__ import annotations

import collections
import operator
import re
from typing import Any, Sequence

import torch
import torch.fx as fx

__all__ = ["op_name", "op_histogram", "tensor_meta", "placeholder_values", "is_tangent", "is_primal",
           "parameter_input_flags", "parameter_only_nodes", "forward_nodes", "has_tangents", "transformer_blocks",
           "normalize_module_path", "module_stack_of_node", "module_path_of_node", "source_path", "is_buffer_source",
           "is_random_op"]


def op_name(node: fx.Node) -> str:
    """A stable, readable name for what a node does (``aten.mm``, ``torch.matmul``, ``.view``)."""
    if node.op == "call_function":
        t = node.target
        if isinstance(t, torch._ops.OpOverload):
            return f"aten.{t.overloadpacket.__name__}" if t.namespace == "aten" else f"{t.namespace}.{t.overloadpacket.__name__}"
        if isinstance(t, torch._ops.OpOverloadPacket):
            return f"{t._qualified_op_name.replace('::', '.')}"
        if isinstance(t, torch._ops.HigherOrderOperator):
            return f"hop.{t.name()}"
        mod = getattr(t, "__module__", None) or ""
        name = getattr(t, "__name__", repr(t))
        if t in (operator.getitem,):
            return "getitem"
        if mod.startswith("torch"):
            if mod.startswith("torch._C._nn") or mod == "torch.nn.functional":
                return f"F.{name}"
            return f"torch.{name}"
        return f"{mod.split('.')[-1]}.{name}" if mod else name
    if node.op == "call_method":
        return f".{node.target}"
    if node.op == "call_module":
        return f"module.{node.target}"
    return node.op


def op_histogram(graph: fx.Graph) -> dict[str, int]:
    """How many nodes of each op the graph has (placeholders, outputs and getitems excluded)."""
    c = collections.Counter(op_name(n) for n in graph.nodes
                            if n.op in ("call_function", "call_method", "call_module"))
    c.pop("getitem", None)
    return dict(sorted(c.items()))


def tensor_meta(node: fx.Node) -> Any:
    """The fake/example value of a node, whichever key the graph level uses."""
    return node.meta.get("val", node.meta.get("example_value"))


def placeholder_values(graph: fx.Graph) -> list[Any]:
    return [tensor_meta(n) for n in graph.nodes if n.op == "placeholder"]


def is_tangent(node: fx.Node) -> bool:
    """A joint or backward graph's input that carries an output's gradient (``tangents_*``)."""
    return node.op == "placeholder" and str(node.target).startswith("tangents")


def is_primal(node: fx.Node) -> bool:
    """A joint graph's forward input (``primals_*``: parameters, buffers and user inputs)."""
    return node.op == "placeholder" and str(node.target).startswith("primals")


def parameter_input_flags(example_inputs: Sequence[Any]) -> tuple[bool, ...]:
    """For each ``primals_*`` input of the joint graph AOTAutograd makes from a Dynamo graph's
    ``example_inputs``, whether it holds (a piece of) a model parameter. Tensor subclasses are flattened into
    their inner tensors (``__tensor_flatten__`` order, recursively), as AOTAutograd flattens them."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    def leaves(t: Any) -> int:
        if isinstance(t, torch.Tensor) and is_traceable_wrapper_subclass(t):
            names, _ = t.__tensor_flatten__()
            return sum(leaves(getattr(t, n)) for n in names)
        return 1

    flags: list[bool] = []
    for x in example_inputs:
        flags += [isinstance(x, torch.nn.Parameter)] * leaves(x)
    return tuple(flags)


def parameter_only_nodes(graph: fx.Graph, flags: Sequence[bool] | None
                         ) -> tuple[set[fx.Node], set[fx.Node]] | None:
    """``(derived, params)``: the joint graph's parameter placeholders (from :func:`parameter_input_flags`)
    and the ops computed from parameters alone (and constants): a weight's dequantization, cast or
    transpose, which a backward can recompute from the parameters instead of saving. None when ``flags``
    does not match the graph's primals (unknown: do nothing)."""
    prims = [n for n in graph.nodes if is_primal(n)]
    if flags is None or len(prims) != len(flags):
        return None
    params = {n for n, f in zip(prims, flags) if f}
    derived: set[fx.Node] = set()
    for n in graph.nodes:
        if n.op != "call_function" or is_random_op(n):
            continue
        if all(i in params or i in derived for i in n.all_input_nodes):
            derived.add(n)
    return derived, params


def forward_nodes(graph: fx.Graph) -> list[fx.Node]:
    """Nodes of a joint forward+backward graph that do not depend on a tangent (and are not tagged backward by
    the partitioner), in graph order: its non-tangent placeholders and forward ops."""
    backward: set[fx.Node] = set()
    out = []
    for n in graph.nodes:
        if n.op == "output":
            continue
        if n.op == "placeholder":
            if is_tangent(n):
                backward.add(n)
            else:
                out.append(n)
            continue
        if n.meta.get("partitioner_tag") == "is_backward" or any(a in backward for a in n.all_input_nodes):
            backward.add(n)
        else:
            out.append(n)
    return out


def has_tangents(graph: fx.Graph) -> bool:
    """Whether ``graph`` is a training graph (joint or backward) rather than a forward or inference one."""
    return any(is_tangent(n) for n in graph.find_nodes(op="placeholder"))


def transformer_blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The model's repeated blocks (transformer layers): the entries of every ``ModuleList`` whose entries
    share one class (a one-layer model has one block).

    Nested repeated lists (a block inside a block) are not blocks of their own: the outermost wins.
    """
    blocks: list[tuple[str, torch.nn.Module]] = []
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.ModuleList) or len(mod) < 1 or len({type(m) for m in mod}) != 1:
            continue
        prefix = f"{name}." if name else ""
        if any(prefix.startswith(b + ".") for b, _ in blocks):
            continue  # inside an already found block
        blocks += [(f"{prefix}{i}", m) for i, m in enumerate(mod)]
    return blocks


# ------------------------------------------------------------------------------------------------------
# module paths: where a node or a graph input came from
# ------------------------------------------------------------------------------------------------------
_BRACKET = re.compile(r"\[['\"]?([^\]'\"]+)['\"]?\]")
_BOUND_SELF = re.compile(r"\.?[^.]+\.__self__")


def normalize_module_path(path: str) -> str:
    """Dynamo's ``"L['self'].model.layers.0"`` (or ``._modules['layers']['0']``) -> ``"model.layers.0"``."""
    p = path
    # The root module of the traced frame: ``self`` of a forward, or the first positional argument of a
    # ``wrapper(*args, **kwargs)`` decorator around it (transformers >= 5.24 wraps ``forward`` so).
    for prefix in ("L['self']", 'L["self"]', "L['args'][0]", 'L["args"][0]', "L['mod']", "L['fn']", "self"):
        if p == prefix or p.startswith(prefix + ".") or p.startswith(prefix + "["):
            p = p[len(prefix):]
            break
    p = p.replace("._modules", "")
    p = _BRACKET.sub(r".\1", p)
    # A forward stored on the instance as a bound method shows up as "<attr>.__self__": the object it is
    # bound to is the module that holds it, so the two segments name nothing.
    p = _BOUND_SELF.sub("", p)
    return p.strip(".")


def module_stack_of_node(node: torch.fx.Node) -> list[tuple[str, type | None]]:
    """[(module path, module class)] from outermost to innermost for a node (empty when unknown)."""
    stack = node.meta.get("nn_module_stack") or {}
    out = []
    for value in stack.values():
        path, klass = value if isinstance(value, tuple) else (value, None)
        if isinstance(klass, str):
            klass = None
        out.append((normalize_module_path(str(path)), klass))
    return out


def module_path_of_node(node: torch.fx.Node) -> str:
    stack = module_stack_of_node(node)
    return stack[-1][0] if stack else ""


def source_path(node: torch.fx.Node) -> str:
    """torch-IR graphs: the dotted name of the parameter or buffer a placeholder stands for, read from
    Dynamo's ``_dynamo_source`` (``L['self']._modules['q_proj']._parameters['weight']`` ->
    ``"q_proj.weight"``); "" for user inputs and nodes without a source."""
    source = getattr(node, "_dynamo_source", None)
    if source is None:
        return ""
    name = getattr(source, "name", "")
    name = name() if callable(name) else str(name)
    if "_parameters" not in name and "_buffers" not in name:
        return ""  # a user input (L['args'][0], L['input_ids']) or another local
    return normalize_module_path(name).replace("._parameters.", ".").replace("._buffers.", ".")


def is_buffer_source(node: torch.fx.Node) -> bool:
    """Whether a torch-IR placeholder stands for a registered buffer of the model."""
    source = getattr(node, "_dynamo_source", None)
    name = getattr(source, "name", "") if source is not None else ""
    return "_buffers" in (name() if callable(name) else str(name))


_RANDOM_WORDS = ("rand", "bernoulli", "dropout", "normal", "multinomial", "uniform", "poisson")


def is_random_op(x: fx.Node) -> bool:
    """Whether a node draws random numbers (by its op's name: rand*, dropout, bernoulli, ...)."""
    return any(w in op_name(x).lower() for w in _RANDOM_WORDS)
