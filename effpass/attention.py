"""The core's attention contract: which ops are fused attention sites, and SDPA that is safe on empty rows.

* :func:`register_attention_op` / :func:`attention_op`: the registry of ops that count as a fused attention
  call with SDPA's signature ``(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)``. A pass that
  inserts its own attention op registers it; a pass that rewrites attention calls (``pack_sequences``)
  asks the registry instead of knowing other passes' functions or module names.
* :func:`masked_sdpa`: SDPA with a mask that may leave query rows with no key (registered above).

:func:`masked_sdpa` is used by ``fuse_attention`` and ``pack_sequences``. torch's fused CPU attention kernel computes wrong
gradients for a query row whose keys are all masked with a finite fill (Hugging Face's ``finfo.min``), and
``-inf`` fills give NaN. Eager attention with a finite fill gives such a row the plain average of ``v``
(``softmax`` of equal values: the fill absorbs the scores) and, in backward, the softmax derivative at those
uniform weights: non-zero gradients into q and k (and 1/n of the row's output gradient into every v).
:func:`masked_sdpa` reproduces both without ever handing the kernel an empty row:

* forward: the row attends to every key with a query whose *value* is 0 (``q - q.detach()``), so its weights
  are exactly uniform and its output is the average of ``v``, eager's value bit for bit;
* backward: that query carries q's gradient (identity), so the kernel's own backward gives eager's gradient
  into q and v; the gradient into k that eager's row sends through its real query is added by a term whose
  value is exactly 0 and whose derivative is eager's: ``(s/n) * (q @ k^T (v - mean v))`` minus itself detached,
  computed through a ``d x d`` product per head (``O(n d^2)``, no ``n x n`` tensor).

So the compiled model's gradients equal eager's on left-padded batches also when the loss reads the padded
positions (as simple training scripts and some test suites do). No host synchronisation: everything is tensor
ops. ``-inf`` fills (eager: NaN) get the same finite values.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn.functional as F

from .graph import MASK_FILL_THRESHOLD

__all__ = ["masked_sdpa", "MASK_FILL_THRESHOLD", "AttentionOp", "register_attention_op", "attention_op",
           "registered_attention_ops", "sdpa_arguments"]

#: SDPA's parameters, in order (every registered attention op takes these, by position or keyword)
SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


@dataclass(frozen=True)
class AttentionOp:
    """A function a torch-IR graph may call for fused attention, with SDPA's signature."""

    target: Callable
    #: who registered it (a pass name or "torch"), for messages
    owner: str
    #: whether another mask may be added to its calls (a caller rewrites it into SDPA with the mask)
    maskable: bool = True


_ATTENTION_OPS: dict[Any, AttentionOp] = {}


def register_attention_op(target: Callable, *, owner: str, maskable: bool = True) -> Callable:
    """Declare ``target`` (a function or custom op called in torch-IR graphs) a fused attention op with
    SDPA's signature. Returns ``target``, so it can decorate."""
    if not callable(target):
        raise TypeError(f"register_attention_op: {target!r} is not callable")
    _ATTENTION_OPS[target] = AttentionOp(target, owner, maskable)
    return target


def attention_op(node: Any) -> AttentionOp | None:
    """The registered attention op ``node`` calls, or None."""
    if not (isinstance(node, fx.Node) and node.op == "call_function"):
        return None
    try:
        return _ATTENTION_OPS.get(node.target)
    except TypeError:  # an unhashable target
        return None


def registered_attention_ops() -> tuple[AttentionOp, ...]:
    return tuple(_ATTENTION_OPS.values())


def sdpa_arguments(node: fx.Node) -> dict[str, Any]:
    """A call of a registered attention op, its arguments by SDPA's parameter names."""
    out = dict(zip(SDPA_PARAMS, node.args))
    out.update(node.kwargs)
    return out


def masked_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``F.scaled_dot_product_attention`` that is safe on fully masked query rows and equal to eager attention
    with a finite fill there, forward and backward (the module docstring says how)."""
    kw = {"enable_gqa": True} if enable_gqa else {}
    if attn_mask is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **kw)
    n_q, n_k = q.shape[-2], k.shape[-2]
    if is_causal:
        tril = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril()
        attn_mask = attn_mask & tril if attn_mask.dtype == torch.bool else attn_mask.masked_fill(~tril, float("-inf"))
    if attn_mask.dtype == torch.bool:
        empty = ~attn_mask.any(-1, keepdim=True)
        attn_mask = attn_mask | empty
    else:
        empty = (attn_mask <= MASK_FILL_THRESHOLD).all(-1, keepdim=True)
        attn_mask = attn_mask.masked_fill(empty, 0.0)
    # NOTE: value 0 (uniform weights: eager's forward), gradient identity (eager's softmax derivative into q)
    q_safe = torch.where(empty, q - q.detach(), q)
    out = F.scaled_dot_product_attention(q_safe, k, v, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale, **kw)
    return out + _empty_row_key_grad(q, k, v, empty, scale, enable_gqa)


def _empty_row_key_grad(q, k, v, empty, scale, enable_gqa):
    """Exactly 0 in value; its gradient into ``k`` is what eager attention sends there from the fully masked
    rows ``empty`` (uniform weights ``1/n``): ``dk_j = (s/n) * sum_r (do_r . (v_j - mean v)) q_r``."""
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        rep = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)
    s = scale if scale is not None else q.shape[-1] ** -0.5
    centred = (v - v.mean(-2, keepdim=True)).detach()
    t = torch.matmul(q.detach(), torch.matmul(k.transpose(-2, -1), centred)) * (s / k.shape[-2])
    return torch.where(empty, t - t.detach(), torch.zeros((), dtype=t.dtype, device=t.device))


register_attention_op(F.scaled_dot_product_attention, owner="torch")
register_attention_op(torch._C._nn.scaled_dot_product_attention, owner="torch")
register_attention_op(masked_sdpa, owner="effpass")
