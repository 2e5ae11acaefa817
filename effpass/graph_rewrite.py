"""Nodes a pass creates and erases (part of :mod:`effpass.graph`, which re-exports every name): provenance, fake
example values (the one fake-value updater), sites (ancestors, how reports name a site) and the one dead-node
eraser.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.fx as fx

from .graph_nodes import is_random_op, module_path_of_node, op_name, tensor_meta

__all__ = ["PROVENANCE_KEYS", "copy_provenance", "infer_fake_values", "annotate_new_nodes", "ancestors", "site_name",
           "erase_dead"]


# ------------------------------------------------------------------------------------------------------
# metadata of nodes a pass creates
# ------------------------------------------------------------------------------------------------------
#: meta keys that say where a node came from (copied onto the nodes that replace it)
PROVENANCE_KEYS = ("nn_module_stack", "stack_trace", "source_fn_stack", "seq_nr")


def copy_provenance(dst: torch.fx.Node, src: torch.fx.Node, *, values: bool = False) -> None:
    """Give ``dst`` the provenance of ``src`` (and its example value, with ``values=True``)."""
    keys = PROVENANCE_KEYS + (("example_value", "val") if values else ())
    for key in keys:
        if key in src.meta:
            dst.meta[key] = src.meta[key]


def infer_fake_values(nodes: Iterable[torch.fx.Node], *, strict: bool = False) -> bool:
    """Compute ``meta["example_value"]`` for new ``call_function`` nodes (in graph order) by running them
    under the fake mode of their inputs' example values, as Dynamo records them for its own nodes. Best
    effort: returns False (leaving the rest unset) when there is no fake mode or an op fails on fake
    tensors; AOTAutograd re-traces the graph anyway, so only passes that read values later care.
    ``strict=True``: an op that fails on fake tensors raises (for passes that check the new values).

    NOTE: torch's ``FakeTensorUpdater`` (torch._inductor.fx_utils) updates ``meta["val"]`` of a whole
    aten-level graph; torch-IR graphs keep ``example_value`` and their targets are torch functions and
    methods, so the new nodes are run here directly."""
    from torch._guards import detect_fake_mode

    from torch._subclasses.fake_tensor import FakeTensor

    nodes = list(nodes)
    inputs = [tensor_meta(a) for n in nodes for a in n.all_input_nodes]
    # NOTE: the inputs' own fake mode first: the ambient TracingContext's mode (which detect_fake_mode prefers)
    # can be another one than the mode Dynamo recorded the example values in, and fake modes cannot be mixed
    modes = {id(v.fake_mode): v.fake_mode for v in inputs if isinstance(v, FakeTensor)}
    fake_mode = next(iter(modes.values())) if len(modes) == 1 else detect_fake_mode(
        [v for v in inputs if isinstance(v, torch.Tensor)])
    if fake_mode is None:
        return False
    env: dict[torch.fx.Node, Any] = {}

    def value(a):
        return env[a] if a in env else tensor_meta(a)

    with fake_mode:
        for n in nodes:
            args = torch.fx.node.map_arg(n.args, value)
            kwargs = torch.fx.node.map_arg(n.kwargs, value)
            try:
                target = getattr(torch.Tensor, n.target) if n.op == "call_method" else n.target
                env[n] = target(*args, **kwargs)
            except Exception:  # noqa: BLE001 - metadata is best effort
                if strict:
                    raise
                return False
            n.meta["example_value"] = env[n]
    return True



def annotate_new_nodes(nodes: Iterable[fx.Node], like: fx.Node | None = None) -> None:
    """Nodes a rewrite inserted: the provenance of the node they replace (``like``, if given) and fake example
    values, node by node in the order given (best effort: a node whose op fails on fake tensors stays
    without one; AOTAutograd re-traces the graph anyway)."""
    for n in nodes:
        if like is not None:
            copy_provenance(n, like)
        infer_fake_values([n])


def ancestors(node: fx.Node, *, include_self: bool = True) -> set[fx.Node]:
    """Every node ``node`` is computed from (and ``node`` itself, unless ``include_self=False``)."""
    seen: set[fx.Node] = set()
    stack = [node] if include_self else list(node.all_input_nodes)
    while stack:
        x = stack.pop()
        if x not in seen:
            seen.add(x)
            stack.extend(x.all_input_nodes)
    return seen


def site_name(node: fx.Node) -> str:
    """How a report names a site: ``module.path:node_name`` (``<root>`` outside any module)."""
    return f"{module_path_of_node(node) or '<root>'}:{node.name}"


def erase_dead(graph: fx.Graph, nodes: Iterable[fx.Node], *, producers: bool = False) -> None:
    """Erase ``nodes`` once nothing uses them, consumers first (the matched nodes a rewrite replaced).

    ``producers=True`` also erases every pure producer that became unused through them (a repeated K/V,
    a causal mask's construction); in-place, random and impure ops are kept unless listed in ``nodes``.
    """
    nodes = list(nodes)
    must = set(nodes)
    erased: set[fx.Node] = set()
    progress = True
    while progress:  # a chain: erase from its consumer end until nothing more goes
        progress = False
        for n in nodes:
            if n in erased or n.users:
                continue
            stack = [n]
            while stack:
                x = stack.pop()
                if x in erased or x.users or (x not in must and (
                        x.op not in ("call_function", "call_method") or not _pure(x))):
                    continue
                inputs = x.all_input_nodes
                graph.erase_node(x)
                erased.add(x)
                if producers:
                    stack.extend(i for i in inputs if i not in must)
            progress = True


def _pure(x: fx.Node) -> bool:
    return not (x.is_impure() or op_name(x).endswith("_") or is_random_op(x))
