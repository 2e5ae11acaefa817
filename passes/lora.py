"""LoRA adapter modules and the helpers around them: inject, save/load in PEFT's format, merge/unmerge.

Used by the ``inject_lora`` pass (``passes/inject_lora.py``) and usable on its own::

    from effpass.passes import lora
    lora.save(model, "adapter/")            # adapter_config.json + adapter_model.safetensors (PEFT's format)
    lora.load(model, "adapter/")            # injects adapters described by the config and loads the weights
    lora.merge(model); lora.unmerge(model)  # fold adapters into the base weights for inference, and back

A :class:`LoRALinear` keeps the wrapped module as its child ``base_layer`` (as PEFT does) and adds two
``nn.Linear`` children ``lora_A`` (in -> r) and ``lora_B`` (r -> out), so parameter names map onto PEFT's:
``model.layers.0.self_attn.q_proj.lora_A.weight`` is PEFT's
``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` in a saved adapter.

Invariant (reference semantics): ``LoRALinear(x) == base(x) + scaling * lora_B(lora_A(dropout(x)))``,
computed in the adapter dtype and cast back to the base output dtype, exactly as PEFT's LoRA layer.
"""
from __future__ import annotations

import json
import math
import os
import re
from collections import Counter
from typing import Any, Iterable

import torch
import torch.nn as nn

from effpass.scope import skip

__all__ = ["LoRALinear", "ExpertLoRA", "is_linear_like", "linear_shape", "lora_modules", "expert_lora_modules",
           "inject", "inject_experts", "expert_parameters", "expert_layout", "freeze_base",
           "parameter_stats", "save", "load", "merge", "unmerge", "ADAPTER_CONFIG", "ADAPTER_WEIGHTS"]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."


def _conv1d_class():
    try:
        from transformers.pytorch_utils import Conv1D
    except Exception:  # pragma: no cover - transformers is optional
        return None
    return Conv1D


def is_linear_like(module: nn.Module) -> bool:
    """``nn.Linear``, GPT-2's ``Conv1D`` (weight ``[in, out]``), or a module that declares itself a linear
    (``__effpass_linear__ = True`` with int ``in_features``/``out_features``: quantized linears)."""
    if isinstance(module, LoRALinear):
        return False
    if isinstance(module, nn.Linear):
        return True
    conv1d = _conv1d_class()
    if conv1d is not None and isinstance(module, conv1d):
        return True
    return bool(getattr(module, "__effpass_linear__", False)) and isinstance(
        getattr(module, "in_features", None), int) and isinstance(getattr(module, "out_features", None), int)


def linear_shape(module: nn.Module) -> tuple[int, int, bool]:
    """(in_features, out_features, fan_in_fan_out) of a linear-like module."""
    conv1d = _conv1d_class()
    if conv1d is not None and isinstance(module, conv1d):
        return module.weight.shape[0], module.weight.shape[1], True
    return int(module.in_features), int(module.out_features), False


def _base_float_param(module: nn.Module) -> torch.Tensor | None:
    w = getattr(module, "weight", None)
    if isinstance(w, torch.Tensor) and w.is_floating_point():
        return w
    for p in module.parameters():
        if p.is_floating_point():
            return p
    for b in module.buffers():
        if b.is_floating_point():
            return b
    return None


@skip("quantize_linear")
class AdapterLinear(nn.Linear):
    """``lora_A`` / ``lora_B``: a plain ``nn.Linear`` that quantize_linear leaves alone.

    NOTE(ordering): adapters are trainable full-precision linears; a later quantize_linear run (e.g. the
    same pipeline applied again to a prepared model) must not quantize them.
    """


