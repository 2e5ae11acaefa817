"""Row-wise functions of one or two heads' distributions (entropy, KL / JSD for distillation, z-loss, ...):
``effpass::linear_rowwise`` runs the row function ``fuse_cross_entropy`` extracted from the graph on blocks of full
rows of the heads' logits, and its backward differentiates it per block with autograd.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

import effpass

from ._fuse_ce_chunks import _COMPUTE, _acc_mm, default_chunk_bytes, weight_grad_dtype

__all__ = ["ROW_FNS", "ROWWISE_OPS", "register_row_fn", "rowwise_rows"]


# ------------------------------------------------------------------------------------------------------
# row-wise functions of one or two heads' distributions: entropy, KL / JSD (distillation), z-loss, ...
# ------------------------------------------------------------------------------------------------------
#: the row functions the graph pass extracted (``fx.GraphModule``: (z0[, z1], *row inputs) -> per-row
#: outputs), keyed by a hash of their code: the key is content-addressed, so a cached graph that names a
#: key always names the function this process registered for the same code
ROW_FNS: dict = {}


def register_row_fn(gm) -> str:
    """Registers ``gm`` (a row function) and returns its key (a hash of its code)."""
    import hashlib

    key = hashlib.sha1(gm.code.encode()).hexdigest()[:20]
    ROW_FNS.setdefault(key, gm)
    return key


def _row_fn(key: str):
    fn = ROW_FNS.get(key)
    if fn is None:
        raise RuntimeError(f"effpass::linear_rowwise: no row function {key!r} is registered in this process "
                           f"(it is registered by fuse_cross_entropy when it rewrites the graph)")
    return fn.forward  # NOTE: not __call__: global module hooks (FlopCounterMode's tracker) must not see it


def _transform(raw: Tensor, t: list[float]) -> Tensor:
    """The head's transform (``t = [pre, softcap, post]``) on raw logits, differentiable, in fp32."""
    pre, cap, post = t
    z = raw.float()
    if cap:
        return torch.tanh(z * pre) * post
    return z * pre if pre != 1.0 else z


class _Head:
    """One projection ``x @ w.T (+ xa @ wa.T) (+ b)`` in the compute dtype."""

    def __init__(self, x, w, b, xa, wa, t, compute):
        cd = _COMPUTE[compute] or torch.promote_types(x.dtype, w.dtype)
        self.x, self.w = x.to(cd), w.to(cd)
        self.b = b.to(cd) if b is not None else None
        self.xa = xa.to(cd) if xa is not None else None
        self.wa = wa.to(cd) if wa is not None else None
        self.t = list(t)

    def raw(self, r0, r1):
        z = self.x[r0:r1] @ self.w.t()
        if self.xa is not None:
            z.addmm_(self.xa[r0:r1], self.wa.t())
        if self.b is not None:
            z.add_(self.b)
        return z


def _heads(args, t0, t1, compute):
    x, w, b, xa, wa, y, v, c, ya, va = args
    heads = [_Head(x, w, b, xa, wa, t0, compute)]
    if y is not None:
        heads.append(_Head(y, v, c, ya, va, t1, compute))
    return heads


def _autograd_inside_op():
    """Autograd back on inside a custom op's implementation (which runs below the autograd dispatch keys):
    the row function is differentiated per block with ``torch.autograd.grad``.

    NOTE: ``torch.func.vjp`` also works there, but not under a ``TorchDispatchMode`` such as
    ``FlopCounterMode`` (the planner's replay): functorch's wrappers have no storage."""
    excl = torch._C._dispatch_tls_local_exclude_set()
    for name in ("AutogradFunctionality", "AutogradOther", "AutogradCPU", "AutogradCUDA", "ADInplaceOrView"):
        key = getattr(torch._C.DispatchKey, name, None)
        if key is not None:
            excl = excl.remove(key)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), excl)


