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

__all__ = ["ConstEval", "fill_value_ok", "is_causal", "rows_nonempty", "sdpa_mask_causal", "static_shape"]


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



# ------------------------------------------------------------------------------------------------------
# a mask handed to an existing SDPA call: exactly causal? (evaluated in row tiles: O(N^2) time, O(tile) memory)
# ------------------------------------------------------------------------------------------------------
#: elementwise ops a mask's (Sq, Sk)-sized nodes may be built from (by name: torch functions, operators, methods)
_TILE_FUNCTIONS = {"le", "lt", "ge", "gt", "eq", "ne", "and_", "or_", "xor", "invert", "not_", "add", "sub", "mul",
                   "logical_and", "logical_or", "logical_not", "logical_xor", "bitwise_and", "bitwise_or",
                   "bitwise_not", "bitwise_xor", "where", "masked_fill", "clone", "neg"}
_TILE_METHODS = _TILE_FUNCTIONS | {"to", "bool", "float", "half", "bfloat16", "int", "long", "type", "contiguous",
                                   "expand", "__and__", "__or__", "__invert__", "__xor__", "masked_fill_"}

#: the largest Sq * Sk a mask is evaluated by row tiles for (about 46K tokens; time grows with it, memory does not);
#: a mask proven by rows and columns (:func:`_separable_causal`) needs no evaluation, at any length
MAX_SDPA_MASK_ELEMENTS = 1 << 31
_TILE_ELEMENTS = 1 << 22


