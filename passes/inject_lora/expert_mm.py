"""The grouped matmul over experts that expert LoRA adapters run (``effpass::expert_mm``): custom ops and their
autograd, apart from the modules that call them (:mod:`._lora_experts`)."""
from __future__ import annotations

import torch

__all__ = ["expert_mm", "expert_mm_grad_w"]


# -- a grouped matmul over experts (rows sorted by expert), opaque to the compiler --------------------------
# NOTE(compile): the rows per expert depend on the routing; inside a custom op the split happens at run time
# (one ``offs.tolist()``), so the compiled graph has static shapes and neither breaks nor recompiles when the
# routing changes. torch's ``F.grouped_mm`` would do the same natively, but its CPU backward fails on fp32
# (torch 2.13: "Invalid strides/sizes") and CUDA supports it for bf16 only.
@torch.library.custom_op("effpass::expert_mm", mutates_args=())
def expert_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, transposed: bool) -> torch.Tensor:
    """Rows ``offs[e-1]:offs[e]`` of ``x`` times ``w[e]`` (``w[e].T`` when ``transposed``)."""
    n_out = w.shape[1] if transposed else w.shape[2]
    out = x.new_zeros(x.shape[0], n_out)
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            we = w[e].T if transposed else w[e]
            torch.mm(x[start:end], we.to(x.dtype), out=out[start:end])
        start = end
    return out


@expert_mm.register_fake
def _(x, w, offs, transposed):
    return x.new_empty(x.shape[0], w.shape[1] if transposed else w.shape[2])


@torch.library.custom_op("effpass::expert_mm_grad_w", mutates_args=())
def expert_mm_grad_w(x: torch.Tensor, grad: torch.Tensor, offs: torch.Tensor, n_experts: int,
                     transposed: bool) -> torch.Tensor:
    """d loss / d w of :func:`expert_mm` (zero for experts that got no row)."""
    k, n = x.shape[1], grad.shape[1]
    gw = grad.new_zeros(n_experts, n, k) if transposed else grad.new_zeros(n_experts, k, n)
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            if transposed:
                torch.mm(grad[start:end].T, x[start:end], out=gw[e])
            else:
                torch.mm(x[start:end].T, grad[start:end], out=gw[e])
        start = end
    return gw


@expert_mm_grad_w.register_fake
def _(x, grad, offs, n_experts, transposed):
    k, n = x.shape[1], grad.shape[1]
    return grad.new_empty(n_experts, n, k) if transposed else grad.new_empty(n_experts, k, n)


def _expert_mm_setup(ctx, inputs, output):
    x, w, offs, transposed = inputs
    ctx.save_for_backward(x, w, offs)
    ctx.transposed = transposed
    ctx.w_dtype = w.dtype


def _expert_mm_backward(ctx, grad):
    x, w, offs = ctx.saved_tensors
    gx = gw = None
    if ctx.needs_input_grad[0]:
        # x @ w_e (K, N): dx = g @ w_e^T  -> expert_mm(g, w, transposed=True); and the other way round
        gx = expert_mm(grad, w, offs, not ctx.transposed)
    if ctx.needs_input_grad[1]:
        gw = expert_mm_grad_w(x, grad, offs, w.shape[0], ctx.transposed).to(ctx.w_dtype)
    return gx, gw, None, None


expert_mm.register_autograd(_expert_mm_backward, setup_context=_expert_mm_setup)
