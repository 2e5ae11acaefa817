"""The hand-written quantized formats of ``quantize_linear`` as they were before the torchao rebuild
(commit 1bef14c): kept here, and only here, so bench/bench_quantize.py can measure the old path beside the
new one in one run. Not part of the package; CPU paths only (the Triton path is left out).
"""
from __future__ import annotations

import functools

import torch.nn.functional as F
from torch import nn

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


def fp8_supported(device: torch.device | str | None = None) -> bool:
    """``torch._scaled_mm`` needs a CUDA GPU with compute capability >= 8.9 (Ada, Hopper and later)."""
    device = torch.device(device) if device is not None else torch.device("cuda")
    if device.type != "cuda" or not torch.cuda.is_available() or not hasattr(torch, "_scaled_mm"):
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def _to_fp8(t: torch.Tensor, dtype: torch.dtype, rowwise: bool):
    """(fp8 tensor, fp32 dequant scale) with dynamic scaling: per row of ``t`` or one per tensor."""
    fmax = torch.finfo(dtype).max
    amax = t.detach().abs().float()
    amax = amax.amax(dim=-1, keepdim=True) if rowwise else amax.amax()
    scale = (amax.clamp_min(1e-12) / fmax)
    q = (t.float() / scale).clamp(-fmax, fmax).to(dtype)
    return q, scale


def _fp8_mm(a: torch.Tensor, b: torch.Tensor, a_dtype, b_dtype, rowwise: bool, emulate: bool, out_dtype):
    """``a @ b.T`` (a [M, K], b [N, K]) with both operands cast to fp8, scaled along the contraction dim."""
    aq, sa = _to_fp8(a, a_dtype, rowwise)
    bq, sb = _to_fp8(b, b_dtype, rowwise)
    if emulate:
        return ((aq.float() * sa) @ (bq.float() * sb).t()).to(out_dtype)
    m, k = aq.shape
    n = bq.shape[0]
    pm, pk, pn = (-m) % 16, (-k) % 16, (-n) % 16  # _scaled_mm wants every dimension divisible by 16
    if pm or pk or pn:
        aq = F.pad(aq.view(torch.uint8), (0, pk, 0, pm)).view(a_dtype)
        bq = F.pad(bq.view(torch.uint8), (0, pk, 0, pn)).view(b_dtype)
        if rowwise:
            sa = F.pad(sa, (0, 0, 0, pm), value=1.0)
            sb = F.pad(sb, (0, 0, 0, pn), value=1.0)
    mm_dtype = torch.bfloat16 if rowwise else out_dtype  # row-wise scaling only writes bf16
    out = torch._scaled_mm(aq, bq.t(), scale_a=sa, scale_b=sb.t() if rowwise else sb, out_dtype=mm_dtype)
    return out[:m, :n].to(out_dtype)


