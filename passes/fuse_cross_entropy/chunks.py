"""The chunked linear + cross-entropy kernel of ``fuse_cross_entropy``: the chunk plan and the passes over the chunks.

Plain torch (matmuls, ``log_softmax``, ``exp``; bf16 operands multiply in bf16), run eagerly inside the custom ops of
``kernels.py``: the forward pass (loss, log-sum-exp and, for ``sum``/``mean``, every gradient), the
frozen-head pass (the input gradient in the forward), the backward pass of the per-row op, and the gradient
accumulators (a bf16/fp16 weight's in its own dtype, :func:`weight_grad_dtype`).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

__all__ = ["MIN_FULL_ROWS", "MIN_CHUNK_ROWS", "TILE_ROWS", "CPU_ROWS_TILE_BYTES", "plan_chunks", "plan_row_tiles",
           "default_chunk_bytes", "default_rows_chunk_bytes", "num_chunks", "weight_grad_dtype"]

#: a full row block of logits is used when the budget holds at least this many rows (else 2-D tiles)
MIN_FULL_ROWS = 128
#: the default budget never holds fewer rows than this (or a quarter of the rows, so that a small batch is
#: still cut in four): every chunk re-reads the head's weight
#: and reads and writes its gradient, so the op's arithmetic intensity is about ``3 * rows / 8`` flops per
#: byte (fp32) whatever the hidden size and vocabulary; below ~256 rows the step is bound by that traffic and
#: by per-chunk overhead (docs/passes/fuse_cross_entropy.md, "Choosing the chunk")
MIN_CHUNK_ROWS = 256
#: the narrowest vocabulary tile the weight-gradient-once order uses (narrower: row chunks, accumulated)
MIN_VOCAB_TILE = 1024
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
    """Every row, the targets (ignored rows pointing at class 0), the rows' mask (``target != ignore_index``),
    the inputs in the compute dtype, and the bounds check.

    NOTE(sync-free): rows are not compacted (``nonzero`` and an ``int()`` of the targets' range would make the
    host wait for the device inside the step, and rule out CUDA graphs): ignored rows run through the chunks with
    a zero row factor (their loss and gradients are zero), and an out-of-range target is a device-side assert
    (``IndexError`` naming the value on the CPU, whose assert raises at once)."""
    keep = target != spec.ignore_index
    tgt = torch.where(keep, target, torch.zeros((), dtype=target.dtype, device=target.device))
    if tgt.numel():
        try:  # a device-side assert on a GPU (asynchronous); the CPU checks at once
            torch._assert_async(((tgt >= 0) & (tgt < spec.vocab)).all(),
                                f"effpass cross_entropy: a target is out of bounds for {spec.vocab} classes")
        except RuntimeError:  # the error path may wait: name the value, as torch's IndexError does
            bad = int(tgt.min()) if int(tgt.min()) < 0 else int(tgt.max())
            raise IndexError(f"cross_entropy: target {bad} is out of bounds for {spec.vocab} classes") from None
    if spec.chunk_bytes <= 0:
        # 0: the budget was left to run time (the graph's row count is symbolic: a packed length), the same
        # default the pass computes for a static row count, from this call's rows
        hb = x.numel() * x.element_size()
        spec.chunk_bytes = (default_rows_chunk_bytes(x.shape[0], spec.vocab, hb, x.device.type)
                            if spec.plan is plan_row_tiles else default_chunk_bytes(x.shape[0], spec.vocab, hb))
    cd = spec.compute
    xs = [x]
    ws = [w]
    if x2 is not None:
        xs.append(x2)
        ws.append(w2)
    if cd is None:
        cd = torch.promote_types(x.dtype, w.dtype)
    xs = [t.to(cd) for t in xs]
    ws = [t.to(cd) for t in ws]
    b = bias.to(cd) if bias is not None else None
    return keep, tgt, xs, ws, b


def _forward_pass(xs, ws, b, tgt, spec: _Spec, grads: Optional[dict], gscale: Optional[Tensor]):
    """Per-row loss and log-sum-exp of the valid rows; with ``grads`` also accumulates the gradients
    (``gscale``: per-row gradient of the loss, None for 1)."""
    n, vocab, eps = tgt.shape[0], spec.vocab, spec.smoothing
    loss = torch.empty(n, dtype=torch.float32, device=tgt.device)
    lse_all = torch.empty(n, dtype=torch.float32, device=tgt.device)
    if n == 0:
        return loss, lse_all
    rows, vt = spec.plan(n, vocab, spec.chunk_bytes)
    if grads is not None and rows < n and _vocab_tile(n, vocab, spec) and any(a is not None for a in grads["w"]):
        # NOTE(weight gradient written once): with several row chunks, accumulating the head weight's gradient
        # chunk by chunk would read and rewrite all of it once per chunk; instead the loss and log-sum-exp
        # first (row chunks), then the gradients by vocabulary tiles over every row (each tile of the weight's
        # gradient written once; the rows' gradient, the smaller one, accumulated): 4 matmuls in all
        loss, lse_all = _forward_pass(xs, ws, b, tgt, spec, None, None)
        _grads_by_vocab(xs, ws, b, tgt, lse_all, gscale, spec, grads)
        return loss, lse_all
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


def _vocab_tile(n: int, vocab: int, spec: _Spec) -> int:
    """Vocabulary entries per tile of all ``n`` rows within the chunk budget (0: too narrow a tile to be worth
    it, fewer than ``MIN_VOCAB_TILE`` entries: the row-major order is kept)."""
    vt = min(vocab, spec.chunk_bytes // (4 * max(n, 1)))
    return vt if vt >= min(vocab, MIN_VOCAB_TILE) else 0


def _grads_by_vocab(xs, ws, b, tgt, lse_all, gscale, spec: _Spec, grads: dict):
    """The gradients by vocabulary tiles over every row: each tile of the head weight's gradient is written
    once (no read-modify-write per row chunk); the rows' gradient accumulates over the tiles."""
    n, vocab = tgt.shape[0], spec.vocab
    vt = _vocab_tile(n, vocab, spec)
    for v0 in range(0, vocab, vt):
        v1 = min(vocab, v0 + vt)
        z, th = spec.logits(xs, ws, b, 0, n, v0, v1)
        _grad_tile(_softmax_(z, lse_all), th, tgt, gscale, xs, ws, 0, n, v0, v1, spec, grads, once=True)


