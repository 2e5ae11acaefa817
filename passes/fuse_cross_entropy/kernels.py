"""The custom ops of ``fuse_cross_entropy``'s chunked head (opaque to Inductor, which can then neither fuse,
reorder nor keep extra chunks alive):

* ``effpass::linear_cross_entropy``: ``sum``/``mean`` loss; the gradients of the inputs are computed in the
  forward, chunk by chunk (as Liger does); the registered backward only scales them by the incoming gradient;
* ``effpass::linear_cross_entropy_rows`` (+ ``_backward``): per-row losses and log-sum-exp; the backward
  recomputes each chunk;
* ``effpass::linear_rowwise`` (+ ``_backward``): any row-wise function of one or two heads (``rowwise.py``).

The chunked passes they run are in ``chunks.py``. :func:`linear_cross_entropy` is the eager entry point.
The graph pass that inserts the ops is ``passes/fuse_cross_entropy/__init__.py``; the matcher that finds the sites is
``passes/fuse_cross_entropy/matching.py``.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

import effpass

from .chunks import (CPU_ROWS_TILE_BYTES, MIN_CHUNK_ROWS, MIN_FULL_ROWS, TILE_ROWS,  # noqa: F401 (re-exported)
                              _accumulators, _backward_pass, _forward_pass, _prepare,
                              _scatter_grads, _Spec, _tiles_forward, _tiles_grads, _x_grad_pass, default_chunk_bytes,
                              default_rows_chunk_bytes, num_chunks, plan_chunks, plan_row_tiles)
from .triton_tiles import wanted as _tiles_wanted
from .rowwise import ROWWISE_OPS, register_row_fn, rowwise_rows  # noqa: F401 (re-exported)

__all__ = ["MIN_FULL_ROWS", "MIN_CHUNK_ROWS", "TILE_ROWS", "CPU_ROWS_TILE_BYTES", "plan_chunks", "default_chunk_bytes",
           "default_rows_chunk_bytes", "num_chunks", "register_row_fn", "rowwise_rows",
           "linear_cross_entropy", "OPS", "NO_IGNORE"]


# ------------------------------------------------------------------------------------------------------
# the custom ops
# ------------------------------------------------------------------------------------------------------
@torch.library.custom_op("effpass::linear_cross_entropy", mutates_args=())
def _lce_reduced(x: Tensor, w: Tensor, x2: Optional[Tensor], w2: Optional[Tensor], bias: Optional[Tensor],
                 target: Tensor, ignore_index: int, smoothing: float, pre: float, softcap: bool, post: float,
                 mean: bool, chunk_bytes: int, compute: str, grad_mask: list[bool], impl: str = "effpass"
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Summed (``mean``: averaged over valid rows) loss and the gradients of x, w, x2, w2, bias. ``impl``: the
    pass's ``kernel`` option (an argument named ``kernel`` would collide with Inductor's ``FallbackKernel.create``) (``"effpass"``: the Triton tiles where the code runs for CUDA, else the chunked kernel)."""
    spec = _Spec(w.shape[0], ignore_index, smoothing, pre, softcap, post, chunk_bytes, compute)
    keep, tgt, xs, ws, b = _prepare(x, w, x2, w2, bias, target, spec)
    tiles = _tiles_wanted(impl, x, second_projection=x2 is not None, x_grad=False)
    acc = _accumulators(xs, ws, bias is not None, grad_mask, spec.vocab, x.device,
                        (w.dtype, w2.dtype if w2 is not None else None), w_written=tiles)
    count = keep.sum()  # a device tensor: no host synchronisation
    if mean:  # applied to each tile's logit gradient (fp32), before the matmuls
        spec.grad_scale = 1.0 / count.clamp(min=1).to(torch.float32)
    if tiles:
        loss, lse = _tiles_forward(xs, ws, b, tgt, spec)
        rowg = keep.to(torch.float32) * spec.grad_scale
        _tiles_grads(xs, ws, b, tgt, lse, rowg, spec, acc)
    else:
        loss, _ = _forward_pass(xs, ws, b, tgt, spec, acc, keep.to(torch.float32))  # ignored rows: factor 0
    total = torch.where(keep, loss, 0.0).sum()
    if mean:
        total = total / count  # 0/0 is nan, as torch's mean
    return (total,) + _scatter_grads(acc, x, w, x2, w2, bias, None)


