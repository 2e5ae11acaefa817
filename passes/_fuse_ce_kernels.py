"""The chunked linear + cross-entropy kernel of ``fuse_cross_entropy`` and its custom ops.

Plain torch run eagerly inside ``torch.library.custom_op``s (opaque to Inductor, which can then neither fuse,
reorder nor keep extra chunks alive):

* ``effpass::linear_cross_entropy``: ``sum``/``mean`` loss; the gradients of the inputs are computed in the
  forward, chunk by chunk (as Liger does); the registered backward only scales them by the incoming gradient;
* ``effpass::linear_cross_entropy_rows`` (+ ``_backward``): per-row losses and log-sum-exp; the backward
  recomputes each chunk.

:func:`linear_cross_entropy` is the eager entry point. The graph pass that inserts the ops is
``passes/fuse_cross_entropy.py``; the matcher that finds the sites is ``passes/_fuse_ce_match.py``.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

import effpass

__all__ = ["MIN_FULL_ROWS", "MIN_CHUNK_ROWS", "TILE_ROWS", "CPU_ROWS_TILE_BYTES", "plan_chunks", "default_chunk_bytes",
           "default_rows_chunk_bytes", "num_chunks",
           "linear_cross_entropy", "OPS", "NO_IGNORE"]

#: a full row block of logits is used when the budget holds at least this many rows (else 2-D tiles)
MIN_FULL_ROWS = 128
#: the default budget never holds fewer rows than this (or a quarter of the rows, so that a small batch is
#: still cut in four): every chunk re-reads the head's weight
#: and reads and writes its gradient, so the op's arithmetic intensity is about ``3 * rows / 8`` flops per
#: byte (fp32) whatever the hidden size and vocabulary; below ~256 rows the step is bound by that traffic and
#: by per-chunk overhead (docs/fuse_cross_entropy.md, "Choosing the chunk")
MIN_CHUNK_ROWS = 256
#: the per-row ops' tiles (a budget smaller than full rows) hold at most this many rows
TILE_ROWS = 256
#: the per-row ops' default budget on CPU: a tile of fp32 logits that stays in the cache (bench, docs/fused_losses.md)
CPU_ROWS_TILE_BYTES = 2 << 20
_COMPUTE = {"": None, "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


# ------------------------------------------------------------------------------------------------------
# the chunked kernel (plain torch, run eagerly inside the custom ops)
# ------------------------------------------------------------------------------------------------------
def plan_chunks(rows: int, vocab: int, chunk_bytes: int, max_tile_rows: int = 0) -> tuple[int, int]:
    """``(rows per chunk, vocabulary entries per chunk)`` for a fp32 logits tile of at most
    ``chunk_bytes``: full rows when at least ``MIN_FULL_ROWS`` (or a quarter of the rows) fit, else a
    near-square tile (of at most ``max_tile_rows`` rows when given: the per-row ops)."""
    elems = max(1, chunk_bytes // 4)
    rows = max(1, rows)
    full = elems // vocab
    if full >= min(-(-rows // 4), MIN_FULL_ROWS):
        return max(1, min(rows, full)), vocab
    r = max(1, min(rows, math.isqrt(elems), max_tile_rows or rows))
    return r, max(1, min(vocab, elems // r))


def plan_row_tiles(rows: int, vocab: int, chunk_bytes: int) -> tuple[int, int]:
    """The per-row ops' plan: as :func:`plan_chunks`, tiles of at most ``TILE_ROWS`` rows. Cutting the vocabulary
    costs these ops no matmul (their backward recomputes every tile whatever its shape: 4 matmul-equivalents for
    a trained head either way), only an online log-sum-exp over the tiles' row maxima."""
    return plan_chunks(rows, vocab, chunk_bytes, TILE_ROWS)


def default_rows_chunk_bytes(rows: int, vocab: int, hidden_bytes: int, device_type: str) -> int:
    """The per-row ops' default budget: on CPU a cache-sized tile (``CPU_ROWS_TILE_BYTES``: the elementwise work
    of the log-softmax and its gradient then reads and writes the cache, not memory); elsewhere
    :func:`default_chunk_bytes` (full row blocks: fewer, larger kernels)."""
    if device_type == "cpu":
        return CPU_ROWS_TILE_BYTES
    return default_chunk_bytes(rows, vocab, hidden_bytes)


