"""flash-attn's kernel as a ``torch.library`` custom op (forward, backward, fake impls) for ``fuse_attention``.

Calling ``flash_attn`` directly from a compiled graph graph-breaks (or, in newer versions, depends on its
own op registrations); wrapping its low-level ``_flash_attn_forward`` / ``_flash_attn_backward`` as two
custom ops with fake (meta) implementations and ``register_autograd`` lets AOTAutograd trace the call,
the partitioner save only ``out`` and the log-sum-exp (memory linear in sequence length), and Inductor
keep the kernel as an extern call.

:func:`attention` has SDPA's signature. It takes the flash-attn path only where flash-attn computes
exactly what SDPA would: CUDA, fp16/bf16, 4-D ``(B, H, S, D)`` inputs, equal head dims that are a
multiple of 8 and <= 256, no ``attn_mask``, no dropout (flash-attn's RNG state would have to be threaded
through the graph), ``is_causal`` only with ``q_len == kv_len`` (flash-attn aligns causal masks
bottom-right, SDPA top-left), and KV heads dividing query heads (flash-attn handles GQA natively, so
un-repeated K/V stay un-repeated). Everything else goes to ``F.scaled_dot_product_attention``.

The signatures of flash-attn's private functions changed between 2.5, 2.6 and 2.7
(``window_size`` vs ``window_size_left/right``, ``softcap``, the number of returned values); the calls
below adapt by reading the signature. NOTE: this module cannot be exercised without a CUDA device and
the package; every entry point is guarded by :func:`available`.
"""
from __future__ import annotations

import functools
import inspect
import math

import torch
import torch.nn.functional as F

__all__ = ["available", "supported", "attention"]


@functools.lru_cache(maxsize=None)
def _interface():
    try:
        from flash_attn import flash_attn_interface as fai  # noqa: PLC0415
    except Exception:  # not installed, or built for another torch/CUDA
        return None
    if not hasattr(fai, "_flash_attn_forward") or not hasattr(fai, "_flash_attn_backward"):
        return None
    return fai


def available() -> bool:
    """Whether the flash-attn package can be used here (a CUDA device and an importable package)."""
    return torch.cuda.is_available() and _interface() is not None


def supported(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False) -> bool:
    """Whether flash-attn computes exactly what SDPA would for these arguments."""
    if not available() or attn_mask is not None or dropout_p != 0.0:
        return False
    if not (q.dim() == k.dim() == v.dim() == 4 and q.is_cuda):
        return False
    if not (q.dtype == k.dtype == v.dtype and q.dtype in (torch.float16, torch.bfloat16)):
        return False
    d = q.shape[-1]
    if not (k.shape[-1] == d and v.shape[-1] == d and d % 8 == 0 and d <= 256):
        return False
    if q.shape[0] != k.shape[0] or k.shape[:3] != v.shape[:3] or q.shape[1] % k.shape[1] != 0:
        return False
    return not is_causal or q.shape[-2] == k.shape[-2]


def _fill_kwargs(fn, values: dict) -> dict:
    """Keyword arguments for one of flash-attn's private functions, whatever its version."""
    params = inspect.signature(fn).parameters
    extra = {"window_size": (-1, -1), "window_size_left": -1, "window_size_right": -1, "softcap": 0.0,
             "alibi_slopes": None, "return_softmax": False, "deterministic": False, "rng_state": None}
    out = {}
    for name, p in params.items():
        if name in values:
            out[name] = values[name]
        elif name in extra:
            out[name] = extra[name]
        elif p.default is inspect.Parameter.empty:
            raise TypeError(f"flash_attn.{fn.__name__} needs an argument effpass does not know: {name!r}")
    return out


@functools.lru_cache(maxsize=None)
def _ops():
    """Register the two custom ops on first use (never on machines without the package)."""
    fai = _interface()

    @torch.library.custom_op("effpass::flash_attn_fwd", mutates_args=(), device_types="cuda")
    def flash_attn_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                       causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        kw = _fill_kwargs(fai._flash_attn_forward, dict(q=q, k=k, v=v, dropout_p=0.0, softmax_scale=scale,
                                                        causal=causal))
        res = fai._flash_attn_forward(**kw)
        out, lse = (res[0], res[1]) if len(res) == 4 else (res[0], res[5])  # 2.7+: 4 values; older: 8
        return out.contiguous(), lse.contiguous()

    @flash_attn_fwd.register_fake
    def _(q, k, v, scale, causal):
        b, s, h, d = q.shape
        return q.new_empty((b, s, h, d)), q.new_empty((b, h, s), dtype=torch.float32)

    @torch.library.custom_op("effpass::flash_attn_bwd", mutates_args=(), device_types="cuda")
    def flash_attn_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor, scale: float, causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v, dout = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, dout))
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        kw = _fill_kwargs(fai._flash_attn_backward, dict(dout=dout, q=q, k=k, v=v, out=out, softmax_lse=lse,
                                                         dq=dq, dk=dk, dv=dv, dropout_p=0.0, softmax_scale=scale,
                                                         causal=causal))
        fai._flash_attn_backward(**kw)
        return dq, dk, dv

    @flash_attn_bwd.register_fake
    def _(dout, q, k, v, out, lse, scale, causal):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def setup_context(ctx, inputs, output):
        q, k, v, scale, causal = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.causal = scale, causal

    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = flash_attn_bwd(dout, q, k, v, out, lse, ctx.scale, ctx.causal)
        return dq, dk, dv, None, None

    flash_attn_fwd.register_autograd(backward, setup_context=setup_context)
    return flash_attn_fwd


def attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``F.scaled_dot_product_attention`` that runs flash-attn's kernel where it applies."""
    if not supported(q, k, v, attn_mask, dropout_p, is_causal):
        kw = {"enable_gqa": True} if enable_gqa else {}
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale, **kw)
    scale = float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out, _ = _ops()(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale, bool(is_causal))
    return out.transpose(1, 2)


# ------------------------------------------------------------------------------------------------------
# varlen (packed rows) for pack_sequences
# ------------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _varlen_ops():
    """flash-attn's varlen forward/backward as custom ops (registered on first use, CUDA only)."""
    fai = _interface()
    if not hasattr(fai, "_flash_attn_varlen_forward"):
        return None

    @torch.library.custom_op("effpass::flash_attn_varlen_fwd", mutates_args=(), device_types="cuda")
    def varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int, scale: float,
                   causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        kw = _fill_kwargs(fai._flash_attn_varlen_forward, dict(
            q=q, k=k, v=v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len, max_seqlen_k=max_len,
            dropout_p=0.0, softmax_scale=scale, causal=causal))
        res = fai._flash_attn_varlen_forward(**kw)
        out, lse = (res[0], res[1]) if len(res) == 4 else (res[0], res[5])
        return out.contiguous(), lse.contiguous()

    @varlen_fwd.register_fake
    def _(q, k, v, cu, max_len, scale, causal):
        t, h, _ = q.shape
        return q.new_empty(q.shape), q.new_empty((h, t), dtype=torch.float32)

    @torch.library.custom_op("effpass::flash_attn_varlen_bwd", mutates_args=(), device_types="cuda")
    def varlen_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, cu: torch.Tensor, max_len: int, scale: float,
                   causal: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v, dout = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, dout))
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        kw = _fill_kwargs(fai._flash_attn_varlen_backward, dict(
            dout=dout, q=q, k=k, v=v, out=out, softmax_lse=lse, dq=dq, dk=dk, dv=dv, cu_seqlens_q=cu,
            cu_seqlens_k=cu, max_seqlen_q=max_len, max_seqlen_k=max_len, dropout_p=0.0, softmax_scale=scale,
            causal=causal))
        fai._flash_attn_varlen_backward(**kw)
        return dq, dk, dv

    @varlen_bwd.register_fake
    def _(dout, q, k, v, out, lse, cu, max_len, scale, causal):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def setup_context(ctx, inputs, output):
        q, k, v, cu, max_len, scale, causal = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, cu)
        ctx.max_len, ctx.scale, ctx.causal = max_len, scale, causal

    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, cu = ctx.saved_tensors
        dq, dk, dv = varlen_bwd(dout, q, k, v, out, lse, cu, ctx.max_len, ctx.scale, ctx.causal)
        return dq, dk, dv, None, None, None, None

    varlen_fwd.register_autograd(backward, setup_context=setup_context)
    return varlen_fwd


def varlen_attention(q, k, v, doc, causal: bool, scale=None):
    """Attention of packed rows ``(B, H, N, D)`` where ``doc`` ``(1 or B, N)`` holds example ids that never
    decrease along a row. The boundaries become ``cu_seqlens`` of fixed length ``B*N + 1`` (empty
    examples pad it) and ``max_seqlen = N``, so nothing is read back to the host."""
    b, h, n, d = q.shape
    ops = _varlen_ops() if available() else None
    if ops is None or not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16) or d % 8 or d > 256:
        same = doc[:, None, :, None] == doc[:, None, None, :]
        if causal:
            idx = torch.arange(n, device=q.device)
            same = same & (idx[:, None] >= idx[None, :])
        kw = {"enable_gqa": True} if k.shape[1] != h else {}
        return F.scaled_dot_product_attention(q, k, v, attn_mask=same, scale=scale, **kw)
    scale = float(scale) if scale is not None else 1.0 / math.sqrt(d)
    doc = doc.expand(b, n).long()
    doc = doc - doc[:, :1] + (torch.arange(b, device=q.device) * n)[:, None]  # ids unique across rows
    flat = doc.reshape(-1)
    cu = torch.searchsorted(flat, torch.arange(b * n + 1, device=q.device), right=False).to(torch.int32)
    qf, kf, vf = (t.transpose(1, 2).reshape(b * n, t.shape[1], d) for t in (q, k, v))
    out, _ = ops(qf, kf, vf, cu, n, scale, bool(causal))
    return out.reshape(b, n, h, d).transpose(1, 2)
