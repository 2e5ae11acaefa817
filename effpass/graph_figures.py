"""Figures of one lowered graph read from its tensor metadata, with nothing run: what the HTML report and the
dump show first for each graph (issue 38.6, 36.3).

* ``flops``: torch's flop formulas for matmuls, convolutions and attention (``torch.utils.flop_counter``), one
  per output element for other compute ops, zero for views (:func:`node_flops`); ``matmul_flops``: the part
  torch's formulas count (what ``FlopCounterMode`` reports for the same ops);
* ``input_bytes``: the storages of the graph's inputs (parameters, the batch, and in a backward graph the values
  saved for it), each storage once;
* ``peak_bytes``: the most bytes of intermediate storages alive at once, running the ops in graph order with
  each value freed after its last use (outputs kept): the graph's transient memory above its inputs, as an
  eager run of the unfused ops holds it (Inductor's fusions and buffer reuse hold less);
* ``saved_bytes`` (backward graphs): activations saved for the backward (inputs that are neither gradients of
  outputs nor forward inputs), each storage once;
* ``bytes_moved``: bytes read and written by the compute ops, each op one kernel (an upper bound: fusion reads
  and writes less);
* ``est_ms``: a roofline estimate per device (``effpass.devices``): each op the larger of its compute and
  memory time, plus one launch; predicted, never measured.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from .graph_nodes import is_primal, is_tangent, tensor_meta

__all__ = ["node_flops", "graph_figures", "storage_key", "storage_nbytes", "value_bytes"]

_aten = torch.ops.aten
_FREE = (_aten.detach, _aten.alias, _aten.lift_fresh_copy, _aten.sym_size)


def value_bytes(val: torch.Tensor) -> int:
    """Bytes of ``val``'s elements (a symbolic size read at its hint)."""
    n = val.numel()
    try:
        n = int(n)
    except Exception:  # symbolic: use the hint
        n = int(getattr(getattr(n, "node", None), "hint", None) or 4096)
    return n * val.element_size()


def storage_key(val: torch.Tensor):
    """What identifies ``val``'s storage (views share it)."""
    try:
        from torch.multiprocessing.reductions import StorageWeakRef

        return StorageWeakRef(val.untyped_storage())
    except Exception:
        return id(val)


def storage_nbytes(val: torch.Tensor) -> int:
    """Bytes of ``val``'s whole storage (a view counts the storage it views)."""
    try:
        return int(val.untyped_storage().nbytes())
    except Exception:
        return value_bytes(val)


def _is_free(target) -> bool:
    if target is operator.getitem:
        return True
    if isinstance(target, torch._ops.OpOverload):
        return target.is_view or target.overloadpacket in _FREE
    return False


def node_flops(node: fx.Node) -> int:
    """FLOPs of one node: torch's flop formulas for matmuls/convs/attention; one per output element for
    other compute ops; zero for views. A ``run_with_rng_state(state, op, *args)`` node (a random op the
    partitioner replays in the backward) counts as its op."""
    if node.op != "call_function":
        return 0
    target, args = node.target, node.args
    if "run_with_rng_state" in str(getattr(target, "__name__", target)) and len(args) >= 2:
        target, args = args[1], args[2:]
    return op_flops(target, args, node.kwargs, tensor_meta(node))


def op_flops(target, args, kwargs, out) -> int:
    """FLOPs of ``target`` on ``args`` (nodes or values) producing ``out``."""
    if _is_free(target):
        return 0
    packet = target.overloadpacket if isinstance(target, torch._ops.OpOverload) else target
    import torch.utils._pytree as pytree
    from torch.utils.flop_counter import flop_registry

    metas = pytree.tree_map(lambda a: tensor_meta(a) if isinstance(a, fx.Node) else a, (args, kwargs))
    fn = flop_registry.get(packet)
    if fn is not None:
        try:
            return int(fn(*metas[0], **metas[1], out_val=out))
        except Exception:
            pass
    if "attention" in str(packet):
        flops = _attention_flops(metas[0])  # e.g. the CPU flash op, which torch's flop counter lacks
        if flops is not None:
            return flops
    vals = out if isinstance(out, (list, tuple)) else [out]
    return sum(value_bytes(v) // max(v.element_size(), 1) for v in vals if isinstance(v, torch.Tensor))


def _attention_flops(args) -> int | None:
    """``q @ k^T`` and ``p @ v`` of an attention op from its (B, H, S, D) q/k/v arguments (GQA: k/v may
    have fewer heads; the kernel broadcasts them)."""
    qkv = list(args[:3])
    if len(qkv) < 3 or not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in qkv):
        return None
    (b, hq, sq, d), (_, _, sk, _), (_, _, _, dv) = (tuple(int(x) for x in t.shape) for t in qkv)
    return 2 * b * hq * sq * sk * (d + dv)


