"""``checkpoint_activations``'s policy planning: which block (layer) each forward node belongs to, and the marks of
the "ops" and "full" policies (``node.meta["recompute"]`` / ``["ac_graph_id"]``, written by :func:`mark_graph`)."""
from __future__ import annotations

import operator
import re
from typing import Iterable

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from effpass.graph import forward_nodes, module_path_of_node, module_stack_of_node, tensor_meta, transformer_blocks
from effpass.scope import glob_match

MUST_SAVE = CheckpointPolicy.MUST_SAVE
MUST_RECOMPUTE = CheckpointPolicy.MUST_RECOMPUTE
RECOMPUTE = CheckpointPolicy.PREFER_RECOMPUTE

_aten = torch.ops.aten
#: ops whose outputs the "ops" policy saves: matmuls, convolutions, attention (costly to recompute)
_SAVE_PACKETS = {
    _aten.mm, _aten.addmm, _aten.bmm, _aten.baddbmm, _aten.matmul, _aten.linear, _aten.convolution,
    _aten._convolution, _aten.scaled_dot_product_attention, _aten._scaled_dot_product_flash_attention,
    _aten._scaled_dot_product_efficient_attention, _aten._scaled_dot_product_cudnn_attention,
    _aten._scaled_dot_product_flash_attention_for_cpu, _aten._flash_attention_forward,
    _aten._efficient_attention_forward,
}
for _name in ("_scaled_mm", "_weight_int8pack_mm", "_int_mm", "_scaled_dot_product_fused_attention_overrideable"):
    if hasattr(_aten, _name):
        _SAVE_PACKETS.add(getattr(_aten, _name))


def _packet_of_name(name: str):
    short = name.removeprefix("aten.").removeprefix("torch.ops.aten.").split(".")[0]
    return getattr(_aten, short, None) if short else None


def _packet(node: fx.Node):
    t = node.target
    return t.overloadpacket if isinstance(t, torch._ops.OpOverload) else t


def num_forward_outputs(gm: fx.GraphModule) -> int:
    """How many of the joint graph's outputs belong to the forward (the rest are gradients)."""
    import torch.utils._pytree as pytree

    out = next(iter(gm.graph.find_nodes(op="output")))
    leaves = pytree.arg_tree_leaves(*out.args)
    descs = out.meta.get("desc")
    if descs is not None:
        descs = pytree.arg_tree_leaves(descs)
        for i, d in enumerate(descs):
            if d is None or type(d).__name__ == "GradAOTOutput":
                return i
        return len(descs)
    fwd = set(forward_nodes(gm.graph))  # fallback: leading outputs computed without tangents
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, fx.Node) or leaf not in fwd or leaf.op == "placeholder":
            return i
    return len(leaves)  # pragma: no cover


_INDEX = re.compile(r"^\d+$")


def find_blocks(nodes: Iterable[fx.Node], targets: Iterable[str] = (), model: torch.nn.Module | None = None
                ) -> dict[fx.Node, str]:
    """node -> the block (module path) it belongs to, "" outside every block.

    With ``targets`` a block is the outermost module whose name matches a glob; otherwise it is one
    transformer layer: one of the model's repeated blocks (:func:`effpass.graph.transformer_blocks`), or,
    when the model is unknown, the outermost numbered child of a module (``model.layers.3``).
    """
    targets = tuple(targets)
    blocks = {name for name, _ in transformer_blocks(model)} if model is not None else None
    cache: dict[tuple, str] = {}
    out = {}
    for n in nodes:
        stack = tuple(p for p, _ in module_stack_of_node(n))
        if stack not in cache:
            cache[stack] = _block_of_stack(stack, targets, blocks)
        out[n] = cache[stack]
    if blocks is not None and not targets and not any(out.values()):
        # the graph's module paths are relative to another root than ctx.model (e.g. a wrapper such as a
        # PeftModel or a Trainer's model), or the model has no list of identical layers (a hybrid's layers are of
        # several classes): fall back to numbered children
        return find_blocks(nodes, targets, None)
    return out


