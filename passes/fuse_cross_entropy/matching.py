"""The sites ``fuse_cross_entropy`` rewrites: output projection -> (casts, reshapes, slices, scaling,
soft-capping) -> ``F.cross_entropy``.

The head is matched with torch's pattern matcher (``torch._inductor.pattern_matcher``, building blocks in
:mod:`effpass.patterns`): :data:`PROJECTION` (``F.linear(h, W[, b])``) or :data:`LORA_HEAD` + :data:`LOW_RANK`
(``linear(h, W) + (linear(linear(x, A), B) * s).cast``), the output of a linear-like module with an adapter
(``effpass.linear_like``: a LoRA head, known by its module; the extra check is that the module's tensors are
the ones in the graph). The chain between the head and the loss is variadic: :func:`walk` goes back from each
cross-entropy through it (the hand-written part) and asks the head patterns at each node.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor
from torch._inductor import pattern_matcher as pm

from effpass.graph import Skip, autocast_dtype_at, copy_provenance, erase_dead, infer_fake_values, source_path  # noqa: F401
from effpass.graph import is_fn as _is_fn, is_method as _is_method, is_number as _is_number, val as _val  # noqa: F401
from effpass.graph import same_shape, same_size, size_hint
from effpass.linear_like import linear_parts
from effpass.patterns import Calls, OneOf, first_match, linear
from effpass.scope import module_path_of_node

# ------------------------------------------------------------------------------------------------------
_CE_FNS = {F.cross_entropy}
_MUL_FNS = {operator.mul, torch.mul, torch.multiply}
_DIV_FNS = {operator.truediv, torch.div, torch.true_divide, torch.divide}
_ADD_FNS = {operator.add, torch.add}
_TANH = {torch.tanh, torch.nn.functional.tanh}
_NOOP_METHODS = {"float", "to", "type_as", "contiguous", "type"}
_RESHAPE_METHODS = {"view", "reshape"}
_CE_PARAMS = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing")
_CE_DEFAULTS = {"weight": None, "size_average": None, "ignore_index": -100, "reduce": None, "reduction": "mean",
                "label_smoothing": 0.0}


def _linear_parts(n: fx.Node):
    """``(h, weight, bias)`` of a linear node."""
    args = list(n.args) + [None] * (3 - len(n.args))
    return args[0], args[1], n.kwargs.get("bias", args[2])


def ce_args(n: fx.Node) -> dict:
    out = dict(_CE_DEFAULTS)
    out.update(zip(_CE_PARAMS, n.args))
    out.update(n.kwargs)
    return out


@dataclass
class Site:
    ce: fx.Node
    proj: fx.Node                       # the node computing the raw logits (linear, or base + LoRA)
    h: fx.Node
    weight: fx.Node
    bias: Any
    lora: tuple | None                  # (u0, B, scaling) for a LoRA head
    chain: list[fx.Node]                # proj -> ... -> ce input, in graph order (proj excluded)
    shape_ops: list[fx.Node]            # the chain's shape ops, in order
    pre: float = 1.0
    softcap: bool = False
    post: float = 1.0
    lora_nodes: tuple = ()


def _scale_of(n: fx.Node) -> tuple[fx.Node, float] | None:
    """``(tensor input, factor)`` of a multiplication or division by a Python number."""
    if _is_fn(n, _MUL_FNS) or _is_method(n, {"mul", "__mul__"}):
        a, b = n.args[0], n.args[1] if len(n.args) > 1 else None
        if isinstance(a, fx.Node) and _is_number(b):
            return a, float(b)
        if isinstance(b, fx.Node) and _is_number(a):
            return b, float(a)
    if _is_fn(n, _DIV_FNS) or _is_method(n, {"div", "__truediv__"}):
        a, b = n.args[0], n.args[1] if len(n.args) > 1 else None
        if isinstance(a, fx.Node) and _is_number(b) and b != 0 and not n.kwargs.get("rounding_mode"):
            return a, 1.0 / float(b)
    return None


def _tensor_of(node: Any, model) -> Optional[Tensor]:
    """The parameter or buffer of ``model`` a torch-IR placeholder stands for (None otherwise)."""
    if not (isinstance(node, fx.Node) and node.op == "placeholder") or model is None:
        return None
    name = source_path(node)
    if not name:
        return None
    for get in (model.get_parameter, model.get_buffer):
        try:
            return get(name)
        except AttributeError:
            continue
    return None


# ------------------------------------------------------------------------------------------------------
# the head: torch pattern-matcher patterns (effpass.patterns), the module contract as their extra check
# ------------------------------------------------------------------------------------------------------
_KW = pm.KeywordArg


def _add(a: pm.PatternExpr, b: pm.PatternExpr) -> pm.PatternExpr:
    """``a + b`` in its torch-IR spellings (function, operator, method; canonical or not)."""
    return OneOf(pm.CallFunction([torch.add, operator.add], a, b, _users=pm.MULTIPLE),
                 pm.CallMethod(["add", "__add__"], a, b, _users=pm.MULTIPLE))


#: the plain projection: ``F.linear(h, W[, b])``
PROJECTION = linear(_KW("h"), _KW("weight"))
#: a LoRA head: ``linear(h, W[, b]) + casts(scaled)`` in either order (``scaled``: the adapter's scaled low-rank
#: product; the casts are ``.type_as(result)`` / ``.to(dtype)``, any number)
_BRANCH = Calls(_KW("scaled"), methods={"type_as", "to"}, name="casts")
LORA_HEAD = (_add(linear(_KW("h"), _KW("weight")), _BRANCH), _add(_BRANCH, linear(_KW("h"), _KW("weight"))))
#: the adapter's low-rank product ``linear(linear(x, A), B)`` (biases: the extra check's)
LOW_RANK = linear(linear(_KW("x"), _KW("a")), _KW("b"))
_ANY_ADD = _add(pm.Arg(), pm.Arg())


def _adapter_head(n: fx.Node, model):
    """The output of a linear-like module with one adapter (``effpass.linear_like``: a LoRA head) ->
    ``(base linear, u0, B, scale, nodes)``. The patterns :data:`LORA_HEAD` and :data:`LOW_RANK` say the graph is
    ``linear(h, W, b) + (linear(u0, B) * scale).cast`` with ``u0 = linear(x, A)``; the extra check, that the
    contract's tensors (base weight, A, B, scale) are the ones the graph uses and that the adapter has no bias."""
    if model is None or n.kwargs or first_match([_ANY_ADD], n) is None:
        return None
    path = module_path_of_node(n)
    try:
        module = model.get_submodule(path) if path else None
    except AttributeError:
        return None
    parts = linear_parts(module) if module is not None else None
    if parts is None or not parts.adapters:
        return None
    if len(parts.adapters) != 1:
        raise Skip(f"the head {path} has {len(parts.adapters)} adapters (one is supported)")
    ad = parts.adapters[0]
    for base, pattern in zip(n.args, LORA_HEAD):
        m = first_match([pattern], n)
        if m is None or not isinstance(m.kwargs["scaled"], fx.Node) or _tensor_of(m.kwargs["weight"], model) \
                is not parts.weight:
            continue
        nodes = [n, *m.kwargs["casts"]]
        x, scale = m.kwargs["scaled"], 1.0
        if (sc := _scale_of(x)) is not None:
            nodes.append(x)
            x, scale = sc
        if not math.isclose(scale, ad.scale, rel_tol=1e-12):
            raise Skip(f"the head {path}'s adapter is scaled by {scale} in the graph, {ad.scale} by its module")
        low = first_match([LOW_RANK], x)
        if low is None or _linear_parts(x)[2] is not None or _tensor_of(low.kwargs["b"], model) is not ad.b \
                or _linear_parts(x.args[0])[2] is not None or _tensor_of(low.kwargs["a"], model) is not ad.a:
            continue
        nodes.append(x)
        return base, x.args[0], low.kwargs["b"], scale, nodes
    raise Skip(f"the head {path} is linear-like with an adapter, but its graph is not "
                "linear(h, W) + scale * linear(linear(h, A), B) on its tensors")


