"""The quantized weight formats of ``quantize_linear``, as tensor subclasses that sit in ``nn.Linear.weight``.

Where torchao 0.18 has the format, the weight *is* torchao's tensor subclass, with a faster CPU path
added where torchao's is slower here (measured in ``bench/bench_quantize.py``):

* int8: :class:`Int8WeightTensor`, a subclass of torchao's ``Int8Tensor`` (what
  ``quantize_(m, Int8WeightOnlyConfig())`` makes: symmetric, one scale per output row; 2-D for linears,
  3-D ``[experts, out, in]`` for MoE expert weights). ``F.linear`` runs torchao's weight-only path, except
  on CPU with bf16/fp16 activations and no gradient needed, where ``aten._weight_int8pack_mm`` is ~3x
  faster.
* NF4: :class:`NF4WeightTensor`, a subclass of torchao's ``NF4Tensor`` (QLoRA NF4 with double
  quantization; ``to_nf4`` / ``linear_nf4``). ``F.linear`` dequantizes with one table lookup per packed
  byte (~2x faster than torchao's two lookups on CPU), inside an autograd function that saves the NF4
  weight, not the dequantized one, and is differentiable with respect to the input (QLoRA).
* int4 (group-wise asymmetric, own format: torchao's int4 weight-only needs a GPU library):
  :class:`Int4WeightTensor`, built on torchao's ``TorchAOBaseTensor``. ``F.linear``: the Triton kernel of
  ``_quant_kernels`` on CUDA (registered there into :data:`INT4_KERNELS`), else dequantize + linear.

Every subclass keeps the original ``dtype`` and ``shape``, so model code reading ``weight.dtype`` works.
This module never imports ``_quant_kernels`` (the kernels import it): no import circle.
"""
from __future__ import annotations

import math
from typing import Callable


import hashlib


import torch
import torch.nn.functional as F


from effpass.quantized import quiet_torchao_import  # noqa: E402

with quiet_torchao_import():
    from torchao.quantization.granularity import PerRow
    from torchao.quantization.quantize_.workflows.int8.int8_tensor import Int8Tensor
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, SubclassTensorArgs, to_nf4
    from torchao.utils import TorchAOBaseTensor

from effpass.quantized import dequantize as _core_dequantize
from effpass.quantized import register_quantized_format

__all__ = ["NF4_CODE", "nf4_code_from_normal_quantiles", "sqnr", "Int8WeightTensor", "NF4WeightTensor",
           "Int4WeightTensor", "quantize_int4", "dequantize_int4", "to_nf4_weight", "dequantize_weight",
           "INT4_KERNELS", "register_torchao_int4"]

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


def stable_hash_for_caching(t: torch.Tensor) -> str:
    """AOTAutograd's cache key of a quantized weight (``_stable_hash_for_caching``): its class, logical
    shape, dtype and flatten metadata, and each inner tensor's metadata (shape, stride, dtype, device),
    not the values (weights are graph inputs, as for plain parameters)."""
    names, meta = t.__tensor_flatten__()
    parts = [type(t).__module__, type(t).__qualname__, tuple(t.shape), str(t.dtype), t.requires_grad, repr(meta)]
    for n in names:
        inner = getattr(t, n)
        if hasattr(inner, "_stable_hash_for_caching"):
            parts.append((n, inner._stable_hash_for_caching()))
        else:
            parts.append((n, tuple(inner.shape), tuple(inner.stride()), str(inner.dtype), inner.device.type))
    return hashlib.sha256(repr(parts).encode()).hexdigest()


# ------------------------------------------------------------------------------------------------------
# int8: torchao's Int8Tensor, with aten._weight_int8pack_mm for CPU half-precision inference
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


def int8pack_applies(x: torch.Tensor, w: "Int8Tensor") -> bool:
    """Whether ``F.linear(x, w)`` takes ``aten._weight_int8pack_mm``: CPU, bf16/fp16 activations (its fp32
    path is ~4x slower than torchao's), no gradient needed (no autograd formula), a 2-D per-row weight."""
    return (x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16) and w.qdata.dim() == 2
            and w.act_quant_kwargs is None and w.act_pre_scale is None and w.zero_point is None
            and w.block_size[-1] == w.qdata.shape[-1] and w.block_size[0] == 1
            and not (torch.is_grad_enabled() and x.requires_grad))


