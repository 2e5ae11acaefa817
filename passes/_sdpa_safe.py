"""SDPA with a mask that may leave query rows with no key: such rows get every key and a zero query.

Shared by ``fuse_attention`` and ``pack_sequences``. torch's fused CPU attention kernel computes wrong
gradients for a query row whose keys are all masked with a finite fill (Hugging Face's ``finfo.min``), and
``-inf`` fills give NaN. Eager attention with a finite fill gives such a row the plain average of ``v``
(``softmax`` of equal values). :func:`masked_sdpa` reproduces that without ever handing the kernel an
empty row: the row attends to every key with a zero query, so its weights are exactly uniform and its
output is the average of ``v``. The forward equals eager's; the gradient into q and k through that row is
0, the true derivative (the row's output does not depend on them), where eager autograd returns a value
that depends on how the fill rounded. Rows that reach the loss only through padding (labels -100, as
every trainer masks padding) get identical gradients. No host synchronisation: everything is tensor ops.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["masked_sdpa", "MASK_FILL_THRESHOLD"]

#: an additive mask value at or below this counts as "masked out" (HF uses finfo(dtype).min)
MASK_FILL_THRESHOLD = -1e4


def masked_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``F.scaled_dot_product_attention`` that is safe (and equal to eager) on fully masked query rows."""
    kw = {"enable_gqa": True} if enable_gqa else {}
    if attn_mask is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **kw)
    if is_causal:
        n_q, n_k = q.shape[-2], k.shape[-2]
        tril = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril()
        attn_mask = attn_mask & tril if attn_mask.dtype == torch.bool else attn_mask.masked_fill(~tril, float("-inf"))
    if attn_mask.dtype == torch.bool:
        empty = ~attn_mask.any(-1, keepdim=True)
        attn_mask = attn_mask | empty
    else:
        empty = (attn_mask <= MASK_FILL_THRESHOLD).all(-1, keepdim=True)
        attn_mask = attn_mask.masked_fill(empty, 0.0)
    q = q.masked_fill(empty, 0.0)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale, **kw)
