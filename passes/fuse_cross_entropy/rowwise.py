"""Row-wise functions of one or two heads' distributions (entropy, KL / JSD for distillation, z-loss, ...):
``effpass::linear_rowwise`` runs the row function ``fuse_cross_entropy`` extracted from the graph on blocks of full
rows of the heads' logits, and its backward differentiates it per block with autograd.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

import effpass
from effpass.config import rowwise_compile_from_env

from .chunks import _COMPUTE, _acc_mm, default_chunk_bytes, weight_grad_dtype

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

    def raw(self, r0, r1, buf):
        """Rows ``r0:r1`` of the raw logits, written into ``buf`` (reused from block to block: a fresh
        block-sized tensor per block costs the CPU a page fault per page, more than the matmul itself)."""
        z = torch.mm(self.x[r0:r1], self.w.t(), out=buf[:r1 - r0])
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


#: on CPU the row function (and its gradient) runs on tiles of this many bytes of every head's fp32 logits
#: together (at least one row): its elementwise passes then read and write the cache, and its temporaries stay
#: below glibc's mmap threshold (no page faults); the matmuls still run on the op's full row blocks
CPU_ROW_TILE_BYTES = 4 << 20


def _tile_rows(rows: int, vocab: int, heads: int, device: torch.device) -> int:
    if device.type != "cpu":
        return rows
    return max(1, min(rows, CPU_ROW_TILE_BYTES // (4 * vocab * max(heads, 1))))


#: the trained form's tile program (the row function, its outputs' gradients) is compiled with Inductor (C++ on a CPU,
#: Triton on a CUDA device: one fused kernel instead of an eager kernel per elementwise step) when a tile holds at
#: least this many logits per head (large vocabularies; below, the eager tile is as fast and
#: compiling would cost more than it saves); EFFPASS_ROWWISE_COMPILE=0 turns it off
COMPILE_MIN_TILE_ELEMS = 1 << 18
_PROGRAMS: dict = {}
#: the dispatch-key TLS of a top-level call (taken at import)
_TOP_TLS = (torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set())


def _tile_program(f, heads, want, cots, z, es):
    """The compiled tile program ``(*raw tiles, *row inputs) -> (values, [[d raw_k for k in want] per column])``
    for the trained form's cotangents (ones on one output each), or None where the eager tile runs: not on a CPU
    or CUDA device, a small tile, under a dispatch mode (the planner's replay) or while tracing, EFFPASS_ROWWISE_COMPILE=0, a
    per-row cotangent (the recomputing backward), or after a compile failure (warned, never retried)."""
    if (z.device.type not in ("cpu", "cuda") or z.numel() < COMPILE_MIN_TILE_ELEMS or not cots
            or not all(isinstance(c, int) for c in cots) or not rowwise_compile_from_env()
            or torch._C._len_torch_dispatch_stack() > 0 or torch.compiler.is_compiling()):
        return None
    key = (f, tuple(tuple(h.t) for h in heads), tuple(want), tuple(cots), z.dtype, len(es))
    prog = _PROGRAMS.get(key)
    if prog is None:
        ts, nh, cols = [list(h.t) for h in heads], len(heads), list(cots)

        def program(*args):
            zs, rest = list(args[:nh]), args[nh:]

            def values(*leaves):
                zz = list(zs)
                for k, leaf in zip(want, leaves):
                    zz[k] = leaf
                return tuple(o.reshape(-1).float() for o in f(*[_transform(a, t) for a, t in zip(zz, ts)], *rest))

            outs, vjp = torch.func.vjp(values, *[zs[k] for k in want])
            ds = [list(vjp(tuple(torch.ones_like(o) if i == j else torch.zeros_like(o) for i, o in enumerate(outs))))
                  for j in cols]
            return outs, ds

        prog = _PROGRAMS[key] = torch.compile(program, dynamic=False)
    if prog is False:
        return None

    def run(*args):
        try:
            # the program runs as a top-level call would (the op's kernel runs below autograd and functorch's
            # dispatch keys, which functorch's vjp and Dynamo's tracing need), with gradients on
            with torch._C._ForceDispatchKeyGuard(*_TOP_TLS), torch.enable_grad():
                return prog(*args)
        except Exception as e:  # noqa: BLE001 - the eager tile computes the same; say so once
            import warnings

            warnings.warn(f"effpass::linear_rowwise_train: compiling the tile program failed ({type(e).__name__}: "
                          f"{e}); the eager tile runs instead", RuntimeWarning, stacklevel=2)
            _PROGRAMS[key] = False
            return None

    return run


def _pass(heads, f, ext, n, chunk_bytes, want, cots, on_block, out=None):
    """One pass over the rows: each block's raw logits (matmuls into reused buffers), the row function on
    tiles of it (``out``: its values), and for every cotangent in ``cots`` (an ``(N, outs)`` tensor, or an
    int ``j``: ones on output ``j``, zeros elsewhere) the gradient of the raw logits of each head in ``want``,
    handed per block to ``on_block(c, k, r0, r1, d)``."""
    vocab = heads[0].w.shape[0]
    rows = rowwise_rows(n, vocab, len(heads), chunk_bytes, heads[0].x)
    dev = heads[0].x.device
    bufs = [torch.empty((min(rows, n), vocab), dtype=h.x.dtype, device=dev) for h in heads]
    grad = bool(want) and bool(cots)
    dbufs = {(c, k): torch.empty_like(bufs[k]) for c in range(len(cots)) for k in want} if grad else {}
    tile = _tile_rows(rows, vocab, len(heads), dev)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        raws = [h.raw(r0, r1, b) for h, b in zip(heads, bufs)]
        for s0 in range(0, r1 - r0, tile):
            s1 = min(r1 - r0, s0 + tile)
            a0, a1 = r0 + s0, r0 + s1
            es = [e[a0:a1] for e in ext]
            if not grad:
                res = f(*[_transform(r[s0:s1], h.t) for r, h in zip(raws, heads)], *es)
                for j, o in enumerate(res):
                    out[a0:a1, j] = o.reshape(a1 - a0)
                continue
            # the compiled program sees one tile shape: a short last tile of a block runs on the full tile that
            # ends where it ends (rows are independent; the rows before it are recomputed and dropped), so a
            # call's row count never compiles a program of its own (a compile per remainder cost minutes at a
            # 128K vocabulary)
            w0 = s1 - tile if s1 - s0 < tile <= r1 - r0 else s0
            prog = _tile_program(f, heads, want, cots, raws[0][w0:s1], es)
            got = None
            if prog is not None:
                got = prog(*[r[w0:s1] for r in raws], *([e[r0 + w0:a1] for e in ext] if w0 != s0 else es))
            if got is not None:  # the tile's values and gradients in a few fused loops (Inductor)
                res, ds_all = got
                skip = s0 - w0
                for j, o in enumerate(res):
                    out[a0:a1, j] = o[skip:]
                for c in range(len(cots)):
                    for k, d in zip(want, ds_all[c]):
                        dbufs[(c, k)][s0:s1].copy_(d[skip:])
                continue
            with _autograd_inside_op(), torch.enable_grad():
                leaves = [r[s0:s1].detach().requires_grad_() if k in want else r[s0:s1] for k, r in enumerate(raws)]
                res = [o.reshape(a1 - a0).float() for o in
                       f(*[_transform(z, h.t) for z, h in zip(leaves, heads)], *es)]
                if out is not None:
                    for j, o in enumerate(res):
                        out[a0:a1, j] = o.detach()
                for c, cot in enumerate(cots):
                    if isinstance(cot, int):
                        pairs = [(res[cot], torch.ones_like(res[cot]))] if res[cot].requires_grad else []
                    else:
                        pairs = [(o, cot[a0:a1, j]) for j, o in enumerate(res) if o.requires_grad]
                    ds = torch.autograd.grad([o for o, _ in pairs], [leaves[k] for k in want],
                                             [g for _, g in pairs], allow_unused=True,
                                             retain_graph=c + 1 < len(cots)) if pairs else [None] * len(want)
                    for k, d in zip(want, ds):
                        if d is None:
                            dbufs[(c, k)][s0:s1].zero_()
                        else:
                            dbufs[(c, k)][s0:s1].copy_(d)
            del leaves, res
        if grad:
            for c in range(len(cots)):
                for k in want:
                    on_block(c, k, r0, r1, dbufs[(c, k)][:r1 - r0])


def _accumulate(acc, heads, k, r0, r1, d):
    """The logits' gradient block ``d`` of head ``k`` pushed through its projection into ``acc`` (the 10
    slots x, w, b, xa, wa, y, v, c, ya, va; None where not asked for)."""
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


def _acc_dtype(i, a, heads):
    """The accumulator dtype of slot ``i``: a weight's :func:`weight_grad_dtype`, fp32 otherwise."""
    if i % 5 in (1, 4):
        return weight_grad_dtype(a.dtype, heads[min(i // 5, len(heads) - 1)].x.dtype)
    return torch.float32


@torch.library.custom_op("effpass::linear_rowwise", mutates_args=())
def _rowwise(x: Tensor, w: Tensor, b: Optional[Tensor], xa: Optional[Tensor], wa: Optional[Tensor],
             y: Optional[Tensor], v: Optional[Tensor], c: Optional[Tensor], ya: Optional[Tensor], va: Optional[Tensor],
             ext: list[Tensor], fn: str, t0: list[float], t1: list[float], chunk_bytes: int, compute: str,
             outs: int) -> Tensor:
    """``(N, outs)`` fp32: the row function ``fn`` of the transformed logits of one or two heads (x/w: the
    trained head, y/v: the second one, e.g. a teacher), computed on blocks of full rows."""
    f = _row_fn(fn)
    heads = _heads((x, w, b, xa, wa, y, v, c, ya, va), t0, t1, compute)
    out = torch.empty((x.shape[0], outs), dtype=torch.float32, device=x.device)
    _pass(heads, f, ext, x.shape[0], chunk_bytes, [], [], None, out)
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
    acc = [torch.zeros(a.shape, dtype=_acc_dtype(i, a, heads), device=x.device) if (a is not None and mask[i])
           else None for i, a in enumerate(args)]
    want = [k for k in range(len(heads)) if any(mask[5 * k:5 * k + 5])]
    _pass(heads, f, ext, x.shape[0], chunk_bytes, want, [grad.float()],
          lambda _c, k, r0, r1, d: _accumulate(acc, heads, k, r0, r1, d))
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


# ------------------------------------------------------------------------------------------------------
# the trained form: every gradient computed in the forward, the backward only scales it
# ------------------------------------------------------------------------------------------------------
_ROW_SLOTS = (0, 3, 5, 8)  # x, xa, y, ya: one gradient row per input row (any per-row cotangent scales them)


@torch.library.custom_op("effpass::linear_rowwise_train", mutates_args=())
def _rowwise_train(x: Tensor, w: Tensor, b: Optional[Tensor], xa: Optional[Tensor], wa: Optional[Tensor],
                   y: Optional[Tensor], v: Optional[Tensor], c: Optional[Tensor], ya: Optional[Tensor],
                   va: Optional[Tensor], ext: list[Tensor], fn: str, t0: list[float], t1: list[float],
                   chunk_bytes: int, compute: str, outs: int, grad_mask: list[bool], out_mask: list[bool]
                   ) -> list[Tensor]:
    """``[values, *gradients]``: the ``(N, outs)`` values of :func:`_rowwise` and, in the same pass (as the
    reduced cross-entropy op and Liger's fused-linear losses), for every input slot in ``grad_mask`` the
    gradient of each output in ``out_mask`` with a cotangent of ones, stacked ``(outputs, *input shape)``: the
    backward scales them by the incoming per-row gradient (exact for the row inputs x, xa, y, ya whatever it is;
    for the weights and biases when it is the same on every row, e.g. the rows summed; else it recomputes)."""
    f = _row_fn(fn)
    args = (x, w, b, xa, wa, y, v, c, ya, va)
    heads = _heads(args, t0, t1, compute)
    cols = [j for j in range(outs) if out_mask[j]]
    mask = [bool(grad_mask[i]) and a is not None for i, a in enumerate(args)]
    stacked = [torch.zeros((len(cols),) + tuple(a.shape), dtype=_acc_dtype(i, a, heads), device=x.device)
               if mask[i] else None for i, a in enumerate(args)]
    accs = [[s[ci] if s is not None else None for s in stacked] for ci in range(len(cols))]
    want = [k for k in range(len(heads)) if any(mask[5 * k:5 * k + 5])]
    out = torch.empty((x.shape[0], outs), dtype=torch.float32, device=x.device)
    _pass(heads, f, ext, x.shape[0], chunk_bytes, want, cols,
          lambda ci, k, r0, r1, d: _accumulate(accs[ci], heads, k, r0, r1, d), out)
    return [out] + [s for s in stacked if s is not None]


@_rowwise_train.register_fake
def _(x, w, b, xa, wa, y, v, c, ya, va, ext, fn, t0, t1, chunk_bytes, compute, outs, grad_mask, out_mask):
    args = (x, w, b, xa, wa, y, v, c, ya, va)
    n_cols = sum(bool(m) for m in out_mask[:outs])
    res = [x.new_empty((x.shape[0], outs), dtype=torch.float32)]
    for i, a in enumerate(args):
        if a is not None and grad_mask[i]:
            hx, hw = args[5 * (i // 5)], args[5 * (i // 5) + 1]
            cd = _COMPUTE[compute] or torch.promote_types(hx.dtype, hw.dtype)
            dt = weight_grad_dtype(a.dtype, cd) if i % 5 in (1, 4) else torch.float32
            res.append(a.new_empty((n_cols,) + tuple(a.shape), dtype=dt))
    return res


def _train_setup(ctx, inputs, output):
    tensors = inputs[:10]
    ctx.n_ext = len(inputs[10])
    ctx.consts = inputs[11:16]
    ctx.masks = (inputs[16], list(inputs[17]), list(inputs[18]))  # outs, grad_mask, out_mask
    ctx.need = [bool(ctx.needs_input_grad[i]) and tensors[i] is not None for i in range(10)]
    ctx.save_for_backward(*tensors, *inputs[10], *output[1:])


@torch.library.custom_op("effpass::linear_rowwise_train_backward", mutates_args=())
def _train_bwd(grad: Tensor, stored: list[Tensor], x: Tensor, w: Tensor, b: Optional[Tensor], xa: Optional[Tensor],
               wa: Optional[Tensor], y: Optional[Tensor], v: Optional[Tensor], c: Optional[Tensor],
               ya: Optional[Tensor], va: Optional[Tensor], ext: list[Tensor], fn: str, t0: list[float],
               t1: list[float], chunk_bytes: int, compute: str, outs: int, grad_mask: list[bool],
               out_mask: list[bool], need: list[bool]) -> list[Tensor]:
    """The gradients of the slots in ``need`` (empty elsewhere) from the forward's ``stored`` ones scaled by the
    incoming ``(N, outs)`` gradient: a row input's row by row (exact whatever the cotangent); a weight's or
    bias's by the one value every row has, checked here (data-dependent, hence an op); where the rows differ, or a
    gradient was not computed in the forward, the block pass runs again (:func:`_rowwise_bwd`)."""
    args = (x, w, b, xa, wa, y, v, c, ya, va)
    g = grad.float()
    n = g.shape[0]
    cols = [j for j in range(outs) if out_mask[j]]
    others = [j for j in range(outs) if not out_mask[j]]
    clean = not others or not bool(g[:, others].any())
    uniform = clean and (n == 0 or all(bool((g[:, j] == g[0, j]).all()) for j in cols))
    it = iter(stored)
    per_slot = {i: next(it) for i in range(10) if grad_mask[i] and args[i] is not None}
    grads = [x.new_empty(0) for _ in range(10)]
    redo = [False] * 10
    for i in range(10):
        if not need[i] or args[i] is None:
            continue
        s = per_slot.get(i)
        if s is None or not clean or (i not in _ROW_SLOTS and not uniform):
            redo[i] = True
            continue
        if i in _ROW_SLOTS:
            d = sum(g[:, j, None] * s[ci].float() for ci, j in enumerate(cols))
        else:
            d = sum(s[ci].float() * g[0, j] for ci, j in enumerate(cols)) if n else torch.zeros_like(s[0].float())
        grads[i] = d.to(args[i].dtype)
    if any(redo):
        again = _rowwise_bwd(grad, *args, ext, fn, t0, t1, chunk_bytes, compute, redo)
        grads = [again[i] if redo[i] else grads[i] for i in range(10)]
    return grads


@_train_bwd.register_fake
def _(grad, stored, x, w, b, xa, wa, y, v, c, ya, va, ext, fn, t0, t1, chunk_bytes, compute, outs, grad_mask,
      out_mask, need):
    args = (x, w, b, xa, wa, y, v, c, ya, va)
    return [torch.empty_like(a) if (a is not None and need[i]) else x.new_empty(0) for i, a in enumerate(args)]


def _train_backward(ctx, gs, *_):
    g = gs[0] if isinstance(gs, (list, tuple)) else gs  # (a list output: one gradient per tensor)
    saved = ctx.saved_tensors
    tensors, ext, stored = saved[:10], list(saved[10:10 + ctx.n_ext]), list(saved[10 + ctx.n_ext:])
    grads = _train_bwd(g, stored, *tensors, ext, *ctx.consts, *ctx.masks, ctx.need)
    out = [d if (m and d.numel()) else None for m, d in zip(ctx.need, grads)]
    return (*out, [None] * ctx.n_ext, None, None, None, None, None, None, None, None)


_rowwise_train.register_autograd(_train_backward, setup_context=_train_setup)


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
effpass.register_flop_formula(  # the logits once, and per output in out_mask one matmul per gradient asked for
    torch.ops.effpass.linear_rowwise_train,
    lambda x, w, b, xa, wa, y, v, c, ya, va, ext, fn, t0, t1, chunk_bytes, compute, outs, grad_mask, out_mask,
    out_val=None, **k: _rowwise_flops(x, w, xa, y, v, ya) + sum(bool(m) for m in out_mask[:outs]) * (
        _rowwise_flops(x, w, xa, y, v, ya, list(grad_mask)) - _rowwise_flops(x, w, xa, y, v, ya)))
# the trained form's backward scales what the forward stored (no matmul); where the rows' gradients differ it runs
# the recomputing backward inside (data-dependent: not counted here)
effpass.register_flop_formula(torch.ops.effpass.linear_rowwise_train_backward, lambda *a, out_val=None, **k: 0)
effpass.register_flop_formula(torch.ops.effpass.linear_rowwise_backward,
                              lambda grad, x, w, b, xa, wa, y, v, c, ya, va, *a, out_val=None, **k:
                              _rowwise_flops(x, w, xa, y, v, ya, list(a[6]) if len(a) > 6 else k.get("mask")))

#: the row-wise op (the joint hook marks it never-recompute)
ROWWISE_OPS = (torch.ops.effpass.linear_rowwise.default, torch.ops.effpass.linear_rowwise_train.default)