class _Fp8Linear(torch.autograd.Function):
    """y = x W^T + b with fp8 matmuls in forward (e4m3) and backward (e5m2 per-tensor / e4m3 row-wise)."""

    @staticmethod
    def forward(ctx, x2d, weight, bias, rowwise: bool, emulate: bool):
        ctx.save_for_backward(x2d, weight)
        ctx.rowwise, ctx.emulate, ctx.has_bias = rowwise, emulate, bias is not None
        e4 = torch.float8_e4m3fn
        y = _fp8_mm(x2d, weight, e4, e4, rowwise, emulate, x2d.dtype)
        return y + bias.to(y.dtype) if bias is not None else y

    @staticmethod
    def backward(ctx, g):
        x2d, weight = ctx.saved_tensors
        e4 = torch.float8_e4m3fn
        gd = e4 if ctx.rowwise else torch.float8_e5m2
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = _fp8_mm(g, weight.t().contiguous(), gd, e4, ctx.rowwise, ctx.emulate, x2d.dtype)
        if ctx.needs_input_grad[1]:
            gw = _fp8_mm(g.t().contiguous(), x2d.t().contiguous(), gd, e4, ctx.rowwise, ctx.emulate, weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g.sum(0)
        return gx, gw, gb, None, None


# ------------------------------------------------------------------------------------------------------
# CPU int8 inference kernel
# ------------------------------------------------------------------------------------------------------
# HACK(Inductor's lowering of aten._weight_int8pack_mm asserts when an input is an unrealized pointwise
# value, e.g. the output of an RMSNorm, on torch 2.13): an opaque custom op makes Inductor call the aten
# kernel as an extern with realized inputs. Remove when the lowering realizes its inputs.
@torch.library.custom_op("effpass_legacy_quant::weight_int8pack_mm", mutates_args=())
def weight_int8pack_mm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x @ (qweight * scales[:, None]).T`` via ``aten._weight_int8pack_mm`` (no autograd: inference only)."""
    return torch.ops.aten._weight_int8pack_mm(x.contiguous(), qweight, scales.to(x.dtype))


@weight_int8pack_mm.register_fake
def _(x, qweight, scales):
    return x.new_empty(x.shape[0], qweight.shape[0])


# ------------------------------------------------------------------------------------------------------
# the module
# ------------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _triton_available() -> bool:
    try:
        import triton  # noqa: F401

        return True
    except Exception:
        return False


class QuantizedLinear(nn.Module):
    """A linear layer with a quantized frozen weight (or fp8 matmuls). Drop-in for ``nn.Linear``.

    Buffers by scheme (all in ``state_dict``):

    * int8: ``qweight`` int8 [N, K], ``scales`` fp32 [N]
    * int4: ``qweight`` uint8 [N, K/2], ``scales`` fp32 [N, K/g], ``zeros`` uint8 [N, K/g]
    * nf4: ``qweight`` uint8 [N, K/2] and ``absmax`` fp32 [N, K/64], or with double quantization
      ``qabsmax`` int8 [N, K/64], ``absmax_scale`` fp32 [ceil(N*K/64/256)], ``absmax_offset`` fp32 []
    * fp8: the high-precision ``weight`` stays a trainable parameter; matmuls run in fp8.
    * every scheme: ``outlier_idx`` int64 [n] and ``outlier_weight`` [N, n] (input features kept in the
      original precision; n = 0 unless ``outlier_threshold`` is set).
    """

    __effpass_linear__ = True

    def __init__(self, in_features: int, out_features: int, *, scheme: str, bias: nn.Parameter | None = None,
                 group_size: int = 128, block_size: int = 64, double_quant: bool = True, kernel: str = "auto",
                 fp8_granularity: str = "rowwise", fp8_emulate: bool = False,
                 compute_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.scheme, self.group_size, self.block_size = scheme, group_size, block_size
        self.double_quant, self.kernel = double_quant, kernel
        self.fp8_granularity, self.fp8_emulate = fp8_granularity, fp8_emulate
        self.compute_dtype = compute_dtype
        self.dq_block = 256
        self.bias = bias
        # NOTE(compile): a plain bool read in forward; probing the import there would trace an import.
        self._triton_ok = _triton_available()

    # -- construction -------------------------------------------------------------------------------
    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, *, scheme: str, outlier_threshold: float = 0.0, **kw) -> "QuantizedLinear":
        w = linear.weight.detach()
        m = cls(linear.in_features, linear.out_features, scheme=scheme, bias=linear.bias,
                compute_dtype=w.dtype, **kw)
        if scheme == "fp8":
            m.weight = linear.weight
            return m
        idx = torch.zeros(0, dtype=torch.long, device=w.device)
        if outlier_threshold > 0:
            colmax = w.float().abs().amax(dim=0)
            idx = torch.nonzero(colmax > outlier_threshold * w.float().std()).flatten()
        m.register_buffer("outlier_idx", idx)
        m.register_buffer("outlier_weight", w[:, idx].clone())
        if idx.numel():
            w = w.clone()
            w[:, idx] = 0  # the outlier columns no longer inflate the scales of the rest
        if scheme == "int8":
            q, s = quantize_int8(w)
            m.register_buffer("qweight", q)
            m.register_buffer("scales", s)
        elif scheme == "int4":
            q, s, z = quantize_int4(w, m.group_size)
            m.register_buffer("qweight", q)
            m.register_buffer("scales", s)
            m.register_buffer("zeros", z)
        elif scheme == "nf4":
            for name, t in quantize_nf4(w, m.block_size, m.double_quant, m.dq_block).items():
                m.register_buffer(name, t)
        else:  # pragma: no cover - validated by the pass
            raise ValueError(f"unknown scheme {scheme!r}; choose one of {list(SCHEMES)}")
        return m

    # -- reference semantics ------------------------------------------------------------------------
    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight the layer computes with, [out_features, in_features], in ``dtype``."""
        dtype = dtype or self.compute_dtype
        if self.scheme == "fp8":
            return self.weight.to(dtype)
        if self.scheme == "int8":
            w = dequantize_int8(self.qweight, self.scales, dtype)
        elif self.scheme == "int4":
            w = dequantize_int4(self.qweight, self.scales, self.zeros, self.group_size, dtype)
        else:
            w = dequantize_nf4(self._nf4_buffers(), self.block_size, dtype, self.dq_block)
        if self.outlier_idx.numel():
            w = w.index_copy(1, self.outlier_idx, self.outlier_weight.to(dtype))
        return w

    def _nf4_buffers(self) -> dict:
        names = ("qweight", "qabsmax", "absmax_scale", "absmax_offset") if self.double_quant else ("qweight", "absmax")
        return {n: getattr(self, n) for n in names}

    def weight_nbytes(self) -> int:
        """Bytes of the stored weight (packed values, scales, outliers; not the bias)."""
        if self.scheme == "fp8":
            return self.weight.numel() * self.weight.element_size()
        return sum(b.numel() * b.element_size() for n, b in self.named_buffers(recurse=False))

    def kernel_for(self, device: torch.device, needs_grad: bool) -> str:
        """The matmul path ``forward`` takes for inputs on ``device``."""
        if self.scheme == "fp8":
            return "fp8_emulated" if self.fp8_emulate else f"torch._scaled_mm({self.fp8_granularity})"
        k = self.kernel
        if k == "auto":
            if device.type == "cuda" and self._triton_ok:
                k = "triton"
            elif self.scheme == "int8" and not needs_grad and device.type == "cpu":
                k = "aten"
            else:
                k = "reference"
        if k == "aten" and needs_grad:
            k = "reference"  # HACK(no autograd formula for _weight_int8pack_mm): remove when it has one
        return {"triton": f"triton_{self.scheme}_mm", "aten": "aten._weight_int8pack_mm",
                "reference": "dequantize+linear"}[k]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if self.scheme == "fp8":
            y = _Fp8Linear.apply(x.reshape(-1, shape[-1]), self.weight, self.bias,
                                 self.fp8_granularity == "rowwise", self.fp8_emulate)
            return y.reshape(*shape[:-1], self.out_features)
        needs_grad = torch.is_grad_enabled() and x.requires_grad
        kernel = self.kernel_for(x.device, needs_grad)
        if kernel == "dequantize+linear":
            return F.linear(x, self.dequantize(x.dtype), self.bias.to(x.dtype) if self.bias is not None else None)
        x2d = x.reshape(-1, shape[-1])
        if kernel == "aten._weight_int8pack_mm":
            y = weight_int8pack_mm(x2d, self.qweight, self.scales)
        else:
            raise NotImplementedError("the legacy Triton path is not part of the bench copy")
        if self.outlier_idx.numel():
            y = y + x2d.index_select(1, self.outlier_idx) @ self.outlier_weight.to(x.dtype).t()
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*shape[:-1], self.out_features)

    # -- state dict: outlier buffers are data-dependent in size ----------------------------------------
    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        for name, buf in list(self._buffers.items()):
            t = state_dict.get(prefix + name)
            if buf is not None and t is not None and t.shape != buf.shape:
                self._buffers[name] = torch.empty(t.shape, dtype=buf.dtype, device=buf.device)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        s = f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme}"
        if self.scheme == "int4":
            s += f", group_size={self.group_size}"
        if self.scheme == "nf4":
            s += f", block_size={self.block_size}, double_quant={self.double_quant}"
        if self.scheme == "fp8":
            s += f", granularity={self.fp8_granularity}{', emulated' if self.fp8_emulate else ''}"
        elif self.outlier_idx.numel():
            s += f", outliers={self.outlier_idx.numel()}"
        return s + f", bias={self.bias is not None}"




def legacy_prepare(model: nn.Module, scheme: str, exclude=(), **kw) -> nn.Module:
    """Replace every plain, untied ``nn.Linear`` not named in ``exclude`` by the old ``QuantizedLinear``."""
    import fnmatch

    for name, mod in list(model.named_modules()):
        if type(mod) is not nn.Linear or any(fnmatch.fnmatchcase(name, g) for g in exclude):
            continue
        q = QuantizedLinear.from_linear(mod, scheme=scheme, **kw)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, q)
    return model
