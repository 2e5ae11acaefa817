"""``quantize_linear``: store ``nn.Linear`` weights in int8, int4 or NF4 (with double quantization), or run
their matmuls in fp8.

Phase: module only (``prepare_module``). Quantized weights are state that must exist before the optimizer
is built and that ``state_dict()`` must carry, so they are made on the eager model, not inside a graph
(see torch-facts "Therefore state that must exist before the optimizer ...").

Each in-scope ``nn.Linear`` is replaced by a :class:`QuantizedLinear` that holds the packed weight and its
scales as buffers; the full-precision weight is dropped (freed once the caller holds no reference). The
module's eager ``forward`` is the reference semantics: dequantize, then ``F.linear``, differentiable with
respect to the input (the packed weight is frozen), so the prepared eager model and the compiled one
compute the same function and a LoRA adapter on top trains (QLoRA). Faster paths compute the same thing:

* CPU, int8, no gradient needed: ``aten._weight_int8pack_mm`` (no autograd formula, so only then);
* CUDA, int8 / int4 / NF4: Triton kernels that dequantize inside the matmul (``_quant_kernels``),
  registered as ``torch.library`` custom ops with a fake impl and a backward with respect to the input;
* fp8: ``torch._scaled_mm`` with dynamic per-tensor or row-wise scales on GPUs with compute capability
  >= 8.9 (forward e4m3; gradients e5m2 per-tensor or e4m3 row-wise); elsewhere a ``ValueError``, or an
  emulation (quantize-dequantize casts) that only tests should ask for.

Ordering: no ``run_after``. ``inject_lora`` runs after this pass (QLoRA) and treats any module with
``__effpass_linear__ = True`` as a linear base (it reads ``in_features``, ``out_features``, ``bias`` and calls
``base(x)``); ``wrap_fsdp`` runs after every module pass.

Invariants: a quantized linear's ``state_dict`` holds exactly its packed weight, scales and bias, and
loading it into a model prepared with the same options reproduces the outputs bit for bit. Linears whose
weight is tied to another parameter, subclasses of ``nn.Linear`` (their forward may differ) and shapes a
scheme cannot handle are left alone and listed in ``skipped`` with the reason.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

import effpass
from ._quant_formats import (  # noqa: F401  (re-exported)
    NF4_CODE, nf4_code_from_normal_quantiles, sqnr, quantize_int8, dequantize_int8, quantize_int4, dequantize_int4,
    quantize_nf4, dequantize_nf4)

SCHEMES = ("int8", "int4", "nf4", "fp8")
KERNELS = ("auto", "reference", "triton", "aten")

__all__ = ["QuantizeLinear", "QuantizedLinear", "NF4_CODE", "quantize_int8", "quantize_int4", "quantize_nf4",
           "nf4_code_from_normal_quantiles", "sqnr", "fp8_supported"]

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
@torch.library.custom_op("effpass_quant::weight_int8pack_mm", mutates_args=())
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
            from . import _quant_kernels as qk

            y = qk.quantized_mm(self, x2d)
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


# ------------------------------------------------------------------------------------------------------
# the pass
# ------------------------------------------------------------------------------------------------------
@effpass.register_pass("quantize_linear")
@dataclass(frozen=True, kw_only=True)
class QuantizeLinear(effpass.Pass):
    """Replace linears with int8 / int4 / NF4 weight-quantized ones (or fp8-matmul ones).

    Before (module tree)::

        q_proj: Linear(64 -> 64)            weight fp32 [64, 64]            16 KiB
    After ``QuantizeLinear(scheme="nf4")``::

        q_proj: QuantizedLinear(scheme=nf4) qweight uint8 [64, 32] + qabsmax int8 [64, 1]
                                            + absmax_scale, absmax_offset   ~2.1 KiB
    ``forward(x) = F.linear(x, dequantize(), bias)`` (or a fused kernel computing the same).
    """

    scheme: Literal["int8", "int4", "nf4", "fp8"] = field(default="int8", metadata={
        "doc": "int8: per-output-channel symmetric; int4: group-wise asymmetric; nf4: QLoRA NormalFloat4 "
               "(block 64); fp8: e4m3 matmuls with dynamic scales (weight stays high precision)"})
    group_size: int = field(default=128, metadata={"doc": "int4: input features per scale/zero point"})
    block_size: int = field(default=64, metadata={"doc": "nf4: input features per absmax constant"})
    double_quant: bool = field(default=True, metadata={
        "doc": "nf4: quantize the absmax constants to int8 with one fp32 scale per 256 (QLoRA)"})
    kernel: Literal["auto", "reference", "triton", "aten"] = field(default="auto", metadata={
        "doc": "matmul path: auto (Triton on CUDA, aten int8pack on CPU without grad, else reference), "
               "reference (dequantize+linear), triton (fused; CUDA or TRITON_INTERPRET=1), aten (int8 only)"})
    outlier_threshold: float = field(default=0.0, metadata={
        "doc": "keep input-feature columns whose max |w| exceeds this many std of the weight in high "
               "precision (LLM.int8 idea); 0 disables"})
    fp8_granularity: Literal["tensorwise", "rowwise"] = field(default="rowwise", metadata={
        "doc": "fp8: one scale per tensor or per row (per token / per output channel)"})
    fp8_emulate: bool = field(default=False, metadata={
        "doc": "fp8: emulate the fp8 casts with plain matmuls on any device (for tests only)"})

    @classmethod
    def default_note(cls) -> str:
        return "off (lossy: opt in with QuantizeLinear(scheme=...))"

    def validate(self) -> None:
        for name in ("group_size", "block_size"):
            v = getattr(self, name)
            if v <= 0 or v % 2:
                raise ValueError(f"quantize_linear: {name} must be a positive even number, got {v}")
        if self.outlier_threshold < 0:
            raise ValueError(f"quantize_linear: outlier_threshold must be >= 0 (0 disables), got {self.outlier_threshold}")
        if self.kernel == "aten" and self.scheme != "int8":
            raise ValueError(f"quantize_linear: kernel='aten' (_weight_int8pack_mm) needs scheme='int8', got "
                             f"scheme={self.scheme!r}; use kernel='auto', 'reference' or 'triton'")
        if self.scheme == "fp8" and self.outlier_threshold:
            raise ValueError("quantize_linear: outlier_threshold applies to int8/int4/nf4, not scheme='fp8'")
        if self.fp8_emulate and self.scheme != "fp8":
            raise ValueError(f"quantize_linear: fp8_emulate=True needs scheme='fp8', got {self.scheme!r}")

    def _site_problem(self, name: str, lin: nn.Linear, tied: set[int]) -> str | None:
        if type(lin) is not nn.Linear:
            return f"{type(lin).__name__} is a subclass of nn.Linear (its forward may differ)"
        if id(lin.weight) in tied:
            return "weight is tied to another parameter (quantizing it would untie them)"
        if lin.weight.device.type == "meta":
            return "weight is on the meta device"
        if not lin.weight.is_floating_point():
            return f"weight dtype {lin.weight.dtype} is not floating point"
        k, n = lin.in_features, lin.out_features
        if self.scheme == "int4" and k % self.group_size:
            return f"in_features={k} is not divisible by group_size={self.group_size}"
        if self.scheme == "nf4" and k % self.block_size:
            return f"in_features={k} is not divisible by block_size={self.block_size}"
        if self.scheme == "fp8" and (k % 16 or n % 16):
            return f"fp8 matmuls need in/out features divisible by 16, got {k}x{n}"
        return None

    def prepare_module(self, model: nn.Module, ctx) -> effpass.PassResult:
        sites = ctx.scope.select_modules(model, lambda n, m: isinstance(m, nn.Linear), what="nn.Linear")
        if self.scheme == "fp8" and not self.fp8_emulate:
            devices = {lin.weight.device for _, lin in sites}
            bad = [d for d in devices if not fp8_supported(d)]
            if bad:
                raise ValueError(
                    f"quantize_linear: scheme='fp8' needs torch._scaled_mm on a CUDA GPU with compute capability "
                    f">= 8.9 (Ada/Hopper), but the linears are on {sorted(map(str, bad))}; choose scheme 'int8', "
                    "'int4' or 'nf4' there (fp8_emulate=True exists for tests only)")
        seen: dict[int, int] = {}
        for _, p in model.named_parameters(remove_duplicate=False):
            seen[id(p)] = seen.get(id(p), 0) + 1
        tied = {i for i, c in seen.items() if c > 1}
        per_linear, skipped = {}, []
        before = after = params = 0
        opts = dict(group_size=self.group_size, block_size=self.block_size, double_quant=self.double_quant,
                    kernel=self.kernel, fp8_granularity=self.fp8_granularity, fp8_emulate=self.fp8_emulate)
        for name, lin in sites:
            problem = self._site_problem(name, lin, tied)
            if problem:
                skipped.append({"site": name, "reason": problem})
                continue
            q = QuantizedLinear.from_linear(lin, scheme=self.scheme, outlier_threshold=self.outlier_threshold, **opts)
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, q)
            b0 = lin.weight.numel() * lin.weight.element_size()
            b1 = q.weight_nbytes()
            dev = lin.weight.device
            per_linear[name] = {
                "scheme": self.scheme, "shape": [lin.out_features, lin.in_features], "bytes_before": b0,
                "bytes_after": b1, "kernel": q.kernel_for(dev, needs_grad=False),
                "kernel_grad": q.kernel_for(dev, needs_grad=True),
                "outlier_columns": int(q.outlier_idx.numel()) if self.scheme != "fp8" else 0}
            before, after, params = before + b0, after + b1, params + lin.weight.numel()
            del lin  # the caller's model no longer references the full-precision weight
        stats = {"scheme": self.scheme, "quantized": len(per_linear), "skipped": len(skipped),
                 "bytes_before": before, "bytes_after": after,
                 "bytes_per_param": round(after / params, 4) if params else 0.0, "linears": per_linear}
        return effpass.PassResult(changed=bool(per_linear), stats=stats, skipped=skipped)
