"""The quantized weight formats of quantize_linear: int8 per-channel, int4 grouped, NF4 with double
quantization (QLoRA's code table). Shared by the module (``quantize_linear``) and the Triton kernels
(``_quant_kernels``), so neither imports the other."""
from __future__ import annotations

import torch
import torch.nn.functional as F

#: The 16 NF4 code values (QLoRA paper, appendix E; bitsandbytes ``create_normal_map``).
NF4_CODE = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
)



def nf4_code_from_normal_quantiles(offset: float = 0.9677083) -> torch.Tensor:
    """NF4 built as in the paper: 8 positive and 7 negative quantiles of N(0, 1), an exact zero,
    normalized to [-1, 1] (bitsandbytes' ``create_normal_map(offset, use_extra_value=True)``)."""
    pos = torch.special.ndtri(torch.linspace(offset, 0.5, 9, dtype=torch.float64)[:-1])
    neg = -torch.special.ndtri(torch.linspace(offset, 0.5, 8, dtype=torch.float64)[:-1])
    v = torch.cat([pos, torch.zeros(1, dtype=torch.float64), neg]).sort().values
    return v / v.abs().max()


def sqnr(ref: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB: 20 log10(|ref| / |ref - approx|)."""
    ref, approx = ref.detach().double(), approx.detach().double()
    return float(20 * torch.log10(ref.norm() / (ref - approx).norm().clamp_min(1e-30)))


# ------------------------------------------------------------------------------------------------------
# quantize / dequantize (plain torch; the reference every kernel is checked against)
# ------------------------------------------------------------------------------------------------------
def _pack4(q: torch.Tensor) -> torch.Tensor:
    """[N, K] values 0..15 -> [N, K/2] uint8; element 2j in the low nibble, 2j+1 in the high one."""
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def _unpack4(p: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_pack4`: [N, K/2] uint8 -> [N, K] uint8."""
    return torch.stack([p & 15, p >> 4], dim=-1).flatten(-2)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8: ``w ~= q * scale[:, None]``, ``|w - q*scale| <= scale/2``."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12)
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q, scale, dtype):
    return (q.float() * scale.float()[:, None]).to(dtype)


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group-wise asymmetric 4-bit (min/max per group of ``group_size`` input features).

    Returns (packed uint8 [N, K/2], scale fp32 [N, K/g], zero point uint8 [N, K/g]);
    ``w ~= (q - zero) * scale``.
    """
    n, k = w.shape
    g = w.float().reshape(n, k // group_size, group_size)
    lo = g.amin(-1).clamp(max=0.0)
    hi = g.amax(-1).clamp(min=0.0)
    scale = ((hi - lo) / 15.0).clamp_min(1e-12)
    zero = torch.round(-lo / scale).clamp_(0, 15)
    q = torch.round(g / scale[..., None] + zero[..., None]).clamp_(0, 15)
    return _pack4(q.reshape(n, k)), scale, zero.to(torch.uint8)


def dequantize_int4(packed, scale, zero, group_size: int, dtype):
    n = packed.shape[0]
    q = _unpack4(packed).float().reshape(n, -1, group_size)
    return ((q - zero.float()[..., None]) * scale.float()[..., None]).reshape(n, -1).to(dtype)


def quantize_nf4(w: torch.Tensor, block_size: int = 64, double_quant: bool = True, dq_block: int = 256):
    """NF4 with one absmax per ``block_size`` consecutive input features of a row (QLoRA).

    With ``double_quant`` the absmax constants are centred on their mean and quantized to int8 with one
    fp32 scale per ``dq_block`` constants. Returns a dict of buffers: ``qweight`` (uint8 [N, K/2]) and either
    ``absmax`` (fp32 [N, K/b]) or ``qabsmax`` (int8 [N, K/b]), ``absmax_scale`` (fp32 [ceil(N*K/b/256)]),
    ``absmax_offset`` (fp32 scalar).
    """
    n, k = w.shape
    blocks = w.float().reshape(n, k // block_size, block_size)
    absmax = blocks.abs().amax(-1).clamp_min(1e-12)
    code = torch.tensor(NF4_CODE, dtype=torch.float32, device=w.device)
    mids = (code[1:] + code[:-1]) / 2
    q = torch.bucketize(blocks / absmax[..., None], mids)
    out = {"qweight": _pack4(q.reshape(n, k))}
    if not double_quant:
        out["absmax"] = absmax
        return out
    offset = absmax.mean()
    c = (absmax - offset).flatten()
    nb = c.numel()
    pad = (-nb) % dq_block
    cb = F.pad(c, (0, pad)).reshape(-1, dq_block)
    s2 = (cb.abs().amax(-1) / 127.0).clamp_min(1e-12)
    qa = torch.round(cb / s2[:, None]).clamp_(-127, 127).to(torch.int8).flatten()[:nb]
    out.update(qabsmax=qa.reshape(n, k // block_size), absmax_scale=s2, absmax_offset=offset.reshape(()))
    return out


def nf4_absmax(buffers: dict, dq_block: int = 256) -> torch.Tensor:
    if "absmax" in buffers and buffers["absmax"].numel():
        return buffers["absmax"].float()
    qa = buffers["qabsmax"]
    flat = qa.flatten().float()
    idx = torch.arange(flat.numel(), device=qa.device) // dq_block
    return (flat * buffers["absmax_scale"].float()[idx] + buffers["absmax_offset"].float()).reshape(qa.shape)


def _nf4_pair_table(device) -> torch.Tensor:
    """[256, 2]: the two code values a packed byte holds (low nibble first): one gather per byte."""
    code = torch.tensor(NF4_CODE, dtype=torch.float32, device=device)
    b = torch.arange(256, device=device)
    return torch.stack([code[b & 15], code[b >> 4]], dim=-1)


def dequantize_nf4(buffers: dict, block_size: int, dtype, dq_block: int = 256):
    packed = buffers["qweight"]
    n = packed.shape[0]
    # NOTE(speed): index_select with int32 indices is ~2x faster than advanced indexing on CPU
    vals = _nf4_pair_table(packed.device).index_select(0, packed.flatten().int()).reshape(n, -1, block_size)
    return (vals * nf4_absmax(buffers, dq_block)[..., None]).reshape(n, -1).to(dtype)


# ------------------------------------------------------------------------------------------------------
# fp8
# ------------------------------------------------------------------------------------------------------
