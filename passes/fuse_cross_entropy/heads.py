"""The head helpers ``fuse_cross_entropy``'s rewrites share (the cross-entropy and log-probability rewrites in the
pass, the row-wise rewrite in ``rewrite.py``): check a site's head, find who reads its logits, emit the op's
projection inputs, give the new nodes example values, drop the logits, count the head in the statistics.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from effpass.graph import same_shape
from effpass.quantized import dequantize, is_quantized

from .matching import Site, Skip, _val, autocast_dtype_at, erase_unused, replay_shape, set_meta

__all__ = ["node_caller", "check_head", "logits_readers", "compute_dtype", "emit_head", "set_meta_or_skip",
           "drop_logits", "count_head"]


def node_caller(graph: fx.Graph, new: list):
    """``call(fn, *args, **kwargs)``: a ``call_function`` node inserted at the graph's insertion point and
    appended to ``new`` (the rewrite's new nodes, erased again when it skips)."""
    def call(fn, *args, **kwargs):
        n = graph.call_function(fn, args, kwargs)
        new.append(n)
        return n
    return call


def check_head(site: Site) -> tuple[int, int]:
    """``(vocab, width)`` of a site's head; Skip when its tensors have no static value or its weight is a
    tensor subclass other than a frozen registered quantized weight."""
    hv, wv = _val(site.h), _val(site.weight)
    if not (isinstance(hv, torch.Tensor) and isinstance(wv, torch.Tensor) and wv.dim() == 2):
        raise Skip("the projection's input or weight has no static example value")
    if is_traceable_wrapper_subclass(wv) and (wv.requires_grad or not is_quantized(wv)):
        raise Skip(f"the head's weight is a {type(wv).__name__} (a tensor subclass that is not a frozen "
                   "quantized weight from quantize_linear)")
    return int(wv.shape[0]), int(wv.shape[1])


def logits_readers(site: Site, consumers) -> tuple[set, list, list]:
    """The logits chain of a site, and who else reads it: the graph output (returned logits) or other
    computations (``consumers``: the nodes the rewrite replaces)."""
    chain_set = set(site.chain) | {site.proj} | set(site.lora_nodes)
    returned, used_elsewhere = [], []
    for n in chain_set:
        for u in n.users:
            if u in chain_set or u in consumers:
                continue
            (returned if u.op == "output" else used_elsewhere).append(n)
    return chain_set, returned, used_elsewhere


def compute_dtype(graph: fx.Graph, site: Site) -> str:
    """The matmul dtype inside the op: an enclosing autocast region's, for an fp32 head ("" otherwise)."""
    hv = _val(site.h)
    dtype = autocast_dtype_at(graph, site.proj, hv.device.type)
    return "" if dtype is None or hv.dtype != torch.float32 else str(dtype).removeprefix("torch.")


def emit_head(graph: fx.Graph, site: Site, call, new: list, vocab: int, width: int):
    """Nodes for the op's projection inputs: rows ``x`` (N, H), the plain weight (a quantized head
    dequantised once), and a LoRA head's ``x2 = A(h) * s`` rows and ``B``."""
    def rows_of(src: fx.Node, w: int) -> fx.Node:
        for op in site.shape_ops:
            src = replay_shape(graph, op, src, vocab, w)
            new.append(src)
        return call(torch.reshape, src, (-1, w))

    x = rows_of(site.h, width)
    # a quantized head (quantize_linear: torchao Int8Tensor, NF4, int4): the op takes plain tensors, so the
    # frozen weight is dequantised once in the graph, as the unfused F.linear on it does (torchao's
    # weight-only linear dequantises the whole weight too)
    weight = call(dequantize, site.weight) if is_traceable_wrapper_subclass(_val(site.weight)) else site.weight
    x2 = w2 = None
    if site.lora is not None:
        u0, w2, s = site.lora
        x2 = rows_of(call(torch.mul, u0, s) if s != 1.0 else u0, int(_val(w2).shape[1]))
    return x, weight, x2, w2


def set_meta_or_skip(graph: fx.Graph, new: list, like: fx.Node, x: fx.Node, want: tuple) -> None:
    """Example values for the new nodes; Skip (new nodes erased) when the rows do not line up or a shape op
    does not replay on the projection's input."""
    try:
        set_meta(new, like)
        got = _val(x)
        if got is None or not same_shape(got.shape, want):
            raise Skip(f"the projection's rows do not line up with the loss's rows "
                       f"({None if got is None else tuple(got.shape)} vs {want})")
    except Skip:
        erase_unused(graph, list(reversed(new)))
        raise
    except Exception as e:  # noqa: BLE001 - a shape op that does not replay on h: leave the site alone
        erase_unused(graph, list(reversed(new)))
        raise Skip(f"could not rebuild the projection's rows: {type(e).__name__}: {e}") from None


def drop_logits(graph: fx.Graph, site: Site, chain_set: set, returned: list, keep: bool) -> bool:
    """Returned logits become None (unless kept); the logits chain is erased once nothing reads it."""
    dropped = bool(returned) and not keep
    if dropped:
        out = next(n for n in graph.nodes if n.op == "output")
        out.args = fx.node.map_arg(out.args, lambda n: None if n in chain_set else n)
    erase_unused(graph, list(reversed(site.chain)) + [site.proj] + list(site.lora_nodes))
    return dropped


def count_head(stats: dict, site: Site, weight, compute: str) -> None:
    """Add a fused head to the statistics: a LoRA head, matmuls in a lower precision, a dequantised weight."""
    stats["lora_heads"] += int(site.lora is not None)
    stats["low_precision_matmuls"] += int(bool(compute))
    stats["dequantized_heads"] += int(weight is not site.weight)
