"""Row-wise functions of the output projections' distributions, found for ``fuse_cross_entropy``: entropy,
KL and JSD between two heads (distillation: a student and a teacher), z-loss, and anything else computed row
by row from the logits (``log_softmax``, ``softmax``, ``logsumexp``, elementwise arithmetic, reductions over
the vocabulary, ``gather`` of per-row indices, ``F.kl_div``).

A *region* is a connected set of such row-local nodes fed by one or two projections' logits (*entries*: the
end of a chain ``walk`` accepts) and by per-row tensors (masks, indices); its *outputs* are its per-row values
read outside it. The region is copied into a small graph ``(z0[, z1], *row inputs) -> outputs`` on 2-D row
blocks (leading dims flattened; dims normalised to ``-1``), which ``effpass::linear_rowwise`` evaluates on
blocks of full rows, its backward differentiating the same graph by autograd per block: the result and every
gradient are the unfused graph's ops, only the rows are cut.

A reduction over everything (``.sum()``, ``.mean()``, ``F.kl_div(..., reduction="batchmean")``) of a
vocabulary-sized region value is split: the region sums each row, the graph sums the rows (and divides).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

from effpass.graph import Skip, is_fn as _is_fn, is_method as _is_method, same_shape, val as _val

from .matching import Site, walk

_LOG_SOFTMAX = {F.log_softmax, torch.log_softmax, torch.special.log_softmax}
_SOFTMAX = {F.softmax, torch.softmax, torch.special.softmax}
_LSE = {torch.logsumexp, torch.special.logsumexp}
#: ops whose output starts a region (their input is walked back to a projection)
SEED_FNS = _LOG_SOFTMAX | _SOFTMAX | _LSE
SEED_METHODS = {"log_softmax", "softmax", "logsumexp"}

_UNARY_FNS = {torch.exp, torch.log, torch.neg, operator.neg, torch.abs, torch.sigmoid, torch.tanh, torch.square,
              torch.sqrt, torch.log1p, torch.expm1, torch.relu, torch.clamp, torch.clamp_min, torch.clamp_max,
              torch.nan_to_num, F.logsigmoid, torch.exp2, torch.log2, torch.rsqrt, torch.reciprocal}
_UNARY_METHODS = {"exp", "log", "neg", "__neg__", "abs", "sigmoid", "tanh", "square", "sqrt", "log1p", "expm1",
                  "relu", "clamp", "clamp_min", "clamp_max", "nan_to_num", "detach", "float", "to", "contiguous",
                  "exp2", "log2", "rsqrt", "reciprocal"}
_BINARY_FNS = {operator.add, operator.sub, operator.mul, operator.truediv, operator.pow, torch.add, torch.sub,
               torch.subtract, torch.mul, torch.multiply, torch.div, torch.divide, torch.true_divide, torch.pow,
               torch.xlogy, torch.special.xlogy, torch.maximum, torch.minimum, torch.where, torch.rsub}
_BINARY_METHODS = {"add", "sub", "mul", "div", "pow", "xlogy", "maximum", "minimum", "__add__", "__sub__", "__mul__",
                   "__truediv__", "__pow__", "__radd__", "__rsub__", "__rmul__", "__rtruediv__", "__rpow__"}
_ROW_REDUCE_FNS = {torch.sum, torch.mean, torch.amax, torch.logsumexp, torch.special.logsumexp}
_ROW_REDUCE_METHODS = {"sum", "mean", "amax", "logsumexp"}
_GATHER = {torch.gather}


def _dim_arg(n: fx.Node) -> tuple[str | int | None, Any]:
    """Where the ``dim`` argument of a reduction / softmax / gather is (kwarg name or position) and its value."""
    if "dim" in n.kwargs:
        return "dim", n.kwargs["dim"]
    pos = 1
    if len(n.args) > pos:
        return pos, n.args[pos]
    return None, None


def _row_dim(dim: Any, ndim: int) -> bool:
    if isinstance(dim, (list, tuple)) and len(dim) == 1:
        dim = dim[0]
    return isinstance(dim, int) and not isinstance(dim, bool) and dim % ndim == ndim - 1


def _full_reduce_kind(u: fx.Node) -> Optional[str]:
    """``"sum"`` / ``"mean"`` for a reduction of everything (no dim, no dtype), else None."""
    if (_is_method(u, {"sum", "mean"}) or _is_fn(u, {torch.sum, torch.mean})) and len(u.args) == 1 \
            and not u.kwargs:
        return "sum" if (u.target in ("sum",) or u.target is torch.sum) else "mean"
    return None


def _kl_div_parts(n: fx.Node):
    """``(input, target, reduction, log_target)`` of ``F.kl_div`` (constant reduction/log_target), else None."""
    if not _is_fn(n, {F.kl_div}):
        return None
    names = ("input", "target", "size_average", "reduce", "reduction", "log_target")
    a = dict(zip(names, n.args))
    a.update(n.kwargs)
    if a.get("size_average") is not None or a.get("reduce") is not None:
        return None
    red, lt = a.get("reduction", "mean"), a.get("log_target", False)
    if red not in ("none", "sum", "mean", "batchmean") or not isinstance(lt, bool):
        return None
    return a["input"], a["target"], red, lt


@dataclass
class Region:
    entries: list[fx.Node]                      # the logits nodes (one or two)
    sites: list[Site]                           # their projections (walk)
    members: list[fx.Node]                      # region nodes, graph order
    externals: list[fx.Node] = field(default_factory=list)   # per-row tensors read by members
    outputs: list[fx.Node] = field(default_factory=list)     # per-row members read outside
    splits: list[tuple[fx.Node, fx.Node, str]] = field(default_factory=list)  # (vocab member, outside user, kind)
    leading: tuple = ()
    vocab: int = 0


class _Grow:
    """Membership tests for one graph: which nodes are row-local functions of entries."""

    def __init__(self, graph: fx.Graph, model):
        self.graph, self.model = graph, model
        self.order = {n: i for i, n in enumerate(graph.nodes)}

    def shape(self, n):
        v = _val(n)
        return tuple(v.shape) if isinstance(v, torch.Tensor) else None

    def tail(self, n, leading, vocab) -> Optional[tuple]:
        """``(V,)``, ``(1,)`` or ``()`` when ``n``'s value is row-aligned with ``leading``, else None. Symbolic
        dims (a packed length) compare by their expressions, never guarded on."""
        s = self.shape(n)
        if s is None:
            return None
        if same_shape(s, leading):
            return ()
        if len(s) == len(leading) + 1 and same_shape(s[:-1], leading) and isinstance(s[-1], int) \
                and s[-1] in (vocab, 1):
            return (s[-1],)
        return None


def _tensor_inputs(n: fx.Node) -> list:
    out = []
    for a in list(n.args) + list(n.kwargs.values()):
        if isinstance(a, fx.Node):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(x for x in a if isinstance(x, fx.Node))
    return out


def _scalars_ok(n: fx.Node, skip: set) -> bool:
    """Every non-node argument is a number, bool, dtype, None or a dim (lists of ints)."""
    for a in list(n.args) + list(n.kwargs.values()):
        if isinstance(a, fx.Node):
            v = _val(a)
            if not isinstance(v, torch.Tensor) and a not in skip:
                return False  # a symbolic scalar computed in the graph
            continue
        if a is None or isinstance(a, (bool, int, float, torch.dtype, str)):
            continue
        if isinstance(a, (list, tuple)) and all(isinstance(x, int) for x in a):
            continue
        return False
    return True


def row_local(n: fx.Node, ndim_of) -> Optional[str]:
    """The kind of a row-local op (``"unary"``, ``"binary"``, ``"softmax"``, ``"reduce"``, ``"gather"``,
    ``"kl"``), else None. ``ndim_of(node)`` gives an input's rank."""
    if n.op not in ("call_function", "call_method"):
        return None
    if _is_fn(n, _UNARY_FNS) or _is_method(n, _UNARY_METHODS):
        if n.target in ("to",) and any(isinstance(a, torch.device) or (isinstance(a, str) and a not in ())
                                       for a in n.args[1:]):
            return None
        return "unary"
    if _is_fn(n, _BINARY_FNS) or _is_method(n, _BINARY_METHODS):
        return "binary"
    if _is_fn(n, _LOG_SOFTMAX | _SOFTMAX) or _is_method(n, {"log_softmax", "softmax"}):
        where, dim = _dim_arg(n)
        src = n.args[0]
        if where is None or not isinstance(src, fx.Node) or not _row_dim(dim, ndim_of(src)):
            return None
        if len(n.args) > 2 or any(k not in ("dim",) for k in n.kwargs):
            return None  # a dtype or _stacklevel: left alone
        return "softmax"
    if _is_fn(n, _ROW_REDUCE_FNS) or _is_method(n, _ROW_REDUCE_METHODS):
        where, dim = _dim_arg(n)
        src = n.args[0]
        if where is None or not isinstance(src, fx.Node) or not _row_dim(dim, ndim_of(src)):
            return None
        if any(k not in ("dim", "keepdim") for k in n.kwargs) or len(n.args) > 3:
            return None
        return "reduce"
    if _is_fn(n, _GATHER) or _is_method(n, {"gather"}):
        where, dim = _dim_arg(n)
        src = n.args[0]
        if where is None or not isinstance(src, fx.Node) or not _row_dim(dim, ndim_of(src)) \
                or n.kwargs.get("sparse_grad", False):
            return None
        return "gather"
    if _is_fn(n, {torch.squeeze, torch.unsqueeze}) or _is_method(n, {"squeeze", "unsqueeze"}):
        where, dim = _dim_arg(n)
        src = n.args[0]
        grow = 1 if n.target in ("unsqueeze", torch.unsqueeze) else 0
        if where is None or not isinstance(src, fx.Node) or not _row_dim(dim, ndim_of(src) + grow):
            return None
        return "squeeze"
    kl = _kl_div_parts(n)
    if kl is not None and kl[2] == "none":
        return "kl"
    return None