def match(ce: fx.Node, model=None) -> Site:
    a = ce_args(ce)
    if a["weight"] is not None:
        raise Skip("class weights (weight=...) are not supported")
    if a["size_average"] is not None or a["reduce"] is not None:
        raise Skip("deprecated size_average/reduce arguments")
    if a["reduction"] not in ("mean", "sum", "none"):
        raise Skip(f"reduction {a['reduction']!r} is not a constant 'mean', 'sum' or 'none'")
    if not _is_number(a["ignore_index"]) or not _is_number(a["label_smoothing"]):
        raise Skip("ignore_index or label_smoothing is not a constant")
    x, t = _val(a["input"]), _val(a["target"])
    if not (isinstance(x, torch.Tensor) and x.dim() == 2 and isinstance(t, torch.Tensor) and t.dim() == 1
            and not t.dtype.is_floating_point):
        raise Skip("input is not (N, V) logits with (N,) class-index targets")
    return walk(a["input"], ce, model)


def walk(logits: fx.Node, anchor: fx.Node, model=None) -> Site:
    """The projection behind ``logits`` (read by ``anchor``: the loss) and the chain between them."""
    x = _val(logits)
    chain: list[fx.Node] = []
    n = logits
    while True:
        if not isinstance(n, fx.Node):
            raise Skip("the logits do not come from a tensor in this graph")
        if n.op == "placeholder":
            raise Skip(f"the logits are a graph input ({n.name}): the projection is in another graph "
                        "(a graph break between the head and the loss?; a Hugging Face model whose loss_type is "
                        "None, such as GPT2LMHeadModel, breaks there; effpass.compile sets it, or call "
                        "effpass.integrations.huggingface.set_hf_loss_type(model) or "
                        "model.loss_type = 'ForCausalLM' before compiling)")
        if (proj := first_match([PROJECTION], n)) is not None:
            site = Site(anchor, n, proj.kwargs["h"], proj.kwargs["weight"], _linear_parts(n)[2], None, [], [])
            break
        lora = _adapter_head(n, model)
        if lora is not None:
            base, u0, bw, s, nodes = lora
            h, w, b = _linear_parts(base)
            site = Site(anchor, n, h, w, b, (u0, bw, s), [], [], lora_nodes=tuple(nodes) + (base,))
            break
        if _is_method(n, _NOOP_METHODS):
            if n.target in ("to", "type") and not all(isinstance(v, (torch.dtype, torch.device, str)) or v is None
                                                      for v in list(n.args[1:]) + list(n.kwargs.values())
                                                      if not isinstance(v, fx.Node)):
                raise Skip(f"cast {n.name} has unusual arguments")
            out = _val(n)
            if out is not None and not out.dtype.is_floating_point:
                raise Skip(f"{n.name} casts the logits to a non-float dtype")
            chain.append(n)
            n = n.args[0]
            continue
        if (sc := _scale_of(n)) is not None or _is_fn(n, _TANH) or _is_method(n, {"tanh"}):
            chain.append(n)
            n = sc[0] if sc is not None else n.args[0]
            continue
        if (_is_method(n, _RESHAPE_METHODS | {"flatten"}) or _is_fn(n, {torch.reshape, torch.flatten})
                or _is_fn(n, {operator.getitem})):
            chain.append(n)
            n = n.args[0]
            continue
        raise Skip(f"the logits pass through {n.op} {getattr(n.target, '__name__', n.target)!s} ({n.name}), "
                    "which is not a cast, scale, soft-cap, reshape or slice")
    chain.reverse()
    site.chain = chain
    vocab = _val(site.proj).shape[-1] if _val(site.proj) is not None else None
    if not isinstance(vocab, int) or vocab != x.shape[-1]:
        raise Skip("the vocabulary size is not static or the logits' last dim changes")
    tanh_seen = False
    for c in chain:
        if (sc := _scale_of(c)) is not None:
            if tanh_seen:
                site.post *= sc[1]
            else:
                site.pre *= sc[1]
        elif _is_fn(c, _TANH) or _is_method(c, {"tanh"}):
            if tanh_seen:
                raise Skip("two tanh soft-caps")
            tanh_seen = True
        elif not _is_method(c, _NOOP_METHODS):
            site.shape_ops.append(c)
    site.softcap = tanh_seen
    if not tanh_seen:
        site.pre, site.post = site.pre * site.post, 1.0
    return site


