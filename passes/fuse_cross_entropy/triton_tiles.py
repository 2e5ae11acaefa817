"""Triton tiles of ``fuse_cross_entropy``'s loss head for a GPU: the logits never reach memory.

Two kernels, each one ``torch.library`` custom op declared one device kernel (:func:`effpass.register_device_kernel`,
so the cost model counts it as the GPU runs it) with a fake implementation and a FLOP formula:

* ``effpass::lce_lse`` (forward): for every row, the log-sum-exp of its transformed logits, its target's logit and
  (label smoothing) their sum. Each program owns a block of rows and a range of the vocabulary; it computes the
  ``rows x vocab`` logit tiles with ``tl.dot`` (bf16/fp16 operands, fp32 accumulation; fp32 operands in IEEE
  precision), applies the transform (scale, soft-cap) and folds each tile into a running maximum and sum of
  exponentials (online softmax) in registers. Only ``3 x rows`` floats per vocabulary range are written; the
  ranges are combined in plain torch (a few kernels on ``rows``-sized vectors). One matmul-equivalent.
* ``effpass::lce_dlogits`` (backward): the gradient of the loss with respect to the logits of the vocabulary slab
  ``v0:v1``, ``(softmax - smoothed one-hot) x transform' x row factor``, computed in the epilogue of the tile
  matmul that recomputes the logits, written once in the compute dtype (``rows x slab``: the only logit-sized
  buffer, bounded by the slab). The caller then runs two library GEMMs per slab (cuBLAS on a GPU): the rows'
  gradient accumulates ``dlogits @ W[slab]`` and the weight's gradient slab is ``dlogits^T @ x``, written once
  (one rounding, no read-modify-write of the weight's gradient, no atomics: deterministic).

So a training step costs 4 matmul-equivalents (logits, logits again, two gradients), no host synchronisation, and a
number of kernels set by the vocabulary and the slab, not by the rows. On a CPU the ops run their kernels in Triton's
interpreter when ``TRITON_INTERPRET=1`` (the suite's tests), else a reference in plain torch (what the cost model
runs on CPU tensors when it estimates a GPU step: the counted kernel is the Triton one).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

import effpass
from effpass.config import triton_interpret_from_env
from effpass.devices import device_type_for

try:  # an optional dependency: the chunked torch kernel serves where Triton is missing
    import triton
    import triton.language as tl
    HAVE_TRITON = True
except ImportError:  # pragma: no cover - triton is installed with torch's CUDA wheels and the dev extra
    triton = tl = None
    HAVE_TRITON = False

__all__ = ["HAVE_TRITON", "available", "slab_entries", "lse_rows", "dlogits_slab", "SLAB_BYTES"]

#: bytes of one slab of logit gradients (rows x slab entries in the compute dtype): the backward's only
#: logit-sized buffer
SLAB_BYTES = 64 << 20
#: programs the forward aims for (a GPU has ~132 SMs; each range of the vocabulary is one more program per row block)
_TARGET_PROGRAMS = 512


def available(device_type: str) -> str:
    """"" when the Triton tiles can run for ``device_type`` here, else why not (for errors and skip reasons)."""
    if not HAVE_TRITON:
        return "triton is not installed (pip install triton; it comes with torch's CUDA wheels)"
    if device_type == "cuda":
        return ""
    if device_type == "cpu":
        return "" if triton_interpret_from_env() else (
            "Triton kernels run on CUDA devices (on a CPU only in Triton's interpreter: TRITON_INTERPRET=1)")
    return f"Triton kernels run on CUDA devices, not {device_type!r}"


def slab_entries(rows: int, vocab: int, itemsize: int) -> int:
    """Vocabulary entries per backward slab: ``rows x entries`` logit gradients within :data:`SLAB_BYTES`, a
    multiple of 128 (at least 128), at most the vocabulary."""
    per = max(1, rows) * itemsize
    entries = max(128, (SLAB_BYTES // per) // 128 * 128)
    return min(vocab, entries)


# ------------------------------------------------------------------------------------------------------
# the kernels
# ------------------------------------------------------------------------------------------------------
if HAVE_TRITON:
    @triton.jit
    def _tanh(x):
        # tanh(x) = 2 sigmoid(2x) - 1 (tl has no tanh in every version and in the interpreter)
        return 2.0 * tl.sigmoid(2.0 * x) - 1.0

    @triton.jit
    def _dot_acc(acc, X, W, rows, cols, rmask, cmask, H, sxn, swv, IEEE: tl.constexpr, BK: tl.constexpr):
        # 64-bit row offsets: a 256k vocabulary x hidden 8,192 weight has more elements than an int32 indexes
        xrow = rows.to(tl.int64)[:, None] * sxn
        wrow = cols.to(tl.int64)[None, :] * swv
        for k0 in range(0, H, BK):
            ks = k0 + tl.arange(0, BK)
            kmask = ks < H
            a = tl.load(X + xrow + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            b = tl.load(W + wrow + ks[:, None], mask=kmask[:, None] & cmask[None, :], other=0.0)
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        return acc

    @triton.jit
    def _logit_tile(X, W, X2, W2, rows, cols, rmask, cmask, H, H2, sxn, swv, sx2, sw2, HAS2: tl.constexpr,
                    IEEE: tl.constexpr, BN: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr):
        # x @ W^T, plus a LoRA head's second projection (A x s) @ B^T over its rank
        acc = _dot_acc(tl.zeros((BN, BV), dtype=tl.float32), X, W, rows, cols, rmask, cmask, H, sxn, swv, IEEE, BK)
        if HAS2:
            acc = _dot_acc(acc, X2, W2, rows, cols, rmask, cmask, H2, sx2, sw2, IEEE, BK)
        return acc

    @triton.jit
    def _lse_kernel(X, W, X2, W2, B, T, M, S, ZT, ZS, N, V, H, H2, sxn, swv, sx2, sw2, per_split, pre, post,
                    HAS2: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, SMOOTH: tl.constexpr,
                    IEEE: tl.constexpr,
                    BN: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr):
        pid_n = tl.program_id(0)
        split = tl.program_id(1)
        rows = pid_n * BN + tl.arange(0, BN)
        rmask = rows < N
        t = tl.load(T + rows, mask=rmask, other=0)
        m = tl.full((BN,), float("-inf"), tl.float32)
        s = tl.zeros((BN,), tl.float32)
        zt = tl.zeros((BN,), tl.float32)
        zs = tl.zeros((BN,), tl.float32)
        v_lo = split * per_split
        v_hi = tl.minimum(V, v_lo + per_split)
        for v0 in range(v_lo, v_hi, BV):
            cols = v0 + tl.arange(0, BV)
            cmask = cols < v_hi
            acc = _logit_tile(X, W, X2, W2, rows, cols, rmask, cmask, H, H2, sxn, swv, sx2, sw2, HAS2, IEEE, BN, BV,
                              BK)
            if HAS_BIAS:
                acc += tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
            z = acc * pre
            if SOFTCAP:
                z = _tanh(z) * post
            z = tl.where(cmask[None, :], z, float("-inf"))
            zt += tl.sum(tl.where(cols[None, :] == t[:, None], z, 0.0), axis=1)
            if SMOOTH:
                zs += tl.sum(tl.where(cmask[None, :], z, 0.0), axis=1)
            m_new = tl.maximum(m, tl.max(z, axis=1))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new[:, None]), axis=1)
            m = m_new
        out = split * N + rows
        tl.store(M + out, m, mask=rmask)
        tl.store(S + out, s, mask=rmask)
        tl.store(ZT + out, zt, mask=rmask)
        tl.store(ZS + out, zs, mask=rmask)

    @triton.jit
    def _dlogits_kernel(X, W, X2, W2, B, T, LSE, G, D, N, H, H2, v_lo, VS, sxn, swv, sx2, sw2, sdn, pre, post, hit,
                        eps_v, HAS2: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, IEEE: tl.constexpr,
                        BN: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr):
        # W, B: the slab's rows (VS of them, vocabulary entries v_lo + 0..VS-1). Programs along the vocabulary
        # first: the ones running together share a block of rows (read once from memory) and walk the slab of
        # the weight, which stays in the L2 cache across row blocks
        pid_v = tl.program_id(0)
        pid_n = tl.program_id(1)
        rows = pid_n * BN + tl.arange(0, BN)
        rmask = rows < N
        cols = pid_v * BV + tl.arange(0, BV)
        cmask = cols < VS
        acc = _logit_tile(X, W, X2, W2, rows, cols, rmask, cmask, H, H2, sxn, swv, sx2, sw2, HAS2, IEEE, BN, BV, BK)
        if HAS_BIAS:
            acc += tl.load(B + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        u = acc * pre
        if SOFTCAP:
            th = _tanh(u)
            z = th * post
            dz = (1.0 - th * th) * (pre * post)
        else:
            z = u
            dz = pre
        t = tl.load(T + rows, mask=rmask, other=0)
        lse = tl.load(LSE + rows, mask=rmask, other=float("inf"))
        g = tl.load(G + rows, mask=rmask, other=0.0)
        p = tl.exp(z - lse[:, None])
        d = p - tl.where((cols + v_lo)[None, :] == t[:, None], hit, 0.0) - eps_v
        d = d * dz * g[:, None]
        d = tl.where(rmask[:, None] & cmask[None, :], d, 0.0)
        tl.store(D + rows.to(tl.int64)[:, None] * sdn + cols[None, :], d.to(D.dtype.element_ty),
                 mask=rmask[:, None] & cmask[None, :])


def _blocks(x: Tensor) -> tuple[int, int, int, int]:
    """(rows, vocabulary, hidden) block sizes and warps: tensor-core tiles on a GPU, small ones in the interpreter."""
    if x.device.type != "cuda":
        return 16, 32, 32, 4
    return 64, 128, 64, 8


def _args(x: Tensor, w: Tensor, bias: Optional[Tensor], x2: Optional[Tensor], w2: Optional[Tensor]):
    """Contiguous operands; an absent bias or second projection is a placeholder pointer the kernel never reads."""
    x, w = x.contiguous(), w.contiguous()
    return (x, w, bias.contiguous() if bias is not None else w, x2.contiguous() if x2 is not None else x,
            w2.contiguous() if w2 is not None else w)


# ------------------------------------------------------------------------------------------------------
# the reference (CPU tensors without the interpreter: what the cost model runs for a GPU step)
# ------------------------------------------------------------------------------------------------------
def _ref_logits(x, w, bias, v0, v1, pre, softcap, post, x2=None, w2=None):
    """Logits of the rows of ``w`` (and ``bias``, ``w2``) ``v0:v1`` and the transform's derivative."""
    z = (x.float() @ w[v0:v1].float().t())
    if x2 is not None:
        z = z + x2.float() @ w2[v0:v1].float().t()
    if bias is not None:
        z = z + bias[v0:v1].float()
    u = z * pre
    if softcap:
        th = torch.tanh(u)
        return th * post, (1.0 - th * th) * (pre * post)
    return u, pre