def _backward_pass(xs, ws, b, tgt, lse_all, gscale, spec: _Spec, grads: dict):
    n, vocab = tgt.shape[0], spec.vocab
    if n == 0:
        return
    rows, vt = spec.plan(n, vocab, spec.chunk_bytes)
    if rows < n and _vocab_tile(n, vocab, spec) and any(a is not None for a in grads["w"]):
        _grads_by_vocab(xs, ws, b, tgt, lse_all, gscale, spec, grads)  # NOTE(weight gradient written once)
        return
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        for v0 in range(0, vocab, vt):
            v1 = min(vocab, v0 + vt)
            z, th = spec.logits(xs, ws, b, r0, r1, v0, v1)
            _grad_tile(_softmax_(z, lse_all[r0:r1]), th, tgt[r0:r1], gscale[r0:r1], xs, ws, r0, r1, v0, v1, spec,
                       grads)


def _tiles_forward(xs, ws, b, tgt, spec: _Spec):
    """Per-row loss and log-sum-exp by the Triton tiles (``triton_tiles.py``: the logits stay in registers)."""
    x, w = xs[0], ws[0]
    x2, w2 = (xs[1], ws[1]) if len(xs) > 1 else (None, None)
    lse, zt, zs = torch.ops.effpass.lce_lse(x, w, b, tgt, float(spec.pre), bool(spec.softcap), float(spec.post),
                                            bool(spec.smoothing), x2, w2)
    loss = lse - zt
    if spec.smoothing:
        eps = spec.smoothing
        loss = (1.0 - eps) * loss + eps * (lse - zs / spec.vocab)
    return loss, lse