class LoRALinear(nn.Module):
    """A linear-like module plus a low-rank update: ``base(x) + scaling * B(A(dropout(x)))``.

    ``lora_B`` starts at zero (the LoRA paper), so a fresh adapter leaves the function unchanged.
    """

    def __init__(self, base: nn.Module, rank: int, alpha: float, dropout: float = 0.0, *,
                 use_rslora: bool = False, init: str = "kaiming", dtype: torch.dtype | None = None):
        super().__init__()
        in_f, out_f, fan_in_fan_out = linear_shape(base)
        ref = _base_float_param(base)
        device = ref.device if ref is not None else torch.device("cpu")
        if dtype is None:
            # NOTE(parity): PEFT's default autocast_adapter_dtype keeps half-precision bases' adapters in fp32.
            dtype = ref.dtype if ref is not None and ref.dtype not in (torch.float16, torch.bfloat16) else torch.float32
        self.base_layer = base
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.lora_A = AdapterLinear(in_f, rank, bias=False, device=device, dtype=dtype)
        self.lora_B = AdapterLinear(rank, out_f, bias=False, device=device, dtype=dtype)
        self.in_features, self.out_features = in_f, out_f
        self.rank, self.alpha, self.dropout_p = rank, float(alpha), float(dropout)
        self.use_rslora = use_rslora
        self.fan_in_fan_out = fan_in_fan_out
        self.scaling = alpha / math.sqrt(rank) if use_rslora else alpha / rank
        self.merged = False
        self.reset_lora_parameters(init)


    # NOTE(compat): model code that reads the wrapped linear's weight (T5: ``self.wo.weight.dtype``) keeps
    # working, as with PEFT's tuner layers.
    @property
    def weight(self) -> torch.Tensor:
        return self.base_layer.weight

    @property
    def bias(self):
        return getattr(self.base_layer, "bias", None)

    def reset_lora_parameters(self, init: str = "kaiming") -> None:
        with torch.no_grad():
            if init == "kaiming":
                nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # as PEFT (and nn.Linear)
            elif init == "gaussian":
                nn.init.normal_(self.lora_A.weight, std=1 / self.rank)
            else:
                raise ValueError(f"init {init!r} is not valid; choose one of ['kaiming', 'gaussian']")
            nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base_layer(x)
        if self.merged:
            return result
        x = x.to(self.lora_A.weight.dtype)
        # NOTE(audit): ``type_as(result)``, not ``.to(result.dtype)``: Dynamo bakes ``result.dtype`` into
        # the graph as the dtype seen while tracing (fp32), so once apply_autocast wraps the graph the
        # adapter output was cast back to fp32 where eager torch.autocast keeps bf16 (~1% gradient
        # difference). ``type_as`` stays a graph op that follows the dtype at run time.
        return result + (self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling).type_as(result)

    # -- merging -------------------------------------------------------------------------------------
    def delta_weight(self) -> torch.Tensor:
        """``scaling * B @ A`` in the base weight's layout (``[in, out]`` for Conv1D)."""
        delta = (self.lora_B.weight.float() @ self.lora_A.weight.float()) * self.scaling
        return delta.T if self.fan_in_fan_out else delta

    def _base_weight(self) -> torch.Tensor:
        w = getattr(self.base_layer, "weight", None)
        if getattr(self.base_layer, "__effpass_linear__", False) or not isinstance(w, torch.Tensor) \
                or not w.is_floating_point():
            raise ValueError(f"cannot merge a LoRA adapter into a {type(self.base_layer).__name__} base "
                             "(quantized or non-float weight); merge works on nn.Linear and Conv1D bases")
        return w

    def merge(self) -> None:
        if self.merged:
            return
        w = self._base_weight()
        with torch.no_grad():
            w.copy_((w.float() + self.delta_weight()).to(w.dtype))
        self.merged = True

    def unmerge(self) -> None:
        if not self.merged:
            return
        w = self._base_weight()
        with torch.no_grad():
            w.copy_((w.float() - self.delta_weight()).to(w.dtype))
        self.merged = False

    # -- loading a plain state dict (keys without ``base_layer.``) ------------------------------------
    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        for name, _ in self.base_layer.named_parameters(recurse=False):
            old, new = prefix + name, prefix + "base_layer." + name
            if old in state_dict and new not in state_dict:
                state_dict[new] = state_dict.pop(old)
        for name, _ in self.base_layer.named_buffers(recurse=False):
            old, new = prefix + name, prefix + "base_layer." + name
            if old in state_dict and new not in state_dict:
                state_dict[new] = state_dict.pop(old)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, rank={self.rank}, alpha={self.alpha}, "
                f"dropout={self.dropout_p}, scaling={self.scaling:.4g}{', merged' if self.merged else ''}")