def sdpa_mask_causal(mask: fx.Node, const: ConstEval, sq: int, sk: int) -> str | None:
    """None when ``mask`` (an SDPA ``attn_mask``: bool "attend", or float 0 / masked) is a compile-time constant
    equal to the causal lower triangle over every batch and head, else why not. Nodes of the mask's full
    ``(.., Sq, Sk)`` size are evaluated ``_TILE_ELEMENTS`` at a time over query rows (elementwise ops and
    ``expand`` only); the smaller nodes they are computed from by :class:`ConstEval`."""
    if not (isinstance(sq, int) and isinstance(sk, int)) or sq != sk:
        return f"query/key lengths ({sq}, {sk}) are not one static length"
    index = {m: i for i, m in enumerate(mask.graph.nodes)}
    order = sorted(ancestors(mask), key=index.__getitem__)
    big = [n for n in order if _full_size(n, sq, sk)]
    if mask not in big:
        return "the mask is not (.., Sq, Sk)-sized"
    # NOTE(any length): a mask that is a conjunction of comparisons of a per-row with a per-column value
    # (transformers' ``kv_idx <= q_idx`` & ``packed[q] == packed[kv]``) is proven in O(S) time, at any length;
    # before, masks over 2**31 elements (46,341 tokens) were kept, saved for backward (S^2 bytes: the 8B
    # QLoRA plan's +4.5 GiB from 46,080 to 47,104 tokens)
    why_sep = _separable_causal(mask, big, const, sq, sk)
    if why_sep is None:
        return None
    if sq * sk > MAX_SDPA_MASK_ELEMENTS:
        return (f"{sq} x {sk} mask is above the {MAX_SDPA_MASK_ELEMENTS:,}-element evaluation limit and not "
                f"proven by rows and columns ({why_sep})")
    for n in big:
        name = n.target if n.op == "call_method" else getattr(n.target, "__name__", "")
        if n.op not in ("call_function", "call_method") or name not in (
                _TILE_METHODS if n.op == "call_method" else _TILE_FUNCTIONS):
            # not evaluated by rows (e.g. ``ones(S, S).tril()``): whole, within ConstEval's element limit
            whole = const(mask)
            if not isinstance(whole, torch.Tensor):
                return (f"the mask is built with {n.op} {name or n.target} (not evaluated by rows) and is not a "
                        f"constant within the evaluation limit")
            return _causal_rows(whole, 0, sq, sk)
    for n in big:
        for a in n.all_input_nodes:
            if a not in big and not isinstance(const(a), (torch.Tensor, int, float, bool)):
                return "the mask depends on a graph input or a value not known at compile time"
    rows = max(1, _TILE_ELEMENTS // sk)
    for r0 in range(0, sq, rows):
        r1 = min(sq, r0 + rows)
        tile = _eval_rows(big, const, sq, r0, r1)
        if tile is None:
            return "the mask could not be evaluated"
        why = _causal_rows(tile[mask], r0, r1, sk)
        if why is not None:
            return why
    return None


#: comparisons ``op(a, b)`` and the same relation with the operands swapped
_CMP_SWAP = {"le": "ge", "ge": "le", "lt": "gt", "gt": "lt", "eq": "eq"}
_CMP_NAMES = {"__le__": "le", "__ge__": "ge", "__lt__": "lt", "__gt__": "gt", "__eq__": "eq"}
_AND_NAMES = {"and_", "__and__", "logical_and", "bitwise_and"}
_SAME_NAMES = {"to", "clone", "contiguous", "expand", "bool"}  # bool in, bool out: the same values


def _separable_causal(mask: fx.Node, big: list, const: ConstEval, sq: int, sk: int) -> str | None:
    """None when the bool mask is proven exactly causal as a conjunction of terms ``a[.., i] REL b[.., j]``
    (REL one of <=, <, >=, >, ==; ``a`` a constant per query row, ``b`` per key column, leading dims broadcast)
    and all-True constants, by prefix and suffix extremes of ``b``: O(S) time at any length. Else why not (the
    caller then evaluates the mask by row tiles where it may). Sound, not complete: every term must hold on the
    causal prefix ``j <= i`` of each row, and in each row some term must be false on every ``j > i``."""
    big_set = set(big)
    terms: list = []

    def name_of(n):
        name = n.target if n.op == "call_method" else getattr(n.target, "__name__", "")
        return _CMP_NAMES.get(name, name)

    def is_bool(n):
        v = val(n)
        return isinstance(v, torch.Tensor) and v.dtype == torch.bool

    def walk(n) -> str | None:
        if not isinstance(n, fx.Node) or n not in big_set:  # an operand of a conjunction: must be all True
            v = const(n) if isinstance(n, fx.Node) else n
            if isinstance(v, bool) and v or isinstance(v, torch.Tensor) and v.dtype == torch.bool and bool(v.all()):
                return None
            return "a conjunction operand is not an all-True constant"
        if n.op not in ("call_function", "call_method") or not is_bool(n):
            return f"{n.name} is not a bool elementwise op"
        name = name_of(n)
        if name in _AND_NAMES and len(n.args) == 2 and not n.kwargs:
            return walk(n.args[0]) or walk(n.args[1])
        if name in _SAME_NAMES:
            src = n.args[0] if n.args else None
            if not isinstance(src, fx.Node) or not is_bool(src):
                return f"{n.name} ({name}) does not keep a bool mask"
            return walk(src)
        if name in _CMP_SWAP and len(n.args) == 2 and not n.kwargs:
            if any(isinstance(a, fx.Node) and a in big_set for a in n.args):
                return f"{n.name} compares (Sq, Sk)-sized values"
            terms.append((name, n.args[0], n.args[1]))
            return None
        return f"{n.name} ({name}) is not a comparison or a conjunction"

    why = walk(mask)
    if why is not None:
        return why
    if not terms:
        return "no comparison term"
    contains, exact = [], []
    for name, a, b in terms:
        va, vb = (const(x) if isinstance(x, fx.Node) else x for x in (a, b))
        if not all(isinstance(v, torch.Tensor) for v in (va, vb)):
            return "a comparison operand is not a constant tensor"
        kinds = [_orientation(v, sq, sk) for v in (va, vb)]
        if kinds == ["col", "row"]:
            va, vb, name = vb, va, _CMP_SWAP[name]
        elif kinds != ["row", "col"]:
            return f"a comparison of {kinds[0]} and {kinds[1]} values (not a query-row and a key-column value)"
        dt = torch.promote_types(va.dtype, vb.dtype)
        va, vb = va.to(dt), vb.to(dt)
        if dt.is_floating_point and bool(va.isnan().any() | vb.isnan().any()):
            return "a comparison operand holds NaN"
        lead = torch.broadcast_shapes(va.shape[:-2], vb.shape[:-2])
        x = va.expand(*lead, sq, 1)[..., 0]   # (.., S): the query row's value
        y = vb.expand(*lead, 1, sk)[..., 0, :]  # (.., S): the key column's value
        pmax, pmin = y.cummax(-1).values, y.cummin(-1).values
        smax = y.flip(-1).cummax(-1).values.flip(-1)[..., 1:]  # over j > i, for i < S - 1
        smin = y.flip(-1).cummin(-1).values.flip(-1)[..., 1:]
        xs = x[..., :-1]
        if name == "ge":    # y_j <= x_i
            c, e = pmax <= x, smin > xs
        elif name == "gt":  # y_j < x_i
            c, e = pmax < x, smin >= xs
        elif name == "le":  # y_j >= x_i
            c, e = pmin >= x, smax < xs
        elif name == "lt":  # y_j > x_i
            c, e = pmin > x, smax <= xs
        else:               # y_j == x_i
            c, e = (pmin == x) & (pmax == x), (smin > xs) | (smax < xs)
        last = torch.ones(*e.shape[:-1], 1, dtype=torch.bool)
        contains.append(c)
        exact.append(c & torch.cat([e, last], -1))
    if not all(bool(c.all()) for c in contains):
        return "a term is false somewhere on the causal triangle"
    excluded = torch.zeros((), dtype=torch.bool)
    for e in exact:
        excluded = excluded | e
    if not bool(excluded.all()):
        return "no term is false on every key after the query in some row"
    return None


def _orientation(v: torch.Tensor, sq: int, sk: int) -> str:
    """``row`` (.., Sq, 1), ``col`` (.., 1, Sk) or ``scalar`` (.., 1, 1): how a mask operand broadcasts; else
    ``other``."""
    shape = (1,) * max(0, 2 - v.dim()) + tuple(v.shape)
    last = shape[-2:]
    return {(sq, 1): "row", (1, sk): "col", (1, 1): "scalar"}.get(last, "other") if sq != 1 else "other"


def _causal_rows(t: torch.Tensor, r0: int, r1: int, sk: int) -> str | None:
    """None when rows ``r0:r1`` of mask ``t`` (bool "attend" or float 0 / masked) are the causal triangle's."""
    if t.dim() < 2 or tuple(t.shape[-2:]) != (r1 - r0, sk):
        return f"the mask's rows have shape {tuple(t.shape)}"
    if t.dtype == torch.bool:
        allowed = t
    else:
        allowed, drop = t == 0, t <= MASK_FILL_THRESHOLD
        if not bool((allowed | drop).all()):
            return "the float mask holds values other than 0 and a masking value (a bias)"
    tril = torch.arange(r0, r1, device=t.device)[:, None] >= torch.arange(sk, device=t.device)[None, :]
    if not bool((allowed == tril).all()):
        return "the mask is constant but not causal (a window, chunks, padding or bidirectional)"
    return None


def _full_size(n: fx.Node, sq: int, sk: int) -> bool:
    shape = shape_of(n)
    return shape is not None and len(shape) >= 2 and tuple(shape[-2:]) == (sq, sk)


def _eval_rows(big: list, const: ConstEval, sq: int, r0: int, r1: int) -> dict | None:
    """The big nodes' values for query rows ``r0:r1`` (smaller constant operands sliced where they span rows)."""
    vals: dict = {}

    def arg(a):
        if a in vals:
            return vals[a]
        v = const(a)
        if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[-2] == sq and sq != 1:
            v = v[..., r0:r1, :]
        return v

    try:
        for n in big:
            args = fx.node.map_arg(n.args, arg)
            kwargs = fx.node.map_arg(n.kwargs, arg)
            name = n.target if n.op == "call_method" else n.target.__name__
            if name == "expand":
                sizes = list(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple)) else list(args[1:])
                if len(sizes) >= 2 and sizes[-2] == sq:
                    sizes[-2] = r1 - r0
                args = (args[0], *sizes)
            if n.op == "call_function":
                vals[n] = n.target(*args, **kwargs)
            else:
                vals[n] = getattr(args[0], n.target)(*args[1:], **kwargs)
    except Exception:  # anything unexpected: not proven
        return None
    return vals