def find_regions(graph: fx.Graph, model, done: set) -> tuple[list[Region], list[dict]]:
    """Every region of the graph (and, for seeds that cannot be fused, why)."""
    g = _Grow(graph, model)
    skipped: list[dict] = []
    # 1. entries: the inputs of seeds (log_softmax / softmax / logsumexp over the last dim) that walk back to a
    #    projection
    #    NOTE(reduction seeds): a reduction over the vocabulary of a head's logits with no softmax at all (a mean
    #    logit per token, logged as a metric, e.g. by TRL's ORPO; a max) is a seed too, so the head is not kept
    #    whole for it after its log-probs are fused; it only seeds where it walks back to a projection
    entries: dict[fx.Node, Site] = {}
    for n in graph.nodes:
        reduction = _is_fn(n, _ROW_REDUCE_FNS - _LSE) or _is_method(n, _ROW_REDUCE_METHODS - {"logsumexp"})
        if n in done or not (_is_fn(n, SEED_FNS) or _is_method(n, SEED_METHODS) or reduction):
            continue
        src = n.args[0] if n.args else None
        if reduction and _is_method(src, {"detach"}):
            src = src.args[0]  # a metric of detached logits: the detach is a member of the region
        if not isinstance(src, fx.Node) or src in entries:
            continue
        sv = _val(src)
        if not isinstance(sv, torch.Tensor) or sv.dim() < 1 or not _row_dim(_dim_arg(n)[1], sv.dim()):
            continue
        try:
            site = walk(src, n, model)
        except Skip as e:
            if reduction or "graph input" in str(e) or "not a cast" in str(e):
                continue  # not a projection's logits (attention scores, a router's, ...) or not reachable
            skipped.append({"node": n, "reason": str(e)})
            continue
        pv, hv = _val(site.proj), _val(site.h)
        if isinstance(pv, torch.Tensor) and isinstance(hv, torch.Tensor) and pv.shape[-1] < 2 * hv.shape[-1]:
            continue  # a narrow projection (a router's, a classifier's): not a vocabulary
        entries[src] = site
    if not entries:
        return [], skipped

    # 2. the row-local closure of all entries, in graph order
    def ndim_of(a):
        v = _val(a)
        return v.dim() if isinstance(v, torch.Tensor) else -1

    member: dict[fx.Node, fx.Node] = {e: e for e in entries}   # node -> its component's root (union-find)

    def find(a):
        while member[a] is not a:
            member[a] = member[member[a]]
            a = member[a]
        return a

    first = min(g.order[e] for e in entries)
    for n in list(graph.nodes)[first:]:
        if n in member or n in done:
            continue
        kind = row_local(n, ndim_of)
        if kind is None:
            continue
        ins = _tensor_inputs(n)
        inside = [a for a in ins if a in member]
        if not inside or not _scalars_ok(n, set()):
            continue
        if kind == "gather":
            idx = n.args[2] if len(n.args) > 2 else n.kwargs.get("index")
            if idx in member or not isinstance(idx, fx.Node):
                continue
        member[n] = n
        for a in inside:
            ra, rn = find(a), find(n)
            if ra is not rn:
                member[ra] = rn
    # a KL reduced over everything (F.kl_div(..., reduction="batchmean")) joins its two inputs' components
    for n in graph.nodes:
        kl = _kl_div_parts(n)
        if kl is not None and kl[2] != "none" and kl[0] in member and kl[1] in member:
            ra, rb = find(kl[0]), find(kl[1])
            if ra is not rb:
                member[ra] = rb
    comps: dict[fx.Node, list[fx.Node]] = {}
    for n in member:
        comps.setdefault(find(n), []).append(n)
    regions: list[Region] = []
    for nodes in comps.values():
        ents = sorted((n for n in nodes if n in entries), key=g.order.get)
        mem = sorted((n for n in nodes if n not in entries), key=g.order.get)
        if not mem:
            continue
        try:
            regions.append(_check(g, ents, [entries[e] for e in ents], mem))
        except Skip as e:
            skipped.append({"node": mem[0], "reason": str(e)})
    return regions, skipped