def _tiles_grads(xs, ws, b, tgt, lse, rowg, spec: _Spec, grads: dict) -> None:
    """The gradients by the Triton tiles: per vocabulary slab, the logits' gradient (one kernel: the logits
    recomputed, the softmax gradient in its epilogue) then two library GEMMs: the rows' gradient accumulated, the
    weight's gradient slab written once. ``lse``: ``inf`` on rows to leave at 0; ``rowg``: each row's factor."""
    from .triton_tiles import slab_entries

    x, w = xs[0], ws[0]
    x2, w2 = (xs[1], ws[1]) if len(xs) > 1 else (None, None)
    n, vocab = tgt.shape[0], spec.vocab
    gx, gw, gb = grads["x"][0], grads["w"][0], grads["b"]
    gx2, gw2 = (grads["x"][1], grads["w"][1]) if len(xs) > 1 else (None, None)
    if n == 0:
        for g in (gw, gw2):
            if g is not None:
                g.zero_()
        return
    step = slab_entries(n, vocab, x.element_size())
    for v0 in range(0, vocab, step):
        v1 = min(vocab, v0 + step)
        d = torch.ops.effpass.lce_dlogits(x, w[v0:v1], b[v0:v1] if b is not None else None, tgt, lse, rowg,
                                          float(spec.pre), bool(spec.softcap), float(spec.post),
                                          float(spec.smoothing), v0, vocab, x2, w2[v0:v1] if w2 is not None else None)
        if gx is not None:
            _acc_mm(gx, d, w[v0:v1])
        if gw is not None:
            _acc_mm(gw[v0:v1], d.t(), x, once=True)
        if gx2 is not None:  # a LoRA head: the adapter's rows and B
            _acc_mm(gx2, d, w2[v0:v1])
        if gw2 is not None:
            _acc_mm(gw2[v0:v1], d.t(), x2, once=True)
        if gb is not None:
            gb[v0:v1] += d.float().sum(0)


def _softmax_(z: Tensor, lse: Tensor) -> Tensor:
    """``exp(z - lse)`` in ``z``'s buffer: the softmax of a tile given its rows' log-sum-exp."""
    return z.sub_(lse[:, None]).exp_()


def _grad_tile(d, th, t, g, xs, ws, r0, r1, v0, v1, spec: _Spec, grads: dict, once: bool = False):
    """d loss / d logits for one tile (``d``: its softmax, overwritten: minus the smoothed one-hot, times
    the row's gradient), pushed through the transform and the projection(s) into the accumulators (``once``:
    this tile's rows of the weights' gradients are visited only now: written, not accumulated)."""
    eps = spec.smoothing
    if th is not None:  # d softcap(z)/dz = pre * post * (1 - tanh^2), computed in tanh's buffer
        deriv = th.mul_(th).neg_().add_(1.0).mul_(spec.pre * spec.post)
    inside = (t >= v0) & (t < v1)  # the one-hot, scattered without a host synchronisation (no nonzero)
    local = (t - v0).clamp(0, v1 - v0 - 1)[:, None]
    d.scatter_add_(1, local, inside.to(d.dtype).mul_(-(1.0 - eps))[:, None])
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
            _acc_mm(grads["w"][i][v0:v1], dc.t(), x[r0:r1], once)
    if grads["b"] is not None:
        grads["b"][v0:v1] += d.sum(0)


