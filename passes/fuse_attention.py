"""``fuse_attention``: hand-written attention becomes one fused attention call, K/V kept un-repeated.

What it does
    Finds attention written out by hand (``softmax(q @ k^T * scale + mask) @ v``, with the variants
    listed below) in the graph Dynamo hands over and replaces each site with
    ``torch.nn.functional.scaled_dot_product_attention`` (SDPA): ``is_causal=True`` where the mask is
    provably causal, ``attn_mask`` otherwise, ``enable_gqa=True`` with the un-repeated K/V for
    grouped-query and multi-query attention, and the dropout probability in training. SDPA picks its
    kernel itself: FlashAttention on CUDA for fp16/bf16 (GQA included), the fused flash kernel on CPU.

Phase: torch IR (``transform_torch_ir``), and why
    At this level the graph is small and its ops are torch functions, so one structural matcher
    covers ``torch.matmul``/``@``/``bmm``, ``softmax`` in its three spellings, ``masked_fill``,
    ``where``, ``dropout`` and the casts, whatever the model's layout. The replacement is an ordinary
    torch call: AOTAutograd traces it afterwards and derives a correct backward, and the rewrite works
    for both lowerings (Inductor and eager). At the aten level the same sites are split into
    layout-specific ``bmm``/``expand``/``clone`` patterns (Inductor needs ~30 fixed patterns there and
    still misses the Llama causal form); the forward+backward would also have to be rewritten together.

Recognised forms (the matcher walks back from each ``softmax``):
    * scores ``q @ k^T`` (``k^T`` by ``transpose``/``permute``, or any ``(…, D, S)`` tensor), scaled by
      any chain of ``*``/``/`` by Python numbers (or pre-scaled q, which is simply part of q), in place
      too (``/=``, ``*=``, ``+=``, ``masked_fill_``: Falcon), through same-shape ``view``/``reshape``;
    * multi-query attention by broadcasting (one K/V head against every query head, Falcon);
    * BLOOM's ALiBi: ``alibi.baddbmm(q, k^T, beta=b, alpha=a)`` on (B*H, S, D) tensors, the scores viewed as
      (B, H, Sq, Sk) for the mask and the weights viewed back for ``bmm`` with v: ``a`` joins the scale, the
      bias (``b`` times the later scales) becomes one more additive mask term in the (B, H, ...) layout, and
      q, k, v are viewed as (B, H, S, D) for SDPA (its output viewed back);
    * masks, any combination: additive float tensors (``scores + mask``: BERT padding, Hugging Face
      5.x masks, constant ALiBi-style biases), ``masked_fill(mask, v)`` and ``where(cond, scores, v)`` /
      ``where(cond, v, scores)`` with ``v`` = ``-inf`` or ``<= -1e4`` (Hugging Face uses ``finfo.min``);
    * softmax over the last dim, in the input dtype or upcast (``.float()``, ``dtype=``) and cast back;
    * optional ``dropout`` on the weights (``training=True`` only; ``p`` becomes ``dropout_p``);
    * ``@ v``; K/V repeated for GQA/MQA by ``x[:, :, None].expand(...).reshape(...)`` (HF
      ``repeat_kv``), ``unsqueeze(2).expand().reshape()``, ``repeat_interleave(r, dim=1)`` or indexing
      with ``arange(H) // r``.

Proving causality
    A mask is causal when it is a compile-time constant (no graph input among its ancestors; with
    ``assume_constant_buffers`` registered buffers count as constants, which is how a GPT-2/nanoGPT
    ``bias`` buffer is recognised) that evaluates, at the real shape, to exactly the lower triangle over
    a square ``S x S`` score matrix (masked values ``-inf`` or ``<= -1e4``, kept values exactly 0 for
    additive masks). Evaluation is skipped above ``max_mask_eval_elements``; such masks, and every mask
    that is not provably causal, are passed as ``attn_mask`` (always correct). ``q_len != kv_len``
    (decoding with a cache) never uses ``is_causal`` (SDPA aligns it top-left).

Autocast: a site inside an autocast region (one Dynamo recorded, e.g. ``apply_autocast``'s module capture,
or autocast entered around the compiled call, as accelerate/TRL do for ``bf16=True``) runs both matmuls in
the autocast dtype in eager, whatever the dtypes of q, k, v (Llama's rotated q/k are fp32 while v is bf16);
SDPA gets q, k, v and a float mask cast to that dtype, which is what Hugging Face's SDPA attention computes
under autocast (bit-identical on the tested families, docs/apply_autocast.md).

Left alone, with the reason in ``PassResult.skipped`` (and the dump): softmax over another dim; a scale
that is not a constant positive number; a mask computed from the scores ("mask depends on data"); an
additive bias that requires grad ("bias is not a mask": T5 relative bias, learned ALiBi); attention
weights used elsewhere (``output_attentions``); q/k/v of different dtypes outside autocast (two
precisions, not one SDPA call) or broadcast batch dims.

Runs after: nothing (it is the first graph pass). ``apply_autocast`` and ``checkpoint_activations``
run after it, so autocast sees the fused op (SDPA is on autocast's lower-precision list) and the
checkpointing policy sees the fused op instead of the ``S x S`` intermediates.

Invariants: only nodes of matched sites are replaced; every new node carries the replaced node's
``nn_module_stack`` and a fake ``example_value``; placeholders are never added or removed.

Fully masked rows (a query that may attend to no key: left padding). torch's fused CPU kernel computes
wrong gradients there with a finite fill (HF's ``finfo.min``), and ``-inf`` gives NaN. A site whose mask
may hold such rows (any mask from the inputs; stat ``empty_row_guard``) calls
:func:`effpass.attention.masked_sdpa`: such rows get every key and a zero query, so the fused
kernel runs and their output is eager's (uniform weights: the mean of v). Their gradient into q and k
is 0 (the true derivative) where eager autograd returns a value that depends on how the fill rounded;
no loss that ignores padded positions sees a difference.

Statistics: ``rewritten`` (sites replaced), ``fused`` (of those, sites where a fused kernel runs: SDPA's
own dispatcher asked with the site's dtype, device, head dim, mask and dropout, or flash-attn), and
``unfused`` (rewritten, but SDPA runs its math op: e.g. dropout on CPU; listed with the reason among the
skipped sites, flag ``unfused``).
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from torch._inductor import pattern_matcher as pm

import effpass
from effpass.attention import masked_sdpa
from effpass.graph import (MASK_FILL_THRESHOLD, AutocastRegions, Skip, copy_provenance, erase_dead,
                           infer_fake_values, is_buffer_source, is_fn, is_softmax, is_method, is_number, module_path_of_node,
                           is_random_op, op_name, shape_of, val)


__all__ = ["FuseAttention"]

# NOTE(canonical): the manager canonicalizes torch-IR graphs first (effpass.canonicalize): one function per op
# (torch.matmul, torch.mul, torch.div, torch.add, torch.masked_fill, torch.transpose, torch.softmax) and in-place
# forms out of place where no alias sees the difference. In-place forms below are the ones it had to keep.
_MATMUL_FNS = {torch.matmul, torch.bmm}
_MUL_FNS = {torch.mul, operator.imul}
_DIV_FNS = {torch.div, operator.itruediv}
_ADD_FNS = {torch.add, operator.iadd}
#: in-place spellings (Falcon scales its scores with ``/=`` and ``*=``): same value, the input is updated
_INPLACE = {operator.imul, operator.itruediv, operator.iadd, "mul_", "div_", "add_", "masked_fill_", "__imul__",
            "__itruediv__", "__iadd__"}
#: shape-only ops that keep every element in place when the shape does not change
_SAME_SHAPE_VIEWS = {"view", "reshape", "contiguous", "flatten", "unflatten"}
_CAST_METHODS = {"to", "type", "float", "half", "bfloat16", "double", "type_as"}
_DROPOUT_FNS = {F.dropout, torch.dropout}


# ------------------------------------------------------------------------------------------------------
# small predicates on torch-IR nodes
# ------------------------------------------------------------------------------------------------------
def _arg(n: fx.Node, i: int, name: str, default=None):
    if len(n.args) > i:
        return n.args[i]
    return n.kwargs.get(name, default)


def _static(shape) -> bool:
    return shape is not None and all(isinstance(s, int) for s in shape)


def _is_matmul(n: Any) -> bool:
    return is_fn(n, _MATMUL_FNS)


def _is_baddbmm(n: Any) -> bool:
    """``bias.baddbmm(q, k^T, beta=, alpha=)`` / ``torch.baddbmm``: ``beta * bias + alpha * (q @ k^T)`` (BLOOM)."""
    return is_fn(n, {torch.baddbmm}) or is_method(n, {"baddbmm"})


def _baddbmm_parts(n: fx.Node):
    """(bias, batch1, batch2, beta, alpha) of a baddbmm node."""
    return (_arg(n, 0, "input"), _arg(n, 1, "batch1"), _arg(n, 2, "batch2"), n.kwargs.get("beta", 1),
            n.kwargs.get("alpha", 1))


def _merge_view_heads(n: Any) -> tuple | None:
    """(B, H) when ``n`` views a (B, H, S, T) tensor as (B*H, S, T) (BLOOM's weights before ``bmm`` with v)."""
    if not (is_method(n, {"view", "reshape"}) or is_fn(n, {torch.reshape})):
        return None
    src = n.args[0] if n.args else None
    a, b = shape_of(src), shape_of(n)
    if _static(a) and _static(b) and len(a) == 4 and len(b) == 3 and a[0] * a[1] == b[0] and a[2:] == b[1:]:
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
        p, training = _arg(n, 1, "p", 0.5), _arg(n, 2, "training", True)
        inplace = _arg(n, 3, "inplace", False)
    elif is_fn(n, {torch.dropout}):
        p, training, inplace = _arg(n, 1, "p", 0.5), _arg(n, 2, "train", True), False
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


def _ancestors(n: fx.Node) -> set[fx.Node]:
    seen, stack = set(), [n]
    while stack:
        x = stack.pop()
        if x in seen:
            continue
        seen.add(x)
        stack.extend(x.all_input_nodes)
    return seen


# ------------------------------------------------------------------------------------------------------
# compile-time evaluation of constant subgraphs (masks, GQA index tensors)
# ------------------------------------------------------------------------------------------------------
class _ConstEval:
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
        order = [n for n in _ancestors(node) if n not in self.known]
        total = 0
        for n in order:
            if n.op != "call_function" and n.op != "call_method":
                return None
            if is_random_op(n) or n.target is torch._C._set_grad_enabled:
                return None
            shape = shape_of(n)
            if shape is not None:
                if not _static(shape):
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
                if n.target in _INPLACE and args and isinstance(args[0], torch.Tensor):
                    args = (args[0].clone(), *args[1:])  # never mutate a value another node was given
                if n.op == "call_function":
                    self.known[n] = n.target(*args, **kwargs)
                else:
                    self.known[n] = getattr(args[0], n.target)(*args[1:], **kwargs)
        except Exception:  # anything unexpected: the value is simply not known
            return None
        return self.known[node]


# ------------------------------------------------------------------------------------------------------
# the match
# ------------------------------------------------------------------------------------------------------
@dataclass
class _Site:
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


def _fill_value_ok(value: Any, const: _ConstEval) -> bool:
    if is_number(value):
        return value <= MASK_FILL_THRESHOLD
    t = const(value)
    return isinstance(t, torch.Tensor) and t.numel() > 0 and bool((t <= MASK_FILL_THRESHOLD).all())


def _match(sm: fx.Node, const: _ConstEval) -> _Site:
    site = _Site(softmax=sm)
    x = sm.args[0] if sm.args else sm.kwargs.get("input")
    if not isinstance(x, fx.Node) or shape_of(x) is None:
        raise Skip("softmax input is not a tensor")
    ndim = len(shape_of(x))
    dim = _arg(sm, 1, "dim", None)
    if not isinstance(dim, int) or dim % ndim != ndim - 1:
        raise Skip(f"softmax over a different dim ({dim}), not the last one")
    if ndim < 3:
        raise Skip("scores are not batched (fewer than 3 dims)")

    # -- forward from softmax: casts, dropout, then probs @ v ------------------------------------------
    site.chain.append(sm)
    y = _single_user(sm, "the softmax output")
    while True:
        if _is_cast(y):
            site.chain.append(y)
            y = _single_user(y, "the attention weights")
            continue
        if _is_same_shape_view(y):
            site.chain.append(y)
            y = _single_user(y, "the attention weights")
            continue
        hm = _merge_view_heads(y)
        if hm is not None and site.heads is None:
            site.heads = hm
            site.chain.append(y)
            y = _single_user(y, "the attention weights")
            continue
        p = _dropout_of(y)
        if p is not None:
            if site.dropout_p:
                raise Skip("two dropouts on the attention weights")
            site.dropout_p = p
            site.chain.append(y)
            y = _single_user(y, "the attention weights")
            continue
        break
    if not _is_matmul(y) or y.args[0] is not site.chain[-1] or len(y.args) < 2:
        raise Skip(f"the attention weights feed {op_name(y)}, not weights @ v")
    site.pv, site.v = y, y.args[1]

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
        elif _is_matmul(x) or _is_baddbmm(x):
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
            nxt, mask, value = args[0], _arg(cur, 1, "mask"), _arg(cur, 2, "value")
            if not _fill_value_ok(value, const):
                raise Skip(f"masked_fill with {value!r} is not a mask (needs -inf or <= {MASK_FILL_THRESHOLD:g})")
            site.allowed.append((mask, True))
            if split_seen:
                site.split_terms.add(mask)
        elif is_fn(cur, {torch.where}) and len(args) == 3:
            cond, a, b = args
            if a is not None and isinstance(a, fx.Node) and shape_of(a) == x_shape and _fill_value_ok(b, const):
                nxt, negate = a, False
            elif isinstance(b, fx.Node) and shape_of(b) == x_shape and _fill_value_ok(a, const):
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
            if any(nxt in _ancestors(m) for m, _ in site.additive + site.allowed if isinstance(m, fx.Node)):
                raise Skip("mask depends on data (it is computed from the attention scores)")
            raise Skip(f"the attention scores ({nxt.name}) are used elsewhere")
        consumer, x = x, nxt
    if site.heads is not None and not split_seen:
        raise Skip("the attention weights are viewed as (batch*heads, q, k) but the scores were not split the same way")
    site.qk = x
    site.chain.extend(chain_back)
    site.chain.append(x)
    if _is_baddbmm(x):
        # beta * bias + alpha * (q @ k^T): the bias is one more additive term (scaled like the scores after it)
        bias, b1, b2, beta, alpha = _baddbmm_parts(x)
        if not (is_number(beta) and is_number(alpha)) or alpha <= 0:
            raise Skip(f"baddbmm with beta={beta!r}, alpha={alpha!r} (needs constant numbers, alpha > 0)")
        if isinstance(bias, fx.Node) and beta != 0:
            site.additive.append((bias, site.scale * beta))
            if split_seen:
                site.split_terms.add(bias)
        elif not (is_number(bias) or beta == 0):
            raise Skip("baddbmm bias is not a tensor")
        site.scale *= alpha
        site.q, site.k_t = b1, b2
    else:
        site.q, site.k_t = x.args[0], x.args[1]
    if not all(isinstance(n, fx.Node) for n in (site.q, site.k_t, site.v)):
        raise Skip("q, k or v is not a tensor")

    # masks must not be computed from the scores themselves
    for m, _ in site.additive + site.allowed:
        if not isinstance(m, fx.Node):
            raise Skip("mask is not a tensor")
        anc = _ancestors(m)
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


def _is_inplace(n: Any) -> bool:
    """An in-place arithmetic op (``/=``, ``*=``, ``+=``, ``masked_fill_``, ``add_``...)."""
    return isinstance(n, fx.Node) and ((n.op == "call_function" and n.target in _INPLACE)
                                       or (n.op == "call_method" and n.target in _INPLACE))


def _is_same_shape_view(n: Any) -> bool:
    """A view/reshape/contiguous that keeps the shape (Falcon's ``scores.view(b, h, q, kv)``)."""
    if not (is_method(n, _SAME_SHAPE_VIEWS) or is_fn(n, {torch.reshape, torch.flatten})):
        return False
    src = n.args[0] if n.args else None
    return isinstance(src, fx.Node) and shape_of(src) is not None and shape_of(src) == shape_of(n)


def _depends_on_matmul(n: fx.Node) -> bool:
    return any(_is_matmul(a) or _is_baddbmm(a) for a in _ancestors(n))


def _split_view_of(n: Any, heads: tuple) -> bool:
    """``n`` views a (B*H, S, T) tensor as (B, H, S, T) with ``heads == (B, H)`` (BLOOM's scores)."""
    if not (is_method(n, {"view", "reshape"}) or is_fn(n, {torch.reshape})):
        return False
    src = n.args[0] if n.args else None
    a, b = shape_of(src), shape_of(n)
    return (_static(a) and _static(b) and len(a) == 3 and len(b) == 4 and tuple(b[:2]) == tuple(heads)
            and a[0] == b[0] * b[1] and a[1:] == b[2:])


def _term_4d(t: torch.Tensor, site: _Site, node: fx.Node) -> torch.Tensor | None:
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


def _strip_transpose(kt: fx.Node) -> fx.Node | None:
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


def _match_repeat_kv(n: fx.Node) -> "pm.Match | None":
    for pattern in _REPEAT_KV:
        m = pattern.match(n)
        if m:
            return m
    return None


def _unrepeat(n: fx.Node, const: _ConstEval) -> tuple[fx.Node, int] | None:
    """(un-repeated K or V, repeat factor) when ``n`` repeats KV heads as ``repeat_interleave`` does."""
    shape = shape_of(n)
    if shape is None or len(shape) != 4:
        return None
    B, H, S, D = shape
    # expand + reshape (HF repeat_kv), with the new axis right after the heads: the fixed shape of the
    # pattern by torch's pattern matcher, the axis and shapes as its extra check
    m = _match_repeat_kv(n)
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
        r = _arg(n, 1, "repeats")
        d = _arg(n, 2, "dim")
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
        if _arg(n, 1, "dim") in (1, -3):
            idx, z = _arg(n, 2, "index"), n.args[0]
    if idx is not None and shape_of(z) is not None and len(shape_of(z)) == 4:
        hkv = shape_of(z)[1]
        t = const(idx)
        if isinstance(t, torch.Tensor) and hkv and H % hkv == 0 and t.shape == (H,):
            r = H // hkv
            if torch.equal(t.cpu().long(), torch.arange(H) // r):
                return z, r
    return None


def _allowed(site: _Site, const: _ConstEval, keep_of) -> torch.Tensor | None:
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


def _causal_allowed(site: _Site, const: _ConstEval) -> torch.Tensor | None:
    """The "attend" mask when the terms are constant 0 / -inf masks (a real bias is not), else None."""
    def keep_of(t):
        keep, drop = t == 0, t <= MASK_FILL_THRESHOLD
        return keep if bool((keep | drop).all()) else None

    return _allowed(site, const, keep_of)


def _const_term(m: fx.Node, site: _Site, const: _ConstEval) -> torch.Tensor | None:
    t = const(m)
    return _term_4d(t, site, m) if isinstance(t, torch.Tensor) else None


def _is_causal(site: _Site, const: _ConstEval) -> bool:
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


def _rows_nonempty(site: _Site, const: _ConstEval) -> bool:
    """True when the mask is a known constant in which every query row attends to at least one key
    (additive terms: a value above the mask threshold, e.g. an ALiBi bias, counts as attending)."""
    allowed = _allowed(site, const, lambda t: t > MASK_FILL_THRESHOLD)
    return isinstance(allowed, torch.Tensor) and allowed.dim() >= 1 and bool(allowed.any(-1).all())


# ------------------------------------------------------------------------------------------------------
# the pass
# ------------------------------------------------------------------------------------------------------
@effpass.register_pass("fuse_attention")
@dataclass(frozen=True, kw_only=True)
class FuseAttention(effpass.Pass):
    """Fuse hand-written attention into scaled_dot_product_attention (flash kernels), GQA K/V un-repeated.

    Before (Hugging Face eager Llama attention, torch IR)::

        k_rep  = k[:, :, None].expand(B, 2, 2, S, D).reshape(B, 4, S, D)   # and v_rep alike
        scores = torch.matmul(q, k_rep.transpose(2, 3)) * 0.125
        scores = scores + mask                                            # causal, 0 / finfo.min
        probs  = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        probs  = F.dropout(probs, p=0.0, training=False)
        out    = torch.matmul(probs, v_rep)

    After::

        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.125, enable_gqa=True)
    """

    gqa: bool = field(default=True, metadata={"doc": "feed SDPA the un-repeated K/V (enable_gqa=True) for GQA/MQA"})
    prove_causal: bool = field(default=True, metadata={
        "doc": "use is_causal=True where the mask is provably causal (else always pass attn_mask)"})
    assume_constant_buffers: bool = field(default=True, metadata={
        "doc": "treat registered buffers (GPT-2's causal 'bias') as constants when proving causality"})
    max_mask_eval_elements: int = field(default=1 << 26, metadata={
        "doc": "largest constant mask subgraph (elements) evaluated at compile time to prove causality"})

    def validate(self) -> None:
        if self.max_mask_eval_elements < 0:
            raise ValueError(f"max_mask_eval_elements must be >= 0, got {self.max_mask_eval_elements}")

    @classmethod
    def enabled_by_default(cls, device=None) -> bool:
        return True

    @classmethod
    def default_note(cls) -> str:
        return "on for every device (the replacement computes the same function)"

    # -- the hook -----------------------------------------------------------------------------------------
    def transform_torch_ir(self, gm: fx.GraphModule, ctx) -> effpass.PassResult:
        graph = gm.graph
        const = _ConstEval(gm, ctx, self.assume_constant_buffers, self.max_mask_eval_elements)
        regions = AutocastRegions(graph)
        stats = {"rewritten": 0, "fused": 0, "unfused": 0, "causal": 0, "attn_mask": 0, "gqa": 0, "dropout": 0,
                 "empty_row_guard": 0, "skipped": 0}
        unfused: list[dict] = []
        skipped = []
        # the scope keeps the softmaxes in targets/exclude (and warns, naming the pass, when it keeps none)
        for sm in ctx.scope.select_nodes(gm, [n for n in graph.nodes if is_softmax(n)], what="attention softmax"):
            where = f"{module_path_of_node(sm) or '<root>'}:{sm.name}"
            try:
                site = _match(sm, const)
                self._rewrite(graph, site, const, stats, unfused, where, regions)
            except Skip as e:
                stats["skipped"] += 1
                skipped.append({"site": where, "reason": str(e)})
        changed = stats["rewritten"] > 0
        if changed:
            graph.lint()
        # NOTE: rewritten sites whose SDPA call will not run a fused kernel are listed with the left-alone ones
        # (flag "unfused"), so the dump and report show every site that does not get a fused kernel, and why
        return effpass.PassResult(changed=changed, stats=stats, skipped=skipped + unfused)

    def _rewrite(self, graph: fx.Graph, site: _Site, const: _ConstEval, stats: dict, unfused: list,
                 where: str, autocast: AutocastRegions) -> None:
        qv, vv = val(site.q), val(site.v)
        k = _strip_transpose(site.k_t)
        kv_ = val(k) if k is not None else None
        if k is not None and (kv_ is None or kv_.dim() != qv.dim()):
            k = None
        if qv is None or vv is None or qv.dim() != vv.dim():
            raise Skip("q and v have different ranks")
        dtypes = (qv.dtype, val(site.k_t).dtype, vv.dtype)
        # NOTE(autocast): under autocast both matmuls run in the autocast dtype whatever q, k, v are (Llama's
        # rotary output is fp32 while v is bf16); SDPA then gets q, k, v (and a float mask) cast to it
        ac = autocast.dtype_at(site.qk, qv.device.type)
        if ac != autocast.dtype_at(site.pv, qv.device.type):
            raise Skip("q @ k^T and weights @ v run under different autocast states")
        if ac is not None and all(d in (torch.float32, torch.float16, torch.bfloat16) for d in dtypes):
            compute = ac
        elif len(set(dtypes)) == 1:
            compute = qv.dtype
        else:
            raise Skip(f"q, k, v dtypes differ ({qv.dtype}, {val(site.k_t).dtype}, {vv.dtype}) outside autocast")
        if val(site.pv).dtype != compute:
            raise Skip(f"attention output dtype ({val(site.pv).dtype}) differs from the matmuls' ({compute})")
        kt_shape = shape_of(site.k_t)
        k_base, v_base, rep = k, site.v, 1
        mqa = (qv.dim() == 4 and k is not None and len(kt_shape) == 4 and kt_shape[1] == 1 and vv.shape[1] == 1
               and qv.shape[1] > 1 and kt_shape[0] == qv.shape[0] == vv.shape[0])
        if mqa:
            # multi-query attention by broadcasting (Falcon): one K/V head matmul'ed against every query head
            rep = int(qv.shape[1])
            if not self.gqa:
                raise Skip("multi-query attention by broadcasting needs gqa=True")
        elif tuple(qv.shape[:-2]) != tuple(kt_shape[:-2]) or tuple(qv.shape[:-2]) != tuple(vv.shape[:-2]):
            raise Skip("q, k, v batch dims differ (broadcast matmul)")
        if self.gqa and k is not None and not mqa:
            ku, vu = _unrepeat(k, const), _unrepeat(site.v, const)
            if ku and vu and ku[1] == vu[1] and shape_of(ku[0])[1] == shape_of(vu[0])[1] and ku[1] > 1:
                k_base, v_base, rep = ku[0], vu[0], ku[1]
        causal = self.prove_causal and _is_causal(site, const)

        with graph.inserting_before(site.pv):
            new_nodes = []

            def call(fn, *args, **kwargs):
                n = graph.call_function(fn, args, kwargs)
                new_nodes.append(n)
                return n

            if k_base is None:
                k_base = call(torch.transpose, site.k_t, -2, -1)
            q_in = site.q
            # autocast casts each matmul operand to its dtype: cast once, before SDPA (none where equal;
            # K/V un-repeated or transposed back keep the dtype of the k^T / v the matmuls read)
            q_in, k_base, v_base = (x if dt == compute else call(torch.Tensor.to, x, compute)
                                    for x, dt in zip((q_in, k_base, v_base), dtypes))
            if site.heads is not None:
                # BLOOM: q, k, v as (B*H, S, D) become (B, H, S, D) views, SDPA's layout
                B, H = site.heads
                # shapes from the matmuls' operands: a cast or transpose made above has no example value yet
                k_shape = (*kt_shape[:-2], kt_shape[-1], kt_shape[-2])
                q_in = call(torch.reshape, q_in, (B, H, *qv.shape[1:]))
                k_base = call(torch.reshape, k_base, (B, H, *k_shape[1:]))
                v_base = call(torch.reshape, v_base, (B, H, *vv.shape[1:]))

            def term(m):
                if site.heads is None or m not in site.split_terms or val(m).dim() < 3:
                    return m
                B, H = site.heads
                return call(torch.reshape, m, (B, H, *val(m).shape[1:]) if val(m).shape[0] == B * H
                            else (1, *val(m).shape))

            attn_mask = None
            if not causal:
                allowed = None
                for m, negate in site.allowed:
                    m = term(m)
                    a = call(torch.logical_not, m) if negate else m
                    allowed = a if allowed is None else call(torch.logical_and, allowed, a)
                additive = None
                for m, f in site.additive:
                    m = term(m)
                    t = m if f == 1.0 else call(torch.mul, m, f)
                    additive = t if additive is None else call(torch.add, additive, t)
                if additive is not None:
                    if val(site.additive[0][0]).dtype != compute or len(site.additive) > 1:
                        # NOTE: SDPA wants a float mask in the query dtype
                        additive = call(torch.Tensor.to, additive, compute)
                    attn_mask = additive if allowed is None else call(
                        torch.masked_fill, additive, call(torch.logical_not, allowed), float("-inf"))
                else:
                    attn_mask = allowed
            mask_dim = max((val(m).dim() for m, _ in site.additive + site.allowed), default=2)
            if attn_mask is not None and mask_dim < 2:
                # NOTE: SDPA needs at least a (q_len, kv_len) mask; a broadcast view costs nothing
                attn_mask = call(torch.broadcast_to, attn_mask, tuple(shape_of(site.qk)[-2:]))
            # NOTE(audit): torch's fused CPU SDPA kernel computes WRONG GRADIENTS for a query row whose keys are
            # all masked with a finite fill (HF's finfo.min; left-padded batches), and -inf fills give NaN. Where
            # such rows cannot be ruled out at compile time (a mask from the inputs), masked_sdpa gives them every
            # key and a zero query (uniform weights: eager's result) so the fused kernel never sees an empty row.
            rows_safe = attn_mask is None or _rows_nonempty(site, const)
            kwargs = dict(attn_mask=attn_mask, dropout_p=site.dropout_p, is_causal=causal, scale=site.scale)
            if rep > 1:
                kwargs["enable_gqa"] = True
            fn = F.scaled_dot_product_attention if rows_safe else masked_sdpa
            fused = call(fn, q_in, k_base, v_base, **kwargs)
            if site.heads is not None:
                fused = call(torch.reshape, fused, shape_of(site.pv))
        _set_meta(new_nodes, site.pv)
        site.pv.replace_all_uses_with(fused)
        dead = [site.pv, *site.chain]
        if k is not None:
            dead.append(site.k_t)
        erase_dead(graph, dead, producers=True)
        stats["rewritten"] += 1
        stats["causal"] += int(causal)
        stats["attn_mask"] += int(attn_mask is not None)
        stats["gqa"] += int(rep > 1)
        stats["dropout"] += int(site.dropout_p > 0)
        stats["empty_row_guard"] += int(not rows_safe)
        q4, v4 = val(q_in), val(v_base)
        why = _why_unfused(q4, val(k_base) if isinstance(k_base, fx.Node) else None, v4, attn_mask, site, rep > 1)
        if why is None:
            stats["fused"] += 1
        else:
            stats["unfused"] += 1
            unfused.append({"site": where, "unfused": True,
                            "reason": f"rewritten to SDPA, but SDPA runs its unfused math op: {why}"})


def _why_unfused(qv, kv, vv, attn_mask, site: _Site, gqa: bool) -> str | None:
    """None when SDPA will pick a fused kernel for this call, else the reason it runs its math op.

    Asks SDPA's own dispatcher (``torch._fused_sdp_choice``) on tiny real tensors with the site's dtype,
    device, head dims, mask dtype, dropout and GQA (the choice does not depend on the lengths)."""
    mv = val(attn_mask) if isinstance(attn_mask, fx.Node) else None
    if site.dropout_p > 0 and qv.device.type == "cpu":
        return "dropout on CPU (torch's fused CPU kernel has no dropout)"
    try:
        hk = kv.shape[1] if isinstance(kv, torch.Tensor) and kv.dim() == 4 else qv.shape[1]
        dev, dt = qv.device, qv.dtype
        q = torch.zeros(1, qv.shape[1], 2, qv.shape[-1], device=dev, dtype=dt)
        k = torch.zeros(1, hk, 2, qv.shape[-1], device=dev, dtype=dt)
        v = torch.zeros(1, hk, 2, vv.shape[-1], device=dev, dtype=dt)
        m = None
        if attn_mask is not None:
            mdt = mv.dtype if isinstance(mv, torch.Tensor) else dt
            m = torch.zeros(1, 1, 2, 2, device=dev, dtype=mdt) if mdt != torch.bool else torch.ones(
                1, 1, 2, 2, device=dev, dtype=torch.bool)
        kw = {"enable_gqa": True} if gqa else {}
        choice = torch._fused_sdp_choice(q, k, v, m, site.dropout_p, False, scale=site.scale, **kw)
    except Exception as e:  # the fake device or an unusual layout: say so rather than guess
        return f"the kernel choice could not be checked ({type(e).__name__})"
    if int(choice) == int(torch.nn.attention.SDPBackend.MATH):
        return (f"SDPA has no fused kernel for {qv.dtype}, head dim {qv.shape[-1]}, "
                f"{'a ' + str(mv.dtype if isinstance(mv, torch.Tensor) else 'mask') + ' mask' if attn_mask is not None else 'no mask'}"
                f"{', GQA' if gqa else ''}{f', dropout {site.dropout_p}' if site.dropout_p else ''} on {qv.device.type}")
    return None


def _set_meta(nodes: list[fx.Node], like: fx.Node) -> None:
    """Copy provenance from the replaced node and compute fake example values for the new nodes."""
    for n in nodes:
        copy_provenance(n, like)
    infer_fake_values(nodes)
