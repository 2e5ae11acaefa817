"""LoRA on linear-like modules: :class:`LoRALinear` (PEFT's LoRA layer), injection, freezing, merging.

Invariant (reference semantics): ``LoRALinear(x) == base(x) + scaling * lora_B(lora_A(dropout(x)))``,
computed in the adapter dtype and cast back to the base output dtype, exactly as PEFT's LoRA layer.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Iterable

import torch
import torch.nn as nn

from effpass.linear_like import Adapter, LinearParts, register_linear_like
from effpass.scope import skip

from .experts import expert_lora_modules, merge_experts

__all__ = ["LoRALinear", "AdapterLinear", "is_linear_like", "linear_shape", "lora_modules", "inject", "freeze_base",
           "parameter_stats", "merge", "unmerge"]


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
        return not overrides_linear_forward(module)
    conv1d = _conv1d_class()
    if conv1d is not None and isinstance(module, conv1d):
        return True
    return bool(getattr(module, "__effpass_linear__", False)) and isinstance(
        getattr(module, "in_features", None), int) and isinstance(getattr(module, "out_features", None), int)


def overrides_linear_forward(module: nn.Module) -> bool:
    """An ``nn.Linear`` subclass with a ``forward`` of its own (Llama 4's router returns ``(scores, logits)``) that
    does not declare itself a linear (``__effpass_linear__``): not a plain linear map of its input, so an adapter
    added to its output would change what it returns."""
    return (isinstance(module, nn.Linear) and type(module).forward is not nn.Linear.forward
            and not getattr(module, "__effpass_linear__", False))


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
def _describe(m: "LoRALinear"):
    """effpass.linear_like: ``base(x) + scaling * B(A(dropout(x)))`` (None for a Conv1D base: not F.linear)."""
    if m.fan_in_fan_out or not isinstance(getattr(m.base_layer, "weight", None), torch.Tensor):
        return None
    adapters = () if m.merged else (Adapter(a=m.lora_A.weight, b=m.lora_B.weight, scale=float(m.scaling),
                                            dropout=m.lora_dropout),)
    return LinearParts(weight=m.base_layer.weight, bias=m.bias, adapters=adapters)


register_linear_like(LoRALinear, _describe)


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
    """Trainable and frozen parameter counts and bytes (shared parameters counted once; bytes as storage holds
    them: a quantized base weight (NF4, int8) counts its codes and scales, not its logical dtype)."""
    from effpass.quantized import storage_bytes

    seen: set[int] = set()
    storages: set = set()
    out = {"trainable_params": 0, "frozen_params": 0, "trainable_bytes": 0, "frozen_bytes": 0}
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        kind = "trainable" if p.requires_grad else "frozen"
        out[f"{kind}_params"] += p.numel()
        out[f"{kind}_bytes"] += storage_bytes(p, storages)
    return out


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
    return merged + merge_experts(root, +1)


def unmerge(model: nn.Module) -> int:
    """Undo :func:`merge` (``W -= scaling * B @ A``). Returns the number unmerged."""
    root = getattr(model, "_orig_mod", model)
    mods = lora_modules(root).values()
    for m in mods:
        m.unmerge()
    return len(mods) + merge_experts(root, -1)
