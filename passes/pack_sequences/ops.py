"""``pack_sequences``'s ops: the functions a packed graph calls and the per-call packing context.

Plain torch code that AOTAutograd traces (no host synchronisation): per-token document ids and per-example
positions from a boundary tensor, the block-diagonal mask, SDPA restricted to one example
(:func:`packed_sdpa`, :func:`effpass.attention.masked_sdpa` where the model's own mask may empty a row),
torch's varlen kernel (:func:`packed_varlen`, CUDA), and the custom ops ``effpass::pack_context_set`` /
``effpass::pack_context_get`` through which graphs without the boundary input (after a graph break) read the
packed call in progress.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

import effpass
from effpass.attention import masked_sdpa

__all__ = ["document_ids", "position_ids_from", "positions_of", "same_document_mask", "packed_sdpa", "mask_scores",
           "packed_varlen", "first_row", "pack_context_set", "pack_context_get", "set_context", "context_doc",
           "CONTEXT_SET_OPS"]

# ------------------------------------------------------------------------------------------------------
# functions the rewritten graph calls (plain torch code: AOTAutograd traces them, no host sync)
# ------------------------------------------------------------------------------------------------------
def document_ids(kind: str, boundary: torch.Tensor, n: int) -> torch.Tensor:
    """Per-token example ids, shape ``(1 or B, n)``, from a boundary tensor of kind ``kind``."""
    if kind == "seq_idx":
        return boundary.long()
    if kind in ("cu_seq_lens_q", "cu_seq_lens_k"):
        idx = torch.arange(n, device=boundary.device)
        return torch.searchsorted(boundary[1:].contiguous().long(), idx, right=True)[None]
    return torch.cumsum((boundary == 0).long(), dim=-1)


def position_ids_from(kind: str, boundary: torch.Tensor, n: int) -> torch.Tensor:
    """``position_ids`` (restarting at 0 per example) from ``cu_seq_lens_*`` or ``seq_idx``."""
    idx = torch.arange(n, device=boundary.device)
    if kind == "seq_idx":
        s = boundary.long()
        new = torch.ones_like(s, dtype=torch.bool)
        new[..., 1:] = s[..., 1:] != s[..., :-1]
        start = torch.cummax(torch.where(new, idx.expand_as(s), 0), dim=-1).values
        return idx - start
    cu = boundary.long()
    doc = torch.searchsorted(cu[1:].contiguous(), idx, right=True)
    return (idx - cu[doc])[None]


def same_document_mask(doc: torch.Tensor, causal: bool) -> torch.Tensor:
    """``(B, 1, N, N)`` boolean mask: True where query and key belong to the same example (and, if
    ``causal``, the key is not after the query)."""
    same = doc[:, None, :, None] == doc[:, None, None, :]
    if causal:
        idx = torch.arange(doc.shape[-1], device=doc.device)
        same = same & (idx[:, None] >= idx[None, :])
    return same


def packed_sdpa(q, k, v, same, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """SDPA with ``attn_mask`` (``is_causal`` already folded into ``same``) restricted to one example."""
    kw = {"enable_gqa": True} if enable_gqa else {}
    if attn_mask is None:  # every row keeps its own token: the fused kernel is safe as is
        return F.scaled_dot_product_attention(q, k, v, attn_mask=same, dropout_p=dropout_p, scale=scale, **kw)
    if attn_mask.dtype == torch.bool:
        mask = attn_mask & same
    else:
        mask = attn_mask.masked_fill(~same, torch.finfo(attn_mask.dtype).min)
    # NOTE: the model's own mask (padding) may empty a row: masked_sdpa keeps the fused kernel safe there
    return masked_sdpa(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale, **kw)


def mask_scores(scores: torch.Tensor, same: torch.Tensor) -> torch.Tensor:
    """Hand-written attention scores with the other examples' keys masked (HF's finfo.min convention)."""
    return scores.masked_fill(~same, torch.finfo(scores.dtype).min)


def packed_varlen(q, k, v, doc, is_causal, scale=None, enable_gqa=False):
    """Packed attention with torch's variable-length kernel (``torch.nn.attention.varlen.varlen_attn``, CUDA
    FlashAttention): ``(B, H, N, D)`` rows whose ``doc`` ``(1 or B, N)`` ids never decrease along a row. The
    boundaries become ``cu_seqlens`` of fixed length ``B*N + 1`` (empty examples repeat an offset) and
    ``max_seqlen = N``, so nothing is read back to the host. NOTE: written for CUDA, untested on a GPU (none
    was available); :func:`_varlen_usable` chooses it only where the kernel exists."""
    from torch.nn.attention.varlen import varlen_attn

    b, h, n, d = q.shape
    doc = doc.expand(b, n).long()
    doc = doc - doc[:, :1] + (torch.arange(b, device=q.device) * n)[:, None]  # ids unique across rows
    cu = torch.searchsorted(doc.reshape(-1).contiguous(), torch.arange(b * n + 1, device=q.device)).to(torch.int32)
    qf, kf, vf = (t.transpose(1, 2).reshape(b * n, t.shape[1], t.shape[-1]) for t in (q, k, v))
    out = varlen_attn(qf, kf, vf, cu, cu, n, n, scale=scale, window_size=(-1, 0) if is_causal else (-1, -1),
                      enable_gqa=bool(enable_gqa))
    return out.reshape(b, n, h, v.shape[-1]).transpose(1, 2)


def positions_of(kind: str, boundary: torch.Tensor, n: int) -> torch.Tensor:
    """Per-example positions ``(1 or B, N)`` from a boundary tensor of kind ``kind``."""
    if kind == "position_ids":
        return boundary.long()
    return position_ids_from(kind, boundary, n).reshape(-1, n)


def first_row(pos: torch.Tensor) -> torch.Tensor:
    return pos[0]


# ------------------------------------------------------------------------------------------------------
# the per-call packing context: the boundary hook sets it once per call; graphs without a boundary input
# (after a graph break) read it through a custom op, so every graph Dynamo makes of the model is packed
# ------------------------------------------------------------------------------------------------------
class _PackContext:
    """Per-example document ids and positions ``(1 or B, N)`` of the packed call in progress (None: the call
    in progress is not a packed row). Set by the boundary hook (eagerly, or by :func:`pack_context_set` in a
    graph when the hook is traced inline), read by :func:`pack_context_get` in graphs that lack the boundary
    input. NOTE: one call at a time per process; a backward that recomputes (activation checkpointing) reads
    the context of the last forward, so run each forward's backward before the next packed forward."""

    doc: torch.Tensor | None = None
    pos: torch.Tensor | None = None


