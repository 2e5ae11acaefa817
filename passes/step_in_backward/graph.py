"""step_in_backward's rewrite of a joint graph: each hooked parameter's gradient output replaced by a
``effpass::step_parameter`` call placed where the gradient is complete (:func:`insert_steps`). Private to the pass."""
from __future__ import annotations

import torch
import torch.fx as fx

__all__ = ["insert_steps"]


def _desc_position(desc) -> int | None:
    """The flat input position a gradient output of the joint graph belongs to (``PlainAOTInput.idx``)."""
    d = getattr(desc, "grad_of", None)
    if type(d).__name__ == "PlainAOTInput":
        return int(d.idx)
    return None


def _readers(p: fx.Node) -> list[fx.Node]:
    """Nodes reading ``p``'s storage: its users and, through view ops, their users."""
    out, stack, seen = [], [p], {p}
    while stack:
        n = stack.pop()
        for u in n.users:
            if u not in seen:
                seen.add(u)
                out.append(u)
                if u.op == "call_function" and getattr(u.target, "is_view", False):
                    stack.append(u)
    return out


def insert_steps(gm: fx.GraphModule, positions) -> tuple[int, list[dict]]:
    """In a joint graph, replace the gradient output of every input at ``positions`` (flat input positions of
    hooked parameters) by a :func:`step_parameter` call placed where that gradient is complete and after the
    backward's last read of the parameter; the graph returns no gradient for it. Returns (steps, skipped)."""
    import torch.utils._pytree as pytree

    from effpass.graph import is_tangent

    graph = gm.graph
    out = next(iter(graph.find_nodes(op="output")))
    descs = out.meta.get("desc")
    if descs is None:
        return 0, [{"site": "graph", "reason": "the joint graph's outputs carry no descriptors (older torch)"}]
    leaves, spec = pytree.tree_flatten(out.args)
    descs = pytree.arg_tree_leaves(descs)
    if len(descs) != len(leaves):
        return 0, [{"site": "graph", "reason": "joint outputs and their descriptors differ in number"}]
    primals = {}
    for ph in graph.find_nodes(op="placeholder"):
        d = ph.meta.get("desc")
        if type(d).__name__ == "PlainAOTInput":
            primals[int(d.idx)] = ph
    order = {n: i for i, n in enumerate(graph.nodes)}
    backward: set[fx.Node] = set()
    for n in graph.nodes:  # nodes computed from a tangent: the backward
        if (n.op == "placeholder" and is_tangent(n)) or any(a in backward for a in n.all_input_nodes):
            backward.add(n)
    steps, skipped, new_leaves = 0, [], list(leaves)
    for j, (leaf, d) in enumerate(zip(leaves, descs)):
        pos = _desc_position(d)
        if pos is None or pos not in positions or not isinstance(leaf, fx.Node):
            continue
        p = primals.get(pos)
        if p is None or leaf not in backward:
            skipped.append({"site": p.name if p is not None else f"input {pos}",
                            "reason": "its gradient is not computed from the loss's gradient in this graph"
                                      if p is not None else "no primal input for it"})
            continue
        # NOTE(ordering): after every backward read of the parameter (direct or through a view, and the
        # backward users of forward reads, which the partitioner may recompute just before them): the step
        # writes it in place.
        after, readers = [leaf], []
        for r in _readers(p):
            if r is out:
                continue
            after.append(r)
            if r in backward:
                readers.append(r)
            else:
                users = [u for u in r.users if u in backward and u is not out]
                after.extend(users)
                readers.extend(users)
        last = max(after, key=order.get)
        deps = []
        for r in readers:
            v = r.meta.get("val")
            if r.op == "call_function" and getattr(r.target, "is_view", False):
                continue  # an alias of the parameter: its own readers are listed
            if isinstance(v, torch.Tensor):
                deps.append(r)
            elif isinstance(v, (tuple, list)):  # a multi-output op: its pieces
                deps.extend(u for u in r.users if isinstance(u.meta.get("val"), torch.Tensor) and u in backward)
        deps = sorted(set(deps), key=order.get)
        last = max([last, *deps], key=order.get)
        tokens = []
        for d in deps:  # NOTE(lifetimes): see step_after
            if d is leaf:
                continue  # the gradient itself is an operand anyway
            with graph.inserting_after(d):
                t = graph.call_function(torch.ops.effpass.step_after.default, (d,))
            t.meta["val"] = d.meta["val"].new_empty(0)
            t.meta["partitioner_tag"] = "must_be_in_backward"
            t.meta["custom"] = {**(d.meta.get("custom") or {}), "effpass_step": pos}
            order[t] = order[d] + 0.25
            tokens.append(t)
        with graph.inserting_after(last):
            node = graph.call_function(torch.ops.effpass.step_parameter.default, (p, leaf, tokens))
        node.meta["val"] = None
        node.meta["partitioner_tag"] = "must_be_in_backward"
        node.meta["custom"] = {**(leaf.meta.get("custom") or {}), "effpass_step": pos}
        order[node] = order[last] + 0.5
        new_leaves[j] = None
        steps += 1
    if steps:
        out.args = pytree.tree_unflatten(new_leaves, spec)
    return steps, skipped
