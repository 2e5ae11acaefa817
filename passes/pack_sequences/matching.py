"""``pack_sequences``'s matcher: which nodes are attention sites, where the boundaries enter the graph, and the
per-example positions that replace absolute row positions (``arange(N)``) in masks and scalings.

* sites: calls of the core's attention-op registry (:func:`effpass.attention.attention_op`; arguments by
  :func:`effpass.attention.sdpa_arguments`) and softmaxes over a square ``(..., N, N)`` score matrix, or over
  ``cat([scores, sinks], -1)`` (learned attention sinks);
* :func:`find_boundary`: the boundary input (a placeholder, or the context setter of a hook traced inline);
* :func:`per_example_positions`: an abstract interpretation of how each position-derived value changes when
  positions shift by an example's offset, and the copies that read per-example positions instead.
"""
from __future__ import annotations

import operator
import re

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from effpass.attention import attention_op, sdpa_arguments
from effpass.graph import Skip, ancestors, annotate_new_nodes, shape_of, tensor_meta

from .ops import CONTEXT_SET_OPS

__all__ = ["is_sdpa", "attention_scores", "sdpa_args", "pair_cost", "scores_pair_cost", "find_boundary",
           "varlen_usable", "same", "per_example_positions", "TOKENS_RE"]

_PLACEHOLDER_RE = re.compile(r"^L_(?:kwargs_)?(seq_idx|cu_seq_lens_q|cu_seq_lens_k|position_ids)_$")
TOKENS_RE = re.compile(r"^L_(?:kwargs_)?(input_ids|inputs_embeds|tokens)_$")


def same(a, b) -> bool:
    """Two lengths are equal: statically, or, for symbols the model never relates, by a guard on it."""
    if static_same(a, b):
        return True
    try:
        # NOTE(dynamic lengths): the boundary's and the tokens' lengths are separate symbols when the model
        # never relates them (Falcon with ALiBi ignores position_ids). Evaluating the comparison guards on
        # it (as Dynamo does when it specialises): equal lengths, the only valid input, reuse the graph.
        return bool(a == b)
    except Exception:
        return False


def is_sdpa(n: fx.Node) -> bool:
    """A call of a fused attention op with SDPA's signature (the core's registry, :mod:`effpass.attention`:
    SDPA, masked_sdpa and what other passes register). A registered op that takes no extra mask is a site
    too: :class:`effpass.passes.pack_sequences.PackSequences` refuses it (it cannot be isolated)."""
    return attention_op(n) is not None


def _softmax_input(sm: fx.Node) -> fx.Node | None:
    """The input of a softmax over the last dim of a tensor of >= 3 dims, else None."""
    x = sm.args[0] if sm.args else sm.kwargs.get("input")
    sh = shape_of(x)
    if sh is None or len(sh) < 3:
        return None
    dim = sm.args[1] if len(sm.args) > 1 else sm.kwargs.get("dim")
    if not isinstance(dim, int) or dim % len(sh) != len(sh) - 1:
        return None
    return x


def attention_scores(sm: fx.Node) -> tuple[fx.Node, fx.Node | None] | None:
    """``(scores, None)`` for a softmax over a square ``(..., S, S)`` score matrix; ``(scores, cat)`` for a
    softmax over ``cat([scores, extra], -1)`` where ``scores`` is square (learned attention sinks: N x (N+k));
    None for any other softmax (not attention: MoE routing, ...)."""
    x = _softmax_input(sm)
    if x is None:
        return None
    sh = shape_of(x)
    if static_same(sh[-1], sh[-2]):
        return x, None
    src = x
    for _ in range(6):  # back through elementwise steps between the cat and the softmax (casts, x - x.max())
        if src.op == "call_function" and src.target in (torch.cat, torch.concat, torch.concatenate):
            break
        nxt = src.args[0] if src.args and isinstance(src.args[0], fx.Node) else None
        if nxt is None or src.op not in ("call_function", "call_method") or shape_of(nxt) != sh:
            return None
        src = nxt
    if src.op == "call_function" and src.target in (torch.cat, torch.concat, torch.concatenate):
        parts = src.args[0] if src.args else src.kwargs.get("tensors")
        dim = src.args[1] if len(src.args) > 1 else src.kwargs.get("dim", 0)
        if isinstance(parts, (list, tuple)) and parts and isinstance(parts[0], fx.Node):
            ps = shape_of(parts[0])
            if ps is not None and isinstance(dim, int) and dim % len(ps) == len(ps) - 1 and static_same(ps[-1], ps[-2]):
                return parts[0], src
    return None