class Int8WeightTensor(Int8Tensor):
    """torchao's ``Int8Tensor`` (symmetric, per output row) with a faster CPU inference path."""

    @classmethod
    def from_float(cls, w: torch.Tensor) -> "Int8Tensor":
        """2-D: an :class:`Int8WeightTensor`; 3-D (MoE experts, per expert and row): torchao's ``Int8Tensor``
        (its ``select`` / ``index``, which the experts loop uses, build ``Int8Tensor``; the int8pack path is
        2-D only anyway)."""
        t = (cls if w.dim() == 2 else Int8Tensor).from_hp(w.detach(), PerRow())
        # NOTE(memory): symmetric: torchao stores an all-zero int8 zero point per row; drop it (one byte
        # per row, and dequantize_affine treats None as zero).
        if t.zero_point is not None and not bool(t.zero_point.any()):
            t.zero_point = None
        return t


_int8_torchao_linear = Int8Tensor._TORCH_FN_TABLE[Int8Tensor][F.linear]


def _int8_linear(x, w, bias):
    if int8pack_applies(x, w):
        shape = x.shape
        x2d = x.reshape(-1, shape[-1])
        if torch.compiler.is_compiling():
            y = weight_int8pack_mm(x2d, w.qdata, w.scale.reshape(-1))
        else:  # NOTE(speed): eager decode calls this per linear per token: no custom op overhead
            # (no cached cast of the scales: load_state_dict copies into them below autograd, unseen)
            scales = w.scale.reshape(-1).to(x.dtype)
            y = torch.ops.aten._weight_int8pack_mm(x2d.contiguous(), w.qdata, scales)
        y = y.reshape(*shape[:-1], w.shape[0])
        return y + bias.to(y.dtype) if bias is not None else y
    return _int8_torchao_linear(F.linear, (type(w),), (x, w, bias), {})


def _int8_torch_function(cls, func, types, args=(), kwargs=None):
    # NOTE(speed): F.linear is answered before torchao's generic table dispatch (per-call overhead in decode)
    if func is F.linear and len(args) >= 2 and type(args[1]) is Int8WeightTensor:
        kwargs = kwargs or {}
        return _int8_linear(args[0], args[1], args[2] if len(args) > 2 else kwargs.get("bias"))
    return Int8Tensor.__torch_function__.__func__(cls, func, types, args, kwargs)


Int8WeightTensor.__torch_function__ = classmethod(_int8_torch_function)
Int8WeightTensor._stable_hash_for_caching = stable_hash_for_caching


Int8WeightTensor.__module__ = "effpass.passes.quantize_linear.formats"


# ------------------------------------------------------------------------------------------------------
# NF4: torchao's NF4Tensor (double quantization), dequantized with one lookup per packed byte
# ------------------------------------------------------------------------------------------------------
_LUTS: dict = {}


def _shared_lut(device, dtype, like: torch.Tensor | None = None) -> torch.Tensor:
    """One NF4 code table per (device, dtype) shared by every weight (16 values; counted once).

    NOTE(fake tensors): weights quantized under a ``FakeTensorMode`` (the memory planner's replay) share a
    fake table kept on that mode (it dies with it); a real table must never meet fake weights, nor a fake
    one real weights ("got mixed fake and real tensors")."""
    key = (str(device), dtype)
    mode = getattr(like, "fake_mode", None)
    if mode is not None:
        luts = mode.__dict__.setdefault("_effpass_nf4_luts", {})
        if key not in luts:
            with mode:
                luts[key] = torch.tensor(NF4_CODE, device=device, dtype=dtype)
        return luts[key]
    if key not in _LUTS:
        _LUTS[key] = torch.tensor(NF4_CODE, device=device, dtype=dtype)
    return _LUTS[key]