@_lce_reduced.register_fake
def _(x, w, x2, w2, bias, target, ignore_index, smoothing, pre, softcap, post, mean, chunk_bytes, compute,
      grad_mask, impl="effpass"):
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
    return (*out, None, None, None, None, None, None, None, None, None, None, None)


_lce_reduced.register_autograd(_reduced_backward, setup_context=_reduced_setup)


@torch.library.custom_op("effpass::linear_cross_entropy_rows", mutates_args=())
def _lce_rows(x: Tensor, w: Tensor, x2: Optional[Tensor], w2: Optional[Tensor], bias: Optional[Tensor],
              target: Tensor, ignore_index: int, smoothing: float, pre: float, softcap: bool, post: float,
              chunk_bytes: int, compute: str, x_grad: bool = False, impl: str = "effpass"
              ) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row losses (0 on ignored rows, as ``reduction="none"``), per-row log-sum-exp, and with ``x_grad``
    (a frozen head: only ``x`` needs a gradient; no second projection, no smoothing) ``d loss_i / d x_i``
    computed in the same pass (else an empty tensor)."""
    spec = _Spec(w.shape[0], ignore_index, smoothing, pre, softcap, post, chunk_bytes, compute, True)
    keep, tgt, xs, ws, b = _prepare(x, w, x2, w2, bias, target, spec)
    if x_grad:
        if x2 is not None or smoothing:
            raise ValueError("linear_cross_entropy_rows(x_grad=True) takes one projection without label smoothing")
        loss_v, lse_v, gx_v = _x_grad_pass(xs, ws, b, tgt, spec)
        gx = gx_v.mul_(keep[:, None]).to(x.dtype)
    elif _tiles_wanted(impl, x, second_projection=x2 is not None, x_grad=False):
        loss_v, lse_v = _tiles_forward(xs, ws, b, tgt, spec)
        gx = x.new_empty(0)
    else:
        loss_v, lse_v = _forward_pass(xs, ws, b, tgt, spec, None, None)
        gx = x.new_empty(0)
    # ignored rows: loss and log-sum-exp 0 (as reduction="none"; the backward reads the mask, not this 0)
    return torch.where(keep, loss_v, 0.0), torch.where(keep, lse_v, 0.0), gx


@_lce_rows.register_fake
def _(x, w, x2, w2, bias, target, ignore_index, smoothing, pre, softcap, post, chunk_bytes, compute, x_grad=False,
      impl="effpass"):
    n = target.shape[0]
    return (x.new_empty((n,), dtype=torch.float32), x.new_empty((n,), dtype=torch.float32),
            torch.empty_like(x) if x_grad else x.new_empty(0))


@torch.library.custom_op("effpass::linear_cross_entropy_rows_backward", mutates_args=())
def _lce_rows_bwd(grad: Tensor, lse: Tensor, x: Tensor, w: Tensor, x2: Optional[Tensor], w2: Optional[Tensor],
                  bias: Optional[Tensor], target: Tensor, ignore_index: int, smoothing: float, pre: float,
                  softcap: bool, post: float, chunk_bytes: int, compute: str, grad_mask: list[bool],
                  impl: str = "effpass") -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    spec = _Spec(w.shape[0], ignore_index, smoothing, pre, softcap, post, chunk_bytes, compute, True)
    keep, tgt, xs, ws, b = _prepare(x, w, x2, w2, bias, target, spec)
    tiles = _tiles_wanted(impl, x, second_projection=x2 is not None, x_grad=False)
    acc = _accumulators(xs, ws, bias is not None, grad_mask, spec.vocab, x.device,
                        (w.dtype, w2.dtype if w2 is not None else None), w_written=tiles)
    # ignored rows: an infinite log-sum-exp makes their softmax 0 (never exp of an unnormalised logit) and the
    # zero row factor their gradient 0
    lse_k = torch.where(keep, lse, float("inf"))
    rowg = torch.where(keep, grad.float(), 0.0)
    if tiles:  # the incoming gradient is each row's factor: no gradient is computed twice or rescaled
        _tiles_grads(xs, ws, b, tgt, lse_k, rowg, spec, acc)
    else:
        _backward_pass(xs, ws, b, tgt, lse_k, rowg, spec, acc)
    return _scatter_grads(acc, x, w, x2, w2, bias, None)


@_lce_rows_bwd.register_fake
def _(grad, lse, x, w, x2, w2, bias, target, ignore_index, smoothing, pre, softcap, post, chunk_bytes, compute,
      grad_mask, impl="effpass"):
    def like(t, on):
        return torch.empty_like(t) if (t is not None and on) else x.new_empty(0)

    return like(x, grad_mask[0]), like(w, grad_mask[2]), like(x2, grad_mask[1]), like(w2, grad_mask[3]), like(bias, grad_mask[4])


def _head_flops(x, w, x2, w2, grad_mask=None, chunk_bytes=None, kernel=None) -> int:
    """Matmul FLOPs of the chunked head: the logits (2*N*H*V, plus the adapter's 2*N*r*V; computed again
    by the per-row form's backward) and one matmul per gradient computed (dx, dw; dx2, dw2); with
    ``chunk_bytes`` (the reduced op), once more the logits when its weight gradient is taken by vocabulary
    tiles (several row chunks: chunks.py, NOTE(weight gradient written once))."""
    n, v = x.shape[0], w.shape[0]
    main, side = 2 * n * x.shape[-1] * v, (2 * n * x2.shape[-1] * v if x2 is not None and x2.numel() else 0)
    m = grad_mask or [False] * 5
    again = 0
    if kernel is not None and (m[0] or m[2]) and _tiles_wanted(kernel, x, second_projection=x2 is not None
                                                                and x2.numel() > 0, x_grad=False):
        again = 1  # the Triton tiles: the log-sum-exp first, then the logits again with the gradients
    elif chunk_bytes is not None and (m[2] or m[3]):
        from .chunks import _Spec, _vocab_tile, default_chunk_bytes

        spec = _Spec(v, -100, 0.0, 1.0, False, 1.0, int(chunk_bytes) or default_chunk_bytes(
            n, v, x.numel() * x.element_size()), "")
        again = int(spec.plan(n, v, spec.chunk_bytes)[0] < n and bool(_vocab_tile(n, v, spec)))
    return main * (1 + m[0] + m[2] + again) + side * (1 + m[1] + m[3] + again)


# for the memory planner (effpass.memory_options): the per-row op also serves the log-probability sites
effpass.register_flop_formula(torch.ops.effpass.linear_cross_entropy, lambda x, w, x2, w2, bias, target, *a, out_val=None, **k:
                              _head_flops(x, w, x2, w2, list(a[8]) if len(a) > 8 else k.get("grad_mask"),
                                          a[6] if len(a) > 6 else k.get("chunk_bytes"),
                                          a[9] if len(a) > 9 else k.get("impl", "effpass")))
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
    ctx.kernel = inputs[14] if len(inputs) > 14 else "effpass"
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
        return (dx, None, None, None, None, None, None, None, None, None, None, None, None, None, None)
    x, w, x2, w2, bias, target, lse = ctx.saved_tensors
    grads = _lce_rows_bwd(g, lse, x, w, x2, w2, bias, target, *ctx.consts, ctx.mask, ctx.kernel)
    dx, dw, dx2, dw2, db = grads
    out = [d if (p and d.numel()) else None for p, d in zip(ctx.present, (dx, dw, dx2, dw2, db))]
    return (*out, None, None, None, None, None, None, None, None, None, None)


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

OPS = OPS + ROWWISE_OPS