def replay_shape(graph: fx.Graph, op: fx.Node, src: fx.Node, vocab: int, width: int) -> fx.Node:
    """The shape op ``op`` (on logits with last dim ``vocab``) applied to ``src`` (last dim ``width``)."""
    in_val = _val(op.args[0])
    ndim = in_val.dim() if isinstance(in_val, torch.Tensor) else None
    if _is_fn(op, {operator.getitem}):
        idx = op.args[1]
        items = list(idx) if isinstance(idx, tuple) else [idx]
        if ndim is None or any(isinstance(i, fx.Node) or i is None or isinstance(i, torch.Tensor) for i in items):
            raise Skip(f"slice {op.name} uses tensors or new axes")
        if Ellipsis in items:
            after = items[items.index(Ellipsis) + 1:]
            touches_last = bool(after) and after[-1] != slice(None)
        else:
            touches_last = len(items) >= ndim and items[ndim - 1] != slice(None)
        if touches_last:
            raise Skip(f"slice {op.name} selects along the vocabulary dim")
        return graph.call_function(operator.getitem, (src, op.args[1]))
    if _is_method(op, {"flatten"}) or _is_fn(op, {torch.flatten}):
        start = op.args[1] if len(op.args) > 1 else op.kwargs.get("start_dim", 0)
        end = op.args[2] if len(op.args) > 2 else op.kwargs.get("end_dim", -1)
        if ndim is None or not (isinstance(start, int) and isinstance(end, int)) or end % ndim == ndim - 1:
            raise Skip(f"flatten {op.name} merges the vocabulary dim")
        return graph.call_function(torch.flatten, (src, start, end))
    shape = list(op.args[1:]) if _is_method(op, _RESHAPE_METHODS) else [op.args[1]]
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        shape = list(shape[0])
    if any(not isinstance(s, int) for s in shape) or not shape or shape[-1] not in (vocab, -1):
        raise Skip(f"reshape {op.name} has symbolic sizes or moves the vocabulary dim")
    if shape[-1] == vocab:
        shape[-1] = width
    return graph.call_function(torch.reshape, (src, tuple(shape)))


