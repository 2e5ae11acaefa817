"""Quantized MoE expert weights: one 3-D tensor subclass for every expert layout transformers 5 uses.

transformers 5 keeps the experts of an MoE layer as 3-D parameters ``[experts, ...]``, read three ways:

* per expert, as a linear weight: ``F.linear(x, self.gate_up_proj[e])`` (Qwen3-MoE, Mixtral, DeepSeek-V3,
  Qwen2-MoE, OLMoE, Granite-MoE ...; storage ``[experts, out, in]``);
* per expert, transposed: ``x @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]`` (GPT-OSS; storage
  ``[experts, in, out]``; biases are 2-D and stay plain);
* all experts at once: ``torch.bmm(x, self.gate_up_proj)`` (Llama 4; storage ``[experts, in, out]``).

:class:`ExpertsWeightTensor` holds every expert quantized in "linear form" (``[out, in]`` per expert:
rows are output channels, as for ``nn.Linear`` weights, so int8 scales are per output channel and NF4
blocks run along the inputs) and keeps the logical shape and dtype of the parameter it replaces.
Indexing one expert returns an :class:`ExpertWeight` (2-D, logical orientation); ``F.linear`` /
``matmul`` on it and ``bmm`` on the 3-D tensor run an autograd function that dequantizes one expert at a
time in forward and again in backward, saving only the quantized tensor (QLoRA's memory rule: no
dequantized expert outlives its matmul). Any other op sees the dequantized tensor (correct, not lean).

Formats: ``int8`` (torchao's symmetric per-row quantization, the ``Int8Tensor`` data: ``qdata`` int8
``[E, out, in]``, ``scale`` ``[E, out, 1]``) and ``nf4`` (torchao's ``to_nf4`` per expert: QLoRA NF4 with
double quantization, the inner tensors stacked over experts; the 16-value code table shared).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from effpass.quantized import register_quantized_format

from .formats import _compact, _shared_lut, nf4_scaler_block, stable_hash_for_caching  # first: imports torchao quietly
from torchao.quantization.granularity import PerRow  # noqa: E402
from torchao.quantization.quantize_.workflows.int8.int8_tensor import Int8Tensor  # noqa: E402
from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4  # noqa: E402
from torchao.utils import TorchAOBaseTensor  # noqa: E402

__all__ = ["ExpertsWeightTensor", "ExpertWeight", "quantize_experts"]

EXPERT_SCHEMES = ("int8", "nf4")


def _nf4_dequant_flat(qd, qs, qf, mean, code, block_size, scaler_block, dtype):
    """torchao's NF4 arithmetic on one expert's flat inner tensors (pair table, as ``nf4_dequantize``)."""
    b = torch.arange(256, device=code.device)
    pairs = torch.stack([code[b >> 4], code[b & 15]], dim=-1)
    vals = pairs.index_select(0, qd.flatten().int()).view(-1, block_size)
    scalers = (qs.view(-1, scaler_block) / qf.unsqueeze(-1)).flatten().to(code.dtype) + mean
    return (vals * scalers.unsqueeze(-1)).flatten().to(dtype)


class ExpertsWeightTensor(TorchAOBaseTensor):
    """A quantized 3-D expert weight (``scheme`` ``int8`` or ``nf4``) in the logical shape of the parameter
    it replaces. ``transposed``: the logical storage is ``[experts, in, out]`` (GPT-OSS, Llama 4)."""

    tensor_data_names = ["qdata", "scale", "qf", "mean", "code"]
    tensor_attribute_names = ["scheme", "lin_shape", "transposed", "block_size", "scaler_block", "dtype"]

    def __new__(cls, qdata, scale, qf, mean, code, scheme, lin_shape, transposed, block_size, scaler_block, dtype):
        e, o, i = lin_shape
        shape = (e, i, o) if transposed else (e, o, i)
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=qdata.device,
                                                   requires_grad=False)

    def __init__(self, qdata, scale, qf, mean, code, scheme, lin_shape, transposed, block_size, scaler_block,
                 dtype):
        super().__init__()
        self.qdata, self.scale, self.qf, self.mean, self.code = qdata, scale, qf, mean, code
        self.scheme, self.lin_shape, self.transposed = scheme, tuple(lin_shape), bool(transposed)
        self.block_size, self.scaler_block = block_size, scaler_block

    # -- building --------------------------------------------------------------------------------------
    @classmethod
    def from_float(cls, w: torch.Tensor, scheme: str, transposed: bool, block_size: int = 64
                   ) -> "ExpertsWeightTensor":
        if scheme not in EXPERT_SCHEMES:
            raise ValueError(f"expert weights: scheme {scheme!r} has no expert format; valid: {list(EXPERT_SCHEMES)}")
        if w.dim() != 3:
            raise ValueError(f"expert weights must be 3-D [experts, ...], got shape {tuple(w.shape)}")
        lin = w.detach().transpose(1, 2) if transposed else w.detach()
        lin = lin.contiguous()
        e, o, i = lin.shape
        if scheme == "int8":
            t = Int8Tensor.from_hp(lin, PerRow())  # per expert and output row, torchao's arithmetic
            scale = t.scale.reshape(e, o, 1)
            # NOTE: symmetric (torchao's zero point is all zeros; dropped). Not checked on fake tensors.
            one = torch.zeros(0, device=w.device)
            return cls(t.qdata, scale, one, one, one, "int8", (e, o, i), transposed, 0, 0, w.dtype)
        if (o * i) % block_size:
            raise ValueError(f"expert weights: {o}x{i} per expert is not divisible by block_size={block_size}")
        sb = nf4_scaler_block(o * i, block_size)
        parts = [to_nf4(lin[k], block_size, sb) for k in range(e)]
        qd = torch.stack([_compact(p.quantized_data) for p in parts])
        qs = torch.stack([_compact(p.quantized_scalers) for p in parts])
        qf = torch.stack([_compact(p.quantization_factor) for p in parts])
        mean = torch.stack([p.scaler_mean.reshape(()) for p in parts])
        code = _shared_lut(w.device, w.dtype, like=qd)
        return cls(qd, qs, qf, mean, code, "nf4", (e, o, i), transposed, block_size, sb, w.dtype)

    # -- reading ---------------------------------------------------------------------------------------
    def expert_linear_form(self, e, dtype=None) -> torch.Tensor:
        """Expert ``e`` dequantized as ``[out, in]`` (``y = x @ W.T``)."""
        dtype = dtype or self.dtype
        _, o, i = self.lin_shape
        if self.scheme == "int8":
            return (self.qdata[e].to(dtype) * self.scale[e].to(dtype))
        w = _nf4_dequant_flat(self.qdata[e], self.scale[e], self.qf[e], self.mean[e], self.code, self.block_size,
                              self.scaler_block, dtype)
        return w.view(o, i)

    def dequantize(self, dtype=None) -> torch.Tensor:
        """The whole 3-D weight in its logical layout."""
        lin = torch.stack([self.expert_linear_form(e, dtype) for e in range(self.lin_shape[0])])
        return lin.transpose(1, 2).contiguous() if self.transposed else lin

    def expert(self, e) -> "ExpertWeight":
        return ExpertWeight(self, e)

    def __repr__(self):
        return (f"ExpertsWeightTensor(scheme={self.scheme}, shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"transposed={self.transposed})")


class _ExpertLinear(torch.autograd.Function):
    """``F.linear(x, W_e)`` for a quantized expert, ``W_e`` in linear form (``linear_form=True``) or its
    transpose; saves only the quantized 3-D tensor (by reference) and the expert index."""

    @staticmethod
    def forward(ctx, x, experts, e, transpose):
        ctx.experts, ctx.e, ctx.transpose = experts, e, transpose
        w = experts.expert_linear_form(e, x.dtype)
        return F.linear(x, w.t() if transpose else w)

    @staticmethod
    def backward(ctx, g):
        w = ctx.experts.expert_linear_form(ctx.e, g.dtype)
        return g @ (w.t() if ctx.transpose else w), None, None, None


class _ExpertsBmm(torch.autograd.Function):
    """``torch.bmm(x, W)`` over every expert (Llama 4): one expert dequantized at a time."""

    @staticmethod
    def forward(ctx, x, experts):
        ctx.experts = experts
        # logical W[e] = lin.T (transposed) or lin: x[e] @ W[e] = F.linear(x[e], W[e].T)
        return torch.stack([F.linear(x[e], _bmm_weight(experts, e, x.dtype)) for e in range(x.shape[0])])

    @staticmethod
    def backward(ctx, g):
        ex = ctx.experts
        return torch.stack([g[e] @ _bmm_weight(ex, e, g.dtype) for e in range(g.shape[0])]), None


def _bmm_weight(experts, e, dtype):
    """The ``[out, in]`` matrix M with ``x @ W_logical[e] == F.linear(x, M)``."""
    w = experts.expert_linear_form(e, dtype)
    return w if experts.transposed else w.t()


def _scalar_index(idx):
    if isinstance(idx, tuple) and len(idx) == 1:
        idx = idx[0]
    if isinstance(idx, int):
        return idx
    if isinstance(idx, torch.Tensor) and idx.dim() == 0 and not idx.is_floating_point() and idx.dtype != torch.bool:
        return idx
    return None


def _plain(args, kwargs):
    def one(t):
        if isinstance(t, ExpertWeight):
            return t.dequantize()
        if isinstance(t, ExpertsWeightTensor):
            return t.dequantize()
        return t

    return torch.utils._pytree.tree_map(one, (args, kwargs or {}))


# NOTE(compile): the experts loop is data-dependent (which experts are hit) and Dynamo breaks the graph there
# anyway; these overrides run eagerly (a graph break per call under torch.compile), not traced.
@torch._dynamo.disable
def _experts_torch_function(cls, func, types, args=(), kwargs=None):
    kwargs = kwargs or {}
    if func is torch.Tensor.__getitem__ and isinstance(args[0], ExpertsWeightTensor):
        e = _scalar_index(args[1])
        if e is not None:
            return args[0].expert(e)
    if func in (torch.bmm, torch.Tensor.bmm) and len(args) == 2 and isinstance(args[1], ExpertsWeightTensor) \
            and not isinstance(args[0], ExpertsWeightTensor):
        return _ExpertsBmm.apply(args[0], args[1])
    if func in (torch.Tensor.dim, torch.Tensor.size, torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__,
                torch.Tensor.device.__get__, torch.Tensor.requires_grad.__get__):
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    return TorchAOBaseTensor.__torch_function__.__func__(cls, func, types, args, kwargs)


ExpertsWeightTensor.__torch_function__ = classmethod(_experts_torch_function)
ExpertsWeightTensor._stable_hash_for_caching = stable_hash_for_caching


class ExpertWeight(torch.Tensor):
    """One expert of an :class:`ExpertsWeightTensor`, 2-D in the logical orientation (what
    ``experts_weight[e]`` reads). ``F.linear`` and ``@`` on it dequantize inside an autograd function."""

    @staticmethod
    def __new__(cls, experts: ExpertsWeightTensor, e):
        shape = experts.shape[1:]
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=experts.dtype, device=experts.device,
                                                   requires_grad=False)

    def __init__(self, experts, e):
        self.experts, self.e = experts, e

    def dequantize(self, dtype=None) -> torch.Tensor:
        w = self.experts.expert_linear_form(self.e, dtype)
        return w.t() if self.experts.transposed else w

    def __repr__(self):
        return f"ExpertWeight(expert={int(self.e)}, shape={tuple(self.shape)}, scheme={self.experts.scheme})"

    @classmethod
    @torch._dynamo.disable
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and len(args) >= 2 and isinstance(args[1], ExpertWeight) \
                and not isinstance(args[0], ExpertWeight):
            w = args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            # logical W: y = x @ W.T; linear form is W (not transposed) or W.T (transposed)
            y = _ExpertLinear.apply(args[0], w.experts, w.e, w.experts.transposed)
            return y + bias.to(y.dtype) if bias is not None else y
        if func in (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__) and len(args) == 2 \
                and isinstance(args[1], ExpertWeight) and not isinstance(args[0], ExpertWeight):
            w = args[1]
            # y = x @ W: linear form M with y = x @ M.T is W.T, i.e. the stored form when transposed
            return _ExpertLinear.apply(args[0], w.experts, w.e, not w.experts.transposed)
        if func in (torch.Tensor.dim, torch.Tensor.size, torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__,
                    torch.Tensor.device.__get__, torch.Tensor.requires_grad.__get__):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        a, k = _plain(args, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*a, **k)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        a, k = _plain(args, kwargs)
        return func(*a, **k)


ExpertsWeightTensor.__module__ = "effpass.passes.quantize_linear.experts"
ExpertWeight.__module__ = "effpass.passes.quantize_linear.experts"
register_quantized_format(ExpertsWeightTensor, dequantize=lambda t, dtype: t.dequantize(dtype))
register_quantized_format(ExpertWeight, dequantize=lambda t, dtype: t.dequantize(dtype))
torch.serialization.add_safe_globals([ExpertsWeightTensor])


def quantize_experts(w: torch.Tensor, scheme: str, transposed: bool, block_size: int = 64) -> ExpertsWeightTensor:
    return ExpertsWeightTensor.from_float(w, scheme, transposed, block_size)