def nf4_dequantize(t: NF4Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The weight of an ``NF4Tensor`` in ``dtype``: torchao's arithmetic (double-quantized scalers in the
    weight's dtype), but one ``index_select`` per packed byte through a 256-entry pair table."""
    code = t.nf4
    # torchao packs element 2i in the high nibble, 2i+1 in the low one
    b = torch.arange(256, device=code.device)
    pairs = torch.stack([code[b >> 4], code[b & 15]], dim=-1)
    vals = pairs.index_select(0, t.quantized_data.flatten().int()).view(t.n_blocks, t.block_size)
    n_sb = t.quantized_scalers.numel() // t.scaler_block_size
    scalers = (t.quantized_scalers.view(n_sb, t.scaler_block_size) / t.quantization_factor.unsqueeze(-1))
    scalers = scalers.flatten().to(t.dtype) + t.scaler_mean
    w = (vals * scalers.unsqueeze(-1)).view(t.shape)
    return w if dtype is None else w.to(dtype)


class _NF4Linear(torch.autograd.Function):
    """``F.linear(x, dequant(W))``; saves the NF4 weight (not its dequantized copy); grad w.r.t. x only."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(weight)
        return F.linear(x, nf4_dequantize(weight, x.dtype))

    @staticmethod
    def backward(ctx, g):
        (weight,) = ctx.saved_tensors
        return g @ nf4_dequantize(weight, g.dtype), None


class NF4WeightTensor(NF4Tensor):
    """torchao's ``NF4Tensor`` whose ``F.linear`` dequantizes with a pair table (faster on CPU)."""

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return NF4WeightTensor(meta["tensor_meta"], meta["block_size"], meta["n_blocks"], meta["scaler_block_size"],
                               inner["quantized_scalers"], inner["quantization_factor"], inner["scaler_mean"],
                               inner["quantized_data"], inner["nf4"])

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is F.linear:
            kwargs = kwargs or {}
            x, w = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            y = _NF4Linear.apply(x, w)
            return y + bias.to(y.dtype) if bias is not None else y
        return _rewrap_nf4(super().__torch_function__(func, types, args, kwargs))

    @classmethod
    @torch._dynamo.disable
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        # NOTE(subclass): torchao's NF4 ops build plain NF4Tensors; keep the subclass (detach, clone, to...).
        if func is torch.ops.aten.clone.default:  # torchao's clone re-quantizes (with its default blocks)
            t = args[0]
            meta = SubclassTensorArgs(t.shape, t.stride(), t.storage_offset(), t.dtype, t.device, t.requires_grad)
            return NF4WeightTensor(meta, t.block_size, t.n_blocks, t.scaler_block_size, t.quantized_scalers.clone(),
                                   t.quantization_factor.clone(), t.scaler_mean.clone(), t.quantized_data.clone(),
                                   t.nf4.clone())
        return _rewrap_nf4(super().__torch_dispatch__(func, types, args, kwargs))

    def dequantize_to(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return nf4_dequantize(self, dtype)

    def _stable_hash_for_caching(self) -> str:
        return stable_hash_for_caching(self)

    @classmethod
    def from_nf4(cls, t: NF4Tensor) -> "NF4WeightTensor":
        meta = SubclassTensorArgs(t.shape, t.stride(), t.storage_offset(), t.dtype, t.device, False)
        return cls(meta, t.block_size, t.n_blocks, t.scaler_block_size, _compact(t.quantized_scalers),
                   _compact(t.quantization_factor), _compact(t.scaler_mean), _compact(t.quantized_data),
                   _shared_lut(t.device, t.dtype, like=t.quantized_data))


NF4WeightTensor.__module__ = "effpass.passes.quantize_linear.formats"


def _compact(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy of it when it is a view that keeps a larger storage alive (torchao's NF4
    ``quantization_factor`` of small layers is a slice: storage-true bytes count the whole storage)."""
    try:
        if t.untyped_storage().nbytes() > t.numel() * t.element_size():
            return t.clone()
    except Exception:  # noqa: BLE001 - tensors without storage (rare): keep
        pass
    return t


def _rewrap_nf4(out):
    def one(t):
        if type(t) is NF4Tensor:
            meta = SubclassTensorArgs(t.shape, t.stride(), t.storage_offset(), t.dtype, t.device, t.requires_grad)
            return NF4WeightTensor(meta, t.block_size, t.n_blocks, t.scaler_block_size, t.quantized_scalers,
                                   t.quantization_factor, t.scaler_mean, t.quantized_data, t.nf4)
        return t

    return torch.utils._pytree.tree_map(one, out)


def nf4_scaler_block(numel: int, block_size: int, preferred: int = 256) -> int:
    """The double-quantization block: QLoRA's 256 constants, or the largest power of two dividing the
    number of constants when 256 does not (torchao requires it to divide them)."""
    return math.gcd(numel // block_size, preferred)


def to_nf4_weight(w: torch.Tensor, block_size: int = 64, fast: bool = True) -> NF4Tensor:
    """torchao's ``to_nf4`` (double quantization) on a 2-D weight; :class:`NF4WeightTensor` when ``fast``."""
    w = w.detach().contiguous()
    with _one_chunk_if_fake(w):
        t = to_nf4(w, block_size, nf4_scaler_block(w.numel(), block_size))
    return NF4WeightTensor.from_nf4(t) if fast else t


class _one_chunk_if_fake:
    """NOTE(planner speed): torchao quantizes to NF4 in chunks of 2^20 elements to bound the memory of its
    intermediates: 56 rounds of ops for one Llama-3-8B MLP weight. A fake or meta weight (the memory
    planner's replay) holds no memory, so it is quantized in one chunk: the same values and bytes (each
    element's code is its nearest NF4 value, chunked or not), a fraction of the ops to dispatch."""

    def __init__(self, w: torch.Tensor):
        from torch._subclasses.fake_tensor import FakeTensor

        self.mod = None
        if isinstance(w, FakeTensor) or w.device.type == "meta":
            import sys

            self.mod = sys.modules.get(to_nf4.__module__)
            if not isinstance(getattr(self.mod, "CHUNK_SIZE", None), int):  # feature-tested: left as it is
                self.mod = None
        self.n = w.numel()

    def __enter__(self):
        if self.mod is not None:
            self.saved = self.mod.CHUNK_SIZE
            self.mod.CHUNK_SIZE = max(self.saved, self.n)

    def __exit__(self, *exc):
        if self.mod is not None:
            self.mod.CHUNK_SIZE = self.saved
        return False


# ------------------------------------------------------------------------------------------------------
# int4 (own format): group-wise asymmetric, two values per byte
# ------------------------------------------------------------------------------------------------------
def _pack4(q: torch.Tensor) -> torch.Tensor:
    """[N, K] values 0..15 -> [N, K/2] uint8; element 2j in the low nibble, 2j+1 in the high one."""
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def _unpack4(p: torch.Tensor) -> torch.Tensor:
    return torch.stack([p & 15, p >> 4], dim=-1).flatten(-2)


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed uint8 [N, K/2], scale fp32 [N, K/g], zero point uint8 [N, K/g]); ``w ~= (q - zero) * scale``."""
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


#: int4 matmul kernels by name (``_quant_kernels`` registers ``"triton"`` when imported).
INT4_KERNELS: dict[str, Callable] = {}


class Int4WeightTensor(TorchAOBaseTensor):
    """A group-wise asymmetric int4 weight ``[N, K]`` (``qdata`` uint8 [N, K/2], ``scale`` fp32 [N, K/g],
    ``zero`` uint8 [N, K/g]). ``kernel``: ``"auto"`` (Triton on CUDA when registered, else dequantize +
    linear), ``"triton"`` or ``"reference"``."""

    tensor_data_names = ["qdata", "scale", "zero"]
    tensor_attribute_names = ["group_size", "dtype", "kernel"]

    def __new__(cls, qdata, scale, zero, group_size, dtype, kernel="auto"):
        shape = (qdata.shape[0], qdata.shape[1] * 2)
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=qdata.device, requires_grad=False)

    def __init__(self, qdata, scale, zero, group_size, dtype, kernel="auto"):
        super().__init__()
        self.qdata, self.scale, self.zero = qdata, scale, zero
        self.group_size, self.kernel = group_size, kernel

    @classmethod
    def from_float(cls, w: torch.Tensor, group_size: int, kernel: str = "auto") -> "Int4WeightTensor":
        q, s, z = quantize_int4(w.detach(), group_size)
        return cls(q, s, z, group_size, w.dtype, kernel)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize_int4(self.qdata, self.scale, self.zero, self.group_size, dtype or self.dtype)

    def kernel_for(self, device: torch.device) -> str:
        if self.kernel == "triton" or (self.kernel == "auto" and device.type == "cuda" and "triton" in INT4_KERNELS):
            return "triton_int4_mm"
        return "dequantize+linear"


def _int4_torch_function(cls, func, types, args=(), kwargs=None):
    # NOTE(speed): F.linear is answered before torchao's generic table dispatch
    if func is F.linear and len(args) >= 2 and type(args[1]) is Int4WeightTensor:
        kwargs = kwargs or {}
        return _int4_linear(args[0], args[1], args[2] if len(args) > 2 else kwargs.get("bias"))
    return TorchAOBaseTensor.__torch_function__.__func__(cls, func, types, args, kwargs)


def _int4_linear(x, w, bias):
    if w.kernel_for(x.device) == "triton_int4_mm":
        shape = x.shape
        y = INT4_KERNELS["triton"](x.reshape(-1, shape[-1]), w.qdata, w.scale, w.zero, w.group_size)
        y = y.reshape(*shape[:-1], w.shape[0])
        return y + bias.to(y.dtype) if bias is not None else y
    return F.linear(x, w.dequantize(x.dtype), bias.to(x.dtype) if bias is not None else None)


Int4WeightTensor.__torch_function__ = classmethod(_int4_torch_function)
Int4WeightTensor._stable_hash_for_caching = stable_hash_for_caching
Int4WeightTensor.__module__ = "effpass.passes.quantize_linear.formats"
torch.serialization.add_safe_globals([Int8WeightTensor, NF4WeightTensor, NF4Tensor, SubclassTensorArgs,
                                      Int4WeightTensor])


# ------------------------------------------------------------------------------------------------------
# helpers over every format; registration with the core contract (effpass.quantized)
# ------------------------------------------------------------------------------------------------------
def dequantize_weight(w: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The high-precision weight a quantized (or plain) tensor stands for (the core contract's dispatch)."""
    return _core_dequantize(w, dtype)


def _deq_nf4_fast(t, dtype):
    return nf4_dequantize(t, dtype or t.dtype)


def _deq_nf4_torchao(t, dtype):
    return t.get_original_weight().to(dtype or t.dtype)


def _deq_int8(t, dtype):
    return t.dequantize(dtype or t.dtype)


def _deq_int4(t, dtype):
    return t.dequantize(dtype or t.dtype)


# NOTE(contract): every format this pass can put into a model is registered, torchao's plain classes
# included (kernel="torchao" and 3-D expert weights make them); subclasses registered on their own win.
register_quantized_format(Int8Tensor, dequantize=_deq_int8)
register_quantized_format(Int8WeightTensor, dequantize=_deq_int8)
register_quantized_format(NF4Tensor, dequantize=_deq_nf4_torchao)
register_quantized_format(NF4WeightTensor, dequantize=_deq_nf4_fast)
register_quantized_format(Int4WeightTensor, dequantize=_deq_int4)


def _deq_torchao_int4(t, dtype):
    """torchao's tile-packed int4 has no ``dequantize``: its own matmul of the identity gives W^T exactly (each
    output element is one dequantized weight times 1)."""
    eye = torch.eye(t.shape[1], dtype=t.dtype, device=t.device)
    return torch.nn.functional.linear(eye, t).t().contiguous().to(dtype or t.dtype)


def register_torchao_int4() -> None:
    """Register torchao's ``Int4TilePackedTo4dTensor`` (made only by ``kernel="torchao"``; imported on first use)."""
    from torchao.quantization.quantize_.workflows.int4.int4_tile_packed_to_4d_tensor import Int4TilePackedTo4dTensor

    register_quantized_format(Int4TilePackedTo4dTensor, dequantize=_deq_torchao_int4)