def _check(g: _Grow, ents, sites, mem) -> Region:
    """Validates a component: one or two entries with the same rows and vocabulary, every value row-aligned,
    vocabulary-sized values read only inside (or by a reduction of everything, which is split), per-row
    externals without gradient."""
    if len(ents) > 2:
        raise Skip(f"{len(ents)} projections feed one row-wise computation (at most two are fused: a student "
                   "and a teacher)")
    ev = [_val(e) for e in ents]
    if any(not same_shape(v.shape, ev[0].shape) for v in ev) or not isinstance(ev[0].shape[-1], int):
        raise Skip("the two heads' logits differ in shape (or have a symbolic vocabulary): "
                   + ", ".join(str(tuple(v.shape)) for v in ev))
    leading, vocab = tuple(ev[0].shape[:-1]), int(ev[0].shape[-1])
    region = Region(list(ents), list(sites), list(mem), leading=leading, vocab=vocab)
    inside = set(ents) | set(mem)
    for n in mem:
        tail = g.tail(n, leading, vocab)
        if tail is None:
            raise Skip(f"{n.name} is not row-aligned with the logits' rows {leading} (shape {g.shape(n)})")
        for a in _tensor_inputs(n):
            if a in inside or a in region.externals:
                continue
            t = g.tail(a, leading, vocab)
            av = _val(a)
            if t is None:
                raise Skip(f"{n.name} reads {a.name} (shape {g.shape(a)}), which is not row-aligned with the "
                           f"logits' rows {leading}")
            if isinstance(av, torch.Tensor) and av.requires_grad:
                raise Skip(f"{n.name} reads {a.name}, a row-aligned tensor that needs a gradient")
            # a vocabulary-sized one (a teacher's logits computed in another graph) is read row block by row block
            region.externals.append(a)
        outside = [u for u in n.users if u not in inside]
        if not outside:
            continue
        if tail == (vocab,):
            for u in outside:
                kind = _full_reduce_kind(u)
                kl = _kl_div_parts(u)
                if kind is None and kl is not None and kl[2] != "none" and kl[0] in inside and (
                        kl[1] in inside or _frozen_rows(g, kl[1], leading, vocab)):
                    # NOTE(frozen target): a teacher's log-probs computed from logits of another graph (its head
                    # before an FSDP boundary) are read row block by row block, as any per-row input without grad
                    if kl[1] not in inside and kl[1] not in region.externals:
                        region.externals.append(kl[1])
                    kind = "kl_" + kl[2]
                if kind is None:
                    raise Skip(f"the vocabulary-sized {n.name} is read by {u.name} outside the row-wise "
                               "computation (the full distribution would be materialised)")
                if all(s[1] is not u for s in region.splits):
                    region.splits.append((n, u, kind))
        else:
            region.outputs.append(n)
    if not region.outputs and not region.splits:
        raise Skip("the row-wise computation has no per-row result")
    return region