def _tensors(val) -> list[torch.Tensor]:
    vals = val if isinstance(val, (list, tuple)) else [val]
    return [v for v in vals if isinstance(v, torch.Tensor)]


def _symbolic(gm: fx.GraphModule) -> bool:
    for n in gm.graph.find_nodes(op="placeholder"):
        v = tensor_meta(n)
        if isinstance(v, (torch.SymInt, torch.SymFloat)):
            return True
        if isinstance(v, torch.Tensor) and not all(isinstance(d, int) for d in v.shape):
            return True
    return False


def graph_figures(gm: fx.GraphModule, devices=("h100",)) -> dict[str, Any]:
    """The figures of the module docstring for ``gm`` (an aten graph with tensor metadata). A graph with symbolic
    sizes (``dynamic=True``, packed lengths) gets ``{"skipped": reason}``: reading its sizes would cost symbolic
    algebra per op, and turning them into numbers would add guards to the compile."""
    from .devices import get_device, kernel_seconds

    if _symbolic(gm):
        return {"skipped": "symbolic sizes: figures are read from graphs with fixed sizes only"}
    nodes = list(gm.graph.nodes)
    last: dict[fx.Node, int] = {}
    for i, n in enumerate(nodes):
        for a in n.all_input_nodes:
            last[a] = i
    outputs = {a for n in nodes if n.op == "output" for a in n.all_input_nodes}
    inputs: dict[Any, int] = {}
    saved: dict[Any, int] = {}
    for n in nodes:
        if n.op != "placeholder":
            continue
        for v in _tensors(tensor_meta(n)):
            key = storage_key(v)
            inputs[key] = max(inputs.get(key, 0), storage_nbytes(v))
            if not (is_tangent(n) or is_primal(n)):
                saved[key] = max(saved.get(key, 0), storage_nbytes(v))
    live: dict[Any, int] = {}
    holders: dict[Any, set] = {}
    keys_of: dict[fx.Node, list] = {}
    from torch.utils.flop_counter import flop_registry

    cur = peak = flops = mm_flops = moved = kernels = 0
    est = {d: 0.0 for d in devices}
    for i, n in enumerate(nodes):
        if n.op == "call_function":
            outs = _tensors(tensor_meta(n))
            keys = []
            for v in outs:
                key = storage_key(v)
                keys.append(key)
                if key in inputs:
                    continue
                if key not in live:
                    live[key] = storage_nbytes(v)
                    cur += live[key]
                holders.setdefault(key, set()).add(n)
            keys_of[n] = keys
            peak = max(peak, cur)
            if not _is_free(n.target):
                f = node_flops(n)
                b = sum(value_bytes(v) for v in outs) + sum(
                    value_bytes(v) for a in n.all_input_nodes for v in _tensors(tensor_meta(a)))
                flops, moved, kernels = flops + f, moved + b, kernels + 1
                target = n.args[1] if "run_with_rng_state" in str(n.target) and len(n.args) >= 2 else n.target
                packet = target.overloadpacket if isinstance(target, torch._ops.OpOverload) else target
                if packet in flop_registry or "attention" in str(packet):
                    mm_flops += f
                dtype = next((v.dtype for a in n.all_input_nodes for v in _tensors(tensor_meta(a))
                              if v.is_floating_point()), None)
                for d in devices:
                    est[d] += kernel_seconds(get_device(d), f, b, dtype)
        for a in n.all_input_nodes:
            if last.get(a) == i and a not in outputs:
                for key in keys_of.pop(a, ()):
                    held = holders.get(key)
                    if held is None:
                        continue
                    held.discard(a)
                    if not held and key in live:
                        cur -= live.pop(key)
                        del holders[key]
    out = {"nodes": len(nodes), "kernels": kernels, "flops": flops, "matmul_flops": mm_flops, "input_bytes": sum(inputs.values()),
           "peak_bytes": peak, "bytes_moved": moved, "est_ms": {d: round(s * 1e3, 4) for d, s in est.items()}}
    if any(is_tangent(n) for n in nodes):
        out["saved_bytes"] = sum(saved.values())
    return out