_CONTEXT = _PackContext()


def set_context(pos: torch.Tensor | None) -> None:
    if pos is None:
        _CONTEXT.doc = _CONTEXT.pos = None
        return
    pos = pos.long()
    _CONTEXT.pos = pos
    _CONTEXT.doc = torch.cumsum((pos == 0).long(), dim=-1)


@torch.library.custom_op("effpass::pack_context_set", mutates_args=())
def pack_context_set(pos: torch.Tensor) -> torch.Tensor:
    """Records ``pos`` (per-example positions) as the packed call in progress; returns a copy of it (used as
    the call's ``position_ids``, so the op stays in a graph that traces the hook)."""
    set_context(pos)
    return pos.clone()


@pack_context_set.register_fake
def _(pos):
    return torch.empty_like(pos)



@torch.library.custom_op("effpass::pack_context_get", mutates_args=())
def pack_context_get(like: torch.Tensor, batch_dim: int, length_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Document ids and per-example positions ``(B, N)`` of the packed call in progress, with ``B`` and ``N``
    read from ``like``'s dims. Outside a packed call: one document and positions ``0..N-1`` (the graph then
    computes what it did before the pass)."""
    b, n = like.shape[batch_dim], like.shape[length_dim]
    doc, pos = _CONTEXT.doc, _CONTEXT.pos
    if doc is None:
        pos = torch.arange(n, device=like.device).expand(b, n)
        return torch.zeros(b, n, dtype=torch.long, device=like.device), pos.contiguous()
    if doc.shape[-1] != n or doc.shape[0] not in (1, b):
        raise effpass.WrongResultError(
            f"pack_sequences: a graph without the boundary input expected a packed call of {b} row(s) of {n} "
            f"tokens, but the packed call in progress has {tuple(doc.shape)} (a forward of another packed batch "
            "ran between this forward and its backward?). Run each packed forward's backward before the next")
    return doc.to(like.device).expand(b, n).contiguous(), pos.to(like.device).expand(b, n).contiguous()


@pack_context_get.register_fake
def _(like, batch_dim, length_dim):
    b, n = like.shape[batch_dim], like.shape[length_dim]
    return like.new_empty((b, n), dtype=torch.long), like.new_empty((b, n), dtype=torch.long)


#: the targets of the context setter in a graph (the boundary hook traced inline)
CONTEXT_SET_OPS = frozenset({torch.ops.effpass.pack_context_set.default, torch.ops.effpass.pack_context_set,
                             pack_context_set})


def context_doc() -> torch.Tensor | None:
    """The document ids of the packed call in progress (None: no packed call)."""
    return _CONTEXT.doc