def _ref_lse(x, w, bias, target, pre, softcap, post, smooth, x2=None, w2=None):
    n, vocab = x.shape[0], w.shape[0]
    step = max(128, slab_entries(n, vocab, 4))
    lse = torch.full((n,), -math.inf, device=x.device)
    zt = torch.zeros(n, device=x.device)
    zs = torch.zeros(n, device=x.device)
    for v0 in range(0, vocab, step):
        v1 = min(vocab, v0 + step)
        z, _ = _ref_logits(x, w, bias, v0, v1, pre, softcap, post, x2, w2)
        inside = (target >= v0) & (target < v1)
        zt = zt + torch.where(inside, z.gather(1, (target - v0).clamp(0, v1 - v0 - 1)[:, None]).squeeze(1), 0.0)
        if smooth:
            zs = zs + z.sum(1)
        lse = torch.logaddexp(lse, torch.logsumexp(z, 1))
    return lse, zt, zs


def _ref_dlogits(x, w, bias, target, lse, rowg, pre, softcap, post, eps, v0, vocab, x2=None, w2=None):
    vs = w.shape[0]
    z, dz = _ref_logits(x, w, bias, 0, vs, pre, softcap, post, x2, w2)
    d = torch.exp(z - lse[:, None])
    inside = (target >= v0) & (target < v0 + vs)
    d.scatter_add_(1, (target - v0).clamp(0, vs - 1)[:, None], inside.float().mul(-(1.0 - eps))[:, None])
    if eps:
        d.sub_(eps / vocab)
    return (d * dz * rowg[:, None]).to(x.dtype)