# ------------------------------------------------------------------------------------------------------
# injection and freezing
# ------------------------------------------------------------------------------------------------------
def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """Every :class:`LoRALinear` in ``model`` by its fully qualified name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def inject(model: nn.Module, names: Iterable[str], *, rank: int, alpha: float, dropout: float = 0.0,
           use_rslora: bool = False, init: str = "kaiming", dtype: torch.dtype | None = None,
           rank_of=None, alpha_of=None) -> list[str]:
    """Wrap the linear-like modules ``names`` of ``model`` in :class:`LoRALinear` (in place).

    ``rank_of(name)`` / ``alpha_of(name)`` may override the rank/alpha per module (PEFT's patterns).
    Returns the names wrapped; modules already wrapped are left alone.
    """
    done = []
    for name in names:
        mod = model.get_submodule(name)
        if isinstance(mod, LoRALinear):
            continue
        if not is_linear_like(mod):
            raise TypeError(f"module {name!r} is a {type(mod).__name__}, not a linear-like module")
        r = rank_of(name) if rank_of else rank
        a = alpha_of(name) if alpha_of else alpha
        model.set_submodule(name, LoRALinear(mod, r, a, dropout, use_rslora=use_rslora, init=init, dtype=dtype))
        done.append(name)
    return done


def freeze_base(model: nn.Module, trainable_adapters: bool = True) -> None:
    """Freeze every parameter except the adapters (whose ``requires_grad`` is ``trainable_adapters``)."""
    adapter = {id(p) for m in lora_modules(model).values() for p in (m.lora_A.weight, m.lora_B.weight)}
    adapter |= {id(p) for m in expert_lora_modules(model).values() for p in (m.lora_A, m.lora_B)}
    for p in model.parameters():
        p.requires_grad_(trainable_adapters if id(p) in adapter else False)


def parameter_stats(model: nn.Module) -> dict[str, int]:
    """Trainable and frozen parameter counts and bytes (shared parameters counted once)."""
    seen: set[int] = set()
    out = {"trainable_params": 0, "frozen_params": 0, "trainable_bytes": 0, "frozen_bytes": 0}
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        kind = "trainable" if p.requires_grad else "frozen"
        out[f"{kind}_params"] += p.numel()
        out[f"{kind}_bytes"] += p.numel() * p.element_size()
    return out


# ------------------------------------------------------------------------------------------------------
# MoE experts: LoRA on 3-D expert parameters (PEFT's ``target_parameters``), never materialising a delta
# ------------------------------------------------------------------------------------------------------
#: layouts effpass computes expert adapters for (see :func:`expert_layout`)
EXPERT_LAYOUTS = {
    "routed": "transformers' use_experts_implementation contract: forward(hidden (T, H), top_k_index (T, k), "
              "top_k_weights (T, k)) with flags has_gate / has_bias / is_transposed (Qwen3-MoE, Mixtral, "
              "GPT-OSS, Qwen2-MoE, DeepSeek-V3, OLMoE, ...; a self-written module that declares the flags)",
    "dense": "Llama 4's Llama4TextExperts: every expert on every (pre-weighted) token, batched with bmm",
}


def expert_layout(module: nn.Module) -> str | None:
    """The expert layout of ``module`` (a key of :data:`EXPERT_LAYOUTS`) or None when unsupported."""
    if type(module).__name__ == "Llama4TextExperts" or getattr(module, "__effpass_experts__", None) == "dense":
        return "dense"
    flags = ("has_gate", "has_bias", "is_transposed")
    if all(isinstance(getattr(module, f, None), bool) for f in flags) and isinstance(
            getattr(module, "num_experts", None), int) and not getattr(module, "_is_expert_parallel", False):
        return "routed"
    return None


def expert_parameters(model: nn.Module) -> dict[str, tuple[nn.Module, str, nn.Module]]:
    """Every 3-D floating parameter of an experts module: full name -> (experts module, attribute, owner name).

    An experts module is one whose class name ends in ``Experts`` or that has an int ``num_experts``."""
    out = {}
    for mn, m in model.named_modules():
        if isinstance(m, ExpertLoRA) or ".lora_experts" in mn:
            continue
        if not (type(m).__name__.endswith("Experts") or isinstance(getattr(m, "num_experts", None), int)):
            continue
        for pn, p in m.named_parameters(recurse=False):
            if p.dim() == 3:
                out[f"{mn}.{pn}" if mn else pn] = (m, pn, mn)
    return out


def _expert_param_roles(module: nn.Module, layout: str) -> dict[str, str]:
    """attribute -> how the forward multiplies it: ``"xWt"`` (``x @ W_e.T``, W_e (out, in)) or ``"xW"``."""
    if layout == "dense":
        return {"gate_up_proj": "xW", "down_proj": "xW"}
    use = "xW" if module.is_transposed else "xWt"
    return {("gate_up_proj" if module.has_gate else "up_proj"): use, "down_proj": use}


@skip("quantize_linear")
class ExpertLoRA(nn.Module):
    """One adapter per expert on a 3-D expert parameter ``W`` (E, d1, d2), as PEFT's ``ParamWrapper``.

    ``lora_A`` (E, r, a) and ``lora_B`` (E, b, r) are PEFT's per-expert ``A_e`` / ``B_e`` (PEFT stores them
    flattened: ``lora_A.weight`` (E*r, a) and ``lora_B.weight`` (b, r*E), expert index fastest in B's
    columns). PEFT's delta is ``scaling * B_e @ A_e`` in ``W``'s (d1, d2) layout, transposed when the
    experts module says ``is_transposed``. Here the delta is never formed: the forward multiplies the routed
    rows ``x`` of expert e by the two factors, ``x @ F1_e @ F2_e * scaling``, with ``(F1, F2) = (A^T, B^T)``
    when the forward computes ``x @ W_e^T`` on a non-transposed weight or ``x @ W_e`` on a transposed one,
    and ``(B, A)`` when it computes ``x @ W_e`` but the module does not declare ``is_transposed`` (Llama 4:
    PEFT reads its (E, in, out) weight as (E, out, in)).
    """

    def __init__(self, weight: torch.Tensor, use: str, peft_transposed: bool, rank: int, alpha: float, *,
                 use_rslora: bool = False, init: str = "kaiming", dtype: torch.dtype | None = None):
        super().__init__()
        n_exp, d1, d2 = weight.shape
        if dtype is None:
            dtype = weight.dtype if weight.dtype not in (torch.float16, torch.bfloat16) else torch.float32
        if not dtype.is_floating_point:
            dtype = torch.float32
        # PEFT: (experts, in, out) when transposed, else (experts, out, in)
        a_in, b_out = (d1, d2) if peft_transposed else (d2, d1)
        self.lora_A = nn.Parameter(torch.empty(n_exp, rank, a_in, device=weight.device, dtype=dtype))
        self.lora_B = nn.Parameter(torch.zeros(n_exp, b_out, rank, device=weight.device, dtype=dtype))
        self.n_experts, self.rank, self.alpha = n_exp, rank, float(alpha)
        self.use_rslora, self.dropout_p = use_rslora, 0.0
        self.scaling = alpha / math.sqrt(rank) if use_rslora else alpha / rank
        # x @ delta (use xW) or x @ delta^T (use xWt), with delta = B A (or (B A)^T when peft_transposed)
        self.a_first = (use == "xW") == peft_transposed
        self.use, self.peft_transposed = use, peft_transposed
        self.merged = False
        self.reset_lora_parameters(init)

    def reset_lora_parameters(self, init: str = "kaiming") -> None:
        with torch.no_grad():
            if init == "kaiming":  # PEFT's nn.Linear(a, r*E) kaiming_uniform(a=sqrt(5)): U(-1/sqrt(a), 1/sqrt(a))
                bound = 1.0 / math.sqrt(self.lora_A.shape[-1])
                self.lora_A.uniform_(-bound, bound)
            elif init == "gaussian":
                nn.init.normal_(self.lora_A, std=1 / self.rank)
            else:
                raise ValueError(f"init {init!r} is not valid; choose one of ['kaiming', 'gaussian']")
            self.lora_B.zero_()

    def factors(self) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """(F1, F2, transposed): the term is ``x @ F1_e @ F2_e`` with F1/F2 given as stored (E, ., .) and
        ``transposed`` saying both are used transposed (``x @ A_e^T @ B_e^T``)."""
        return (self.lora_A, self.lora_B, True) if self.a_first else (self.lora_B, self.lora_A, False)

    def delta(self, e: int) -> torch.Tensor:
        """Expert e's delta in the weight's (d1, d2) layout (merging only)."""
        d = (self.lora_B[e].float() @ self.lora_A[e].float()) * self.scaling
        return d.T if self.peft_transposed else d

    # PEFT's flattened layout
    def peft_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        n, r = self.n_experts, self.rank
        a = self.lora_A.detach().reshape(n * r, -1)
        b = self.lora_B.detach().permute(1, 2, 0).reshape(self.lora_B.shape[1], r * n)
        return a.contiguous(), b.contiguous()

    def load_peft_tensors(self, a: torch.Tensor, b: torch.Tensor) -> None:
        n, r = self.n_experts, self.rank
        with torch.no_grad():
            self.lora_A.copy_(a.reshape(n, r, -1).to(self.lora_A.dtype))
            self.lora_B.copy_(b.reshape(b.shape[0], r, n).permute(2, 0, 1).to(self.lora_B.dtype))

    def extra_repr(self) -> str:
        return (f"experts={self.n_experts}, A={tuple(self.lora_A.shape)}, B={tuple(self.lora_B.shape)}, "
                f"rank={self.rank}, alpha={self.alpha}, scaling={self.scaling:.4g}{', merged' if self.merged else ''}")


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


def _float_weight(module: nn.Module, name: str) -> torch.Tensor:
    """The expert weight as a float tensor: plain weights as they are, quantized ones (quantize_linear's
    int8 experts) dequantized for the base matmul (QLoRA: the adapters stay in full precision)."""
    w = getattr(module, name)
    if type(w) is nn.Parameter or type(w) is torch.Tensor:  # NOTE(compile): is_quantized breaks Dynamo's graph
        return w
    return w.dequantize()  # torchao's Int8Tensor / NF4Tensor; checked at injection (_check_dequantizable)


def _check_dequantizable(full: str, mod: nn.Module, attr: str) -> None:
    w = getattr(mod, attr)
    if type(w) is nn.Parameter or type(w) is torch.Tensor:
        return
    if not callable(getattr(w, "dequantize", None)):
        raise _unsupported(full, mod, f"its weight is a {type(w).__name__} without a dequantize() method")


def _routed_lora_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                         top_k_weights: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """transformers' grouped experts forward plus ``scaling * x @ F1_e @ F2_e`` on each adapted projection."""
    num_top_k = top_k_index.size(-1)
    num_tokens, hidden_dim = hidden_states.shape[0], hidden_states.shape[-1]
    n_exp = self.num_experts
    expert_ids = top_k_index.reshape(-1)
    sample_weights = top_k_weights.reshape(-1)
    ids_sorted, perm = torch.sort(expert_ids, stable=True)
    x = hidden_states[perm // num_top_k]
    counts = torch.zeros(n_exp, dtype=torch.long, device=x.device).scatter_add_(
        0, ids_sorted, torch.ones_like(ids_sorted))
    offs = torch.cumsum(counts, 0)
    adapters = self.lora_experts
    first = "gate_up_proj" if self.has_gate else "up_proj"

    def project(inp, name):
        use_t = not self.is_transposed
        out = expert_mm(inp, _float_weight(self, name), offs, use_t)
        if self.has_bias:
            out = out + getattr(self, f"{name}_bias")[ids_sorted]
        ad = adapters[name] if name in adapters else None
        if ad is not None and not ad.merged:
            f1, f2, tr = ad.factors()
            xa = inp.to(f1.dtype)
            term = expert_mm(expert_mm(xa, f1, offs, tr), f2, offs, tr) * ad.scaling
            out = out + term.type_as(out)
        return out

    h = project(x, first)
    h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
    h = project(h, "down_proj")
    if getattr(self, "has_post_expert_norm", False):
        h = self.post_expert_norm(h)
    h = h * sample_weights[perm].unsqueeze(-1)
    inv_perm = torch.empty_like(perm)
    inv_perm[perm] = torch.arange(perm.size(0), device=perm.device)
    out = h[inv_perm].view(num_tokens, num_top_k, hidden_dim).sum(dim=1)
    return out.to(hidden_states.dtype)


def _dense_lora_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """Llama 4's experts forward (every expert on its slice of rows, bmm) plus the adapter terms."""
    adapters = self.lora_experts
    hidden_size = self.gate_up_proj.shape[1]
    x = hidden_states.view(self.gate_up_proj.shape[0], -1, hidden_size)

    def project(inp, name):
        out = torch.bmm(inp, _float_weight(self, name))
        ad = adapters[name] if name in adapters else None
        if ad is not None and not ad.merged:
            f1, f2, tr = ad.factors()
            if tr:
                f1, f2 = f1.transpose(1, 2), f2.transpose(1, 2)
            out = out + (torch.bmm(torch.bmm(inp.to(f1.dtype), f1), f2) * ad.scaling).type_as(out)
        return out

    gate, up = project(x, "gate_up_proj").chunk(2, dim=-1)
    out = project(up * self.act_fn(gate), "down_proj")
    return out.view(-1, out.shape[-1])


_LORA_EXPERT_CLASSES: dict[tuple[type, str], type] = {}


def _lora_experts_class(cls: type, layout: str) -> type:
    key = (cls, layout)
    if key not in _LORA_EXPERT_CLASSES:
        fwd = _routed_lora_forward if layout == "routed" else _dense_lora_forward
        _LORA_EXPERT_CLASSES[key] = type(f"LoRA{cls.__name__}", (cls,), {
            "forward": fwd, "__effpass_lora_experts__": layout, "__module__": __name__,
            "__doc__": f"{cls.__name__} with effpass expert LoRA adapters in ``lora_experts`` ({layout} layout)."})
    return _LORA_EXPERT_CLASSES[key]


def expert_lora_modules(model: nn.Module) -> dict[str, ExpertLoRA]:
    """Every expert adapter by the full name of the parameter it adapts (``...experts.gate_up_proj``)."""
    out = {}
    for mn, m in model.named_modules():
        ad = getattr(m, "lora_experts", None)
        if getattr(type(m), "__effpass_lora_experts__", None) and isinstance(ad, nn.ModuleDict):
            for pn, a in ad.items():
                out[f"{mn}.{pn}" if mn else pn] = a
    return out


def _unsupported(full: str, module: nn.Module, why: str) -> ValueError:
    supported = "; ".join(f"{k}: {v}" for k, v in EXPERT_LAYOUTS.items())
    return ValueError(f"inject_lora: cannot put LoRA on expert parameter {full!r} of {type(module).__name__} "
                      f"({why}). Supported expert layouts: {supported}")


def inject_experts(model: nn.Module, names: Iterable[str], *, rank: int, alpha: float, dropout: float = 0.0,
                   use_rslora: bool = False, init: str = "kaiming", dtype: torch.dtype | None = None,
                   rank_of=None, alpha_of=None) -> list[str]:
    """Put one LoRA adapter per expert on the 3-D expert parameters ``names`` (full names, in place).

    The experts module's class is swapped for a subclass whose forward adds ``x @ F1_e @ F2_e`` for the
    routed rows of each expert (no delta weight). Raises on unsupported layouts, dropout, too large a rank.
    """
    params = expert_parameters(model)
    done = []
    for full in names:
        if full not in params:
            raise ValueError(f"inject_lora: {full!r} is not a 3-D expert parameter; expert parameters here: "
                             f"{sorted(params)[:6]}")
        mod, attr, _ = params[full]
        layout = getattr(type(mod), "__effpass_lora_experts__", None) or expert_layout(mod)
        if layout is None:
            why = ("expert parallel sharding" if getattr(mod, "_is_expert_parallel", False) else
                   "its forward is not one effpass knows how to add adapter terms to")
            raise _unsupported(full, mod, f"layout unknown: {why}")
        roles = _expert_param_roles(mod, layout)
        if attr not in roles:
            raise _unsupported(full, mod, f"layout {layout!r} has expert projections {sorted(roles)}, not {attr!r}")
        if dropout > 0:
            raise ValueError(
                f"inject_lora: dropout={dropout} on expert parameter {full!r} ({type(mod).__name__}, {layout} layout): "
                "PEFT's target_parameters LoRA defines expert adapters without dropout (it adds B@A to the "
                "weight), so an adapter trained with dropout would have no PEFT equivalent; use dropout=0, or "
                "exclude the expert parameters from targets and keep dropout on the linears")
        for other in roles:
            _check_dequantizable(f"{full.rpartition('.')[0]}.{other}", mod, other)
        w = getattr(mod, attr)
        r = rank_of(full) if rank_of else rank
        a = alpha_of(full) if alpha_of else alpha
        _, d1, d2 = w.shape
        if r > min(d1, d2):
            raise ValueError(f"inject_lora: rank {r} on expert parameter {full!r} ({type(mod).__name__}, shape "
                             f"{tuple(w.shape)}, {layout} layout) is larger than the expert's dimensions "
                             f"({d1}, {d2}); use a rank <= {min(d1, d2)}")
        if layout == "routed" and not isinstance(getattr(mod, "lora_experts", None), nn.ModuleDict):
            pass
        if not isinstance(getattr(mod, "lora_experts", None), nn.ModuleDict):
            mod.lora_experts = nn.ModuleDict()
        if attr in mod.lora_experts:
            continue
        mod.lora_experts[attr] = ExpertLoRA(w, roles[attr], bool(getattr(mod, "is_transposed", False)), r, a,
                                            use_rslora=use_rslora, init=init, dtype=dtype)
        if not getattr(type(mod), "__effpass_lora_experts__", None):
            mod.__class__ = _lora_experts_class(type(mod), layout)
        done.append(full)
    return done


def _peft_expert_keys(model: nn.Module) -> dict[str, tuple[str, ExpertLoRA]]:
    """PEFT key stem (``<module>.base_layer....``) -> (full parameter name, adapter).

    PEFT nests one ``ParamWrapper`` per targeted parameter of a module, in the module's parameter order:
    the first is innermost, so it gets one ``base_layer.`` per wrapper outside it."""
    out = {}
    for mn, m in model.named_modules():
        if not getattr(type(m), "__effpass_lora_experts__", None):
            continue
        order = [pn for pn, _ in m.named_parameters(recurse=False) if pn in m.lora_experts]
        for i, pn in enumerate(order):
            stem = (f"{mn}." if mn else "") + "base_layer." * (len(order) - 1 - i)
            out[stem.rstrip(".")] = (f"{mn}.{pn}" if mn else pn, m.lora_experts[pn])
    return out


# ------------------------------------------------------------------------------------------------------
# PEFT interop
# ------------------------------------------------------------------------------------------------------
def _most_common(values: list) -> Any:
    return Counter(values).most_common(1)[0][0]


def adapter_config(model: nn.Module) -> dict[str, Any]:
    """The ``adapter_config.json`` contents (PEFT's ``LoraConfig``) describing ``model``'s adapters.

    Expert adapters go to ``target_parameters`` (full parameter names), as PEFT's ``ParamWrapper``."""
    mods = lora_modules(model)
    experts = expert_lora_modules(model)
    if not mods and not experts:
        raise ValueError("the model has no LoRA adapters (apply the inject_lora pass or lora.load first)")
    every = {**mods, **experts}
    r = _most_common([m.rank for m in every.values()])
    alpha = _most_common([m.alpha for m in every.values()])
    dropouts = {m.dropout_p for m in mods.values()} | ({0.0} if not mods else set())
    rslora = {m.use_rslora for m in every.values()}
    fifo = {m.fan_in_fan_out for m in mods.values()} | ({False} if not mods else set())
    if len(dropouts) > 1 or len(rslora) > 1 or len(fifo) > 1:
        raise ValueError(f"PEFT's format needs one dropout / use_rslora / fan_in_fan_out for all adapters; "
                         f"this model has dropout {sorted(dropouts)}, use_rslora {sorted(rslora)}, "
                         f"fan_in_fan_out {sorted(fifo)}")
    if experts and (dropouts != {0.0} or fifo != {False}):
        raise ValueError("PEFT's target_parameters LoRA takes no lora_dropout and no fan_in_fan_out; this model "
                         f"has expert adapters with dropout {sorted(dropouts)} / fan_in_fan_out {sorted(fifo)}")
    base_name = getattr(getattr(model, "config", None), "_name_or_path", None) or None
    cfg = {
        "peft_type": "LORA", "task_type": None, "base_model_name_or_path": base_name, "inference_mode": True,
        "r": r, "lora_alpha": alpha, "lora_dropout": dropouts.pop(), "use_rslora": rslora.pop(),
        "fan_in_fan_out": fifo.pop(), "bias": "none", "init_lora_weights": True,
        "target_modules": sorted(mods) if mods else None,
        "rank_pattern": {n: m.rank for n, m in every.items() if m.rank != r},
        "alpha_pattern": {n: m.alpha for n, m in every.items() if m.alpha != alpha},
        "modules_to_save": None,
    }
    if experts:
        cfg["target_parameters"] = sorted(experts)
    return cfg


def save(model: nn.Module, path: str | os.PathLike) -> None:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors`` that ``peft.PeftModel.from_pretrained``
    loads into the same base model. Only the adapters are written; expert adapters in PEFT's
    ``ParamWrapper`` layout (``<experts>[.base_layer].lora_A.weight`` (E*r, in), ``lora_B.weight`` (out, r*E))."""
    from safetensors.torch import save_file

    model = getattr(model, "_orig_mod", model)
    config = adapter_config(model)
    os.makedirs(path, exist_ok=True)
    tensors = {}
    for name, m in lora_modules(model).items():
        tensors[f"{_PEFT_PREFIX}{name}.lora_A.weight"] = m.lora_A.weight.detach().contiguous().cpu()
        tensors[f"{_PEFT_PREFIX}{name}.lora_B.weight"] = m.lora_B.weight.detach().contiguous().cpu()
    for stem, (_, ad) in _peft_expert_keys(model).items():
        a, b = ad.peft_tensors()
        tensors[f"{_PEFT_PREFIX}{stem}.lora_A.weight"] = a.cpu()
        tensors[f"{_PEFT_PREFIX}{stem}.lora_B.weight"] = b.cpu()
    save_file(tensors, os.path.join(path, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(path, ADAPTER_CONFIG), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def _target_matcher(target_modules) -> Any:
    if isinstance(target_modules, str):
        rx = re.compile(target_modules)
        return lambda name: rx.fullmatch(name) is not None
    targets = list(target_modules or [])
    return lambda name: any(name == t or name.endswith("." + t) for t in targets)


def _pattern_lookup(patterns: dict, default):
    def lookup(name: str):
        for pat, value in (patterns or {}).items():
            if re.match(rf"(.*\.)?({pat})$", name):
                return value
        return default
    return lookup


def load(model: nn.Module, path: str | os.PathLike, *, trainable: bool = False) -> list[str]:
    """Load a PEFT LoRA adapter (or one :func:`save` wrote) into ``model`` in place.

    Adapters are injected where the config's ``target_modules`` point (unless already there), the weights
    are copied in, and base weights are frozen. ``trainable`` makes the adapters trainable (PEFT's
    ``is_trainable``). Returns the names of the adapted modules.
    """
    from safetensors.torch import load_file

    model = getattr(model, "_orig_mod", model)
    with open(os.path.join(path, ADAPTER_CONFIG)) as f:
        cfg = json.load(f)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path}: peft_type {cfg.get('peft_type')!r} is not supported; only 'LORA' is")
    for key, ok in (("bias", ("none", None)), ("modules_to_save", (None, [])), ("use_dora", (False, None))):
        if cfg.get(key) not in ok:
            raise ValueError(f"{path}: {key}={cfg.get(key)!r} is not supported by effpass's LoRA; supported: {list(ok)}")
    weights_file = os.path.join(path, ADAPTER_WEIGHTS)
    if os.path.exists(weights_file):
        state = load_file(weights_file)
    else:
        state = torch.load(os.path.join(path, "adapter_model.bin"), map_location="cpu", weights_only=True)
    match = _target_matcher(cfg.get("target_modules"))
    r, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
    existing = lora_modules(model)
    names = [n for n, m in model.named_modules()
             if n and is_linear_like(m) and match(n) and ".lora_" not in n and not n.endswith(".base_layer")]
    if not names and not any(match(n) for n in existing) and not cfg.get("target_parameters"):
        linear = [n for n, m in model.named_modules() if n and is_linear_like(m) and ".lora_" not in n]
        raise ValueError(f"{path}: the adapter's target_modules {cfg.get('target_modules')!r} match no linear "
                         f"module of this {type(model).__name__}; its linear modules include "
                         f"{linear[:8]}{' ...' if len(linear) > 8 else ''}")
    inject(model, names, rank=r, alpha=alpha, dropout=float(cfg.get("lora_dropout", 0.0)),
           use_rslora=bool(cfg.get("use_rslora", False)),
           rank_of=_pattern_lookup(cfg.get("rank_pattern"), r), alpha_of=_pattern_lookup(cfg.get("alpha_pattern"), alpha))
    targets_p = list(cfg.get("target_parameters") or [])
    if targets_p:
        params = expert_parameters(model)
        have = expert_lora_modules(model)
        wanted = [n for n in params if n not in have and any(n == t or n.endswith("." + t) for t in targets_p)]
        if not wanted and not have:
            raise ValueError(f"{path}: the adapter's target_parameters {targets_p!r} match no expert parameter of "
                             f"this {type(model).__name__}; expert parameters: {sorted(params)[:8]}")
        inject_experts(model, wanted, rank=r, alpha=alpha, use_rslora=bool(cfg.get("use_rslora", False)),
                       rank_of=_pattern_lookup(cfg.get("rank_pattern"), r),
                       alpha_of=_pattern_lookup(cfg.get("alpha_pattern"), alpha))
    expert_stems = _peft_expert_keys(model)
    expert_parts: dict[str, dict[str, torch.Tensor]] = {}
    mods = lora_modules(model)
    loaded = set()
    for key, value in state.items():
        k = key[len(_PEFT_PREFIX):] if key.startswith(_PEFT_PREFIX) else key
        m = re.fullmatch(r"(.*)\.(lora_A|lora_B)(?:\.[^.]+)?\.weight", k)
        if m is None:
            raise ValueError(f"{path}: unexpected tensor {key!r} in the adapter (only lora_A/lora_B weights are supported)")
        name, which = m.group(1), m.group(2)
        if name in expert_stems and name not in mods:
            expert_parts.setdefault(name, {})[which] = value
            continue
        if name not in mods:
            raise ValueError(f"{path}: adapter tensor {key!r} names module {name!r}, which has no LoRA adapter "
                             f"in this model; adapted modules: {sorted(mods)[:8]}")
        param = getattr(mods[name], which).weight
        if tuple(param.shape) != tuple(value.shape):
            raise ValueError(f"{path}: {key!r} has shape {tuple(value.shape)}, the model's adapter expects "
                             f"{tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(value.to(param.dtype))
        loaded.add((name, which))
    for stem, (full, ad) in expert_stems.items():
        part = expert_parts.get(stem, {})
        if set(part) != {"lora_A", "lora_B"}:
            raise ValueError(f"{path}: no weights for the expert adapter of {full!r} (PEFT key "
                             f"{_PEFT_PREFIX}{stem}.lora_A/lora_B.weight)")
        a, b = part["lora_A"], part["lora_B"]
        want_a, want_b = ad.peft_tensors()
        if a.shape != want_a.shape or b.shape != want_b.shape:
            raise ValueError(f"{path}: expert adapter of {full!r} has shapes {tuple(a.shape)}, {tuple(b.shape)}; the "
                             f"model expects {tuple(want_a.shape)}, {tuple(want_b.shape)}")
        ad.load_peft_tensors(a, b)
    missing = [n for n in mods if n not in existing and not {(n, "lora_A"), (n, "lora_B")} <= loaded]
    if missing:
        raise ValueError(f"{path}: no weights for the adapters of {missing[:8]}")
    freeze_base(model, trainable_adapters=trainable)
    return sorted(mods) + sorted(v[0] for v in expert_stems.values())


def merge(model: nn.Module) -> int:
    """Fold every adapter into its base weight (``W += scaling * B @ A``); the forward then skips the
    adapter branch, so a compiled merged model has no adapter ops. Returns the number merged."""
    root = getattr(model, "_orig_mod", model)
    mods = lora_modules(root)
    # NOTE(audit): a base weight shared with another parameter (GPT-2's lm_head is tied to the token
    # embedding) must not be merged: ``W += B @ A`` would change the embedding as well, silently changing
    # the model. Those adapters stay unmerged (the forward then still adds their branch: same function).
    uses = Counter(id(p) for _, p in root.named_parameters(remove_duplicate=False))
    tied = sorted(n for n, m in mods.items() if not m.merged
                  and uses[id(getattr(m.base_layer, "weight", None))] > 1)
    if tied:
        import warnings

        warnings.warn(f"effpass.lora.merge: left {tied} unmerged: their base weight is tied to another "
                      "parameter (merging would change that one too); their adapter branch stays active",
                      stacklevel=2)
    merged = 0
    for n, m in mods.items():
        if n not in tied:
            m.merge()
            merged += 1
    return merged + _merge_experts(root, +1)


def unmerge(model: nn.Module) -> int:
    """Undo :func:`merge` (``W -= scaling * B @ A``). Returns the number unmerged."""
    root = getattr(model, "_orig_mod", model)
    mods = lora_modules(root).values()
    for m in mods:
        m.unmerge()
    return len(mods) + _merge_experts(root, -1)


def _merge_experts(root: nn.Module, sign: int) -> int:
    """Add (``sign=+1``) or subtract the expert deltas, one expert at a time (one expert-sized temporary)."""
    from effpass.quantized import is_quantized

    n = 0
    for full, ad in expert_lora_modules(root).items():
        if ad.merged == (sign > 0):
            continue
        mod_name, _, attr = full.rpartition(".")
        w = getattr(root.get_submodule(mod_name) if mod_name else root, attr)
        if is_quantized(w) or not w.is_floating_point():
            raise ValueError(f"cannot merge the expert adapter of {full!r} into a quantized or non-float weight")
        with torch.no_grad():
            for e in range(ad.n_experts):
                w[e].copy_((w[e].float() + sign * ad.delta(e)).to(w.dtype))
        ad.merged = sign > 0
        n += 1
    return n


def _register_namespace() -> None:
    """``effpass.lora`` is this module (save, load, merge, unmerge)."""
    import sys

    import effpass

    effpass.register_extension("lora", sys.modules[__name__])


_register_namespace()