def set_meta(nodes: list[fx.Node], like: fx.Node) -> None:
    """Provenance from ``like`` and fake example values for the new nodes (an op that fails on fake tensors
    raises: the caller leaves the site alone)."""
    for n in nodes:
        copy_provenance(n, like)
    infer_fake_values(nodes, strict=True)


def erase_unused(graph: fx.Graph, nodes) -> None:
    """Erase the matched nodes that nothing uses any more, consumers first."""
    erase_dead(graph, nodes)




# ------------------------------------------------------------------------------------------------------
# chosen-token log-probabilities: log_softmax(z).gather(-1, t), gather(z, -1, t) - logsumexp(z, -1)
# ------------------------------------------------------------------------------------------------------
_LOG_SOFTMAX_FNS = {F.log_softmax, torch.log_softmax, torch.nn.functional.log_softmax}
_GATHER_FNS = {torch.gather}
_LSE_FNS = {torch.logsumexp}
_SUB_FNS = {operator.sub, torch.sub, torch.subtract}


@dataclass
class LogProbSite:
    """``out = log_softmax(logits)[..., index]`` (``index``: the gather's ``(..., 1)`` index); ``nodes`` are
    the nodes the fused op replaces (besides the logits chain), ``out`` the node whose uses it takes."""

    site: Site
    out: fx.Node
    index: fx.Node
    nodes: tuple
    squeezed: bool = False              # the output drops the index's last (size 1) dim


def _last_dim(dim: Any, ndim: int) -> bool:
    return isinstance(dim, int) and dim % ndim == ndim - 1


def _arg(n: fx.Node, i: int, name: str, default=None):
    if len(n.args) > i:
        return n.args[i]
    return n.kwargs.get(name, default)


def _gather_parts(n: Any):
    """``(source, index)`` of ``gather(source, -1, index)`` (function or method), else None."""
    if not (_is_fn(n, _GATHER_FNS) or _is_method(n, {"gather"})):
        return None
    src, dim, idx = _arg(n, 0, "input"), _arg(n, 1, "dim"), _arg(n, 2, "index")
    v = _val(src)
    if not (isinstance(src, fx.Node) and isinstance(idx, fx.Node) and isinstance(v, torch.Tensor)
            and _last_dim(dim, v.dim()) and not n.kwargs.get("sparse_grad", False)):
        return None
    iv = _val(idx)
    # symbolic dims (a packed length) compare without a guard; sizes only equal in the traced example (the index's
    # length and the logits' rows from different inputs, as after an FSDP boundary) are taken here and guarded to
    # stay equal once the site is known to be a head's (_guard_rows), never guarded for another gather
    if not (isinstance(iv, torch.Tensor) and iv.dim() == v.dim() and same_size(iv.shape[-1], 1)
            and (same_shape(iv.shape[:-1], v.shape[:-1])
                 or [size_hint(d) for d in iv.shape[:-1]] == [size_hint(d) for d in v.shape[:-1]])):
        return None
    return src, idx