# ------------------------------------------------------------------------------------------------------
# the custom ops (one device kernel each)
# ------------------------------------------------------------------------------------------------------
@torch.library.custom_op("effpass::lce_lse", mutates_args=())
def lse_rows(x: Tensor, w: Tensor, bias: Optional[Tensor], target: Tensor, pre: float, softcap: bool,
             post: float, smooth: bool, x2: Optional[Tensor] = None, w2: Optional[Tensor] = None
             ) -> tuple[Tensor, Tensor, Tensor]:
    """Per row: log-sum-exp of the transformed logits (``x @ w^T + bias [+ x2 @ w2^T]``: a LoRA head's second
    projection), the target's logit, their sum over the vocabulary (0 unless ``smooth``); fp32. ``target`` holds
    valid classes only (ignored rows mapped to 0 by the caller)."""
    n, vocab, hidden = x.shape[0], w.shape[0], x.shape[1]
    if n == 0:
        e = x.new_empty(0, dtype=torch.float32)
        return e, e.clone(), e.clone()
    if x.device.type != "cuda" and not triton_interpret_from_env():
        return _ref_lse(x, w, bias, target, pre, softcap, post, smooth, x2, w2)
    has2 = x2 is not None
    x, w, b, x2, w2 = _args(x, w, bias, x2, w2)
    bn, bv, bk, warps = _blocks(x)
    nblk = triton.cdiv(n, bn)
    splits = max(1, min(triton.cdiv(vocab, bv), triton.cdiv(_TARGET_PROGRAMS, nblk)))
    per_split = triton.cdiv(triton.cdiv(vocab, splits), bv) * bv
    splits = triton.cdiv(vocab, per_split)
    part = torch.empty(4, splits, n, dtype=torch.float32, device=x.device)
    _lse_kernel[(nblk, splits)](
        x, w, x2, w2, b, target.contiguous(), part[0], part[1], part[2], part[3], n, vocab, hidden, x2.shape[1],
        x.stride(0), w.stride(0), x2.stride(0), w2.stride(0), per_split, float(pre), float(post), HAS2=has2,
        HAS_BIAS=bias is not None, SOFTCAP=bool(softcap),
        SMOOTH=bool(smooth), IEEE=x.dtype == torch.float32, BN=bn, BV=bv, BK=bk, num_warps=warps)
    m, s, zt, zs = part.unbind(0)
    top = m.amax(0)
    lse = top + (s * torch.exp(m - top)).sum(0).log()
    return lse, zt.sum(0), zs.sum(0)


