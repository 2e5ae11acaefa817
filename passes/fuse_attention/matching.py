"""``fuse_attention``'s matcher: the attention spine as torch pattern-matcher patterns, the variadic scale and mask
chain as the pattern's extra check.

Patterns (``torch._inductor.pattern_matcher``, on canonical torch-IR graphs, :mod:`effpass.canonicalize`):

* the spine :data:`SPINE`: ``softmax(scores, dim) [-> cast | view | dropout]{0..4} -> (weights @ v)``
  (``torch.matmul``/``torch.bmm``; the canonical ``torch.softmax(x, dim)``, its ``dtype`` keyword free; every
  node before ``@ v`` with one user; the ops between, :class:`effpass.patterns.Calls`);
* the score root :data:`QK_ROOTS`: ``q @ k^T`` (``matmul``/``bmm``) or BLOOM's ``bias.baddbmm(q, k^T)``;
* HF ``repeat_kv`` (:func:`unrepeat`, in :mod:`._attention_kv` with ``k^T -> k``): ``kv[:, :, None].expand(...)
  .reshape(...)`` and its spellings.

The extra check (:func:`match_site`), where a fixed pattern cannot say it: what each op between the softmax
and ``@ v`` is (a dtype-only cast, a same-shape view, BLOOM's ``(B*H, S, S)`` view once, one dropout with a
constant probability); the chain from the softmax's input down to a score root, of any length (scales by
constant positive numbers, additive masks, ``masked_fill``/``where`` fills, casts, same-shape views, BLOOM's
head split, in-place forms canonicalize had to keep); that no mask is computed from the scores; and, in
:mod:`._attention_proofs`, what constant evaluation proves (causal masks, rows that attend to some key, GQA
index tensors). A softmax no spine pattern matches gets its reason from :func:`_explain_no_spine`.

NOTE: the patterns are matched with ``PatternExpr.match`` per softmax rather than by a ``PatternMatcherPass``:
every softmax in scope gets a reason when it is left alone, and ``PatternMatcherPass.apply`` discards matches
that span autocast enter/exit nodes (it treats them as mutation barriers), which attention under an autocast
region does.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._inductor import pattern_matcher as pm

from effpass.canonicalize import INPLACE_FORMS
from effpass.graph import MASK_FILL_THRESHOLD, Skip, ancestors, arg, is_fn, is_method, is_number, op_name, shape_of, val
from effpass.patterns import Calls, first_match

from .kv import match_repeat_kv, strip_transpose, unrepeat  # noqa: F401  (the K/V forms)
from .proofs import ConstEval, fill_value_ok, static_shape

__all__ = ["Site", "SPINE", "QK_ROOTS", "spine_of", "match_site", "strip_transpose", "unrepeat", "match_repeat_kv"]

# NOTE(canonical): the manager canonicalizes torch-IR graphs first (effpass.canonicalize): one function per op
# (torch.matmul, torch.mul, torch.div, torch.add, torch.masked_fill, torch.transpose, torch.softmax) and in-place
# forms out of place where no alias sees the difference. In-place forms below are the ones it had to keep.
_MATMUL_FNS = {torch.matmul, torch.bmm}
_MUL_FNS = {torch.mul, operator.imul}
_DIV_FNS = {torch.div, operator.itruediv}
_ADD_FNS = {torch.add, operator.iadd}
#: shape-only ops that keep every element in place when the shape does not change
_SAME_SHAPE_VIEWS = {"view", "reshape", "contiguous", "flatten", "unflatten"}
_CAST_METHODS = {"to", "type", "float", "half", "bfloat16", "double", "type_as"}
_DROPOUT_FNS = {F.dropout, torch.dropout}
#: the ops the spine pattern allows between the softmax and ``@ v`` (what each does is the extra check's)
_WEIGHTS_METHODS = _CAST_METHODS | _SAME_SHAPE_VIEWS
_WEIGHTS_FNS = {torch.Tensor.to, torch.reshape, torch.flatten} | _DROPOUT_FNS
#: the most ops between the softmax and ``@ v`` (HF: cast, dropout; BLOOM: cast, dropout, view)
MAX_WEIGHTS_OPS = 4


# ------------------------------------------------------------------------------------------------------
# the patterns
# ------------------------------------------------------------------------------------------------------
def _spine_patterns() -> list[pm.PatternExpr]:
    # canonical softmax: torch.softmax(x, dim), dtype by keyword (a keyword the pattern does not name is free); then
    # up to MAX_WEIGHTS_OPS casts, views and dropouts with any argument list, each with one user (what each does is
    # the extra check's)
    sm = pm.CallFunction(torch.softmax, pm.KeywordArg("scores"), pm.KeywordArg("dim"))
    weights = Calls(sm, methods=_WEIGHTS_METHODS, fns=_WEIGHTS_FNS, max_len=MAX_WEIGHTS_OPS, single_user=True)
    return [pm.CallFunction(list(_MATMUL_FNS), weights, pm.KeywordArg("v"))]


#: softmax(scores) [-> cast | view | dropout]{0..4} -> weights @ v
SPINE = _spine_patterns()
#: the scores' root: q @ k^T, or BLOOM's beta * bias + alpha * (q @ k^T) (beta/alpha keywords: the extra check's)
QK_ROOTS = [pm.CallFunction(list(_MATMUL_FNS), pm.KeywordArg("q"), pm.KeywordArg("k_t"), _users=pm.MULTIPLE)] + [
    p for fn in (torch.baddbmm, "baddbmm") for p in (
        (pm.CallFunction if fn is torch.baddbmm else pm.CallMethod)(
            fn, pm.KeywordArg("bias"), pm.KeywordArg("q"), pm.KeywordArg("k_t"), _users=pm.MULTIPLE),
        (pm.CallFunction if fn is torch.baddbmm else pm.CallMethod)(
            fn, pm.KeywordArg("bias"), batch1=pm.KeywordArg("q"), batch2=pm.KeywordArg("k_t"), _users=pm.MULTIPLE))]


def spine_of(sm: fx.Node) -> pm.Match | None:
    """The match of :data:`SPINE` that ``sm`` (a softmax) is part of, or None: tried at the ``matmul``/``bmm``
    its single users lead to (the pattern's anchor), at most ``MAX_WEIGHTS_OPS + 1`` nodes on. Looked up when
    the site is matched, so that a rewrite of an earlier site (its ``@ v`` feeding this one) is seen."""
    y = sm
    for _ in range(MAX_WEIGHTS_OPS + 1):
        if len(y.users) != 1:
            return None
        y = next(iter(y.users))
        if is_fn(y, _MATMUL_FNS):
            m = first_match(SPINE, y)
            return m if m is not None and m.nodes[0] is sm else None  # depth first: the softmax comes first
    return None


# ------------------------------------------------------------------------------------------------------
# predicates of the extra check
# ------------------------------------------------------------------------------------------------------
def _is_matmul(n: Any) -> bool:
    return is_fn(n, _MATMUL_FNS)


def _is_baddbmm(n: Any) -> bool:
    """``bias.baddbmm(q, k^T, beta=, alpha=)`` / ``torch.baddbmm``: ``beta * bias + alpha * (q @ k^T)`` (BLOOM)."""
    return is_fn(n, {torch.baddbmm}) or is_method(n, {"baddbmm"})


def _merge_view_heads(n: Any) -> tuple | None:
    """(B, H) when ``n`` views a (B, H, S, T) tensor as (B*H, S, T) (BLOOM's weights before ``bmm`` with v)."""
    if not (is_method(n, {"view", "reshape"}) or is_fn(n, {torch.reshape})):
        return None
    src = n.args[0] if n.args else None
    a, b = shape_of(src), shape_of(n)
    if static_shape(a) and static_shape(b) and len(a) == 4 and len(b) == 3 and a[0] * a[1] == b[0] and a[2:] == b[1:]:
        return a[0], a[1]
    return None


def _is_cast(n: Any) -> bool:
    """A dtype-only cast: same shape and device, floating in and out."""
    if not (is_method(n, _CAST_METHODS) or (is_fn(n, {torch.Tensor.to}))):
        return False
    src, out = val(n.args[0]), val(n)
    return (isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor) and src.shape == out.shape
            and src.device == out.device and src.dtype.is_floating_point and out.dtype.is_floating_point)


def _dropout_of(n: Any) -> float | None:
    """The dropout probability of a dropout node (0.0 when inactive), or None if ``n`` is not one."""
    if is_fn(n, {F.dropout}):
        p, training = arg(n, 1, "p", 0.5), arg(n, 2, "training", True)
        inplace = arg(n, 3, "inplace", False)
    elif is_fn(n, {torch.dropout}):
        p, training, inplace = arg(n, 1, "p", 0.5), arg(n, 2, "train", True), False
    else:
        return None
    if not is_number(p) or not isinstance(training, bool) or inplace:
        raise Skip("dropout probability or training flag is not a constant")
    return float(p) if training else 0.0


def _single_user(n: fx.Node, what: str) -> fx.Node:
    users = list(n.users)
    if len(users) != 1:
        raise Skip(f"{what} ({n.name}) is used elsewhere (e.g. attention weights returned to the caller)")
    return users[0]


def _is_inplace(n: Any) -> bool:
    """An in-place arithmetic op (``/=``, ``*=``, ``+=``, ``masked_fill_``, ``add_``...)."""
    return isinstance(n, fx.Node) and ((n.op == "call_function" and n.target in INPLACE_FORMS)
                                       or (n.op == "call_method" and n.target in INPLACE_FORMS))


def _is_same_shape_view(n: Any) -> bool:
    """A view/reshape/contiguous that keeps the shape (Falcon's ``scores.view(b, h, q, kv)``)."""
    if not (is_method(n, _SAME_SHAPE_VIEWS) or is_fn(n, {torch.reshape, torch.flatten})):
        return False
    src = n.args[0] if n.args else None
    return isinstance(src, fx.Node) and shape_of(src) is not None and shape_of(src) == shape_of(n)


def _depends_on_matmul(n: fx.Node) -> bool:
    return any(_is_matmul(a) or _is_baddbmm(a) for a in ancestors(n))


def _split_view_of(n: Any, heads: tuple) -> bool:
    """``n`` views a (B*H, S, T) tensor as (B, H, S, T) with ``heads == (B, H)`` (BLOOM's scores)."""
    if not (is_method(n, {"view", "reshape"}) or is_fn(n, {torch.reshape})):
        return False
    src = n.args[0] if n.args else None
    a, b = shape_of(src), shape_of(n)
    return (static_shape(a) and static_shape(b) and len(a) == 3 and len(b) == 4 and tuple(b[:2]) == tuple(heads)
            and a[0] == b[0] * b[1] and a[1:] == b[2:])


# ------------------------------------------------------------------------------------------------------
# the match: pattern, then the extra check
# ------------------------------------------------------------------------------------------------------
@dataclass
class Site:
    softmax: fx.Node
    qk: fx.Node = None
    pv: fx.Node = None
    q: fx.Node = None
    k: fx.Node = None                 # (…, Sk, D); None: k^T must be transposed back
    k_t: fx.Node = None
    v: fx.Node = None
    scale: float = 1.0
    additive: list = field(default_factory=list)   # [(node, factor)]
    allowed: list = field(default_factory=list)    # [(node, negate)]: bool masks, True = attend
    dropout_p: float = 0.0
    chain: list = field(default_factory=list)      # nodes replaced by the fused call
    causal: bool = False
    gqa: bool = False
    #: (B, H) when q, k, v and the scores' matmul are laid out as (B*H, S, D) and the scores/weights are viewed
    #: as (B, H, Sq, Sk) around the softmax (BLOOM); mask terms in ``split_terms`` are in the (B*H, ...) layout
    heads: tuple | None = None
    split_terms: set = field(default_factory=set)



def _weights_op(site: Site, y: fx.Node) -> bool:
    """Take ``y``, an op between the softmax and ``@ v``, into the site if it is one the fused call absorbs: a
    dtype-only cast, a same-shape view, BLOOM's (B*H, S, S) view (once), a dropout (once; its probability
    becomes ``dropout_p``)."""
    if _is_cast(y) or _is_same_shape_view(y):
        pass
    elif (hm := _merge_view_heads(y)) is not None and site.heads is None:
        site.heads = hm
    else:
        p = _dropout_of(y)
        if p is None:
            return False
        if site.dropout_p:
            raise Skip("two dropouts on the attention weights")
        site.dropout_p = p
    site.chain.append(y)
    return True


def _explain_no_spine(sm: fx.Node) -> Skip:
    """Why no spine pattern matched at ``sm`` (the reason the extra check would give, found in the same order)."""
    site, y, what = Site(softmax=sm), sm, "the softmax output"
    while True:
        nxt = _single_user(y, what)
        if not _weights_op(site, nxt):
            break
        y, what = nxt, "the attention weights"
    if _is_matmul(nxt) and nxt.args and nxt.args[0] is y and len(nxt.args) == 2:
        return Skip(f"more than {MAX_WEIGHTS_OPS} casts, views and dropouts between the softmax and weights @ v")
    return Skip(f"the attention weights feed {op_name(nxt)}, not weights @ v")


def match_site(sm: fx.Node, const: ConstEval) -> Site:
    """The site of the attention whose softmax is ``sm``, or :class:`Skip` with the reason it is left alone."""
    site = Site(softmax=sm)
    x = sm.args[0] if sm.args else sm.kwargs.get("input")
    if not isinstance(x, fx.Node) or shape_of(x) is None:
        raise Skip("softmax input is not a tensor")
    ndim = len(shape_of(x))
    dim = arg(sm, 1, "dim", None)
    if not isinstance(dim, int) or dim % ndim != ndim - 1:
        raise Skip(f"softmax over a different dim ({dim}), not the last one")
    if ndim < 3:
        raise Skip("scores are not batched (fewer than 3 dims)")

    # -- the spine: softmax -> casts, views, dropout -> weights @ v ------------------------------------
    spine = spine_of(sm)
    if spine is None:
        raise _explain_no_spine(sm)
    site.chain.append(sm)
    *ops, pv = spine.nodes[1:]
    for y in ops:
        if not _weights_op(site, y):
            raise Skip(f"the attention weights feed {op_name(y)}, not weights @ v")
    site.pv, site.v = pv, pv.args[1]

    # -- backward from softmax: scale, masks, casts, down to q @ k^T -----------------------------------
    x_shape = shape_of(x)
    chain_back = []
    split_seen = False
    order = {n: i for i, n in enumerate(sm.graph.nodes)}
    consumer, done_inplace = sm, set()
    while True:
        # an in-place op on the scores before they are read (``att.masked_fill_(m, -inf); softmax(att)``):
        # Dynamo keeps the read on the original node, so the mutation is only visible as another user
        inplace = [u for u in x.users if u is not consumer and u not in done_inplace and _is_inplace(u)
                   and u.args and u.args[0] is x and order[u] < order[consumer]]
        if inplace:
            if len(inplace) > 1:
                raise Skip("the scores are mutated in place by several ops between the matmul and the softmax")
            cur = inplace[0]
            done_inplace.add(cur)
        elif (root := first_match(QK_ROOTS, x)) is not None:
            break
        else:
            cur = x
        if cur is x and site.heads is not None and not split_seen and _split_view_of(cur, site.heads):
            # BLOOM: (B*H, Sq, Sk) scores viewed as (B, H, Sq, Sk); below this point terms are in the 3-D layout
            chain_back.append(cur)
            split_seen, nxt = True, cur.args[0]
            others = [u for u in nxt.users if u is not cur]
            if others:
                raise Skip(f"the attention scores ({nxt.name}) are used elsewhere")
            consumer, x, x_shape = x, nxt, shape_of(nxt)
            continue
        if any(_is_inplace(u) and u.args and u.args[0] is x and order[u] > order[consumer] for u in x.users):
            raise Skip("the scores are mutated in place after the softmax reads them")
        if shape_of(cur) != x_shape:
            raise Skip(f"{op_name(cur)} broadcasts the scores to another shape")
        chain_back.append(cur)
        args = cur.args
        if _is_cast(cur):
            nxt = args[0]
        elif _is_same_shape_view(cur):
            nxt = args[0]
        elif is_fn(cur, _MUL_FNS) or is_method(cur, {"mul_", "__imul__"}):
            a, b = args[0], args[1]
            nxt, c = (a, b) if isinstance(a, fx.Node) and not isinstance(b, fx.Node) else (b, a)
            if not is_number(c):
                raise Skip("scale not constant (multiplied by a tensor)")
            if c <= 0:
                raise Skip(f"scale not constant positive ({c})")
            site.scale *= c
        elif is_fn(cur, _DIV_FNS) or is_method(cur, {"div_", "__itruediv__"}):
            nxt, c = args[0], args[1]
            if cur.kwargs.get("rounding_mode") is not None:
                raise Skip("scores divided with a rounding mode")
            if not is_number(c):
                raise Skip("scale not constant (divided by a tensor)")
            if c <= 0:
                raise Skip(f"scale not constant positive (1/{c})")
            site.scale /= c
        elif is_fn(cur, _ADD_FNS) or is_method(cur, {"add_", "__iadd__"}):
            if cur.kwargs.get("alpha", 1) != 1:
                raise Skip("scores added with alpha")
            a, b = args[0], args[1]
            a_chain = isinstance(a, fx.Node) and shape_of(a) == x_shape
            nxt, m = (a, b) if a_chain and (not isinstance(b, fx.Node) or shape_of(b) != x_shape
                                            or not _depends_on_matmul(b)) else (b, a)
            if is_number(m):
                pass  # a constant shift: softmax is invariant to it
            elif isinstance(m, fx.Node):
                # walking back: softmax input = scale * node + terms, so a term added here is scaled by
                # every multiplication that comes after it in the program (those seen so far)
                site.additive.append((m, site.scale))
                if split_seen:
                    site.split_terms.add(m)
            else:
                raise Skip(f"scores added to {type(m).__name__}")
        elif is_method(cur, {"masked_fill_"}) or is_fn(cur, {torch.masked_fill}):
            nxt, mask, value = args[0], arg(cur, 1, "mask"), arg(cur, 2, "value")
            if not fill_value_ok(value, const):
                raise Skip(f"masked_fill with {value!r} is not a mask (needs -inf or <= {MASK_FILL_THRESHOLD:g})")
            site.allowed.append((mask, True))
            if split_seen:
                site.split_terms.add(mask)
        elif is_fn(cur, {torch.where}) and len(args) == 3:
            cond, a, b = args
            if a is not None and isinstance(a, fx.Node) and shape_of(a) == x_shape and fill_value_ok(b, const):
                nxt, negate = a, False
            elif isinstance(b, fx.Node) and shape_of(b) == x_shape and fill_value_ok(a, const):
                nxt, negate = b, True
            else:
                raise Skip("where() on the scores does not fill with -inf or a large negative value")
            site.allowed.append((cond, negate))
            if split_seen:
                site.split_terms.add(cond)
        else:
            raise Skip(f"unrecognised op {op_name(cur)} between q @ k^T and softmax")
        if not isinstance(nxt, fx.Node):
            raise Skip("scores chain is broken")
        if cur is not x:
            continue  # the in-place op was applied to x itself: x is processed next, for the same consumer
        others = [u for u in nxt.users if u is not cur and not (_is_inplace(u) and u.args and u.args[0] is nxt)]
        if others:
            if any(nxt in ancestors(m) for m, _ in site.additive + site.allowed if isinstance(m, fx.Node)):
                raise Skip("mask depends on data (it is computed from the attention scores)")
            raise Skip(f"the attention scores ({nxt.name}) are used elsewhere")
        consumer, x = x, nxt
    if site.heads is not None and not split_seen:
        raise Skip("the attention weights are viewed as (batch*heads, q, k) but the scores were not split the same way")
    site.qk = x
    site.chain.extend(chain_back)
    site.chain.append(x)
    site.q, site.k_t = root.kwargs["q"], root.kwargs["k_t"]
    if "bias" in root.kwargs:
        # beta * bias + alpha * (q @ k^T): the bias is one more additive term (scaled like the scores after it)
        bias, beta, alpha = root.kwargs["bias"], x.kwargs.get("beta", 1), x.kwargs.get("alpha", 1)
        if not (is_number(beta) and is_number(alpha)) or alpha <= 0:
            raise Skip(f"baddbmm with beta={beta!r}, alpha={alpha!r} (needs constant numbers, alpha > 0)")
        if isinstance(bias, fx.Node) and beta != 0:
            site.additive.append((bias, site.scale * beta))
            if split_seen:
                site.split_terms.add(bias)
        elif not (is_number(bias) or beta == 0):
            raise Skip("baddbmm bias is not a tensor")
        site.scale *= alpha
    if not all(isinstance(n, fx.Node) for n in (site.q, site.k_t, site.v)):
        raise Skip("q, k or v is not a tensor")

    # masks must not be computed from the scores themselves
    for m, _ in site.additive + site.allowed:
        if not isinstance(m, fx.Node):
            raise Skip("mask is not a tensor")
        anc = ancestors(m)
        if any(n in anc for n in site.chain) or site.pv in anc:
            raise Skip("mask depends on data (it is computed from the attention scores)")
    for m, _ in site.additive:
        mv = val(m)
        if not isinstance(mv, torch.Tensor) or not mv.dtype.is_floating_point:
            raise Skip("additive term is not a float tensor")
        if mv.requires_grad:
            raise Skip("bias is not a mask: it requires grad (a learned bias such as T5's relative bias)")
    for m, _ in site.allowed:
        mv = val(m)
        if not isinstance(mv, torch.Tensor) or mv.dtype != torch.bool:
            raise Skip("mask is not a boolean tensor")
    return site