def rowwise_rows(n: int, vocab: int, heads: int, chunk_bytes: int, x: Optional[Tensor] = None) -> int:
    """Rows per chunk of the row-wise op: full rows of every head's fp32 logits within ``chunk_bytes`` (0: the
    budget left to run time, a symbolic row count in the graph: the pass's default from ``x``, this call's rows)."""
    if chunk_bytes <= 0 and x is not None:
        chunk_bytes = default_chunk_bytes(n, vocab, x.numel() * x.element_size())
    return max(1, min(max(n, 1), chunk_bytes // (4 * vocab * max(heads, 1))))


@torch.library.custom_op("effpass::linear_rowwise", mutates_args=())
def _rowwise(x: Tensor, w: Tensor, b: Optional[Tensor], xa: Optional[Tensor], wa: Optional[Tensor],
             y: Optional[Tensor], v: Optional[Tensor], c: Optional[Tensor], ya: Optional[Tensor], va: Optional[Tensor],
             ext: list[Tensor], fn: str, t0: list[float], t1: list[float], chunk_bytes: int, compute: str,
             outs: int) -> Tensor:
    """``(N, outs)`` fp32: the row function ``fn`` of the transformed logits of one or two heads (x/w: the
    trained head, y/v: the second one, e.g. a teacher), computed on blocks of full rows."""
    f = _row_fn(fn)
    heads = _heads((x, w, b, xa, wa, y, v, c, ya, va), t0, t1, compute)
    n, vocab = x.shape[0], w.shape[0]
    out = torch.empty((n, outs), dtype=torch.float32, device=x.device)
    rows = rowwise_rows(n, vocab, len(heads), chunk_bytes, x)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        zs = [_transform(h.raw(r0, r1), h.t) for h in heads]
        res = f(*zs, *(e[r0:r1] for e in ext))
        del zs
        for j, o in enumerate(res):
            out[r0:r1, j] = o.reshape(r1 - r0)
    return out


@_rowwise.register_fake
def _(x, w, b, xa, wa, y, v, c, ya, va, ext, fn, t0, t1, chunk_bytes, compute, outs):
    return x.new_empty((x.shape[0], outs), dtype=torch.float32)


@torch.library.custom_op("effpass::linear_rowwise_backward", mutates_args=())
def _rowwise_bwd(grad: Tensor, x: Tensor, w: Tensor, b: Optional[Tensor], xa: Optional[Tensor], wa: Optional[Tensor],
                 y: Optional[Tensor], v: Optional[Tensor], c: Optional[Tensor], ya: Optional[Tensor],
                 va: Optional[Tensor], ext: list[Tensor], fn: str, t0: list[float], t1: list[float], chunk_bytes: int,
                 compute: str, mask: list[bool]) -> list[Tensor]:
    """Gradients of x, w, b, xa, wa, y, v, c, ya, va (empty where not asked for): each block of rows is
    recomputed and the row function differentiated by autograd on it; the logits' gradient block is pushed
    through the projection(s)."""
    f = _row_fn(fn)
    args = (x, w, b, xa, wa, y, v, c, ya, va)
    heads = _heads(args, t0, t1, compute)
    n, vocab = x.shape[0], w.shape[0]
    f32 = torch.float32
    cd = [heads[k].x.dtype for k in range(len(heads))]
    acc = [torch.zeros(a.shape, dtype=(weight_grad_dtype(a.dtype, cd[i // 5]) if i % 5 in (1, 4) else f32),
                       device=x.device) if (a is not None and mask[i]) else None
           for i, a in enumerate(args)]
    rows = rowwise_rows(n, vocab, len(heads), chunk_bytes, x)
    g = grad.float()
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        raws = [h.raw(r0, r1) for h in heads]
        want = [k for k in range(len(heads)) if any(mask[5 * k:5 * k + 5])]
        if not want:
            continue
        with _autograd_inside_op(), torch.enable_grad():
            zs = list(raws)
            for k in want:
                zs[k] = raws[k].requires_grad_()
            zs = [_transform(z, h.t) for z, h in zip(zs, heads)]
            outs_ = [o.reshape(r1 - r0).float() for o in f(*zs, *(e[r0:r1] for e in ext))]
            pairs = [(o, g[r0:r1, j]) for j, o in enumerate(outs_) if o.requires_grad]
            ds = torch.autograd.grad([o for o, _ in pairs], [raws[k] for k in want], [gg for _, gg in pairs],
                                     allow_unused=True) if pairs else [None] * len(want)
        leaves = [(k, None) for k in want]
        del raws, zs, outs_, pairs
        for (k, _), d in zip(leaves, ds):
            if d is None:
                continue
            h, i = heads[k], 5 * k
            if acc[i] is not None:
                _acc_mm(acc[i][r0:r1], d, h.w)
            if acc[i + 1] is not None:
                _acc_mm(acc[i + 1], d.t(), h.x[r0:r1])
            if acc[i + 2] is not None:
                acc[i + 2] += d.sum(0)
            if acc[i + 3] is not None:
                _acc_mm(acc[i + 3][r0:r1], d, h.wa)
            if acc[i + 4] is not None:
                _acc_mm(acc[i + 4], d.t(), h.xa[r0:r1])
    return [a.to(args[i].dtype) if a is not None else x.new_empty(0) for i, a in enumerate(acc)]


@_rowwise_bwd.register_fake
def _(grad, x, w, b, xa, wa, y, v, c, ya, va, ext, fn, t0, t1, chunk_bytes, compute, mask):
    args = (x, w, b, xa, wa, y, v, c, ya, va)
    return [torch.empty_like(a) if (a is not None and mask[i]) else x.new_empty(0) for i, a in enumerate(args)]


def _rowwise_setup(ctx, inputs, output):
    tensors = inputs[:10]
    ctx.n_ext = len(inputs[10])
    ctx.consts = inputs[11:16]
    ctx.present = [t is not None for t in tensors]
    ctx.mask = [bool(ctx.needs_input_grad[i]) and tensors[i] is not None for i in range(10)]
    ctx.save_for_backward(*tensors, *inputs[10])


def _rowwise_backward(ctx, g):
    saved = ctx.saved_tensors
    tensors, ext = saved[:10], list(saved[10:])
    grads = _rowwise_bwd(g, *tensors, ext, *ctx.consts, ctx.mask)
    out = [d if (m and d.numel()) else None for m, d in zip(ctx.mask, grads)]
    return (*out, [None] * ctx.n_ext, None, None, None, None, None, None)


_rowwise.register_autograd(_rowwise_backward, setup_context=_rowwise_setup)


def _rowwise_flops(x, w, xa, y, v, ya, mask=None) -> int:
    """Matmul FLOPs of the row-wise op: every head's logits (2*N*H*V, plus an adapter's), and in the backward
    the logits again plus one matmul per gradient asked for."""
    n, vocab = x.shape[0], w.shape[0]
    per = [2 * n * x.shape[-1] * vocab + (2 * n * xa.shape[-1] * vocab if xa is not None else 0)]
    if y is not None:
        per.append(2 * n * y.shape[-1] * vocab + (2 * n * ya.shape[-1] * vocab if ya is not None else 0))
    if mask is None:
        return sum(per)
    total = sum(per)
    for k, p in enumerate(per):
        m = mask[5 * k:5 * k + 5]
        total += (p if m[0] or m[3] else 0) + (p if m[1] or m[4] else 0)
    return total


effpass.register_flop_formula(torch.ops.effpass.linear_rowwise,
                              lambda x, w, b, xa, wa, y, v, c, ya, va, *a, out_val=None, **k:
                              _rowwise_flops(x, w, xa, y, v, ya))
effpass.register_flop_formula(torch.ops.effpass.linear_rowwise_backward,
                              lambda grad, x, w, b, xa, wa, y, v, c, ya, va, *a, out_val=None, **k:
                              _rowwise_flops(x, w, xa, y, v, ya, list(a[6]) if len(a) > 6 else k.get("mask")))

#: the row-wise op (the joint hook marks it never-recompute)
ROWWISE_OPS = (torch.ops.effpass.linear_rowwise.default,)
