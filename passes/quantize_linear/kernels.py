"""Triton kernel for ``quantize_linear``'s int4 weights: a matmul that dequantizes in registers.

Only int4 (group-wise asymmetric, effpass's own format) uses it: int8 and NF4 weights are torchao tensor
subclasses with torchao's own kernels (see ``_quant_formats``). The kernel body still handles the int8 and
NF4 layouts it was written for (``SCHEME`` 0 and 2); only the int4 entry point is registered.

``y[M, N] = x[M, K] @ dequant(W)[N, K]^T``. Each program computes a ``BM x BN`` tile; per ``BK`` slice it loads
the packed weight, unpacks nibbles (element ``2j`` in the low nibble), applies the scales (int8: once on
the fp32 accumulator, the per-output-channel scale factors out; int4: ``(q - zero) * scale`` per group;
NF4: code lookup times the block absmax, itself dequantized from int8 when double-quantized) and
accumulates in fp32 with ``tl.dot``.

The kernel is a ``torch.library`` custom op (``effpass_quant::int4_mm``) with a fake impl, so
Dynamo and Inductor treat it as one opaque node, and a backward with respect to ``x`` (``g @ dequant(W)``;
the quantized weight is frozen), so QLoRA trains through it. CI runs these kernels on the CPU with
``TRITON_INTERPRET=1``; on a GPU they run natively.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .formats import INT4_KERNELS, NF4_CODE, dequantize_int4

__all__ = ["int4_mm"]

_INT8, _INT4, _NF4 = 0, 1, 2


@triton.jit
def _dequant_mm_kernel(x_ptr, w_ptr, out_ptr, s_ptr, z_ptr, qa_ptr, as_ptr, off_ptr, code_ptr,
                       M, N, K, stride_xm, stride_xk, stride_om,
                       SCHEME: tl.constexpr, GROUP: tl.constexpr, DQ: tl.constexpr, DQ_BLOCK: tl.constexpr,
                       IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        k_ok = rk < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :] * stride_xk,
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        wmask = k_ok[:, None] & n_ok[None, :]  # the weight tile is loaded transposed: [BK, BN]
        if SCHEME == 0:
            w = tl.load(w_ptr + rn[None, :] * K + rk[:, None], mask=wmask, other=0).to(tl.float32)
        else:
            p = tl.load(w_ptr + rn[None, :] * (K // 2) + (rk // 2)[:, None], mask=wmask, other=0).to(tl.int32)
            q = (p >> ((rk % 2) * 4)[:, None]) & 15
            blk = rn[None, :] * (K // GROUP) + (rk // GROUP)[:, None]
            if SCHEME == 1:
                s = tl.load(s_ptr + blk, mask=wmask, other=0.0).to(tl.float32)
                z = tl.load(z_ptr + blk, mask=wmask, other=0).to(tl.float32)
                w = (q.to(tl.float32) - z) * s
            else:
                v = tl.load(code_ptr + q)
                if DQ:
                    qa = tl.load(qa_ptr + blk, mask=wmask, other=0).to(tl.float32)
                    a = qa * tl.load(as_ptr + blk // DQ_BLOCK, mask=wmask, other=0.0) + tl.load(off_ptr)
                else:
                    a = tl.load(s_ptr + blk, mask=wmask, other=0.0)
                w = v * a
        w = w.to(x.dtype)
        if IEEE:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    if SCHEME == 0:
        acc = acc * tl.load(s_ptr + rn, mask=n_ok, other=0.0)[None, :]
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@functools.lru_cache(maxsize=None)
def _code(device: torch.device) -> torch.Tensor:
    return torch.tensor(NF4_CODE, dtype=torch.float32, device=device)


def _launch(x, qweight, scheme, n, s, z=None, qa=None, a_scale=None, a_off=None, group=1, dq=False):
    m, k = x.shape
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    dummy = qweight
    bm = 16 if m <= 16 else (32 if m <= 32 else 64)
    bn, bk = 64, min(64, max(16, triton.next_power_of_2(k)))
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _dequant_mm_kernel[grid](
        x, qweight, out, s, z if z is not None else dummy, qa if qa is not None else dummy,
        a_scale if a_scale is not None else s, a_off if a_off is not None else s, _code(x.device),
        m, n, k, x.stride(0), x.stride(1), out.stride(0),
        SCHEME=scheme, GROUP=group, DQ=dq, DQ_BLOCK=256, IEEE=x.dtype == torch.float32, BM=bm, BN=bn, BK=bk)
    return out


# ------------------------------------------------------------------------------------------------------
# custom op (one opaque graph node) with a fake impl and a backward with respect to x
# ------------------------------------------------------------------------------------------------------
@torch.library.custom_op("effpass_quant::int4_mm", mutates_args=())
def int4_mm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
            group_size: int) -> torch.Tensor:
    return _launch(x, qweight, _INT4, qweight.shape[0], scales.float().contiguous(), zeros, group=group_size)


@int4_mm.register_fake
def _fake(x, qweight, *args):
    return x.new_empty(x.shape[0], qweight.shape[0])


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*[t for t in inputs[1:] if isinstance(t, torch.Tensor)])
    ctx.extra = [t for t in inputs[1:] if not isinstance(t, torch.Tensor)]


def _int4_bwd(ctx, g):
    q, s, z = ctx.saved_tensors
    return g @ dequantize_int4(q, s, z, ctx.extra[0], g.dtype), None, None, None, None


int4_mm.register_autograd(_int4_bwd, setup_context=_setup)
INT4_KERNELS["triton"] = int4_mm
