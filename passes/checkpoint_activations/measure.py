"""``checkpoint_activations``'s measuring: partition a copy of the joint graph as AOTAutograd would
(:func:`partition_stats`) and count the activation bytes saved for the backward and the FLOPs it recomputes."""
from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.fx as fx

from effpass.graph import forward_nodes, is_primal, is_tangent, snapshot_graph, tensor_meta
from effpass.graph_figures import node_flops, storage_key as _storage_key, value_bytes as _nbytes  # noqa: F401

from .plan import Plan, _is_random, mark_graph, num_forward_outputs


def activation_bytes(saved: Iterable[fx.Node], inputs: Iterable[fx.Node] = (), exclude: Iterable = ()) -> int:
    """Bytes of the saved tensors, each storage once, leaving out storages of graph inputs (parameters and
    batch tensors are alive anyway) and the storages in ``exclude``."""
    exclude = set(exclude) | {_storage_key(v) for v in (tensor_meta(n) for n in inputs) if isinstance(v, torch.Tensor)}
    sizes: dict[Any, int] = {}
    for n in saved:
        v = tensor_meta(n)
        if not isinstance(v, torch.Tensor):
            continue
        key = _storage_key(v)
        if key in exclude:
            continue
        try:
            size = int(v.untyped_storage().nbytes())
        except Exception:
            size = _nbytes(v)
        sizes[key] = max(sizes.get(key, 0), size)
    return sum(sizes.values())


def partition_stats(gm: fx.GraphModule, num_fwd_outputs: int | None = None, *, plan: Plan | None = None,
                    memory_budget: float | None = None, clear_marks: bool = False) -> dict[str, Any]:
    """Partition a copy of the joint graph ``gm`` as AOTAutograd would and measure it.

    ``plan`` marks the copy first; ``clear_marks`` removes existing marks; ``memory_budget`` runs torch's
    own ``activation_memory_budget``. Returns ``saved_bytes`` (activations only), ``saved_tensors``,
    ``recompute_flops`` (forward ops the backward recomputes) and ``recomputed`` (their names).
    """
    from torch._functorch import config as fconfig
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    if num_fwd_outputs is None:
        num_fwd_outputs = num_forward_outputs(gm)
    env: dict[fx.Node, fx.Node] = {}
    copy = fx.GraphModule(gm, snapshot_graph(gm.graph, env))
    if clear_marks:
        for n in copy.graph.nodes:
            n.meta.pop("recompute", None)
            n.meta.pop("ac_graph_id", None)
            n.meta.pop("memory_budget", None)
    if plan:
        mark_graph({env[n]: p for n, p in plan.items()})
    fwd_names = {n.name: n for n in forward_nodes(copy.graph) if n.op == "call_function"}
    patches = {} if memory_budget is None else {"activation_memory_budget": memory_budget}
    with fconfig.patch(patches):
        _fw, bw = min_cut_rematerialization_partition(copy, None, num_fwd_outputs=num_fwd_outputs)
    saved = [n for n in bw.graph.find_nodes(op="placeholder") if not is_tangent(n)]
    inputs = [n for n in copy.graph.find_nodes(op="placeholder")]
    recomputed = [n for n in bw.graph.nodes if n.op == "call_function" and n.name in fwd_names]
    replayed = [n for n in bw.graph.nodes if n.op == "call_function" and "run_with_rng_state" in str(n.target)]
    return {
        "saved": [n.name for n in saved if isinstance(tensor_meta(n), torch.Tensor) and not is_primal(n)],
        # recomputed random ops are replayed from their saved RNG state (functionalized by the partitioner)
        "recomputed_rng_ops": sum(1 for n in recomputed if _is_random(fwd_names[n.name])) + sum(
            1 for n in bw.graph.nodes if n.op == "call_function" and "run_with_rng_state" in str(n.target)),
        "saved_bytes": activation_bytes(saved, inputs),
        "saved_tensors": sum(1 for n in saved if isinstance(tensor_meta(n), torch.Tensor) and not is_primal(n)),
        "recompute_flops": sum(node_flops(n) for n in recomputed + replayed),
        "recomputed": [n.name for n in recomputed],
    }