def default_chunk_bytes(rows: int, vocab: int, hidden_bytes: int) -> int:
    """The default budget: a chunk of fp32 logits no larger than the larger of the batch's hidden states
    (``hidden_bytes``) and ``min(MIN_CHUNK_ROWS, rows / 4)`` full rows of logits."""
    return max(int(hidden_bytes), min(-(-max(rows, 1) // 4), MIN_CHUNK_ROWS) * vocab * 4)


def num_chunks(rows: int, vocab: int, chunk_bytes: int, per_row: bool = False) -> int:
    r, v = (plan_row_tiles if per_row else plan_chunks)(rows, vocab, chunk_bytes)
    return math.ceil(max(rows, 0) / r) * math.ceil(vocab / v) if rows > 0 else 0


class _Spec:
    """The per-call constants of the kernel."""

    def __init__(self, vocab, ignore_index, smoothing, pre, softcap, post, chunk_bytes, compute, per_row=False):
        self.vocab, self.ignore_index, self.smoothing = vocab, ignore_index, smoothing
        self.plan = plan_row_tiles if per_row else plan_chunks
        self.pre, self.softcap, self.post = pre, softcap, post
        self.chunk_bytes, self.compute = chunk_bytes, _COMPUTE[compute]
        #: a constant factor of every row's gradient (``mean``: 1 / valid rows), applied to each tile of logit
        #: gradients in fp32 before it is cast to the matmul dtype, as the unfused graph scales its logits' gradient
        self.grad_scale = 1.0

    def logits(self, xs, ws, bias, r0, r1, v0, v1):
        """The transformed fp32 logits of rows ``r0:r1`` and vocabulary ``v0:v1`` (and tanh's output)."""
        z = None
        for x, w in zip(xs, ws):
            part = x[r0:r1] @ w[v0:v1].t()
            z = part if z is None else z.add_(part)
        if bias is not None:
            z = z.add_(bias[v0:v1])
        z = z.float()
        if self.softcap:
            t = z.mul_(self.pre).tanh_()
            return t * self.post, t
        if self.pre != 1.0:
            z = z.mul_(self.pre)
        return z, None


def _prepare(x, w, x2, w2, bias, target, spec: _Spec):
    """Valid rows (label != ignore_index), their inputs in the compute dtype, and checks."""
    valid = (target != spec.ignore_index).nonzero().squeeze(1)
    tgt = target.index_select(0, valid)
    if tgt.numel() and (int(tgt.min()) < 0 or int(tgt.max()) >= spec.vocab):
        bad = int(tgt.min()) if int(tgt.min()) < 0 else int(tgt.max())
        raise IndexError(f"cross_entropy: target {bad} is out of bounds for {spec.vocab} classes")
    cd = spec.compute
    xs = [x.index_select(0, valid)]
    ws = [w]
    if x2 is not None:
        xs.append(x2.index_select(0, valid))
        ws.append(w2)
    if cd is None:
        cd = torch.promote_types(x.dtype, w.dtype)
    xs = [t.to(cd) for t in xs]
    ws = [t.to(cd) for t in ws]
    b = bias.to(cd) if bias is not None else None
    return valid, tgt, xs, ws, b


def _forward_pass(xs, ws, b, tgt, spec: _Spec, grads: Optional[dict], gscale: Optional[Tensor]):
    """Per-row loss and log-sum-exp of the valid rows; with ``grads`` also accumulates the gradients
    (``gscale``: per-row gradient of the loss, None for 1)."""
    n, vocab, eps = tgt.shape[0], spec.vocab, spec.smoothing
    loss = torch.empty(n, dtype=torch.float32, device=tgt.device)
    lse_all = torch.empty(n, dtype=torch.float32, device=tgt.device)
    if n == 0:
        return loss, lse_all
    rows, vt = spec.plan(n, vocab, spec.chunk_bytes)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        t = tgt[r0:r1]
        if vt == vocab:  # one pass: the full rows fit in a chunk
            # NOTE(speed): log_softmax is one vectorised kernel (max, sum of exp, write); logsumexp then
            # z - lse then exp took three more passes over the chunk and a temporary of its size
            z, th = spec.logits(xs, ws, b, r0, r1, 0, vocab)
            zt = z.gather(1, t[:, None]).squeeze(1)
            ls = torch.log_softmax(z, 1)
            del z
            lst = ls.gather(1, t[:, None]).squeeze(1)
            lse = zt - lst
            if eps:  # the smoothing term: lse - mean_v z_v = -mean_v log_softmax_v
                smooth = ls.sum(1).div_(-vocab)
        else:  # log-sum-exp over vocabulary tiles, combined with logaddexp (online softmax)
            lse = torch.full((r1 - r0,), -math.inf, device=t.device)
            zt = torch.zeros(r1 - r0, device=t.device)
            zsum = torch.zeros(r1 - r0, device=t.device) if eps else None
            for v0 in range(0, vocab, vt):
                v1 = min(vocab, v0 + vt)
                z, _ = spec.logits(xs, ws, b, r0, r1, v0, v1)
                inside = (t >= v0) & (t < v1)
                zt = torch.where(inside, z.gather(1, (t - v0).clamp(0, v1 - v0 - 1)[:, None]).squeeze(1), zt)
                if eps:
                    zsum += z.sum(1)
                lse = torch.logaddexp(lse, torch.logsumexp(z, 1))
            smooth = lse - zsum / vocab if eps else None
        lse_all[r0:r1] = lse
        l = lse - zt
        if eps:
            l = (1.0 - eps) * l + eps * smooth
        loss[r0:r1] = l
        if grads is not None:
            g = gscale[r0:r1] if gscale is not None else None
            if vt == vocab:
                _grad_tile(ls.exp_(), th, t, g, xs, ws, r0, r1, 0, vocab, spec, grads)
            else:
                for v0 in range(0, vocab, vt):
                    v1 = min(vocab, v0 + vt)
                    z, th = spec.logits(xs, ws, b, r0, r1, v0, v1)
                    _grad_tile(_softmax_(z, lse), th, t, g, xs, ws, r0, r1, v0, v1, spec, grads)
        ls = None
    return loss, lse_all


def _x_grad_pass(xs, ws, b, tgt, spec: _Spec):
    """Per-row loss, log-sum-exp and ``d loss / d x`` of a frozen head (only ``x`` needs a gradient), in the
    forward's one pass over the tiles (online softmax, rescaled as the row maxima grow):
    ``gx = sum_v (p_v - [v == t]) c_v W_v`` with ``c_v`` the transform's derivative. The backward then only
    scales ``gx`` by the incoming per-row gradient: 2 matmul-equivalents in all, as unfused (logits, input
    gradient), where recomputing in the backward costs 3."""
    (x,), (w,) = xs, ws
    n, vocab = tgt.shape[0], spec.vocab
    f32, dev = torch.float32, tgt.device
    loss = torch.empty(n, dtype=f32, device=dev)
    lse_all = torch.empty(n, dtype=f32, device=dev)
    gx = torch.zeros(n, x.shape[1], dtype=f32, device=dev)
    if n == 0:
        return loss, lse_all, gx
    rows, vt = spec.plan(n, vocab, spec.chunk_bytes)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        t = tgt[r0:r1]
        m = torch.full((r1 - r0,), -math.inf, device=dev)
        ssum = torch.zeros(r1 - r0, device=dev)
        zt = torch.zeros(r1 - r0, device=dev)
        ct = torch.full((r1 - r0,), spec.pre, device=dev)
        u = gx[r0:r1]
        for v0 in range(0, vocab, vt):
            v1 = min(vocab, v0 + vt)
            z, th = spec.logits(xs, ws, b, r0, r1, v0, v1)
            inside = (t >= v0) & (t < v1)
            local = (t - v0).clamp(0, v1 - v0 - 1)[:, None]
            zt = torch.where(inside, z.gather(1, local).squeeze(1), zt)
            m_new = torch.maximum(m, z.amax(1))
            scale = torch.exp(m - m_new)
            e = z.sub_(m_new[:, None]).exp_()
            ssum = ssum * scale + e.sum(1)
            if th is not None:  # d softcap(z)/dz = pre * post * (1 - tanh^2)
                deriv = th.mul_(th).neg_().add_(1.0).mul_(spec.pre * spec.post)
                ct = torch.where(inside, deriv.gather(1, local).squeeze(1), ct)
                e.mul_(deriv)
            elif spec.pre != 1.0:
                e.mul_(spec.pre)
            u.mul_(scale[:, None])
            _acc_mm(u, e.to(x.dtype), w[v0:v1])
            m = m_new
        lse = m + ssum.log()
        u.div_(ssum[:, None])
        u.sub_(ct[:, None] * w.index_select(0, t).float())
        lse_all[r0:r1] = lse
        loss[r0:r1] = lse - zt
    return loss, lse_all, gx


def _backward_pass(xs, ws, b, tgt, lse_all, gscale, spec: _Spec, grads: dict):
    n, vocab = tgt.shape[0], spec.vocab
    if n == 0:
        return
    rows, vt = spec.plan(n, vocab, spec.chunk_bytes)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        for v0 in range(0, vocab, vt):
            v1 = min(vocab, v0 + vt)
            z, th = spec.logits(xs, ws, b, r0, r1, v0, v1)
            _grad_tile(_softmax_(z, lse_all[r0:r1]), th, tgt[r0:r1], gscale[r0:r1], xs, ws, r0, r1, v0, v1, spec,
                       grads)


def _softmax_(z: Tensor, lse: Tensor) -> Tensor:
    """``exp(z - lse)`` in ``z``'s buffer: the softmax of a tile given its rows' log-sum-exp."""
    return z.sub_(lse[:, None]).exp_()


def _grad_tile(d, th, t, g, xs, ws, r0, r1, v0, v1, spec: _Spec, grads: dict):
    """d loss / d logits for one tile (``d``: its softmax, overwritten: minus the smoothed one-hot, times
    the row's gradient), pushed through the transform and the projection(s) into the accumulators."""
    eps = spec.smoothing
    if th is not None:  # d softcap(z)/dz = pre * post * (1 - tanh^2), computed in tanh's buffer
        deriv = th.mul_(th).neg_().add_(1.0).mul_(spec.pre * spec.post)
    inside = (t >= v0) & (t < v1)
    rows = inside.nonzero().squeeze(1)
    if rows.numel():
        d.index_put_((rows, t[rows] - v0), torch.full((rows.numel(),), -(1.0 - eps), device=d.device),
                     accumulate=True)
    if eps:
        d.sub_(eps / spec.vocab)
    if th is not None:
        d.mul_(deriv)
    factor = spec.grad_scale * (spec.pre if th is None else 1.0)
    if g is not None:
        factor = g[:, None] * factor
    cd = xs[0].dtype
    if cd != d.dtype and grads["b"] is None:  # NOTE(speed): the row scale and the cast in one pass over the tile
        dc = torch.mul(d, factor, out=torch.empty(d.shape, dtype=cd, device=d.device))
    else:
        if isinstance(factor, Tensor) or factor != 1.0:
            d.mul_(factor)
        dc = d.to(cd)
    for i, (x, w) in enumerate(zip(xs, ws)):
        if grads["x"][i] is not None:
            _acc_mm(grads["x"][i][r0:r1], dc, w[v0:v1])
        if grads["w"][i] is not None:
            _acc_mm(grads["w"][i][v0:v1], dc.t(), x[r0:r1])
    if grads["b"] is not None:
        grads["b"][v0:v1] += d.sum(0)


def _acc_mm(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """``acc += a @ b``: one ``addmm_`` when the accumulator has the operands' dtype (a low-precision weight's
    gradient: the GEMM accumulates in fp32 and rounds once per call), else the product is added (an fp32
    accumulator of low-precision operands: autocast)."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    else:
        acc.add_(a @ b)


_LOW = (torch.bfloat16, torch.float16)


def weight_grad_dtype(param_dtype: torch.dtype, compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype a head weight's gradient is accumulated in: the weight's own dtype when it is bf16/fp16 and the
    matmuls run in it (a bf16 model without autocast: the unfused graph's gradient is a bf16 matmul output, so
    the accumulator is the gradient itself and no full-size fp32 buffer exists), else fp32 (an fp32 weight, or
    an fp32 weight under autocast, whose gradient is fp32)."""
    return param_dtype if (param_dtype in _LOW and compute_dtype == param_dtype) else torch.float32


def _accumulators(xs, ws, has_bias, mask, vocab, device, w_dtypes=(None, None)):
    """fp32 accumulators of the rows' and the bias's gradients; the weights' in :func:`weight_grad_dtype`
    (``w_dtypes``: the weights' own dtypes, before the cast to the compute dtype)."""
    f32 = torch.float32
    return {"x": [torch.zeros(x.shape, dtype=f32, device=device) if mask[i] else None for i, x in enumerate(xs)],
            "w": [torch.zeros(w.shape, dtype=weight_grad_dtype(w_dtypes[i] or f32, w.dtype), device=device)
                  if mask[2 + i] else None for i, w in enumerate(ws)],
            "b": torch.zeros(vocab, dtype=f32, device=device) if has_bias and mask[4] else None}


def _scatter_grads(acc, valid, x, w, x2, w2, bias, scale):
    """Full-size gradients in the inputs' dtypes (empty tensors for those not asked for)."""
    def rows(a, like):
        if a is None:
            return like.new_empty(0)
        out = torch.zeros(like.shape, dtype=torch.float32, device=like.device)
        out.index_copy_(0, valid, a)
        if scale is not None:
            out.mul_(scale)
        return out.to(like.dtype)

    def whole(a, like):
        if a is None or like is None:
            return (like if like is not None else x).new_empty(0)
        if scale is not None:
            a.mul_(scale)
        return a.to(like.dtype)

    dx2 = rows(acc["x"][1], x2) if x2 is not None else x.new_empty(0)
    dw2 = whole(acc["w"][1], w2) if w2 is not None else x.new_empty(0)
    return rows(acc["x"][0], x), whole(acc["w"][0], w), dx2, dw2, whole(acc["b"], bias)


# ------------------------------------------------------------------------------------------------------
# the custom ops
# ------------------------------------------------------------------------------------------------------
@torch.library.custom_op("effpass::linear_cross_entropy", mutates_args=())
def _lce_reduced(x: Tensor, w: Tensor, x2: Optional[Tensor], w2: Optional[Tensor], bias: Optional[Tensor],
                 target: Tensor, ignore_index: int, smoothing: float, pre: float, softcap: bool, post: float,
                 mean: bool, chunk_bytes: int, compute: str, grad_mask: list[bool]
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Summed (``mean``: averaged over valid rows) loss and the gradients of x, w, x2, w2, bias."""
    spec = _Spec(w.shape[0], ignore_index, smoothing, pre, softcap, post, chunk_bytes, compute)
    valid, tgt, xs, ws, b = _prepare(x, w, x2, w2, bias, target, spec)
    acc = _accumulators(xs, ws, bias is not None, grad_mask, spec.vocab, x.device,
                        (w.dtype, w2.dtype if w2 is not None else None))
    count = tgt.shape[0]
    if mean and count:
        spec.grad_scale = 1.0 / count  # applied to each tile's logit gradient (fp32), before the matmuls
    loss, _ = _forward_pass(xs, ws, b, tgt, spec, acc, None)
    total = loss.sum()
    if mean:
        total = total / count if count else total * float("nan")  # 0/0, as torch's mean
    return (total,) + _scatter_grads(acc, valid, x, w, x2, w2, bias, None)


@_lce_reduced.register_fake
def _(x, w, x2, w2, bias, target, ignore_index, smoothing, pre, softcap, post, mean, chunk_bytes, compute,
      grad_mask):
    def like(t, on):
        return torch.empty_like(t) if (t is not None and on) else x.new_empty(0)

    loss = x.new_empty((), dtype=torch.float32)
    return (loss, like(x, grad_mask[0]), like(w, grad_mask[2]), like(x2, grad_mask[1]), like(w2, grad_mask[3]),
            like(bias, grad_mask[4]))


def _reduced_setup(ctx, inputs, output):
    ctx.save_for_backward(*output[1:])
    ctx.present = [inputs[i] is not None for i in range(5)]


def _reduced_backward(ctx, g, *_):
    dx, dw, dx2, dw2, db = ctx.saved_tensors
    out = []
    for present, d in zip(ctx.present, (dx, dw, dx2, dw2, db)):
        out.append(d * g.to(d.dtype) if present and d.numel() else None)
    return (*out, None, None, None, None, None, None, None, None, None, None)


_lce_reduced.register_autograd(_reduced_backward, setup_context=_reduced_setup)


@torch.library.custom_op("effpass::linear_cross_entropy_rows", mutates_args=())
def _lce_rows(x: Tensor, w: Tensor, x2: Optional[Tensor], w2: Optional[Tensor], bias: Optional[Tensor],
              target: Tensor, ignore_index: int, smoothing: float, pre: float, softcap: bool, post: float,
              chunk_bytes: int, compute: str, x_grad: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row losses (0 on ignored rows, as ``reduction="none"``), per-row log-sum-exp, and with ``x_grad``
    (a frozen head: only ``x`` needs a gradient; no second projection, no smoothing) ``d loss_i / d x_i``
    computed in the same pass (else an empty tensor)."""
    spec = _Spec(w.shape[0], ignore_index, smoothing, pre, softcap, post, chunk_bytes, compute, True)
    valid, tgt, xs, ws, b = _prepare(x, w, x2, w2, bias, target, spec)
    n = target.shape[0]
    if x_grad:
        if x2 is not None or smoothing:
            raise ValueError("linear_cross_entropy_rows(x_grad=True) takes one projection without label smoothing")
        loss_v, lse_v, gx_v = _x_grad_pass(xs, ws, b, tgt, spec)
        gx = torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_copy_(0, valid, gx_v).to(x.dtype)
    else:
        loss_v, lse_v = _forward_pass(xs, ws, b, tgt, spec, None, None)
        gx = x.new_empty(0)
    loss = torch.zeros(n, dtype=torch.float32, device=x.device).index_copy_(0, valid, loss_v)
    lse = torch.zeros(n, dtype=torch.float32, device=x.device).index_copy_(0, valid, lse_v)
    return loss, lse, gx


@_lce_rows.register_fake
def _(x, w, x2, w2, bias, target, ignore_index, smoothing, pre, softcap, post, chunk_bytes, compute, x_grad=False):
    n = target.shape[0]
    return (x.new_empty((n,), dtype=torch.float32), x.new_empty((n,), dtype=torch.float32),
            torch.empty_like(x) if x_grad else x.new_empty(0))


@torch.library.custom_op("effpass::linear_cross_entropy_rows_backward", mutates_args=())
def _lce_rows_bwd(grad: Tensor, lse: Tensor, x: Tensor, w: Tensor, x2: Optional[Tensor], w2: Optional[Tensor],
                  bias: Optional[Tensor], target: Tensor, ignore_index: int, smoothing: float, pre: float,
                  softcap: bool, post: float, chunk_bytes: int, compute: str, grad_mask: list[bool]
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    spec = _Spec(w.shape[0], ignore_index, smoothing, pre, softcap, post, chunk_bytes, compute, True)
    valid, tgt, xs, ws, b = _prepare(x, w, x2, w2, bias, target, spec)
    acc = _accumulators(xs, ws, bias is not None, grad_mask, spec.vocab, x.device,
                        (w.dtype, w2.dtype if w2 is not None else None))
    _backward_pass(xs, ws, b, tgt, lse.index_select(0, valid), grad.float().index_select(0, valid), spec, acc)
    return _scatter_grads(acc, valid, x, w, x2, w2, bias, None)


@_lce_rows_bwd.register_fake
def _(grad, lse, x, w, x2, w2, bias, target, ignore_index, smoothing, pre, softcap, post, chunk_bytes, compute,
      grad_mask):
    def like(t, on):
        return torch.empty_like(t) if (t is not None and on) else x.new_empty(0)

    return like(x, grad_mask[0]), like(w, grad_mask[2]), like(x2, grad_mask[1]), like(w2, grad_mask[3]), like(bias, grad_mask[4])


def _head_flops(x, w, x2, w2, grad_mask=None) -> int:
    """Matmul FLOPs of the chunked head: the logits (2*N*H*V, plus the adapter's 2*N*r*V; computed again
    by the per-row form's backward) and one matmul per gradient computed (dx, dw; dx2, dw2)."""
    n, v = x.shape[0], w.shape[0]
    main, side = 2 * n * x.shape[-1] * v, (2 * n * x2.shape[-1] * v if x2 is not None and x2.numel() else 0)
    m = grad_mask or [False] * 5
    return main * (1 + m[0] + m[2]) + side * (1 + m[1] + m[3])


# for the memory planner (effpass.memory_options): the per-row op also serves the log-probability sites
effpass.register_flop_formula(torch.ops.effpass.linear_cross_entropy, lambda x, w, x2, w2, bias, target, *a, out_val=None, **k:
                              _head_flops(x, w, x2, w2, list(a[8]) if len(a) > 8 else k.get("grad_mask")))
effpass.register_flop_formula(torch.ops.effpass.linear_cross_entropy_rows,  # x_grad: the input gradient too
                              lambda x, w, x2, w2, *a, out_val=None, **k: _head_flops(x, w, x2, w2) * (
                                  2 if (a[9] if len(a) > 9 else k.get("x_grad", False)) else 1))
effpass.register_flop_formula(torch.ops.effpass.linear_cross_entropy_rows_backward,
                              lambda grad, lse, x, w, x2, w2, bias, target, *a, out_val=None, **k: _head_flops(
                                  x, w, x2, w2, list(a[7]) if len(a) > 7 else k.get("grad_mask")))


def _rows_setup(ctx, inputs, output):
    x, w, x2, w2, bias, target = inputs[:6]
    ctx.consts = inputs[6:13]
    ctx.x_grad = bool(inputs[13]) if len(inputs) > 13 else False
    ctx.present = [t is not None for t in (x, w, x2, w2, bias)]
    ctx.mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[2], ctx.needs_input_grad[1],
                ctx.needs_input_grad[3], ctx.needs_input_grad[4]]
    if ctx.x_grad:
        if any(ctx.mask[1:]):  # NOTE: a gradient the forward did not compute would silently be None
            raise RuntimeError("linear_cross_entropy_rows(x_grad=True): only x may need a gradient (the head's "
                               "weight, bias and second projection must be frozen)")
        ctx.save_for_backward(output[2])
    else:
        ctx.save_for_backward(x, w, x2, w2, bias, target, output[1])


def _rows_backward(ctx, g, _glse, _ggx):
    if ctx.x_grad:
        (gx,) = ctx.saved_tensors
        dx = gx * g[:, None].to(gx.dtype) if ctx.mask[0] else None
        return (dx, None, None, None, None, None, None, None, None, None, None, None, None, None)
    x, w, x2, w2, bias, target, lse = ctx.saved_tensors
    grads = _lce_rows_bwd(g, lse, x, w, x2, w2, bias, target, *ctx.consts, ctx.mask)
    dx, dw, dx2, dw2, db = grads
    out = [d if (p and d.numel()) else None for p, d in zip(ctx.present, (dx, dw, dx2, dw2, db))]
    return (*out, None, None, None, None, None, None, None, None, None)


_lce_rows.register_autograd(_rows_backward, setup_context=_rows_setup)


def linear_cross_entropy(x: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None = None, *,
                         ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                         scale: float = 1.0, softcap: float | None = None, chunk_bytes: int | None = None,
                         compute_dtype: torch.dtype | None = None, x2: Tensor | None = None,
                         weight2: Tensor | None = None) -> Tensor:
    """``F.cross_entropy(transform(x @ weight.T + bias [+ x2 @ weight2.T]), target)`` in chunks.

    ``transform`` is ``z * scale``, or ``softcap * tanh(z * scale / softcap)`` with ``softcap``.
    ``x`` is ``(N, H)``, ``target`` ``(N,)``. The chunk budget defaults to ``default_chunk_bytes``: the
    larger of the bytes of ``x`` and ``MIN_CHUNK_ROWS`` rows of logits.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction {reduction!r} is not valid; choose one of ['mean', 'sum', 'none']")
    if chunk_bytes is None:
        chunk_bytes = default_chunk_bytes(x.shape[0], weight.shape[0], x.numel() * x.element_size())
    pre, post, cap = (scale / softcap, softcap, True) if softcap else (scale, 1.0, False)
    compute = "" if compute_dtype is None else str(compute_dtype).removeprefix("torch.")
    if reduction == "none":
        return _lce_rows(x, weight, x2, weight2, bias, target, ignore_index, float(label_smoothing), pre, cap,
                         post, int(chunk_bytes), compute)[0]
    mask = [x.requires_grad, x2 is not None and x2.requires_grad, weight.requires_grad,
            weight2 is not None and weight2.requires_grad, bias is not None and bias.requires_grad]
    return _lce_reduced(x, weight, x2, weight2, bias, target, ignore_index, float(label_smoothing), pre, cap, post,
                        reduction == "mean", int(chunk_bytes), compute, mask)[0]



#: the ``ignore_index`` of log-probability sites: no row is ignored (a negative index raises, as gather)
NO_IGNORE = -(2 ** 63)

#: the ops the graph pass inserts (the joint hook marks them never-recompute)
OPS = (torch.ops.effpass.linear_cross_entropy.default, torch.ops.effpass.linear_cross_entropy_rows.default)



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


def rowwise_rows(n: int, vocab: int, heads: int, chunk_bytes: int) -> int:
    """Rows per chunk of the row-wise op: full rows of every head's fp32 logits within ``chunk_bytes``."""
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
    rows = rowwise_rows(n, vocab, len(heads), chunk_bytes)
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
    rows = rowwise_rows(n, vocab, len(heads), chunk_bytes)
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

OPS = OPS + (torch.ops.effpass.linear_rowwise.default,)