def _block_of_stack(stack: tuple[str, ...], targets: tuple[str, ...], blocks: set[str] | None) -> str:
    path = stack[-1] if stack else ""
    parts = path.split(".") if path else []
    for i in range(1, len(parts) + 1):
        prefix = ".".join(parts[:i])
        if targets:
            if glob_match(prefix, targets):
                return prefix
        elif blocks is not None:
            # exact names: effpass.graph.normalize_module_path strips the traced frame's root (L['self'],
            # L['args'][0]); a wrapper's own prefix names no block and falls back to numbered children
            # (find_blocks). A suffix match would take a top-level block "0" for a path "x.0".
            if prefix in blocks:
                return prefix
        elif _INDEX.match(parts[i - 1]) and i > 1:
            return prefix
    return ""


def _block_ids(nodes: list[fx.Node], block_of: dict[fx.Node, str]) -> dict[fx.Node, int]:
    """Block number per node, in graph order (1..N); nodes outside blocks get 0 before the first block
    and N+1 after it."""
    order: dict[str, int] = {}
    for n in nodes:
        b = block_of.get(n, "")
        if b and b not in order:
            order[b] = len(order) + 1
    ids, seen_block = {}, False
    for n in nodes:
        b = block_of.get(n, "")
        if b:
            seen_block = True
            ids[n] = order[b]
        else:
            ids[n] = len(order) + 1 if seen_block else 0
    return ids


def _is_random(node: fx.Node) -> bool:
    t = node.target
    return isinstance(t, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in t.tags


def is_opaque(node: fx.Node) -> bool:
    """A custom op outside aten/prims (e.g. ``fuse_cross_entropy``'s loss, which computes its gradients in its
    forward): its cost is unknown here, and torch's partitioner never recomputes one unless a mark tells it to
    ("non-builtin op"). The "ops" policy and the budget plans save it, so no statistic predicts a recompute
    that the backward graph will not do (or that a later joint pass forbids)."""
    t = node.target
    return isinstance(t, torch._ops.OpOverload) and t.namespace not in ("aten", "prims")


def _is_view_or_free(node: fx.Node) -> bool:
    t = node.target
    if t is operator.getitem:
        return True
    if isinstance(t, torch._ops.OpOverload):
        return t.is_view or t.overloadpacket in (_aten.detach, _aten.alias, _aten.lift_fresh_copy, _aten.sym_size)
    return not isinstance(tensor_meta(node), torch.Tensor)


def _multi_output_parent(node: fx.Node) -> fx.Node | None:
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        parent = node.args[0]
        if not isinstance(tensor_meta(parent), torch.Tensor):
            return parent
    return None


Plan = dict  # fx.Node -> (CheckpointPolicy, ac_graph_id)


def plan_policy(nodes: list[fx.Node], block_of: dict[fx.Node, str], policy: str, extra_save=frozenset(),
                recompute_modules: tuple[str, ...] = ()) -> Plan:
    """Marks for the "ops" or "full" policy (no graph change yet)."""
    ids = _block_ids(nodes, block_of)
    plan: Plan = {}
    for n in nodes:
        if _multi_output_parent(n) is not None:
            continue  # follows its parent below
        if policy == "full":
            if not block_of.get(n):
                continue  # outside blocks: the partitioner decides
            plan[n] = (RECOMPUTE, ids[n])
        else:
            save = _packet(n) in _SAVE_PACKETS or _packet(n) in extra_save or is_opaque(n)
            if save and recompute_modules and _packet(n) not in extra_save and not is_opaque(n):
                path = module_path_of_node(n)
                save = not glob_match(path, recompute_modules)
            plan[n] = (MUST_SAVE if save else RECOMPUTE, ids[n])
    _copy_to_getitems(nodes, plan)
    return plan


def _copy_to_getitems(nodes: list[fx.Node], plan: Plan) -> None:
    for n in nodes:
        parent = _multi_output_parent(n)
        if parent is not None:
            if parent in plan:
                plan[n] = plan[parent]
            else:
                plan.pop(n, None)


def mark_graph(plan: Plan) -> None:
    for n, (policy, gid) in plan.items():
        if n.meta.get("recompute") is MUST_RECOMPUTE:
            # another pass's hard constraint (quantize_linear: a dequantized weight is recomputed from the
            # quantized parameter, never saved) wins over this plan, whichever joint hook ran first
            continue
        n.meta["recompute"] = policy
        n.meta["ac_graph_id"] = gid
