"""``fuse_attention``'s K/V forms: ``k^T`` back to ``k`` (:func:`strip_transpose`), and K/V heads repeated for GQA/MQA
back to the un-repeated tensor and its factor (:func:`unrepeat`): HF ``repeat_kv`` as torch pattern-matcher patterns
(``kv[:, :, None].expand(...).reshape(...)`` and its spellings), the axis and shapes as their extra check;
``repeat_interleave`` and ``arange(H) // r`` indexing (proved by constant evaluation)."""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch._inductor import pattern_matcher as pm

from effpass.graph import arg, is_fn, is_method, is_number, shape_of
from effpass.patterns import first_match

from .proofs import ConstEval

__all__ = ["strip_transpose", "match_repeat_kv", "unrepeat"]


def strip_transpose(kt: fx.Node) -> fx.Node | None:
    """k when ``kt`` is ``k.transpose(-2, -1)`` (any spelling), else None."""
    shape = shape_of(kt)
    if shape is None:
        return None
    nd = len(shape)
    if is_fn(kt, {torch.transpose}):
        d0, d1 = kt.args[1], kt.args[2]
        if isinstance(d0, int) and isinstance(d1, int) and {d0 % nd, d1 % nd} == {nd - 2, nd - 1}:
            return kt.args[0]
    if is_method(kt, {"permute"}) or is_fn(kt, {torch.permute}):
        dims = kt.args[1:] if is_method(kt, {"permute"}) else kt.args[1]
        if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
            dims = dims[0]
        dims = [d % nd for d in dims] if all(isinstance(d, int) for d in dims) else None
        if dims == list(range(nd - 2)) + [nd - 1, nd - 2]:
            return kt.args[0]
    return None


# ------------------------------------------------------------------------------------------------------
# K/V repeated for GQA/MQA: pattern, then the extra check
# ------------------------------------------------------------------------------------------------------
def _repeat_kv_patterns() -> list:
    """HF ``repeat_kv``: ``kv[:, :, None].expand(B, Hkv, r, S, D).reshape(B, H, S, D)`` and its spellings
    (``unsqueeze(kv, 2)``; ``expand`` with a size tuple; ``view``/``torch.reshape``; sizes as a tuple)."""
    def sizes(n):  # NOTE: one Ignored per position: a pattern object met twice must match one node
        return [pm.Ignored() for _ in range(n)]

    kv = pm.KeywordArg("kv")
    inserts = [pm.CallMethod("unsqueeze", kv, pm.KeywordArg("dim"), _users=pm.MULTIPLE),
               pm.CallFunction(torch.unsqueeze, kv, pm.KeywordArg("dim"), _users=pm.MULTIPLE),
               pm.CallFunction(operator.getitem, kv, pm.KeywordArg("index"), _users=pm.MULTIPLE)]
    expands = [pm.CallMethod("expand", ins, *sizes(k), _users=pm.MULTIPLE) for ins in inserts for k in (5, 1)]
    return [p for e in expands for p in (
        pm.CallMethod(["reshape", "view"], e, *sizes(4), _users=pm.MULTIPLE),
        pm.CallMethod(["reshape", "view"], e, *sizes(1), _users=pm.MULTIPLE),
        pm.CallFunction(torch.reshape, e, *sizes(1), _users=pm.MULTIPLE))]


_REPEAT_KV = _repeat_kv_patterns()


def match_repeat_kv(n: fx.Node) -> pm.Match | None:
    return first_match(_REPEAT_KV, n)


def unrepeat(n: fx.Node, const: ConstEval) -> tuple[fx.Node, int] | None:
    """(un-repeated K or V, repeat factor) when ``n`` repeats KV heads as ``repeat_interleave`` does."""
    shape = shape_of(n)
    if shape is None or len(shape) != 4:
        return None
    B, H, S, D = shape
    # expand + reshape (HF repeat_kv), with the new axis right after the heads: the fixed shape of the
    # pattern by torch's pattern matcher, the axis and shapes as its extra check
    m = match_repeat_kv(n)
    if m is not None:
        z, x, y = m.kwargs["kv"], n.args[0], n.args[0].args[0]
        xs, ys = shape_of(x), shape_of(y)
        if xs is None or ys is None or len(xs) != 5 or len(ys) != 5:
            return None
        if ys[2] != 1 or ys[:2] + ys[3:] != xs[:2] + xs[3:]:
            return None
        if xs[0] != B or xs[1] * xs[2] != H or xs[3:] != (S, D):
            return None
        if "dim" in m.kwargs:
            if not (isinstance(m.kwargs["dim"], int) and m.kwargs["dim"] % 5 == 2):
                return None
        else:
            idx = m.kwargs["index"]
            idx = idx if isinstance(idx, tuple) else (idx,)
            full = all(i is None or i is Ellipsis or i == slice(None) for i in idx)
            if not (full and sum(i is None for i in idx) == 1 and Ellipsis not in idx and idx.index(None) == 2):
                return None
        if shape_of(z) == (B, xs[1], S, D):
            return z, xs[2]
        return None
    if is_method(n, {"reshape", "view"}) or is_fn(n, {torch.reshape}):
        return None
    # repeat_interleave(r, dim=1)
    if is_method(n, {"repeat_interleave"}) or is_fn(n, {torch.repeat_interleave}):
        r = arg(n, 1, "repeats")
        d = arg(n, 2, "dim")
        z = n.args[0]
        if is_number(r) and isinstance(d, int) and d % 4 == 1 and shape_of(z) == (B, H // int(r), S, D):
            return z, int(r)
        return None
    # indexing with arange(H) // r along the head dim
    idx, z = None, None
    if is_fn(n, {operator.getitem}) and isinstance(n.args[1], tuple) and len(n.args[1]) >= 2:
        sel = n.args[1]
        if sel[0] == slice(None) and isinstance(sel[1], fx.Node) and all(s == slice(None) for s in sel[2:]):
            idx, z = sel[1], n.args[0]
    elif is_fn(n, {torch.index_select}) or is_method(n, {"index_select"}):
        if arg(n, 1, "dim") in (1, -3):
            idx, z = arg(n, 2, "index"), n.args[0]
    if idx is not None and shape_of(z) is not None and len(shape_of(z)) == 4:
        hkv = shape_of(z)[1]
        t = const(idx)
        if isinstance(t, torch.Tensor) and hkv and H % hkv == 0 and t.shape == (H,):
            r = H // hkv
            if torch.equal(t.cpu().long(), torch.arange(H) // r):
                return z, r
    return None