def _acc_mm(acc: Tensor, a: Tensor, b: Tensor, once: bool = False) -> None:
    """``acc += a @ b``: one ``addmm_`` when the accumulator has the operands' dtype (a low-precision weight's
    gradient: the GEMM accumulates in fp32 and rounds once per call), else the product is added (an fp32
    accumulator of low-precision operands: autocast). ``once``: ``acc`` (still zero) is written, not read."""
    if once:
        if a.dtype == acc.dtype:
            torch.mm(a, b, out=acc)
        else:
            acc.copy_(a @ b)
        return
    if a.dtype == acc.dtype:
        torch.addmm(acc, a, b, out=acc)  # as addmm_, in the overload FlopCounterMode counts
    elif acc.dtype == torch.float32 and a.dtype in _LOW and _mixed_addmm(acc):
        # one GEMM accumulating low-precision operands into the fp32 buffer (cuBLAS's C += A B with an fp32 C):
        # no low-precision product written and read back, no rounding of each partial product
        torch.ops.aten.addmm.dtype_out(acc, a, b, torch.float32, out=acc)
    else:
        acc.add_(a @ b)


_LOW = (torch.bfloat16, torch.float16)
#: whether ``addmm`` with an fp32 output of bf16/fp16 operands ran on CUDA here (None: not tried yet)
_MIXED_ADDMM: dict[str, bool] = {}


def _mixed_addmm(acc: Tensor) -> bool:
    """Whether :func:`_acc_mm` may call ``aten.addmm.dtype_out`` on ``acc``: CUDA (feature-tested once: older torch
    builds lack the kernel) or fake tensors of a CUDA-targeted estimate; never real CPU tensors (no kernel)."""
    from torch._subclasses.fake_tensor import FakeTensor

    from effpass.devices import device_type_for

    if isinstance(acc, FakeTensor):
        return device_type_for(acc) == "cuda"
    if acc.device.type != "cuda":
        return False
    if "cuda" not in _MIXED_ADDMM:
        try:
            probe = torch.zeros(2, 2, device=acc.device)
            one = torch.ones(2, 2, device=acc.device, dtype=torch.bfloat16)
            torch.ops.aten.addmm.dtype_out(probe, one, one, torch.float32, out=probe)
            _MIXED_ADDMM["cuda"] = bool(torch.equal(probe, torch.full_like(probe, 2.0)))
        except (RuntimeError, NotImplementedError):
            _MIXED_ADDMM["cuda"] = False
    return _MIXED_ADDMM["cuda"]


def weight_grad_dtype(param_dtype: torch.dtype, compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype a head weight's gradient is accumulated in: the weight's own dtype when it is bf16/fp16 and the
    matmuls run in it (a bf16 model without autocast: the unfused graph's gradient is a bf16 matmul output, so
    the accumulator is the gradient itself and no full-size fp32 buffer exists), else fp32 (an fp32 weight, or
    an fp32 weight under autocast, whose gradient is fp32)."""
    return param_dtype if (param_dtype in _LOW and compute_dtype == param_dtype) else torch.float32


def _accumulators(xs, ws, has_bias, mask, vocab, device, w_dtypes=(None, None), w_written: bool = False):
    """fp32 accumulators of the rows' and the bias's gradients; the weights' in :func:`weight_grad_dtype`
    (``w_dtypes``: the weights' own dtypes, before the cast to the compute dtype). ``w_written``: every slab of the
    weights' gradients will be written once (the Triton tiles), so they start uninitialised (no memset)."""
    f32 = torch.float32
    new_w = torch.empty if w_written else torch.zeros
    return {"x": [torch.zeros(x.shape, dtype=f32, device=device) if mask[i] else None for i, x in enumerate(xs)],
            "w": [new_w(w.shape, dtype=weight_grad_dtype(w_dtypes[i] or f32, w.dtype), device=device)
                  if mask[2 + i] else None for i, w in enumerate(ws)],
            "b": torch.zeros(vocab, dtype=f32, device=device) if has_bias and mask[4] else None}


def _scatter_grads(acc, x, w, x2, w2, bias, scale):
    """Full-size gradients in the inputs' dtypes (empty tensors for those not asked for)."""
    def rows(a, like):
        if a is None:
            return like.new_empty(0)
        out = a
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
