"""``fuse_attention``'s proofs by constant evaluation: compile-time values of constant subgraphs (masks, GQA index
tensors), and what they prove about a matched site: the mask is exactly causal (SDPA's ``is_causal``), or every
query row attends to some key (plain SDPA is safe; else :func:`effpass.attention.masked_sdpa`).

The extra check of the attention pattern (:mod:`._attention_match`) calls these; nothing here matches nodes.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx as fx

from effpass.canonicalize import INPLACE_FORMS
from effpass.graph import MASK_FILL_THRESHOLD, ancestors, is_buffer_source, is_number, is_random_op, shape_of, val

__all__ = ["ConstEval", "fill_value_ok", "is_causal", "rows_nonempty", "static_shape"]


def static_shape(shape) -> bool:
    return shape is not None and all(isinstance(s, int) for s in shape)


# ------------------------------------------------------------------------------------------------------
# compile-time evaluation of constant subgraphs (masks, GQA index tensors)
# ------------------------------------------------------------------------------------------------------
class ConstEval:
    """Evaluates subgraphs that depend on no graph input (optionally treating buffers as constants)."""

    def __init__(self, gm: fx.GraphModule, ctx, trust_buffers: bool, max_elements: int):
        self.max_elements = max_elements
        self.known: dict[fx.Node, Any] = {}
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        examples = list(ctx.example_inputs or [])
        if trust_buffers and len(examples) == len(placeholders):
            for n, x in zip(placeholders, examples):
                if isinstance(x, torch.Tensor) and is_buffer_source(n) and not x.requires_grad:
                    self.known[n] = x

    def __call__(self, node: Any) -> Any:
        if not isinstance(node, fx.Node):
            return node
        if node in self.known:
            return self.known[node]
        order = [n for n in ancestors(node) if n not in self.known]
        total = 0
        for n in order:
            if n.op != "call_function" and n.op != "call_method":
                return None
            if is_random_op(n) or n.target is torch._C._set_grad_enabled:
                return None
            shape = shape_of(n)
            if shape is not None:
                if not static_shape(shape):
                    return None
                total += math.prod(shape)
            elif not isinstance(val(n), (int, float, bool, type(None), torch.Size, tuple, list)):
                return None
        if total > self.max_elements:
            return None
        index = {n: i for i, n in enumerate(node.graph.nodes)}
        try:
            for n in sorted(order, key=index.__getitem__):
                args = fx.node.map_arg(n.args, self.known.__getitem__)
                kwargs = fx.node.map_arg(n.kwargs, self.known.__getitem__)
                if n.target in INPLACE_FORMS and args and isinstance(args[0], torch.Tensor):
                    args = (args[0].clone(), *args[1:])  # never mutate a value another node was given
                if n.op == "call_function":
                    self.known[n] = n.target(*args, **kwargs)
                else:
                    self.known[n] = getattr(args[0], n.target)(*args[1:], **kwargs)
        except Exception:  # anything unexpected: the value is simply not known
            return None
        return self.known[node]



def fill_value_ok(value: Any, const: ConstEval) -> bool:
    """A masked_fill / where fill value that masks: ``-inf`` or at most :data:`MASK_FILL_THRESHOLD` (a number, or a
    constant tensor)."""
    if is_number(value):
        return value <= MASK_FILL_THRESHOLD
    t = const(value)
    return isinstance(t, torch.Tensor) and t.numel() > 0 and bool((t <= MASK_FILL_THRESHOLD).all())


def _term_4d(t: torch.Tensor, site, node: fx.Node) -> torch.Tensor | None:
    """A mask term's value in the (B, H, Sq, Sk) layout of the scores (terms of BLOOM's (B*H, ...) layout are
    split), or None when it cannot be."""
    if site.heads is None or node not in site.split_terms or t.dim() < 3:
        return t
    B, H = site.heads
    if t.shape[0] == B * H:
        return t.reshape(B, H, *t.shape[1:])
    if t.shape[0] == 1:
        return t.unsqueeze(0)
    return None



def _allowed(site, const: ConstEval, keep_of) -> torch.Tensor | None:
    """The combined "attend" mask when every mask term is a known constant, else None; ``keep_of(t)`` reads
    an additive term as "attend" (None: the term is not a mask)."""
    allowed = None
    terms = [(m, negate, False) for m, negate in site.allowed] + [(m, False, True) for m, _ in site.additive]
    for m, negate, additive in terms:
        t = _const_term(m, site, const)
        if not isinstance(t, torch.Tensor):
            return None
        t = keep_of(t) if additive else (~t if negate else t)
        if t is None:
            return None
        allowed = t if allowed is None else allowed & t
    return allowed


def _causal_allowed(site, const: ConstEval) -> torch.Tensor | None:
    """The "attend" mask when the terms are constant 0 / -inf masks (a real bias is not), else None."""
    def keep_of(t):
        keep, drop = t == 0, t <= MASK_FILL_THRESHOLD
        return keep if bool((keep | drop).all()) else None

    return _allowed(site, const, keep_of)


def _const_term(m: fx.Node, site, const: ConstEval) -> torch.Tensor | None:
    t = const(m)
    return _term_4d(t, site, m) if isinstance(t, torch.Tensor) else None


def is_causal(site, const: ConstEval) -> bool:
    if not site.additive and not site.allowed:
        return False
    shape = shape_of(site.qk)
    sq, sk = shape[-2], shape[-1]
    if sq != sk:
        return False
    allowed = _causal_allowed(site, const)
    if allowed is None or allowed.dim() < 2 or tuple(allowed.shape[-2:]) != (sq, sk):
        return False
    tril = torch.ones(sq, sk, dtype=torch.bool, device=allowed.device).tril()
    return bool((allowed == tril).all())


def rows_nonempty(site, const: ConstEval) -> bool:
    """True when the mask is a known constant in which every query row attends to at least one key
    (additive terms: a value above the mask threshold, e.g. an ALiBi bias, counts as attending)."""
    allowed = _allowed(site, const, lambda t: t > MASK_FILL_THRESHOLD)
    return isinstance(allowed, torch.Tensor) and allowed.dim() >= 1 and bool(allowed.any(-1).all())