def _guard_rows(src: fx.Node, idx: fx.Node) -> None:
    """The guard that keeps a fused log-prob site's index rows equal to its logits' rows (see _gather_parts)."""
    if not same_shape(_val(idx).shape[:-1], _val(src).shape[:-1], guard=True):
        raise Skip(f"the index {idx.name} and the logits {src.name} have different rows")


def _lse_of(n: Any, keep: bool):
    """The logits of ``logsumexp(z, -1)`` (``keep``: with ``keepdim=True`` or followed by ``unsqueeze(-1)``),
    and the nodes of the form, else None."""
    nodes = [n]
    if keep and (_is_method(n, {"unsqueeze"}) or _is_fn(n, {torch.unsqueeze})):
        v = _val(n)
        if not (isinstance(v, torch.Tensor) and _last_dim(_arg(n, 1, "dim"), v.dim())):
            return None
        n = n.args[0]
        nodes.append(n)
        keep = False
    if not (_is_fn(n, _LSE_FNS) or _is_method(n, {"logsumexp"})) or bool(_arg(n, 2, "keepdim", False)) != keep:
        return None
    z, dim = n.args[0], _arg(n, 1, "dim")
    if isinstance(dim, (list, tuple)) and len(dim) == 1:
        dim = dim[0]
    zv = _val(z)
    if not (isinstance(zv, torch.Tensor) and _last_dim(dim, zv.dim())):
        return None
    return z, nodes


def _squeezed_last(n: Any):
    """``x`` of ``x.squeeze(-1)`` (method or function), else None."""
    if not (_is_method(n, {"squeeze"}) or _is_fn(n, {torch.squeeze})) or len(n.args) != 2:
        return None
    v = _val(n.args[0])
    return n.args[0] if isinstance(v, torch.Tensor) and _last_dim(n.args[1], v.dim()) else None


def match_logprob(n: fx.Node, model=None) -> Optional[LogProbSite]:
    """A chosen-token log-probability site ending at ``n``, or None when ``n`` is not one (``Skip`` when it
    is one the pass cannot fuse)."""
    g = _gather_parts(n)
    if g is not None:  # log_softmax(z, -1).gather(-1, t)
        ls, idx = g
        if not (_is_fn(ls, _LOG_SOFTMAX_FNS) or _is_method(ls, {"log_softmax"})):
            return None
        zv = _val(ls.args[0])
        if not isinstance(zv, torch.Tensor) or not _last_dim(_arg(ls, 1, "dim"), zv.dim()) \
                or _arg(ls, 2, "dtype", None) is not None or (len(ls.args) > 3) or "_stacklevel" in ls.kwargs:
            raise Skip(f"log_softmax {ls.name} is not over the last dim (or has a dtype)")
        if len(ls.users) != 1:
            raise Skip(f"the full log-probabilities {ls.name} are used elsewhere")
        site = walk(ls.args[0], n, model)
        _guard_rows(ls, idx)
        return LogProbSite(site, n, idx, (n, ls))
    if (_is_fn(n, _SUB_FNS) or _is_method(n, {"sub", "__sub__"})) and len(n.args) == 2 and not n.kwargs:
        a = n.args[0]
        inner = _squeezed_last(a)
        gnodes = [a] if inner is None else [a, inner]
        g = _gather_parts(gnodes[-1])
        lse = _lse_of(n.args[1], keep=inner is None) if isinstance(n.args[1], fx.Node) else None
        if g is None or lse is None or g[0] is not lse[0]:
            return None
        for m in [*gnodes, *lse[1]]:
            if len(m.users) != 1:
                raise Skip(f"{m.name} (part of a log-probability) is used elsewhere")
        site = walk(g[0], n, model)
        _guard_rows(g[0], g[1])
        return LogProbSite(site, n, g[1], (n, *gnodes, *lse[1]), squeezed=inner is not None)
    return None