@lse_rows.register_fake
def _(x, w, bias, target, pre, softcap, post, smooth, x2=None, w2=None):
    n = x.shape[0]
    return (x.new_empty((n,), dtype=torch.float32), x.new_empty((n,), dtype=torch.float32),
            x.new_empty((n,), dtype=torch.float32))


@torch.library.custom_op("effpass::lce_dlogits", mutates_args=())
def dlogits_slab(x: Tensor, w: Tensor, bias: Optional[Tensor], target: Tensor, lse: Tensor, rowg: Tensor,
                 pre: float, softcap: bool, post: float, eps: float, v0: int, vocab: int,
                 x2: Optional[Tensor] = None, w2: Optional[Tensor] = None) -> Tensor:
    """``d loss / d logits`` of a vocabulary slab (``w``, ``bias``: the head's rows ``v0 : v0 + len(w)`` of a
    ``vocab``-entry head; the result ``rows x len(w)`` in ``x``'s dtype):
    ``(softmax - (1 - eps) one-hot - eps / vocab) x transform' x rowg``. ``lse``: the rows' log-sum-exp (``inf``
    for a row to leave at 0), ``rowg``: each row's factor (0 for ignored rows)."""
    n, hidden, vs = x.shape[0], x.shape[1], w.shape[0]
    if n == 0 or vs == 0:
        return x.new_zeros(n, vs)
    if x.device.type != "cuda" and not triton_interpret_from_env():
        return _ref_dlogits(x, w, bias, target, lse, rowg, pre, softcap, post, eps, v0, vocab, x2, w2)
    has2 = x2 is not None
    x, w, b, x2, w2 = _args(x, w, bias, x2, w2)
    out = torch.empty(n, vs, dtype=x.dtype, device=x.device)
    bn, bv, bk, warps = _blocks(x)
    grid = (triton.cdiv(vs, bv), triton.cdiv(n, bn))
    _dlogits_kernel[grid](
        x, w, x2, w2, b, target.contiguous(), lse.contiguous(), rowg.contiguous().float(), out, n, hidden,
        x2.shape[1], v0, vs, x.stride(0), w.stride(0), x2.stride(0), w2.stride(0), out.stride(0), float(pre),
        float(post), 1.0 - float(eps), float(eps) / vocab, HAS2=has2, HAS_BIAS=bias is not None, SOFTCAP=bool(softcap), IEEE=x.dtype == torch.float32, BN=bn, BV=bv, BK=bk,
        num_warps=warps)
    return out