def _frozen_rows(g: _Grow, n, leading, vocab) -> bool:
    """``n`` is a vocabulary-sized tensor row-aligned with the logits that needs no gradient."""
    v = _val(n)
    return isinstance(v, torch.Tensor) and not v.requires_grad and g.tail(n, leading, vocab) == (vocab,)


def build_row_fn(region: Region) -> tuple[fx.GraphModule, list]:
    """The region as ``(z0[, z1], *externals) -> tuple of per-row outputs`` on 2-D row blocks, and the list of
    what each output is: ``("node", member)`` or ``("split", outside user)``."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, e in enumerate(region.entries):
        env[e] = g.placeholder(f"z{i}")
    for i, x in enumerate(region.externals):
        env[x] = g.placeholder(f"r{i}")

    def ndim(a):
        v = _val(a)
        return v.dim() if isinstance(v, torch.Tensor) else 0

    def row_args(n):
        args, kwargs = list(n.args), dict(n.kwargs)
        kind = row_local(n, ndim)
        if kind in ("softmax", "reduce", "gather", "squeeze"):
            where, _ = _dim_arg(n)
            if where == "dim":
                kwargs["dim"] = -1
            else:
                args[where] = -1
        return fx.node.map_arg(tuple(args), lambda a: env[a]), fx.node.map_arg(kwargs, lambda a: env[a])

    def emit(n):
        args, kwargs = row_args(n)
        node = g.create_node(n.op, n.target, args, kwargs)
        v = _val(n)
        # NOTE(grad mode): a value computed under no_grad (a teacher's) carries no gradient in the original
        # graph; the row function runs under autograd in the backward, so such values are cut here
        if isinstance(v, torch.Tensor) and not v.requires_grad:
            node = g.call_method("detach", (node,))
        env[n] = node

    for n in region.members:
        emit(n)
    outs, what = [], []
    for n in region.outputs:
        outs.append(env[n])
        what.append(("node", n))
    for n, u, kind in region.splits:
        src = n
        if kind.startswith("kl_"):
            a, b, _, lt = _kl_div_parts(u)
            node = g.call_function(F.kl_div, (env[a], env[b]), {"reduction": "none", "log_target": lt})
            if not (_val(u) is not None and _val(u).requires_grad):
                node = g.call_method("detach", (node,))
            outs.append(g.call_method("sum", (node, -1)))
        else:
            outs.append(g.call_method("sum", (env[src], -1)))
        what.append(("split", u))
    g.output(tuple(outs))
    gm = fx.GraphModule(torch.nn.Module(), g)
    return gm, what