def static_same(a, b) -> bool:
    """Two lengths (ints or symbols) are known equal without a guard."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    try:
        return bool(statically_known_true(a == b))
    except Exception:
        return False


def sdpa_args(n: fx.Node):
    """(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa) of an attention-op call (Skip: not usable)."""
    vals = sdpa_arguments(n)
    q, k, v = vals.get("query"), vals.get("key"), vals.get("value")
    if not all(isinstance(t, fx.Node) for t in (q, k, v)):
        raise Skip("q, k or v is not a tensor")
    if shape_of(q) is None or len(shape_of(q)) != 4:
        raise Skip("q is not (batch, heads, length, head_dim)")
    is_causal = vals.get("is_causal", False)
    dropout = vals.get("dropout_p", 0.0)
    if not isinstance(is_causal, bool):
        raise Skip("is_causal is not a constant")
    mask = vals.get("attn_mask")
    if mask is not None and not isinstance(mask, fx.Node):
        raise Skip("attn_mask is not a tensor")
    return q, k, v, mask, dropout, is_causal, vals.get("scale"), bool(vals.get("enable_gqa", False))


def _static(x) -> int:
    try:
        return int(x)
    except Exception:  # a symbolic size with no static value
        return 0


def pair_cost(q: fx.Node, v: fx.Node) -> int:
    """FLOPs per attended (query, key) pair and row of an SDPA call: ``2*H*D`` for ``q @ k^T`` plus
    ``2*H*Dv`` for ``p @ v``."""
    qs, vs = shape_of(q), shape_of(v)
    return 2 * _static(qs[-3]) * (_static(qs[-1]) + _static(vs[-1] if vs else qs[-1]))


def scores_pair_cost(scores: fx.Node) -> int:
    """FLOPs per pair and row of hand-written attention: heads from the scores' shape, the head dim from the
    ``q @ k^T`` matmul found by walking back through elementwise ops (scaling, soft-capping)."""
    sh = shape_of(scores)
    heads = _static(sh[-3]) if len(sh) >= 3 else 1
    n, d = scores, 0
    for _ in range(8):
        if not isinstance(n, fx.Node) or n.op not in ("call_function", "call_method"):
            break
        if n.target in (torch.matmul, torch.bmm, "matmul", "__matmul__") or getattr(n.target, "__name__", "") in (
                "matmul", "bmm", "matmul_"):
            qs = shape_of(n.args[0]) if n.args else None
            d = _static(qs[-1]) if qs else 0
            break
        n = next((a for a in n.args if isinstance(a, fx.Node) and shape_of(a) is not None), None)
    return 4 * heads * d


def find_boundary(graph: fx.Graph) -> tuple[str, fx.Node] | None:
    found = {}
    for n in graph.nodes:
        if n.op == "call_function" and n.target in CONTEXT_SET_OPS:  # the hook, traced inline
            return "position_ids", n
        if n.op != "placeholder":
            continue
        m = _PLACEHOLDER_RE.match(str(n.target))
        v = tensor_meta(n)
        if m and isinstance(v, torch.Tensor) and not v.dtype.is_floating_point:
            found[m.group(1)] = n
    # NOTE: position_ids first: its length is the packed length (cu_seq_lens need it separately)
    for kind in ("seq_idx", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k"):
        if kind in found:
            return kind, found[kind]
    return None


def varlen_usable(q: fx.Node, mask, dropout_p) -> bool:
    """torch's varlen kernel takes this site: CUDA, fp16/bf16, no mask but causal, no dropout, and this torch
    has ``torch.nn.attention.varlen`` (feature-tested)."""
    if mask is not None or (not isinstance(dropout_p, (int, float))) or dropout_p != 0.0:
        return False
    v = tensor_meta(q)
    if not (isinstance(v, torch.Tensor) and v.is_cuda and v.dtype in (torch.float16, torch.bfloat16)):
        return False
    if v.shape[-1] % 8 or v.shape[-1] > 256:
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True



# ------------------------------------------------------------------------------------------------------
# per-example positions for masks and scalings computed from absolute row positions (``arange(N)``)
# ------------------------------------------------------------------------------------------------------
_INPLACE_FN = {"iadd": "add", "isub": "sub", "imul": "mul", "itruediv": "truediv", "ifloordiv": "floordiv",
               "iand": "and_", "ior": "or_", "ixor": "xor", "imod": "mod"}
_VIEWS = {"view", "reshape", "unsqueeze", "expand", "expand_as", "to", "contiguous", "clone", "float", "long", "int",
          "type_as", "flatten", "squeeze", "transpose", "permute", "repeat", "__getitem__", "getitem", "detach"}
_CMP = {"lt", "le", "gt", "ge", "eq", "ne", "__lt__", "__le__", "__gt__", "__ge__", "__eq__", "__ne__"}
_LOGIC = {"and_", "or_", "xor", "__and__", "__or__", "__xor__", "invert", "__invert__", "logical_and", "logical_or",
          "logical_not", "bitwise_and", "bitwise_or", "bitwise_not", "where", "masked_fill", "abs"}


def _op_of(n: fx.Node) -> str:
    t = n.target
    name = t if isinstance(t, str) else getattr(t, "__name__", str(t))
    return _INPLACE_FN.get(name, name[:-1] if name.endswith("_") and not name.endswith("__") else name)


def _is_row_arange(n: fx.Node, n_len) -> bool:
    """``torch.arange(N)`` / ``arange(0, N)`` / ``arange(0, N, 1)`` of the packed length: absolute row positions."""
    if n.op != "call_function" or n.target is not torch.arange:
        return False
    sh = shape_of(n)
    if sh is None or len(sh) != 1 or not same(sh[0], n_len):
        return False
    args = list(n.args)
    start = n.kwargs.get("start", args[0] if len(args) >= 2 else 0)
    step = n.kwargs.get("step", args[2] if len(args) >= 3 else 1)
    return isinstance(start, int) and start == 0 and isinstance(step, int) and step == 1


def _absolute_index(n: fx.Node, dep: set[fx.Node], n_len) -> bool:
    """``n`` indexes a per-token tensor (a dim of the packed length) with a position-derived index: the index
    names a token of the row, so it must stay absolute (a padding mask read at ``kv_idx``)."""
    op = _op_of(n)
    if op in ("getitem", "__getitem__") and len(n.args) >= 2:
        base, idx = n.args[0], n.args[1]
        idx_nodes = [a for a in (idx if isinstance(idx, (tuple, list)) else (idx,)) if isinstance(a, fx.Node)]
        if not any(a in dep for a in idx_nodes) or not isinstance(base, fx.Node):
            return False
    elif op in ("index_select", "gather", "take_along_dim", "index"):
        base = n.args[0] if n.args else None
    else:
        return False
    sh = shape_of(base) if isinstance(base, fx.Node) else None
    return sh is not None and any(static_same(d, n_len) for d in sh)


def _shift_class(order: list[fx.Node], aranges: set[fx.Node], dep: set[fx.Node], n_len) -> dict[fx.Node, str]:
    """Abstract interpretation: how each position-derived value changes when every absolute position shifts by
    one example's offset: "P" shifts with it, "I" is unchanged (differences, comparisons of two positions, a
    per-token value read at a position), "X" changes otherwise (``pos // chunk``, ``log(pos)``)."""
    cls: dict[fx.Node, str] = {a: "P" for a in aranges}
    for n in order:
        if n in cls or n not in dep:
            continue
        ins = [cls.get(a, "C") for a in n.all_input_nodes]  # "C": does not depend on positions
        op = _op_of(n)
        if _absolute_index(n, dep, n_len):
            c = "I"
        elif "X" in ins:
            c = "X"
        elif op in _VIEWS:
            c = cls.get(n.args[0], "I") if isinstance(n.args[0], fx.Node) else "I"
        elif op in ("add", "__add__", "__radd__"):
            c = "X" if ins.count("P") > 1 else ("P" if "P" in ins else "I")
        elif op in ("sub", "__sub__", "__rsub__"):
            c = "I" if ins.count("P") == 2 else ("P" if "P" in ins else "I")
        elif op in _CMP:
            c = "I" if ins.count("P") in (0, 2) else "X"
        elif op in _LOGIC:
            c = "I" if "P" not in ins else "X"
        else:
            c = "I" if "P" not in ins else "X"
        cls[n] = c
    return cls


def per_example_positions(graph: fx.Graph, site: fx.Node, pro, call) -> int:
    """Give the masks and scalings that reach ``site`` from absolute row positions (``arange(N)``, e.g. HF's
    ``cache_position``: a chunked local-attention mask, a position-dependent attention temperature) the
    per-example positions instead: the position-derived nodes between the ``arange`` and the site are copied
    with the positions substituted (indexing a per-token tensor keeps the absolute index), and the site reads
    the copies. Returns the number of ``arange`` nodes substituted. With several packed rows in a call
    (``B > 1``), where one vector cannot stand for every row's positions, only what does not change under a
    shift of positions (differences, comparisons of two positions: causal and sliding-window masks) is left
    as is; anything else raises :class:`Skip`."""
    anc = ancestors(site, include_self=False)
    aranges = {n for n in anc if _is_row_arange(n, pro.n_len)}
    if not aranges:
        return 0
    dep = set(aranges)
    order = [n for n in graph.nodes if n in anc]
    for n in order:
        if n not in dep and any(a in dep for a in n.all_input_nodes):
            dep.add(n)
    site_ins = [a for a in site.all_input_nodes if a in dep]
    if not site_ins:
        return 0
    batch = pro.batch
    if not (isinstance(batch, int) and batch == 1):
        cls = _shift_class(order, aranges, dep, pro.n_len)
        bad = [a.name for a in site_ins if cls.get(a) in ("P", "X")]
        if bad:
            raise Skip(f"its mask or scaling ({', '.join(bad)}) is computed from absolute row positions "
                        "(arange over the packed row) in a way that differs per example (e.g. chunked local "
                        f"attention, a position-dependent temperature), and the call packs {batch} rows: per-example "
                        "positions can stand in only with one packed row per call (DataCollatorWithFlattening and "
                        "TRL padding_free make one row)")
        return 0
    subst: dict[fx.Node, fx.Node] = {}
    row = pro.pos_row()
    for a in aranges:
        dtype = getattr(tensor_meta(a), "dtype", torch.long)
        if dtype == torch.long:
            subst[a] = row
        else:
            with graph.inserting_before(site):
                subst[a] = call(torch.Tensor.to, row, dtype)
            annotate_new_nodes([subst[a]], a)
    for n in order:
        if n in aranges or n not in dep or not any(i in subst for i in n.all_input_nodes):
            continue
        if _absolute_index(n, dep, pro.n_len):
            continue  # reads a per-token tensor at a token of the row: stays absolute
        # NOTE: copies go right before the site: after their inputs (ancestors of the site) and after the
        # positions (which, read from the per-call context, may come after the original arange)
        with graph.inserting_before(site):
            copy = graph.node_copy(n, lambda x: subst.get(x, x))
        name = copy.target if isinstance(copy.target, str) else getattr(copy.target, "__name__", "")
        if name in _INPLACE_FN:  # NOTE: never mutate the per-example positions in place
            copy.target = getattr(operator, _INPLACE_FN[name])
        elif copy.op == "call_method" and name.endswith("_") and not name.endswith("__"):
            copy.target = name[:-1]
        elif copy.op == "call_function" and name.endswith("_") and not name.endswith("__") and hasattr(torch, name[:-1]):
            copy.target = getattr(torch, name[:-1])
        subst[n] = copy
    site.args = fx.node.map_arg(site.args, lambda x: subst.get(x, x))
    site.kwargs = fx.node.map_arg(site.kwargs, lambda x: subst.get(x, x))
    return len(aranges)