@dlogits_slab.register_fake
def _(x, w, bias, target, lse, rowg, pre, softcap, post, eps, v0, vocab, x2=None, w2=None):
    return x.new_empty((x.shape[0], w.shape[0]))


def _tile_flops(x, w, x2, w2) -> int:
    """The logits' matmul: ``2 N H V`` plus a second projection's ``2 N r V``."""
    return 2 * x.shape[0] * w.shape[0] * (x.shape[1] + (x2.shape[1] if x2 is not None else 0))


effpass.register_flop_formula(torch.ops.effpass.lce_lse, lambda x, w, bias, target, pre, softcap, post, smooth,
                              x2=None, w2=None, out_val=None: _tile_flops(x, w, x2, w2))
effpass.register_flop_formula(torch.ops.effpass.lce_dlogits,
                              lambda x, w, bias, target, lse, rowg, pre, softcap, post, eps, v0, vocab, x2=None,
                              w2=None, out_val=None: _tile_flops(x, w, x2, w2))
effpass.register_device_kernel(torch.ops.effpass.lce_lse)
effpass.register_device_kernel(torch.ops.effpass.lce_dlogits)


def wanted(kernel: str, x: Tensor, *, second_projection: bool, x_grad: bool) -> bool:
    """Whether a call of the fused head takes the Triton tiles: ``kernel`` ``"triton"`` always (the pass checked it
    can run), ``"effpass"`` where the code runs for a CUDA device (:func:`effpass.devices.device_type_for`: the
    tensors', or the cost model's target) and Triton is installed; never for the op's frozen-head form (``x_grad``:
    its input gradient computed in the forward), which keeps the chunked kernel (the pass does not ask for it where
    the tiles run). ``second_projection`` (a LoRA head) is supported."""
    del second_projection
    if x_grad or kernel not in ("effpass", "triton"):
        return False
    if kernel == "triton":
        return True
    return HAVE_TRITON and device_type_for(x) == "cuda"
